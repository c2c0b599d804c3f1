"""Extract a LoRA from the difference between a fine-tuned checkpoint and its base.

    python tools/extract_lora.py --model BASE --tuned TUNED --save_to OUT.safetensors \
        (--rank R [--svd lowrank] | --energy X [--rank R]) [--save_precision fp32|bf16|fp16|float] [--device cuda]

BASE and TUNED are read as tools/merge_lora.py reads a base (open_base: a diffusion transformer's
single file, ComfyUI prefixes included, or diffusers folder; a Hugging Face LLM folder or file;
pre-quantized fp8 files are dequantized as merge_lora does) and must be the same family and naming.
The LoRA targets are the architecture's Linears that the spec's LoRA targets name (what training
adapts: e.g. the block Linears, with or without modulation, and some embedders; for an LLM the
attention and MLP projections), found through the same key maps merge_lora uses. A single file that
fuses or renames the model's modules (a fused qkv: the family's checkpoint_names, parts_are_model) gives
each part its own LoRA, from its rows' delta, in the model's name, as training and merge_lora name it.

Per target module, D = W_tuned - W_base (float32), and its SVD D = U S Vh (torch.linalg.svd on
--device) gives the best rank-k approximation: down = Vh_k, up = U_k S_k, alpha = k (scale 1).
k = --rank, or with --energy X the smallest k whose retained Frobenius energy
sqrt(sum_{i<k} S_i^2 / sum S_i^2) is >= X (at most --rank when given). Modules with D = 0 are left
out. --svd lowrank (with --rank only) takes the top rank + 8 singular triplets by randomized SVD
(torch.svd_lowrank, 4 power iterations, fixed seed): exact for a delta of rank <= R + 8 (a merged
LoRA), otherwise near the best rank-R approximation, and many times faster than the full SVD on
large weights; the error printed is measured, so it shows what was lost. Printed per module: k, the retained energy, and the measured relative error of the delta
actually written, ||D - (alpha / k) up @ down|| / ||D|| (after casting to --save_precision), and
||D|| / ||W_base||. Tensors that differ but no LoRA can carry (biases, norms, embeddings) are counted.

Streaming: one module at a time, base and tuned weight read, differenced, decomposed and dropped;
peak memory is a few copies of the largest weight plus the LoRA being built.

Output: kohya (`lora_unet_` for a diffusion transformer, `lora_te_` for LLMs) in the model's own module
names (our trainer's), or PEFT with `transformer.` for a checkpoint in the other naming of a model's
two (a diffusers folder of a BFL-named model: diffusers names; our loader and merge_lora convert them
to BFL). It loads with networks.lora.LoRANetwork.load_weights, merge_lora
and generate. Errors are one line on stderr, exit status 2, and nothing is written.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import sys
import time
from dataclasses import dataclass

if __package__ in (None, ""):  # run as a script: make `library` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.cli import Parser, check_command_line, save_precision_name, exit_without_collecting  # noqa: E402


# sd-scripts' and musubi-tuner's LoRA-extraction scripts' flags -> ours
PEER_FLAGS = {"--model_org": "--model", "--model_tuned": "--tuned", "--dim": "--rank",
              # theirs clip U S and Vh at this quantile (0.99 unset): each module's delta weaker and less exact
              "--clamp_quantile": "none: ours keeps the SVD's factors unclipped",
              "--no_metadata": "none: ours always writes the header (rank, base, ModelSpec)",
              "--mem_eff_safe_open": "none: ours reads the checkpoints tensor by tensor",
              "--conv_dim": "none: ours extracts the transformer's Linear layers",
              "--load_precision": "none: the differences and SVDs run in float32"}


def build_parser() -> Parser:
    parser = Parser(description=__doc__.split("\n\n")[0], peer_flags=PEER_FLAGS)
    parser.add_argument("--model", required=True, help="base checkpoint: file or folder")
    parser.add_argument("--tuned", required=True, help="fine-tuned checkpoint of the same model and layout")
    parser.add_argument("--save_to", required=True, help="output LoRA .safetensors")
    parser.add_argument("--rank", type=int, default=None, help="rank of every module (the cap with --energy)")
    parser.add_argument("--energy", type=float, default=None, help="keep this Frobenius fraction per module, e.g. 0.95")
    parser.add_argument("--save_precision", type=save_precision_name, choices=["fp32", "bf16", "fp16"], default=None,
                        help="default fp32 (float: fp32, as sd-scripts says)")
    parser.add_argument("--device", default=None, help="where the SVDs run (cuda for a GPU; default cpu)")
    parser.add_argument("--svd", choices=["full", "lowrank"], default="full",
                        help="lowrank: randomized SVD of the top rank + 8 (with --rank; much faster on big weights)")
    return parser


# The arguments are checked before torch and the library load (seconds): --help and a bad flag answer at once.
if __name__ == "__main__":
    check_command_line(build_parser)

import torch  # noqa: E402

from library.io import CheckpointError  # noqa: E402
from library.precision.fp8_checkpoints import SCALE_SUFFIXES  # noqa: E402
from networks.lora_args import lora_targets  # noqa: E402
from networks.lora_files import (FOLDED_MARK, LoRAWeights, build_metadata, dim_and_alpha, modelspec_fields,  # noqa: E402
                                 write_kohya, write_peft)
from networks.lora_svd import factors, rank_for_energy, svd_lowrank_of_matrix, svd_of_matrix, written_error  # noqa: E402
from tools.devices import device_from_flag  # noqa: E402
from tools.lora_common import check_output_path, one_line, save_dtype  # noqa: E402
from tools.merge_base import Base, open_base  # noqa: E402
from tools.merge_lora import Fp8BasePlan  # noqa: E402


def read_weight(base: Base, key: str) -> torch.Tensor:
    """A checkpoint tensor as float32 (fp8 codes dequantized with their scale, as merge_lora does)."""
    if base.fp8 is not None:
        return Fp8BasePlan(base, None, {}).dequantized(key)
    return base.reader.get(key).float()


@dataclass(frozen=True)
class Target:
    """One LoRA module to extract: the rows `rows` of checkpoint module `module`'s weight, written as `name`."""

    module: str  # the checkpoint's module path (a key of base.weight_key)
    name: str  # the LoRA module written
    rows: tuple[tuple[int, int], ...] | None = None  # row ranges of the weight (None: all of it)

    def of(self, weight: torch.Tensor) -> torch.Tensor:
        return weight if self.rows is None else torch.cat([weight[start:end] for start, end in self.rows])


