"""Optimizers, LR schedulers and learning-rate tracking.

Prodigy and the D-Adaptation family keep their step-size estimate in `param_groups[i]["d"]`:
the step they apply is d * lr, not lr. `effective_lrs` reports both, one name per value, and
`LRLogger` writes them every optimizer step to CSV (and TensorBoard through accelerate).
"""

from __future__ import annotations

import csv
import importlib
import os
import warnings

import torch

from library.errors import ConfigError
from library.io import append_csv_row, atomic_path
from library.training import run_length
from library.training.schedule_free import OptimizerModes

BNB_OPTIMIZERS = ("AdamW8bit", "PagedAdamW8bit", "Lion8bit", "PagedLion8bit", "SGD8bit", "AdEMAMix8bit", "PagedAdamW")


def split_weight_decay(named_params, weight_decay_1d: bool = False):
    """Weight decay only on >= 2-D parameters (matrices), as nanoGPT: decaying biases and norm
    scales pulls them to zero for no benefit."""
    decay, no_decay = [], []
    for _, p in named_params:
        if p.requires_grad:
            (decay if p.dim() >= 2 or weight_decay_1d else no_decay).append(p)
    return decay, no_decay


# sd-scripts' and musubi-tuner's optimizer_type names for classes of other packages: (module, class, the
# arguments they add where the config gives none). Adafactor is transformers' (torch.optim has one of that name).
PEER_OPTIMIZERS = {
    "sgdnesterov": ("torch.optim", "SGD", {"nesterov": True, "momentum": 0.9}),
    "sgdnesterov8bit": ("bitsandbytes.optim", "SGD8bit", {"nesterov": True, "momentum": 0.9}),
    "dadaptation": ("dadaptation.experimental", "DAdaptAdamPreprint", {}),
    "dadaptadampreprint": ("dadaptation.experimental", "DAdaptAdamPreprint", {}),
    "dadaptadanip": ("dadaptation.experimental", "DAdaptAdanIP", {}),
    **{name.lower(): ("dadaptation", name, {}) for name in ("DAdaptAdaGrad", "DAdaptAdam", "DAdaptAdan", "DAdaptLion",
                                                             "DAdaptSGD")},
    "adafactor": ("transformers.optimization", "Adafactor", {}),
    # schedule-free (library/training/schedule_free.py: switched to eval mode while the weights are read)
    **{name.lower(): ("schedulefree", name, {}) for name in ("AdamWScheduleFree", "RAdamScheduleFree", "SGDScheduleFree")},
}


def optimizer_class(optimizer_type: str):
    """The optimizer class for `optimizer_type`; ConfigError naming it if unknown or not installed. A bare
    name is looked up as sd-scripts does: its own names, then torch.optim's classes, then bitsandbytes.optim's
    (any case)."""
    name = optimizer_type
    lower = name.lower()
    try:
        if lower == "adamw":
            return torch.optim.AdamW
        if lower == "prodigy":
            from prodigyopt import Prodigy

            return Prodigy
        if lower in PEER_OPTIMIZERS:
            module_name, class_name, _ = PEER_OPTIMIZERS[lower]
            return getattr(importlib.import_module(module_name), class_name)
        if name in BNB_OPTIMIZERS or lower in (n.lower() for n in BNB_OPTIMIZERS):
            import bitsandbytes as bnb

            return getattr(bnb.optim, next(n for n in BNB_OPTIMIZERS if n.lower() == lower))
    except ImportError as e:
        raise ConfigError(f"optimizer_type '{name}' needs the package '{e.name}', which is not installed") from None
    if "." in name:
        module_name, _, class_name = name.rpartition(".")
        try:
            found = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError):
            raise ConfigError(f"optimizer_type '{name}': cannot import {class_name} from {module_name}") from None
        return found
    if found := torch_optimizer(lower) or bnb_optimizer(lower):
        return found
    raise ConfigError(f"optimizer_type '{name}' is unknown (AdamW, AdamW8bit, Prodigy, {', '.join(BNB_OPTIMIZERS[1:])}, "
                      f"Adafactor, SGDNesterov, DAdaptAdam and sd-scripts' other DAdapt names, a torch.optim or "
                      f"bitsandbytes.optim class, or module.Class)")


def torch_optimizer(lower: str):
    """torch.optim's optimizer class `lower` names in any case (SGD, Adam, RMSprop: sd-scripts' and musubi-tuner's
    bare names), or None."""
    for name in dir(torch.optim):
        found = getattr(torch.optim, name)
        if name.lower() == lower and isinstance(found, type) and issubclass(found, torch.optim.Optimizer):
            return found
    return None


