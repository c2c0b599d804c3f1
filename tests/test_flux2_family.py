"""FLUX.2 as a diffusion family: the VAE's latent normalisation, the sampler (noise, sigmas, positions,
CFG, decode) and the training loss's packing against diffusers' Flux2KleinPipeline on the tiny set."""

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel
from diffusers.pipelines.flux2.pipeline_flux2_klein import Flux2KleinPipeline

from library.models.family import family_class
from library.models.flux2.family import Flux2Family
from library.models.flux2.vae import load_flux2_vae
from library.models.latents import pack_latents, unpack_latents

# FLUX.2 scheduler_config.json (klein and dev): dynamic shifting with the pipeline's mu, exponential.
FLUX2_SCHEDULER = dict(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=4096, max_shift=1.15,
                       num_train_timesteps=1000, shift=3.0, time_shift_type="exponential", use_dynamic_shifting=True)


def images(batch=2, size=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(batch, 3, size, size, generator=g) * 2 - 1


@pytest.fixture(scope="module")
def vae(tiny_set):
    return load_flux2_vae(tiny_set["flux2_vae"])


def test_flux2_vae_latents_are_the_pipelines_packed_latents(vae, tiny_set):
    x = images()
    ours = vae.encode(x)
    assert ours.shape == (2, 32, 4, 4) and ours.dtype == torch.float32
    stub = SimpleNamespace(vae=AutoencoderKLFlux2.from_pretrained(tiny_set["flux2_vae"]).eval(),
                           _patchify_latents=Flux2KleinPipeline._patchify_latents)
    with torch.no_grad():
        theirs = Flux2KleinPipeline._encode_vae_image(stub, x, generator=None)  # [B, 128, 2, 2], bn-normalised
    err = (pack_latents(ours) - Flux2KleinPipeline._pack_latents(theirs)).abs().max().item()
    assert err <= 1e-5, err
    # The BatchNorm statistics are applied (the tiny VAE's are far from 0 / 1).
    raw = vae.vae.encode(x).latent_dist.mode()
    assert (ours - raw).abs().max().item() > 0.1


def test_flux2_vae_decode_is_the_pipelines_decode(vae, tiny_set):
    g = torch.Generator().manual_seed(3)
    packed = torch.randn(2, 4, 128, generator=g)  # a 2x2 token grid: latents [B, 32, 4, 4]
    ours = vae.decode(unpack_latents(packed, 4, 4))
    pipe_vae = AutoencoderKLFlux2.from_pretrained(tiny_set["flux2_vae"]).eval()
    with torch.no_grad():  # the end of Flux2KleinPipeline.__call__
        ids = Flux2KleinPipeline._prepare_latent_ids(torch.zeros(2, 128, 2, 2))
        lat = Flux2KleinPipeline._unpack_latents_with_ids(packed, ids, 2, 2)
        mean = pipe_vae.bn.running_mean.view(1, -1, 1, 1)
        std = torch.sqrt(pipe_vae.bn.running_var.view(1, -1, 1, 1) + pipe_vae.config.batch_norm_eps)
        theirs = pipe_vae.decode(Flux2KleinPipeline._unpatchify_latents(lat * std + mean), return_dict=False)[0]
    err = (ours - theirs.clamp(-1, 1)).abs().max().item()
    assert err <= 1e-5, err


def test_flux2_is_registered_with_32_latent_channels_and_klein_variant(tiny_set):
    family = family_class("flux2")(tiny_set["flux2_tiny"], tiny_set["flux2_vae"], text_encoder=tiny_set["flux2_text_encoder"])
    assert family.latent_channels == 32 and not family.is_dev() and not family.is_distilled
    assert Flux2Family(tiny_set["flux2_dev_tiny"]).is_dev()
    with pytest.raises(ValueError, match="needs the Mistral Small 3.1 language model"):  # [klein]'s Qwen3 for [dev]
        Flux2Family(tiny_set["flux2_dev_tiny"], text_encoder=tiny_set["flux2_text_encoder"]).load_text_encoder("fp32")


def _pipeline(tiny_set, distilled: bool) -> Flux2KleinPipeline:
    return Flux2KleinPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**FLUX2_SCHEDULER),
        vae=AutoencoderKLFlux2.from_pretrained(tiny_set["flux2_vae"]).eval(),
        text_encoder=None, tokenizer=None,
        transformer=Flux2Transformer2DModel.from_pretrained(tiny_set["flux2_diffusers"]).eval(),
        is_distilled=distilled,
    )


