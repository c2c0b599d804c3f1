"""The base checkpoint tools/merge_lora.py merges into and the LoRAs' deltas by its weight keys.

open_base tells the architecture and naming of a checkpoint (a single file, a diffusers folder, a Hugging
Face LLM) from its tensor names, as each family says which checkpoints are its own; lora_deltas reads one
LoRA file through networks/lora_reader.py (down / up LoRAs and LyCORIS files alike) into
{checkpoint weight key: delta}, checked against the base's names, shapes and version. extract_lora and
lora_info --model open bases here too.
"""

from __future__ import annotations

import functools
import os
import re
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from library.io import CheckpointError, CheckpointReader, component_folder
from library.models.llm import checkpoint_key_to_llm
from library.models.registry import FAMILIES, arch_spec, arch_specs
from library.precision import fp8
from library.precision.bfl_weights import is_bfl
from library.precision.bnb_weights import refuse_serialized
from library.precision.fp8_checkpoints import Fp8Checkpoint, read_fp8_checkpoint
from library.precision.gguf_weights import is_gguf
from networks.lora_files import (LoRAWeights, read_lora_tensors, refuse_non_finite_tensors, split_text_encoders,
                                 text_encoder_note)
from networks.lora_arch import begins_release, detect_arch, header_arch, header_version, takes_loras_of, text_encoder_labels
from networks.lora_reader import (FusedRows, RowsOfFused, WholeDelta, lora_for_model, lycoris_for_model,
                                  split_whole_deltas, whole_deltas_for_model)
from networks.lycoris_network import LycorisDelta, is_lycoris_file, lycoris_deltas, lycoris_kohya_names
from tools.cli import LoRASpec

if TYPE_CHECKING:
    from library.models.family import DiffusionFamily


# ----------------------------------------------------------------------------------------------
# The base checkpoint


@dataclass
class Base:
    """A checkpoint and what its names mean. `to_model` maps a checkpoint key to the module path LoRAs
    name (None for tensors no LoRA can target); `spec_names` gives the module names that the
    architecture's spec (its LoRA targets and fp8 keep rules) is written in."""

    path: str  # the checkpoint file or folder actually read
    reader: CheckpointReader
    family: str  # the architecture (an arch of the registry: "llm" for a language model)
    naming: str  # "bfl" | "diffusers" | "hf"
    to_model: Callable[[str], str | None]
    module_map: dict | None = None  # fused modules: model module -> [(module in the other naming, row0, row1)]
    weight_key: dict[str, str] = field(default_factory=dict)  # model module path -> checkpoint weight key
    # a packed weight's path (its LoRA's module: networks/lora_packed.py) -> its expert count; also in weight_key
    packed_experts: dict[str, int] = field(default_factory=dict)
    fp8: Fp8Checkpoint | None = None  # a pre-quantized base (its layout; Fp8BasePlan reads and keeps it)
    native: bool = True  # named as the model names its modules (False: module_map's other naming)
    parts_are_model: bool = False  # module_map's keys are the checkpoint's modules, its parts the model's

    @property
    def is_folder(self) -> bool:
        return os.path.isdir(self.path)

    def spec_names(self, module: str) -> list[str]:
        """The model's module names of checkpoint module `module`, which the spec's LoRA targets and fp8
        rules are written in: itself, the module it is part of (the other naming: not native), or the
        modules it holds (parts_are_model: the single file's fused and renamed modules)."""
        if not self.native:
            return [self._native_owner.get(module, module)]
        return list(self.model_parts(module) or [module])

    def model_parts(self, module: str) -> dict[str, list[tuple[int, int]]] | None:
        """{model module: its row ranges in checkpoint module `module`'s weight} where the checkpoint
        fuses or renames the model's modules (parts_are_model: a single file's qkv); None elsewhere."""
        if not self.parts_are_model or module not in (self.module_map or {}):
            return None
        parts = {}
        for name, start, end in self.module_map[module]:
            parts.setdefault(name, []).append((start, end))
        return parts

    @functools.cached_property
    def _native_owner(self) -> dict[str, str]:
        return {other: own for own, parts in self.module_map.items() for other, _, _ in parts}

    @functools.cached_property
    def _meta_model(self) -> tuple[DiffusionFamily, torch.nn.Module] | None:
        """(the family, its transformer built on meta from this checkpoint's header: no tensor read); None for an
        LLM. A base the family cannot build raises its error (CheckpointError, ...)."""
        from library.models.family import family_class

        if self.family == "llm" or self.family not in FAMILIES:
            return None
        family = family_class(self.family)(self.path)
        return family, family.load_transformer(torch.float32, read_weights=False)

    @functools.cached_property
    def version(self) -> str | None:
        """The release the family names this checkpoint (model_version: what train_lora.py writes as
        ss_base_model_version), from the model built on meta; None for an LLM or a base it cannot build."""
        try:
            built = self._meta_model
            return None if built is None else built[0].model_version(built[1])
        except (ValueError, OSError, KeyError, RuntimeError):  # CheckpointError is a ValueError
            return None

    @functools.cached_property
    def packed_weights(self) -> dict[str, str]:
        """Checkpoint key -> the model's name of each packed weight (a mixture's experts [E, K, N], no Linear), as
        the family's model built on meta names them (fp8.packed_weight_names); empty for an LLM. The model is built
        only where the checkpoint holds a 3-D tensor (some tiny bases' configs are not told by their shapes)."""
        keys = [key for key in self.reader.keys() if self.to_model(key) and len(self.reader.shape(key)) == 3]
        built = self._meta_model if keys else None
        names = fp8.packed_weight_names(built[1]) if built is not None else {}
        return {key: self.to_model(key) for key in keys if self.to_model(key) in names}