def bnb_optimizer(lower: str):
    """The optimizer class bitsandbytes.optim names `lower` in any case (PagedAdamW32bit, RMSprop8bit, ...),
    or None: none of that name, or no bitsandbytes. Imported only for a name that is not one of ours or
    torch.optim's (SGD, Adam, RMSprop are torch's, as in sd-scripts: write bitsandbytes.optim.SGD for its)."""
    try:
        import bitsandbytes as bnb
    except ImportError:
        return None
    for name in dir(bnb.optim):  # "adamw" is also a module there: classes only
        found = getattr(bnb.optim, name)
        if name.lower() == lower and isinstance(found, type) and issubclass(found, torch.optim.Optimizer):
            return found
    return None


def preset_kwargs(optimizer_type: str) -> dict:
    """The arguments sd-scripts gives its name's class where the config does not (SGDNesterov: nesterov=True,
    momentum=0.9)."""
    return dict(PEER_OPTIMIZERS.get(optimizer_type.lower(), (None, None, {}))[2])


def check_adafactor(cls, optimizer_type: str, optimizer_kwargs: dict) -> None:
    """transformers' Adafactor with relative_step (its default, and sd-scripts'): it computes its own lr, ignoring
    learning_rate and the schedule (sd-scripts switches to its "adafactor" scheduler, which this trainer has
    not); transformers refused it in a line that did not say what to write."""
    if getattr(cls, "__module__", "").startswith("transformers") and cls.__name__ == "Adafactor" and (
            optimizer_kwargs.get("relative_step", True) or optimizer_kwargs.get("warmup_init", False)):
        raise ConfigError(f"optimizer_type {optimizer_type}: Adafactor's relative_step (its own lr schedule, sd-scripts' "
                          f"default) is not supported; add optimizer_args = [\"relative_step=False\", "
                          f"\"scale_parameter=False\", \"warmup_init=False\"] to train at learning_rate with an lr_scheduler")


def create_optimizer(param_groups: list[dict], optimizer_type: str, lr: float, optimizer_kwargs: dict):
    """param_groups: [{"params": [...], "name": str, "lr": float (optional)}, ...]."""
    cls = optimizer_class(optimizer_type)
    given = ", ".join(f"{k}={v!r}" for k, v in optimizer_kwargs.items())  # what the user wrote, for errors
    devices = {p.device.type for g in param_groups for p in g["params"]}
    user_kwargs, optimizer_kwargs = optimizer_kwargs, {**preset_kwargs(optimizer_type), **optimizer_kwargs}
    check_adafactor(cls, optimizer_type, optimizer_kwargs)
    if cls is torch.optim.AdamW and len(devices) == 1 and devices <= {"cuda", "cpu"} and "foreach" not in optimizer_kwargs:
        # One kernel for all parameters. On the CPU the per-tensor loop cost ~8 ms an op on a busy
        # 2-core machine (bench_peers profile): fused is 20x faster on a mid-size model's LoRA shapes.
        optimizer_kwargs.setdefault("fused", True)
    try:
        return cls(param_groups, lr=lr, **optimizer_kwargs)
    except (TypeError, ValueError, IndexError, KeyError, NotImplementedError) as e:  # unknown names, refused values
        if not user_kwargs:  # nothing of the user's beside the parameters and lr: the type is what failed
            raise ConfigError(f"optimizer_type {optimizer_type}: cannot be built as an optimizer (params, lr=...): {e}") from None
        raise ConfigError(f"optimizer_args ({given}) do not fit {optimizer_type}: {e}") from None


