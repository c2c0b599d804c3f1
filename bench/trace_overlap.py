"""What a CUDA timeline says about copies and compute: read a torch.profiler chrome trace
(`prof.export_chrome_trace`) and report, per step window, how much of the host-to-device copy time
ran under compute kernels and how long the compute stream sat idle, split into idle while a copy
was in flight (waiting on the swap) and idle with nothing on the device (waiting on the host).

    python bench/trace_overlap.py trace.json [--gaps 10]

Block swap's overhead (bench_block_swap.py) is either copies the compute stream waits for (raise
the prefetch, or the copies are slower than the blocks they feed) or host work between kernels
(launches, the swap's own bookkeeping); the two need different fixes and only a timeline tells
them apart. Intervals are in microseconds, as the trace stores them.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

Interval = tuple[float, float]


@dataclass
class Overlap:
    window: float  # first device event's start to the last one's end
    compute_busy: float  # the compute stream's kernels, merged
    copy_total: float  # host-to-device copies, merged
    copy_hidden: float  # copy time under a compute kernel
    idle_copying: float  # compute stream idle while a copy runs: waiting on the swap
    idle_empty: float  # compute stream idle with no copy either: waiting on the host
    gaps: list[tuple[float, float, str]]  # the longest idle gaps: (start, length, "copy" | "host")


def merge(intervals: list[Interval]) -> list[Interval]:
    """Sorted, disjoint union of [start, end) intervals."""
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def intersect(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """Intersection of two merged interval lists."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def complement(a: list[Interval], lo: float, hi: float) -> list[Interval]:
    """[lo, hi) minus a merged interval list."""
    out, at = [], lo
    for s, e in a:
        if s > at:
            out.append((at, min(s, hi)))
        at = max(at, e)
    if at < hi:
        out.append((at, hi))
    return [(s, e) for s, e in out if e > s]


def total(a: list[Interval]) -> float:
    return sum(e - s for s, e in a)


def device_events(trace: dict) -> tuple[dict[int, list[Interval]], list[Interval]]:
    """Kernels per stream, and host-to-device copies (any stream), from a chrome trace's events."""
    kernels: dict[int, list[Interval]] = {}
    copies: list[Interval] = []
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") != "X" or "dur" not in ev:
            continue
        cat, start = ev.get("cat", ""), float(ev["ts"])
        span = (start, start + float(ev["dur"]))
        if cat == "kernel":
            stream = int(ev.get("args", {}).get("stream", ev.get("tid", 0)))
            kernels.setdefault(stream, []).append(span)
        elif cat == "gpu_memcpy" and "HtoD" in ev.get("name", ""):
            copies.append(span)
    return kernels, copies


def overlap(trace: dict, n_gaps: int = 10) -> Overlap:
    kernels, copies = device_events(trace)
    if not kernels:
        raise ValueError("the trace holds no CUDA kernels (profile with ProfilerActivity.CUDA on a GPU)")
    # the compute stream: the one with the most kernel time (the swap's copies run on a side stream)
    stream = max(kernels, key=lambda s: total(merge(kernels[s])))
    busy, copy = merge(kernels[stream]), merge(copies)
    everything = merge([iv for ivs in kernels.values() for iv in ivs] + copies)
    lo, hi = everything[0][0], everything[-1][1]
    idle = complement(busy, lo, hi)
    idle_copying = intersect(idle, copy)
    gaps = []
    for s, e in sorted(idle, key=lambda iv: iv[0] - iv[1])[:n_gaps]:
        covered = total(intersect([(s, e)], copy))
        gaps.append((s - lo, e - s, "copy" if covered > (e - s) / 2 else "host"))
    return Overlap(window=hi - lo, compute_busy=total(busy), copy_total=total(copy),
                   copy_hidden=total(intersect(copy, busy)), idle_copying=total(idle_copying),
                   idle_empty=total(idle) - total(idle_copying), gaps=gaps)


def report(o: Overlap) -> str:
    ms = 1e-3
    lines = [
        f"device window {o.window * ms:.1f} ms: compute stream busy {o.compute_busy * ms:.1f} ms "
        f"({100 * o.compute_busy / o.window:.0f}%)",
        f"host-to-device copies {o.copy_total * ms:.1f} ms, of which under compute {o.copy_hidden * ms:.1f} ms "
        f"({100 * o.copy_hidden / max(o.copy_total, 1e-9):.0f}% hidden)",
        f"compute idle {(o.idle_copying + o.idle_empty) * ms:.1f} ms: waiting on copies {o.idle_copying * ms:.1f} ms, "
        f"on the host (nothing on the device) {o.idle_empty * ms:.1f} ms",
        "longest compute-idle gaps (offset ms, length ms, what ran): "
        + ", ".join(f"{s * ms:.1f}+{n * ms:.2f} {what}" for s, n, what in o.gaps),
    ]
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("trace", help="a chrome trace JSON from torch.profiler's export_chrome_trace")
    p.add_argument("--gaps", type=int, default=10, help="how many of the longest idle gaps to list")
    args = p.parse_args(argv)
    with open(args.trace) as f:
        print(report(overlap(json.load(f), args.gaps)))


if __name__ == "__main__":
    main()
