"""Plot learning rate (lr and the effective d*lr of Prodigy-style optimizers) and loss of one or
more training runs from their CSV logs.

    python tools/plot_lr.py out/run_a out/run_b/lora_log.csv --out lr.png [--log] [--smooth 0.9]

A run is a `*_log.csv` file; a folder stands for every one it holds. Top panel: every lr/<group> and
d*lr/<group> column against step, runs overlaid and labelled by run name. Bottom panel: loss,
raw (faint) and exponentially smoothed, and val_loss (dots, at the steps it was measured) where
the log has it. Prints a summary line per run. A log that cannot be read (or a cell that is not a
number) is one `error: ...` line naming the file, line and column, exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The drawing is library's (train_lora.py draws its run too); that module loads no torch until it draws.
from library.errors import exit_without_collecting  # noqa: E402
from tools.cli import Parser, check_png_out  # noqa: E402
from library.training.lr_plot import find_logs, plot_runs  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="CSV logs or folders holding *_log.csv")
    p.add_argument("--out", default="lr_plot.png", help="PNG to write")
    p.add_argument("--log", action="store_true", help="log-scale y axes")
    p.add_argument("--smooth", type=float, default=0.9, help="EMA factor for the smoothed loss")
    return p


def check_out(out: str, runs: list[str]) -> None:
    """--out is a .png file that is none of the logs, checked before anything is read or drawn: a log
    named as --out was replaced by the PNG; a folder failed after the drawing, naming a temporary file."""
    check_png_out(out)
    if os.path.exists(out) and any(os.path.samefile(out, log) for run in runs for log in find_logs(run)):
        raise ValueError(f"--out {out}: is one of the logs read; write the plot elsewhere")


def main(argv=None) -> list[str]:
    try:
        args = build_parser().parse_args(argv)
        check_out(args.out, args.runs)
        if not 0 <= args.smooth < 1:  # 90 (a percent) drew a "smoothed" loss of 1e34
            raise ValueError(f"--smooth {args.smooth}: expected an EMA factor in [0, 1) (0.9 keeps 90% of the last value)")
        return plot_runs(args.runs, args.out, args.log, args.smooth)
    except (ValueError, OSError) as e:  # bad input: one line, exit status 2, no plot written
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    exit_without_collecting(main)
