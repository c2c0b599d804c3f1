"""timestep_sampling = "qinglong" (musubi-tuner's qinglong_flux / qinglong_qwen hybrid sampler): each sigma from the
mid draw (qinglong_mid's law, or the model's own), the logsnr draw or the detail draw (log-SNR normal 5.36 / 1), picked
per sample by shares; checked against musubi-tuner's formula restated, carried from its configs."""

import math
import re

import pytest
import torch

from library.models import flow_matching as fm
from library.models.flux1.family import FluxFamily
from library.training.config import ConfigError, load_config
from library.training.peers import musubi_tuner
from tests.test_timestep_range import FLUX, ks_distance, loss_args


def musubi_qinglong(n: int, g: torch.Generator, mu: float, shares: tuple[float, float], logit=(0.0, 1.0)):
    """musubi-tuner's trainer_base qinglong branch, restated: a decision per sample; below 1 - the two shares the mid
    shift (sigmoid(randn) shifted by e^mu), then its logsnr (sigmoid(-logsnr / 2), logsnr ~ N(logit_mean,
    logit_std)), then N(5.36, 1)."""
    decision = torch.rand(n, generator=g, dtype=torch.float64)
    shift = math.exp(mu)
    t = torch.sigmoid(torch.randn(n, generator=g, dtype=torch.float64))
    mid = t * shift / (1 + (shift - 1) * t)
    logsnr = torch.sigmoid(-(logit[0] + logit[1] * torch.randn(n, generator=g, dtype=torch.float64)) / 2)
    detail = torch.sigmoid(-(5.36 + torch.randn(n, generator=g, dtype=torch.float64)) / 2)
    mid_mask, detail_mask = decision < 1 - sum(shares), decision >= 1 - shares[1]
    return torch.where(mid_mask, mid, torch.where(detail_mask, detail, logsnr))


@pytest.mark.parametrize("shares, tokens, mid", [((0.11, 0.10), 4096, "flux_shift"), ((0.0, 0.05), 1024, "qwen_shift")])
def test_the_mixture_is_musubi_tuners(shares, tokens, mid):
    """200,000 draws each: ours (flow_matching's qinglong_sigmas, the mid draw the spec's shift at the token count)
    against musubi-tuner's formula with that mu; KS < 0.01. The same draws without the detail share are far from it
    (the test tells the shares apart)."""
    sampling = fm._shift_method(mid)
    mu = fm.resolution_mu(sampling, tokens)
    g = torch.Generator().manual_seed(0)
    ours = fm.qinglong_sigmas(200_000, g, lambda: fm.sample_sigmas(200_000, mid, generator=g, image_seq_len=tokens),
                              shares, (0.0, 1.0))
    theirs = musubi_qinglong(200_000, torch.Generator().manual_seed(1), mu, shares)
    assert ours.dtype == torch.float32 and ks_distance(ours.double(), theirs) < 0.01
    assert ks_distance(musubi_qinglong(200_000, torch.Generator().manual_seed(2), mu, (shares[0], 0.0)), theirs) > 0.04
    assert (ours < 0.2).double().mean().item() == pytest.approx((theirs < 0.2).double().mean().item(), abs=0.005)


def test_each_share_takes_its_draw():
    """All detail: log-SNR 5.36 / 1 (median sigma 0.064); all mid: the mid draw, bit for bit."""
    g = torch.Generator().manual_seed(3)
    detail = fm.qinglong_sigmas(50_000, g, lambda: torch.full((50_000,), 0.5), (0.0, 1.0))
    assert detail.median().item() == pytest.approx(1 / (1 + math.exp(2.68)), abs=2e-3)
    mid = fm.qinglong_sigmas(1000, torch.Generator().manual_seed(4), lambda: torch.full((1000,), 0.5), (0.0, 0.0))
    assert torch.equal(mid, torch.full((1000,), 0.5))


def test_the_training_step_draws_the_mixture_from_each_samples_generator(tiny_set):
    """The tiny FLUX.1's step: each sample's noise, then its pick and three draws from the same generator; the mid
    draw is the model's own (flux_shift at the latents' 32 tokens) unless qinglong_mid names another."""
    family = FluxFamily(tiny_set["flux_bfl"])
    model = family.load_transformer(torch.float32)
    latents, seeds = torch.randn(3, 16, 8, 16), [5, 6, 7]
    text = {"t5": torch.randn(3, 7, 32), "clip_pooled": torch.randn(3, 32)}
    for mid in (None, "uniform"):
        args = loss_args(timestep_sampling="qinglong", qinglong_mid=mid, qinglong_logsnr_share=0.3,
                         qinglong_detail_share=0.3, logsnr_mean=-6.0, logsnr_std=2.0)
        _, sigmas = family.training_loss(model, latents, text, args, [torch.Generator().manual_seed(s) for s in seeds])
        expected = []
        for seed in seeds:
            g = torch.Generator().manual_seed(seed)
            torch.randn(latents.shape[1:], generator=g)
            expected.append(fm.qinglong_sigmas(1, g, lambda g=g: fm.sample_sigmas(
                1, mid or "flux_shift", generator=g, image_seq_len=32), (0.3, 0.3), (-6.0, 2.0)))
        assert torch.equal(sigmas, torch.cat(expected))


