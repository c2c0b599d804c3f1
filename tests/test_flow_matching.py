import math

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.flux.pipeline_flux import calculate_shift as diffusers_calculate_shift
from diffusers.training_utils import compute_loss_weighting_for_sd3

from library.models import flow_matching as fm
from library.models.flux2.sampling import compute_empirical_mu as flux2_mu

# The released schedulers (FLUX.1-dev and Qwen/Qwen-Image scheduler_config.json).
FLUX_DEV_SCHEDULER = dict(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=4096, max_shift=1.15,
                          num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True)
QWEN_IMAGE_SCHEDULER = dict(base_image_seq_len=256, base_shift=0.5, invert_sigmas=False, max_image_seq_len=8192,
                            max_shift=0.9, num_train_timesteps=1000, shift=1.0, shift_terminal=0.02,
                            stochastic_sampling=False, time_shift_type="exponential", use_dynamic_shifting=True)


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("method", fm.SAMPLING_METHODS[:-1])  # (qinglong, a mixture of these: test_qinglong.py)
def test_sampled_sigmas_are_float32_within_unit_interval(method):
    s = fm.sample_sigmas(4096, method, generator=gen(), image_seq_len=4096)
    assert s.dtype == torch.float32 and s.shape == (4096,)
    assert float(s.min()) > 0.0 and float(s.max()) <= 1.0
    # a distribution, not a constant (logsnr's default, the Style-Friendly paper's, holds 90% of it in [0.79, 0.99])
    assert float(s.std()) > (0.05 if method == "logsnr" else 0.1)


def test_sigma_sampling_is_reproducible_from_the_generator():
    a = fm.sample_sigmas(8, "flux_shift", generator=gen(3), image_seq_len=1024)
    b = fm.sample_sigmas(8, "flux_shift", generator=gen(3), image_seq_len=1024)
    c = fm.sample_sigmas(8, "flux_shift", generator=gen(4), image_seq_len=1024)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_uniform_and_sigmoid_have_the_expected_medians():
    u = fm.sample_sigmas(20000, "uniform", generator=gen())
    s = fm.sample_sigmas(20000, "sigmoid", generator=gen(), sigmoid_scale=1.0)
    assert abs(float(u.median()) - 0.5) < 0.02 and abs(float(u.mean()) - 0.5) < 0.01
    assert abs(float(s.median()) - 0.5) < 0.02
    # sigmoid(1.0 * randn): P(s < sigmoid(1)) = P(z < 1) = 0.8413
    assert abs(float((s < torch.sigmoid(torch.tensor(1.0))).float().mean()) - 0.8413) < 0.01


def test_shift_applies_k_s_over_one_plus_k_minus_one_s_to_the_sigmoid_draw():
    base = fm.sample_sigmas(64, "sigmoid", generator=gen(5))
    shifted = fm.sample_sigmas(64, "shift", generator=gen(5), shift=3.0)
    torch.testing.assert_close(shifted, 3.0 * base / (1 + 2.0 * base), rtol=0, atol=1e-7)
    # monotonic and pushes every sigma up for k > 1
    order = torch.argsort(base)
    assert bool((shifted[order].diff() >= 0).all()) and bool((shifted >= base).all())
    assert float(shifted.median()) == pytest.approx(0.75, abs=0.05)  # 3*0.5/(1+2*0.5)


@pytest.mark.parametrize("tokens", [256, 1024, 4096])
def test_flux_mu_equals_diffusers_calculate_shift(tokens):
    d = fm.sampling_of("flux").mu
    mu = fm.calculate_shift(tokens, d.base_seq_len, d.max_seq_len, d.base_shift, d.max_shift)
    assert mu == pytest.approx(diffusers_calculate_shift(tokens), abs=1e-12)
    assert mu == pytest.approx({256: 0.5, 1024: 0.5 + 0.65 * 768 / 3840, 4096: 1.15}[tokens], abs=1e-12)


