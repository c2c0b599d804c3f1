"""Ideogram 4 end to end on tiny models against Ideogram4Pipeline: our text encoder, transformer (the
conditional and the unconditional one), schedule, Euler steps with the pipeline's guidance blend and
VAE decode give the pipeline's latents and image from the same starting noise."""

import os

import pytest
import torch

from library.models.ideogram4.model import Ideogram4
from library.models.ideogram4.sampling import inference_sigmas
from library.models.ideogram4.text_encoder import load_ideogram4_text_encoder
from library.models.ideogram4.tiny import TINY_TAPS, tiny_config, write_ideogram4_text_encoder
from library.models.ideogram4.vae import Ideogram4VAE, from_ideogram_tokens, to_ideogram_tokens
from library.models.latents import pack_latents, unpack_latents

H, W, STEPS, GUIDANCE = 32, 48, 3, 4.0  # pixels: a 2 x 3 grid of tokens (VAE 8x, patch 2)
PROMPTS = ["a red chair by the sea", "a dog"]


def random_transformer(config, seed):
    from diffusers import Ideogram4Transformer2DModel

    g = torch.Generator().manual_seed(seed)
    model = Ideogram4Transformer2DModel(**{k: v for k, v in config.__dict__.items()})
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.2 * torch.randn(p.shape, generator=g))
    return model.eval()


@pytest.fixture(scope="module")
def setup(tmp_path_factory, request):
    import dataclasses

    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Ideogram4Pipeline
    from transformers import AutoTokenizer, Qwen3VLModel

    files = write_ideogram4_text_encoder(str(tmp_path_factory.mktemp("ideogram4_pipe")), 0)
    config = dataclasses.replace(tiny_config(), llm_features_dim=len(TINY_TAPS) * 32)
    torch.manual_seed(3)
    vae = AutoencoderKLFlux2(block_out_channels=[8, 16, 16, 16], norm_num_groups=4, layers_per_block=1,
                             sample_size=64, latent_channels=32).eval()
    with torch.no_grad():
        vae.bn.running_mean.copy_(0.5 * torch.randn_like(vae.bn.running_mean))
        vae.bn.running_var.copy_(0.2 + torch.rand_like(vae.bn.running_var))
    pipe = Ideogram4Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae,
                             text_encoder=Qwen3VLModel.from_pretrained(files["ideogram4_text_encoder"]).eval(),
                             tokenizer=AutoTokenizer.from_pretrained(files["ideogram4_tokenizer"]),
                             transformer=random_transformer(config, 1), unconditional_transformer=random_transformer(config, 2))
    return pipe, config, files, vae


def run_pipeline(pipe, noise, output_type, monkeypatch):
    import diffusers.pipelines.ideogram4.pipeline_ideogram4 as module

    monkeypatch.setattr(module, "QWEN3_VL_ACTIVATION_LAYERS", TINY_TAPS)
    with torch.no_grad():
        return pipe(PROMPTS, height=H, width=W, num_inference_steps=STEPS, guidance_scale=None, guidance_schedule=[GUIDANCE] * STEPS,
                    max_sequence_length=40, latents=noise.clone(), output_type=output_type).images


def ours(pipe, config, files, noise_tokens):
    """Our sampler: x += (s' - s) v with v = g v_cond + (1 - g) v_uncond (ours: noise - x0)."""
    text = load_ideogram4_text_encoder(os.path.dirname(files["ideogram4_text_encoder"]), taps=TINY_TAPS, max_length=40)
    features, mask = text.encode(PROMPTS)
    cond, uncond = Ideogram4(config).eval(), Ideogram4(config).eval()
    cond.load_state_dict(pipe.transformer.state_dict())
    uncond.load_state_dict(pipe.unconditional_transformer.state_dict())
    sigmas = inference_sigmas(STEPS, H, W)
    x, b = noise_tokens, noise_tokens.shape[0]
    empty = features.new_zeros(b, 0, features.shape[-1])
    with torch.no_grad():
        for s, s_next in zip(sigmas[:-1], sigmas[1:]):
            t = s.expand(b)
            v = GUIDANCE * cond(x, features, t, 2, 3, txt_mask=mask) + (1 - GUIDANCE) * uncond(x, empty, t, 2, 3)
            x = x + (s_next - s) * v
    return x, sigmas


