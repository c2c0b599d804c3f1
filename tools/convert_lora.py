"""Convert a FLUX.1, FLUX.2 or Qwen-Image LoRA between kohya and diffusers/PEFT layouts, and an LLM
LoRA between a kohya file and a PEFT adapter folder.

    python tools/convert_lora.py IN OUT --to kohya|diffusers|peft [--model_type flux|flux_kontext|flux2|qwen_image|qwen_image_edit|llm] [--alpha X]

The source layout (kohya `lora_unet_*`, PEFT `transformer.*.lora_A/B`, ComfyUI `diffusion_model.*`)
and the model type are told from the tensor names (--model_type settles a LoRA that names only
modules both models have, such as attention projections).

- FLUX.1: kohya files use BFL module names (`double_blocks.0.img_attn.qkv`), diffusers files
  diffusers names (`transformer_blocks.0.attn.to_q`). Fused modules are split by output rows (the
  down matrix is shared) or joined back, through library.flux_checkpoint's module map, sized from
  the LoRA's own block indices and shapes.
- FLUX.2: as FLUX.1 through library/models/flux2/checkpoint.py's module map (double blocks' qkv
  split into to_q/to_k/to_v, add_*_proj; the single blocks' linear1 / linear2 stay fused as
  attn.to_qkv_mlp_proj / attn.to_out). FLUX.1 and FLUX.2 share their BFL block names: a FLUX-named
  LoRA is FLUX.2 when it names a FLUX.2-only module (ff.linear_in, to_qkv_mlp_proj, the shared
  *_stream_modulation), when its metadata says so (ss_base_model_version flux2-*, what
  train_lora.py writes), or by its MLP widths (FLUX.2's SwiGLU: fused MLP-in rows = 6 x hidden,
  single linear1 = 9 x hidden; FLUX.1: 4 x, 7 x); else FLUX.1 (for attention-only LoRAs both
  convert to the same names). --model_type flux2 settles it.
- Qwen-Image: the module names are the same; only the prefix changes.

Alpha: a kohya file stores it per module (`.alpha`); a diffusers/PEFT file written by diffusers
stores its adapter config in the safetensors header (`lora_adapter_metadata`, lora_alpha /
alpha_pattern / use_rslora). kohya output keeps alpha (or sets it to --alpha, rescaling up so the
delta is unchanged); diffusers output has alpha/rank folded into lora_B (float32 math), since a PEFT
file without an adapter config is loaded with scale 1. A PEFT file with neither is read as alpha =
rank (what diffusers does) with a warning. Tensors keep the source dtype.

LLM (Llama / Qwen2): kohya files (`lora_te_model_layers_0_self_attn_q_proj...`, what train_lora.py
wrote before PEFT folders became the default) <-> PEFT adapter folders (`OUT/adapter_config.json` +
`OUT/adapter_model.safetensors`, keys `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`,
what PeftModel.from_pretrained, vLLM and llama.cpp's convert_lora_to_gguf.py read). Nothing is folded:
the PEFT config carries lora_alpha (the most common alpha) and r, with rank_pattern / alpha_pattern
for modules that differ, so kohya -> PEFT -> kohya gives back the same tensors bit for bit.

DoRA: the magnitude travels along (`dora_scale` [out, 1] in kohya files, `lora_magnitude_vector`
[out] in diffusers/PEFT files); it is per output row, so FLUX's fused modules split and join
exactly (joining needs every part). LyCORIS files (LoKr, LoHa, ...) are refused with the reason.
"""

from __future__ import annotations

import os
import re
import sys

if __package__ in (None, ""):  # run as a script: make `library` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.cli import Parser, check_command_line  # noqa: E402


def build_parser() -> Parser:
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("input", help="LoRA .safetensors (kohya, PEFT/diffusers or ComfyUI) or PEFT adapter folder (LLM)")
    parser.add_argument("output", help="converted LoRA .safetensors, or the PEFT adapter folder for --to peft")
    parser.add_argument("--to", required=True, choices=["kohya", "diffusers", "peft"], help="peft: LLM LoRAs only")
    parser.add_argument("--model_type", choices=["flux", "flux_kontext", "flux2", "qwen_image", "qwen_image_edit", "llm"], default=None,
                        help="default: told from the names (FLUX.1 / FLUX.2: also metadata and MLP widths; "
                             "a flux_kontext LoRA has FLUX.1's, a qwen_image_edit one Qwen-Image's)")
    parser.add_argument("--alpha", type=float, default=None, help="kohya output: store this alpha (up rescaled)")
    return parser