@pytest.mark.parametrize("guidance", [1.0, 3.0])
def test_flux2_sampling_equals_flux2_klein_pipeline(tiny_set, vae, guidance):
    """Same seed, prompt embeddings, size and steps: our sampler + VAE decode give the pipeline's image
    (its noise draw, empirical-mu sigmas, positions, CFG with the negative embeddings, BN de-normalisation)."""
    family = Flux2Family(tiny_set["flux2_tiny"], tiny_set["flux2_vae"], text_encoder=tiny_set["flux2_text_encoder"])
    model = family.load_transformer(torch.float32)
    g = torch.Generator().manual_seed(5)
    text, negative = ({"embeds": torch.randn(1, 12, 96, generator=g)} for _ in range(2))
    latents = family.sample_latents(model, text, 64, 48, steps=3, seed=7, guidance=guidance, negative_text=negative)
    ours = (vae.decode(latents) + 1) / 2
    with torch.no_grad():
        theirs = _pipeline(tiny_set, distilled=False)(
            prompt_embeds=text["embeds"], negative_prompt_embeds=negative["embeds"], height=48, width=64,
            num_inference_steps=3, guidance_scale=guidance, generator=torch.Generator().manual_seed(7), output_type="pt",
        ).images
    err = (ours - theirs).abs().max().item()
    assert err <= 1e-5, err


def test_training_loss_packs_like_the_pipeline_and_is_finite(tiny_set):
    family = Flux2Family(tiny_set["flux2_tiny"])
    model = family.load_transformer(torch.float32)
    g = torch.Generator().manual_seed(1)
    latents, noise = torch.randn(2, 32, 4, 6, generator=g), torch.randn(2, 32, 4, 6, generator=g)
    text = {"embeds": torch.randn(2, 5, 96, generator=g)}
    sigmas = torch.tensor([0.2, 0.9])
    loss = family.loss_at(model, latents, text, noise, sigmas, None)
    # By hand: the pipeline's packing of the patchified noisy latents, the model, the flow target.
    pipe_pack = lambda z: Flux2KleinPipeline._pack_latents(Flux2KleinPipeline._patchify_latents(z))  # noqa: E731
    x_t = (1 - sigmas.view(-1, 1, 1, 1)) * latents + sigmas.view(-1, 1, 1, 1) * noise
    with torch.no_grad():
        pred = family.predict(model, pipe_pack(x_t), sigmas, text, 2, 3, None)
    expected = ((pred - pipe_pack(noise - latents)) ** 2).mean()
    assert torch.isfinite(loss) and abs(loss.item() - expected.item()) <= 1e-6 * expected.item()


def test_planner_counts_the_text_encoder_as_loaded_from_a_klein_repo(tiny_set, tmp_path):
    """The planner sizes klein's Qwen3 as load_klein_text_encoder reads it (layers up to 27, no
    lm_head), resolved inside a repo folder (text_encoder/ beside a transformer file: not the latter)."""
    import shutil

    from library.models.flux2.text_encoder import load_klein_text_encoder

    repo = tmp_path / "repo"
    shutil.copytree(tiny_set["flux2_text_encoder"], repo / "text_encoder")
    shutil.copytree(tiny_set["flux2_tokenizer"], repo / "tokenizer")
    shutil.copy(tiny_set["flux2_tiny"], repo / "flux2-tiny.safetensors")
    family = Flux2Family(str(repo / "flux2-tiny.safetensors"), tiny_set["flux2_vae"], text_encoder=str(repo))
    loaded = load_klein_text_encoder(str(repo)).llm
    assert family.text_encoder_params() == sum(p.numel() for p in loaded.parameters())


@pytest.mark.parametrize("distilled,steps", [(True, 4), (False, 50)])
def test_sample_steps_default_to_a_distilled_kleins_own_4(tiny_set, tmp_path, distilled, steps):
    """A pipeline folder whose model_index.json says is_distilled (the step-distilled [klein] 4B / 9B)
    samples with their 4 steps by default, the base ones with Flux2KleinPipeline's 50; both rendered 20 before."""
    import json
    import shutil

    shutil.copytree(tiny_set["flux2_diffusers"], tmp_path / "transformer")
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "Flux2KleinPipeline", "is_distilled": distilled}))
    family = Flux2Family(str(tmp_path / "transformer"))
    assert family.is_distilled == distilled and family.sample_steps == steps


@pytest.mark.parametrize("name, version, distilled", [
    ("flux-2-klein-4b.safetensors", None, True), ("flux-2-klein-base-4b.safetensors", None, False),
    ("flux-2-klein-9b-fp8.safetensors", None, True), ("my-finetune.safetensors", None, False),
    ("my-finetune.safetensors", "klein-4b", True), ("flux-2-klein-4b.safetensors", "klein-base-4b", False)])
def test_a_single_files_distilled_klein_is_told_by_its_name_or_model_version(tiny_set, tmp_path, name, version,
                                                                            distilled):
    """A single file said nothing, so BFL's / Comfy-Org's flux-2-klein-4b.safetensors (the step-distilled [klein])
    sampled as the base: 50 steps with CFG 4 against "", and no key could say otherwise (model_version was refused
    for flux2; musubi-tuner's --model_version klein-4b was dropped by its converter). Its name, or model_version in
    musubi-tuner's names, tells now."""
    import shutil

    shutil.copy(tiny_set["flux2_tiny"], tmp_path / name)
    family = Flux2Family(str(tmp_path / name), model_version=version)
    assert (family.is_distilled, family.sample_steps) == (distilled, 4 if distilled else 50)
    with pytest.raises(ValueError, match=r"model_version 'klein': expected one of dev, klein-4b, klein-9b"):
        Flux2Family(str(tmp_path / name), model_version="klein")


