"""Rectified-flow training objective and Euler sampling for FLUX.1, FLUX.2 and Qwen-Image.

    x_t    = (1 - s) * x0 + s * noise        s = sigma in [0, 1] (1 = pure noise)
    target = noise - x0                       the velocity the transformer predicts
    sample: x_{i+1} = x_i + (s_{i+1} - s_i) * v(x_i, s_i), from s = 1 down to 0

Models receive s itself (Flux.forward / QwenImage.forward take sigma in [0, 1]). Every sigma,
weight and loss here is float32, whatever dtype the model runs in.

The resolution-dependent shift (flux_shift / qwen_shift) is the one the released models'
diffusers schedulers use at inference: mu grows linearly with the image token count and
s' = e^mu / (e^mu + 1/s - 1). Constants per model, from the diffusers pipelines and the models'
scheduler_config.json:
- FLUX.1-dev (diffusers pipeline_flux.calculate_shift defaults = black-forest-labs/FLUX.1-dev
  scheduler_config.json): base_image_seq_len 256, max_image_seq_len 4096, base_shift 0.5,
  max_shift 1.15, no shift_terminal.
- Qwen-Image (Qwen/Qwen-Image scheduler/scheduler_config.json; pipeline_qwenimage.py reads these
  keys from the scheduler config, its own calculate_shift defaults are FLUX's and do not apply):
  base_image_seq_len 256, max_image_seq_len 8192, base_shift 0.5, max_shift 0.9,
  shift_terminal 0.02 (inference schedule only), time_shift_type "exponential".
- FLUX.2 ([klein] and [dev]): the pipelines pass the scheduler (use_dynamic_shifting, exponential)
  mu = compute_empirical_mu(image_seq_len, num_steps) (pipeline_flux2*.py, BFL's flux2 sampling):
  two lines in the token count, fitted at 10 and at 200 steps, interpolated linearly in the step
  count; above 4300 tokens the 200-step line alone. No shift_terminal. Training has no step count:
  flux2_shift uses mu at FLUX2_TRAIN_MU_STEPS (50, the klein base models' default step count; the
  distilled models sample in 4 steps, where mu is higher by at most 0.35 below 4300 tokens).
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch

from library.models.registry import SAMPLING_METHODS  # the names the config schema offers

# Training defaults per family. sd-scripts' FLUX flags default to timestep_sampling "sigma" with
# model_prediction_type "sigma_scaled", while its FLUX.1 docs recommend "shift" 3.1582 with "raw"
# predictions; we default instead to what each released model's scheduler does at inference: the
# resolution-dependent shift with that model's constants, applied to a logit-normal draw
# (sigmoid(randn), scale 1), raw velocity target, no loss weighting, plain L2. FLUX.1-dev gets
# guidance 1.0 during LoRA training (the common choice: the distilled guidance embedding is kept
# near its "no extra guidance" end). `shift` 3.0 is FLUX.1-dev's scheduler "shift", used only
# when timestep_sampling = "shift" is chosen explicitly.
DEFAULTS = {
    "flux": {
        "timestep_sampling": "flux_shift", "sigmoid_scale": 1.0, "shift": 3.0,
        "base_seq_len": 256, "max_seq_len": 4096, "base_shift": 0.5, "max_shift": 1.15,
        "shift_terminal": None, "weighting_scheme": "none", "loss_type": "l2", "huber_c": 0.1,
        "guidance_scale": 1.0,
    },
    "qwen_image": {
        "timestep_sampling": "qwen_shift", "sigmoid_scale": 1.0, "shift": 3.0,
        "base_seq_len": 256, "max_seq_len": 8192, "base_shift": 0.5, "max_shift": 0.9,
        "shift_terminal": 0.02, "weighting_scheme": "none", "loss_type": "l2", "huber_c": 0.1,
        "guidance_scale": None,
    },
    # mu from compute_empirical_mu (the base_* / max_* line constants do not apply); training
    # guidance as FLUX.1-dev's, used by [dev] only ([klein] has no guidance embedding).
    "flux2": {
        "timestep_sampling": "flux2_shift", "sigmoid_scale": 1.0, "shift": 3.0, "empirical_mu": True,
        "shift_terminal": None, "weighting_scheme": "none", "loss_type": "l2", "huber_c": 0.1,
        "guidance_scale": 1.0,
    },
}
_SHIFT_FAMILY = {"flux_shift": "flux", "qwen_shift": "qwen_image", "flux2_shift": "flux2"}
FLUX2_TRAIN_MU_STEPS = 50
WEIGHTING_SCHEMES = ("none", "sigma_sqrt", "cosmap")
LOSS_TYPES = ("l2", "huber")


def calculate_shift(image_seq_len: int, base_seq_len: int, max_seq_len: int, base_shift: float, max_shift: float) -> float:
    """mu on the line through (base_seq_len, base_shift) and (max_seq_len, max_shift); not
    clamped outside it (as diffusers)."""
    m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return image_seq_len * m + (base_shift - m * base_seq_len)


def compute_empirical_mu(image_seq_len: int, num_steps: int) -> float:
    """FLUX.2's mu (diffusers pipeline_flux2.compute_empirical_mu, BFL flux2 sampling.py): the mu
    lines fitted at 10 and 200 steps, interpolated in num_steps; the 200-step line above 4300 tokens."""
    a1, b1 = 8.73809524e-05, 1.89833333  # the 10-step line
    a2, b2 = 0.00016927, 0.45666666  # the 200-step line
    m_200 = a2 * image_seq_len + b2
    if image_seq_len > 4300:
        return float(m_200)
    m_10 = a1 * image_seq_len + b1
    a = (m_200 - m_10) / 190.0
    return float(a * num_steps + (m_200 - 200.0 * a))


def family_mu(family: str, image_seq_len: int, steps: int) -> float:
    """The resolution shift mu of a family's released scheduler for this token count (and, for
    FLUX.2, step count)."""
    d = DEFAULTS[family]
    if d.get("empirical_mu"):
        return compute_empirical_mu(image_seq_len, steps)
    return calculate_shift(image_seq_len, d["base_seq_len"], d["max_seq_len"], d["base_shift"], d["max_shift"])


def time_shift(mu: float, sigmas: torch.Tensor) -> torch.Tensor:
    """s' = e^mu / (e^mu + 1/s - 1), in float32 (s = 0 stays 0, s = 1 stays 1)."""
    s = sigmas.float()
    return math.exp(mu) / (math.exp(mu) + (1.0 / s - 1.0))


