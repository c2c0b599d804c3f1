"""A Llama / Mistral / Qwen2 / Qwen3 causal language model built from the shared core (library/models/core.py).

The same class runs Llama-3-8B, Qwen2-style models, the language model of Qwen2.5-VL (a diffusion
text encoder; for text-only prompts its multimodal RoPE reduces to 1-D RoPE) and Qwen3 (no qkv
bias, a per-head RMSNorm on q and k before RoPE, head_dim set by the config rather than
hidden_size / num_heads) and Mistral (the language model of Mistral Small 3.1: Llama-like, explicit
head_dim; Mistral-7B-v0.1's sliding_window on every layer) and Gemma 2 (Gemma-2-2B: GeGLU, four
norms per layer computing x * (1 + w), scaled embeddings, softcapped attention scores and logits, a window on
every other layer); the diffusion families that encode text with them say which. Module names mirror Hugging
Face checkpoints (`model.layers.N.self_attn.q_proj`, ...), so loading is a plain name-for-name copy.

Precision: token ids and position ids are int64; RoPE tables are float32 computed outside
autocast (core.rope_tables; a scaled RoPE's frequencies in float64, llm_rope.py); the residual
stream runs in `compute_dtype`; logits are returned in float32. Attention masks (padding, causal, sliding
window) are boolean, True = attend: SDPA turns a False into -inf on the scores in their own dtype, so no float
mask is rounded to bf16 and a hidden key gets exactly zero weight, as transformers' masks give it.

Gemma 2's softcapped attention cannot run through SDPA (tanh(s / 50) * 50 acts on the scores inside the kernel):
it runs eagerly as transformers' eager_attention_forward does (scores and tanh in the compute dtype, the mask
as -inf, softmax in float32, cast back before the product with v). That is also what the diffusion pipelines that
encode prompts with Gemma 2 compute: transformers 5.23's Gemma2Model sets _supports_sdpa = False ("sdpa does not
support softcapping"; attn_implementation="sdpa" is refused), so a diffusers pipeline (Gemma2Model.from_pretrained,
no attn_implementation) runs eager with the cap; transformers 4.45-4.46 also defaulted Gemma 2 to eager (PR #32865)
for this reason; sd-scripts (Gemma2Model._from_config, transformers 4.54.1) takes that version's default. ComfyUI's
Gemma2 (comfy/text_encoders/llama.py) drops the cap (SDPA at head_dim ** -0.5 = 256 ** -0.5 for Gemma-2-2B, no
window). On a tiny random Gemma 2 text encoder (width 64, weights ~N(0, 0.02), scores far below 50) the cap on vs off moves the hidden_states[-2] of system-prompted captions by 3.8e-6 (5e-7 of their
largest value); on the real model's peaked heads it matters more. The cap is the config's attn_logit_softcapping:
replacing it with 0 gives ComfyUI's numbers.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from library.models import core
from library.models.llm_config import (  # noqa: F401 (re-exported: the config lives there)
    GEMMA2_2B, LLAMA3_8B, LLMConfig, MISTRAL_SMALL_3_1, QWEN2_5_7B, QWEN3_4B, QWEN3_8B, QWEN3_VL_4B, QWEN3_VL_8B,
)
from library.models.llm_spec import FP8 as LLM_FP8
from library.models.spec import TextWeights
from library.precision.fp8_checkpoints import scaled_fp8_converter
from library.io import CheckpointError, CheckpointReader, PrefixedReader, load_streaming, save_safetensors, write_text

# ----------------------------------------------------------------------------------------------
# Attention layouts besides the causal one


@dataclass(frozen=True)
class CausalThenFull:
    """A sequence whose queries attend causally until their row's `full_from`, and to every real key from there on:
    a causal prefix (a prompt) followed by rows that see the whole sequence (tokens generated in parallel). Row b's
    query i sees key j iff key_mask[b, j] and (j <= i or i >= full_from[b]).

    prefix: the first `prefix` positions hold every causal query (full_from[b] <= prefix) and their pads lie after
    their real tokens (right padding), so a real causal query sees only keys of the prefix. full_from: int64 [B].
    first_full: min(full_from) as a Python int (slicing needs it: the caller's one host sync). key_mask:
    bool [B, L] (True: a real key) or None when every key is real.

    attend() runs two passes, exact in arithmetic against the boolean mask `dense()` gives: the prefix's causal
    attention, then the full rows' attention over every real key (without pads a plain non-causal pass: both stay
    eligible for SDPA's flash kernel, which a [B, 1, L, L] mask rules out)."""

    prefix: int
    full_from: torch.Tensor
    first_full: int
    key_mask: torch.Tensor | None = None

    def dense(self, length: int) -> torch.Tensor:
        """The same attention as a boolean mask [B, 1, L, L] (True = attend); a row seeing no key is opened, as
        core.attention_mask opens one."""
        device = self.full_from.device
        index = torch.arange(length, device=device)
        allowed = (index[None, :] <= index[:, None]) | (index[None, :, None] >= self.full_from[:, None, None])
        if self.key_mask is not None:
            allowed = allowed & self.key_mask.bool()[:, None, :]
            allowed = allowed | ~allowed.any(-1, keepdim=True)
        return allowed[:, None]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [B, H, L, Dh], k / v [B, Hkv, L, Dh] -> [B, L, H * Dh]: rows before first_full from the causal pass,
        rows from the prefix on from the full pass, the rows between from the pass their row's full_from says."""
        p, f, keys = self.prefix, self.first_full, self.key_mask
        causal = core.attention(q[:, :, :p], k[:, :, :p], v[:, :, :p], mask=None if keys is None else keys[:, :p],
                                causal=True)  # [B, p, H * Dh]
        full = core.attention(q[:, :, f:], k, v, mask=keys)  # [B, L - f, H * Dh]
        rows = torch.arange(f, p, device=q.device)
        sees_all = (rows[None, :] >= self.full_from[:, None])[..., None]  # [B, p - f, 1]
        between = torch.where(sees_all, full[:, : p - f], causal[:, f:])
        return torch.cat((causal[:, :f], between, full[:, p - f :]), dim=1)


def mrope_tables_per_axis(config: LLMConfig, position_ids: torch.Tensor):
    """M-RoPE's float32 (cos, sin) [B, L, head_dim / 2] of ids [B, L, 3] (int64, or float32 / float64 exact
    integers), equal bit for bit to core.mrope_tables' but computed through core.rope_tables: each axis' table over
    the whole head's frequencies (axes (head_dim,) x 3: the same float64 angles), each frequency then read from its
    axis (core.mrope_axes). So the one function the precision doctor audits sees the positions as they are."""
    c = config
    if len(c.mrope_section) != 3 or position_ids.shape[-1] != 3:
        raise ValueError(f"mrope_tables_per_axis: M-RoPE sections {c.mrope_section} and ids "
                         f"{tuple(position_ids.shape)}: expected 3 sections and 3 position axes")
    cos, sin = core.rope_tables(position_ids, (c.head_dim,) * 3, c.rope_theta)  # [B, L, 3 * head_dim / 2]
    half = c.head_dim // 2
    axis = core.mrope_axes(c.head_dim, c.mrope_section, c.mrope_interleaved, position_ids.device)
    column = axis * half + torch.arange(half, device=position_ids.device)  # frequency j of axis[j]'s table
    return cos[..., column], sin[..., column]


# ----------------------------------------------------------------------------------------------
# Model


class SelfAttention(nn.Module):
    """Causal grouped-query self-attention with half-split (HF) RoPE on q and k (Qwen3: each head
    of q and k RMS-normed over head_dim first, `q_norm` / `k_norm` as in its checkpoints)."""

    def __init__(self, cfg: LLMConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = core.RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = core.RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = nn.Identity()
        self.softcap = cfg.attn_logit_softcapping
        # None: SDPA's own head_dim ** -0.5 (every model but Gemma 2, whose query_pre_attn_scalar sets it)
        self.scale = cfg.attention_scale if cfg.query_pre_attn_scalar else None

    def forward(self, x, cos, sin, mask, visible=None):
        """mask: boolean (True = attend, used as given), a CausalThenFull, or None (causal).
        visible: [B, L, 1] (1: the query sees a key; 0: a left-pad query, whose output is 0 as in
        transformers' SDPA path) or None when nothing is padded."""
        # x: [B, L, D] -> q: [B, H, L, Dh], k/v: [B, Hkv, L, Dh]; q/k norms act on Dh, before RoPE
        q = self.q_norm(self.q_proj(x).unflatten(-1, (self.num_heads, self.head_dim))).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))).transpose(1, 2)
        v = self.v_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim)).transpose(1, 2)
        q = core.apply_rope(q, cos, sin, interleaved=False)
        k = core.apply_rope(k, cos, sin, interleaved=False)
        if isinstance(mask, CausalThenFull):
            out = mask.attend(q, k, v)
        elif self.softcap or self.scale is not None:
            out = softcapped_attention(q, k, v, mask, self.scale or self.head_dim ** -0.5, self.softcap)
        else:
            out = core.attention(q, k, v, mask=mask, causal=True)  # [B, L, H*Dh]
        return self.o_proj(out if visible is None else out * visible)  # -> [B, L, D]


