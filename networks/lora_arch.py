"""Which architecture a LoRA file is for, from its module names, metadata and shapes: each
architecture's spec lists names only it has (LoRAFiles.markers); architectures that share names
(a variant of another's blocks) are told apart by their markers, their header (LoRAFiles.model_versions) and
their shapes (LoRAFiles.recognise): variant_of. Every LoRA tool
and the merge's version check ask here."""

from __future__ import annotations

import functools
import re

from library.io import CheckpointError
from library.models.registry import arch_spec, arch_specs
from library.models.spec import LoRAFiles, load_symbol
from networks.lora_files import _PART_OF_SUFFIX, LYCORIS_COMFY_PREFIX, TEXT_ENCODER_PREFIXES


def lora_files() -> dict[str, LoRAFiles]:
    """arch -> the LoRA file facts of its spec, for every architecture that has them."""
    return {arch: spec.lora_files for arch, spec in arch_specs().items() if spec.lora_files is not None}


def base_arch(arch: str) -> str:
    """The architecture whose names `arch`'s LoRAs have: itself, or the one it is a variant of (LoRAFiles.names_of)."""
    return lora_files()[arch].names_of or arch


def header_decides(metadata: dict[str, str] | None, bases) -> str | None:
    """For names several base architectures hold whole: the architecture the header names (header_arch) where its
    base is one of `bases`, else None (the names cannot tell; the header names none of them)."""
    said = header_arch(metadata or {})
    return said if said is not None and base_arch(said) in bases else None


def text_encoder_labels(arch: str | None) -> dict[str, str]:
    """Kohya text-encoder prefix -> the encoder it is in `arch`'s files where sd-scripts' names say another
    (LoRAFiles.text_encoders), for lora_files.text_encoder_note; {} for an arch without (or None)."""
    files = lora_files().get(arch)
    return dict(files.text_encoders) if files else {}


def _marker_groups(files: dict[str, LoRAFiles]) -> dict[str, tuple[tuple[str, ...], list[str]]]:
    """Base arch -> (the markers of it and of the architectures that share its names, their titles)."""
    groups: dict[str, tuple[tuple[str, ...], list[str]]] = {}
    for arch, f in files.items():
        base = base_arch(arch)
        markers, titles = groups.get(base, ((), []))
        groups[base] = (markers + f.markers, titles + [arch_spec(arch).title])
    return groups


def title_list(titles: list[str]) -> str:
    return ", ".join(titles[:-1]) + " or " + titles[-1] if len(titles) > 1 else "".join(titles)


def base_arch_of_names(keys, metadata: dict[str, str] | None = None) -> str:
    """The base architecture whose names the keys have (a variant sharing them: `variant_of`). Where two have
    every module named (a language model's decoder layers: an LLM's and a diffusion model built on one), the one
    the header names (header_arch); none: a CheckpointError asking for --model_type."""
    flat = [k.replace(".", "_") for k in keys if not k.startswith(tuple(TEXT_ENCODER_PREFIXES))]  # CLIP / T5: no arch
    if not flat:
        raise CheckpointError("LoRA holds text-encoder modules only (lora_te1_ / lora_te2_ / lora_te3_), no transformer's")
    groups = _marker_groups(lora_files())
    found = {}  # base arch -> the first name only it has
    for arch, (markers, _) in groups.items():
        hit = next((k for k in flat if any(m in k for m in markers)), None)
        if hit:
            found[arch] = hit
    title = {arch: " / ".join(titles) for arch, (_, titles) in groups.items()}
    if len(found) > 1:  # names two groups' markers hit (a diffusers attn2.to_k of a cross-attention model and of one
        # with a second self-attention): the group whose architectures hold every module named, where one does
        bases = {base_arch(a) for a in archs_holding(list(dict.fromkeys(map(module_of_key, keys))))}
        if len(holding := [arch for arch in found if arch in bases]) == 1:
            return holding[0]
        if said := header_decides(metadata, holding):
            return base_arch(said)
        (a, ka), (b, kb) = list(found.items())[:2]
        if len(holding) > 1:  # every module is each one's: only the header could have told
            example = module_of_key(next(k for k in keys if k.replace(".", "_") == ka))
            raise CheckpointError(f"cannot tell {' from '.join(title[h] for h in holding)} by the names (each has "
                                  f"every module named, e.g. '{example}') nor by the header (its "
                                  f"ss_base_model_version / modelspec.architecture names neither): pass --model_type")
        raise CheckpointError(f"LoRA names both {title[a]} ('{ka}') and {title[b]} ('{kb}') modules")
    if not found:
        raise CheckpointError(f"cannot tell {title_list(list(title.values()))} by the names (e.g. '{flat[0]}'): pass --model_type")
    return next(iter(found))


