"""The lock file a run holds from its start to its end so that no second run writes its outputs
(train_lora.py output_lock). The main process takes it (library/io.py held_lock: the kernel's
flock, so a killed run drops it) and the other processes of a multi-process run get its answer: the
lock belongs to the run, and its processes never lock each other out. A second run that finds it
held stops at once with one line naming the file and its holder (pid, host). (Cache folders are
held shared instead, by the main process alone: DiffusionTask._hold_cache_folders.)"""

from __future__ import annotations

import contextlib

from library.io import LockedError, held_lock


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
