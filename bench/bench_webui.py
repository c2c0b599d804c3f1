"""Does watching a run in the web UI slow its training steps? The same tiny quickstart run (fp8_scaled
base, Prodigy, no samples) timed alone (train_lora.py as on the command line) and as a UI job with a
client fetching the whole live view (progress, the three charts, the samples, the log) and the queue
every 2 s, as an open page refreshes (the page itself skips unchanged views: this is its upper
bound on the server side); runs alternate, the ratio is printed.

    python bench/bench_webui.py --steps 100 --repeats 2

Time per step = (time step N appears in the CSV - time step 1 appears) / (N - 1), the CSV polled
every 20 ms: the process start, caching and the final save are left out of both.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import toml  # noqa: E402

from library.ui import run_files  # noqa: E402
from tests.ui_support import WebUIProcess, tiny_job_settings  # noqa: E402


def step_time(csv_path: str, steps: int, process=None, timeout: float = 1800) -> float:
    """Seconds per step between the CSV's first and last step (polled every 20 ms)."""
    first = last = None
    deadline = time.time() + timeout
    while time.time() < deadline:
        step = run_files.last_step(csv_path)
        if step >= 1 and first is None:
            first = (step, time.perf_counter())
        if step >= steps:
            last = (step, time.perf_counter())
            break
        if process is not None and process.poll() is not None and step < steps:
            raise RuntimeError(f"the run ended at step {step}")
        time.sleep(0.02)
    if last is None:
        raise RuntimeError("timed out")
    return (last[1] - first[1]) / (last[0] - first[0])


def alone(settings: dict, out: str, steps: int) -> float:
    config = os.path.join(out, "config.toml")
    os.makedirs(out, exist_ok=True)
    with open(config, "w") as f:
        toml.dump({**settings, "output_dir": out}, f)
    with open(os.path.join(out, "train.log"), "w") as log:
        process = subprocess.Popen([sys.executable, os.path.join(ROOT, "train_lora.py"), "--config_file", config],
                                   cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    seconds = step_time(os.path.join(out, f"{settings['output_name']}_log.csv"), steps, process)
    process.wait()
    return seconds


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def watched(server: WebUIProcess, settings: dict, steps: int) -> tuple[float, float, float]:
    """(seconds per step, the UI process's CPU seconds per wall second, the watching client's)."""
    client = server.client()
    answer = client.predict("bench", toml.dumps(settings), *[None] * 11, api_name="/create_and_queue")[0]
    stop = threading.Event()

    def watch():
        viewer = server.client()
        while not stop.is_set():
            viewer.predict(str(answer["job_id"]), api_name="/live")
            viewer.predict(api_name="/list_jobs")
            stop.wait(2.0)  # library.ui.app.REFRESH_SECONDS

    thread = threading.Thread(target=watch, daemon=True)
    ui_cpu, client_cpu, wall = cpu_seconds(server.process.pid), time.process_time(), time.perf_counter()
    thread.start()
    try:
        seconds = step_time(os.path.join(answer["output_dir"], f"{settings['output_name']}_log.csv"), steps)
    finally:
        stop.set()
        thread.join()
    wall = time.perf_counter() - wall
    return seconds, (cpu_seconds(server.process.pid) - ui_cpu) / wall, (time.process_time() - client_cpu) / wall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    from tools.make_tiny_dataset import make_tiny_dataset
    from tools.make_tiny_models import make_tiny_models

    with tempfile.TemporaryDirectory() as tmp:
        tiny = make_tiny_models(os.path.join(tmp, "models"))
        tiny.update(make_tiny_dataset(os.path.join(tmp, "dataset")))
        tiny["root"] = tmp
        settings = tiny_job_settings(tiny, steps=args.steps)
        server = WebUIProcess(os.path.join(tmp, "jobs"), [tmp], os.path.join(tmp, "webui.log"))
        times = {"alone": [], "watched": [], "ui": [], "client": []}
        try:
            for r in range(args.repeats):
                times["alone"].append(alone(settings, os.path.join(tmp, f"alone{r}"), args.steps))
                seconds, ui, client = watched(server, settings, args.steps)
                times["watched"].append(seconds)
                times["ui"].append(ui)
                times["client"].append(client)
                print(f"run {r}: alone {times['alone'][-1] * 1000:.1f} ms/step, watched {seconds * 1000:.1f} ms/step; "
                      f"while watched the UI process used {ui * 100:.1f}% of one core, the watching client "
                      f"{client * 100:.1f}% (with the CSV poller both runs have)", flush=True)
        finally:
            server.stop()
    a, w = statistics.median(times["alone"]), statistics.median(times["watched"])
    print(f"SUMMARY: median over {args.repeats}: alone {a * 1000:.1f} ms/step, watched by the UI {w * 1000:.1f} ms/step, "
          f"ratio watched/alone {w / a:.3f}; the UI process's CPU while watched {statistics.median(times['ui']) * 100:.1f}% "
          f"of one core")


if __name__ == "__main__":
    main()
