"""nf4 / nf4_dq / int8 base weights through bitsandbytes (library/precision/bnb_weights.py): the
stored tensors are bitsandbytes' own (and decode by its nf4 table as QLoRA defines it), the weight
dequantizes bit for bit as bitsandbytes does, a tiny FLUX.1 loaded with `base_precision` computes
exactly as its dequantized float32 twin (forward and input gradients), LoRA / DoRA / LoKr train over
it from a config, block swap changes no gradient bit, and the config keys agree or fail in one line."""

import bitsandbytes.functional as bnbf
import pytest
import torch
import torch.nn as nn
from safetensors import safe_open

import train_lora
from library.errors import ConfigError
from library.io import CheckpointReader
from library.models.block_swap import enable_block_swap
from library.models.family import fp8_prepare
from library.models.flux1.checkpoint import load_flux
from library.models.registry import LOWBIT_PRECISIONS
from library.precision import bnb_weights as bnb
from library.training.config import base_precision, load_config
from tests.test_gguf import flux_inputs_for
from tests.test_merge_convert import lora, run
from tests.test_reliability import flux_args, one_error_line

MODES = bnb.MODES


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[t.dtype])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def test_the_modes_are_the_configs_lowbit_precisions():
    assert MODES == LOWBIT_PRECISIONS


def bnb_reference(w: torch.Tensor, mode: str, dtype: torch.dtype) -> torch.Tensor:
    """bitsandbytes alone, from the float32 weight: quantize and dequantize with its functional API."""
    if mode == "int8":
        q, stats, _ = bnbf.int8_vectorwise_quant(w.float())
        return bnbf.int8_vectorwise_dequant(q, stats).to(dtype)
    q, state = bnbf.quantize_4bit(w.float(), blocksize=64, quant_type="nf4", compress_statistics=mode == "nf4_dq")
    state.dtype = dtype
    return bnbf.dequantize_4bit(q, state)


@pytest.mark.parametrize("mode", MODES)
def test_dequantization_is_bitsandbytes_own_bit_for_bit(mode):
    w = torch.randn(48, 320) * 0.02  # 48 * 320 = 240 blocks of 64: the double-quant block of 256 is partial
    w[3, 64:128] = 0.0  # an all-zero block
    layer = bnb.from_linear(nn.Linear(320, 48).requires_grad_(False).eval().to(torch.float32), mode)
    layer.load_quantized(bnb.quantize(w, mode))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        ours = layer.dequantized_weight(dtype)
        assert same_bits(ours, bnb_reference(w, mode, dtype)), (mode, dtype)
        # one rounding: the low-precision weight is the float32 one rounded once
        assert same_bits(ours, layer.dequantized_weight(torch.float32).to(dtype)), (mode, dtype)
    assert torch.all(layer.dequantized_weight(torch.float32)[3, 64:128] == 0)
    # model.to(bf16) and a state-dict round trip keep every stored tensor and its dtype
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    layer.to(torch.bfloat16)
    after = layer.state_dict()
    assert all(after[k].dtype == before[k].dtype and torch.equal(after[k], before[k]) for k in before if k != "bias")
    fresh = bnb.empty_layer(320, 48, True, mode)
    fresh.load_state_dict(after)
    assert same_bits(fresh.dequantized_weight(torch.float32), layer.dequantized_weight(torch.float32))


# (12, 96) and (5, 40): rows off the block of 64 (a packed expert's [K, N] with N = 96 is one), where bitsandbytes
# 0.50's CPU kernel counted its blocks per row and read other blocks' absmaxes: the [12, 96] weight dequantized 0.26
# off (relative) instead of nf4's 0.093 before dequantize_nf4 read such weights as one flat row.
@pytest.mark.parametrize("shape", [(8, 128), (12, 96), (5, 40)])
def test_nf4_codes_decode_by_qloras_table_high_nibble_first(shape):
    """Independent of bitsandbytes' kernels: byte i holds weights 2i (high nibble) and 2i+1 (low), each
    the NormalFloat level (QLoRA's table of 16) times its block of 64's absmax (float32), blocks of 64 counted
    over the flat weight (as quantize_4bit and the CUDA kernel count them) whatever the row length."""
    nf4 = torch.tensor([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                        -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                        0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                        0.7229568362236023, 1.0])  # fmt: skip
    w = torch.randn(shape)
    stored = bnb.quantize_nf4(w)
    codes = stored["weight"].reshape(-1)
    levels = nf4[torch.stack([codes >> 4, codes & 0x0F], dim=1).reshape(-1).long()]
    expected = (levels * stored["weight_absmax"].repeat_interleave(64)[: w.numel()]).reshape(shape)
    for dtype in (torch.float32, torch.bfloat16):
        got = bnb.dequantize_nf4(shape, dtype, stored["weight"], stored["weight_absmax"])
        assert got.shape == shape and same_bits(got, expected.to(dtype)), dtype
    # and the codes are the nearest levels: the error of each weight is at most half its level gap x absmax
    assert (expected - w).abs().max() <= 0.5 * 0.3208 * w.abs().max()


