"""Rectified-flow training objective and Euler sampling, the same for every diffusion family.

    x_t    = (1 - s) * x0 + s * noise        s = sigma in [0, 1] (1 = pure noise)
    target = noise - x0                       the velocity the transformer predicts
    sample: x_{i+1} = x_i + (s_{i+1} - s_i) * v(x_i, s_i), from s = 1 down to 0

Models receive s itself (every family's forward takes sigma in [0, 1]). Every sigma, weight and loss
here is float32, whatever dtype the model runs in.

The resolution-dependent shift is the one each released model's diffusers scheduler uses at
inference: mu grows with the image token count and s' = e^mu / (e^mu + 1/s - 1). Its constants are
the architecture's (its spec's `sampling`: a MuLine, a function of the token and step counts, or a
constant shift k, mu = ln k, for a scheduler without a resolution shift),
and training draws with them by default (timestep_sampling = the spec's method): a logit-normal draw
(sigmoid(randn), scale 1) shifted as the released scheduler shifts, raw velocity target, no loss
weighting, plain L2.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import numpy as np
import torch

from library.models.registry import (MODE_SCALE, MODE_SCALES, SAMPLING_METHODS, SHIFTED_DRAWS,  # the config's
                                     TIMESTEP_BIASES, UNSHIFTED_DRAWS, arch_specs)
from library.models.spec import MuLine, Sampling, load_symbol

WEIGHTING_SCHEMES = ("none", "sigma_sqrt", "cosmap", "sigma_sq")
QUANTILE_EDGE = 1e-6  # a biased quantile's distance from 0 and 1 (erfinv(+-1) is infinite)
SIGMA_SQRT_FLOOR = 1e-3  # the smallest sigma of a 1000-step scheduler (loss_weighting)
LOSS_TYPES = ("l2", "huber")
# timestep_sampling = "logsnr": the log-SNR's mean and std by default, the Style-Friendly paper's (Choi et al. 2024,
# arXiv 2411.14793; musubi-tuner's docs): mostly high noise, where a style is set (median sigma 0.95)
LOGSNR = (-6.0, 2.0)
# timestep_sampling = "qinglong" (musubi-tuner's qinglong_* hybrid sampler, its PR #407): each sample's sigma from the
# mid draw (the model's own, or qinglong_mid), the logsnr draw (logsnr_mean / logsnr_std) or the detail draw, the
# log-SNR normal at 5.36 / 1 (low noise: median sigma 0.064), by shares; QINGLONG_SHARES: the logsnr and detail
# shares of musubi-tuner's first qinglong draw (its second's: 0 / 0.05; each family's spec names its own), the mid
# draw the rest
QINGLONG_DETAIL = (5.36, 1.0)
QINGLONG_SHARES = (0.11, 0.10)


def calculate_shift(image_seq_len: int, base_seq_len: int, max_seq_len: int, base_shift: float, max_shift: float) -> float:
    """mu on the line through (base_seq_len, base_shift) and (max_seq_len, max_shift); not
    clamped outside it (as diffusers)."""
    m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return image_seq_len * m + (base_shift - m * base_seq_len)


def sampling_of(arch: str) -> Sampling:
    """The architecture's Sampling (its spec); a ValueError for one without (the LLM)."""
    spec = arch_specs().get(arch)
    if spec is None or spec.sampling is None:
        archs = [a for a, s in arch_specs().items() if s.sampling]
        raise ValueError(f"no flow-matching schedule for {arch!r}: expected one of {', '.join(archs)}")
    return spec.sampling


def resolution_mu(sampling: Sampling, image_seq_len: int, steps: int | None = None) -> float:
    """mu of the released scheduler for this token count; a step-dependent mu at `steps` (training,
    which has none: the spec's train_mu_steps). A constant shift k is mu = ln k at every token count
    (training, steps None: ln of its train_shift where it has one)."""
    if sampling.shift is not None:
        return math.log((sampling.train_shift or sampling.shift) if steps is None else sampling.shift)
    if isinstance(sampling.mu, MuLine):
        line = sampling.mu
        return calculate_shift(image_seq_len, line.base_seq_len, line.max_seq_len, line.base_shift, line.max_shift)
    return load_symbol(sampling.mu)(image_seq_len, sampling.train_mu_steps if steps is None else steps)


