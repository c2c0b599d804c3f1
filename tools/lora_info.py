"""Describe a LoRA file: layout, network type, model architecture, modules, ranks, alphas, dtypes,
training metadata and which model it fits.

    python tools/lora_info.py LORA.safetensors [--model BASE] [--json]   # or a PEFT adapter folder

- format: kohya (`lora_unet_*` / `lora_te_*`), diffusers (PEFT keys under `transformer.`), PEFT
  (`base_model.model.*`, other prefixes), comfy (`diffusion_model.*`), or lycoris (LyCORIS' own keys).
- network: LoRA, DoRA (`dora_scale` / `lora_magnitude_vector`), LoKr (`lokr_*`), LoHa (`hada_*`),
  OFT, full (`diff`), (IA)^3 (`on_input`); LyCORIS with `dora_scale` is reported as e.g. "LoKr + DoRA".
- arch (the transformer architecture) and naming (bfl, diffusers, hf) from the module names, as each
  architecture's spec describes them (library/models/<folder>/spec.py, LORA_FILES.info_markers; an
  architecture sharing another's names is told apart as tools/convert_lora.py does; names several
  architectures have, such as attention projections alone, by the release their width and block counts
  fit: networks/lora_arch.py arch_by_shapes, "unknown" naming the candidates where none or several); the width comes
  from the shapes and the block counts from the highest index named, which tell a full-size
  release (the spec's releases) from another size (the tiny test models). With --model, the LoRA is
  also matched against that checkpoint exactly as tools/merge_lora.py matches it (names and shapes):
  "fits" or the reason it does not; a GGUF base too (the weights' shapes, not its blocks' packed bytes),
  which merge_lora refuses to merge into.
- ranks of a mixture's packed experts (networks/lora_packed.py) are per expert, by the header's expert counts
  (lora_packed_experts).
- values: whether every factor is finite (a diverged training's LoRA holds NaN / inf, which the trainer,
  generate and the LoRA tools refuse; a LyCORIS file's factors are not read).
- zero modules: those whose delta is exactly 0, an up (or down) all zeros: as initialized and never trained (a
  module frozen or left out of the optimizer, a save before the first step); sd-scripts' check_lora_weights.py
  prints every tensor's mean |x| to find them.
- metadata: the training settings our trainer and sd-scripts write (ss_* keys, networks/lora_files.py
  METADATA_KEYS: rank, alpha, network args, base model and its precision, optimizer, lr, steps ...),
  then every other header entry (modelspec.*, sshs_model_hash, our tools' lora_* records).

A LoRA is read whole (they are small) and its alphas are reported as our loaders apply them (kohya
alpha tensors, or a PEFT file's adapter config header); a LyCORIS file's tensors are not read, only
its alpha scalars.
--json prints one JSON object (every metadata entry in full). Errors: one line, exit status 2.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections import Counter, defaultdict

if __package__ in (None, ""):  # run as a script: make `library` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.cli import Parser, check_command_line, exit_without_collecting  # noqa: E402


def build_parser() -> Parser:
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("lora", help="LoRA .safetensors (kohya, PEFT/diffusers, ComfyUI, LyCORIS) or PEFT adapter folder")
    parser.add_argument("--model", default=None, help="also check the LoRA against this checkpoint (as merge_lora does)")
    parser.add_argument("--json", action="store_true", help="one JSON object")
    return parser


# The arguments are checked before torch and the library load (seconds): --help and a bad flag answer at once.
if __name__ == "__main__":
    check_command_line(build_parser)

import torch  # noqa: E402

from library.io import CheckpointError  # noqa: E402
from library.models.registry import arch_specs  # noqa: E402
from networks.lora_files import (  # noqa: E402
    ADAPTER_METADATA_KEY,
    METADATA_KEYS,
    TEXT_ENCODER_PREFIXES,
    beside_lora_note,
    detect_format,
    lora_reader,
    naming,
    non_finite_factor,
    parse_lora,
    split_beside_lora,
    split_text_encoders,
    stored_alpha,
    text_encoder_note,
)
from networks.lycoris_network import is_lycoris_file, lycoris_kind  # noqa: E402
from networks.lora_arch import (  # noqa: E402
    arch_by_shapes,
    arch_of,
    archs_holding,
    fitted_releases,
    header_decides,
    info_block_counts,
    lora_files,
    module_of_key,
    naming_of,
    other_holders,
    text_encoder_labels,
    title_list,
    variant_of,
    width_of,
)
from tools.lora_common import FOLDED_MARK, layout_name, one_line  # noqa: E402

DORA_KEYS = (".dora_scale", ".lora_magnitude_vector")


def network_type(keys: list[str]) -> str:
    kinds = sorted({kind for k in keys if (kind := lycoris_kind(k))})
    base = " + ".join(kinds) if kinds else "LoRA"
    if any(k.endswith(DORA_KEYS) for k in keys):
        return f"{base} + DoRA" if kinds else "DoRA"
    return base


def layout(keys: list[str]) -> str:
    if is_lycoris_file(keys):
        return "lycoris"
    return layout_name(keys, detect_format(keys))


def shared_names_fit(held: list[str], widths: dict[str, int]) -> str:
    """The fits line of a LoRA whose names several architectures have and whose shapes tell none."""
    fitted = [name for a in held for _, name in fitted_releases(a, widths)]
    titles = title_list([arch_specs()[a].title for a in held])
    if any(not lora_files()[a].releases for a in held):  # one of any size: no width or depth tells it
        return (f"names {' and '.join(arch_specs()[a].title for a in held)} all have, and a header naming none of "
                f"them (ss_base_model_version): unknown")
    return (f"{title_list(fitted)} alike (names and shapes they share)" if fitted else
            f"names {titles} all have, at a width and block count of no released size (e.g. the tiny test models)")


def fits(arch: str, width: int | None, counts: dict[str, int]) -> str:
    """Which supported model the names and shapes fit (without a checkpoint)."""
    width = "unknown" if width is None else width
    files = lora_files()
    if arch in files and files[arch].fits_text:
        return files[arch].fits_text.format_map(defaultdict(int, counts, width=width))
    if arch not in files or not files[arch].releases:
        titles = ", ".join(arch_specs()[a].title for a in files)
        return f"no supported model ({titles}) recognised from the module names"
    for release in files[arch].releases:
        if width == release.width and all(counts.get(k, 0) <= n for k, n in release.blocks.items()):
            return release.name
    shown = ", ".join(str(n) if k == "block" else f"{n} {k}" for k, n in counts.items())  # not "2 block blocks"
    names = " / ".join(release.name for release in files[arch].releases)
    title = arch_specs()[arch].title
    article = "an" if title[0].lower() in "aeiou" else "a"
    return f"{article} {title} model of width {width} with at least {shown} blocks (not a released size of {names})"


def _modules(keys: list[str]) -> list[str]:
    """Module names in file order (LyCORIS keys: `lora_unet_<module>.<part>` or `diffusion_model.<path>.<part>`)."""
    return list(dict.fromkeys(module_of_key(key) for key in keys))


def _alpha_source(keys: list[str], metadata: dict[str, str], adapter_config: dict | None) -> str:
    if any(k.endswith(".alpha") for k in keys):
        return "per-module alpha tensors"
    if adapter_config is not None:
        return "the folder's adapter_config.json"
    if ADAPTER_METADATA_KEY in metadata:
        return f"the PEFT adapter config in the header ({ADAPTER_METADATA_KEY})"
    if metadata.get(FOLDED_MARK) == "true":
        return "folded into lora_B (alpha = rank, scale 1)"
    return "none: loaders use alpha = rank (scale 1)"


def read_info(path: str) -> dict:
    """Everything lora_info prints, as a dict (the --json output); errors name the file."""
    try:
        return _read_info(path)
    except CheckpointError as e:
        raise naming(path, e) from None


def _read_info(path: str) -> dict:
    reader, adapter_config = lora_reader(path)  # a PEFT adapter folder: its alphas are in adapter_config.json
    metadata = dict(reader.metadata)
    keys, diffs = (list(part) for part in split_beside_lora(dict.fromkeys(reader.keys())))  # .diff_b ...
    fmt = layout(keys)
    _, te = split_text_encoders(dict.fromkeys(keys))
    modules = _modules(keys)
    transformer = [m for m in modules if not m.startswith(tuple(TEXT_ENCODER_PREFIXES))]  # CLIP / T5: no arch
    arch, naming = arch_of(transformer)
    ranks, alphas, weights = Counter(), Counter(), {}
    if fmt == "lycoris":  # no single rank: the alphas only
        alphas.update(f"{stored_alpha(reader.get(k), path, k.removesuffix('.alpha')):g}"
                      for k in keys if k.endswith(".alpha"))
    else:
        weights, _ = parse_lora({k: reader.get(k) for k in keys}, metadata, None, source=path,  # alphas as loaders apply them
                                adapter_config=adapter_config)
        for w in weights.values():
            ranks[w.rank] += 1
            alphas[f"{w.alpha:g}"] += 1
    widths = {m: w.down.shape[1] for m, w in weights.items()}
    held = archs_holding(transformer) if arch == "unknown" else []  # names many have: shapes and block counts tell
    if arch != "unknown" and (others := other_holders(arch, transformer)):  # names another has whole: the header
        if said := header_decides(metadata, [arch, *others]):
            arch, naming = said, naming_of(said, transformer) or naming
        else:
            held, naming = [arch, *others], None
    if held:
        arch = arch_by_shapes(held, widths)
    if any(f.names_of == arch for f in lora_files().values()):  # names shared: shapes and metadata tell (headers only)
        shapes = {k: torch.empty(reader.shape(k), device="meta") for k in keys}
        arch = variant_of(arch, shapes, metadata)
        naming = naming_of(arch, transformer) or naming  # the variant's own naming where its names say one
    width, counts = width_of(widths, arch), info_block_counts(modules, arch)
    fit = fits(arch, width, counts) if arch != "unknown" or not held else shared_names_fit(held, widths)
    training = {field: metadata[key] for field, key in METADATA_KEYS.items() if key in metadata}
    return {
        "file": os.path.basename(path), "bytes": sum(os.path.getsize(f) for f in reader.files),
        "format": fmt, "network": network_type(keys), "arch": arch, "naming": naming,
        "modules": len(modules), "ranks": {str(k): v for k, v in sorted(ranks.items())},
        "alphas": dict(alphas), "alpha_source": _alpha_source(keys, metadata, adapter_config),
        "dtypes": dict(Counter(reader.dtype_name(k) for k in keys)), "width": width, "blocks": counts,
        "fits": fit, "text_encoders": text_encoder_note(te, text_encoder_labels(arch)) if te else None,
        "beside_lora": beside_lora_note(diffs) if diffs else None,
        "finite": None if fmt == "lycoris" else non_finite_factor(weights) or "all finite", "training": training,
        "zero_modules": None if fmt == "lycoris" else zero_modules(weights),
        "metadata": {k: v for k, v in metadata.items() if k not in METADATA_KEYS.values()},
    }


def zero_modules(weights: dict) -> list[str]:
    """The modules whose delta is exactly 0 (an up or a down of zeros: never trained)."""
    return [m for m, w in weights.items() if not w.up.any() or not w.down.any()]


def check_against(path: str, model: str) -> str:
    """merge_lora's own matching of the LoRA against the checkpoint: 'fits ...' or the reason not."""
    from tools.merge_base import LoRASpec, lora_deltas, open_base

    base = open_base(model, "lora_info", names_only=True)  # a GGUF base too: names and logical shapes
    try:
        matched = lora_deltas(base, LoRASpec(path, 1.0), allow_unmatched=False)
    except CheckpointError as e:
        return f"does not fit {model}: {' '.join(str(e).split())}"
    return f"fits {model} ({base.family}, {base.naming} names): {len(matched)} weights"


