"""Host memory that follows the live tensors (glibc).

glibc serves an allocation above its mmap threshold with its own mapping, unmapped on free; smaller
ones come from heap arenas, which keep freed blocks for reuse. The threshold starts at 128 KiB and
rises (up to 32 MiB) each time a mapped block is freed, so after a few steps a training process's
activation and per-layer dequantization buffers (MBs each at full size) live in the heap, and the
arenas' free holes grow the RSS by ~50 MB per block per step: a full-size 6 B model's CPU step
measured 10.2 GiB against 8.1 planned (bench/RESULTS.md). Pinning the threshold keeps buffers above it
mapped, so RSS falls back when they are freed. Buffers below 1 MiB (every tensor of a tiny model)
stay on the heap, where reuse is cheaper than a fresh mapping's page faults.

The price is those page faults: a mid-size DiT step on the CPU takes ~25% more CPU time pinned
(5.6 -> 7.0 s, 1 thread). train_lora.py pins it when the model runs on a GPU (the host then only
loads, caches and stages: RAM follows the tensors at no step cost); a CPU run can ask for it with
glibc's own variable, MALLOC_MMAP_THRESHOLD_=1048576 (the full-size CPU benches do).
"""

from __future__ import annotations

import ctypes
import gc

M_MMAP_THRESHOLD = -3  # mallopt parameter (malloc.h)


def return_freed_buffers(threshold: int = 1 << 20) -> bool:
    """Allocations of `threshold` bytes or more get their own mapping, unmapped on free (glibc's
    mallopt; setting it also stops the threshold's growth). False where libc has no mallopt."""
    try:
        return ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, threshold) == 1
    except (OSError, AttributeError):
        return False


def release_freed_memory() -> None:
    """Collects garbage, then hands the freed heap pages back to the kernel (glibc's malloc_trim; nothing
    elsewhere). glibc keeps the pages of freed tensors under 32 MiB (its mmap threshold grows to the largest
    freed): the VAE's conv buffers and the text encoder's activations stayed in the process after caching, beside
    the base that loads next (a 3-D VAE's two 512 px encodes on the CPU: 0.24-0.33 GiB; bench/bench_host_trim.py)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # no glibc (macOS, Windows, musl)
        pass
