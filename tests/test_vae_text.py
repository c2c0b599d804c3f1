"""VAEs (latent packing, normalisation, single-file loading) and text encoders (CLIP-L/T5 for FLUX,
the Qwen2.5-VL-style encoder for Qwen-Image), checked against diffusers/transformers on tiny models."""

import os
import shutil

import pytest
import torch
from diffusers import AutoencoderKL, AutoencoderKLQwenImage
from diffusers.pipelines.flux.pipeline_flux import FluxPipeline
from diffusers.pipelines.qwenimage.pipeline_qwenimage import QwenImagePipeline

from library.io import CheckpointError
from library.models.flux1.text_encoder import encode_flux_prompts
from library.models.flux1.vae import FLUX_VAE_CONFIG, FluxVAE, load_flux_vae
from library.models.qwen_image.text_encoder import (
    QWEN_IMAGE_DROP_TOKENS,
    QWEN_IMAGE_PROMPT_TEMPLATE,
    QwenImageTextEncoder,
    load_qwen_image_text_encoder,
)
from library.models.qwen_image.vae import QwenImageVAE
from library.models.text_encoders import load_clip_l, load_t5
from library.models.latents import pack_latents, unpack_latents
from library.models.flux1 import tiny
from library.models.qwen_image.tiny import write_qwen_text_encoder

PROMPTS = ["a cat", "a photo of a dog with a blue ball in the grass, oil on canvas"]


@pytest.fixture(scope="module")
def encoders(tmp_path_factory):
    """Tiny CLIP/T5/Qwen text-encoder folders written by the tiny-model tool (no FLUX/Qwen DiT)."""
    out = str(tmp_path_factory.mktemp("enc"))
    paths = {**tiny.write_clip(out, 0), **tiny.write_t5(out, 0), **write_qwen_text_encoder(out, 0)}
    paths["out"] = out
    return paths


def _tiny_flux_vae():
    config = {**FLUX_VAE_CONFIG, "block_out_channels": [8, 16, 16, 16], "norm_num_groups": 4, "layers_per_block": 1}
    return AutoencoderKL(**config).eval(), config


def _images(batch=2, size=32):
    return torch.rand(batch, 3, size, size, generator=torch.Generator().manual_seed(1)) * 2 - 1


# ----------------------------------------------------------------------------------------------
# Packing


def test_pack_unpack_match_diffusers_flux_and_qwen_pipelines():
    z = torch.randn(2, 16, 6, 8)
    packed = pack_latents(z)
    assert packed.shape == (2, 12, 64)
    assert torch.equal(packed, FluxPipeline._pack_latents(z, 2, 16, 6, 8))
    assert torch.equal(packed, QwenImagePipeline._pack_latents(z, 2, 16, 6, 8))
    # diffusers unpacks from the pixel size (48 x 64 at VAE factor 8) to the same latent grid.
    assert torch.equal(unpack_latents(packed, 6, 8), FluxPipeline._unpack_latents(packed, 48, 64, 8))
    assert torch.equal(unpack_latents(packed, 6, 8), z)


def test_pack_latents_rejects_odd_latent_size():
    with pytest.raises(ValueError, match="multiples of 2, got 5x8"):
        pack_latents(torch.zeros(1, 16, 5, 8))
    with pytest.raises(ValueError, match="multiples of 32, got 64x48"):
        pack_latents(torch.zeros(1, 3, 64, 48), 32)
    with pytest.raises(ValueError, match="do not fit"):
        unpack_latents(torch.zeros(1, 12, 64), 4, 4)


# ----------------------------------------------------------------------------------------------
# FLUX VAE


def test_flux_vae_latents_are_shifted_and_scaled_mode():
    vae, config = _tiny_flux_vae()
    wrapper, x = FluxVAE(vae), _images()
    latents = wrapper.encode(x)
    with torch.no_grad():
        dist = vae.encode(x).latent_dist
        expected = (dist.mode() - 0.1159) * 0.3611
        decoded = vae.decode(latents / 0.3611 + 0.1159).sample.clamp(-1, 1)
    assert latents.dtype == torch.float32 and latents.shape == (2, 16, 4, 4)
    assert (latents - expected).abs().max().item() <= 1e-6
    assert (wrapper.decode(latents) - decoded).abs().max().item() <= 1e-6
    # With a generator the latents are a sample of the posterior (as BFL/sd-scripts encode).
    sampled = wrapper.encode(x, generator=torch.Generator().manual_seed(3))
    manual = (dist.sample(torch.Generator().manual_seed(3)) - 0.1159) * 0.3611
    assert (sampled - manual).abs().max().item() <= 1e-6
    assert (sampled - latents).abs().max().item() > 1e-3