def check_optimizer(optimizer_type: str, lr: float, optimizer_kwargs: dict, group_lrs: str | None = None,
                    where: str = "command line") -> None:
    """The optimizer built on one stand-in CPU parameter: an unknown type, a missing package, an
    argument name or value it refuses is a ConfigError now, not after caching and loading. Only a
    torch.optim.Optimizer subclass is called (a module.Class may name any callable, os.system
    included); another failure (one that wants device tensors) is left to the real build.
    group_lrs: the setting that gives the parameter groups different lrs (LoRA+), if any: Prodigy and
    D-Adaptation apply one lr to all groups (Prodigy raises at the first step). where: the file or "command
    line" that set learning_rate, for the warning on an adaptive optimizer's low lr."""
    cls = optimizer_class(optimizer_type)
    if isinstance(cls, type) and not issubclass(cls, torch.optim.Optimizer):  # torch.nn.Linear: after caching and loading
        raise ConfigError(f"optimizer_type {optimizer_type}: a class, but no torch.optim.Optimizer")
    if not isinstance(cls, type):
        return
    stand_in = torch.nn.Parameter(torch.zeros(1, 1))
    try:
        built = create_optimizer([{"params": [stand_in]}], optimizer_type, lr, optimizer_kwargs)
    except ConfigError:
        raise
    except Exception:  # noqa: BLE001 (not a verdict on the config: the stand-in is on the CPU)
        return
    try:  # values the constructor takes and its step refuses (betas of three: "too many values to unpack")
        # A nonzero gradient: on a zero one Prodigy returns before its d update and never reads growth_rate.
        stand_in.grad = torch.ones_like(stand_in)
        OptimizerModes(built).train()  # a schedule-free step refuses eval mode, which it is built in
        built.step()
    except (TypeError, ValueError, IndexError, KeyError) as e:
        given = ", ".join(f"{k}={v!r}" for k, v in optimizer_kwargs.items())
        raise ConfigError(f"optimizer_args ({given}) do not fit {optimizer_type}: its first step says: {e}") from None
    except Exception:  # noqa: BLE001 (as above)
        pass
    if group_lrs and adapts_step_size(built):
        raise ConfigError(f"{group_lrs} gives the parameter groups different learning rates, which {optimizer_type} "
                          f"does not take (it adapts one step size for all); use AdamW (or another optimizer) for it")
    if lr <= 0.1 and adapts_step_size(built):  # sd-scripts warns the same; the default learning_rate is AdamW's 1e-4
        warnings.warn(f"{where}: learning_rate = {lr:g} with {optimizer_type}, whose step is d * learning_rate (d: the "
                      f"step size it adapts): {1 / lr:,.0f}x smaller than at the usual learning_rate = 1.0; set it "
                      f"around 1.0", stacklevel=2)


# lr_scheduler = "rex" (musubi-tuner's): its alpha and beta (lr_scheduler_rex_alpha / _beta), and its floor unless
# lr_scheduler_min_lr_ratio is given, musubi-tuner's defaults (IvanVassi/REX_LR's; the paper's are 0.5 / 0.5)
REX = (0.1, 0.9)
REX_MIN_LR_RATIO = 0.01


def check_scheduler(name: str, lr: float, power: float = 1.0, min_lr_ratio: float | None = None,
                    timescale: int | None = None, rex: tuple[float, float] = REX) -> None:
    """The schedule built on a stand-in optimizer at learning_rate: a value it refuses is a ConfigError
    now, not after caching and loading (diffusers' polynomial decays to a fixed lr_end of 1e-7, which
    learning_rate must exceed). The step counts are stand-ins: no schedule's check reads them."""
    stand_in = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    try:
        create_scheduler(stand_in, name, 0, 2, power=power, min_lr_ratio=min_lr_ratio, decay_steps=1,
                         timescale=timescale, rex=rex)
    except ValueError as e:
        if name == "rex":  # its curve's own keys
            raise ConfigError(str(e)) from None
        raise ConfigError(f"learning_rate = {lr:g} does not fit lr_scheduler = \"{name}\": {e}") from None


# The schedules diffusers' get_scheduler lacks, which sd-scripts and musubi-tuner take from transformers.
TRANSFORMERS_SCHEDULES = ("cosine_with_min_lr", "warmup_stable_decay", "inverse_sqrt")


def create_scheduler(optimizer, name: str, warmup_steps: int, max_steps: int, num_cycles: int = 1, power: float = 1.0,
                     min_lr_ratio: float | None = None, decay_steps: int = 0, timescale: int | None = None,
                     rex: tuple[float, float] = REX):
    """diffusers' schedules, transformers' TRANSFORMERS_SCHEDULES and musubi-tuner's rex (its (alpha, beta): rex);
    warmup_steps and decay_steps in steps (run_length reads their fraction forms). run_scheduler gives these from a
    run's keys."""
    if name == "rex":
        return rex_scheduler(optimizer, warmup_steps, max_steps, REX_MIN_LR_RATIO if min_lr_ratio is None else
                             min_lr_ratio, *rex)
    if name in TRANSFORMERS_SCHEDULES:
        return _transformers_scheduler(optimizer, name, warmup_steps, max_steps, num_cycles, min_lr_ratio,
                                       decay_steps, timescale)
    from diffusers.optimization import get_scheduler

    return get_scheduler(name, optimizer, num_warmup_steps=warmup_steps, num_training_steps=max_steps,
                         num_cycles=num_cycles, power=power)


