"""ERNIE-Image transformer: parity with diffusers' ErnieImageTransformer2DModel (masked text of different
lengths, odd grids), the released size on `meta`, checkpoint layouts (single file, ComfyUI prefix, diffusers
folder, pre-quantized), one-line errors, checkpointing and block swap."""

import os
import re

import pytest
import torch
import torch.nn as nn
from diffusers import ErnieImageTransformer2DModel
from diffusers.loaders.single_file_utils import convert_ernie_image_transformer_checkpoint_to_diffusers
from safetensors.torch import load_file, save_file

from library.io import CheckpointError
from library.models import core
from library.models.block_swap import enable_block_swap
from library.models.ernie_image import model as ernie_model
from library.models.ernie_image.checkpoint import (
    COMFY_PREFIX, config_from_diffusers, diffusers_config, load_ernie_image, save_ernie_image_diffusers,
    save_ernie_image_single_file,
)
from library.models.ernie_image.model import ERNIE_IMAGE, ErnieImage, ErnieImageConfig, joint_positions, random_inputs
from library.precision.fp8 import FP8Linear

# head_dim 32 with the released RoPE split scaled down (8, 12, 12); in, out and text widths differ so that a
# swapped projection cannot pass.
TINY = dict(hidden_size=64, num_attention_heads=2, num_layers=2, ffn_hidden_size=96, in_channels=16, out_channels=12,
            text_in_dim=40, rope_axes_dim=(8, 12, 12))
H, W, T, B = 5, 7, 6, 2  # an odd token grid, the padded text length, the batch
LENGTHS = (4, 6)  # real text tokens per row: row 0 is padded (masked keys, image at position 4)
E4M3 = torch.float8_e4m3fn


def tiny_config(patch_size: int = 1) -> ErnieImageConfig:
    return ErnieImageConfig(**TINY, patch_size=patch_size)


def tiny_diffusers(patch_size: int = 1) -> ErnieImageTransformer2DModel:
    """Every parameter random (diffusers zero-inits the modulation and the output): norms around 1."""
    config = {k: v for k, v in diffusers_config(tiny_config(patch_size)).items() if not k.startswith("_")}
    model = ErnieImageTransformer2DModel(**config)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            norm = "norm" in name or "_ln" in name
            p.copy_(1 + 0.2 * noise if norm else 0.15 * noise if p.dim() > 1 else 0.1 * noise)
    return model.eval()


def ours_from(reference: ErnieImageTransformer2DModel) -> ErnieImage:
    model = ErnieImage(tiny_config(reference.config.patch_size))
    model.load_state_dict(reference.state_dict(), strict=True)  # the same names: no map
    return model.eval()


def inputs(patch_size: int = 1, masked: bool = True) -> dict:
    """Our forward's arguments: tokens of an (H p) x (W p) grid, text padded to T with a mask (or all real)."""
    g = torch.Generator().manual_seed(2)
    h, w = H * patch_size, W * patch_size
    lengths = torch.tensor(LENGTHS if masked else (T, T))
    return dict(img=torch.randn(B, h * w, 16, generator=g), txt=torch.randn(B, T, 40, generator=g),
                timesteps=torch.tensor([0.3, 0.85]), h=h, w=w,
                txt_mask=torch.arange(T)[None] < lengths[:, None] if masked else None)


def diffusers_forward(model: ErnieImageTransformer2DModel, x: dict) -> torch.Tensor:
    """As ErnieImagePipeline calls it: the latent [B, C, h, w], timestep = 1000 sigma, text_lens; output as tokens."""
    latent = x["img"].transpose(1, 2).unflatten(-1, (x["h"], x["w"]))
    mask = x["txt_mask"]
    lens = mask.sum(1) if mask is not None else torch.full((B,), T)
    with torch.no_grad():
        out = model(hidden_states=latent, timestep=x["timesteps"] * 1000, text_bth=x["txt"], text_lens=lens,
                    return_dict=False)[0]
    return out.flatten(2).transpose(1, 2)


