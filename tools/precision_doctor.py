"""Precision doctor: finds fp8 damage in minutes, and says whether it comes from positions, from
weight quantization or from a LoRA merged into fp8 weights.

    python tools/precision_doctor.py --model_type MODEL_TYPE --model PATH [--lora FILE[:ratio]] \
        [--resolution 1024 | WxH] [--seed 0] [--timesteps 0.9,0.5,0.1] [--out DIR] [--threshold 0.05] \
        [--text_len 128] [--skip_fp32] [--max_tokens 256] [--device cuda] [--inject_position_bug]

The same random inputs (packed latents for the resolution, random text embeddings of the model's
context width and whatever else the architecture takes: a pooled vector, a text mask) go through the base in
bf16 (the reference), fp32 (the bf16 floor), plain fp8, fp8_scaled and fp8_compute (the fp8_scaled
base run as fp8 GEMMs, train_lora's fp8_compute = true: library/precision/fp8_compute.py) at a few
sigmas. With --lora, also bf16 + LoRA (the LoRA reference), fp8 / fp8_scaled / fp8_compute + LoRA at
runtime (unmerged), and
the LoRA merged into plain fp8: in float32 then rounded to nearest ("merge_rtn") or
stochastically ("merge_sr"), or added to the fp8 weights ("merge_into_fp8").

Each mode is loaded from disk just before its run (fp8 quantized while loading), so one full-size
model is in memory at a time. The report (stdout, DIR/report.txt, DIR/report.json, DIR/heatmap_*.png):
per-layer relative errors (blocks and the worst layers; the first layer over --threshold), per-token
error heatmaps with the border-band / centre and max / min of 4x4 regions ratios and a verdict per mode,
the positions each model really fed to core.rope_tables, for a mixture-of-experts model whose experts choose their
tokens the share of the reference's (expert, token) choices each mode kept, and, with --lora, how much of the LoRA
survives each way of applying it. --inject_position_bug casts positions to each model's weight
dtype (float8_e4m3fn on fp8 bases), the bug users hit, to show what it looks like.

Exit status 0 whatever damage is found (a diagnostic), 2 with one line on stderr for bad input.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys

if __package__ in (None, ""):  # run as a script: make `library` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.cli import Parser, check_command_line, check_out_folder, exit_without_collecting  # noqa: E402
from library.models.registry import FAMILIES, arch_spec  # noqa: E402

# A variant is checked as the transformer of its architecture (lora_arch): an edit model on
# target-only inputs, whose reference tokens go through the same layers (and, where they only add a
# first-axis position, positions exact in every dtype), so the same fp8 damage shows.
BASE_MODES = ("fp32", "bf16", "fp8", "fp8_scaled", "fp8_compute")
LORA_MODES = ("bf16+lora", "fp32+lora", "fp8+lora", "fp8_scaled+lora", "fp8_compute+lora", "fp8+merge_rtn",
              "fp8+merge_sr", "fp8+merge_into_fp8")
COMPUTED = {"fp8_compute": "fp8_scaled"}  # a mode run as fp8 GEMMs -> how its weights are stored
VAE_PATCH = 16  # pixels per packed token: 8x VAE downsampling x 2x2 patches


def build_parser() -> argparse.ArgumentParser:
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model_type", required=True, choices=FAMILIES, help="a registered diffusion family")
    p.add_argument("--model", required=True, help="transformer checkpoint (bf16/fp32; file or diffusers folder)")
    p.add_argument("--lora", default=None, help="LoRA file, optionally :ratio")
    p.add_argument("--resolution", default="1024", help="image size in pixels: 1024 or WxH")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timesteps", default="0.9,0.5,0.1", help="sigmas in (0, 1], comma-separated")
    p.add_argument("--out", default="precision_report", help="report folder")
    p.add_argument("--threshold", type=float, default=0.05, help="relative error that counts as damage")
    p.add_argument("--text_len", type=int, default=128, help="random text tokens")
    p.add_argument("--max_tokens", type=int, default=256, help="tokens per layer kept for the per-layer errors")
    p.add_argument("--skip_fp32", action="store_true", help="no fp32 run (for models too large for fp32)")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--inject_position_bug", action="store_true", help="demonstration: positions cast to the weight dtype")
    return p


# The arguments are checked before torch and the library load (seconds): --help and a bad flag answer at once.
if __name__ == "__main__":
    check_command_line(build_parser)

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

from library.models import precision_doctor as precision  # noqa: E402
from library.models.family import fp8_prepare, lora_arch  # noqa: E402
from library.models.spec import load_symbol  # noqa: E402
from library.precision.fp8 import (  # noqa: E402
    FP8Linear, dequantize_weight, fp8_load_converter, is_high_precision, prepare_fp8, quantize_module,
)
from library.io import CheckpointError, atomic_path, write_text  # noqa: E402
from library.precision.stored_layouts import refuse_stored_base  # noqa: E402
from library.precision.fp8_compute import enable_fp8_compute, fp8_gemm_available  # noqa: E402
from tools.devices import device_from_flag  # noqa: E402
from networks.lora_module import LoRAModule  # noqa: E402
from networks.lora_args import diffusers_module_map  # noqa: E402
from networks.lora_files import LoRAWeights  # noqa: E402
from networks.lora_reader import check_lora_arch, leave_out_text_encoders, read_for_model  # noqa: E402
from tools.cli import parse_lora_spec  # noqa: E402


# ----------------------------------------------------------------------------------------------
# Inputs


def token_width(config) -> int:
    """Features of one packed image token: a config's `token_width` where its in_channels counts the
    latent channels (diffusers' config says so for some models), else in_channels (64: 16 x 2 x 2)."""
    return getattr(config, "token_width", config.in_channels)


def make_inputs(arch: str, config, width: int, height: int, seed: int = 0, text_len: int = 128,
                device: torch.device | str = "cpu") -> precision.DoctorInputs:
    """Random inputs shared by all modes, float32 on `device`: noisy packed latents x_t = (1 - s) x0
    + s noise for an image of width x height pixels, and the architecture's conditioning with random
    text (its spec's transformer.random_inputs: text embeddings N(0, 1) and what else it takes)."""
    h, w = height // VAE_PATCH, width // VAE_PATCH
    gen = torch.Generator().manual_seed(seed)
    x0, noise = (torch.randn(1, h * w, token_width(config), generator=gen) for _ in range(2))
    conditioning = load_symbol(arch_spec(arch).transformer.random_inputs)(config, h, w, text_len, gen)
    fixed = conditioning.fixed

    def make_kwargs(sigma: float) -> dict:
        on_device = {k: v.to(device) if torch.is_tensor(v) else v for k, v in fixed.items()}
        img = ((1 - sigma) * x0 + sigma * noise).to(device)
        return dict(img=img, timesteps=torch.full((1,), float(sigma), device=device), **on_device)

    return precision.DoctorInputs(arch, (h, w), make_kwargs, conditioning.positions, conditioning.axes_dim,
                                  conditioning.theta)


# ----------------------------------------------------------------------------------------------
# LoRA: read for a model, apply at runtime, merge into fp8


def read_lora_for(model: nn.Module, arch: str, path: str, ratio: float = 1.0) -> dict[str, LoRAWeights]:
    """{module path of `model`: LoRAWeights (float32, ratio folded into alpha)} from any layout
    networks/lora_reader.py reads (the reader every LoRA-applying tool shares). A DoRA file is refused:
    the runtime and merged columns here add plain low-rank deltas. Text-encoder modules are left out with a
    warning (they were dropped without a word: the numbers measured part of the file)."""
    linears = {n: m for n, m in model.named_modules() if isinstance(m, (nn.Linear, FP8Linear))}
    read = read_for_model(path, arch, linears, lambda: diffusers_module_map(arch, model.config), strict=True)
    leave_out_text_encoders(path, read.text_encoders, bool(read.weights), arch, stacklevel=2)  # the numbers: the rest
    out = {}
    for p, w in read.weights.items():
        if p not in linears:
            raise CheckpointError(f"{path}: LoRA module '{p}' is not a Linear of this {arch} model")
        if w.magnitude is not None:
            raise CheckpointError(f"{path}: LoRA module '{p}' is DoRA; the precision tools apply and merge plain LoRAs "
                                  f"(merge it with tools/merge_lora.py and compare bases instead)")
        m = linears[p]
        if (w.up.shape[0], w.down.shape[1]) != (m.out_features, m.in_features):
            raise CheckpointError(f"{path}: LoRA '{p}' gives a delta {(w.up.shape[0], w.down.shape[1])}, "
                                  f"the layer is {(m.out_features, m.in_features)}")
        out[p] = LoRAWeights(w.down.float(), w.up.float(), w.alpha * ratio)
    if not out:
        raise CheckpointError(f"{path}: the LoRA holds no module")
    return out


def apply_runtime_lora(model: nn.Module, weights: dict[str, LoRAWeights]) -> nn.Module:
    """LoRAModule (float32 branch, unmerged) on each named module; the base stays as it is."""
    modules = dict(model.named_modules())
    for path, w in weights.items():
        lora = LoRAModule(path, modules[path], w.rank, w.alpha)
        with torch.no_grad():
            lora.lora_down.weight.copy_(w.down)
            lora.lora_up.weight.copy_(w.up)
        lora.eval().apply_to_base()  # base.forward now holds the module
    return model


def merged_codes(w: torch.Tensor, delta: torch.Tensor, mode: str, how: str, generator: torch.Generator):
    """(float8 codes, scale | None) of W + dW for one fp8 Linear, W and dW float32 [out, in]."""
    if how == "merge_rtn":
        return precision.quantize_with(w + delta, mode, "nearest")
    if how == "merge_sr":
        return precision.quantize_with(w + delta, mode, "stochastic", generator=generator)
    if how == "merge_into_fp8":  # add to the fp8 base's values, keep its scales, round to nearest
        codes, scale = precision.quantize_with(w, mode)
        return precision.quantize_with(dequantize_weight(codes, scale, torch.float32) + delta, mode, "nearest", scale)
    raise ValueError(f"unknown merge {how!r}")


class MergingConverter:
    """load_streaming convert hook: the fp8 converter, with LoRA deltas merged (merged_codes) into
    the weights of the LoRA's modules; high-precision LoRA modules get W + dW in float32, cast back."""

    def __init__(self, inner, deltas: dict[str, torch.Tensor], mode: str, how: str, generator):
        self.inner, self.deltas, self.mode, self.how, self.generator = inner, deltas, mode, how, generator
        self.keep_dtype = inner.keep_dtype

    def __call__(self, key: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        path = key[: -len(".weight")] if key.endswith(".weight") else None
        if path not in self.deltas:
            return self.inner(key, tensor)
        delta = self.deltas[path]
        if key not in self.inner.quantized:
            return {key: (tensor.float() + delta).to(tensor.dtype)}
        codes, scale = merged_codes(tensor.float(), delta, self.mode, self.how, self.generator)
        return {key: codes, **({path + ".weight_scale": scale} if scale is not None else {})}


# ----------------------------------------------------------------------------------------------
# Model variants: mode name -> a function that builds that model


def _finish(model: nn.Module, dtype: torch.dtype, device, precision_name: str = "") -> nn.Module:
    model = model.to(device=device, dtype=dtype).eval()  # FP8Linear keeps its fp8 codes and bf16 scales
    model.compute_dtype = dtype
    if precision_name in COMPUTED:
        if dtype != torch.bfloat16:  # FP8ComputeLinear would fall back to the dequantized matmul
            raise ValueError(f"{precision_name} computes in bfloat16, not {dtype}")
        enable_fp8_compute(model)
    return model


def in_memory_variant(fp32_model: nn.Module, arch: str, mode: str, lora=None, seed: int = 0, device="cpu") -> nn.Module:
    """Build `mode` from an fp32 model in memory (a copy; tests and tiny models)."""
    computed, _, how = mode.partition("+")
    precision_name = COMPUTED.get(computed, computed)
    model = copy.deepcopy(fp32_model)
    deltas = {p: w.delta() for p, w in (lora or {}).items()} if how.startswith("merge") else {}
    if precision_name == "fp32":
        model = _finish(model, torch.float32, device)
        return apply_runtime_lora(model, lora) if how == "lora" else model
    modules = dict(model.named_modules())
    originals = {p: modules[p].weight.detach().float().clone() for p in deltas}
    with torch.no_grad():
        for p, d in deltas.items():
            if precision_name == "bf16" or is_high_precision(p, arch_spec(arch).fp8):
                modules[p].weight += d
    if precision_name in ("fp8", "fp8_scaled"):
        quantize_module(model, precision_name, arch_spec(arch).fp8)
        modules, gen = dict(model.named_modules()), torch.Generator().manual_seed(seed)
        for p, d in deltas.items():
            if isinstance(modules[p], FP8Linear):
                modules[p].weight, modules[p].weight_scale = merged_codes(originals[p], d, precision_name, how, gen)
    model = _finish(model, torch.bfloat16, device, computed)
    return apply_runtime_lora(model, lora) if how == "lora" else model


def disk_variant(path: str, arch: str, mode: str, lora=None, seed: int = 0, device="cpu",
                 dtype: torch.dtype | None = None) -> nn.Module:
    """Load `mode` from the checkpoint at `path` (fp8 quantized tensor by tensor while loading).
    dtype: the high-precision weights' and compute dtype (default: float32 for "fp32", else bfloat16)."""
    load = _loader(arch)
    computed, _, how = mode.partition("+")
    precision_name = COMPUTED.get(computed, computed)
    dtype = dtype or (torch.float32 if precision_name == "fp32" else torch.bfloat16)
    prepare = fp8_prepare(precision_name if precision_name.startswith("fp8") else None, arch)
    if how.startswith("merge"):
        deltas = {p: w.delta() for p, w in lora.items()}
        gen, rules = torch.Generator().manual_seed(seed), arch_spec(arch).fp8
        prepare = lambda m: MergingConverter(fp8_load_converter(prepare_fp8(m, precision_name, rules)), deltas,  # noqa: E731
                                             precision_name, how, gen)
    model = _finish(load(path, dtype=dtype, prepare=prepare), dtype, device, computed)
    return apply_runtime_lora(model, lora) if how == "lora" else model


def _loader(arch: str):
    return load_symbol(arch_spec(arch).transformer.load)


def survival_table(model: nn.Module, lora: dict[str, LoRAWeights], arch: str, seed: int = 0) -> dict:
    """precision.lora_survival per LoRA module and fp8 mode (modules that stay high precision skipped),
    from the weights of a high-precision `model`; plus median / min of `kept` and median `error`."""
    modules, gen = dict(model.named_modules()), torch.Generator().manual_seed(seed)
    per_module = {mode: {} for mode in ("fp8", "fp8_scaled")}
    for path, w in lora.items():
        if is_high_precision(path, arch_spec(arch).fp8):
            continue
        weight = modules[path].weight.detach().float().cpu()
        for mode in per_module:
            per_module[mode][path] = precision.lora_survival(weight, w.delta(), mode, gen)
    summary = {}
    for mode, rows in per_module.items():
        for way in next(iter(rows.values()), {}):
            kept = [r[way]["kept"] for r in rows.values()]
            summary[f"{mode} {way}"] = {"median_kept": statistics.median(kept), "min_kept": min(kept),
                                        "median_error": statistics.median(r[way]["error"] for r in rows.values()),
                                        "median_norm_ratio": statistics.median(r[way]["norm_ratio"] for r in rows.values())}
    return {"summary": summary, "modules": per_module}


# ----------------------------------------------------------------------------------------------
# Report


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(wd) for c, wd in zip(r, widths)).rstrip() for r in rows)