def test_dev_sampling_matches_flux2_pipeline(tiny_set, tmp_path):
    """FLUX.2 [dev] (guidance embedding, no CFG; empirical mu from the size and step count): sample_latents
    equals Flux2Pipeline.__call__ on the same weights (our file saved as a diffusers folder), seed and
    embeddings."""
    from diffusers.pipelines.flux2.pipeline_flux2 import Flux2Pipeline

    from library.models.flux2.checkpoint import save_flux2_diffusers

    family = Flux2Family(tiny_set["flux2_dev_tiny"], tiny_set["flux2_vae"])
    model = family.load_transformer(torch.float32)
    save_flux2_diffusers(model, model.config, str(tmp_path / "transformer"))
    reference = Flux2Transformer2DModel.from_pretrained(str(tmp_path / "transformer")).eval()
    text = {"embeds": torch.randn(1, 9, reference.config.joint_attention_dim, generator=torch.Generator().manual_seed(1))}
    ours = family.pack_target(family.sample_latents(model, text, 64, 48, 3, 7, 4.0))
    pipe = Flux2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(**FLUX2_SCHEDULER), vae=AutoencoderKLFlux2.from_pretrained(
        tiny_set["flux2_vae"]).eval(), text_encoder=None, tokenizer=None, transformer=reference)
    with torch.no_grad():
        theirs = pipe(prompt_embeds=text["embeds"], height=48, width=64, num_inference_steps=3, guidance_scale=4.0,
                      generator=torch.Generator().manual_seed(7), output_type="latent").images
    relative = ((ours - theirs).norm() / theirs.norm()).item()
    print(f"FLUX.2 [dev] sampling vs Flux2Pipeline: relative {relative:.3g}")
    assert relative <= 1e-5


def test_max_sequence_length_is_the_tokens_a_caption_is_padded_to(tiny_set):
    """The config's max_sequence_length (the pipelines' argument; default 512) sets the encoder's padded length,
    the text cache key, the caption check's limit and the planner's text tokens: a tiny base trained on short
    captions (learned/flux2: 64) samples and plans at its own length."""
    from library.training.memory_plan import text_tokens_for

    family = Flux2Family(tiny_set["flux2_tiny"], tiny_set["flux2_vae"], text_encoder=tiny_set["flux2_text_encoder"])
    short, default = SimpleNamespace(max_sequence_length=40), SimpleNamespace()
    assert family.text_options(default) == {"max_length": 512} and family.text_options(short) == {"max_length": 40}
    encode = family.load_text_encoder("fp32", torch.device("cpu"), **family.text_options(short))
    (embeds,) = (e["embeds"] for e in encode(["a red cat"]))
    assert embeds.shape == (40, 96)
    assert family.text_cache_key(family.text_options(short), "bf16") != family.text_cache_key({"max_length": 512}, "bf16")
    assert family.caption_token_limit(short).max_tokens == 40 and text_tokens_for(family, short) == 40
    assert text_tokens_for(family, default) == 512


def test_a_loras_trained_text_length_is_honoured_only_as_the_key_takes_it():
    """ss_trained_keys is read as the config check reads the key (an int >= 1); another tool's value is left out,
    not set unchecked; a second LoRA of another length is said, the first one's kept."""
    import argparse

    from tools.generate import honour_lora_options
    from library.lora_spec import LoRASpec

    def header(value):
        return {"ss_trained_keys": json.dumps({"max_sequence_length": value})}

    assert Flux2Family.lora_trained_options(header(64)) == {"max_sequence_length": (64, "ss_trained_keys")}
    for bad in ("64", 0, True, 6.5):
        assert Flux2Family.lora_trained_options(header(bad)) == {}
    assert Flux2Family.lora_trained_options({"ss_trained_keys": "not json"}) == {}
    args = argparse.Namespace(model_type="flux2", max_sequence_length=None)
    notes = honour_lora_options(args, [LoRASpec("a.safetensors", 1.0), LoRASpec("b.safetensors", 1.0)],
                                [header(64), header(48)])
    assert args.max_sequence_length == 64 and notes == [
        "note: a.safetensors was trained with max_sequence_length 64 (ss_trained_keys): rendering with it",
        "note: b.safetensors was trained with max_sequence_length 48 (ss_trained_keys); rendering with 64, as the "
        "LoRA before it"]
    given = argparse.Namespace(model_type="flux2", max_sequence_length=128)  # the web UI passes its job's value
    assert honour_lora_options(given, [LoRASpec("a.safetensors", 1.0)], [header(64)]) == [
        "note: a.safetensors was trained with max_sequence_length 64 (ss_trained_keys); rendering with the "
        "max_sequence_length given, 128"] and given.max_sequence_length == 128