def softcapped_attention(q, k, v, mask, scale: float, softcap: float) -> torch.Tensor:
    """Causal attention with scores softcap * tanh(s / softcap) (0: no cap), as transformers' eager Gemma 2:
    q [B, H, L, Dh], k / v [B, Hkv, L, Dh] in the compute dtype; mask boolean [B or 1, 1, L, L] (True = attend; it
    holds causality) or None (causal only). Scores and tanh in the compute dtype, softmax in float32, the weights
    cast back to it. Returns [B, L, H * Dh]."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # GQA: each kv head's queries
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [B, H, L, L]
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        mask = core.attention_mask(None, q.shape[-2], k.shape[-2], causal=True, device=q.device)
    weights = scores.masked_fill(~mask, float("-inf")).softmax(-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, v).transpose(1, 2).flatten(2)


class GemmaRMSNorm(core.RMSNorm):
    """Gemma's RMSNorm: x * (1 + w), statistics and product in float32, output in x's dtype; the checkpoint
    stores w as the offset from 1 (zeros at init)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__(dim, eps)
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return core.rms_norm(x, 1.0 + self.weight.float(), self.eps)  # 1 + w in float32, as transformers


class GeGLU(core.SwiGLU):
    """down(gelu_tanh(gate(x)) * up(x)): Gemma's MLP (hidden_activation gelu_pytorch_tanh), the same names."""

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x)


