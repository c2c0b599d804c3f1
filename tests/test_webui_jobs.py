"""The web UI's job queue and runner (library/ui/jobs.py, runner.py): claiming, stop = Ctrl-C (LoRA + state
saved), resume from that state, re-attach after a UI restart, interrupted when the trainer is gone, delete
confined to the job's folder. With the real train_lora.py on the tiny FLUX set, through the UI process: stop,
re-attach and resume in test_webui_faults.py, a stop of the UI's own trainer in test_webui_api.py."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time

import pytest

from library.ui import runner as actions
from library.ui.jobs import JobError, JobStore
from library.ui.runner import Runner
from tests.ui_support import wait_for


def claimed_job(tmp_path) -> tuple[JobStore, object]:
    """A queue with one job of 5 steps, claimed by the cpu worker (running, no process yet)."""
    store = JobStore(str(tmp_path / "jobs"))
    job = store.create("a", {"output_name": "lora"}, 5, queue=True)
    store.claim_next("cpu")
    return store, job


def test_claiming_gives_each_queued_job_to_one_worker(tmp_path):
    store = JobStore(str(tmp_path / "jobs"))
    ids = [store.create(f"j{i}", {"output_name": "x"}, 1, queue=True).id for i in range(12)]
    claimed: list[int] = []

    def worker(device):
        while (job := JobStore(str(tmp_path / "jobs")).claim_next(device)) is not None:
            claimed.append(job.id)

    threads = [threading.Thread(target=worker, args=(f"d{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(claimed) == ids  # each once, none lost
    assert {job.state for job in store.list()} == {"running"}


def test_each_job_writes_to_its_own_folder_whatever_its_config_says(tmp_path):
    store = JobStore(str(tmp_path / "jobs"))
    a = store.create("a", {"output_dir": "/tmp/shared", "output_name": "lora"}, 5)
    b = store.create("b", {"output_dir": "/tmp/shared", "output_name": "lora"}, 5)
    assert a.output_dir != b.output_dir
    assert f'output_dir = "{a.output_dir}"' in a.config and "/tmp/shared" not in a.config
    assert os.path.dirname(a.output_dir) == store.root


def test_a_new_job_never_gets_a_folder_holding_another_runs_files(tmp_path):
    """With jobs.sqlite gone and the job folders kept, ids restarted at 1: the new job's folder held the old
    run's log and state (its view showed step 7 of 4; Resume continued the old run). Such ids are skipped;
    an empty folder is taken."""
    store = JobStore(str(tmp_path / "jobs"))
    old = store.create("old", {"output_name": "lora"}, 9)
    (tmp_path / "jobs" / "job-0001" / "lora_log.csv").write_text("step,loss\n7,0.5\n")
    os.remove(store.path)
    os.makedirs(store.job_folder(3))  # empty: free
    store = JobStore(str(tmp_path / "jobs"))
    new = store.create("new", {"output_name": "lora"}, 4)
    assert old.id == 1 and new.id == 2 and os.listdir(new.output_dir) == []
    (tmp_path / "jobs" / "job-0004").write_text("a file where a folder goes")  # skipped too
    assert [store.create(n, {}, 1).id for n in "ab"] == [3, 5]


def test_delete_removes_only_the_jobs_own_folder(tmp_path):
    store = JobStore(str(tmp_path / "jobs"))
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "keep.txt").write_text("x")
    job = store.create("a", {"output_name": "lora"}, 5)
    with sqlite3.connect(store.path) as db:  # a tampered row pointing elsewhere
        db.execute("UPDATE jobs SET output_dir = ? WHERE id = ?", (str(outside), job.id))
    with pytest.raises(JobError, match="not deleting"):
        store.delete(job.id)
    assert (outside / "keep.txt").exists()
    store.update(job.id, output_dir=store.job_folder(job.id), state="running")
    with pytest.raises(JobError, match="stop it before deleting"):
        store.delete(job.id)
    store.update(job.id, state="done")
    store.delete(job.id)
    assert not os.path.exists(store.job_folder(job.id)) and store.list() == []


def test_a_queued_job_claimed_while_it_is_deleted_is_not_deleted(tmp_path, monkeypatch):
    """Two tabs: Delete read the job as queued, a runner claimed it, and Delete removed the running
    job's row and folder (its watcher then died on 'no such job', and the device's queue with it)."""
    store = JobStore(str(tmp_path / "jobs"))
    job = store.create("a", {"output_name": "lora"}, 5, queue=True)
    read = store.get

    def read_then_claimed(job_id):  # the runner claims the job just after Delete has read it
        found = read(job_id)
        store.claim_next("cpu")
        return found

    monkeypatch.setattr(store, "get", read_then_claimed)
    with pytest.raises(JobError, match=f"job {job.id} is running: stop it before deleting it"):
        store.delete(job.id)
    assert read(job.id).state == "running" and os.path.isdir(job.output_dir)


def test_a_retry_does_not_clear_the_files_of_a_job_another_tab_retried_and_started(tmp_path, monkeypatch):
    """Old: Retry read the state (failed), then cleared the folder, then queued it: another tab's retry
    and the runner's start in between lost their train.log (and the trainer's outputs) to the clear."""
    store, job = claimed_job(tmp_path)
    store.update(job.id, state="failed")
    read, raced = store.get, []

    def read_then_the_other_tab(job_id):  # the other tab's retry, claimed and started, right after this read
        found = read(job_id)
        if not raced:
            raced.append(store.update(job.id, state="running"))
            with open(job.log_path, "w") as f:
                f.write("the other tab's run\n")
        return found

    monkeypatch.setattr(store, "get", read_then_the_other_tab)
    try:
        actions.retry(store, job.id)
    except JobError:
        pass
    assert open(job.log_path).read() == "the other tab's run\n" and read(job.id).state == "running"


def test_a_trainer_gone_during_a_restart_is_marked_interrupted_with_its_step(tmp_path):
    store, job = claimed_job(tmp_path)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    with open(job.csv_path, "w") as f:
        f.write("step,epoch,loss\n1,0,1.5\n2,0,1.4\n3,0,1.")  # a row cut short by the kill
    store.update(job.id, pid=dead.pid, pid_started=12345)
    Runner(store, str(tmp_path)).recover()
    job = store.get(job.id)
    assert job.state == "interrupted" and job.last_step == 2 and job.resume is None
    assert "last logged step 2" in job.message and "retry" in job.message


@pytest.mark.parametrize("last_line", ["error: the loss is nan at step 3 (epoch 0); the LoRA was not saved",
                                       "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"])
def test_a_trainer_that_failed_while_no_ui_watched_is_failed_with_its_error_not_interrupted(tmp_path, last_line):
    """Old: a trainer that ended in an error while the UI was down read 'interrupted: the UI restarted
    and the trainer was gone', as if the restart had lost it; Retry then failed the same way."""
    store, job = claimed_job(tmp_path)
    with open(job.csv_path, "w") as f:
        f.write("step,epoch,loss\n1,0,1.5\n2,0,1.4\n")
    with open(job.log_path, "w") as f:
        f.write(f"$ python train_lora.py\nsteps:  40%|####      | 2/5\nTraceback (most recent call last):\n  ...\n{last_line}\n")
    store.update(job.id, pid=2**22 + 7, pid_started=1)  # no such process
    Runner(store, str(tmp_path)).recover()
    job = store.get(job.id)
    assert job.state == "failed" and job.message == last_line and job.last_step == 2