# The arguments are checked before torch and the library load (seconds): --help and a bad flag answer at once.
if __name__ == "__main__":
    check_command_line(build_parser)

import torch  # noqa: E402

from library.models.family import lora_arch  # noqa: E402
from library.models.flux1.checkpoint import flux_diffusers_module_map  # noqa: E402
from library.models.flux2.checkpoint import flux2_diffusers_module_map  # noqa: E402
from library.io import CheckpointError  # noqa: E402
from networks.lora_files import (  # noqa: E402
    ADAPTER_METADATA_KEY,
    LoRAWeights,
    detect_format,
    flux_bfl_to_diffusers,
    flux_diffusers_to_bfl,
    parse_lora,
    read_lora_tensors,
    write_kohya,
    write_peft,
    write_peft_folder,
)
from networks.lycoris_network import is_lycoris_file  # noqa: E402

FOLDED_MARK = "lora_alpha_folded"  # header entry of our diffusers output: alpha/rank is inside lora_B
DROPPED_METADATA = ("sshs_model_hash", ADAPTER_METADATA_KEY, FOLDED_MARK, "format")

# Names (with '.' and '_' alike) that only one model type has.
FLUX_MARKERS = ("double_blocks_", "single_blocks_", "single_transformer_blocks_", "_ff_net_", "_ff_context_", "_norm1_linear")
QWEN_MARKERS = ("_img_mlp_net_", "_txt_mlp_net_", "_img_mod_1", "_txt_mod_1")  # BFL has img_mlp_0, img_mod_lin
# single_transformer_blocks first: findall takes the first alternative that matches at a position.
BLOCK = re.compile(r"(single_transformer_blocks|double_blocks|single_blocks|transformer_blocks)[._](\d+)[._]")


# diffusers / BFL names only FLUX.2 has (its BFL block names are FLUX.1's).
FLUX2_MARKERS = ("_ff_linear_in", "_ff_linear_out", "_ff_context_linear_", "_to_qkv_mlp_proj", "stream_modulation")
LLM_MARKERS = ("_self_attn_q_proj", "_self_attn_k_proj", "_self_attn_v_proj", "_self_attn_o_proj",
               "_mlp_gate_proj", "_mlp_up_proj", "_mlp_down_proj")
LLM_LAYER = re.compile(r"layers[._](\d+)[._]")
MARKERS = {"flux": FLUX_MARKERS + FLUX2_MARKERS, "qwen_image": QWEN_MARKERS, "llm": LLM_MARKERS}
NAMES = {"flux": "FLUX", "flux2": "FLUX.2", "qwen_image": "Qwen-Image", "llm": "LLM"}
# (BFL / diffusers module of a fused MLP input, FLUX.1's and FLUX.2's rows per input width)
FLUX_MLP_RATIOS = [(re.compile(r"(img|txt)_mlp[._]0$"), 4, 6), (re.compile(r"single_blocks[._]\d+[._]linear1$"), 7, 9)]


def detect_model_type(keys) -> str:
    flat = [k.replace(".", "_") for k in keys]
    found = {}  # model type -> the first name only it has
    for model_type, markers in MARKERS.items():
        hit = next((k for k in flat if any(m in k for m in markers)), None)
        if hit:
            found[model_type] = hit
    if len(found) > 1:
        (a, ka), (b, kb) = list(found.items())[:2]
        raise CheckpointError(f"LoRA names both {NAMES[a]} ('{ka}') and {NAMES[b]} ('{kb}') modules")
    if not found:
        raise CheckpointError(f"cannot tell FLUX, Qwen-Image or LLM by the names (e.g. '{flat[0]}'): pass --model_type")
    return next(iter(found))


