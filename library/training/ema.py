"""Exponential moving average (EMA) of the trained tensors, kept in float32.

After every optimizer step s (1-based; micro-batches of an accumulated step do not count):

    s <= ema_start_step:  ema = w                                   (the EMA follows the raw weights)
    s >  ema_start_step:  ema = d_t * ema + (1 - d_t) * w,   t = s - ema_start_step - 1
                          d_t = ema_decay, or with ema_warmup
                          d_t = min(ema_decay, 1 - (1 + t / ema_inv_gamma) ** -ema_power)

The warmup is diffusers' EMAModel(use_ema_warmup=True, inv_gamma, power, update_after_step =
ema_start_step), the same numbers step for step: d_0 = 0, so the first update after the start copies
the weights; with the defaults (1, 2/3) d reaches 0.9 at t = 31, 0.99 at t = 999, 0.999 at t = 31622
(power 3/4: 0.999 at t = 9999). Not diffusers' other ramp, min(decay, (1 + t) / (10 + t)), which it
applies when use_ema_warmup is off: without ema_warmup the decay here is ema_decay throughout.

The EMA starts from the weights the run starts with (the initial LoRA, or network_weights). Every
process updates its own copy from the same post-step weights (DDP keeps them equal), so all ranks
hold the same EMA. A step that fp16's grad scaler skips (inf/NaN gradients: the weights did not
change) is no update (train_lora.py); t still counts it, as it counts in the step numbers.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn


def ema_decay_at(decay: float, t: int, warmup: bool, inv_gamma: float = 1.0, power: float = 2 / 3) -> float:
    """Decay of the t-th averaged update (t = 0 for the first); the warmup's is 0 at t = 0."""
    return min(decay, 1 - (1 + t / inv_gamma) ** -power) if warmup else decay


class TrainableEMA:
    """float32 shadows of a task's trainable tensors, by the names of named_trainable_parameters()."""

    def __init__(self, params: dict[str, nn.Parameter], decay: float, warmup: bool = False, start_step: int = 0,
                 device: str = "same", inv_gamma: float = 1.0, power: float = 2 / 3):
        self.params, self.decay, self.warmup, self.start_step = params, decay, warmup, start_step
        self.inv_gamma, self.power = inv_gamma, power
        # float32 whatever the LoRA dtype: a 0.999 average of bf16 weights would round every update away.
        self.shadow = {n: p.detach().to(torch.device("cpu") if device == "cpu" else p.device, torch.float32, copy=True)
                       for n, p in params.items()}

    def decay_at_step(self, step: int) -> float:
        """The decay applied after optimizer step `step` (0 = the EMA is set to the weights)."""
        if step <= self.start_step:
            return 0.0
        return ema_decay_at(self.decay, step - self.start_step - 1, self.warmup, self.inv_gamma, self.power)

    @torch.no_grad()
    def update(self, step: int):
        """After optimizer step `step` (1-based): ema = d * ema + (1 - d) * w."""
        shadows = list(self.shadow.values())
        weights = [p.detach().to(s.device, torch.float32) for p, s in zip(self.params.values(), shadows)]
        decay = self.decay_at_step(step)
        if decay == 0.0:
            torch._foreach_copy_(shadows, weights)
        else:  # one fused kernel over all tensors: ema + (1 - d) * (w - ema)
            torch._foreach_lerp_(shadows, weights, 1.0 - decay)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """For the training state (resume), on the CPU."""
        return {n: s.detach().cpu() for n, s in self.shadow.items()}

    @torch.no_grad()
    def load_state_tensors(self, tensors: dict[str, torch.Tensor], where: str):
        missing = sorted(set(self.shadow) - set(tensors))
        if missing:
            raise ValueError(f"{where}: the EMA in the state has no tensor '{missing[0]}' ({len(missing)} missing); "
                             f"was it written with other network settings?")
        for n, s in self.shadow.items():
            if tensors[n].shape != s.shape:
                raise ValueError(f"{where}: EMA tensor '{n}' has shape {tuple(tensors[n].shape)}, expected {tuple(s.shape)}")
            s.copy_(tensors[n])

    @contextlib.contextmanager
    def swapped_in(self):
        """The EMA copied into the live parameters (saving, samples), the raw weights restored
        bit for bit afterwards (a copy of the same dtype is exact)."""
        raw = {n: p.detach().clone() for n, p in self.params.items()}
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(self.shadow[n])  # float32 -> the parameter's dtype
        try:
            yield
        finally:
            with torch.no_grad():
                for n, p in self.params.items():
                    p.copy_(raw[n])