def test_a_trainer_gone_while_stopping_after_steps_is_interrupted_not_stopped_before_its_first_step(tmp_path):
    """Old: a job Stop was asked of, whose trainer was gone at the restart without its 'SIGINT: saved'
    line (killed while saving), read 'stopped before the first step: nothing to save' after 3 steps."""
    store, job = claimed_job(tmp_path)
    with open(job.csv_path, "w") as f:
        f.write("step,epoch,loss\n1,0,1.5\n2,0,1.4\n3,0,1.3\n")
    store.update(job.id, state="stopping", pid=2**22 + 7, pid_started=1)  # no such process
    Runner(store, str(tmp_path)).recover()
    job = store.get(job.id)
    assert job.state == "interrupted" and job.last_step == 3 and "last logged step 3" in job.message


def test_a_done_job_is_not_resumed_from_the_state_a_stop_left(tmp_path):
    """Old: a job stopped at step 2, resumed and finished (done at 4) still had the stop's state in its
    folder; Resume queued it from step 2, re-training steps 3-4 over the finished LoRA."""
    store = JobStore(str(tmp_path / "jobs"))
    job = store.create("a", {"output_name": "lora"}, 4, queue=True)
    os.makedirs(job.state_dir)
    with open(os.path.join(job.state_dir, "train_state.json"), "w") as f:
        f.write('{"step": 2}')
    store.update(job.id, state="done", resume=None, last_step=4)
    with pytest.raises(JobError, match=f"job {job.id} is done: nothing to resume"):
        actions.resume(store, job.id)
    assert store.get(job.id).state == "done"
    store.update(job.id, state="stopped")
    assert actions.resume(store, job.id).state == "queued"


