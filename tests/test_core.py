"""The shared core (library/models/core.py): RoPE precision, attention masking, norms, rotation layouts
and the timestep embedding, each checked against a float64 reference or the diffusers /
transformers function it replaces."""

import math

import pytest
import torch
import torch.nn as nn

from library.models import core

FLUX_AXES = (16, 56, 56)
FLUX_THETA = 10000.0


def flux_img_ids(h: int, w: int) -> torch.Tensor:
    """int64 [h*w, 3] ids as FLUX builds them: (0, row, col)."""
    ids = torch.zeros(h, w, 3, dtype=torch.long)
    ids[..., 1] = torch.arange(h)[:, None]
    ids[..., 2] = torch.arange(w)[None, :]
    return ids.reshape(h * w, 3)


def rope_reference_f64(ids: torch.Tensor, axes, theta):
    """cos/sin [L, sum(axes)/2] in float64, written out independently of core.rope_tables."""
    angles = []
    for i, dim in enumerate(axes):
        inv_freq = torch.tensor([theta ** (-2.0 * j / dim) for j in range(dim // 2)], dtype=torch.float64)
        angles.append(ids[:, i : i + 1].double() * inv_freq[None])
    angles = torch.cat(angles, dim=-1)
    return angles.cos(), angles.sin()


class TinyCoreModule(nn.Module):
    """A core-built module whose forward computes RoPE tables from its position ids."""

    def __init__(self):
        super().__init__()
        self.norm = core.RMSNorm(8)
        self.proj = nn.Linear(8, 8)

    def forward(self, ids):
        return core.rope_tables(ids, FLUX_AXES, FLUX_THETA)


# ----------------------------------------------------------------------------------------------
# (a) RoPE precision


def test_rope_tables_independent_of_param_dtype_and_autocast_at_128x128_grid():
    ids = flux_img_ids(128, 128)  # positions 0..127 on both spatial axes
    tables = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float8_e4m3fn):
        module = TinyCoreModule().to(dtype)
        assert module.proj.weight.dtype == dtype
        with torch.autocast("cpu", dtype=torch.bfloat16):
            tables[dtype] = module(ids)
    cos32, sin32 = tables[torch.float32]
    assert cos32.dtype == torch.float32 and cos32.shape == (128 * 128, sum(FLUX_AXES) // 2)
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        assert torch.equal(tables[dtype][0], cos32) and torch.equal(tables[dtype][1], sin32), dtype
    cos64, sin64 = rope_reference_f64(ids, FLUX_AXES, FLUX_THETA)
    assert (cos32.double() - cos64).abs().max().item() <= 1e-6
    assert (sin32.double() - sin64).abs().max().item() <= 1e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn])
def test_rope_tables_refuse_low_precision_positions(dtype):
    ids = flux_img_ids(4, 4).float().to(dtype)
    with pytest.raises(TypeError, match="RoPE positions"):
        core.rope_tables(ids, FLUX_AXES, FLUX_THETA)


def test_low_precision_positions_collapse_distinct_values():
    # Why positions must never be cast with the model: bf16 keeps integers exactly only to 256,
    # float8_e4m3fn only to 16.
    low = torch.arange(0, 256).to(torch.bfloat16).unique().numel()
    high = torch.arange(256, 512).to(torch.bfloat16).unique().numel()
    fp8 = torch.arange(0, 64).float().to(torch.float8_e4m3fn).float().unique().numel()
    assert (low, high, fp8) == (256, 129, 33)
    # and the damage reaches the tables: position 300 in bf16 lands on 300 or 302's angle
    exact = core.rope_tables(torch.tensor([301]), (128,), 10000.0)[0]
    rounded = core.rope_tables(torch.tensor([301]).to(torch.bfloat16).float(), (128,), 10000.0)[0]
    assert (exact - rounded).abs().max().item() > 0.5


# ----------------------------------------------------------------------------------------------
# (b) attention


def attention_reference_f64(q, k, v, key_mask):
    """Causal + key-padding + GQA attention in float64 by hand: [B, Lq, H*D]."""
    B, H, L, D = q.shape
    rep = H // k.shape[1]
    k, v = k.double().repeat_interleave(rep, dim=1), v.double().repeat_interleave(rep, dim=1)
    scores = q.double() @ k.transpose(-1, -2) / math.sqrt(D)
    allowed = torch.ones(L, L, dtype=torch.bool).tril()[None, None] & key_mask[:, None, None, :]
    scores = scores.masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    return (weights @ v).transpose(1, 2).flatten(2)


def test_attention_causal_padding_gqa_matches_float64_reference():
    B, H, Hkv, L, D = 3, 4, 2, 7, 16
    q, k, v = torch.randn(B, H, L, D), torch.randn(B, Hkv, L, D), torch.randn(B, Hkv, L, D)
    key_mask = torch.ones(B, L, dtype=torch.bool)
    key_mask[1, :3] = False  # left padding
    key_mask[2, -2:] = False  # right padding
    out = core.attention(q, k, v, mask=key_mask, causal=True)
    assert out.shape == (B, L, H * D)
    assert not torch.isnan(out).any()
    ref = attention_reference_f64(q, k, v, key_mask)
    valid = key_mask  # padded query rows are don't-care
    assert (out.double() - ref)[valid].abs().max().item() <= 1e-5
    # The precomputed 4-D mask (what the LLM builds once per forward) gives the same result.
    full = core.attention_mask(key_mask, L, L, causal=True, device=q.device)
    assert torch.equal(core.attention(q, k, v, mask=full), out)


# ----------------------------------------------------------------------------------------------
# (c) norms, rotation layouts, timestep embedding


def test_rms_norm_bf16_input_matches_float64_reference():
    x = (3.0 + 2.0 * torch.randn(4, 3072)).to(torch.bfloat16)
    w = (1.0 + 0.1 * torch.randn(3072)).to(torch.bfloat16)
    out = core.rms_norm(x, w, 1e-6)
    x64 = x.double()
    ref = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    assert out.dtype == torch.bfloat16
    assert ((out.double() - ref).abs() / ref.abs()).max().item() <= 2**-8  # one bf16 rounding
    out32 = core.RMSNorm(3072)(x.float())
    ref32 = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert (out32.double() - ref32).abs().max().item() <= 1e-5


@pytest.mark.parametrize("offset", [5.0, 200.0])  # at 200 a bf16 mean would be off by up to 0.5
def test_layer_norm_no_affine_bf16_input_matches_float64_reference(offset):
    """bf16 in, bf16 out (also under autocast), statistics and gradients as float32 math gives them."""
    x = (offset + 3.0 * torch.randn(4, 3072)).to(torch.bfloat16).requires_grad_(True)
    grad = torch.randn(4, 3072, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = core.LayerNormNoAffine(3072)(x)
    out.backward(grad)
    x64 = x.detach().double().requires_grad_(True)
    ref = (x64 - x64.mean(-1, keepdim=True)) / torch.sqrt(x64.var(-1, unbiased=False, keepdim=True) + 1e-6)
    ref.backward(grad.double())
    assert out.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16
    assert (out.double() - ref).abs().max().item() <= 2**-8 * ref.abs().max().item()
    assert (x.grad.double() - x64.grad).abs().max().item() <= 2**-7 * x64.grad.abs().max().item()
    out32 = core.LayerNormNoAffine(3072)(x.float())
    assert (out32.double() - ref).abs().max().item() <= 1e-5


def test_apply_rope_interleaved_equals_diffusers_apply_rotary_emb():
    from diffusers.models.embeddings import apply_rotary_emb

    x = torch.randn(2, 3, 20, 128)
    cos, sin = core.rope_tables(flux_img_ids(4, 5), FLUX_AXES, FLUX_THETA)  # [20, 64] fp32
    ours = core.apply_rope(x, cos, sin, interleaved=True)
    theirs = apply_rotary_emb(x, (cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)), use_real=True, use_real_unbind_dim=-1)
    assert (ours - theirs).abs().max().item() == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_rope_complex_multiply_equals_the_real_rotation(monkeypatch, dtype):
    """Eager interleaved RoPE is one complex64 multiply; under torch.compile (no complex codegen) it is
    the real formula. Both must give the same bits, forward and backward, in float32 and bf16."""
    x = torch.randn(2, 3, 20, 128, dtype=dtype)
    cos, sin = core.rope_tables(torch.stack([flux_img_ids(4, 5)] * 2), FLUX_AXES, FLUX_THETA)  # [2, 20, 64]
    grad = torch.randn_like(x)
    results = []
    for compiling in (False, True):
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda c=compiling: c)
        assert core._complex_rotation(x.float()) is not compiling
        xg = x.clone().requires_grad_(True)
        out = core.apply_rope(xg, cos, sin, interleaved=True)
        out.backward(grad)
        assert out.dtype == dtype
        results.append((out, xg.grad))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    odd = torch.randn(2, 3, 20, 129)[..., 1:]  # odd strides: view_as_complex cannot take it, the real path does
    assert not core._complex_rotation(odd) and torch.equal(
        core.apply_rope(odd, cos, sin), core.apply_rope(odd.contiguous(), cos, sin))