class DecoderLayer(nn.Module):
    """x = x + attn(norm(x)); x = x + mlp(norm(x)). Gemma 2 (gemma_norms): the attention's and the MLP's outputs
    are normed again before each add, x = x + post_attention_layernorm(attn(input_layernorm(x))) and
    x = x + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))."""

    def __init__(self, cfg: LLMConfig):
        super().__init__()
        norm = GemmaRMSNorm if cfg.gemma_norms else core.RMSNorm
        self.input_layernorm = norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = SelfAttention(cfg)
        self.post_attention_layernorm = norm(cfg.hidden_size, cfg.rms_norm_eps)
        mlp = GeGLU if cfg.hidden_act == "gelu_pytorch_tanh" else core.SwiGLU
        self.mlp = mlp(cfg.hidden_size, cfg.intermediate_size)
        self.sandwich = cfg.gemma_norms
        if cfg.gemma_norms:
            self.pre_feedforward_layernorm = norm(cfg.hidden_size, cfg.rms_norm_eps)
            self.post_feedforward_layernorm = norm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, mask, visible=None):
        if self.sandwich:
            x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, mask, visible))
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, visible)
        h = self.mlp.hidden(self.post_attention_layernorm(x))
        return x + core.residual_projection(self.mlp.down_proj, h, output_needed=False)  # the add saves nothing