def test_a_resumed_run_stopped_before_its_first_step_keeps_its_state(tmp_path):
    """Old: Stop while a resumed run was still caching ended it with 'nothing to save; retry to start
    again' and resume None: the state it had resumed from (step 3) was no longer offered."""
    store, job = claimed_job(tmp_path)
    with open(job.csv_path, "w") as f:
        f.write("step,epoch,loss\n1,0,1.5\n2,0,1.4\n3,0,1.3\n")  # the first run's steps
    os.makedirs(job.state_dir)
    with open(os.path.join(job.state_dir, "train_state.json"), "w") as f:
        f.write('{"step": 3}')
    store.update(job.id, state="stopping")
    ended = actions.outcome(store.get(job.id), -signal.SIGINT)  # our SIGINT, before its handler was set
    assert ended == {"state": "stopped", "resume": job.state_dir, "message": "stopped before its first step: nothing "
                                                                         "saved; resume continues from the state at step 3"}


def pending_signals(pid: int) -> set[int]:
    """The signals waiting for a (stopped) process, from /proc/<pid>/status's ShdPnd mask."""
    with open(f"/proc/{pid}/status") as f:
        mask = next(int(line.split()[1], 16) for line in f if line.startswith("ShdPnd:"))
    return {n + 1 for n in range(64) if mask >> n & 1}


def test_a_run_that_ended_while_no_ui_watched_gets_its_outcome_from_its_log(tmp_path):
    store = JobStore(str(tmp_path / "jobs"))
    for text in ("training: 100%|##| 5/5 [00:01<00:00]\nsaved /x/lora.safetensors after 5 steps in 1.0 s\n",
                 "training:  40%|#  | 2/5 [00:01<00:02]SIGINT: saved /x/lora-step000002.safetensors and state "
                 "/x/lora-state at step 2; continue with --resume /x/lora-state\n"):
        job = store.create("a", {"output_name": "lora"}, 5, queue=True)
        store.claim_next("cpu")
        with open(job.log_path, "w") as f:
            f.write(text)
        store.update(job.id, pid=2**22 + 7, pid_started=1)  # no such process
    Runner(store, str(tmp_path)).recover()
    done, stopped = store.list()
    assert done.state == "done" and stopped.state == "stopped"
    assert stopped.message.startswith("stopped at step 2")


def test_a_resumed_run_is_judged_by_its_own_lines_not_the_stop_of_the_run_before(tmp_path):
    """A resumed job appends to its log: a resumed run that died (re-attached, exit status unknown) read
    "stopped at step 2" from the run before it, and its live bar was that run's until its own drew."""
    from library.ui import run_files

    store = JobStore(str(tmp_path / "jobs"))
    job = store.create("a", {"output_name": "lora"}, 9, queue=True)
    store.claim_next("cpu")
    first = ("\n$ python train_lora.py --config_file job.toml\ntraining:  22%|#  | 2/9 [00:04<00:14]SIGINT: saved "
             "/x/lora-step000002.safetensors and state /x/lora-state at step 2; continue with --resume /x/lora-state\n")
    resumed = "\n$ python train_lora.py --config_file job.toml --resume /x/lora-state\nresumed from /x/lora-state at step 2\n"
    with open(job.log_path, "w") as f:
        f.write(first + resumed)
    assert run_files.progress(job.log_path, 2, 9) == run_files.Progress(2, 9)  # not the old bar's 2/9 and its ETA
    with open(job.log_path, "a") as f:
        f.write("training:  55%|#  | 5/9 [00:03<00:02]")  # killed here (exit status unknown after a UI restart)
    assert run_files.progress(job.log_path, 5, 9) == run_files.Progress(5, 9, "00:03", "00:02")
    ended = actions.outcome(store.get(job.id), None)
    assert ended["state"] == "failed" and "stopped" not in ended["message"], ended
    assert any(line.startswith("SIGINT: saved") for line in run_files.log_lines(job.log_path))  # the whole log view keeps it


