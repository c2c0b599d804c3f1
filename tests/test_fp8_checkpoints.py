"""Pre-quantized fp8 checkpoints as the base (library/precision/fp8_checkpoints.py): ComfyUI's
scaled fp8 (the `scaled_fp8` marker + per-tensor `scale_weight`, and the newer comfy_quant +
`weight_scale`) and plain e4m3 files with ComfyUI's prefix and bundled text encoder / VAE keys,
built from the tiny FLUX and Qwen-Image, load as they are and compute exactly ComfyUI's dequantized
weights; other layouts are refused in one line naming the key."""

import json
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

import train_lora

from library.io import CheckpointError, CheckpointReader
from library.models.flux1.checkpoint import load_flux, save_flux_bfl
from library.models.flux1.model import Flux
from library.models.flux3.checkpoint import load_flux3
from library.models.flux3.model import Flux3Transformer
from library.models.qwen_image.model import QwenImage, load_qwen_image
from library.precision import fp8
from library.precision.fp8_checkpoints import fp8_checkpoint_layout
from networks.lora import LoRANetwork
from tests.test_merge_convert import FLUX_CFG, QWEN_CFG, flux_inputs, lora, qwen_inputs, randomized, run, runtime_output
from tests.test_flux3_model import inputs as flux3_inputs, tiny_config as flux3_config
from tests.test_reliability import flux_args, one_error_line
from library.models.registry import arch_spec

PREFIX = "model.diffusion_model."
BUNDLED = {  # what a ComfyUI full checkpoint carries beside the transformer: never read for it
    "text_encoders.t5xxl.transformer.encoder.block.0.layer.0.SelfAttention.q.weight": torch.ones(4, 4).to(torch.float8_e4m3fn),
    "text_encoders.t5xxl.transformer.scaled_fp8": torch.empty(0, dtype=torch.float8_e5m2),
    "vae.decoder.conv_in.weight": torch.ones(4, 4, 3, 3, dtype=torch.bfloat16),
}
# a high-precision Linear stored fp8 + scale
WIDENED = {"flux": "final_layer.linear", "qwen_image": "proj_out", "flux3": "final_layer.image.linear"}


