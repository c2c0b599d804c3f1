"""fp8 compute (library/precision/fp8_compute.py) on the CPU, PyTorch's reference _scaled_mm: the
forward and the input-gradient backward equal an explicit float64 product of the same e4m3 codes to
one bf16 rounding; against the dequantize-then-matmul path they differ by the activations' e4m3
rounding (a few percent, never zero: the fp8 path really runs); a LoRA trains on top; the config
refuses what it cannot run."""

import os
import sys

import pytest
import torch
import torch.nn as nn
from safetensors import safe_open

import train_lora
from library.precision.fp8 import FP8Linear
from library.precision import fp8_compute
from library.precision.fp8_compute import (FP8ComputeLinear, enable_fp8_compute, fp8_gemm_available, quantize_rows,
                                           rowwise_requantization_error, rowwise_requantize)
from tests.test_train_lora import flux_args, read_losses

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
from fp8_compute_ops import OpLog, computed_layer, per_call_work  # noqa: E402
from fp8_gemm_error import excess as excess_past_rounding  # noqa: E402

MODES = ("fp8", "fp8_scaled", "fp8_tensor_scaled")
BF16_HALF_ULP = 2.0 ** -8  # round to nearest bf16 (8 significant bits): |error| <= 2^-8 |value|
# torch 2.11's CPU _scaled_mm takes one scale per tensor (the GPU session's torch): the CPU GEMM tests
# need 2.13's per-row scales; the refusal test below covers the other case.
cpu_rowwise = pytest.mark.skipif(not fp8_gemm_available("cpu"), reason="this torch's CPU _scaled_mm takes no per-row scales")


def layer(mode: str, out_features: int = 96, in_features: int = 192, bias: bool = False, seed: int = 0) -> FP8Linear:
    gen = torch.Generator().manual_seed(seed)
    linear = nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out_features, in_features, generator=gen) * 0.02)
        linear.weight[:, 3] *= 10  # an outlier input column: per-row scales must cope
        if bias:
            linear.bias.copy_(torch.randn(out_features, generator=gen))
    return FP8Linear.from_linear(linear, mode)


def computed(mode: str, **kw) -> FP8Linear:
    model = nn.Sequential(layer(mode, **kw))
    assert enable_fp8_compute(model) == 1
    return model[0]


def within_one_bf16_rounding(y: torch.Tensor, exact: torch.Tensor) -> bool:
    """|y - exact| <= half a bf16 step, plus what the float32 accumulation before the rounding may add
    (1e-6 of the largest output: it shows only where a sum nearly cancels)."""
    slack = 1e-6 * exact.abs().max().item()
    return bool(((y.double() - exact).abs() <= exact.abs() * BF16_HALF_ULP + slack).all())


def inputs(seed: int = 1, shape=(3, 17, 192)) -> torch.Tensor:
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    x[0, 0] = 0  # an all-zero token
    return x.requires_grad_(True)


@cpu_rowwise
@pytest.mark.parametrize("mode", MODES)
def test_forward_is_the_fp8_product_of_the_same_codes_rounded_once_to_bf16(mode):
    lin = computed(mode)
    x = inputs()
    y = lin(x)
    assert y.dtype == torch.bfloat16 and y.shape == (3, 17, 96)
    xq, s_x = quantize_rows(x.detach().reshape(-1, 192))
    w = lin.weight.double() * lin.row_scales().double()[:, None]
    exact = (xq.double() * s_x.double()) @ w.t()
    assert within_one_bf16_rounding(y.reshape(-1, 96), exact)
    assert (y[0, 0] == 0).all()