def test_a_ctrl_c_during_the_final_samples_is_a_done_job(tmp_path):
    """train_lora.py exits 130 when a Ctrl-C cuts its final samples short, after the final LoRA: the
    job was 'stopped' with a resume offered (whose state has nothing to train); it is done."""
    store = JobStore(str(tmp_path / "jobs"))
    job = store.create("a", {"output_name": "lora"}, 5, queue=True)
    with open(job.log_path, "w") as f:
        f.write("SIGINT during the final samples: 1 written, the rest skipped; the LoRA is final\n"
                "saved /x/lora.safetensors after 5 steps in 1.0 s\n")
    os.makedirs(job.state_dir)
    ended = actions.outcome(store.get(job.id), 130)
    assert ended["state"] == "done" and ended["resume"] is None


def test_a_stop_during_the_first_samples_is_stopped_before_its_first_step(tmp_path):
    """train_lora.py exits 130 when Stop lands during sample_at_first's samples, before step 1 and
    without saving: the job read 'stopped at step None: LoRA and state saved'."""
    store, job = claimed_job(tmp_path)
    with open(job.log_path, "w") as f:
        f.write("SIGINT during the first samples: stopped before step 1; nothing trained, nothing saved\n")
    with open(job.csv_path, "w") as f:
        f.write("step,epoch,loss\n")
    store.update(job.id, state="stopping")
    ended = actions.outcome(store.get(job.id), 130)
    assert ended == {"state": "stopped", "resume": None,
                     "message": "stopped before its first step: nothing saved; retry to start again"}


def test_retry_starts_over_keeping_only_the_config(tmp_path):
    store, job = claimed_job(tmp_path)
    for name in ("config.toml", "lora-step000002.safetensors", "lora_log.csv"):
        open(os.path.join(job.output_dir, name), "w").close()
    os.makedirs(job.state_dir)
    store.update(job.id, state="stopped", resume=job.state_dir, last_step=2)
    with pytest.raises(JobError, match="is stopped: cannot stop"):
        actions.stop(store, job.id)
    retried = actions.retry(store, job.id)
    assert retried.state == "queued" and retried.resume is None and retried.last_step == 0 and retried.device is None
    assert os.listdir(job.output_dir) == ["config.toml"]
    with pytest.raises(JobError, match="no saved state"):
        store.update(job.id, state="failed")
        actions.resume(store, job.id)


FAKE_TRAINER = """
import signal, sys, time
log = open(sys.argv[1], "a")
def on_int(*_):
    log.write("SIGINT: saved /x/lora-step000002.safetensors and state /x/lora-state at step 2\\n")
    log.close()
    sys.exit(130)
signal.signal(signal.SIGINT, on_int)
log.write("started\\n"); log.flush()
time.sleep(120)
"""


def test_a_restart_with_another_device_list_still_watches_and_runs_the_old_devices_jobs(tmp_path):
    """A UI restarted with --device cpu after running on cuda:7: the trainer left running there is
    watched (Stop reaches it; its end is recorded), and a job queued for cuda:7 runs on cpu after it."""
    store = JobStore(str(tmp_path / "jobs"))
    orphan = store.create("orphan", {"output_name": "lora"}, 5, queue=True)
    store.claim_next("cuda:7")
    trainer = subprocess.Popen([sys.executable, "-c", FAKE_TRAINER, orphan.log_path], start_new_session=True)
    wait_for(lambda: os.path.exists(orphan.log_path), 30, "the fake trainer's start")
    from library.ui import run_files

    store.update(orphan.id, pid=trainer.pid, pid_started=run_files.process_started(trainer.pid))
    waiting = store.create("retried", {"output_name": "lora"}, 5, queue=True)
    store.update(waiting.id, device="cuda:7")  # queued (or retried) for a device no longer served
    runner = Runner(store, str(tmp_path), devices=("cpu",), python="/bin/true", poll=0.1)
    runner.start()
    try:
        assert store.get(orphan.id).state == "running"
        assert store.get(waiting.id).state == "queued"  # not beside the re-attached trainer
        actions.stop(store, orphan.id)
        assert trainer.wait(timeout=10) == 130  # the watcher sent SIGINT
        stopped = wait_for(lambda: (j := store.get(orphan.id)).state == "stopped" and j, 10, "the orphan's end")
        assert stopped.message.startswith("stopped at step 2") and stopped.pid is None
        done = wait_for(lambda: (j := store.get(waiting.id)).state == "done" and j, 10, "the queued job on cpu")
        assert done.device == "cpu"
    finally:
        runner.close()
        if trainer.poll() is None:
            trainer.kill()


