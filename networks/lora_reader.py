"""The one reader of LoRA files for everything that applies one to a model: generate.py's --lora,
the trainer's network_weights and base_loras, tools/merge_lora.py, the precision tools, and
tools/convert_lora.py's input. Every layout networks/lora_files.py parses (kohya `lora_unet_*` /
OneTrainer's `lora_transformer_*`, diffusers/PEFT `transformer.*`, ComfyUI `diffusion_model.*`, PEFT
adapter folders) in either naming of the architecture (its spec's LORA_FILES.module_paths list both),
and ComfyUI's own names of a model that fuses modules ours split (LORA_FILES.comfy_map), become in
memory `{module path of the target: LoRAWeights}`:

1. kohya names resolved against the target's paths and the architecture's (`lora_in_our_names`);
2. ComfyUI's own names -> ours, a fused module split by rows (down shared: exact);
3. the architecture's other naming -> the target's (`to_target_names`, through a module map): a fused
   module joined from parts that share one down keeps it; parts with their own downs are stacked along
   the rank with each part's scale folded into a block-diagonal up, so the delta is exact and the
   rank is the parts' sum (`LoRARead.regrouped`).

A file whose names are another architecture's is refused in one line that says which, as
tools/lora_info.py reports it (`foreign_arch_error`; `check_lora_arch` does it from the header alone); so is
one in names a variant shares with its base that only the base's model takes (lora_arch.is_base_lora), and
one of names many architectures have whose width and blocks are another's released size, or whose header
names another (lora_arch.header_arch); where nothing tells, one warning says so (`shared_shapes_note`). A
variant whose model takes its base's LoRAs (LoRAFiles.takes_base_loras) reads them less the modules it lacks,
with one warning (`without_base_only`). Text-encoder modules and the tensors some trainers save beside a LoRA
(lora_files.split_beside_lora) are left out, each with one warning. LyCORIS files
are read by `lycoris_for_model` (names only: their factors are no rows of a fused module's; a merge into a
fused weight merges each part into its rows, `FusedRows`; a fused module into split parts gives each its rows of
the whole delta, `RowsOfFused`).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from library.io import CheckpointError, CheckpointReader
from library.models.registry import arch_spec
from library.models.spec import load_symbol
from networks.lora_arch import (
    arch_by_shapes,
    arch_of,
    archs_holding,
    base_arch,
    base_only_modules,
    block_counts,
    detect_arch,
    down_widths,
    fitted_releases,
    header_arch,
    info_block_counts,
    is_base_lora,
    lora_files,
    module_of_key,
    naming_of,
    says_base,
    text_encoder_labels,
    width_of,
)
from networks.lora_files import (
    NAME_ADVICE,
    LoRAWeights,
    adapter_name_dropped,
    beside_lora_note,
    detect_format,
    is_lycoris_file,
    lora_reader,
    naming,
    parse_lora,
    peft_alpha_known,
    read_lora_tensors,
    refuse_embedding_lora,
    refuse_non_finite_tensors,
    resolve_kohya_names,
    split_beside_lora,
    split_text_encoders,
    text_encoder_note,
    whole_delta_suffix,
)
from networks.lora_module_map import bfl_to_diffusers, diffusers_to_bfl


@dataclass
class LoRARead:
    weights: dict[str, LoRAWeights]  # module path -> LoRA; a path the target lacks is the caller's to report
    metadata: dict[str, str]
    fmt: str  # "kohya" | "peft" | "comfy": the layout on disk
    alpha_known: bool  # False: a PEFT file storing its alpha nowhere (read as alpha = rank)
    text_encoders: dict[str, torch.Tensor] = field(default_factory=dict)  # sd-scripts' lora_te1_ / lora_te3_, left out
    # modules whose rank a fused <-> split conversion set: a fused module joined from parts with their own
    # downs (rank summed), or a part split from a fused module of ComfyUI's (the fused module's rank)
    regrouped: set[str] = field(default_factory=set)


def _names_to_resolve(tensors: dict, files, extra_paths=()) -> tuple[dict[str, int], list[str]]:
    """(the LoRA's block counts, the paths its kohya names resolve against: `extra_paths` (the target's)
    then the architecture's module paths at those counts, each once; one of these whose kohya name a target's path
    has is left to the target's: a ComfyUI-named base's `img_attn.qkv` and our `img_attn_qkv` are one module).
    files: the arch's LORA_FILES or None."""
    counts = block_counts(tensors, files.block_pattern) if files else {}
    known = load_symbol(files.module_paths)(counts) if files and files.module_paths else []
    taken = {p.replace(".", "_") for p in extra_paths}
    return counts, list(dict.fromkeys([*extra_paths, *(p for p in known if p.replace(".", "_") not in taken)]))