def test_flux_and_qwen_shift_apply_the_exponential_time_shift_with_their_own_mu():
    base = fm.sample_sigmas(64, "sigmoid", generator=gen(7))
    flux = fm.sample_sigmas(64, "flux_shift", generator=gen(7), image_seq_len=4096)
    qwen = fm.sample_sigmas(64, "qwen_shift", generator=gen(7), image_seq_len=4096)
    mu_flux = 1.15
    mu_qwen = 0.5 + (0.9 - 0.5) * (4096 - 256) / (8192 - 256)  # 0.6935...
    torch.testing.assert_close(flux, math.exp(mu_flux) / (math.exp(mu_flux) + 1 / base - 1), rtol=0, atol=1e-6)
    torch.testing.assert_close(qwen, math.exp(mu_qwen) / (math.exp(mu_qwen) + 1 / base - 1), rtol=0, atol=1e-6)
    # more tokens -> larger mu -> noisier sigmas
    small = fm.sample_sigmas(64, "flux_shift", generator=gen(7), image_seq_len=256)
    assert bool((flux > small).all())


def test_shift_methods_need_the_token_count():
    with pytest.raises(ValueError, match="image_seq_len"):
        fm.sample_sigmas(2, "qwen_shift", generator=gen())
    with pytest.raises(ValueError, match="'logit' is not one of"):
        fm.sample_sigmas(2, "logit", generator=gen())


def test_noisy_input_and_target_satisfy_the_flow_algebra():
    x0 = torch.randn(3, 4, 8, 8).to(torch.bfloat16)
    noise = torch.randn(3, 4, 8, 8)
    s = torch.tensor([0.0, 0.25, 1.0])
    xt = fm.noisy_input(x0, noise, s)
    v = fm.flow_target(x0, noise)
    assert xt.dtype == torch.float32 and v.dtype == torch.float32
    torch.testing.assert_close(xt[0], x0[0].float(), rtol=0, atol=0)
    torch.testing.assert_close(xt[2], noise[2], rtol=0, atol=0)
    # x_t + (1 - s) v = noise and x_t - s v = x0
    torch.testing.assert_close(xt[1] + 0.75 * v[1], noise[1], rtol=0, atol=1e-6)
    torch.testing.assert_close(xt[1] - 0.25 * v[1], x0[1].float(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("scheme", [s for s in fm.WEIGHTING_SCHEMES if s != "sigma_sq"])  # (not diffusers')
def test_loss_weighting_matches_diffusers_sd3_weighting(scheme):
    s = torch.tensor([0.1, 0.3, 0.5, 0.9])
    ours = fm.loss_weighting(s, scheme)
    theirs = compute_loss_weighting_for_sd3(scheme if scheme != "none" else "logit_normal", s)
    torch.testing.assert_close(ours, theirs.float(), rtol=1e-6, atol=0)
    expected = {"none": [1, 1, 1, 1], "sigma_sqrt": [100, 1 / 0.09, 4, 1 / 0.81],
                "cosmap": [2 / (math.pi * (1 - 2 * x + 2 * x * x)) for x in (0.1, 0.3, 0.5, 0.9)]}[scheme]
    torch.testing.assert_close(ours, torch.tensor(expected, dtype=torch.float32), rtol=1e-6, atol=0)


def test_sigma_sqrt_weight_is_capped_where_the_peers_discrete_sigmas_stop():
    """A uniform draw near 0 weighted s^-2 without bound (1e10 at s = 1e-5, once in 1e5 samples); diffusers'
    and musubi-tuner's sigmas are k / 1000 of their scheduler, so their weight stops at 1e6."""
    w = fm.loss_weighting(torch.tensor([1e-5, 1e-3, 0.5]), "sigma_sqrt")
    torch.testing.assert_close(w, torch.tensor([1e6, 1e6, 4.0]), rtol=1e-5, atol=0)


def test_l2_loss_is_per_sample_mean_times_weight_then_batch_mean():
    pred = torch.zeros(2, 3, 4)
    target = torch.ones(2, 3, 4)
    target[1] *= 2.0  # per-sample mse: 1 and 4
    assert float(fm.flow_loss(pred, target)) == pytest.approx(2.5)
    assert float(fm.flow_loss(pred, target, torch.tensor([1.0, 0.5]))) == pytest.approx((1 + 2) / 2)
    assert fm.flow_loss(pred.bfloat16(), target.bfloat16()).dtype == torch.float32


def test_huber_with_a_large_c_keeps_its_value_in_float32():
    """Old: 2c (sqrt(r^2 + c^2) - c) cancelled in float32: c = 1e4 on r ~ 1.4 logged 0.28 for 2.02 (the
    gradient was right; the loss in the CSV / TensorBoard was not). The float64 value is the reference."""
    pred, target = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(0)), torch.zeros(2, 4, 8)
    for c in (1e3, 1e4, 1e5):
        r = pred.double()
        exact = float((2 * c * (torch.sqrt(r**2 + c**2) - c)).mean())
        assert float(fm.flow_loss(pred, target, loss_type="huber", huber_c=c)) == pytest.approx(exact, rel=1e-5)


def test_huber_is_l2_for_small_residuals_and_linear_for_large():
    c = 0.1
    small = torch.full((1, 8), 1e-3)
    large = torch.full((1, 8), 10.0)
    zero = torch.zeros(1, 8)
    assert float(fm.flow_loss(small, zero, loss_type="huber", huber_c=c)) == pytest.approx(1e-6, rel=1e-3)
    # 2c (sqrt(100 + c^2) - c) ~= 2c * 10 = 2.0, far below the l2 value 100
    assert float(fm.flow_loss(large, zero, loss_type="huber", huber_c=c)) == pytest.approx(
        2 * c * (math.sqrt(100 + c * c) - c), rel=1e-6)
    assert float(fm.flow_loss(large, zero, loss_type="l2")) == pytest.approx(100.0)


def _scheduler_sigmas(config, steps, tokens):
    scheduler = FlowMatchEulerDiscreteScheduler(**config)
    mu = diffusers_calculate_shift(tokens, config["base_image_seq_len"], config["max_image_seq_len"],
                                   config["base_shift"], config["max_shift"])
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)  # what the pipelines pass
    return scheduler.sigmas


