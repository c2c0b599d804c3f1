"""LoRA files: one in-memory form, the key layouts people load, and safetensors I/O.

Canonical form: `{module_path: LoRAWeights(down [r, in], up [out, r], alpha)}` with dotted module
paths of the model the LoRA applies to; the delta it adds to that module's weight is
`(alpha / r) * up @ down`. Tensors keep the dtype they were read in; every conversion computes in
float32 and writers cast to the requested dtype at the end.

Layouts on disk (`detect_format`):
- "kohya":  `lora_unet_<path with '.' -> '_'>.{lora_down.weight, lora_up.weight, alpha}` (sd-scripts,
  musubi-tuner, ComfyUI, diffusers' kohya converters). `_` is ambiguous, so names are mapped back
  through the model's known module paths (`resolve_kohya_names`).
- "peft":   `<prefix>.<path>.{lora_A.weight, lora_B.weight}` (diffusers / PEFT; prefix `transformer.`,
  `base_model.model.` ...). Alpha comes from diffusers' `lora_adapter_metadata` header entry when
  present, else alpha = rank (scale 1). We write alpha folded into lora_B, so no header is needed.
  Keys with a PEFT adapter name (`lora_A.default.weight`: a raw model.state_dict()) read without it, and
  its wrapped Linears' own `<module>.base_layer.weight` / `.bias` are left out (base_layer_keys).
- "comfy":  `diffusion_model.<path>.{lora_down.weight, lora_up.weight, alpha}` (dotted paths).
- PEFT adapter folder (LLMs): `adapter_config.json` + `adapter_model.safetensors` with keys
  `base_model.model.<path>.lora_A.weight` / `lora_B.weight`; lora_B is NOT scaled, the config holds
  r / lora_alpha and rank_pattern / alpha_pattern for modules that differ (PEFT's scale is
  alpha / r per module). `read_lora` takes the folder (or its adapter_model.safetensors);
  networks/lora_peft_folder.py writes one.

BFL-named models' split and fused modules: networks/lora_module_map.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import warnings
from dataclasses import dataclass

import torch
from safetensors.torch import save as safetensors_bytes

from library.io import CheckpointError, CheckpointReader, save_safetensors
from networks.lora_metadata import (METADATA_KEYS, MODELSPEC_HASH, MODELSPEC_VERSION, PACKED_EXPERTS_KEY,  # noqa: F401
                                    build_metadata, dim_and_alpha, modelspec_fields, packed_experts,
                                    packed_experts_header)  # (their importers find them here too)


@dataclass
class LoRAWeights:
    """One module's LoRA: down [r, in], up [out, r]; delta W = (alpha / r) * up @ down.

    A packed weight's (experts set: a weight [E, K, N] of E experts used as x @ W[e], library/precision/fp8_packed.py)
    is PEFT's ParamWrapper's layout, which reads the weight as E matrices [out, in] = [K, N]: down (lora_A)
    [r E, N] with expert e's rows e r .. e r + r - 1, up (lora_B) [K, r E] with expert e's columns e, E + e, ...
    (rank-major); delta[e] = (alpha / r) * up_e @ down_e [K, N], r the rank of one expert (packed_factors)."""

    down: torch.Tensor
    up: torch.Tensor
    alpha: float
    magnitude: torch.Tensor | None = None  # DoRA: m [out], one per output row; None for a plain LoRA
    experts: int | None = None  # a packed weight's LoRA: its E; None for a Linear's

    @property
    def rank(self) -> int:
        return self.down.shape[0] // (self.experts or 1)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the weight it changes: (out, in), or (E, K, N) for a packed weight's."""
        if self.experts:
            return self.experts, self.up.shape[0], self.down.shape[1]
        return self.up.shape[0], self.down.shape[1]

    def packed_factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A packed weight's LoRA per expert: (up [E, K, r], down [E, r, N]), views of contiguous factors."""
        experts, rank = self.experts, self.rank
        return self.up.reshape(-1, rank, experts).permute(2, 0, 1), self.down.reshape(experts, rank, -1)

    def delta(self) -> torch.Tensor:
        """The low-rank update (alpha / r) * up @ down [out, in] (a packed weight's [E, K, N], expert by
        expert), float32 (the whole weight delta of a plain LoRA; for DoRA use merged())."""
        if self.experts:
            up, down = self.packed_factors()
            return self.scale * torch.bmm(up.float(), down.float())
        return self.scale * (self.up.float() @ self.down.float())

    def merged(self, weight: torch.Tensor, multiplier: float = 1.0) -> torch.Tensor:
        """The base weight [out, in] with this adapter merged at `multiplier`, float32.
        LoRA: W + multiplier * dW. DoRA (the paper, PEFT): W' = m * (W + dW) / ||W + dW||, the
        norm over the input dim per output row; a multiplier interpolates, W + multiplier * (W' - W),
        as ComfyUI applies strength."""
        w = weight.float()
        adapted = w + self.delta().to(w.device)
        if self.magnitude is None:
            return w + multiplier * (adapted - w)
        decomposed = adapted * (self.magnitude.float().to(w.device) / adapted.norm(dim=1)).unsqueeze(1)
        return w + multiplier * (decomposed - w)


def first_non_finite(named_tensors) -> str | None:
    """"<label> holds 3 non-finite values (NaN / inf) of 64" for the first of (label, tensor) pairs that holds a NaN
    or inf (a diverged training's LoRA), None where every value is finite."""
    for label, tensor in named_tensors:
        if bad := int((~torch.isfinite(tensor.float())).sum()):
            return f"{label} holds {bad} non-finite value{'s' * (bad > 1)} (NaN / inf) of {tensor.numel()}"
    return None


