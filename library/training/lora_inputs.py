"""The LoRA files a run reads (network_weights, base_loras), checked from their headers before the
model loads and before caching: a file that is not a LoRA, holds text-encoder modules only, or is
another model's (networks/lora_reader.py check_lora_arch) stops the run in one line naming the key."""

from __future__ import annotations

from library.errors import ConfigError
from library.lora_spec import parse_lora_spec


def check_lora_inputs(args, arch: str) -> None:
    """Raise ConfigError for the first of network_weights / base_loras that `arch`'s model cannot take."""
    from networks.lora_reader import check_lora_arch  # torch: not for the config check the web UI runs

    where = args.config_file or "command line"
    named = [("network_weights", args.network_weights)] if args.network_weights else []
    named += [("base_loras", parse_lora_spec(entry, "base_loras").path) for entry in getattr(args, "base_loras", None) or []]
    for key, path in named:
        try:
            check_lora_arch(path, arch)
        except (ValueError, OSError) as e:  # CheckpointError is a ValueError
            raise ConfigError(f"{where}: key '{key}': {e}") from None
