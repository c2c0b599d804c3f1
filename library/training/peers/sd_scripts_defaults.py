"""sd-scripts' parser defaults, and how its rules read a value: the config's, else that default (sd_scripts.py and
sd_scripts_training.py read them). No torch."""

from __future__ import annotations

from typing import Any

from library.training.peers import sd_scripts_models as models
from library.training.peers.rules import Translation

# sd-scripts' parser defaults that the rules read where the config leaves a key out (the first script's: a script of
# its own gives those that differ in its spec's SdScriptsModels.defaults).
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
    """The value sd-scripts runs with: the config's, else its script's parser's default."""
    return t.given.get(key, their_default(key, script_of(t)))


def script_of(t: Translation) -> str:
    """The script the translation's model trains with (the first script's before the model is known)."""
    return models.script_of(t.config["model_type"]) if "model_type" in t.config else models.first_script()


def their_default(key: str, script: str) -> Any:
    """`script`'s parser's default of `key` (its --model_type default, or its own model: the specs')."""
    if key == "model_type":
        return models.default_model_type(script)
    return {**THEIR_DEFAULTS, **models.entry(script).defaults}.get(key)


def text_encoder_lr_zero(t: Translation) -> bool:
    """text_encoder_lr (its first: the first text encoder's) 0: its LoRA modules skip a parameter group at lr 0, the
    text encoder LoRA's too."""
    rates = their(t, "text_encoder_lr")
    first = rates[0] if isinstance(rates, list) and rates else rates
    return isinstance(first, (int, float, str)) and str(first).strip() in ("0", "0.0")


def note(t: Translation, text: str) -> None:
    """The last line's text: what it became, where our key alone would not say it."""
    t.lines[-1].text = text
