"""Lock files a run holds from its start to its end: its outputs' (train_lora.py output_lock) and
its cache folders' (DiffusionTask). The main process takes them (library/io.py held_lock: the
kernel's flock, so a killed run drops them) and the other processes of a multi-process run get its
answer: the lock belongs to the run, and its processes never lock each other out. A second run that
finds one held stops at once with one line naming the file and its holder (pid, host); one that is
told to wait tries again every WAIT_POLL_S, each try a short broadcast, so no process sits in a
collective for longer than the launcher's timeout allows."""

from __future__ import annotations

import contextlib
import time

from library.io import LockedError, held_lock

WAIT_POLL_S = 5.0


@contextlib.contextmanager
def held_by_run(paths: list[str], accelerator, advice: str, wait_advice: str | None = None):
    """Hold every lock file in `paths` for the block, or raise LockedError: '<file>: held by <pid,
    host>: <advice>'. With `wait_advice` a held lock is waited for instead, said once in a line
    ending with it; what this run took meanwhile is let go between tries (no two runs wait on each
    other)."""
    said, paths = False, sorted(set(paths))
    while True:
        with contextlib.ExitStack() as held:
            refusal = _take(paths, wait_advice or advice, held) if accelerator.is_main_process else None
            if accelerator.num_processes > 1:
                from accelerate.utils import broadcast_object_list

                refusal = broadcast_object_list([refusal])[0]
            if refusal is None:
                yield
                return
        if wait_advice is None:
            raise LockedError(refusal)
        if not said:
            accelerator.print(refusal)
            said = True
        time.sleep(WAIT_POLL_S)


def _take(paths: list[str], advice: str, held: contextlib.ExitStack) -> str | None:
    """None with every lock in `held`, or the refusal of the first one held elsewhere."""
    for path in paths:
        try:
            held.enter_context(held_lock(path, advice))
        except LockedError as e:
            return str(e)
    return None