def lora_in_our_names(tensors: dict, metadata: dict[str, str], adapter_config: dict | None, arch: str,
                      extra_paths=(), source: str = "LoRA", strict: bool = True, experts: dict[str, int] | None = None):
    """Tensors of one architecture's LoRA -> ({module path: LoRAWeights}, format, block counts, the modules
    split from ComfyUI's fused ones), in our names or the architecture's other naming (steps 1 and 2 of the
    module docstring). strict: a kohya name that fits no path is an error; else it stays as the file spells it.
    experts: {path: E} of the target's packed weights (parse_lora)."""
    files = lora_files().get(arch)
    counts, paths = _names_to_resolve(tensors, files, extra_paths)
    try:
        fmt = detect_format(tensors)
    except CheckpointError as e:
        raise naming(source, e) from None
    weights, _ = parse_lora(tensors, metadata, paths if fmt == "kohya" else None, source=source,
                            adapter_config=adapter_config, strict=strict, experts=experts)
    split = {}
    if files and files.comfy_map:  # modules in ComfyUI's own names -> ours (a fused one split by rows)
        comfy_map = load_symbol(files.comfy_map)(weights, counts)
        named = {p: w for p, w in weights.items() if p in comfy_map}
        split = bfl_to_diffusers(named, comfy_map)
        weights = joined({p: w for p, w in weights.items() if p not in named}, split, source)
    if strict and fmt != "kohya" and paths and (unplaced := _unplaced_module(weights, paths, files, counts)):
        spelled = next((m for m in map(module_of_key, tensors) if m == unplaced or m.endswith("." + unplaced)), unplaced)
        raise CheckpointError(f"{source}: LoRA module '{spelled}' matches no module of the model ({NAME_ADVICE})")
    return weights, fmt, counts, set(split)


def _unplaced_module(weights: dict, paths, files, counts: dict[str, int]) -> str | None:
    """The first dotted module name of `weights` that is none of `paths`, nor one the architecture's module
    map (LORA_FILES.module_map, sized from the LoRA's shapes) renames into or out of them (a vision-language
    LLM's nested names), else None: a dotted name fits a module as a kohya name must (resolve_kohya_names)."""
    known = set(paths)
    unplaced = [p for p in weights if p not in known]
    if unplaced and files and files.module_map:
        module_map = load_symbol(files.module_map)(weights, counts)
        known |= {part for key, parts in module_map.items() if key in known for part, _, _ in parts}
        known |= {key for key, parts in module_map.items() if all(part in known for part, _, _ in parts)}
        unplaced = [p for p in unplaced if p not in known]
    return unplaced[0] if unplaced else None


def joined(kept: dict, converted: dict, source: str) -> dict:
    """kept and the modules converted from the file's other naming: a module in both was in the file twice
    (e.g. ComfyUI's fused qkv beside our split to_q), and one would silently replace the other."""
    if twice := sorted(set(kept) & set(converted)):
        raise CheckpointError(f"{source}: module '{twice[0]}' is in the file twice, in two namings (e.g. a fused "
                              f"qkv beside its split to_q); a file holds one LoRA per module")
    return {**kept, **converted}


def to_target_names(weights: dict[str, LoRAWeights], paths, module_map: dict | None, target_is_key: bool = True,
                    source: str = "LoRA"):
    """(weights with the modules named in the module map's other naming converted to the target's, the
    fused modules joined from parts with their own downs). module_map: {key path: [(other path, row0, row1)]};
    target_is_key: the target names its modules as the map's keys (ours: BFL names), else as its values."""
    if not module_map:
        return weights, set()
    own = set(paths)
    other = ({d for parts in module_map.values() for d, _, _ in parts} if target_is_key else set(module_map)) - own
    foreign = {p: w for p, w in weights.items() if p in other}
    if not foreign:
        return weights, set()
    kept = {p: w for p, w in weights.items() if p not in foreign}
    if not target_is_key:
        return joined(kept, bfl_to_diffusers(foreign, module_map), source), set()
    converted = diffusers_to_bfl(foreign, module_map)
    fused = {p for p, w in converted.items() if w.rank != max(foreign[d].rank for d, _, _ in module_map[p] if d in foreign)}
    return joined(kept, converted, source), fused


