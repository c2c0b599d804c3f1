"""Training state for resume: everything needed to continue a run bit-for-bit.

A state folder holds trainable.safetensors (the trained tensors), ema.safetensors (their float32
EMA, when ema_decay is set), optimizer.pt (loaded back with
`torch.load(weights_only=True)`: tensors and numbers only), rng.safetensors (torch/CUDA RNG
states as uint8 tensors) and train_state.json (step, epoch, batches done in the epoch, scheduler
state, the run's length and batches per epoch, each dataset's batch and repeats, a short digest of each
training file, the intermediate saves it wrote, and a digest of the
settings that must not change across a resume). The folder is written under a temporary name and
renamed, so a crash never leaves a half state.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
from collections import Counter
from typing import NamedTuple

import torch

from library.data.packing import packing_of
from library.io import CheckpointError, CheckpointReader, atomic_folder, save_safetensors
from library.models.registry import LOWBIT_PRECISIONS
from library.training.base_loras import base_loras_metadata
from library.training.run_length import plan_steps

# Settings a resumed run must share with the run that wrote the state.
RUN_IDENTITY = (
    "model_type", "network_module", "network_dim", "network_alpha", "network_args", "optimizer_type",
    "optimizer_args", "learning_rate", "lr_scheduler", "gradient_accumulation_steps", "fp8_base", "fp8_scaled",
    "mixed_precision", "seed", "pretrain", "network_dropout", "dim_from_weights",
)
# Compared where the state has them (states written before a key was kept still resume).
KEPT_SINCE = ("network_dropout",  # its own key: network_args' dropout=... was compared, it was not (2026-11-27)
              "base_loras",  # the LoRAs merged into the frozen base (files' names, ratios): another base (2026-11-28)
              # network_weights adds the modules its file names to the network (dim_from_weights: the file's modules
              # and ranks are the network's): resumed without it, the state's tensors had no modules to go to
              "network_weights", "dim_from_weights")

# The schedule's shape: the scheduler's state holds its step, not its lambda, which the resumed run
# rebuilds from these. Compared where the state has them (states written before they were kept resume).
SCHEDULE_IDENTITY = ("lr_warmup_steps", "lr_scheduler_num_cycles", "lr_scheduler_power", "lr_scheduler_min_lr_ratio",
                     "lr_decay_steps", "lr_scheduler_timescale", "lr_scheduler_rex_alpha", "lr_scheduler_rex_beta")

# An LLM's windows (and its held-out share): another max_length / stride cuts the text into other batches,
# so the resumed run would skip batches of another set; train_on_all_tokens changes which targets are
# trained (and which windows hold one). Compared where the state has them, as above (a state written
# before train_on_all_tokens was kept may have run with either value).
LLM_DATA_IDENTITY = ("max_length", "stride", "val_fraction", "batch_size", "train_on_all_tokens")
# An LLM's data settings that change which targets are trained (and so which windows are kept), each with the
# value a state written before the key ran with: such a state resumes only with that value.
LLM_TRAINED_BEFORE_KEY = {"attend_across_documents": True,  # border targets were trained, attention crossed
                          "packing": "stream"}  # the stream's windows (2026-12-04)

EMA_IDENTITY = ("ema_decay", "ema_warmup", "ema_start_step")
EMA_WARMUP_IDENTITY = ("ema_inv_gamma", "ema_power")

# What train_state.json must hold.
PROGRESS_KEYS = ("step", "epoch", "batches_done", "scheduler", "run")


def run_digest(args) -> dict:
    identity = {k: getattr(args, k) for k in RUN_IDENTITY + SCHEDULE_IDENTITY}
    identity["base_loras"] = base_loras_metadata(getattr(args, "base_loras", None))
    identity["network_weights"] = file_name(args.network_weights)  # the same file moved or copied elsewhere resumes
    if args.model_type == "llm":
        identity.update({k: getattr(args, k) for k in (*LLM_DATA_IDENTITY, *LLM_TRAINED_BEFORE_KEY)})
        identity["packing"] = packing_of(args)
    identity["base_model"] = base_model_name(args.pretrained_model_name_or_path)
    if getattr(args, "base_precision", None) in LOWBIT_PRECISIONS:  # fp8 and bf16 are in fp8_base / fp8_scaled
        identity["base_precision"] = args.base_precision  # (so states written before the key still resume)
    if args.ema_decay:  # only with EMA on, so states written without these keys still resume without EMA
        identity.update({k: getattr(args, k) for k in EMA_IDENTITY})
        if args.ema_warmup:  # likewise: the warmup's shape only where there is a warmup
            identity.update({k: getattr(args, k) for k in EMA_WARMUP_IDENTITY})
    return identity


def same_setting(key: str, saved, current) -> bool:
    """Whether a state's recorded setting is this run's: network_args / optimizer_args as the run reads them
    (any order, any spelling of one value: ['a=1', 'b=0.10'] is ['b = 0.1', 'a=1']), optimizer_type as the class
    it names (sd-scripts looks names up in any case: 'adamw' is 'AdamW'); the rest as recorded. Each was
    compared as written, and a resume of the same run refused."""
    if saved == current:
        return True
    if key in ("network_args", "optimizer_args") and isinstance(saved, list) and isinstance(current, list):
        from library.training.config import parse_kv_literals

        try:
            return (parse_kv_literals(saved, key, "state", any_text=key == "network_args")
                    == parse_kv_literals(current, key, "run", any_text=key == "network_args"))
        except ValueError:
            return False
    if key == "optimizer_type" and isinstance(saved, str) and isinstance(current, str):
        from library.training.optim import optimizer_class

        try:
            return optimizer_class(saved) is optimizer_class(current)
        except ValueError:  # (ConfigError) a class no longer installed: not this run's
            return False
    return False


def base_model_name(path: str | None) -> str:
    """The base as the state records it: its file or folder name, with the parent's where the folder is a
    diffusers component (`<base>/transformer`: every diffusers base's transformer folder is called
    so, and a resume on another base was accepted without a word, its loss 54299)."""
    path = os.path.normpath(path or "")
    name = os.path.basename(path)
    return f"{os.path.basename(os.path.dirname(os.path.abspath(path)))}/{name}" if name == "transformer" else name


def file_name(path: str | None) -> str | None:
    """A file's (or a PEFT adapter folder's) name without its folder, as the state records it."""
    return os.path.basename(os.path.normpath(path)) if path else None


def save_state(folder: str, trainable: dict[str, torch.Tensor], optimizer, scheduler, progress: dict, args,
               ema: dict[str, torch.Tensor] | None = None):
    with atomic_folder(folder) as tmp:
        save_safetensors(trainable, os.path.join(tmp, "trainable.safetensors"))
        if ema is not None:
            save_safetensors(ema, os.path.join(tmp, "ema.safetensors"))
        with open(os.path.join(tmp, "optimizer.pt"), "wb") as f:  # to a file object a full disk is an OSError
            torch.save(optimizer.state_dict(), f)  # (to a path, a RuntimeError that names nothing)
        save_safetensors(rng_states(), os.path.join(tmp, "rng.safetensors"))
        with open(os.path.join(tmp, "train_state.json"), "w") as f:
            json.dump({**progress, "scheduler": scheduler.state_dict(), "run": run_digest(args)}, f, indent=1,
                      default=str)


class SavedState(NamedTuple):
    trainable: dict[str, torch.Tensor]
    optimizer: dict
    progress: dict  # step, epoch, batches_done, scheduler
    rng: dict[str, torch.Tensor]
    ema: dict[str, torch.Tensor] | None  # with ema_decay set


# What accelerate's save_state writes (sd-scripts' and musubi-tuner's --save_state, named <output_name>-state at a
# run's end as ours is; sd-scripts adds a train_state.json of its own, current_epoch / current_step).
ACCELERATE_STATE_FILES = ("optimizer.bin", "scheduler.bin", "random_states_0.pkl")
PEER_STATE = "an accelerate state (sd-scripts' or musubi-tuner's save_state)"


def is_peer_state(folder: str) -> bool:
    return any(os.path.isfile(os.path.join(folder, name)) for name in ACCELERATE_STATE_FILES)


class NothingToTrain(Exception):
    """A resumed state at (or past) the run's last step: the run that wrote it saved its LoRA. One line and exit 0,
    as soon as the run's length is known (before the models load and the caches fill)."""