def refuse_non_finite_tensors(tensors: dict, source: str, why: str) -> None:
    """A NaN / inf in a LoRA file's float tensors (a diverged training's): a CheckpointError naming the first one
    ("<source>: tensor 'key' holds 3 non-finite values ...: a broken LoRA, <why>")."""
    if problem := first_non_finite((f"tensor '{k}'", t) for k, t in tensors.items() if t.is_floating_point()):
        raise CheckpointError(f"{source}: {problem}: a broken LoRA, {why}")


def non_finite_factor(weights: dict[str, LoRAWeights]) -> str | None:
    """first_non_finite of the factors of `weights`: "module 'name' down holds 3 non-finite values ...", or None."""
    return first_non_finite((f"module '{name}' {part}", tensor) for name, w in weights.items()
                            for part, tensor in (("down", w.down), ("up", w.up), ("DoRA magnitude", w.magnitude))
                            if tensor is not None)


def merge_into_weight(weight: torch.Tensor, loras) -> torch.Tensor:
    """A base weight [out, in] (a packed weight's [E, K, N]) with LoRAs merged, in the order given: loras =
    [(ratio, w)], w a LoRAWeights or anything with merged(weight, ratio) (DoRA, LyCORIS). float32 (a copy: the base is
    never written to): W + ratio * (alpha / r) up @ down per plain LoRA, in one addmm each, the math
    tools/merge_lora.py writes checkpoints with and the trainer's base_loras merge with."""
    tensor = weight.to(torch.float32, copy=True)
    for ratio, w in loras:
        if isinstance(w, LoRAWeights) and w.experts:  # [E, K, N] += up_e @ down_e, one batched GEMM
            up, down = (f.float().to(tensor.device) for f in w.packed_factors())
            tensor.baddbmm_(up, down, alpha=ratio * w.scale)
        elif isinstance(w, LoRAWeights) and w.magnitude is None:
            tensor.addmm_(w.up.float().to(tensor.device), w.down.float().to(tensor.device), alpha=ratio * w.scale)
        else:  # DoRA or LyCORIS: the merged weight, not an additive low-rank delta
            tensor = w.merged(tensor, ratio)
    return tensor


# ----------------------------------------------------------------------------------------------
# Key layouts

# kohya name prefixes: lora_unet_ (the denoiser), lora_te_ (a lone text encoder: our LLM LoRAs), lora_te1_ /
# lora_te2_ / lora_te3_ (a diffusion model's text encoders: sd-scripts' networks write CLIP-L as lora_te1_
# and T5-XXL as lora_te3_, SDXL CLIP-G as lora_te2_; where an architecture's files use one for another encoder,
# its LoRAFiles.text_encoders says so), lora_transformer_ (OneTrainer, SimpleTuner).
KOHYA_PREFIXES = ("lora_unet_", "lora_te_", "lora_te1_", "lora_te2_", "lora_te3_", "lora_transformer_")
TEXT_ENCODER_PREFIXES = {"lora_te1_": "CLIP-L", "lora_te2_": "CLIP-G", "lora_te3_": "T5-XXL",
                         # dotted: diffusers' pipelines save a text encoder's LoRA under the component's name
                         # (text_encoder: CLIP-L where a pipeline has it), ComfyUI's extraction under text_encoders.
                         "text_encoder.": "diffusers", "text_encoder_2.": "diffusers", "text_encoders.": "ComfyUI"}
KOHYA_TEXT_ENCODERS = ("lora_te1_", "lora_te2_", "lora_te3_")  # the ones a kohya file holds beside lora_unet_
PEFT_PREFIXES = ("transformer.", "diffusion_model.", "base_model.model.", "unet.", "model.diffusion_model.")
COMFY_PREFIXES = ("diffusion_model.", "model.diffusion_model.", "transformer.")
# Where a name fits no module: networks/lora_reader.py reads every layout and naming a family knows, so a
# name it cannot place is most likely another model's.
NAME_ADVICE = "tools/lora_info.py tells which model a LoRA is for"
ADAPTER_METADATA_KEY = "lora_adapter_metadata"  # diffusers' safetensors header entry (PEFT config json)
FOLDED_MARK = "lora_alpha_folded"  # header entry of our PEFT-layout outputs: alpha / rank is inside lora_B

_PART_OF_SUFFIX = {
    ".lora_down.weight": "down",
    ".lora_up.weight": "up",
    ".alpha": "alpha",
    ".lora_A.weight": "down",
    ".lora_B.weight": "up",
    ".dora_scale": "magnitude",  # kohya / LyCORIS / ComfyUI DoRA magnitude, [out, 1]
    ".lora_magnitude_vector": "magnitude",  # PEFT / diffusers DoRA magnitude, [out]
}


def kohya_name(path: str, prefix: str = "lora_unet") -> str:
    """`double_blocks.0.img_attn.qkv` -> `lora_unet_double_blocks_0_img_attn_qkv`."""
    return f"{prefix}_{path.replace('.', '_')}"