def read_for_model(source, arch: str, paths, module_map=None, target_is_key: bool = True, name: str | None = None,
                   strict: bool = False, experts: dict[str, int] | None = None) -> LoRARead:
    """A LoRA file (path: a .safetensors or PEFT adapter folder) or tensor dict -> its modules in the
    target's names (lora_for_model)."""
    name = name or (source if isinstance(source, str) else "state dict")
    if isinstance(source, str):
        tensors, metadata, config = read_lora_tensors(source)
    else:  # a state dict: keys under their PEFT names, as a file's (lora_reader)
        refuse_embedding_lora(source, name)
        names = adapter_name_dropped(source, name)
        tensors, metadata, config = {names.get(k, k): v for k, v in source.items()}, {}, None
    return lora_for_model(tensors, metadata, config, arch, paths, module_map, target_is_key, name, strict, experts)


def lora_for_model(tensors: dict, metadata: dict[str, str], adapter_config: dict | None, arch: str, paths,
                   module_map=None, target_is_key: bool = True, name: str = "LoRA", strict: bool = False,
                   experts: dict[str, int] | None = None) -> LoRARead:
    """A LoRA's tensors -> its modules in the target's names. paths: the target's module paths; module_map:
    its BFL <-> diffusers map, or a function building it (called only when the file names a module outside
    `paths`); None for a target in the model's own names: the architecture's map sized from the LoRA's
    shapes (LORA_FILES.module_map). target_is_key: see to_target_names. experts: {path: E} of the target's
    packed weights (parse_lora). LyCORIS files are the caller's."""
    tensors, te = split_text_encoders(tensors)
    if te and not tensors:  # sd-scripts' text encoders alone: nothing for the model (an empty file is an error below)
        return LoRARead({}, dict(metadata), "kohya", True, te)
    tensors, beside = split_beside_lora(tensors)
    others, whole = split_whole_deltas(beside)
    if whole:  # generate.py and base_loras add them beside the network (merge_whole_deltas) and silence this
        warnings.warn(WholeDeltasLeftOut(f"{name}: left out {beside_lora_note(whole)}: a LoRA network applies the "
                                         f"down/up modules only (merge_lora, generate.py and base_loras add them)"),
                      stacklevel=3)
    if others:
        warnings.warn(f"{name}: left out {beside_lora_note(others)}: a LoRA network applies the down/up modules only",
                      stacklevel=3)
    tensors = without_base_only(name, tensors, metadata, arch)
    if (error := foreign_arch_error(name, tensors, metadata, arch)) is not None:
        raise CheckpointError(error)
    if (note := shared_shapes_note(name, tensors, metadata, arch)) is not None:
        warnings.warn(note, stacklevel=3)
    paths = list(paths)
    weights, fmt, counts, split = lora_in_our_names(tensors, metadata, adapter_config, arch, paths, source=name,
                                                    strict=strict, experts=experts)
    own = set(paths)
    other_naming = any(p not in own for p in weights)
    files = lora_files().get(arch)
    if callable(module_map):
        module_map = module_map() if other_naming else None
    elif module_map is None and target_is_key and other_naming and files and files.module_map:
        module_map = load_symbol(files.module_map)(weights, counts)  # sized from the LoRA's shapes, as convert_lora does
    try:
        weights, joined = to_target_names(weights, paths, module_map, target_is_key, name)
    except CheckpointError as e:
        raise naming(name, e) from None
    alpha_known = peft_alpha_known(tensors, metadata, adapter_config)
    return LoRARead(weights, dict(metadata), fmt, alpha_known, te, (split & set(weights)) | joined)


def lycoris_module_paths(tensors: dict, arch: str, source: str = "LyCORIS file") -> dict[str, str]:
    """{kohya module name: dotted module path} of a LyCORIS file's modules, resolved as lora_in_our_names resolves a
    LoRA's: against the architecture's module paths at the file's block counts (either naming); a name that fits
    none is an error naming it."""
    _, paths = _names_to_resolve(tensors, lora_files().get(arch))
    try:
        return resolve_kohya_names(dict.fromkeys(module_of_key(k) for k in tensors), paths)
    except CheckpointError as e:
        raise naming(source, e) from None