def _family_base(path: str, reader: CheckpointReader, keys: list[str]) -> Base | None:
    """The base as the family whose architecture the checkpoint is names it (None: no family's)."""
    from library.models.family import family_class

    families = {}
    for model_type in FAMILIES:  # each architecture once (a variant reads its base's checkpoints)
        families.setdefault(family_class(model_type).arch, family_class(model_type))
    # Architectures that share another's names (their spec's lora_files.names_of) ask first: their
    # checkpoints carry their base's names too, and each tells its own apart (as lora_info orders them).
    shares = lambda arch: getattr(arch_spec(arch).lora_files, "names_of", None) is not None  # noqa: E731
    for arch, family in sorted(families.items(), key=lambda item: not shares(item[0])):
        if (names := family.checkpoint_names(keys, reader.shape)) is not None:
            prefix = names.prefix
            to_model = lambda k: k[len(prefix) :] if k.startswith(prefix) else None  # noqa: E731
            return Base(path, reader, arch, names.naming, to_model, names.module_map, native=names.native,
                        parts_are_model=names.parts_are_model)
    return None


def _unread_base(path: str, layout: str, tool: str, merge_advice: str) -> CheckpointError:
    """The refusal of a base stored in `layout`, naming the `tool` run; merge_lora's advice is its own."""
    advice = merge_advice if tool == "merge_lora" else "pass that model's checkpoint in one of those"
    return CheckpointError(f"{path}: a {layout} base; {tool} reads bf16 / fp16 / fp32 / fp8 bases: {advice}")


def open_base(path: str, tool: str = "merge_lora", names_only: bool = False) -> Base:
    """Detect family and naming of the checkpoint at `path` from its tensor names; `tool` (merge_lora,
    extract_lora, ...) is the one named where a stored layout is refused. names_only: the caller reads
    names and shapes alone (lora_info's fit check), which a GGUF file has (its logical shapes: reader.shape)."""
    path = component_folder(path, "transformer")
    reader = CheckpointReader(path)
    # merging into its blocks would re-quantize every merged weight from rounded values
    if is_gguf(reader) and not names_only:
        raise _unread_base(path, "GGUF", tool, "merge into the bf16 checkpoint (--save_precision gguf_q8_0 ... writes "
                           "a GGUF), or load the LoRA beside the .gguf (ComfyUI-GGUF applies LoRAs at runtime)")
    if is_bfl(reader):  # nvfp4 / fp8r: re-quantizing every merged weight would round it again
        raise _unread_base(path, "BFL fp8r / nvfp4", tool, "load the LoRA beside it (diffusers' load_lora_weights, "
                           "generate.py --lora) instead")
    keys = reader.keys()
    # bitsandbytes' packed layers: no float weight to merge into (or to read)
    refuse_serialized(keys, path, f"{tool} reads bf16 / fp16 / fp32 / fp8 bases: give the bf16 checkpoint")
    base = _family_base(path, reader, keys)
    if base is None and any(checkpoint_key_to_llm(k) and checkpoint_key_to_llm(k).startswith("model.layers.") for k in keys):
        base = Base(path, reader, "llm", "hf", checkpoint_key_to_llm)
    if base is None:
        *others, last = [spec.title for spec in arch_specs().values()]
        raise CheckpointError(f"{path}: not a {', '.join(others)} or {last} checkpoint (first key '{sorted(keys)[0]}')")
    renamed = base.family == "llm" and any(checkpoint_key_to_llm(k) != k for k in keys)  # a VL / LLaVA layout
    if renamed or not base.native:
        fp8.refuse_fp8_checkpoint(reader, path)  # fp8 bases are read in the model's own names only
    else:
        base.fp8 = read_fp8_checkpoint(reader, path)
    packed = _packed_targets(base.family)
    for key in keys:
        name = base.to_model(key)
        if name and name.endswith(".weight") and len(reader.shape(key)) == 2:
            base.weight_key[name[: -len(".weight")]] = key
        elif name and len(reader.shape(key)) == 3 and any(p.fullmatch(name) for p in packed):
            base.weight_key[name], base.packed_experts[name] = key, reader.shape(key)[0]
    return base