def report_text(result: dict, worst: int = 8) -> str:
    modes = result["modes"]
    compared = [m for m, e in modes.items() if e.get("reference")]
    h, w = result["grid"]
    lines = [f"precision doctor: {result['family']}, grid {h}x{w} patches ({w * VAE_PATCH}x{h * VAE_PATCH} px), "
             f"sigmas {','.join(str(t) for t in result['timesteps'])}, threshold {result['threshold']}"
             + (", POSITION BUG INJECTED (positions cast to each model's weight dtype)" if result.get("position_bug") else ""),
             "", "== Output vs reference (per-token error map: border band / centre, max / min of 4x4 regions) =="]
    rows = [["mode", "reference", "error", "border/centre", "regions max/min", "verdict"]]
    for m in compared:
        e = modes[m]
        rows.append([m, e["reference"], f"{e['output_error']:.4f}", f"{e['map']['border_centre_ratio']:.2f}",
                     f"{e['map']['region_ratio']:.2f}", e["verdict"].split(":")[0]])
    lines += [_table(rows), ""] + [f"{m}: {modes[m]['verdict']}" for m in compared]

    layer_modes = [m for m in compared if modes[m]["layers"]]
    if layer_modes:
        lines += ["", f"== Per-layer relative error (blocks, then the {worst} worst layers) =="]
        names = list(modes[layer_modes[0]]["layers"])
        blocks = [n for n in names if n in result["blocks"]]
        others = [n for n in names if n not in blocks]
        worst_layers = sorted(others, key=lambda n: -max(modes[m]["layers"].get(n, 0) for m in layer_modes))[:worst]
        rows = [["layer"] + layer_modes]
        for n in blocks + worst_layers:
            rows.append([n] + [f"{modes[m]['layers'].get(n, float('nan')):.4f}" for m in layer_modes])
        rows.append(["mean over layers"] + [f"{mean_layer_error(modes[m]):.4f}" for m in layer_modes])
        lines.append(_table(rows))
        lines.append(f"first layer (in execution order) over {result['threshold']}:")
        lines += [f"  {m}: {modes[m]['first_layer_over_threshold'] or 'none'}" for m in layer_modes]

    lines += routing_report(modes, compared)
    lines += ["", "== Positions fed to core.rope_tables (vs the int64 positions a correct model uses) =="]
    rows = [["mode", "dtype", "distinct per axis", "expected", "changed", "max |pos err|", "table vs float64"]]
    for m, e in modes.items():
        p = e["positions"]
        if not p.get("calls"):
            rows.append([m, "no rope_tables call seen", "", "", "", "", ""])
            continue
        rows.append([m, p["dtype"], str(p["distinct"]), str(p.get("expected_distinct", "?")),
                     str(p.get("positions_changed", "?")),
                     f"{p.get('max_position_error', float('nan')):g}", f"{p.get('table_max_abs_diff', float('nan')):.2e}"])
    lines.append(_table(rows))
    scans = {f"{m}: {t['name']} {t['dtype']}" for m, e in modes.items() for t in e["low_precision_position_tensors"]}
    lines.append("low-precision freq/rope/pos tensors: " + (", ".join(sorted(scans)) if scans else "none"))

    if "lora_effect" in result:
        lines += lora_report(result)
    return "\n".join(lines) + "\n"