def lycoris_for_model(deltas: dict, tensors: dict, metadata: dict[str, str], arch: str, paths, module_map=None,
                      target_is_key: bool = True, name: str = "LoRA") -> dict:
    """A LyCORIS file's modules ({kohya name: its delta}, networks/lycoris_network.py lycoris_deltas) by the
    target's module paths, as lora_for_model reads a LoRA: another architecture's file refused in one line,
    kohya names resolved against the target's paths and the architecture's (a name that fits none keeps its
    kohya name: the caller reports it), a module in the other naming renamed where the module map maps it
    whole. Parts the map joins by rows into a target's fused weight (target_is_key) become one FusedRows, each
    part merged into its rows. A fused module the map splits by rows (a single file's qkv into a diffusers
    folder's to_q / to_k / to_v) gives each part its rows of the whole delta (RowsOfFused); a weight-decomposed
    one (dora_wd normalises the whole fused weight) is an error. LyCORIS' factors (Kronecker, Hadamard) are no
    rows of the fused module's: convert_lora writes them in their own naming only, for that reason."""
    tensors = without_base_only(name, tensors, metadata, arch)
    kept = {module_of_key(k) for k in tensors}
    deltas = {n: d for n, d in deltas.items() if n in kept}
    if (error := foreign_arch_error(name, tensors, metadata, arch)) is not None:
        raise CheckpointError(error)
    if (note := shared_shapes_note(name, tensors, metadata, arch)) is not None:
        warnings.warn(note, stacklevel=3)
    paths = list(paths)
    _, resolvable = _names_to_resolve(tensors, lora_files().get(arch), paths)
    rename = resolve_kohya_names(deltas, resolvable, strict=False)
    weights = {rename[n]: d for n, d in deltas.items()}
    own = set(paths)
    if callable(module_map):
        module_map = module_map() if any(p not in own for p in weights) else None
    if not module_map:
        return weights
    # other naming -> the target's, for every module of the map: (target path, parts it is one of)
    pairs = [(key, other, parts) for key, parts in module_map.items() for other, _, _ in parts]
    other_of = {other: (key, parts) for key, other, parts in pairs} if target_is_key else \
        {key: (other, parts) for key, other, parts in pairs}
    out, renamed, rows_of = {}, {}, {}
    for path, delta in weights.items():
        if path in own or path not in other_of:
            out[path] = delta
            continue
        target, parts = other_of[path]
        if len(parts) == 1 and parts[0][1] == 0:
            renamed[target] = delta
        elif target_is_key:  # a part of a fused weight: merged into its own rows (FusedRows)
            rows_of.setdefault(target, []).append((delta, [(a, b) for p, a, b in parts if p == path]))
        elif getattr(delta, "weight_decomposed", False):
            rows = " + ".join(f"{p} [{a}:{b}]" for p, a, b in parts)
            raise CheckpointError(f"{name}: LyCORIS module '{path}' is in the other naming, where '{path}' is the "
                                  f"rows {rows}, and weight-decomposed (dora_wd: it normalises the whole fused "
                                  f"weight); apply the file to a model or checkpoint in its own naming")
        else:  # a fused module into the parts that split it: each takes its rows of the whole delta
            fused_rows, names = max(b for _, _, b in parts), list(dict.fromkeys(p for p, _, _ in parts))
            whole = WholeOfFused(delta, fused_rows, len(names))  # computed once for all the parts
            for part in names:
                renamed[part] = RowsOfFused(whole, [(a, b) for p, a, b in parts if p == part])
    return joined(out, {**renamed, **{t: FusedRows(parts) for t, parts in rows_of.items()}}, name)


@dataclass
class FusedRows:
    """The LyCORIS modules of the parts of one fused weight (a single file's attention.qkv from a file's to_q /
    to_k / to_v), each merged into its own rows: exactly what merging them into the model in the parts' naming
    and then fusing gives, as each part's merge reads and writes its rows only."""

    parts: list[tuple[object, list[tuple[int, int]]]]  # (a part's delta: anything with merged(weight, ratio), its rows)

    def merged(self, weight: torch.Tensor, multiplier: float = 1.0) -> torch.Tensor:
        """weight [out, in] -> the merged weight, float32 (a copy)."""
        out = weight.to(torch.float32, copy=True)
        for delta, ranges in self.parts:
            rows = torch.cat([torch.arange(a, b) for a, b in ranges])
            out[rows] = delta.merged(out[rows], multiplier)
        return out


class WholeOfFused:
    """ratio * dW of one fused module, shared by the RowsOfFused of its parts: computed once (linear1's is 4 parts
    of a 21504 x 3072 float32 delta at a released model's width) and released once every part has taken its rows."""

    def __init__(self, delta, fused_rows: int, parts: int):
        self.delta, self.fused_rows, self.parts = delta, fused_rows, parts
        self.key, self.whole, self.served = None, None, 0

    def rows(self, rows: torch.Tensor, columns: int, multiplier: float) -> torch.Tensor:
        if self.whole is None or self.key != (columns, multiplier):
            self.key, self.served = (columns, multiplier), 0
            # ratio * dW, float32: the module merged into zeros of the fused shape, one zero expanded (only read)
            self.whole = self.delta.merged(torch.zeros(()).expand(self.fused_rows, columns), multiplier)
        out = self.whole[rows]
        self.served += 1
        if self.served >= self.parts:  # the last part: nothing else takes rows of it
            self.key, self.whole = None, None
        return out


