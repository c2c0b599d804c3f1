"""The sigma draw's keys from musubi-tuner: min_timestep / max_timestep, the sigmas a run trains, the law scaled into
the range or, with preserve_distribution_shape, cut to it (checked in the config and, for a range the law hardly
reaches, before caching); and timestep_sampling = "logsnr", the Style-Friendly log-SNR-normal draw."""

import argparse

import pytest
import torch

from library.models import flow_matching as fm
from library.models.flux1.family import FluxFamily
from library.training.config import ConfigError, base_precision, compute_dtype, load_config
from library.training.diffusion_checks import check_timestep_range

LO, HI = 0.7, 0.95
LAWS = {  # timestep_sampling (and its arguments) -> sample_sigmas' keywords
    "sigmoid": dict(method="sigmoid"),
    "shift 3": dict(method="shift", shift=3.0),
    "flux_shift at 1024 px": dict(method="flux_shift", image_seq_len=4096),
    "uniform, high_noise bias": dict(method="uniform", bias="high_noise"),
}


def law(g: torch.Generator, method: str, **kw):
    """draw(n): n sigmas of the law from g, as a family's draw_sigmas gives them."""
    return lambda n: fm.sample_sigmas(n, method, generator=g, **kw)


def per_sample(count: int, lo: float, hi: float, preserve: bool, **kw) -> torch.Tensor:
    """One sigma per sample, each from its own generator, as training_loss draws them."""
    return torch.cat([fm.sigmas_in_range(law(torch.Generator().manual_seed(seed), **kw), 1, lo, hi, preserve)
                      for seed in range(count)])


def ks_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest gap between the two samples' empirical CDFs."""
    a, b = a.sort().values, b.sort().values
    x = torch.cat([a, b])
    cdf_a, cdf_b = torch.searchsorted(a, x, right=True) / len(a), torch.searchsorted(b, x, right=True) / len(b)
    return (cdf_a - cdf_b).abs().max().item()


def test_unset_the_draw_is_the_laws_own_bit_for_bit():
    g, h = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert torch.equal(fm.sigmas_in_range(law(g, "flux_shift", image_seq_len=256), 1, *fm.timestep_range(
        argparse.Namespace(min_timestep=None, max_timestep=None)), True), fm.sample_sigmas(
        1, "flux_shift", generator=h, image_seq_len=256))
    assert fm.timestep_range(argparse.Namespace(min_timestep=0, max_timestep=1000)) == (0.0, 1.0)
    assert fm.timestep_range(argparse.Namespace(min_timestep=250, max_timestep=None)) == (0.25, 1.0)


@pytest.mark.parametrize("name", LAWS)
def test_preserve_cuts_the_law_to_the_range_and_the_default_scales_it_into_it(name):
    """musubi-tuner's two readings: scaled, each sigma is the law's s (hi - lo) + lo; preserved, the law restricted
    to [lo, hi] (its rejection sampling): 3000 draws against the in-range share of 400,000 from the plain law. The
    scaled draws are far from that law (the test tells the two apart)."""
    scaled = per_sample(3000, LO, HI, False, **LAWS[name])
    plain = per_sample(3000, 0.0, 1.0, False, **LAWS[name])
    assert torch.equal(scaled, plain * (HI - LO) + LO)
    kept = per_sample(3000, LO, HI, True, **LAWS[name])
    assert kept.min() >= LO and kept.max() <= HI and kept.dtype == torch.float32
    many = law(torch.Generator().manual_seed(10**6), **LAWS[name])(400_000)
    cut = many[(many >= LO) & (many <= HI)]
    assert ks_distance(kept, cut) < 0.03
    assert ks_distance(scaled, cut) > 0.1


def test_a_range_the_law_never_reaches_is_one_line_naming_the_keys():
    never = lambda n: torch.full((n,), 0.5)  # noqa: E731
    with pytest.raises(ValueError, match=r"min_timestep / max_timestep: 0 of 65536 sigmas of this draw fell in "
                                         r"\[0\.9, 1\], 1 needed"):
        fm.sigmas_in_range(never, 1, 0.9, 1.0, True)


def loss_args(**overrides):
    values = dict(timestep_sampling=None, discrete_flow_shift=3.0, sigmoid_scale=1.0, guidance_scale=1.0,
                  weighting_scheme="none", loss_type="l2", huber_c=0.1, min_timestep=None, max_timestep=None,
                  preserve_distribution_shape=False)
    return argparse.Namespace(**{**values, **overrides})