def text_report(info: dict) -> str:
    lines = [f"{info['file']}: {info['network']} in {info['format']} layout, {info['bytes'] / 2**20:.1f} MiB",
             f"arch: {info['arch']}" + (f" ({info['naming']} names)" if info["naming"] else ""),
             f"fits: {info['fits']}"]  # fmt: skip
    if info["text_encoders"]:
        lines.append(f"text encoders: {info['text_encoders']} (transformer tools leave them out)")
    if info["beside_lora"]:
        lines.append(f"also in the file: {info['beside_lora']} (merge_lora, generate.py and base_loras add .diff / .diff_b "
                     f"as ComfyUI does, resize_lora keeps them, combine_loras sums them; network_weights and convert_lora leave "
                     f"them out)")
    if "checked" in info:
        lines.append(f"checked: {info['checked']}")
    if info["finite"] is not None:  # a diverged training's file is what every loader refuses
        lines.append("values: all finite" if info["finite"] == "all finite" else
                     f"values: NOT FINITE: {info['finite']}: the trainer, generate and the LoRA tools refuse this file")
    if zero := info["zero_modules"]:  # a module never trained: its delta is 0 whatever the ratio
        lines.append(f"zero modules: {len(zero)} of {info['modules']} have an up or down of zeros, their delta is 0 "
                     f"(never trained; first: {zero[0]})")
    lines += [f"modules: {info['modules']}", "ranks: " + (", ".join(f"{r} x{n}" for r, n in info["ranks"].items()) or "n/a (LyCORIS factors)"),
              "alphas: " + ", ".join(f"{a} x{n}" for a, n in info["alphas"].items()) + f" ({info['alpha_source']})",
              "dtypes: " + ", ".join(f"{d} x{n}" for d, n in info["dtypes"].items())]  # fmt: skip
    lines += ["training:"] + [f"  {k}: {_short(v)}" for k, v in info["training"].items()] if info["training"] else []
    lines += ["metadata:"] + [f"  {k}: {_short(v)}" for k, v in info["metadata"].items()] if info["metadata"] else []
    return "\n".join(lines)


def _short(value: str, limit: int = 160) -> str:
    value = " ".join(value.split())
    return value if len(value) <= limit else value[: limit - 3] + "..."


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
        info = read_info(args.lora)
        if args.model:
            info["checked"] = check_against(args.lora, args.model)
    except (ValueError, OSError) as e:  # CheckpointError is a ValueError
        print(one_line(e), file=sys.stderr)
        return 2
    print(json.dumps(info, indent=2) if args.json else text_report(info))
    return 0


if __name__ == "__main__":
    exit_without_collecting(main)
