"""tools/webui.py refuses a start it cannot make with one line naming the option, before it makes
anything (no queue, no runner, no server)."""

from __future__ import annotations

import os
import socket

from library.ui.jobs import JobStore
from tools.webui import build_parser, main, start_up_problem


def test_bad_start_up_options_get_one_line_naming_the_option(tmp_path, capsys):
    jobs = str(tmp_path / "jobs")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cases = {("--port", str(port)): f"error: --port {port}: cannot serve on 127.0.0.1:{port} (Address already "
                                        f"in use; another UI?): pick another --port",
                 ("--port", "99999"): "error: --port 99999: a port is 1 to 65535",
                 ("--jobs_dir", "/etc/passwd"): "error: --jobs_dir /etc/passwd: not a folder (the queue's database "
                                                "and the jobs' folders go there)",
                 ("--root", "/nonexistent"): "error: --root /nonexistent: no such folder",
                 # Old: taken, and each entry got a worker: two jobs at once on cuda:0
                 ("--device", "cuda:0", "--device", "cuda:0"): "error: --device cuda:0: given twice (each device "
                                                                "runs one job at a time: name it once)",
                 ("--device", "gpu0"): "error: --device gpu0: expected cpu, cuda or cuda:N (N the GPU's index)"}
        for option, expected in cases.items():
            argv = ["--jobs_dir", jobs, "--root", str(tmp_path), *option]
            assert main(argv) == 2
            assert capsys.readouterr().err == expected + "\n"
    assert not (tmp_path / "jobs").exists()



def test_one_gpu_named_two_ways_is_given_twice(tmp_path):
    """Old: both taken, a worker each: plain cuda (CUDA_VISIBLE_DEVICES left alone) trained on GPU 0 beside
    cuda:0's job. (start_up_problem itself: main would serve.)"""
    def problem(*devices):
        args = build_parser().parse_args([arg for d in devices for arg in ("--device", d)] + ["--port", "1"])
        return start_up_problem(args, str(tmp_path / "jobs"), [])

    assert problem("cuda", "cuda:00") == ("--device cuda:00: given twice (as cuda: both are cuda:0) (each device "
                                          "runs one job at a time: name it once)")
    assert problem("cuda:1", "cuda:01").startswith("--device cuda:01: given twice (as cuda:1: both are cuda:1)")
    assert problem("cpu", "cuda", "cuda:1") is None or "given twice" not in problem("cpu", "cuda", "cuda:1")


def test_a_jobs_folder_whose_queue_cannot_be_opened_gets_one_line(tmp_path, capsys):
    """Old: a sqlite3.OperationalError traceback (a folder it may not write; no OSError, which was caught).
    Here jobs.sqlite is a folder: unwritable alike, also as root."""
    jobs = tmp_path / "jobs"
    (jobs / "jobs.sqlite").mkdir(parents=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["--jobs_dir", str(jobs), "--root", str(tmp_path), "--port", str(port)]) == 2
    assert capsys.readouterr().err == f"error: --jobs_dir {jobs}: unable to open database file: {jobs}/jobs.sqlite\n"

def test_help_gives_the_whole_first_paragraph():
    assert build_parser().description.endswith("the memory planner, the dataset view and the LoRA tools as forms.")


def test_a_second_ui_on_the_same_jobs_folder_is_refused(tmp_path, capsys):
    """Old: it started (the port clash's advice is "pick another --port"), and both UIs' runners took
    queued jobs: two trainers at once on one device."""
    jobs = str(tmp_path / "jobs")
    assert JobStore(jobs).hold() is None  # the first UI (this process)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["--jobs_dir", jobs, "--root", str(tmp_path), "--port", str(port)]) == 2
    assert capsys.readouterr().err == (f"error: --jobs_dir {jobs}: another UI (pid {os.getpid()}) serves this queue: "
                                       f"use that one, stop it, or give another --jobs_dir\n")


def test_a_root_is_added_to_the_repositorys_folders(tmp_path, monkeypatch, capsys):
    """--root replaced configs / tiny_models / learned / out, while its help and every refusal said "add": the
    shipped configs and their prompt files could no longer be opened."""
    from library.ui import handlers
    from tools.webui import ROOT

    seen = []

    def recorded(jobs_dir, workdir, roots, devices):
        seen.extend(roots)
        raise OSError(13, "stopped here", jobs_dir)

    monkeypatch.setattr(handlers, "WebUI", recorded)
    assert main(["--jobs_dir", str(tmp_path / "jobs"), "--root", str(tmp_path)]) == 2
    assert seen == [os.path.join(ROOT, r) for r in ("configs", "tiny_models", "learned", "out")] + [str(tmp_path)]
    capsys.readouterr()


def test_a_port_a_stopped_ui_served_on_is_free_at_once_but_a_served_one_is_not():
    """Old: restarting the UI right after stopping it, with a tab connected, was refused as "another UI?": the old
    server's closed connections wait out their close (TIME_WAIT) on the port, and the check bound it without
    SO_REUSEADDR, which uvicorn sets (and binds fine)."""
    from tools.webui import port_in_use

    with socket.socket() as served:  # as uvicorn serves: SO_REUSEADDR, which its connections inherit
        served.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        served.bind(("127.0.0.1", 0))
        served.listen()
        port = served.getsockname()[1]
        assert "Address already in use; another UI?" in port_in_use("127.0.0.1", port)
        tab = socket.create_connection(("127.0.0.1", port))
        connection, _ = served.accept()
        connection.close()  # the server closes first: its end waits in TIME_WAIT on the port
        tab.recv(1)
        tab.close()
    assert port_in_use("127.0.0.1", port) is None


def test_the_ui_empties_its_own_gradio_cache_at_start_and_never_the_users(tmp_path, monkeypatch):
    """gradio's copies of the images a stopped UI served went nowhere, one per image viewed: the cache is the
    jobs folder's now (whose lock the UI holds), emptied at start; a GRADIO_TEMP_DIR the user set is left alone."""
    from tools.webui import own_gradio_cache

    jobs = tmp_path / "jobs"
    stale = jobs / ".gradio_cache" / "3cd44f" / "sample.png"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"a copy a stopped UI left")
    monkeypatch.delenv("GRADIO_TEMP_DIR", raising=False)
    assert own_gradio_cache(str(jobs)) == os.environ["GRADIO_TEMP_DIR"] == str(jobs / ".gradio_cache")
    assert not stale.exists()
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"a copy this UI made")
    (jobs / "job-0001").mkdir()
    (jobs / "job-0001" / "000_1.png").write_bytes(b"a sample")
    from library.ui.files import Roots

    # the pages' pickers list the jobs folder's images, not gradio's copies of them (a hidden folder)
    assert Roots([str(jobs)], str(tmp_path)).listing((".png",)) == [os.path.join("jobs", "job-0001", "000_1.png")]
    users = tmp_path / "users_cache" / "kept.png"
    users.parent.mkdir()
    users.write_bytes(b"another program's")
    monkeypatch.setenv("GRADIO_TEMP_DIR", str(users.parent))
    assert own_gradio_cache(str(jobs)) is None and users.exists()