def _shift_method(method: str) -> Sampling:
    """The Sampling whose method is `method` (a resolution shift named after an architecture); the
    specs that share a method share its constants (tests/test_family_spec.py), so the first one's."""
    return next(s.sampling for s in arch_specs().values() if s.sampling and s.sampling.method == method)


def time_shift(mu: float, sigmas: torch.Tensor) -> torch.Tensor:
    """s' = e^mu / (e^mu + 1/s - 1), in float32 (s = 0 stays 0, s = 1 stays 1)."""
    s = sigmas.float()
    return math.exp(mu) / (math.exp(mu) + (1.0 / s - 1.0))


# ----------------------------------------------------------------------------------------------
# Training


def standard_normal(batch: int, generator: torch.Generator | None, bias: str = "none",
                    dtype: torch.dtype = torch.float32, quantiles: torch.Tensor | None = None) -> torch.Tensor:
    """[batch] N(0, 1) draws; with a timestep_bias, the normal quantile of the biased q (TIMESTEP_BIASES), so a
    law made of the normal (sigmoid(n), its shifts) keeps its shape and leans to high or low sigmas.
    quantiles: [batch] given uniform quantiles in (0, 1) (num_timestep_buckets' stratified ones) instead of draws."""
    device = generator.device if generator is not None else torch.device("cpu")
    if bias == "none" and quantiles is None:
        return torch.randn(batch, generator=generator, device=device, dtype=dtype)
    if quantiles is None:
        q = biased_quantile(batch, generator, bias, dtype).double()  # erfinv near +-1 in float64: q ~ 1e-6 keeps digits
    else:
        q = lean(quantiles.double(), bias).clamp(QUANTILE_EDGE, 1.0 - QUANTILE_EDGE)
    return (math.sqrt(2.0) * torch.special.erfinv(2.0 * q - 1.0)).to(dtype)


def lean(u: torch.Tensor, bias: str) -> torch.Tensor:
    """A uniform quantile u leaned by timestep_bias: 1 - u^3 (high_noise: sigma near 1 more often), u^3
    (low_noise), u itself (none)."""
    if bias not in TIMESTEP_BIASES:
        raise ValueError(f"timestep_bias {bias!r} is not one of {', '.join(TIMESTEP_BIASES)}")
    return u if bias == "none" else 1.0 - u ** 3 if bias == "high_noise" else u ** 3


def biased_quantile(batch: int, generator: torch.Generator | None, bias: str, dtype=torch.float32) -> torch.Tensor:
    """[batch] quantiles in (0, 1): 1 - u^3 (high_noise: sigma near 1 more often) or u^3 (low_noise)."""
    if bias not in TIMESTEP_BIASES[1:]:
        raise ValueError(f"timestep_bias {bias!r} is not one of {', '.join(TIMESTEP_BIASES)}")
    device = generator.device if generator is not None else torch.device("cpu")
    u = torch.rand(batch, generator=generator, device=device, dtype=dtype)
    return lean(u, bias).clamp(QUANTILE_EDGE, 1.0 - QUANTILE_EDGE)


def stratified_quantiles(strata: list[int], buckets: int, generators: list[torch.Generator]) -> list[torch.Tensor]:
    """num_timestep_buckets (musubi-tuner's stratified draw): sample i's uniform quantile, float64 [1], drawn
    uniform within its stratum [k / buckets, (k + 1) / buckets) from its own generator (where its sigma draw was:
    noise first, then this). The sampler deals an epoch's samples the strata evenly (BucketBatchSampler)."""
    return [(k + torch.rand(1, generator=g, dtype=torch.float64)) / buckets for k, g in zip(strata, generators)]


