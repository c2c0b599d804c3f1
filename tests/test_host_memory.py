"""library/training/host_memory.py: with the mmap threshold pinned, a CPU step's freed buffers leave
the process (RSS follows the live tensors); glibc's default keeps them in its heap. Each case runs in
a fresh interpreter (glibc's threshold moves once per process)."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest
import torch

import train_lora

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A training step's pattern after a first large block was freed: per block a temporary (4-6 MiB, freed at
# once) and an activation kept for the backward (1-2 MiB, freed at the step's end). Live at the peak:
# ~30 MiB of activations + 6.
STEPS = """
import sys, torch
sys.path.insert(0, {root!r})
from library.training.host_memory import return_freed_buffers
if {pinned}:
    assert return_freed_buffers()
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20
# glibc raises its threshold to a freed mapped block's size: after this one (as after a model's load),
# by default every step buffer below 31 MiB comes from the heap.
torch.ones(31 << 18).sum()  # 31 MiB, mapped, freed
start, peak = rss(), 0.0
for step in range(4):
    saved = []
    for block in range(20):
        temp = torch.ones((4 + block % 3) << 18)
        saved.append(torch.ones((1 + block % 2) << 18))
        del temp
    peak = max(peak, rss() - start)
    del saved
print(peak, rss() - start)
"""


def rss_growth(pinned: bool) -> tuple[float, float]:
    """(peak, after the steps) RSS growth in MiB."""
    out = subprocess.run([sys.executable, "-c", STEPS.format(root=ROOT, pinned=pinned)], capture_output=True,
                         text=True, check=True, env={**{k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")},
                                                     "OMP_NUM_THREADS": "1"}).stdout
    peak, after = map(float, out.split())
    return peak, after


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_pinned_threshold_returns_freed_step_buffers_to_the_os():
    peak, after = rss_growth(pinned=True)
    default_peak, default_after = rss_growth(pinned=False)
    assert peak < 45 and after < 8, (peak, after)  # the live tensors, then back
    assert default_after > 25, (default_peak, default_after)  # what it fixes: freed buffers kept by the heap


@pytest.mark.parametrize("device, pinned", [("cuda", True), ("cpu", False)])
def test_train_lora_pins_it_before_loading_on_a_gpu_only(monkeypatch, device, pinned):
    """On a GPU run the host only loads and caches: pinned before the models load. A CPU run keeps
    glibc's default (its steps would pay a fresh mapping per activation)."""
    calls = []
    monkeypatch.setattr(train_lora, "return_freed_buffers", lambda: calls.append(1))
    monkeypatch.setattr(train_lora, "make_accelerator", lambda args: types.SimpleNamespace(device=torch.device(device)))
    monkeypatch.setattr(train_lora, "output_lock", lambda args, accelerator: (_ for _ in ()).throw(RuntimeError("loading")))
    with pytest.raises(RuntimeError, match="loading"):
        train_lora.train(None)
    assert calls == ([1] if pinned else [])
