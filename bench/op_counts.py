"""The aten ops one training step dispatches (forward + loss, backward, optimizer step), by op name.

At batch 1 an eager GPU step is bound by the host launching kernels as much as by FLOPs, so the count of
ops per step is a measure of its own, and one that no device or load changes: it depends on the code
path, not on widths or token counts. OpCounter is a TorchDispatchMode (below autograd and autocast), so it
sees every op that reaches a kernel or a view: autocast's casts, checkpointing's recompute and detaches,
the backward's and the optimizer's ops, in the thread that runs them.

bench_peers.py --count-ops runs it on ours and the peer; per_block_counts takes the difference of two
models that differ by one block, so the embedders, the loss and the optimizer's fixed part drop out.
--count-bytes runs the same at full width and the given tokens and sums the bytes each op reads and
writes: outside the GEMMs and attention, an eager GPU kernel's time is about its bytes over the memory
bandwidth, so the bytes per block compare the two sides' unfused elementwise work (norms, RoPE,
modulation, casts, residuals) on any machine.
"""

from __future__ import annotations

import collections
import contextlib

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from library.models.block_checkpoint import ATTENTION_KERNELS

PHASES = ("forward", "backward", "optimizer")
# ops that make no kernel launch on a GPU (a new view of the same storage, or metadata)
VIEWS = frozenset({"view", "_unsafe_view", "t", "transpose", "unsqueeze", "squeeze", "slice", "select", "expand",
                   "split", "split_with_sizes", "chunk", "unbind", "permute", "detach", "alias", "as_strided",
                   "view_as_real", "view_as_complex", "_conj", "unflatten", "_reshape_alias", "narrow"})


# ops whose time is FLOPs, not memory traffic: GEMMs and attention (the kernels a GPU runs near its peak)
GEMMS = frozenset({"mm", "addmm", "bmm", "baddbmm", "_scaled_mm"})


def is_compute(name: str) -> bool:
    return name in GEMMS or "attention" in name


def nbytes(value) -> int:
    """Bytes of the tensors in an op's argument or result (nested lists / tuples included)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(nbytes(v) for v in value)
    return 0


class AttentionKernels(TorchDispatchMode):
    """Which fused attention kernels ran inside it (flash, efficient, cudnn, flash_attention_for_cpu...), by
    name and call count: SDPA picks its backend per call (torch's priority, the shapes, the masks), so a
    comparison says what each side ran. str(): e.g. "cudnn x6" or "math (no fused kernel)"."""

    def __enter__(self):
        self.calls = collections.Counter()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in ATTENTION_KERNELS:  # the fused kernels the core's attention stash knows
            name = func.overloadpacket.__name__
            self.calls[name.removeprefix("_scaled_dot_product_").removesuffix("_attention")] += 1
        return func(*args, **(kwargs or {}))

    def __str__(self) -> str:
        return ", ".join(f"{k} x{n}" for k, n in sorted(self.calls.items())) or "math (no fused kernel)"


class OpCounter(TorchDispatchMode):
    """Counts each aten op by name (overload packet) under the phase set with `phase(name)`, and the
    bytes each op that is not a view reads and writes (its tensor arguments and results: the memory
    traffic of an unfused kernel, which bounds an elementwise op on a GPU)."""

    def __init__(self):
        super().__init__()
        self.counts = {name: collections.Counter() for name in PHASES}
        self.traffic = {name: collections.Counter() for name in PHASES}
        self.current = PHASES[0]

    @contextlib.contextmanager
    def phase(self, name: str):
        self.current = name
        with self:
            yield

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.counts[self.current][name] += 1
        out = func(*args, **(kwargs or {}))
        if name not in VIEWS:
            self.traffic[self.current][name] += nbytes(args) + nbytes(list((kwargs or {}).values())) + nbytes(out)
        return out


def step_counts(forward, params: list, target: torch.Tensor, autocast, measure: str = "counts"
                ) -> dict[str, collections.Counter]:
    """Op counts (measure "counts") or bytes moved per op name ("traffic") per phase of the second of two
    steps (the first creates the optimizer state). AdamW with foreach=True, the default where the
    trainers run (CUDA), so the optimizer's count does not grow with the number of parameters on the
    CPU either."""
    optimizer = torch.optim.AdamW(params, lr=1e-4, foreach=True)
    counter = OpCounter()
    for counted in (False, True):
        phase = counter.phase if counted else lambda name: contextlib.nullcontext()
        optimizer.zero_grad(set_to_none=True)
        with phase("forward"):
            with autocast():
                pred = forward()
            loss = F.mse_loss(pred.float(), target)
        with phase("backward"):
            loss.backward()
        with phase("optimizer"):
            optimizer.step()
    return getattr(counter, measure)


def difference(more: dict, fewer: dict) -> dict[str, collections.Counter]:
    """Per phase: counts of `more` minus those of `fewer` (negative entries kept)."""
    out = {}
    for name in PHASES:
        diff = collections.Counter(more[name])
        diff.subtract(fewer[name])
        out[name] = collections.Counter({k: v for k, v in diff.items() if v})
    return out


def total(counts: dict) -> collections.Counter:
    out = collections.Counter()
    for name in PHASES:
        out.update(counts[name])
    return out


def summary(label: str, counts: dict) -> str:
    """One line: the whole step's ops, those that launch a kernel, and the per-phase split."""
    every = total(counts)
    kernels = sum(v for k, v in every.items() if k not in VIEWS)
    phases = ", ".join(f"{name} {sum(counts[name].values())}" for name in PHASES)
    return f"{label}: {sum(every.values())} ops ({kernels} not views; {phases})"


def top(counts: dict, n: int = 15) -> list[str]:
    every = total(counts)
    return [f"{name} {count}" for name, count in every.most_common(n)]


def table(columns: dict[str, dict], n: int = 15) -> str:
    """The n most frequent ops of each column's whole step, side by side."""
    tops = {label: top(counts, n) for label, counts in columns.items()}
    width = max(len(s) for rows in tops.values() for s in rows + [""]) + 2
    lines = ["    " + "".join(f"{label:<{width}}" for label in tops)]
    for i in range(n):
        lines.append("    " + "".join(f"{(rows[i] if i < len(rows) else ''):<{width}}" for rows in tops.values()))
    return "\n".join(lines)
