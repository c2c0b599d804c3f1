"""GGUF base files (library/precision/gguf_weights.py, library/io.py's GGUF reading): every block
type dequantizes bit for bit as `gguf.quants.dequantize`; a tiny FLUX.1 written with gguf's own
GGUFWriter (Q8_0 block Linears, Q4_K MLP outputs, F32 for the rest, as ComfyUI-GGUF's files) loads
as stored, computes as its dequantized float32 twin, trains a LoRA (the layout in its metadata),
swaps blocks, and is planned at its real bytes; other types are refused in one line."""

import json

import gguf
import numpy as np
import pytest
import torch
import torch.nn as nn
from gguf import GGMLQuantizationType as T
from safetensors import safe_open
from safetensors.torch import load_file as load_file_tensors

import train_lora
from library.io import CheckpointError, CheckpointReader
from library.models.block_swap import enable_block_swap
from library.models.flux1.checkpoint import load_flux
from library.models.flux1.model import Flux
from library.precision.gguf_weights import GGUF_TYPES, GGUFLinear, dequantize
from tests.test_merge_convert import flux_inputs, lora, run
from tests.test_reliability import flux_args, one_error_line

# Byte offsets of each type's fp16 scales in a block: random bytes there could be inf / NaN.
SCALE_OFFSETS = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q4_K": [0, 2], "Q5_K": [0, 2],
                 "Q6_K": [208], "Q3_K": [108], "Q2_K": [80, 82], "IQ4_NL": [0], "IQ4_XS": [0]}  # fmt: skip
QUANTIZABLE = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")  # what gguf.quants.quantize writes; K-quants: random blocks


def random_blocks(qtype: str, rows: int, cols: int, seed: int, scale: float = 0.01) -> torch.Tensor:
    """Valid random `qtype` blocks for an [rows, cols] weight (uint8 [rows, row bytes]): every code
    byte random, the fp16 scales finite, of either sign, around `scale`."""
    kind = GGUF_TYPES[qtype]
    g = torch.Generator().manual_seed(seed)
    b = torch.randint(0, 256, (rows * cols // kind.block, kind.block_bytes), dtype=torch.uint8, generator=g)
    for offset in SCALE_OFFSETS[qtype]:
        b[:, offset : offset + 2] = (torch.randn(b.shape[0], 1, generator=g) * scale).half().view(torch.uint8)
    return b.reshape(rows, -1)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype == torch.float32 and a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def reference(packed: torch.Tensor, qtype: str) -> torch.Tensor:
    """gguf's own numpy dequantization, float32."""
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(packed.numpy(), T[qtype])))


@pytest.mark.parametrize("qtype", list(GGUF_TYPES))
def test_every_block_type_dequantizes_bit_for_bit_as_gguf(qtype):
    kind = GGUF_TYPES[qtype]
    assert gguf.GGML_QUANT_SIZES[T[qtype]] == (kind.block, kind.block_bytes)
    rows, cols = 7, kind.block * 3
    packed = random_blocks(qtype, rows, cols, seed=len(qtype) + kind.block_bytes)
    assert same_bits(dequantize(packed, qtype, (rows, cols)), reference(packed, qtype))
    if qtype in QUANTIZABLE:  # weights as gguf itself quantizes them, zero blocks included
        w = np.random.default_rng(1).normal(0, 0.02, (rows, cols)).astype(np.float32)
        w[0, : kind.block] = 0
        packed = torch.from_numpy(gguf.quants.quantize(w, T[qtype]))
        got = dequantize(packed, qtype, (rows, cols))
        assert same_bits(got, reference(packed, qtype))
        assert (got - torch.from_numpy(w)).abs().max() < 0.02  # and it is a quantization of w
    assert dequantize(packed, qtype, (rows, cols), torch.bfloat16).equal(reference(packed, qtype).to(torch.bfloat16))


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16"])
def test_float_types_dequantize_bit_for_bit_as_gguf(qtype):
    w = np.random.default_rng(2).normal(0, 1, (5, 8)).astype(np.float32)
    raw = {"F32": w, "F16": w.astype(np.float16), "BF16": gguf.quants.quantize(w, T.BF16)}[qtype]
    packed = torch.from_numpy(raw.view(np.uint8).copy())
    assert same_bits(dequantize(packed, qtype, (5, 8)), reference(packed, qtype).reshape(5, 8))