def test_flux_vae_bfl_single_file_loads_like_diffusers_folder(tmp_path):
    paths = tiny.write_flux_vae(str(tmp_path), 0)
    folder, single = load_flux_vae(paths["flux_vae"]), load_flux_vae(paths["flux_vae_single"])
    a, b = folder.vae.state_dict(), single.vae.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    x = _images()
    assert torch.equal(folder.encode(x), single.encode(x))
    # The reference loader agrees: diffusers reads the folder to the same weights.
    ref = AutoencoderKL.from_pretrained(paths["flux_vae"]).state_dict()
    assert all(torch.equal(ref[k], a[k]) for k in ref)


def test_flux_vae_single_file_without_config_uses_released_config(tmp_path):
    paths = tiny.write_flux_vae(str(tmp_path), 0)
    bare = tmp_path / "bare" / "ae.safetensors"
    os.makedirs(bare.parent)
    from library.io import CheckpointReader, save_safetensors

    reader = CheckpointReader(paths["flux_vae_single"])
    save_safetensors(dict(reader.items()), str(bare))  # no metadata: the full-size FLUX config applies
    with pytest.raises(CheckpointError, match="ae.safetensors"):
        load_flux_vae(str(bare))


def test_flux_vae_bf16_returns_float32_latents_close_to_fp32():
    vae, _ = _tiny_flux_vae()
    x = _images()
    fp32 = FluxVAE(vae).encode(x)
    bf16 = FluxVAE(vae, dtype=torch.bfloat16).encode(x)
    assert bf16.dtype == torch.float32
    assert (bf16 - fp32).abs().max().item() < 0.05


# ----------------------------------------------------------------------------------------------
# Qwen-Image VAE


def test_qwen_vae_latents_are_normalised_per_channel():
    vae = AutoencoderKLQwenImage(base_dim=4, z_dim=16).eval()
    wrapper, x = QwenImageVAE(vae), _images(size=16)  # 3-D convs: keep the image small
    latents = wrapper.encode(x)
    mean = torch.tensor(vae.config.latents_mean).view(1, 16, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, 16, 1, 1, 1)
    with torch.no_grad():
        z = vae.encode(x[:, :, None]).latent_dist.mode()  # [B, 16, 1, h, w]
        expected = ((z - mean) / std)[:, :, 0]
        decoded = vae.decode(latents[:, :, None] * std + mean).sample[:, :, 0]
    assert latents.shape == (2, 16, 2, 2) and latents.dtype == torch.float32
    assert (latents - expected).abs().max().item() <= 1e-5
    assert (wrapper.decode(latents) - decoded).abs().max().item() <= 1e-6
    assert (wrapper.decode(latents[:, :, None]) - decoded).abs().max().item() <= 1e-6  # 5-D accepted


def test_decoding_in_tiles_is_diffusers_tiled_decode_at_our_tile_size_and_only_inside_the_block():
    """vae_tiling's decode: diffusers' tiled_decode with TILE_PIXELS tiles for a one-size-tiling VAE (its own
    tile is the config's sample_size, 1024 for the released ones: nothing tiled at 1024 px), the VAE's own
    tile sizes otherwise; whole again after the block, and whole where the image is not over a tile."""
    from library.models.vae import decoding_in_tiles

    vae, _ = _tiny_flux_vae()
    wrapper = FluxVAE(vae)
    latents = wrapper.encode(_images(1, 64))
    whole = wrapper.decode(latents)
    with decoding_in_tiles(vae, tile_pixels=64):
        assert torch.equal(wrapper.decode(latents), whole)  # 64 px is not over a 64 px tile
    with decoding_in_tiles(vae, tile_pixels=32):
        tiled = wrapper.decode(latents)
    assert (vae.use_tiling, vae.tile_sample_min_size, vae.tile_latent_min_size) == (False, 1024, 128)
    vae.tile_sample_min_size, vae.tile_latent_min_size = 32, 4
    with torch.no_grad():
        expected = vae.tiled_decode(latents / 0.3611 + 0.1159).sample.clamp(-1, 1)
    assert torch.equal(tiled, expected) and (tiled - whole).abs().max() > 1e-3

    qwen = AutoencoderKLQwenImage(base_dim=4, z_dim=16).eval()
    qwen.tile_sample_min_height = qwen.tile_sample_min_width = 16  # its own sizes (diffusers' default 256)
    qwen.tile_sample_stride_height = qwen.tile_sample_stride_width = 8
    wrapper = QwenImageVAE(qwen)
    latents = wrapper.encode(_images(1, 32))
    with decoding_in_tiles(qwen):
        tiled = wrapper.decode(latents)
    assert qwen.use_tiling is False and qwen.tile_sample_min_height == 16
    qwen.use_tiling = True
    assert torch.equal(tiled, wrapper.decode(latents))  # diffusers' own tiled decode
    qwen.use_tiling = False
    assert (tiled - wrapper.decode(latents)).abs().max() > 1e-4
    with torch.no_grad():  # a decoder that overshoots, as a trained one does: diffusers clamps its whole decode only
        qwen.decoder.conv_out.weight.mul_(8)
        qwen.decoder.conv_out.bias.mul_(8)
    with decoding_in_tiles(qwen):
        assert wrapper.decode(latents).abs().max() <= 1  # (Qwen-Image-Layered's alpha went past: its preview was off)