def rex_scheduler(optimizer, warmup: int, max_steps: int, min_lr_ratio: float, alpha: float, beta: float):
    """REX, the reflected exponential schedule (Chen et al. 2021, arXiv 2107.04197; musubi-tuner's rex, from
    IvanVassi/REX_LR): after a linear warmup from min_lr_ratio x learning_rate, lr = learning_rate x (r + (1 - r)
    z / (alpha + beta z)), z = the share of the decay's steps left (1 -> 1 / its steps), r = min_lr_ratio: it holds
    near learning_rate longer than a linear decay and drops at the end. musubi-tuner's warmup steps 1 .. W - 1 climb
    from the floor to (W - 2) / (W - 1) and its step 0 reads z = W / (steps - W) (a negative step's modulo); ours
    climbs k / W from step 0. Past the run: the floor."""
    if not alpha + beta > 0:  # z / (alpha + beta z) at z = 1
        raise ValueError(f"rex divides by alpha + beta z: lr_scheduler_rex_alpha ({alpha:g}) + lr_scheduler_rex_beta "
                         f"({beta:g}) must be > 0 (musubi-tuner's 0.1 + 0.9)")
    decay = max_steps - warmup

    def factor(step: int) -> float:
        if step < warmup:
            return min_lr_ratio + (1.0 - min_lr_ratio) * step / warmup
        if step >= max_steps:
            return min_lr_ratio
        z = (decay - (step - warmup)) / decay
        return min_lr_ratio + (1.0 - min_lr_ratio) * z / (alpha + beta * z)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def _transformers_scheduler(optimizer, name: str, warmup: int, max_steps: int, num_cycles: int,
                            min_lr_ratio: float | None, decay: int, timescale: int | None):
    """As sd-scripts' get_scheduler_fix calls them: num_cycles counts half-waves there (1: one half-cosine down,
    transformers' 0.5); warmup_stable_decay holds learning_rate from the warmup's end until its decay takes the
    run's last decay steps, and its floor defaults to 0; inverse_sqrt's timescale defaults (None) to the warmup's
    steps, or 10000 without a warmup."""
    from transformers import optimization as schedules  # here: importing transformers takes seconds

    if name == "inverse_sqrt":
        return schedules.get_inverse_sqrt_schedule(optimizer, num_warmup_steps=warmup, timescale=timescale)
    if name == "cosine_with_min_lr":
        return schedules.get_cosine_with_min_lr_schedule_with_warmup(
            optimizer, num_warmup_steps=warmup, num_training_steps=max_steps, num_cycles=num_cycles / 2,
            min_lr_rate=min_lr_ratio)
    return schedules.get_wsd_schedule(optimizer, num_warmup_steps=warmup, num_decay_steps=decay,
                                      num_stable_steps=max_steps - warmup - decay, num_cycles=num_cycles / 2,
                                      min_lr_ratio=min_lr_ratio or 0.0)


def run_scheduler(optimizer, args, max_steps: int):
    """The run's schedule from its keys, once its max_steps is known (train_lora.py builds it so)."""
    warmup = run_length.warmup_steps(args.lr_warmup_steps, max_steps)
    return create_scheduler(optimizer, args.lr_scheduler, warmup, max_steps, args.lr_scheduler_num_cycles,
                            args.lr_scheduler_power, args.lr_scheduler_min_lr_ratio,
                            run_length.decay_steps(args.lr_decay_steps, max_steps), args.lr_scheduler_timescale,
                            (args.lr_scheduler_rex_alpha, args.lr_scheduler_rex_beta))


def adapts_step_size(optimizer) -> bool:
    """Prodigy / D-Adaptation: they keep an estimate d and apply d * lr."""
    return all("d" in g for g in optimizer.param_groups)


def group_names(optimizer) -> list[str]:
    names = [g.get("name") or f"group{i}" for i, g in enumerate(optimizer.param_groups)]
    if len(set(names)) != len(names):  # one name per value
        names = [f"{n}{i}" for i, n in enumerate(names)]
    return names


def step_ds(optimizer) -> list[float] | None:
    """Each group's d (adaptive optimizers; else None), read before optimizer.step(): the step applies
    d * lr with this d and leaves the next step's d in the group (prodigyopt computes dlr first, then d)."""
    return [float(g["d"]) for g in optimizer.param_groups] if adapts_step_size(optimizer) else None


