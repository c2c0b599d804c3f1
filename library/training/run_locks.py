"""The lock file a run holds from its start to its end so that no second run writes its outputs
(train_lora.py output_lock). The main process takes it (library/io.py held_lock: the kernel's
flock, so a killed run drops it) and the other processes of a multi-process run get its answer: the
lock belongs to the run, and its processes never lock each other out. A second run that finds it
held stops at once with one line naming the file and its holder (pid, host). (Cache folders are
held shared instead, by the main process alone: DiffusionTask._hold_cache_folders.)"""

from __future__ import annotations

import contextlib
import os
import re

from library.io import LockedError, held_lock, left_behind, recover_folder


@contextlib.contextmanager
def held_by_run(path: str, accelerator, advice: str):
    """Hold the lock file `path` for the block, or raise LockedError: '<file>: held by <pid, host>:
    <advice>'."""
    refusal = None
    with contextlib.ExitStack() as held:
        if accelerator.is_main_process:
            try:
                held.enter_context(held_lock(path, advice))
            except LockedError as e:
                refusal = str(e)
        if accelerator.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            refusal = broadcast_object_list([refusal])[0]
        if refusal is not None:
            raise LockedError(refusal)
        yield


def lock_file(output_dir: str, output_name: str) -> str:
    return os.path.join(output_dir, f".{output_name}.lock")


def recover_saves(args) -> list[str]:
    """Set right what a save killed mid-write (SIGKILL, a power cut) left for this output_name; only under
    the run's output lock (nothing else writes these names). The state folder is put back (recover_folder);
    the hidden temporaries atomic_path / atomic_folder made for the LoRA files, PEFT adapter and model
    folders, EMAs, log and lr plot are removed (a folder save moved aside is put back). Returns the lines to say."""
    lines = recover_folder(os.path.join(args.output_dir, f"{args.output_name}-state"))
    ours = re.compile(re.escape(args.output_name) + r"((-step\d+)?(_ema)?(\.safetensors)?|_log\.csv|_lr\.png)")
    left = left_behind(args.output_dir, lambda name: ours.fullmatch(name) and not locked_by_another_run(args, name))
    for target, entries in left.items():
        lines += recover_folder(os.path.join(args.output_dir, target))  # a folder save's
        for entry in entries:
            if os.path.isfile(path := os.path.join(args.output_dir, entry)):
                os.remove(path)
    if left:
        removed = [entry for entries in left.values() for entry in entries]
        lines.append(f"removed what a killed save left in {args.output_dir}: {', '.join(removed)}")
    return lines


def locked_by_another_run(args, name: str) -> bool:
    """Whether `name` may be the save of another output_name whose run holds its lock in output_dir now:
    output_name 'a_ema' writes a_ema.safetensors as 'a' writes its EMA ('a-step000010' alike)."""
    stem = name.removesuffix(".safetensors")
    owners = {stem, stem.removesuffix("_ema"), re.sub(r"-step\d+$", "", stem.removesuffix("_ema"))} - {args.output_name}
    return any(os.path.exists(lock_file(args.output_dir, owner)) for owner in owners)