def routing_report(modes: dict, compared: list[str]) -> list[str]:
    """Expert-choice routers (a mixture-of-experts model): the share of the reference's (expert, token) choices each
    mode made too, per router and in all; nothing for a model without routers."""
    routed = [m for m in compared if modes[m].get("routing_kept")]
    if not routed:
        return []
    names = list(modes[routed[0]]["routing_kept"])
    rows = [["router"] + routed]
    rows += [[n] + [f"{modes[m]['routing_kept'].get(n, float('nan')):.3f}" for m in routed] for n in names]
    rows.append(["mean"] + [f"{sum(modes[m]['routing_kept'].values()) / len(modes[m]['routing_kept']):.3f}"
                            for m in routed])
    return ["", "== Expert-choice routing: share of the reference's (expert, token) choices kept ==", _table(rows),
            "below 1: the base's rounding sent tokens to other experts, so the routed experts' inputs (and a LoRA's "
            "effect through them) differ from the reference's by whole tokens, not by rounding"]


def lora_report(result: dict) -> list[str]:
    effect = result["lora_effect"]
    ref = effect.get("reference", "bf16+lora").split("+")[0]
    lines = ["", "== LoRA ==", f"LoRA effect in bf16: {effect['bf16+lora']['effect_size']:.4f} of the prediction's norm",
             "share of the LoRA's effect on the prediction each mode keeps "
             f"(1 = all; error = ||effect - {ref} effect|| / ||{ref} effect||):"]
    rows = [["mode", "kept", "error"]] + [[m, f"{e['kept']:.3f}", f"{e['error']:.3f}"] for m, e in effect.items()
                                          if isinstance(e, dict) and "kept" in e]
    lines.append(_table(rows))
    if ref == "bf16":  # (--skip_fp32) the reference's own rounding lowers every share alike
        lines.append("note: measured against the bf16 effect (--skip_fp32): its activation rounding lowers every share "
                     "alike, ~|effect|^2 / (|effect|^2 + |noise|^2); compare the modes with each other; the per-module "
                     "numbers below are not affected")
    if "lora_survival" in result:
        lines.append("per module: kept = <effective delta, delta> / ||delta||^2 (runtime application: 1 exactly)")
        rows = [["fp8 mode / way", "median kept", "min kept", "median error", "median |eff|/|delta|"]]
        for way, s in result["lora_survival"]["summary"].items():
            rows.append([way] + [f"{s[k]:.3f}" for k in ("median_kept", "min_kept", "median_error", "median_norm_ratio")])
        lines.append(_table(rows))
    return lines


