"""Precision measurements: where a low-precision run of a model departs from its reference, and why.

Used by tools/precision_doctor.py; every function takes in-memory models and tensors, so tests can
run it on tiny models. The three kinds of fp8 damage it tells apart (shared/DESIGN.md, "Precision"):

- positions / RoPE tables rounded to a low-precision dtype: e4m3 holds integers exactly only up to
  16, bf16 up to 256. The error then sits where positions are large: the borders of a grid
  centred on 0, the high-index (right / bottom) side of a grid that starts at 0. The per-token error map is
  uneven: border-band / centre or max / min region ratio far above 1.
- weight quantization (plain fp8 cast much more than fp8_scaled): the error map is flat (ratios ~1).
- LoRA deltas merged into fp8 weights: round-to-nearest drops the deltas smaller than half an fp8
  step; measured per module as the fraction of the delta the merged weights keep.

All measurements are float32/float64 on copies; models run under torch.no_grad().
"""

from __future__ import annotations

import contextlib
import gc
import math
import re
import sys
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn

from library.models import core
from library.precision.fp8 import FP8_DTYPE, FP8_MAX, FP8Linear, dequantize_weight, quantize_weight, stochastic_round_to_fp8

# A name segment (between dots / underscores) that names positions or RoPE: "pos" inside "postnorm" is not one.
POSITION_NAME = re.compile(r"(?:^|[._])(?:freqs?|inv_freq|rope|pe|pos|positions?|pos_embed)(?:[._]|$)", re.IGNORECASE)
# The largest |cos / sin - float64 reference| of float32 tables: ~1e-7 x the position (5e-4 at 4096); one
# rounded position or a bf16 table is off by 1e-2 to 1.
TABLE_TOLERANCE = 1e-2
ROUNDINGS = ("nearest", "stochastic")


def relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    """||y - ref|| / ||ref||, computed in float64 (inf when ref is zero and y is not)."""
    diff, norm = (y.double() - ref.double()).norm().item(), ref.double().norm().item()
    return diff / norm if norm > 0 else (0.0 if diff == 0 else math.inf)


# ----------------------------------------------------------------------------------------------
# Positions: what reaches core.rope_tables, and a bug that rounds it


@contextlib.contextmanager
def patched_rope_tables(wrap: Callable[[Callable], Callable]):
    """Replace core.rope_tables by wrap(original) in library.models.core and in every loaded module that
    imported the name (`from library.models.core import rope_tables`), restoring all on exit."""
    original = core.rope_tables
    patched = wrap(original)
    holders = [m for m in list(sys.modules.values()) if getattr(m, "__dict__", {}).get("rope_tables") is original]
    for module in holders:
        module.rope_tables = patched
    try:
        yield
    finally:
        for module in holders:
            module.rope_tables = original


def position_bug(dtype: torch.dtype) -> Callable[[Callable], Callable]:
    """The bug users hit, as a rope_tables wrapper: positions cast to the weight dtype (e.g. from a
    `model.dtype` helper) and back to float32 before the tables are computed."""

    def wrap(rope_tables):
        def rounded(positions, *args, **kwargs):
            return rope_tables(positions.to(dtype).to(torch.float32), *args, **kwargs)

        return rounded

    return wrap


def storage_dtype(model: nn.Module) -> torch.dtype:
    """The dtype the bug casts positions to: float8_e4m3fn for a model holding FP8Linear layers,
    else the model's explicit compute_dtype."""
    if any(isinstance(m, FP8Linear) for m in model.modules()):
        return FP8_DTYPE
    return getattr(model, "compute_dtype", torch.float32)


