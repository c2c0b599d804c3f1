"""checkpoint_saves_dequantized (issue 29): eager checkpointing's recompute keeps each low-bit base Linear's
dequantized weight for its backward (dequantized_linear.keeping_dequantized_weights), so a step dequantizes each
weight twice (forward, recompute) rather than three times. The oracle: plain checkpointing's gradients, bit for
bit; the dequantizations counted; the planner's step grows by at most one block's dequantized weights."""

import copy
import gc
import weakref

import pytest
import torch

from library.models import block_checkpoint, core, eager_checkpoint
from library.precision import bnb_weights, dequantized_linear, fp8
from library.precision.fp8 import quantize_module
from library.models.registry import arch_spec, arch_specs
from tests import test_eager_checkpoint
from tests.test_memory_plan import tiny_flux

PLAIN, KEPT = True, core.checkpointing(True, save_dequantized=True)


def _trainer(monkeypatch, family: str, base: str, device: str = "cpu"):
    """test_eager_checkpoint's (model, network, step) on a `base` (fp8_scaled, nf4) base, quantized before the LoRA."""
    def quantize(model, mode, rules):
        return bnb_weights.prepare_bnb(model, base, rules) if base in bnb_weights.MODES else quantize_module(
            model, base, rules)

    monkeypatch.setattr(test_eager_checkpoint, "quantize_module", quantize)
    monkeypatch.setattr(test_eager_checkpoint, "enable_fp8_compute", lambda model: 1)
    return test_eager_checkpoint._trainer(family, device=device, fp8_compute=True)


def _counting(monkeypatch, module, name: str) -> list:
    """module.name (a dequantize function) counting its calls in the returned list's one element."""
    calls, real = [0], getattr(module, name)

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


@pytest.mark.parametrize("keep", [False, True])
def test_a_kept_weight_is_dequantized_once_and_freed_by_its_backward(keep):
    """A Function's forward under keeping_dequantized_weights keeps its weight: backward dequantizes nothing and lets
    the weight go while the graph still lives; outside it, backward dequantizes again (the old path)."""
    q, scale = fp8.quantize_weight(torch.randn(8, 64), "fp8_scaled")
    made = []

    def dequantize(q, scale):
        made.append(fp8.dequantize_weight(q, scale, torch.float32))
        return made[-1]

    x = torch.randn(3, 64, requires_grad=True)
    with dequantized_linear.keeping_dequantized_weights(keep):
        y = dequantized_linear.dequantized_linear(x, None, dequantize, q, scale)
    assert len(made) == 1
    kept = weakref.ref(made.pop())
    y.sum().backward()
    assert len(made) == (0 if keep else 1)  # backward's own dequantization, off the kept path only
    made.clear()
    gc.collect()
    assert kept() is None, "the forward's weight outlived its node's backward"
    assert torch.equal(x.grad, torch.ones(3, 8) @ fp8.dequantize_weight(q, scale, torch.float32))
    assert y.grad_fn is not None  # the graph itself is still alive


@pytest.mark.parametrize("family", ["flux", "qwen_image"])
@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("others", [False, True])
def test_an_fp8_step_keeping_dequantized_weights_trains_the_bits_of_plain_checkpointing(family, autocast, others,
                                                                                        monkeypatch):
    """Prediction and every LoRA gradient equal bit for bit, alone and beside the other keeping keys, and the step
    dequantizes fewer weights: each base Linear whose input gets a gradient once less (the recompute's is reused)."""
    model, network, step = _trainer(monkeypatch, family, "fp8_scaled")
    calls = _counting(monkeypatch, fp8, "dequantize_weight")
    runs = {}
    for name, keep in (("plain", core.Checkpointing(others, others) if others else PLAIN),
                       ("kept", core.Checkpointing(others, others, True))):
        model.gradient_checkpointing = keep
        step(autocast)  # the first call of a block keeping projections runs torch's checkpoint
        calls[0] = 0
        runs[name] = (*step(autocast), calls[0])
    (pred, grads, plain_calls), (kept_pred, kept_grads, kept_calls) = runs["plain"], runs["kept"]
    assert torch.equal(pred, kept_pred)
    assert grads.keys() == kept_grads.keys()
    for name, g in grads.items():
        assert (g is None) == (kept_grads[name] is None), name
        assert g is None or torch.equal(g, kept_grads[name]), name
    blocks = len(model.swappable_blocks())
    assert kept_calls <= plain_calls - 2 * blocks, (plain_calls, kept_calls)  # at least q / k / v and out per block


