"""Experiment trackers through accelerate: TensorBoard (the default with logging_dir) and wandb.

    log_with = "tensorboard" | "wandb" | "all"      # sd-scripts' key; unset: TensorBoard when logging_dir is set

Each run logs into its own folder under logging_dir, named as sd-scripts names it: log_prefix (default
`<output_name>_`) and the start time, e.g. logs/lora_20260105143000/lora/events.*; a resumed run
continues the folder its state names, from its step (TensorBoard drops what the killed run logged
after it). Two fresh runs never mix their curves in one TensorBoard run.

Scalars (loss, lr, d*lr, val_loss, step_s and data_wait_s from StepClock) go through accelerator.log from the LR logger; sample images are
logged here beside them, one image per prompt under `samples/NN` at the step they were rendered, so
a run is watched in one place. The images are the PNGs the task wrote (side by side with the bf16
reference on an fp8 base), read back, so the tracker shows exactly what is on disk.
"""

from __future__ import annotations

import importlib.util
import os
import time

import numpy as np
from PIL import Image

TRACKERS = ("tensorboard", "wandb", "all")


def trackers(log_with: str | None, logging_dir: str | None) -> list[str]:
    """accelerate tracker names for the config; [] when nothing is logged."""
    if log_with is None:
        return ["tensorboard"] if logging_dir else []
    return ["tensorboard", "wandb"] if log_with == "all" else [log_with]


def check_trackers(log_with: str | None, logging_dir: str | None) -> str | None:
    """The reason the trackers cannot run (to be raised as a config error naming the key), or None."""
    names = trackers(log_with, logging_dir)
    if "tensorboard" in names and not logging_dir:
        return f"log_with = '{log_with}' logs TensorBoard events to logging_dir, which is not set"
    if "wandb" in names and importlib.util.find_spec("wandb") is None:
        return f"log_with = '{log_with}' needs the wandb package, which is not installed (pip install wandb; then wandb login)"
    return None


def run_folder(logging_dir: str | None, log_prefix: str | None, output_name: str, claim: bool = False) -> str:
    """A fresh run's folder name under logging_dir: log_prefix + YYYYmmddHHMMSS (sd-scripts'
    --log_prefix), log_prefix defaulting to '<output_name>_'; _2, _3, ... after a name already taken.
    With `claim` the folder is created here, atomically: two runs of one config started together (two
    learning rates on two GPUs) reach this in the same second, and a name only checked was taken by both,
    their curves mixed in one TensorBoard run."""
    name = (output_name + "_" if log_prefix is None else log_prefix) + time.strftime("%Y%m%d%H%M%S")
    if logging_dir is None:
        return name
    if claim:
        os.makedirs(logging_dir, exist_ok=True)
    count = 1
    while not _free(os.path.join(logging_dir, name if count == 1 else f"{name}_{count}"), claim):
        count += 1
    return name if count == 1 else f"{name}_{count}"


def _free(path: str, claim: bool) -> bool:
    """Whether no run holds `path`; claim: and this one does now (mkdir fails where another run made it first,
    even a moment ahead of us)."""
    if not claim:
        return not os.path.exists(path)
    try:
        os.mkdir(path)
        return True
    except FileExistsError:
        return False


def start_trackers(accelerator, args, resumed_run: str | None, step: int) -> str | None:
    """Start the trackers of a run at optimizer `step` (0: fresh); returns its folder name (see the
    module's docstring; saved in the state so that a resume continues it), None without trackers."""
    if not accelerator.log_with:
        return None
    # the main process alone writes the trackers, so it alone claims the folder (no empty twins)
    run = resumed_run or run_folder(args.logging_dir, args.log_prefix, args.output_name,
                                    claim=accelerator.is_main_process)
    if args.logging_dir:
        accelerator.project_configuration.logging_dir = os.path.join(args.logging_dir, run)
    init_kwargs = {"wandb": {"name": run}}
    if resumed_run:  # rows after the state's step, logged before a kill, are dropped as the CSV's are
        init_kwargs["tensorboard"] = {"purge_step": step + 1}
    config = {k: str(v) for k, v in vars(args).items() if k != "key_origins"}  # the values, not where they were set
    accelerator.init_trackers(args.log_prefix or args.output_name, config=config, init_kwargs=init_kwargs)
    return run


def log_sample_images(accelerator, paths: list[str], step: int) -> None:
    """Each rendered sample PNG to every tracker, as `samples/NN` (NN: the prompt's number) at `step`."""
    if not paths or not accelerator.is_main_process:
        return
    images = []
    for path in paths:  # read once, whatever the number of trackers
        with Image.open(path) as img:
            images.append(img.convert("RGB"))
    for tracker in accelerator.trackers:
        for i, image in enumerate(images):
            key = f"samples/{i:02d}"
            if tracker.name == "tensorboard":
                tracker.log_images({key: np.asarray(image)[None]}, step=step, dataformats="NHWC")
            elif tracker.name == "wandb":
                tracker.log_images({key: [image]}, step=step)


class StepClock:
    """Per optimizer step: its wall seconds (step_s, from the end of the previous step's logging and
    saving to this step's log row, so samples and saves do not count) and, of those, the seconds spent
    waiting for the data loader (data_wait_s: a GPU starved of batches shows here, not in the step's
    compute). On CUDA the loss's .item() in the log row synchronises, so step_s is the device's time."""

    def __init__(self):
        self.restart()

    def restart(self):
        self.started, self.wait = time.perf_counter(), 0.0

    def batches(self, iterable):
        """Yield iterable's items, adding the time blocked on each to this step's wait."""
        items = iter(iterable)
        while True:
            asked = time.perf_counter()
            try:
                item = next(items)
            except StopIteration:
                return
            self.wait += time.perf_counter() - asked
            yield item

    def lap(self) -> dict[str, float]:
        return {"step_s": round(time.perf_counter() - self.started, 6), "data_wait_s": round(self.wait, 6)}