def resolve_kohya_names(names, module_paths, strict: bool = True) -> dict[str, str]:
    """Map kohya module names (any prefix of KOHYA_PREFIXES) back to dotted module paths.

    '_' is ambiguous (`img_attn` vs `img.attn`), so the answer comes from the model's own module
    paths. strict: a name that fits no module is a CheckpointError naming it; otherwise it maps to
    itself (the caller reports it as a module the model lacks)."""
    by_flat: dict[str, str] = {}
    for path in module_paths:
        flat = path.replace(".", "_")
        if flat in by_flat and by_flat[flat] != path:
            raise CheckpointError(f"module paths '{by_flat[flat]}' and '{path}' share the kohya name '{flat}'")
        by_flat[flat] = path
    resolved = {}
    for name in names:
        prefix = next((p for p in KOHYA_PREFIXES if name.startswith(p)), None)
        flat = name[len(prefix) :] if prefix else None
        if flat not in by_flat and not strict:
            resolved[name] = name
            continue
        if flat not in by_flat:
            raise CheckpointError(f"LoRA module '{name}' matches no module of the model (expected lora_unet_<module path>; "
                                  f"{NAME_ADVICE})")
        resolved[name] = by_flat[flat]
    return resolved


def _kohya_flat(name: str) -> str | None:
    """A kohya module name less its prefix (`lora_unet_double_blocks_0_qkv` -> `double_blocks_0_qkv`), else None."""
    prefix = next((p for p in KOHYA_PREFIXES if name.startswith(p)), None)
    return name[len(prefix) :] if prefix else None


def naming(source: str, error: Exception) -> CheckpointError:
    """`error` as a CheckpointError whose message starts with `source` (the file it is about)."""
    text = str(error)
    return CheckpointError(text if text.startswith(f"{source}:") else f"{source}: {text}")


def _split_key(key: str) -> tuple[str, str]:
    for suffix, part in _PART_OF_SUFFIX.items():
        if key.endswith(suffix):
            return key[: -len(suffix)], part
    raise CheckpointError(f"LoRA key '{key}': expected a name ending in {', '.join(_PART_OF_SUFFIX)} (is it a LoRA file?)")


def detect_format(keys) -> str:
    """'kohya', 'peft' or 'comfy' from the tensor names (see the module docstring)."""
    keys = list(keys)
    if not keys:
        raise CheckpointError("LoRA file holds no tensors")
    peft = [k for k in keys if k.endswith((".lora_A.weight", ".lora_B.weight"))]
    if peft:
        other = [k for k in keys if k not in peft and not k.endswith((".alpha", ".lora_magnitude_vector", ".dora_scale"))]
        if other:
            raise CheckpointError(f"LoRA key '{other[0]}' mixes with PEFT keys like '{peft[0]}'")
        return "peft"
    modules = sorted({_split_key(k)[0] for k in keys})
    kohya = [m for m in modules if "." not in m and m.startswith(KOHYA_PREFIXES)]
    dotted = [m for m in modules if "." in m]
    if len(kohya) == len(modules):
        return "kohya"
    if len(dotted) == len(modules):
        return "comfy"
    odd = [m for m in modules if m not in kohya and m not in dotted]
    if odd:  # the offender: a kohya-style name of no known prefix
        raise CheckpointError(f"LoRA module '{odd[0]}' is neither kohya (a name starting with "
                              f"{', '.join(KOHYA_PREFIXES)}) nor a dotted module path")
    raise CheckpointError(f"LoRA module '{dotted[0]}' is a dotted path while '{kohya[0]}' is a kohya name: one layout per file")


# The last part of a LyCORIS-only tensor name: a prefix (LoKr, LoHa, OFT) or the whole part (full
# `diff` / `diff_b`, (IA)^3). Matched on that part only: `.diff` is also the start of `.diffusion_model`.
LYCORIS_KEY_PREFIXES = {"lokr_": "LoKr", "hada_": "LoHa", "oft_": "OFT"}
LYCORIS_KEY_NAMES = {"diff": "full", "diff_b": "full", "on_input": "(IA)^3"}


def lycoris_kind(key: str) -> str | None:
    """'LoKr', 'LoHa', 'OFT', 'full' or '(IA)^3' for a tensor name of that LyCORIS-only type, else None."""
    last = key.rsplit(".", 1)[-1]
    return LYCORIS_KEY_NAMES.get(last) or next((kind for p, kind in LYCORIS_KEY_PREFIXES.items() if last.startswith(p)), None)


def is_lycoris_file(tensors) -> bool:
    """True when the keys are LyCORIS-only types (LoKr, LoHa, (IA)^3, full ...), not plain LoRA (whose
    tensors beside it are split_beside_lora')."""
    return any(lycoris_kind(k) for k in split_beside_lora(dict.fromkeys(tensors))[0])


LYCORIS_COMFY_PREFIX = "diffusion_model."  # ai-toolkit's dotted LyCORIS names, as convert_lora --to comfy writes them


def lycoris_kohya_names(tensors: dict, prefix: str = "lora_unet") -> dict:
    """A LyCORIS file's tensors under LyCORIS' kohya names, the ones its loader (and ours) looks modules up by:
    `diffusion_model.<module path>.<part>` -> `<prefix>_<module path, '.' as '_'>.<part>`, as LyCORIS names a
    module; kohya names as they are. A part is one name (lokr_w1, hada_w2_a, alpha, dora_scale ...) or a LoCon
    module's lora_down.weight / lora_up.weight."""
    out = {}
    for key, tensor in tensors.items():
        if key.startswith(LYCORIS_COMFY_PREFIX):
            part = next((s for s in _PART_OF_SUFFIX if key.endswith(s)), "." + key.rpartition(".")[2])
            module = key[len(LYCORIS_COMFY_PREFIX) : -len(part)]
            key = f"{prefix}_{module.replace('.', '_')}{part}"
        out[key] = tensor
    return out


