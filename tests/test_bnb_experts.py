"""nf4 / nf4_dq / int8 storage of packed weights (a mixture's experts [E, K, N] used as x @ W[e]; fp8_packed.py
PackedWeights, bnb_weights.py packed_shapes): each expert's codes are bitsandbytes' own (quantize_4bit of W[e],
int8_vectorwise_quant of the Linear weight W[e]^T), they dequantize as the Linear path does, the prepared module
computes as the float bmm on those dequantized weights and keeps none of them for backward, a LoRA of the experts
on an nf4 base of the tiny Nucleus-Image trains as on its dequantized twin, and the state dict, a streaming load
and the planner's meta model hold the stored tensors."""

import pytest
import torch
import torch.nn as nn

from library.io import CheckpointError, CheckpointReader, load_streaming, save_safetensors
from library.precision import bnb_weights as bnb
from library.precision import fp8_packed
from library.precision.bnb_weights import bnb_load_converter, prepare_bnb
from tests.test_fp8_experts import DIM, E, INNER, RULES, StandIn, StandInExperts, rel_err, stand_in

MODES = ("nf4", "nf4_dq", "int8")


def bnbf():
    import bitsandbytes.functional as functional

    return functional


def expert_reference(w: torch.Tensor, mode: str, dtype: torch.dtype) -> torch.Tensor:
    """[E, K, N] in `dtype`: each expert quantized and dequantized on its own by the Linear path (quantize_nf4 /
    dequantize_nf4 of W[e]; quantize_int8 / dequantize_int8 of the Linear weight W[e]^T), not by the packed code."""
    out = []
    for e in range(w.shape[0]):
        if mode == "int8":
            stored = bnb.quantize_int8(w[e].T)
            out.append(bnb.dequantize_int8(w[e].T.shape, dtype, *stored.values()).T)
        else:
            stored = bnb.quantize_nf4(w[e], double_quant=mode == "nf4_dq")
            out.append(bnb.dequantize_nf4(w[e].shape, dtype, *stored.values()))
    return torch.stack(out)


# ----------------------------------------------------------------------------------------------
# Quantization: bitsandbytes' own, expert by expert


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("k, n", [(128, 96), (96, 128)])  # N = 96: rows off nf4's block of 64 (the flat count)
def test_packed_codes_are_bitsandbytes_own_of_each_expert(mode, k, n):
    torch.manual_seed(0)
    w = torch.randn(3, k, n, dtype=torch.bfloat16) * 0.02
    stored = bnb.quantize_packed(w, mode)
    assert {s: (tuple(t.shape), t.dtype) for s, t in stored.items()} == bnb.packed_shapes(3, k, n, mode)
    for e in range(3):
        if mode == "int8":  # the Linear of expert e is W[e]^T [N, K]: one absmax per output n over K
            q, absmax, _ = bnbf().int8_vectorwise_quant(w[e].T.float(), threshold=0.0)
            assert torch.equal(stored[""][e], q.T) and torch.equal(stored["_absmax"][e], absmax)
        else:
            packed, state = bnbf().quantize_4bit(w[e].float(), blocksize=64, quant_type="nf4",
                                                 compress_statistics=mode == "nf4_dq")
            assert torch.equal(stored[""][e], packed.reshape(-1))
            assert torch.equal(stored["_absmax"][e], state.absmax)
            if mode == "nf4_dq":
                assert torch.equal(stored["_absmax_scale"][e], state.state2.absmax)
                assert torch.equal(stored["_absmax_offset"][e], state.offset.reshape(()))
        for dtype in (torch.bfloat16, torch.float32, torch.float16):
            linear = expert_reference(w[e : e + 1], mode, dtype)[0]
            assert torch.equal(bnb.dequantize_packed(mode, (3, k, n), dtype, e, *stored.values()), linear)
            assert torch.equal(bnb.dequantize_packed(mode, (3, k, n), dtype, slice(e, 3), *stored.values())[0], linear)


def test_nf4_experts_decode_by_qloras_table_over_each_experts_flat_weight():
    """Independent of bitsandbytes' kernels: expert e's byte i holds its weights 2i and 2i+1 (row-major [K, N]), each
    the NormalFloat level times the absmax of its block of 64 counted over that expert's flat weight."""
    torch.manual_seed(1)
    w = torch.randn(2, 96, 40)  # 3840 weights an expert: 60 blocks, rows of 40 straddle them
    stored = bnb.quantize_packed(w, "nf4")
    table = bnbf().get_4bit_type("nf4", device="cpu")
    for e in range(2):
        codes = stored[""][e]
        levels = table[torch.stack([codes >> 4, codes & 0x0F], dim=1).reshape(-1).long()]
        expected = (levels * stored["_absmax"][e].repeat_interleave(64)).reshape(96, 40)
        assert torch.equal(bnb.dequantize_packed("nf4", (2, 96, 40), torch.float32, e, *stored.values()), expected)