class Decoder(nn.Module):
    """The `model.*` part of a checkpoint: embeddings, decoder layers, final norm."""

    def __init__(self, cfg: LLMConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = (GemmaRMSNorm if cfg.gemma_norms else core.RMSNorm)(cfg.hidden_size, cfg.rms_norm_eps)

    def run_embeddings(self, x: torch.Tensor, position_ids: torch.Tensor, mask, checkpointing=False,
                       swap=None) -> torch.Tensor:
        """The decoder layers on embeddings x [B, L, hidden] (the residual stream's dtype) at M-RoPE ids [B or 1,
        L, 3] (int64; their tables float32 from float64 angles, mrope_tables_per_axis), attending by `mask`: a
        boolean [B or 1, 1, L, L] (True = attend, used as given) or a CausalThenFull. Returns the final norm's
        output [B, L, hidden]. checkpointing / swap: core.run_block's, layer i being block i of the swap."""
        if self.config.attn_logit_softcapping or self.config.query_pre_attn_scalar:
            raise ValueError("Decoder.run_embeddings: softcapped or rescaled attention (Gemma 2) runs causal only")
        cos, sin = mrope_tables_per_axis(self.config, position_ids)
        for i, layer in enumerate(self.layers):
            x = core.run_block(layer, checkpointing, x, cos, sin, mask, swap=swap, index=i)
        return self.norm(x)


def position_ids_from_mask(attention_mask: torch.Tensor | None, seq_len: int, device) -> torch.Tensor:
    """int64 positions: [L] = 0..L-1 without a mask; with a [B, L] mask, each row counts its real
    tokens from 0 (so left padding does not shift positions) and pads get 0, as transformers'
    generate() does: cumsum(mask) - 1, masked to 0."""
    if attention_mask is None:
        return torch.arange(seq_len, device=device)
    mask = attention_mask.bool()
    return (mask.long().cumsum(-1) - 1).masked_fill(~mask, 0)


def position_ids_from_documents(documents: torch.Tensor) -> torch.Tensor:
    """int64 [B, L] positions counted from 0 at each document's first token (documents [B, L]: a document
    index per token, equal within a document), as each document alone would get them."""
    index = torch.arange(documents.shape[-1], device=documents.device).expand_as(documents)
    first = torch.ones_like(documents, dtype=torch.bool)
    first[..., 1:] = documents[..., 1:] != documents[..., :-1]
    return index - torch.where(first, index, 0).cummax(-1).values


class LLM(nn.Module):
    """Causal LM. forward(input_ids [B, L] int64, attention_mask [B, L] (1 = token, 0 = pad)).

    compute_dtype: the residual stream's dtype (embeddings are cast to it at entry).
    gradient_checkpointing: recompute each decoder layer in backward (core.run_block)."""

    def __init__(self, config: LLMConfig):
        super().__init__()
        self.config = config
        self.compute_dtype = torch.float32
        self.gradient_checkpointing = False
        self.model = Decoder(config)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.hidden_states_only = False
        # RoPE's float64 inverse frequencies (scaled RoPE) and float32 cos / sin for positions 0..L-1, per
        # (device, length, config): a plain dict, not buffers, so `.to(dtype)` of the model never casts them.
        self._rope_cache: dict = {}

    def truncate_for_hidden_states(self, keep_layers: int) -> None:
        """Drop what a reader of intermediate hidden states never runs: decoder layers after the
        first `keep_layers` and the lm_head (for Qwen3-8B read at layer 27 of 36: 8 layers and a
        622 M-parameter head). Afterwards only selected_hidden_states works."""
        if not 0 < keep_layers <= self.config.num_layers:
            raise ValueError(f"keep_layers {keep_layers}: expected 1..{self.config.num_layers} (num_layers)")
        del self.model.layers[keep_layers:]
        self.lm_head, self.hidden_states_only = None, True

    def _rope(self, position_ids: torch.Tensor):
        """fp32 (cos, sin) from int64 ids: [L] or [B, L] for 1-D RoPE, [B, L, 3] for M-RoPE."""
        if position_ids.dim() == 3:
            if not self.config.mrope_section:
                raise ValueError("3-axis position ids need an M-RoPE model (config mrope_section, e.g. Qwen2.5-VL)")
            return core.mrope_tables(position_ids, self.config.head_dim, self.config.rope_theta, self.config.mrope_section,
                                     self.config.mrope_interleaved)
        c = self.config
        if c.rope_scaling is None:
            return core.rope_tables(position_ids, (c.head_dim,), c.rope_theta)
        seq_len = int(position_ids.max()) + 1 if c.rope_scaling.rope_type == "dynamic" else 0  # a sync: dynamic only
        device = position_ids.device

        def build():  # float64 [D / 2] on the positions' device (MPS: float32: core.angle_dtype)
            inv_freq, scale = c.rope_scaling.inv_freq(c.head_dim, c.rope_theta, c.max_position_embeddings, seq_len)
            return inv_freq.to(device, core.angle_dtype(device)), scale

        inv_freq, scale = self._cached(("inv_freq", device, seq_len), build)
        return core.rope_tables_from_inv_freq(position_ids, inv_freq, scale)

    def _rope_for_length(self, length: int, device: torch.device):
        """fp32 (cos, sin) [L, D / 2] of positions 0..L-1 (a forward without mask or position ids), built once."""
        return self._cached(("tables", device, length), lambda: self._rope(torch.arange(length, device=device)))

    def _cached(self, key: tuple, build: Callable):
        """build()'s tensors, kept under key and this config. Built outside inference mode (a table made under
        torch.inference_mode could not be saved for a later training backward) and without autograd; at most
        8 entries (lengths of eval and training), then the cache starts over."""
        key = (*key, self.config)
        if key not in self._rope_cache:
            with torch.inference_mode(False), torch.no_grad():
                value = build()
            if len(self._rope_cache) >= 8:
                self._rope_cache.clear()
            self._rope_cache[key] = value
        return self._rope_cache[key]

    def _embed(self, input_ids, attention_mask, position_ids, inputs_embeds=None, documents=None):
        """(embeddings [B, L, D] compute_dtype, cos, sin fp32, each layer's mask (bool or None), visible or
        None) for a forward. inputs_embeds [B, L, D] replaces the token lookup (e.g. image tokens carrying vision
        features). documents [B, L] int64 (packed windows): attention stays within a document and, unless
        position_ids are given, positions restart at 0 at each document's first token."""
        B, L = input_ids.shape
        if position_ids is None and attention_mask is None and documents is None:
            cos, sin = self._rope_for_length(L, input_ids.device)  # fp32, positions 0..L-1
        else:
            if position_ids is None and documents is not None:
                position_ids = position_ids_from_documents(documents)  # int64
            elif position_ids is None:
                position_ids = position_ids_from_mask(attention_mask, L, input_ids.device)  # int64
            cos, sin = self._rope(position_ids)  # fp32
        key_mask = None if attention_mask is None else attention_mask.bool()
        # Built once per forward when there is padding or more than one document; without either, SDPA
        # applies causality itself.
        # A left-pad query sees no key: attention_mask opens its row (no kernel returns NaN) and
        # `visible` zeroes its output in every layer, as transformers does (text encoders whose
        # output keeps the pad rows then match it). Causal and square: query i sees a key iff one
        # of keys 0..i is real.
        mask = visible = None
        if key_mask is not None or documents is not None:
            mask = core.attention_mask(key_mask, L, L, causal=True, device=input_ids.device, documents=documents)
        if key_mask is not None:
            visible = (key_mask.cumsum(-1) > 0)[..., None].to(self.compute_dtype)  # [B, L, 1]
        # The window layers' boolean mask (True = attend): keys i - sliding_window + 1 .. i, where the window hides any
        # key at all (L > sliding_window); a real query always sees itself, so only pad rows are opened.
        window = self.config.sliding_window
        masks = [mask] * self.config.num_layers
        if window and L > window:
            window_mask = core.attention_mask(key_mask, L, L, causal=True, device=input_ids.device, window=window,
                                              documents=documents)
            masks = [window_mask if i in self.config.window_layers else mask for i in range(self.config.num_layers)]
        if inputs_embeds is None:
            inputs_embeds = self.model.embed_tokens(input_ids)
            if self.config.scale_embeddings:  # Gemma: x sqrt(hidden) rounded to the weights' dtype (bf16: 48.0 for
                # 2304), the product in that dtype, as transformers' Gemma2TextScaledWordEmbedding
                scale = torch.tensor(self.config.hidden_size ** 0.5, dtype=inputs_embeds.dtype)
                inputs_embeds = inputs_embeds * scale.to(inputs_embeds.device)
        return inputs_embeds.to(self.compute_dtype), cos, sin, masks, visible

    def _decode(self, input_ids, attention_mask, keep_all: bool, position_ids=None, inputs_embeds=None, documents=None):
        """Run the decoder; returns (final normed hidden [B, L, D], HF-style list or None)."""
        if self.hidden_states_only:
            raise RuntimeError("this LLM was truncated for hidden states (truncate_for_hidden_states): use selected_hidden_states")
        x, cos, sin, masks, visible = self._embed(input_ids, attention_mask, position_ids, inputs_embeds, documents)
        states = [x] if keep_all else None
        for layer, mask in zip(self.model.layers, masks):
            x = core.run_block(layer, self.gradient_checkpointing, x, cos, sin, mask, visible)
            if keep_all:
                states.append(x)
        x = self.model.norm(x)
        if keep_all:  # like transformers: embeddings, each layer's output, the last one after the final norm
            states[-1] = x
        return x, states

    def selected_hidden_states(self, input_ids, attention_mask, indices, position_ids=None,
                               final_norm: bool = True, inputs_embeds=None, deepstack=None) -> list[torch.Tensor]:
        """transformers' `output_hidden_states[k]` for each k in indices (0 = embeddings, k = layer
        k's output, num_layers = the last layer after the final norm; final_norm=False: before it,
        as a pipeline that runs the decoder layers itself taps it), each [B, L, D] compute_dtype.
        Only the layers up to max(indices) run (e.g. 9, 18, 27 of Qwen3's 36).
        position_ids [B, L] or [L] int64: None derives them from the mask (position_ids_from_mask);
        pass torch.arange(L) to match a transformers call that gave none (pads then keep their index).
        inputs_embeds [B, L, D]: replaces the token lookup (image tokens carrying vision features);
        deepstack (Qwen3-VL): (positions bool [B, L], [features [N, D] per layer]): after decoder layer j
        (0-based) the j-th features are added at the N marked positions, as transformers' _deepstack_process;
        the returned state of that layer is its output before the addition, as transformers records it."""
        n, have = self.config.num_layers, len(self.model.layers)
        if not indices or any(not 0 <= k <= have for k in indices):
            raise ValueError(f"selected_hidden_states: indices {list(indices)} must lie in 0..{have} (the layers loaded)")
        x, cos, sin, masks, visible = self._embed(input_ids, attention_mask, position_ids, inputs_embeds)
        where, extra = deepstack if deepstack is not None else (None, [])
        states = {0: x}
        for i, layer in enumerate(self.model.layers[: max(indices)], start=1):
            x = core.run_block(layer, self.gradient_checkpointing, x, cos, sin, masks[i - 1], visible)
            # transformers records a layer's output before its deepstack addition (hidden_states[i] of
            # Qwen3-VL); the next layer gets the sum. A tap of an early layer reads it there.
            states[i] = self.model.norm(x) if i == n and final_norm else x
            if i <= len(extra):
                x = x.index_put((where,), x[where] + extra[i - 1].to(x.dtype))
        return [states[k] for k in indices]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[B, L, D] compute_dtype -> [B, L, V] float32 (Gemma 2: softcapped in float32)."""
        if self.lm_head is None:  # tied: the embedding matrix is the head
            logits = F.linear(hidden, self.model.embed_tokens.weight).float()
        else:
            logits = self.lm_head(hidden).float()
        cap = self.config.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap else logits

    def forward(self, input_ids, attention_mask=None, output_hidden_states: bool = False, position_ids=None,
                documents=None):
        """documents: int64 [B, L] (None: one sequence a row), the document of each token of packed windows:
        each attends only to its own document, its positions counted from that document's start."""
        hidden, states = self._decode(input_ids, attention_mask, output_hidden_states, position_ids, documents=documents)
        logits = self.logits(hidden)
        return (logits, states) if output_hidden_states else logits

    def hidden_states(self, input_ids, attention_mask=None, position_ids=None, inputs_embeds=None) -> torch.Tensor:
        """Last hidden state after the final norm, [B, L, D] in compute_dtype (text-encoder use).
        position_ids: int64 [L] / [B, L], or [B, L, 3] (M-RoPE, with inputs_embeds for image tokens)."""
        return self._decode(input_ids, attention_mask, False, position_ids, inputs_embeds)[0]


def hidden_state_index(index: int, num_layers: int) -> int:
    """transformers' hidden_states[index] (num_layers + 1 entries, 0 = the embeddings) as a non-negative index."""
    resolved = index + num_layers + 1 if index < 0 else index
    if not 0 <= resolved <= num_layers:
        raise ValueError(f"hidden state {index}: a model of {num_layers} layers has hidden states "
                         f"{-num_layers - 1}..{num_layers}")
    return resolved


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# ----------------------------------------------------------------------------------------------
# Loading


# Qwen2.5-VL's vision tower; Mistral3's Pixtral tower and projector, top-level or under `model.`
VISION_PREFIXES = ("visual.", "model.visual.", "vision_tower.", "model.vision_tower.", "multi_modal_projector.",
                   "model.multi_modal_projector.")
# A transformers base model's own save (Qwen3Model, LlamaModel: what save_pretrained writes for a pipeline whose
# text_encoder component is the base class, not the causal LM): the decoder's modules at the top, no `model.`
BASE_MODEL_PREFIXES = ("embed_tokens.", "layers.", "norm.")
# ComfyUI's Gemma 2 single file (gemma_2_2b_fp16.safetensors) carries its sentencepiece tokenizer as a uint8 tensor
# under this key (comfy/sd.py: tokenizer_data["spiece_model"]): not a weight
TOKENIZER_KEY = "spiece_model"


def checkpoint_key_to_llm(key: str, tie_word_embeddings: bool = False) -> str | None:
    """Checkpoint key -> LLM key, or None to skip. Accepts plain HF causal-LM keys and the
    Qwen2.5-VL / Qwen3-VL / Mistral3 layouts (`model.language_model.*` of transformers >= 4.52,
    `language_model.*` of a saved Qwen3VLModel, `language_model.model.*` / `language_model.lm_head.*`
    of LLaVA-style exports and the released Mistral Small 3.1 files) and a saved base model's (`layers.*`);
    vision tower and multimodal projector keys and a stored tokenizer (TOKENIZER_KEY) are skipped (never read)."""
    if key.startswith(VISION_PREFIXES) or key == TOKENIZER_KEY:
        return None
    if key.startswith(BASE_MODEL_PREFIXES):
        return "model." + key
    for old, new in (("model.language_model.", "model."), ("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                     ("language_model.", "model.")):  # the last: Qwen3VLModel's own files (no `model.`, no head)
        if key.startswith(old):
            key = new + key[len(old) :]
            break
    if tie_word_embeddings and key.startswith("lm_head."):
        return None  # tied: the embedding matrix is the head
    return key


# ComfyUI's full checkpoint (comfy/sd.py save_checkpoint, text_encoder_key_prefix "text_encoders."; an "all
# in one" file) holds each text encoder's model under `text_encoders.<its name>.transformer.`
# (text_encoders.gemma2_2b.transformer.model.embed_tokens.weight), beside the diffusion model under
# `model.diffusion_model.` and the VAE under `vae.`; the name's own tensors (logit_scale, spiece_model) are no LM's
BUNDLED_TEXT_ENCODERS = "text_encoders."
BUNDLED_MODEL = ".transformer."


def bundled_llm_prefix(keys: list[str], path: str = "checkpoint") -> str:
    """'' for a language model's own file; for a ComfyUI full checkpoint, the `text_encoders.<name>.transformer.`
    under which the one language model's decoder layers are. A checkpoint bundling several (or none: a T5 / CLIP
    only) is refused, naming them."""
    prefixes = {k[: k.index(BUNDLED_MODEL, len(BUNDLED_TEXT_ENCODERS)) + len(BUNDLED_MODEL)]
                for k in keys if k.startswith(BUNDLED_TEXT_ENCODERS) and BUNDLED_MODEL in k}
    if not prefixes:
        return ""
    decoders = sorted(p for p in prefixes if any(
        k.startswith(p) and (checkpoint_key_to_llm(k[len(p) :]) or "").startswith("model.layers.") for k in keys))
    if len(decoders) != 1:
        found = ", ".join(decoders or sorted(prefixes))
        raise CheckpointError(f"{path}: a checkpoint bundling text encoders ({found}) with "
                              f"{'no' if not decoders else 'more than one'} language model: give the one to load "
                              f"as its own file")
    return decoders[0]


def llm_reader(path: str) -> CheckpointReader | PrefixedReader:
    """The reader of an LLM checkpoint (a file, an index or a folder): its own keys, or those of the language model a
    ComfyUI full checkpoint bundles, named without their prefix (bundled_llm_prefix)."""
    reader = CheckpointReader(path)
    prefix = bundled_llm_prefix(reader.keys(), path)
    return PrefixedReader(reader, prefix) if prefix else reader


def _kept_layer_key(key: str | None, keep_layers: int) -> str | None:
    """None for the tensors of decoder layers >= keep_layers (not loaded), else the key."""
    if key is not None and key.startswith("model.layers."):
        if int(key.split(".", 3)[2]) >= keep_layers:
            return None
    return key


def llm_text_weights(reader: CheckpointReader, keys: list[str]) -> TextWeights:
    """The tensors `keys` of an LLM text encoder's checkpoint (those its loader reads) as load_llm keeps them
    with fp8_prepare(mode, "llm"): under fp8 every 2-D weight of a Linear that the LLM's fp8 rules do not
    keep (the embeddings and the head stay bf16; all others of the LLM core are its decoder Linears)."""
    from library.models.registry import arch_spec
    from library.precision.fp8 import is_high_precision, scale_shape

    rules = arch_spec("llm").fp8
    fp8 = [reader.shape(k) for k in keys if len(reader.shape(k)) == 2 and (name := checkpoint_key_to_llm(k, True))
           and name.endswith(".weight") and not is_high_precision(name.removesuffix(".weight"), rules)]
    scales = [scale_shape(out, inp) for out, inp in fp8]
    return TextWeights(reader.numel(keys), fp8_weights=sum(o * i for o, i in fp8), fp8_scales=sum(o * i for o, i in scales))


def config_json_path(path: str) -> str:
    """The config.json of an LLM given as its folder, its .safetensors or its index (beside the weights)."""
    return os.path.join(path if os.path.isdir(path) else os.path.dirname(path), "config.json")


def _find_config(path: str) -> LLMConfig:
    config_path = config_json_path(path)
    if not os.path.isfile(config_path):
        raise CheckpointError(f"{path}: no config.json beside the checkpoint; pass config=LLMConfig(...)")
    with open(config_path) as f:
        try:
            return LLMConfig.from_hf(json.load(f))
        except ValueError as e:  # from_hf says "config.json: ...": name the file itself
            raise CheckpointError(f"{config_path}: {str(e).removeprefix('config.json: ')}") from None


def load_llm(
    path: str,
    config: LLMConfig | None = None,
    dtype: torch.dtype = torch.float32,
    convert: Callable[[str, torch.Tensor], dict[str, torch.Tensor]] | None = None,
    prepare: Callable[[LLM], None] | None = None,
    keep_layers: int | None = None,
) -> LLM:
    """Build an LLM on `meta` and stream a safetensors checkpoint into it, tensor by tensor.

    path: a .safetensors file, a *.safetensors.index.json, or a folder (config.json is read from
        the folder when config is None). dtype: floating tensors are cast to it on read and it
        becomes model.compute_dtype (float32 / bfloat16 / float16).
    prepare: optional hook run on the meta model before loading; a callable it returns becomes
        the convert hook (library.models.family.fp8_prepare(mode, "llm") swaps Linears for
        FP8Linear and quantizes each weight as it is read).
    keep_layers: load only the first keep_layers decoder layers, no lm_head (their tensors are
        skipped): for text encoders that read intermediate hidden states (LLM.truncate_for_hidden_states).
    A ComfyUI full checkpoint (the diffusion model, the VAE and a text encoder in one file) loads the language
    model it bundles (llm_reader); the other components' tensors are not read.
    ComfyUI's scaled fp8 file (qwen_2.5_vl_7b_fp8_scaled) is never quantized again: `prepare` is not
    run; with one (a quantized base asked for) its Linears keep their codes and per-tensor scales, as
    the llm spec's fp8 rules place them; without, every fp8 weight is dequantized to dtype
    (fp8_checkpoints.scaled_fp8_converter).
    Missing or unexpected keys raise CheckpointError. Returned in eval mode.
    """
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"load_llm: dtype {dtype}: expected float32, bfloat16 or float16 (fp8 goes through convert)")
    config = config or _find_config(path)
    with torch.device("meta"):
        model = LLM(config)
    rename = lambda k: checkpoint_key_to_llm(k, config.tie_word_embeddings)  # noqa: E731
    if keep_layers is not None:
        model.truncate_for_hidden_states(keep_layers)
        rename = lambda k: _kept_layer_key(checkpoint_key_to_llm(k, True), keep_layers)  # noqa: E731
    reader = llm_reader(path)
    stored = scaled_fp8_converter(model, reader, path, LLM_FP8 if prepare is not None else None, dtype, rename)
    hook = stored or (prepare(model) if prepare is not None else None)
    if callable(hook) and not isinstance(hook, nn.Module):  # prepare may return the converter (as for a transformer)
        convert = hook
    load_streaming(model, reader, rename, dtype=dtype, convert=convert)
    model.compute_dtype = dtype
    return model.eval()


SPECIAL_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def special_token_ids(tokenizer=None, source_config: dict | None = None) -> dict:
    """bos/eos/pad token ids for config.json and generation_config.json: the source config.json's
    where it names them (a pretrained model's own choice), else the tokenizer's."""
    ids = {k: getattr(tokenizer, k, None) for k in SPECIAL_TOKEN_IDS}
    ids.update({k: v for k, v in (source_config or {}).items() if k in SPECIAL_TOKEN_IDS and v is not None})
    return ids


def generation_config(ids: dict, source: dict | None = None, stops: Sequence[int] = ()) -> dict:
    """generation_config.json: the base's own (`source`: its eos list and sampling defaults kept), the special
    token ids filling what it lacks; its eos_token_id then lists the base's ids and, after them, `stops` (where
    our sampler stopped: a chat template's end of turn, so generate() ends the reply where the eval sample did)."""
    generation = {**{k: v for k, v in ids.items() if v is not None}, **(source or {})}
    eos = generation.get("eos_token_id")
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    added = [i for i in dict.fromkeys(stops) if i not in eos]
    if added:
        generation["eos_token_id"] = eos + added
    return generation


def save_hf_folder(model: LLM, folder: str, tokenizer=None, dtype: torch.dtype | None = None,
                   metadata: dict | None = None, source_config: dict | None = None,
                   source_generation: dict | None = None, stops: Sequence[int] = ()) -> None:
    """A Hugging Face model folder transformers loads as it loads a downloaded one:
    model.safetensors (cast to `dtype`), config.json with the special token ids (so
    `eos_token_id` survives), generation_config.json (what `generate()` reads to stop at EOS:
    generation_config's) and, given a tokenizer, tokenizer.json + a tokenizer_config.json that
    transformers 4.x and 5.x read alike (library.data.tokenizer.save_tokenizer). Every file is
    written atomically."""
    from library.data.tokenizer import save_tokenizer

    tensors = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v) for k, v in model.state_dict().items()}
    save_safetensors(tensors, os.path.join(folder, "model.safetensors"), {"format": "pt", **(metadata or {})})
    ids = special_token_ids(tokenizer, source_config)
    write_text(os.path.join(folder, "config.json"), json.dumps({**model.config.to_hf(), **ids}, indent=2) + "\n")
    generation = generation_config(ids, source_generation, stops)
    write_text(os.path.join(folder, "generation_config.json"), json.dumps(generation, indent=2) + "\n")
    if tokenizer is not None:
        save_tokenizer(tokenizer, folder)