def sample_sigmas(batch: int, method: str, *, generator: torch.Generator | None, shift: float = 3.0,
                  sigmoid_scale: float = 1.0, image_seq_len: int | None = None, bias: str = "none",
                  logsnr: tuple[float, float] = LOGSNR, quantiles: torch.Tensor | None = None,
                  shifted: str = "sigmoid", sigmoid_mean: float = 0.0, mode_scale: float = MODE_SCALE) -> torch.Tensor:
    """One sigma per sample, float32 [batch] in [0, 1], on the generator's device.

    uniform: U(0, 1]; sigmoid: sigmoid(sigmoid_mean + sigmoid_scale * randn) (sigmoid_mean > 0: more noise);
    mode: the mode law (Esser et al. 2024) at mode_scale (mode_sigmas); shift: the sigmoid draw then
    s' = k s / (1 + (k - 1) s) with k = shift; logsnr: the log signal-to-noise ratio ln((1 - s)^2 / s^2) drawn
    N(mean, std) (logsnr = (mean, std); the Style-Friendly sampler, musubi-tuner's logsnr), s = sigmoid(-logSNR / 2),
    as sigmoid((std n - mean) / 2) so that a larger n is more noise; an architecture's method (its spec's
    sampling.method):
    the sigmoid draw then the time_shift with that architecture's mu for image_seq_len (at its
    train_mu_steps where mu depends on a step count; ln of its constant train shift where it has one).
    bias: timestep_bias (TIMESTEP_BIASES), the uniform draw's quantile or the normal's biased; "none": as ever.
    quantiles: [batch] uniform quantiles to map through the law instead of drawing (stratified_quantiles); the
    law's sigma is monotone in its quantile. shifted (shifted_draw): the draw a shift moves, sigmoid(sigmoid_scale
    randn), "uniform" (sd-scripts' sigma draw on its shifted scheduler, its nextdit_shift; ai-toolkit's shifts) or
    "mode" (sd-scripts' sigma draw with weighting_scheme mode; with a training_shift)."""
    if method not in SAMPLING_METHODS or method == "qinglong":  # (a mixture of laws: qinglong_sigmas)
        raise ValueError(f"timestep_sampling {method!r} is not one of {', '.join(SAMPLING_METHODS[:-1])}")
    if shifted not in SHIFTED_DRAWS:
        raise ValueError(f"shifted_draw {shifted!r} is not one of {', '.join(SHIFTED_DRAWS)}")
    drawn = method if method in UNSHIFTED_DRAWS else shifted  # the draw the method's shift (if any) moves
    if drawn == "uniform":
        sigmas = uniform_sigmas(batch, generator, bias, quantiles)
    elif drawn == "mode":
        sigmas = mode_sigmas(uniform_sigmas(batch, generator, bias, quantiles), mode_scale)
    elif method == "logsnr":
        mean, std = logsnr
        return torch.sigmoid((std * standard_normal(batch, generator, bias, quantiles=quantiles) - mean) / 2.0)
    else:
        logits = sigmoid_scale * standard_normal(batch, generator, bias, quantiles=quantiles)
        sigmas = torch.sigmoid(logits + sigmoid_mean if sigmoid_mean else logits)
    if method in UNSHIFTED_DRAWS:
        return sigmas
    if method == "shift":
        return shift * sigmas / (1.0 + (shift - 1.0) * sigmas)
    sampling = _shift_method(method)
    if image_seq_len is None and sampling.shift is None:
        raise ValueError(f"timestep_sampling {method!r} needs image_seq_len (image tokens per sample)")
    return time_shift(resolution_mu(sampling, image_seq_len), sigmas)


