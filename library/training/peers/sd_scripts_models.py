"""sd-scripts' names for our models, as the family specs give them (each spec's peer_models["sd-scripts"], an
SdScriptsModels: library/models/spec.py): the scripts that train them (one per spec; specs may share one and tell
their models apart by its --model_type), each script's LoRA module, --model_type values and their default, its
timestep draws named after a model. sd_scripts.py reads them here, so a model a script comes to train, or a script
of its own, is a line in the family's spec.py, not in the peer module. No torch."""

from __future__ import annotations

from library.models.registry import arch_specs
from library.models.spec import SdScriptsModels

PEER = "sd-scripts"


def every_model() -> tuple[SdScriptsModels, ...]:
    """The specs' SdScriptsModels, in the registry's order."""
    return tuple(s.peer_models[PEER] for s in arch_specs().values() if PEER in s.peer_models)


def scripts() -> tuple[str, ...]:
    """Its training scripts for our models, in the registry's order (the first: sd_scripts.RULES')."""
    return tuple(dict.fromkeys(m.script for m in every_model()))


def first_script() -> str:
    """The script whose parser sd_scripts.RULES follows, and a config's that names no script's model."""
    return scripts()[0]


def models_of(script: str) -> tuple[SdScriptsModels, ...]:
    """The SdScriptsModels of the specs `script` trains."""
    return tuple(m for m in every_model() if m.script == script)


def entry(script: str) -> SdScriptsModels:
    """The first of `script`'s SdScriptsModels: its own arguments (those of a script of its own)."""
    return models_of(script)[0]


def _one(script: str, what: str) -> str:
    """The one value the specs `script` trains give for `what` (its LoRA module)."""
    values = {getattr(m, what) for m in models_of(script)}
    if len(values) != 1:
        raise ValueError(f"the specs' peer_models[{PEER!r}] of {script} name {len(values)} {what}s "
                         f"({', '.join(sorted(values))}): one script has one")
    return values.pop()


def lora_module(script: str) -> str:
    """Its LoRA module of `script`'s models' blocks."""
    return _one(script, "lora_module")


def lora_modules() -> dict[str, str]:
    """Its LoRA modules -> the script each goes with."""
    return {lora_module(s): s for s in scripts()}


def model_types(script: str) -> dict[str, str]:
    """`script`'s --model_type values -> our model_type ({} for a script that takes none)."""
    return {name: keys["model_type"] for m in models_of(script) for name, keys in m.models.items()}


def default_model_type(script: str) -> str:
    """`script`'s --model_type default (one spec's `default`), or the model a script of its own trains."""
    defaults = [m.default for m in models_of(script) if m.default] or [m.model_type for m in models_of(script)
                                                                       if m.model_type and not m.models]
    if len(defaults) != 1:
        raise ValueError(f"the specs' peer_models[{PEER!r}] of {script} give {len(defaults)} defaults: expected one")
    return defaults[0]


def model_entry(model_type: str) -> SdScriptsModels:
    """The SdScriptsModels of the spec whose script trains our `model_type` (one of its models, or its own)."""
    for m in every_model():
        if model_type in (keys["model_type"] for keys in m.models.values()) or model_type == m.model_type:
            return m
    raise ValueError(f"model_type {model_type!r}: no sd-scripts script of the specs trains it")


def script_of(model_type: str) -> str:
    """The script that trains our `model_type` (one of some script's model_types, or a script's own model)."""
    for script in scripts():
        if model_type in model_types(script).values() or model_type == entry(script).model_type:
            return script
    raise ValueError(f"model_type {model_type!r}: no sd-scripts script of the specs trains it")


def shift_draws() -> tuple[str, ...]:
    """Its timestep_sampling values named after a model (ours by the same name)."""
    return tuple(d for m in every_model() for d in m.draws)


def ignored_text(script: str) -> str:
    """The line of a key of `script`'s parser its training of these models does not read."""
    titles = " / ".join(dict.fromkeys(s.title for s in arch_specs().values()
                                      if PEER in s.peer_models and s.peer_models[PEER].script == script))
    return f"sd-scripts' {titles} training does not read it either ({script.removesuffix('.py')})"
