"""The names a run writes in output_dir, made from output_name: a save's name (lora_save_name), and the
check at load that the longest of them (through its atomic temporary) fits the file system's name limit:
a name too long failed only when its file was written, at the first sample or after every step had trained.

Torch-free: config.py checks it when the config loads.
"""

from __future__ import annotations

import os
import time

from library.atomic_files import name_limit, temporary_name
from library.data.prompts import sample_file_name
from library.errors import ConfigError


def step_tag(step: int) -> str:
    """A step's tag, stepNNNNNN: in its save's name and its samples' (train_lora.py's render tag)."""
    return f"step{step:06d}"


def sample_tag(sample_every_n_steps: int, sample_every_n_epochs: int, step: int, max_steps: int,
               epoch: int | None = None) -> str | None:
    """The tag of the samples rendered after optimizer step `step` (epoch None) or at the end of epoch `epoch`
    (its last step `step`), None where none render. Either interval fires, as in musubi-tuner (sd-scripts
    reads the epochs' alone); a step that ends an epoch renders once, as that step's (musubi-tuner renders it
    twice). The last step's are the final samples, rendered after the final save."""
    if step >= max_steps:
        return None
    by_steps = bool(sample_every_n_steps) and step % sample_every_n_steps == 0
    if epoch is None:
        return step_tag(step) if by_steps else None
    by_epochs = bool(sample_every_n_epochs) and epoch % sample_every_n_epochs == 0
    return f"epoch{epoch:04d}" if by_epochs and not by_steps else None


def lora_save_name(output_name: str, step: int | None = None) -> str:
    """A save's name before its suffix: <output_name> (the final one), <output_name>-stepNNNNNN (a step's)."""
    return output_name if step is None else f"{output_name}-{step_tag(step)}"


def check_name_length(args, where: str, formats: list[str]) -> None:
    """A name too long for output_dir's file system failed only when the file was written: at the first
    sample, or at the save after every step had trained ('File name too long')."""
    name, longest = args.output_name, longest_written_name(args, formats)
    size, longest_size, limit = len(name.encode()), len(longest.encode()), name_limit(args.output_dir)
    if longest_size > limit:
        shape = longest.replace(name, "<output_name>", 1)
        raise ConfigError(f"{where}: key 'output_name' is {size} bytes (UTF-8): the longest file name the run "
                          f"writes from it, '{shape}', is {longest_size} bytes, over the file system's limit of "
                          f"{limit} in output_dir '{args.output_dir}'; use at most {size - longest_size + limit} bytes")


def longest_written_name(args, formats: list[str]) -> str:
    """The longest name the run writes in output_dir, each made as the run makes it: a numbered save (any run
    may write one: a diverged loss keeps its step), its EMA, the state folder, logs, samples; each written
    through an atomic temporary."""
    name, step = args.output_name, max(args.max_train_steps or 0, 1)
    save = lora_save_name(name, step) + ("_ema" if args.ema_decay else "")
    names = [save, f"{name}-state", f"{name}_log.csv", f"{name}_eval.csv", f"{name}_lr.png"]
    if not args.pretrain and "kohya" in formats:
        names.append(save + ".safetensors")
    if args.sample_prompts and args.model_type != "llm":  # the longest tag (stepNNNNNN) and seed (2^32 - 1)
        names.append(sample_file_name(name, step_tag(step), 0, time.strftime("%Y%m%d%H%M%S"), 2**32 - 1))
    return temporary_name(max(names, key=lambda n: len(n.encode())))


