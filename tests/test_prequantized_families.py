"""Pre-quantized Z-Image, Chroma, FLUX.3, ERNIE-Image, Nucleus-Image and Anima transformer files, loaded as stored
(precision/stored_layouts.py): ComfyUI's scaled fp8 (`scaled_fp8` marker + per-tensor `scale_weight`) and
comfy_quant (`weight_scale` + per-layer JSON), musubi-tuner's per-tensor and per-64-block `scale_weight`s, our
fp8_scaled block scales, plain e4m3 (everything, norms included) and city96's ComfyUI-GGUF blocks. Nucleus-Image's
packed experts (3-D, no Linears) are stored bf16 beside the fp8 Linears; in a plain e4m3 file they are e4m3 too
and load as stored (plain fp8, fp8_packed.PackedWeights), computing as their dequantized twin as the Linears do.

The tiny files are written here from the tiny set's single files, in each family's single-file names
(Z-Image: ComfyUI's fused `attention.qkv`; Chroma, FLUX.3: BFL names). The oracle is a plain float32 model
holding the file's tensors dequantized as ComfyUI computes them (codes.to(f32) * scale.to(f32); GGUF:
gguf's own numpy dequantization), built from the file tensor by tensor without our loader: for Z-Image
the fused qkv is dequantized whole and only then split into q / k / v, so a scale given to the wrong
rows shows. Forward outputs are compared exactly (float32 on both sides: max abs diff 0.0)."""

import json

import gguf
import numpy as np
import pytest
import torch
import torch.nn as nn
from gguf import GGMLQuantizationType as T
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import train_lora
from library.io import CheckpointError, CheckpointReader
from library.models.anima.checkpoint import load_anima
from library.models.anima.model import Anima
from library.models.lumina2.checkpoint import load_lumina2
from library.models.lumina2.model import Lumina2
from library.models.chroma.checkpoint import load_chroma
from library.models.chroma.model import Chroma
from library.models.ernie_image.checkpoint import load_ernie_image
from library.models.ernie_image.model import ErnieImage
from library.models.flux3.checkpoint import load_flux3
from library.models.flux3.model import Flux3Transformer
from library.models.nucleus_image.checkpoint import load_nucleus_image
from library.models.nucleus_image.model import NucleusImage
from library.models.zimage.checkpoint import CONFIG_KEY, QKV, from_single_file_state_dict, load_zimage
from library.models.zimage.model import ZImage
from library.precision import fp8
from library.precision.fp8 import FP8Linear
from library.precision.gguf_weights import GGUFLinear
from tests.test_fp8_checkpoints import BUNDLED, comfy_quantize
from tests.test_gguf import write_gguf
from tests.test_zimage_train import train_args
from tools.precision_doctor import make_inputs

E4M3 = torch.float8_e4m3fn
SCALES = (".scale_weight", ".weight_scale")
NOT_WEIGHTS = ("scaled_fp8", ".scale_input", ".input_scale", ".comfy_quant") + SCALES
COMFY_QUANT = torch.tensor(list(json.dumps({"format": "float8_e4m3fn"}).encode()), dtype=torch.uint8)

# family -> (tiny_set key of its single file, config metadata key, model class, loader)
FAMILIES = {
    "zimage": ("zimage", CONFIG_KEY, ZImage, load_zimage),
    "chroma": ("chroma_bfl", "chroma_config", Chroma, load_chroma),
    "flux3": ("flux3_tiny", "flux3_config", Flux3Transformer, load_flux3),
    "ernie_image": ("ernie_image", "ernie_image_config", ErnieImage, load_ernie_image),
    "nucleus_image": ("nucleus_image", "nucleus_image_config", NucleusImage, load_nucleus_image),
    "anima": ("anima", "anima_config", Anima, load_anima),
    "lumina2": ("lumina2", "lumina2_config", Lumina2, load_lumina2),
}
# layout -> (what the loader reports, the ComfyUI prefix the file carries)
LAYOUTS = {
    "comfy_marker": ("fp8_tensor_scaled", "model.diffusion_model."),
    "comfy_quant": ("fp8_tensor_scaled", "diffusion_model."),
    "musubi_tensor": ("fp8_tensor_scaled", ""),
    "musubi_block": ("fp8_scaled", ""),
    "ours": ("fp8_scaled", ""),
    "plain": ("fp8", "model.diffusion_model."),
}


