"""The web UI process killed (SIGKILL) during a job: the trainer goes on, its files stay whole, and the
restarted UI re-attaches to it and sees it finish. (Two tabs queuing at once: test_webui_api.py.)"""

from __future__ import annotations

import csv
import os
import signal

import toml

from tests.ui_support import WebUIProcess, job_pid, mark_to_pause, pause_hook_env, paused, tiny_job_settings, wait_for


def csv_steps(path: str) -> list[int]:
    with open(path) as f:
        return [int(row["step"]) for row in csv.DictReader(f)]


def test_killing_the_ui_during_a_job_keeps_its_files_and_the_job_finishes(tiny_set, tmp_path):
    jobs = str(tmp_path / "jobs")
    server = WebUIProcess(jobs, [tiny_set["root"]], str(tmp_path / "webui.log"), env=pause_hook_env(tmp_path))
    steps = 3  # paused at step 2 while the UI is killed, the last one under the new UI
    text = toml.dumps(tiny_job_settings(tiny_set, steps=steps))
    client = server.client()
    answer = client.predict("killed", text, *[None] * 11, api_name="/create_job")[0]
    folder, job_id = answer["output_dir"], answer["job_id"]
    mark_to_pause(folder)
    assert client.predict(str(job_id), api_name="/queue_job")[0]["state"] == "queued"
    log = os.path.join(folder, "train.log")
    wait_for(lambda: os.path.exists(log) and job_pid(jobs, job_id), 60, "the trainer's start")
    pid = job_pid(jobs, job_id)
    try:  # it pauses itself at step 2 (held while no UI runs, so the new UI finds it running)
        wait_for(lambda: paused(pid, log), 240, "the trainer's pause at step 2")
        server.stop(kill=True)
        assert os.path.exists(f"/proc/{pid}"), "the trainer died with the UI"
        server = WebUIProcess(jobs, [tiny_set["root"]], str(tmp_path / "webui2.log"))
        client = server.client()
        assert client.predict(str(job_id), api_name="/live")["state"] == "running"  # re-attached
    finally:
        os.kill(pid, signal.SIGCONT)
    try:
        view = wait_for(lambda: (v := client.predict(str(job_id), api_name="/live"))["state"] != "running" and v,
                        240, "the job to finish under the new UI")
    finally:
        server.stop()
    assert view["state"] == "done", view["status"]
    assert csv_steps(os.path.join(folder, "tiny_flux_lora_log.csv")) == list(range(1, steps + 1))
    assert os.path.getsize(os.path.join(folder, "tiny_flux_lora.safetensors")) > 0
    assert os.path.isfile(os.path.join(folder, "config.toml")) and not os.path.exists(os.path.join(folder, "config.toml.tmp"))