@dataclass
class RowsOfFused:
    """One part's rows of a LyCORIS module of a fused weight (a single file's qkv merged into a diffusers folder's
    to_q): W_part + ratio * dW[rows]. A LoKr / LoHa / LoCon delta does not depend on the weight it is added to, so
    dW is the module merged into zeros of the fused shape: what merging into the fused weight and splitting gives.
    The parts of one module share `whole` (lycoris_for_model), so dW is computed once for all of them."""

    whole: WholeOfFused  # the module's delta (anything with merged(weight, ratio) adding a delta independent of it)
    ranges: list[tuple[int, int]]  # the part's rows of the fused weight

    def merged(self, weight: torch.Tensor, multiplier: float = 1.0) -> torch.Tensor:
        """weight [rows of the part, in] -> the merged weight, float32 (a copy)."""
        rows = torch.cat([torch.arange(a, b) for a, b in self.ranges])
        if weight.shape[0] != len(rows):  # a checkpoint of other sizes: else a broadcast error, no file named
            delta = self.whole.delta
            raise CheckpointError(f"{getattr(delta, 'source', 'LyCORIS file')}: LyCORIS module "
                                  f"'{getattr(delta, 'name', '?')}' gives {len(rows)} rows of its fused weight to "
                                  f"a part of {weight.shape[0]} rows")
        return weight.float() + self.whole.rows(rows, weight.shape[1], multiplier)


# ----------------------------------------------------------------------------------------------
# Whole-tensor deltas: `.diff` / `.diff_b`

# The part a whole delta's key ends in -> the tensor of its module it changes. ComfyUI's Extract and Save Lora
# writes `.diff_b` for every bias (bias_diff, its default) and `.diff` for every 1-D weight (every weight with
# lora_type full_diff) beside the down / up modules; LyCORIS' full type saves them alone. ComfyUI patches them in
# as W += strength * diff (comfy/lora.py's "diff" patch: no alpha, no rank).
WHOLE_DELTA_PARTS = {".diff": "weight", ".diff_b": "bias"}
_COMFY_PREFIX, _DIFFUSERS_PREFIX = "diffusion_model.", "transformer."


def split_whole_deltas(tensors: dict) -> tuple[dict, dict]:
    """(the other tensors, the `.diff` / `.diff_b` ones) of a LoRA file, with or without down / up modules."""
    whole = {k: v for k, v in tensors.items() if whole_delta_suffix(k)}
    return {k: v for k, v in tensors.items() if k not in whole}, whole


def _header_keys(path: str) -> tuple[dict, dict]:
    """split_whole_deltas of a LoRA file's keys, from its header alone (a PEFT adapter folder: no whole deltas)."""
    return split_whole_deltas(dict.fromkeys(CheckpointReader(path).keys())) if os.path.isfile(path) else ({}, {})


@dataclass
class WholeDelta:
    """What a file's whole deltas add to one tensor of the target: each its whole (rows None) or its rows (a part
    of a fused module, or the rows of a fused module's delta a part takes). merged: ComfyUI's patch, float32."""

    name: str  # the file's key (the first one), as errors name it
    parts: list[tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=list)  # (delta, row indices)

    def mismatch(self, shape) -> str | None:
        """A line saying why the deltas do not fit a tensor of `shape`, else None."""
        for diff, rows in self.parts:
            want = tuple(shape) if rows is None else (len(rows), *tuple(shape)[1:])
            if tuple(diff.shape) != want or (rows is not None and int(rows.max()) >= shape[0]):
                return f"'{self.name}' is a delta of shape {tuple(diff.shape)}, the tensor it changes is {tuple(shape)}"
        return None

    def merged(self, tensor: torch.Tensor, multiplier: float = 1.0) -> torch.Tensor:
        out = tensor.to(torch.float32, copy=True)
        for diff, rows in self.parts:
            if rows is None:  # (a copy: a delta on a file's pages may be unaligned, and a kernel's rounding with it)
                out.add_(diff.to(out.device, torch.float32, copy=True), alpha=multiplier)
            else:
                out[rows] += multiplier * diff.to(out.device, torch.float32)
        return out


def whole_deltas_only(path: str) -> bool:
    """A file of `.diff` / `.diff_b` tensors and nothing else (ComfyUI's full_diff extraction, LyCORIS' full type),
    from its header: no down / up module to read, its deltas merge as they are (base_loras)."""
    body, diffs = _header_keys(path)
    return bool(diffs) and not body


class WholeDeltasLeftOut(UserWarning):
    """A LoRA network read a file's down / up modules and left its `.diff` / `.diff_b` tensors out."""