# ----------------------------------------------------------------------------------------------
# Single VAE files in the layouts the families' VAEs are released in (BFL, ComfyUI)


def _saved_with_config(tensors: dict, folder: str, path: str) -> str:
    """`tensors` at `path`, carrying the diffusers `folder`'s tiny sizes only: where its config differs from the
    class's defaults (the released VAE's, which a released file gets, as it carries no config)."""
    import inspect
    import json

    import diffusers

    from library.io import save_safetensors

    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    defaults = inspect.signature(getattr(diffusers, config["_class_name"])).parameters
    tiny = {k: v for k, v in config.items() if k in defaults and json.loads(json.dumps(defaults[k].default)) != v}
    save_safetensors({k: v.contiguous() for k, v in tensors.items()}, path,
                     metadata={"diffusers_config": json.dumps(tiny)})
    return path


def _flux2_bfl_file(folder: str, path: str) -> str:
    """The diffusers FLUX.2 VAE `folder` as BFL's ae.safetensors (musubi-tuner's load_ae layout): AutoencoderKL's
    LDM keys with the quant convs inside the encoder / decoder, the latents' BatchNorm `bn.*` as diffusers has it."""
    from library.io import CheckpointReader
    from library.models.vae import autoencoder_kl_to_ldm_state_dict

    sd = dict(CheckpointReader(os.path.join(folder, "diffusion_pytorch_model.safetensors")).items())
    ldm = autoencoder_kl_to_ldm_state_dict({k: v for k, v in sd.items() if not k.startswith("bn.")}, 4)
    inside = {"quant_conv.": "encoder.", "post_quant_conv.": "decoder."}
    bfl = {next((inside[p] + k for p in inside if k.startswith(p)), k): v for k, v in ldm.items()}
    assert {"encoder.quant_conv.weight", "decoder.post_quant_conv.weight"} <= bfl.keys()
    return _saved_with_config({**bfl, **{k: v for k, v in sd.items() if k.startswith("bn.")}}, folder, path)


# AutoencoderKLQwenImage keys -> the Wan layout (ComfyUI's qwen_image_vae.safetensors), in order: the inverse of
# diffusers' convert_wan_vae_to_diffusers. A resnet's parts are a Sequential: residual.0 / 2 / 3 / 6.
_WAN_RULES = [
    (r"^quant_conv\.", "conv1."), (r"^post_quant_conv\.", "conv2."), (r"^(\w+)\.conv_in\.", r"\1.conv1."),
    (r"^(\w+)\.norm_out\.", r"\1.head.0."), (r"^(\w+)\.conv_out\.", r"\1.head.2."),
    (r"\.mid_block\.attentions\.0\.", ".middle.1."),
    (r"\.mid_block\.resnets\.(\d)\.", lambda m: f".middle.{2 * int(m[1])}."),
    (r"\.down_blocks\.", ".downsamples."),
    (r"\.up_blocks\.(\d)\.resnets\.(\d)\.", lambda m: f".upsamples.{4 * int(m[1]) + int(m[2])}."),
    (r"\.up_blocks\.(\d)\.upsamplers\.0\.", lambda m: f".upsamples.{4 * int(m[1]) + 3}."),
    (r"\.(\d+)\.norm1\.", r".\1.residual.0."), (r"\.(\d+)\.conv1\.", r".\1.residual.2."),
    (r"\.(\d+)\.norm2\.", r".\1.residual.3."), (r"\.(\d+)\.conv2\.", r".\1.residual.6."),
    (r"\.(\d+)\.conv_shortcut\.", r".\1.shortcut."),
]


