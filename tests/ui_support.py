"""Shared by the web UI tests: a tiny FLUX job's config on the session's tiny set, and waiting."""

from __future__ import annotations

import os
import time

import toml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_job_settings(tiny_set, steps: int = 12, samples: bool = False, **extra) -> dict:
    """configs/quickstart.toml on the tiny set: fp32 compute, Prodigy, `steps` steps, no disk caches
    (the session's dataset folder is shared), samples every 2 steps if asked (bf16 / fp8 pairs)."""
    settings = {}
    for table in toml.load(os.path.join(ROOT, "configs", "quickstart.toml")).values():
        settings.update(table)
    settings.update({
        "pretrained_model_name_or_path": tiny_set["flux_bfl"], "ae": tiny_set["flux_vae_single"],
        "clip_l": tiny_set["clip_l"], "t5xxl": tiny_set["t5xxl"], "dataset_config": tiny_set["dataset_config"],
        "max_train_steps": steps, "save_every_n_steps": 0, "sample_at_first": False,
        "cache_latents_to_disk": False, "cache_text_encoder_outputs_to_disk": False,
    })
    if samples:
        settings.update({"sample_prompts": tiny_set["sample_prompts"], "sample_every_n_steps": 2})
    else:
        settings.pop("sample_prompts")
    settings.update(extra)
    return settings


def wait_for(condition, timeout: float, what: str, every: float = 0.2):
    """condition()'s first true value, polled; AssertionError naming `what` after `timeout` seconds."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
