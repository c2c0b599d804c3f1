"""FLUX.3 LoRA files: the module maps and paths tools/convert_lora.py, tools/merge_lora.py and networks/lora.py use
(through the spec's LORA / LORA_FILES), and how a LoRA in FLUX.1's BFL names is told to be FLUX.3's.

Our modules have BFL's single-file names (`single_blocks.0.q_proj`), which kohya files
(`lora_unet_single_blocks_0_q_proj`) and the ComfyUI / BFL layout (`diffusion_model.single_blocks.0.q_proj.lora_A`,
what diffusers' Flux3LoraLoaderMixin converts) use; diffusers names them otherwise
(`single_transformer_blocks.0.attn.to_q`), as its convert_flux3_transformer_checkpoint_to_diffusers renames the
weights (checkpoint.flux3_diffusers_names: the one name table). Nothing is fused: the map is a rename, one module
to one module, {ours: [(diffusers, row0, row1)]} in the format of FLUX.1's row maps, except the final adaLN
projection whose [shift | scale] rows diffusers holds as [scale | shift] (its converter's swap_scale_shift): two
segments of one module.
"""

from __future__ import annotations

import re

from library.models.flux3.checkpoint import FINAL_ADALN, flux3_diffusers_names

RowMap = dict[str, list[tuple[str, int, int]]]

# a LoRA in FLUX.1's BFL / diffusers block names that only FLUX.3 has (FLUX.1: linear1 / linear2, proj_mlp ...)
_FLUX3_SINGLE = re.compile(r"single_blocks[._]\d+[._](q_proj|k_proj|v_proj|attn_out|mlp_in|mlp_out)([._]|$)"
                           r"|single_transformer_blocks[._]\d+[._]ff[._]linear_(in|out)([._]|$)")


def linear_names(key_names: dict[str, str]) -> dict[str, str]:
    """{our (BFL) Linear path: diffusers' path} of a key table as checkpoint.flux3_diffusers_names gives it."""
    return {ours[: -len(".weight")]: theirs[: -len(".weight")] for ours, theirs in key_names.items()
            if ours.endswith(".weight")}


def module_names(mode_blocks: int, single_blocks: int, flow_map: bool = True) -> dict[str, str]:
    """{our Linear path: diffusers' path} of a FLUX.3 with these block counts."""
    return linear_names(flux3_diffusers_names(mode_blocks, single_blocks, flow_map))


def row_map(names: dict[str, str], rows: dict[str, int]) -> RowMap:
    """The BFL <-> diffusers module map of the modules `rows` holds ({our path: its output rows}), named by `names`
    (linear_names); the final adaLN's two halves swapped."""
    table = {}
    for path, n in rows.items():
        theirs = names[path]
        swapped = path + ".weight" == FINAL_ADALN
        table[path] = [(theirs, n // 2, n), (theirs, 0, n // 2)] if swapped else [(theirs, 0, n)]
    return table


def module_map_of_config(cfg) -> RowMap:
    """BFL <-> diffusers module map of a model built from `cfg` (a Flux3Config), from its Linears on meta."""
    import torch

    from library.models.flux3.model import Flux3Transformer

    with torch.device("meta"):
        model = Flux3Transformer(cfg)
    rows = {name: m.out_features for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    return row_map(module_names(cfg.depth, cfg.depth_single, cfg.flow_map), rows)


def _depths(counts: dict[str, int]) -> tuple[int, int]:
    """(per-mode, single) block counts a LoRA names, in either naming (the spec's block_pattern kinds)."""
    mode = max((n for kind, n in counts.items() if "mode_blocks" in kind), default=0)
    single = max((n for kind, n in counts.items() if kind.startswith("single")), default=0)
    return mode, single


def module_paths(counts: dict[str, int]) -> list[str]:
    """Every FLUX.3 Linear path of a model with the blocks a LoRA names, ours then diffusers' names."""
    names = module_names(*_depths(counts))
    return list(names) + list(names.values())


def module_map_of_lora(weights: dict, counts: dict[str, int]) -> RowMap:
    """The module map of the modules a LoRA names (in either naming), rows from its own up matrices."""
    names = module_names(*_depths(counts))
    ours_of = {theirs: ours for ours, theirs in names.items()}
    return row_map(names, {ours_of.get(path, path): w.up.shape[0] for path, w in weights.items()})


def has_flux3_names(tensors: dict) -> bool:
    """True for a LoRA in FLUX.1's block names whose single blocks are FLUX.3's (q_proj / attn_out / mlp_in ...,
    or diffusers' single_transformer_blocks.N.ff.linear_in), where its markers and header did not tell."""
    return any(_FLUX3_SINGLE.search(key) for key in tensors)
