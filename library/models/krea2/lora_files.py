"""Krea 2 LoRA files: the module maps and paths tools/convert_lora.py, tools/merge_lora.py and
networks/lora.py use (through the spec's LORA / LORA_FILES).

Our modules have the released single file's names (`blocks.0.attn.wq`), which kohya files (musubi-tuner:
`lora_unet_blocks_0_attn_wq`) and the `diffusion_model.` files of the Krea 2 trainer / ComfyUI use;
diffusers names them otherwise (`transformer_blocks.0.attn.to_q`). Nothing is fused, so the map is a
rename, one module to one module: {ours: [(diffusers, 0, rows)]} in the format of FLUX.1's row maps.
"""

from __future__ import annotations

import torch

from library.models.krea2.checkpoint import diffusers_key, original_key
from library.models.krea2.model import Krea2, Krea2Config


def _linears(config: Krea2Config) -> dict[str, int]:
    """{our Linear path: output rows} of a model built from `config` (on meta)."""
    with torch.device("meta"):
        model = Krea2(config)
    return {name: m.out_features for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def _module(path: str, rename) -> str:
    return rename(path + ".weight")[: -len(".weight")]


def module_map_of_config(cfg: Krea2Config) -> dict[str, list[tuple[str, int, int]]]:
    """Ours <-> diffusers module map of a model built from `cfg`."""
    return {path: [(_module(path, diffusers_key), 0, rows)] for path, rows in _linears(cfg).items()}


def _config_of_counts(counts: dict[str, int]) -> Krea2Config:
    """A small Krea 2 with as many blocks as a LoRA names (only the names matter)."""
    return Krea2Config(num_layers=max(counts.get("blocks", 0), counts.get("transformer_blocks", 0)),
                       num_layerwise_text_blocks=counts.get("layerwise_blocks", 0),
                       num_refiner_text_blocks=counts.get("refiner_blocks", 0),
                       attention_head_dim=32, num_attention_heads=2, num_key_value_heads=1, intermediate_size=8,
                       timestep_embed_dim=8, text_hidden_dim=8, text_num_attention_heads=1, text_num_key_value_heads=1,
                       text_intermediate_size=8, axes_dims_rope=(8, 12, 12))


def module_paths(counts: dict[str, int]) -> list[str]:
    """Every Krea 2 Linear path of a model with the blocks a LoRA names, ours then diffusers' names."""
    table = module_map_of_config(_config_of_counts(counts))
    return list(table) + [parts[0][0] for parts in table.values()]


def module_map_of_lora(weights: dict, counts: dict[str, int]) -> dict[str, list[tuple[str, int, int]]]:
    """The module map of the modules a LoRA names (in either naming), rows from its own up matrices."""
    table = {}
    for path, w in weights.items():
        ours = _module(path, original_key)
        table[ours] = [(_module(ours, diffusers_key), 0, w.up.shape[0])]
    return table
