"""Activation checkpointing of an eager block whose forward records no autograd graph (issue 29).

torch's non-reentrant checkpoint runs a block's forward with grad on: every op builds its autograd node
and hands each tensor it would save to a Python pack hook that drops it (about 110 a block of the
double-stream image models). Here the forward runs under no_grad, as torch's reentrant checkpoint does:
the whole block is one autograd node, whose backward reruns the forward with grad on and backpropagates
through that graph. The eager GPU step at batch 1 is bound by the host issuing work, and this is host
work saved: on one CPU thread at toy widths, where each op costs its fixed host overhead, the training
step takes x0.80-0.83 of the host time (bench/RESULTS.md). The gradients are the same bits
(tests/test_eager_checkpoint.py).

The recompute runs under the forward's autocast state and RNG state (LoRA's dropouts draw the same), and
in the checkpointed call's recompute context (block_checkpoint._checkpoint_contexts: kept projections /
attention), which knows its graph is the one backward runs (block_checkpoint.recompute_graph).

Where it cannot serve, core.run_block keeps torch's non-reentrant checkpoint: in a process group (DDP
with find_unused_parameters, our multi-process runs, finds no parameter of the block in the forward's
graph, marks them unused and refuses the gradients the nested backward then delivers; FSDP2's unshard
and reduce hooks are not checked with it) and inside torch.compile (compile_block's regions). torch.autograd.grad
with `inputs` cannot reach through the nested backward either; the trainer calls backward().
"""

from __future__ import annotations

import contextlib
import types

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten
from torch.utils.checkpoint import get_device_states, set_device_states


def usable() -> bool:
    """Whether run_block may checkpoint through checkpoint_block: one process, not in a process group."""
    return not (dist.is_available() and dist.is_initialized())


def checkpoint_block(block, contexts: tuple, args: tuple, kwargs: dict):
    """block(*args, **kwargs), checkpointed: nothing of the forward kept but its inputs (and what the
    forward context stashes), the forward rerun in backward. contexts: (forward, recompute) context
    managers of this call, each entered once."""
    leaves, spec = tree_flatten((args, kwargs))
    if not any(isinstance(t, torch.Tensor) and t.requires_grad for t in leaves):
        # only the block's own weights train (the first adapted block): an input that requires grad
        # puts the node in the graph, or autograd would never call its backward
        leaves.append(torch.empty((), requires_grad=True))
    out_spec = []
    outs = _BlockCheckpoint.apply(block, contexts, spec, out_spec, *leaves)
    return tree_unflatten(list(outs), out_spec[0])


class _BlockCheckpoint(torch.autograd.Function):
    """The block as one node: forward under no_grad, backward = recompute with grad on + backward through it."""

    @staticmethod
    def forward(ctx, block, contexts, spec, out_spec, *leaves):
        # Function.forward runs under no_grad: the block records nothing
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        ctx.block, ctx.recompute, ctx.spec = block, contexts[1], spec
        ctx.leaves = [None if isinstance(t, torch.Tensor) else t for t in leaves]  # tensors: saved below
        ctx.tensor_at = [isinstance(t, torch.Tensor) for t in leaves]
        ctx.save_for_backward(*tensors)  # the inputs themselves (an in-place write to one fails backward)
        ctx.set_materialize_grads(False)  # an output the loss never reads gets None, not zeros: its path
        # is not backpropagated, so the LoRAs that feed only it get no gradient (None, as without this)
        ctx.autocast = _autocast_state(tensors)
        ctx.cpu_rng = torch.get_rng_state()
        ctx.devices, ctx.device_rng = get_device_states(*tensors)
        args, kwargs = tree_unflatten(list(leaves[: spec.num_leaves]), spec)
        with contexts[0]:
            out = block(*args, **kwargs)
        outs, done = tree_flatten(out)
        out_spec.append(done)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        saved = iter(ctx.saved_tensors)
        inputs = [next(saved).detach().requires_grad_(need) if is_tensor else t
                  for t, is_tensor, need in zip(ctx.leaves, ctx.tensor_at, ctx.needs_input_grad[4:])]
        args, kwargs = tree_unflatten(inputs[: ctx.spec.num_leaves], ctx.spec)
        device_type = _device_type(ctx.devices)
        with torch.random.fork_rng(ctx.devices, device_type=device_type), contextlib.ExitStack() as stack:
            torch.set_rng_state(ctx.cpu_rng)
            if ctx.devices:
                set_device_states(ctx.devices, ctx.device_rng, device_type=device_type)
            stack.enter_context(torch.enable_grad())
            for kind, (enabled, dtype, cache) in ctx.autocast.items():
                stack.enter_context(torch.autocast(kind, dtype=dtype, enabled=enabled, cache_enabled=cache))
            stack.enter_context(ctx.recompute)
            outs = tree_leaves(ctx.block(*args, **kwargs))
        pairs = [(o, g) for o, g in zip(outs, grads)
                 if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None, None, None,
                *(t.grad if isinstance(t, torch.Tensor) and need else None
                  for t, need in zip(inputs, ctx.needs_input_grad[4:])))