@pytest.mark.parametrize("steps,tokens", [(4, 256), (28, 4096), (50, 1024)])
def test_flux_inference_sigmas_match_diffusers_scheduler(steps, tokens):
    ours = fm.inference_sigmas(steps, tokens, "flux")
    theirs = _scheduler_sigmas(FLUX_DEV_SCHEDULER, steps, tokens)
    assert ours.shape == (steps + 1,) and ours.dtype == torch.float32
    assert float((ours - theirs).abs().max()) < 1e-6


@pytest.mark.parametrize("arch,config", [("flux", FLUX_DEV_SCHEDULER), ("qwen_image", QWEN_IMAGE_SCHEDULER)])
@pytest.mark.parametrize("shift", [0.5, 2.2, 7.0])
def test_a_fixed_flow_shift_is_the_released_scheduler_with_that_shift_and_no_dynamic_shifting(arch, config, shift):
    """A prompt's --fs (musubi-tuner's flow_shift): its get_scheduler(shift) is the release's scheduler with shift k,
    use_dynamic_shifting off and the linear shift (Qwen-Image's terminal stretch kept), given the pipeline's linspace;
    for FLUX.1 (no terminal) also its own FlowMatchDiscreteScheduler's sd3_time_shift of linspace(1, 0, steps + 1)."""
    steps = 8
    scheduler = FlowMatchEulerDiscreteScheduler(**{**config, "shift": shift, "use_dynamic_shifting": False,
                                                   "time_shift_type": "linear"})
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps))
    ours = fm.inference_sigmas(steps, 4096, arch, shift=shift)
    assert ours.dtype == torch.float32 and float((ours - scheduler.sigmas).abs().max()) < 1e-6
    assert torch.equal(ours, fm.inference_sigmas(steps, 256, arch, shift=shift))  # no token count in it
    if arch == "flux":
        t = torch.linspace(1, 0, steps + 1, dtype=torch.float64)
        assert float((ours - shift * t / (1 + (shift - 1) * t)).abs().max()) < 1e-6
    else:
        assert float(ours[-2]) == pytest.approx(0.02, abs=1e-6)


