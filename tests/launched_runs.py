"""Several train_lora runs in turn inside each process of one multi-process launch (torchrun or accelerate
launch; tests/test_train_lora.py and tests/test_fsdp.py): a process's interpreter start and imports take ~20 s
on 2 CPU cores, a tiny run a few seconds, so a launch pays them once for all its runs.

    <launcher> tests/launched_runs.py RUNS.json

RUNS.json: [[fault, argv], ...], run in that order; `fault` (a name in FAULTS, or null) is put in for its run
alone. Each process writes a run's output to <the run's output_dir>.rank<R>.log, ending with the line
"rank R returned C at <time>", and exits with the last run's code: a run whose early exit the launcher must
see (a signal's 130) comes last. The process group is kept from run to run. An alarm ends a process whose
collectives deadlocked.
"""

import contextlib
import json
import os
import signal
import sys
import time

sys.path.insert(0, os.getcwd())  # the launcher runs in the repository root
from library.models.family import DiffusionFamily  # noqa: E402
from library.models.flux1.family import FluxFamily  # noqa: E402
from library.training.diffusion_task import DiffusionTask  # noqa: E402
from library.training import saves  # noqa: E402
import train_lora  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.state import PartialState  # noqa: E402

RANK = os.environ["RANK"]


@contextlib.contextmanager
def patched(owner, name, make):
    """owner.name replaced by make(the real one) for one run."""
    real = getattr(owner, name)
    setattr(owner, name, make(real))
    try:
        yield
    finally:
        setattr(owner, name, real)


def at_call(owner, name, number, act):
    """owner.name's call `number` of this run made by act(the real one, args, kwargs) in its place."""
    calls = []

    def make(real):
        def counted(*a, **k):
            calls.append(1)
            return act(real, a, k) if len(calls) == number else real(*a, **k)
        return counted
    return patched(owner, name, make)


def nan_loss_in_process_1():  # the second batch of process 1 only
    def nan(real, a, k):
        loss, sigmas = real(*a, **k)
        return (loss * float("nan") if RANK == "1" else loss), sigmas
    return at_call(DiffusionFamily, "training_loss", 2, nan)


def sigterm(rank: str):
    def send(real, a, k):
        if RANK == rank:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*a, **k)
    return send


def sigterm_to_process_1():  # at its second batch
    return at_call(DiffusionFamily, "training_loss", 2, sigterm("1"))


def sigterm_to_process_1_in_a_render():  # inside its first sample (of 2 prompts)
    return at_call(DiffusionFamily, "sample_latents", 1, sigterm("1"))


@contextlib.contextmanager
def sigterm_to_main_and_a_slow_save():
    """SIGTERM to the main process at its second batch; a full-size state takes seconds to write, and a
    second signal comes meanwhile."""
    def slow(real):
        def slow_save(*a, **k):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(3)
            real(*a, **k)
            print(f"state written at {time.time()}", file=sys.stderr, flush=True)
        return slow_save
    def barrier(real):  # process 1's proof that it waited: its "returned" line can be lost (below)
        def waited(*a, **k):
            real(*a, **k)
            print(f"rank {RANK} past a barrier at {time.time()}", file=sys.stderr, flush=True)
        return waited
    with at_call(DiffusionFamily, "training_loss", 2, sigterm("0")), patched(saves, "save_state", slow), \
            patched(Accelerator, "wait_for_everyone", barrier):
        yield


@contextlib.contextmanager
def out_of_memory_in_process_1_loading_its_first_render():
    """Process 1's first render runs out of memory loading the VAE (its GPU fuller than the others'): before the
    render's names were broadcast, process 0 waited in that broadcast and process 1 in the next step's all-reduce."""
    import torch

    rendering, failed = [], []

    def render(real):
        def rendering_samples(*a, **k):
            rendering.append(1)
            try:
                return real(*a, **k)
            finally:
                rendering.clear()
        return rendering_samples

    def vae(real):
        def load_vae(*a, **k):
            if rendering and RANK == "1" and not failed:
                failed.append(1)
                raise torch.OutOfMemoryError("CUDA out of memory (a test's)")
            return real(*a, **k)
        return load_vae

    with patched(DiffusionTask, "render_samples", render), patched(FluxFamily, "load_vae", vae):
        yield


def full_disk_at_the_main_process_first_save():  # only the main process writes: only it meets the full disk
    def full(real, a, k):
        raise OSError(f"{a[1]}: cannot be written, no space left on device (nothing was written)")
    return at_call(DiffusionTask, "save", 1, full)


FAULTS = {f.__name__: f for f in (nan_loss_in_process_1, sigterm_to_process_1, sigterm_to_process_1_in_a_render,
                                  sigterm_to_main_and_a_slow_save, out_of_memory_in_process_1_loading_its_first_render,
                                  full_disk_at_the_main_process_first_save)}


def run(fault: str | None, argv: list[str], last: bool) -> int:
    """train_lora.main(argv) with the fault in, its output (fds 1 and 2: tqdm's, the prints') to its log. The
    process group is kept for the next run (end_training destroys it; one started again on the launcher's
    store hung in the third run)."""
    out = argv[argv.index("--output_dir") + 1]
    sys.stdout.flush(), sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(f"{out}.rank{RANK}.log", "w") as log:
        os.dup2(log.fileno(), 1), os.dup2(log.fileno(), 2)
        try:
            print(f"rank {RANK} started at {time.time()}", file=sys.stderr, flush=True)
            kept = contextlib.nullcontext() if last else patched(PartialState, "destroy_process_group",
                                                                  lambda real: lambda *a, **k: None)
            with kept, FAULTS[fault]() if fault else contextlib.nullcontext():
                code = train_lora.main(argv)
            print(f"rank {RANK} returned {code} at {time.time()}", file=sys.stderr, flush=True)
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os.dup2(saved[0], 1), os.dup2(saved[1], 2)
    return code


if __name__ == "__main__":
    signal.alarm(240)  # a deadlocked process (blocked in a collective) is ended by the kernel: nothing left behind
    with open(sys.argv[1]) as f:
        runs = json.load(f)
    sys.exit([run(fault, argv, last=i == len(runs) - 1) for i, (fault, argv) in enumerate(runs)][-1])
