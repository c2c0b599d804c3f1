"""Adding a family is one folder plus one registration line (library/models/registry.py): so no .py
file outside a family's folder names it. This test reads every .py file of the trainer (library/,
networks/, tools/, train_lora.py; tests, configs, docs and bench aside: they pick families to test
and measure) and fails on any of a registered family's names (its spec's `names`, regexes, matched
case-insensitively, not followed by a lowercase letter or digit) outside the family folders,
listing file and line. A family folder may name another family it builds on. Comments and docstrings count: a generic module that explains itself through one family
is the first place the next family gets missed.
"""

import os
import re

import pytest

from library.models.registry import FAMILIES, arch_specs, family_folder

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCANNED = ("library", "networks", "tools", "train_lora.py")
# Files that may name every family, each with why.
ALLOWED = {
    "library/models/registry.py": "the registration lines themselves",
    # below the models layer (io -> data -> models): it cannot read the specs' musubi-tuner dataset_renames, so
    # the unknown-key hint of our dataset loader lists them (test_convert_config_musubi checks they agree)
    "library/data/peer_keys.py": "musubi-tuner's dataset keys (qwen_image_edit_control_resolution ...)",
}


def _python_files():
    for top in SCANNED:
        path = os.path.join(ROOT, top)
        if os.path.isfile(path):
            yield top
            continue
        for folder, _, files in os.walk(path):
            for name in sorted(files):
                if name.endswith(".py"):
                    yield os.path.relpath(os.path.join(folder, name), ROOT).replace(os.sep, "/")


def _folders() -> dict[str, str]:
    """arch -> its folder, relative to the repository ("library/models/flux1/")."""
    folders = {}
    for model_type in FAMILIES:
        spec_module = family_folder(model_type)
        arch = arch_specs_by_module()[spec_module]
        folders[arch] = spec_module.replace(".", "/") + "/"
    return folders


def arch_specs_by_module() -> dict[str, str]:
    from library.models.spec import load_symbol

    return {family_folder(m): load_symbol(family_folder(m) + ".spec:SPEC").arch for m in FAMILIES}


def name_pattern(names: tuple[str, ...]) -> re.Pattern:
    return re.compile("|".join(f"(?i:{n})(?![a-z0-9])" for n in names))


def family_name_hits() -> list[str]:
    specs, folders = arch_specs(), _folders()
    patterns = {arch: name_pattern(specs[arch].names) for arch in folders if specs[arch].names}
    hits = []
    for rel in _python_files():
        if rel in ALLOWED:
            continue
        with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
            lines = f.read().splitlines()
        if rel.startswith(tuple(folders.values())):
            continue
        for arch, pattern in patterns.items():
            for number, line in enumerate(lines, 1):
                if pattern.search(line):
                    hits.append(f"{rel}:{number}: names {arch}: {line.strip()[:120]}")
    return hits


def test_every_registered_family_declares_the_names_the_scan_looks_for():
    specs = arch_specs()
    for arch in _folders():
        assert specs[arch].names, f"{arch}'s spec.py declares no names: the scan would find nothing"


@pytest.mark.parametrize("text, arch, hit", [
    ("class FluxVAE:", "flux", True), ("flux_kontext", "flux", True), ("FLUX.1-dev", "flux", True),
    ("FLUX.2", "flux", False), ("flux2_shift", "flux", False), ("influxes", "flux", False), ("FLUX.3", "flux", False),
    ("flux-3-image", "flux", False), ("flux3_shift", "flux3", True),
    ("AutoencoderKLFlux2", "flux2", True), ("klein", "flux2", True),
    ("QwenImageTextEncoder", "qwen_image", True), ("Qwen-Image-Edit", "qwen_image", True), ("qwen2", "qwen_image", False),
])
def test_the_name_patterns_find_what_they_should(text, arch, hit):
    assert bool(name_pattern(arch_specs()[arch].names).search(text)) is hit


def test_no_file_outside_a_family_folder_names_the_family():
    hits = family_name_hits()
    assert not hits, f"{len(hits)} mentions of a family outside its folder:\n" + "\n".join(hits)
