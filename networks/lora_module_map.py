"""A LoRA between BFL module names and diffusers module names (its in-memory form: lora_files.LoRAWeights).

BFL-named models: BFL module names (`double_blocks.N.img_attn.qkv`) and diffusers names
(`transformer_blocks.N.attn.to_q`) differ, and some BFL modules are fused. `bfl_to_diffusers` /
`diffusers_to_bfl` convert through a module map `{bfl_path: [(diffusers_path, row_start, row_end)]}`
(rows of the BFL weight that form the diffusers module, in order), as the family's checkpoint module
builds it (named by its spec: LORA.diffusers_module_map, LORA_FILES.module_map).
"""

from __future__ import annotations

import torch

from library.io import CheckpointError
from networks.lora_files import LoRAWeights


def _full_rows(module_map: dict) -> dict[str, int]:
    return {bfl: max(end for _, _, end in parts) for bfl, parts in module_map.items()}


def bfl_to_diffusers(weights: dict[str, LoRAWeights], module_map: dict) -> dict[str, LoRAWeights]:
    """BFL-named LoRA -> diffusers-named LoRA. A fused module (qkv, linear1) becomes one LoRA per
    diffusers module with the same down (cloned) and the matching rows of up; alpha is kept."""
    out = {}
    for bfl, w in weights.items():
        if bfl not in module_map:
            raise CheckpointError(f"LoRA module '{bfl}' has no diffusers counterpart in the module map")
        rows: dict[str, list[torch.Tensor]] = {}
        magnitudes: dict[str, list[torch.Tensor]] = {}  # DoRA is per output row: rows split exactly
        for diffusers, start, end in module_map[bfl]:
            rows.setdefault(diffusers, []).append(w.up[start:end])
            if w.magnitude is not None:
                magnitudes.setdefault(diffusers, []).append(w.magnitude[start:end])
        if w.up.shape[0] != _full_rows(module_map)[bfl]:
            raise CheckpointError(f"LoRA module '{bfl}': up has {w.up.shape[0]} rows, the module map expects {_full_rows(module_map)[bfl]}")
        for diffusers, ups in rows.items():
            magnitude = torch.cat(magnitudes[diffusers], 0).clone() if w.magnitude is not None else None
            out[diffusers] = LoRAWeights(w.down.clone(), torch.cat(ups, 0).clone(), w.alpha, magnitude)
    return out


def diffusers_to_bfl(weights: dict[str, LoRAWeights], module_map: dict) -> dict[str, LoRAWeights]:
    """diffusers-named LoRA -> BFL-named LoRA. The parts of a fused module are stacked by rows;
    modules absent from the file contribute zero rows. When all parts share one down (bitwise) and
    one alpha, the result keeps that down, rank and alpha (exact inverse of bfl_to_diffusers);
    otherwise the downs are concatenated along the rank and up is block-diagonal with each part's
    scale folded in (float32), alpha = the new rank (scale 1), as kohya's converter does."""
    owner = {}
    for bfl, parts in module_map.items():
        for diffusers, _, _ in parts:
            owner[diffusers] = bfl
    unknown = [p for p in weights if p not in owner]
    if unknown:
        raise CheckpointError(f"LoRA module '{unknown[0]}' is not a diffusers module of the module map")
    out = {}
    full_rows = _full_rows(module_map)
    for bfl in dict.fromkeys(owner[p] for p in weights):
        segments = module_map[bfl]
        present = [d for d in dict.fromkeys(d for d, _, _ in segments) if d in weights]
        first = weights[present[0]]
        magnitude = _fused_magnitude(bfl, segments, {d: weights[d] for d in present}, full_rows[bfl])
        shared = all(
            torch.equal(weights[d].down, first.down) and weights[d].alpha == first.alpha for d in present
        )
        if shared:
            down, alpha = first.down, first.alpha
            up = torch.zeros(full_rows[bfl], first.rank, dtype=first.up.dtype)
        else:
            down = torch.cat([weights[d].down.float() for d in present], 0)
            alpha = float(down.shape[0])
            up = torch.zeros(full_rows[bfl], down.shape[0], dtype=torch.float32)
        rank_offset = {}
        offset = 0
        for d in present:
            rank_offset[d], offset = offset, offset + weights[d].rank
        consumed = dict.fromkeys(present, 0)
        for d, start, end in segments:
            if d not in weights:
                continue
            w, n = weights[d], end - start
            part = w.up[consumed[d] : consumed[d] + n]
            consumed[d] += n
            if shared:
                up[start:end] = part
            else:
                r0 = rank_offset[d]
                up[start:end, r0 : r0 + w.rank] = part.float() * w.scale
        for d in present:
            if consumed[d] != weights[d].up.shape[0]:
                raise CheckpointError(
                    f"LoRA module '{d}': up has {weights[d].up.shape[0]} rows, the module map gives it {consumed[d]}"
                )
        out[bfl] = LoRAWeights(down.clone(), up, alpha, magnitude)
    return out


def _fused_magnitude(bfl: str, segments, parts: dict[str, LoRAWeights], rows: int) -> torch.Tensor | None:
    """The DoRA magnitudes of a fused module's parts stacked by rows (None for a plain LoRA). A
    part the file lacks would need ||W|| of its rows, which only the base knows: an error."""
    dora = [d for d, w in parts.items() if w.magnitude is not None]
    if not dora:
        return None
    missing = [d for d, _, _ in segments if d not in dora]
    if missing:
        raise CheckpointError(f"DoRA module '{missing[0]}' is missing or plain LoRA, so the fused '{bfl}' magnitude "
                              f"cannot be built (it would need the base weight's row norms)")
    magnitude = torch.zeros(rows, dtype=torch.float32)
    consumed = dict.fromkeys(parts, 0)
    for d, start, end in segments:
        magnitude[start:end] = parts[d].magnitude[consumed[d] : consumed[d] + end - start].float()
        consumed[d] += end - start
    return magnitude