def check_steps_left(folder: str, progress: dict, max_steps: int, args) -> None:
    if progress["step"] >= max_steps:
        planned = (f"the run is {max_steps} step{'s' * (max_steps != 1)} (max_train_epochs = {args.max_train_epochs})"
                   if args.max_train_epochs else f"max_train_steps is {max_steps}")
        raise NothingToTrain(f"nothing to train: {folder} is at step {progress['step']}, {planned}")


def check_no_unfinished_state(args) -> None:
    """A run that does not resume, in an output_dir that holds <output_name>-state of an unfinished run: one line.
    The state is one folder, replaced at each save: a forgotten --resume replaced it at the new run's first save
    without a word, and the run it could continue could continue no more. A finished run's state (or one written
    before max_steps was kept, or a damaged one) is replaced, as sd-scripts replaces its own."""
    folder = os.path.join(args.output_dir, f"{args.output_name}-state")
    if is_peer_state(folder):  # the peers name their final state as ours: it was replaced at our first save
        raise ValueError(f"{folder}: {PEER_STATE}; this run would replace it at its first save: move it, or set "
                         f"another output_name")
    path = os.path.join(folder, "train_state.json")
    if not os.path.isfile(path):
        return
    try:
        progress = read_progress(path)
    except CheckpointError:
        return
    step, total = progress["step"], progress.get("max_steps")
    if isinstance(total, int) and step < total:
        raise ValueError(f"{folder}: the state of an unfinished run (step {step} of {total}); this run does not resume "
                         f"it and would replace it at its first save: continue it with --resume {folder}, or remove "
                         f"it (or set another output_name) to start over")


