"""Change a LoRA's rank: SVD of each module's delta, keep the largest singular values.

    python tools/resize_lora.py --lora IN.safetensors --save_to OUT.safetensors --new_rank 16 \
        [--dynamic_method sv_ratio|sv_fro|sv_cumulative --dynamic_param X] [--save_precision fp32|bf16|fp16|float] \
        [--device cuda] [--model BASE]

Per module, the SVD of up @ down (taken from the factors' QR, exact: networks/lora_svd.py) gives
the best rank-k approximation (Eckart-Young). The rank k is --new_rank, or with --dynamic_method
chosen per module exactly as sd-scripts' networks/resize_lora.py defines it, --new_rank then being
the cap:
  sv_ratio X:      keep the singular values larger than S_max / X, plus one
  sv_cumulative X: keep until the sum of the kept S reaches X of sum(S), plus one
  sv_fro X:        keep until sqrt(sum of kept S^2 / sum S^2) reaches X, plus one
(the "plus one" is sd-scripts' own: its rank is index + 1); a zero delta gets rank 1. k never exceeds
the module's old rank (the singular values past it are zero).

Alpha (sd-scripts' convention): the scale alpha / rank of each module is preserved, so the new
alpha is old_alpha / old_rank * k; down = the top k right singular vectors (orthonormal rows),
up = the left ones times the singular values. At k = old rank the delta is unchanged (to the rounding
of the save precision: a bf16 file's factors are new bf16 numbers, 2e-3 off; the error printed is the
written one's). DoRA files keep their magnitudes (the direction is resized, m * (W + dW') / ||W + dW'||).
LyCORIS files are refused. Tensors saved beside the LoRA (ComfyUI's whole `.diff` / `.diff_b` deltas, OneTrainer's
bundled embeddings) have no rank: they are written back as they are. The output has the layout of the input (kohya, PEFT with alpha folded
into lora_B, ComfyUI) and its metadata, with ss_network_dim / ss_network_alpha updated (
"Dynamic" for dynamic resizing, as sd-scripts writes) and `lora_resized` describing the run.

Printed per module: old -> new rank, the retained Frobenius energy sqrt(sum kept S^2 / sum S^2),
the retained sum of S, and the relative error ||dW - dW_k|| / ||dW||. With --model (a checkpoint
of a registered family or an LLM, small enough to run on the CPU in float32, e.g. the tiny models), the
output error too: the model's output with the resized LoRA vs the original LoRA, relative to the
original LoRA's effect on the output (fixed random inputs).

Unlike sd-scripts, --model is the base (as in merge_lora.py) and the LoRA is --lora; safetensors only.
The LoRA is read whole (LoRA files are small); each module is resized and dropped in turn.
Errors are one line on stderr, exit status 2, and nothing is written.
"""

from __future__ import annotations

import json
import os
import statistics
import sys

if __package__ in (None, ""):  # run as a script: make `library` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.cli import Parser, check_command_line, save_precision_name, exit_without_collecting  # noqa: E402


# sd-scripts' resize_lora.py flags -> ours (its --model is the LoRA: ours' --lora; ours' --model is the base)
PEER_FLAGS = {"--verbose": "none: ours prints every module's ranks, kept energy and error",
              "--new_conv_rank": "none: ours resizes Linear LoRAs (a conv LoRA is refused)"}


def build_parser() -> Parser:
    parser = Parser(description=__doc__.split("\n\n")[0], peer_flags=PEER_FLAGS)
    parser.add_argument("--lora", required=True, help="LoRA .safetensors to resize (kohya, PEFT/diffusers, ComfyUI; "
                                                      "sd-scripts' resize_lora.py --model)")
    parser.add_argument("--save_to", required=True, help="output .safetensors (same layout as the input)")
    parser.add_argument("--new_rank", type=int, default=4, help="rank, or the largest rank with --dynamic_method (default 4)")
    # Not argparse choices: DYNAMIC_METHODS lives with the SVD code (torch); check_args refuses other names.
    parser.add_argument("--dynamic_method", default=None, help="sv_ratio, sv_fro or sv_cumulative: choose the rank per module")
    parser.add_argument("--dynamic_param", type=float, default=None, help="target of --dynamic_method")
    parser.add_argument("--save_precision", type=save_precision_name, choices=["fp32", "bf16", "fp16"], default=None,
                        help="default: the input's dtype (float: fp32, as sd-scripts says)")
    parser.add_argument("--device", default=None, help="where the SVDs run (cuda for a GPU; default cpu)")
    parser.add_argument("--model", default=None, help="base checkpoint (small): also report the output error")
    return parser


# The arguments are checked before torch and the library load (seconds): --help and a bad flag answer at once.
if __name__ == "__main__":
    check_command_line(build_parser)

import torch  # noqa: E402

from networks.lora_files import LoRAWeights  # noqa: E402
from networks.lora_svd import DYNAMIC_METHODS, choose_rank, factors, svd_of_product, written_error  # noqa: E402
from tools.devices import device_from_flag  # noqa: E402
from tools.lora_common import (  # noqa: E402
    check_output_path,
    one_line,
    output_error,
    read_lora_file,
    save_dtype,
    write_lora_file,
)


