"""HiDream-O1-Image LoRA files: the module paths tools/convert_lora.py, tools/lora_info.py and tools/merge_lora.py
check a LoRA's names against (through the spec's LORA_FILES).

Our modules have the Comfy-Org single file's names, which are musubi-tuner's module paths (its kohya files name
`lora_unet_model_language_model_layers_0_self_attn_q_proj`). ComfyUI's model and ai-toolkit's saved files drop the
root's `model.` (`diffusion_model.language_model.layers.0.self_attn.q_proj`): `--to comfy` writes those
(comfy_module) and a LoRA in them reads as ours (comfy_module_map): a rename, no rows split.
"""

from __future__ import annotations

import torch

from library.models.hidream_o1.model import HiDreamO1, HiDreamO1Config

RowMap = dict[str, list[tuple[str, int, int]]]


def _linears(counts: dict[str, int]) -> dict[str, int]:
    """Our Linear paths of a small model with as many decoder layers as a LoRA names (only the names matter)."""
    config = HiDreamO1Config(hidden_size=8, num_layers=counts.get("layers", 0), num_heads=1, num_kv_heads=1,
                             head_dim=8, intermediate_size=8, vocab_size=8, mrope_section=(2, 1, 1),
                             bottleneck_dim=8, tms_token_id=0)
    with torch.device("meta"):
        model = HiDreamO1(config)
    return {name: m.out_features for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def comfy_module(path: str) -> str:
    """Our module path -> ComfyUI's and ai-toolkit's (without the root's `model.`)."""
    return path.removeprefix("model.")


def module_paths(counts: dict[str, int]) -> list[str]:
    """Every Linear path of a model with the layers a LoRA names: ours, then ComfyUI's / ai-toolkit's."""
    ours = list(_linears(counts))
    return ours + [comfy_module(p) for p in ours]


def comfy_module_map(weights: dict, counts: dict[str, int]) -> RowMap:
    """{ComfyUI's / ai-toolkit's module path: [(ours, 0, rows)]} of the modules a LoRA names in those names (a
    rename; the rows its own up matrix has)."""
    ours_of = {comfy_module(p): p for p in _linears(counts)}
    return {path: [(ours_of[path], 0, w.up.shape[0])] for path, w in weights.items() if path in ours_of}