def _qwen_wan_file(folder: str, path: str) -> str:
    """The diffusers Qwen-Image VAE `folder` in the Wan layout (ComfyUI's qwen_image_vae.safetensors)."""
    import re

    from library.io import CheckpointReader

    wan = {}
    for key, value in CheckpointReader(os.path.join(folder, "diffusion_pytorch_model.safetensors")).items():
        for pattern, replacement in _WAN_RULES:
            key = re.sub(pattern, replacement, key)
        wan[key] = value
    assert {"conv1.weight", "encoder.head.2.weight", "decoder.upsamples.4.shortcut.weight"} <= wan.keys()
    return _saved_with_config(wan, folder, path)


def _family(tiny_set, model_type: str, ae: str):
    from library.models.family import family_class

    transformer = {"flux2": "flux2_tiny"}.get(model_type, model_type)
    return family_class(model_type)(tiny_set[transformer], ae, text_encoder=tiny_set[f"{model_type}_text_encoder"])


@pytest.mark.parametrize("model_type, folder_key, write", [
    ("flux2", "flux2_vae", _flux2_bfl_file), ("ideogram4", "flux2_vae", _flux2_bfl_file),
    ("qwen_image", "qwen_image_vae", _qwen_wan_file), ("krea2", "qwen_image_vae", _qwen_wan_file)])
def test_vae_single_file_in_released_layout_loads_like_diffusers_folder(tiny_set, tmp_path, model_type, folder_key,
                                                                        write):
    """BFL's FLUX.2 ae.safetensors passed the header check, then stopped latent caching with KeyError
    'down_block_types'; ComfyUI's qwen_image_vae.safetensors was refused as "not a Qwen-Image VAE"."""
    folder = tiny_set[folder_key]
    single = write(folder, str(tmp_path / "vae.safetensors"))
    family = _family(tiny_set, model_type, single)
    family.check_model_files()
    x = _images(1, 32)
    expected = _family(tiny_set, model_type, folder).load_vae().encode(x)
    assert (family.load_vae().encode(x) - expected).abs().max().item() == 0


def test_vae_single_file_of_another_family_is_refused_in_one_line(tiny_set, tmp_path):
    wan = _qwen_wan_file(tiny_set["qwen_image_vae"], str(tmp_path / "qwen_image_vae.safetensors"))
    bfl = _flux2_bfl_file(tiny_set["flux2_vae"], str(tmp_path / "ae.safetensors"))
    with pytest.raises(CheckpointError) as e:
        _family(tiny_set, "flux2", wan).check_model_files()
    assert str(e.value).startswith(f"{wan}: ae is not a FLUX.2 VAE (32 latent channels): no key ends in "
                                   f"'encoder.conv_out.weight' (its keys: ")
    with pytest.raises(CheckpointError) as e:
        _family(tiny_set, "krea2", bfl).check_model_files()
    assert str(e.value) == (f"{bfl}: ae is not a Qwen-Image VAE (16 latent channels, 3-D convolutions): "
                            f"'encoder.conv_out.weight' has shape (64, 16, 3, 3), expected (32, *, 3, 3, 3)")
    # Old: Qwen-Image-Layered's RGBA VAE passed for an RGB family and failed at the first encode (4 channels
    # expected, 3 given), a traceback after the check
    rgba = tiny_set["qwen_image_layered_vae"]
    for model_type in ("qwen_image", "krea2"):
        with pytest.raises(CheckpointError) as e:
            _family(tiny_set, model_type, rgba).check_model_files()
        assert "is not a Qwen-Image VAE" in str(e.value) and "conv_in.weight' has shape (" in str(e.value), str(e.value)
        assert str(e.value).endswith("expected (*, 3, 3, 3, 3)"), str(e.value)


# ----------------------------------------------------------------------------------------------
# FLUX text encoders