# Measured: 8.0e-6 (patch 1) and 6.7e-6 (patch 2) with outputs ~5 on average, all of it from the RoPE angles:
# diffusers computes them in float32, core.rope_tables in float64. With float32 angles the outputs are equal.
@pytest.mark.parametrize("patch_size", [1, 2])
def test_ernie_image_matches_diffusers_fp32(patch_size, monkeypatch):
    reference = tiny_diffusers(patch_size)
    model = ours_from(reference)
    x = inputs(patch_size)
    expected = diffusers_forward(reference, x)
    with torch.no_grad():
        out = model(**x)
    diff = (out - expected).abs().max().item()
    print(f"patch {patch_size}: max |ours - diffusers| {diff:.2e}, mean |out| {expected.abs().mean():.2f}")
    assert out.shape == (B, H * W * patch_size**2, 12) and out.dtype == torch.float32
    assert expected.abs().mean() > 1.0 and diff <= 2e-5
    monkeypatch.setattr(core, "angle_dtype", lambda device: torch.float32)
    with torch.no_grad():
        assert torch.equal(model(**x), expected)


def test_masking_and_text_lengths_are_diffusers_and_matter():
    """The padded row's keys are masked and its image sits at its real length: changing its padding changes
    nothing, and a mask that masks nothing is the same as none (and as diffusers' full text_lens)."""
    reference = tiny_diffusers()
    model = ours_from(reference)
    x = inputs()
    with torch.no_grad():
        out = model(**x)
        x["txt"][0, LENGTHS[0]:] = 100.0  # the masked padding of row 0
        assert (model(**x) - out).abs().max().item() <= 1e-5
        full = inputs(masked=False)
        none = model(**full)
        assert torch.equal(model(**{**full, "txt_mask": torch.ones(B, T, dtype=torch.bool)}), none)
    assert (none - diffusers_forward(reference, full)).abs().max().item() <= 2e-5
    assert (none[0] - out[0]).abs().max().item() > 0.1  # 4 real tokens against 6: another prompt


RELEASED_PARAMETERS = 8_033_490_048  # baidu/ERNIE-Image (and -Turbo) transformer/config.json, on meta


def test_released_size_on_meta_matches_diffusers():
    released = {k: v for k, v in diffusers_config(ERNIE_IMAGE).items() if not k.startswith("_")}
    with torch.device("meta"):
        ours, reference = ErnieImage(ERNIE_IMAGE), ErnieImageTransformer2DModel(**released)
    count = sum(p.numel() for p in ours.parameters())
    print(f"ERNIE-Image: {count:,} parameters")
    assert count == sum(p.numel() for p in reference.parameters()) == RELEASED_PARAMETERS
    theirs = reference.state_dict()
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in theirs.items()}


def test_released_config_json_reads_as_the_released_config():
    """baidu/ERNIE-Image's transformer/config.json (ERNIE-Image-Turbo's adds lora_rank / use_lora, which diffusers
    ignores); a key diffusers' class does not know is refused, naming it."""
    released = {"_class_name": "ErnieImageTransformer2DModel", "_diffusers_version": "0.36.0", "eps": 1e-06,
                "ffn_hidden_size": 12288, "hidden_size": 4096, "in_channels": 128, "num_attention_heads": 32,
                "num_layers": 36, "out_channels": 128, "patch_size": 1, "qk_layernorm": True,
                "rope_axes_dim": [32, 48, 48], "rope_theta": 256, "text_in_dim": 3072}
    assert config_from_diffusers(released) == config_from_diffusers({**released, "lora_rank": 4, "use_lora": False})
    assert config_from_diffusers(released) == ERNIE_IMAGE and diffusers_config(ERNIE_IMAGE) == {
        k: v for k, v in released.items() if k != "_diffusers_version"}
    with pytest.raises(CheckpointError, match=r"config.json: unknown ErnieImageTransformer2DModel config keys \['x'\]"):
        config_from_diffusers({**released, "x": 1})