@torch.no_grad()
def merge_whole_deltas(model: torch.nn.Module, arch: str, path: str, ratio: float,
                       keep_float32=lambda module: False, codes_merge_before: bool = False) -> int:
    """Add the `.diff` / `.diff_b` tensors of LoRA file `path` into `model`'s parameters (ratio * diff, float32 math),
    each stored back in its own dtype, or float32 where keep_float32(module) (a weight an fp8 conversion quantizes
    next); returns how many. A module or tensor the model lacks, a delta of another shape, or a weight that is not a
    float parameter (an fp8 base's codes) is a CheckpointError naming it. codes_merge_before: the check on a meta
    model of a run whose deltas merge into its weights before they are quantized (base_loras): a quantized
    weight's shape is checked and the weight left as it is."""
    from networks.lora_args import diffusers_module_map

    if not _header_keys(path)[1]:  # the header alone: most LoRAs hold no whole delta
        return 0
    diffs = split_whole_deltas(split_text_encoders(read_lora_tensors(path, map_whole_deltas=True)[0])[0])[1]
    if not diffs:
        return 0
    modules = dict(model.named_modules())
    config = getattr(model, "config", None)
    found = whole_deltas_for_model(diffs, arch, [p for p in modules if p],
                                   (lambda: diffusers_module_map(arch, config)) if config is not None else None, name=path)
    for (module, part), delta in found.items():
        param = getattr(modules.get(module), part, None)
        if codes_merge_before and isinstance(param, torch.Tensor) and param.dtype.itemsize == 1:
            layer = modules[module]  # the weight's own shape: nf4 / int8 packings store codes of another
            linear = part == "weight" and hasattr(layer, "in_features")
            shape = (layer.out_features, layer.in_features) if linear else param.shape
            if problem := delta.mismatch(shape):
                raise CheckpointError(f"{path}: {problem} ({module}.{part})")
            continue
        if not isinstance(param, torch.nn.Parameter) or param.dtype.itemsize < 2 or not param.is_floating_point():
            raise CheckpointError(f"{path}: '{delta.name}' changes {module}.{part}, which this model holds "
                                  f"{'as ' + str(param.dtype) if param is not None else 'nowhere'}: render on a bf16 "
                                  f"base (base_precision bf16), or merge the file into a bf16 checkpoint with "
                                  f"tools/merge_lora.py")
        if problem := delta.mismatch(param.shape):
            raise CheckpointError(f"{path}: {problem} ({module}.{part})")
        dtype = torch.float32 if part == "weight" and keep_float32(module) else param.dtype
        setattr(modules[module], part, torch.nn.Parameter(delta.merged(param, ratio).to(dtype), requires_grad=False))
    return len(found)


def _whole_delta_module(key: str, paths) -> str:
    """The module path a whole delta's key names: ComfyUI's `diffusion_model.<path>` or diffusers' `transformer.`
    dotted, else a kohya name resolved against `paths` (kept as it is where none fits)."""
    module = key.rsplit(".", 1)[0]
    for prefix in (_COMFY_PREFIX, _DIFFUSERS_PREFIX):
        if module.startswith(prefix):
            return module[len(prefix) :]
    return resolve_kohya_names([module], paths, strict=False)[module] if "." not in module else module


def whole_deltas_for_model(tensors: dict, arch: str, paths, module_map=None, target_is_key: bool = True,
                           name: str = "LoRA") -> dict[tuple[str, str], WholeDelta]:
    """A file's `.diff` / `.diff_b` tensors -> {(module path of the target, "weight" | "bias"): WholeDelta}. paths: every
    module path of the target (norms too: a `.diff` may be a norm's weight). Names as lycoris_for_model reads them; a
    module in ComfyUI's own names (LORA_FILES.comfy_map) or the other naming (module_map, target_is_key as there)
    moves by rows, exact for whole deltas: a row of a fused tensor is a row of one part's. A module the target lacks
    keeps the file's name (the caller reports it); a NaN / inf is a CheckpointError naming the tensor (every tool
    that applies them reads them here)."""
    refuse_non_finite_tensors(tensors, name, "which would make the weights it touches NaN")
    files = lora_files().get(arch)
    counts, resolvable = _names_to_resolve(tensors, files, paths)
    own = set(paths)
    read: dict[str, dict[str, tuple[str, torch.Tensor]]] = {}  # module -> part -> (key, delta)
    for key, diff in tensors.items():
        part = WHOLE_DELTA_PARTS[whole_delta_suffix(key)]
        read.setdefault(_whole_delta_module(key, resolvable), {})[part] = (key, diff)
    out: dict[tuple[str, str], WholeDelta] = {}

    def add(module, part, key, diff, rows=None):
        out.setdefault((module, part), WholeDelta(key)).parts.append((diff, rows))

    maps = []  # (module map, whether the target names its modules as the map's keys), in the order they apply
    if files and files.comfy_map and (comfy := [m for m in read if m not in own]):
        shapes = {m: SimpleNamespace(up=next(iter(read[m].values()))[1]) for m in comfy}  # the map reads up's rows
        maps.append((load_symbol(files.comfy_map)(shapes, counts), False))
    if callable(module_map):
        module_map = module_map() if any(m not in own for m in read) else None
    if module_map:
        maps.append((module_map, target_is_key))
    for module, parts in read.items():
        for part, (key, diff) in parts.items():
            moved = [(module, diff, None)]
            for mapping, to_key in maps:
                moved = [m for item in moved for m in _by_rows(item, mapping, to_key, own)]
            for target, delta, rows in moved:
                add(target, part, key, delta, rows)
    return out


