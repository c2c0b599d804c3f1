"""Block swap (sd-scripts / musubi-tuner `blocks_to_swap`): the frozen weights of the last N
transformer blocks live in (pinned) CPU memory and are copied to the device just before each use.

One step, for blocks s..n-1 swapped and a prefetch depth p (default 1: at most p + 1 swapped blocks
on the device at any time):
  forward   before block i: wait for i's copy, start copying i+1 .. i+p (a side CUDA stream, so the
            copies overlap the compute of block i and of the blocks before it: with p > 1 the first
            swapped blocks start coming in while the resident ones run); after block i: release i.
  backward  an identity autograd node at block i's outputs fires before block i's backward (and
            before its checkpoint recompute): release i+1, wait for i, start copying i-1 .. i-p.
            Whatever is still resident when backward ends is released by an engine callback.
  the turn  a forward that builds a graph keeps its last p blocks (the backward's first) instead of
            releasing them to copy them straight back (a 20B model's block is 330 MB: 6.5 ms of PCIe
            at 50 GB/s that nothing hides); they count within the p + 1 on the device. A forward that
            starts before a backward took them (a graph never backpropagated) releases them first.
A deeper prefetch hides the copies of large blocks behind more compute, for p - 1 more
blocks of device memory (tools/plan_memory.py counts them).
Only frozen tensors move (base parameters and buffers: bf16 weights, fp8 codes and scales); the
LoRA lives outside the block tree (it patches forwards), so it and its optimizer state never move.

"Release" swaps each tensor's storage for an empty placeholder (`tensor.data = ...`, the same
tensor object, so autograd's saved references see the reload before backward: no stale or
resident copies). Any use of a released block fails loudly on the empty shape, never silently.

Everything observable on CPU: `log` records ("load", i) / ("release", i) in order (the last LOG_RECORDS:
a run adds 4 a swapped block a step: ~0.5 GB over 100k steps of 20 blocks if all were kept), and on CPU a
"load" makes a fresh copy of the home tensor, so residency is real there too.
"""

from __future__ import annotations

import collections
import contextlib

import torch
import torch.nn as nn


LOG_RECORDS = 4096


class _BeforeBackward(torch.autograd.Function):
    """Identity on one output of a block; its backward runs before the block's own backward.
    One node per output (not one joining them): an output the loss never uses stays unreachable
    in backward, exactly as without the swap (a joint node would send zero grads down its path)."""

    @staticmethod
    def forward(ctx, swap, index, output):
        ctx.swap, ctx.index = swap, index
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad):
        ctx.swap.enter_backward(ctx.index)
        return None, None, grad


def _frozen_tensors(block: nn.Module) -> list[tuple[nn.Module, str]]:
    """(module, attribute) of every frozen parameter and buffer of the block."""
    found = []
    for module in block.modules():
        for name, p in module._parameters.items():
            if p is not None:
                if p.requires_grad:
                    raise ValueError(f"block swap moves frozen tensors only; '{name}' of {type(module).__name__} "
                                     f"requires grad (train LoRA on a frozen base)")
                found.append((module, name))
        found += [(module, name) for name, b in module._buffers.items() if b is not None]
    return found


def check_swap_count(blocks_to_swap: int, blocks: int, key: str = "blocks_to_swap") -> None:
    """At least one block stays resident (it runs while the first swapped one is copied in). key: the
    setting's name in the message (generate.py's flag is --blocks_to_swap)."""
    if not 0 < blocks_to_swap < blocks:
        raise ValueError(f"{key} must be between 1 and {blocks - 1} for this model ({blocks} blocks), "
                         f"got {blocks_to_swap}")