# ----------------------------------------------------------------------------------------------
# A tiny FLUX.1 as a ComfyUI-GGUF file


def write_gguf(sd: dict[str, torch.Tensor], path, types: dict[str, str], metadata: dict[str, str] | None = None,
               prefix: str = "") -> str:
    """`sd` through gguf's GGUFWriter: keys in `types` (key -> ggml type, or uint8 blocks given as
    they are) block-quantized, the rest F32, as city96's convert.py keeps norms, biases and
    embedders. Returns the path."""
    writer = gguf.GGUFWriter(str(path), arch="tiny")
    for key, value in (metadata or {}).items():
        writer.add_string(key, value)
    for key, tensor in sd.items():
        qtype = types.get(key)
        if qtype is None:
            writer.add_tensor(prefix + key, tensor.detach().float().numpy())
        else:
            packed = tensor if tensor.dtype == torch.uint8 else torch.from_numpy(gguf.quants.quantize(tensor.float().numpy(), T[qtype]))
            writer.add_tensor(prefix + key, packed.numpy(), raw_dtype=T[qtype])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def gguf_types(model: nn.Module) -> dict[str, str]:
    """Q4_K for the MLP outputs (256 inputs: one super-block per row), Q8_0 for every other Linear of
    the blocks; embedders and the final layer stay F32."""
    types = {}
    for name, m in model.named_modules():
        if type(m) is nn.Linear and name.startswith(("double_blocks.", "single_blocks.")):
            types[f"{name}.weight"] = "Q4_K" if m.in_features % 256 == 0 else "Q8_0"
    return types


def tiny_gguf(tiny_set, path, prefix: str = "") -> tuple[str, dict[str, str]]:
    model = load_flux(tiny_set["flux_bfl"])
    sd, types = dict(model.state_dict()), gguf_types(model)
    for i, key in enumerate(k for k, t in types.items() if t == "Q4_K"):  # gguf cannot quantize K-quants
        out, inputs = sd[key].shape
        sd[key] = random_blocks("Q4_K", out, inputs, seed=10 + i, scale=1e-4)
    config = CheckpointReader(tiny_set["flux_bfl"]).metadata["flux_config"]
    return write_gguf(sd, path, types, {"flux_config": config}, prefix), types


@pytest.fixture(scope="module")
def flux_gguf(tiny_set, tmp_path_factory):
    return tiny_gguf(tiny_set, tmp_path_factory.mktemp("gguf") / "flux1-tiny-Q8_0.gguf")


def test_the_reader_gives_torch_shapes_ggml_types_and_the_stored_bytes(flux_gguf, tiny_set):
    path, types = flux_gguf
    reader, source = CheckpointReader(path), CheckpointReader(tiny_set["flux_bfl"])
    assert sorted(reader.keys()) == sorted(source.keys()) and reader.metadata["flux_config"] == source.metadata["flux_config"]
    raw = {t.name: t for t in gguf.GGUFReader(path).tensors}
    for key in reader.keys():
        assert reader.shape(key) == source.shape(key) == tuple(reversed(raw[key].shape.tolist()))  # ggml: innermost first
        assert reader.dtype_name(key) == types.get(key, "F32") == raw[key].tensor_type.name
        assert reader.is_block_quantized(key) == (key in types)
        assert torch.equal(reader.get(key), torch.from_numpy(np.array(raw[key].data)))  # the stored values / blocks


def test_loaded_weights_are_ggufs_dequantization_and_the_rest_loads_as_usual(flux_gguf):
    path, types = flux_gguf
    model, reader = load_flux(path), CheckpointReader(path)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, GGUFLinear)}
    assert {f"{n}.weight" for n in layers} == set(types) and {m.qtype for m in layers.values()} == {"Q8_0", "Q4_K"}
    for name, layer in layers.items():
        assert layer.weight.dtype == torch.uint8 and torch.equal(layer.weight, reader.get(f"{name}.weight"))
        assert same_bits(layer.dequantized_weight(torch.float32), reference(layer.weight, layer.qtype))
    for key, value in model.state_dict().items():
        if key not in types:
            assert value.dtype == torch.float32 and torch.equal(value, reader.get(key))


