"""Combine several LoRAs, each with a ratio, into one LoRA file.

    python tools/combine_loras.py --lora a.safetensors:0.8 b.safetensors:1.0 --save_to OUT.safetensors \
        [--mode concat | --mode svd --rank R] [--save_precision fp32|bf16|fp16|float] [--device cuda]

Per module, the combined delta is sum_i ratio_i * (alpha_i / r_i) * up_i @ down_i over the files
that have the module (float32):
  concat (default, exact): down = [down_1; down_2; ...] stacked along the rank, up = [ratio_1 s_1 up_1,
      ratio_2 s_2 up_2, ...] side by side (s_i = alpha_i / r_i folded into up), alpha = the summed
      rank (scale 1). Applying the result equals applying every LoRA at its ratio.
  svd: the same sum compressed to rank R per module by its SVD (exact SVD of the stacked factors,
      networks/lora_svd.py; the best rank-R approximation), alpha = R; the retained Frobenius
      energy and relative error per module are printed.

Names: LoRAs in one naming combine module by module. When every input has dotted names (PEFT /
diffusers, ComfyUI), the output has the first input's layout; when any is kohya, dotted names are
turned into kohya names (`lora_unet_`, `lora_te_` for `model.layers...` LLM paths) and the output is
kohya. LoRAs of one model in two namings (its original and diffusers' names, or ComfyUI's own fused
qkv beside split q / k / v: the spec's module_map / comfy_map) are read as tools/merge_lora.py reads them, by the
model's own module paths (a fused module split by rows, parts joined: exact), and combined in those.
Whole deltas beside the LoRAs (ComfyUI's extraction: `.diff` / `.diff_b`) are summed key by key at the ratios
(exact) where every input is in the output's layout. DoRA (its delta is not additive) and LyCORIS files are refused.
The metadata is the first input's, with `lora_combined` listing the files, ratios and mode, every input's training
folders and tags (ss_dataset_dirs, ss_tag_frequency: combined_folders) and the output's own name (ss_output_name,
modelspec.title where present).
Errors are one line on stderr, exit status 2, and nothing is written.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

if __package__ in (None, ""):  # run as a script: make `library` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.cli import Parser, check_command_line, save_precision_name, exit_without_collecting  # noqa: E402


# sd-scripts' svd_merge_lora.py and its models' merge_lora.py scripts without a base (LoRAs into one) -> ours. Their
# concat scales up and down by sqrt(ratio) each time (ratio twice) and keeps the first file's alpha over the summed
# rank: theirs at ratio 1 is half the sum; ours stacks each LoRA at its own strength (alpha = the summed rank).
PEER_FLAGS = {"--models": "--lora PATH:RATIO ...", "--ratios": "--lora PATH:RATIO ...",
              "--new_rank": "--mode svd --rank N", "--concat": "--mode concat (the default)",
              "--shuffle": "none: --mode concat stacks the factors as they are",
              "--new_conv_rank": "none: ours combines Linear LoRAs (a conv LoRA is refused)",
              "--no_metadata": "none: ours always writes the header", "--lbws": "none (SD / SDXL block weights)",
              "--precision": "none: the deltas and SVDs run in float32"}


def build_parser() -> Parser:
    parser = Parser(description=__doc__.split("\n\n")[0], peer_flags=PEER_FLAGS)
    parser.add_argument("--lora", required=True, nargs="+", help="LoRA files as path[:ratio] (ratio 1 when left out)")
    parser.add_argument("--save_to", required=True, help="output .safetensors")
    parser.add_argument("--mode", choices=["concat", "svd"], default="concat", help="concat: exact; svd: compress to --rank")
    parser.add_argument("--rank", type=int, default=None, help="--mode svd: rank of every module")
    parser.add_argument("--save_precision", type=save_precision_name, choices=["fp32", "bf16", "fp16"], default=None,
                        help="default: the first input's dtype (float: fp32, as sd-scripts says)")
    parser.add_argument("--device", default=None, help="where the SVDs run (cuda for a GPU; default cpu)")
    return parser


# The arguments are checked before torch and the library load (seconds): --help and a bad flag answer at once.
if __name__ == "__main__":
    check_command_line(build_parser)

import torch  # noqa: E402

from library.io import CheckpointError  # noqa: E402
from library.models.registry import arch_spec  # noqa: E402
from networks.lora_arch import lora_files  # noqa: E402
from networks.lora_files import KOHYA_PREFIXES, KOHYA_TEXT_ENCODERS, PEFT_PREFIXES, LoRAWeights, beside_lora_note, kohya_name  # noqa: E402
from networks.lora_reader import read_for_model, split_whole_deltas  # noqa: E402
from networks.lora_svd import factors, svd_of_product  # noqa: E402
from tools.devices import device_from_flag  # noqa: E402
from tools.lora_common import (  # noqa: E402
    DOTTED_TEXT_ENCODERS,
    LoRAFile,
    LoRASpec,
    check_output_path,
    named_as,
    one_line,
    parse_lora_spec,
    read_lora_file,
    save_dtype,
    write_lora_file,
)


DENOISER_PREFIXES = ("lora_unet_", "lora_transformer_")  # sd-scripts' and musubi-tuner's; OneTrainer's


def _kohya_named(weights: dict[str, LoRAWeights], denoiser: str) -> dict[str, LoRAWeights]:
    """Names in one kohya naming, the denoiser's under `denoiser` (the first kohya input's prefix): the same
    module under lora_unet_ in one file and lora_transformer_ in another was two modules. Dotted paths
    become kohya names (`lora_te_` for `model.layers...` LLM paths)."""
    other = next(p for p in DENOISER_PREFIXES if p != denoiser)

    def kohya(name: str) -> str:
        if "." in name or not name.startswith(KOHYA_PREFIXES):
            return kohya_name(name, "lora_te" if name.startswith("model.") else denoiser[:-1])
        return denoiser + name[len(other) :] if name.startswith(other) else name

    return {kohya(n): w for n, w in weights.items()}


def _denoiser_prefix(loras: list[LoRAFile]) -> str:
    names = (n for lora in loras if lora.fmt == "kohya" for n in lora.weights)
    return next((p for n in names for p in DENOISER_PREFIXES if n.startswith(p)), "lora_unet_")


def _flat(name: str) -> str:
    """A module name without its kohya or PEFT prefix (a file of transformer. and text_encoder. modules keeps
    it), '_'-flattened: a kohya and a dotted name of one module alike."""
    prefix = next((p for p in (PEFT_PREFIXES if "." in name else KOHYA_PREFIXES) if name.startswith(p)), "")
    return name[len(prefix) :].replace(".", "_")


def _renamed(lora: LoRAFile, read: dict[str, LoRAWeights]) -> bool:
    """True where the reader names a module of `lora` otherwise than the file does: the model's other naming."""
    own = {_flat(n) for n in lora.weights}
    return any(_flat(p) not in own for p in read)