def is_linear_weight(key: str, tensor: torch.Tensor) -> bool:
    return key.endswith(".weight") and tensor.dim() == 2


def fp8_file(sd: dict[str, torch.Tensor], layout: str) -> dict[str, torch.Tensor]:
    """A float32 single-file state dict (no prefix) as `layout` stores it: every Linear weight in e4m3
    with its scales (ComfyUI makes every Linear fp8, embedders and the final layer included; the
    loader widens those our fp8 rules keep), the rest bf16; "plain": every tensor e4m3."""
    if layout == "plain":
        return {k: v.to(E4M3) for k, v in sd.items()}
    out = {}
    for key, w in sd.items():
        if not is_linear_weight(key, w):
            out[key] = w.to(torch.bfloat16)
            continue
        layer = key[: -len(".weight")]
        if layout in ("ours", "musubi_block"):  # bf16 scales per 64 input columns (per row where in % 64 != 0)
            out[key], scale = fp8.quantize_weight(w, "fp8_scaled")
            out[layer + (".weight_scale" if layout == "ours" else ".scale_weight")] = scale if layout == "ours" else scale[..., None]
            continue
        out[key], scale = comfy_quantize(w)  # one float32 scale per tensor
        if layout == "comfy_marker":
            out[layer + ".scale_weight"], out[layer + ".scale_input"] = scale, torch.ones(())
        elif layout == "comfy_quant":
            out[layer + ".weight_scale"], out[layer + ".input_scale"] = scale, torch.ones(())
            out[layer + ".comfy_quant"] = COMFY_QUANT.clone()
        else:  # musubi per tensor: the scale in the model dtype
            out[layer + ".scale_weight"] = scale.to(torch.bfloat16)
    if layout == "comfy_marker":
        out["scaled_fp8"] = torch.empty(0, dtype=E4M3)
    return out


