"""The web UI process killed (SIGKILL) during a job: the trainer goes on, its files stay whole, and the
restarted UI re-attaches to it, stops it (SIGINT to a trainer that is not its child: LoRA and state saved at
step 2), runs the tools on its LoRA, resumes it, sees it finish, compares and deletes it. (Two tabs queuing at once: test_webui_api.py; the queue and runner
without the UI: test_webui_jobs.py.)"""

from __future__ import annotations

import csv
import os
import signal

import toml
from PIL import Image
from safetensors import safe_open

from library.ui.jobs import JobStore
from tests.test_webui_jobs import pending_signals
from tests.ui_support import WebUIProcess, job_pid, mark_to_pause, pause_hook_env, paused, tiny_job_settings, wait_for


def tools_on_a_stopped_jobs_lora(client, jobs: str, job_id: str, lora: str):
    """The pages' tools on a LoRA a stopped job saved: lora_info, convert (into the jobs folder's tools/), resize
    (refused outside the roots) and generate with it."""
    info = client.predict(lora, api_name="/lora_info")
    assert "rank" in info.lower() and "8" in info, info
    converted = client.predict(lora, "as_diffusers.safetensors", "diffusers", api_name="/convert_lora")
    assert os.path.isfile(os.path.join(jobs, "tools", "as_diffusers.safetensors")), converted
    resized = client.predict(lora, "/etc/r4.safetensors", 4, api_name="/resize_lora")
    assert "outside the folders" in resized and not os.path.exists("/etc/r4.safetensors")
    output, image = client.predict(job_id, lora, 0.8, "a red circle", 64, 2, 0, api_name="/generate")
    assert image and Image.open(image).size == (64, 64), output


def csv_steps(path: str) -> list[int]:
    with open(path) as f:
        return [int(row["step"]) for row in csv.DictReader(f)]


def live(client, job_id) -> dict:
    return client.predict(str(job_id), api_name="/live")


def test_a_job_outlives_a_killed_ui_and_the_new_ui_stops_resumes_and_finishes_it(tiny_set, tmp_path):
    """One job, two trainer processes: the first pauses itself at step 2 (ui_support.PAUSE_AT_STEP_2) while
    the UI is killed and restarted and the new UI asks it to stop, so the stop lands at step 2 however fast
    the machine is; the resume trains the last step. (This was two tests, one through the runner without
    the UI process: the same stop, resume and re-attach, with a trainer started twice more.)"""
    jobs = str(tmp_path / "jobs")
    server = WebUIProcess(jobs, [tiny_set["root"]], str(tmp_path / "webui.log"), env=pause_hook_env(tmp_path))
    steps = 3  # paused at step 2 while the UI is killed, stopped there, the resume trains the last one
    text = toml.dumps(tiny_job_settings(tiny_set, steps=steps))
    client = server.client()
    answer = client.predict("killed", text, *[None] * 11, api_name="/create_job")[0]
    folder, job_id = answer["output_dir"], answer["job_id"]
    mark_to_pause(folder)
    assert client.predict(str(job_id), api_name="/queue_job")[0]["state"] == "queued"
    log = os.path.join(folder, "train.log")
    wait_for(lambda: os.path.exists(log) and job_pid(jobs, job_id), 60, "the trainer's start", every=0.1)
    pid = job_pid(jobs, job_id)
    try:  # it pauses itself at step 2 (held while no UI runs, so the new UI finds it running)
        wait_for(lambda: paused(pid, log), 240, "the trainer's pause at step 2", every=0.1)
        server.stop(kill=True)
        assert os.path.exists(f"/proc/{pid}"), "the trainer died with the UI"
        server = WebUIProcess(jobs, [tiny_set["root"]], str(tmp_path / "webui2.log"))
        client = server.client()
        assert live(client, job_id)["state"] == "running" and job_pid(jobs, job_id) == pid  # re-attached
        assert client.predict(str(job_id), api_name="/stop_job")[0]["state"] == "stopping"
        # sent by the new UI's watcher, to a trainer that is not its child
        wait_for(lambda: signal.SIGINT in pending_signals(pid), 10, "the new UI's SIGINT", every=0.1)
    finally:
        os.kill(pid, signal.SIGCONT)
    try:
        view = wait_for(lambda: (v := live(client, job_id))["state"] != "stopping" and v, 120, "the clean stop")
        stopped = JobStore(jobs).get(job_id)
        assert view["state"] == "stopped" and stopped.message.startswith("stopped at step 2:"), \
            (stopped.message, open(log).read()[-4000:])
        step = 2
        lora = os.path.join(folder, f"tiny_flux_lora-step{step:06d}.safetensors")
        with safe_open(lora, "pt") as f:
            meta = f.metadata()  # the steps it trained, and the steps it was asked for
            assert meta["ss_steps"] == str(step) and meta["ss_max_train_steps"] == str(steps) and len(list(f.keys())) > 0
        assert stopped.resume == stopped.state_dir and os.path.isdir(stopped.state_dir)
        assert stopped.peak_rss > 100 * 2**20
        assert os.path.isdir(os.path.join(folder, "tiny_flux_lora-state"))
        tools_on_a_stopped_jobs_lora(client, jobs, str(job_id), lora)

        assert client.predict(str(job_id), api_name="/resume_job")[0]["state"] == "queued"
        view = wait_for(lambda: (v := live(client, job_id))["state"] in ("done", "failed") and v, 240,
                        "the resumed run to finish under the new UI")
        assert view["state"] == "done", view["status"]
        assert [row["value"] for row in view["loss"] if row["series"] == "loss"] and len(view["loss"]) == steps
        assert {row["series"] for row in view["dlr"]} == {"d*lr/lora"} and len(view["lr"]) == steps
        assert view["peak_rss"] > 100 * 2**20 and "peak RSS" in view["status"]
        done = JobStore(jobs).get(job_id)
        assert done.exit_code == 0 and done.last_step == steps and os.path.getsize(done.lora_path) > 0
        assert done.lora_path == os.path.join(folder, "tiny_flux_lora.safetensors")
        assert csv_steps(done.csv_path) == list(range(1, steps + 1))  # each step once across the two runs
        with open(log) as f:
            assert f"resumed from {done.state_dir} at step {step}" in f.read()
        assert os.path.isfile(os.path.join(folder, "config.toml")) and not os.path.exists(os.path.join(folder, "config.toml.tmp"))
        both, note = client.predict(str(job_id), str(job_id), "d*lr", api_name="/compare")  # the two runs as one
        assert not note["visible"]
        assert len(both["data"]) == 2 * steps and {r[2] for r in both["data"]} == {f"{job_id} killed: d*lr/lora"}

        refused = client.predict(str(job_id), False, api_name="/delete_job")[0]
        assert refused["ok"] is False and "confirm" in refused["error"] and os.path.isdir(folder)
        assert client.predict(str(job_id), True, api_name="/delete_job")[0]["ok"] is True
        assert not os.path.exists(folder)
        assert all(row[0] != job_id for row in client.predict(api_name="/list_jobs")["data"])
    finally:
        server.stop()

