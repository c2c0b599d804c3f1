"""HunyuanImage-2.1's VAE wrapper (library/models/hunyuan_image/vae.py) against diffusers' AutoencoderKLHunyuanImage
and HunyuanImagePipeline's normalisation; its three file layouts; the single file's name table against the released
layout; wrong files; the memory planner's estimate of its passes."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from library.io import CheckpointError, save_safetensors
from library.models.hunyuan_image.tiny_vae import write_hunyuan_image_vae
from library.models.hunyuan_image.vae import (
    HUNYUAN_IMAGE_VAE_CONFIG,
    HunyuanImageVAE,
    diffusers_to_single_file,
    single_file_blocks,
    single_file_to_diffusers,
)
from library.models.vae import vae_on_meta


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("hunyuan_image_vae"))
    return {**write_hunyuan_image_vae(out, seed=0), "root": os.path.join(out, "hunyuan_image")}


def images(batch: int = 2, height: int = 64, width: int = 96) -> torch.Tensor:
    """Non-square images in [-1, 1] (2 x 3 latents at 32x)."""
    return torch.rand(batch, 3, height, width, generator=torch.Generator().manual_seed(3)) * 2 - 1


def test_hunyuan_image_vae_matches_diffusers_and_the_pipeline_fp32(files):
    """encode = diffusers' posterior mode x scaling_factor, decode = diffusers' decode of latents / scaling_factor
    (HunyuanImagePipeline.__call__), the diffusers model loaded by diffusers' own from_pretrained."""
    from diffusers import AutoencoderKLHunyuanImage

    reference = AutoencoderKLHunyuanImage.from_pretrained(files["hunyuan_image_vae"]).eval()
    ours = HunyuanImageVAE(files["hunyuan_image_vae"])
    x = images()
    latents = ours.encode(x)
    assert latents.shape == (2, 64, 2, 3) and latents.dtype == torch.float32
    with torch.no_grad():
        z = reference.encode(x).latent_dist.mode()
        expected = z * reference.config.scaling_factor
        assert (latents - expected).abs().max().item() <= 1e-5
        decoded = reference.decode(latents / reference.config.scaling_factor).sample.clamp(-1, 1)
    assert (ours.decode(latents) - decoded).abs().max().item() <= 1e-5
    # The normalisation counts: without it the latents are z, off by a factor 1 / 0.75289.
    assert (latents - z).abs().max().item() > 0.1 * z.abs().max().item()
    # A generator samples the posterior (mean + std * noise), reproducibly.
    sampled = ours.encode(x, torch.Generator().manual_seed(0))
    assert torch.equal(sampled, ours.encode(x, torch.Generator().manual_seed(0))) and not torch.equal(sampled, latents)


def test_hunyuan_image_vae_scaling_factor_is_the_released_one(files):
    """0.75289, scale only (diffusers' converted vae/config.json, sd-scripts' LATENT_SCALING_FACTOR, ComfyUI's
    latent_formats.HunyuanImage21), in the built-in config and kept by the tiny files."""
    assert HUNYUAN_IMAGE_VAE_CONFIG["scaling_factor"] == 0.75289
    meta = vae_on_meta(HunyuanImageVAE)
    assert meta.scaling_factor == 0.75289 and meta.latent_channels == 64 and meta.downsample == 32
    ours = HunyuanImageVAE(files["hunyuan_image_vae_single"])
    x = images(1)
    with torch.no_grad():
        z = ours.vae.encode(x).latent_dist.mode()
    assert (ours.encode(x) - 0.75289 * z).abs().max().item() <= 1e-6


def test_hunyuan_image_vae_file_layouts_load_the_same_weights(files, tmp_path):
    """The diffusers folder, a repo folder with vae/, a diffusers-keyed single file and the ComfyUI / sd-scripts
    single file (Tencent's names, float16) give the same model, bit for bit."""
    from diffusers import AutoencoderKLHunyuanImage

    folder = HunyuanImageVAE(files["hunyuan_image_vae"]).vae.state_dict()
    single = load_file(files["hunyuan_image_vae_single"])
    assert all(v.dtype == torch.float16 for v in single.values()) and not any("_blocks." in k for k in single)
    diffusers_file = str(tmp_path / "diffusers_keyed.safetensors")
    config = dict(AutoencoderKLHunyuanImage.load_config(files["hunyuan_image_vae"]))
    save_safetensors(folder, diffusers_file, metadata={"diffusers_config": json.dumps(config)})
    for path in (files["root"], files["hunyuan_image_vae_single"], diffusers_file):
        loaded = HunyuanImageVAE(path).vae.state_dict()
        assert loaded.keys() == folder.keys()
        assert all(torch.equal(loaded[k], folder[k]) for k in folder), path
    # bfloat16 as asked: the VAE runs in it, latents still float32
    assert HunyuanImageVAE(files["hunyuan_image_vae_single"], torch.bfloat16).encode(images(1)).dtype == torch.float32