def test_random_inputs_positions_are_what_the_model_feeds_rope(monkeypatch):
    """The precision doctor's expected positions are the one rope_tables call of a forward: [image, text]."""
    seen = []
    original = ernie_model.rope_tables
    monkeypatch.setattr(ernie_model, "rope_tables", lambda pos, *a: seen.append(pos) or original(pos, *a))
    config = tiny_config()
    conditioning = random_inputs(config, 3, 4, 8, torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = ErnieImage(config)(img=torch.randn(1, 12, 16), timesteps=torch.tensor([0.5]), **conditioning.fixed)
    assert out.shape == (1, 12, 12) and len(seen) == 1 and seen[0].dtype == torch.int64
    assert torch.equal(seen[0], conditioning.positions) and conditioning.positions[0, 0].tolist() == [6, 0, 0]
    assert torch.equal(joint_positions(torch.tensor([2]), 1, 2, 3)[0],
                       torch.tensor([[2, 0, 0], [2, 0, 1], [0, 0, 0], [1, 0, 0], [2, 0, 0]]))


# ----------------------------------------------------------------------------------------------
# Checkpoints


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """One tiny model as the released single file (no metadata: the config from its shapes), the same under
    ComfyUI's prefix beside a bundled VAE tensor, and diffusers' own save_pretrained folder (sharded)."""
    folder = tmp_path_factory.mktemp("ernie_image")
    reference = tiny_diffusers()
    sd = {k: v.contiguous() for k, v in reference.state_dict().items()}
    save_file(sd, folder / "ernie_image.safetensors")
    save_file({**{COMFY_PREFIX + k: v for k, v in sd.items()}, "vae.decoder.conv_in.weight": torch.ones(2)},
              folder / "comfy.safetensors")
    reference.save_pretrained(folder / "pipeline" / "transformer", max_shard_size="100KB")
    return {"reference": reference, "single": str(folder / "ernie_image.safetensors"),
            "comfy": str(folder / "comfy.safetensors"), "diffusers": str(folder / "pipeline")}


def test_single_comfy_and_diffusers_files_load_the_same_model(files):
    models = [load_ernie_image(files[kind]) for kind in ("single", "comfy", "diffusers")]
    shards = [f for f in os.listdir(os.path.join(files["diffusers"], "transformer")) if f.endswith(".safetensors")]
    assert len(shards) > 1
    assert all(m.config == tiny_config() for m in models)
    weights = [m.state_dict() for m in models]
    assert all(w.keys() == weights[0].keys() and all(torch.equal(w[k], weights[0][k]) for k in w) for w in weights)
    x = inputs()
    expected = diffusers_forward(files["reference"], x)
    with torch.no_grad():
        outs = [m(**x) for m in models]
    assert all(torch.equal(o, outs[0]) for o in outs) and (outs[0] - expected).abs().max().item() <= 2e-5


def test_our_files_load_in_diffusers_and_back(files, tmp_path):
    model = load_ernie_image(files["single"])
    save_ernie_image_diffusers(model, None, str(tmp_path / "transformer"))
    pretrained = ErnieImageTransformer2DModel.from_pretrained(str(tmp_path / "transformer"))
    x = inputs()
    with torch.no_grad():
        assert (model(**x) - diffusers_forward(pretrained, x)).abs().max().item() <= 2e-5
    save_ernie_image_single_file(model, str(tmp_path / "comfy.safetensors"), prefix=COMFY_PREFIX)
    theirs = convert_ernie_image_transformer_checkpoint_to_diffusers(load_file(tmp_path / "comfy.safetensors"))
    pretrained.load_state_dict(theirs, strict=True)  # diffusers' own single-file conversion reads our file
    for path in (tmp_path, tmp_path / "comfy.safetensors"):
        again = load_ernie_image(str(path))
        assert again.config == model.config
        assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), model.state_dict().values()))
    planned = load_ernie_image(files["comfy"], dtype=torch.bfloat16, read_weights=False)
    assert {p.device.type for p in planned.parameters()} == {"meta"} and planned.compute_dtype == torch.bfloat16


def test_bf16_weights_compute_in_bf16_close_to_fp32(files):
    model, reference = load_ernie_image(files["single"], dtype=torch.bfloat16), load_ernie_image(files["single"])
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16} and model.compute_dtype == torch.bfloat16
    x = inputs()
    with torch.no_grad():
        out, expected = model(**x), reference(**x)
    assert out.dtype == torch.bfloat16
    assert ((out.float() - expected).norm() / expected.norm()).item() < 0.02