SLOW_SAVER = """
import signal, sys, time
log = open(sys.argv[1], "a", buffering=1)
def on_int(*_):
    log.write("SIGINT\\n")
signal.signal(signal.SIGINT, on_int)
log.write("started\\n")
time.sleep(120)
"""


def test_a_ui_restarted_while_a_job_stops_does_not_send_a_second_sigint(tmp_path):
    """train_lora.py takes a second SIGINT as 'leave now' (no LoRA, no state saved). The watcher of a
    restarted UI sent Stop's SIGINT again to a trainer still saving after the first: two in the log."""
    store, job = claimed_job(tmp_path)
    trainer = subprocess.Popen([sys.executable, "-c", SLOW_SAVER, job.log_path], start_new_session=True)
    try:
        wait_for(lambda: os.path.exists(job.log_path), 30, "the fake trainer's start")
        from library.ui import run_files

        store.update(job.id, pid=trainer.pid, pid_started=run_files.process_started(trainer.pid))
        for _ in range(2):  # a UI, then the UI restarted
            runner = Runner(store, str(tmp_path), devices=("cpu",), python="/bin/true", poll=0.05)
            runner.start()
            if store.get(job.id).state == "running":
                actions.stop(store, job.id)
            wait_for(lambda: "SIGINT" in open(job.log_path).read(), 10, "the SIGINT")
            time.sleep(0.5)  # ten of its watcher's polls
            runner.close()
        assert open(job.log_path).read().split() == ["started", "SIGINT"]
    finally:
        trainer.kill()
        trainer.wait()


def test_a_queue_made_by_an_older_ui_gets_the_new_columns(tmp_path):
    from library.ui import jobs

    (tmp_path / "jobs").mkdir()
    with sqlite3.connect(tmp_path / "jobs" / "jobs.sqlite") as db:
        db.execute(jobs.SCHEMA.replace(", stop_sent REAL,\n    stop_now REAL", ""))
        db.execute("INSERT INTO jobs (name, config, state, output_dir, output_name, created) "
                   "VALUES ('old', '', 'stopping', '/x', 'lora', 0)")
    old = JobStore(str(tmp_path / "jobs")).get(1)
    assert (old.stop_sent, old.stop_now) == (None, None)


@pytest.mark.parametrize("log, number, message", [
    ("training:  40%|#  | 2/5 [00:01<00:02, 1.2it/s]", signal.SIGKILL,
     "killed by signal 9 (SIGKILL: out of memory? the kernel's OOM killer sends it)"),
    # Old: a SIGABRT (glibc's abort, a CUDA assert) or SIGSEGV read 'killed by signal 6 (SIGABRT: sent by another
    # process)', and the log's last line, which says why, was dropped.
    ("\n$ python train_lora.py\ntraining:  20%|#  | 1/5 [00:01<00:04, 1.2it/s]free(): invalid pointer\n", signal.SIGABRT,
     "crashed with signal 6 (SIGABRT: a fault of its own, in native or CUDA code); free(): invalid pointer"),
])
def test_a_trainer_ended_by_a_signal_says_so_not_its_progress_bar(tmp_path, log, number, message):
    store = JobStore(str(tmp_path / "jobs"))
    job = store.create("a", {"output_name": "lora"}, 5, queue=True)
    with open(job.log_path, "w") as f:
        f.write(log)
    ended = actions.outcome(store.get(job.id), -number)
    assert ended["state"] == "failed" and ended["message"] == message


