"""Shared by the web UI tests: a tiny FLUX job's config on the session's tiny set, waiting, and a built
page's blocks and event functions run as gradio runs them."""

from __future__ import annotations

import os
import time

import toml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_job_settings(tiny_set, steps: int = 12, samples: bool = False, **extra) -> dict:
    """configs/quickstart.toml on the tiny set: fp32 compute, Prodigy, `steps` steps, no disk caches
    (the session's dataset folder is shared), samples every 2 steps if asked (bf16 / fp8 pairs)."""
    settings = {}
    for table in toml.load(os.path.join(ROOT, "configs", "quickstart.toml")).values():
        settings.update(table)
    settings.update({
        "pretrained_model_name_or_path": tiny_set["flux_bfl"], "ae": tiny_set["flux_vae_single"],
        "clip_l": tiny_set["clip_l"], "t5xxl": tiny_set["t5xxl"], "dataset_config": tiny_set["dataset_config"],
        "max_train_steps": steps, "save_every_n_steps": 0, "sample_at_first": False,
        "cache_latents_to_disk": False, "cache_text_encoder_outputs_to_disk": False,
    })
    if samples:
        settings.update({"sample_prompts": tiny_set["sample_prompts"], "sample_every_n_steps": 2})
    else:
        settings.pop("sample_prompts")
    settings.update(extra)
    return settings


def wait_for(condition, timeout: float, what: str, every: float = 0.2):
    """condition()'s first true value, polled; AssertionError naming `what` after `timeout` seconds."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# A sitecustomize that makes a train_lora.py run pause itself (SIGSTOP) when its progress bar reaches
# step 2, if a file `pause_at_step_2` lies beside its config (a job's folder) and it is not a resume:
# a test can then stop it, restart the UI around it, ... at a known step however fast or loaded the
# machine. (Pausing it from the test once the bar showed in the log let a fast machine run all its
# steps first.) Python imports it from PYTHONPATH in every child process; unmarked runs are untouched.
PAUSE_AT_STEP_2 = """
import os, signal, sys


def marked():
    argv = sys.argv
    if not argv or not argv[0].endswith("train_lora.py") or "--resume" in argv or "--config_file" not in argv:
        return False
    config = argv[argv.index("--config_file") + 1]
    return os.path.exists(os.path.join(os.path.dirname(config), "pause_at_step_2"))


if marked():
    from tqdm import std
    update = std.tqdm.update

    def update_then_pause(self, n=1):
        shown = update(self, n)
        if self.n == 2 and self.desc.startswith("training"):
            os.kill(os.getpid(), signal.SIGSTOP)
        return shown

    std.tqdm.update = update_then_pause
"""


def pause_hook_env(folder) -> dict:
    """os.environ plus the PYTHONPATH under which marked train_lora.py runs pause after step 2."""
    hook = os.path.join(str(folder), "pause_hook")
    os.makedirs(hook, exist_ok=True)
    with open(os.path.join(hook, "sitecustomize.py"), "w") as f:
        f.write(PAUSE_AT_STEP_2)
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [hook, os.environ.get("PYTHONPATH")]))}


def mark_to_pause(job_folder: str) -> None:
    """The job's trainer (started later, under pause_hook_env) pauses after its step 2."""
    os.makedirs(job_folder, exist_ok=True)
    open(os.path.join(job_folder, "pause_at_step_2"), "w").close()


def paused(pid: int, log_path: str) -> bool:
    """Whether the trainer is stopped (SIGSTOP); an AssertionError with its log's tail if it exited."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]  # R running, S sleeping, T stopped, Z exited
    except OSError:
        state = "gone"
    if state in ("Z", "gone"):
        with open(log_path, errors="replace") as f:
            raise AssertionError(f"the trainer {pid} exited before its pause:\n{f.read()[-3000:]}")
    return state == "T"


class WebUIProcess:
    """tools/webui.py as a subprocess on a free port, its jobs in `jobs_dir`, reading under `roots`."""

    def __init__(self, jobs_dir: str, roots: list[str], log_path: str, host: str = "127.0.0.1",
                 password: str | None = None, env: dict | None = None):
        import subprocess
        import sys

        self.jobs_dir, self.roots, self.log_path, self.password = jobs_dir, roots, log_path, password
        self.port = free_port()
        self.url = f"http://{host}:{self.port}"
        command = [sys.executable, os.path.join(ROOT, "tools", "webui.py"), "--port", str(self.port),
                   "--jobs_dir", jobs_dir, "--host", host] + (["--password", password] if password else [])
        for root in roots:
            command += ["--root", root]
        with open(log_path, "ab") as log:
            self.process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, env=env)
        wait_for(self._ready, 180, f"the web UI at {self.url} (log: {log_path})", every=0.5)

    def _ready(self) -> bool:
        import urllib.error
        import urllib.request

        if self.process.poll() is not None:
            with open(self.log_path) as f:
                raise AssertionError(f"tools/webui.py exited with {self.process.returncode}:\n{f.read()[-3000:]}")
        try:
            with urllib.request.urlopen(self.url + "/config", timeout=5) as answer:
                return answer.status == 200
        except urllib.error.HTTPError as e:  # up, behind its password
            return e.code == 401 and self.password is not None
        except OSError:
            return False

    def client(self):
        from gradio_client import Client

        return Client(self.url, verbose=False, auth=("admin", self.password) if self.password else None)

    def stop(self, kill: bool = False) -> None:
        if self.process.poll() is None:
            self.process.kill() if kill else self.process.terminate()
            self.process.wait(timeout=30)


def job_pid(jobs_dir: str, job_id: int) -> int | None:
    import sqlite3

    with sqlite3.connect(os.path.join(jobs_dir, "jobs.sqlite")) as db:
        return db.execute("SELECT pid FROM jobs WHERE id = ?", (job_id,)).fetchone()[0]


# -- a built page (library/ui/app.py build_app) driven without a server -----------------------------------

def block(app, elem_id: str):
    return next(b for b in app.blocks.values() if getattr(b, "elem_id", None) == elem_id)


def event(app, name: str, elem_id: str | None = None, api_name: str | None = None):
    """The function gradio runs on event `name` of the block with `elem_id` (or the one named `api_name`)."""
    if api_name:
        return next(fn for fn in app.fns.values() if fn.api_name == api_name)
    return next(fn for fn in app.fns.values() if (block(app, elem_id)._id, name) in fn.targets)


def run(fn, values: dict, *event_data) -> None:
    """`fn` as gradio runs it: its inputs read from `values` (block id -> the page's value), its outputs
    written back there."""
    out = fn.fn(*[values.get(block._id) for block in fn.inputs], *event_data)
    out = out if len(fn.outputs) > 1 else [out]
    values.update({block._id: value for block, value in zip(fn.outputs, out)})


def labelled(app, label: str):
    return next(b for b in app.blocks.values() if getattr(b, "label", None) == label)