def _packed_targets(family: str) -> list[re.Pattern]:
    """The LoRA targets of the family's packed weights (its spec's LoRATargets.packed_types): [E, K, N] tensors a
    LoRA names by their own path."""
    lora = arch_spec(family).lora if family in arch_specs() else None
    return [re.compile(lora.targets[t]) for t in lora.packed_types] if lora else []


# ----------------------------------------------------------------------------------------------
# LoRAs -> per checkpoint key deltas


def _check_version(base: Base, spec: LoRASpec, tensors: dict, metadata: dict[str, str]) -> None:
    """A LoRA whose header (ss_base_model_version, else modelspec.architecture: lora_arch.header_version)
    names another architecture than the base's is refused, even where the two share every name and shape
    (an architecture whose spec sets names_of): its deltas were learned on other weights. The architecture
    is the one the header names (each family's LoRAFiles.model_versions), else the names'. Another release
    of the base's own architecture (a distilled and a guidance-embedded release) is a warning: LoRAs are
    commonly moved between those. A version that begins the base's (sd-scripts writes the family's stem),
    spelled any trainer's way (lora_arch.begins_release), matches. A LoRA of the architecture whose names the
    base's shares, where the base's model takes its LoRAs (LoRAFiles.takes_base_loras), passes:
    lora_for_model has left out the modules the base lacks, saying how many."""
    header = header_version(metadata)
    if header is None or base.version is None or begins_release(base.version, header[1]):
        return
    key, wanted = header
    try:
        arch = header_arch(metadata) or detect_arch(tensors, metadata)
    except CheckpointError:  # the names tell no architecture: the shapes decide
        arch = None
    if arch is not None and takes_loras_of(base.family, arch):
        return
    if arch is not None and arch != base.family:
        raise CheckpointError(f"{spec.path}: a {arch_spec(arch).title} LoRA ({key} '{wanted}') and the base {base.path} "
                              f"is {arch_spec(base.family).title} ('{base.version}'): its deltas were learned on other "
                              f"weights; merge it into a {arch_spec(arch).title} checkpoint")
    print(f"warning: {spec.path}: trained on '{wanted}' ({key}), merged into '{base.version}' "
          f"({base.path}): the same architecture, another release", file=sys.stderr)