def test_apply_rope_halves_equals_transformers_apply_rotary_pos_emb():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    q, k = torch.randn(2, 4, 11, 32), torch.randn(2, 2, 11, 32)
    positions = torch.arange(11)[None].repeat(2, 1) + torch.tensor([[0], [5]])
    cos, sin = core.rope_tables(positions, (32,), 1e6)  # [2, 11, 16] fp32
    q_ref, k_ref = apply_rotary_pos_emb(q, k, torch.cat([cos, cos], -1), torch.cat([sin, sin], -1))
    assert (core.apply_rope(q, cos, sin, interleaved=False) - q_ref).abs().max().item() == 0.0
    assert (core.apply_rope(k, cos, sin, interleaved=False) - k_ref).abs().max().item() == 0.0


def test_timestep_embedding_matches_diffusers_get_timestep_embedding():
    from diffusers.models.embeddings import get_timestep_embedding

    sigmas = torch.tensor([0.0, 0.001, 0.25, 0.5, 0.999, 1.0])
    ours = core.timestep_embedding(sigmas, 256)
    theirs = get_timestep_embedding(1000.0 * sigmas, 256, flip_sin_to_cos=True, downscale_freq_shift=0)
    assert ours.dtype == torch.float32
    assert (ours - theirs).abs().max().item() <= 1e-6