def target_modules(base: Base) -> list[Target]:
    """The LoRA modules the arch's LoRA targets name, in checkpoint order. A module in the other naming
    of the model's module map is matched through the module it is part of and written in its own name.
    A checkpoint module holding model modules under other names (parts_are_model: a fused qkv, a renamed
    projection) gives each part a target names its own LoRA, in the model's name: training gives each
    part its own, and a fused name matches no target (its rows' deltas were left out)."""
    spec = lora_targets(base.family)  # a packed weight's LoRA (experts) is not extracted: Linears only
    patterns = [re.compile(p) for t, p in spec.targets.items() if t not in spec.packed_types]
    wanted = lambda name: any(r.fullmatch(name) for r in patterns)  # noqa: E731
    targets = []
    for module in base.weight_key:
        parts = base.model_parts(module)
        if parts is None:
            targets += [Target(module, module)] if any(map(wanted, base.spec_names(module))) else []
        else:
            targets += [Target(module, name, tuple(rows)) for name, rows in parts.items() if wanted(name)]
    return targets


def extract_module(delta: torch.Tensor, rank: int | None, energy: float | None, dtype: torch.dtype, device=None,
                   lowrank: bool = False):
    """(LoRAWeights in `dtype`, stats) of the best low-rank approximation of `delta` [out, in]."""
    spectrum = svd_lowrank_of_matrix(delta, rank, device) if lowrank else svd_of_matrix(delta, device)
    k = rank_for_energy(spectrum, energy, rank) if energy is not None else min(rank, len(spectrum.S))
    down, up = factors(spectrum, k)
    w = LoRAWeights(down.to(dtype), up.to(dtype), float(k))
    return w, {"rank": k, "fro_retained": spectrum.fro_retained(k), "rel_error": written_error(delta, up, down, dtype)}