def test_a_wrong_shape_or_foreign_file_is_one_line_naming_file_key_and_shapes(files, tmp_path):
    sd = load_file(files["single"])
    save_file({**sd, "layers.1.mlp.up_proj.weight": torch.zeros(96, 32)}, tmp_path / "bad.safetensors")
    with pytest.raises(CheckpointError) as single_error:
        load_ernie_image(str(tmp_path / "bad.safetensors"))
    assert str(single_error.value) == (f"{tmp_path / 'bad.safetensors'}: key 'layers.1.mlp.up_proj.weight' has "
                                       f"shape (96, 32), expected (96, 64)")
    folder = os.path.join(files["diffusers"], "transformer")
    bad = tmp_path / "bad_folder"
    bad.mkdir()
    (bad / "config.json").write_text(open(os.path.join(folder, "config.json")).read())
    save_file({**sd, "layers.0.self_attention.to_v.weight": torch.zeros(64, 7)},
              bad / "diffusion_pytorch_model.safetensors")
    with pytest.raises(CheckpointError, match=re.escape("diffusion_pytorch_model.safetensors: key "
                                                        "'layers.0.self_attention.to_v.weight' has shape (64, 7), "
                                                        "expected (64, 64)")) as folder_error:
        load_ernie_image(str(bad))
    assert "\n" not in str(folder_error.value)
    save_file({"double_blocks.0.img_attn.qkv.weight": torch.zeros(6, 2)}, tmp_path / "other.safetensors")
    with pytest.raises(CheckpointError, match="not an ERNIE-Image transformer"):
        load_ernie_image(str(tmp_path / "other.safetensors"))


def test_a_comfyui_scaled_fp8_file_loads_as_stored(files, tmp_path):
    """ComfyUI's marker layout under its prefix (every Linear e4m3 with a float32 scale_weight): the Linears the
    keep rules leave to fp8 keep the file's codes and scales bit for bit, the kept ones hold codes * scale, and
    the output is the dequantized float32 model's exactly."""
    sd = load_file(files["single"])
    stored, dequantized = {"scaled_fp8": torch.empty(0, dtype=E4M3)}, {}
    for key, w in sd.items():
        if w.dim() == 2:  # the Linears (the patch embedding is a Conv2d: ComfyUI leaves it)
            scale = w.abs().max() / 448
            stored[key], stored[key[: -len("weight")] + "scale_weight"] = (w / scale).to(E4M3), scale
            dequantized[key] = stored[key].float() * scale
        else:
            stored[key] = dequantized[key] = w
    save_file({COMFY_PREFIX + k: v for k, v in stored.items()}, tmp_path / "ernie_fp8_scaled.safetensors")
    loaded = load_ernie_image(str(tmp_path / "ernie_fp8_scaled.safetensors")).eval()  # the spec's keep rules
    quantized = [n for n, m in loaded.named_modules() if isinstance(m, FP8Linear)]
    assert len(quantized) == 2 * 7  # q, k, v, out and the MLP's three in each block
    for name in quantized:
        layer = loaded.get_submodule(name)
        assert torch.equal(layer.weight.view(torch.uint8), stored[f"{name}.weight"].view(torch.uint8)), name
        assert torch.equal(layer.weight_scale, stored[f"{name}.scale_weight"]), name
    assert type(loaded.text_proj) is nn.Linear and torch.equal(loaded.text_proj.weight, dequantized["text_proj.weight"])
    twin = ErnieImage(tiny_config())
    twin.load_state_dict(dequantized, strict=True)
    with torch.no_grad():
        assert torch.equal(loaded(**inputs()), twin.eval()(**inputs()))


# ----------------------------------------------------------------------------------------------
# Training paths


def test_gradient_checkpointing_gives_the_same_gradients(files):
    model = load_ernie_image(files["single"])
    x = inputs()
    grads = []
    for ckpt in (False, True):
        model.zero_grad()
        model.gradient_checkpointing = ckpt
        model(**x).square().mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])
    for name in ("adaLN_modulation.1.weight", "layers.0.self_attention.norm_k.weight", "x_embedder.proj.weight",
                 "text_proj.weight", "time_embedding.linear_1.weight"):
        assert grads[0][name].abs().max() > 0, name


def test_block_swap_changes_nothing(files):
    model = load_ernie_image(files["single"]).requires_grad_(False)
    x = inputs()
    with torch.no_grad():
        expected = model(**x)
        swap = enable_block_swap(model, 1, "cpu")
        out = model(**x)
    assert torch.equal(out, expected) and not swap.resident and not swap.pending