def lora_deltas(base: Base, spec: LoRASpec,
                allow_unmatched: bool) -> dict[str, LoRAWeights | LycorisDelta | FusedRows | RowsOfFused | WholeDelta]:
    """One LoRA file -> {checkpoint key: LoRAWeights, LycorisDelta, FusedRows, RowsOfFused or WholeDelta}, checked against the
    base's shapes (a LyCORIS module's shape is checked by LyCORIS when it merges). A down/up LoRA is read
    by networks/lora_reader.py (every layout convert_lora reads, in the base's naming); its `.diff` / `.diff_b`
    tensors (ComfyUI's extraction, LyCORIS' full type) change the weight or bias they name, as ComfyUI patches them."""
    # a file (its whole deltas on its pages: as large as the model they change), or a PEFT adapter folder
    tensors, metadata, adapter_config = read_lora_tensors(spec.path, map_whole_deltas=True)
    body, te = split_text_encoders(tensors)
    if te and not body:
        raise CheckpointError(f"{spec.path}: holds only {text_encoder_note(te, text_encoder_labels(base.family))}; "
                              f"merge_lora merges into the transformer")
    body, diffs = split_whole_deltas(body)  # their NaN check: whole_deltas_for_model's
    # merged, a NaN made every weight it touches NaN and the whole checkpoint was written
    refuse_non_finite_tensors(body, spec.path, "which would make the weights it touches NaN")
    if te:  # sd-scripts' files: CLIP-L / T5-XXL modules beside the transformer's
        print(f"warning: {spec.path}: skipped {text_encoder_note(te, text_encoder_labels(base.family))}: they adapt the text encoders, not the transformer "
              f"merged here", file=sys.stderr)  # fmt: skip
    if diffs and not body:  # whole deltas alone (LyCORIS' full type, ComfyUI's full_diff extraction)
        weights = {}
    elif is_lycoris_file(body):  # LoKr, LoHa, ...: kohya names; another naming's modules renamed where whole
        body = lycoris_kohya_names(body)  # ai-toolkit's diffusion_model.* names (convert_lora --to comfy) too
        weights = lycoris_for_model(lycoris_deltas(body, spec.path), body, metadata, base.family, base.weight_key, base.module_map,
                                    target_is_key=base.native, name=spec.path)
    else:
        weights = lora_for_model(body, metadata, adapter_config, base.family, base.weight_key, base.module_map,
                                 target_is_key=base.native, name=spec.path, experts=base.packed_experts).weights
    whole = _whole_deltas(base, diffs, spec.path) if diffs else {}
    unmatched = [p for p in weights if p not in base.weight_key] + [f"{m} ({part})" for (m, part), (key, _) in whole.items() if key is None]
    matched = {base.weight_key[p]: w for p, w in weights.items() if p in base.weight_key}
    if both := sorted(key for key, _ in whole.values() if key in matched):
        raise CheckpointError(f"{spec.path}: '{both[0]}' has a down / up LoRA and a whole delta (.diff) both; a file holds one")
    matched.update({key: w for key, w in whole.values() if key is not None})
    if not matched:
        first = unmatched[0] if unmatched else "(none)"
        raise CheckpointError(
            f"{spec.path}: no LoRA module matches a weight of the {base.family} checkpoint {base.path} "
            f"(first: '{first}'): is it a LoRA for another model? (tools/lora_info.py tells which)"
        )
    _check_version(base, spec, tensors, metadata)  # names fit: does the LoRA say it was trained on this model?
    if unmatched and not allow_unmatched:
        shown = ", ".join(unmatched[:5]) + (f" ... ({len(unmatched)} in all)" if len(unmatched) > 5 else "")
        raise CheckpointError(f"{spec.path}: LoRA modules match no weight of {base.path}: {shown} "
                              f"(merge_lora.py --allow_unmatched skips them)")
    if unmatched:
        print(f"warning: {spec.path}: skipped {len(unmatched)} unmatched LoRA modules: {', '.join(unmatched)}", file=sys.stderr)
    for key, w in matched.items():
        if isinstance(w, WholeDelta) and (problem := w.mismatch(base.reader.shape(key))):
            raise CheckpointError(f"{spec.path}: {problem} ('{key}')")
        if not isinstance(w, LoRAWeights):  # LyCORIS (FusedRows, RowsOfFused too): checked as it merges
            continue
        want = base.reader.shape(key)
        got = w.shape  # (out, in), a packed weight's (E, K, N)
        if got != want:
            raise CheckpointError(f"{spec.path}: LoRA for '{key}' gives a delta of shape {got}, the checkpoint weight is {want}")
    return matched


def _whole_deltas(base: Base, diffs: dict, path: str) -> dict[tuple[str, str], tuple[str | None, WholeDelta]]:
    """A file's `.diff` / `.diff_b` tensors -> {(module path, "weight" | "bias"): (the base's key of that tensor, None
    where it has none; the delta)}, resolved against every module of the base (a norm's weight too)."""
    keys = {}
    for key in base.reader.keys():
        name = base.to_model(key)
        if name and name.rsplit(".", 1)[-1] in ("weight", "bias"):
            keys[tuple(name.rsplit(".", 1))] = key
    found = whole_deltas_for_model(diffs, base.family, list(dict.fromkeys(m for m, _ in keys)), base.module_map,
                                   target_is_key=base.native, name=path)
    return {where: (keys.get(where), delta) for where, delta in found.items()}