def mean_layer_error(entry: dict) -> float:
    values = list(entry["layers"].values())
    return sum(values) / len(values) if values else float("nan")


def write_heatmap(path: str, mode: str, error_map: torch.Tensor, ratios: dict):
    """One figure: the per-token error map, its row profile and its column profile (PNG, atomic)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = error_map.numpy()
    fig, axes = plt.subplots(1, 3, figsize=(13, 4), gridspec_kw={"width_ratios": [1.2, 1, 1]})
    fig.subplots_adjust(left=0.04, right=0.98, bottom=0.14, top=0.82, wspace=0.3)
    im = axes[0].imshow(m, cmap="magma")
    fig.colorbar(im, ax=axes[0], fraction=0.046)
    axes[0].set_title(f"{mode}: per-token error / mean |ref|")
    axes[1].plot(m.mean(1))
    axes[1].set(title="row profile", xlabel="row (patch)", ylabel="mean error")
    axes[2].plot(m.mean(0))
    axes[2].set(title="column profile", xlabel="column (patch)")
    fig.suptitle(f"border/centre {ratios['border_centre_ratio']:.2f}, regions max/min {ratios['region_ratio']:.2f}")
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=80)
    plt.close(fig)


def write_report(result: dict, out: str) -> str:
    """report.txt, report.json (every number, maps as nested lists) and heatmap_<mode>.png in `out`."""
    os.makedirs(out, exist_ok=True)
    text = report_text(result)
    write_text(os.path.join(out, "report.txt"), text)
    data = {k: v for k, v in result.items() if k != "maps"}
    data["maps"] = {m: [[round(float(x), 6) for x in row] for row in t] for m, t in result["maps"].items()}
    write_text(os.path.join(out, "report.json"), json.dumps(data, indent=1, default=str) + "\n")
    for mode, error_map in result["maps"].items():
        write_heatmap(os.path.join(out, f"heatmap_{mode.replace('+', '_')}.png"), mode, error_map, result["modes"][mode]["map"])
    return text


# ----------------------------------------------------------------------------------------------
# CLI


def run_doctor(model_path: str, arch: str, lora_spec: str | None = None, resolution: tuple[int, int] = (1024, 1024),
               seed: int = 0, timesteps=(0.9, 0.5, 0.1), out: str = "precision_report", threshold: float = 0.05,
               text_len: int = 128, skip_fp32: bool = False, max_tokens: int = 256, device: str = "cpu",
               inject_position_bug: bool = False, log=print) -> dict:
    """Load, diagnose, report. The bf16 model loaded first (for the config and the LoRA's module
    names) is handed to the bf16 run, then dropped; every other mode is loaded when it runs."""
    first = disk_variant(model_path, arch, "bf16", device=device)
    inputs = make_inputs(arch, first.config, *resolution, seed=seed, text_len=text_len, device=device)
    lora, survival = None, None
    if lora_spec:
        from tools.merge_lora import parse_lora_spec

        spec = parse_lora_spec(lora_spec)
        lora = read_lora_for(first, arch, spec.path, spec.ratio)
        survival = survival_table(first, lora, arch, seed)
    held = [first]
    del first
    modes = report_modes(device, skip_fp32, lora is not None)
    if not fp8_gemm_available(device):  # e.g. an RTX 3090, or the CPU under torch 2.11: report the rest
        log(f"skipped: the fp8_compute modes ({device} has no fp8 GEMMs with per-row scales under torch {torch.__version__})")
    models = {m: (lambda m=m: held.pop() if m == "bf16" and held else disk_variant(model_path, arch, m, lora, seed, device))
              for m in modes}
    result = precision.diagnose(models, inputs, timesteps, threshold, max_tokens, inject_position_bug, log=log)
    result["position_bug"] = inject_position_bug
    if survival:
        result["lora_survival"] = survival
    log(write_report(result, out))
    log(f"written: {out}/report.txt, report.json, {len(result['maps'])} heatmaps")
    return result


def report_modes(device: str, skip_fp32: bool = False, with_lora: bool = False) -> list[str]:
    """The modes run_doctor diagnoses: the fp8_compute ones only where `device` has fp8 GEMMs with per-row scales."""
    modes = [m for m in BASE_MODES + (LORA_MODES if with_lora else ()) if not (skip_fp32 and m.startswith("fp32"))]
    return [m for m in modes if m.split("+")[0] not in COMPUTED or fp8_gemm_available(device)]


def parse_resolution(text: str) -> tuple[int, int]:
    """'1024' or 'WxH' -> (width, height), multiples of 16 pixels."""
    parts = text.lower().split("x")
    try:
        width, height = (int(parts[0]), int(parts[0])) if len(parts) == 1 else (int(parts[0]), int(parts[1]))
    except ValueError:
        raise ValueError(f"--resolution {text!r}: expected a number or WxH, e.g. 1024 or 1344x768") from None
    if len(parts) > 2 or width <= 0 or height <= 0 or width % VAE_PATCH or height % VAE_PATCH:
        raise ValueError(f"--resolution {text!r}: width and height must be positive multiples of {VAE_PATCH}")
    return width, height


def parse_timesteps(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(t) for t in text.split(","))
    except ValueError:
        raise ValueError(f"--timesteps {text!r}: expected comma-separated sigmas in (0, 1], e.g. 0.9,0.5,0.1") from None
    if not all(0 < t <= 1 for t in values):
        raise ValueError(f"--timesteps {text!r}: every sigma must lie in (0, 1]")
    return values


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
        resolution, timesteps = parse_resolution(args.resolution), parse_timesteps(args.timesteps)
        if not args.threshold > 0 or args.text_len < 1 or args.max_tokens < 1:
            raise ValueError("--threshold must be > 0, --text_len and --max_tokens >= 1")
        device = device_from_flag(args.device)
        check_out_folder("--out", args.out, "the report folder")  # now, not after every mode has run
        if not os.path.exists(args.model):
            raise ValueError(f"--model {args.model}: no such file or folder")
        refuse_stored_base(args.model, "--model", "every mode, the bf16 reference too, would be that base")
        if args.lora:  # headers only: not a LoRA, or another model's, is named before the model loads
            check_lora_arch(parse_lora_spec(args.lora).path, lora_arch(args.model_type))
        run_doctor(args.model, lora_arch(args.model_type), args.lora, resolution, args.seed, timesteps, args.out, args.threshold,
                   args.text_len, args.skip_fp32, args.max_tokens,
                   str(device), args.inject_position_bug)
    except (ValueError, OSError) as e:  # CheckpointError is a ValueError
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    exit_without_collecting(main)