def uniform_sigmas(batch: int, generator: torch.Generator | None, bias: str = "none",
                   quantiles: torch.Tensor | None = None) -> torch.Tensor:
    """[batch] float32 sigmas uniform in (0, 1]: 1 - U[0, 1) (never exactly 0, where sigma_sqrt weighting is
    infinite); with a timestep_bias the biased quantile itself; of given quantiles, as these."""
    device = generator.device if generator is not None else torch.device("cpu")
    if quantiles is not None:
        u = lean(quantiles.double(), bias).clamp(QUANTILE_EDGE, 1.0 - QUANTILE_EDGE)
        return (u if bias != "none" else 1.0 - u).to(torch.float32)
    if bias != "none":
        return biased_quantile(batch, generator, bias)
    return 1.0 - torch.rand(batch, generator=generator, device=device, dtype=torch.float32)


def mode_sigmas(u: torch.Tensor, scale: float = MODE_SCALE) -> torch.Tensor:
    """The mode law (Esser et al. 2024, eq. 20) of uniform sigmas u (float32): (1 + s) u - s sin^2(pi u / 2),
    increasing in u (MODE_SCALES). The peers' f(v) = 1 - v - s (cos^2(pi v / 2) - 1 + v) of v ~ U[0, 1) is 1 - this
    at u = v, the same law (f(1 - v) = 1 - f(v)): their sigma 1 - f(v) (a scheduler's timesteps indexed by f(v)) and
    f(v) itself (a sigma drawn as u) are it too. s = 0: uniform; s > 0: more mid sigmas (1.29: the paper's and
    diffusers' default)."""
    lo, hi = MODE_SCALES
    if not lo < scale <= hi:
        raise ValueError(f"mode_scale {scale:g} is not in ({lo:g}, {hi:g}] (the law's map is monotone there)")
    u64 = u.double()
    return ((1.0 + scale) * u64 - scale * torch.sin(math.pi * u64 / 2.0) ** 2).clamp(0.0, 1.0).to(torch.float32)


def qinglong_sigmas(count: int, generator: torch.Generator | None, mid: Callable[[], torch.Tensor],
                    shares: tuple[float, float] = QINGLONG_SHARES, logsnr: tuple[float, float] = LOGSNR,
                    bias: str = "none", quantiles: torch.Tensor | None = None) -> torch.Tensor:
    """`count` sigmas of the qinglong mixture, float32: a uniform pick per draw (first, from the generator), then
    the mid draw (`mid()`: count sigmas of that law), the logsnr draw and the detail draw, each of all `count`, in
    that order; draw i takes the mid's below 1 - logsnr share - detail share, the logsnr's below 1 - detail share,
    else the detail's (musubi-tuner's masks). quantiles / bias: each draw's (num_timestep_buckets, timestep_bias)."""
    pick = torch.rand(count, generator=generator, dtype=torch.float64)
    laws = torch.stack([mid(), *(sample_sigmas(count, "logsnr", generator=generator, bias=bias, logsnr=law,
                                               quantiles=quantiles) for law in (logsnr, QINGLONG_DETAIL))])
    edges = torch.tensor([1.0 - sum(shares), 1.0 - shares[1]], dtype=torch.float64)
    which = torch.searchsorted(edges, pick, right=True)
    return laws.gather(0, which[None].to(laws.device)).squeeze(0)


# min_timestep / max_timestep (musubi-tuner's): the sigmas trained, in thousandths.
TIMESTEPS = 1000
REDRAW_CHUNK, REDRAW_ROUNDS = 1024, 64  # preserve_distribution_shape: up to 65,536 draws for a sample's sigma


def timestep_range(args) -> tuple[float, float]:
    """(lo, hi): the sigmas a run trains, min_timestep / 1000 to max_timestep / 1000 ((0, 1) unset)."""
    lo, hi = getattr(args, "min_timestep", None), getattr(args, "max_timestep", None)
    return (lo or 0) / TIMESTEPS, (TIMESTEPS if hi is None else hi) / TIMESTEPS


