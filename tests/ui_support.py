"""Shared by the web UI tests: a tiny FLUX job's config on the session's tiny set, and waiting."""

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


class WebUIProcess:
    """tools/webui.py as a subprocess on a free port, its jobs in `jobs_dir`, reading under `roots`."""

    def __init__(self, jobs_dir: str, roots: list[str], log_path: str, host: str = "127.0.0.1",
                 password: str | None = None):
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
                                            stdin=subprocess.DEVNULL)
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
