"""The one place that picks the network type from `network_module` (sd-scripts' config key).

    networks.lora   our LoRA (networks/lora.py), with DoRA through network_args dora=True
    lycoris.kohya   LoKr, LoHa, (IA)^3, ... through the lycoris-lora package (networks/lycoris_network.py)

Both classes share the trainer's interface (apply, param_groups, trainable_parameters,
state_dict, load_weights, save), so the tasks call build_network and never branch on the type.
"""

from __future__ import annotations

import torch.nn as nn

NETWORK_MODULES = ("networks.lora", "lycoris.kohya")


def check_network_module(name: str) -> None:
    if name not in NETWORK_MODULES:
        raise ValueError(f"network_module '{name}' is not supported (supported: {', '.join(NETWORK_MODULES)})")


def network_class(name: str):
    check_network_module(name)
    if name == "lycoris.kohya":
        from networks.lycoris_network import LycorisNetwork  # imports lycoris only when asked for

        return LycorisNetwork
    from networks.lora import LoRANetwork

    return LoRANetwork


def build_network(network_module: str, model: nn.Module, family: str, rank: int, alpha=None,
                  network_args: dict | None = None, multiplier: float = 1.0) -> nn.Module:
    """A fresh network of the chosen type on `model` (not applied; in eval mode)."""
    return network_class(network_module)(model, family, rank, alpha, multiplier=multiplier, network_args=network_args)


def network_module_of_file(path: str) -> str:
    """The network_module a LoRA / DoRA / LyCORIS file (or PEFT adapter folder) was saved by, from
    its header alone; an unreadable or truncated file is a CheckpointError naming it."""
    from library.io import CheckpointReader
    from networks.lora_files import peft_folder_of
    from networks.lycoris_network import is_lycoris_file

    if peft_folder_of(path) is not None:  # a PEFT adapter folder is a plain LoRA (or DoRA)
        return "networks.lora"
    return "lycoris.kohya" if is_lycoris_file(CheckpointReader(path).keys()) else "networks.lora"


def network_from_file(model: nn.Module, family: str, path: str, multiplier: float = 1.0) -> nn.Module:
    """The network a LoRA / DoRA / LyCORIS file describes, on `model` (not applied)."""
    return network_class(network_module_of_file(path)).from_weights(model, family, path, multiplier=multiplier)