def load_state(folder: str, args) -> SavedState:
    """Every file of the state, read and checked before anything is built from it. Refuses a state
    written by a run with other settings, naming the first setting that differs, and a damaged
    file, naming it."""
    if not os.path.isdir(folder):
        what = "a file, not a folder" if os.path.exists(folder) else "no such folder"
        raise ValueError(f"{folder}: {what}; --resume takes the <output_name>-state folder a run saved")
    if is_peer_state(folder):  # its train_state.json, where it has one, was called damaged
        raise ValueError(f"{folder}: {PEER_STATE}; ours resumes only its own: start from the peer's LoRA with "
                         f"network_weights")
    path = os.path.join(folder, "train_state.json")
    if not os.path.exists(path):
        inside = sorted(d for d in os.listdir(folder)
                        if os.path.isfile(os.path.join(folder, d, "train_state.json")))
        hint = f"; it holds {', '.join(os.path.join(folder, d) for d in inside)}" if inside else ""
        raise ValueError(f"{folder}: not a training state (no train_state.json){hint}")
    progress = read_progress(path)
    saved, current = progress.pop("run"), json.loads(json.dumps(run_digest(args), default=str))
    # A state with an EMA resumed with it off: the EMA would be dropped and its old _ema file left stale.
    current.update({k: getattr(args, k) for k in EMA_IDENTITY if k in saved and k not in current})
    for key in SCHEDULE_IDENTITY + LLM_DATA_IDENTITY + KEPT_SINCE:
        if key not in saved:
            current.pop(key, None)
    for key, before in LLM_TRAINED_BEFORE_KEY.items():
        if key in current:
            saved.setdefault(key, before)
    if saved.get("base_model") == current["base_model"].rpartition("/")[2]:  # written before the parent was kept
        current["base_model"] = saved["base_model"]
    for key in current:
        if not same_setting(key, saved.get(key), current[key]):
            raise ValueError(
                f"{folder}: state was written with {key} = {saved.get(key)!r}, this run has {current[key]!r}; "
                f"resume needs the same settings"
            )
    if not args.max_train_epochs:  # else the task checks (check_resumed_fit), once the dataset gives the steps
        check_resumed_length(folder, progress, args.max_train_steps, args)
    trainable = read_tensors(os.path.join(folder, "trainable.safetensors"))
    optimizer = read_optimizer_state(os.path.join(folder, "optimizer.pt"))
    rng = read_tensors(os.path.join(folder, "rng.safetensors"))
    ema = load_ema_state(folder) if args.ema_decay else None
    if not args.max_train_epochs:  # a damaged file is said first
        check_steps_left(folder, progress, args.max_train_steps, args)
    return SavedState(trainable, optimizer, progress, rng, ema)


