"""sd-scripts' optimizer, its schedule, its timestep draw, prediction and loss keys read into ours (sd_scripts.py
translates the rest of its config; its RULES take these). Its draw, prediction type and loss weighting read each
other (`weighting_scheme` weighs the loss only with model_prediction_type sigma_scaled and shapes the draw only
with timestep_sampling sigma): those rules read the other keys' values (sd_scripts_defaults.their). No torch."""

from __future__ import annotations

from typing import Any

from library.models.registry import SAMPLING_METHODS, mode_scale_unfit
from library.training.config_keys import REX_KEYS, SCHEDULE_KEY_READERS
from library.training.config_schema import SCHEMA
from library.training.peers import sd_scripts_models as models
from library.training.peers.rules import (
    KEPT, RENAMED, Rule, Translation, adafactor_refusal, carry_schedule, custom, ignored, implied, is_off, is_true,
    same, schedule_key, unless_off, unless_schedule_free, unsupported, warmup_steps,
)
from library.training.peers.sd_scripts_defaults import note, script_of, their

IGNORED = models.ignored_text(models.first_script())  # a key of its parser its training of these models does not read


# ----------------------------------------------------------------------------------------------
# The optimizer and its schedule


def optimizer_refusal(t: Translation) -> str:
    """Why ours does not train with sd-scripts' optimizer ("" where it does): rules.adafactor_refusal."""
    return adafactor_refusal(their(t, "optimizer_type"), their(t, "optimizer_args"), "sd-scripts")


def _optimizer_type(t: Translation, key: str, value: Any) -> None:
    """The same names as ours (optim.py reads sd-scripts'); "" is AdamW, or the use_8bit_adam / use_lion_optimizer
    switches' optimizer (train_util.get_optimizer)."""
    name = str(value)
    if name == "":
        name = "AdamW8bit" if is_true(their(t, "use_8bit_adam")) else "Lion" if is_true(their(t, "use_lion_optimizer")) else ""
        if not name:
            t.drop(key, value, "AdamW: ours' default too")
            return
    if optimizer_refusal(t):
        t.refuse(key, value, optimizer_refusal(t))
        return
    t.set("optimizer_type", name, key, value, KEPT if name == value else RENAMED)
    if name != value:
        note(t, f'optimizer_type = "{name}"')


def _optimizer_args(t: Translation, key: str, value: Any) -> None:
    if optimizer_refusal(t) and not is_off(value):
        t.refuse(key, value, f"goes with optimizer_type {their(t, 'optimizer_type')!r}, not carried")
    else:
        t.set(key, value, key, value)


def _optimizer_switch(t: Translation, key: str, value: Any) -> None:
    """use_8bit_adam / use_lion_optimizer: the optimizer where optimizer_type is not given."""
    if not is_true(value):
        t.drop(key, value, "off")
    elif their(t, "optimizer_type"):
        t.drop(key, value, "optimizer_type names the optimizer (sd-scripts ignores this then)")
    else:
        _optimizer_type(t, key, "")
        t.lines[-1].value = value


# ours: diffusers' six, and transformers' three as sd-scripts calls them (not musubi-tuner's rex, nor its keys);
# sd-scripts' scheduler keys: train_util.get_scheduler_fix reads them as ours
SCHEDULERS = tuple(name for name in SCHEMA["lr_scheduler"].choices if name != "rex")
SCHEDULER_KEYS = {key: tuple(name for name in readers if name != "rex")
                  for key, readers in SCHEDULE_KEY_READERS.items() if key not in REX_KEYS}


def _lr_scheduler(t: Translation, key: str, value: Any) -> None:
    carry_schedule(t, key, value, t.given, SCHEDULERS)


def _scheduler_key(t: Translation, key: str, value: Any) -> None:
    schedule_key(t, key, value, t.given, their(t, "lr_scheduler"), SCHEDULER_KEYS[key])


# ----------------------------------------------------------------------------------------------
# The timestep draw, the prediction and the loss