def dequantized_twin(model: nn.Module) -> nn.Module:
    """The same model with every GGUFLinear replaced by an nn.Linear holding its float32 weight."""
    with torch.device("meta"):
        twin = type(model)(model.config)
    sd = {}
    for key, value in model.state_dict().items():
        layer = model.get_submodule(key.rsplit(".", 1)[0])
        sd[key] = layer.dequantized_weight(torch.float32) if isinstance(layer, GGUFLinear) and key.endswith("weight") else value
    twin.load_state_dict(sd, assign=True)
    return twin.eval()


def test_forward_and_input_grads_equal_the_dequantized_float32_model(flux_gguf, tiny_set, tmp_path):
    path, _ = flux_gguf
    model = load_flux(path).eval()
    twin = dequantized_twin(model)
    inputs = flux_inputs_for(model)
    assert torch.equal(run(model, inputs), run(twin, inputs))
    grads = []
    for m in (model, twin):
        img = inputs["img"].clone().requires_grad_(True)
        m(**{**inputs, "img": img}).square().mean().backward()
        grads.append(img.grad)
    assert torch.equal(grads[0], grads[1])
    # The ComfyUI prefix (model.diffusion_model.) is read too, as for safetensors files
    prefixed, _ = tiny_gguf(tiny_set, tmp_path / "prefixed.gguf", prefix="model.diffusion_model.")
    assert torch.equal(run(load_flux(prefixed).eval(), inputs), run(twin, inputs))


def flux_inputs_for(model: Flux) -> dict:
    cfg, g = model.config, torch.Generator().manual_seed(5)
    inputs = flux_inputs()
    inputs["txt"] = torch.randn(1, 8, cfg.context_in_dim, generator=g)
    inputs["y"] = torch.randn(1, cfg.vec_in_dim, generator=g)
    inputs["img"] = torch.randn(1, 16, cfg.in_channels, generator=g)
    inputs["guidance"] = torch.tensor([1.0])
    return inputs


def test_gradients_reach_the_lora_only_and_block_swap_gives_the_same_step(flux_gguf):
    path, _ = flux_gguf
    inputs = flux_inputs_for(load_flux(path))
    results = []
    for swap in (0, 2):
        model = load_flux(path).requires_grad_(False)
        net = lora(model, "flux", rank=4, alpha=4.0, seed=1)
        net.apply()
        if swap:
            enable_block_swap(model, swap, "cpu")
        model(**inputs).square().mean().backward()
        assert all(p.grad is None for p in model.parameters()) and not any(b.requires_grad for b in model.buffers())
        grads = {n: p.grad for n, p in net.named_parameters()}
        assert sum(g is not None and g.abs().sum() > 0 for g in grads.values()) > len(grads) // 2
        results.append(grads)
    assert all(torch.equal(results[0][k], results[1][k]) for k in results[0] if results[0][k] is not None)


def test_a_lora_trains_over_a_gguf_base_and_records_its_layout(flux_gguf, tiny_set, tmp_path, capsys):
    path, _ = flux_gguf
    out = tmp_path / "out"
    capsys.readouterr()
    line = one_error_line(capsys, train_lora.main(flux_args(tiny_set, out, "--pretrained_model_name_or_path", path)))
    assert "stores a pre-quantized gguf_q8_0+q4_k base (used as it is), but the config asks for fp8_scaled; set " \
           "fp8_base = false" in line, line
    assert train_lora.main(flux_args(tiny_set, out, "--pretrained_model_name_or_path", path, "--fp8_base", "false",
                                     "--max_train_steps", "2")) == 0
    with safe_open(str(out / "tiny_flux_lora.safetensors"), framework="pt") as f:
        assert f.metadata()["ss_base_precision"] == "gguf_q8_0+q4_k"