def _by_rows(item, mapping: dict, to_key: bool, own: set) -> list:
    """[(module, delta, rows)] of one (module, delta, rows) moved through a module map: into its rows of the fused
    module it is part of (to_key), or split into the parts of the fused module it is (else); as it is where the
    map does not name it or the target has it."""
    module, diff, rows = item
    if module in own or rows is not None:
        return [item]
    if to_key:
        for fused, parts in mapping.items():
            if ranges := [(a, b) for p, a, b in parts if p == module]:
                return [(fused, diff, torch.cat([torch.arange(a, b) for a, b in ranges]))]
        return [item]
    if module not in mapping:
        return [item]
    ranges: dict[str, list] = {}
    for part, a, b in mapping[module]:
        ranges.setdefault(part, []).append(torch.arange(a, b))
    return [(part, diff[torch.cat(r)], None) for part, r in ranges.items()]


# ----------------------------------------------------------------------------------------------
# Another architecture's LoRA


def foreign_arch(tensors: dict, metadata: dict[str, str], arch: str) -> str | None:
    """The architecture a LoRA's names say it is for, when that is not `arch`: names only another
    architecture has, or a variant sharing `arch`'s names that claims the file (lora_arch.variant_of). None
    when the names fit `arch` or tell nothing (attention projections many models have)."""
    files = lora_files()
    if arch not in files:
        return None
    try:
        found = detect_arch(tensors, metadata)
    except CheckpointError:  # no telling names: a released size of another architecture, or the header, may tell
        found = _released_size_of(tensors, arch) or _header_of_holder(tensors, metadata)
        if found is None:
            return None
    if base_arch(found) != base_arch(arch) or (found != arch and files[found].names_of):
        return found
    if found != arch and is_base_lora(found, arch, tensors, metadata):  # the base's LoRA on a variant's model
        return found
    return None


def _header_of_holder(tensors: dict, metadata: dict[str, str]) -> str | None:
    """For names several architectures have: the one the header names (lora_arch.header_arch) where its
    Linears hold every module named, else None."""
    found = header_arch(metadata)
    return found if found in archs_holding(list(dict.fromkeys(module_of_key(k) for k in tensors))) else None


def shared_shapes_note(name: str, tensors: dict, metadata: dict[str, str], arch: str) -> str | None:
    """One line for a LoRA that nothing tells apart (module names several architectures have, a width and
    block counts that fit a release of `arch` and of another, no header naming one): it is read as `arch`'s.
    None where the names, the sizes or the header tell (foreign_arch refuses another's)."""
    files = lora_files()
    if arch not in files or header_arch(metadata) is not None or _names_tell(tensors, metadata):
        return None
    modules = list(dict.fromkeys(module_of_key(k) for k in tensors))
    widths = down_widths(tensors)
    base = base_arch(arch)
    others = list(dict.fromkeys(base_arch(a) for a in archs_holding(modules)
                                if base_arch(a) != base and fitted_releases(a, widths)))
    if not others or not fitted_releases(arch, widths):
        return None
    blocks = sum(info_block_counts(widths, arch).values())
    titles = [f"{arch_spec(a).title}'s" for a in [arch, *others]]
    alike = ", ".join(titles[:-1]) + " and " + titles[-1]
    return (f"{name}: its modules (e.g. '{modules[0]}') are {alike} alike, at width {width_of(widths, arch)} in {blocks} "
            f"blocks, and its header names no model (ss_base_model_version): read as this {arch_spec(arch).title} "
            f"model's LoRA")


def _names_tell(tensors: dict, metadata: dict[str, str]) -> bool:
    """True where the module names tell the architecture (lora_arch.detect_arch)."""
    try:
        detect_arch(tensors, metadata)
    except CheckpointError:
        return False
    return True