@cpu_rowwise
@pytest.mark.parametrize("mode", MODES)
def test_backward_is_the_fp8_product_of_the_scaled_gradient_codes_and_the_base_gets_none(mode):
    lin = computed(mode)
    x = inputs()
    g = torch.randn(3, 17, 96, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    lin(x).backward(g)
    s_w = lin.row_scales().double()
    gq, s_g = quantize_rows(g.reshape(-1, 96).float() * s_w.float()[None, :])
    exact = (gq.double() * s_g.double()) @ lin.weight.double()
    assert x.grad.dtype == torch.bfloat16
    assert within_one_bf16_rounding(x.grad.reshape(-1, 192), exact)
    assert all(not p.requires_grad for p in lin.parameters())


@cpu_rowwise
@pytest.mark.parametrize("mode", MODES)
def test_against_dequantize_then_matmul_the_error_is_the_activations_e4m3_rounding(mode):
    """Relative error of output and input gradient vs FP8Linear's bf16 path on the same codes: a few
    percent (e4m3 keeps 4 significant bits), and not zero (a silent fallback would give 0)."""
    lin = computed(mode)
    reference = FP8Linear(192, 96, bias=False, mode=lin.mode)
    reference.weight, reference.weight_scale = lin.weight, lin.weight_scale
    x, x_ref = inputs(), inputs()
    g = torch.randn(3, 17, 96, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    y, y_ref = lin(x), reference(x_ref)
    y.backward(g), y_ref.backward(g)
    for a, b in ((y, y_ref), (x.grad, x_ref.grad)):
        rel = ((a.double() - b.double()).norm() / b.double().norm()).item()
        assert 0.005 < rel < 0.05, rel


@cpu_rowwise
def test_bias_is_added_in_bf16_and_autocast_bf16_takes_the_fp8_path():
    lin = computed("fp8_scaled", bias=True)
    x = inputs().detach()
    without = lin(x) - lin.bias.to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = lin(x.float())
    assert y.dtype == torch.bfloat16
    assert ((y.double() - without.double() - lin.bias.double()).abs() <= y.double().abs() * 2 * BF16_HALF_ULP + 1e-2).all()


def explicit_quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The recipe spelled out: a float32 copy, its row absmax, the quotient clamped to +-448, e4m3."""
    t32 = t.float()
    scale = (t32.abs().amax(-1, keepdim=True) / 448.0).clamp_min(torch.finfo(torch.float32).tiny)
    return (t32 / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), scale


@pytest.mark.parametrize("device", ("cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device"))))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32))
def test_quantize_rows_equals_the_explicit_recipe_bit_for_bit(dtype, device):
    """Without the float32 copy and the clamp: the same codes and scales, from 1e-40 to 1e35, with zero,
    inf and NaN rows and a row whose absmax appears with both signs."""
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randn(16, 160, generator=gen) * 10.0 ** e for e in range(-40, 36, 5)]
    t = torch.cat(rows)
    t[0], t[1, 3], t[1, 4] = 0, 7.0, -7.0
    t[2, 5], t[3, 6], t[4, 7] = float("nan"), float("inf"), -float("inf")
    t = t.to(device, dtype)
    (q, s), (q_ref, s_ref) = quantize_rows(t), explicit_quantize_rows(t)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(s.view(torch.int32), s_ref.view(torch.int32))  # NaN scales too


def code_steps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many e4m3 codes apart a and b are, element by element (within one sign, neighbouring codes are
    neighbouring bit patterns; a sign change counts its two distances to zero)."""
    def signed(q):
        bits = q.view(torch.uint8).long()
        return torch.where(bits >= 128, -(bits - 128), bits)

    return (signed(a) - signed(b)).abs()


@pytest.mark.parametrize("device", (pytest.param("cpu", marks=cpu_rowwise), pytest.param(
    "cuda", marks=pytest.mark.skipif(not fp8_gemm_available("cuda"), reason="needs a GPU with fp8 tensor cores"))))
@pytest.mark.parametrize("mode", MODES)
def test_a_compiled_layer_runs_the_fp8_gemms_of_the_codes_its_fused_quantizer_makes(mode, device):
    """torch_compile = true: inductor fuses each quantizer (row absmax, division, e4m3 cast) into one graph with
    the fp8 GEMMs (fullgraph: no break at the autograd Function or _scaled_mm). On the CPU forward and input
    gradient are within one bf16 rounding of the float64 product of the compiled quantizer's codes, and equal
    eager's bit for bit. On CUDA inductor divides in float32 with Triton's div.full (2 ulp; eager_numerics.
    division_rounding is off by default): a rare element may take the next code, so output and gradient are held
    to 2e-3 of eager's (one code step moves a row by ~0.5%; dequantize-then-matmul, a fallback, is 0.5-5% away)."""
    lin = computed(mode).to(device)
    compiled_lin, compiled_quantize = torch.compile(lin, fullgraph=True), torch.compile(quantize_rows, fullgraph=True)
    x, g = inputs().detach().to(device), torch.randn(3, 17, 96, generator=torch.Generator().manual_seed(2))
    g = g.to(torch.bfloat16).to(device)
    results = {}
    for name, call in (("eager", lin), ("compiled", compiled_lin)):
        xi = x.clone().requires_grad_(True)
        y = call(xi)
        y.backward(g)
        results[name] = (y.detach(), xi.grad)
    xq, s_x = compiled_quantize(x.reshape(-1, 192))
    xq_eager, s_x_eager = quantize_rows(x.reshape(-1, 192))
    if device == "cpu":
        s_w = lin.row_scales().double()
        gq, s_g = compiled_quantize(g.reshape(-1, 96).float() * s_w.float()[None, :])
        y, dx = results["compiled"]
        assert within_one_bf16_rounding(y.reshape(-1, 96), (xq.double() * s_x.double()) @ (
            lin.weight.double() * s_w[:, None]).t())
        assert within_one_bf16_rounding(dx.reshape(-1, 192), (gq.double() * s_g.double()) @ lin.weight.double())
        assert torch.equal(xq.view(torch.uint8), xq_eager.view(torch.uint8)) and torch.equal(s_x, s_x_eager)
        assert all(torch.equal(c, e) for c, e in zip(results["compiled"], results["eager"]))
    else:
        assert torch.allclose(s_x, s_x_eager, rtol=2.0 ** -21, atol=0)
        steps = code_steps(xq, xq_eager)
        assert steps.max() <= 1 and (steps > 0).float().mean() < 1e-3
        for c, e in zip(results["compiled"], results["eager"]):
            assert ((c.double() - e.double()).norm() / e.double().norm()).item() < 2e-3


@cpu_rowwise
@pytest.mark.parametrize("mode", MODES)
def test_per_call_work_beside_the_gemm(mode):
    """Per call (bench/fp8_compute_ops.py): the forward passes over x three times (row absmax, x / scale
    in float32, e4m3) moving 13 bytes per element, the backward four (the product with the row scales
    first; plain fp8 skips it): 23 bytes (13); nothing the size of a weight row or column is made per
    call, and the only weight-sized copy is the backward's transposed codes. Before: 6 passes and 39
    bytes forward (a float32 copy of x, abs, amax, divide, clamp, cast), 7 and 47 backward, and a per-call
    cast of the scales (fp8: torch.ones) plus torch.ones for the backward."""
    work = per_call_work(computed_layer(mode, 64, bias=False), 64)
    forward, backward = work["forward"], work["backward"]
    assert (forward.gemm, forward.passes, forward.bytes, forward.vector_ops, forward.weight_copies) == (1, 3, 13, 0, 0)
    scaled = mode != "fp8"
    assert (backward.gemm, backward.passes, backward.bytes) == (1, 3 + scaled, 13 + 10 * scaled)
    assert (backward.vector_ops, backward.weight_copies) == (0, 1)
    assert len(forward.ops) == 7 and len(backward.ops) == 8


@cpu_rowwise
def test_linears_reading_one_activation_quantize_it_once_to_the_same_bits():
    """Three Linears on each of two inputs, interleaved as Qwen-Image's joint attention calls them
    (add_q(txt), to_q(img), add_k(txt), ...): each input is quantized once (3 passes each, the GEMMs
    beside), and the outputs and input gradients equal separate copies' bit for bit. Before: 6 x 6
    passes. An input changed in place is quantized again."""
    lins = [computed("fp8_scaled", seed=s) for s in range(6)]
    img, txt = inputs(1), inputs(2)
    with OpLog(img[..., 0].numel(), 192) as log:
        shared = [lin(x) for lin, x in zip(lins, (txt, img) * 3)]
    assert log.work.gemm == 6 and log.work.passes == 2 * 3
    copies = [inputs(s) for s in (2, 1) * 3]
    alone = [lin(x) for lin, x in zip(lins, copies)]
    assert all(torch.equal(a, b) for a, b in zip(shared, alone))
    for y, x, y_alone, x_alone in zip(shared, (txt, img) * 3, alone, copies):
        g = torch.ones_like(y)
        assert torch.equal(torch.autograd.grad(y, x, g)[0], torch.autograd.grad(y_alone, x_alone, g)[0])
    x = inputs(3).detach()
    before = lins[0](x)
    x.mul_(2)
    assert torch.equal(lins[0](x), lins[0](x.clone())) and not torch.equal(lins[0](x), before)


@cpu_rowwise
def test_the_gemm_scales_stay_float32_and_follow_a_state_dict_load():
    """forward_weight_scale / backward_weight_scale, made at enable time: model.to(bf16) leaves them
    float32 (the GEMM takes no other), a load of other codes remakes them, and neither is a state key."""
    model = nn.Sequential(computed("fp8_scaled"))
    other = nn.Sequential(computed("fp8_scaled", seed=3))
    assert list(model.state_dict()) == ["0.weight", "0.weight_scale"]
    model.to(torch.bfloat16)
    assert model[0].forward_weight_scale.dtype == model[0].backward_weight_scale.dtype == torch.float32
    model.load_state_dict(other.state_dict())
    assert torch.equal(model[0].row_scales(), other[0].weight_scale.float().reshape(-1))
    x = inputs().detach()
    assert torch.equal(model(x), other(x))


def test_other_compute_dtypes_keep_the_dequantize_then_matmul_path():
    lin = computed("fp8_scaled")
    reference = FP8Linear(192, 96, bias=False, mode="fp8_scaled")
    reference.weight, reference.weight_scale = lin.weight, lin.weight_scale
    x = torch.randn(5, 192)
    assert torch.equal(lin(x), reference(x))


def test_enable_turns_the_aligned_fp8_linears_and_requantizes_block_scales_per_row():
    model = nn.Sequential(layer("fp8_scaled"), layer("fp8_scaled", out_features=40), nn.Linear(8, 8), layer("fp8"))
    q, scale = model[0].weight.clone(), model[0].weight_scale.clone()
    keys = list(model.state_dict())
    assert enable_fp8_compute(model) == 2
    assert [type(m) for m in model] == [FP8ComputeLinear, FP8Linear, nn.Linear, FP8ComputeLinear]
    assert model[0].weight_scale.shape == (96, 1) and model[0].weight_scale.dtype == torch.bfloat16
    assert list(model.state_dict()) == keys and model[1].weight_scale.shape == (40, 3)
    assert torch.equal(model[0].weight, rowwise_requantize(q, scale)[0])
    error = rowwise_requantization_error(q, scale)
    assert 0.005 < error < 0.05, error  # the outlier column makes the per-row grid coarser than the blocks'
    assert enable_fp8_compute(model) == 0  # idempotent


def test_enable_on_meta_changes_only_the_scale_shape():
    with torch.device("meta"):
        model = nn.Sequential(FP8Linear(192, 96, mode="fp8_scaled"))
    assert enable_fp8_compute(model) == 1
    assert model[0].weight.is_meta and model[0].weight_scale.shape == (96, 1)


@cpu_rowwise
def test_a_lora_trains_on_an_fp8_compute_base_and_its_file_says_so(tiny_set, tmp_path):
    """The tiny FLUX quickstart, 6 steps, fp8_scaled base, bf16 compute: with fp8_compute the losses
    follow the dequantize-then-matmul run's to within a few percent, are not the same numbers (the
    fp8 GEMMs ran) and the LoRA's header records it."""
    common = ("--mixed_precision", "bf16", "--max_train_steps", "6", "--optimizer_type", "AdamW", "--optimizer_args",
              "--learning_rate", "3e-3", "--sample_prompts", "")
    assert train_lora.main(flux_args(tiny_set, tmp_path / "bf16", *common)) == 0
    assert train_lora.main(flux_args(tiny_set, tmp_path / "fp8", *common, "--fp8_compute", "true")) == 0
    plain, fp8 = read_losses(tmp_path / "bf16"), read_losses(tmp_path / "fp8")
    assert plain != fp8
    assert all(abs(a - b) <= 0.05 * abs(b) for a, b in zip(fp8, plain)), (fp8, plain)
    with safe_open(os.path.join(tmp_path / "fp8", "tiny_flux_lora.safetensors"), "pt") as f:
        assert f.metadata()["ss_fp8_compute"] == "true"
    with safe_open(os.path.join(tmp_path / "bf16", "tiny_flux_lora.safetensors"), "pt") as f:
        assert "ss_fp8_compute" not in f.metadata()


@pytest.mark.parametrize("extra, named", [
    (("--fp8_base", "false"), "fp8_compute needs an fp8 base"),
    (("--mixed_precision", "no"), "it needs mixed_precision = \"bf16\""),
])
def test_config_refuses_fp8_compute_without_an_fp8_base_or_bf16(tiny_set, tmp_path, capsys, extra, named):
    code = train_lora.main(flux_args(tiny_set, tmp_path, "--fp8_compute", "true", *extra))
    err = capsys.readouterr().err.strip()
    assert code == 2 and named in err and "fp8_compute" in err and len(err.splitlines()) == 1


def test_config_refuses_fp8_compute_where_scaled_mm_takes_no_row_scales(tiny_set, tmp_path, capsys, monkeypatch):
    """A torch whose _scaled_mm refuses per-row scales on this device (2.11 on the CPU): one line and
    exit 2 before any step, not an internal assert from the first GEMM."""
    def per_tensor_only(*args, **kwargs):
        raise RuntimeError("Now _scaled_mm only supports per-tensor scaling for CPU backend.")

    monkeypatch.setattr(torch, "_scaled_mm", per_tensor_only)
    fp8_compute._rowwise_scaled_mm_runs.cache_clear()
    try:
        code = train_lora.main(flux_args(tiny_set, tmp_path, "--fp8_compute", "true", "--mixed_precision", "bf16"))
    finally:
        monkeypatch.undo()
        fp8_compute._rowwise_scaled_mm_runs.cache_clear()
    err = capsys.readouterr().err.strip()
    assert code == 2 and "per-row scales" in err and "fp8_compute = false" in err and len(err.splitlines()) == 1, err
    assert not list(tmp_path.glob("*.safetensors"))


# One bf16 rounding of the float64 product (plus 1e-6 of the largest output), which the CPU meets, failed on the
# H200 in all three modes (2026-12-04), though every output the failure printed (27) was the correct rounding of
# the exact value: the failing ones were near-cancelling sums, where float32 accumulation in the GPU's order
# alone errs by up to ~K 2^-24 of sum |a_k b_k|, far over that slack (Hopper's fp8 accumulation may also be
# narrower, the DeepSeek-V3 report's ~14 bits; a 13-bit truncating accumulator, emulated here, errs by 3-6e-3
# of the sum and ~1% of the whole, which the printed outputs rule out). Allowed on top of the rounding: 2^-10 of
# the sum; bench/fp8_gemm_error.py measures the device's excess in these units. A 3% scale error fails it.
FP8_ACCUMULATION = 2.0 ** -10


def within_fp8_accumulation(y: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    """y (bf16) against a @ b.T (float64): one bf16 rounding plus FP8_ACCUMULATION of sum |a_k b_k|, measured
    as bench/fp8_gemm_error.py reports it."""
    return excess_past_rounding(y, a, b)[0] <= FP8_ACCUMULATION


@pytest.mark.skipif(not fp8_gemm_available("cuda"),
                    reason="needs a GPU with fp8 tensor cores (bench/gpu_bench.sh checks runs it there)")
@pytest.mark.parametrize("mode", MODES)
def test_cuda_fp8_gemms_equal_the_same_oracle(mode):
    """cuBLASLt's row-wise fp8 GEMMs: forward and input gradient are the float64 product of the same codes
    (the CPU tests' oracle) to one bf16 rounding and the tensor cores' accumulation."""
    lin = computed(mode).cuda()
    x = inputs().detach().cuda().requires_grad_(True)
    g = torch.randn(3, 17, 96, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16).cuda()
    y = lin(x)
    y.backward(g)
    s_w = lin.row_scales().double()
    xq, s_x = quantize_rows(x.detach().reshape(-1, 192))
    w = lin.weight.double() * s_w[:, None]
    assert within_fp8_accumulation(y.reshape(-1, 96), xq.double() * s_x.double(), w)
    gq, s_g = quantize_rows(g.reshape(-1, 96).float() * s_w.float()[None, :])
    assert within_fp8_accumulation(x.grad.reshape(-1, 192), gq.double() * s_g.double(), lin.weight.double().t())
    # a wrong weight scale (per column instead of per row) is far outside the bound
    assert not within_fp8_accumulation(y.reshape(-1, 96), xq.double() * s_x.double(), w * 1.03)


@cpu_rowwise
def test_compiled_fp8_compute_blocks_swap_bit_for_bit():
    """An unset torch_compile compiles fp8_compute runs on CUDA (2026-12-04), where a 24 GB card swaps blocks:
    compiled checkpointed blocks on fp8_compute with one block swapped give the loss and LoRA gradients of the same
    compiled blocks resident, bit for bit, under bf16 autocast (the fp8 GEMMs' dtype), without recompiling; and
    fp8 GEMMs ran (the loss is not the dequantizing model's, but near it)."""
    import copy

    import torch._dynamo
    from torch._dynamo.utils import counters

    from library.models.block_swap import enable_block_swap
    from library.models.core import compile_block
    from tests.test_block_swap import step, tiny_flux, two_blocks, with_lora

    torch._dynamo.reset()
    base, family, inputs = two_blocks(tiny_flux)
    (model, net), (reference, ref_net), (plain, plain_net) = (
        with_lora(copy.deepcopy(base), family, "fp8_scaled", fp8_gemms) for fp8_gemms in (True, True, False))
    ref_net.load_state_dict(net.state_dict()), plain_net.load_state_dict(net.state_dict())
    swap = enable_block_swap(model, 1, "cpu")
    for m in (model, reference, plain):
        m.gradient_checkpointing = True
    for block in (*model.swappable_blocks(), *reference.swappable_blocks()):  # (plain: eager, for its loss alone)
        compile_block(block, backend="aot_eager")
    counters.clear()
    with torch.autocast("cpu", torch.bfloat16):
        for _ in range(2):
            loss, grads = step(model, net, inputs)
            ref_loss, ref_grads = step(reference, ref_net, inputs)
            assert torch.equal(loss, ref_loss)
            assert all(g is None and ref_grads[n] is None or torch.equal(g, ref_grads[n]) for n, g in grads.items())
        plain_loss, _ = step(plain, plain_net, inputs)
    assert sum(counters["recompiles"].values()) == 0 and counters["stats"]["unique_graphs"] > 0
    assert not swap.resident and ("load", swap.first) in swap.log
    assert loss != plain_loss and abs(loss - plain_loss) < 0.05 * plain_loss  # fp8 GEMMs, near the dequantized