def _in_model_names(loras: list[LoRAFile], arch: str | None) -> list[dict[str, LoRAWeights]] | None:
    """Where the inputs are in two namings of `arch` (its original and diffusers' names, or ComfyUI's own fused
    qkv beside split q / k / v): each input's modules by the model's own module paths, read as merge_lora and
    the loaders read them (networks/lora_reader.py: a fused module split by rows, parts joined, exact), with its
    kohya text-encoder modules as they are. None where they share one naming: each file's names are kept (side
    by side, two namings of one module were two modules, and every loader refuses such a file)."""
    files = lora_files().get(arch)
    if len(loras) < 2 or files is None or not (files.module_map or files.comfy_map):
        return None
    with warnings.catch_warnings(record=True) as said:  # the reader's (text encoders left out ...): said if used
        warnings.simplefilter("always")
        reads = [read_for_model(lora.path, arch, (), name=lora.path).weights for lora in loras]
    renamed = [_renamed(lora, read) for lora, read in zip(loras, reads)]
    if all(renamed) or not any(renamed):
        return None
    for warning in said:
        print(f"warning: {warning.message}", file=sys.stderr)
    return [{**read, **{n: w for n, w in lora.weights.items() if n.startswith((*KOHYA_TEXT_ENCODERS, *DOTTED_TEXT_ENCODERS))}}
            for lora, read in zip(loras, reads)]