# ----------------------------------------------------------------------------------------------
# Training


def sample_sigmas(
    batch: int, method: str, *, generator: torch.Generator | None, shift: float = 3.0,
    sigmoid_scale: float = 1.0, image_seq_len: int | None = None, base_seq_len: int | None = None,
    max_seq_len: int | None = None, base_shift: float | None = None, max_shift: float | None = None,
) -> torch.Tensor:
    """One sigma per sample, float32 [batch] in [0, 1], on the generator's device.

    uniform: U(0, 1]; sigmoid: sigmoid(sigmoid_scale * randn); shift: the sigmoid draw then
    s' = k s / (1 + (k - 1) s) with k = shift; flux_shift / qwen_shift: the sigmoid draw then the
    resolution-dependent time_shift with mu from image_seq_len. The mu constants left None are
    the released model's (DEFAULTS["flux"] for flux_shift, DEFAULTS["qwen_image"] for qwen_shift);
    flux2_shift: mu = compute_empirical_mu(image_seq_len, FLUX2_TRAIN_MU_STEPS) (no line constants)."""
    if method not in SAMPLING_METHODS:
        raise ValueError(f"timestep_sampling {method!r} is not one of {', '.join(SAMPLING_METHODS)}")
    device = generator.device if generator is not None else torch.device("cpu")
    if method == "uniform":  # 1 - U[0, 1): never exactly 0, where sigma_sqrt weighting is infinite
        return 1.0 - torch.rand(batch, generator=generator, device=device, dtype=torch.float32)
    sigmas = torch.sigmoid(sigmoid_scale * torch.randn(batch, generator=generator, device=device, dtype=torch.float32))
    if method == "shift":
        return shift * sigmas / (1.0 + (shift - 1.0) * sigmas)
    if method == "sigmoid":
        return sigmas
    if image_seq_len is None:
        raise ValueError(f"timestep_sampling {method!r} needs image_seq_len (image tokens per sample)")
    if method == "flux2_shift":
        return time_shift(compute_empirical_mu(image_seq_len, FLUX2_TRAIN_MU_STEPS), sigmas)
    d = DEFAULTS[_SHIFT_FAMILY[method]]
    mu = calculate_shift(
        image_seq_len,
        d["base_seq_len"] if base_seq_len is None else base_seq_len,
        d["max_seq_len"] if max_seq_len is None else max_seq_len,
        d["base_shift"] if base_shift is None else base_shift,
        d["max_shift"] if max_shift is None else max_shift,
    )
    return time_shift(mu, sigmas)


