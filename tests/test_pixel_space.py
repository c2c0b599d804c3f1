"""What a pixel-space family needs of the generic code: a VAE wrapper that passes the pixels through and reads no
file (vae.py PixelVAE, the family's vae_file = False: `ae` neither required nor taken, the latent cache keyed by the
wrapper), pixel patches packed as tokens (pack_latents at p = 32); with the training-noise hook
(test_training_objective.py) and loss masks repeated onto the pixel grid (test_masked_loss.py).

PixelFluxFamily, a test-only family, puts the tiny FLUX.1 transformer behind pixel latents: 32 px patches of the
[-1, 1] pixels (3072 values a token) through a fixed random projection to the 64 channels its img_in takes, and
its output back. It trains (alpha-masked images: the masks on the pixel grid), caches, validates, samples, plans
and generates with no `ae` anywhere."""

import os
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

import train_lora
from library.models.family import family_class
from library.models.flux1.family import FluxFamily
from library.models.latents import pack_latents, unpack_latents
from library.models.registry import FAMILIES
from library.models.vae import PixelVAE
from tests.test_train_lora import read_losses, sample_png

PATCH = 32  # pixels per token side
ALIAS = "library.models.flux1.pixel_space_test_family"  # in FLUX.1's folder: the family finds FLUX.1's spec


def projections(device) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed maps between a 3 x 32 x 32 pixel patch and the tiny FLUX.1's 64 token channels."""
    g = torch.Generator().manual_seed(140)
    down = torch.randn(3 * PATCH * PATCH, 64, generator=g) / (3 * PATCH * PATCH) ** 0.5
    up = torch.randn(64, 3 * PATCH * PATCH, generator=g) / 8.0
    return down.to(device), up.to(device)


class PixelFluxFamily(FluxFamily):
    """The tiny FLUX.1 on pixels: no VAE file, 1x "downsampling", 3 channels, 32 px patches."""

    vae = "library.models.vae:PixelVAE"
    vae_file = False
    vae_downsample, latent_channels, patch = 1, 3, PATCH

    def model_files(self):
        return [f for f in super().model_files() if f.key != "ae"]

    def pack_target(self, latents):
        return pack_latents(latents, self.patch)

    def unpack_target(self, tokens, shape):
        return unpack_latents(tokens, shape[-2], shape[-1], self.patch)

    def predict(self, model, x_t, sigmas, text, h, w, guidance):
        down, up = projections(x_t.device)
        return super().predict(model, x_t.float() @ down, sigmas, text, h, w, guidance).float() @ up


@pytest.fixture
def pixel_flux(monkeypatch):
    """model_type flux served by PixelFluxFamily for the test (this module under a name in FLUX.1's folder)."""
    monkeypatch.setitem(sys.modules, ALIAS, sys.modules[__name__])
    monkeypatch.setitem(FAMILIES, "flux", f"{ALIAS}:PixelFluxFamily")
    assert family_class("flux") is PixelFluxFamily


# ----------------------------------------------------------------------------------------------
# The pieces


def test_the_pixel_vae_passes_pixels_through_reads_no_file_and_holds_no_weights():
    images = torch.rand(2, 3, 64, 96) * 2 - 1
    vae = PixelVAE(None, torch.bfloat16)
    latents = vae.encode(images)
    assert latents.dtype == torch.float32 and torch.equal(latents, images) and vae.latent_channels == 3
    assert torch.equal(vae.decode(latents * 3), (images * 3).clamp(-1, 1))  # clamped as the VAEs' decodes
    assert sum(p.numel() for p in vae.vae.parameters()) == 0
    on_meta = vae.encode(torch.empty(1, 3, 64, 64, device="meta"))
    assert on_meta.device.type == "meta" and on_meta.shape == (1, 3, 64, 64)
    with pytest.raises(Exception, match="ae.safetensors: this model takes pixels and reads no VAE file"):
        PixelVAE("ae.safetensors")