def test_a_plain_fp8_configs_advice_on_a_gguf_base_is_one_that_passes(flux_gguf, tiny_set, tmp_path, capsys):
    """fp8_base = true with fp8_scaled = false (sd-scripts' plain cast) on a GGUF base was told "set fp8_base =
    false", which the idle-key check then refused (fp8_scaled = false without fp8_base): the advice drops both."""
    path, _ = flux_gguf
    args = flux_args(tiny_set, tmp_path / "out", "--pretrained_model_name_or_path", path, "--fp8_scaled", "false")
    line = one_error_line(capsys, train_lora.main(args))
    assert "asks for fp8; set fp8_base = false without fp8_scaled = false (what gguf" in line, line


def test_fp8_compute_on_a_gguf_base_is_refused_for_itself_not_sent_round_the_precision_advice(flux_gguf, tiny_set,
                                                                                                tmp_path, capsys):
    """fp8_compute = true on a GGUF base was told "set fp8_base = false", which fp8_compute's own check then
    refused ("needs an fp8 base"): a loop. The first line now names fp8_compute, which has no fp8 codes to run."""
    from tests.test_fp8_checkpoints import assert_fp8_compute_refused

    assert_fp8_compute_refused(tiny_set, tmp_path, capsys, flux_gguf[0], "gguf_q8_0+q4_k")


@pytest.mark.parametrize("mlps", [("Q2_K", "Q3_K"), ("IQ4_XS", "IQ4_NL")])
def test_low_bit_files_q2_k_q3_k_and_iq4_load_as_ggufs_own_dequantization(tiny_set, tmp_path, mlps):
    """city96's Q2_K and Q3_K_S files (Q2_K / Q3_K MLPs) and IQ4_NL / IQ4_XS files (ComfyUI-GGUF reads them),
    refused until these kernels: the layers hold the blocks, dequantize to exactly gguf's float32 and
    compute as that float32 model."""
    model = load_flux(tiny_set["flux_bfl"])
    sd = dict(model.state_dict())
    types = {"double_blocks.0.img_mlp.2.weight": mlps[0], "double_blocks.0.txt_mlp.2.weight": mlps[1],
             "single_blocks.0.linear2.weight": "IQ4_NL"}  # 256, 256 and 320 inputs
    for i, (key, qtype) in enumerate(types.items()):
        sd[key] = random_blocks(qtype, *sd[key].shape, seed=30 + i, scale=1e-3)
    config = CheckpointReader(tiny_set["flux_bfl"]).metadata["flux_config"]
    loaded = load_flux(write_gguf(sd, tmp_path / f"flux1-tiny-{mlps[0]}.gguf", types, {"flux_config": config})).eval()
    for key, qtype in types.items():
        layer = loaded.get_submodule(key[: -len(".weight")])
        assert isinstance(layer, GGUFLinear) and layer.qtype == qtype
        assert same_bits(layer.dequantized_weight(torch.float32), reference(sd[key], qtype).reshape(layer.out_features, -1))
    inputs = flux_inputs_for(loaded)
    assert torch.equal(run(loaded, inputs), run(dequantized_twin(loaded), inputs))


