"""sd-scripts' parser defaults, and how its rules read a value: the config's, else that default (sd_scripts.py and
sd_scripts_training.py read them). No torch."""

from __future__ import annotations

from typing import Any

from library.training.peers import sd_scripts_models as models
from library.training.peers.rules import Translation

# sd-scripts' parser defaults that the rules read where the config leaves a key out.
THEIR_DEFAULTS = {
    "timestep_sampling": "sigma", "weighting_scheme": "uniform",
    "model_prediction_type": "sigma_scaled", "discrete_flow_shift": 3.0, "sigmoid_scale": 1.0, "logit_mean": 0.0,
    "logit_std": 1.0, "mode_scale": 1.29, "guidance_scale": 3.5, "loss_type": "l2", "huber_schedule": "snr",
    "huber_c": 0.1, "huber_scale": 1.0, "network_dim": 4,  # its LoRA module's create_network's, for None
    "network_alpha": 1, "learning_rate": 2e-6, "mixed_precision": "no", "network_train_unet_only": False,
    "lr_scheduler": "constant", "output_name": "last",  # train_util.DEFAULT_LAST_OUTPUT_NAME
    "apply_t5_attn_mask": False, "max_data_loader_n_workers": 8,
}


def their(t: Translation, key: str) -> Any:
    """The value sd-scripts runs with: the config's, else its parser's default."""
    return t.given.get(key, their_default(key))


def their_default(key: str) -> Any:
    """Its parser's default of `key` (its --model_type default: the specs')."""
    return models.default_model_type() if key == "model_type" else THEIR_DEFAULTS.get(key)


def note(t: Translation, text: str) -> None:
    """The last line's text: what it became, where our key alone would not say it."""
    t.lines[-1].text = text