def test_hunyuan_image_vae_name_table_is_the_released_layout():
    """Every diffusers tensor of the released VAE maps to one single-file name and back, none left over; the names
    are those of diffusers' scripts/convert_hunyuan_image_to_diffusers.py (a flat block list: per encoder level 2
    resnets then the downsampling, per decoder level 3 then the upsampling) and of sd-scripts' HunyuanVAE2D."""
    meta = vae_on_meta(HunyuanImageVAE).vae.state_dict()
    config = HUNYUAN_IMAGE_VAE_CONFIG
    original = diffusers_to_single_file(meta, config)
    # encoder: conv_in 2 + 12 resnets x 8 + 5 downsamplings x 2 + mid (2 resnets x 8 + attention 10) + head 4 = 138;
    # decoder: conv_in 2 + mid 26 + 18 resnets x 8 + 5 upsamplings x 2 + head 4 = 186
    assert len(original) == len(meta) == 138 + 186
    back = single_file_to_diffusers(original, config)
    assert back.keys() == meta.keys() and all(back[k] is meta[k] for k in meta)
    blocks = single_file_blocks(config)
    assert len(set(blocks.values())) == len(blocks)
    expected = {
        "encoder.down_blocks.0": "encoder.down.0.block.0", "encoder.down_blocks.2": "encoder.down.0.downsample",
        "encoder.down_blocks.14": "encoder.down.4.downsample", "encoder.down_blocks.16": "encoder.down.5.block.1",
        "decoder.up_blocks.3": "decoder.up.0.upsample", "decoder.up_blocks.19": "decoder.up.4.upsample",
        "decoder.up_blocks.22": "decoder.up.5.block.2", "encoder.mid_block.attentions.0": "encoder.mid.attn_1",
        "decoder.mid_block.resnets.1": "decoder.mid.block_2",
    }
    assert {k: blocks[k] for k in expected} == expected
    assert "encoder.down_blocks.17" not in blocks and "decoder.up_blocks.23" not in blocks
    assert not any(".down.5.downsample" in k or ".up.5.upsample" in k for k in original)
    assert original["encoder.mid.attn_1.proj_out.weight"].shape == (1024, 1024, 1, 1)
    assert original["decoder.up.0.upsample.conv.weight"].shape == (4 * 1024, 1024, 3, 3)  # 1024 -> 1024 at 2x
    assert original["encoder.down.0.downsample.conv.weight"].shape == (256 // 4, 128, 3, 3)
    assert {k for k in original if k.startswith("encoder.mid.attn_1.")} == {
        f"encoder.mid.attn_1.{m}.{p}" for m in ("norm", "q", "k", "v", "proj_out") for p in ("weight", "bias")}


def test_hunyuan_image_vae_wrong_files_are_one_clear_error(files, tmp_path):
    """FLUX.1's 16-channel AE, a video VAE (Qwen-Image's, 3-D convolutions), Qwen-Image-2.1's 64-channel RGBA VAE
    and a single file with a tensor missing: one CheckpointError naming the file."""
    from library.models.flux1.tiny import write_flux_vae
    from library.models.qwen_image.tiny import write_qwen_vae
    from library.models.qwen_image21.tiny import write_qwen_image21_vae

    flux = write_flux_vae(str(tmp_path), 0)["flux_vae_single"]
    video = write_qwen_vae(str(tmp_path), 0)["qwen_image_vae"]
    rgba = write_qwen_image21_vae(str(tmp_path), 0)["qwen_image21_vae"]
    not_it = r": ae is not a HunyuanImage-2.1 VAE \(64 latent channels, 32x\): "
    with pytest.raises(CheckpointError, match=r"flux/ae\.safetensors" + not_it + r".*conv_out.*\(128, \*, 3, 3\)"):
        HunyuanImageVAE(flux)
    with pytest.raises(CheckpointError, match=r"qwen_image/vae" + not_it + r".*conv_out.*\(128, \*, 3, 3\)"):
        HunyuanImageVAE(video)
    with pytest.raises(CheckpointError, match=r"qwen_image21/vae" + not_it + r"'encoder.conv_in.weight'.*\(\*, 3, 3"):
        HunyuanImageVAE(rgba)
    cut = load_file(files["hunyuan_image_vae_single"])
    del cut["decoder.up.1.block.0.conv1.weight"]
    broken = str(tmp_path / "broken.safetensors")
    with safe_open(files["hunyuan_image_vae_single"], "pt") as f:
        save_safetensors(cut, broken, metadata=f.metadata())  # its config: the tiny sizes
    with pytest.raises(CheckpointError, match=r"broken\.safetensors: .*missing \['decoder.up_blocks.3.conv1.weight"):
        HunyuanImageVAE(broken)
    with pytest.raises(ValueError, match="multiples of 32"):
        HunyuanImageVAE(files["hunyuan_image_vae"]).encode(images(1, 64, 80))


def test_hunyuan_image_vae_memory_plan_counts_a_real_pass(files):
    """The planner's meta run of an encode and a decode (vae_pass_peak) against the tensors a real CPU run holds
    (LiveBytes on cpu), within 1%; on the released VAE tiled decoding lowers the planned 1024 px decode."""
    from library.training.memory_plan import LiveBytes, module_bytes, vae_pass_peak

    ours = HunyuanImageVAE(files["hunyuan_image_vae"])
    meta = vae_on_meta(HunyuanImageVAE, files["hunyuan_image_vae"])
    weights = module_bytes(ours.vae)
    x = images(1, 128, 192)
    with LiveBytes("cpu") as encoding:  # the input counts, as the planner's does (made on meta inside its count)
        encoding.track(x)
        latents = ours.encode(x)
    with LiveBytes("cpu") as decoding:
        decoding.track(latents)
        ours.decode(latents)
    planned_encode = vae_pass_peak(meta, 192, 128, 1, decode=False) - weights
    planned_decode = vae_pass_peak(meta, 192, 128, 1, decode=True, downsample=32) - weights
    assert abs(planned_encode / encoding.peak - 1) < 0.01 and abs(planned_decode / decoding.peak - 1) < 0.01
    released = vae_on_meta(HunyuanImageVAE)
    whole = vae_pass_peak(released, 1024, 1024, 1, decode=True, downsample=32)
    tiled = vae_pass_peak(released, 1024, 1024, 1, decode=True, downsample=32, tiled=True)
    # 405.6 M parameters (1.51 GiB float32) + 1792.5 bytes per decoded pixel whole, 459 in 512 px tiles
    assert module_bytes(released.vae) == 1_622_301_964 and whole - tiled > 1.2 * 2**30


def test_the_family_reads_its_vae_downsampling_from_the_vae_config(files, tmp_path):
    """HunyuanImageFamily.vae_downsample: the release's 32 for the tiny set's VAE (its config says 32), a file without
    a config and a path not written yet; a 16x AutoencoderKLHunyuanImage (the learned tiny base's) is read at 16, the
    latent grid its wrapper encodes to (the family sizes buckets and sampled latents by it)."""
    from diffusers import AutoencoderKLHunyuanImage

    from library.io import save_diffusers_folder
    from library.models.hunyuan_image.family import HunyuanImageFamily
    from library.models.hunyuan_image.tiny_vae import tiny_vae_config

    unwritten = str(tmp_path / "not_yet")
    for path in (files["hunyuan_image_vae"], files["root"], unwritten, None):
        assert HunyuanImageFamily("transformer.safetensors", path).vae_downsample == 32, path
    config = {**tiny_vae_config(), "block_out_channels": [32, 32, 32, 64, 128], "spatial_compression_ratio": 16}
    torch.manual_seed(0)
    folder = str(tmp_path / "vae16")
    save_diffusers_folder(AutoencoderKLHunyuanImage(**config).state_dict(),
                          {"_class_name": "AutoencoderKLHunyuanImage", **config}, folder)
    family = HunyuanImageFamily("transformer.safetensors", folder)
    assert family.vae_downsample == 16
    assert family.load_vae(torch.float32).encode(images(1)).shape == (1, 64, 4, 6)