def reference_tables(positions: torch.Tensor, axes_dim: tuple[int, ...], theta: float):
    """float64 cos/sin [..., L, sum(axes_dim) / 2] of int/float positions [..., L, n_axes],
    computed here independently of core.rope_tables (the audit checks that one)."""
    pos = positions.to(torch.float64)
    angles = []
    for i, dim in enumerate(axes_dim):
        inv_freq = theta ** (-torch.arange(0, dim, 2, dtype=torch.float64, device=pos.device) / dim)
        angles.append(pos[..., i : i + 1] * inv_freq)
    angles = torch.cat(angles, dim=-1)
    return angles.cos(), angles.sin()


class PositionAudit:
    """Records what every rope_tables call receives and returns, against the positions a correct
    model uses (`expected`, int64 [B, L, n_axes])."""

    def __init__(self, expected: torch.Tensor, axes_dim: tuple[int, ...], theta: float):
        self.expected, self.axes_dim, self.theta = expected, tuple(axes_dim), theta
        self.calls: list[dict] = []

    def wrap(self, rope_tables):
        def recorded(positions, *args, **kwargs):
            cos, sin = rope_tables(positions, *args, **kwargs)
            self.calls.append(self._check(positions, cos, sin))
            return cos, sin

        return recorded

    def _check(self, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> dict:
        axes = positions.shape[-1] if positions.dim() > 1 else 1
        seen = positions.detach().reshape(-1, axes).cpu()
        record = {
            "dtype": str(positions.dtype).replace("torch.", ""),
            "table_dtype": str(cos.dtype).replace("torch.", ""),
            "distinct": [int(seen[:, i].unique().numel()) for i in range(axes)],
        }
        expected = self.expected.reshape(-1, self.expected.shape[-1])
        if seen.shape != expected.shape:  # not the call the doctor's inputs made (e.g. another model part)
            record["matches_inputs"] = False
            return record
        ref_cos, ref_sin = reference_tables(expected, self.axes_dim, self.theta)
        got_cos, got_sin = cos.detach().reshape(-1, cos.shape[-1]).cpu(), sin.detach().reshape(-1, sin.shape[-1]).cpu()
        record.update(
            matches_inputs=True,
            expected_distinct=[int(expected[:, i].unique().numel()) for i in range(axes)],
            positions_changed=int((seen.double() != expected.double()).any(-1).sum()),
            max_position_error=float((seen.double() - expected.double()).abs().max()),
            table_max_abs_diff=float(max((got_cos.double() - ref_cos).abs().max(), (got_sin.double() - ref_sin).abs().max())),
        )
        return record

    def summary(self) -> dict:
        """The worst call that matched the inputs (all calls of one model are alike)."""
        matching = [c for c in self.calls if c.get("matches_inputs")] or self.calls
        if not matching:
            return {"calls": 0}
        worst = max(matching, key=lambda c: c.get("table_max_abs_diff", 0.0))
        return {"calls": len(self.calls), **worst}


def low_precision_position_tensors(model: nn.Module) -> list[dict]:
    """Floating parameters/buffers named like positions or RoPE (freq|rope|pos) that are not
    float32/float64: `model.to(dtype)` rounded them, as it would a RoPE table kept as a buffer."""
    found = []
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if POSITION_NAME.search(name) and t.is_floating_point() and t.dtype not in (torch.float32, torch.float64):
            found.append({"name": name, "dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape)})
    return found


# ----------------------------------------------------------------------------------------------
# Per-layer errors: forward hooks on every Linear / FP8Linear and block


def block_names(model: nn.Module) -> list[str]:
    """The model's repeated blocks (its swappable_blocks(): every family's, in run order), by module name. A fixed
    list of two families' block names left the others' blocks out of the report's per-block rows."""
    blocks = {id(b) for b in model.swappable_blocks()}
    return [name for name, m in model.named_modules() if id(m) in blocks]


def probed_modules(model: nn.Module) -> dict[str, nn.Module]:
    blocks = set(block_names(model))
    return {name: m for name, m in model.named_modules() if isinstance(m, (nn.Linear, FP8Linear)) or name in blocks}


def _sampled(output, max_tokens: int) -> torch.Tensor:
    """A module output (tensor or tuple of tensors; [B, L, D] or [B, D]) -> one flat vector of the
    same evenly spaced tokens in every run, in the output's own dtype (a bf16 reference is kept exact)."""
    tensors = output if isinstance(output, (tuple, list)) else (output,)
    parts = []
    for t in tensors:
        if not torch.is_tensor(t):
            continue
        if t.dim() == 3 and t.shape[1] > max_tokens:
            t = t[:, torch.linspace(0, t.shape[1] - 1, max_tokens, device=t.device).round().long()]
        parts.append(t.detach().reshape(-1))
    return torch.cat(parts)


class LayerProbe:
    """Hooks on `probed_modules(model)`. Without `reference`, stores each layer's sampled output
    per step (on the CPU); with one, accumulates ||y - y_ref||^2 and ||y_ref||^2 per layer."""

    def __init__(self, model: nn.Module, max_tokens: int = 256, reference: dict | None = None):
        self.max_tokens, self.reference = max_tokens, reference
        self.step = 0
        self.store: dict[tuple[int, str], torch.Tensor] = {}
        self.order: list[str] = []  # execution order of the first step
        self.err_sq: dict[str, float] = {}
        self.ref_sq: dict[str, float] = {}
        self.handles = [m.register_forward_hook(self._hook(name)) for name, m in probed_modules(model).items()]

    def _hook(self, name: str):
        def hook(module, args, output):
            if name not in self.order:
                self.order.append(name)
            y = _sampled(output, self.max_tokens)
            if self.reference is None:
                self.store[(self.step, name)] = y.cpu()
                return
            ref = self.reference.get((self.step, name))
            if ref is None or ref.numel() != y.numel():
                return
            ref = ref.to(y.device).double()
            self.err_sq[name] = self.err_sq.get(name, 0.0) + (y.double() - ref).pow(2).sum().item()
            self.ref_sq[name] = self.ref_sq.get(name, 0.0) + ref.pow(2).sum().item()

        return hook

    def errors(self) -> dict[str, float]:
        """Relative error per layer over all steps, in execution order."""
        out = {}
        for name in self.order:
            if name in self.err_sq:
                ref = self.ref_sq[name]
                out[name] = math.sqrt(self.err_sq[name] / ref) if ref > 0 else (0.0 if self.err_sq[name] == 0 else math.inf)
        return out

    def remove(self):
        for h in self.handles:
            h.remove()


def routers(model: nn.Module) -> dict[str, nn.Module]:
    """Expert-choice routers: modules with an `expert_choice(logits) -> (scores, tokens [B, E, C])` method and the
    `gate` Linear whose output is those logits (a mixture-of-experts layer whose experts pick their tokens)."""
    return {name: m for name, m in model.named_modules()
            if callable(getattr(m, "expert_choice", None)) and isinstance(getattr(m, "gate", None), nn.Module)}


class RoutingProbe:
    """Hooks on each router's gate. Without `reference`, stores the tokens every expert chose per step (int64
    [B, E, C], on the CPU); with one, counts how many of the reference's choices the run made too. A top-k over
    near-equal scores turns a low-precision base's small input errors into whole tokens routed elsewhere, which
    the per-layer errors show only as a spread-out error: this says it as the share of the choices kept."""

    def __init__(self, model: nn.Module, reference: dict | None = None):
        self.reference, self.step = reference, 0
        self.store: dict[tuple[int, str], torch.Tensor] = {}
        self.kept_count: dict[str, int] = {}
        self.total: dict[str, int] = {}
        self.handles = [m.gate.register_forward_hook(self._hook(name, m)) for name, m in routers(model).items()]

    def _hook(self, name: str, router: nn.Module):
        def hook(module, args, logits):
            tokens = router.expert_choice(logits)[1]  # [B, E, C]
            if self.reference is None:
                self.store[(self.step, name)] = tokens.cpu()
                return
            ref = self.reference.get((self.step, name))
            if ref is None or ref.shape != tokens.shape:
                return
            chosen = torch.zeros(*tokens.shape[:2], logits.shape[1], dtype=torch.bool)  # [B, E, S]
            ref_chosen = chosen.clone().scatter_(2, ref, True)
            run_chosen = chosen.scatter_(2, tokens.cpu(), True)
            self.kept_count[name] = self.kept_count.get(name, 0) + int((ref_chosen & run_chosen).sum())
            self.total[name] = self.total.get(name, 0) + ref.numel()

        return hook

    def kept(self) -> dict[str, float]:
        """Per router (by its module name): the share of the reference's (expert, token) choices the run made too."""
        return {name: self.kept_count[name] / self.total[name] for name in self.total}

    def remove(self):
        for h in self.handles:
            h.remove()


# ----------------------------------------------------------------------------------------------
# Per-token error map on the image grid


def token_error_map(pred: torch.Tensor, ref: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """pred, ref [B, h*w, C] (row-major patch tokens) -> float64 [h, w]: ||pred - ref|| per token
    (mean over the batch) / the mean over tokens of ||ref||."""
    h, w = grid
    err = (pred.double() - ref.double()).norm(dim=-1).mean(0)
    scale = ref.double().norm(dim=-1).mean()
    return (err / scale if scale > 0 else err).reshape(h, w).cpu()


def map_ratios(error_map: torch.Tensor, band: float = 1 / 8, regions: int = 4) -> dict:
    """Where the error sits. border band: the outer `band` of rows and columns; centre: the middle
    half of rows x the middle half of columns; regions: a regions x regions grid of equal blocks
    (fewer where a block would be under 8 tokens a side). A flat map (weight quantization) gives ratios
    ~1. Rounded positions give a high border/centre ratio on a grid centred on 0 and a high max/min
    region ratio on a grid that starts at 0 (the low-index corner keeps exact positions, the
    right/bottom side carries the large ones)."""
    m = error_map.double()
    h, w = m.shape
    bh, bw = max(1, round(h * band)), max(1, round(w * band))
    rows, cols = torch.arange(h)[:, None], torch.arange(w)[None, :]
    border = (rows < bh) | (rows >= h - bh) | (cols < bw) | (cols >= w - bw)
    centre = (rows >= h // 4) & (rows < h - h // 4) & (cols >= w // 4) & (cols < w - w // 4)
    border_mean = float(m[border].mean())
    centre_mean = float(m[centre].mean()) if centre.any() else float(m.mean())
    rh, rw = max(1, min(regions, h // 8)), max(1, min(regions, w // 8))  # >= 8 tokens a side: a flat map stays ~1
    block = lambda i, j: m[i * h // rh : (i + 1) * h // rh, j * w // rw : (j + 1) * w // rw]  # noqa: E731
    blocks = [[float(block(i, j).mean()) for j in range(rw)] for i in range(rh)]
    flat = [v for row in blocks for v in row]
    return {
        "mean": float(m.mean()),
        "border": border_mean,
        "centre": centre_mean,
        "border_centre_ratio": border_mean / centre_mean if centre_mean > 0 else math.inf,
        "regions": blocks,
        "region_ratio": max(flat) / min(flat) if min(flat) > 0 else math.inf,
    }


def verdict(ratios: dict, output_error: float, threshold: float, positions: dict | None = None,
            position_ratio: float = 2.0) -> str:
    """One line: position damage, weight quantization (flat map over threshold), or ok. Position damage is
    what the position audit saw (positions reaching rope_tables changed, or tables off the float64 ones),
    else an uneven error map. The audit comes first: on a model that has learned, wrong positions spread
    their error over the image (a learned base's border / centre ratio stays ~0.9 under the e4m3 bug)."""
    uneven = output_error > 1e-6 and max(ratios["border_centre_ratio"], ratios["region_ratio"]) > position_ratio
    where = ("borders" if ratios["border_centre_ratio"] > position_ratio else "high-index side (far from position 0)")
    shape = (f"border/centre {ratios['border_centre_ratio']:.2f}, regions max/min {ratios['region_ratio']:.2f}")
    audit = positions or {}
    if audit.get("positions_changed", 0) > 0 or audit.get("table_max_abs_diff", 0.0) > TABLE_TOLERANCE:
        found = (f"{audit['positions_changed']} positions reached the RoPE tables changed" if audit.get("positions_changed")
                 else "the RoPE tables are off")
        return (f"POSITION DAMAGE: {found} (table error {audit['table_max_abs_diff']:.2g}; output error "
                f"{output_error:.4f}, {shape}): positions or RoPE tables went through a low-precision dtype")
    if uneven:
        return (f"POSITION DAMAGE: error concentrated at the {where} ({shape}): positions or RoPE tables went "
                f"through a low-precision dtype")
    if output_error > threshold:
        return (f"WEIGHT QUANTIZATION: flat error map, output error {output_error:.4f} > {threshold}: "
                "use fp8_scaled, keep more layers in bf16, or train the LoRA on this base")
    return f"OK: output error {output_error:.4f} <= {threshold}, flat map"


# ----------------------------------------------------------------------------------------------
# fp8 rounding of merged weights, and how much of a LoRA delta survives it


def quantize_with(w: torch.Tensor, mode: str, rounding: str = "nearest", scale: torch.Tensor | None = None,
                  generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """w [out, in] (float) -> (float8_e4m3fn codes, bf16 block scale or None), rounding to nearest
    or stochastically. fp8_scaled: the scale is computed from w (absmax / 448, library.precision.fp8) unless
    given (keeping an existing fp8 checkpoint's scales)."""
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
    w32 = w.detach().float()
    if mode == "fp8_scaled" and scale is None:
        codes, scale = quantize_weight(w32, mode)
        if rounding == "nearest":
            return codes, scale
    if mode == "fp8":
        scaled = w32
    elif mode == "fp8_scaled":
        rows, blocks = scale.shape
        scaled = (w32.reshape(rows, blocks, -1) / scale.float()[..., None]).reshape(w32.shape)
    else:
        raise ValueError(f"fp8 mode must be fp8 or fp8_scaled, got {mode!r}")
    if rounding == "nearest":
        return scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale
    return stochastic_round_to_fp8(scaled, generator), scale


def dequantized(w: torch.Tensor, mode: str, rounding: str = "nearest", scale=None, generator=None) -> torch.Tensor:
    """Q(w) as float32: what an fp8 layer holding quantize_with(w, ...) computes with."""
    return dequantize_weight(*quantize_with(w, mode, rounding, scale, generator), torch.float32)


def _kept(effective: torch.Tensor, delta: torch.Tensor) -> dict:
    """effective vs intended delta: kept = <effective, delta> / ||delta||^2 (1: all of it, 0: gone),
    error = ||effective - delta|| / ||delta||, changed = share of weights whose value moved."""
    d = delta.double()
    norm_sq = d.pow(2).sum().item()
    e = effective.double()
    return {
        "kept": (e * d).sum().item() / norm_sq if norm_sq > 0 else 1.0,
        "error": relative_error(e, d),
        "norm_ratio": e.norm().item() / math.sqrt(norm_sq) if norm_sq > 0 else 0.0,
        "changed": (e != 0).double().mean().item(),
    }


def lora_survival(weight: torch.Tensor, delta: torch.Tensor, mode: str, generator: torch.Generator | None = None) -> dict:
    """How much of a LoRA delta dW (float32 [out, in]) an fp8 base of `mode` keeps when merged.

    Two ways users merge, each with round-to-nearest and stochastic rounding:
    - "merge_fp32": W + dW in float32, then quantized: effective delta Q(W + dW) - Q(W);
    - "into_fp8": added to the fp8 weights (W on the fp8 grid, fp8_scaled keeps its scales):
      effective delta Q(Q(W) + dW) - Q(W). Round-to-nearest keeps nothing of a delta below half a step.
    Runtime (unmerged) application adds dW itself: kept 1, error 0."""
    w = weight.detach().float()
    base_codes, base_scale = quantize_with(w, mode)
    base = dequantize_weight(base_codes, base_scale, torch.float32)
    out = {"runtime": {"kept": 1.0, "error": 0.0, "norm_ratio": 1.0, "changed": 1.0}}
    for rounding in ROUNDINGS:
        merged = dequantized(w + delta, mode, rounding, None, generator)
        into = dequantized(base + delta, mode, rounding, base_scale, generator)
        out[f"merge_fp32_{rounding}"] = _kept(merged - base, delta)
        out[f"into_fp8_{rounding}"] = _kept(into - base, delta)
    return out


# ----------------------------------------------------------------------------------------------
# The whole run


@dataclass
class DoctorInputs:
    """The same random inputs for every mode. make_kwargs(sigma) -> the model's forward kwargs
    (timesteps: float32 [B]); positions: int64 [B, T + L, n_axes], what a correct model uses."""

    family: str
    grid: tuple[int, int]  # (h, w) in patches
    make_kwargs: Callable[[float], dict]
    positions: torch.Tensor
    axes_dim: tuple[int, ...]
    theta: float


def base_of(mode: str) -> str:
    """'fp8+merge_rtn' -> 'fp8': the same base without the LoRA."""
    return mode.split("+")[0]


def reference_of(mode: str) -> str:
    return "bf16+lora" if "+" in mode else "bf16"


@dataclass
class ModeRun:
    preds: list[torch.Tensor]  # per timestep, float32 [B, L, C] on the CPU
    layers: dict[str, float] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)
    positions: dict = field(default_factory=dict)
    position_tensors: list[dict] = field(default_factory=list)
    blocks: list[str] = field(default_factory=list)  # block_names(model): the layers that are whole blocks
    routing: dict[str, float] = field(default_factory=dict)  # RoutingProbe.kept(): routers' choices kept


@torch.no_grad()
def run_mode(model: nn.Module, inputs: DoctorInputs, timesteps, max_tokens: int, reference_store: dict | None,
             inject_position_bug: bool) -> tuple[ModeRun, dict]:
    """Run `model` on the inputs at each sigma with layer and routing hooks and the position audit.
    Returns the run and the store {"layers", "routing"} (filled only when reference_store is None)."""
    audit = PositionAudit(inputs.positions, inputs.axes_dim, inputs.theta)
    bug = position_bug(storage_dtype(model)) if inject_position_bug else (lambda f: f)
    reference_store = reference_store or {}
    probe = LayerProbe(model, max_tokens, reference_store.get("layers"))
    routing = RoutingProbe(model, reference_store.get("routing"))
    preds = []
    try:
        with patched_rope_tables(lambda rope: bug(audit.wrap(rope))):
            for step, sigma in enumerate(timesteps):
                probe.step = routing.step = step
                preds.append(model(**inputs.make_kwargs(sigma)).float().cpu())
    finally:
        probe.remove()
        routing.remove()
    run = ModeRun(preds, probe.errors(), probe.order, audit.summary(), low_precision_position_tensors(model),
                  block_names(model), routing.kept())
    return run, {"layers": probe.store, "routing": routing.store}


def diagnose(models: dict, inputs: DoctorInputs, timesteps=(0.9, 0.5, 0.1), threshold: float = 0.05,
             max_tokens: int = 256, inject_position_bug: bool = False, log: Callable[[str], None] = lambda s: None) -> dict:
    """Run every mode and compare it to its reference ("bf16", or "bf16+lora" for LoRA modes).

    models: mode name -> nn.Module, or a zero-argument callable that builds it (built just before
    its run and dropped after, so one full-size model is in memory at a time). Names: "fp32",
    "bf16", "fp8", "fp8_scaled", and "<base>+lora" / "<base>+merge_rtn" / ... for LoRA variants.
    Returns a plain dict (JSON-ready apart from the "maps" tensors)."""
    if "bf16" not in models or ("bf16+lora" not in models and any("+" in m for m in models)):
        raise ValueError(f"diagnose needs the 'bf16' reference (and 'bf16+lora' for LoRA modes), got modes {sorted(models)}")
    references = [m for m in ("bf16", "bf16+lora") if m in models]
    stores, runs = {}, {}
    for name in references + [m for m in models if m not in references]:
        log(f"running {name}")
        model = models[name]() if not isinstance(models[name], nn.Module) else models[name]
        ref_store = None if name in references else stores[reference_of(name)]
        runs[name], store = run_mode(model, inputs, timesteps, max_tokens, ref_store, inject_position_bug)
        if name in references:
            stores[name] = store
        large = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers())) > 2**30
        del model
        if large:  # LoRA patches make reference cycles: free a full-size model before the next one loads
            gc.collect()
    return summarise(runs, inputs, timesteps, threshold)


def summarise(runs: dict[str, ModeRun], inputs: DoctorInputs, timesteps, threshold: float) -> dict:
    """Per compared mode: output error (mean over sigmas), error map and its ratios, verdict,
    per-layer errors and the first layer over `threshold`; per mode the position audit."""
    result = {"family": inputs.family, "grid": list(inputs.grid), "timesteps": list(timesteps), "threshold": threshold,
              "modes": {}, "maps": {}, "blocks": next(iter(runs.values())).blocks}
    for name, run in runs.items():
        entry = {"positions": run.positions, "low_precision_position_tensors": run.position_tensors}
        if name not in ("bf16", "bf16+lora"):
            ref = runs[reference_of(name)]
            per_step = [relative_error(p, r) for p, r in zip(run.preds, ref.preds)]
            error_map = torch.stack([token_error_map(p, r, inputs.grid) for p, r in zip(run.preds, ref.preds)]).mean(0)
            ratios = map_ratios(error_map)
            output_error = sum(per_step) / len(per_step)
            first = next((n for n in run.order if run.layers.get(n, 0.0) > threshold), None)
            entry.update(reference=reference_of(name), output_error=output_error, per_timestep=per_step, map=ratios,
                         verdict=verdict(ratios, output_error, threshold, run.positions), layers=run.layers,
                         first_layer_over_threshold=first, routing_kept=run.routing)
            result["maps"][name] = error_map
        else:
            entry.update(reference=None, verdict="reference")
        result["modes"][name] = entry
    if "bf16+lora" in runs:
        result["lora_effect"] = lora_effects(runs)
    return result


def lora_effects(runs: dict[str, ModeRun]) -> dict:
    """How much of the LoRA's effect on the prediction each LoRA mode keeps: effect = pred(mode) -
    pred(same base without LoRA), compared to the reference effect (see _kept): fp32's where fp32+lora ran, else
    bf16's. (Against bf16's alone, its activation rounding sat in the denominator: every share came out
    ~|effect|^2 / (|effect|^2 + |noise|^2), runtime fp8 + LoRA "kept 0.91" of a LoRA at 3x the floor, 1.00 vs fp32.)"""
    effects = {name: torch.cat([a - b for a, b in zip(run.preds, runs[base_of(name)].preds)])
               for name, run in runs.items() if "+" in name and base_of(name) in runs}
    reference = "fp32+lora" if "fp32+lora" in effects else "bf16+lora"
    base_norm = torch.cat(runs["bf16"].preds).double().norm().item()
    out = {"bf16+lora": {"effect_size": effects["bf16+lora"].double().norm().item() / base_norm if base_norm else 0.0},
           "reference": reference}
    for name, effect in effects.items():
        if name != reference:
            out[name] = {**out.get(name, {}), **_kept(effect, effects[reference])}
    return out