def effective_lrs(optimizer, ds: list[float] | None = None) -> dict[str, float]:
    """{'lr/<group>': lr, 'd*lr/<group>': d * lr (adaptive optimizers only)}; ds: the d each group's step
    applied (step_ds before the step), else the groups' d now (after a step: the next step's)."""
    out = {}
    adaptive = adapts_step_size(optimizer)
    ds = ds if ds is not None else [g.get("d") for g in optimizer.param_groups]
    for name, g, d in zip(group_names(optimizer), optimizer.param_groups, ds):
        # schedulefree: its own warmup's lr the step applied ("scheduled_lr", set by each step), lr before one
        out[f"lr/{name}"] = float(g["scheduled_lr"] if g.get("k") and "scheduled_lr" in g else g["lr"])
        if adaptive:
            out[f"d*lr/{name}"] = float(d) * float(g["lr"])
    return out


def _logged_step(cell: str) -> int | None:
    """The optimizer step a log row was written at: "12" or "step000012" -> 12, "start" -> 0; else None."""
    if cell == "start":
        return 0
    digits = cell.removeprefix("step")
    return int(digits) if digits.isdigit() else None


def drop_rows_after(path: str, step: int) -> None:
    """A resumed run's CSV log (its `step` column) without the rows after the state's `step`: a run
    killed after its last save logged them, and the resumed run logs those steps again."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    if not rows or "step" not in rows[0]:
        return
    col = rows[0].index("step")
    # Rows are in the order they were logged: kept up to the last one at or before `step` (a training log's step;
    # an LLM eval log's "start", "stepNNNNNN" and the "epochNNNN" rows between them); what follows goes (later
    # steps, "final", an epoch end the resumed run renders again, a row cut short by a kill).
    at = [i for i, r in enumerate(rows[1:], 1) if len(r) > col and (n := _logged_step(r[col])) is not None and n <= step]
    kept = rows[: at[-1] + 1] if at else rows[:1]
    if len(kept) < len(rows):
        with atomic_path(path) as tmp, open(tmp, "w", newline="") as f:
            csv.writer(f).writerows(kept)


class LRLogger:
    """Per optimizer step: step, epoch, loss, lr/<group>..., d*lr/<group>... and the extras
    (val_loss: None on steps without validation, an empty cell) to
    <output_dir>/<output_name>_log.csv, and to TensorBoard through accelerate if it tracks."""

    def __init__(self, path: str, accelerator=None, append: bool = False, resumed_step: int | None = None):
        """append: continue the log of a resumed run; its rows after resumed_step (the state's
        step; logged by a run killed after its last save) are dropped first, so the resumed run
        logs each step once."""
        self.path = path
        self.accelerator = accelerator
        self.columns: list[str] | None = None
        if append and os.path.exists(path):
            with open(path) as f:
                header = f.readline().strip()
            self.columns = header.split(",") if header else None
            if resumed_step is not None and self.columns and (accelerator is None or accelerator.is_main_process):
                drop_rows_after(path, resumed_step)
        elif os.path.exists(path):
            os.remove(path)

    def log(self, step: int, epoch: int, loss: float, optimizer, extra: dict | None = None, ds: list[float] | None = None):
        """One row: the lr and d * lr the step applied (ds: step_ds before optimizer.step())."""
        values = {"step": step, "epoch": epoch, "loss": loss, **effective_lrs(optimizer, ds), **(extra or {})}
        header = None
        if self.columns is None:
            self.columns = header = list(values)
        elif new := [k for k in values if k not in self.columns]:
            self._widen(new)
        append_csv_row(self.path, [values.get(c, "") for c in self.columns], header)
        if self.accelerator is not None and self.accelerator.trackers:  # None: not measured this step (val_loss)
            self.accelerator.log({k: v for k, v in values.items() if k != "step" and v is not None}, step=step)
        return values


    def _widen(self, new: list[str]) -> None:
        """Columns a resumed run brings that its log lacks (val_loss, where validation was added at the
        resume; its values were dropped until 2026-11-27): the file rewritten with them, the earlier rows'
        cells empty."""
        self.columns = self.columns + new
        with open(self.path, newline="") as f:
            rows = list(csv.reader(f))[1:]
        with atomic_path(self.path) as tmp, open(tmp, "w", newline="") as f:
            csv.writer(f).writerows([self.columns] + [row + [""] * len(new) for row in rows])


def progress_postfix(values: dict) -> dict:
    """tqdm postfix: loss, the effective lr of the first group (d*lr where it exists) and the
    val_loss where one is given."""
    eff = [v for k, v in values.items() if k.startswith("d*lr/")] or [v for k, v in values.items() if k.startswith("lr/")]
    postfix = {"loss": f"{values['loss']:.4f}", "lr": f"{eff[0]:.3g}" if eff else "-"}
    if values.get("val_loss") is not None:
        postfix["val"] = f"{values['val_loss']:.4f}"
    return postfix
