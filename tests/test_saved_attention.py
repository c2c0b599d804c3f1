"""checkpoint_saves_attention: a checkpointed block keeps each attention kernel's outputs (out and its
log-sum-exp) from the forward, and the recompute runs no attention kernel (core.Checkpointing).

The oracle is autograd: the LoRA gradients equal plain checkpointing's bit for bit (a wrong or misordered
kept output would change them), while the attention kernels that run in backward drop from one per
attention call (the recompute's) to none, eager and compiled."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from library.models import block_checkpoint, core
from library.models.registry import arch_specs
from library.precision.fp8 import quantize_module
from tests.test_residual_projection import DIFFUSION_ARCHS, assert_same, one_block_each, tiny_model, with_lora

KEEP_ATTENTION = core.checkpointing(True, save_attention=True)


class KernelCount(TorchDispatchMode):
    """Counts the fused attention kernels that run below autograd (kept ones are returned, not run)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in block_checkpoint.ATTENTION_KERNELS
        return func(*args, **(kwargs or {}))


def step(model, net, kwargs, mode):
    """(LoRA gradients, attention kernels run in the forward, in backward) of one step under `mode`."""
    model.gradient_checkpointing = mode
    net.zero_grad(set_to_none=True)
    with KernelCount() as forward:
        loss = model(**kwargs).float().square().mean()
    with KernelCount() as backward:
        loss.backward()
    return {n: p.grad for n, p in net.named_parameters()}, forward.count, backward.count


@pytest.mark.parametrize("arch", DIFFUSION_ARCHS)
def test_kept_attention_trains_the_same_bits(arch, tiny_set):
    model, kwargs = tiny_model(arch, tiny_set)
    net = with_lora(model, arch)
    plain, calls, recomputed = step(model, net, kwargs, True)
    kept, calls_kept, rerun = step(model, net, kwargs, KEEP_ATTENTION)
    assert_same(kept, plain)
    assert calls > 0 and calls_kept == calls  # every attention ran on a fused kernel, once in the forward
    assert 0 < recomputed <= calls and rerun == 0  # plain: again in the recompute (checkpointed blocks); kept: none


@pytest.mark.parametrize("base", ["fp32", "fp8_scaled"])
def test_kept_attention_with_kept_projections(base, tiny_set):
    """Both keys (FLUX.1's gates train, so projections are kept too): the two stashes in one recompute,
    on a full-precision and an fp8_scaled base (its Linears' own autograd Functions in the recompute)."""
    model, kwargs = tiny_model("flux", tiny_set)
    if base != "fp32":
        model = quantize_module(model, base, arch_specs()["flux"].fp8)
    net = with_lora(model, "flux")
    plain = step(model, net, kwargs, True)[0]
    kept, _, rerun = step(model, net, kwargs, core.checkpointing(True, True, True))
    assert_same(kept, plain)
    assert rerun == 0


def test_kept_attention_in_the_llm():
    """The LLM decoder layer (causal, grouped-query attention, a padded row) keeps its attention too."""
    from library.models.llm import LLM, LLMConfig

    torch.manual_seed(0)
    model = LLM(LLMConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                          intermediate_size=48)).requires_grad_(False).train()
    net = with_lora(model, "llm")
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :3] = 0  # left padding: the masked kernel call
    kwargs = {"input_ids": torch.randint(0, 64, (2, 7)), "attention_mask": mask}
    plain, calls, recomputed = step(model, net, kwargs, True)
    kept, _, rerun = step(model, net, kwargs, KEEP_ATTENTION)
    assert_same(kept, plain)
    assert calls == recomputed == 2 and rerun == 0


def test_compiled_kept_attention_leaves_the_recompute(tiny_set):
    """compile_block's region that keeps attention: the compiled backward graphs hold no attention
    kernel (the plain region's hold one per attention call: the recompute), with the LoRA gradients of
    the plain compiled region bit for bit and no graph break (aot_eager's graphs split by inductor's
    partitioner; train_lora: inductor)."""
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.utils import counters
    from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state

    kernels = []

    def kernel(node) -> bool:  # (the graphs run it under an rng-state wrapper: SDPA may draw dropout)
        wrapped = node.target in (run_with_rng_state, run_and_save_rng_state)  # (rng state, op, ...) / (op, ...)
        return any(op in block_checkpoint.ATTENTION_KERNELS for op in (node.args[:2] if wrapped else (node.target,)))

    def counted(gm, example_inputs):
        kernels.append(sum(kernel(n) for n in gm.graph.nodes))
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=lambda gm, example_inputs: make_boxed_func(gm.forward), bw_compiler=counted,
                           partition_fn=min_cut_rematerialization_partition)  # inductor's partitioner
    model, kwargs = tiny_model("flux", tiny_set)
    net = with_lora(one_block_each(model), "flux")
    for block in model.swappable_blocks():
        core.compile_block(block, backend=backend, dynamic=False)

    def grads(mode):
        kernels.clear()
        model.gradient_checkpointing = mode
        net.zero_grad(set_to_none=True)
        model(**kwargs).float().square().mean().backward()
        return {n: p.grad for n, p in net.named_parameters()}, sum(kernels)

    torch._dynamo.reset()
    counters.clear()
    (plain, recomputed), (kept, rerun) = grads(True), grads(KEEP_ATTENTION)
    torch._dynamo.reset()
    assert_same(kept, plain)
    assert recomputed > 0 and rerun == 0
    assert not counters["graph_break"], dict(counters["graph_break"])
