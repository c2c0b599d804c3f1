"""bench/step_flops.py's FLOP count from shapes against torch.utils.flop_counter on the real step.

The counter sees every matmul the step runs (forward, backward, checkpoint recompute) but not the
CPU SDPA kernel, so the attention term is left out of the comparison. A wrong rule (an input
gradient counted where none is computed, a missing recompute) changes the count and fails here."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

from step_flops import Attn, _attn_flops, count_step, flux_ops, measured_flops, qwen_ops  # noqa: E402

from library.models import core  # noqa: E402
from library.models.flux1.family import FluxFamily  # noqa: E402
from library.models.flux1.model import Flux, FluxConfig  # noqa: E402
from library.models.qwen_image.family import QwenImageFamily  # noqa: E402
from library.models.qwen_image.model import QwenImage, QwenImageConfig  # noqa: E402
from networks.lora import LoRANetwork  # noqa: E402

L, T, RANK = 16, 4, 4  # 4 x 4 image patches, 4 text tokens


def _model(family: str, blocks: tuple[int, int]):
    torch.manual_seed(0)
    if family == "flux":
        return Flux(FluxConfig(in_channels=64, vec_in_dim=16, context_in_dim=32, hidden_size=64, num_heads=2,
                               depth=blocks[0], depth_single=blocks[1], axes_dim=(4, 14, 14), guidance_embed=True))
    return QwenImage(QwenImageConfig(num_layers=blocks[0], attention_head_dim=32, num_attention_heads=2,
                                     joint_attention_dim=32, axes_dims_rope=(8, 12, 12)))


def _step(family: str, model):
    g = torch.Generator().manual_seed(1)
    ctx = model.config.context_in_dim if family == "flux" else model.config.joint_attention_dim
    x_t, txt, sigma = torch.randn(1, L, 64, generator=g), torch.randn(1, T, ctx, generator=g), torch.tensor([0.5])
    if family == "flux":
        text = {"t5": txt, "clip_pooled": torch.randn(1, 16, generator=g)}
        predict = FluxFamily("unused").predict
    else:
        text = {"embeds": txt, "mask": torch.ones(1, T, dtype=torch.bool)}
        predict = QwenImageFamily("unused").predict
    network = LoRANetwork(model, family, RANK, alpha=RANK)
    network.apply()
    params = network.trainable_parameters()

    def step():
        for p in params:
            p.grad = None
        predict(model, x_t, sigma, text, 4, 4, 1.0).float().square().mean().backward()

    return step


@pytest.mark.parametrize("family,blocks,checkpointing", [
    (family, blocks, checkpointing)
    for family, blocks in (("flux", (2, 2)), ("flux", (0, 1)), ("qwen_image", (2, 0)))
    for checkpointing in (False, True) + ((core.SAVE_PROJECTIONS,) if family == "flux" else ())  # FLUX.1's gates train
])
def test_count_matches_torch_flop_counter(family, blocks, checkpointing):
    model = _model(family, blocks).requires_grad_(False)
    model.gradient_checkpointing = checkpointing
    step = _step(family, model)
    step()  # warm
    ckpt, saved = bool(checkpointing), checkpointing == core.SAVE_PROJECTIONS
    ops = flux_ops(model.config, 1, L, T, ckpt) if family == "flux" else qwen_ops(model.config, 1, L, T, ckpt)
    attention = sum(sum(_attn_flops(op).values()) for op in ops if isinstance(op, Attn))
    counted = count_step(family, model.config, 1, L, T, RANK, ckpt, tail_skipped=saved or None)
    assert counted["total"] - attention == measured_flops(step)
    assert (counted["recompute"] > 0) == ckpt


def test_attention_and_lora_terms_by_hand():
    # One 2-row Linear 3 -> 5 with a rank-1 LoRA and input gradient: 2*2*3*5 forward + same backward,
    # LoRA 2*2*1*(3+5) forward, backward 2*2*1*3 (down grad) + 4*2*5*1 (up grad, d lx) + 2*2*1*3 (dx).
    from step_flops import Mat, count

    assert count([Mat(2, 3, 5, lora=True)], 1)["total"] == 60 + 60 + 32 + 12 + 40 + 12
    # QK^T and PV: 2 * (2 * B H S S D) = 4 * 1 * 2 * 4 * 4 * 8; backward twice that; recompute once more.
    assert count([Attn(1, 4, 2, 8, ckpt=True)], 1) == {"forward": 1024, "backward": 2048, "recompute": 1024,
                                                        "total": 4096}


@pytest.mark.parametrize("family,blocks", [("flux", (2, 2)), ("qwen_image", (2, 0))])
def test_kept_attention_leaves_the_recompute_only(family, blocks):
    """checkpoint_saves_attention: the count drops each block's attention forward from the recompute, and
    nothing else."""
    cfg = _model(family, blocks).config
    ops = flux_ops(cfg, 1, L, T, True) if family == "flux" else qwen_ops(cfg, 1, L, T, True)
    attention = sum(_attn_flops(op)["forward"] for op in ops if isinstance(op, Attn))
    plain, kept = (count_step(family, cfg, 1, L, T, RANK, True, attention_kept=k) for k in (False, True))
    assert attention > 0 and plain["recompute"] - kept["recompute"] == attention
    assert (plain["forward"], plain["backward"]) == (kept["forward"], kept["backward"])
