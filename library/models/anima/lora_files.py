"""Anima LoRA files: the module maps and paths tools/convert_lora.py, tools/merge_lora.py and networks/lora.py use
(through the spec's LORA / LORA_FILES).

Our modules have the released single file's names (`blocks.0.self_attn.q_proj`, `llm_adapter.blocks.0.mlp.0`),
which sd-scripts' kohya files (`lora_unet_blocks_0_self_attn_q_proj`) and ComfyUI's `diffusion_model.` files use;
diffusers names the DiT's otherwise (`transformer_blocks.0.attn1.to_q`: checkpoint.DIFFUSERS_NAMES) and holds the
adapter as another component (`text_conditioner.blocks.0.mlp.0`). Nothing is fused, so the map is a rename, one
module to one module: {ours: [(diffusers, 0, rows)]} in the format of FLUX.1's row maps. The adapter's modules keep
their names in it (a `transformer.`-prefixed diffusers file cannot hold them: an adapter LoRA deploys through
`--to comfy`, whose `diffusion_model.llm_adapter.*` keys diffusers' AnimaLoraLoaderMixin reads too).
"""

from __future__ import annotations

import torch

from library.models.anima.checkpoint import DIFFUSERS_NAMES, diffusers_name
from library.models.anima.model import Anima, AnimaConfig

ADAPTER = "llm_adapter."
# A key only a Cosmos DiT's diffusers transformer/ has: its blocks' adaLN-LoRA pairs as norm1-3.linear_1 / _2
DIFFUSERS_MARKER = "transformer_blocks.0.norm2.linear_1.weight"


def diffusers_module(path: str) -> str:
    """A DiT Linear's diffusers module path (the adapter's: unchanged)."""
    if path.startswith(ADAPTER):
        return path
    return diffusers_name(path + ".weight")[1][: -len(".weight")]


def our_module(path: str) -> str:
    """A diffusers-named DiT module path back to ours (ours pass unchanged)."""
    if path.startswith(ADAPTER):
        return path
    for ours, theirs in reversed(DIFFUSERS_NAMES):
        path = path.replace(theirs, ours)
    return path


def _linears(config: AnimaConfig) -> dict[str, int]:
    """{our Linear path: output rows} of a model built from `config` (on meta)."""
    with torch.device("meta"):
        model = Anima(config)
    return {name: m.out_features for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def module_map_of_config(cfg: AnimaConfig) -> dict[str, list[tuple[str, int, int]]]:
    """Ours <-> diffusers module map of a model built from `cfg`."""
    return {path: [(diffusers_module(path), 0, rows)] for path, rows in _linears(cfg).items()}


def _config_of_counts(counts: dict[str, int]) -> AnimaConfig:
    """A small Anima with as many blocks as a LoRA names (only the names matter)."""
    return AnimaConfig(num_blocks=max(counts.get("blocks", 0), counts.get("transformer_blocks", 0), 1),
                       hidden_size=32, num_heads=1, adaln_lora_dim=4, text_dim=8, adapter_layers=6, adapter_dim=8,
                       adapter_heads=1, adapter_source_dim=8, t5_vocab_size=8, mlp_ratio=1.0)


def module_paths(counts: dict[str, int]) -> list[str]:
    """Every Anima Linear path of a model with the blocks a LoRA names, ours then diffusers' names."""
    table = module_map_of_config(_config_of_counts(counts))
    return list(table) + [parts[0][0] for path, parts in table.items() if not path.startswith(ADAPTER)]


def module_map_of_lora(weights: dict, counts: dict[str, int]) -> dict[str, list[tuple[str, int, int]]]:
    """The module map of the modules a LoRA names (in either naming), rows from its own up matrices."""
    return {(ours := our_module(path)): [(diffusers_module(ours), 0, w.up.shape[0])] for path, w in weights.items()}


def module_map_of_keys(keys, shape) -> dict[str, list[tuple[str, int, int]]]:
    """The module map of a diffusers transformer/ folder's Linears (every 2-D weight of a Cosmos DiT), rows from
    its shapes (`shape(key)`)."""
    linears = [k[: -len(".weight")] for k in keys if k.endswith(".weight") and len(shape(k)) == 2]
    return {our_module(path): [(path, 0, shape(path + ".weight")[0])] for path in linears}


def diffusers_refuses(paths: list[str]) -> str | None:
    """The adapter's modules are the pipeline's text_conditioner, not its transformer (LORA_FILES.diffusers_refuses)."""
    adapter = [p for p in paths if our_module(p).startswith(ADAPTER)]
    if not adapter:
        return None
    return (f"{len(adapter)} LLM adapter modules (e.g. '{adapter[0]}') are the diffusers pipeline's text_conditioner, "
            f"which a transformer.* file cannot hold: use --to comfy (diffusion_model.llm_adapter.*, which diffusers' "
            f"Anima loader reads too)")