def test_int8_is_row_absmax_over_127_and_a_zero_row_stays_zero():
    w = torch.randn(4, 64)
    w[2] = 0.0
    stored = bnb.quantize_int8(w)
    assert torch.equal(stored["weight_absmax"], w.abs().amax(1))
    assert torch.equal(stored["weight"], torch.round(w * (127.0 / w.abs().amax(1, keepdim=True))).nan_to_num(0).to(torch.int8))
    assert torch.all(bnb.dequantize_int8((4, 64), torch.float32, **{k[7:] or "weight": v for k, v in stored.items()})[2] == 0)


@pytest.mark.parametrize("mode, bytes_per_weight", [("nf4", 0.5625), ("nf4_dq", 0.5159), ("int8", 1.0013)])
def test_bytes_per_weight_of_a_3072_square_linear(mode, bytes_per_weight):
    layer = bnb.from_linear(nn.Linear(3072, 3072, bias=False, device="meta"), mode)
    stored = sum(b.numel() * b.element_size() for b in layer.buffers())
    assert stored / 3072**2 == bnb.bytes_per_weight(mode) == pytest.approx(bytes_per_weight, abs=5e-5)


# ----------------------------------------------------------------------------------------------
# The tiny FLUX.1 loaded in each mode


@pytest.fixture(scope="module")
def loaded(tiny_set):
    """{mode: the tiny FLUX.1 loaded from its bf16-free BFL file with that base precision (fp32 compute)}."""
    return {mode: load_flux(tiny_set["flux_bfl"], prepare=fp8_prepare(mode, "flux")).requires_grad_(False).eval()
            for mode in MODES}


def dequantized_twin(model: nn.Module, path: str) -> nn.Module:
    """The model with every quantized layer replaced by an nn.Linear holding its float32 weight."""
    twin = load_flux(path).requires_grad_(False).eval()
    with torch.no_grad():
        for name, m in model.named_modules():
            if isinstance(m, bnb._BnbLinear):
                twin.get_submodule(name).weight.copy_(m.dequantized_weight(torch.float32))
    return twin


@pytest.mark.parametrize("mode", MODES)
def test_loading_quantizes_each_weight_as_read_with_the_keep_rules_of_fp8(loaded, tiny_set, mode):
    model, reader = loaded[mode], CheckpointReader(tiny_set["flux_bfl"])
    layers = {n: m for n, m in model.named_modules() if isinstance(m, bnb._BnbLinear)}
    fp8_layers = {n for n, m in load_flux(tiny_set["flux_bfl"], prepare=fp8_prepare("fp8_scaled", "flux")).named_modules()
                  if type(m).__name__ == "FP8Linear"}
    assert set(layers) == fp8_layers and len(layers) > 10  # the same Linears as fp8 (img_in, final layer, ... kept)
    for name, layer in layers.items():
        expected = bnb.quantize(reader.get(f"{name}.weight"), mode)
        assert all(torch.equal(getattr(layer, k), v) and getattr(layer, k).dtype == v.dtype for k, v in expected.items())


@pytest.mark.parametrize("mode", MODES)
def test_forward_and_input_grads_equal_the_dequantized_float32_model(loaded, tiny_set, mode):
    model = loaded[mode]
    twin = dequantized_twin(model, tiny_set["flux_bfl"])
    inputs = flux_inputs_for(model)
    assert torch.equal(run(model, inputs), run(twin, inputs))
    grads = []
    for m in (model, twin):
        img = inputs["img"].clone().requires_grad_(True)
        m(**{**inputs, "img": img}).square().mean().backward()
        grads.append(img.grad)
    assert torch.equal(grads[0], grads[1]) and grads[0].abs().sum() > 0