@pytest.mark.parametrize("flags, message", [
    (["--timestep_sampling", "qinglong", "--qinglong_logsnr_share", "0.6", "--qinglong_detail_share", "0.5"],
     "the qinglong draw's logsnr and detail shares must be in [0, 1] with a sum <= 1 (the mid draw takes the rest), "
     "got 0.6 and 0.5"),
    (["--timestep_sampling", "qinglong", "--discrete_flow_shift", "2"],
     "key 'discrete_flow_shift' does nothing with timestep_sampling = \"qinglong\" and qinglong_mid = unset; it needs "
     "qinglong_mid = \"shift\""),
    (["--timestep_sampling", "sigmoid", "--qinglong_mid", "shift"],
     "key 'qinglong_mid' does nothing with timestep_sampling = \"sigmoid\"; it needs timestep_sampling = \"qinglong\""),
    (["--timestep_sampling", "qinglong", "--qinglong_mid", "qinglong"], "key 'qinglong_mid' must be one of"),
])
def test_bad_keys_are_one_line(flags, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(FLUX + flags)


def test_its_keys_are_taken():
    args = load_config(FLUX + ["--timestep_sampling", "qinglong", "--qinglong_mid", "shift", "--discrete_flow_shift",
                               "2", "--logsnr_mean", "-4"])
    assert (args.qinglong_mid, args.discrete_flow_shift, args.logsnr_mean) == ("shift", 2.0, -4.0)


@pytest.mark.parametrize("config, ours", [
    ({"timestep_sampling": "qinglong_flux", "network_module": "networks.lora_flux"},
     {"timestep_sampling": "qinglong", "qinglong_mid": "flux_shift", "qinglong_logsnr_share": 0.11,
      "qinglong_detail_share": 0.10, "logsnr_mean": 0.0, "logsnr_std": 1.0}),
    ({"timestep_sampling": "qinglong_flux", "logit_mean": -6.0, "logit_std": 2.0,
      "network_module": "networks.lora_flux"},
     {"timestep_sampling": "qinglong", "logsnr_mean": -6.0, "logsnr_std": 2.0}),
    ({"timestep_sampling": "qinglong_qwen", "logit_mean": -6.0, "network_module": "networks.lora_qwen_image"},
     {"timestep_sampling": "qinglong", "qinglong_mid": "qwen_shift", "qinglong_logsnr_share": 0.0,
      "qinglong_detail_share": 0.05}),
])
def test_musubi_tuners_hybrid_draws_are_carried(config, ours):
    t = musubi_tuner.translate(config, "c.toml")
    assert {k: t.config.get(k) for k in ours} == ours
    assert [line.key for line in t.not_carried] == []
    if config.get("timestep_sampling") == "qinglong_qwen":  # no logsnr draw: its logit_mean reads nothing
        assert "logsnr_mean" not in t.config


def test_a_hybrid_draw_whose_mid_draw_is_not_carried_is_not_carried():
    """qinglong_qwen on FLUX.2: its mid qwen_shift counts FLUX.2's token grid as a quarter of the tokens."""
    t = musubi_tuner.translate({"timestep_sampling": "qinglong_qwen", "network_module": "networks.lora_flux_2",
                                "model_version": "klein-4b"}, "c.toml")
    line = next(line for line in t.lines if line.key == "timestep_sampling")
    assert line.verdict == "not carried" and line.text.startswith("its mid draw, qwen_shift: ")


def test_a_run_records_the_mixture(tiny_set, tmp_path):
    import json

    from safetensors import safe_open

    import train_lora
    from tests.test_reliability import flux_args

    out = tmp_path / "out"
    assert train_lora.main(flux_args(tiny_set, out, "--timestep_sampling", "qinglong", "--qinglong_detail_share",
                                     "0.2", "--qinglong_mid", "shift", "--discrete_flow_shift", "2")) == 0
    with safe_open(str(out / "tiny_flux_lora.safetensors"), framework="pt") as f:
        header = f.metadata()
    assert json.loads(header["ss_qinglong"]) == {"logsnr_share": 0.11, "detail_share": 0.2, "mid": "shift"}
    assert (header["ss_timestep_sampling"], header["ss_logsnr_mean_std"], header["ss_discrete_flow_shift"]) == (
        "qinglong", "[-6.0, 2.0]", "2.0")
