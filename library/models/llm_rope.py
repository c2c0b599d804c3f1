"""Scaled RoPE of Llama / Qwen configs: config.json's `rope_scaling` (transformers 4.x) or `rope_parameters`
(5.x) with rope_type linear, dynamic, yarn or llama3 (Llama-3.1 / 3.2 / 3.3), as transformers'
modeling_rope_utils computes them. Each turns the plain inverse frequencies theta ** (-2j / head_dim)
into others; yarn also scales cos and sin by an attention factor.

Precision: the frequencies are float64 (core.rope_tables_from_inv_freq casts them to the angle dtype of
the positions' device, outside autocast); they are never parameters or buffers, so no `.to(dtype)` of
the model touches them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SCALED_TYPES = ("linear", "dynamic", "yarn", "llama3")
PLAIN_TYPES = ("default", "mrope")  # mrope: 1-D RoPE for text, 3-axis for image tokens
REQUIRED = {"linear": ("factor",), "dynamic": ("factor",), "yarn": (), "llama3": ("factor", "low_freq_factor", "high_freq_factor")}
UNSUPPORTED_KEYS = ("mscale", "mscale_all_dim")  # DeepSeek's yarn attention factor


@dataclass(frozen=True)
class RopeScaling:
    """One scaled RoPE. factor: how far the context was stretched (0: yarn's max_position_embeddings /
    original_max_position_embeddings). original_max_position_embeddings: the pretraining context (llama3,
    yarn). low_freq_factor, high_freq_factor: llama3's band edges. beta_fast, beta_slow, attention_factor
    (None: 0.1 ln(factor) + 1), truncate: yarn's ramp and cos/sin scale."""

    rope_type: str
    factor: float = 0.0
    original_max_position_embeddings: int = 0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    truncate: bool = True

    @classmethod
    def from_hf(cls, config: dict, key: str) -> "RopeScaling | None":
        """From a config.json dict whose `key` (rope_scaling / rope_parameters) holds the RoPE settings;
        None for plain RoPE. Refuses, naming config.json and the key, what transformers would compute
        differently from what is read here."""
        rope = config.get(key) or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type in PLAIN_TYPES:
            return None
        if rope_type not in SCALED_TYPES:
            raise ValueError(f"config.json: {key} rope_type '{rope_type}' is not supported "
                             f"(expected {', '.join(PLAIN_TYPES + SCALED_TYPES)})")
        missing = [k for k in REQUIRED[rope_type] if rope.get(k) is None]
        other = [k for k in UNSUPPORTED_KEYS if rope.get(k) is not None]
        if missing or other:
            what = f"needs {', '.join(missing)}" if missing else f"with {', '.join(other)} is not supported"
            raise ValueError(f"config.json: {key} rope_type '{rope_type}' {what}")
        # transformers: a top-level original_max_position_embeddings (Phi-3 style) first, then the key's, then the context
        original = config.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings")
        fields = {k: rope[k] for k in ("low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "attention_factor",
                                       "truncate") if rope.get(k) is not None}
        return cls(rope_type, float(rope.get("factor") or 0.0), int(original or config.get("max_position_embeddings", 0)),
                   **fields)

    def context_length(self) -> int:
        """The context this scaling stretches the pretraining one to: factor x original_max_position_embeddings
        for yarn (Qwen's model cards add yarn to a config.json and leave max_position_embeddings as it was),
        0 where the config's max_position_embeddings says it."""
        return int(self.factor * self.original_max_position_embeddings) if self.rope_type == "yarn" else 0

    def to_hf(self) -> dict:
        """The `rope_scaling` dict of a config.json that from_hf (and transformers) read back."""
        out = {"rope_type": self.rope_type, "factor": self.factor}
        if self.rope_type == "llama3":
            out.update(low_freq_factor=self.low_freq_factor, high_freq_factor=self.high_freq_factor)
        if self.rope_type in ("llama3", "yarn"):
            out["original_max_position_embeddings"] = self.original_max_position_embeddings
        if self.rope_type == "yarn":
            out.update(beta_fast=self.beta_fast, beta_slow=self.beta_slow, truncate=self.truncate,
                       **({"attention_factor": self.attention_factor} if self.attention_factor is not None else {}))
        return out

    def inv_freq(self, head_dim: int, theta: float, max_position_embeddings: int, seq_len: int) -> tuple[torch.Tensor, float]:
        """(inverse frequencies float64 [head_dim / 2], cos/sin scale). seq_len: the largest position + 1 of
        this forward (dynamic NTK only: it stretches theta once seq_len passes max_position_embeddings)."""
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
        if self.rope_type == "dynamic":
            seq_len = max(seq_len, max_position_embeddings)
            theta = theta * (self.factor * seq_len / max_position_embeddings - (self.factor - 1)) ** (head_dim / (head_dim - 2))
        inv_freq = 1.0 / theta**exponents
        if self.rope_type == "linear":
            return inv_freq / self.factor, 1.0
        if self.rope_type == "llama3":
            return self._llama3(inv_freq), 1.0
        if self.rope_type == "yarn":
            return self._yarn(inv_freq, head_dim, theta, max_position_embeddings)
        return inv_freq, 1.0

    def _llama3(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """Wavelengths under original / high_freq_factor kept, over original / low_freq_factor divided by
        factor, the band between blended linearly in original / wavelength."""
        wavelen = 2 * math.pi / inv_freq
        context = self.original_max_position_embeddings
        smooth = (context / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        blended = (1 - smooth) * inv_freq / self.factor + smooth * inv_freq
        scaled = torch.where(wavelen > context / self.low_freq_factor, inv_freq / self.factor, blended)
        return torch.where(wavelen < context / self.high_freq_factor, inv_freq, scaled)

    def _yarn(self, inv_freq: torch.Tensor, head_dim: int, theta: float, max_position_embeddings: int):
        """YaRN: frequency j interpolated (divided by factor) below the correction range, kept above it,
        a linear ramp across it; cos and sin scaled by the attention factor."""
        context = self.original_max_position_embeddings
        factor = self.factor or max_position_embeddings / context

        def dim_of(rotations):  # the frequency index that turns `rotations` times over the original context
            return head_dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = dim_of(self.beta_fast), dim_of(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / ((high - low) or 0.001)).clamp(0, 1)
        scale = self.attention_factor if self.attention_factor is not None else (
            0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)
        return inv_freq / factor * ramp + inv_freq * (1 - ramp), float(scale)