@pytest.mark.parametrize("steps,tokens", [(4, 256), (30, 4096), (50, 6032)])
def test_qwen_image_inference_sigmas_match_diffusers_scheduler(steps, tokens):
    ours = fm.inference_sigmas(steps, tokens, "qwen_image")
    theirs = _scheduler_sigmas(QWEN_IMAGE_SCHEDULER, steps, tokens)
    assert float((ours - theirs).abs().max()) < 1e-6
    assert float(ours[-2]) == pytest.approx(0.02, abs=1e-6)  # shift_terminal


@pytest.mark.parametrize("steps", [1, 8, 28, 40])
@pytest.mark.parametrize("shift", [None, 1.0, 6.0])
def test_a_scheduler_spaced_schedule_is_set_timesteps_without_sigmas(steps, shift):
    """A pipeline that passes no sigmas (StableDiffusion3Pipeline: FlowMatchEulerDiscreteScheduler(shift=3), no dynamic
    shifting) runs the scheduler's own spacing, linspace(1, its shifted 1/1000, steps) shifted, not FLUX.1's
    linspace(1, 1/steps, steps) (0.03 apart at 8 steps): a --fs k is that scheduler built with shift k."""
    from library.models.spec import Sampling

    sampling = Sampling(method="shift", shift=3.0, scheduler_spacing=True)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0 if shift is None else shift)
    scheduler.set_timesteps(steps)
    ours = fm.inference_sigmas(steps, 4096, "flux", sampling=sampling, shift=shift)  # the family's call
    assert float((ours - scheduler.sigmas).abs().max()) < 1e-6, (ours, scheduler.sigmas)
    if steps == 8 and shift is None:
        flux_spacing = fm.inference_sigmas(steps, 4096, "flux", shift=3.0)
        assert float((flux_spacing - scheduler.sigmas).abs().max()) > 1e-2


def test_one_step_is_sigma_one_then_zero_where_the_schedule_stretches_to_a_terminal():
    """shift_terminal's stretch divided 0 by 0 at one step (as diffusers' does): an all-NaN Qwen-Image sample."""
    for arch in ("qwen_image", "flux"):
        assert fm.inference_sigmas(1, 4096, arch).tolist() == [1.0, 0.0], arch


def test_schnell_schedule_is_unshifted():
    torch.testing.assert_close(fm.inference_sigmas(4, 4096, "flux", dynamic_shift=False),
                               torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0]))


def test_euler_sampler_recovers_x0_under_the_exact_velocity():
    # For a fixed x0 the exact velocity at x_t is (x_t - x0) / s, so Euler on the straight path is exact.
    x0 = torch.randn(2, 16)
    noise = torch.randn(2, 16)
    sigmas = fm.inference_sigmas(8, 1024, "flux")
    calls = []

    def model_fn(x, sigma):
        calls.append(sigma.clone())
        assert x.dtype == torch.float32 and sigma.shape == (2,)
        return (x - x0) / sigma[:, None]

    out = fm.euler_sample(model_fn, noise, sigmas)
    assert len(calls) == 8 and float(calls[0][0]) == 1.0
    assert float((out - x0).abs().max()) < 1e-5
    # bf16 model outputs: the float32 state keeps the error at bf16 rounding of one step
    out_bf16 = fm.euler_sample(lambda x, s: model_fn(x, s).bfloat16(), noise, sigmas)
    assert float((out_bf16 - x0).abs().max()) < 1e-2


# FLUX.2 scheduler_config.json (klein and dev); the pipelines pass mu = compute_empirical_mu(tokens, steps).
FLUX2_SCHEDULER = dict(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=4096, max_shift=1.15,
                       num_train_timesteps=1000, shift=3.0, time_shift_type="exponential", use_dynamic_shifting=True)


