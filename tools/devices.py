"""The --device flag of the tools that compute (generate, precision_doctor, caption_images and the
SVD tools combine_loras / extract_lora / resize_lora): one check, made before any model or file is
read, so `--device cuda` on a machine without CUDA is one line instead of torch's
"Torch not compiled with CUDA enabled" from deep inside a load. (tools/cli.py stays torch-free.)
"""

from __future__ import annotations

import torch


def device_from_flag(name: str | None, default: str | None = None) -> torch.device:
    """`--device name` -> torch.device; no name means `default`, or cuda when available, else cpu.
    A name torch does not know or a CUDA device this machine lacks is a ValueError naming it."""
    name = name or default
    try:
        device = torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError:
        raise ValueError(f"--device {name!r}: not a device name (expected cpu, cuda or cuda:N)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available on this machine (torch {torch.__version__}); "
                         "use --device cpu")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def device_or_exit(name: str) -> torch.device:
    """device_from_flag for the bench scripts: a device this machine lacks ends the run with its one line
    (exit 2), before any model is built."""
    try:
        return device_from_flag(name)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