def variant_of(arch: str, tensors: dict, metadata: dict[str, str]) -> str:
    """`arch`, or the architecture sharing its names that claims the LoRA: a module only it has (its markers),
    its header (header_arch), or its shapes (its `recognise`). tensors: key -> tensor; meta tensors do, only
    shapes are read."""
    said, flat = header_arch(metadata), [k.replace(".", "_") for k in tensors]
    for other, f in lora_files().items():
        if f.names_of == arch and (said == other or any(m in k for k in flat for m in f.markers)
                                   or f.recognise and load_symbol(f.recognise)(tensors)):
            return other
    return arch


def detect_arch(tensors: dict, metadata: dict[str, str]) -> str:
    """The architecture of a LoRA from its names, metadata and shapes."""
    return variant_of(base_arch_of_names(tensors, metadata), tensors, metadata)


def block_counts(keys, pattern: str) -> dict[str, int]:
    """Block kind -> count (highest index + 1) named anywhere in the keys (pattern: the spec's block_pattern)."""
    counts: dict[str, int] = {}
    for key in keys:
        for kind, index in re.findall(pattern, key) if pattern else ():
            counts[kind] = max(counts.get(kind, 0), int(index) + 1)
    return counts


def arch_of(modules: list[str]) -> tuple[str, str | None]:
    """(arch, naming) of the first architecture with a module matching its info_markers (what
    tools/lora_info.py reports); those that share another's names are tried before it (their markers are
    the names only they have). ("unknown", None) when none matches."""
    files = lora_files()
    for arch in sorted(files, key=lambda a: files[a].names_of is None):
        if (names := naming_of(arch, modules)) is not None:
            return arch, names
    return "unknown", None


def other_holders(arch: str, modules: list[str]) -> list[str]:
    """The base architectures other than `arch`'s whose Linears hold every module named too (names both have: a
    language model's decoder layers), for a LoRA whose names `arch`'s info_markers matched."""
    base, bases = base_arch(arch), (base_arch(a) for a in archs_holding(modules))
    return list(dict.fromkeys(b for b in bases if b != base))


def archs_holding(modules: list[str]) -> list[str]:
    """The architectures whose Linears (their spec's module_paths, for the blocks the names count) include
    every module named: for names that tell no architecture (attention projections many have)."""
    flat = [m.replace(".", "_") for m in modules]
    return [a for a, f in lora_files().items() if f.module_paths and flat and all(map(_holds(_paths(a, flat)), flat))]


def _paths(arch: str, flat: list[str]) -> frozenset[str]:
    """The '_'-flattened module paths of `arch` for the blocks the flattened module names count."""
    files = lora_files()[arch]
    counts = block_counts([m + "_" for m in flat], files.block_pattern)
    return _flat_paths(files.module_paths, tuple(sorted(counts.items())))


@functools.lru_cache(maxsize=256)
def _flat_paths(module_paths: str, counts: tuple[tuple[str, int], ...]) -> frozenset[str]:
    """module_paths(counts) '_'-flattened: the same for the same block counts, and some build a model's skeleton to
    list them (a file's check asks once per architecture: 2,900 skeletons for one test's 45 files)."""
    return frozenset(p.replace(".", "_") for p in load_symbol(module_paths)(dict(counts)))


def _holds(paths: set[str]):
    """flat module name -> True where it ends in one of the paths (after any prefix: lora_unet_, transformer_)."""
    return lambda m: any("_".join(m.split("_")[i:]) in paths for i in range(m.count("_") + 1))


def naming_of(arch: str, modules: list[str]) -> str | None:
    """The naming (bfl, diffusers, ...) of `arch`'s info_markers that a module name matches, else None."""
    flat = [m.replace(".", "_") for m in modules]
    for names, pattern in lora_files()[arch].info_markers:
        if any(re.search(pattern, m) for m in flat):
            return names
    return None


# ----------------------------------------------------------------------------------------------
# Sizes: the width and block counts a LoRA names, against the releases of an architecture


def down_widths(tensors: dict) -> dict[str, int]:
    """Module name -> the input width of its down (tensors: key -> tensor; meta tensors do)."""
    downs = [suffix for suffix, part in _PART_OF_SUFFIX.items() if part == "down"]
    return {k[: -len(s)]: t.shape[1] for k, t in tensors.items() for s in downs if k.endswith(s) and t.dim() == 2}