def test_an_nf4_step_keeping_dequantized_weights_trains_the_bits_of_plain_checkpointing(monkeypatch):
    """bitsandbytes' nf4 goes through the same Function: the same bits, fewer dequantizations."""
    model, network, step = _trainer(monkeypatch, "flux", "nf4")
    counted = [0]
    real = dequantized_linear.DequantizedLinearFunction.forward

    def forward(ctx, x, bias, dequantize, *args):
        def each(*a):
            counted[0] += 1
            return dequantize(*a)
        return real(ctx, x, bias, each, *args)

    monkeypatch.setattr(dequantized_linear.DequantizedLinearFunction, "forward", staticmethod(forward))
    out = {}
    for name, keep in (("plain", PLAIN), ("kept", KEPT)):
        model.gradient_checkpointing = keep
        counted[0] = 0
        out[name] = (*step(False), counted[0])
    assert torch.equal(out["plain"][0], out["kept"][0])
    for name, g in out["plain"][1].items():
        assert g is None or torch.equal(g, out["kept"][1][name]), name
    assert out["kept"][2] * 2 == out["plain"][2]  # recompute + backward -> the recompute's alone


def test_only_eager_checkpointing_keeps_dequantized_weights(monkeypatch):
    """Only eager_checkpoint's recompute keeps weights: not its forward, and not torch's non-reentrant checkpoint (a
    process group), whose forward runs with grad on and whose ctx would hold the weights for the whole step."""
    seen = []
    real = dequantized_linear._keeps
    monkeypatch.setattr(dequantized_linear, "_keeps",
                        lambda: seen.append((block_checkpoint.recomputing(), real())) or seen[-1][1])
    for usable in (True, False):
        seen.clear()
        model, network, step = _trainer(monkeypatch, "flux", "fp8_scaled")
        model.gradient_checkpointing = KEPT
        monkeypatch.setattr(eager_checkpoint, "usable", lambda: usable)
        step(False)
        assert seen and all(kept == (usable and recompute) for recompute, kept in seen), seen
        assert any(kept for _, kept in seen) == usable


def test_the_plan_counts_the_dequantized_weights_one_block_at_a_time(tiny_set):
    """The planned step of an fp8_scaled base grows by at most the largest block's dequantized weights (bf16), and
    not at all for a bf16 base (nothing is dequantized)."""
    from library.training import memory_plan
    from tools import plan_memory

    family, args = tiny_flux(tiny_set), plan_memory.default_args("flux")
    for base in ("fp8_scaled", "bf16"):
        plain = copy.copy(args)
        plain.base_precision = base
        kept = copy.copy(plain)
        kept.checkpoint_saves_dequantized = True
        a, b = (memory_plan.training_plan(family, x, 256, 256, 1, 8).phase(0).peak for x in (plain, kept))
        model = memory_plan.meta_model_and_network(family, kept)[0]
        largest = max(sum(t.numel() for n, t in block.named_buffers() if n.endswith("weight"))
                      for block in model.swappable_blocks())
        if base == "bf16":
            assert b == a
        else:
            assert 0 < b - a <= largest * 2, (b - a, largest * 2)


def test_the_key_is_refused_under_torch_compile_and_keeps_an_unset_one_eager(tiny_set, tmp_path, capsys):
    """torch_compile = true: one line, exit 2 (a compiled region plans its own recompute); unset: eager, said why."""
    import train_lora

    from library.training.diffusion_task import compile_by_default
    from tests.test_train_lora import flux_args

    argv = flux_args(tiny_set, tmp_path, "--gradient_checkpointing", "true", "--checkpoint_saves_dequantized", "true")
    assert train_lora.main(argv + ["--torch_compile", "true"]) == 2
    err = capsys.readouterr().err.strip()
    assert "checkpoint_saves_dequantized is an eager lever" in err and len(err.splitlines()) == 1, err
    args = copy.copy(plan_defaults())
    args.checkpoint_saves_dequantized = True
    on, why = compile_by_default(args, "cuda", True, None, 1, 10**10, False)
    assert not on and why.startswith("checkpoint_saves_dequantized"), why


def plan_defaults():
    from tools import plan_memory

    return plan_memory.default_args("flux")