def _per_sample(sigmas: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """sigmas [B] as float32 [B, 1, ...] broadcasting over `like`."""
    return sigmas.float().reshape(-1, *([1] * (like.dim() - 1)))


def noisy_input(x0: torch.Tensor, noise: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    """x_t = (1 - s) x0 + s noise. float32 out (x0/noise may be bf16 latents); the model casts
    it to its compute_dtype at entry."""
    s = _per_sample(sigmas, x0)
    return (1.0 - s) * x0.float() + s * noise.float()


def flow_target(x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The velocity d x_t / d s = noise - x0, float32."""
    return noise.float() - x0.float()


def loss_weighting(sigmas: torch.Tensor, scheme: str) -> torch.Tensor:
    """Per-sample weights, float32 [B], as sd-scripts / diffusers compute_loss_weighting_for_sd3:
    none -> 1, sigma_sqrt -> s^-2, cosmap -> 2 / (pi (1 - 2 s + 2 s^2))."""
    s = sigmas.float()
    if scheme == "none":
        return torch.ones_like(s)
    if scheme == "sigma_sqrt":
        return s**-2.0
    if scheme == "cosmap":
        return 2.0 / (math.pi * (1.0 - 2.0 * s + 2.0 * s**2))
    raise ValueError(f"weighting_scheme {scheme!r} is not one of {', '.join(WEIGHTING_SCHEMES)}")


def flow_loss(pred: torch.Tensor, target: torch.Tensor, weighting: torch.Tensor | None = None,
              loss_type: str = "l2", huber_c: float = 0.1, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Scalar float32 loss: per-element loss (times `mask`, pred's shape, where given), mean over all
    non-batch axes, times the per-sample weight, mean over the batch (the weights scale each
    sample, they are not renormalised, as in sd-scripts; a mask's zeros count in the mean, as in
    sd-scripts' apply_masked_loss). huber is sd-scripts' pseudo-Huber 2c (sqrt(r^2 + c^2) - c):
    r^2 for |r| << c, 2c|r| for |r| >> c."""
    r = pred.float() - target.float()
    if loss_type == "l2":
        per_element = r**2
    elif loss_type == "huber":
        per_element = 2.0 * huber_c * (torch.sqrt(r**2 + huber_c**2) - huber_c)
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


def inference_sigmas(steps: int, image_seq_len: int, family: str, *, dynamic_shift: bool = True) -> torch.Tensor:
    """The sigma schedule diffusers' FluxPipeline / QwenImagePipeline / Flux2(Klein)Pipeline run
    with FlowMatchEulerDiscreteScheduler: linspace(1, 1/steps, steps), time-shifted with the
    family's mu for this token count (and step count: FLUX.2), stretched to end at shift_terminal
    (Qwen-Image), then a final 0.
    dynamic_shift=False is FLUX.1-schnell (its scheduler has no shift). float32 [steps + 1]."""
    if family not in DEFAULTS:
        raise ValueError(f"inference_sigmas: family {family!r} is not one of {', '.join(DEFAULTS)}")
    d = DEFAULTS[family]
    sigmas = np.linspace(1.0, 1.0 / steps, steps)  # float64 math, float32 result
    if dynamic_shift:
        mu = family_mu(family, image_seq_len, steps)
        sigmas = math.exp(mu) / (math.exp(mu) + (1.0 / sigmas - 1.0))
        if d["shift_terminal"]:
            one_minus = 1.0 - sigmas
            sigmas = 1.0 - one_minus / (one_minus[-1] / (1.0 - d["shift_terminal"]))
    return torch.cat([torch.from_numpy(sigmas).float(), torch.zeros(1)])


@torch.no_grad()
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