def info_block_counts(modules, arch: str) -> dict[str, int]:
    """Block kind -> highest index named + 1, by the arch's info_blocks (none for an unknown arch)."""
    counts: dict[str, int] = {}
    files = lora_files()
    for kind, pattern in files[arch].info_blocks if arch in files else ():
        found = [int(next(g for g in m.groups() if g)) for name in modules for m in [re.search(pattern, name.replace(".", "_"))] if m]
        if found:
            counts[kind] = max(counts.get(kind, 0), max(found) + 1)
    return counts


def width_pattern(arch: str) -> str:
    """Module name endings whose down input is the model width: the arch's, or any arch's when unknown."""
    files = lora_files()
    endings = [files[arch].width_modules] if arch in files else [f.width_modules for f in files.values() if f.width_modules]
    return f"({'|'.join(endings)})$"


def width_of(widths: dict[str, int], arch: str) -> int | None:
    """The model width: the down input of the first module whose name says it is (width_pattern)."""
    width_re = width_pattern(arch)
    return next((w for m, w in widths.items() if re.search(width_re, m.replace(".", "_"))), None)


def fitted_releases(arch: str, widths: dict[str, int]) -> list[tuple[bool, str]]:
    """(exactly: every block of the release named, its name) of each release of `arch` that the width
    and block counts of a LoRA's modules (widths: down_widths) fit."""
    width, counts = width_of(widths, arch), info_block_counts(widths, arch)
    return [(bool(counts) and all(r.blocks.get(k) == n for k, n in counts.items()), r.name)
            for r in lora_files()[arch].releases
            if width == r.width and all(counts.get(k, 0) <= n for k, n in r.blocks.items())]


def arch_by_shapes(held: list[str], widths: dict[str, int]) -> str:
    """Of the architectures whose Linears hold every module named (lora_arch.archs_holding), the one whose
    release the width and block counts fit: exactly (a LoRA on every block) before loosely; a variant
    sharing the names of another that fits as well counts as it (variant_of tells them apart). "unknown":
    none or several, or one of them of any size (no releases: an LLM's layers fit every width and depth)."""
    files = lora_files()
    if len({base_arch(a) for a in held}) > 1 and any(not files[a].releases for a in held):
        return "unknown"
    fitted = {a: fitted_releases(a, widths) for a in held}
    for exact in (True, False):
        tier = {a for a, fit in fitted.items() if any(e for e, _ in fit) or not exact and fit}
        found = {files[a].names_of if files[a].names_of in tier else a for a in tier}
        if found:
            return found.pop() if len(found) == 1 else "unknown"
    return "unknown"


# ----------------------------------------------------------------------------------------------
# A LoRA in the names a variant shares with its base, that is the base's


def is_base_lora(base: str, variant: str, tensors: dict, metadata: dict[str, str]) -> bool:
    """True for a LoRA in the names `variant` shares with `base` (that variant_of did not claim for `variant`)
    that only `base`'s model takes: its metadata names the base (LoRAFiles.model_versions), it names a
    Linear the base has and the variant lacks, its shapes are the base's (the variant's `refuses`), or its
    width and blocks fit a release of the base exactly and none of the variant's. Else the variant takes it
    (attention projections of the same shapes read the same in both), as it takes every LoRA of the base where
    its spec says so (LoRAFiles.takes_base_loras: the reader leaves out the base_only_modules)."""
    files = lora_files()
    if takes_loras_of(variant, base):  # base_only_modules left out
        return False
    if says_base(base, metadata):
        return True
    if files[variant].module_paths and base_only_modules(variant, dict.fromkeys(module_of_key(k) for k in tensors)):
        return True
    if files[variant].refuses and load_symbol(files[variant].refuses)(tensors):
        return True
    widths = down_widths(tensors)
    return any(exact for exact, _ in fitted_releases(base, widths)) and not fitted_releases(variant, widths)


def takes_loras_of(variant: str, arch: str) -> bool:
    """True where `arch` is the architecture whose names `variant` shares and `variant`'s model takes its LoRAs
    (LoRAFiles.takes_base_loras), less the modules it lacks (base_only_modules): the loaders' rule
    (lora_reader.without_base_only), which the merge's version check follows."""
    files = lora_files().get(variant)
    return files is not None and bool(files.takes_base_loras) and files.names_of == arch


def says_base(base: str, metadata: dict[str, str]) -> bool:
    """True where the header names `base` as the model the LoRA was trained on (LoRAFiles.model_versions)."""
    return header_arch(metadata) == base