def sigmas_in_range(draw: Callable[[int], torch.Tensor], count: int, lo: float, hi: float,
                    preserve: bool) -> torch.Tensor:
    """`count` sigmas, float32 [count], of the law `draw(n)` draws (n sigmas; training: one sample's generator,
    count 1), within [lo, hi], as musubi-tuner's min_timestep / max_timestep: the law scaled into the range,
    s (hi - lo) + lo (its shape squeezed: a logit-normal's peak moves with the range), or with preserve (its
    preserve_distribution_shape) the law cut to it: draws outside are redrawn, from the same generator, at least
    REDRAW_CHUNK at a time (musubi-tuner redraws whole batches and, out of tries, trains the unrestricted draw; a
    ValueError here, and diffusion_checks refuses such a range at the start). (0, 1): the draw as ever, bit for bit."""
    if (lo, hi) == (0.0, 1.0):
        return draw(count)
    if not preserve:
        return draw(count) * (hi - lo) + lo
    kept, total, chunk = [], 0, max(count, REDRAW_CHUNK)
    for _ in range(REDRAW_ROUNDS):
        sigmas = draw(chunk)
        kept.append(sigmas[(sigmas >= lo) & (sigmas <= hi)])
        total += len(kept[-1])
        if total >= count:
            return torch.cat(kept)[:count]
    raise ValueError(f"min_timestep / max_timestep: {total} of {chunk * REDRAW_ROUNDS} sigmas of this draw fell in "
                     f"[{lo:g}, {hi:g}], {count} needed; widen the range, or set preserve_distribution_shape = false")


