"""Ideogram 4's timestep schedule (Ideogram4Pipeline: _logit_normal_sigmas, _resolution_aware_mu).

Inference: sigma_i = expit(mu + std * ndtri(i / N)) for i = N..1 (float64, then float32), each
clamped to the model times allowed by logSNR in [-15, 18], where mu = base_mu + 0.5 ln(H W / 512^2)
(base_mu 0, std 1.5: the pipeline's defaults), 48 steps, guidance 7 for 45 steps then 3.
Training draws sigma from the same law the schedule quantiles: sigma = expit(mu + std * n),
n ~ N(0, 1), at the image's resolution (1024 px: mu = ln 2 = 0.69), clamped alike. No released
training recipe exists; this is the distribution the pipeline samples at.
"""

from __future__ import annotations

import math

import torch

from library.models import flow_matching as fm

BASE_MU, STD, LOGSNR_MIN, LOGSNR_MAX = 0.0, 1.5, -15.0, 18.0
STEPS = 48
GUIDANCE_SCHEDULE = (7.0,) * 45 + (3.0,) * 3


def resolution_mu(height: int, width: int, base_mu: float = BASE_MU) -> float:
    return base_mu + 0.5 * math.log(height * width / (512 * 512))


def _clamp_sigma(sigma: torch.Tensor) -> torch.Tensor:
    t_min = 1.0 / (1.0 + math.exp(0.5 * LOGSNR_MAX))
    t_max = 1.0 / (1.0 + math.exp(0.5 * LOGSNR_MIN))
    return 1.0 - (1.0 - sigma).clamp(t_min, t_max)


def inference_sigmas(steps: int, height: int, width: int, base_mu: float = BASE_MU, std: float = STD) -> torch.Tensor:
    """[steps + 1] float32, decreasing, ending at 0 (the scheduler's terminal zero appended)."""
    s = torch.linspace(0.0, 1.0, steps + 1, dtype=torch.float64)
    t = 1.0 - torch.special.expit(resolution_mu(height, width, base_mu) + std * torch.special.ndtri(s))
    t = t.clamp(1.0 / (1.0 + math.exp(0.5 * LOGSNR_MAX)), 1.0 / (1.0 + math.exp(0.5 * LOGSNR_MIN)))
    sigmas = (1.0 - t).flip(0)[:-1].to(torch.float32)
    return torch.cat([sigmas, sigmas.new_zeros(1)])


def training_sigmas(batch: int, height: int, width: int, generator: torch.Generator | None = None,
                    base_mu: float = BASE_MU, std: float = STD, bias: str = "none",
                    quantiles: torch.Tensor | None = None) -> torch.Tensor:
    """[batch] float32 sigmas drawn from the pipeline's logit-normal law at this resolution (pixels); bias: the
    config's timestep_bias, quantiles: given uniform quantiles (flow_matching.standard_normal)."""
    n = fm.standard_normal(batch, generator, bias, torch.float64, quantiles)
    return _clamp_sigma(torch.special.expit(resolution_mu(height, width, base_mu) + std * n)).to(torch.float32)


def token_mu(image_seq_len: int, steps: int | None = None) -> float:
    """resolution_mu in image tokens (16 x 16 pixels each): 0.5 ln(tokens / 1024); no step dependence."""
    return BASE_MU + 0.5 * math.log(image_seq_len / 1024)