def check_resumed_fit(folder: str, progress: dict, args, batches_per_epoch: int, items: list[str],
                      epoch_settings: list | None = None) -> None:
    """The resumed state against this run's data: the run's length (with max_train_epochs, known from
    the batches), the batches per epoch (with Task.epoch_settings) and the files (Task.data_items). A
    task calls it as soon as it knows its batches, before any slow work (a diffusion task's caching)."""
    steps = plan_steps(args, batches_per_epoch, progress)
    check_steps_left(folder, progress, steps, args)
    check_resumed_length(folder, progress, steps, args)
    check_resumed_epoch(folder, progress, batches_per_epoch, epoch_settings)
    check_resumed_data(folder, progress, item_digests(items))


def check_trainable_fit(folder: str, saved: dict[str, torch.Tensor], network: dict[str, torch.Tensor]) -> None:
    """The state's tensors against this run's network (Task.trainable_tensors), before they are loaded:
    a network of other modules or ranks than the state's run (its network_weights or dim_from_weights,
    where the state predates their record, or another file under the same name) is one line naming
    the state and the first keys, not load_state_dict's traceback listing them all."""
    path = os.path.join(folder, "trainable.safetensors")
    unexpected, missing = [k for k in saved if k not in network], [k for k in network if k not in saved]
    if unexpected or missing:
        said = [f"{what} {len(keys)} (first '{keys[0]}')" for keys, what in
                ((unexpected, "holds tensors this run's network has no module for:"),
                 (missing, "lacks tensors of this run's network:")) if keys]
        raise CheckpointError(f"{path}: {'; '.join(said)}; resume with the network settings the state was written "
                              f"with (network_args, network_weights, dim_from_weights)")
    other = next((k for k in saved if saved[k].shape != network[k].shape), None)
    if other is not None:
        raise CheckpointError(f"{path}: '{other}' has shape {tuple(saved[other].shape)}, this run's network "
                              f"{tuple(network[other].shape)}: resume with the network settings the state was written "
                              f"with (network_dim, network_args, network_weights, dim_from_weights)")


# The schedules whose lr at a step does not read the run's length (inverse_sqrt's decays from the warmup's end on).
LENGTHLESS_SCHEDULES = ("constant", "constant_with_warmup", "inverse_sqrt")


def check_resumed_length(folder: str, progress: dict, max_steps: int, args) -> None:
    """A schedule whose lr at a step depends on the run's length (one that decays to its end, or a
    warmup given as a fraction of it) is rebuilt for this run's max_steps: another length than the
    state's would move the lr onto another curve at the resumed step. A constant schedule may be
    extended. States written before max_steps was kept resume unchecked."""
    saved = progress.get("max_steps")
    follows_length = args.lr_scheduler not in LENGTHLESS_SCHEDULES or 0 < args.lr_warmup_steps < 1
    if saved is None or saved == max_steps or not follows_length:
        return
    raise ValueError(f"{folder}: state was written by a run of {saved} steps, this run has {max_steps} "
                     f"(max_train_steps / max_train_epochs): the {args.lr_scheduler} schedule's lr at step "
                     f"{progress['step']} would jump onto another curve; resume with the same length")


def check_resumed_epoch(folder: str, progress: dict, batches_per_epoch: int, settings: list | None = None) -> None:
    """A state written inside an epoch resumes after its batches_done batches of that epoch's order;
    with another count of batches per epoch (the dataset, its batch_size or repeats, or the number of
    processes changed), or as many of another batch_size and num_repeats (Task.epoch_settings), that
    order and what it skips would be another run's. Between epochs any data may follow. States written
    before the count (or the settings) were kept resume unchecked (on the count)."""
    saved, done = progress.get("batches_per_epoch"), progress["batches_done"]
    if saved is None or done in (0, saved):
        return
    if saved == batches_per_epoch and progress.get("epoch_settings", settings) == settings:
        return
    has = (f"has {batches_per_epoch} batches per epoch (the dataset, its batch_size or num_repeats, or the processes "
           f"changed)" if saved != batches_per_epoch else "has as many, but another batch_size or num_repeats")
    raise ValueError(f"{folder}: state was written {done} of {saved} batches into epoch {progress['epoch']}, this run "
                     f"{has}: the rest of that epoch would be other images; resume with the same data")


