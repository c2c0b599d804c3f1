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
from dataclasses import dataclass, field


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


@dataclass(frozen=True)
class PlannerPreset:
    """A released model planned without its files (tools/plan_memory.py --preset NAME): the family
    it trains as, its transformer's config, and what its files would tell the family."""

    model_type: str  # the family it plans as
    transformer: str  # "module:NAME" of the released transformer's config (Planner.transformer builds it)
    text_params: dict[str, int]  # per text-encoder file key: the parameters its loader reads
    text_options: dict = field(default_factory=dict)  # the family's text_options for a config that sets none
    attributes: dict = field(default_factory=dict)  # other family attributes its files would give (a version)


@dataclass(frozen=True)
class Planner:
    transformer: str  # "module:Class" of the transformer a preset's config builds (on meta)
    text_tokens: int = 512  # text tokens a planned caption carries (the length the encoder pads to)
    # The family's text_options key holding that length where the config or the checkpoint sets it.
    text_length_option: str | None = None
    presets: dict[str, PlannerPreset] = field(default_factory=dict)  # --preset name -> preset


# ----------------------------------------------------------------------------------------------
# Tiny models for tests and the quickstart (tools/make_tiny_models.py)


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
