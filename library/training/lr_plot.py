"""Learning rate (lr and the effective d*lr of Prodigy-style optimizers) and loss of one or more
training runs, read from their CSV logs and drawn into one PNG: train_lora.py draws its own run's
at the end, tools/plot_lr.py is the command line over it.

A run is a `*_log.csv` file; a folder stands for every one it holds. Top panel: every lr/<group> and
d*lr/<group> column against step, runs overlaid and labelled by run name. Bottom panel: loss,
raw (faint) and exponentially smoothed, and val_loss (dots, at the steps it was measured) where
the log has it. A summary line per run is printed.
"""

from __future__ import annotations

import csv
import glob
import io
import math
import os
import statistics

from library.text_files import read_utf8

# library.io and matplotlib (seconds to load) are imported in plot(), so tools/plot_lr.py answers
# --help and a bad flag at once.


def find_logs(path: str) -> list[str]:
    """The file itself, or every *_log.csv in the folder (one per output_name written there)."""
    if os.path.isfile(path):
        return [path]
    logs = sorted(glob.glob(os.path.join(glob.escape(path), "*_log.csv")))
    if not logs:
        raise ValueError(f"{path}: no *_log.csv file found")
    return logs


def read_log(path: str) -> dict[str, list[float]]:
    """Columns of a training log as floats (an empty cell is nan); a cell that is not a number is a
    ValueError naming the file, its line and the column."""
    reader = csv.DictReader(io.StringIO(read_utf8(path, "training log")))  # bytes that are not UTF-8: named
    rows = [(reader.line_num, row) for row in reader]
    if not rows or "step" not in rows[0][1] or "loss" not in rows[0][1]:
        raise ValueError(f"{path}: not a training log (needs step and loss columns)")
    cols: dict[str, list[float]] = {k: [] for k in rows[0][1]}
    for line, row in rows:
        for k in cols:
            try:
                cols[k].append(float(row[k]) if row[k] not in ("", None) else math.nan)
            except ValueError:
                raise ValueError(f"{path}: line {line}, column '{k}': {row[k]!r} is not a number") from None
    return cols


def run_name(log_path: str) -> str:
    """'run_a/lora' for run_a/lora_log.csv: the run folder and the log's output name."""
    return os.path.basename(os.path.dirname(os.path.abspath(log_path))) + "/" + os.path.basename(log_path)[: -len("_log.csv")]


def run_names(logs: list[str]) -> list[str]:
    """Each log's run_name; where runs share one (run folders of one name in two places), their paths
    instead, numbered if still equal (one log given twice): no run replaces another in the plot."""
    short = [run_name(p) for p in logs]
    names = [n if short.count(n) == 1 else os.path.relpath(p)[: -len("_log.csv")] for n, p in zip(short, logs)]
    return [n if names.count(n) == 1 else f"{n} ({names[: i + 1].count(n)})" for i, n in enumerate(names)]


def smooth(values: list[float], beta: float) -> list[float]:
    out, avg = [], None
    for v in values:
        if math.isnan(v):
            out.append(math.nan)
            continue
        avg = v if avg is None else beta * avg + (1 - beta) * v
        out.append(avg)
    return out


def summarize(name: str, log: dict[str, list[float]]) -> list[str]:
    lines = []
    for col in log:
        if col.startswith(("lr/", "d*lr/")):
            vals = log[col]
            peak = max(range(len(vals)), key=lambda i: vals[i])
            lines.append(
                f"{name}: {col}: peak {vals[peak]:.4g} at step {int(log['step'][peak])}, final {vals[-1]:.4g}"
            )
    loss = log["loss"]
    lines.append(f"{name}: loss first {loss[0]:.4f}, last {loss[-1]:.4f}, steps {int(log['step'][-1])}")
    _, seconds = measured(log, "step_s")
    _, waits = measured(log, "data_wait_s")
    if seconds and len(waits) == len(seconds) and sum(seconds) > 0:
        lines.append(f"{name}: {statistics.median(seconds):.3g} s per step (median), waiting for data "
                     f"{sum(waits) / sum(seconds):.1%} of the steps' time")
    steps, vals = measured(log, "val_loss")
    if vals:
        lines.append(f"{name}: val_loss first {vals[0]:.4f} (step {int(steps[0])}), last {vals[-1]:.4f} "
                     f"(step {int(steps[-1])}), {len(vals)} validations")
    return lines