@pytest.mark.parametrize("preserve", [False, True])
def test_the_training_step_trains_the_range(tiny_set, preserve):
    """The tiny FLUX.1's step: each sample's noise, then its sigma in [0.7, 0.95] from the same generator."""
    family = FluxFamily(tiny_set["flux_bfl"])
    model = family.load_transformer(torch.float32)
    latents, seeds = torch.randn(3, 16, 8, 16), [41, 42, 43]
    text = {"t5": torch.randn(3, 7, 32), "clip_pooled": torch.randn(3, 32)}
    args = loss_args(min_timestep=700, max_timestep=950, preserve_distribution_shape=preserve)
    _, sigmas = family.training_loss(model, latents, text, args, [torch.Generator().manual_seed(s) for s in seeds])
    expected = []
    for seed in seeds:
        g = torch.Generator().manual_seed(seed)
        torch.randn(latents.shape[1:], generator=g)
        expected.append(fm.sigmas_in_range(law(g, "flux_shift", image_seq_len=32), 1, LO, HI, preserve))
    assert torch.equal(sigmas, torch.cat(expected)) and sigmas.min() >= LO and sigmas.max() <= HI


FLUX = ["--model_type", "flux", "--pretrained_model_name_or_path", "m", "--ae", "a", "--clip_l", "c", "--t5xxl", "t",
        "--dataset_config", "d.toml"]


@pytest.mark.parametrize("flags, message", [
    (["--min_timestep", "1000"], "key 'min_timestep' must be 0 to 999"),
    (["--max_timestep", "0"], "key 'max_timestep' must be 1 to 1000"),
    (["--min_timestep", "500", "--max_timestep", "500"], r"min_timestep \(500\) must be below max_timestep \(500\)"),
    (["--preserve_distribution_shape", "true"], "key 'preserve_distribution_shape' does nothing with min_timestep "
                                                "unset and max_timestep unset"),
])
def test_a_bad_range_is_refused_in_the_config(flags, message):
    with pytest.raises(ConfigError, match=f"^command line: {message}"):
        load_config(FLUX + flags)
    args = load_config(FLUX + ["--min_timestep", "100", "--max_timestep", "900",
                               "--preserve_distribution_shape", "true"])
    assert (args.min_timestep, args.max_timestep, args.preserve_distribution_shape) == (100, 900, True)


def test_an_llm_run_refuses_them():
    with pytest.raises(ConfigError, match="key 'min_timestep' is read by the diffusion models"):
        load_config(["--model_type", "llm", "--pretrained_model_name_or_path", "m", "--train_data", "a.txt",
                     "--min_timestep", "100"])


def test_a_range_its_law_hardly_reaches_is_refused_before_caching(tiny_set):
    """sigma above 0.995 under FLUX.1's shifted draw at 1024 px: 0.0025% of the draws; preserve_distribution_shape would
    redraw each sample's sigma up to 65,536 times and could stop a long run. Refused now, with the share; the scaled
    reading of the same range, and a range the law reaches, pass."""
    family = FluxFamily(tiny_set["flux_bfl"])
    args = load_config(FLUX[:2] + ["--pretrained_model_name_or_path", tiny_set["flux_bfl"], *FLUX[4:],
                                   "--min_timestep", "995", "--preserve_distribution_shape", "true"])
    def meta_model():
        return family.load_transformer(compute_dtype(args), base_precision(args), read_weights=False)

    with pytest.raises(ConfigError, match=r"min_timestep 995 / max_timestep None with preserve_distribution_shape: "
                                          r"the sigma law \(timestep_sampling unset: flux_shift\) puts 0\.0\d+% of its "
                                          r"draws in \[0\.995, 1\] at 1024 px"):
        check_timestep_range(args, family, meta_model)
    check_timestep_range(argparse.Namespace(**{**vars(args), "preserve_distribution_shape": False}), family, meta_model)
    check_timestep_range(argparse.Namespace(**{**vars(args), "min_timestep": 900}), family, meta_model)