def _check_architectures(loras: list[LoRAFile]) -> str | None:
    """Every input whose architecture its names tell (networks/lora_arch.py detect_arch) is of one
    model: deltas of two models added module by module would make a file that fits neither. Returns
    that architecture (None where no input's names tell one)."""
    from networks.lora_arch import detect_arch

    known = []
    for lora in loras:
        try:
            known.append((lora, detect_arch(lora.shapes, lora.metadata)))
        except CheckpointError:  # e.g. attention projections only: no architecture to compare
            continue
    for lora, arch in known[1:]:
        if arch != known[0][1]:
            first, first_arch = known[0]
            raise CheckpointError(f"{first.path} (for {arch_spec(first_arch).title}) and {lora.path} (for "
                                  f"{arch_spec(arch).title}) are LoRAs of different models: combine_loras combines one model's")
    return known[0][1] if known else None


def combined_whole_deltas(specs: list[LoRASpec], loras: list[LoRAFile], fmt: str, prefix: str) -> dict[str, torch.Tensor]:
    """The inputs' whole deltas (`.diff` / `.diff_b`, ComfyUI's extraction; read_lora_file's `beside`) summed key by key,
    sum_i ratio_i * diff_i in float32: exact, as the deltas are added to the weights. Only where every input is in the
    output's layout (its names are written as read); otherwise, and for other tensors beside a LoRA (bundled
    embeddings), each file's are left out with one warning."""
    kept = all((lora.fmt, lora.prefix) == (fmt, prefix) for lora in loras)
    out: dict[str, torch.Tensor] = {}
    for spec, lora in zip(specs, loras):
        others, whole = split_whole_deltas(lora.beside)
        if others or (whole and not kept):
            left = {**others, **({} if kept else whole)}
            print(f"warning: {lora.path}: left out {beside_lora_note(left)}: " + (
                "combine_loras sums the whole .diff / .diff_b deltas only" if kept else
                "the inputs are in different layouts, and combine_loras renames the down / up modules only"), file=sys.stderr)
        for key, diff in whole.items() if kept else ():
            if key in out and out[key].shape != diff.shape:
                raise CheckpointError(f"{lora.path}: '{key}' is a delta of shape {tuple(diff.shape)}, another input's "
                                      f"{tuple(out[key].shape)}")
            out[key] = out.get(key, torch.zeros(diff.shape)) + spec.ratio * diff.float()
    return out


def gather(specs: list[LoRASpec]) -> tuple[dict[str, list[tuple[float, LoRAWeights]]], list[LoRAFile], str, str]:
    """{module name: [(ratio, LoRA)]} in a common naming, the files, and the output (fmt, prefix)."""
    loras = [read_lora_file(s.path, "combine_loras", keep_beside=True) for s in specs]
    for lora in loras:
        if lora.has_dora:
            raise CheckpointError(f"{lora.path}: a DoRA file (dora_scale / lora_magnitude_vector): its delta is not "
                                  "additive, so it cannot be combined; merge it into the base with tools/merge_lora.py")  # fmt: skip
    arch = _check_architectures(loras)
    weights = _in_model_names(loras, arch) or [lora.weights for lora in loras]
    kohya = any(lora.fmt == "kohya" for lora in loras)
    if kohya:  # a diffusers text encoder's modules have no kohya name here (as convert_lora --to kohya leaves them out)
        for lora, named in zip(loras, weights):
            if left := [n for n in named if n.startswith(DOTTED_TEXT_ENCODERS)]:
                print(f"warning: {lora.path}: left out {len(left)} text-encoder modules ({left[0]} ...): the output is "
                      f"kohya, which names sd-scripts' lora_te1_ / lora_te3_ modules only", file=sys.stderr)
        weights = [{n: w for n, w in named.items() if not n.startswith(DOTTED_TEXT_ENCODERS)} for named in weights]
    denoiser = _denoiser_prefix(loras)
    names = [_kohya_named(w, denoiser) if kohya else w for w in weights]
    modules: dict[str, list[tuple[float, LoRAWeights]]] = {}
    for spec, lora, named in zip(specs, loras, names):
        for name, w in named.items():
            first = modules.get(name, [(0, w)])[0][1]
            if (first.up.shape[0], first.down.shape[1]) != (w.up.shape[0], w.down.shape[1]):
                raise CheckpointError(f"{lora.path}: module '{name}' has a delta of shape {(w.up.shape[0], w.down.shape[1])}, "
                                      f"another input {(first.up.shape[0], first.down.shape[1])}")  # fmt: skip
            modules.setdefault(name, []).append((spec.ratio, w))
    fmt, prefix = ("kohya", "") if kohya else (loras[0].fmt, loras[0].prefix)
    return modules, loras, fmt, prefix


