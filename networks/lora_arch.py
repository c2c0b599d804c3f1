"""Which architecture a LoRA file is for, from its module names, metadata and shapes: each
architecture's spec lists names only it has (LoRAFiles.markers); architectures that share names
(a variant of another's blocks) each recognise their own files (LoRAFiles.recognise). Every LoRA tool
and the merge's version check ask here."""

from __future__ import annotations

import re

from library.io import CheckpointError
from library.models.registry import arch_spec, arch_specs
from library.models.spec import LoRAFiles, load_symbol
from networks.lora_files import TEXT_ENCODER_PREFIXES


def lora_files() -> dict[str, LoRAFiles]:
    """arch -> the LoRA file facts of its spec, for every architecture that has them."""
    return {arch: spec.lora_files for arch, spec in arch_specs().items() if spec.lora_files is not None}


def _marker_groups(files: dict[str, LoRAFiles]) -> dict[str, tuple[tuple[str, ...], list[str]]]:
    """Base arch -> (the markers of it and of the architectures that share its names, their titles)."""
    groups: dict[str, tuple[tuple[str, ...], list[str]]] = {}
    for arch, f in files.items():
        markers, titles = groups.get(f.names_of or arch, ((), []))
        groups[f.names_of or arch] = (markers + f.markers, titles + [arch_spec(arch).title])
    return groups


def title_list(titles: list[str]) -> str:
    return ", ".join(titles[:-1]) + " or " + titles[-1] if len(titles) > 1 else "".join(titles)


def base_arch_of_names(keys) -> str:
    """The base architecture whose names the keys have (a variant sharing them: `variant_of`)."""
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
    if len(found) > 1:
        (a, ka), (b, kb) = list(found.items())[:2]
        raise CheckpointError(f"LoRA names both {title[a]} ('{ka}') and {title[b]} ('{kb}') modules")
    if not found:
        raise CheckpointError(f"cannot tell {title_list(list(title.values()))} by the names (e.g. '{flat[0]}'): pass --model_type")
    return next(iter(found))


def variant_of(arch: str, tensors: dict, metadata: dict[str, str]) -> str:
    """`arch`, or the architecture sharing its names whose `recognise` claims the LoRA (tensors:
    key -> tensor; meta tensors do, only shapes are read)."""
    for other, f in lora_files().items():
        if f.names_of == arch and load_symbol(f.recognise)(tensors, metadata):
            return other
    return arch


def detect_arch(tensors: dict, metadata: dict[str, str]) -> str:
    """The architecture of a LoRA from its names, metadata and shapes."""
    return variant_of(base_arch_of_names(tensors), tensors, metadata)


def arch_of(modules: list[str]) -> tuple[str, str | None]:
    """(arch, naming) of the first architecture with a module matching its info_markers (what
    tools/lora_info.py reports); those that share another's names are tried before it (their markers are
    the names only they have). ("unknown", None) when none matches."""
    files = lora_files()
    for arch in sorted(files, key=lambda a: files[a].names_of is None):
        if (names := naming_of(arch, modules)) is not None:
            return arch, names
    return "unknown", None


def naming_of(arch: str, modules: list[str]) -> str | None:
    """The naming (bfl, diffusers, ...) of `arch`'s info_markers that a module name matches, else None."""
    flat = [m.replace(".", "_") for m in modules]
    for names, pattern in lora_files()[arch].info_markers:
        if any(re.search(pattern, m) for m in flat):
            return names
    return None