@pytest.mark.parametrize("lo_hi", [(None, None), (300, 600)])
def test_a_family_with_its_own_law_draws_it_in_the_range(tiny_set, lo_hi):
    """Ideogram 4 draws its pipeline's law (ideogram4.sampling.training_sigmas) through its draw_sigmas: unset, that
    law itself, sample by sample; with a range, that law cut to it."""
    from library.models.family import family_class
    from library.models.ideogram4.sampling import training_sigmas

    family = family_class("ideogram4")(tiny_set["ideogram4"], tiny_set["flux2_vae"],
                                       text_encoder=tiny_set["ideogram4_text_encoder"])
    model = family.load_transformer(torch.float32)
    latents, seeds = torch.randn(2, family.latent_channels, 4, 6), [7, 8]
    text = {"embeds": torch.randn(2, 5, model.config.llm_features_dim), "mask": torch.ones(2, 5, dtype=torch.bool)}
    args = loss_args(min_timestep=lo_hi[0], max_timestep=lo_hi[1], preserve_distribution_shape=lo_hi[0] is not None)
    _, sigmas = family.training_loss(model, latents, text, args, [torch.Generator().manual_seed(s) for s in seeds])
    lo, hi = fm.timestep_range(args)
    expected = []
    for seed in seeds:
        g = torch.Generator().manual_seed(seed)
        torch.randn(latents.shape[1:], generator=g)
        own_law = lambda n, g=g: training_sigmas(n, 4 * family.vae_downsample,  # noqa: E731
                                                 6 * family.vae_downsample, g)
        expected.append(fm.sigmas_in_range(own_law, 1, lo, hi, True))
    assert torch.equal(sigmas, torch.cat(expected)) and sigmas.min() >= lo and sigmas.max() <= hi


@pytest.mark.parametrize("mean, std, bias", [(-6.0, 2.0, "none"), (0.0, 1.0, "none"), (-2.0, 3.0, "high_noise")])
def test_the_logsnr_draw_is_a_normal_log_snr(mean, std, bias):
    """sigma = sigmoid(-logSNR / 2), logSNR ~ N(mean, std) (musubi-tuner's torch.normal then sigmoid): 20,000 draws
    against that formula's from another generator. A timestep_bias leans it as the other laws (high_noise: more
    noise)."""
    ours = fm.sample_sigmas(20_000, "logsnr", generator=torch.Generator().manual_seed(1), logsnr=(mean, std), bias=bias)
    theirs = torch.sigmoid(-torch.normal(mean, std, (20_000,), generator=torch.Generator().manual_seed(2)) / 2)
    assert ours.dtype == torch.float32 and 0 < ours.min() and ours.max() < 1
    if bias == "none":
        assert ks_distance(ours, theirs) < 0.02
        assert ks_distance(ours, fm.sample_sigmas(20_000, "sigmoid", generator=torch.Generator().manual_seed(1),
                                                  sigmoid_scale=std / 2)) > (0.1 if mean else -1)  # 0: that law
    else:
        assert ours.median() > theirs.median() + 0.1
    assert fm.LOGSNR == (-6.0, 2.0)  # the paper's: median sigma sigmoid(3) = 0.95


def test_the_logsnr_draw_reaches_the_training_step_and_its_keys_are_checked(tiny_set):
    family = FluxFamily(tiny_set["flux_bfl"])
    model = family.load_transformer(torch.float32)
    latents, seeds = torch.randn(2, 16, 8, 16), [51, 52]
    text = {"t5": torch.randn(2, 7, 32), "clip_pooled": torch.randn(2, 32)}
    args = loss_args(timestep_sampling="logsnr", logsnr_mean=-2.0, logsnr_std=1.5)
    _, sigmas = family.training_loss(model, latents, text, args, [torch.Generator().manual_seed(s) for s in seeds])
    expected = []
    for seed in seeds:
        g = torch.Generator().manual_seed(seed)
        torch.randn(latents.shape[1:], generator=g)
        expected.append(fm.sample_sigmas(1, "logsnr", generator=g, logsnr=(-2.0, 1.5)))
    assert torch.equal(sigmas, torch.cat(expected))
    with pytest.raises(ConfigError, match="^command line: key 'logsnr_mean' does nothing with timestep_sampling unset"):
        load_config(FLUX + ["--logsnr_mean", "-3"])
    with pytest.raises(ConfigError, match="key 'sigmoid_scale' does nothing with timestep_sampling = \"logsnr\""):
        load_config(FLUX + ["--timestep_sampling", "logsnr", "--sigmoid_scale", "2"])
    with pytest.raises(ConfigError, match="key 'logsnr_std' must be > 0"):
        load_config(FLUX + ["--timestep_sampling", "logsnr", "--logsnr_std", "0"])