def flux_generation(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> str:
    """"flux" or "flux2" for a FLUX-named LoRA (module docstring: names, metadata, MLP widths)."""
    flat = [k.replace(".", "_") for k in tensors]
    if any(m in k for k in flat for m in FLUX2_MARKERS):
        return "flux2"
    if metadata.get("ss_base_model_version", "").startswith("flux2"):
        return "flux2"
    for key, up in tensors.items():
        for up_suffix, down_suffix in ((".lora_up.weight", ".lora_down.weight"), (".lora_B.weight", ".lora_A.weight")):
            module = key[: -len(up_suffix)]
            down = tensors.get(module + down_suffix) if key.endswith(up_suffix) else None
            for pattern, flux1_ratio, flux2_ratio in FLUX_MLP_RATIOS if down is not None else ():
                if pattern.search(module) and up.shape[0] in (flux1_ratio * down.shape[1], flux2_ratio * down.shape[1]):
                    return "flux2" if up.shape[0] == flux2_ratio * down.shape[1] else "flux"
    return "flux"


def block_counts(keys) -> dict[str, int]:
    """Block kind -> count (highest index + 1) named anywhere in the keys."""
    counts: dict[str, int] = {}
    for key in keys:
        for kind, index in BLOCK.findall(key):
            counts[kind] = max(counts.get(kind, 0), int(index) + 1)
    return counts


# ----------------------------------------------------------------------------------------------
# Module paths (kohya names are resolved against them)


def flux_paths(counts: dict[str, int]) -> list[str]:
    """Every FLUX Linear path, BFL and diffusers names (the sizes do not change the names)."""
    double = max(counts.get("double_blocks", 0), counts.get("transformer_blocks", 0))
    single = max(counts.get("single_blocks", 0), counts.get("single_transformer_blocks", 0))
    table = flux_diffusers_module_map(double, single, 1, 1)
    return list(table) + sorted({d for parts in table.values() for d, _, _ in parts})


def flux2_paths(counts: dict[str, int]) -> list[str]:
    """Every FLUX.2 Linear path, BFL and diffusers names."""
    double = max(counts.get("double_blocks", 0), counts.get("transformer_blocks", 0))
    single = max(counts.get("single_blocks", 0), counts.get("single_transformer_blocks", 0))
    table = flux2_diffusers_module_map(double, single, 1, 1)
    return list(table) + sorted({d for parts in table.values() for d, _, _ in parts})


def llm_paths(keys) -> list[str]:
    """The Linear paths of a Llama / Qwen2 decoder with as many layers as the LoRA names, and lm_head."""
    layers = max((int(n) + 1 for k in keys for n in LLM_LAYER.findall(k)), default=0)
    parts = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
             "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    return [f"model.layers.{i}.{part}" for i in range(layers) for part in parts] + ["lm_head"]


def qwen_paths(counts: dict[str, int]) -> list[str]:
    from library.models.qwen_image.model import QwenImage, QwenImageConfig

    with torch.device("meta"):
        model = QwenImage(QwenImageConfig(num_layers=counts.get("transformer_blocks", 0)))
    return [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]


# ----------------------------------------------------------------------------------------------
# FLUX widths from the LoRA's own shapes

# (path regex, what it tells, how): "in" = down's input width, "out" = up's rows
BFL_SIZES = [
    (r"double_blocks\.\d+\.(img|txt)_(attn\.(qkv|proj)|mod\.lin|mlp\.0)|single_blocks\.\d+\.(linear1|modulation\.lin)", "hidden", "in"),
    (r"double_blocks\.\d+\.(img|txt)_(attn\.proj|mlp\.2)|single_blocks\.\d+\.linear2|img_in|txt_in", "hidden", "out"),
    (r"double_blocks\.\d+\.(img|txt)_mlp\.0", "mlp", "out"),
    (r"double_blocks\.\d+\.(img|txt)_mlp\.2", "mlp", "in"),
    (r"single_blocks\.\d+\.linear1", "mlp", "out-3h"),
    (r"single_blocks\.\d+\.linear2", "mlp", "in-h"),
    (r"final_layer\.linear", "out_channels", "out"),
]
_ATTN = r".*attn\.(to_q|to_k|to_v|add_[qkv]_proj|to_out\.0|to_add_out)"
DIFFUSERS_SIZES = [
    (_ATTN + r"|.*norm1(_context)?\.linear|.*norm\.linear|.*proj_mlp|.*ff(_context)?\.net\.0\.proj", "hidden", "in"),
    (_ATTN + r"|.*ff(_context)?\.net\.2|x_embedder|context_embedder", "hidden", "out"),
    (r".*(ff(_context)?\.net\.0\.proj|proj_mlp)", "mlp", "out"),
    (r".*ff(_context)?\.net\.2", "mlp", "in"),
    (r"single_transformer_blocks\.\d+\.proj_out", "mlp", "in-h"),
    (r"proj_out", "out_channels", "out"),
]


# FLUX.2: the MLP input projections hold [gate | up] (2 x mlp rows), linear1 [q | k | v | gate | up].
_ATTN2 = r".*attn\.(to_q|to_k|to_v|add_[qkv]_proj|to_out\.0|to_add_out)"
FLUX2_BFL_SIZES = [
    (r"double_blocks\.\d+\.(img|txt)_(attn\.(qkv|proj)|mlp\.0)|single_blocks\.\d+\.linear1|.*_modulation.*\.lin", "hidden", "in"),
    (r"double_blocks\.\d+\.(img|txt)_(attn\.proj|mlp\.2)|single_blocks\.\d+\.linear2|img_in|txt_in", "hidden", "out"),
    (r"double_blocks\.\d+\.(img|txt)_mlp\.0", "mlp", "out/2"),
    (r"double_blocks\.\d+\.(img|txt)_mlp\.2", "mlp", "in"),
    (r"single_blocks\.\d+\.linear1", "mlp", "(out-3h)/2"),
    (r"single_blocks\.\d+\.linear2", "mlp", "in-h"),
    (r"final_layer\.linear", "out_channels", "out"),
]
FLUX2_DIFFUSERS_SIZES = [
    (_ATTN2 + r"|.*ff(_context)?\.linear_in|.*to_qkv_mlp_proj|.*_modulation.*\.linear", "hidden", "in"),
    (_ATTN2 + r"|.*ff(_context)?\.linear_out|x_embedder|context_embedder", "hidden", "out"),
    (r".*ff(_context)?\.linear_in", "mlp", "out/2"),
    (r".*ff(_context)?\.linear_out", "mlp", "in"),
    (r".*to_qkv_mlp_proj", "mlp", "(out-3h)/2"),
    (r"single_transformer_blocks\.\d+\.attn\.to_out", "mlp", "in-h"),
    (r"proj_out", "out_channels", "out"),
]


def flux_sizes(weights: dict[str, LoRAWeights], rule_sets=(BFL_SIZES, DIFFUSERS_SIZES), mlp_ratio: int = 4,
               out_channels: int = 64) -> dict[str, int]:
    """hidden, mlp and out_channels of the FLUX model the LoRA was made for, from its shapes (FLUX.1's
    rules and defaults unless given: FLUX.2 passes its own)."""
    sizes: dict[str, int] = {}
    for rules in rule_sets:
        for pattern, what, how in rules:
            for path, w in weights.items():
                if what in sizes or not re.fullmatch(pattern, path):
                    continue
                if "h" in how.replace("hidden", "") and "hidden" not in sizes:
                    continue
                h, out, width = sizes.get("hidden", 0), w.up.shape[0], w.down.shape[1]
                sizes[what] = {"in": width, "out": out, "out-3h": out - 3 * h, "in-h": width - h, "out/2": out // 2,
                               "(out-3h)/2": (out - 3 * h) // 2}[how]  # fmt: skip
    if "hidden" not in sizes:
        raise CheckpointError(f"cannot infer the FLUX width from LoRA modules like '{next(iter(weights))}'")
    sizes.setdefault("mlp", mlp_ratio * sizes["hidden"])
    sizes.setdefault("out_channels", out_channels)
    return sizes


def flux_module_map(weights: dict[str, LoRAWeights], counts: dict[str, int]) -> dict:
    s = flux_sizes(weights)
    double = max(counts.get("double_blocks", 0), counts.get("transformer_blocks", 0))
    single = max(counts.get("single_blocks", 0), counts.get("single_transformer_blocks", 0))
    return flux_diffusers_module_map(double, single, s["hidden"], s["mlp"], s["out_channels"])


def flux2_module_map(weights: dict[str, LoRAWeights], counts: dict[str, int]) -> dict:
    s = flux_sizes(weights, (FLUX2_BFL_SIZES, FLUX2_DIFFUSERS_SIZES), mlp_ratio=3, out_channels=128)
    double = max(counts.get("double_blocks", 0), counts.get("transformer_blocks", 0))
    single = max(counts.get("single_blocks", 0), counts.get("single_transformer_blocks", 0))
    return flux2_diffusers_module_map(double, single, s["hidden"], s["mlp"], s["out_channels"], guidance=True)


MODULE_MAPS = {"flux": flux_module_map, "flux2": flux2_module_map}  # BFL-named families


# ----------------------------------------------------------------------------------------------
# Conversion


def read_source(path: str, model_type: str | None):
    """-> (weights by dotted module path, metadata, format, model type, alpha known?)."""
    tensors, metadata, adapter_config = read_lora_tensors(path)  # a file, or a PEFT adapter folder
    if is_lycoris_file(tensors):
        raise CheckpointError(
            f"{path}: a LyCORIS file (LoKr/LoHa/...) has no kohya/diffusers LoRA form: its own keys "
            "(lora_unet_*.lokr_w1 ...) are what ComfyUI and LyCORIS load, and diffusers 0.42.1 loads LoKr only "
            "for Flux2 and Z-Image, not FLUX.1 or Qwen-Image; merge it with tools/merge_lora.py instead")
    fmt = detect_format(tensors)
    if model_type is None:
        model_type = detect_model_type(tensors)
        model_type = flux_generation(tensors, metadata) if model_type == "flux" else model_type
    counts = block_counts(tensors)
    paths = {"flux": flux_paths, "flux2": flux2_paths, "qwen_image": qwen_paths}.get(model_type, lambda _: llm_paths(tensors))(counts)
    weights, _ = parse_lora(tensors, metadata, paths if fmt == "kohya" else None, source=path, adapter_config=adapter_config)
    known = fmt != "peft" or any(k.endswith(".alpha") for k in tensors) or ADAPTER_METADATA_KEY in metadata
    known = known or metadata.get(FOLDED_MARK) == "true" or (adapter_config or {}).get("lora_alpha") is not None
    return weights, metadata, fmt, model_type, known, counts


def with_alpha(weights: dict[str, LoRAWeights], alpha: float) -> dict[str, LoRAWeights]:
    """Same deltas with every alpha set to `alpha`: up *= old_alpha / alpha (float32 math)."""
    return {p: LoRAWeights(w.down, (w.up.float() * (w.alpha / alpha)).to(w.up.dtype), alpha, w.magnitude)
            for p, w in weights.items()}


def convert_lora(src: str, dst: str, to: str, model_type: str | None = None, alpha: float | None = None) -> dict:
    """Convert `src` to layout `to` ("kohya" | "diffusers" | "peft") at `dst`; returns what was done."""
    if to not in ("kohya", "diffusers", "peft"):
        raise ValueError(f"--to {to!r}: expected kohya, diffusers or peft")
    if alpha is not None and (to != "kohya" or not alpha > 0):
        raise ValueError(f"--alpha {alpha}: only for --to kohya, and must be > 0 (diffusers output has alpha folded in)")
    weights, metadata, fmt, model_type, known, counts = read_source(src, model_type and lora_arch(model_type))
    if (to == "peft") != (model_type == "llm") and to != "kohya":
        want = "--to peft (a PEFT adapter folder)" if model_type == "llm" else "--to diffusers"
        raise ValueError(f"--to {to}: {NAMES[model_type]} LoRAs convert with {want} or --to kohya")
    if not known:
        print(f"warning: {src}: PEFT file without '{ADAPTER_METADATA_KEY}' or alphas: the scale is unknown; "
              "converting as alpha = rank (scale 1), which is what diffusers assumes", file=sys.stderr)  # fmt: skip
    dtype = next(iter(weights.values())).down.dtype
    if model_type in MODULE_MAPS:
        module_map = MODULE_MAPS[model_type](weights, counts)
        bfl_named = all(p in module_map for p in weights)
        if to == "kohya" and not bfl_named:
            weights = flux_diffusers_to_bfl(weights, module_map)
        elif to == "diffusers" and bfl_named:
            weights = flux_bfl_to_diffusers(weights, module_map)
    header = {k: v for k, v in metadata.items() if k not in DROPPED_METADATA}
    header["lora_converted_from"] = fmt
    if to == "kohya":
        prefix = "lora_te" if model_type == "llm" else "lora_unet"  # networks/lora.py KOHYA_PREFIX
        write_kohya(with_alpha(weights, alpha) if alpha else weights, dst, dtype=dtype, metadata=header, prefix=prefix)
    elif to == "peft":
        write_peft_folder(weights, dst, dtype=dtype, metadata=header, base_model=metadata.get("ss_sd_model_name"))
    else:
        write_peft(weights, dst, prefix="transformer", dtype=dtype, metadata={**header, FOLDED_MARK: "true"})
    return {"from": fmt, "to": to, "model_type": model_type, "modules": len(weights), "scale_known": known}


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
        done = convert_lora(args.input, args.output, args.to, args.model_type, args.alpha)
    except (ValueError, OSError) as e:  # CheckpointError is a ValueError
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    print(f"{done['model_type']} LoRA: {done['from']} -> {done['to']}, {done['modules']} modules -> {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
