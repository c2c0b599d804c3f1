"""Runs the queue: per device one train_lora.py process at a time, started with an argument list (no
shell) in its own session, so it outlives the UI; a restarted UI re-attaches to it.

Stop is train_lora.py's Ctrl-C: SIGINT, after which it saves the LoRA (<name>-stepNNNNNN.safetensors)
and the state (<name>-state) at the end of the current optimizer step and exits with status 130
(during the final samples, after the final LoRA, it stops them and exits 130 too: that job is done).
Resume passes --resume <state>; train_lora.py continues the CSV log from the state's step.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

from library.ui import run_files
from library.ui.files import write_whole
from library.ui.jobs import ACTIVE, FINISHED, Job, JobError, JobStore

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN_SCRIPT = os.path.join(ROOT, "train_lora.py")
STOPPED_LINE = re.compile(r"SIG(?:INT|TERM): saved .* at step (\d+)")
DONE_LINE = re.compile(r"^saved .* after (\d+) steps")
RESUMABLE = tuple(s for s in FINISHED if s != "done")  # a done job's folder may hold a stop's older state
# Signals a process gets from its own fault (native code, CUDA, an abort()), not from another process.
CRASH_SIGNALS = (signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGFPE, signal.SIGILL)
# Of a crashed trainer's log, lines that do not say why: the runner's command line, faulthandler's
# dump after its "Fatal Python error: Segmentation fault" (with PYTHONFAULTHANDLER set).
NOT_WHY_IT_CRASHED = re.compile(r"^(?:\$ |Extension modules: |Thread 0x|Current thread 0x|  File |  <no Python frame>)")
# The last line a trainer that failed prints: train_lora.py's "error: ..." or an uncaught exception's.
FAILED_LINE = re.compile(r"^(?:error: |(?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception)\b)")


# -- queue actions (state changes the UI asks for) -------------------------------------------

def queue(store: JobStore, job_id: int) -> Job:
    return store.transition(job_id, ("draft",), "queue", state="queued", queued=time.time())


def stop(store: JobStore, job_id: int) -> Job:
    """A queued job goes back to draft; a running one is asked to stop (the runner sends SIGINT); a stopping one
    whose trainer got the SIGINT and goes on (hung, or in a step of minutes) is ended at once (the runner kills it:
    nothing saved since its last state)."""
    job = store.get(job_id)
    if job.state == "queued":
        return store.transition(job_id, ("queued",), "stop", state="draft", queued=None)
    if job.state == "stopping":
        if not job.stop_sent:  # a double click: killing it now would lose the save the first Stop asked for
            raise JobError(f"job {job_id} is stopping: its stop request reaches the trainer within a second; press "
                           f"Stop again after that to end it at once, without saving")
        return store.transition(job_id, ("stopping",), "stop at once", stop_now=time.time(),
                                message="stopping at once: the trainer is killed; nothing is saved after its last "
                                        "saved state")
    return store.transition(job_id, ("running",), "stop", state="stopping",
                            message="stopping: the LoRA and state are saved after the current step (Stop again ends it "
                                    "at once, unsaved)")


def resume(store: JobStore, job_id: int) -> Job:
    """A stopped, failed or interrupted job, from its saved state. Not a done one: a state a stop saved
    mid-run stays in its folder, and resuming from it re-trained steps and overwrote the finished LoRA."""
    job = store.get(job_id)
    step = run_files.state_step(job.state_dir)
    if job.state == "done":
        raise JobError(f"job {job_id} is done: nothing to resume (retry trains it again from the start)")
    if step is None:
        raise JobError(f"job {job_id} has no saved state ({job.state_dir}): retry it from the start instead")
    return store.transition(job_id, RESUMABLE, "resume", state="queued", queued=time.time(), resume=job.state_dir,
                            device=None, message=f"resumes from the state at step {step}")


def retry(store: JobStore, job_id: int) -> Job:
    """From the start: the job's earlier outputs are removed (its config stays), in the transaction that
    queues it: a folder that cannot be cleared leaves the job as it was, and a job another tab retried
    (and a runner started) meanwhile keeps its files."""
    return store.transition(job_id, FINISHED, "retry", first=store.clear_outputs, state="queued", queued=time.time(),
                            resume=None, device=None, last_step=0, peak_rss=0, peak_vram=0, message="")


# -- the runner ------------------------------------------------------------------------------

class Runner:
    """One worker thread per device, taking queued jobs in order. A job a previous UI left running
    (its process still there) gets a watcher thread of its own, whatever device it ran on: the
    device list may have changed since. The worker of its device (or the first device, if its own is
    no longer served) waits for it to end before starting another job there."""

    def __init__(self, store: JobStore, workdir: str, devices: tuple[str, ...] = ("cpu",),
                 python: str = sys.executable, poll: float = 1.0):
        self.store, self.workdir, self.devices, self.python, self.poll = store, workdir, devices, python, poll
        self.closing = threading.Event()
        self.threads: list[threading.Thread] = []

    def start(self) -> None:
        watchers: dict[str, list[threading.Thread]] = {}
        for device, jobs in self.recover().items():
            for job in jobs:
                watcher = threading.Thread(target=self._watch, args=(job, None), name=f"watch-job{job.id}", daemon=True)
                watcher.start()
                watchers.setdefault(device, []).append(watcher)
                self.threads.append(watcher)
        for device in self.devices:
            thread = threading.Thread(target=self._work, args=(device, watchers.get(device, [])),
                                      name=f"runner-{device}", daemon=True)
            thread.start()
            self.threads.append(thread)

    def close(self) -> None:
        """Stops the workers; running trainers go on (a restarted UI re-attaches to them)."""
        self.closing.set()
        for thread in self.threads:
            thread.join(timeout=10)

    def recover(self) -> dict[str, list[Job]]:
        """Jobs a previous UI left running, by the served device whose worker waits for them:
        re-attached if their trainer still runs, else interrupted, with their last step and the
        state they can resume from."""
        attached: dict[str, list[Job]] = {}
        for job in self.store.with_state(*ACTIVE):
            if job.pid and run_files.process_started(job.pid) == job.pid_started:
                device = job.device if job.device in self.devices else self.devices[0]
                attached.setdefault(device, []).append(job)
                continue
            step = run_files.last_step(job.csv_path)
            ended = outcome(job, None)  # it may have finished (or stopped cleanly) while no UI watched
            if ended["state"] in ("done", "stopped"):
                self.store.update(job.id, **ended, finished=time.time(), last_step=step, pid=None)
                continue
            lines = run_files.log_lines(job.log_path, 1, latest_run=True)
            if lines and FAILED_LINE.match(lines[-1]):  # it failed while no UI watched: not a restart's loss
                self.store.update(job.id, state="failed", message=lines[-1], finished=time.time(),
                                  last_step=step, pid=None, resume=ended["resume"])
                continue
            saved = run_files.state_step(job.state_dir)
            where = f"; resume continues from the state at step {saved}" if saved is not None else "; no state saved: retry"
            self.store.update(job.id, state="interrupted", finished=time.time(), last_step=step, pid=None,
                              message=f"interrupted: the UI restarted and the trainer (pid {job.pid}) was gone; "
                                      f"last logged step {step}{where}",
                              resume=job.state_dir if saved is not None else None)
        return attached

    def _work(self, device: str, watchers: list[threading.Thread]) -> None:
        for watcher in watchers:  # one job at a time per device: a re-attached one first
            while watcher.is_alive() and not self.closing.is_set():
                watcher.join(self.poll)
        while not self.closing.is_set():
            try:
                self._run_next(device)
            except Exception as e:  # a dead worker would stop this device's queue for the UI's life, unseen
                print(f"webui runner {device}: {type(e).__name__}: {e}; the queue goes on", file=sys.stderr)
                self.closing.wait(self.poll)

    def _run_next(self, device: str) -> None:
        """The next queued job of `device`, run to its end (or a poll's wait when none is queued)."""
        job = self.store.claim_next(device, self.devices)
        if job is None:
            self.closing.wait(self.poll)
            return
        try:
            process = self._launch(job, device)
        except OSError as e:
            self.store.update(job.id, state="failed", finished=time.time(), message=f"could not start: {e}")
            return
        try:
            self._watch(self.store.get(job.id), process)
        except Exception:  # e.g. its row deleted by hand: the trainer still holds the device until it ends
            while process.poll() is None and not self.closing.is_set():
                time.sleep(self.poll)
            raise

    def _launch(self, job: Job, device: str) -> subprocess.Popen:
        write_whole(job.config_path, job.config)
        command = [self.python, TRAIN_SCRIPT, "--config_file", job.config_path]
        if job.resume:
            command += ["--resume", job.resume]
        env = dict(os.environ)
        if device == "cpu":  # no GPU visible: train_lora.py's Accelerator takes cuda:0 wherever it sees one
            env["CUDA_VISIBLE_DEVICES"] = ""
        elif device.startswith("cuda:"):
            env["CUDA_VISIBLE_DEVICES"] = device.split(":", 1)[1]
        with open(job.log_path, "ab") as log:
            log.write(f"{run_files.RUN_START}{' '.join(command)}\n".encode())
            log.flush()
            process = subprocess.Popen(command, cwd=self.workdir, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                       stderr=subprocess.STDOUT, start_new_session=True)
        self.store.update(job.id, pid=process.pid, pid_started=run_files.process_started(process.pid))
        return process

    def _watch(self, job: Job, process: subprocess.Popen | None) -> None:
        """Until the trainer exits: its last step, peak memory, and a stop request turned into
        SIGINT (once per run, also across UI restarts: train_lora.py takes a second one as "leave now",
        without saving). process None: a re-attached trainer (not our child: its exit status is read from its log)."""
        vram_checked = 0.0
        while True:
            if self.closing.is_set():  # the UI is going away; the trainer goes on and is re-attached later
                return
            alive = process.poll() is None if process else run_files.process_started(job.pid) == job.pid_started
            current = self.store.get(job.id)
            values = {"last_step": run_files.last_step(job.csv_path),
                      "peak_rss": max(current.peak_rss, run_files.peak_rss(job.pid))}
            # Any device but cpu: "default" is the trainer's own choice, cuda:0 on a GPU machine (0 without nvidia-smi).
            if job.device != "cpu" and time.time() - vram_checked > 2:
                values["peak_vram"] = max(current.peak_vram, gpu_memory(job.pid))
                vram_checked = time.time()
            # Written only when changed: each write is a SQLite commit (an fsync) beside the trainer.
            self.store.update(job.id, **{k: v for k, v in values.items() if getattr(current, k) != v})
            if not alive:
                break
            if current.state == "stopping" and not current.stop_sent:  # sent once, whichever UI watched then
                self.store.update(job.id, stop_sent=time.time())
                os.kill(job.pid, signal.SIGINT)
            if current.state == "stopping" and current.stop_now:  # a second Stop: the trainer's session, workers too
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(job.pid, signal.SIGKILL)
            time.sleep(self.poll)
        code = process.returncode if process else None
        self.store.update(job.id, **outcome(self.store.get(job.id), code), finished=time.time(), pid=None,
                          exit_code=code)


def outcome(job: Job, code: int | None) -> dict:
    """The finished run's state and message, from its exit status (None: unknown, a re-attached
    trainer) and the log's last lines."""
    lines = run_files.log_lines(job.log_path, 20, latest_run=True)
    saved = run_files.state_step(job.state_dir)
    stopped = next((m for m in map(STOPPED_LINE.search, reversed(lines)) if m), None)
    # 130 after the final LoRA (a Ctrl-C during the final samples): done, nothing to resume.
    if code == 0 or (code in (None, 130) and any(DONE_LINE.search(line) for line in lines[-3:])):
        return {"state": "done", "message": lines[-1] if lines else "done", "resume": None}
    if job.stop_now and code in (None, -signal.SIGKILL) and not stopped:  # killed by a second Stop
        then = f"resume continues from the state at step {saved}" if saved is not None else "retry to start again"
        return {"state": "stopped", "message": f"stopped at once by a second Stop (the trainer killed): nothing "
                                               f"saved; {then}", "resume": job.state_dir if saved is not None else None}
    # Stopped before training began (while loading, caching or rendering sample_at_first's samples; our
    # SIGINT before train_lora.py's Ctrl-C handler was set). One gone after logged steps without saving,
    # and not by our SIGINT, failed (or is interrupted at a restart).
    if job.state == "stopping" and not stopped and (code == -signal.SIGINT or not run_files.last_step(job.csv_path)):
        then = f"resume continues from the state at step {saved}" if saved is not None else "retry to start again"
        return {"state": "stopped", "message": f"stopped before its first step: nothing saved; {then}",
                "resume": job.state_dir if saved is not None else None}
    if code == 130 or (code is None and stopped):
        return {"state": "stopped", "message": f"stopped at step {stopped.group(1) if stopped else saved}: "
                                               f"LoRA and state saved; resume continues from there",
                "resume": job.state_dir if saved is not None else None}
    if code is not None and code < 0:
        return {"state": "failed", "message": killed_by(-code, lines),
                "resume": job.state_dir if saved is not None else None}
    errors = [line for line in lines if line.startswith("error:") or "Error" in line]
    if errors:
        why = errors[-1]
    elif code is None:  # re-attached, gone without a word (SIGKILL: the OOM killer?): its last line is a progress bar
        why = (f"the trainer (pid {job.pid}) was gone, its exit status unknown (re-attached after a UI restart); "
               f"last logged step {run_files.last_step(job.csv_path)}")
    else:
        why = lines[-1] if lines else f"exit status {code}"
    return {"state": "failed", "message": why, "resume": job.state_dir if saved is not None else None}


def killed_by(number: int, lines: list[str]) -> str:
    """A crash signal is the trainer's own (a native or CUDA fault, glibc's abort): its log's last line
    (not the progress bar) may say why, e.g. "free(): invalid pointer". Others were sent to it."""
    try:
        name = signal.Signals(number).name
    except ValueError:
        name = "unknown signal"
    if number in CRASH_SIGNALS:
        said = next((line for line in reversed(lines) if not run_files.TQDM.search(line)
                     and not NOT_WHY_IT_CRASHED.match(line)), None)
        crashed = f"crashed with signal {number} ({name}: a fault of its own, in native or CUDA code)"
        return f"{crashed}; {said}" if said else crashed
    why = "out of memory? the kernel's OOM killer sends it" if number == signal.SIGKILL else "sent by another process"
    return f"killed by signal {number} ({name}: {why})"


def gpu_memory(pid: int) -> int:
    """Bytes the process holds on its GPU by nvidia-smi (0 without it): a sample, not a peak."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return 0
    try:
        out = subprocess.run([smi, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    for line in out.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) == 2 and cells[0] == str(pid) and cells[1].isdigit():
            return int(cells[1]) * 1024 * 1024
    return 0