def test_sampling_matches_pipeline(setup, monkeypatch):
    pipe, config, files, vae = setup
    noise = torch.randn(2, 6, 128, generator=torch.Generator().manual_seed(5))  # the pipeline's (ph, pw, c) tokens
    expected = run_pipeline(pipe, noise, "latent", monkeypatch)
    got, sigmas = ours(pipe, config, files, noise)
    assert torch.allclose(pipe.scheduler.sigmas, sigmas, atol=0, rtol=0)  # the same schedule, bit for bit
    diff = (got - expected).abs().max().item()
    print(f"Ideogram 4 sampling ({STEPS} steps, guidance {GUIDANCE}): max abs diff {diff:.2e} "
          f"(latents up to {expected.abs().max():.2f})")
    assert diff <= 1e-5 * expected.abs().max()


def test_vae_decode_matches_pipeline(setup, monkeypatch):
    pipe, _, _, vae = setup
    noise = torch.randn(2, 6, 128, generator=torch.Generator().manual_seed(5))
    tokens = run_pipeline(pipe, noise, "latent", monkeypatch)
    image = torch.from_numpy(run_pipeline(pipe, noise, "np", monkeypatch)).permute(0, 3, 1, 2)  # [0, 1]
    latents = unpack_latents(from_ideogram_tokens(tokens), H // 8, W // 8)  # ours: [B, 32, H/8, W/8]
    assert torch.equal(to_ideogram_tokens(pack_latents(latents)), tokens)
    decoded = (Ideogram4VAE(vae).decode(latents) / 2 + 0.5).clamp(0, 1)
    diff = (decoded - image).abs().max().item()
    print(f"Ideogram 4 VAE decode vs the pipeline's image: max abs diff {diff:.2e}")
    assert diff <= 1e-6


def test_vae_encode_inverts_decode_normalisation(setup):
    """encode's normalisation is decode's inverse (the pipeline has no encode: t2i only)."""
    _, _, _, vae = setup
    ours = Ideogram4VAE(vae)
    z = torch.randn(1, 32, 4, 6, generator=torch.Generator().manual_seed(7))
    t = ours._tokens(z)
    normalised = ours._latents((t - ours.bn_mean) / ours.bn_std, 4, 6)
    back = ours._latents(ours._tokens(normalised) * ours.bn_std + ours.bn_mean, 4, 6)
    assert (back - z).abs().max() <= 1e-6


def test_sampling_at_the_pipelines_defaults_runs_its_guidance_schedule(monkeypatch):
    """Ideogram4Pipeline() without a guidance argument runs guidance_schedule's default (7, then 3 for the last
    3 steps); our samples at its defaults (48 steps, guidance 7) ran 7 on all 48 until 2026-11-27."""
    import inspect

    from diffusers import Ideogram4Pipeline

    from library.models.ideogram4.family import Ideogram4Family

    default = list(inspect.signature(Ideogram4Pipeline.__call__).parameters["guidance_schedule"].default)
    family, seen = object.__new__(Ideogram4Family), []

    def recorded(self, model, x, s, text, negative_text, h, w, guidance):
        seen.append(guidance)
        return torch.zeros_like(x)

    monkeypatch.setattr(Ideogram4Family, "guided_velocity", recorded)
    text = {"embeds": torch.zeros(1, 4, 8)}
    for steps, guidance, expected in ((48, 7.0, default), (48, 5.0, [5.0] * 48), (10, 7.0, [7.0] * 10)):
        seen.clear()
        family.sample_latents(None, text, 32, 32, steps, 0, guidance)
        assert seen == expected, (steps, guidance)
    assert default[-4:] == [7.0, 3.0, 3.0, 3.0] and len(default) == 48 == family.sample_steps