FOLDER_KEYS = ("ss_dataset_dirs", "ss_tag_frequency")  # sd-scripts' {training folder: ...}: A1111 shows the tags


def combined_folders(loras: list[LoRAFile], key: str) -> str | None:
    """The inputs' `key` entries (FOLDER_KEYS, json {folder: ...}) as one, a folder name met again as "name (2)" (as
    sd-scripts names a repeated folder); None where no input has one."""
    folders: dict = {}
    for lora in loras:
        try:
            entries = json.loads(lora.metadata.get(key) or "{}")
        except json.JSONDecodeError:
            entries = None
        for name, value in (entries.items() if isinstance(entries, dict) else ()):
            unique, n = name, 2
            while unique in folders:
                unique, n = f"{name} ({n})", n + 1
            folders[unique] = value
    return json.dumps(folders) if any(key in lora.metadata for lora in loras) else None


def stacked(parts: list[tuple[float, LoRAWeights]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(down [R, in], up [out, R]) float32 with up @ down = sum ratio * scale * up_i @ down_i."""
    down = torch.cat([w.down.float() for _, w in parts], 0)
    up = torch.cat([w.up.float() * (ratio * w.scale) for ratio, w in parts], 1)
    return down, up


def combine_loras(specs: list[LoRASpec], save_to: str, mode: str = "concat", rank: int | None = None,
                  precision: str | None = None, device=None) -> list[dict]:
    """Write the combined LoRA; returns one row per module (rank, retained energy, error)."""
    if mode not in ("concat", "svd"):
        raise ValueError(f"--mode {mode!r}: expected concat or svd")
    if (mode == "svd") != (rank is not None) or (rank is not None and rank < 1):
        raise ValueError(f"--rank {rank}: --mode svd needs --rank R >= 1, --mode concat takes no --rank")
    check_output_path(save_to, *(s.path for s in specs))
    modules, loras, fmt, prefix = gather(specs)
    first = loras[0]
    out, rows = {}, []
    for name, parts in modules.items():
        down, up = stacked(parts)
        if mode == "concat":
            out[name] = LoRAWeights(down, up, float(down.shape[0]))
            rows.append({"module": name, "rank": down.shape[0], "fro_retained": 1.0, "rel_error": 0.0})
            continue
        spectrum = svd_of_product(up, down, device)
        k = min(rank, len(spectrum.S))
        new_down, new_up = factors(spectrum, k)
        out[name] = LoRAWeights(new_down, new_up, float(k))
        rows.append({"module": name, "rank": k, "fro_retained": spectrum.fro_retained(k), "rel_error": spectrum.rel_error(k)})
    ranks = {r["rank"] for r in rows}
    metadata = dict(first.metadata)
    metadata["ss_network_dim"] = metadata["ss_network_alpha"] = str(ranks.pop()) if len(ranks) == 1 else "Dynamic"
    for key in FOLDER_KEYS:
        if (folders := combined_folders(loras, key)) is not None:
            metadata[key] = folders
    metadata = named_as(metadata, save_to)
    metadata["lora_combined"] = json.dumps({"mode": mode, "rank": rank,
                                            "loras": [{"file": os.path.basename(s.path), "ratio": s.ratio} for s in specs]})  # fmt: skip
    whole = combined_whole_deltas(specs, loras, fmt, prefix)
    write_lora_file(save_to, out, fmt, prefix, save_dtype(precision, first.dtype), metadata, whole)
    return rows


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
        specs = [parse_lora_spec(s) for s in args.lora]
        rows = combine_loras(specs, args.save_to, args.mode, args.rank, args.save_precision,
                             device_from_flag(args.device, "cpu"))
    except (ValueError, OSError, RuntimeError) as e:  # CheckpointError is a ValueError; RuntimeError: bad --device
        print(one_line(e), file=sys.stderr)
        return 2
    if args.mode == "svd":
        for r in rows:
            print(f"{r['module']:70s} rank {r['rank']:4d}  fro retained {r['fro_retained']:7.2%}  rel error {r['rel_error']:.2e}")
    ranks = sorted({r["rank"] for r in rows})
    print(f"{len(specs)} LoRAs -> {len(rows)} modules ({args.mode}, ranks {ranks}) -> {args.save_to}; Frobenius energy "
          f"retained min {min(r['fro_retained'] for r in rows):.2%}")
    return 0


if __name__ == "__main__":
    exit_without_collecting(main)
