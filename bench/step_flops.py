"""FLOPs of one LoRA training step counted from the shapes, and this machine's matmul peak: the
CPU analogue of MFU (model FLOPs utilisation) used by bench_peers.py.

What is counted (matmul FLOPs only, 2 per multiply-add; norms, RoPE, activations and AdamW are
elementwise and left out, as MFU conventionally does):
- forward: every Linear (2 M K N) and the joint attention (QK^T and PV: 4 B S^2 H D);
- backward through the frozen base for the activation gradient only (2 M K N) where the Linear's
  input needs a gradient (not in the first block before any LoRA has acted, not the modulation
  Linears whose input is the conditioning vector, not the embedders); attention backward 2x its
  forward (dQ, dK, dV, dP);
- LoRA: forward 2 M r (K + N); backward the two weight gradients (2 M r K + 2 M N r), the gradient of
  down(x) (2 M N r) and, where the input needs one, the input gradient (2 M r K);
- gradient checkpointing: each block's forward once more during backward, except the base GEMM of the
  block's last projection into the residual where nothing saves its output (core.residual_projection:
  an untrained gate), which the recompute runs for one token per batch row, or where the forward kept
  it (checkpoint_saves_projections), which the recompute does not run.
Ops whose output never reaches the loss (Qwen-Image's last text stream after attention) have no
backward. `count_step` is checked against torch.utils.flop_counter on the real step
(bench_peers.py --check-flops, tests/test_step_flops.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Mat:
    """One Linear applied to M rows: [M, K] -> [M, N]."""

    M: int
    K: int
    N: int
    lora: bool = False  # carries a LoRA of the network's rank
    grad_in: bool = True  # its input needs a gradient
    backward: bool = True  # its output reaches the loss
    ckpt: bool = False  # inside a checkpointed block (forward recomputed)
    recompute_rows: int | None = None  # rows of the base GEMM recomputed, when not M (core.residual_projection)


@dataclass(frozen=True)
class Attn:
    """Joint attention over S tokens, H heads of width D, batch B."""

    B: int
    S: int
    H: int
    D: int
    ckpt: bool = False


def _mat_flops(m: Mat, rank: int) -> dict[str, float]:
    fwd = 2 * m.M * m.K * m.N + (2 * m.M * rank * (m.K + m.N) if m.lora else 0)
    bwd = 0.0
    if m.backward:
        bwd += 2 * m.M * m.K * m.N if m.grad_in else 0
        if m.lora:
            bwd += 2 * m.M * rank * m.K + 4 * m.M * m.N * rank + (2 * m.M * rank * m.K if m.grad_in else 0)
    rows = m.M if m.recompute_rows is None else m.recompute_rows
    recompute = fwd - 2 * (m.M - rows) * m.K * m.N if m.ckpt else 0.0
    return {"forward": fwd, "backward": bwd, "recompute": recompute}


def _attn_flops(a: Attn) -> dict[str, float]:
    fwd = 4 * a.B * a.H * a.S * a.S * a.D
    return {"forward": fwd, "backward": 2 * fwd, "recompute": fwd if a.ckpt else 0.0}


def count(ops: list, rank: int) -> dict[str, float]:
    total = {"forward": 0.0, "backward": 0.0, "recompute": 0.0}
    for op in ops:
        for k, v in (_mat_flops(op, rank) if isinstance(op, Mat) else _attn_flops(op)).items():
            total[k] += v
    total["total"] = total["forward"] + total["backward"] + total["recompute"]
    return total


def flux_ops(cfg, batch: int, img: int, txt: int, ckpt: bool, modulation_lora: bool = True,
             tail_skipped: bool = False, attention_kept: bool = False) -> list:
    """FLUX.1 (BFL layout) with our default LoRA targets (sd-scripts' lora_flux default): every
    Linear of the double and single blocks, modulation included; embedders and final layer none.
    tail_skipped: the recompute runs no base GEMM for the MLP outputs and linear2 (ours with
    checkpoint_saves_projections: their outputs kept from the forward; by default the trained gates need
    them recomputed in full). torch's non-reentrant checkpoint (ours in a process group) runs them for one
    token, as the recompute of an untrained gate's tail does in both (core.residual_projection).
    attention_kept: the recompute runs no attention (checkpoint_saves_attention)."""
    h, m, B, S = cfg.hidden_size, cfg.mlp_hidden, batch, img + txt
    attn_ckpt = ckpt and not attention_kept
    tail_rows = 0 if tail_skipped else None
    ops = [Mat(B * img, cfg.in_channels, h, grad_in=False), Mat(B * txt, cfg.context_in_dim, h, grad_in=False),
           Mat(B, 256, h, grad_in=False), Mat(B, h, h, grad_in=False),
           Mat(B, cfg.vec_in_dim, h, grad_in=False), Mat(B, h, h, grad_in=False)]
    if cfg.guidance_embed:
        ops += [Mat(B, 256, h, grad_in=False), Mat(B, h, h, grad_in=False)]
    for i in range(cfg.depth):
        for M in (B * img, B * txt):
            ops += [Mat(B, h, 6 * h, modulation_lora, grad_in=False, ckpt=ckpt),
                    # block 0's input is modulated by LoRA'd shift/scale: it needs a gradient too
                    Mat(M, h, 3 * h, True, grad_in=i > 0 or modulation_lora, ckpt=ckpt), Mat(M, h, h, True, ckpt=ckpt),
                    Mat(M, h, m, True, ckpt=ckpt), Mat(M, m, h, True, ckpt=ckpt, recompute_rows=tail_rows)]
        ops.append(Attn(B, S, cfg.num_heads, cfg.head_dim, attn_ckpt))
    for j in range(cfg.depth_single):
        first = cfg.depth == 0 and j == 0
        ops += [Mat(B, h, 3 * h, modulation_lora, grad_in=False, ckpt=ckpt),
                Mat(B * S, h, 3 * h + m, True, grad_in=not first or modulation_lora, ckpt=ckpt), Mat(B * S, h + m, h, True, ckpt=ckpt, recompute_rows=tail_rows),
                Attn(B, S, cfg.num_heads, cfg.head_dim, attn_ckpt)]
    ops += [Mat(B, h, 2 * h, grad_in=False), Mat(B * img, h, cfg.in_channels)]  # final adaLN, linear
    return ops


def qwen_ops(cfg, batch: int, img: int, txt: int, ckpt: bool, tail_skipped: bool = True,
             attention_kept: bool = False) -> list:
    """Qwen-Image with musubi-tuner's default targets: the blocks' attention and MLP Linears.
    tail_skipped: the recompute runs the MLP output's base GEMM for one token (ours; the peers' run it
    in full). attention_kept: the recompute runs no attention (checkpoint_saves_attention)."""
    h, B, S, n = cfg.inner_dim, batch, img + txt, cfg.num_layers
    out = cfg.patch_size**2 * cfg.out_channels
    ops = [Mat(B * img, cfg.in_channels, h, grad_in=False), Mat(B * txt, cfg.joint_attention_dim, h, grad_in=False),
           Mat(B, 256, h, grad_in=False), Mat(B, h, h, grad_in=False)]
    for i in range(n):
        last = i == n - 1
        for M, reaches_loss in ((B * img, True), (B * txt, not last)):
            ops += [Mat(B, h, 6 * h, grad_in=False, backward=False, ckpt=ckpt)]  # img_mod / txt_mod
            ops += [Mat(M, h, h, True, grad_in=i > 0, ckpt=ckpt) for _ in range(3)]  # q, k, v
            ops += [Mat(M, h, h, True, backward=reaches_loss, ckpt=ckpt),  # to_out / to_add_out
                    Mat(M, h, 4 * h, True, backward=reaches_loss, ckpt=ckpt),
                    Mat(M, 4 * h, h, True, backward=reaches_loss, ckpt=ckpt, recompute_rows=B if tail_skipped else None)]
        ops.append(Attn(B, S, cfg.num_attention_heads, cfg.attention_head_dim, ckpt and not attention_kept))
    ops += [Mat(B, h, 2 * h, grad_in=False), Mat(B * img, h, out)]  # norm_out.linear, proj_out
    return ops


def count_step(family: str, cfg, batch: int, img: int, txt: int, rank: int, ckpt: bool,
               tail_skipped: bool | None = None, attention_kept: bool = False) -> dict[str, float]:
    """tail_skipped: whether the recompute runs the blocks' last projections for one token; None: as
    ours does by default (Qwen-Image yes; FLUX.1 only with checkpoint_saves_projections); False: a
    trainer whose recompute runs every GEMM in full (the peers). attention_kept: ours with
    checkpoint_saves_attention (no attention in the recompute)."""
    ops = (flux_ops(cfg, batch, img, txt, ckpt, tail_skipped=bool(tail_skipped), attention_kept=attention_kept)
           if family == "flux" else qwen_ops(cfg, batch, img, txt, ckpt, tail_skipped is not False, attention_kept))
    return count(ops, rank)


def matmul_peak(dtype: torch.dtype, n: int = 4096, reps: int = 3, device: str | torch.device = "cpu") -> float:
    """Best FLOP/s of an n x n x n matmul in `dtype` on `device` (the CPU with torch's threads, or a
    GPU: synchronized around each product): a large GEMM is the most a step's matmuls can reach."""
    device = torch.device(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
    for _ in range(1 if device.type == "cpu" else 5):  # warm (packing buffers, thread pool, clocks)
        torch.mm(a, b)
    sync()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        torch.mm(a, b)
        sync()
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def measured_flops(step) -> float:
    """FLOPs torch.utils.flop_counter sees in one call of step() (matmuls, SDPA), recompute included."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        step()
    return float(counter.get_total_flops())
