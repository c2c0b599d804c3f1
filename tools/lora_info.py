"""Describe a LoRA file: layout, network type, model architecture, modules, ranks, alphas, dtypes,
training metadata and which model it fits.

    python tools/lora_info.py LORA.safetensors [--model BASE] [--json]   # or a PEFT adapter folder

- format: kohya (`lora_unet_*` / `lora_te_*`), diffusers (PEFT keys under `transformer.`), PEFT
  (`base_model.model.*`, other prefixes), comfy (`diffusion_model.*`), or lycoris (LyCORIS' own keys).
- network: LoRA, DoRA (`dora_scale` / `lora_magnitude_vector`), LoKr (`lokr_*`), LoHa (`hada_*`),
  OFT, full (`diff`), (IA)^3 (`on_input`); LyCORIS with `dora_scale` is reported as e.g. "LoKr + DoRA".
- arch (the transformer architecture) from the module names: flux (FLUX.1; BFL names `double_blocks` or diffusers names
  `single_transformer_blocks`, `ff_context` ...), flux2 (FLUX.1's BFL block names, told apart as
  tools/convert_lora.py does: FLUX.2-only names, ss_base_model_version, SwiGLU MLP widths),
  qwen_image (`img_mlp.net`, `img_mod.1` ...), llm (`layers.N.self_attn` / `mlp`); the width comes
  from the shapes and the block counts from the highest index named, which tell a full-size
  release (FLUX.1 dev / schnell, FLUX.2 [klein] 4B / 9B / [dev], Qwen-Image) from
  another size (the tiny test models). With --model, the LoRA is also matched against that checkpoint
  exactly as tools/merge_lora.py matches it (names and shapes): "fits" or the reason it does not.
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
from collections import Counter

if __package__ in (None, ""):  # run as a script: make `library` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.cli import Parser, check_command_line  # noqa: E402


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
from networks.lora_files import ADAPTER_METADATA_KEY, METADATA_KEYS, _split_key, detect_format, lora_reader, parse_lora  # noqa: E402
from networks.lycoris_network import is_lycoris_file  # noqa: E402
from tools.lora_common import FOLDED_MARK, one_line  # noqa: E402

LYCORIS_TYPES = {".lokr_": "LoKr", ".hada_": "LoHa", ".oft_": "OFT", ".diff": "full", ".on_input": "(IA)^3"}
DORA_KEYS = (".dora_scale", ".lora_magnitude_vector")
# Released sizes: arch -> [(name, width, {block kind: count})]
RELEASES = {
    "flux": [("FLUX.1 dev / schnell", 3072, {"double": 19, "single": 38})],
    "flux2": [("FLUX.2 [klein] 4B", 3072, {"double": 5, "single": 20}), ("FLUX.2 [klein] 9B", 4096, {"double": 8, "single": 24}),
              ("FLUX.2 [dev]", 6144, {"double": 8, "single": 48})],
    "qwen_image": [("Qwen-Image", 3072, {"block": 60})],
}
# (arch, naming, regex over '_'-flattened module names); the first arch with a match wins
ARCH_MARKERS = [
    ("flux2", "bfl", r"(double|single)_stream_modulation_(img_|txt_)?lin$"),
    ("flux2", "diffusers", r"_ff(_context)?_linear_(in|out)|_to_qkv_mlp_proj|(double|single)_stream_modulation_(img_|txt_)?linear"),
    ("flux", "bfl", r"(^|_)(double_blocks|single_blocks)_\d+_"),
    ("flux", "diffusers", r"single_transformer_blocks_\d+_|_ff_context_|_norm1_context_|_attn_add_q_proj.*transformer"),
    ("qwen_image", "diffusers", r"_(img|txt)_mlp_net_|_(img|txt)_mod_1|transformer_blocks_\d+_attn_add_q_proj"),
    ("llm", "hf", r"layers_\d+_(self_attn|mlp)_"),
]
BLOCKS = {"double": r"double_blocks_(\d+)_", "single": r"single_blocks_(\d+)_|single_transformer_blocks_(\d+)_",
          "block": r"(?<!single_)transformer_blocks_(\d+)_|layers_(\d+)_"}  # fmt: skip
# module name endings whose down input is the model width (FLUX BFL / diffusers, Qwen-Image, LLM)
WIDTH_MODULES = (r"(_attn_qkv|_attn_proj|_linear1|_modulation_lin|_mod_lin|_mlp_0|attn_to_[qkv]|attn_add_[qkv]_proj|"
                 r"norm1?(_context)?_linear|proj_mlp|_mod_1|mlp_net_0_proj|self_attn_[qkv]_proj|mlp_(gate|up)_proj)$")


def network_type(keys: list[str]) -> str:
    kinds = sorted({name for part, name in LYCORIS_TYPES.items() if any(part in k for k in keys)})
    base = " + ".join(kinds) if kinds else "LoRA"
    if any(k.endswith(DORA_KEYS) for k in keys):
        return f"{base} + DoRA" if kinds else "DoRA"
    return base


def layout(keys: list[str]) -> str:
    if is_lycoris_file(keys):
        return "lycoris"
    fmt = detect_format(keys)
    if fmt == "peft" and all(k.startswith("transformer.") for k in keys):
        return "diffusers"
    return fmt


def arch_of(modules: list[str]) -> tuple[str, str | None]:
    flat = [m.replace(".", "_") for m in modules]
    for arch, naming, pattern in ARCH_MARKERS:
        if any(re.search(pattern, m) for m in flat):
            return arch, naming
    return "unknown", None


def block_counts(modules: list[str], arch: str) -> dict[str, int]:
    """Block kind -> highest index named + 1 (FLUX diffusers `transformer_blocks` are double blocks)."""
    counts = {}
    for kind, pattern in BLOCKS.items():
        found = [int(next(g for g in m.groups() if g)) for name in modules for m in [re.search(pattern, name.replace(".", "_"))] if m]
        if found:
            counts[kind] = max(found) + 1
    if arch in ("flux", "flux2") and "block" in counts:
        counts["double"] = max(counts.get("double", 0), counts.pop("block"))
    return counts


def fits(arch: str, width: int | None, counts: dict[str, int]) -> str:
    """Which supported model the names and shapes fit (without a checkpoint)."""
    width = "unknown" if width is None else width
    if arch == "llm":
        return f"an LLM (Llama / Qwen2 layout) of width {width}, at least {counts.get('block', 0)} layers"
    if arch not in RELEASES:
        return "no supported model (FLUX.1, FLUX.2, Qwen-Image, LLM) recognised from the module names"
    for name, release_width, blocks in RELEASES[arch]:
        if width == release_width and all(counts.get(k, 0) <= n for k, n in blocks.items()):
            return name
    shown = ", ".join(f"{n} {k}" for k, n in counts.items())
    names = " / ".join(name for name, _, _ in RELEASES[arch])
    return f"a {arch} model of width {width} with at least {shown} blocks (not a released size of {names})"


def _modules(keys: list[str]) -> list[str]:
    """Module names in file order (LyCORIS keys are kohya names: `lora_unet_<module>.<part>`)."""
    names = []
    for key in keys:
        try:
            names.append(_split_key(key)[0])
        except CheckpointError:
            names.append(key.split(".")[0])
    return list(dict.fromkeys(names))


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
    """Everything lora_info prints, as a dict (the --json output)."""
    reader, adapter_config = lora_reader(path)  # a PEFT adapter folder: its alphas are in adapter_config.json
    keys, metadata = reader.keys(), dict(reader.metadata)
    fmt = layout(keys)
    modules = _modules(keys)
    arch, naming = arch_of(modules)
    if arch == "flux":  # FLUX.2 shares FLUX.1's BFL block names: shapes and metadata tell (headers only)
        from tools.convert_lora import flux_generation

        shapes = {k: torch.empty(reader.shape(k), device="meta") for k in keys}
        arch = "flux2" if flux_generation(shapes, metadata) == "flux2" else arch
    ranks, alphas, width = Counter(), Counter(), None
    if fmt == "lycoris":  # no single rank: the alphas only
        alphas.update(f"{float(reader.get(k).float()):g}" for k in keys if k.endswith(".alpha"))
    else:
        weights, _ = parse_lora(dict(reader.items()), metadata, None, source=path,  # alphas as loaders apply them
                                adapter_config=adapter_config)
        for module, w in weights.items():
            ranks[w.rank] += 1
            alphas[f"{w.alpha:g}"] += 1
            if width is None and re.search(WIDTH_MODULES, module.replace(".", "_")):
                width = w.down.shape[1]
    counts = block_counts(modules, arch)
    training = {field: metadata[key] for field, key in METADATA_KEYS.items() if key in metadata}
    return {
        "file": os.path.basename(path), "bytes": sum(os.path.getsize(f) for f in reader.files),
        "format": fmt, "network": network_type(keys), "arch": arch, "naming": naming,
        "modules": len(modules), "ranks": {str(k): v for k, v in sorted(ranks.items())},
        "alphas": dict(alphas), "alpha_source": _alpha_source(keys, metadata, adapter_config),
        "dtypes": dict(Counter(reader.dtype_name(k) for k in keys)), "width": width, "blocks": counts,
        "fits": fits(arch, width, counts), "training": training,
        "metadata": {k: v for k, v in metadata.items() if k not in METADATA_KEYS.values()},
    }


def check_against(path: str, model: str) -> str:
    """merge_lora's own matching of the LoRA against the checkpoint: 'fits ...' or the reason not."""
    from tools.merge_lora import LoRASpec, lora_deltas, open_base

    base = open_base(model)
    try:
        matched = lora_deltas(base, LoRASpec(path, 1.0), allow_unmatched=False)
    except CheckpointError as e:
        return f"does not fit {model}: {' '.join(str(e).split())}"
    return f"fits {model} ({base.family}, {base.naming} names): {len(matched)} weights"


def text_report(info: dict) -> str:
    lines = [f"{info['file']}: {info['network']} in {info['format']} layout, {info['bytes'] / 2**20:.1f} MiB",
             f"arch: {info['arch']}" + (f" ({info['naming']} names)" if info["naming"] else ""),
             f"fits: {info['fits']}"]  # fmt: skip
    if "checked" in info:
        lines.append(f"checked: {info['checked']}")
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
    sys.exit(main())