def test_a_reattached_trainer_gone_without_a_word_is_not_reported_as_its_progress_bar(tmp_path):
    """Old: a trainer re-attached after a UI restart, then killed (SIGKILL: the OOM killer; its exit status is
    unknown), failed with its tqdm bar as the message."""
    store, job = claimed_job(tmp_path)
    with open(job.csv_path, "w") as f:
        f.write("step,epoch,loss\n1,0,1.5\n2,0,1.4\n")
    with open(job.log_path, "w") as f:
        f.write("\n$ python train_lora.py\ntraining:  40%|#  | 2/5 [00:01<00:02, 1.2it/s]")
    store.update(job.id, pid=4321)
    ended = actions.outcome(store.get(job.id), None)
    assert ended["state"] == "failed"
    assert ended["message"] == ("the trainer (pid 4321) was gone, its exit status unknown (re-attached after a UI "
                                "restart); last logged step 2")

def test_sample_captions_read_json_and_toml_prompt_files(tmp_path):
    """The gallery captioned a .json prompt file's samples with its raw lines ('[{"prompt": "a cat"},');
    now with each entry's prompt, as training numbers them, and a text file's lines without --flags."""
    from library.ui import run_files

    (tmp_path / "p.json").write_text('[{"prompt": "a cat", "width": 64},\n "a dog --w 64"]')
    (tmp_path / "p.toml").write_text('[prompt]\nwidth = 64\n[[prompt.subset]]\nprompt = "a bird"\n')
    (tmp_path / "p.txt").write_text("# samples\na fish --w 64 --n blurry\n")
    assert run_files.prompts(str(tmp_path / "p.json")) == ["a cat", "a dog"]
    assert run_files.prompts(str(tmp_path / "p.toml")) == ["a bird"]
    assert run_files.prompts(str(tmp_path / "p.txt")) == ["a fish"]
    (tmp_path / "bad.json").write_text("{")
    assert run_files.prompts(str(tmp_path / "bad.json")) == [] and run_files.prompts(None) == []


def test_sample_captions_split_flags_as_the_sampler_does(tmp_path):
    """The gallery split a line on " --" (the sampler on whitespace before "--" and a non-space): a
    caption's own " -- " lost its tail ('a cat'), a tab before --w kept the flags in the caption."""
    from library.data.prompts import parse_prompt_line
    from library.ui import run_files

    lines = ["a cat -- on a mat --w 64", "a dog\t--w 64 --n blurry"]
    (tmp_path / "p.txt").write_text("\n".join(lines) + "\n")
    assert run_files.prompts(str(tmp_path / "p.txt")) == ["a cat -- on a mat", "a dog"]
    assert [parse_prompt_line(line, "p.txt").prompt for line in lines] == ["a cat -- on a mat", "a dog"]


def test_a_job_whose_row_goes_away_while_it_runs_does_not_stop_the_devices_queue(tmp_path, monkeypatch):
    """A job row deleted by hand (sqlite3) while its trainer ran: the watcher's store.get raised, the
    worker thread died without a word and every job queued after it stayed queued for the UI's life."""
    store = JobStore(str(tmp_path / "jobs"))
    lost = store.create("lost", {"output_name": "lora"}, 5, queue=True)
    after = store.create("after", {"output_name": "lora"}, 5, queue=True)
    real_get = store.get

    def get(job_id):
        if job_id == lost.id:
            raise JobError(f"job {job_id}: no such job")
        return real_get(job_id)

    monkeypatch.setattr(store, "get", get)
    runner = Runner(store, str(tmp_path), devices=("cpu",), python="/bin/true", poll=0.05)
    runner.start()
    try:
        wait_for(lambda: real_get(after.id).state == "done", 10, "the job queued after it")
    finally:
        runner.close()