# The header entries naming the model a LoRA was trained on: ours, sd-scripts' and ai-toolkit's first
# (sd-scripts writes both), then sai_model_spec's `<model>/lora`, which musubi-tuner writes alone.
VERSION_KEYS = ("ss_base_model_version", "modelspec.architecture")


def header_version(metadata: dict[str, str]) -> tuple[str, str] | None:
    """(key, value) of the first VERSION_KEYS entry the header has, else None."""
    return next(((k, metadata[k]) for k in VERSION_KEYS if metadata.get(k)), None)


def release_stem(name: str) -> str:
    """A release's name as every trainer's spelling of it reads: lower case, without modelspec's adapter
    suffix and separators ('Model.2-dev-4b/lora', ai-toolkit's 'model2_dev_4b' and our 'model2-dev-4b' are
    all 'model2dev4b')."""
    return re.sub(r"[^a-z0-9]", "", name.lower().split("/")[0])


def begins_release(name: str, stem: str) -> bool:
    """True where `stem` is the release `name` or begins it, both spelled any trainer's way (release_stem):
    the one rule by which a header's name meets a family's: a family's model_versions prefix the header's
    (header_arch), the header's name or stem (sd-scripts' 'model-2') the base's model_version (the merge's
    version check)."""
    return release_stem(name).startswith(release_stem(stem))


def header_arch(metadata: dict[str, str]) -> str | None:
    """The architecture whose LoRAFiles.model_versions begin the header's ss_base_model_version or
    modelspec.architecture (begins_release; the longest such prefix: a variant's version may begin with its
    base's), else None."""
    said = [v for v in (metadata.get(k) for k in VERSION_KEYS) if v]
    hits = [(len(release_stem(p)), arch) for arch, f in lora_files().items() for p in f.model_versions
            for v in said if begins_release(v, p)]
    return max(hits)[1] if hits else None


def base_only_modules(variant: str, modules) -> list[str]:
    """The module names (any layout) that a Linear of the architecture `variant` shares names with has and
    `variant` lacks; [] for an architecture that shares no other's names."""
    base = lora_files()[variant].names_of
    if base is None:
        return []
    flat = {m: m.replace(".", "_") for m in modules}
    in_base, in_variant = _holds(_paths(base, list(flat.values()))), _holds(_paths(variant, list(flat.values())))
    return [m for m, f in flat.items() if in_base(f) and not in_variant(f)]


def module_of_key(key: str) -> str:
    """The module a LoRA tensor key belongs to (its part suffix stripped)."""
    for suffix in _PART_OF_SUFFIX:
        if key.endswith(suffix):
            return key[: -len(suffix)]
    if key.startswith(LYCORIS_COMFY_PREFIX):  # a LyCORIS key in ai-toolkit's names: `diffusion_model.<path>.<part>`
        return key.rpartition(".")[0]
    return key.split(".")[0]  # a LyCORIS key: `lora_unet_<module>.<part>`


# ----------------------------------------------------------------------------------------------
# A base checkpoint's architecture, by the same markers (a model's weight names are its LoRA's module names)


def check_model_files(family, path: str) -> None:
    """family.check_model_files() (train_lora.py's check before caching, generate's before loading), its refusal
    of the transformer at `path` naming the family whose keys the file has (other_arch_hint)."""
    try:
        family.check_model_files()
    except CheckpointError as e:
        raise CheckpointError(f"{e}{other_arch_hint(str(e), path, family.arch)}") from None


def other_arch_hint(said: str, path: str, arch: str) -> str:
    """"; its keys are a <arch> transformer's: set model_type = ..." where the line a check `said` refuses the
    checkpoint at `path` (a file or folder given as `arch`'s transformer) and it is another registered
    architecture's, else "" (the loaders' lines say what is missing, never which model the file is; a line that
    names a model_type already says)."""
    from library.io import CheckpointReader
    from library.models.registry import FAMILIES, spec_of

    if not said.startswith(f"{path}:") or "model_type" in said:
        return ""
    try:
        modules = [key.rsplit(".", 1)[0] for key in CheckpointReader(path).keys()]
    except (CheckpointError, OSError, ValueError):
        return ""
    found, _ = arch_of(modules)
    if found in ("unknown", arch) or found not in FAMILIES:
        return ""
    types = [t for t in FAMILIES if spec_of(t).arch == found]
    return f"; its keys are a {found} transformer's: set model_type = " + " or ".join(f'"{t}"' for t in types)
