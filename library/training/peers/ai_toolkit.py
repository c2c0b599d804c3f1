"""Placeholder: this peer's rules are being written (tools/convert_config.py)."""

from __future__ import annotations

from library.training.peers.rules import Rule, Translation

RULES: dict[str, Rule] = {}


def translate(config: dict, source: str, *, model_type=None, dataset=None, dataset_source=None, script=None) -> Translation:
    raise ValueError("this peer's translation is not written yet")
