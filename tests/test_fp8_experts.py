"""fp8 storage of packed weights (library/precision/fp8_packed.py; a mixture's experts [E, K, N] used as x @ W[e]) on a
small stand-in module: codes and scales are FP8Linear's of each expert's transposed weight (the same error), the
prepared module computes as its dequantized twin, backward reaches the input with the twin's gradients and keeps no
dequantized weight, chunks change nothing, model.to(dtype) keeps the codes, streaming loads quantize as in memory,
and saved files (ours, ComfyUI's per-tensor and plain packed fp8) load back as stored."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from library.io import CheckpointError, CheckpointReader, load_streaming, save_safetensors
from library.models.spec import FP8Rules
from library.precision import fp8, fp8_packed
from library.precision.fp8 import (
    FP8Linear, bytes_per_parameter, dequantize_packed_weight, dequantize_weight, fp8_load_converter, prepare_fp8,
    quantize_module, quantize_packed_weight, quantize_weight,
)
from library.precision.fp8_checkpoints import read_fp8_checkpoint
from library.precision.fp8_packed import PackedWeights
from library.precision.stored_layouts import stored_converter, stored_extras

F8 = torch.float8_e4m3fn
RULES = FP8Rules(keep=(r"proj_in",))
E, DIM, INNER = 6, 128, 96  # `up` contracts over 128 (two blocks of 64), `down` over 96 (no block: per column)


class StandInExperts(PackedWeights):
    packed_weights = ("up", "down")

    def __init__(self, experts: int = E, dim: int = DIM, inner: int = INNER):
        super().__init__()
        self.up = nn.Parameter(torch.randn(experts, dim, inner) / dim**0.5)
        self.down = nn.Parameter(torch.randn(experts, inner, dim) / inner**0.5 * 0.05)  # small: subnormal for plain fp8

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [E, N, dim]
        out = []
        for experts in self.expert_chunks(x.dtype):
            out.append(self.packed_bmm(F.gelu(self.packed_bmm(x[experts], "up", experts)), "down", experts))
        return out[0] if len(out) == 1 else torch.cat(out)


class StandIn(nn.Module):
    """A Linear kept in high precision, one quantized, and the packed experts."""

    def __init__(self):
        super().__init__()
        self.proj_in, self.proj = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)
        self.experts = StandInExperts()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [E, N, dim]
        return self.experts(self.proj(self.proj_in(x)))


def stand_in(seed: int = 0) -> StandIn:
    torch.manual_seed(seed)
    return StandIn().requires_grad_(False)


def twin_of(model: StandIn, dtype: torch.dtype = torch.float32) -> StandIn:
    """The high-precision model holding what the (prepared) model's weights dequantize to."""
    sd = {k: v.to(dtype) for k, v in model.state_dict().items() if v.dtype != F8 and not k.endswith("_scale")}
    for name, module in model.named_modules():
        if isinstance(module, FP8Linear):
            sd[f"{name}.weight"] = module.dequantized_weight(dtype)
    for weight in StandInExperts.packed_weights:
        sd[f"experts.{weight}"] = model.experts.packed_weight(weight, dtype)
    twin = StandIn()
    twin.load_state_dict(sd)
    return twin.to(dtype).requires_grad_(False)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# ----------------------------------------------------------------------------------------------
# Quantization: FP8Linear's, expert by expert


