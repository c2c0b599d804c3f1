"""A family's declarative facts: one frozen `ArchSpec` per transformer architecture, in its own
folder (library/models/<folder>/spec.py, the module-level SPEC), found through the registry
(library/models/registry.py arch_spec / spec_of). Everything outside the folder that needs a fact
about an architecture (LoRA targets and key names, fp8 keep-high-precision rules, timestep sampling
defaults, the memory planner's shapes and presets, converters' key tables, the blocks to compile and
swap, the tiny test models, the default config) reads it here and never names the family.

Nothing here imports torch: the command lines check names and defaults before loading it. Where a
fact is code (a module map built from a model config, a tiny-model writer) the spec holds a
"module:function" string that the consumer imports when it needs it (`load_symbol`).

Each part below is one concern, read by one place (named in the comment above it).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


def load_symbol(path: str):
    """"package.module:name" -> the object (imported on first use)."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


# ----------------------------------------------------------------------------------------------
# LoRA: targets and key names (networks/lora.py, networks/lycoris_network.py)


# ----------------------------------------------------------------------------------------------
# LoRA files: converters' and inspectors' key tables (tools/convert_lora.py, tools/lora_info.py, ...)


# ----------------------------------------------------------------------------------------------
# fp8: which modules stay in high precision (library/precision/fp8.py)


# ----------------------------------------------------------------------------------------------
# Timestep sampling and shift defaults (library/models/flow_matching.py)


# ----------------------------------------------------------------------------------------------
# Blocks: the repeated transformer blocks (compile, block swap, FSDP wrapping)


# ----------------------------------------------------------------------------------------------
# Memory planner: shapes and presets (library/training/memory_plan.py, tools/plan_memory.py)


# ----------------------------------------------------------------------------------------------
# Tiny models for tests and the quickstart (tools/make_tiny_models.py)


@dataclass(frozen=True)
class TinySpec:
    """The architecture's part of the tiny real-format model set. writers: "module:function" strings,
    each writer(out_dir, seed) -> {component name: path}, run in this order (each seeds its own
    generator: the order sets only the manifest's); dims: (name, value) of its own toy sizes, recorded
    in manifest.json after the shared ones (library/models/tiny_files.py TINY)."""

    writers: tuple[str, ...] = ()
    dims: tuple[tuple[str, int], ...] = ()


# ----------------------------------------------------------------------------------------------
# The spec


@dataclass(frozen=True)
class ArchSpec:
    arch: str  # the architecture's name: LoRA metadata, fp8 rules, caches (a variant's is its base's)
    title: str  # how messages and reports name it
    # Regexes (case-insensitive) of the names the family goes by in code and text; the name-scan
    # test (tests/test_family_names.py) fails on any of them outside the family's folder.
    names: tuple[str, ...] = ()
    lora: object = None  # LoRA targets and key names (section above)
    lora_files: object = None  # converters' key tables
    fp8: object = None  # keep-high-precision rules
    sampling: object = None  # timestep sampling and shift defaults
    blocks: object = None  # the repeated blocks
    planner: object = None  # memory planner shapes and presets
    tiny: object = None  # tiny model writers
    default_config: str | None = None  # configs/<file>: the config the README points a new user to
