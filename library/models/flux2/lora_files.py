"""FLUX.2 LoRA files: the module maps and paths tools/convert_lora.py and networks/lora.py use
(through the spec's LORA / LORA_FILES), and how a LoRA in FLUX.1's BFL block names is told to be
FLUX.2's.

Conversion is FLUX.1's (flux1/lora_files.py) through checkpoint.flux2_diffusers_module_map: the
double blocks' qkv split into to_q/to_k/to_v, add_*_proj; the single blocks' linear1 / linear2 stay
fused as attn.to_qkv_mlp_proj / attn.to_out. FLUX.1 and FLUX.2 share their BFL block names: a
FLUX-named LoRA is FLUX.2's when it names a FLUX.2-only module (ff.linear_in, to_qkv_mlp_proj, the
shared *_stream_modulation: the spec's LORA_FILES.markers), when its metadata says so
(ss_base_model_version flux2-*, what train_lora.py writes; musubi-tuner's modelspec.architecture
Flux.2-dev/lora, Flux.2-klein-4b/lora), or by its MLP widths (FLUX.2's SwiGLU:
fused MLP-in rows = 6 x hidden, single linear1 = 9 x hidden; FLUX.1: 4 x, 7 x); else FLUX.1's (for
attention-only LoRAs both convert to the same names). --model_type flux2 settles it.
"""

from __future__ import annotations

import re

from library.models.flux1.lora_files import ATTN, all_paths, block_depths, sizes_from_lora
from library.models.flux2.checkpoint import RowMap, flux2_diffusers_module_map

# (BFL / diffusers module of a fused MLP input, FLUX.1's and FLUX.2's rows per input width)
MLP_RATIOS = [(re.compile(r"(img|txt)_mlp[._]0$"), 4, 6), (re.compile(r"single_blocks[._]\d+[._]linear1$"), 7, 9)]


def has_flux2_mlp(tensors: dict) -> bool:
    """True for a LoRA with FLUX.2's MLP widths (6 x / 9 x hidden rows), where neither its names nor its header
    (the spec's markers, model_versions) told (module docstring). Meta tensors do: only shapes are read."""
    return mlp_ratio(tensors) == "flux2"


def has_flux1_mlp(tensors: dict) -> bool:
    """True for a LoRA with FLUX.1's MLP widths (4 x / 7 x hidden rows): no FLUX.2 model takes it."""
    return mlp_ratio(tensors) == "flux"


def mlp_ratio(tensors: dict) -> str | None:
    """"flux" or "flux2": whose MLP widths the first fused MLP input the LoRA names has (None: none named)."""
    for key, up in tensors.items():
        for up_suffix, down_suffix in ((".lora_up.weight", ".lora_down.weight"), (".lora_B.weight", ".lora_A.weight")):
            module = key[: -len(up_suffix)]
            down = tensors.get(module + down_suffix) if key.endswith(up_suffix) else None
            for pattern, flux1_ratio, flux2_ratio in MLP_RATIOS if down is not None else ():
                if pattern.search(module) and up.shape[0] in (flux1_ratio * down.shape[1], flux2_ratio * down.shape[1]):
                    return "flux2" if up.shape[0] == flux2_ratio * down.shape[1] else "flux"
    return None


def module_map_of_config(cfg) -> RowMap:
    """BFL <-> diffusers module map of a model built from `cfg` (a Flux2Config)."""
    return flux2_diffusers_module_map(cfg.depth, cfg.depth_single, cfg.hidden_size, cfg.mlp_hidden, cfg.in_channels,
                                      cfg.guidance_embed)


def module_paths(counts: dict[str, int]) -> list[str]:
    """Every FLUX.2 Linear path, BFL and diffusers names."""
    return all_paths(flux2_diffusers_module_map(*block_depths(counts), 1, 1))


# The MLP input projections hold [gate | up] (2 x mlp rows), linear1 [q | k | v | gate | up].
BFL_SIZES = [
    (r"double_blocks\.\d+\.(img|txt)_(attn\.(qkv|proj)|mlp\.0)|single_blocks\.\d+\.linear1|.*_modulation.*\.lin", "hidden", "in"),
    (r"double_blocks\.\d+\.(img|txt)_(attn\.proj|mlp\.2)|single_blocks\.\d+\.linear2|img_in|txt_in", "hidden", "out"),
    (r"double_blocks\.\d+\.(img|txt)_mlp\.0", "mlp", "out/2"),
    (r"double_blocks\.\d+\.(img|txt)_mlp\.2", "mlp", "in"),
    (r"single_blocks\.\d+\.linear1", "mlp", "(out-3h)/2"),
    (r"single_blocks\.\d+\.linear2", "mlp", "in-h"),
    (r"final_layer\.linear", "out_channels", "out"),
]
DIFFUSERS_SIZES = [
    (ATTN + r"|.*ff(_context)?\.linear_in|.*to_qkv_mlp_proj|.*_modulation.*\.linear", "hidden", "in"),
    (ATTN + r"|.*ff(_context)?\.linear_out|x_embedder|context_embedder", "hidden", "out"),
    (r".*ff(_context)?\.linear_in", "mlp", "out/2"),
    (r".*ff(_context)?\.linear_out", "mlp", "in"),
    (r".*to_qkv_mlp_proj", "mlp", "(out-3h)/2"),
    (r"single_transformer_blocks\.\d+\.attn\.to_out", "mlp", "in-h"),
    (r"proj_out", "out_channels", "out"),
]


def module_map_of_lora(weights: dict, counts: dict[str, int]) -> RowMap:
    """The module map of the FLUX.2 model a LoRA was made for (its blocks and shapes)."""
    s = sizes_from_lora(weights, (BFL_SIZES, DIFFUSERS_SIZES), mlp_ratio=3, out_channels=128)
    return flux2_diffusers_module_map(*block_depths(counts), s["hidden"], s["mlp"], s["out_channels"], guidance=True)