def test_pack_latents_at_32_makes_32_px_patch_tokens_in_c_p1_p2_order_and_unpacks_back():
    z = torch.randn(2, 3, 64, 96)
    tokens = pack_latents(z, PATCH)
    assert tokens.shape == (2, 2 * 3, 3 * PATCH * PATCH)
    # token (r, c) of the 2 x 3 grid, row-major, holds its patch's values channel first, then rows, then columns
    assert torch.equal(tokens[1, 1 * 3 + 2], z[1, :, 32:64, 64:96].reshape(-1))
    assert torch.equal(unpack_latents(tokens, 64, 96, PATCH), z)
    assert torch.equal(pack_latents(z[:, :, :8, :8]), pack_latents(z[:, :, :8, :8], 2))  # the default: 2 x 2


def test_a_family_without_a_vae_file_needs_no_ae_refuses_one_and_keys_its_cache_by_its_wrapper(tiny_set):
    assert "ae" in FluxFamily.required_paths() and FluxFamily.unread_files() == {}
    assert PixelFluxFamily.required_paths() == ("pretrained_model_name_or_path", "clip_l", "t5xxl")
    assert PixelFluxFamily.unread_files() == {"ae": "model_type flux takes the image's pixels and has no VAE file"}
    family = PixelFluxFamily(tiny_set["flux_bfl"], None, clip_l=tiny_set["clip_l"], t5xxl=tiny_set["t5xxl"])
    assert family.latent_cache_key() == "flux_PixelVAE"
    assert isinstance(family.load_vae(), PixelVAE) and isinstance(family.vae_on_meta(), PixelVAE)
    assert set(family.unread_training_keys(SimpleNamespace())) == {"ae"}  # the tiny FLUX.1 reads guidance
    family.check_model_files()  # the transformer and the text encoders: no VAE file to check


def test_the_planner_plans_a_pixel_family_with_no_vae_weights(tiny_set):
    from library.training.memory_plan import caching_phase, sampling_phase, training_plan
    from tools import plan_memory

    family = PixelFluxFamily(tiny_set["flux_bfl"], None, clip_l=tiny_set["clip_l"], t5xxl=tiny_set["t5xxl"])
    args = plan_memory.default_args("flux")
    assert training_plan(family, args, 64, 64, 1, 8).phase(0).peak > 0
    sampling = sampling_phase(family, args, 64, 64, 8, 0)
    assert sampling.parts["vae (weights)"] == 0
    caching = caching_phase(family, args, 64, 64)
    # the encode holds the batch of images once (float32), nothing beside it
    assert caching.parts[f"vae encode (batch {args.vae_batch_size})"] <= args.vae_batch_size * 3 * 64 * 64 * 4


# ----------------------------------------------------------------------------------------------
# Training, caching and sampling with no `ae`


def write_masked_dataset(folder) -> tuple[str, str]:
    """Four 64 x 64 RGBA images whose left half is transparent (alpha_mask: the loss there is 0), captioned; a
    dataset TOML on the 32 px token grid and a sample prompt file."""
    images = folder / "images"
    images.mkdir(parents=True)
    for i, colour in enumerate([(200, 30, 30), (30, 200, 30), (30, 30, 200), (200, 200, 30)]):
        array = np.zeros((64, 64, 4), dtype=np.uint8)
        array[..., :3], array[..., 3] = colour, 255
        array[:, :32, 3] = 0
        Image.fromarray(array, "RGBA").save(images / f"{i}.png")
        (images / f"{i}.txt").write_text(f"a square of colour {i}")
    toml = folder / "dataset.toml"
    toml.write_text(f'[general]\nresolution = 64\nbatch_size = 2\ncaption_extension = ".txt"\nenable_bucket = false\n\n'
                    f'[[datasets]]\nvalidation_split = 0.25\n\n  [[datasets.subsets]]\n  image_dir = "{images}"\n'
                    f'  alpha_mask = true\n')
    prompts = folder / "prompts.txt"
    prompts.write_text("a square of colour 1 --w 64 --h 64 --s 2 --d 1 --g 1.0\n")
    return str(toml), str(prompts)