def _released_size_of(tensors: dict, arch: str) -> str | None:
    """For names several architectures have (attention projections): the architecture whose released size
    the width and block counts are (lora_arch.arch_by_shapes) where no release of `arch` fits them, else None
    (the target's own modules decide, as for any size of it: the tiny test models)."""
    modules = list(dict.fromkeys(module_of_key(k) for k in tensors))
    held, widths = archs_holding(modules), down_widths(tensors)
    if arch not in held or fitted_releases(arch, widths):
        return None
    found = arch_by_shapes(held, widths)
    return None if found == "unknown" else found


def without_base_only(name: str, tensors: dict, metadata: dict[str, str], arch: str, say: bool = True) -> dict:
    """`tensors` less those of the modules `arch` lacks that the architecture it shares names with has, where
    `arch`'s model takes that one's LoRAs (LoRAFiles.takes_base_loras), as ComfyUI loads them: one warning says
    how many were left out and why (say=False: the header check, which the load repeats). A LoRA of those
    modules alone is refused in one line: nothing of it would load. Else `tensors` itself."""
    files = lora_files().get(arch)
    if files is None or not files.takes_base_loras:
        return tensors
    modules = list(dict.fromkeys(module_of_key(k) for k in tensors))
    left_out = set(base_only_modules(arch, modules))
    if not left_out:
        return tensors
    base, title = arch_spec(files.names_of).title, arch_spec(arch).title
    if len(left_out) == len(modules):
        raise CheckpointError(f"{name}: {_said(files.names_of, modules)}, not for this {title} model: its {len(modules)} "
                              f"modules are all ones this model lacks ({files.takes_base_loras})")
    if say:
        header = " (its header says so)" if says_base(files.names_of, metadata) else ""
        warnings.warn(f"{name}: a {base} LoRA{header}: left out its {len(left_out)} modules this {title} model lacks "
                      f"(e.g. '{sorted(left_out)[0]}'; {files.takes_base_loras}), kept the other "
                      f"{len(modules) - len(left_out)}", stacklevel=3)  # fmt: skip
    return {k: v for k, v in tensors.items() if module_of_key(k) not in left_out}


def _said(found: str, modules: list[str]) -> str:
    """'a LoRA for <title> (tools/lora_info.py: arch <found>, <naming> names)': what lora_info reports for the modules."""
    names = naming_of(found, modules) or arch_of(modules)[1]  # a variant sharing its base's names: the base's naming
    return f"a LoRA for {arch_spec(found).title} (tools/lora_info.py: arch {found}" + (f", {names} names)" if names else ")")


def foreign_arch_error(name: str, tensors: dict, metadata: dict[str, str], arch: str) -> str | None:
    """One line for a LoRA of another architecture than `arch` (None when it is not one), naming what
    tools/lora_info.py reports for it."""
    found = foreign_arch(tensors, metadata, arch)
    if found is None:
        return None
    return f"{name}: {_said(found, [module_of_key(k) for k in tensors])}, not for this {arch_spec(arch).title} model"


def check_lora_arch(path: str, arch: str) -> None:
    """From the header alone (names, shapes, metadata): a LoRA file or PEFT folder of another architecture
    than `arch` is a CheckpointError in one line, before any model loads."""
    reader, _ = lora_reader(path)
    shapes = {k: torch.empty(reader.shape(k), device="meta") for k in reader.keys()}
    shapes, te = split_text_encoders(shapes)
    if te and not shapes:
        raise CheckpointError(text_encoders_only(path, te, arch))
    shapes = without_base_only(path, split_beside_lora(shapes)[0], dict(reader.metadata), arch, say=False)
    try:  # every name a LoRA's: a VAE or a base checkpoint given as base_loras was named only after caching
        if shapes and not is_lycoris_file(shapes):
            detect_format(shapes)
    except CheckpointError as e:
        raise naming(path, e) from None
    if shapes and (error := foreign_arch_error(path, shapes, dict(reader.metadata), arch)) is not None:
        raise CheckpointError(error)


def text_encoders_only(name: str, te: dict, arch: str) -> str:
    """The line for a LoRA of sd-scripts' text encoders alone, read for `arch`: nothing in it adapts the transformer."""
    return f"{name}: holds only {text_encoder_note(te, text_encoder_labels(arch))}; this LoRA adapts no module of the transformer"


def leave_out_text_encoders(name: str, te: dict, kept: bool, arch: str, stacklevel: int) -> None:
    """For a network of `arch` loading a file: a CheckpointError where it holds text-encoder modules `te` alone
    (`kept` False: nothing else of it loads), else one warning that `te`'s modules were left out (stacklevel: the
    caller's)."""
    if te and not kept:
        raise CheckpointError(text_encoders_only(name, te, arch))
    if te:
        note = text_encoder_note(te, text_encoder_labels(arch))
        warnings.warn(f"{name}: left out {note}: they adapt the text encoders, not this network's model",
                      stacklevel=stacklevel + 1)
