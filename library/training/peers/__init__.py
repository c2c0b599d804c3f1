"""The peers' configs (sd-scripts, musubi-tuner, ai-toolkit) translated into ours: one module per peer
holds its keys' rules (rules.py says what a rule is) and its `translate`; tools/convert_config.py reads
the files and writes ours. config.py asks `peer_key_hint` to name the peer of an unknown key. No torch."""

from __future__ import annotations

import importlib
from types import ModuleType

# name -> module; each has RULES (its training keys) and
# translate(config, source, *, model_type=None, dataset=None, dataset_source=None, script=None) -> Translation
PEERS = {
    "sd-scripts": "library.training.peers.sd_scripts",
    "musubi-tuner": "library.training.peers.musubi_tuner",
    "ai-toolkit": "library.training.peers.ai_toolkit",
}


def peer_module(name: str) -> ModuleType:
    return importlib.import_module(PEERS[name])


# The peers whose training configs are TOML, as ours: an unknown key of a TOML config can be theirs (ai-toolkit's
# are YAML paths, and its process-level words, `device`, `type`, would be named for any file).
TOML_PEERS = ("sd-scripts", "musubi-tuner")


def peers_of(key: str, peers=TOML_PEERS) -> list[str]:
    """The peers that document `key` (a rule for it that is not a plain `same`: those are ours too)."""
    found = []
    for name in peers:
        rules = peer_module(name).RULES
        if key in rules and rules[key].kind != "same":
            found.append(name)
    return found


def peer_lora_modules() -> dict[str, str]:
    """{a peer's LoRA network_module: the peers naming it ("sd-scripts / musubi-tuner")}: sd-scripts' one per script and
    musubi-tuner's, one per model. A config naming one is a peer's even where every key of it is ours too."""
    from library.training.peers import musubi_models, sd_scripts_models

    peers: dict[str, list[str]] = {module: ["sd-scripts"] for module in sd_scripts_models.lora_modules()}
    for module in musubi_models.lora_modules():
        peers.setdefault(module, []).append("musubi-tuner")
    return {module: " / ".join(names) for module, names in peers.items()}


def _peers_having(keys: list[str]) -> list[str]:
    """The peers whose keys these are: one that has them all, else each peer that has one (none for no keys)."""
    if not keys:
        return []
    found = {key: peers_of(key) for key in keys}
    names = [name for name in TOML_PEERS if all(name in peers for peers in found.values())]
    return names or list(dict.fromkeys(name for peers in found.values() for name in peers))


def peer_key_hint(keys: list[str], path: str) -> str:
    """The end of config.py's unknown-key line when the keys are a peer's: which peer, and the command
    that translates the file ('' when none is)."""
    names = _peers_having(keys)
    if not names:
        return ""
    return (f" ({' / '.join(names)} key{'s' if len(keys) > 1 else ''}: `python tools/convert_config.py {path}` "
            f"writes the config as ours and says what each key became)")


def peer_flag_hint(arguments: list[str]) -> str:
    """The end of train_lora.py's unrecognized-arguments line when the flags are a peer's (a musubi-tuner
    command line's --dit, --vae): which peer, and the command that translates that command line ('' when none)."""
    keys = [a[2:].split("=", 1)[0] for a in arguments if a.startswith("--")]
    names = _peers_having([key for key in keys if peers_of(key)])
    if not names:
        return ""
    return (f" ({' / '.join(names)} flags: `python tools/convert_config.py --command \"<the whole command line>\"` "
            f"writes it as our config and says what each flag became)")
