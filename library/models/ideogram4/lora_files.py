"""Ideogram 4 LoRA files: the module paths tools/convert_lora.py resolves kohya names against (through
the spec's LORA_FILES). The model has diffusers' names, so the kohya and diffusers layouts name the
same modules and converting to diffusers changes the prefix only. ComfyUI's model has the original names (the
Comfy-Org single file's fused `attention.qkv`, `attention.o`), which its LoRA key map takes and ai-toolkit's and
musubi-tuner's LoRAs use: --to comfy writes those (comfy_fused_map); diffusers' Ideogram4LoraLoaderMixin splits
them on load, and comfy_module_map reads them as ours."""

from __future__ import annotations

import torch

from library.models.ideogram4.model import Ideogram4, Ideogram4Config


def module_paths(counts: dict[str, int]) -> list[str]:
    """Every Linear path of an Ideogram 4 model with as many blocks as the LoRA names (tiny widths:
    only the names matter)."""
    config = Ideogram4Config(num_layers=counts.get("layers", 0), attention_head_dim=64, num_attention_heads=1,
                             intermediate_size=8, adaln_dim=8, llm_features_dim=8, in_channels=8,
                             mrope_section=(6, 5, 5))
    with torch.device("meta"):
        model = Ideogram4(config)
    paths = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    original = [f"layers.{i}.attention.{m}" for i in range(config.num_layers) for m in ("qkv", "o")]
    return paths + original  # the original / ai-toolkit names (comfy_module_map reads them as ours)


QKV, OUT = ".attention.qkv", ".attention.o"
QKV_PARTS = (".attention.to_q", ".attention.to_k", ".attention.to_v")


def comfy_module_map(weights: dict, counts: dict[str, int]) -> dict[str, list[tuple[str, int, int]]]:
    """{original module path: [(our module path, row0, row1)]} for the modules of `weights` named as the
    original model and ai-toolkit's `diffusion_model.` LoRAs name them (diffusers'
    _convert_non_diffusers_ideogram4_lora_to_diffusers): a fused attention.qkv splits into to_q / to_k /
    to_v by thirds of its rows, attention.o is to_out.0."""
    out = {}
    for path, w in weights.items():
        rows = w.up.shape[0]
        if path.endswith(QKV):
            block, third = path[: -len(QKV)], rows // 3
            out[path] = [(block + part, i * third, (i + 1) * third) for i, part in enumerate(QKV_PARTS)]
        elif path.endswith(OUT):
            out[path] = [(path[: -len(OUT)] + ".attention.to_out.0", 0, rows)]
    return out


def comfy_fused_map(weights: dict, counts: dict[str, int]) -> dict[str, list[tuple[str, int, int]]]:
    """{original module path: [(our module path, row0, row1)]} to write `weights` in the original names (--to comfy,
    networks.lora_module_map.diffusers_to_bfl): each block's to_q / to_k / to_v stacked by rows into attention.qkv
    (the inverse of comfy_module_map), to_out.0 as attention.o, every other module as it is."""
    out = {}
    for path, w in weights.items():
        rows = w.up.shape[0]
        part = next((p for p in QKV_PARTS if path.endswith(p)), None)
        if part is not None:
            block = path[: -len(part)]
            out[block + QKV] = [(block + p, i * rows, (i + 1) * rows) for i, p in enumerate(QKV_PARTS)]
        elif path.endswith(".attention.to_out.0"):
            out[path[: -len(".attention.to_out.0")] + OUT] = [(path, 0, rows)]
        else:
            out[path] = [(path, 0, rows)]
    return out