def open_pair(model: str, tuned: str) -> tuple[Base, Base]:
    base, other = open_base(model, "extract_lora"), open_base(tuned, "extract_lora")
    if (base.family, base.naming) != (other.family, other.naming):
        raise CheckpointError(f"--tuned {tuned}: a {other.family} checkpoint in {other.naming} names, the base {model} "
                              f"is {base.family} in {base.naming} names")  # fmt: skip
    return base, other


def extract_lora(model: str, tuned: str, save_to: str, rank: int | None = None, energy: float | None = None,
                 precision: str | None = None, device=None, log=print, svd: str = "full") -> dict:
    """Write the extracted LoRA to `save_to`; returns {"modules": rows, "skipped": [...], "other_changed": n}."""
    if rank is None and energy is None:
        raise ValueError("give --rank R or --energy X (the smallest rank keeping that Frobenius fraction)")
    if rank is not None and rank < 1:
        raise ValueError(f"--rank {rank}: must be >= 1")
    if energy is not None and not 0 < energy <= 1:
        raise ValueError(f"--energy {energy}: must be in (0, 1]")
    if svd not in ("full", "lowrank") or (svd == "lowrank" and (energy is not None or rank is None)):
        raise ValueError(f"--svd {svd}: expected full, or lowrank with --rank R and no --energy (it sees only the top of the spectrum)")
    check_output_path(save_to, model, tuned)
    base, other = open_pair(model, tuned)
    check_output_path(save_to, *base.reader.files, *other.reader.files)  # a file of a folder base, or a shard
    dtype = save_dtype(precision, torch.float32)
    targets = target_modules(base)
    other_changed = _other_changed(base, other, {base.weight_key[t.module] for t in targets})  # before minutes of SVDs
    weights, rows, skipped = {}, [], []
    for module, parts in itertools.groupby(targets, key=lambda t: t.module):  # a fused weight is read once
        key = base.weight_key[module]
        if key not in other.reader or other.reader.shape(key) != base.reader.shape(key):
            raise CheckpointError(f"--tuned {tuned}: no weight '{key}' of shape {base.reader.shape(key)} (the base has it)")
        w_base = read_weight(base, key)
        delta = read_weight(other, key) - w_base
        if bad := int((~torch.isfinite(delta)).sum()):  # linalg.svd's own error named no weight
            raise CheckpointError(f"'{key}' of --tuned {tuned} minus the base {model} holds {bad} non-finite value"
                                  f"{'s' * (bad > 1)} (NaN / inf in either checkpoint)")
        for target in parts:
            row = _extract_target(target, target.of(delta), target.of(w_base), weights, rank, energy, dtype, device, svd)
            if row is None:
                skipped.append(target.name)
                continue
            rows.append(row)
            log(f"{target.name:60s} {str(tuple(row['shape'])):14s} rank {row['rank']:4d}  fro retained "
                f"{row['fro_retained']:7.2%}  rel error {row['rel_error']:.2e}  |dW|/|W| {row['delta_rel_to_weight']:.2e}")
        del w_base, delta
    if not weights:
        raise CheckpointError(f"--tuned {tuned}: no LoRA target weight differs from the base {model}")
    dim, alpha = dim_and_alpha([w.rank for w in weights.values()], [w.alpha for w in weights.values()])  # as written
    metadata = build_metadata(network_module="networks.lora", network_dim=dim, network_alpha=alpha, base_model=base.path,
                              base_model_version=base.version,  # what train_lora.py writes: merge checks it
                              **extracted_modelspec(base, save_to))
    metadata["lora_extracted"] = json.dumps({"base": os.path.basename(base.path), "tuned": os.path.basename(other.path),
                                             "rank": rank, "energy": energy, "family": base.family})  # fmt: skip
    if not base.native:  # diffusers names of a BFL-named model: PEFT, as diffusers writes it
        write_peft(weights, save_to, prefix="transformer", dtype=dtype, metadata={**metadata, FOLDED_MARK: "true"})
    else:
        write_kohya(weights, save_to, dtype, metadata, prefix=lora_targets(base.family).kohya_prefix)
    return {"modules": rows, "skipped": skipped, "other_changed": other_changed, "family": base.family}