def item_digests(items: list[str]) -> list[str]:
    """The state's record of the training files (Task.data_items): 8 hex digits each, sorted."""
    return sorted(hashlib.sha256(item.encode()).hexdigest()[:8] for item in items)


def check_resumed_data(folder: str, progress: dict, digests: list[str]) -> None:
    """With the same count of batches, other files (one swapped for another, some added and as many
    removed) would also give the saved epoch's rest other images. Checked inside an epoch only, where
    the state has the record (states written before it resume unchecked)."""
    saved, done = progress.get("data_items"), progress["batches_done"]
    if saved is None or done in (0, progress.get("batches_per_epoch")):
        return
    old, new = Counter(saved), Counter(digests)  # (item_digests of this run's files)
    added, removed = sum((new - old).values()), sum((old - new).values())
    if added or removed:
        raise ValueError(f"{folder}: state was written {done} batches into epoch {progress['epoch']}; since then "
                         f"{removed} of its training files are gone and {added} are new (a renamed or resized file "
                         f"counts in both): the rest of that epoch would be other images; resume with the same data, "
                         f"or from a state saved at an epoch's end")


def read_progress(path: str) -> dict:
    try:
        with open(path) as f:
            progress = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e}); the state is damaged") from None
    missing = [k for k in PROGRESS_KEYS if not isinstance(progress, dict) or k not in progress]
    if missing:
        raise CheckpointError(f"{path}: no '{missing[0]}' (expected {', '.join(PROGRESS_KEYS)}); the state is damaged")
    # ("step": "two" was a TypeError traceback at the resume's first subtraction; -5 was taken)
    for key in ("step", "epoch", "batches_done"):
        value = progress[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise CheckpointError(f"{path}: '{key}' is {value!r}, expected a whole number >= 0; the state is damaged")
    for key in ("scheduler", "run"):
        if not isinstance(progress[key], dict):
            raise CheckpointError(f"{path}: '{key}' is {progress[key]!r}, expected a JSON object; the state is damaged")
    return progress


def read_optimizer_state(path: str) -> dict:
    """optimizer.pt with tensors and numbers only (weights_only)."""
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: no such file; the state is incomplete")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, pickle.UnpicklingError) as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0].split(". ")[0]  # torch's first sentence
        # (an empty file's EOFError has no message: its IndexError escaped as a traceback)
        raise CheckpointError(f"{path}: cannot be read (truncated or not a torch file: {reason})") from None


def read_tensors(path: str) -> dict[str, torch.Tensor]:
    """A safetensors file of the state; a truncated one is a CheckpointError naming it."""
    return dict(CheckpointReader(path).items())


def load_ema_state(folder: str) -> dict[str, torch.Tensor]:
    path = os.path.join(folder, "ema.safetensors")
    if not os.path.exists(path):  # run_digest already refuses a state written without EMA; this is a damaged one
        raise ValueError(f"{folder}: the state has no ema.safetensors, this run has ema_decay set")
    return read_tensors(path)


def rng_states() -> dict[str, torch.Tensor]:
    """The torch CPU and CUDA RNG states (uint8 tensors), for restore_rng."""
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng.update({f"cuda{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    return rng


def restore_rng(rng: dict):
    torch.set_rng_state(rng["cpu"])
    cuda = [rng[k] for k in sorted(k for k in rng if k.startswith("cuda"))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)


def sample_seed(seed: int, step: int, key: str) -> int:
    """Noise/sigma seed for one sample at one optimizer step, from what it is (its file) rather
    than where it lands: the same sample gets the same noise on 1 or N processes, and on resume."""
    return int.from_bytes(hashlib.sha256(f"{seed}|{step}|{key}".encode()).digest()[:8], "little") >> 1
