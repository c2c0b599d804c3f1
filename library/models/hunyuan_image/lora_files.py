"""HunyuanImage-2.1 LoRA files: the module maps and paths tools/convert_lora.py, tools/merge_lora.py and
networks/lora.py use (through the spec's LORA / LORA_FILES).

Our modules have Tencent's released names (`double_blocks.0.img_attn_qkv`, `img_mlp.fc1`), which sd-scripts' kohya
files use (`lora_unet_double_blocks_0_img_mlp_fc1`). Two other namings:
- ComfyUI's model renames them to FLUX.1's (`img_attn.qkv`, `img_mlp.0`, `img_mod.lin`, `modulation.lin`,
  `txt_in.t_embedder.in_layer`: checkpoint.comfy_key) and its LoRA key map takes only those (sd-scripts ships
  convert_hunyuan_image_lora_to_comfy.py for it): `--to comfy` writes them (comfy_module) and a LoRA in them reads
  as ours (comfy_module_map). One module each: a rename, no rows split.
- diffusers splits the fused qkv (and a single block's linear1 into q, k, v and the MLP input) by rows and renames
  the rest (checkpoint.diffusers_modules): {ours: [(diffusers, row0, row1)]}, in the format of FLUX.1's row maps.
  The final layer's adaLN, whose two halves diffusers stores swapped, maps as two row ranges of norm_out.linear in
  its order (lora_module_map stacks a module's ranges as listed).

A LoRA in ComfyUI's or diffusers' names has FLUX.1's names: it is HunyuanImage's by its width 3584 (the released one;
FLUX.1's is 3072) or its header, else --model_type says so.
"""

from __future__ import annotations

import torch

from library.models.hunyuan_image.checkpoint import FINAL_MODULATION, comfy_key, diffusers_modules
from library.models.hunyuan_image.model import HUNYUAN_IMAGE, HunyuanImage, HunyuanImageConfig

RowMap = dict[str, list[tuple[str, int, int]]]


def _linears(cfg: HunyuanImageConfig) -> dict[str, int]:
    """Our Linear paths of a model built from `cfg` (on meta) -> their output rows."""
    with torch.device("meta"):
        model = HunyuanImage(cfg)
    return {name: m.out_features for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def _split(path: str, rows: int, width: int) -> list[tuple[str, int, int]]:
    """[(diffusers module, row0, row1)] of our module `path` with `rows` output rows at model width `width`: q, k, v
    of `width` rows each, then a single block's MLP input (the rest)."""
    names = diffusers_modules(path)
    if path == FINAL_MODULATION:  # (shift, scale) rows; diffusers' (scale, shift)
        return [(names[0], rows // 2, rows), (names[0], 0, rows // 2)]
    if len(names) == 1:
        return [(names[0], 0, rows)]
    starts = [0, width, 2 * width, 3 * width, rows][: len(names)] + [rows]
    return [(name, starts[i], starts[i + 1]) for i, name in enumerate(names)]


def module_map_of_config(cfg: HunyuanImageConfig) -> RowMap:
    """Ours <-> diffusers module map of a model built from `cfg`."""
    return {name: _split(name, rows, cfg.hidden_size) for name, rows in _linears(cfg).items()}


def _config_of_counts(counts: dict[str, int]) -> HunyuanImageConfig:
    """A small HunyuanImage with as many blocks as a LoRA names, in any naming (only the names matter)."""
    double = max(counts.get("double_blocks", 0), counts.get("transformer_blocks", 0))
    single = max(counts.get("single_blocks", 0), counts.get("single_transformer_blocks", 0))
    refiner = max(counts.get("blocks", 0), counts.get("refiner_blocks", 0))
    return HunyuanImageConfig(hidden_size=8, num_heads=1, depth=double, depth_single=single, refiner_depth=refiner,
                              text_dim=4, glyph_dim=4, glyph_hidden=4, axes_dim=(4, 4), in_channels=4, out_channels=4)


def module_paths(counts: dict[str, int]) -> list[str]:
    """Every HunyuanImage Linear path of a model with the blocks a LoRA names: ours, then ComfyUI's and diffusers'.
    A ComfyUI name that flattens to ours (`img_attn.qkv`, kohya `img_attn_qkv`) is left to ours: one path per kohya
    name."""
    ours = list(_linears(_config_of_counts(counts)))
    table = module_map_of_config(_config_of_counts(counts))
    flat = {p.replace(".", "_") for p in ours}
    theirs = [comfy_module(p) for p in ours] + [name for parts in table.values() for name, _, _ in parts]
    return ours + [p for p in dict.fromkeys(theirs) if p.replace(".", "_") not in flat]


def comfy_module(path: str) -> str:
    """Our module path -> ComfyUI's (its model's names, which its LoRA key map takes)."""
    return comfy_key(path + ".weight")[: -len(".weight")]


def comfy_module_map(weights: dict, counts: dict[str, int]) -> RowMap:
    """{ComfyUI's module path: [(ours, 0, rows)]} of the modules a LoRA names in ComfyUI's names (a rename)."""
    ours_of = {comfy_module(p): p for p in _linears(_config_of_counts(counts))}
    return {path: [(ours_of[path], 0, w.up.shape[0])] for path, w in weights.items()
            if path in ours_of and ours_of[path] != path}


def module_map_of_lora(weights: dict, counts: dict[str, int]) -> RowMap:
    """The module map of the modules a LoRA names (ours or diffusers'), rows from its own matrices: a fused module's
    q, k and v are as wide as the model (its down's input), a single block's MLP input the rest; diffusers' parts
    give theirs. The model width: the down input of any block Linear reading the stream."""
    table = module_map_of_config(_config_of_counts(counts))
    ours_of = {name: ours for ours, parts in table.items() for name, _, _ in parts}
    width = next((w.down.shape[1] for p, w in weights.items() if p.endswith(("attn_qkv", "attn.to_q", "linear1"))),
                 HUNYUAN_IMAGE.hidden_size)
    out: RowMap = {}
    for path, w in weights.items():
        ours = path if path in table else ours_of.get(path)
        if ours is None:
            continue
        if ours == path:
            out[ours] = _split(ours, w.up.shape[0], width)
        elif ours not in out:  # diffusers' parts: each as wide as the model, a single block's MLP input 4x
            rows = 3 * width + (4 * width if len(table[ours]) == 4 else 0) if len(table[ours]) > 1 else w.up.shape[0]
            out[ours] = _split(ours, rows, width)
    return out


def has_hunyuan_image_shapes(tensors: dict) -> bool:
    """A LoRA in FLUX.1's block names (ComfyUI's or diffusers') that is HunyuanImage-2.1's: a block Linear reading
    the released width 3584 (FLUX.1's blocks read 3072)."""
    for key, t in tensors.items():
        flat = key.replace(".", "_")
        if getattr(t, "ndim", 0) == 2 and flat.endswith(("lora_down_weight", "lora_A_weight")) \
                and ("blocks_" in flat) and t.shape[1] == HUNYUAN_IMAGE.hidden_size:
            return True
    return False