class BlockSwap:
    """Swaps blocks[first:] of a model whose blocks run in list order (see module docstring)."""

    def __init__(self, blocks: list[nn.Module], blocks_to_swap: int, device: torch.device | str, prefetch: int = 1):
        n = len(blocks)
        check_swap_count(blocks_to_swap, n)
        if prefetch < 1:
            raise ValueError(f"block_swap_prefetch must be >= 1, got {prefetch}")
        self.device, self.prefetch = torch.device(device), prefetch
        self.first, self.last = n - blocks_to_swap, n - 1
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.tensors = {i: _frozen_tensors(blocks[i]) for i in range(self.first, n)}
        self.homes: dict[int, list[torch.Tensor]] = {}
        self.pending: dict[int, tuple] = {}  # index -> (copy-done event or None, device tensors)
        self.resident: set[int] = set()
        self.kept: set[int] = set()  # the last blocks, held from the forward for the backward (the turn)
        self.in_backward = False
        self.log: collections.deque[tuple[str, int]] = collections.deque(maxlen=LOG_RECORDS)
        for i, refs in self.tensors.items():  # move each tensor home: pinned CPU, placeholder in the model
            homes = []
            for module, name in refs:
                t = getattr(module, name)
                home = t.detach().to("cpu", copy=True)
                homes.append(home.pin_memory() if self.cuda else home)
                # A new tensor object, not `t.data = ...`: t may be a view (fp8 codes are reshaped
                # from [out, in / 64, 64]) whose base would keep the whole storage on the device.
                if name in module._parameters:
                    module._parameters[name] = nn.Parameter(self._placeholder(t), requires_grad=False)
                else:
                    module._buffers[name] = self._placeholder(t)
            self.homes[i] = homes

    def _placeholder(self, t: torch.Tensor) -> torch.Tensor:
        return torch.empty(0, dtype=t.dtype, device=self.device)

    def swapped(self, i: int) -> bool:
        return i >= self.first and i in self.tensors

    # -- transfers ----------------------------------------------------------------------------
    def _start_load(self, i: int):
        if not self.swapped(i) or i in self.resident or i in self.pending:
            return
        self.log.append(("load", i))
        if self.cuda:
            with torch.cuda.stream(self.stream):
                copies = [h.to(self.device, non_blocking=True) for h in self.homes[i]]
                done = torch.cuda.Event()
                done.record(self.stream)
            self.pending[i] = (done, copies)
        else:
            self.pending[i] = (None, [h.clone() for h in self.homes[i]])

    def _wait(self, i: int):
        if not self.swapped(i) or i in self.resident:
            return
        self._start_load(i)
        done, copies = self.pending.pop(i)
        if done is not None:
            main = torch.cuda.current_stream(self.device)
            main.wait_event(done)
            for c in copies:  # allocated on the side stream, used (and freed) on the main one
                c.record_stream(main)
        for (module, name), c in zip(self.tensors[i], copies):
            getattr(module, name).data = c
        self.resident.add(i)

    def _release(self, i: int):
        self.kept.discard(i)
        if i in self.pending:  # a prefetch that was never used
            self._wait(i)
        if i not in self.resident:
            return
        for module, name in self.tensors[i]:
            t = getattr(module, name)
            t.data = self._placeholder(t)
        self.resident.discard(i)
        self.log.append(("release", i))

    @contextlib.contextmanager
    def held(self, i: int):
        """Block i resident for the with-block, released after it (a swapped block; others stay as they are):
        for callers that run the blocks themselves, one at a time (text_encoders.OneAtATime)."""
        self._wait(i)
        try:
            yield
        finally:
            if self.swapped(i):
                self._release(i)

    def release_all(self):
        for i in sorted(self.resident | set(self.pending)):
            self._release(i)

    def restore(self):
        """Put every swapped block back on the device for good; the swap does nothing afterwards."""
        self.release_all()
        for i, refs in self.tensors.items():
            for (module, name), home in zip(refs, self.homes[i]):
                getattr(module, name).data = home.to(self.device)
        self.tensors, self.homes = {}, {}

    # -- the schedule -------------------------------------------------------------------------
    def before_forward(self, i: int):
        """Called for every block index before the block runs: block i resident, i+1 .. i+p on their way."""
        if i == 0 and self.kept and not self.in_backward:  # a new forward: no backward took the kept ones
            for j in sorted(self.kept):
                self._release(j)
        self._wait(i)
        self._prefetch_after(i)

    def skip(self, i: int):
        """Block i does not run in this forward (a stream without tokens): a prefetch of it is released and
        the blocks after it start on their way, as after it ran."""
        self._release(i)
        self._prefetch_after(i)

    def _prefetch_after(self, i: int):
        for j in range(i + 1, i + 1 + self.prefetch):
            self._start_load(j)

    def after_forward(self, i: int, out):
        """Called with block i's outputs; returns them (wrapped for backward when they need it)."""
        if not self.swapped(i):
            return out
        if torch.is_grad_enabled():
            outs = tuple(_BeforeBackward.apply(self, i, o) if o.requires_grad else o
                         for o in (out if isinstance(out, tuple) else (out,)))
            out = outs if isinstance(out, tuple) else outs[0]
            if i > self.last - self.prefetch and any(o.requires_grad for o in outs):  # the backward's first: kept
                self.kept.add(i)
                return out
        self._release(i)
        return out

    def enter_backward(self, i: int):
        if not self.in_backward:
            self.in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        for j in sorted(self.resident | set(self.pending), reverse=True):
            if j > i:  # backward runs blocks in reverse: everything after i is done
                self._release(j)
        self._wait(i)
        for j in range(i - 1, i - 1 - self.prefetch, -1):
            self._start_load(j)

    def _end_backward(self):
        self.in_backward = False
        self.release_all()


def enable_block_swap(model: nn.Module, blocks_to_swap: int, device, prefetch: int = 1) -> BlockSwap | None:
    """Swap the last `blocks_to_swap` blocks of `model` (its `swappable_blocks()` in run order), copying
    `prefetch` of them ahead of use. Call before moving the model to the device: swapped weights then
    never touch it whole."""
    if getattr(model, "block_swap", None) is not None:
        model.block_swap.restore()
    if not blocks_to_swap:
        model.block_swap = None
        return None
    model.block_swap = BlockSwap(list(model.swappable_blocks()), blocks_to_swap, device, prefetch)
    return model.block_swap
