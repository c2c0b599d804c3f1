"""Z-Image LoRA files: the module paths tools/convert_lora.py resolves kohya names against (through
the spec's LORA_FILES). The model has diffusers names, so every layout names the same modules and
converting changes the prefix only."""

from __future__ import annotations

import torch

from library.models.zimage.model import ZImage, ZImageConfig


def module_paths(counts: dict[str, int]) -> list[str]:
    """Every Linear path of a Z-Image model with as many blocks as the LoRA names (small width: only
    the names matter)."""
    refiners = max(counts.get("noise_refiner", 0), counts.get("context_refiner", 0))
    config = ZImageConfig(dim=64, n_heads=2, cap_feat_dim=32, axes_dims=(8, 12, 12),
                          n_layers=counts.get("layers", 0), n_refiner_layers=refiners)
    with torch.device("meta"):
        model = ZImage(config)
    return [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]


def single_file_module_map(keys: list[str], shape) -> dict[str, list[tuple[str, int, int]]]:
    """{single-file module: [(our (diffusers) module, row0, row1)]} for a single-file checkpoint with
    tensor names `keys` (prefix stripped; shape(key): its shape), so tools/merge_lora.py merges a LoRA
    with our names into it: the fused attention.qkv takes to_q / to_k / to_v by rows, the renamed
    modules (attention.out, x_embedder, final_layer) take theirs whole."""
    from library.models.zimage.checkpoint import QKV, diffusers_key

    out = {}
    for key in keys:
        if not key.endswith(".weight") or len(shape(key)) != 2:
            continue
        module, rows = key[: -len(".weight")], shape(key)[0]
        if key.endswith(QKV):
            block, third = key[: -len(QKV)], rows // 3
            out[module] = [(f"{block}.attention.to_{p}", i * third, (i + 1) * third) for i, p in enumerate("qkv")]
        elif diffusers_key(key) != key:
            out[module] = [(diffusers_key(key)[: -len(".weight")], 0, rows)]
    return out