# Tensors trainers save beside a down/up LoRA that no LoRA network applies: kind -> what it is. ".diff" / ".diff_b":
# the last part of a key (ComfyUI's Extract and Save Lora writes them for 1-D weights and, with bias_diff, its
# default, for biases); "bundle_emb.": the first (OneTrainer's embeddings bundled with the LoRA).
BESIDE_LORA = {".diff": "whole 1-D weight deltas", ".diff_b": "bias deltas", "bundle_emb.": "OneTrainer's bundled embeddings"}


def whole_delta_suffix(key: str) -> str | None:
    """".diff" / ".diff_b" for a whole weight / bias delta's key (ComfyUI's extraction, LyCORIS' full type), else None."""
    last = "." + key.rsplit(".", 1)[-1]
    return last if last in (".diff", ".diff_b") else None


def _beside_kind(key: str) -> str | None:
    return "bundle_emb." if key.startswith("bundle_emb.") else whole_delta_suffix(key)


def split_beside_lora(tensors: dict) -> tuple[dict, dict]:
    """(the down/up LoRA's tensors, the tensors saved beside it: BESIDE_LORA) of a file holding both. A LoRA
    network applies down/up only, so callers leave them out and say so (beside_lora_note). A file without
    down/up modules is (tensors, {}): whole deltas alone are LyCORIS' full type."""
    beside = {k: v for k, v in tensors.items() if _beside_kind(k)}
    if not beside or not any(k.endswith((".lora_down.weight", ".lora_A.weight")) for k in tensors):
        return tensors, {}
    return {k: v for k, v in tensors.items() if k not in beside}, beside


def beside_lora_note(beside) -> str:
    """'14 tensors beside the LoRA (bias deltas .diff_b x12, OneTrainer's bundled embeddings bundle_emb. x2)'
    for split_beside_lora's second part."""
    kinds = [f"{what} {kind} x{n}" for kind, what in BESIDE_LORA.items() if (n := sum(_beside_kind(k) == kind for k in beside))]
    return f"{len(beside)} tensors beside the LoRA ({', '.join(kinds)})"


def split_text_encoders(tensors: dict) -> tuple[dict, dict]:
    """(the denoiser's tensors, the text encoders' tensors: TEXT_ENCODER_PREFIXES) of a LoRA file.
    sd-scripts trains CLIP-L / T5-XXL beside a transformer into one file; no transformer tool
    applies them, so callers keep them aside and say so (text_encoder_note)."""
    te = {k: v for k, v in tensors.items() if k.startswith(tuple(TEXT_ENCODER_PREFIXES))}
    return {k: v for k, v in tensors.items() if k not in te}, te


def _module_of(key: str) -> str:
    """A dotted key's module: its part suffix (.lora_A.weight ...) or last component stripped."""
    return next((key[: -len(s)] for s in _PART_OF_SUFFIX if key.endswith(s)), key.rsplit(".", 1)[0])


def text_encoder_note(te_tensors, labels: dict[str, str] | None = None) -> str:
    """'3 text-encoder modules (CLIP-L lora_te1_ x2, T5-XXL lora_te3_ x1)' for split_text_encoders' second part.
    labels: prefix -> encoder where the file's architecture says another than TEXT_ENCODER_PREFIXES
    (lora_arch.text_encoder_labels)."""
    modules = {k.split(".")[0] if k.startswith(KOHYA_TEXT_ENCODERS) else _module_of(k) for k in te_tensors}
    named = {**TEXT_ENCODER_PREFIXES, **(labels or {})}
    counts = [f"{named[p]} {p} x{sum(m.startswith(p) for m in modules)}" for p in TEXT_ENCODER_PREFIXES
              if any(m.startswith(p) for m in modules)]
    return f"{len(modules)} text-encoder modules ({', '.join(counts)})"


# ----------------------------------------------------------------------------------------------
# Reading


PEFT_DEFAULT_ALPHA = 8  # peft.LoraConfig.lora_alpha's default


def _peft_alphas(metadata: dict[str, str], prefix: str, adapter_config: dict | None = None):
    """(default alpha or None, alpha_pattern, use_rslora) from a PEFT folder's adapter_config.json
    when given, else from diffusers' adapter-config header."""
    config = adapter_config
    if config is None:
        raw = metadata.get(ADAPTER_METADATA_KEY)
        if not raw:
            return None, {}, False
        config = json.loads(raw)
        head = prefix.rstrip(".") + "."
        # Pipeline-level saves prefix every field ("transformer.lora_alpha"); model-level saves do not.
        config = {k[len(head) :] if k.startswith(head) else k: v for k, v in config.items()}
    # a config without lora_alpha is LoraConfig's default, 8 (what PEFT scales by), not alpha = rank
    alpha = config.get("lora_alpha", PEFT_DEFAULT_ALPHA)
    return alpha, dict(config.get("alpha_pattern") or {}), bool(config.get("use_rslora"))


def _component_heads(metadata: dict[str, str]) -> list[str]:
    """The components a pipeline-level save's adapter-config header names ("transformer.", "text_encoder.": its
    keys "transformer.lora_alpha", ...), each with its own alphas; [] for a model-level save's."""
    try:
        config = json.loads(metadata.get(ADAPTER_METADATA_KEY) or "{}")
    except ValueError:
        return []
    return sorted({k.split(".")[0] + "." for k in config if "." in k}, key=len, reverse=True)