@pytest.mark.parametrize("mode", ["fp8", "fp8_scaled"])
@pytest.mark.parametrize("k", [128, 96])  # blocks of 64 along K, and the per-column fallback
def test_packed_codes_and_scales_are_fp8linears_of_each_expert_transposed(mode, k):
    w = torch.randn(3, k, 40, dtype=torch.bfloat16) * 0.02
    codes, scale = quantize_packed_weight(w, mode)
    assert codes.shape == w.shape and codes.dtype == F8
    assert (scale is None) == (mode == "fp8")
    if scale is not None:
        assert scale.shape == ((3, k // 64, 40) if k % 64 == 0 else (3, 1, 40)) and scale.dtype == torch.bfloat16
    for e in range(3):
        q, s = quantize_weight(w[e].T, mode)
        assert torch.equal(codes[e].view(torch.uint8), q.T.view(torch.uint8))
        assert s is None or torch.equal(scale[e], s.T)
        for dtype in (torch.bfloat16, torch.float32, torch.float16):
            linear = dequantize_weight(q, s, dtype).T
            assert torch.equal(dequantize_packed_weight(codes, scale, dtype, e), linear)
            assert torch.equal(dequantize_packed_weight(codes, scale, dtype, slice(e, e + 1))[0], linear)
    assert torch.equal(dequantize_packed_weight(codes, scale, torch.float32, slice(1, 3)),
                       dequantize_packed_weight(codes, scale, torch.float32)[1:3])


def test_tensor_scaled_packed_weight_is_one_scale_for_the_whole_tensor():
    w = torch.randn(3, 64, 40) * 0.02
    codes, scale = quantize_packed_weight(w, "fp8_tensor_scaled")
    q, s = quantize_weight(w.reshape(-1, 40), "fp8_tensor_scaled")  # the same numbers as one 2-D tensor
    assert scale.shape == () and scale.dtype == torch.float32 and torch.equal(scale, s)
    assert torch.equal(codes.reshape(-1, 40).view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(dequantize_packed_weight(codes, scale, torch.bfloat16),
                       codes.to(torch.bfloat16) * scale.to(torch.bfloat16))  # ComfyUI's order and rounding
    with pytest.raises(ValueError, match="already torch.float8_e4m3fn"):
        quantize_packed_weight(codes, "fp8")
    with pytest.raises(ValueError, match=r"expected a packed weight \[E, K, N\], got shape \(64, 40\)"):
        quantize_packed_weight(w[0], "fp8")


# Measured (relative error of the weights / of x @ W, FP8Linear's the same to the last bit): N(0, 0.02) plain 0.0330 /
# 0.0330, fp8_scaled 0.0251 / 0.0252; N(0, 0.01) plain 0.0565 / 0.0572, fp8_scaled 0.0251 / 0.0252 (flat: e4m3's
# floor); N(0, 0.02) with every 32nd row of K x20 (outliers as DiT weights have) plain 0.0267, fp8_scaled 0.0132.
@pytest.mark.parametrize("std, plain_error, scaled_error", [(0.02, 0.0330, 0.0252), (0.01, 0.0572, 0.0252)])
def test_packed_error_equals_fp8linears_on_the_same_weights(std, plain_error, scaled_error):
    torch.manual_seed(0)
    w = torch.randn(4, 256, 192) * std
    x = torch.randn(4, 64, 256)
    errors = {}
    for mode in ("fp8", "fp8_scaled"):
        packed = dequantize_packed_weight(*quantize_packed_weight(w, mode), torch.float32)
        linear = torch.stack([dequantize_weight(*quantize_weight(w[e].T, mode), torch.float32).T for e in range(4)])
        assert torch.equal(packed, linear)
        linear_out = torch.stack([F.linear(x[e], linear[e].T) for e in range(4)])
        errors[mode] = (rel_err(packed, w), rel_err(torch.bmm(x, packed), torch.bmm(x, w)))
        assert rel_err(linear_out, torch.bmm(x, w)) == pytest.approx(errors[mode][1], rel=1e-4)
    print(f"std {std}: weight / output relative error "
          + ", ".join(f"{m} {a:.4f} / {b:.4f}" for m, (a, b) in errors.items()))
    assert errors["fp8"][1] == pytest.approx(plain_error, abs=0.002)
    assert errors["fp8_scaled"][1] == pytest.approx(scaled_error, abs=0.002)


# ----------------------------------------------------------------------------------------------
# The prepared module


# Measured against the float32 weights (three quantized matmuls: proj, up, down, whose weights are small): plain
# 0.116, fp8_scaled 0.045, fp8_tensor_scaled 0.046.
@pytest.mark.parametrize("mode, expected_error", [("fp8", 0.116), ("fp8_scaled", 0.045), ("fp8_tensor_scaled", 0.046)])
def test_prepared_module_computes_as_its_dequantized_twin(mode, expected_error):
    """The same output (1e-6, fp32) as the high-precision model holding the dequantized weights, at fp8's cost from
    the float32 weights; the kept Linear stays nn.Linear, the packed weights become buffers."""
    model = stand_in()
    reference = twin_of(model)  # before quantizing: the high-precision weights
    quantize_module(model, mode, RULES)
    assert type(model.proj_in) is nn.Linear and isinstance(model.proj, FP8Linear)
    assert model.experts.packed_modes == {"up": mode, "down": mode}
    assert model.experts.up.dtype == F8 and "up" not in dict(model.experts.named_parameters())
    x = torch.randn(E, 10, DIM)
    out = model(x)
    assert (out - twin_of(model)(x)).abs().max().item() <= 1e-6 * out.abs().max().item()
    error = rel_err(out, reference(x))
    print(f"{mode}: output error against the float32 weights {error:.4f}")
    assert error == pytest.approx(expected_error, abs=0.005)


def test_backward_gives_the_twins_input_gradients_and_keeps_no_dequantized_weight():
    """The experts' fp8 weights are dequantized again in backward: no saved tensor has a weight's shape (a bmm on
    plain weights would save them), and the input gradient is the twin's; the base gets none."""
    model = quantize_module(stand_in(), "fp8_scaled", RULES)
    twin = twin_of(model)
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    x = torch.randn(E, 10, DIM, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model.experts(x)
    weight_shapes = {(E, DIM, INNER), (E, INNER, DIM), (DIM, INNER), (INNER, DIM)}
    assert saved and not weight_shapes & set(saved), saved
    out.square().sum().backward()
    x_twin = x.detach().clone().requires_grad_(True)
    twin.experts(x_twin).square().sum().backward()
    assert (x.grad - x_twin.grad).abs().max().item() <= 1e-6 * x_twin.grad.abs().max().item()
    assert all(t.grad is None for t in model.experts.buffers())
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        twin.experts.requires_grad_(False)(x_twin)
    assert weight_shapes & set(saved)  # the test can tell: plain frozen weights are saved by bmm


def test_chunks_change_nothing_and_stay_within_the_byte_bound(monkeypatch):
    """One expert a chunk (the bound below one expert's weight) gives the output and gradients of one chunk of all
    (to float32 rounding); the released size's chunks keep one weight's dequantized chunk within 128 MiB."""
    model = quantize_module(stand_in(), "fp8_scaled", RULES)
    x = torch.randn(E, 10, DIM, requires_grad=True)
    whole = model.experts(x)
    (grad_whole,) = torch.autograd.grad(whole.square().sum(), x)
    assert model.experts.expert_chunks(torch.float32) == [slice(0, E)]
    monkeypatch.setattr(fp8_packed, "DEQUANTIZED_CHUNK_BYTES", 1)
    assert model.experts.expert_chunks(torch.float32) == [slice(e, e + 1) for e in range(E)]
    chunked = model.experts(x)
    (grad_chunked,) = torch.autograd.grad(chunked.square().sum(), x)
    # float32 rounding only (a bmm of one expert blocks its sums otherwise than one of six): measured 1.2e-7 / 2e-7
    for a, b in ((chunked, whole), (grad_chunked, grad_whole)):
        assert (a - b).abs().max().item() <= 1e-6 * b.abs().max().item()
    monkeypatch.undo()
    with torch.device("meta"):
        released = StandInExperts(experts=64, dim=2048, inner=2 * 1344)
    released.quantize_packed("up", "fp8_scaled")
    chunks = released.expert_chunks(torch.bfloat16)
    sizes = [c.stop - c.start for c in chunks]
    assert sizes == [12] * 5 + [4]
    assert max(sizes) * 2048 * 2688 * 2 <= fp8_packed.DEQUANTIZED_CHUNK_BYTES  # 132 MB


def test_autocast_dequantizes_in_its_dtype():
    model = quantize_module(stand_in(), "fp8_scaled", RULES)
    x = torch.randn(E, 10, DIM)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = model.experts(x)
    assert y.dtype == torch.bfloat16 and torch.equal(y, model.experts(x.to(torch.bfloat16)))


def test_fsdp_shards_the_codes_and_scales_as_frozen_parameters():
    """FSDP shards parameters and replicates buffers: the codes and scales become frozen Parameters (the same
    tensors), and the module computes as before."""
    from library.training.fsdp import stored_buffers_to_parameters

    model = quantize_module(stand_in(), "fp8_scaled", RULES)
    x = torch.randn(E, 4, DIM)
    expected, state = model(x), {k: v.clone() for k, v in model.state_dict().items()}
    assert stored_buffers_to_parameters(model) == 2 + 4  # proj's weight and scale, the experts' codes and scales
    params = dict(model.experts.named_parameters())
    assert sorted(params) == ["down", "down_scale", "up", "up_scale"]
    assert not any(p.requires_grad for p in params.values())
    assert all(torch.equal(v.view(torch.uint8), state[k].view(torch.uint8)) for k, v in model.state_dict().items())
    assert torch.equal(model(x), expected)


def test_model_to_dtype_keeps_codes_and_scales():
    model = quantize_module(stand_in(), "fp8_scaled", RULES)
    codes, scale = model.experts.up.clone(), model.experts.up_scale.clone()
    for convert in (lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.float()):
        convert(model)
        assert model.experts.up.dtype == F8 and model.experts.up_scale.dtype == torch.bfloat16
        assert torch.equal(model.experts.up.view(torch.uint8), codes.view(torch.uint8))
        assert torch.equal(model.experts.up_scale, scale)
    assert model.proj_in.weight.dtype == torch.float32  # the last convert was .float()
    meta = prepare_fp8(StandIn().to("meta"), "fp8_scaled", RULES).to_empty(device="cpu")
    assert meta.experts.down.dtype == F8 and meta.experts.down.device.type == "cpu"
    assert meta.experts.down_scale.shape == (E, 1, DIM) and meta.experts.down_scale.dtype == torch.bfloat16


# ----------------------------------------------------------------------------------------------
# Loading and saving


def test_meta_prepare_gives_the_shapes_and_bytes_the_planner_counts():
    model = prepare_fp8(StandIn().to("meta"), "fp8_scaled", RULES)
    experts = model.experts
    assert {n: (tuple(b.shape), b.dtype) for n, b in experts.named_buffers()} == {
        "up": ((E, DIM, INNER), F8), "up_scale": ((E, DIM // 64, INNER), torch.bfloat16),
        "down": ((E, INNER, DIM), F8), "down_scale": ((E, 1, DIM), torch.bfloat16)}
    up_bytes, down_bytes = E * DIM * INNER * (1 + 2 / 64), E * INNER * DIM * (1 + 2 / INNER)  # scales: bf16
    assert bytes_per_parameter(experts) == pytest.approx((up_bytes + down_bytes) / (2 * E * DIM * INNER))
    with torch.device("meta"):
        large = StandInExperts(experts=8, dim=2048, inner=2688)
    assert bytes_per_parameter(prepare_fp8(large, "fp8_scaled", RULES)) == 1 + 2 / 64  # 1.03125 bytes a weight
    with pytest.raises(ValueError, match="already stored in fp8_scaled"):
        large.quantize_packed("up", "fp8")
    kept = prepare_fp8(StandIn().to("meta"), "fp8", FP8Rules(keep=(r"proj_in", r"experts\.down")))
    assert kept.experts.packed_modes == {"up": "fp8"} and kept.experts.down.dtype == torch.float32


@pytest.mark.parametrize("mode", ["fp8", "fp8_scaled"])
def test_streaming_load_quantizes_the_experts_as_in_memory(tmp_path, mode):
    source = stand_in().to(torch.bfloat16)
    path = str(tmp_path / "bf16.safetensors")
    save_safetensors(source.state_dict(), path)
    streamed = prepare_fp8(StandIn().to("meta"), mode, RULES)
    load_streaming(streamed, CheckpointReader(path), rename=lambda k: k, dtype=torch.bfloat16,
                   convert=fp8_load_converter(streamed, mode))
    expected = quantize_module(source, mode, RULES).state_dict()
    got = streamed.state_dict()
    assert sorted(got) == sorted(expected)
    assert all(got[k].dtype == expected[k].dtype and torch.equal(got[k], expected[k]) for k in expected)
    with pytest.raises(ValueError, match=r"prepared with \['fp8_scaled'\], not 'fp8'"):
        fp8_load_converter(prepare_fp8(StandIn().to("meta"), "fp8_scaled", RULES), "fp8")
    with pytest.raises(CheckpointError, match="'experts.up' is already torch.float8_e4m3fn"):
        fp8_load_converter(prepare_fp8(StandIn().to("meta"), mode, RULES))("experts.up", got["experts.up"])


def load_as_stored(path: str, dtype: torch.dtype = torch.float32) -> StandIn:
    """What a family loader does with a pre-quantized file (stored_layouts): the layout from the header, the meta
    model prepared as the file stores it, every tensor streamed through the converter."""
    reader = CheckpointReader(path)
    info = read_fp8_checkpoint(reader, path)
    model = StandIn().to("meta")
    assert all(stored_extras(info)(k) for k in reader.keys() if k not in model.state_dict())
    convert = stored_converter(model, info, RULES, dtype, reader, path)
    load_streaming(model, reader, rename=lambda k: k, dtype=dtype, convert=convert)
    return model


@pytest.mark.parametrize("mode", ["fp8", "fp8_scaled"])  # the layouts we write (per tensor: ComfyUI's, below)
def test_a_saved_fp8_model_loads_back_bit_for_bit(tmp_path, mode):
    model = quantize_module(stand_in(), mode, RULES)
    path = str(tmp_path / f"{mode}.safetensors")
    save_safetensors(model.state_dict(), path)
    again = load_as_stored(path)
    assert again.experts.packed_modes == model.experts.packed_modes
    for key, value in model.state_dict().items():
        got = again.state_dict()[key]
        assert got.dtype == value.dtype and torch.equal(got.view(torch.uint8), value.view(torch.uint8)), key
    x = torch.randn(E, 4, DIM)
    assert torch.equal(again(x), model(x))


def test_comfyui_packed_fp8_experts_load_as_stored(tmp_path):
    """ComfyUI's packed experts: e4m3 with one float32 scale (`_scale`, `.scale_weight` or `.weight_scale`), or plain;
    dequantized as ComfyUI does (codes.to(dtype) * scale.to(dtype)). A bf16 packed weight beside them stays bf16."""
    source = stand_in()
    sd = {k: v.to(torch.bfloat16) for k, v in source.state_dict().items()}
    up, scale = quantize_packed_weight(source.experts.up, "fp8_tensor_scaled")
    for suffix in ("_scale", ".scale_weight", ".weight_scale"):
        path = str(tmp_path / f"comfy{suffix}.safetensors")
        save_safetensors({**sd, "experts.up": up, "experts.up" + suffix: scale}, path)
        model = load_as_stored(path, torch.bfloat16)
        assert model.experts.packed_modes == {"up": "fp8_tensor_scaled"} and model.experts.down.dtype == torch.bfloat16
        assert torch.equal(model.experts.up.view(torch.uint8), up.view(torch.uint8))
        assert torch.equal(model.experts.packed_weight("up", torch.bfloat16),
                           up.to(torch.bfloat16) * scale.to(torch.bfloat16))
    plain = str(tmp_path / "plain.safetensors")
    save_safetensors({**sd, "experts.up": sd["experts.up"].to(F8)}, plain)
    model = load_as_stored(plain, torch.bfloat16)
    assert model.experts.packed_modes == {"up": "fp8"}
    assert torch.equal(model.experts.packed_weight("up", torch.bfloat16), sd["experts.up"].to(F8).to(torch.bfloat16))


def test_a_packed_scale_of_another_shape_is_one_line(tmp_path):
    model = quantize_module(stand_in(), "fp8_scaled", RULES)
    sd = model.state_dict()
    path = str(tmp_path / "bad.safetensors")
    save_safetensors({**sd, "experts.up_scale": sd["experts.up_scale"][:, :1]}, path)
    with pytest.raises(CheckpointError, match=r"'experts.up_scale' has shape \(6, 1, 96\): a packed fp8 weight "
                                              r"\(6, 128, 96\) is read with one scale per tensor, or bf16 block "
                                              r"scales \(6, 2, 96\)"):
        read_fp8_checkpoint(CheckpointReader(path), path)
    save_safetensors({**sd, "experts.up.scale_weight": torch.ones(())}, path)
    with pytest.raises(CheckpointError, match=r"'experts.up' has 2 scales"):
        read_fp8_checkpoint(CheckpointReader(path), path)
    assert fp8.PACKED_SCALE_SUFFIX == "_scale"
