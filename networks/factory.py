"""The one place that picks the network type from `network_module` (sd-scripts' config key).

    networks.lora   our LoRA (networks/lora.py), with DoRA through network_args dora=True
    lycoris.kohya   LoKr, LoHa, LoCon, ... through the lycoris-lora package (networks/lycoris_network.py)

Both classes fulfil the Network protocol below, so the tasks and tools call build_network /
network_from_file and never branch on the type. `arch` is the transformer architecture the network
targets (a registered family's arch, library/models/registry.py; or llm), not the family name.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn as nn

from library.io import CheckpointError

NETWORK_MODULES = ("networks.lora", "lycoris.kohya")


class Network(Protocol):
    """What build_network and network_from_file return: an nn.Module (to, train, state_dict,
    load_state_dict, named_parameters: the trainable tensors, float32 by default) over a frozen model
    that it patches, and these."""

    def apply(self) -> None:
        """Route the model's target modules through the network (the model's weights stay as they are)."""

    def param_groups(self, lr: float) -> list[dict]:
        """The optimizer's parameter groups, each with "params", "lr" and a "name"."""

    def trainable_parameters(self) -> list[nn.Parameter]:
        """The parameters training updates."""

    def load_weights(self, source, strict: bool = True) -> dict:
        """Load a file (path) or a tensor dict, cast to the network's dtype; counts "loaded", "added",
        "missing". strict: every module of the network must be in it."""

    def describe_loaded(self, counts: dict) -> str:
        """load_weights' counts as one line for the log."""

    def save(self, path: str, dtype: torch.dtype = torch.float32, metadata: dict | None = None) -> None:
        """Write the weights cast to `dtype` as one safetensors file, `metadata` in its header."""

    @classmethod
    def from_weights(cls, model: nn.Module, arch: str, source, multiplier: float = 1.0) -> Network:
        """A network of exactly the modules a file names, on `model` (not applied)."""


def check_network_module(name: str) -> None:
    if name not in NETWORK_MODULES:
        raise ValueError(f"network_module '{name}' is not supported (supported: {', '.join(NETWORK_MODULES)})")


def check_network_args(name: str, arch: str, args: dict, base_precision: str = "bf16",
                       precision_key: str = "base_precision") -> None:
    """network_args named and typed for the network type and arch, without a model (a ValueError
    naming the bad one): the config check runs it before minutes of caching. base_precision: how the
    base is stored, as the config said it with precision_key (LyCORIS' algo=full needs a high-precision one)."""
    check_network_module(name)
    if name == "lycoris.kohya":
        from networks.lycoris_network import check_lycoris_args

        check_lycoris_args(args, arch, base_precision, precision_key)
    else:
        from networks.lora_args import check_lora_args

        check_lora_args(arch, args)


def network_class(name: str):
    check_network_module(name)
    if name == "lycoris.kohya":
        from networks.lycoris_network import LycorisNetwork  # imports lycoris only when asked for

        return LycorisNetwork
    from networks.lora import LoRANetwork

    return LoRANetwork


def build_network(network_module: str, model: nn.Module, arch: str, rank: int, alpha=None,
                  network_args: dict | None = None, multiplier: float = 1.0, modules_from: str | None = None) -> Network:
    """A fresh network of the chosen type on `model` (not applied; in eval mode). modules_from (networks.lora:
    sd-scripts' dim_from_weights): a LoRA file whose modules, at its ranks and alphas and with its weights, are
    the network's, and no others; network_args' dropouts, LoRA+ and dora apply (a DoRA file needs dora=true)."""
    cls = network_class(network_module)
    if modules_from is None:
        return cls(model, arch, rank, alpha, multiplier=multiplier, network_args=network_args)
    built_on = torch.empty(0).device  # meta inside the planner's `with torch.device("meta")`
    with torch.device("cpu"):  # the file is read and its modules made on the CPU (file-sized), then moved
        network = cls(model, arch, rank, alpha, multiplier=multiplier, network_args=network_args, select=False)
        network.load_weights(modules_from, strict=False)
    if built_on.type == "meta":
        network.to(built_on)
    kinds = {m.dora_scale is not None for m in network.lora_modules()}
    if kinds != {network.dora}:
        raise CheckpointError(f"{modules_from}: {'DoRA' if True in kinds else 'plain LoRA'} modules, network_args dora="
                              f"{network.dora}: with dim_from_weights the file's modules are the network's; set dora to match")
    return network


def network_module_of_file(path: str) -> str:
    """The network_module a LoRA / DoRA / LyCORIS file (or PEFT adapter folder) was saved by, from
    its header alone; an unreadable or truncated file is a CheckpointError naming it."""
    from library.io import CheckpointReader
    from networks.lora_files import peft_folder_of
    from networks.lycoris_network import is_lycoris_file

    if peft_folder_of(path) is not None:  # a PEFT adapter folder is a plain LoRA (or DoRA)
        return "networks.lora"
    return "lycoris.kohya" if is_lycoris_file(CheckpointReader(path).keys()) else "networks.lora"


def network_from_file(model: nn.Module, arch: str, path: str, multiplier: float = 1.0) -> Network:
    """The network a LoRA / DoRA / LyCORIS file describes, on `model` (not applied)."""
    return network_class(network_module_of_file(path)).from_weights(model, arch, path, multiplier=multiplier)
