"""What a run has written so far, read without torch: the CSV log's rows, the log's tail and its
progress bar, the samples by step, the state's step, and the trainer process's memory."""

from __future__ import annotations

import csv
import glob
import json
import math
import os
import re
from dataclasses import dataclass

from library.data.prompts import SAMPLE_NAME, prompt_texts

TQDM = re.compile(r"(\d+)/(\d+) \[([0-9:]+)<([0-9:?]+)")
BAR_THEN_TEXT = re.compile(r"(\d+/\d+ \[[^\]\n]*\])(?=\S)")
RUN_START = "\n$ "  # library/ui/runner.py writes "$ <command>" on a line of its own before each launch


def read_tail(path: str, size: int = 65536) -> str:
    """The last `size` bytes of a text file ("" if there is none), as text."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - size))
            return f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


def this_run(text: str) -> str:
    """Of a log's tail, what its latest run wrote: from the command line the runner writes before each
    launch (a resumed job appends to its log: the run before it said "stopped at step N" too)."""
    start = text.rfind(RUN_START)
    return text if start < 0 else text[start + 1:]


def log_lines(path: str, count: int = 40, latest_run: bool = False) -> list[str]:
    """The log's last lines (latest_run: only its latest run's); tqdm's redrawn bar (carriage returns)
    counts once, as its last state."""
    lines: list[str] = []
    tail = read_tail(path)
    text = BAR_THEN_TEXT.sub("\\1\n", this_run(tail) if latest_run else tail)  # a message right after the bar: its line
    for line in text.replace("\r", "\n").split("\n"):
        line = line.rstrip()
        if not line:
            continue
        if lines and TQDM.search(line) and TQDM.search(lines[-1]):
            lines[-1] = line
        else:
            lines.append(line)
    return lines[-count:]


@dataclass
class Progress:
    step: int
    total: int | None
    elapsed: str = ""
    remaining: str = ""


def progress(log_path: str, last_step: int, max_steps: int | None) -> Progress:
    """Steps done and planned, with tqdm's elapsed and remaining time from the log when it has them."""
    bars = TQDM.findall(this_run(read_tail(log_path, 8192)))  # (a resumed run's bar, not the run's before)
    if bars:
        done, total, elapsed, remaining = bars[-1]
        return Progress(int(done), int(total), elapsed, remaining)
    return Progress(last_step, max_steps)


def read_rows(csv_path: str, columns: tuple[str, ...] | None = None) -> list[dict[str, float | None]]:
    """The CSV log's rows as numbers (an empty cell, e.g. val_loss between validations: None); a
    half-written last row is left out. columns: only these, of the rows that have them as numbers
    (an LLM's eval CSV also holds a text sample, and a "start" / "final" step)."""
    try:
        with open(csv_path, newline="") as f:
            rows = list(csv.reader(f))
    except OSError:
        return []
    if not rows:
        return []
    header, out = rows[0], []
    for row in rows[1:]:
        if len(row) != len(header):
            continue
        try:
            out.append({k: (float(v) if v != "" else None) for k, v in zip(header, row)
                        if columns is None or k in columns})
        except ValueError:
            continue
    return out


def last_step(csv_path: str) -> int:
    """The last step the CSV log has (0: none), reading only its head and tail."""
    try:
        with open(csv_path, newline="") as f:
            header = f.readline().strip().split(",")
    except OSError:
        return 0
    if "step" not in header:
        return 0
    column = header.index("step")
    for line in reversed(read_tail(csv_path, 4096).split("\n")[:-1]):  # after the last newline: a row cut short
        cells = line.split(",")
        if len(cells) == len(header) and cells[column].isdigit():
            return int(cells[column])
    return 0


def state_step(state_dir: str) -> int | None:
    """The step a saved state resumes at (None: no readable state)."""
    try:
        with open(os.path.join(state_dir, "train_state.json")) as f:
            return int(json.load(f)["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


@dataclass
class Sample:
    path: str
    tag: str  # start, step000060, epoch0001, final
    step: int | None  # None for start / final: their step is the run's first / last
    index: int  # the prompt's line
    stamp: str  # when it was rendered (YYYYmmddHHMMSS; "" in names written before the stamp)


def samples(output_dir: str, output_name: str) -> list[Sample]:
    """The sample PNGs (library/data/prompts.py SAMPLE_NAME), in the order they were rendered: by
    tag, then by time (a resumed run's renders of a step after the killed run's), then prompt."""
    found = []
    for path in glob.glob(os.path.join(glob.escape(output_dir), glob.escape(output_name) + "_*.png")):
        match = SAMPLE_NAME.fullmatch(path[len(os.path.join(output_dir, output_name)):])
        if not match:
            continue  # the LR plot (<name>_lr.png)
        tag = match.group(1)
        step = int(match.group(2)) if match.group(2) else None
        found.append(Sample(path, tag, step, int(match.group(4)), match.group(5) or ""))
    order = {"start": -1, "final": 10**12}
    return sorted(found, key=lambda s: (order.get(s.tag, s.step if s.step is not None else 0), s.stamp, s.index))


def saves(output_dir: str, output_name: str) -> list[str]:
    """The run's LoRA saves, <name>-stepNNNNNN and the final <name> (files, or PEFT adapter folders), in step order,
    the final last; its EMA saves (<name>..._ema) are not among them."""
    pattern = re.compile(re.escape(output_name) + r"(-step(\d+))?(\.safetensors)?")
    found = []
    for entry in os.listdir(output_dir) if os.path.isdir(output_dir) else []:
        match = pattern.fullmatch(entry)
        if match and (match.group(3) or os.path.isdir(os.path.join(output_dir, entry))):
            found.append((int(match.group(2)) if match.group(2) else math.inf, os.path.join(output_dir, entry)))
    return [path for _, path in sorted(found)]


def prompts(path: str | None) -> list[str]:
    """The sample prompts' texts as the samples number them (library/data/prompts.py prompt_texts: a
    text file's lines, a .json / .toml file's prompt entries); [] for a file that cannot be read."""
    if not path:
        return []
    try:
        return prompt_texts(path)
    except (OSError, ValueError):  # (JSON's and TOML's errors are ValueErrors)
        return []


def peak_rss(pid: int) -> int:
    """The process's peak resident memory in bytes (the kernel's VmHWM: a true peak, not a sample)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def process_started(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (None: no such process, or a zombie):
    with the pid it names one process, even after the pid is reused."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] == "Z":  # exited, not yet reaped
        return None
    return int(fields[19])