def test_gradients_reach_the_lora_only_and_block_swap_and_checkpointing_give_the_same_bits(tiny_set):
    path = tiny_set["flux_bfl"]
    results = []
    for swap, checkpointing in ((0, False), (2, False), (0, True)):
        model = load_flux(path, prepare=fp8_prepare("nf4", "flux")).requires_grad_(False)
        model.gradient_checkpointing = checkpointing  # the recompute unpacks the saved codes again
        inputs = flux_inputs_for(model)
        net = lora(model, "flux", rank=4, alpha=4.0, seed=1)
        net.apply()
        net.train()
        if swap:
            enable_block_swap(model, swap, "cpu")
        model(**inputs).square().mean().backward()
        assert all(p.grad is None for p in model.parameters()) and not any(b.requires_grad for b in model.buffers())
        grads = {n: p.grad for n, p in net.named_parameters()}
        assert sum(g is not None and g.abs().sum() > 0 for g in grads.values()) > len(grads) // 2
        results.append(grads)
    for other in results[1:]:
        assert all(torch.equal(results[0][k], other[k]) for k in results[0] if results[0][k] is not None)


# ----------------------------------------------------------------------------------------------
# Training from a config


@pytest.mark.parametrize("mode, network", [("nf4", []), ("int8", ["--network_args", "dora=True"]),
                                           ("nf4_dq", ["--network_module", "lycoris.kohya", "--network_args", "algo=lokr",
                                                       "factor=4"])])
def test_lora_dora_and_lokr_train_over_the_base_and_record_its_precision(tiny_set, tmp_path, mode, network):
    out = tmp_path / "out"
    assert train_lora.main(flux_args(tiny_set, out, "--fp8_base", "false", "--base_precision", mode,
                                     "--max_train_steps", "2", *network)) == 0
    with safe_open(str(out / "tiny_flux_lora.safetensors"), framework="pt") as f:
        assert f.metadata()["ss_base_precision"] == mode
        keys = list(f.keys())
        trained = [f.get_tensor(k) for k in keys if k.endswith((".lora_up.weight", ".lokr_w2"))]
    assert any(k.endswith(".dora_scale") for k in keys) == ("dora=True" in network)
    assert trained and sum(t.abs().sum() > 0 for t in trained) > len(trained) // 2  # the up halves left zero


def test_base_precision_and_the_fp8_keys_agree_or_fail_in_one_line(tiny_set, tmp_path, capsys):
    args = load_config(flux_args(tiny_set, tmp_path, "--fp8_base", "false", "--base_precision", "int8"))
    assert base_precision(args) == "int8" and not args.fp8_base
    args = load_config(flux_args(tiny_set, tmp_path, "--base_precision", "fp8_scaled"))  # quickstart: fp8_base = true
    assert base_precision(args) == "fp8_scaled" and args.fp8_base and args.fp8_scaled
    assert base_precision(load_config(flux_args(tiny_set, tmp_path))) == "fp8_scaled"  # the old keys alone
    with pytest.raises(ConfigError, match=r'base_precision = "nf4" and fp8_base = true and fp8_scaled = true ask for two '
                                          r"different bases \(nf4 vs fp8_scaled\); set base_precision alone"):
        load_config(flux_args(tiny_set, tmp_path, "--base_precision", "nf4"))
    with pytest.raises(ConfigError, match=r'base_precision = "fp8" and fp8_base = true and fp8_scaled = true'):
        load_config(flux_args(tiny_set, tmp_path, "--base_precision", "fp8"))
    line = one_error_line(capsys, train_lora.main(flux_args(tiny_set, tmp_path, "--base_precision", "int4")))
    assert "key 'base_precision' must be one of bf16, fp8, fp8_scaled, nf4, nf4_dq, int8, got 'int4'" in line


