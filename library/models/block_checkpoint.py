"""Gradient checkpointing of the transformer blocks: run_block (the one call every family makes per block),
compile_block (torch_compile's regions) and what a checkpointed call keeps from its forward instead of recomputing
(Checkpointing: the residual projections' outputs, the attention kernels' outputs, a low-bit Linear's dequantized
weight). The eager recompute itself is eager_checkpoint's; library/models/core.py re-exports this module's public
names, so a family writes core.run_block and core.residual_projection beside the rest of the core."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import logging
import threading
import types
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map_only
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from library.models import eager_checkpoint
from library.precision.autocast import matmul_input
from library.precision.dequantized_linear import keeping_dequantized_weights, keeping_outputs


# .active: in a recompute; .stash / .attention: this call's kept projections / attention outputs, or None
_recompute = threading.local()


@dataclass(frozen=True)
class Checkpointing:
    """run_block's use_checkpoint (a model's gradient_checkpointing) for checkpointing that keeps some
    tensors from the forward instead of recomputing them. projections: the outputs of the blocks' last
    projections into the residual where a trained gate needs them (residual_projection); attention: each
    attention kernel's outputs (out and its log-sum-exp, [tokens, width] and [heads, tokens] per call), so
    the recompute runs no attention kernel (its q, k, v are still recomputed: its backward reads them);
    dequantized: a low-bit base Linear's weight as the eager recompute dequantized it, kept for its backward
    (dequantized_linear.keeping_dequantized_weights; compiled regions leave it to their partitioner)."""

    projections: bool = False
    attention: bool = False
    dequantized: bool = False


SAVE_PROJECTIONS = Checkpointing(projections=True)


def checkpointing(enabled: bool, save_projections: bool = False, save_attention: bool = False,
                  save_dequantized: bool = False) -> bool | Checkpointing:
    """A model's gradient_checkpointing value for the config's keys."""
    if enabled and (save_projections or save_attention or save_dequantized):
        return Checkpointing(bool(save_projections), bool(save_attention), bool(save_dequantized))
    return enabled


def compile_block(block: nn.Module, **options):
    """torch.compile a block for run_block: its own call (no grad, or checkpointing off) in place
    (nn.Module.compile: names and state dict unchanged), and the checkpointed call as one compiled
    region, checkpoint included, so the partitioner plans forward, recompute and backward together: the
    recompute fuses into the backward graph instead of running the compiled forward again (the mid
    3072-wide bf16 CPU step x0.90-0.96, activation memory per block unchanged; bench/RESULTS.md).
    One region per Checkpointing (each compiled on first use), each checkpoint with a selective policy
    (_keeping): plain checkpointing's recomputes everything; each kind that keeps tensors saves them, so
    the partitioner drops their ops from the recompute, as the eager stashes do. The plain region takes
    a policy too: torch 2.11's compiled checkpoint without one tags only the ops it sees at the top of
    the region, not those inside an autograd.Function (the quantized Linears' dequantization), and the
    partitioner saved those for backward: the base in the compute dtype (a 12B fp8_scaled model on an
    H100: 43.4 GiB peak against eager's 15.2). A policy tags every op as it runs. torch 2.13 does so
    itself (pytorch#177396), and there the policy only triples the compile time (tests/test_block_swap.py's
    compiled swap: 8 -> 24 s): from 2.13 on the plain region goes without."""
    block.compile(**options)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, REGION_RECOMPILE_LIMIT)
    if any(getattr(m, "backward_saves_weights_only", False) for m in block.modules()):
        block._compiled_call_impl = _keeping_weights_quantized(block._compiled_call_impl)
    logging.getLogger("torch._higher_order_ops.wrap").addFilter(_without_context_fn_warning)
    call = functools.partial(checkpoint, block._call_impl, use_reentrant=False)
    block._compiled_checkpoints = {
        keep: torch.compile(call if policy is None else functools.partial(call, context_fn=policy), **options)
        for keep, policy in _REGION_POLICIES.items()}


PLAIN_REGION_NEEDS_POLICY = torch.torch_version.TorchVersion(torch.__version__) < (2, 13)

# dynamo's recompile_limit counts the compiled variants of one code object, and every block's checkpointed
# region runs torch.utils.checkpoint's: the variants of all kinds of block add up. A kind of block (a
# double-stream model has three: the first double block, whose input needs no grad, the other doubles,
# the singles) compiles static, then with the token count dynamic at the second bucket, then the batch
# dynamic at a smaller last batch: 9 variants, past torch's default 8, after which those calls run eager
# (measured on a tiny double-stream model, tests/test_block_swap.py). compile_block raises it to this.
REGION_RECOMPILE_LIMIT = 64


def compile_limit_hits() -> int:
    """How many times dynamo gave up compiling a function at its recompile limit in this process: from
    then on that function's new variants run eager, as slow as without torch_compile or slower (a
    full-size model ran all but 8 blocks eager so, a step 1.55x the eager one). torch says so once in a log line."""
    from torch._dynamo.utils import counters

    return sum(n for reason, n in counters["unimplemented"].items() if reason.startswith("Dynamo recompile limit"))


def _keeping_weights_quantized(compiled):
    """A quantized block's own compiled call (no checkpointing) with the partitioner free to recompute
    what backward's GEMMs read: by default it saves every dequantized weight for the input-gradient GEMM
    (an op's output "materialized in backward" is never recomputed), which eager's autograd Functions
    avoid, so the compiled step held the base in the compute dtype (a tiny fp8_scaled model: 878 KB saved
    against 378 KB eager; 191 KB with this). The checkpointed regions are unaffected: their policy rules."""

    def call(*args, **kwargs):
        with torch._functorch.config.patch(ban_recompute_materialized_backward=False):
            return compiled(*args, **kwargs)

    return call


# A compiled region that keeps projections: residual_projection runs the base call of a projection whose
# output a trained gate needs under this torch.fx annotation; the selective-checkpoint policy saves the
# GEMMs made there (the [tokens, out] output; the rest of the call, e.g. an fp8 weight's dequantization,
# is recomputed). One that keeps attention saves the fused attention kernels' outputs. Everything else
# the partitioner may recompute, as plain checkpointing does.
_KEEP_OUTPUT = "residual_projection_keeps_output"
_GEMMS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
          torch.ops.aten.baddbmm.default, torch.ops.aten._scaled_mm.default)


def _keeping(keep: Checkpointing, ctx, op, *args, **kwargs) -> CheckpointPolicy:
    if keep.attention and op in ATTENTION_KERNELS:
        return CheckpointPolicy.MUST_SAVE
    if keep.projections and op in _GEMMS and torch.fx.traceback.get_current_meta().get("custom", {}).get(_KEEP_OUTPUT):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


# Each kind of compiled region's selective-checkpoint policy (context_fn), one object for every block:
# the blocks' compiled regions share one code object (torch.utils.checkpoint's), so dynamo guards on the
# identity of what the partial holds. A policy built per block failed those guards at each block: one
# compile per block, and past torch._dynamo's recompile_limit (8) the rest of the model ran eager
# (a 60-block model on an H200: 2.03 s a step against 0.65 s compiled). None: no policy (plain).
_REGION_POLICIES = {
    keep: None if keep == Checkpointing() and not PLAIN_REGION_NEEDS_POLICY
    else functools.partial(create_selective_checkpoint_contexts, functools.partial(_keeping, keep))
    for keep in (Checkpointing(), Checkpointing(True, False), Checkpointing(False, True), Checkpointing(True, True))}


def _without_context_fn_warning(record: logging.LogRecord) -> bool:
    """torch warns once that a compiled checkpoint with a context_fn must hold no in-place op; the blocks'
    regions hold none on a saved tensor (their gradients are compared in tests/test_residual_projection.py),
    so a user would read three lines about nothing."""
    return "context_fn is passed to torch.utils.checkpoint" not in record.getMessage()


def _marked_output(forward, h: torch.Tensor) -> torch.Tensor:
    """The base call (forward, h) -> output in a compiled region: marked for _keeping (outside a region
    that keeps projections the mark is inert metadata)."""
    with torch.fx.traceback.annotate({_KEEP_OUTPUT: True}):
        return forward(h)


def recomputing() -> bool:
    """True while checkpointing reruns a block's forward in backward (run_block's)."""
    return getattr(_recompute, "active", False)


def recompute_graph() -> bool:
    """True in a recompute whose graph backward runs through (eager_checkpoint's); False in torch's
    non-reentrant one, whose recompute only refills the tensors the forward's graph saved."""
    return getattr(_recompute, "graph", False)


@contextlib.contextmanager
def _checkpoint_pass(recompute: bool, stash, attention: collections.deque | None, graph: bool = False,
                     dequantized: bool = False, outputs=None):
    """dequantized: the recompute's low-bit Linears keep their dequantized weights for the backward that runs
    through its graph (graph: eager_checkpoint's; torch's recompute only refills the forward's saved tensors);
    outputs: this pass's eager_checkpoint.OutputStash call for the low-bit Linears' outputs."""
    previous = (recomputing(), getattr(_recompute, "stash", None), getattr(_recompute, "attention", None),
                recompute_graph())
    _recompute.active, _recompute.stash, _recompute.attention, _recompute.graph = recompute, stash, attention, graph
    try:
        with keeping_dequantized_weights(dequantized), keeping_outputs(outputs):
            yield
    finally:
        _recompute.active, _recompute.stash, _recompute.attention, _recompute.graph = previous


def _checkpoint_contexts(keep: Checkpointing = Checkpointing(), needs: dict | None = None, graph: bool = False,
                         per_sample: dict | None = None):
    """(original forward, recompute) contexts of one checkpointed call; both passes share its stashes.
    needs: the block's record of which projections its recompute found needed (_ProjectionStash);
    graph: backward runs through the recompute's graph (eager_checkpoint); per_sample: the block's record of
    which low-bit Linear calls take a per-sample input needing no gradient (eager_checkpoint.OutputStash)."""
    stash = _ProjectionStash({} if needs is None else needs) if keep.projections else None
    attention = collections.deque() if keep.attention else None
    outputs = eager_checkpoint.OutputStash(per_sample) if graph and per_sample is not None else None
    return (_checkpoint_pass(False, stash, attention, outputs=outputs and functools.partial(outputs.call, False)),
            _checkpoint_pass(True, stash, attention, graph, dequantized=graph and keep.dequantized,
                             outputs=outputs and functools.partial(outputs.call, True)))


# SDPA's fused kernels (CPU, CUDA flash / memory-efficient / cuDNN, other backends): what autograd records
# for one attention call, outputs (out, log-sum-exp, ...) that its backward reads. The math fallback
# (e.g. an additive float mask on CPU) is many ops and is recomputed.
ATTENTION_KERNELS = frozenset(
    getattr(torch.ops.aten, name).default
    for name in ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                 "_scaled_dot_product_fused_attention_overrideable")
    if hasattr(torch.ops.aten, name))


class _AttentionStash(TorchDispatchMode):
    """Around one eager attention call in a checkpointed block that keeps attention (Checkpointing):
    the forward appends this call's entry to the block's stash, the fused kernel's outputs, and the
    recompute takes them back instead of running the kernel. Below autograd, so the recomputed node saves
    the recomputed q, k, v and the kept outputs, as the forward's did.

    The forward may run under no_grad (eager_checkpoint), where SDPA asks the memory-efficient and cuDNN
    kernels for no log-sum-exp (backward reads it): the forward asks for it. A recompute call whose kernel
    or arguments differ from what the forward kept (a kernel chosen otherwise with grad on) runs the kernel."""

    def __init__(self, stash: collections.deque, recompute: bool):
        super().__init__()
        self.recompute = recompute
        if recompute:
            self.entry = stash.popleft() if stash else []
        else:
            self.entry = []  # (kernel, its arguments' signature, outputs) per kernel of this call
            stash.append(self.entry)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in ATTENTION_KERNELS:
            return func(*args, **kwargs)
        if func in _LOG_SUMEXP_ARGUMENT:  # (bool compute_log_sumexp, 5th argument)
            args = (*args[:4], True, *args[5:])
        signature = _signature(args, kwargs)
        if self.recompute:
            if self.entry and self.entry[0][0] is func and self.entry[0][1] == signature:
                return _detached(self.entry.pop(0)[2])  # a fresh alias: autograd attaches the new node to it
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        self.entry.append((func, signature, _detached(out)))
        return out


_LOG_SUMEXP_ARGUMENT = frozenset(getattr(torch.ops.aten, name).default for name in (
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention") if hasattr(torch.ops.aten, name))


def _signature(args: tuple, kwargs: dict) -> tuple:
    """An attention kernel call's arguments, tensors by shape, dtype and layout."""
    return tuple((t.shape, t.dtype, t.stride()) if isinstance(t, torch.Tensor) else t
                 for t in tree_leaves((args, kwargs)))


def _detached(out):
    return tree_map_only(torch.Tensor, torch.Tensor.detach, out)


def _kept_attention():
    """The attention stash of the checkpointed call running now (eager), else nothing to do."""
    if torch.compiler.is_compiling():  # compiled: the region's checkpoint policy keeps it
        return contextlib.nullcontext()
    stash = getattr(_recompute, "attention", None)
    if stash is None:
        return contextlib.nullcontext()
    return _AttentionStash(stash, recomputing())






def on_one_token(forward, h: torch.Tensor) -> torch.Tensor:
    """forward(h) computed for the first token only and broadcast over the others: what a layer saves for
    backward that does not depend on its input (a frozen Linear's weight) is saved as in the full call."""
    if not h.is_contiguous():  # F.linear folds a contiguous input into one GEMM, saving the [in, out]
        return forward(h)  # weight; other strides it may run batched, saving a broadcast one
    one = h[..., :1, :].clone(memory_format=torch.contiguous_format)
    return forward(one).expand(*h.shape[:-1], -1)


class _ProjectionStash:
    """The projection outputs one checkpointed call keeps (SAVE_PROJECTIONS): the original forward keeps a
    needed projection's base output, the recompute takes it back instead of running the GEMM (torch's
    checkpoint: and runs the base on one token, for what its graph saves, the weights; eager_checkpoint:
    with the base's input gradient, eager_checkpoint.output_given). Calls are matched by their order in the
    block (both passes make the same calls). Which outputs are needed (the gate needs a gradient) only a pass
    with grad on knows:
    each such pass records it in `needs` (kept on the block across steps), and a forward under no_grad
    (eager_checkpoint, from the block's second checkpointed call on: run_block) keeps what it says."""

    def __init__(self, needs: dict):
        self.needs, self.kept, self.calls = needs, {}, [0, 0]  # calls so far: forward, recompute

    def next_call(self, output_needed: bool):
        """This call's base call (forward, h) -> output through the stash, or None where it keeps nothing."""
        recompute = recomputing()
        i = self.calls[recompute]
        self.calls[recompute] += 1
        if recompute or torch.is_grad_enabled():
            self.needs[i] = output_needed
        return self._base_call(i) if self.needs.get(i, False) else None

    def _base_call(self, i: int):
        def call(forward, h: torch.Tensor) -> torch.Tensor:
            if not recomputing():
                out = forward(h)
                self.kept[i] = out.detach()
                return out
            kept = self.kept.pop(i, None)
            if kept is None:  # not kept by the forward (under no_grad, before a recompute said it is needed)
                return forward(h)
            if recompute_graph():
                return eager_checkpoint.output_given(h, kept, forward)
            on_one_token(forward, h)  # what the forward's graph saved: the base's weights
            return kept

        return call


def _stand_in(forward, h: torch.Tensor) -> torch.Tensor:
    """A base output nothing reads, in a recompute whose graph backward runs through, and the base's input
    gradient for h (eager_checkpoint.output_given): zeros of the output's dtype and shape for a low-bit
    layer (its one-token call would dequantize the whole weight for them), else on_one_token's value."""
    layer = eager_checkpoint.layer_of(forward)
    if hasattr(layer, "dequantized_weight") and hasattr(layer, "compute_dtype"):
        dtype = matmul_input(h, layer.compute_dtype)[1]  # the dtype the layer's matmul returns
        out = torch.zeros((), dtype=dtype, device=h.device).expand(*h.shape[:-1], layer.out_features)
    else:
        with torch.no_grad():
            out = on_one_token(forward, h)
    return eager_checkpoint.output_given(h, out, forward)


def residual_projection(proj: nn.Module, h: torch.Tensor, output_needed: bool) -> torch.Tensor:
    """proj(h) for the block's last projection into the residual stream, `x + gate * proj(h)`.

    In checkpointing's recompute only the tensors autograd saves matter, and proj's output is saved by
    nothing downstream when the gate needs no gradient (the multiply saves the gate alone; the add
    nothing): there the base GEMM runs on one token (on_one_token) while an adapter's own path (LoRA
    down saves h) runs in full. That skips the MLP's / single block's output GEMM, about a third of the
    recomputed forward's GEMM work. `output_needed` (the gate needs a gradient): computed in full, or
    with SAVE_PROJECTIONS checkpointing the base output is kept from the forward (one [tokens, out]
    tensor per projection until the block's recompute) and the recompute skips the same GEMM (compiled:
    the base call is marked for the region's checkpoint policy, compile_block). An
    adapter that does not offer `forward_with_base_output`, a layer not known to save only its
    weights (saves_only_weights) and a non-contiguous h are computed in full. A residual without a
    gate is the same case: pass output_needed=False."""
    if torch.compiler.is_compiling():  # the partitioner recomputes only what backward reads
        if not output_needed:
            return proj(h)
        base_call = _marked_output  # kept where the region's checkpoint saves marked outputs
    elif not h.is_contiguous():
        return proj(h)
    elif (stash := getattr(_recompute, "stash", None)) is not None and (kept := stash.next_call(output_needed)):
        base_call = kept
    elif not output_needed and recomputing():
        base_call = _stand_in if recompute_graph() else on_one_token
    else:
        return proj(h)
    with_base = getattr(proj, "forward_with_base_output", None)
    if with_base is not None and _same_owner(proj.forward, with_base):
        return with_base(h, base_call)
    if "forward" in vars(proj) or not saves_only_weights(proj):  # wrapped, or a layer that may save h
        return proj(h)
    return base_call(proj, h)


def _same_owner(forward, with_base) -> bool:
    """Whether proj's forward and its forward_with_base_output are methods of one object (the adapter
    that routes proj's calls now, or proj itself). Written without getattr's default: under torch 2.11's
    dynamo `getattr(method, "__self__", None) is getattr(other, "__self__", 0)` is False for the same
    owner, and 2.13's for a class's own methods, so a compiled region lost the marked base call."""
    return (isinstance(forward, types.MethodType) and isinstance(with_base, types.MethodType)
            and forward.__self__ is with_base.__self__)


def saves_only_weights(layer: nn.Module) -> bool:
    """Whether `layer`'s backward keeps only its frozen weights, never its input: nn.Linear's own forward
    (the weight, or autocast's copy of it) and the quantized Linears that say so."""
    known = type(layer).forward is nn.Linear.forward or getattr(layer, "backward_saves_weights_only", False)
    return known and not any(p.requires_grad for p in layer.parameters())


def _builds_graph(block: nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether a training call of the block records anything backward needs: an input that requires grad,
    a parameter of it that does, or a layer an adapter routes (its forward set on the instance: a LoRA's
    weights are the adapter's, not the block's). A block before the first adapted one has none (a model's
    refiner blocks outside its default targets, the double blocks under train_blocks = single); its compiled
    checkpoint region then ran AOTAutograd's inference path, which refuses the attention's RNG tag."""
    if any(t.requires_grad for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)):
        return True
    return (any(p.requires_grad for p in block.parameters())
            or any("forward" in vars(m) for m in block.modules() if m is not block))


def run_block(block: nn.Module, use_checkpoint: bool, *args, swap=None, index: int = 0, **kwargs):
    """Call a block, through activation checkpointing when training with it on: eager_checkpoint's (its
    forward records no graph) in one process, torch's non-reentrant checkpoint in a process group.
    swap: the model's BlockSwap (library/models/block_swap.py) or None; `index` is the block's
    position in run order, so the swap can bring its weights in before and release them after."""
    if swap is not None:
        swap.before_forward(index)
    if use_checkpoint and torch.is_grad_enabled() and not _builds_graph(block, args, kwargs):
        with torch.no_grad():  # nothing in or before it trains: no graph, so nothing to checkpoint
            out = block(*args, **kwargs)
    elif use_checkpoint and torch.is_grad_enabled():
        keep = use_checkpoint if isinstance(use_checkpoint, Checkpointing) else Checkpointing()
        if hasattr(block, "_compiled_checkpoints"):  # compile_block's
            out = block._compiled_checkpoints[dataclasses.replace(keep, dequantized=False)](*args, **kwargs)
        elif eager_checkpoint.usable() and (not keep.projections or "_projections_needed" in vars(block)):
            # the forward records no graph (the eager step's host time); keeping projections, once a
            # forward with grad on has said which are needed (_ProjectionStash)
            needs, per_sample = vars(block).get("_projections_needed"), vars(block).setdefault("_per_sample_calls", {})
            contexts = _checkpoint_contexts(keep, needs, graph=True, per_sample=per_sample)
            out = eager_checkpoint.checkpoint_block(block, contexts, args, kwargs)
        else:
            needs = vars(block).setdefault("_projections_needed", {}) if keep.projections else None
            contexts = functools.partial(_checkpoint_contexts, keep, needs)
            out = checkpoint(block, *args, use_reentrant=False, context_fn=contexts, **kwargs)
    else:
        out = block(*args, **kwargs)
    return out if swap is None else swap.after_forward(index, out)