@pytest.mark.parametrize("steps,tokens", [(4, 256), (28, 1024), (50, 4096), (50, 6032)])
def test_flux2_inference_sigmas_match_flux2_klein_pipeline(steps, tokens):
    from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu

    assert flux2_mu(tokens, steps) == compute_empirical_mu(tokens, steps)
    scheduler = FlowMatchEulerDiscreteScheduler(**FLUX2_SCHEDULER)
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=compute_empirical_mu(tokens, steps))
    ours = fm.inference_sigmas(steps, tokens, "flux2")
    assert ours.shape == (steps + 1,) and ours.dtype == torch.float32
    assert float((ours - scheduler.sigmas).abs().max()) < 1e-6


def test_flux2_shift_training_draw_uses_the_empirical_mu_at_50_steps():
    ours = fm.sample_sigmas(64, "flux2_shift", generator=gen(3), image_seq_len=1024)
    base = fm.sample_sigmas(64, "sigmoid", generator=gen(3))
    torch.testing.assert_close(ours, fm.time_shift(flux2_mu(1024, 50), base), rtol=0, atol=0)
    assert float(ours.mean()) > float(base.mean()) + 0.1  # mu ~ 2.0 at 1024 tokens: shifted towards noise


def test_constant_shift_is_the_time_shift_at_mu_ln_k_for_training_and_inference():
    """A scheduler without a resolution shift (Sampling.shift): s' = k s / (1 + (k - 1) s) is the time
    shift at mu = ln k, at every token count; training draws with train_shift, samples with shift."""
    import dataclasses
    import math

    from library.models.spec import Sampling

    s = torch.linspace(0.05, 1.0, 20)
    k = 3.0
    torch.testing.assert_close(fm.time_shift(math.log(k), s), k * s / (1 + (k - 1) * s), rtol=1e-6, atol=1e-7)
    sampling = Sampling(method="any_shift", shift=3.0, train_shift=2.0)
    assert fm.resolution_mu(sampling, 256) == fm.resolution_mu(sampling, 65536) == math.log(2.0)
    assert fm.resolution_mu(sampling, 256, steps=8) == math.log(3.0)
    sigmas = fm.inference_sigmas(4, 1024, "flux", sampling=sampling)
    base = torch.linspace(1.0, 0.25, 4)
    torch.testing.assert_close(sigmas[:-1], k * base / (1 + (k - 1) * base))
    assert fm.resolution_mu(dataclasses.replace(sampling, train_shift=None), 256) == math.log(3.0)


def test_a_timestep_bias_draws_the_methods_law_at_a_cubed_quantile_as_ai_toolkit():
    """timestep_bias (2026-12-01): ai-toolkit's content / style index its descending timesteps with u^3 (its
    linear grid: sigma ~ 1 - u^3 for content); ours draws each method's law at the quantile 1 - u^3 / u^3."""
    from statistics import NormalDist

    u = torch.rand(4000, generator=torch.Generator().manual_seed(5))
    high = fm.sample_sigmas(4000, "uniform", generator=torch.Generator().manual_seed(5), bias="high_noise")
    assert torch.allclose(high, (1 - u ** 3).clamp(1e-6, 1 - 1e-6))
    low = fm.sample_sigmas(4000, "sigmoid", generator=torch.Generator().manual_seed(5), bias="low_noise")
    quantiles = (u ** 3).clamp(1e-6, 1 - 1e-6).tolist()
    expected = torch.sigmoid(torch.tensor([NormalDist().inv_cdf(q) for q in quantiles], dtype=torch.float32))
    assert torch.allclose(low, expected, atol=1e-5)
    medians = {bias: fm.sample_sigmas(4000, "flux_shift", generator=torch.Generator().manual_seed(5), bias=bias,
                                      image_seq_len=1024).median().item()
               for bias in ("none", "high_noise", "low_noise")}
    assert medians["low_noise"] < medians["none"] - 0.2 and medians["high_noise"] > medians["none"] + 0.1, medians
    plain = fm.sample_sigmas(8, "sigmoid", generator=torch.Generator().manual_seed(5))  # none: the draws as before
    assert torch.equal(plain, torch.sigmoid(torch.randn(8, generator=torch.Generator().manual_seed(5))))