@pytest.mark.parametrize("base", ["nf4", "int8", "gguf"])
def test_lycoris_wraps_every_target_of_a_quantized_base(loaded, tiny_set, tmp_path, base):
    """Every LoRA target of an nf4 / int8 / GGUF base gets its LyCORIS module, through the nn.Linear view
    (LyCORIS wraps nn.Linear only: GGUFLinear targets were silently left out before the view took
    any quantized Linear), and LoKr's output is the one it gives on the dequantized float32 twin."""
    from networks.lora import LoRANetwork
    from networks.lycoris_network import LycorisNetwork
    from tests.test_gguf import dequantized_twin as gguf_twin, tiny_gguf

    if base == "gguf":
        model = load_flux(tiny_gguf(tiny_set, tmp_path / "flux1-tiny-Q8_0.gguf")[0]).requires_grad_(False).eval()
        twin = gguf_twin(model)
    else:
        model, twin = loaded[base], dequantized_twin(loaded[base], tiny_set["flux_bfl"])
    targets = len(LoRANetwork(model, "flux", rank=4, alpha=4.0).lora_modules())
    net = LycorisNetwork(model, "flux", 4, 2.0, network_args={"algo": "lokr", "factor": 4})
    assert len(net.lycoris_modules()) == len(net._fp8_targets) == targets > 10
    twin_net = LycorisNetwork(twin, "flux", 4, 2.0, network_args={"algo": "lokr", "factor": 4})
    torch.manual_seed(3)
    with torch.no_grad():
        for p in twin_net.parameters():
            p.normal_(0, 0.1)
    net.load_weights(twin_net.state_dict())
    inputs = flux_inputs_for(model)
    net.apply(), twin_net.apply()
    try:
        assert (run(model, inputs) - run(twin, inputs)).abs().max() < 1e-5
    finally:
        net.remove(), twin_net.remove()


@pytest.mark.parametrize("mode", MODES)
def test_the_planner_holds_the_formats_bytes_for_a_full_size_preset(mode):
    """FLUX.1-dev on meta as the planner builds it: the base is the bf16 one less 2 bytes per weight of
    every Linear fp8's keep rules quantize, plus that Linear's stored bytes (bytes_per_weight)."""
    from library.training.memory_plan import module_bytes
    from tools.plan_memory import PresetFamily

    family = PresetFamily("flux1-dev")
    bf16, quantized = (family.load_transformer(torch.bfloat16, p) for p in ("bf16", mode))
    layers = [m for m in quantized.modules() if isinstance(m, bnb._BnbLinear)]
    weights = sum(m.in_features * m.out_features for m in layers)
    stored = sum(m.in_features * m.out_features * bnb.bytes_per_weight(mode, m.out_features, m.in_features) for m in layers)
    assert module_bytes(quantized) == module_bytes(bf16) - 2 * weights + stored
    assert weights / sum(p.numel() for p in bf16.parameters()) > 0.99  # nearly every weight is quantized


@pytest.mark.parametrize("suffix, kind", [(".weight.quant_state.bitsandbytes__nf4", "nf4"), (".SCB", "int8")])
def test_a_checkpoint_stored_by_bitsandbytes_is_refused_naming_its_key(tmp_path, suffix, kind):
    """lllyasviel's flux1-dev-bnb-nf4 layout (packed uint8 [n/2, 1] weights beside their quant_state): the
    old loader said only "key '...proj.weight' has shape (2048, 1), the model expects (64, 64)"."""
    from library.models.flux1.model import Flux
    from tests.test_fp8_checkpoints import one_line_refusal, quantized_linears, write_comfy
    from tests.test_merge_convert import FLUX_CFG

    model = Flux(FLUX_CFG)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for layer in quantized_linears(model, "flux"):
        n = sd[f"{layer}.weight"].numel()
        sd[f"{layer}.weight"] = torch.zeros(n // 2, 1, dtype=torch.uint8)
        sd[f"{layer}.weight.absmax"] = torch.ones(n // 64)
        sd[layer + suffix] = torch.zeros(8, dtype=torch.uint8)
    path = write_comfy(sd, tmp_path / "bnb.safetensors", "flux", prefix="", bundled=False)
    first = next(k for k in CheckpointReader(path).keys() if k.endswith(suffix))
    refusal = rf"bnb.safetensors: '{first}' shows a checkpoint stored by bitsandbytes \({kind}\)"
    one_line_refusal(path, load_flux, refusal)
    # merge_lora: the old line said "LoRA for '...proj.weight' gives a delta of shape (64, 64), the checkpoint weight is (2048, 1)"
    from tools.merge_lora import open_base

    one_line_refusal(path, open_base, refusal + r", which is not read; merge_lora reads bf16 / fp16 / fp32 / fp8 bases: "
                     r"give the bf16 checkpoint$")
    # extract_lora and lora_info --model open bases here too: the line names the tool run, not merge_lora
    one_line_refusal(path, lambda p: open_base(p, "extract_lora"), refusal + r", which is not read; extract_lora reads")
