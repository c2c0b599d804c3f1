"""Start-up time of every command line: `--help` and a bad flag, per script, in a fresh process.

Both should answer before torch / diffusers / transformers load (seconds on a shared CPU). The
scripts are train_lora.py and every tools/*.py that parses a command line; each runs as a user
runs it (`python SCRIPT --help`, `python SCRIPT --no_such_flag`), best wall time of --reps runs,
with its exit status (0 and 2 expected). Prints a table and a SUMMARY line; add them to
bench/RESULTS.md.

    python bench/bench_cli_startup.py [--reps 3] [--scripts train_lora.py,tools/merge_lora.py]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tools.cli import command_line_scripts  # noqa: E402

BAD_FLAG = "--no_such_flag"


def best_run(argv: list[str], reps: int) -> tuple[float, int]:
    """(best wall seconds, exit status) of `python argv` run from the repository root."""
    best, code = float("inf"), None
    for _ in range(reps):
        start = time.perf_counter()
        done = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True)
        best, code = min(best, time.perf_counter() - start), done.returncode
    return best, code


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--reps", type=int, default=3, help="runs per case; the best is kept")
    p.add_argument("--scripts", default=None, help="comma-separated scripts (default: all with a command line)")
    args = p.parse_args(argv)
    scripts = args.scripts.split(",") if args.scripts else command_line_scripts()
    baseline, _ = best_run(["-c", "pass"], args.reps)
    print(f"python -c pass: {baseline:.2f} s (best of {args.reps})")
    print(f"{'script':32s} {'--help s':>9s} {'exit':>5s} {BAD_FLAG + ' s':>18s} {'exit':>5s}")
    worst = 0.0
    for script in scripts:
        help_s, help_code = best_run([script, "--help"], args.reps)
        bad_s, bad_code = best_run([script, BAD_FLAG], args.reps)
        worst = max(worst, help_s, bad_s)
        print(f"{script:32s} {help_s:9.2f} {help_code:5d} {bad_s:18.2f} {bad_code:5d}")
    print(f"SUMMARY: {len(scripts)} scripts, slowest --help / bad flag {worst:.2f} s (best of {args.reps}; "
          f"bare python {baseline:.2f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