def sampling_of(t: Translation) -> tuple[dict | None, str]:
    """sd-scripts' timestep draw as our keys ({} none), or (None, why ours has no such draw)."""
    method = their(t, "timestep_sampling")
    if method == "sigma":
        return sigma_draw(t)
    refused, carried = models.entry(script_of(t)).draws_refused, models.entry(script_of(t)).draws_carried
    if method in refused:
        return None, f"{method!r}: {refused[method]}"
    if method in carried:  # its own draw, ours by these keys
        return dict(carried[method]), ""
    if method == "logsnr":  # ours by musubi-tuner's name: not one of sd-scripts' (its parser refuses it)
        return None, "'logsnr': not one of sd-scripts' draws (ours reads musubi-tuner's)"
    if method not in SAMPLING_METHODS:
        return None, f"{method!r}: ours draws {', '.join(SAMPLING_METHODS)}"
    keys = {"timestep_sampling": method}  # uniform, sigmoid, shift, a model's shift: the same draws by the same names
    if method != "uniform":
        keys["sigmoid_scale"] = their(t, "sigmoid_scale")
    if method == "shift":
        keys["discrete_flow_shift"] = their(t, "discrete_flow_shift")
    return keys, ""


def sigma_draw(t: Translation) -> tuple[dict | None, str]:
    """sd-scripts' "sigma": u from weighting_scheme's density (uniform; sigmoid(N(logit_mean, logit_std)) for
    logit_normal; the "mode" curve at mode_scale) picks one of the 1000 timesteps of a scheduler shifted by
    discrete_flow_shift (k s / (1 + (k - 1) s)), from sigma 1 down: its sigma is the shift of 1 - u, so its
    logit_mean is ours' sigmoid_mean negated (the mode law is its own mirror). Ours draws the same law,
    continuously."""
    scheme, shift = their(t, "weighting_scheme"), float(their(t, "discrete_flow_shift"))
    if scheme == "logit_normal":
        mean = float(their(t, "logit_mean"))
        keys = {"sigmoid_scale": float(their(t, "logit_std")), **({"sigmoid_mean": -mean} if mean else {})}
        if shift == 1:
            return {"timestep_sampling": "sigmoid", **keys}, ""
        return {"timestep_sampling": "shift", **keys, "discrete_flow_shift": shift}, ""
    if scheme == "mode":
        scale = float(their(t, "mode_scale"))
        if why := mode_scale_unfit(scale):
            return None, f"'sigma' with mode_scale {scale:g}: {why}"
        if shift == 1:
            return {"timestep_sampling": "mode", "mode_scale": scale}, ""
        return {"timestep_sampling": "shift", "shifted_draw": "mode", "mode_scale": scale,
                "discrete_flow_shift": shift}, ""
    if shift == 1:
        return {"timestep_sampling": "uniform"}, ""
    # a uniform draw moved by the shift: ours continuous, its on the 1000-sigma grid (CDF within 1 / 1000)
    return {"timestep_sampling": "shift", "shifted_draw": "uniform", "discrete_flow_shift": shift}, ""


def _timestep_sampling(t: Translation, key: str, value: Any) -> None:
    keys, why = sampling_of(t)
    if keys is None:
        t.refuse(key, value, why)
    else:
        ours = keys["timestep_sampling"]
        t.set(key, ours, key, value, KEPT if ours == value else RENAMED)
        if "shifted_draw" in keys:  # (the shift and scale are their keys' own lines)
            t.config["shifted_draw"] = keys["shifted_draw"]
        if ours != value:
            extra = ", ".join(f'{k} = "{v}"' if isinstance(v, str) else f"{k} = {v:g}" for k, v in keys.items()
                              if k != key)
            note(t, f'timestep_sampling = "{ours}"{" with " + extra if extra else ""} (the same draw, continuous)')
    t.lines[-1].note = models.entry(script_of(t)).timestep_feed  # its script's feed of the draw, where not ours'


def _discrete_flow_shift(t: Translation, key: str, value: Any) -> None:
    keys, _ = sampling_of(t)
    method = their(t, "timestep_sampling")
    if keys is not None and key in keys:
        t.set(key, float(value), key, value)
    elif method == "sigma":
        t.drop(key, value, "1: no shift (said with timestep_sampling)" if keys is not None
               else "goes with timestep_sampling sigma, not carried")
    else:
        t.drop(key, value, "sd-scripts reads it only with timestep_sampling shift / sigma")