def jobs_run_by(tmp_path, script: str, devices: tuple[str, ...]):
    """A job per device, each run to its end by a stand-in trainer (`script`, sh) -> (store, {device: job})."""
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\n{script}\n")
    fake.chmod(0o755)
    store = JobStore(str(tmp_path / "jobs"))
    jobs = {device: store.create(device, {"output_name": "lora"}, 1, queue=True, device=device) for device in devices}
    runner = Runner(store, str(tmp_path), devices=devices, python=str(fake), poll=0.05)
    runner.start()
    try:
        for job in jobs.values():
            wait_for(lambda job=job: store.get(job.id).state == "done", 10, f"the {job.device} job")
    finally:
        runner.close()
    return store, jobs


def test_a_cpu_workers_job_sees_no_gpu(tmp_path, monkeypatch):
    """Old: the cpu worker launched the trainer with CUDA_VISIBLE_DEVICES as the UI had it (unset: every
    GPU); train_lora.py's Accelerator takes CUDA where it sees it, so a "cpu" job ran on cuda:0 beside
    the cuda:0 worker's job. Now it is launched with none visible; a cuda:N worker's job sees GPU N."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    store, jobs = jobs_run_by(tmp_path, 'echo "CUDA_VISIBLE_DEVICES=[${CUDA_VISIBLE_DEVICES-unset}]"', ("cpu", "cuda:1"))
    seen = {device: open(job.log_path).read().splitlines()[-1] for device, job in jobs.items()}
    assert seen == {"cpu": "CUDA_VISIBLE_DEVICES=[]", "cuda:1": "CUDA_VISIBLE_DEVICES=[1]"}


def test_the_default_devices_job_gets_its_peak_vram(tmp_path, monkeypatch):
    """Old: sampled only on a cuda device named with --device; webui.py's default ("default": the trainer's
    own choice, cuda:0 on a GPU machine) never showed a peak VRAM. A cpu job has none to sample."""
    from library.ui import runner as runner_module

    monkeypatch.setattr(runner_module, "gpu_memory", lambda pid: 2 * 2**30)  # nvidia-smi's answer for the job
    store, jobs = jobs_run_by(tmp_path, "sleep 0.3", ("cpu", "default"))
    assert {device: store.get(job.id).peak_vram for device, job in jobs.items()} == {"cpu": 0, "default": 2 * 2**30}


def test_a_trainer_that_does_not_stop_is_ended_by_a_second_stop(tmp_path):
    """Old: a trainer that did not act on Stop's SIGINT (hung, or a step of minutes) left its job stopping for
    good: a second Stop was refused ("job 1 is stopping: cannot stop"), so was Delete, and the device's queue
    waited behind it. Now a second Stop, once the SIGINT went out, kills the trainer: the job is stopped, with
    the state it saved before (none here: retry)."""
    store, job = claimed_job(tmp_path)
    hung = "import signal, sys, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nopen(sys.argv[1], 'w')\ntime.sleep(120)"
    trainer = subprocess.Popen([sys.executable, "-c", hung, job.log_path], start_new_session=True)
    runner = Runner(store, str(tmp_path), devices=("cpu",), python="/bin/true", poll=0.05)
    try:
        wait_for(lambda: os.path.exists(job.log_path), 30, "the fake trainer's start")
        from library.ui import run_files

        store.update(job.id, pid=trainer.pid, pid_started=run_files.process_started(trainer.pid))
        runner.start()
        actions.stop(store, job.id)
        wait_for(lambda: store.get(job.id).stop_sent, 10, "the SIGINT")
        time.sleep(0.3)  # the trainer goes on
        assert trainer.poll() is None and store.get(job.id).state == "stopping"
        assert actions.stop(store, job.id).message.startswith("stopping at once: the trainer is killed")
        wait_for(lambda: store.get(job.id).state == "stopped", 10, "the stopped job")
        assert trainer.wait(10) == -signal.SIGKILL
        assert store.get(job.id).message == "stopped at once by a second Stop (the trainer killed): nothing saved; " \
                                            "retry to start again"
    finally:
        runner.close()
        trainer.kill()
        trainer.wait()


def test_a_double_click_on_stop_does_not_kill_the_save_the_first_asked_for(tmp_path):
    """A second Stop before the first's SIGINT went out (a double click) is refused: it would kill the trainer
    the first one asked to save."""
    store, job = claimed_job(tmp_path)
    actions.stop(store, job.id)
    with pytest.raises(JobError, match="^job 1 is stopping: its stop request reaches the trainer within a second"):
        actions.stop(store, job.id)
