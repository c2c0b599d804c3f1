"""bench/trace_overlap.py's interval arithmetic on a hand-made chrome trace: which copy time ran under
compute kernels and which compute-idle time waited on a copy or on the host (the block-swap timeline
reading of bench_block_swap.py --trace)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

from trace_overlap import complement, intersect, merge, overlap  # noqa: E402


def _ev(cat, ts, dur, stream, name="k"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": stream, "args": {"stream": stream}}


def test_merge_intersect_complement():
    assert merge([(5, 7), (0, 2), (1, 3)]) == [(0, 3), (5, 7)]
    assert intersect([(0, 3), (5, 7)], [(2, 6)]) == [(2, 3), (5, 6)]
    assert complement([(0, 3), (5, 7)], 0, 10) == [(3, 5), (7, 10)]


def test_copies_hidden_and_idle_split():
    events = [_ev("kernel", 0, 10, 7), _ev("kernel", 12, 8, 7), _ev("kernel", 30, 10, 7),
              _ev("kernel", 1, 1, 20),  # a small kernel on the copy stream: not the compute stream
              _ev("gpu_memcpy", 5, 10, 20, "Memcpy HtoD (Pinned -> Device)"),
              _ev("gpu_memcpy", 22, 6, 20, "Memcpy HtoD (Pinned -> Device)"),
              _ev("gpu_memcpy", 40, 5, 7, "Memcpy DtoH (Device -> Pinned)"),  # not a host-to-device copy
              {"ph": "i", "cat": "kernel", "ts": 3}]
    o = overlap({"traceEvents": events}, n_gaps=2)
    assert (o.window, o.compute_busy, o.copy_total) == (40, 28, 16)
    assert o.copy_hidden == 8  # [5, 10] + [12, 15]
    assert (o.idle_copying, o.idle_empty) == (8, 4)  # idle [10, 12] + [20, 30]; copies cover 2 + 6
    assert o.gaps == [(20, 10, "copy"), (10, 2, "copy")]


def test_no_kernels_is_refused():
    with pytest.raises(ValueError, match="no CUDA kernels"):
        overlap({"traceEvents": [_ev("cpu_op", 0, 5, 1)]})
