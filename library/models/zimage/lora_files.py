"""Z-Image LoRA files: the module paths tools/convert_lora.py resolves kohya names against (through
the spec's LORA_FILES). The model has diffusers names, and so do our files in every layout (kohya,
diffusers, ComfyUI's `diffusion_model.*`): converting between them changes the prefix only.

ComfyUI's own Z-Image model keeps the single-file names (checkpoint.py's table: a fused
attention.qkv, attention.out, x_embedder, final_layer). Its LoRA key map (comfy/lora.py
model_lora_keys_unet, the Lumina2 branch through comfy/utils.py z_image_to_diffusers) takes our
diffusers names under `diffusion_model.` / `transformer.` and patches to_q / to_k / to_v into the
qkv rows; a `lora_unet_` name it takes only in its own names (lora_unet_layers_0_attention_qkv, as
musubi-tuner's convert_z_image_lora_to_comfy.py writes). LoRAs in those names read as ours through
comfy_module_map."""

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
    ours = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    return ours + sorted(comfy_names(ours) - set(ours))


def comfy_names(paths) -> set[str]:
    """ComfyUI's module names of our module `paths` (to_q / to_k / to_v: the block's fused qkv)."""
    from library.models.zimage.checkpoint import QKV_MODULE, QKV_PART_MODULES, single_file_key

    names = set()
    for path in paths:
        part = next((p for p in QKV_PART_MODULES if path.endswith(p)), None)
        names.add(path[: -len(part)] + QKV_MODULE if part else single_file_key(path + ".weight")[: -len(".weight")])
    return names


def comfy_module_map(weights: dict, counts: dict[str, int]) -> dict[str, list[tuple[str, int, int]]]:
    """{ComfyUI module path: [(our module path, row0, row1)]} for the modules of `weights` (a LoRA read
    under ComfyUI's names; only up's rows are read) that ComfyUI names otherwise: a fused attention.qkv
    splits into to_q / to_k / to_v by thirds of its rows, a renamed module maps whole."""
    from library.models.zimage.checkpoint import QKV_MODULE, QKV_PART_MODULES, diffusers_key

    out = {}
    for path, w in weights.items():
        rows = w.up.shape[0]
        if path.endswith(QKV_MODULE):
            block, third = path[: -len(QKV_MODULE)], rows // 3
            out[path] = [(block + part, i * third, (i + 1) * third) for i, part in enumerate(QKV_PART_MODULES)]
        elif (ours := diffusers_key(path + ".weight")[: -len(".weight")]) != path:
            out[path] = [(ours, 0, rows)]
    return out


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
