"""SD3 / SD3.5 LoRA files: the module maps and paths tools/convert_lora.py, tools/merge_lora.py and networks/lora.py
use (through the spec's LORA / LORA_FILES).

Our modules have SAI's released names (`joint_blocks.0.x_block.attn.qkv`), which sd-scripts' kohya files use
(`lora_unet_joint_blocks_0_x_block_attn_qkv`) and ComfyUI's key map takes as they are (`lora_unet_` + any model
key). diffusers splits the fused qkv by rows (to_q / to_k / to_v; the text stream's add_q_proj / add_k_proj /
add_v_proj; MMDiT-X's attn2.to_q ...) and renames the rest (checkpoint.diffusers_modules): {ours: [(diffusers, row0,
row1)]}, in the format of FLUX.1's row maps. The two adaLNs whose halves diffusers stores swapped (the final layer's,
the last block's pre-only text stream's: its scale, shift for SAI's shift, scale) map as two row ranges of the one
diffusers module in its order, [(name, half, rows), (name, 0, half)]: lora_module_map stacks a module's ranges as
listed, so up's halves swap both ways.

A LoRA in diffusers' names has FLUX.1's double-block names: it is SD3's by its width (2432 or 1536; FLUX.1's 3072),
or its header, else --model_type says so.
"""

from __future__ import annotations

import torch

from library.models.sd3.checkpoint import diffusers_modules, swapped_modules
from library.models.sd3.model import HEAD_DIM, SD3, SD3Config

RowMap = dict[str, list[tuple[str, int, int]]]
RELEASED_WIDTHS = (2432, 1536)  # SD3.5-Large; SD3-Medium and SD3.5-Medium


def _linears(cfg: SD3Config) -> dict[str, int]:
    """Our Linear paths of a model built from `cfg` (on meta) -> their output rows."""
    with torch.device("meta"):
        model = SD3(cfg)
    return {name: m.out_features for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def _split(path: str, rows: int, swapped: tuple[str, ...] = ()) -> list[tuple[str, int, int]]:
    """[(diffusers module, row0, row1)] of our module `path` with `rows` output rows: a fused qkv in three equal
    parts, a module of `swapped` as its two halves in diffusers' order, any other one whole."""
    names = diffusers_modules(path)
    if path in swapped:
        return [(names[0], rows // 2, rows), (names[0], 0, rows // 2)]
    part = rows // len(names)
    return [(name, i * part, (i + 1) * part) for i, name in enumerate(names)]


def module_map_of_config(cfg: SD3Config) -> RowMap:
    """Ours <-> diffusers module map of a model built from `cfg`."""
    swapped = swapped_modules(cfg.depth)
    return {name: _split(name, rows, swapped) for name, rows in _linears(cfg).items()}


def _config_of_counts(counts: dict[str, int]) -> SD3Config:
    """A small SD3 with as many blocks as a LoRA names, in either naming, every block but the last with MMDiT-X's
    attn2 (only the names matter)."""
    depth = max(counts.get("joint_blocks", 0), counts.get("transformer_blocks", 0), 1)
    return SD3Config(depth=depth, hidden_size=HEAD_DIM, context_dim=4, pooled_dim=4, in_channels=4, out_channels=4,
                     pos_embed_max_size=1, dual_attention_layers=tuple(range(depth - 1)))


def module_paths(counts: dict[str, int]) -> list[str]:
    """Every SD3 Linear path of a model with the blocks a LoRA names: ours, then diffusers'."""
    cfg = _config_of_counts(counts)
    ours = list(_linears(cfg))
    theirs = [name for parts in module_map_of_config(cfg).values() for name, _, _ in parts]
    return ours + [p for p in dict.fromkeys(theirs) if p not in ours]


def module_map_of_lora(weights: dict, counts: dict[str, int]) -> RowMap:
    """The module map of the modules a LoRA names (ours or diffusers'), rows from its own matrices: a fused qkv's
    rows (ours) in three, diffusers' q / k / v parts each a third of the fused module, a swapped adaLN's halves."""
    cfg = _config_of_counts(counts)
    table, swapped = module_map_of_config(cfg), swapped_modules(cfg.depth)
    ours_of = {name: ours for ours, parts in table.items() for name, _, _ in parts}
    out: RowMap = {}
    for path, w in weights.items():
        ours = path if path in table else ours_of.get(path)
        if ours is None or ours in out:
            continue
        parts = len(diffusers_modules(ours))
        out[ours] = _split(ours, w.up.shape[0] * (1 if ours == path else parts), swapped)
    return out


def has_sd3_shapes(tensors: dict) -> bool:
    """A LoRA in FLUX.1's double-block names (diffusers') that is SD3's: an attention input projection reading a
    released width, 2432 or 1536 (FLUX.1's blocks read 3072), and no single-stream blocks."""
    if any("single_transformer_blocks" in key or "single_blocks" in key for key in tensors):
        return False
    for key, t in tensors.items():
        flat = key.replace(".", "_")
        if getattr(t, "ndim", 0) == 2 and flat.endswith(("lora_down_weight", "lora_A_weight")) \
                and "_attn_to_q_" in flat and t.shape[1] in RELEASED_WIDTHS:
            return True
    return False