# ----------------------------------------------------------------------------------------------
# Training and sampling helpers (LLMs-from-scratch style)


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Mean token cross-entropy over the flattened batch x sequence. logits [B, L, V] (any
    float dtype, upcast to float32), targets [B, L] int64. Returns a float32 scalar."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=ignore_index)


def perplexity(loss) -> float:
    """exp(mean cross-entropy), for a float or a scalar tensor."""
    return math.exp(min(float(loss), 700.0))  # 700: keep exp finite for a diverged run


@torch.no_grad()
def generate(
    model: nn.Module,
    idx: torch.Tensor,
    max_new_tokens: int,
    context_size: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    eos_id: int | Sequence[int] | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Extend idx [B, T] int64 by up to max_new_tokens. Each step feeds the last context_size
    tokens, keeps the top_k logits, then samples at `temperature` (greedy when 0) from `generator`
    (None: the global one of idx's device).

    A row that samples eos_id (or one of them, as transformers' generation_config lists several:
    EOS and a chat template's end of turn) is finished and is padded with the first while others
    continue; the loop stops when every row is finished, without appending that final step (so for
    a single sequence eos is never in the output, as in LLMs-from-scratch)."""
    stops = None if eos_id is None else torch.as_tensor(eos_id, dtype=torch.long, device=idx.device).reshape(-1)
    finished = torch.zeros(idx.shape[0], dtype=torch.bool, device=idx.device)
    for _ in range(max_new_tokens):
        logits = model(idx[:, -context_size:])[:, -1, :].float()  # [B, V] float32
        if top_k is not None:  # a k over the vocab keeps every token, as transformers' TopKLogitsWarper
            kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if temperature > 0.0:
            idx_next = torch.multinomial(torch.softmax(logits / temperature, dim=-1), num_samples=1, generator=generator)
        else:
            idx_next = logits.argmax(dim=-1, keepdim=True)
        if stops is not None:
            finished = finished | torch.isin(idx_next[:, 0], stops)
            if finished.all():
                break
            idx_next = idx_next.masked_fill(finished[:, None], stops[0])
        idx = torch.cat([idx, idx_next], dim=1)
    return idx


__all__ = [
    "LLMConfig",
    "QWEN2_5_7B",
    "LLAMA3_8B",
    "QWEN3_4B",
    "QWEN3_8B",
    "MISTRAL_SMALL_3_1",
    "LLM",
    "load_llm",
    "save_hf_folder",
    "checkpoint_key_to_llm",
    "position_ids_from_mask",
    "count_parameters",
    "cross_entropy_loss",
    "perplexity",
    "generate",
]