# Measured, N(0, 0.02) experts [4, 256, 192], x [4, 64, 256] (weights / x @ W, relative): nf4 0.0919 / 0.0924,
# nf4_dq 0.0919 / 0.0924, int8 0.0062 / 0.0062 (fp8_scaled 0.0251 / 0.0252, test_fp8_experts.py).
@pytest.mark.parametrize("mode, weight_error", [("nf4", 0.0919), ("nf4_dq", 0.0919), ("int8", 0.0062)])
def test_packed_error_is_the_formats(mode, weight_error):
    torch.manual_seed(0)
    w, x = torch.randn(4, 256, 192) * 0.02, torch.randn(4, 64, 256)
    stored = bnb.quantize_packed(w, mode)
    packed = bnb.dequantize_packed(mode, tuple(w.shape), torch.float32, slice(None), *stored.values())
    errors = rel_err(packed, w), rel_err(torch.bmm(x, packed), torch.bmm(x, w))
    print(f"{mode}: weight / output relative error {errors[0]:.4f} / {errors[1]:.4f}")
    assert errors[0] == pytest.approx(weight_error, abs=0.002) and errors[1] == pytest.approx(weight_error, abs=0.002)


# ----------------------------------------------------------------------------------------------
# The prepared module


def experts_reference(source: StandIn, mode: str, x: torch.Tensor) -> torch.Tensor:
    """The stand-in's experts as float bmm's on the weights expert_reference dequantizes from `source`'s."""
    up, down = (expert_reference(getattr(source.experts, n).detach(), mode, torch.float32) for n in ("up", "down"))
    return torch.bmm(nn.functional.gelu(torch.bmm(x, up)), down)


@pytest.mark.parametrize("mode", MODES)
def test_prepared_experts_compute_the_float_bmm_of_their_dequantized_weights(mode, monkeypatch):
    """prepare_bnb stores the experts (and the quantized Linear) in `mode`; their output equals the float32 bmm's on
    the reference's dequantized weights to rounding, one chunk of all experts or one expert a chunk; the input
    gradient too, and autograd saves no weight-sized tensor."""
    source = stand_in()
    model = prepare_bnb(stand_in(), mode, RULES)
    assert model.experts.packed_modes == {"up": mode, "down": mode} and type(model.proj_in) is nn.Linear
    assert "up" not in dict(model.experts.named_parameters()) and model.experts.packed_shape("up") == (E, DIM, INNER)
    x = torch.randn(E, 10, DIM)
    want = experts_reference(source, mode, x)
    print(f"{mode}: experts' output against the float32 weights {rel_err(want, source.experts(x)):.4f}")
    saved = []
    for chunk_bytes in (fp8_packed.DEQUANTIZED_CHUNK_BYTES, 1):
        monkeypatch.setattr(fp8_packed, "DEQUANTIZED_CHUNK_BYTES", chunk_bytes)
        assert len(model.experts.expert_chunks(torch.float32)) == (1 if chunk_bytes > 1 else E)
        x_grad = x.clone().requires_grad_(True)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
            got = model.experts(x_grad)
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()
        (grad,) = torch.autograd.grad(got.square().sum(), x_grad)
        x_ref = x.clone().requires_grad_(True)
        (grad_ref,) = torch.autograd.grad(experts_reference(source, mode, x_ref).square().sum(), x_ref)
        assert (grad - grad_ref).abs().max() <= 1e-5 * grad_ref.abs().max()
    weight_shapes = {(e, DIM, INNER) for e in (1, E)} | {(e, INNER, DIM) for e in (1, E)}
    assert saved and not weight_shapes & set(saved), saved
    assert all(t.grad is None for t in model.experts.buffers())