def test_clip_and_t5_match_transformers_and_pad_to_variant_length(encoders):
    from transformers import CLIPTextModel, T5EncoderModel

    clip, t5 = load_clip_l(encoders["clip_l"]), load_t5(encoders["t5xxl"])
    for variant, length in (("dev", 512), ("schnell", 256)):
        hidden, pooled = encode_flux_prompts(PROMPTS, clip, t5, length)
        assert hidden.shape == (2, length, 32) and pooled.shape == (2, 32), variant
        assert hidden.dtype == pooled.dtype == torch.float32
    ref_clip = CLIPTextModel.from_pretrained(encoders["clip_l"]).eval()
    ref_t5 = T5EncoderModel.from_pretrained(encoders["t5xxl"]).eval()
    clip_ids = clip.tokenizer(PROMPTS, padding="max_length", max_length=77, truncation=True, return_tensors="pt").input_ids
    t5_ids = t5.tokenizer(PROMPTS, padding="max_length", max_length=256, truncation=True, return_tensors="pt").input_ids
    assert clip_ids.shape == (2, 77) and (t5_ids[0] == 0).sum() > 200  # padded with <pad> = 0
    with torch.no_grad():
        assert (ref_clip(clip_ids).pooler_output - pooled).abs().max().item() <= 1e-6
        assert (ref_t5(t5_ids).last_hidden_state - hidden).abs().max().item() <= 1e-6


def test_clip_and_t5_single_files_load_like_folders(encoders, tmp_path):
    clip, t5 = load_clip_l(encoders["clip_l"]), load_t5(encoders["t5xxl"])
    for name in ("clip_l", "t5xxl"):
        shutil.copy(os.path.join(encoders[name], "model.safetensors"), tmp_path / f"{name}.safetensors")
    clip_file = load_clip_l(str(tmp_path / "clip_l.safetensors"), tokenizer=encoders["clip_l"],
                            config=os.path.join(encoders["clip_l"], "config.json"))
    t5_file = load_t5(str(tmp_path / "t5xxl.safetensors"), tokenizer=encoders["t5xxl"],
                      config=os.path.join(encoders["t5xxl"], "config.json"))
    assert torch.equal(clip.encode(PROMPTS), clip_file.encode(PROMPTS))
    assert torch.equal(t5.encode(PROMPTS, 64), t5_file.encode(PROMPTS, 64))
    # Without a config a single file is the released CLIP-L: the tiny one is refused by key and shape.
    with pytest.raises(CheckpointError, match="clip_l.safetensors.*shape"):
        load_clip_l(str(tmp_path / "clip_l.safetensors"), tokenizer=encoders["clip_l"])


def test_single_files_in_one_folder_take_only_their_own_kind_of_tokenizer(encoders, tmp_path):
    """ComfyUI's layout: clip_l and t5xxl files in one folder, which holds one tokenizer (T5's here). Until
    2026-11-28 CLIP-L took T5's tokenizer from it (T5 ids, another pooled vector) and trained on."""
    folder, beside = tmp_path / "text_encoders", tmp_path / "tokenizer"
    folder.mkdir()
    for name in ("clip_l", "t5xxl"):
        shutil.copy(os.path.join(encoders[name], "model.safetensors"), folder / f"{name}.safetensors")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(encoders["t5xxl"], name), folder / name)
    clip_file, clip_config = str(folder / "clip_l.safetensors"), os.path.join(encoders["clip_l"], "config.json")
    with pytest.raises(CheckpointError) as error:
        load_clip_l(clip_file, config=clip_config)
    assert str(error.value) == (f"{clip_file}: no CLIP tokenizer found in {[str(folder), str(beside)]}; skipped "
                                f"{folder}: a T5 tokenizer; put the CLIP tokenizer's files in one of those folders")
    shutil.copytree(encoders["clip_l"], beside, ignore=shutil.ignore_patterns("*.safetensors", "config.json"))
    clip = load_clip_l(clip_file, config=clip_config)
    t5 = load_t5(str(folder / "t5xxl.safetensors"), config=os.path.join(encoders["t5xxl"], "config.json"))
    assert clip.tokenizer.name_or_path == str(beside) and t5.tokenizer.name_or_path == str(folder)
    assert torch.equal(clip.encode(PROMPTS), load_clip_l(encoders["clip_l"]).encode(PROMPTS))
    assert torch.equal(t5.encode(PROMPTS, 64), load_t5(encoders["t5xxl"]).encode(PROMPTS, 64))
    # The released tokenizers say their class; the generic tiny ones (Qwen's, Mistral's) their BOS / EOS.
    from library.models.text_encoders import tokenizer_kind
    from library.models.tiny_files import build_mistral_tokenizer, save_tokenizer

    save_tokenizer(build_mistral_tokenizer(()), str(tmp_path / "mistral"))
    assert tokenizer_kind(encoders["qwen_image_tokenizer"]) == "Qwen2" and tokenizer_kind(tmp_path / "mistral") == "Mistral"
    for name, kind in (("CLIPTokenizer", "CLIP"), ("T5TokenizerFast", "T5"), ("Qwen2Tokenizer", "Qwen2"), ("Other", None)):
        (beside / "tokenizer_config.json").write_text(f'{{"tokenizer_class": "{name}", "eos_token": "x"}}')
        assert tokenizer_kind(beside) == kind, name