def comfy_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ComfyUI's own per-tensor quantizer (quant_ops TensorCoreFP8Layout.quantize): scale = amax / 448
    in float32, codes = (w * (1 / scale)).to(e4m3)."""
    scale = (w.abs().amax() / 448.0).float()
    return (w * (1.0 / scale).to(w.dtype)).to(torch.float8_e4m3fn), scale


def quantized_linears(model: nn.Module, family: str) -> list[str]:
    return [n for n, m in model.named_modules() if type(m) is nn.Linear and not fp8.is_high_precision(n, arch_spec(family).fp8)]


def comfy_state_dict(model: nn.Module, family: str, layout: str) -> dict[str, torch.Tensor]:
    """The model's tensors as ComfyUI stores them (no prefix): "marker" (scaled_fp8 + scale_weight +
    scale_input), "comfy_quant" (per-layer JSON + weight_scale + input_scale) or "plain" (every
    tensor e4m3, norms and biases too, as ComfyUI's flux1-dev-fp8)."""
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if layout == "plain":
        return {k: v.to(torch.float8_e4m3fn) for k, v in sd.items()}
    for layer in quantized_linears(model, family) + [WIDENED[family]]:
        sd[f"{layer}.weight"], scale = comfy_quantize(sd[f"{layer}.weight"])
        if layout == "marker":
            sd[f"{layer}.scale_weight"], sd[f"{layer}.scale_input"] = scale, torch.ones(())
        else:
            sd[f"{layer}.weight_scale"], sd[f"{layer}.input_scale"] = scale, torch.ones(())
            sd[f"{layer}.comfy_quant"] = torch.tensor(list(json.dumps({"format": "float8_e4m3fn"}).encode()), dtype=torch.uint8)
    if layout == "marker":
        sd["scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    return sd


def write_comfy(sd: dict, path, family: str, prefix: str = PREFIX, bundled: bool = True, config=FLUX_CFG):
    full = {prefix + k: v for k, v in sd.items()} | (BUNDLED if bundled else {})
    if family == "flux":
        save_flux_bfl(full, str(path), config=config)
    else:
        save_file(full, str(path))
    return str(path)


def comfy_dequantized(sd: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """What ComfyUI computes with: codes.to(dtype) * scale.to(dtype), everything else cast to dtype."""
    out = {}
    for k, v in sd.items():
        if k == "scaled_fp8" or k.endswith(("_scale", "scale_weight", "scale_input", "comfy_quant")):
            continue
        layer = k[: -len(".weight")]
        scale = sd.get(f"{layer}.scale_weight", sd.get(f"{layer}.weight_scale"))
        out[k] = v.to(dtype) * scale.to(dtype) if scale is not None else v.to(dtype)
    return out


def reference(model_cls, config, sd: dict, dtype: torch.dtype) -> nn.Module:
    """A plain-Linear model holding ComfyUI's dequantized weights, computing in `dtype`."""
    model = model_cls(config).to(dtype)
    model.load_state_dict(comfy_dequantized(sd, dtype), strict=True)
    model.compute_dtype = dtype
    return model.eval()


def realigned(model: nn.Module) -> nn.Module:
    """Every tensor copied into fresh memory. Tensors read in their file dtype stay views of the
    mmapped file, 8-byte aligned only, and this CPU's matmul rounds differently on unaligned data
    (same values, other bits): compare computations, not addresses."""
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            t.data = t.data.clone()
    return model


FAMILIES = {
    "flux": (Flux, FLUX_CFG, load_flux, flux_inputs),
    "qwen_image": (QwenImage, QWEN_CFG, load_qwen_image, qwen_inputs),
    "flux3": (Flux3Transformer, flux3_config(), load_flux3, lambda: flux3_inputs(references=True)),
}


# ----------------------------------------------------------------------------------------------
# The layer


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_per_tensor_layer_computes_comfyuis_dequantized_weight_exactly(dtype):
    lin = nn.Linear(96, 40)
    layer = fp8.FP8Linear.from_linear(lin, "fp8_tensor_scaled")
    assert layer.weight_scale.dtype == torch.float32 and layer.weight_scale.shape == ()
    q, scale = layer.weight, layer.weight_scale
    w = q.to(dtype) * scale.to(dtype)  # ComfyUI: both cast to the compute dtype, one multiply in it
    x = torch.randn(5, 96).to(dtype).requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    y = layer(x)
    assert torch.equal(y, F.linear(x_ref, w, lin.bias.detach().to(dtype)))
    y.sum().backward()
    F.linear(x_ref, w, lin.bias.detach().to(dtype)).sum().backward()
    assert torch.equal(x.grad, x_ref.grad) and layer.weight.grad is None


def test_per_tensor_dequantization_casts_the_scale_first_as_comfyui_does():
    """Every finite e4m3 code times 64 scales: ours is codes.to(dt) * scale.to(dt) bit for bit, and
    in bf16 that differs from rounding the fp32 product once (so the order is really tested)."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    codes = codes[torch.isfinite(codes.float())].reshape(2, -1)
    scales = torch.rand(64, generator=torch.Generator().manual_seed(0)) * 1e-3
    differs = 0
    for scale in scales:
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            assert torch.equal(fp8.dequantize_weight(codes, scale, dtype), codes.to(dtype) * scale.to(dtype))
        differs += int(not torch.equal(codes.to(torch.bfloat16) * scale.to(torch.bfloat16), (codes.float() * scale).bfloat16()))
    assert differs > 0


def test_per_tensor_quantization_round_trips_through_the_state_dict():
    layer = fp8.FP8Linear.from_linear(nn.Linear(64, 16), "fp8_tensor_scaled")
    other = fp8.FP8Linear(64, 16, mode="fp8_tensor_scaled")
    other.load_state_dict({k: (v.double() if k == "weight_scale" else v) for k, v in layer.state_dict().items()})
    assert other.weight_scale.dtype == torch.float32 and torch.equal(other.weight_scale, layer.weight_scale)
    assert layer.to(torch.bfloat16).weight_scale.dtype == torch.float32  # model.to(dtype) leaves it alone


# ----------------------------------------------------------------------------------------------
# Whole files


@pytest.mark.parametrize("family", ["flux", "qwen_image", "flux3"])
@pytest.mark.parametrize("layout", ["marker", "comfy_quant", "plain"])
def test_comfy_files_load_as_they_are_and_equal_comfyuis_dequantized_model(tmp_path, family, layout):
    cls, config, load, inputs = FAMILIES[family]
    sd = comfy_state_dict(randomized(cls(config), 3), family, layout)
    path = write_comfy(sd, tmp_path / f"{family}_{layout}.safetensors", family)
    expected = "fp8" if layout == "plain" else "fp8_tensor_scaled"
    assert fp8_checkpoint_layout(CheckpointReader(path)) == expected
    for dtype in (torch.float32, torch.bfloat16):
        with pytest.warns(UserWarning, match="fp8 tensors where the model keeps high precision"):
            loaded = load(path, dtype=dtype, config=config)
        layers = [m for m in loaded.modules() if isinstance(m, fp8.FP8Linear)]
        assert len(layers) == len(quantized_linears(cls(config), family)) and {m.mode for m in layers} == {expected}
        assert torch.equal(run(realigned(loaded), inputs()), run(reference(cls, config, sd, dtype), inputs()))


def test_a_diffusion_model_only_file_without_prefix_loads_too(tmp_path):
    sd = comfy_state_dict(randomized(Flux(FLUX_CFG), 4), "flux", "marker")
    path = write_comfy(sd, tmp_path / "unet.safetensors", "flux", prefix="", bundled=False)
    with pytest.warns(UserWarning):
        loaded = load_flux(path)
    assert torch.equal(run(realigned(loaded), flux_inputs()), run(reference(Flux, FLUX_CFG, sd, torch.float32), flux_inputs()))


def test_a_missing_scale_is_one_and_a_high_precision_linear_in_the_file_is_quantized_per_tensor(tmp_path):
    model = randomized(Flux(FLUX_CFG), 5)
    sd = comfy_state_dict(model, "flux", "marker")
    del sd["double_blocks.0.img_attn.qkv.scale_weight"]  # ComfyUI's default scale: 1.0
    sd["single_blocks.0.linear2.weight"] = model.single_blocks[0].linear2.weight.detach().clone()  # kept bf16
    del sd["single_blocks.0.linear2.scale_weight"]
    with pytest.warns(UserWarning):
        loaded = load_flux(write_comfy(sd, tmp_path / "partial.safetensors", "flux"))
    assert loaded.double_blocks[0].img_attn.qkv.weight_scale.item() == 1.0
    q, scale = fp8.quantize_weight(sd["single_blocks.0.linear2.weight"], "fp8_tensor_scaled")
    assert torch.equal(loaded.single_blocks[0].linear2.weight_scale, scale)
    assert torch.equal(loaded.single_blocks[0].linear2.weight.view(torch.uint8), q.view(torch.uint8))


def test_a_comfy_quant_mixed_file_keeps_its_bf16_linear_as_stored_as_comfyui_does(tmp_path):
    """ComfyUI's *_fp8mixed files leave some Linears bf16 (no comfy_quant entry): ComfyUI computes with
    that weight as stored (mixed_precision_ops), so it stays a plain Linear, in the plan too."""
    model = randomized(Flux(FLUX_CFG), 7)
    sd = comfy_state_dict(model, "flux", "comfy_quant")
    kept = "double_blocks.0.img_attn.qkv"
    sd[f"{kept}.weight"] = model.get_submodule(kept).weight.detach().bfloat16()
    for suffix in (".weight_scale", ".input_scale", ".comfy_quant"):
        del sd[kept + suffix]
    path = write_comfy(sd, tmp_path / "fp8mixed.safetensors", "flux")
    assert type(load_flux(path, read_weights=False).get_submodule(kept)) is nn.Linear  # the memory planner's model
    for dtype in (torch.float32, torch.bfloat16):
        with pytest.warns(UserWarning, match="fp8 tensors where the model keeps high precision"):
            loaded = load_flux(path, dtype=dtype)
        layer = loaded.get_submodule(kept)
        assert type(layer) is nn.Linear and torch.equal(layer.weight.bfloat16(), sd[f"{kept}.weight"])
        fp8_layers = [m for m in loaded.modules() if isinstance(m, fp8.FP8Linear)]
        assert len(fp8_layers) == len(quantized_linears(Flux(FLUX_CFG), "flux")) - 1
        assert torch.equal(run(realigned(loaded), flux_inputs()), run(reference(Flux, FLUX_CFG, sd, dtype), flux_inputs()))


def one_line_refusal(path, load, match: str):
    with pytest.raises(CheckpointError, match=match) as info:
        load(path)
    assert "\n" not in str(info.value)


def test_layouts_we_do_not_read_are_refused_in_one_line_naming_the_key(tmp_path):
    model = randomized(Flux(FLUX_CFG), 6)
    qkv = "double_blocks.0.img_attn.qkv"
    sd = comfy_state_dict(model, "flux", "marker")
    bad = dict(sd, scaled_fp8=torch.empty(0, dtype=torch.float16))
    one_line_refusal(write_comfy(bad, tmp_path / "a.safetensors", "flux"), load_flux, r"'model.diffusion_model.scaled_fp8' is F16")
    bad = dict(sd, **{f"{qkv}.scale_weight": torch.ones(192, 1)})
    one_line_refusal(write_comfy(bad, tmp_path / "b.safetensors", "flux"), load_flux,
                     rf"'model.diffusion_model.{qkv}.scale_weight' has shape \(192, 1\); ComfyUI's scaled fp8 stores one")
    bad = dict(sd, **{f"{qkv}.weight": sd[f"{qkv}.weight"].to(torch.float8_e5m2)})
    one_line_refusal(write_comfy(bad, tmp_path / "c.safetensors", "flux"), load_flux,
                     rf"'model.diffusion_model.{qkv}.weight' is float8_e5m2")
    cq = comfy_state_dict(model, "flux", "comfy_quant")
    cq[f"{qkv}.comfy_quant"] = torch.tensor(list(b'{"format": "nvfp4"}'), dtype=torch.uint8)
    one_line_refusal(write_comfy(cq, tmp_path / "d.safetensors", "flux"), load_flux,
                     rf"layer '{qkv}' is comfy_quant format 'nvfp4'; only 'float8_e4m3fn'")
    musubi = musubi_state_dict(model, "flux", "channel")  # per row, on rows of 64 inputs or more
    one_line_refusal(write_comfy(musubi, tmp_path / "e.safetensors", "flux"), load_flux,
                     r"'model.diffusion_model.double_blocks.0.img_mlp.2.scale_weight' \(BF16 \(64, 1\), weight "
                     r"\[64, 256\]\) is a musubi-tuner fp8 scale that maps onto neither one scale per tensor \(all of "
                     r"them\) nor bf16 scales per 64 input columns \(64, 4, 1\)")
    unmarked = {k: v for k, v in cq.items() if not k.endswith("comfy_quant")}
    one_line_refusal(write_comfy(unmarked, tmp_path / "f.safetensors", "flux"), load_flux,
                     r"weight_scale' has shape \(\), not the \[out, in/64\] block scales of fp8_scaled")


# ----------------------------------------------------------------------------------------------
# Training, generation and merging on such files


def tiny_comfy_flux(tiny_set, tmp_path, layout="marker") -> str:
    model = load_flux(tiny_set["flux_bfl"])
    return write_comfy(comfy_state_dict(model, "flux", layout), tmp_path / f"flux1_{layout}.safetensors", "flux",
                       config=model.config)


def test_training_on_a_comfy_scaled_file_needs_fp8_scaled_and_records_the_layout(tiny_set, tmp_path, capsys):
    path = tiny_comfy_flux(tiny_set, tmp_path)
    out = tmp_path / "out"
    capsys.readouterr()
    line = one_error_line(capsys, train_lora.main(flux_args(tiny_set, out, "--pretrained_model_name_or_path", path,
                                                            "--fp8_base", "true", "--fp8_scaled", "false")))
    assert ("flux1_marker.safetensors: the checkpoint stores a pre-quantized fp8_tensor_scaled base (used as it is), "
            "but the config asks for fp8; set fp8_base = true and fp8_scaled = true") in line, line
    assert train_lora.main(flux_args(tiny_set, out, "--pretrained_model_name_or_path", path, "--fp8_base", "true",
                                     "--fp8_scaled", "true", "--max_train_steps", "2")) == 0
    with safe_open(str(out / "tiny_flux_lora.safetensors"), framework="pt") as f:
        assert f.metadata()["ss_base_precision"] == "fp8_tensor_scaled"


def test_a_stored_base_refused_under_base_precision_is_advised_in_that_key(tiny_set, tmp_path, capsys):
    """base_precision = "nf4" (fp8_base = false) on a stored file was told "set fp8_base = true and ..." (the older
    keys, one of them already false)."""
    path = tiny_comfy_flux(tiny_set, tmp_path)
    capsys.readouterr()
    line = one_error_line(capsys, train_lora.main(flux_args(tiny_set, tmp_path / "out", "--pretrained_model_name_or_path",
                                                            path, "--base_precision", "nf4", "--fp8_base", "false")))
    assert line.endswith("but the config asks for nf4; set base_precision = \"fp8_scaled\" (what fp8_tensor_scaled "
                         "files need), or give the bf16 checkpoint"), line


def tiny_e5m2_flux(tiny_set, tmp_path) -> str:
    """The tiny FLUX.1 as a plain float8_e5m2 file (every tensor e5m2, as the "-fp8-e5m2" releases)."""
    model = load_flux(tiny_set["flux_bfl"])
    sd = {k: v.detach().to(torch.float8_e5m2) for k, v in model.state_dict().items()}
    return write_comfy(sd, tmp_path / "flux1-e5m2.safetensors", "flux", config=model.config)


def assert_fp8_compute_refused(tiny_set, tmp_path, capsys, path: str, layout: str) -> None:
    """fp8_compute = true on a base stored without fp8 codes (`layout`): one line naming fp8_compute."""
    args = flux_args(tiny_set, tmp_path / "out", "--pretrained_model_name_or_path", path, "--fp8_compute", "true",
                     "--mixed_precision", "bf16")
    line = one_error_line(capsys, train_lora.main(args))
    assert line == (f"error: {path}: fp8_compute = true runs an fp8 base's codes as fp8 GEMMs, but the checkpoint "
                    f"stores its base as {layout} (used as it is), with no fp8 codes; remove fp8_compute, or give a "
                    f"bf16 or fp8 checkpoint"), line


def test_training_on_a_plain_e5m2_file_refuses_an_fp8_base_before_caching_and_records_e5m2(tiny_set, tmp_path,
                                                                                            capsys, monkeypatch):
    """An fp8 base asked of a plain e5m2 file failed while the transformer loaded, after caching, naming a
    tensor and no file. Now one line naming the file, the tensor and the key, before caching. Trained
    on it with a bf16 base, the LoRA's ss_base_precision said "bf16"; now "fp8_e5m2": e5m2 widens
    exactly, so that file is the base the LoRA was trained on. The samples' panel then still said "bf16";
    now "fp8_e5m2" too (DiffusionTask.trained_precision names the base for both)."""
    from PIL import Image

    from library.training.diffusion_task import DiffusionTask
    from tests.test_train_lora import sample_png

    path = tiny_e5m2_flux(tiny_set, tmp_path)
    fill = DiffusionTask._fill_caches
    cached = []
    monkeypatch.setattr(DiffusionTask, "_fill_caches", lambda self: cached.append(1) or fill(self))
    capsys.readouterr()
    line = one_error_line(capsys, train_lora.main(flux_args(tiny_set, tmp_path / "out", "--pretrained_model_name_or_path",
                                                            path, "--fp8_base", "true", "--fp8_scaled", "true")))
    assert line == (f"error: {path}: 'model.diffusion_model.double_blocks.0.img_attn.proj.weight' is float8_e5m2 (a "
                    f"plain e5m2 file, widened exactly to the compute dtype), but the config asks for a fp8_scaled "
                    f"base; set base_precision = \"bf16\" (fp8_base = false), or give a bf16 checkpoint"), line
    assert cached == []
    # fp8_compute on it: told so first, not "set base_precision = bf16", which fp8_compute then refuses
    assert_fp8_compute_refused(tiny_set, tmp_path, capsys, path, "fp8_e5m2")
    out, prompts = tmp_path / "out", tmp_path / "prompts.txt"
    prompts.write_text("a red square --w 32 --h 32 --s 2\n")
    assert train_lora.main(flux_args(tiny_set, out, "--pretrained_model_name_or_path", path, "--fp8_base", "false",
                                     "--sample_prompts", str(prompts))) == 0
    with safe_open(str(out / "tiny_flux_lora.safetensors"), framework="pt") as f:
        assert f.metadata()["ss_base_precision"] == "fp8_e5m2"
    with Image.open(sample_png(out, "tiny_flux_lora", "final")) as png:
        assert png.text["panels"] == "fp8_e5m2"  # the one base sampled
        # the settings it was rendered with, under generate.py's names (old: prompt and panels alone)
        assert {k: png.text.get(k) for k in ("size", "steps", "guidance", "lora", "model_type")} == {
            "size": "32x32", "steps": "2", "guidance": "3.5", "lora": "tiny_flux_lora final", "model_type": "flux"}
        assert png.text["seed"] == sample_png(out, "tiny_flux_lora", "final").stem.rsplit("_", 1)[1]


def test_generate_reads_comfy_files_with_a_lora_on_top_and_records_the_stored_layout(tiny_set, tmp_path):
    from PIL import Image

    from tools import generate

    path = tiny_comfy_flux(tiny_set, tmp_path)
    with pytest.warns(UserWarning):
        net = lora(load_flux(path), "flux", rank=4, alpha=4.0, seed=1)
    net.save(str(tmp_path / "l.safetensors"))
    assert generate.main(["--model_type", "flux", "--model", path, "--ae", tiny_set["flux_vae_single"],
                          "--clip_l", tiny_set["clip_l"], "--t5xxl", tiny_set["t5xxl"], "--prompt", "a red square",
                          "--width", "64", "--height", "64", "--steps", "2", "--dtype", "bf16",
                          "--lora", f"{tmp_path / 'l.safetensors'}:0.8", "--out", str(tmp_path / "flux")]) == 0
    (png,) = os.listdir(tmp_path / "flux")
    assert Image.open(tmp_path / "flux" / png).text["base_precision"] == "fp8_tensor_scaled"

    qwen = tmp_path / "qwen_comfy"  # ComfyUI's Qwen-Image files carry no prefix; config.json beside it
    model = load_qwen_image(tiny_set["qwen_image"])
    write_comfy(comfy_state_dict(model, "qwen_image", "comfy_quant"), tmp_path / "q.safetensors", "qwen_image", prefix="",
                bundled=False)
    os.makedirs(qwen)
    os.rename(tmp_path / "q.safetensors", qwen / "diffusion_pytorch_model.safetensors")
    with open(qwen / "config.json", "w") as f:
        json.dump(model.config.to_diffusers(), f)
    assert generate.main(["--model_type", "qwen_image", "--model", str(qwen), "--ae", tiny_set["qwen_image_vae"],
                          "--text_encoder", tiny_set["qwen_image_text_encoder"], "--prompt", "a red square",
                          "--width", "64", "--height", "64", "--steps", "2", "--dtype", "fp32",
                          "--out", str(tmp_path / "qwen")]) == 0
    assert len(os.listdir(tmp_path / "qwen")) == 1


def test_generate_on_a_plain_e5m2_file_names_that_base_in_the_image(tiny_set, tmp_path):
    """generate's PNG said base_precision 'bf16' for a plain e5m2 file (loaded widened, exactly): the base
    the image was made on is that file's, as a LoRA trained on it records (fp8_e5m2)."""
    from PIL import Image

    from tools import generate

    path = tiny_e5m2_flux(tiny_set, tmp_path)
    with pytest.warns(UserWarning, match="widened exactly"):
        code = generate.main(["--model_type", "flux", "--model", path, "--ae", tiny_set["flux_vae_single"],
                              "--clip_l", tiny_set["clip_l"], "--t5xxl", tiny_set["t5xxl"], "--prompt", "a red square",
                              "--width", "32", "--height", "32", "--steps", "2", "--out", str(tmp_path / "out")])
    assert code == 0
    (png,) = os.listdir(tmp_path / "out")
    assert Image.open(tmp_path / "out" / png).text["base_precision"] == "fp8_e5m2"


def merge(*argv) -> int:
    from tools import merge_lora

    return merge_lora.main([str(a) for a in argv])


def read_all(path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.parametrize("family", ["flux", "qwen_image", "flux3"])
def test_merge_lora_into_a_comfy_file_keeps_its_layout_or_widens_it(tmp_path, family):
    cls, config, load, inputs = FAMILIES[family]
    sd = comfy_state_dict(randomized(cls(config), 7), family, "marker")
    path = write_comfy(sd, tmp_path / "base.safetensors", family)
    ref = reference(cls, config, sd, torch.float32)
    net = lora(ref, family, rank=4, alpha=4.0, seed=2)
    net.save(str(tmp_path / "l.safetensors"))

    # fp32 output: ComfyUI's dequantized weights + the LoRA, no scales or markers left
    assert merge("--model", path, "--lora", f"{tmp_path / 'l.safetensors'}:0.7", "--save_to", tmp_path / "fp32.safetensors",
                 "--save_precision", "fp32") == 0
    wide = read_all(tmp_path / "fp32.safetensors")
    assert not any(k.endswith(("scale_weight", "scale_input", "scaled_fp8")) for k in wide if k.startswith(PREFIX))
    assert all(torch.equal(wide[k].float(), v.float()) for k, v in BUNDLED.items())  # other models: as they are
    assert all(v.dtype == torch.float32 for k, v in wide.items() if k.startswith(PREFIX))
    merged = load(str(tmp_path / "fp32.safetensors"), config=config)
    expected = runtime_output(ref, [(net, 0.7)], inputs())
    assert torch.allclose(run(realigned(merged), inputs()), expected, atol=1e-5, rtol=1e-5)

    # kept layout: unmerged tensors byte for byte, merged ones re-quantized per tensor from those fp32 weights
    # (rounded to nearest here, to compare bits; stochastically by default)
    assert merge("--model", path, "--lora", f"{tmp_path / 'l.safetensors'}:0.7", "--save_to", tmp_path / "kept.safetensors",
                 "--no-stochastic_rounding") == 0
    base, kept = read_all(path), read_all(tmp_path / "kept.safetensors")
    assert {k: (v.dtype, v.shape) for k, v in kept.items()} == {k: (v.dtype, v.shape) for k, v in base.items()}
    targets = {n for n, m in ref.named_modules() if n in {t.name for t in net.lora_modules()}}
    for k, v in kept.items():
        layer = k[len(PREFIX) :].rsplit(".", 1)[0]
        if layer not in targets or k.endswith(("bias", "scale_input")):
            assert torch.equal(v.view(torch.uint8) if v.dtype.itemsize == 1 else v, base[k].view(torch.uint8) if v.dtype.itemsize == 1 else base[k]), k
        elif k.endswith(".weight"):
            q, scale = fp8.quantize_weight(wide[k], "fp8_tensor_scaled")
            assert torch.equal(v.view(torch.uint8), q.view(torch.uint8)) and torch.equal(kept[f"{PREFIX}{layer}.scale_weight"], scale)
    with pytest.warns(UserWarning):
        assert fp8_checkpoint_layout(CheckpointReader(str(tmp_path / "kept.safetensors"))) == "fp8_tensor_scaled"
        load(str(tmp_path / "kept.safetensors"), config=config)


def test_merge_lora_into_an_fp8_base_refuses_another_fp8_layout_and_rounds_stochastically(tmp_path, capsys):
    sd = comfy_state_dict(randomized(Flux(FLUX_CFG), 8), "flux", "marker")
    path = write_comfy(sd, tmp_path / "base.safetensors", "flux")
    lora(reference(Flux, FLUX_CFG, sd, torch.float32), "flux", rank=4, alpha=4.0, seed=2).save(str(tmp_path / "l.safetensors"))
    capsys.readouterr()
    assert merge("--model", path, "--lora", tmp_path / "l.safetensors", "--save_to", tmp_path / "o.safetensors",
                 "--save_precision", "fp8_scaled") == 2
    err = capsys.readouterr().err
    assert "is a pre-quantized fp8_tensor_scaled base; another fp8 layout would re-round all its weights" in err
    assert err.count("\n") == 1 and not (tmp_path / "o.safetensors").exists()
    outs = []
    for seed in (0, 1):
        assert merge("--model", path, "--lora", tmp_path / "l.safetensors", "--save_to", tmp_path / f"s{seed}.safetensors",
                     "--stochastic_rounding", "--seed", seed) == 0
        outs.append(read_all(tmp_path / f"s{seed}.safetensors")[PREFIX + "double_blocks.0.img_attn.qkv.weight"])
    assert not torch.equal(outs[0].view(torch.uint8), outs[1].view(torch.uint8))  # the seed decides the rounding


def test_a_comfy_quant_header_is_kept_only_where_the_merge_keeps_the_fp8_layout(tmp_path):
    """comfy_quant files may list their fp8 layers in the `_quantization_metadata` header alone (ComfyUI's
    convert_old_quants reads it). A bf16 / fp16 / fp32 merge leaves it out: ComfyUI would build those bf16
    Linears as fp8 layers without a scale. A merge that keeps the fp8 layout keeps it, true of its layers."""
    sd = comfy_state_dict(randomized(Flux(FLUX_CFG), 8), "flux", "comfy_quant")
    layers = {k[: -len(".comfy_quant")]: {"format": "float8_e4m3fn"} for k in sd if k.endswith(".comfy_quant")}
    sd = {k: v for k, v in sd.items() if not k.endswith(".comfy_quant")}
    header = json.dumps({"format_version": "1.0", "layers": layers})
    path = str(tmp_path / "base.safetensors")
    save_flux_bfl(sd, path, config=FLUX_CFG, metadata={"_quantization_metadata": header})
    assert fp8_checkpoint_layout(CheckpointReader(path)) == "fp8_tensor_scaled" and len(layers) == 14
    lora(reference(Flux, FLUX_CFG, sd, torch.float32), "flux", rank=4, alpha=4.0, seed=2).save(str(tmp_path / "l.safetensors"))
    for precision in ("bf16", "fp16", "fp32"):
        out = tmp_path / f"{precision}.safetensors"
        assert merge("--model", path, "--lora", tmp_path / "l.safetensors", "--save_to", out, "--save_precision", precision) == 0
        assert "_quantization_metadata" not in CheckpointReader(str(out)).metadata, precision
        assert not any(v.dtype == torch.float8_e4m3fn for v in read_all(out).values())
    for name, extra in (("kept", []), ("fp8", ["--save_precision", "fp8"])):
        out = tmp_path / f"{name}.safetensors"
        assert merge("--model", path, "--lora", tmp_path / "l.safetensors", "--save_to", out, *extra) == 0
        assert CheckpointReader(str(out)).metadata["_quantization_metadata"] == header, name
        tensors = read_all(out)
        scaled = {k[: -len(".weight")] for k, v in tensors.items() if v.dtype == torch.float8_e4m3fn and f"{k}_scale" in tensors}
        assert scaled == set(layers), name


@pytest.mark.parametrize("layout", ["marker", "plain"])
def test_a_gentle_lora_merged_into_an_fp8_base_is_kept_by_default_rounding_stochastically(tmp_path, capsys, layout):
    """Into an fp8 base the merged weight starts on the fp8 grid: rounded to nearest, a delta under half a
    step gives the same code back (a LoRA at ratio 0.1 kept 17-43% of its effect, silently). By default the
    merge rounds stochastically, as ComfyUI's patching does: the delta is kept in expectation."""
    sd = comfy_state_dict(randomized(Flux(FLUX_CFG), 8), "flux", layout)
    path = write_comfy(sd, tmp_path / "base.safetensors", "flux")
    lora(reference(Flux, FLUX_CFG, sd, torch.float32), "flux", rank=4, alpha=4.0, seed=2).save(str(tmp_path / "l.safetensors"))
    key = PREFIX + "double_blocks.0.img_attn.qkv.weight"
    scale_key = key[: -len("weight")] + "scale_weight"

    def weight(file) -> torch.Tensor:
        tensors = read_all(file)
        return tensors[key].float() * (tensors[scale_key].float() if scale_key in tensors else 1.0)

    assert merge("--model", path, "--lora", f"{tmp_path / 'l.safetensors'}:0.05", "--save_to", tmp_path / "wide.safetensors",
                 "--save_precision", "fp32") == 0
    base, delta = weight(path), read_all(tmp_path / "wide.safetensors")[key].float() - weight(path)
    kept = {}
    for name, extra in (("default", []), ("nearest", ["--no-stochastic_rounding"]), ("seed0", ["--stochastic_rounding"])):
        capsys.readouterr()
        assert merge("--model", path, "--lora", f"{tmp_path / 'l.safetensors'}:0.05", "--save_to",
                     tmp_path / f"{name}.safetensors", *extra) == 0
        assert ("stochastic rounding" in capsys.readouterr().out) == (name != "nearest")
        change = weight(tmp_path / f"{name}.safetensors") - base
        kept[name] = ((change * delta).sum() / (delta * delta).sum()).item()  # the delta's share that is there
    assert kept["default"] == kept["seed0"]  # the same rounding (--seed 0) as the explicit flag
    assert abs(kept["default"] - 1) < 0.3 and kept["nearest"] < 0.7, kept


@pytest.mark.parametrize("kind", ["dora", "lokr_dora_wd"])
def test_dora_and_lycoris_on_a_comfy_scaled_base_equal_the_dequantized_base(tmp_path, kind):
    from networks.lycoris_network import LycorisNetwork

    sd = comfy_state_dict(randomized(Flux(FLUX_CFG), 9), "flux", "marker")
    with pytest.warns(UserWarning):
        model = realigned(load_flux(write_comfy(sd, tmp_path / "base.safetensors", "flux")))
    ref = reference(Flux, FLUX_CFG, sd, torch.float32)
    if kind == "dora":
        make = lambda m: LoRANetwork(m, "flux", 4, 4.0, network_args={"use_dora": "true"})  # noqa: E731
    else:
        make = lambda m: LycorisNetwork(m, "flux", 4, 2.0, network_args={"algo": "lokr", "factor": 4, "dora_wd": True})  # noqa: E731
    net, ref_net = make(model), make(ref)
    with torch.no_grad():
        for p in ref_net.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    net.load_state_dict(ref_net.state_dict())
    net.apply(), ref_net.apply()
    out = model(**flux_inputs())
    assert torch.allclose(out, ref(**flux_inputs()), atol=1e-5, rtol=1e-5)
    out.square().mean().backward()
    assert all(p.grad is not None for p in net.parameters() if p.requires_grad)
    assert not any(t.requires_grad for t in model.parameters()) and all(b.grad is None for b in model.buffers())


# ----------------------------------------------------------------------------------------------
# musubi-tuner's layout (a saved state dict of its --fp8_scaled models)


def musubi_state_dict(model: nn.Module, family: str, mode: str) -> dict[str, torch.Tensor]:
    """musubi-tuner's quantize_weight (fp8_optimization_utils.py) on the model's Linears: scale =
    absmax / 448 per tensor, per row ([out, 1]) or per 64-column block ([out, in/64, 1]), clamped to
    1e-8; codes = (w / scale).clamp(+-448).to(e4m3); the scale stored in the model dtype (bf16)."""
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for layer in quantized_linears(model, family):
        w = sd[f"{layer}.weight"].float()
        out, in_features = w.shape
        blocked = w.view(out, in_features // 64, 64) if mode == "block" else w
        if mode == "tensor":
            scale = blocked.abs().max() / 448.0
        else:
            scale = blocked.abs().amax(dim=-1, keepdim=True) / 448.0
        scale = scale.clamp(min=1e-8)
        sd[f"{layer}.weight"] = (blocked / scale).clamp(-448, 448).to(torch.float8_e4m3fn).view(out, in_features)
        sd[f"{layer}.scale_weight"] = scale.to(torch.bfloat16)
    return sd


def musubi_dequantized(sd: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """musubi's fp8_linear_forward_patch: weight.to(scale.dtype) * scale (blocks: viewed [out, blocks, 64])."""
    out = {}
    for k, v in sd.items():
        if k.endswith("scale_weight"):
            continue
        scale = sd.get(k[: -len("weight")] + "scale_weight")
        if scale is None:
            out[k] = v.to(dtype)
        elif scale.dim() < 3:
            out[k] = (v.to(scale.dtype) * scale).to(dtype)
        else:
            out[k] = (v.to(scale.dtype).view(scale.shape[0], scale.shape[1], -1) * scale).view(v.shape).to(dtype)
    return out


@pytest.mark.parametrize("family", ["flux", "qwen_image", "flux3"])
@pytest.mark.parametrize("mode, layout", [("tensor", "fp8_tensor_scaled"), ("block", "fp8_scaled")])
def test_musubi_state_dicts_load_as_they_are_and_equal_musubis_dequantized_model(tmp_path, family, mode, layout):
    cls, config, load, inputs = FAMILIES[family]
    sd = musubi_state_dict(randomized(cls(config), 10), family, mode)
    path = write_comfy(sd, tmp_path / f"{mode}.safetensors", family, prefix="", bundled=False)
    assert fp8_checkpoint_layout(CheckpointReader(path)) == layout
    loaded = load(path, dtype=torch.bfloat16, config=config)  # musubi dequantizes in the model dtype, bf16
    assert {m.mode for m in loaded.modules() if isinstance(m, fp8.FP8Linear)} == {layout}
    expected = cls(config).to(torch.bfloat16)
    expected.load_state_dict(musubi_dequantized(sd, torch.bfloat16))
    expected.compute_dtype = torch.bfloat16
    assert torch.equal(run(loaded, inputs()), run(expected.eval(), inputs()))
    if family == "flux":  # merged into as it is: only the merged weights change, scales keep musubi's shapes
        net = lora(expected.float(), family, rank=4, alpha=4.0, seed=2)
        net.save(str(tmp_path / "l.safetensors"))
        assert merge("--model", path, "--lora", tmp_path / "l.safetensors", "--save_to", tmp_path / "m.safetensors",
                     "--no-stochastic_rounding") == 0  # to compare bits
        before, after = read_all(path), read_all(tmp_path / "m.safetensors")
        assert {k: (v.dtype, v.shape) for k, v in after.items()} == {k: (v.dtype, v.shape) for k, v in before.items()}
        load(str(tmp_path / "m.safetensors"), config=config)
        if mode == "tensor":  # the codes divide by the bf16 scale stored (by its fp32 value: every weight off by up
            for module, weights in net.lora_weights().items():  # to 0.4%, the scale's bf16 rounding)
                scale = after[f"{module}.scale_weight"].float()
                target = before[f"{module}.weight"].float() * before[f"{module}.scale_weight"].float() + weights.delta()
                codes = (target / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
                assert torch.equal(after[f"{module}.weight"].view(torch.uint8), codes.view(torch.uint8)), module


# ----------------------------------------------------------------------------------------------
# merge_lora writes ComfyUI's layout (--save_precision fp8, the default for single files)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("family", ["flux", "qwen_image", "flux3"])
def test_merge_writes_comfyuis_scaled_fp8_that_loads_back_as_comfyui_computes_it(tmp_path, family):
    cls, config, load, inputs = FAMILIES[family]
    model = randomized(cls(config), 11)
    base = write_comfy(model.state_dict(), tmp_path / "bf16.safetensors", family, prefix="", bundled=False)
    net = lora(model, family, rank=4, alpha=4.0, seed=3)
    net.save(str(tmp_path / "l.safetensors"))
    out, quantized_base = tmp_path / "comfy.safetensors", tmp_path / "base_comfy.safetensors"
    assert merge("--model", base, "--lora", f"{tmp_path / 'l.safetensors'}:0.8", "--save_to", out, "--save_precision", "fp8") == 0
    assert merge("--model", base, "--lora", f"{tmp_path / 'l.safetensors'}:0", "--save_to", quantized_base,
                 "--save_precision", "fp8", "--fp8_layout", "comfy") == 0

    # The layout ComfyUI's scaled_fp8_ops builds: every Linear e4m3 (biases too) + a float32 0-dim scale_weight.
    sd = read_all(out)
    assert sd["scaled_fp8"].dtype == torch.float8_e4m3fn and sd["scaled_fp8"].numel() == 2  # "no fp8 matmul"
    linears = [n for n, m in model.named_modules() if type(m) is nn.Linear]
    for layer in linears:
        assert sd[f"{layer}.weight"].dtype == torch.float8_e4m3fn and sd[f"{layer}.scale_weight"].shape == ()
        assert sd[f"{layer}.scale_weight"].dtype == torch.float32
        assert f"{layer}.bias" not in sd or sd[f"{layer}.bias"].dtype == torch.float8_e4m3fn
    rest = set(sd) - {f"{n}.{s}" for n in linears for s in ("weight", "bias", "scale_weight")} - {"scaled_fp8"}
    assert rest and all(sd[k].dtype == torch.bfloat16 for k in rest)  # norms
    assert fp8_checkpoint_layout(CheckpointReader(str(out))) == "fp8_tensor_scaled"

    # Our loader computes exactly ComfyUI's dequantized model of it (fp32 and bf16).
    for dtype in (torch.float32, torch.bfloat16):
        with pytest.warns(UserWarning, match="widened"):
            loaded = load(str(out), dtype=dtype, config=config)
        assert torch.equal(run(realigned(loaded), inputs()), run(reference(cls, config, sd, dtype), inputs()))

    # Merged into fp8 vs the same LoRA unmerged on the same-layout fp8 base, against the fp32 truth.
    truth = runtime_output(model, [(net, 0.8)], inputs())
    with pytest.warns(UserWarning):
        merged_out = run(realigned(load(str(out), config=config)), inputs())
        fp8_base = realigned(load(str(quantized_base), config=config))
    unmerged_net = LoRANetwork(fp8_base, family, rank=4, alpha=4.0)
    unmerged_net.load_weights(str(tmp_path / "l.safetensors"))
    unmerged_out = runtime_output(fp8_base, [(unmerged_net, 0.8)], inputs())
    merged_err, unmerged_err = rel(merged_out, truth), rel(unmerged_out, truth)
    print(f"{family}: merged {merged_err:.4f}, unmerged {unmerged_err:.4f}, between {rel(merged_out, unmerged_out):.4f}")
    assert merged_err <= 1.5 * unmerged_err and rel(merged_out, unmerged_out) <= 0.08, (merged_err, unmerged_err)


def test_fp32_block_scales_of_an_fp8_scaled_file_load_when_bf16_holds_them_else_are_refused(tmp_path):
    """The old converter rounded any stored `weight_scale` to bf16: scales x1.001 in float32 loaded as
    other values (the weight off by up to 0.4%) without a word."""
    model = randomized(Flux(FLUX_CFG), 7)
    qkv = "double_blocks.0.img_attn.qkv"
    q, scale = fp8.quantize_weight(model.double_blocks[0].img_attn.qkv.weight.detach(), "fp8_scaled")
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()} | {f"{qkv}.weight": q}
    widened = write_comfy(sd | {f"{qkv}.weight_scale": scale.float()}, tmp_path / "a.safetensors", "flux", "", False)
    assert torch.equal(load_flux(widened).double_blocks[0].img_attn.qkv.weight_scale, scale)
    inexact = write_comfy(sd | {f"{qkv}.weight_scale": scale.float() * 1.001}, tmp_path / "b.safetensors", "flux", "", False)
    one_line_refusal(inexact, load_flux, rf"'{qkv}.weight_scale' holds torch.float32 block scales that bfloat16 would round")


def test_comfy_quant_scales_stored_as_shape_1_are_per_tensor_not_bfl_per_row(tmp_path):
    """A float32 `weight_scale` of shape [1] is ComfyUI's per-tensor scale: the old check took any 1-D
    float32 weight_scale for BFL's fp8r per-row scale, and the load failed ('has shape (1,), the model
    expects (64,)')."""
    model = randomized(Flux(FLUX_CFG), 8)
    sd = {k: v.reshape(1) if k.endswith(".weight_scale") else v for k, v in comfy_state_dict(model, "flux", "comfy_quant").items()}
    path = write_comfy(sd, tmp_path / "one.safetensors", "flux")
    assert fp8_checkpoint_layout(CheckpointReader(path)) == "fp8_tensor_scaled"
    from library.precision.stored_layouts import stored_layout

    assert stored_layout(CheckpointReader(path), path) == "fp8_tensor_scaled"
    with pytest.warns(UserWarning):
        loaded = load_flux(path)
    expected = comfy_dequantized(sd, torch.bfloat16)
    layers = {n: m for n, m in loaded.named_modules() if isinstance(m, fp8.FP8Linear)}
    assert len(layers) == len(quantized_linears(model, "flux"))
    assert all(torch.equal(m.dequantized_weight(torch.bfloat16), expected[f"{n}.weight"]) for n, m in layers.items())


def test_base_loras_on_a_comfy_scaled_file_are_refused_before_caching(tiny_set, tmp_path, capsys, monkeypatch):
    """The old line said so in _load_base, after the latents and text had been cached (minutes)."""
    from library.training.diffusion_task import DiffusionTask

    path = tiny_comfy_flux(tiny_set, tmp_path)
    adapter = str(tmp_path / "adapter.safetensors")
    LoRANetwork(load_flux(tiny_set["flux_bfl"]), "flux", 4, 4.0).save(adapter)
    cached = []
    monkeypatch.setattr(DiffusionTask, "_fill_caches", lambda self: cached.append(1))
    capsys.readouterr()
    line = one_error_line(capsys, train_lora.main(flux_args(tiny_set, tmp_path / "out", "--pretrained_model_name_or_path", path,
                                                            "--fp8_base", "true", "--fp8_scaled", "true",
                                                            "--base_loras", f"{adapter}:0.5")))
    assert f"{path}: base_loras merge into a high-precision base; this checkpoint is pre-quantized (fp8_tensor_scaled)" in line
    assert cached == []


def test_fine_grained_fp8_with_weight_scale_inv_is_refused_not_read_as_plain_fp8(tmp_path):
    """transformers' fine-grained fp8 (the "-FP8" LLM releases): the old reader called it plain "fp8",
    so the config check asked for fp8_base = true, and the load failed later on 'unexpected keys'."""
    model = randomized(Flux(FLUX_CFG), 9)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    qkv = "double_blocks.0.img_attn.qkv"
    sd[f"{qkv}.weight"] = sd[f"{qkv}.weight"].to(torch.float8_e4m3fn)
    sd[f"{qkv}.weight_scale_inv"] = torch.ones(2, 1)
    path = write_comfy(sd, tmp_path / "fine.safetensors", "flux", prefix="", bundled=False)
    one_line_refusal(path, lambda p: fp8_checkpoint_layout(CheckpointReader(p)),
                     rf"'{qkv}.weight_scale_inv' is a block-wise fp8 scale \(transformers' fine-grained fp8")


def test_fine_grained_scales_beside_e5m2_codes_are_refused_not_read_as_a_plain_e5m2_file(tmp_path):
    """The block-wise refusal comes before the plain-e5m2 reading (which would widen the codes and drop
    the scales) on both paths that read a file's fp8 layout."""
    from library.precision.fp8_checkpoints import plain_e5m2_key

    sd = {k: v.detach().to(torch.float8_e5m2) for k, v in randomized(Flux(FLUX_CFG), 9).state_dict().items()}
    qkv = "double_blocks.0.img_attn.qkv"
    sd[f"{qkv}.weight_scale_inv"] = torch.ones(2, 1)
    path = write_comfy(sd, tmp_path / "fine-e5m2.safetensors", "flux", prefix="", bundled=False)
    refusal = rf"'{qkv}.weight_scale_inv' is a block-wise fp8 scale \(transformers' fine-grained fp8"
    one_line_refusal(path, lambda p: fp8_checkpoint_layout(CheckpointReader(p)), refusal)
    one_line_refusal(path, lambda p: plain_e5m2_key(CheckpointReader(p)), refusal)


def test_per_row_weight_scales_on_64_divisible_rows_are_refused_from_the_header(tmp_path):
    """compressed-tensors' fp8 (per-channel float32 `weight_scale` [out, 1]) read as our fp8_scaled: the
    old reader said "fp8_scaled" and the load failed after caching, on the first scale's shape or values."""
    model = randomized(Flux(FLUX_CFG), 10)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    mlp = "double_blocks.0.img_mlp.2"  # [64, 256]: fp8_scaled holds (64, 4)
    scale = sd[f"{mlp}.weight"].abs().amax(1, keepdim=True) / 448
    sd[f"{mlp}.weight"], sd[f"{mlp}.weight_scale"] = (sd[f"{mlp}.weight"] / scale).to(torch.float8_e4m3fn), scale
    path = write_comfy(sd, tmp_path / "rows.safetensors", "flux", prefix="", bundled=False)
    one_line_refusal(path, lambda p: fp8_checkpoint_layout(CheckpointReader(p)),
                     rf"'{mlp}.weight_scale' has shape \(64, 1\), not the fp8_scaled block scales \(64, 4\)")


def test_a_plain_e5m2_file_widens_exactly_and_an_fp8_base_on_it_is_refused(tmp_path):
    """A plain float8_e5m2 file (every tensor e5m2, as the "-fp8-e5m2" releases; ComfyUI loads them)
    was refused: "'model.diffusion_model.double_blocks.0...' is float8_e5m2; fp8 bases must be
    float8_e4m3fn". e5m2 -> bf16 / fp32 is exact, so it loads as a high-precision file whose
    weights are the e5m2 values; an fp8 base asked of it is one line naming the key."""
    from library.models.family import fp8_prepare

    sd = {k: v.detach().to(torch.float8_e5m2) for k, v in randomized(Flux(FLUX_CFG), 6).state_dict().items()}
    path = write_comfy(sd, tmp_path / "flux-e5m2.safetensors", "flux")
    assert fp8_checkpoint_layout(CheckpointReader(path)) is None
    for dtype in (torch.bfloat16, torch.float32):
        with pytest.warns(UserWarning, match=r"float8_e5m2 tensors \(first 'model.diffusion_model.* widened exactly"):
            loaded = load_flux(path, dtype=dtype).state_dict()
        assert all(torch.equal(loaded[k], v.to(dtype)) and torch.equal(loaded[k].to(torch.float8_e5m2).view(torch.uint8),
                                                                       v.view(torch.uint8)) for k, v in sd.items())
    with pytest.warns(UserWarning), pytest.raises(CheckpointError, match=r"'double_blocks.0.img_attn.\w+.weight' is "
                                                  r"float8_e5m2: it widens exactly to bf16 but not to the fp8 base"):
        load_flux(path, prepare=fp8_prepare("fp8_scaled", "flux"))