def _pattern_alpha(path: str, default, patterns: dict):
    for pattern, alpha in patterns.items():  # PEFT's own rule (peft.utils.other.get_pattern_key)
        if re.match(rf"(.*\.)?({pattern})$", path):
            return alpha
    return default


def parse_lora(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None, module_paths=None, source="LoRA",
               adapter_config: dict | None = None, strict: bool = True, experts: dict[str, int] | None = None):
    """Tensors of a LoRA file -> (weights, format).

    Keys of `weights` are dotted module paths when they can be known: always for peft/comfy files
    (prefix stripped), for kohya files when `module_paths` is given; otherwise the kohya names.
    adapter_config: a PEFT folder's adapter_config.json (lora_alpha, alpha_pattern, use_rslora).
    strict: a kohya name that fits none of `module_paths` is an error (else it keeps its kohya name).
    experts: {module path: E} of the target's packed weights, beside the header's (packed_experts): those modules
    read as packed weights' LoRAs (LoRAWeights.experts, the rank per expert)."""
    metadata = metadata or {}
    experts = packed_experts(metadata, source, experts)
    flat_experts = {p.replace(".", "_"): e for p, e in experts.items()}  # for kohya names no module path resolved
    try:  # what the names say (layout, modules): an error here names the file
        fmt = detect_format(tensors)
        groups: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in tensors.items():
            module, part = _split_key(key)
            groups.setdefault(module, {})[part] = tensor
        if fmt == "kohya":
            rename = resolve_kohya_names(groups, module_paths, strict) if module_paths is not None else {m: m for m in groups}
            prefix = ""
        else:
            prefix = _common_prefix(list(groups), PEFT_PREFIXES if fmt == "peft" else COMFY_PREFIXES)
            rename = {m: m[len(prefix) :] for m in groups}
    except CheckpointError as e:
        raise naming(source, e) from None
    # PEFT alphas by component: a pipeline save of the transformer and a text encoder has each's own (no common
    # prefix: the transformer's were read as LoraConfig's default, 8)
    heads = _component_heads(metadata) if fmt == "peft" and adapter_config is None else []
    # component head (the file's common prefix where the header names none) -> (default alpha, alpha_pattern, rslora)
    alphas = {h: _peft_alphas(metadata, h, adapter_config) for h in [*heads, prefix]} if fmt == "peft" else {}
    weights = {}
    for module, parts in groups.items():
        if "down" not in parts or "up" not in parts:
            missing = "down" if "down" not in parts else "up"
            raise CheckpointError(f"{source}: module '{module}' has no {missing} weight")
        down, up = parts["down"], parts["up"]
        if down.dim() != 2 or up.dim() != 2 or up.shape[1] != down.shape[0]:
            raise CheckpointError(
                f"{source}: module '{module}' down {tuple(down.shape)} / up {tuple(up.shape)} are not [r, in] / [out, r]"
            )
        rank = down.shape[0]
        if rank == 0:  # alpha / rank would divide by zero; such a module adds nothing
            raise CheckpointError(f"{source}: module '{module}' has rank 0 (down {tuple(down.shape)}, up "
                                  f"{tuple(up.shape)}): no LoRA there; drop its tensors from the file")
        path = rename[module]
        if (e := experts.get(path, flat_experts.get(_kohya_flat(module)))) is not None:  # r E rows: packed_factors
            if rank % e:
                raise CheckpointError(f"{source}: module '{module}' down {tuple(down.shape)} is no LoRA of {e} "
                                      f"experts (its rows are not a multiple of {e})")
            rank //= e
        if path in weights:  # two names of one module (two kohya prefixes, two layouts): one would be lost
            other = next(m for m in groups if m != module and rename[m] == path)
            raise CheckpointError(f"{source}: modules '{other}' and '{module}' are both '{path}'; a file holds one "
                                  f"LoRA per module (tools/combine_loras.py adds two LoRAs)")
        if "alpha" in parts:  # 0 means alpha = rank (scale 1), as sd-scripts' LoRAModule reads it
            alpha = stored_alpha(parts["alpha"], source, module) or float(rank)
        elif fmt == "peft" and alphas[head := next((h for h in heads if module.startswith(h)), prefix)][0] is not None:
            default_alpha, alpha_pattern, rslora = alphas[head]  # its patterns match the path inside its component
            alpha = float(_pattern_alpha(module[len(head):], default_alpha, alpha_pattern))
            alpha = alpha * rank**0.5 if rslora else alpha  # rsLoRA scale alpha/sqrt(r) as alpha'/r
        else:
            alpha = float(rank)  # no alpha stored: the PEFT convention, scale 1
        magnitude = parts.get("magnitude")
        if magnitude is not None:
            if magnitude.numel() != up.shape[0] or magnitude.dim() > 2 or magnitude.shape[0] != up.shape[0]:
                raise CheckpointError(f"{source}: module '{module}' DoRA magnitude {tuple(magnitude.shape)} is not "
                                      f"[{up.shape[0]}] or [{up.shape[0]}, 1] (one per output row)")
            magnitude = magnitude.reshape(-1)
        if magnitude is not None and e is not None:
            raise CheckpointError(f"{source}: module '{module}' is a packed weight's LoRA with a DoRA magnitude: "
                                  f"not supported")
        weights[path] = LoRAWeights(down, up, alpha, magnitude, e)
    return weights, fmt


