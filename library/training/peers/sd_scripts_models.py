"""sd-scripts' names for our models, as the family specs give them (each spec's peer_models["sd-scripts"], an
SdScriptsModels: library/models/spec.py): the one script that trains them, its LoRA module, its --model_type
values and their default, its timestep draws named after a model. sd_scripts.py reads them here, so a model
that script comes to train is a line in the family's spec.py, not in the peer module. No torch."""

from __future__ import annotations

from library.models.registry import arch_specs
from library.models.spec import SdScriptsModels

PEER = "sd-scripts"


def every_model() -> tuple[SdScriptsModels, ...]:
    """The specs' SdScriptsModels, in the registry's order."""
    return tuple(s.peer_models[PEER] for s in arch_specs().values() if PEER in s.peer_models)


def _one(what: str) -> str:
    """The one value every spec that lists sd-scripts gives for `what` (its script, its LoRA module)."""
    values = {getattr(m, what) for m in every_model()}
    if len(values) != 1:
        raise ValueError(f"the specs' peer_models[{PEER!r}] name {len(values)} {what}s ({', '.join(sorted(values))}): "
                         f"library/training/peers/sd_scripts.py translates one script's configs")
    return values.pop()


def script() -> str:
    """Its training script for our models."""
    return _one("script")


def untranslated_scripts() -> dict[str, str]:
    """Its scripts that train models of ours whose configs do not translate (yet) -> the spec's arch."""
    return {name: s.arch for s in arch_specs().values() for name in s.untranslated_scripts.get(PEER, ())}


def lora_module() -> str:
    """Its LoRA module of their blocks."""
    return _one("lora_module")


def model_types() -> dict[str, str]:
    """Its --model_type values -> our model_type."""
    return {name: keys["model_type"] for m in every_model() for name, keys in m.models.items()}


def default_model_type() -> str:
    """Its --model_type default (the one spec's `default`)."""
    defaults = [m.default for m in every_model() if m.default]
    if len(defaults) != 1:
        raise ValueError(f"the specs' peer_models[{PEER!r}] give {len(defaults)} defaults: expected one")
    return defaults[0]


def shift_draws() -> tuple[str, ...]:
    """Its timestep_sampling values named after a model (ours by the same name)."""
    return tuple(d for m in every_model() for d in m.draws)


def ignored_text() -> str:
    """The line of a key of its parser its training of these models does not read."""
    titles = " / ".join(dict.fromkeys(s.title for s in arch_specs().values() if PEER in s.peer_models))
    return f"sd-scripts' {titles} training does not read it either ({script().removesuffix('.py')})"