def test_model_to_dtype_keeps_the_stored_tensors_and_a_state_dict_round_trips():
    model = prepare_bnb(stand_in(), "nf4_dq", RULES)
    before = {k: v.clone() for k, v in model.experts.state_dict().items()}
    assert sorted(before) == sorted(f"{w}{s}" for w in ("up", "down") for s in ("", "_absmax", "_absmax_scale",
                                                                                 "_absmax_offset"))
    model.to(torch.bfloat16)
    after = model.experts.state_dict()
    assert all(after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in before.items())
    fresh = prepare_bnb(StandIn().to("meta"), "nf4_dq", RULES).to_empty(device="cpu")
    fresh.load_state_dict(model.state_dict())
    fresh.to(torch.bfloat16)
    x = torch.randn(E, 4, DIM, dtype=torch.bfloat16)
    assert torch.equal(fresh(x), model(x))
    bad = {**model.state_dict(), "experts.up_absmax": model.experts.up_absmax.float()}
    with pytest.raises(CheckpointError, match=r"'experts.up_absmax': a packed weight stored in nf4_dq expects "
                                              r"torch.uint8, got torch.float32; load high-precision checkpoints "
                                              r"through bnb_load_converter\(model\)"):
        fresh.load_state_dict(bad)


def test_fsdp_shards_the_stored_tensors_as_frozen_parameters():
    from library.training.fsdp import stored_buffers_to_parameters

    model = prepare_bnb(stand_in(), "int8", RULES)
    x = torch.randn(E, 4, DIM)
    expected = model(x)
    assert stored_buffers_to_parameters(model) == 2 + 4  # proj's weight and absmax, the experts' codes and absmaxes
    assert sorted(dict(model.experts.named_parameters())) == ["down", "down_absmax", "up", "up_absmax"]
    assert torch.equal(model(x), expected)


# ----------------------------------------------------------------------------------------------
# Loading and planning


@pytest.mark.parametrize("mode", MODES)
def test_streaming_load_quantizes_the_experts_as_in_memory(tmp_path, mode):
    source = stand_in().to(torch.bfloat16)
    path = str(tmp_path / "bf16.safetensors")
    save_safetensors(source.state_dict(), path)
    streamed = prepare_bnb(StandIn().to("meta"), mode, RULES)
    convert = bnb_load_converter(streamed)
    assert convert.keep_dtype("experts.up") and convert.packed == {"experts.up": mode, "experts.down": mode}
    load_streaming(streamed, CheckpointReader(path), rename=lambda k: k, dtype=torch.bfloat16, convert=convert)
    expected = prepare_bnb(source, mode, RULES).state_dict()
    got = streamed.state_dict()
    assert sorted(got) == sorted(expected)
    assert all(got[k].dtype == expected[k].dtype and torch.equal(got[k], expected[k]) for k in expected)
    with pytest.raises(CheckpointError, match=rf"'experts.up' is torch.uint8: {mode} quantizes bf16/fp16/fp32"):
        convert("experts.up", torch.zeros(4, dtype=torch.uint8))


@pytest.mark.parametrize("mode", MODES)
def test_meta_prepare_holds_the_bytes_the_planner_counts(mode):
    """The meta model prepared for `mode` (what the planner counts) holds packed_shapes' tensors; at the released
    expert shapes nf4 is 0.5625 bytes a weight, nf4_dq 0.5159 (+4 bytes an expert), int8 1 + 4 / K."""
    from library.training.memory_plan import module_bytes

    meta = prepare_bnb(StandIn().to("meta"), mode, RULES)
    assert {n: (tuple(b.shape), b.dtype) for n, b in meta.experts.named_buffers()} == {
        f"{w}{s}": spec for w, shape in (("up", (E, DIM, INNER)), ("down", (E, INNER, DIM)))
        for s, spec in bnb.packed_shapes(*shape, mode).items()}
    with torch.device("meta"):
        released = StandInExperts(experts=64, dim=2048, inner=2688)  # gate_up [64, 2048, 2688]
    prepare_bnb(released, mode, RULES)
    up_bytes = sum(b.numel() * b.element_size() for n, b in released.named_buffers() if n.startswith("up"))
    expected = {"nf4": 0.5625, "nf4_dq": 0.5 + 1 / 64 + 4 / (64 * 256) + 4 / (2048 * 2688),
                "int8": 1 + 4 / 2048}[mode]
    assert up_bytes == pytest.approx(64 * 2048 * 2688 * expected, rel=1e-12)
    assert module_bytes(released) == up_bytes + sum(
        b.numel() * b.element_size() for n, b in released.named_buffers() if n.startswith("down"))


# ----------------------------------------------------------------------------------------------
# Training the experts' LoRA on an nf4 base


def dequantized_twin(model: nn.Module, twin: nn.Module) -> nn.Module:
    """`twin` (the same architecture in float32) given what `model`'s quantized Linears and experts dequantize to."""
    from library.precision.fp8_packed import PackedWeights

    sd = twin.state_dict()
    for name, module in model.named_modules():
        if isinstance(module, bnb._BnbLinear):
            sd[f"{name}.weight"] = module.dequantized_weight(torch.float32)
        elif isinstance(module, PackedWeights):
            sd.update({f"{name}.{w}": module.packed_weight(w, torch.float32) for w in module.packed_weights})
    twin.load_state_dict(sd)
    return twin.requires_grad_(False)