def stored_alpha(stored: torch.Tensor, source: str, module: str) -> float:
    """A module's `.alpha` tensor as the number it must be (a LoRA's, a LyCORIS module's), else one line."""
    if stored.numel() != 1 or not torch.isfinite(stored.float()).all():
        described = f"{stored.float().item()}" if stored.numel() == 1 else f"a tensor of shape {tuple(stored.shape)}"
        raise CheckpointError(f"{source}: module '{module}' alpha is {described}; expected one finite number")
    return float(stored.float().item())


def _common_prefix(modules: list[str], prefixes) -> str:
    for p in prefixes:
        if all(m.startswith(p) for m in modules):
            return p
    return ""


# PEFT keeps an adapter's tensors under its name in the model (`<module>.lora_A.<adapter>.weight`): a raw
# model.state_dict() saves them so (DiffSynth-Studio's files: `.default.`), get_peft_model_state_dict drops
# the name (peft's _remove_adapter_name_from_state_dict_key; DoRA's magnitude becomes `lora_magnitude_vector`).
ADAPTER_NAMED = re.compile(r"\.(lora_A|lora_B|lora_magnitude_vector)\.([^.]+)\.weight$")


def adapter_name_dropped(keys, source: str = "LoRA") -> dict[str, str]:
    """{key: the name get_peft_model_state_dict saves it under} for the keys carrying a PEFT adapter name
    (ADAPTER_NAMED); {} for none. Two adapters' names, or keys with one beside keys without, are a
    CheckpointError naming them: the file holds more than one LoRA."""
    keys = list(keys)
    found = {k: m for k in keys if (m := ADAPTER_NAMED.search(k))}
    if not found:
        return {}
    first = next(iter(found))
    names = sorted({m.group(2) for m in found.values()})
    if len(names) > 1:
        raise CheckpointError(f"{source}: holds the PEFT adapters {', '.join(map(repr, names))} (keys like '{first}'): "
                              f"one adapter per LoRA file; save one with get_peft_model_state_dict(model, adapter_name=...)")
    plain = next((k for k in keys if k.endswith((".lora_A.weight", ".lora_B.weight")) and k not in found), None)
    if plain is not None:
        raise CheckpointError(f"{source}: key '{plain}' has no adapter name beside keys of the PEFT adapter '{names[0]}' "
                              f"(like '{first}'): one adapter per LoRA file")
    return {k: k[: m.start()] + (".lora_magnitude_vector" if m.group(1) == "lora_magnitude_vector" else f".{m.group(1)}.weight")
            for k, m in found.items()}


# PEFT's LoRA of an nn.Embedding (target_modules naming embed_tokens) saves `<module>.lora_embedding_A` [r, vocab] /
# `lora_embedding_B` [dim, r] (Parameters: no `.weight`; a raw state_dict() adds the adapter name), beside the
# embedding's own `<module>.base_layer.weight`. LoRA networks here adapt Linears alone.
EMBEDDING_LORA = re.compile(r"\.lora_embedding_[AB](\.[^.]+)?$")


def refuse_embedding_lora(keys, source: str = "LoRA") -> None:
    """A CheckpointError naming the module of the first PEFT embedding LoRA (EMBEDDING_LORA) among `keys`: left
    unsaid, its keys read as a whole model's beside the LoRA (base_layer_keys) or as keys mixed with PEFT's."""
    found = next((m for k in keys if (m := EMBEDDING_LORA.search(k))), None)
    if found is not None:
        module = found.string[: found.start()]
        raise CheckpointError(f"{source}: an embedding LoRA (lora_embedding_A / lora_embedding_B on '{module}') is not "
                              f"supported: LoRAs of Linear modules (lora_A / lora_B) are; train the adapter without the "
                              f"embedding in target_modules")


# A PEFT-wrapped Linear keeps its own weight and bias as `<module>.base_layer.weight` / `.bias` beside its
# lora_A / lora_B: a raw model.state_dict() saves them too (peft's LoraLayer.base_layer).
BASE_LAYER = ".base_layer."


def base_layer_keys(keys, source: str = "LoRA") -> list[str]:
    """The base_layer keys of a raw PEFT state dict whose every other key is the LoRA's (_PART_OF_SUFFIX, after
    adapter_name_dropped): the wrapped Linears' own weights, which a LoRA tool leaves out. A whole model's
    dump (its untargeted modules' tensors beside) is a CheckpointError naming one and saying what to save."""
    keys, suffixes = list(keys), tuple(_PART_OF_SUFFIX)
    base = [k for k in keys if BASE_LAYER in k]
    lora = [k for k in keys if k.endswith(suffixes) and BASE_LAYER not in k]
    other = [k for k in keys if not k.endswith(suffixes) and BASE_LAYER not in k]
    if base and lora and other:
        raise CheckpointError(f"{source}: a whole PEFT model's state_dict(): {len(other)} tensors of the model (like "
                              f"'{other[0]}') beside the LoRA and its base_layer weights; save the LoRA alone "
                              f"(peft's get_peft_model_state_dict(model))")
    return base if lora else []


