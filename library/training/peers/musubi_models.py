"""musubi-tuner's names for our models, as the family specs give them (each spec's peer_models["musubi-tuner"],
a MusubiModels: library/models/spec.py): its scripts, LoRA modules, version keys, reference and layered models,
its per-model timestep draws. musubi_tuner.py and musubi_dataset.py read them here, so a family musubi-tuner
trains is a line in its spec.py, not in these modules. No torch."""

from __future__ import annotations

from library.models.registry import arch_specs, spec_of
from library.models.spec import MusubiModels, PeerDraw, PeerFixed, PeerMixture

PEER = "musubi-tuner"


def every_model() -> tuple[MusubiModels, ...]:
    """The specs' MusubiModels, in the registry's order."""
    return tuple(s.peer_models[PEER] for s in arch_specs().values() if PEER in s.peer_models)


def models_of(model_type: str) -> MusubiModels:
    """The MusubiModels of the spec `model_type` trains with (one of model_types())."""
    return spec_of(model_type).peer_models[PEER]


def scripts() -> dict[str, str]:
    """Its training script -> our model_type."""
    return {m.script: m.model_type for m in every_model()}


def lora_modules() -> dict[str, str]:
    """Its LoRA module -> our model_type."""
    return {m.lora_module: m.model_type for m in every_model()}


def model_types() -> tuple[str, ...]:
    """Our model_types it trains LoRAs for: each script's, then the ones its version keys pick."""
    found = {}
    for m in every_model():
        found.update(dict.fromkeys((m.model_type, *(k["model_type"] for k in m.versions.values()), *m.references,
                                    *m.layered)))
    return tuple(found)


def family(model_type: str) -> str:
    """The model_type of the script and LoRA module that train `model_type` (a variant's: its family's)."""
    return models_of(model_type).model_type


def version_keys() -> tuple[str, ...]:
    """Its scripts' version arguments (model_version, and a script's own: its MusubiModels.version_key), model_version
    first."""
    return tuple(dict.fromkeys(("model_version", *(m.version_key for m in every_model()))))


def versions(key: str = "model_version") -> dict[str, tuple[MusubiModels, dict[str, str]]]:
    """The values of its version argument `key` (lowercase) -> (the spec's MusubiModels, our keys)."""
    return {v.lower(): (m, keys) for m in every_model() if m.version_key == key for v, keys in m.versions.items()}


def version_switches() -> dict[str, tuple[MusubiModels, str]]:
    """Its version switches (edit_plus ...) -> (MusubiModels, the model_version value each stands for)."""
    return {switch: (m, version) for m in every_model() for switch, version in m.version_switches.items()}


def draws() -> dict[str, tuple[MusubiModels, PeerDraw]]:
    """Its per-model timestep_sampling values -> (the MusubiModels of the model it is made for, the draw)."""
    return {name: (m, draw) for m in every_model() for name, draw in m.draws.items()}


def mixtures() -> dict[str, PeerMixture]:
    """Its hybrid draws named after a model (qinglong_<model>) -> what ours' qinglong draw takes of each."""
    return {name: mixture for m in every_model() for name, mixture in m.mixtures.items()}


def references() -> dict[str, str]:
    """Our model_types that train on its control_directory -> how ours sizes a reference ("target" / "area" / "own")."""
    return {t: sizing for m in every_model() for t, sizing in m.references.items()}


def layered() -> dict[str, str]:
    """Our model_types that train on its multiple_target -> the model's name."""
    return {t: name for m in every_model() for t, name in m.layered.items()}


def dataset_renames() -> dict[str, str]:
    """Its per-model dataset keys -> the name it reads each by (load_user_config's renames)."""
    return {old: new for m in every_model() for old, new in m.dataset_renames.items()}


def options(model_type: str) -> dict[str, PeerFixed]:
    """Its own options for `model_type`'s model that ours reads at one value (the spec's peer_options)."""
    return spec_of(model_type).peer_options.get(PEER, {})


def option_names() -> tuple[str, ...]:
    """Every model's such options (each is read by the model it is for: options)."""
    return tuple(dict.fromkeys(name for s in arch_specs().values() for name in s.peer_options.get(PEER, {})))


def same_args() -> tuple[str, ...]:
    """Its scripts' own arguments that are a family's config keys of the same name and meaning."""
    return tuple(dict.fromkeys(name for m in every_model() for name in m.same_args))


def ignored_args() -> dict[str, str]:
    """Its scripts' own arguments ours reads nothing of -> why."""
    return {name: why for m in every_model() for name, why in m.ignored_args.items()}