def test_other_ggml_types_are_refused_in_one_line_naming_the_tensor_and_type(tiny_set, tmp_path):
    model = load_flux(tiny_set["flux_bfl"])
    sd, key = dict(model.state_dict()), "double_blocks.0.img_mlp.2.weight"
    out, inputs = sd[key].shape
    sd[key] = torch.randint(0, 256, (out, inputs // 256 * gguf.GGML_QUANT_SIZES[T.IQ2_XXS][1]), dtype=torch.uint8)
    config = CheckpointReader(tiny_set["flux_bfl"]).metadata["flux_config"]
    path = write_gguf(sd, tmp_path / "iq2xxs.gguf", {key: "IQ2_XXS"}, {"flux_config": config})
    with pytest.raises(CheckpointError) as info:
        load_flux(path)
    message = str(info.value)
    assert f"iq2xxs.gguf: tensor '{key}' is GGUF type IQ2_XXS; only Q8_0, Q4_0" in message and "\n" not in message
    (tmp_path / "bad.gguf").write_bytes(b"GGUF" + b"\0" * 10)
    with pytest.raises(CheckpointError, match=r"bad.gguf: not a readable GGUF file"):
        CheckpointReader(str(tmp_path / "bad.gguf"))


def test_a_truncated_or_another_models_gguf_is_named_as_such(flux_gguf, tiny_set, tmp_path):
    """A cut file read 'not a readable GGUF file (cannot reshape array ...)'; another model's GGUF was sent to
    merge into a BFL file (FLUX.1 given Z-Image's) or called a Krea 2 file (Krea 2 given FLUX.1's)."""
    from library.models.krea2.checkpoint import load_krea2

    with open(flux_gguf[0], "rb") as f:
        data = f.read()
    (tmp_path / "cut.gguf").write_bytes(data[:-1000])
    with pytest.raises(CheckpointError, match=r"cut.gguf: not a readable GGUF file \(truncated, or not GGUF: "):
        CheckpointReader(str(tmp_path / "cut.gguf"))
    with pytest.raises(CheckpointError, match=r"flux1-tiny-Q8_0.gguf: not a Krea 2 transformer"):
        load_krea2(flux_gguf[0])
    sd = load_file_tensors(tiny_set["zimage"])
    path = write_gguf(sd, tmp_path / "zimage.gguf", {k: "Q8_0" for k, v in sd.items() if v.dim() == 2 and v.shape[1] % 32 == 0})
    with pytest.raises(CheckpointError, match=r"zimage.gguf: not a FLUX.1 transformer"):
        load_flux(path)


def test_planned_weight_bytes_are_the_buffers_bytes(flux_gguf, tiny_set):
    from library.models.flux1.family import FluxFamily
    from library.training.memory_plan import module_bytes

    path, types = flux_gguf
    family = FluxFamily(path, tiny_set["flux_vae_single"], clip_l=tiny_set["clip_l"], t5xxl=tiny_set["t5xxl"])
    planned, loaded = family.load_transformer(torch.float32, read_weights=False), family.load_transformer(torch.float32)
    assert module_bytes(planned) == module_bytes(loaded)
    assert [module_bytes(b) for b in planned.swappable_blocks()] == [module_bytes(b) for b in loaded.swappable_blocks()]
    reader = CheckpointReader(path)
    stored = sum(reader.numel([k]) * (GGUF_TYPES[t].bytes_per_parameter if (t := types.get(k)) else 4) for k in reader.keys())
    assert module_bytes(loaded) == stored  # 34/32 bytes per Q8_0 weight, 144/256 per Q4_K, 4 per F32


def test_plan_memory_plans_a_gguf_file_in_its_stored_layout_only(flux_gguf, tiny_set, tmp_path, capsys):
    from tests.test_memory_plan import write_config
    from tools import plan_memory

    config = write_config(tmp_path / "gguf.toml", model_type="flux", pretrained_model_name_or_path=flux_gguf[0],
                          ae=tiny_set["flux_vae_single"], clip_l=tiny_set["clip_l"], t5xxl=tiny_set["t5xxl"],
                          dataset_config=tiny_set["dataset_config"], output_dir=str(tmp_path / "out"))
    assert plan_memory.main(["--config_file", config, "--vram", "12"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "gradient_checkpointing=" in line]
    rows = [line.split()[0] for line in lines if "with checkpoint_saves" not in line]
    assert rows == ["gguf_q8_0+q4_k", "gguf_q8_0+q4_k"]
    for key in ("checkpoint_saves_projections", "checkpoint_saves_attention"):  # (FLUX.1's gates train)
        assert [line.split()[0] for line in lines if key in line] == ["gguf_q8_0+q4_k"]


@pytest.mark.parametrize("qtype", ["Q8_0", "Q6_K", "Q5_K", "Q4_K", "Q4_0"])
def test_a_preset_planned_as_gguf_holds_its_types_bytes_per_weight(qtype):
    """The planner's GGUF model quantizes the Linears the writer quantizes (the family's GgufLayout):
    every 2-D weight but the unquantized embedders and final layer, the per-block modulation included."""
    from library.models.registry import arch_spec
    from library.precision.gguf_writer import prepare_gguf_like
    from library.training.memory_plan import module_bytes
    from tests.test_merge_convert import FLUX_CFG

    with torch.device("meta"):
        model = prepare_gguf_like(Flux(FLUX_CFG), qtype, arch_spec("flux").gguf)
    kind, kept = GGUF_TYPES[qtype], arch_spec("flux").gguf.unquantized
    layers = {n: m for n, m in model.named_modules() if isinstance(m, GGUFLinear)}
    expected = {n for n, m in model.named_modules() if isinstance(m, (nn.Linear, GGUFLinear))
                and not (n + ".").startswith(kept) and m.in_features % kind.block == 0}
    assert set(layers) == expected and ("double_blocks.0.img_mod.lin" in layers) == (kind.block == 32)  # 64 inputs
    for layer in layers.values():
        weights = layer.in_features * layer.out_features
        assert module_bytes(layer) == weights * kind.bytes_per_parameter + 4 * layer.out_features  # + the f32 bias
    assert {q: GGUF_TYPES[q].bytes_per_parameter for q in GGUF_TYPES} == {
        "Q8_0": 1.0625, "Q4_0": 0.5625, "Q4_1": 0.625, "Q5_0": 0.6875, "Q5_1": 0.75, "Q4_K": 0.5625, "Q5_K": 0.6875,
        "Q6_K": 0.8203125, "Q3_K": 0.4296875, "Q2_K": 0.328125, "IQ4_NL": 0.5625, "IQ4_XS": 0.53125}


def test_a_preset_planned_as_gguf_keeps_flux2s_shared_modulation_as_the_files_do():
    """FLUX.2's three shared modulation Linears stay BF16 in ComfyUI-GGUF's files (its auto_convert
    branch's "flux" rules, flux2/spec.py GGUF), so the planner keeps them unquantized too."""
    from tools import plan_memory

    family = plan_memory.PresetFamily("flux2-klein-4b", "Q8_0")
    model = family.load_transformer(torch.bfloat16)
    assert not isinstance(model.double_stream_modulation_img.lin, GGUFLinear)
    assert not isinstance(model.single_stream_modulation.lin, GGUFLinear)
    assert not isinstance(model.final_layer.linear, GGUFLinear)
    assert isinstance(model.double_blocks[0].img_mlp[0], GGUFLinear)


def test_plan_memory_refuses_a_gguf_type_it_cannot_read_in_one_line(capsys):
    from tools import plan_memory

    line = one_error_line(capsys, plan_memory.main(["--preset", "flux1-dev", "--gguf", "IQ2_XXS"]))
    assert line == ("error: --gguf IQ2_XXS: not a GGUF block type we read (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, "
                    "Q6_K, Q3_K, Q2_K, IQ4_NL, IQ4_XS)")


def test_merge_lora_refuses_a_gguf_base_in_one_line(flux_gguf, tmp_path, capsys):
    from tests.test_merge_convert import merge

    net = lora(load_flux(flux_gguf[0]), "flux", rank=4, alpha=4.0, seed=1)
    net.save(str(tmp_path / "l.safetensors"))
    capsys.readouterr()
    line = one_error_line(capsys, merge("--model", flux_gguf[0], "--lora", tmp_path / "l.safetensors",
                                        "--save_to", tmp_path / "m.safetensors"))
    assert "flux1-tiny-Q8_0.gguf: a GGUF base; merge_lora reads bf16 / fp16 / fp32 / fp8 bases" in line, line


def test_extract_lora_refuses_a_gguf_base_naming_itself_not_merge_lora(flux_gguf, tiny_set, tmp_path, capsys):
    """open_base is shared: the old line of every tool said "merge_lora reads ... merge into the bf16 checkpoint"."""
    from tools import extract_lora

    capsys.readouterr()
    line = one_error_line(capsys, extract_lora.main(["--model", flux_gguf[0], "--tuned", tiny_set["flux_bfl"],
                                                     "--save_to", str(tmp_path / "e.safetensors"), "--rank", "4"]))
    assert line.endswith("flux1-tiny-Q8_0.gguf: a GGUF base; extract_lora reads bf16 / fp16 / fp32 / fp8 bases: pass that "
                         "model's checkpoint in one of those"), line


def test_lora_info_checks_a_lora_against_a_gguf_base_by_its_logical_shapes(flux_gguf, tiny_set, tmp_path, capsys):
    """lora_info refused a GGUF base with merge_lora's refusal, though names and shapes are all its check reads;
    its blocks' packed byte shapes ([64, 68] for a Q8_0 [64, 64]) are not the weights' shapes."""
    from networks import lora_files
    from tools import lora_info

    path, types = flux_gguf
    lora(load_flux(tiny_set["flux_bfl"]), "flux", rank=4, alpha=4.0, seed=1).save(str(tmp_path / "l.safetensors"))
    wrong = {"double_blocks.0.img_attn.proj": lora_files.LoRAWeights(torch.ones(4, 32), torch.ones(64, 4), 4.0)}
    lora_files.write_kohya(wrong, str(tmp_path / "wrong.safetensors"))
    assert "double_blocks.0.img_attn.proj.weight" in types  # stored in blocks: packed bytes, not [64, 64]
    checked = {}
    for name in ("l", "wrong"):
        capsys.readouterr()
        assert lora_info.main([str(tmp_path / f"{name}.safetensors"), "--model", path, "--json"]) == 0
        checked[name] = json.loads(capsys.readouterr().out)["checked"]
    assert checked["l"] == f"fits {path} (flux, bfl names): 26 weights", checked
    assert checked["wrong"] == (f"does not fit {path}: {tmp_path / 'wrong.safetensors'}: LoRA for "
                                f"'double_blocks.0.img_attn.proj.weight' gives a delta of shape (64, 32), the checkpoint "
                                f"weight is (64, 64)"), checked


def test_a_qwen_image_gguf_with_diffusers_names_loads_and_computes_as_its_dequantized_twin(tiny_set, tmp_path):
    from library.models.qwen_image.model import load_qwen_image
    from tests.test_merge_convert import qwen_inputs

    model = load_qwen_image(tiny_set["qwen_image"])
    types = {f"{n}.weight": "Q6_K" if m.in_features % 256 == 0 else "Q8_0" for n, m in model.named_modules()
             if type(m) is nn.Linear and n.startswith("transformer_blocks.")}
    sd = dict(model.state_dict())
    for i, key in enumerate(k for k, t in types.items() if t == "Q6_K"):  # gguf cannot quantize K-quants
        sd[key] = random_blocks("Q6_K", *sd[key].shape, seed=20 + i, scale=1e-3)
    path = write_gguf(sd, tmp_path / "qwen-image-tiny.gguf", types)
    # The tiny head dim (32) has no released RoPE axes to infer: the config is given, as a folder's config.json would
    loaded = load_qwen_image(path, config=model.config).eval()
    layers = {n: m.qtype for n, m in loaded.named_modules() if isinstance(m, GGUFLinear)}
    assert {f"{n}.weight": t for n, t in layers.items()} == types and set(layers.values()) == {"Q8_0", "Q6_K"}
    inputs = {**qwen_inputs(), "txt": torch.randn(1, 8, model.config.joint_attention_dim)}
    assert torch.equal(run(loaded, inputs), run(dequantized_twin(loaded), inputs))


def test_plan_memory_refuses_gguf_for_a_family_comfyui_gguf_has_no_layout_for(capsys):
    from library.models.registry import arch_specs
    from tools import plan_memory

    no_layout = [p for spec in arch_specs().values() if spec.planner and spec.gguf is None for p in spec.planner.presets]
    assert no_layout
    line = one_error_line(capsys, plan_memory.main(["--preset", no_layout[0], "--gguf", "Q8_0"]))
    assert f"--gguf Q8_0: ComfyUI-GGUF has no layout for" in line and f"({no_layout[0]})" in line, line


def test_generate_applies_a_lora_over_a_gguf_base(flux_gguf, tiny_set, tmp_path):
    """generate.py checks a LoRA's modules on the base's meta skeleton before any weights load; on a GGUF base
    that skeleton holds GGUFLinear layers, so the check must name the same modules as on the loaded model."""
    from tests.test_generate import generate_args
    from tools import generate

    net = lora(load_flux(flux_gguf[0]), "flux", rank=4, alpha=4.0, seed=1)
    net.save(str(tmp_path / "l.safetensors"))
    out = tmp_path / "out"
    assert generate.main(generate_args(tiny_set, out, "--model", flux_gguf[0], "--lora", str(tmp_path / "l.safetensors"))) == 0
    assert len(list(out.glob("*.png"))) == 1