def fp8_dequantized(stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What ComfyUI computes with in float32: codes.to(f32) * scale.to(f32), per tensor or per block of
    input columns; every other tensor widened."""
    out = {}
    for key, t in stored.items():
        if key.endswith(NOT_WEIGHTS):
            continue
        layer = key[: -len(".weight")]
        scale = next((stored[layer + s] for s in SCALES if layer + s in stored), None)
        w = t.to(torch.float32)
        if scale is not None and scale.numel() == 1:
            w = w * scale.to(torch.float32).reshape(())
        elif scale is not None:
            blocks = scale.reshape(w.shape[0], -1).to(torch.float32)
            w = (w.reshape(w.shape[0], blocks.shape[1], -1) * blocks[..., None]).reshape(w.shape)
        out[key] = w
    return out


def gguf_types(sd: dict[str, torch.Tensor]) -> dict[str, str]:
    """Q8_0 for the attention projections (Z-Image's fused qkv among them), Q5_1 for the other Linears
    whose inputs divide into blocks of 32; the rest F32, as ComfyUI-GGUF's convert.py keeps small ones."""
    return {k: "Q8_0" if "attn" in k or "attention" in k else "Q5_1" for k, v in sd.items()
            if is_linear_weight(k, v) and v.shape[1] % 32 == 0}  # fmt: skip


def gguf_dequantized(path: str, types: dict[str, str], prefix: str) -> dict[str, torch.Tensor]:
    """The file's tensors (named without `prefix`) as gguf's own numpy code dequantizes them, float32."""
    out = {}
    for t in gguf.GGUFReader(path).tensors:
        name, shape = t.name[len(prefix) :], tuple(int(n) for n in reversed(t.shape.tolist()))
        values = gguf.quants.dequantize(np.array(t.data), T[types[name]]) if name in types else np.array(t.data)
        out[name] = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(shape)
    return out


def twin(family: str, config, dequantized: dict[str, torch.Tensor]) -> nn.Module:
    """A plain float32 model holding the dequantized file (Z-Image: fused qkv split only now)."""
    model = FAMILIES[family][2](config)
    sd = from_single_file_state_dict(dequantized) if family == "zimage" else dequantized
    model.load_state_dict(sd, strict=True)
    model.compute_dtype = torch.float32
    return model.eval()


@torch.no_grad()
def output(model: nn.Module, family: str) -> torch.Tensor:
    inputs = make_inputs(family, model.config, 64, 48, seed=3, text_len=8)
    return model(**inputs.make_kwargs(0.6))


def source(tiny_set, family: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tiny single file's float32 tensors (no prefix) and its config metadata (Anima's, as released: none, its
    `net.` prefix and RoPE buffers dropped; Lumina 2's: none, its unused norm_final dropped)."""
    key, config_key, _, _ = FAMILIES[family]
    sd, metadata = load_file(tiny_set[key]), CheckpointReader(tiny_set[key]).metadata
    if family == "anima":
        sd = {k.removeprefix("net."): v for k, v in sd.items() if ".pos_embedder." not in f".{k}"}
    if family == "lumina2":  # the released file's unused norm_final, which the loader drops
        sd.pop("norm_final.weight")
    return sd, {k: v for k, v in metadata.items() if k == config_key}


def write_fp8(tiny_set, family: str, layout: str, path) -> tuple[str, dict[str, torch.Tensor]]:
    sd, metadata = source(tiny_set, family)
    stored = fp8_file(sd, layout)
    prefix = LAYOUTS[layout][1]
    full = {prefix + k: v for k, v in stored.items()} | (BUNDLED if prefix == "model.diffusion_model." else {})
    save_file(full, str(path), metadata=metadata)
    return str(path), stored


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fp8_files_load_as_stored_and_compute_as_their_dequantized_twin(tiny_set, tmp_path, family, layout):
    path, stored = write_fp8(tiny_set, family, layout, tmp_path / f"{family}-{layout}.safetensors")
    loader = FAMILIES[family][3]
    with pytest.warns(UserWarning, match="widened"):  # ComfyUI's fp8 embedders / final layer: kept high precision here
        model = loader(path).eval()
    layers = [m for m in model.modules() if isinstance(m, FP8Linear)]
    assert layers and {m.mode for m in layers} == {LAYOUTS[layout][0]}
    # Nucleus-Image's packed experts are stored as the file holds them: e4m3 (plain fp8) in a plain file, else bf16
    stored_as = [module.packed_modes.get(weight) for module, weight in fp8.packed_weight_names(model).values()]
    assert bool(stored_as) == (family == "nucleus_image")
    assert set(stored_as) <= {"fp8" if layout == "plain" else None}
    reference = twin(family, model.config, fp8_dequantized(stored))
    diff = (output(model, family) - output(reference, family)).abs().max().item()
    print(f"{family} {layout}: max abs diff vs the dequantized float32 twin {diff}")
    assert diff == 0.0


def test_a_fused_qkv_splits_its_scales_with_its_rows(tiny_set, tmp_path):
    """Z-Image's `attention.qkv`: a per-tensor scale goes to q, k and v unchanged, block scales with
    their rows, and the three dequantize to the fused weight's rows bit for bit."""
    for layout, scale_key in (("comfy_marker", "scale_weight"), ("ours", "weight_scale"), ("musubi_block", "scale_weight")):
        path, stored = write_fp8(tiny_set, "zimage", layout, tmp_path / f"{layout}.safetensors")
        with pytest.warns(UserWarning, match="widened"):
            model = load_zimage(path)
        fused_codes, fused_scale = stored["layers.1" + QKV], stored[f"layers.1.attention.qkv.{scale_key}"]
        rows = fused_codes.shape[0] // 3
        fused = fp8_dequantized({"w.weight": fused_codes, f"w.{scale_key}": fused_scale})["w.weight"]
        for i, part in enumerate("qkv"):
            layer = model.get_submodule(f"layers.1.attention.to_{part}")
            assert torch.equal(layer.weight.view(torch.uint8), fused_codes[i * rows : (i + 1) * rows].view(torch.uint8))
            if fused_scale.numel() == 1:
                assert torch.equal(layer.weight_scale, fused_scale.float())
            else:
                assert torch.equal(layer.weight_scale, fused_scale.reshape(3 * rows, -1)[i * rows : (i + 1) * rows])
            assert torch.equal(layer.dequantized_weight(torch.float32), fused[i * rows : (i + 1) * rows])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_gguf_files_load_as_stored_and_compute_as_their_dequantized_twin(tiny_set, tmp_path, family):
    sd, metadata = source(tiny_set, family)
    types = gguf_types(sd)
    path = write_gguf(sd, tmp_path / f"{family}-tiny.gguf", types, metadata, prefix="model.diffusion_model.")
    model = FAMILIES[family][3](path).eval()
    packed = {n: m for n, m in model.named_modules() if isinstance(m, GGUFLinear)}
    assert {m.qtype for m in packed.values()} == {"Q8_0", "Q5_1"}
    if family == "zimage":  # the fused blocks' rows, split: every row is whole blocks along the input
        fused = CheckpointReader(path).get("model.diffusion_model.layers.0" + QKV)
        rows = fused.shape[0] // 3
        for i, part in enumerate("qkv"):
            assert torch.equal(packed[f"layers.0.attention.to_{part}"].weight, fused[i * rows : (i + 1) * rows])
    reference = twin(family, model.config, gguf_dequantized(path, types, "model.diffusion_model."))
    diff = (output(model, family) - output(reference, family)).abs().max().item()
    print(f"{family} gguf: max abs diff vs gguf's float32 dequantization {diff}")
    assert diff == 0.0


def test_a_zimage_gguf_with_llama_cpps_one_dim_pad_tokens_loads(tiny_set, tmp_path):
    """llama.cpp's quantize writes each tensor with ggml_n_dims, so the Z-Image GGUFs people run hold the
    [1, dim] pad tokens as [dim] (city96/ComfyUI-GGUF issue 379): they load as the model's [1, dim], the
    same values; a safetensors file of that shape is still the wrong file."""
    sd, metadata = source(tiny_set, "zimage")
    flat = {k: v.reshape(-1) if k.endswith("pad_token") else v for k, v in sd.items()}
    path = write_gguf(flat, tmp_path / "zimage-Q8_0.gguf", gguf_types(sd), metadata)
    assert CheckpointReader(path).shape("x_pad_token") == (sd["x_pad_token"].shape[1],)
    model = load_zimage(path)
    for key in ("x_pad_token", "cap_pad_token"):
        assert torch.equal(model.state_dict()[key], sd[key]), key
    save_file(flat, str(tmp_path / "flat.safetensors"), metadata=metadata)
    with pytest.raises(CheckpointError, match=r"key 'cap_pad_token' has shape \(64,\), expected \(1, 64\)"):
        load_zimage(str(tmp_path / "flat.safetensors"))


def test_wrong_files_are_one_error_naming_the_key(tiny_set, tmp_path):
    sd, metadata = source(tiny_set, "zimage")
    stored = fp8_file(sd, "comfy_marker")
    stored["layers.0" + QKV] = stored["layers.0" + QKV].to(torch.float8_e5m2)
    path = tmp_path / "e5m2.safetensors"
    save_file({"model.diffusion_model." + k: v for k, v in stored.items()}, str(path), metadata=metadata)
    with pytest.raises(CheckpointError) as info:
        load_zimage(str(path))
    assert "'model.diffusion_model.layers.0.attention.qkv.weight' is float8_e5m2" in str(info.value)
    assert "\n" not in str(info.value)

    sd, metadata = source(tiny_set, "chroma")
    stored = fp8_file(sd, "comfy_quant")
    stored["double_blocks.0.img_attn.qkv.comfy_quant"] = torch.tensor(list(b'{"format": "nvfp4"}'), dtype=torch.uint8)
    path = tmp_path / "nvfp4.safetensors"
    save_file(stored, str(path), metadata=metadata)
    with pytest.raises(CheckpointError, match=r"layer 'double_blocks\.0\.img_attn\.qkv' is comfy_quant format 'nvfp4'"):
        load_chroma(str(path))

    folder = tmp_path / "chroma_fp8_diffusers"  # a diffusers folder splits fused rows: the single file is asked for
    folder.mkdir()
    diffusers = load_file(tiny_set["chroma_diffusers"] + "/diffusion_pytorch_model.safetensors")
    key = "transformer_blocks.0.attn.to_q.weight"
    diffusers[key] = diffusers[key].to(E4M3)
    save_file(diffusers, str(folder / "diffusion_pytorch_model.safetensors"))
    (folder / "config.json").write_text(open(tiny_set["chroma_diffusers"] + "/config.json").read())
    with pytest.raises(CheckpointError, match=r"a pre-quantized \(fp8\) Chroma checkpoint must use BFL key names"):
        load_chroma(str(folder))


def test_samples_on_a_prequantized_file_render_no_bf16_reference_and_a_set_true_is_refused(tiny_set, tmp_path,
                                                                                             monkeypatch, capsys):
    """The "bf16" panel beside a pre-quantized file's sample was the same file loaded again (max diff 0): it loads
    as stored in any precision. Unset: that base alone, said in one line, and the planner counts no copy; true:
    refused before caching, naming the key and the stored layout."""
    from library.data import images
    from library.models.family import get_family
    from library.training.config import load_config
    from library.training.memory_plan import sampling_phase

    panels = []
    real = images.save_side_by_side
    monkeypatch.setattr(images, "save_side_by_side",
                        lambda shown, *a, **k: (panels.append([n for n, _ in shown]), real(shown, *a, **k))[1])
    path, _ = write_fp8(tiny_set, "zimage", "comfy_marker", tmp_path / "z_image_tiny_fp8_e4m3fn_scaled.safetensors")
    args = train_args(tiny_set, tmp_path / "out", "prequant", model=path, steps=1, extra=(
        "--base_precision", "fp8_scaled", "--sample_prompts", tiny_set["sample_prompts"]))
    run = load_config(args)
    assert "bf16 reference (base, lora)" not in sampling_phase(get_family(run), run, 64, 64, 8, 0).parts
    with pytest.warns(UserWarning, match="widened"):
        assert train_lora.main(args) == 0
    assert panels and all(labels == ["fp8_tensor_scaled"] for labels in panels), panels
    said = [line for line in capsys.readouterr().out.splitlines() if "sample_bf16_reference" in line]
    assert said == [f"samples render on the fp8_tensor_scaled base alone: no bf16 reference beside it "
                    f"(sample_bf16_reference), {path} is stored pre-quantized and has no bf16 base to load"], said
    assert train_lora.main(args + ["--sample_bf16_reference", "true", "--output_dir", str(tmp_path / "true")]) != 0
    out, err = capsys.readouterr()
    assert err.strip() == (f"error: {path}: sample_bf16_reference = true, but the checkpoint stores a pre-quantized "
                           f"fp8_tensor_scaled base, which loads as stored in any precision: there is no bf16 base to "
                           f"render beside it; remove the key, or give the bf16 checkpoint"), err
    assert "latents:" not in out  # before caching


def test_a_lora_trains_two_steps_on_a_comfyui_scaled_fp8_zimage(tiny_set, tmp_path, monkeypatch):
    from library.data import images

    panels = []  # the sample's panel labels: the old line said the configured "fp8_scaled", not what loaded
    real = images.save_side_by_side
    monkeypatch.setattr(images, "save_side_by_side",
                        lambda shown, *a, **k: (panels.append([n for n, _ in shown]), real(shown, *a, **k))[1])
    path, _ = write_fp8(tiny_set, "zimage", "comfy_marker", tmp_path / "z_image_tiny_fp8_e4m3fn_scaled.safetensors")
    out = tmp_path / "out"
    args = train_args(tiny_set, out, "prequant", model=path, extra=(
        "--fp8_base", "true", "--fp8_scaled", "true", "--sample_prompts", tiny_set["sample_prompts"],
        "--sample_bf16_reference", "false"))
    with pytest.warns(UserWarning, match="widened"):
        assert train_lora.main(args) == 0
    assert panels and all(labels == ["fp8_tensor_scaled"] for labels in panels), panels
    with safe_open(str(out / "prequant.safetensors"), framework="pt") as f:
        assert f.metadata()["ss_base_precision"] == "fp8_tensor_scaled"
        assert any(k.startswith("lora_unet_layers_0_attention_to_q.") for k in f.keys())