def measured(log: dict[str, list[float]], col: str) -> tuple[list[float], list[float]]:
    """(steps, values) of a column on the steps where it holds a value (val_loss is empty between
    validations)."""
    pairs = [(s, v) for s, v in zip(log["step"], log.get(col, [])) if not math.isnan(v)]
    return [s for s, _ in pairs], [v for _, v in pairs]


def plot(runs: dict[str, dict[str, list[float]]], out: str, log_scale: bool, beta: float) -> dict[str, list[float]]:
    """Write the PNG; returns each drawn line's label -> its y values (what the figure shows), with
    "y scales" (each axis's label -> linear / log) and "effective step axis" (the labels drawn there)."""
    import matplotlib

    from library.io import atomic_path

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_lr, ax_loss) = plt.subplots(2, 1, figsize=(10, 8), sharex=True)
    # Prodigy-style runs: lr (often 1.0) and the effective d*lr differ by orders of magnitude, so
    # lr goes on its own right-hand axis and the effective step gets the main one.
    adaptive = any(c.startswith("d*lr/") for log in runs.values() for c in log)
    ax_base = ax_lr.twinx() if adaptive else ax_lr
    for name, log in runs.items():
        own_step = not any(c.startswith("d*lr/") for c in log)  # AdamW & co: the lr is the step itself
        for col in log:
            if col.startswith("d*lr/"):
                ax_lr.plot(log["step"], log[col], "-", label=f"{name} {col}")
            elif col.startswith("lr/") and adaptive and own_step:
                # beside a Prodigy run the lr is this run's effective step: on that axis, where the two
                # compare (on the base-lr axis a 1e-3 schedule was a flat line at 0 under Prodigy's 1.0)
                ax_lr.plot(log["step"], log[col], "-", label=f"{name} {col} (its effective step)")
            elif col.startswith("lr/"):
                ax_base.plot(log["step"], log[col], "--", alpha=0.6, label=f"{name} {col}")
        line = ax_loss.plot(log["step"], log["loss"], alpha=0.25)[0]
        ax_loss.plot(log["step"], smooth(log["loss"], beta), color=line.get_color(), label=f"{name} (smoothed)")
        steps, vals = measured(log, "val_loss")
        if vals:
            ax_loss.plot(steps, vals, "o--", color=line.get_color(), markersize=4, label=f"{name} val_loss")
    if adaptive:
        ax_lr.set_ylabel("effective step: d*lr, or a plain lr (solid)")
        ax_base.set_ylabel("base lr (dashed)")
        ax_base.legend(fontsize=8, loc="lower right")
    else:
        ax_lr.set_ylabel("learning rate")
    ax_loss.set_ylabel("loss")
    ax_loss.set_xlabel("optimizer step")
    if log_scale:  # every y axis (the base-lr twin was left linear)
        for ax in {ax_lr, ax_base, ax_loss}:
            ax.set_yscale("log")
    for ax in (ax_lr, ax_loss):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    # Fixed margins that hold 8-character tick labels and the axis labels: tight_layout measures them
    # with a draw of its own, a third of the plot's time (0.55 -> 0.37 s), paid at the end of every run.
    fig.subplots_adjust(left=0.1, right=0.92 if adaptive else 0.975, bottom=0.065, top=0.98, hspace=0.06)
    with atomic_path(out) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    drawn = {line.get_label(): [float(y) for y in line.get_ydata()] for ax in fig.axes for line in ax.get_lines()}
    drawn["y scales"] = {ax.get_ylabel(): ax.get_yscale() for ax in fig.axes}
    drawn["effective step axis"] = [line.get_label() for line in ax_lr.get_lines()]
    plt.close(fig)
    return drawn


def plot_runs(paths: list[str], out: str, log_scale: bool = False, beta: float = 0.9) -> list[str]:
    """Draw the runs (CSV logs or folders holding one) into the PNG `out`, named <folder>/<log stem>;
    prints and returns the summary lines. A log that cannot be read is a ValueError / OSError naming
    it, raised before anything is drawn."""
    logs = [log for path in paths for log in find_logs(path)]
    runs = {name: read_log(log) for name, log in zip(run_names(logs), logs)}
    plot(runs, out, log_scale, beta)
    lines = [line for name, log in runs.items() for line in summarize(name, log)]
    print("\n".join(lines))
    print(f"wrote {out}")
    return lines