def _autocast_state(tensors: list) -> dict:
    """{device type: (enabled, dtype, cache enabled)} for the CPU and each device type of the inputs."""
    kinds = {"cpu"} | {t.device.type for t in tensors}
    return {kind: (torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind), torch.is_autocast_cache_enabled())
            for kind in kinds if kind != "meta"}


def _device_type(devices: list) -> str:
    """The accelerator type whose RNG states get_device_states took ('cuda' where none: unused then)."""
    return torch.accelerator.current_accelerator().type if devices and torch.accelerator.is_available() else "cuda"


class OutputStash:
    """The outputs of one checkpointed call's low-bit Linears (dequantized_linear.keeping_outputs) whose input is
    per-sample ([batch, ..., 1 token, in]) and needs no gradient, a modulation Linear's on the timestep embedding:
    the forward keeps them and the recompute takes them back, dequantizing no weight for them (the forward's bits:
    the recompute runs under the forward's autocast). Only the recompute knows which inputs need no gradient (the
    forward runs under no_grad): it records that in `per_sample` (kept on the block across steps, as
    block_checkpoint._ProjectionStash's needs), so the forward keeps them from a block's second checkpointed call
    on. A call is named by its layer's stored tensors and how often the pass has called that layer, not by its
    order in the block: the recompute skips calls the forward made (kept projections, stand-ins); the input's shape
    is checked."""

    def __init__(self, per_sample: dict):
        self.per_sample, self.kept, self.calls = per_sample, {}, ({}, {})  # per pass: layer -> calls so far

    def call(self, recompute: bool, x: torch.Tensor, stored: tuple, compute):
        layer = tuple(id(t) for t in stored if isinstance(t, torch.Tensor))
        n = self.calls[recompute].get(layer, 0)
        self.calls[recompute][layer] = n + 1
        i = (layer, n)
        if not recompute:
            out = compute()
            if self.per_sample.get(i):
                self.kept[i] = (x.shape, out)
            return out
        per_sample = not x.requires_grad and x.dim() > 1 and x.numel() == x.shape[0] * x.shape[-1]
        self.per_sample[i] = per_sample
        kept = self.kept.pop(i, None)
        return kept[1] if per_sample and kept is not None and kept[0] == x.shape else compute()


def output_given(h: torch.Tensor, out: torch.Tensor, forward) -> torch.Tensor:
    """A base projection's call in this recompute (whose graph backward runs) with its output given
    instead of computed: kept from the forward, or a stand-in nothing reads (core.residual_projection).
    forward: the layer, or its bound forward. The GEMM is skipped; backward is the layer's own input
    gradient. Only for a layer whose backward reads no input (block_checkpoint.saves_only_weights)."""
    return _OutputGiven.apply(h, out, layer_of(forward))


def layer_of(forward) -> torch.nn.Module:
    """The layer a base call runs: a bound forward's owner, or the layer itself."""
    return forward.__self__ if isinstance(forward, types.MethodType) else forward


class _OutputGiven(torch.autograd.Function):
    """out as h's projection by `layer`; backward the layer's `input_gradient(grad, dtype)` where it has one
    (fp8_compute's fp8 GEMM), else g @ W in the matmul's dtype, what F.linear's and the low-bit Linears'
    DequantizedLinearFunction compute (the weight dequantized again: `dequantized_weight`); then cast to
    h's dtype, as the layer's input cast does."""

    @staticmethod
    def forward(ctx, h, out, layer):
        ctx.layer, ctx.dtype, ctx.h_dtype = layer, out.dtype, h.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        if not ctx.needs_input_grad[0]:
            return None, None, None
        own = getattr(ctx.layer, "input_gradient", None)
        if own is not None:
            return own(grad, ctx.dtype).to(ctx.h_dtype), None, None
        dequantized = getattr(ctx.layer, "dequantized_weight", None)
        w = dequantized(ctx.dtype) if dequantized is not None else ctx.layer.weight.to(ctx.dtype)
        return (grad.to(w.dtype) @ w).to(ctx.h_dtype), None, None