def _sigmoid_scale(t: Translation, key: str, value: Any) -> None:
    keys, _ = sampling_of(t)
    draws = ("sigmoid", "shift", *models.shift_draws())
    if keys is not None and their(t, "timestep_sampling") in draws:
        t.set(key, float(value), key, value)
    else:
        t.drop(key, value, f"sd-scripts reads it only with timestep_sampling {' / '.join(draws)}")


def _logit_key(t: Translation, key: str, value: Any) -> None:
    """logit_mean, logit_std, mode_scale: the density of the "sigma" draw (weighting_scheme logit_normal / mode)."""
    keys, _ = sampling_of(t)
    scheme = "mode" if key == "mode_scale" else "logit_normal"
    if their(t, "timestep_sampling") != "sigma" or their(t, "weighting_scheme") != scheme:
        t.drop(key, value, f"sd-scripts reads it only with timestep_sampling sigma and weighting_scheme {scheme}")
    elif keys is None:
        t.drop(key, value, "goes with timestep_sampling sigma, not carried")
    elif key == "logit_std":
        t.set("sigmoid_scale", float(value), key, value, RENAMED)
    elif key == "mode_scale":
        t.set("mode_scale", float(value), key, value)
    elif float(value) == 0:
        t.drop(key, value, "0: ours' sigmoid draw is centred too")
    else:  # its sigma is 1 - u of u = sigmoid(N(mean, std)): ours' sigmoid(N(-mean, std))
        t.set("sigmoid_mean", -float(value), key, value, RENAMED,
              note="negated: its draw indexes its scheduler's timesteps from sigma 1 down")


def predicts_raw_only(t: Translation) -> bool:
    """Its script takes no model_prediction_type: it predicts the raw velocity and weighs that loss by
    weighting_scheme (sigma_sqrt / cosmap), as ours."""
    return "model_prediction_type" in models.entry(script_of(t)).lacks


def _weighting_scheme(t: Translation, key: str, value: Any) -> None:
    if value in ("sigma_sqrt", "cosmap") and predicts_raw_only(t):
        t.set(key, value, key, value)
    elif value in ("sigma_sqrt", "cosmap"):
        if their(t, "model_prediction_type") == "sigma_scaled":
            t.refuse(key, value, "it weighs sd-scripts' sigma_scaled loss (model_prediction_type, not carried); "
                                 "ours' weighting_scheme weighs the raw velocity loss")
        else:
            t.drop(key, value, "sd-scripts weighs the loss only with model_prediction_type sigma_scaled")
    elif value in ("logit_normal", "mode"):
        method = their(t, "timestep_sampling")
        t.drop(key, value, "the density of the 'sigma' draw: timestep_sampling says what it became" if method == "sigma"
               else "shapes only timestep_sampling sigma's draw")
    else:
        t.drop(key, value, "no weighting: ours' none")


def huber_carried(t: Translation) -> bool:
    """sd-scripts' huber loss with a constant threshold: ours, at huber_c x huber_scale."""
    return their(t, "loss_type") == "huber" and their(t, "huber_schedule") == "constant"


def _loss_type(t: Translation, key: str, value: Any) -> None:
    if value == "l2" or huber_carried(t):
        t.set(key, value, key, value)
    elif value in ("huber", "smooth_l1") and their(t, "huber_schedule") != "constant":
        t.refuse(key, value, f"with huber_schedule {their(t, 'huber_schedule')}: a threshold that follows the "
                             f"timestep (its default snr needs an SD noise schedule: this training stops); ours keeps "
                             f"huber_c constant")
    elif value == "smooth_l1":
        t.refuse(key, value, "smooth_l1 is ours' huber divided by huber_c")
    else:
        t.refuse(key, value, "ours: l2, huber")