def lora_reader(path: str) -> tuple[CheckpointReader, dict | None]:
    """A LoRA safetensors file or PEFT adapter folder -> (reader of its tensors, keys under their PEFT names
    less an adapter name (adapter_name_dropped) and a raw PEFT state dict's base_layer tensors (base_layer_keys,
    with one warning saying how many), the folder's adapter_config.json or None). Any other folder, and a PEFT
    embedding LoRA (refuse_embedding_lora), is a CheckpointError saying what is expected."""
    folder = peft_folder_of(path)
    config = read_adapter_config(folder) if folder else None
    reader = CheckpointReader(os.path.join(folder, PEFT_WEIGHTS_FILE) if folder else path)
    refuse_embedding_lora(reader.keys(), path)
    reader.rename(adapter_name_dropped(reader.keys(), path))
    if base := base_layer_keys(reader.keys(), path):
        reader.leave_out(base)
        warnings.warn(f"{path}: left out {len(base)} base_layer tensors (the base model's weights a PEFT "
                      f"model.state_dict() saves beside its LoRA): read the LoRA alone", stacklevel=2)
    return reader, config


def read_lora_tensors(path: str, map_whole_deltas: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, str], dict | None]:
    """A LoRA safetensors file or PEFT adapter folder -> (tensors, header metadata, the folder's
    adapter_config.json or None). map_whole_deltas: the `.diff` / `.diff_b` tensors on the file's pages
    (CheckpointReader.get(mapped=True)), for a tool that adds each once: a file of whole deltas is as large as the
    model it changes. (The rest in memory of their own: views of a mapping may be unaligned, and the CPU's GEMMs
    round differently there.)"""
    reader, config = lora_reader(path)
    tensors = {k: reader.get(k, map_whole_deltas and whole_delta_suffix(k) is not None) for k in reader.keys()}
    return tensors, reader.metadata, config


def peft_alpha_known(keys, metadata: dict[str, str], adapter_config: dict | None = None) -> bool:
    """False for a PEFT file that stores its alpha nowhere (no `.alpha` tensors, no adapter config in
    the header or the folder, not marked alpha-folded): loaders then take alpha = rank (scale 1),
    which is right only by luck, so the tools warn."""
    keys = list(keys)
    if not any(k.endswith((".lora_A.weight", ".lora_B.weight")) for k in keys):
        return True  # kohya / ComfyUI layouts carry .alpha (or mean alpha = rank by their own convention)
    return (any(k.endswith(".alpha") for k in keys) or ADAPTER_METADATA_KEY in metadata
            or metadata.get(FOLDED_MARK) == "true" or adapter_config is not None)


def read_lora(path: str, module_paths=None):
    """Read a LoRA safetensors file or PEFT adapter folder -> (weights, metadata, format); see
    `parse_lora` for the keys."""
    tensors, metadata, config = read_lora_tensors(path)
    weights, fmt = parse_lora(tensors, metadata, module_paths, source=path, adapter_config=config)
    return weights, metadata, fmt


# ----------------------------------------------------------------------------------------------
# Writing


def kohya_state_dict(weights: dict[str, LoRAWeights], dtype=torch.float32, prefix="lora_unet") -> dict[str, torch.Tensor]:
    """Canonical -> kohya tensors. down/up cast to `dtype`; alpha is always a float32 scalar so
    that the scale alpha/r is stored exactly whatever the weight dtype, and a DoRA magnitude float32 too: it
    scales each output row (bf16's 2^-8 steps are 0.4% of the row, the size of a learned magnitude change)."""
    out = {}
    for path, w in weights.items():
        name = kohya_name(path, prefix)
        out[f"{name}.lora_down.weight"] = w.down.detach().to(dtype)
        out[f"{name}.lora_up.weight"] = w.up.detach().to(dtype)
        out[f"{name}.alpha"] = torch.tensor(float(w.alpha), dtype=torch.float32)
        if w.magnitude is not None:  # [out, 1]: ComfyUI reads a 2-D dora_scale per output row (LyCORIS' layout)
            out[f"{name}.dora_scale"] = w.magnitude.detach().reshape(-1, 1).to(torch.float32)
    return out


def rescaled_up(up: torch.Tensor, factor: float, dtype: torch.dtype) -> torch.Tensor | None:
    """lora_up * factor computed in float32 and cast to `dtype`, or None where that overflows `dtype`
    (a finite up turned inf: large alpha / rank in float16); the caller names the module and why."""
    scaled = (up.detach().float() * factor).to(dtype)
    return None if not bool(scaled.isfinite().all()) and bool(up.isfinite().all()) else scaled


def peft_state_dict(weights: dict[str, LoRAWeights], prefix="transformer", dtype=torch.float32) -> dict[str, torch.Tensor]:
    """Canonical -> PEFT tensors with the scale alpha/r folded into lora_B (computed in float32,
    then cast to `dtype`), so any PEFT/diffusers loader gets the right delta without alpha. A folded
    lora_B that overflows `dtype` (a large alpha / r in float16) is a ValueError naming the module: it
    would be written as inf."""
    head = f"{prefix}." if prefix else ""
    out = {}
    for path, w in weights.items():
        out[f"{head}{path}.lora_A.weight"] = w.down.detach().to(dtype)
        if (up := rescaled_up(w.up, w.scale, dtype)) is None:
            raise ValueError(f"module {path}'s lora_up times its alpha / rank {w.alpha:g} / {w.rank} overflows "
                             f"{str(dtype).removeprefix('torch.')} folded into lora_B; the kohya layout keeps the alpha apart")
        out[f"{head}{path}.lora_B.weight"] = up
        if w.magnitude is not None:  # PEFT's DoRA magnitude [out]; its norm uses the same folded B
            out[f"{head}{path}.lora_magnitude_vector"] = w.magnitude.detach().reshape(-1).to(torch.float32)  # (kohya's)
    return out


