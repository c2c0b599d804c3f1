"""FLUX.1 LoRA files in BFL and diffusers names: the module maps and paths tools/convert_lora.py and
networks/lora.py use (through the spec's LORA / LORA_FILES).

kohya files use BFL module names (`double_blocks.0.img_attn.qkv`), diffusers files diffusers names
(`transformer_blocks.0.attn.to_q`). Fused modules are split by output rows (the down matrix is
shared) or joined back through checkpoint.flux_diffusers_module_map, sized from the model's config
or, for a LoRA file alone, from the LoRA's own block indices and shapes (`sizes_from_lora`).
"""

from __future__ import annotations

import re

from library.io import CheckpointError
from library.models.flux1.checkpoint import RowMap, flux_diffusers_module_map


def module_map_of_config(cfg) -> RowMap:
    """BFL <-> diffusers module map of a model built from `cfg` (a FluxConfig)."""
    return flux_diffusers_module_map(cfg.depth, cfg.depth_single, cfg.hidden_size, cfg.mlp_hidden, cfg.in_channels,
                                     cfg.guidance_embed)


def block_depths(counts: dict[str, int]) -> tuple[int, int]:
    """(double, single) block counts a LoRA names, in either naming (convert_lora's block counts)."""
    double = max(counts.get("double_blocks", 0), counts.get("transformer_blocks", 0))
    single = max(counts.get("single_blocks", 0), counts.get("single_transformer_blocks", 0))
    return double, single


def all_paths(table: RowMap) -> list[str]:
    """Every Linear path of a module map, BFL names then diffusers names."""
    return list(table) + sorted({d for parts in table.values() for d, _, _ in parts})


def module_paths(counts: dict[str, int]) -> list[str]:
    """Every FLUX.1 Linear path, BFL and diffusers names (the sizes do not change the names)."""
    return all_paths(flux_diffusers_module_map(*block_depths(counts), 1, 1))


# ----------------------------------------------------------------------------------------------
# Widths from a LoRA's own shapes

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
ATTN = r".*attn\.(to_q|to_k|to_v|add_[qkv]_proj|to_out\.0|to_add_out)"  # diffusers' attention projections
DIFFUSERS_SIZES = [
    (ATTN + r"|.*norm1(_context)?\.linear|.*norm\.linear|.*proj_mlp|.*ff(_context)?\.net\.0\.proj", "hidden", "in"),
    (ATTN + r"|.*ff(_context)?\.net\.2|x_embedder|context_embedder", "hidden", "out"),
    (r".*(ff(_context)?\.net\.0\.proj|proj_mlp)", "mlp", "out"),
    (r".*ff(_context)?\.net\.2", "mlp", "in"),
    (r"single_transformer_blocks\.\d+\.proj_out", "mlp", "in-h"),
    (r"proj_out", "out_channels", "out"),
]


def sizes_from_lora(weights: dict, rule_sets=(BFL_SIZES, DIFFUSERS_SIZES), mlp_ratio: int = 4,
                    out_channels: int = 64) -> dict[str, int]:
    """hidden, mlp and out_channels of the FLUX model the LoRA (weights: {module path: LoRAWeights})
    was made for, from its shapes (FLUX.1's rules and defaults unless given: FLUX.2 passes its own)."""
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


def module_map_of_lora(weights: dict, counts: dict[str, int]) -> RowMap:
    """The module map of the FLUX.1 model a LoRA was made for (its blocks and shapes)."""
    s = sizes_from_lora(weights)
    return flux_diffusers_module_map(*block_depths(counts), s["hidden"], s["mlp"], s["out_channels"])