@pytest.mark.parametrize("stored", [torch.float32, torch.float16, torch.bfloat16])
def test_t5_in_float16_keeps_feed_forward_output_in_float32(encoders, tmp_path, stored):
    """Whatever the file stores (users mostly have t5xxl_fp16): until 2026-11-27 an fp16 or bf16 file
    left `wo` in its own dtype; the output must equal transformers' float16 load of the same file."""
    from library.io import CheckpointReader, save_safetensors
    from transformers import T5EncoderModel

    reader = CheckpointReader(os.path.join(encoders["t5xxl"], "model.safetensors"))
    shutil.copytree(encoders["t5xxl"], tmp_path / "t5", ignore=shutil.ignore_patterns("model.safetensors"))
    save_safetensors({k: v.to(stored) for k, v in reader.items()}, str(tmp_path / "t5" / "model.safetensors"))
    t5 = load_t5(str(tmp_path / "t5"), dtype=torch.float16)
    ff = t5.model.encoder.block[0].layer[1].DenseReluDense
    assert ff.wo.weight.dtype == torch.float32 and ff.wi_0.weight.dtype == torch.float16
    assert t5.model.shared.weight.dtype == torch.float16
    assert torch.equal(t5.model.shared.weight, t5.model.encoder.embed_tokens.weight)
    reference = T5EncoderModel.from_pretrained(str(tmp_path / "t5"), dtype=torch.float16).eval()
    ids = t5.tokenizer(PROMPTS, padding="max_length", max_length=64, truncation=True, return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(t5.encode(PROMPTS, 64), reference(ids).last_hidden_state.float())


# ----------------------------------------------------------------------------------------------
# Qwen-Image text encoder


def _diffusers_qwen_pipeline(encoders):
    """diffusers' QwenImagePipeline holding only its tokenizer and, as text encoder, transformers'
    Qwen2 model with our tiny weights (Qwen2.5-VL's language model is Qwen2 for text-only input)."""
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(encoders["qwen_image_tokenizer"])
    text_encoder = Qwen2ForCausalLM.from_pretrained(encoders["qwen_image_text_encoder"]).model.eval()
    return QwenImagePipeline(scheduler=None, vae=None, text_encoder=text_encoder, tokenizer=tokenizer, transformer=None)


def test_qwen_text_encoder_matches_diffusers_prompt_embeds(encoders):
    ours = load_qwen_image_text_encoder(encoders["qwen_image_text_encoder"])
    embeds, mask = ours.encode(PROMPTS)
    with torch.no_grad():
        pipe = _diffusers_qwen_pipeline(encoders)
        ref, ref_mask = pipe._get_qwen_prompt_embeds(PROMPTS, torch.device("cpu"), torch.float32)
    assert embeds.shape == ref.shape and embeds.shape[-1] == 32 and embeds.dtype == torch.float32
    assert torch.equal(mask, ref_mask.bool())
    assert mask[0].sum() < mask[1].sum()  # the short prompt is padded
    assert (embeds - ref).abs().max().item() <= 1e-5
    # Padding never leaks into the valid tokens: the short prompt alone gives the same rows.
    alone, alone_mask = ours.encode(PROMPTS[:1])
    n = int(alone_mask.sum())
    assert (alone[0, :n] - embeds[0, :n]).abs().max().item() <= 1e-5
    assert embeds[0, n:].abs().max().item() == 0.0


def test_qwen_template_and_drop_count_are_diffusers(encoders):
    pipe = QwenImagePipeline(scheduler=None, vae=None, text_encoder=None, tokenizer=None, transformer=None)
    assert QWEN_IMAGE_PROMPT_TEMPLATE == pipe.prompt_template_encode
    assert QWEN_IMAGE_DROP_TOKENS == pipe.prompt_template_encode_start_idx == 34
    # A tokenizer that splits the template prefix into another count is refused, not silently misused.
    from transformers import AutoTokenizer

    llm = load_qwen_image_text_encoder(encoders["qwen_image_text_encoder"]).llm
    with pytest.raises(ValueError, match="expected 34"):
        QwenImageTextEncoder(llm, AutoTokenizer.from_pretrained(encoders["clip_l"]))