CASES = [("flux", "fp8_scaled", "cpu"), ("qwen_image", "fp8_scaled", "cpu"), ("flux", "nf4", "cpu"),
         pytest.param("flux", "fp8_scaled", "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                              reason="no CUDA device")),
         pytest.param("qwen_image", "fp8_scaled", "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                                   reason="no CUDA device"))]


@pytest.mark.parametrize("family,base,device", CASES)
def test_a_low_bit_eager_step_trains_the_bits_of_torch_checkpoint(family, base, device, monkeypatch):
    """The oracle for both cuts (the kept weights, and the tail's stand-in without its one-token call): eager
    checkpointing with and without the key gives torch's non-reentrant checkpoint's prediction and gradients
    (on CUDA too: `-k cuda`)."""
    model, network, step = _trainer(monkeypatch, family, base, device)
    runs = {}
    for name, usable, keep in (("torch", False, PLAIN), ("eager", True, PLAIN), ("kept", True, KEPT)):
        monkeypatch.setattr(eager_checkpoint, "usable", lambda usable=usable: usable)
        model.gradient_checkpointing = keep
        runs[name] = (step(True), step(True))  # the second: the forward keeps the per-sample outputs
    for name in ("eager", "kept"):
        for run, oracle in zip(runs[name], runs["torch"]):
            assert torch.equal(oracle[0], run[0]), name
            for key, g in oracle[1].items():
                assert (g is None) == (run[1][key] is None), key
                assert g is None or torch.equal(g, run[1][key]), (name, key)


def test_a_low_bit_tail_stand_in_dequantizes_nothing(monkeypatch):
    """The block's last projection, whose output nothing reads in the recompute: a low-bit layer's stand-in
    dequantized its whole weight for a one-token GEMM; now zeros of the output's dtype and shape."""
    model, network, step = _trainer(monkeypatch, "qwen_image", "fp8_scaled")  # its gates do not train
    calls = _counting(monkeypatch, fp8, "dequantize_weight")
    during, real = [], block_checkpoint._stand_in

    def stand_in(forward, h):
        before = calls[0]
        out = real(forward, h)
        during.append((calls[0] - before, out.dtype))
        return out

    monkeypatch.setattr(block_checkpoint, "_stand_in", stand_in)
    model.gradient_checkpointing = PLAIN
    step(True)
    assert during and all(n == 0 and dtype == torch.bfloat16 for n, dtype in during), during


@pytest.mark.parametrize("family", ["flux", "qwen_image"])
def test_the_recompute_takes_the_modulation_outputs_from_the_forward(family, monkeypatch):
    """A low-bit Linear on a per-sample input that needs no gradient (the blocks' modulation on the timestep
    embedding) is run once a step, not again in the recompute: from a block's second checkpointed call on, the
    forward keeps its output (eager_checkpoint.OutputStash). Tokens' Linears are never kept."""
    model, network, step = _trainer(monkeypatch, family, "fp8_scaled")
    model.gradient_checkpointing = PLAIN
    calls = _counting(monkeypatch, fp8, "dequantize_weight")
    counts = []
    for _ in range(3):
        calls[0] = 0
        step(True)
        counts.append(calls[0])
    kept = sum(sum(vars(b)["_per_sample_calls"].values()) for b in model.swappable_blocks())
    assert kept >= len(model.swappable_blocks())  # a modulation Linear at least in every block
    assert counts[1] == counts[2] == counts[0] - kept, (counts, kept)


@pytest.mark.parametrize("arch", sorted({spec.arch for spec in arch_specs().values()} - {"llm"}))
def test_every_family_on_an_fp8_base_trains_the_bits_of_torch_checkpoint(arch, tiny_set, monkeypatch):
    """Every family's tiny transformer on an fp8_scaled base with every keeping key, three steps (keeping
    projections, the first runs torch's checkpoint; from the third the forward keeps the modulation's outputs: a
    family writing one in place, or a kept call matched to another, would change the recompute), eager
    checkpointing against torch's non-reentrant checkpoint."""
    from tests.test_residual_projection import assert_same, tiny_model, with_lora

    model, kwargs = tiny_model(arch, tiny_set)
    model = quantize_module(model, "fp8_scaled", arch_spec(arch).fp8)
    model.gradient_checkpointing = core.Checkpointing(True, True, True)
    net = with_lora(model, arch)

    def three_steps(usable: bool) -> list:
        monkeypatch.setattr(eager_checkpoint, "usable", lambda: usable)
        grads = []
        for _ in range(3):
            net.zero_grad(set_to_none=True)
            model(**kwargs).float().square().mean().backward()
            grads.append({n: p.grad for n, p in net.named_parameters()})
        return grads

    eager, oracle = three_steps(True), three_steps(False)
    for a, b in zip(eager, oracle):
        assert_same(a, b)


def test_a_call_the_recompute_skips_shifts_no_kept_output():
    """OutputStash names a call by its layer and that layer's count, not by its order: a call the forward made and
    the recompute skips (a kept projection, a stand-in) takes no other call's kept output, even of the same shape."""
    from library.models.eager_checkpoint import OutputStash

    layers = {name: (torch.zeros(1),) for name in "atb"}  # each layer's stored tensors
    x = torch.ones(2, 8)
    per_sample = {}
    for step in range(2):
        stash, computed = OutputStash(per_sample), []
        outs = {name: stash.call(False, x, layers[name], lambda name=name: torch.full((2, 4), float("atb".index(name))))
                for name in "atb"}
        for name in "ab":  # the recompute skips t
            got = stash.call(True, x, layers[name], lambda name=name: computed.append(name) or outs[name].clone())
            assert torch.equal(got, outs[name]), (step, name)
            assert (got is outs[name]) == (step == 1)  # kept from the second call on
        assert computed == ([] if step else ["a", "b"])
