"""A run's saves: the LoRA files (atomically, with their metadata; with EMA also <name>_ema) and the
state folder to resume from, which save the main process writes and every process waits for, and which
of the intermediate saves save_last_n_saves keeps."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import time
import warnings

from library.io import CheckpointError, CheckpointReader
from library.training.config import PRECISION_DTYPES, ConfigError, lora_network_args
from library.training.ema import TrainableEMA
from library.training.output_names import lora_save_name, step_tag
from library.training.state import save_state
from networks.lora_files import PEFT_WEIGHTS_FILE

# The weights file of a folder save (a PEFT adapter, a pretrained model), whose header the save's metadata is in.
SAVED_FOLDER_WEIGHTS = (PEFT_WEIGHTS_FILE, "model.safetensors")


def stratified_buckets(args) -> int | None:
    """num_timestep_buckets where it stratifies (> 1), for the header; None else (an LLM's args have none)."""
    buckets = getattr(args, "num_timestep_buckets", None)
    return buckets if buckets and buckets > 1 else None


def qinglong_mid(args) -> str | None:
    """timestep_sampling = "qinglong": its mid draw's law as set (None: the model's own, or another draw)."""
    return getattr(args, "qinglong_mid", None) if getattr(args, "timestep_sampling", None) == "qinglong" else None


def loss_table_fact(path: str | None) -> dict | None:
    """timestep_loss_weights for the header: its file's name, how many weights, their mean (None: unset)."""
    if not path:
        return None
    from library.models.flow_matching import loss_table

    table = loss_table(path)
    return {"file": os.path.basename(path), "count": len(table), "mean": round(float(table.mean()), 6)}


def draws_mode(args, method: str) -> bool:
    """The run draws the mode law: timestep_sampling "mode", or a shift (or qinglong's mid draw) that moves it."""
    if getattr(args, "shifted_draw", "sigmoid") == "mode":  # (refused where no shift reads it)
        return True
    return "mode" in (method, qinglong_mid(args))


def qinglong_draw(args) -> dict:
    """The qinglong mixture for the header: its shares and mid draw ("own": the model's)."""
    return {"logsnr_share": args.qinglong_logsnr_share, "detail_share": args.qinglong_detail_share,
            "mid": args.qinglong_mid or "own"}


def lora_metadata(args, task, step: int, epoch: int, max_steps: int, epochs: int, started: float) -> dict:
    from library.models.registry import spec_of
    from networks.lora_files import build_metadata, modelspec_fields
    from networks.lora_metadata import MODELSPEC_TEXTS

    facts, now = task.metadata(), time.time()
    dim = facts.get("network_dim") or args.network_dim
    # ModelSpec's keys, as sd-scripts and musubi-tuner write them: the release's names from its family's spec, the
    # first dataset's resolution. An LLM's spec gives none: its PEFT adapters carry none (neither peer trains one).
    spec = spec_of(args.model_type)
    names = spec.modelspec_of(facts["base_model_version"])
    if names is None and spec.modelspec is not None:  # a contributor's miss: the LoRA still saves
        warnings.warn(f"{args.model_type}'s spec.py: modelspec names no release {facts['base_model_version']!r}; "
                      f"the LoRA's header has no modelspec.* keys", stacklevel=2)
    title = getattr(args, "metadata_title", None) or args.output_name  # (an LLM's args have none of these)
    modelspec = modelspec_fields(names, title, facts["resolution"].split(",")[0], now) if names else {}
    modelspec.update({f"modelspec_{name}": getattr(args, f"metadata_{name}", None) for name in MODELSPEC_TEXTS})
    return build_metadata(
        network_module=args.network_module, network_dim=dim,
        network_alpha=facts.get("network_alpha") or args.network_alpha or float(dim),  # 0: alpha = rank
        network_args=lora_network_args(args), network_dropout=getattr(args, "network_dropout", None),
        base_model_version=facts["base_model_version"], base_model=args.pretrained_model_name_or_path,
        base_precision=facts["base_precision"], fp8_compute=facts.get("fp8_compute"), base_loras=facts.get("base_loras"),
        output_preservation=facts.get("output_preservation"), trained_keys=facts.get("trained_keys"),
        scale_weight_norms=getattr(args, "scale_weight_norms", None),
        ip_noise_gamma=getattr(args, "ip_noise_gamma", 0) or None,  # (an LLM's args have none)
        timestep_bias=None if getattr(args, "timestep_bias", "none") == "none" else args.timestep_bias,
        min_timestep=getattr(args, "min_timestep", None), max_timestep=getattr(args, "max_timestep", None),
        preserve_distribution_shape=getattr(args, "preserve_distribution_shape", False) or None,
        num_timestep_buckets=stratified_buckets(args),
        mixed_precision=args.mixed_precision, resolution=facts["resolution"],
        steps=step, max_steps=max_steps, epochs=epochs, epoch=epoch,
        batch_size=facts["batch_size"], optimizer=args.optimizer_type
        + (f" ({' '.join(args.optimizer_args)})" if args.optimizer_args else ""),
        lr=args.learning_rate, lr_scheduler=args.lr_scheduler, timestep_sampling=facts["timestep_sampling"],
        **{key: getattr(args, key, None)  # sd-scripts' keys (an LLM's args have them too)
           for key in ("lr_warmup_steps", "gradient_accumulation_steps", "max_grad_norm")},
        shift=args.discrete_flow_shift if "shift" in (facts["timestep_sampling"], qinglong_mid(args)) else None,
        logsnr=[args.logsnr_mean, args.logsnr_std] if facts["timestep_sampling"] in ("logsnr", "qinglong") else None,
        qinglong=qinglong_draw(args) if facts["timestep_sampling"] == "qinglong" else None,
        shifted_draw=shifted if (shifted := getattr(args, "shifted_draw", "sigmoid")) != "sigmoid" else None,
        sigmoid_mean=getattr(args, "sigmoid_mean", 0.0) or None,
        timestep_loss_weights=loss_table_fact(getattr(args, "timestep_loss_weights", None)),
        mode_scale=args.mode_scale if draws_mode(args, facts["timestep_sampling"]) else None,
        guidance=facts.get("guidance"), seed=args.seed, dataset=facts["dataset"],
        **{key: facts.get(key) for key in ("dataset_dirs", "tag_frequency", "num_train_images", "num_reg_images")},
        num_batches_per_epoch=task.batches_per_epoch(),
        training_started_at=int(started), training_finished_at=int(now),
        training_seconds=round(now - started, 1), output_name=args.output_name,
        training_comment=getattr(args, "training_comment", None), **modelspec,
    )


def ema_metadata(args) -> dict:
    """Header keys that mark an _ema file (beside the normal LoRA metadata)."""
    keys = {"ss_ema": "true", "ss_ema_decay": str(args.ema_decay), "ss_ema_warmup": str(args.ema_warmup).lower(),
            "ss_ema_start_step": str(args.ema_start_step)}
    if args.ema_warmup:
        keys.update({"ss_ema_inv_gamma": str(args.ema_inv_gamma), "ss_ema_power": str(args.ema_power)})
    return keys


def earlier_emas(args) -> dict[str, list[str]]:
    """A run without EMA writes no <output_name>[-stepNNNNNN]_ema.safetensors (nor the _ema folder of a
    PEFT adapter or pretrained model), so one already in output_dir would sit beside the LoRA this run
    writes under that name as if it were its EMA. Those an earlier run of this trainer wrote for this
    output_name (their header: ss_ema, ss_output_name) are returned by the name of their LoRA, for the
    save that replaces it to remove; anything else so named is refused before the models load (never
    deleted)."""
    if args.ema_decay or not os.path.isdir(args.output_dir):
        return {}
    twin = re.compile(re.escape(args.output_name) + r"(-step\d+)?_ema(\.safetensors)?")
    found = {}
    for entry in sorted(filter(twin.fullmatch, os.listdir(args.output_dir))):
        path = os.path.join(args.output_dir, entry)
        metadata = saved_header(path)
        if metadata.get("ss_ema") != "true" or metadata.get("ss_output_name") != args.output_name:
            raise ConfigError(f"{path}: not an EMA this trainer wrote for output_name '{args.output_name}' (no ss_ema "
                              f"/ ss_output_name in its header); this run has no ema_decay and would leave it beside "
                              f"its LoRA as if it were its EMA: move it, or choose another output_name")
        found.setdefault(entry.removesuffix(".safetensors").removesuffix("_ema"), []).append(path)
    return found


def saved_header(path: str) -> dict:
    """The metadata of a save: a .safetensors file's, or that of the weights in a folder save (a PEFT
    adapter's adapter_model.safetensors, a pretrained model's model.safetensors); {} where none reads."""
    if os.path.isdir(path) and not path.endswith(".safetensors"):
        path = next((p for p in (os.path.join(path, n) for n in SAVED_FOLDER_WEIGHTS) if os.path.isfile(p)), path)
    try:
        return CheckpointReader(path).metadata if os.path.isfile(path) else {}
    except CheckpointError:
        return {}


def remove_save(path: str) -> None:
    """A save's file, or its folder (a PEFT adapter, a pretrained model)."""
    if os.path.isdir(path):
        shutil.rmtree(path)
    else:
        os.remove(path)


class Saver:
    """Writes LoRAs (atomically, with metadata; with EMA also <name>_ema.safetensors) and states;
    keeps the newest N intermediates of those this run wrote, counting those the run it resumes wrote
    (its state lists them). A save it did not write (another run's, with the same output_name) is
    never deleted."""

    def __init__(self, args, task, accelerator, started: float, max_steps: int, epochs: int,
                 ema: TrainableEMA | None = None, saves: list[int] | None = None,
                 earlier_emas: dict[str, list[str]] | None = None, reading=contextlib.nullcontext):
        self.args, self.task, self.accelerator, self.started, self.ema = args, task, accelerator, started, ema
        self.reading = reading  # the weights as saved: a schedule-free optimizer's average (OptimizerModes.reading)
        self.earlier_emas = earlier_emas or {}  # LoRA name -> an earlier run's EMAs of it, removed as it is replaced
        self.max_steps = max_steps  # as planned (max_train_epochs counted in); a Ctrl-C save has trained fewer
        self.epochs = epochs  # as planned, a resumed run's earlier epochs counted in (planned_epochs)
        self.saves = sorted(saves or [])  # the steps of the intermediate saves this run (and those it resumes) wrote
        # An intermediate save: <name>-stepNNNNNN and <name>-stepNNNNNN_ema, as .safetensors files
        # and/or folders (PEFT adapters, pretrained models).
        self.numbered = re.compile(re.escape(args.output_name) + r"-step(\d+)(_ema)?(\.safetensors)?")

    def lora(self, step: int, epoch: int, final: bool = False, prune: bool = True) -> str:
        """The LoRA of `step`, which falls in `epoch` (from 1: Trainer.save_epoch)."""
        name = lora_save_name(self.args.output_name, None if final else step)
        path = os.path.join(self.args.output_dir, name + ".safetensors")
        with self.reading():  # on every process: each switches its own copy of the weights
            return self._write_lora(name, path, step, epoch, final, prune)

    def _agreed(self, write, default=None):
        """write() on the main process (the one that saves; its answer there, else `default`), its failure every
        process's: a full disk raised there alone, the others died in the next all-reduce with a gloo traceback
        under its line. Its error (OSError, ValueError: the lines main() says) is sent to the others, which
        raise it too."""
        result, failure = default, None
        try:
            if self.accelerator.is_main_process:
                result = write()
        except (OSError, ValueError) as e:
            failure = e
        if self.accelerator.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            said = broadcast_object_list([None if failure is None else (isinstance(failure, OSError), str(failure))])[0]
            if said is not None and failure is None:
                failure = OSError(said[1]) if said[0] else ValueError(said[1])
        if failure is not None:
            raise failure
        return result

    def _write_lora(self, name: str, path: str, step: int, epoch: int, final: bool, prune: bool) -> str:
        return self._agreed(lambda: self._write_main(name, path, step, epoch, final, prune), default=path)

    def _write_main(self, name: str, path: str, step: int, epoch: int, final: bool, prune: bool) -> str:
        """The main process's part of a LoRA save: its file(s), its EMA's, the pruning; the path written."""
        metadata = lora_metadata(self.args, self.task, step, epoch, self.max_steps, self.epochs, self.started)
        # A task may write a folder (PEFT adapter, pretrained model) and/or the file: it says which.
        dtype = PRECISION_DTYPES[{"float": "fp32"}.get(self.args.save_precision, self.args.save_precision)]
        written = self.task.save(path, metadata, dtype) or [path]  # the raw weights, always
        path = written[0]
        if self.ema is not None:
            ema_path = os.path.join(self.args.output_dir, name + "_ema.safetensors")
            with self.ema.swapped_in():  # the same writer, so the same format and keys
                written += self.task.save(ema_path, {**metadata, **ema_metadata(self.args)}, dtype) or [ema_path]
        self._remove_earlier_emas(name)
        if not final and prune:
            self._prune(step)
        return path

    def _remove_earlier_emas(self, name: str):
        for earlier in self.earlier_emas.pop(name, []):  # its file and / or folder
            if os.path.isdir(earlier) or os.path.isfile(earlier):
                remove_save(earlier)
                self.accelerator.print(f"removed {earlier}: the EMA of the earlier run whose LoRA this one replaced "
                                       f"(this run has no ema_decay)")

    def state(self, optimizer, scheduler, progress: dict) -> str:
        folder = os.path.join(self.args.output_dir, f"{self.args.output_name}-state")
        def write():
            ema = self.ema.state_tensors() if self.ema is not None else None
            save_state(folder, self.task.trainable_tensors(), optimizer, scheduler, progress, self.args, ema)

        self._agreed(write)
        return folder

    def intermediate_saves(self) -> dict[int, list[str]]:
        """step -> the paths of that step's save in output_dir, whichever run (or the run this one
        resumes) wrote them."""
        saves: dict[int, list[str]] = {}
        for entry in sorted(os.listdir(self.args.output_dir)):
            # step digits as ours writes them (step_tag): sd-scripts' step saves, <name>-step00000500 (8 digits),
            # are another trainer's files of the same step, never counted (pruning deleted them)
            if (match := self.numbered.fullmatch(entry)) and match.group(1) == step_tag(int(match.group(1)))[4:]:
                saves.setdefault(int(match.group(1)), []).append(os.path.join(self.args.output_dir, entry))
        return saves

    def _prune(self, step: int):
        """Keep the newest save_last_n_saves of this run's saves, `step` (the one just written) the
        newest. Saves of later steps (a run killed after them, resumed from an older state) are left:
        this run writes them again."""
        self.saves = sorted({*self.saves, step})
        keep = self.args.save_last_n_saves
        if not keep or len(self.saves) <= keep:
            return
        saves = self.intermediate_saves()
        old_steps, self.saves = self.saves[:-keep], self.saves[-keep:]
        for old_step in old_steps:
            for old in saves.get(old_step, []):
                remove_save(old)


def keep_finished_final(args, step: int) -> list[tuple[str, str]]:
    """A run resumed at the end of a finished one, to train on, writes its final LoRA under the finished run's
    name: that LoRA (and its EMA's; files or folders) is kept as the step's save, <name>-stepNNNNNN, the name a
    step save there takes, where its header says it is the state's step and that name is free (sd-scripts
    writes over it: the finished run's result was lost). The (old, new) paths moved; the pruning of
    save_last_n_saves never counts them (a save this run did not write)."""
    moved = []
    for suffix in ("", "_ema"):
        for extension in (".safetensors", ""):  # a file, or a folder (a PEFT adapter, a pretrained model)
            old = os.path.join(args.output_dir, lora_save_name(args.output_name) + suffix + extension)
            new = os.path.join(args.output_dir, lora_save_name(args.output_name, step) + suffix + extension)
            if os.path.exists(old) and not os.path.exists(new) and saved_header(old).get("ss_steps") == str(step):
                os.replace(old, new)
                moved.append((old, new))
    return moved


def saves_at(args) -> list[str]:
    """Where a run's intermediate saves are: its output folder (real path) and output_name."""
    return [os.path.realpath(args.output_dir), args.output_name]


def resumed_saves(progress: dict, args) -> list[int] | None:
    """The steps of the saves the resumed run wrote, for save_last_n_saves to prune: only where this run
    writes to the same folder and name (resumed elsewhere, the same step numbers there are another run's
    files, which were deleted). States from before saves_at: none known, nothing of theirs pruned."""
    return progress.get("saves") if progress.get("saves_at") == saves_at(args) else None