def resize_weights(weights: dict[str, LoRAWeights], new_rank: int, method: str | None = None,
                   param: float | None = None, device=None,
                   dtype: torch.dtype = torch.float32) -> tuple[dict[str, LoRAWeights], list[dict]]:
    """Every module resized; returns (new weights, one stats row per module). rel_error is the delta's as
    written in `dtype` (the truncation's alone said 0 for a bf16 file at its own rank, 2.4e-3 off)."""
    out, rows = {}, []
    for name, w in weights.items():
        spectrum = svd_of_product(w.up, w.down, device)  # of up @ down: the scale stays in alpha
        k = choose_rank(spectrum, new_rank, method, param)
        down, up = factors(spectrum, k)
        out[name] = LoRAWeights(down, up, w.scale * k, w.magnitude)
        rows.append({"module": name, "old_rank": w.rank, "new_rank": k, "alpha": w.scale * k,
                     "fro_retained": spectrum.fro_retained(k), "sum_retained": spectrum.sum_retained(k),
                     "rel_error": spectrum.rel_error(k) if dtype == torch.float32
                     else written_error(w.up.float() @ w.down.float(), up, down, dtype)})
    return out, rows


def check_args(new_rank: int, method: str | None, param: float | None) -> None:
    if new_rank < 1:
        raise ValueError(f"--new_rank {new_rank}: must be >= 1 (with --dynamic_method it is the largest rank kept)")
    if method is not None and method not in DYNAMIC_METHODS:
        raise ValueError(f"--dynamic_method {method!r}: expected one of {', '.join(DYNAMIC_METHODS)}")
    if (method is None) != (param is None):
        raise ValueError("--dynamic_method and --dynamic_param go together")
    if method is not None and not param > 0:
        raise ValueError(f"--dynamic_param {param}: must be > 0")
    if method in ("sv_fro", "sv_cumulative") and param > 1:
        raise ValueError(f"--dynamic_param {param}: {method} takes a fraction in (0, 1]")


def resize_lora(src: str, dst: str, new_rank: int, method: str | None = None, param: float | None = None,
                precision: str | None = None, device=None, model: str | None = None) -> dict:
    """Resize `src` into `dst`; returns {"modules": rows, "summary": ..., "output_error": ... or None}."""
    check_args(new_rank, method, param)
    check_output_path(dst, src)
    lora = read_lora_file(src, "resize_lora", keep_beside=True)  # ComfyUI's .diff_b ...: no rank to resize, kept
    measure = output_error(model, src) if model else None  # a --model that cannot take the LoRA: before writing
    dtype = save_dtype(precision, lora.dtype)
    weights, rows = resize_weights(lora.weights, new_rank, method, param, device, dtype)
    old_dim = max(w.rank for w in lora.weights.values())
    metadata = dict(lora.metadata)
    comment = metadata.get("ss_training_comment", "")
    if method:
        metadata.update(ss_network_dim="Dynamic", ss_network_alpha="Dynamic",
                        ss_training_comment=f"Dynamic resize with {method}: {param} from {old_dim}; {comment}")
    else:  # the ranks written: --new_rank above a module's rank keeps that rank
        alphas, ranks = {r["alpha"] for r in rows}, {r["new_rank"] for r in rows}
        dim = str(ranks.pop()) if len(ranks) == 1 else "Dynamic"
        metadata.update(ss_network_dim=dim, ss_network_alpha=str(alphas.pop()) if len(alphas) == 1 else "Dynamic",
                        ss_training_comment=f"dimension is resized from {old_dim} to {dim}; {comment}")
    metadata["lora_resized"] = json.dumps({"from": os.path.basename(src), "new_rank": new_rank,
                                           "dynamic_method": method, "dynamic_param": param})  # fmt: skip
    write_lora_file(dst, weights, lora.fmt, lora.prefix, dtype, metadata, lora.beside)
    fro = [r["fro_retained"] for r in rows]
    summary = {"modules": len(rows), "mean_fro_retained": statistics.fmean(fro), "min_fro_retained": min(fro),
               "max_rel_error": max(r["rel_error"] for r in rows),
               "ranks": sorted({r["new_rank"] for r in rows})}  # fmt: skip
    error = measure(dst) if measure else None
    return {"modules": rows, "summary": summary, "output_error": error}


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
        done = resize_lora(args.lora, args.save_to, args.new_rank, args.dynamic_method, args.dynamic_param,
                           args.save_precision, device_from_flag(args.device, "cpu"), args.model)
    except (ValueError, OSError) as e:  # CheckpointError is a ValueError
        print(one_line(e), file=sys.stderr)
        return 2
    for r in done["modules"]:
        print(f"{r['module']:70s} rank {r['old_rank']:4d} -> {r['new_rank']:4d}  fro retained {r['fro_retained']:7.2%}  "
              f"sum(S) retained {r['sum_retained']:7.2%}  rel error {r['rel_error']:.2e}")
    s = done["summary"]
    print(f"{s['modules']} modules -> {args.save_to}: ranks {s['ranks']}, Frobenius energy retained mean "
          f"{s['mean_fro_retained']:.2%} min {s['min_fro_retained']:.2%}, max relative delta error {s['max_rel_error']:.2e}")
    if done["output_error"]:
        e = done["output_error"]
        print(f"output error on {args.model}: {e['rel_to_lora_effect']:.2e} of the LoRA's effect, "
              f"{e['rel_to_output']:.2e} of the output")
    return 0


if __name__ == "__main__":
    exit_without_collecting(main)