def extracted_modelspec(base: Base, save_to: str) -> dict[str, str]:
    """The ModelSpec keys sd-scripts' LoRA extraction writes (sai_model_spec.build_metadata): the release's
    architecture + "/lora", the title from the file's name, its default resolution 1024x1024 (an extraction
    trains at none), the date; none for a release its spec names no ModelSpec strings for (the LLM)."""
    from library.models.registry import arch_specs

    spec = arch_specs().get(base.family)
    names = spec.modelspec_of(base.version) if spec is not None and base.version else None
    title = os.path.splitext(os.path.basename(save_to.rstrip("/")))[0]
    return modelspec_fields(names, title, "1024x1024", time.time()) if names else {}


def _extract_target(target: Target, delta: torch.Tensor, w_base: torch.Tensor, weights: dict, rank, energy, dtype,
                    device, svd: str) -> dict | None:
    """Add `target`'s LoRA of `delta` to `weights`; its stats row, or None where its delta is zero."""
    if not delta.any():
        return None
    weights[target.name], stats = extract_module(delta, rank, energy, dtype, device, lowrank=svd == "lowrank")
    return {"module": target.name, "shape": list(delta.shape), **stats,
            "delta_rel_to_weight": float(delta.norm() / w_base.norm().clamp_min(1e-30))}  # fmt: skip


# What a quantized checkpoint keeps beside a target's weight (fp8 / comfy_quant scales and markers, nvfp4's
# second scale): it changes with the weight, and is no "other tensor" of the summary.
WEIGHT_COMPANIONS = (*SCALE_SUFFIXES, ".weight_scale_2")


def _other_changed(base: Base, other: Base, done: set[str]) -> int:
    """How many tensors outside the LoRA targets differ between the checkpoints (one at a time). Where their
    dtypes differ (an fp8 base's e4m3 bias beside a bf16 fine-tune's), the other is cast to the base's first:
    a mixed pair is no error (it raised after every module's SVD). A scaled fp8 weight beside a float one is
    not compared: its codes are of weight / scale, which no cast of the float weight gives."""
    companions = lambda key: {key[: -len(".weight")] + s for s in WEIGHT_COMPANIONS} if key.endswith(".weight") else set()  # noqa: E731
    done = done.union(*(companions(key) for key in done))
    changed = 0
    for key in base.reader.keys():
        if key in done or key not in other.reader or other.reader.shape(key) != base.reader.shape(key):
            continue
        a, b = base.reader.get(key), other.reader.get(key)
        if a.dtype == b.dtype:
            changed += not torch.equal(a, b)
        elif not any(c in base.reader for c in companions(key)):
            changed += not torch.equal(a.float(), b.to(a.dtype).float())
    return changed


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
        done = extract_lora(args.model, args.tuned, args.save_to, args.rank, args.energy, args.save_precision,
                            device_from_flag(args.device, "cpu"), svd=args.svd)
    except (ValueError, OSError, RuntimeError) as e:  # CheckpointError is a ValueError; RuntimeError: bad --device
        print(one_line(e), file=sys.stderr)
        return 2
    rows = done["modules"]
    print(f"{len(rows)} {done['family']} modules -> {args.save_to}: ranks {sorted({r['rank'] for r in rows})}, "
          f"Frobenius energy retained min {min(r['fro_retained'] for r in rows):.2%}, max relative delta error "
          f"{max(r['rel_error'] for r in rows):.2e}; {len(done['skipped'])} target weights unchanged; "
          f"{done['other_changed']} other tensors differ and are not in the LoRA (biases, norms, embeddings ...)")
    return 0


if __name__ == "__main__":
    exit_without_collecting(main)
