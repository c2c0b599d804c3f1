"""Lumina 2 LoRA files: the module maps and paths tools/convert_lora.py, tools/merge_lora.py and networks/lora.py use
(through the spec's LORA / LORA_FILES).

Our modules have the released single file's names (`layers.0.attention.qkv`, `feed_forward.w1`), which sd-scripts'
kohya files (`lora_unet_layers_0_attention_qkv`) and ComfyUI's `diffusion_model.` files use. diffusers splits the
fused qkv into to_q / to_k / to_v (grouped-query: n_heads, n_kv_heads, n_kv_heads heads of rows) and renames the rest
(checkpoint.diffusers_keys): {ours: [(diffusers, row0, row1)]}, in the format of FLUX.1's row maps.

Z-Image's single file has these names too (lora_arch.variant_of asks has_lumina2_shapes): Lumina 2's qkv is
grouped-query (its rows 5/3 of its width at release, where Z-Image's are 3 times), and its width 2304.
"""

from __future__ import annotations

import torch

from library.models.lumina2.checkpoint import DIFFUSERS_MARKER, QKV, QKV_PARTS, _PIECES, _PREFIXES, diffusers_keys
from library.models.lumina2.model import LUMINA2, Lumina2, Lumina2Config

_QKV_MODULE = QKV[: -len(".weight")]  # ".attention.qkv"
_QKV_PART_MODULES = tuple(p[: -len(".weight")] for p in QKV_PARTS)  # ".attn.to_q" ...


def _diffusers_modules(path: str) -> tuple[str, ...]:
    """Our Linear's diffusers module path(s): to_q / to_k / to_v for a fused qkv."""
    return tuple(k[: -len(".weight")] for k in diffusers_keys(path + ".weight"))


def _qkv_rows(config: Lumina2Config) -> tuple[int, int, int]:
    return (config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim, config.n_kv_heads * config.head_dim)


def _split(path: str, rows: int, qkv_rows: tuple[int, int, int]) -> list[tuple[str, int, int]]:
    """[(diffusers module, row0, row1)] of our module `path` with `rows` output rows."""
    names = _diffusers_modules(path)
    if len(names) == 1:
        return [(names[0], 0, rows)]
    starts = [0, qkv_rows[0], qkv_rows[0] + qkv_rows[1], rows]
    return [(name, starts[i], starts[i + 1]) for i, name in enumerate(names)]


def module_map_of_config(cfg: Lumina2Config) -> dict[str, list[tuple[str, int, int]]]:
    """Ours <-> diffusers module map of a model built from `cfg` (on meta)."""
    with torch.device("meta"):
        model = Lumina2(cfg)
    qkv = _qkv_rows(cfg)
    return {name: _split(name, m.out_features, qkv) for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear)}


def _config_of_counts(counts: dict[str, int]) -> Lumina2Config:
    """A small Lumina 2 with as many blocks as a LoRA names (only the names matter)."""
    refiners = max(counts.get("noise_refiner", 0), counts.get("context_refiner", 0))
    return Lumina2Config(dim=24, n_heads=3, n_kv_heads=1, n_layers=counts.get("layers", 0),
                         n_refiner_layers=refiners, cap_feat_dim=8, multiple_of=8, axes_dims=(2, 2, 4))


def module_paths(counts: dict[str, int]) -> list[str]:
    """Every Lumina 2 Linear path of a model with the blocks a LoRA names, ours then diffusers' names."""
    table = module_map_of_config(_config_of_counts(counts))
    return list(table) + [name for parts in table.values() for name, _, _ in parts if name not in table]


def our_module(path: str) -> str:
    """A diffusers module path back to ours (to_q / to_k / to_v: their fused qkv); ours pass unchanged."""
    key = path + "."
    for part in _QKV_PART_MODULES:
        if path.endswith(part):
            return path[: -len(part)] + _QKV_MODULE
    for ours, theirs in _PREFIXES:
        if key.startswith(theirs):
            return (ours + key[len(theirs):])[:-1]
    for ours, theirs in _PIECES:
        if theirs in key:
            return key.replace(theirs, ours)[:-1]
    return path


def module_map_of_lora(weights: dict, counts: dict[str, int]) -> dict[str, list[tuple[str, int, int]]]:
    """The module map of the modules a LoRA names (in either naming), rows from its own matrices: our fused qkv's q
    is as wide as the model (its down's input) and k, v share the rest; diffusers' to_q / to_k / to_v give theirs (a
    part the file lacks: q the width, v as k)."""
    out, parts = {}, {}
    for path, w in weights.items():
        ours = our_module(path)
        if ours == path and path.endswith(_QKV_MODULE):
            q, rows = w.down.shape[1], w.up.shape[0]
            out[ours] = _split(ours, rows, (q, (rows - q) // 2, (rows - q) // 2))
        elif ours.endswith(_QKV_MODULE):
            parts.setdefault(ours, {})[path[len(ours) - len(_QKV_MODULE):]] = (w.up.shape[0], w.down.shape[1])
        else:
            out[ours] = [(_diffusers_modules(ours)[0], 0, w.up.shape[0])]
    for ours, found in parts.items():
        width = next(iter(found.values()))[1]
        q, k, v = (found.get(p, (None,))[0] for p in _QKV_PART_MODULES)
        q, k = q or width, k or v
        out[ours] = _split(ours, q + 2 * k, (q, k, v or k))
    return out


def module_map_of_keys(keys, shape) -> dict[str, list[tuple[str, int, int]]]:
    """The module map of a diffusers transformer/ folder's Linears (every 2-D weight), rows from its shapes
    (`shape(key)`): to_q / to_k / to_v fuse into our qkv by their rows."""
    weights = {k[: -len(".weight")]: _Shapes(shape(k)) for k in keys if k.endswith(".weight") and len(shape(k)) == 2}
    return module_map_of_lora(weights, {})


class _Shapes:
    """A Linear weight's shape where module_map_of_lora reads a LoRA's up and down matrices."""

    def __init__(self, shape):
        self.up, self.down = torch.empty(shape[0], 0, device="meta"), torch.empty(0, shape[1], device="meta")


def has_lumina2_shapes(tensors: dict) -> bool:
    """A LoRA in the single file's names (Z-Image's too) that is Lumina 2's: a qkv whose up rows are not three times
    its down's input width (grouped-query attention), or a block Linear reading the released width 2304."""
    downs, ups = {}, {}
    for key, t in tensors.items():
        flat = key.replace(".", "_")
        for store, parts in ((downs, ("lora_down_weight", "lora_A_weight")),
                             (ups, ("lora_up_weight", "lora_B_weight"))):
            for part in parts:
                if flat.endswith(part) and getattr(t, "ndim", 0) == 2:
                    store[flat[: -len(part)]] = t.shape
    for module, shape in downs.items():
        if module.endswith("attention_qkv_") and module in ups and ups[module][0] != 3 * shape[1]:
            return True
    return any(shape[1] == LUMINA2.dim for m, shape in downs.items() if "attention_" in m or "feed_forward_w" in m)
