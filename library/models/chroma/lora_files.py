"""Chroma LoRA files: the module maps and paths tools/convert_lora.py and networks/lora.py use
(through the spec's LORA / LORA_FILES).

Chroma's blocks are FLUX.1's minus the modulation Linears, with the same names and shapes, so its
diffusers map is chroma/checkpoint.py's (FLUX.1's rows without the pruned ones, the approximator's
added) and a LoRA of the blocks alone reads the same in both models. It is Chroma's when it names the
approximator (`distilled_guidance_layer`, the spec's marker) or its header says so (the spec's
model_versions); else it is FLUX.1's. --model_type chroma settles the rest (the conversion is the same
for the blocks).
"""

from __future__ import annotations

from library.models.chroma.checkpoint import chroma_diffusers_module_map
from library.models.chroma.model import ChromaConfig
from library.models.flux1.checkpoint import RowMap
from library.models.flux1.lora_files import all_paths, block_depths, sizes_from_lora

def module_map_of_config(cfg: ChromaConfig) -> RowMap:
    """BFL <-> diffusers module map of a model built from `cfg`."""
    return chroma_diffusers_module_map(cfg)


def module_paths(counts: dict[str, int]) -> list[str]:
    """Every Chroma Linear path, BFL and diffusers names (the sizes do not change the names)."""
    double, single = block_depths(counts)
    return all_paths(chroma_diffusers_module_map(ChromaConfig(hidden_size=2, num_heads=1, axes_dim=(2,), depth=double,
                                                              depth_single=single, approximator_hidden=1)))


def module_map_of_lora(weights: dict, counts: dict[str, int]) -> RowMap:
    """The module map of the Chroma model a LoRA was made for (its blocks and shapes; FLUX.1's rules
    read the widths: the blocks are FLUX.1's). The approximator's width is read from its own LoRA
    modules when the LoRA has them (in_proj's up rows), else the released 5120."""
    s = sizes_from_lora(weights)
    double, single = block_depths(counts)
    approximator = next((w.up.shape[0] for p, w in weights.items() if p.startswith("distilled_guidance_layer.in_proj")), 5120)
    head_dim = 128 if s["hidden"] % 128 == 0 else s["hidden"]  # the map names rows, not heads: any divisor will do
    config = ChromaConfig(in_channels=s["out_channels"], hidden_size=s["hidden"], mlp_ratio=s["mlp"] / s["hidden"],
                          num_heads=s["hidden"] // head_dim, axes_dim=(head_dim,), depth=double, depth_single=single,
                          approximator_hidden=approximator)
    return chroma_diffusers_module_map(config)