def _per_sample(sigmas: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """sigmas [B] as float32 [B, 1, ...] broadcasting over `like`."""
    return sigmas.float().reshape(-1, *([1] * (like.dim() - 1)))


def noisy_input(x0: torch.Tensor, noise: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    """x_t = (1 - s) x0 + s noise. float32 out (x0/noise may be bf16 latents); the model casts
    it to its compute_dtype at entry."""
    s = _per_sample(sigmas, x0)
    return (1.0 - s) * x0.float() + s * noise.float()


def perturbed_noise(noise: torch.Tensor, gamma: float, random_strength: bool,
                    generators: list[torch.Generator]) -> torch.Tensor | None:
    """The noise the model's input is made of under input perturbation (sd-scripts' ip_noise_gamma): noise + g xi,
    xi ~ N(0, 1) drawn after the sample's noise and sigma from its generator (so gamma = 0 leaves every draw as it
    was), g = gamma, or uniform in [0, gamma) per sample with random_strength (sd-scripts draws one per batch: here a
    sample's draw does not depend on its batch). The target stays noise - x0. None when gamma is 0. float32."""
    if not gamma:
        return None
    shape = noise.shape[1:]
    xi = torch.stack([torch.randn(shape, generator=g, dtype=torch.float32) for g in generators])
    strength = torch.tensor([gamma] * len(generators), dtype=torch.float32)
    if random_strength:
        strength = torch.cat([torch.rand(1, generator=g, dtype=torch.float32) * gamma for g in generators])
    return noise.float() + _per_sample(strength, xi).to(noise.device) * xi.to(noise.device)


def flow_target(x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The velocity d x_t / d s = noise - x0, float32."""
    return noise.float() - x0.float()


def loss_weighting(sigmas: torch.Tensor, scheme: str) -> torch.Tensor:
    """Per-sample weights, float32 [B], as sd-scripts' and diffusers' compute_loss_weighting (training_utils):
    none -> 1, sigma_sqrt -> s^-2, cosmap -> 2 / (pi (1 - 2 s + 2 s^2)); and sigma_sq -> s^2, the clean-latent
    error of the velocity error (x0 = x_t - s v): what a script training with preconditioned outputs and weight 1
    minimises (a family's spec says whose).

    sigma_sqrt takes s no smaller than SIGMA_SQRT_FLOOR: the peers draw s from the 1000 sigmas of a
    scheduler (k / 1000), so their weight is at most 1e6; our continuous draw reaches 1e-5 about once in
    1e5 samples with uniform sampling (a weight of 1e10: one sample's loss then swamps Adam's second
    moment for hundreds of steps)."""
    s = sigmas.float()
    if scheme == "none":
        return torch.ones_like(s)
    if scheme == "sigma_sqrt":
        return s.clamp(min=SIGMA_SQRT_FLOOR) ** -2.0
    if scheme == "cosmap":
        return 2.0 / (math.pi * (1.0 - 2.0 * s + 2.0 * s**2))
    if scheme == "sigma_sq":
        return s**2
    raise ValueError(f"weighting_scheme {scheme!r} is not one of {', '.join(WEIGHTING_SCHEMES)}")


@functools.lru_cache(maxsize=4)
def loss_table(path: str) -> torch.Tensor:
    """timestep_loss_weights' table, float32 [N] (text_files.read_number_list: the config check read it first)."""
    from library.text_files import read_number_list

    return torch.tensor(read_number_list(path, "timestep_loss_weights table"), dtype=torch.float32)


def table_weights(sigmas: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Per-sample loss weights, float32 [B], from a table of N weights over sigma from 1 down, as ai-toolkit's
    timestep_type "weighted" indexes its 1000 (weight i at sigma (N - i) / N, its timesteps linspace(1000, 1, 1000)):
    each sigma's nearest entry, i = round(N (1 - sigma)) within [0, N - 1]."""
    n = len(table)
    index = torch.round((1.0 - sigmas.double()) * n).long().clamp(0, n - 1)
    return table.to(sigmas.device)[index]


def flow_loss(pred: torch.Tensor, target: torch.Tensor, weighting: torch.Tensor | None = None,
              loss_type: str = "l2", huber_c: float = 0.1, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Scalar float32 loss: per-element loss (times `mask`, pred's shape, where given), mean over all
    non-batch axes, times the per-sample weight, mean over the batch (the weights scale each
    sample, they are not renormalised, as in sd-scripts; a mask's zeros count in the mean, as in
    sd-scripts' apply_masked_loss). huber is sd-scripts' pseudo-Huber 2c (sqrt(r^2 + c^2) - c):
    r^2 for |r| << c, 2c|r| for |r| >> c, computed as 2c r^2 / (sqrt(r^2 + c^2) + c), the same value
    without the cancellation that lost it in float32 for c >> |r| (c = 1e4 logged 0.28 for 2.02)."""
    r = pred.float() - target.float()
    if loss_type == "l2":
        per_element = r**2
    elif loss_type == "huber":
        per_element = 2.0 * huber_c * r**2 / (torch.sqrt(r**2 + huber_c**2) + huber_c)
    else:
        raise ValueError(f"loss_type {loss_type!r} is not one of {', '.join(LOSS_TYPES)}")
    if mask is not None:
        per_element = per_element * mask.float()
    per_sample = per_element.reshape(r.shape[0], -1).mean(dim=1)
    if weighting is not None:
        per_sample = per_sample * weighting.float().to(per_sample.device)
    return per_sample.mean()


# ----------------------------------------------------------------------------------------------
# Inference


def inference_sigmas(steps: int, image_seq_len: int, arch: str, *, dynamic_shift: bool = True,
                     sampling: Sampling | None = None, grid: list[float] | None = None,
                     shift: float | None = None) -> torch.Tensor:
    """The sigma schedule the architecture's diffusers pipeline runs with FlowMatchEulerDiscreteScheduler:
    linspace(1, 1/steps, steps) (or the scheduler's own spacing, sampling.scheduler_spacing), time-shifted with its mu for this token count (and step count,
    where mu depends on it) or its constant shift, stretched to end at its shift_terminal where it has
    one, then a final 0. dynamic_shift=False: no shift (a distilled model whose scheduler has none).
    sampling: a release's own schedule where it differs from the architecture's (the family's
    inference_sampling). grid: the unshifted sigmas a release ships in place of the linspace (its
    pipeline's sample_sigmas; `steps` of them), shifted alike. shift: a fixed shift k in place of the mu
    (a prompt's --fs, musubi-tuner's flow_shift: its scheduler with shift k and dynamic shifting off, the
    terminal stretch kept), on a distilled model too. float32 [steps + 1]."""
    sampling = sampling or sampling_of(arch)
    if grid is not None and len(grid) != steps:
        raise ValueError(f"a sigma grid of {len(grid)} values for {steps} steps")
    # the linspace in float64 math, a grid in float32 as the scheduler takes it; float32 results
    sigmas = np.linspace(1.0, 1.0 / steps, steps) if grid is None else np.array(grid, dtype=np.float32)
    if grid is None and sampling.scheduler_spacing:  # set_timesteps' linspace(sigma_max, sigma_min), its training
        k = shift if shift is not None else sampling.shift  # sigmas' ends: 1 and 1/1000, shifted when it shifts
        last = 1e-3 if k is None else k * 1e-3 / (1.0 + (k - 1.0) * 1e-3)
        sigmas = np.linspace(1.0, last, steps)
    if shift is not None or dynamic_shift:
        if shift is not None:  # the scheduler's own shift set, its dynamic shifting off (musubi-tuner's --fs)
            sigmas = shift * sigmas / (1.0 + (shift - 1.0) * sigmas)
        else:
            mu = resolution_mu(sampling, image_seq_len, steps)
            sigmas = math.exp(mu) / (math.exp(mu) + (1.0 / sigmas - 1.0))
        if sampling.shift_terminal and steps > 1:  # one step: sigma 1, which the stretch turns into 0 / 0
            one_minus = 1.0 - sigmas
            sigmas = 1.0 - one_minus / (one_minus[-1] / (1.0 - sampling.shift_terminal))
    return torch.cat([torch.from_numpy(sigmas).float(), torch.zeros(1)])


def norm_rescaled_cfg(cond: torch.Tensor, uncond: torch.Tensor, guidance: float) -> torch.Tensor:
    """Classifier-free guidance renormalised, as some pipelines run their true CFG (each family says whose, and along
    which axis: a token's channels, a latent row): uncond + g (cond - uncond), rescaled along the last axis to the
    conditional prediction's norm. float32 [..., C] in and out."""
    guided = uncond + guidance * (cond - uncond)
    return guided * (cond.norm(dim=-1, keepdim=True) / guided.norm(dim=-1, keepdim=True))


@torch.no_grad()
def flash_sample(model_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], noise: torch.Tensor,
                 sigmas: torch.Tensor, fresh_noise: Callable[[], torch.Tensor]) -> torch.Tensor:
    """The flash (LCM) scheduler of step-distilled releases: each step the clean latent the velocity gives,
    x0 = x - sigma v, re-noised to the next sigma with fresh noise, x = (1 - s_next) x0 + s_next n (diffusers'
    FlowMatchLCMScheduler.step, ComfyUI's lcm sampler). fresh_noise() -> n ~ N(0, 1) in x's shape (the pipelines
    draw it from the global generator: the method is theirs; the bits where it is given their generator). float32
    between steps."""
    x = noise.float()
    sigmas = sigmas.float().to(x.device)
    for s, s_next in zip(sigmas[:-1], sigmas[1:]):
        x0 = x - s * model_fn(x, s.expand(x.shape[0])).float()
        x = (1 - s_next) * x0 + s_next * fresh_noise().float().to(x.device)
    return x


def euler_sample(model_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], noise: torch.Tensor,
                 sigmas: torch.Tensor) -> torch.Tensor:
    """Integrate from x = noise at sigmas[0] to sigmas[-1] (0: the clean latent).
    model_fn(x float32 [B, ...], sigma float32 [B]) -> velocity (any dtype). The state is kept in
    float32 between steps, so bf16 model outputs do not accumulate rounding."""
    x = noise.float()
    sigmas = sigmas.float().to(x.device)
    for s, s_next in zip(sigmas[:-1], sigmas[1:]):
        v = model_fn(x, s.expand(x.shape[0]))
        x = x + (s_next - s) * v.float()
    return x