def _huber_key(t: Translation, key: str, value: Any) -> None:
    """huber_c, huber_scale, huber_schedule: with a constant schedule ours' huber_c is huber_c x huber_scale."""
    loss = their(t, "loss_type")
    if not huber_carried(t):
        t.drop(key, value, f"goes with loss_type {loss}, not carried" if loss in ("huber", "smooth_l1")
               else "read only by loss_type huber / smooth_l1")
    elif key == "huber_schedule":
        t.drop(key, value, "constant: ours' huber_c is constant")
    else:
        c = float(their(t, "huber_c")) * float(their(t, "huber_scale"))
        t.set("huber_c", c, key, value, KEPT if key == "huber_c" and c == float(value) else RENAMED)
        note(t, f"huber_c = {c:g} (huber_c x huber_scale)")


def _ip_noise_gamma_random_strength(t: Translation, key: str, value: Any) -> None:
    if is_true(value) and not is_off(their(t, "ip_noise_gamma")):
        t.set(key, True, key, value, note="a strength per sample (sd-scripts draws one per batch: the same at "
                                          "batch 1)")
    else:
        t.drop(key, value, "off" if not is_true(value) else "no ip_noise_gamma")


# ----------------------------------------------------------------------------------------------
# The rules (sd_scripts.RULES takes them)


RULES: dict[str, Rule] = {
    # the optimizer and its schedule
    "optimizer_type": custom(_optimizer_type),
    "use_8bit_adam": custom(_optimizer_switch),
    "use_lion_optimizer": custom(_optimizer_switch),
    "optimizer_args": custom(_optimizer_args),
    "max_grad_norm": same(),
    "lr_scheduler": unless_schedule_free(custom(_lr_scheduler)),
    "lr_warmup_steps": unless_schedule_free(custom(lambda t, key, value: warmup_steps(t, key, value, t.given))),
    **{key: unless_schedule_free(custom(_scheduler_key)) for key in SCHEDULER_KEYS},
    "lr_scheduler_type": unless_schedule_free(unsupported("a scheduler class of its own: ours runs the lr_scheduler "
                                                          "schedules")),
    "lr_scheduler_args": unless_schedule_free(unsupported("arguments of a scheduler class (lr_scheduler_type): ours has none")),
    "fused_backward_pass": ignored("sd-scripts' LoRA training does not read it (its full fine-tuning does)"),
    "gradient_accumulation_steps": same(),
    "max_train_steps": same(),
    "max_train_epochs": unless_off("0: no epoch count (sd-scripts computes 0 steps from it; ours refuses 0): "
                                   "max_train_steps counts"),
    # the timestep draw, the prediction and the loss
    "timestep_sampling": custom(_timestep_sampling),
    "discrete_flow_shift": custom(_discrete_flow_shift),
    "sigmoid_scale": custom(_sigmoid_scale),
    **{key: custom(_logit_key) for key in ("logit_mean", "logit_std", "mode_scale")},
    "weighting_scheme": custom(_weighting_scheme),
    "model_prediction_type": implied(lambda v: v == "raw", "ours trains the raw velocity prediction (sd-scripts' docs "
                                                           "recommend raw)"),
    "loss_type": custom(_loss_type),
    **{key: custom(_huber_key) for key in ("huber_c", "huber_scale", "huber_schedule")},
    "ip_noise_gamma": unless_off("off (0)"),
    "ip_noise_gamma_random_strength": custom(_ip_noise_gamma_random_strength),
    **{key: ignored(IGNORED) for key in (
        "noise_offset", "noise_offset_random_strength", "multires_noise_iterations", "multires_noise_discount",
        "adaptive_noise_scale", "zero_terminal_snr", "min_timestep", "max_timestep", "min_snr_gamma",
        "scale_v_pred_loss_like_noise_pred", "v_pred_like_loss", "debiased_estimation_loss")},
    "weighted_captions": ignored("sd-scripts' text encoding for these models takes no caption weights (it stops); ours encodes "
                                 "captions as written"),
    "prior_loss_weight": same(),
    "masked_loss": ignored("ours: a subset's mask_dir (sd-scripts' conditioning_data_dir) or alpha_mask masks the loss"),
    "conditioning_data_dir": ignored(IGNORED + " (a dataset TOML's subsets do: mask_dir)"),
}