@pytest.fixture
def trained(tiny_set, tmp_path, pixel_flux):
    dataset, prompts = write_masked_dataset(tmp_path / "data")
    out = tmp_path / "run"
    code = train_lora.main([
        "--model_type", "flux", "--pretrained_model_name_or_path", tiny_set["flux_bfl"],
        "--clip_l", tiny_set["clip_l"], "--t5xxl", tiny_set["t5xxl"], "--t5xxl_max_token_length", "16",
        "--dataset_config", dataset, "--sample_prompts", prompts, "--output_dir", str(out), "--output_name", "pixels",
        "--max_train_steps", "2", "--mixed_precision", "no", "--network_dim", "4", "--network_alpha", "4",
        "--optimizer_type", "AdamW", "--learning_rate", "1e-3", "--sample_at_first", "false",
        "--save_every_n_steps", "0", "--cache_latents_to_disk", "true",
    ])
    assert code == 0
    return out, dataset


def test_a_pixel_family_trains_caches_validates_and_samples_without_ae(trained):
    out, dataset = trained
    losses = read_losses(out, "pixels")
    assert len(losses) == 2 and all(np.isfinite(losses))
    assert any(k.startswith("lora_unet_double_blocks_0_img_attn_qkv.") for k in load_file(out / "pixels.safetensors"))
    image = Image.open(sample_png(out, "pixels", "final"))
    assert image.size == (64, 64 + 14) and image.text["size"] == "64x64"  # one panel below its 14 px label strip
    caches = [f for f in os.listdir(os.path.dirname(dataset) + "/images") if f.endswith(".safetensors")]
    assert caches, "the pixel latents were cached to disk"
    cached = load_file(os.path.join(os.path.dirname(dataset), "images", sorted(caches)[0]))
    latents = next(v for k, v in cached.items() if k.startswith("latents"))
    assert latents.shape == (3, 64, 64) and float(latents.abs().max()) <= 1.0  # the pixels themselves, in [-1, 1]


def test_an_ae_given_to_a_pixel_family_is_refused_before_caching(tiny_set, tmp_path, pixel_flux, capsys):
    dataset, _ = write_masked_dataset(tmp_path / "data")
    code = train_lora.main([
        "--model_type", "flux", "--pretrained_model_name_or_path", tiny_set["flux_bfl"],
        "--ae", tiny_set["flux_vae_single"], "--clip_l", tiny_set["clip_l"], "--t5xxl", tiny_set["t5xxl"],
        "--dataset_config", dataset, "--output_dir", str(tmp_path / "run"), "--max_train_steps", "1",
    ])
    assert code != 0
    assert (f"key 'ae' = {tiny_set['flux_vae_single']} does nothing: model_type flux takes the image's pixels and "
            f"has no VAE file; remove it") in capsys.readouterr().err
    assert not [f for f in os.listdir(tmp_path / "data" / "images") if f.endswith(".safetensors")]


def test_generate_renders_a_pixel_family_without_ae_and_refuses_one(tiny_set, tmp_path, pixel_flux, capsys):
    from tools import generate

    argv = ["--model_type", "flux", "--model", tiny_set["flux_bfl"], "--clip_l", tiny_set["clip_l"],
            "--t5xxl", tiny_set["t5xxl"], "--t5xxl_max_token_length", "16", "--prompt", "a red square",
            "--width", "64", "--height", "64", "--steps", "2", "--seed", "1", "--dtype", "fp32", "--out",
            str(tmp_path / "out"), "--device", "cpu"]
    assert generate.main(argv) == 0
    (png,) = (tmp_path / "out").glob("*.png")
    assert Image.open(png).size == (64, 64)
    assert generate.main([*argv, "--ae", tiny_set["flux_vae_single"]]) == 2
    assert "--ae is not read: model_type flux takes the image's pixels and has no VAE file" in capsys.readouterr().err