def comfy_state_dict(weights: dict[str, LoRAWeights], dtype=torch.float32,
                     prefix: str = "diffusion_model") -> dict[str, torch.Tensor]:
    """ComfyUI's dotted layout: `diffusion_model.<path>.lora_A.weight` / `.lora_B.weight` with the scale
    folded in (peft_state_dict), a DoRA magnitude as `.dora_scale` [out, 1]: comfy/lora.py load_lora
    reads `{name}.dora_scale` (per output row when its first dim is out), not PEFT's lora_magnitude_vector."""
    out = {}
    for key, tensor in peft_state_dict(weights, prefix, dtype).items():
        if key.endswith(".lora_magnitude_vector"):
            out[key[: -len(".lora_magnitude_vector")] + ".dora_scale"] = tensor.reshape(-1, 1)
        else:
            out[key] = tensor
    return out


def tensor_hash(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over the data section of the safetensors serialization of `tensors` (every tensor's
    bytes in file order, the json header excluded): sd-scripts' `sshs_model_hash`. The header is
    excluded, so the hash does not change with metadata."""
    blob = safetensors_bytes({k: v.detach().cpu().contiguous() for k, v in tensors.items()})
    header_len = int.from_bytes(blob[:8], "little")
    return hashlib.sha256(blob[8 + header_len :]).hexdigest()


def write_lora_tensors(tensors: dict[str, torch.Tensor], path: str, metadata: dict[str, str] | None = None):
    """Atomic write with `sshs_model_hash` added to the (all-string) metadata, an input's
    `modelspec.hash_sha256` (MODELSPEC_HASH) set to that of these tensors, and an input's
    `sshs_legacy_hash` (sd-scripts' other hash of the tensors, which we do not compute) dropped as stale."""
    metadata = {k: v for k, v in (metadata or {}).items() if k != "sshs_legacy_hash"}
    bad = [k for k, v in metadata.items() if not isinstance(v, str)]
    if bad:
        raise ValueError(f"metadata '{bad[0]}' must be a string (use build_metadata), got {type(metadata[bad[0]]).__name__}")
    metadata["sshs_model_hash"] = tensor_hash(tensors)
    if MODELSPEC_HASH in metadata:
        metadata[MODELSPEC_HASH] = "0x" + metadata["sshs_model_hash"]
    save_safetensors(tensors, path, metadata)


def write_kohya(weights, path, dtype=torch.float32, metadata=None, prefix="lora_unet"):
    header = {**(metadata or {}), **packed_experts_header(weights)}
    write_lora_tensors(kohya_state_dict(weights, dtype, prefix), path, header)


def write_peft(weights, path, prefix="transformer", dtype=torch.float32, metadata=None):
    """PEFT tensors with alpha / rank folded into lora_B, and the header saying so (FOLDED_MARK)."""
    write_lora_tensors(peft_state_dict(weights, prefix, dtype), path,
                       {**(metadata or {}), FOLDED_MARK: "true", **packed_experts_header(weights)})


# ----------------------------------------------------------------------------------------------
# PEFT adapter folders (LLMs): what PeftModel.from_pretrained, vLLM and llama.cpp's converter read. Found and
# checked here; written by networks/lora_peft_folder.py

PEFT_CONFIG_FILE, PEFT_WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
# adapter_config.json fields whose non-default values add weights or behaviour a plain LoRA lacks.
# aLoRA (alora_invocation_tokens) applies the LoRA only from its invocation tokens on, QALoRA pools the
# LoRA's input in groups: both other math than W + BA on every token.
PEFT_UNSUPPORTED = {"bias": "none", "modules_to_save": None, "lora_bias": False, "layer_replication": None,
                    "trainable_token_indices": None, "target_parameters": None, "alora_invocation_tokens": None,
                    "use_qalora": False}


def input_files(paths) -> list[str]:
    """The files behind LoRA inputs that exist: each path, and a PEFT adapter folder's weights file
    (an output must be none of them)."""
    return [f for p in paths for f in (p, os.path.join(p, PEFT_WEIGHTS_FILE)) if os.path.exists(f)]


def peft_folder_of(path: str) -> str | None:
    """The PEFT adapter folder `path` names (the folder, or its adapter_model.safetensors), else None."""
    folder = path if os.path.isdir(path) else os.path.dirname(path) if os.path.basename(path) == PEFT_WEIGHTS_FILE else None
    if folder is None:
        return None
    if not os.path.isfile(os.path.join(folder, PEFT_CONFIG_FILE)):
        if os.path.isdir(path):
            raise CheckpointError(f"{path}: a folder without {PEFT_CONFIG_FILE} (expected a PEFT adapter folder or a .safetensors LoRA)")
        return None
    return folder


def read_adapter_config(folder: str) -> dict:
    """adapter_config.json of a PEFT LoRA, checked for what a plain LoRA cannot represent."""
    path = os.path.join(folder, PEFT_CONFIG_FILE)
    try:
        with open(path) as f:
            config = json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise CheckpointError(f"{path}: peft_type '{config['peft_type']}' is not supported (expected LORA)")
    for key, default in PEFT_UNSUPPORTED.items():
        if config.get(key, default) not in (default, [], {}):
            raise CheckpointError(f"{path}: {key} = {config[key]!r} is not supported (a plain LoRA needs {default!r})")
    if not os.path.isfile(os.path.join(folder, PEFT_WEIGHTS_FILE)):
        raise CheckpointError(f"{folder}: no {PEFT_WEIGHTS_FILE} (adapter_model.bin is not read: safetensors only)")
    return config