@pytest.mark.parametrize("mode", ["nf4", "int8"])
def test_an_experts_lora_step_on_a_quantized_base_trains_as_on_its_dequantized_twin(mode):
    """The tiny Nucleus-Image (3 MoE blocks of 8 experts, gate_up [8, 128, 96]) prepared for `mode` by its fp8 keep
    rules, a LoRA with experts_dim 2 (and the default Linears) on it: one step's loss and every LoRA factor's gradient
    equal those of the same LoRA on the float32 model holding the dequantized weights (measured: bit for bit)."""
    from library.models.nucleus_image.spec import FP8 as NUCLEUS_RULES
    from networks.lora import LoRANetwork, PackedLoRAModule
    from tests.test_nucleus_image_model import inputs, ours_from, tiny_diffusers

    reference = tiny_diffusers()
    model = prepare_bnb(ours_from(reference).requires_grad_(False), mode, NUCLEUS_RULES)
    experts = [m for m in model.modules() if isinstance(m, fp8_packed.PackedWeights)]
    assert len(experts) == 3 and all(m.packed_modes == {"gate_up_proj": mode, "down_proj": mode} for m in experts)
    twin = dequantized_twin(model, ours_from(reference))
    nets = [LoRANetwork(m, "nucleus_image", 4, network_args={"experts_dim": 2}) for m in (model, twin)]
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # random ups: a zero up gives the downs no gradient
        for lora in nets[0].lora_modules():
            lora.lora_up.weight.copy_(torch.randn(lora.lora_up.weight.shape, generator=g) * 0.1)
    nets[1].load_state_dict(nets[0].state_dict())
    losses, grads = [], []
    for m, net in zip((model, twin), nets):
        net.apply()
        loss = m(**inputs()).square().mean()
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad for n, p in net.named_parameters()})
    packed = [n for n, p in nets[0].named_parameters() if ".experts." in n or "_experts_" in n]
    assert len(packed) == 12 and all(grads[0][n].abs().max() > 0 for n in packed)
    assert sum(isinstance(lora, PackedLoRAModule) for lora in nets[0].lora_modules()) == 6
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    worst = max(((grads[0][n] - grads[1][n]).abs().max() / grads[1][n].abs().max()).item() for n in grads[1])
    print(f"{mode}: LoRA step on the quantized base vs its dequantized twin: loss {losses[0]:.6f} / {losses[1]:.6f}, "
          f"worst gradient difference {worst:.1e} (relative)")
    assert worst <= 1e-5


def test_a_bf16_nucleus_file_loads_with_its_experts_quantized_and_the_planners_meta_load_matches(tmp_path):
    """load_nucleus_image with the family's nf4 hook (library/models/family.py fp8_prepare) quantizes the experts
    while loading, bit for bit as prepare_bnb does in memory; the planner's meta load (read_weights=False) holds the
    same names, shapes and dtypes."""
    from safetensors.torch import save_file

    from library.models.family import fp8_prepare
    from library.models.nucleus_image.checkpoint import load_nucleus_image
    from library.models.nucleus_image.spec import FP8 as NUCLEUS_RULES
    from tests.test_nucleus_image_model import ours_from, tiny_diffusers

    reference = tiny_diffusers()
    path = str(tmp_path / "nucleus_bf16.safetensors")
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in reference.state_dict().items()}, path)
    loaded = load_nucleus_image(path, dtype=torch.bfloat16, prepare=fp8_prepare("nf4", "nucleus_image"))
    expected = prepare_bnb(ours_from(reference).to(torch.bfloat16), "nf4", NUCLEUS_RULES).state_dict()
    got = loaded.state_dict()
    assert got.keys() == expected.keys()
    assert all(got[k].dtype == v.dtype and torch.equal(got[k], v) for k, v in expected.items())
    assert got["transformer_blocks.3.img_mlp.experts.gate_up_proj"].shape == (8, 128 * 96 // 2)
    planned = load_nucleus_image(path, dtype=torch.bfloat16, prepare=fp8_prepare("nf4", "nucleus_image"),
                                 read_weights=False)
    assert {k: (v.shape, v.dtype) for k, v in planned.state_dict().items()} == \
        {k: (v.shape, v.dtype) for k, v in got.items()}
