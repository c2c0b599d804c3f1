"""sd-scripts' timestep draw and loss of sd3_train_network.py read into ours (the spec's SD_SCRIPTS.draw, which
library/training/peers/sd_scripts_script.py calls): its code (48d368f), and the keys of ours that train the same.

Its script takes no timestep_sampling. sd3_train_utils.get_noisy_model_input_and_timesteps draws
  u ~ the density of `weighting_scheme` (compute_density_for_timestep_sampling: sigmoid(N(logit_mean, logit_std)) for
      logit_normal, 1 - v - mode_scale (cos^2(pi v / 2) - 1 + v) for mode, U[0, 1) for the rest),
  u' = k u / (1 + (k - 1) u), k = training_shift (default 1: none),
  t = floor(u' (max_timestep - min_timestep) + min_timestep) (default 0 and 1000: a whole timestep), sigma = t / 1000,
and noises with that sigma (so the network is fed the same whole-number t). Its prediction is x0 (model_pred x (-sigma)
+ noisy input) against the latents: sigma (v_pred - v) for velocities v, a loss of sigma^2 |v_pred - v|^2, times
compute_loss_weighting_for_sd3(weighting_scheme): sigma^-2 for sigma_sqrt, 2 / (pi (1 - 2 sigma + 2 sigma^2)) for
cosmap, 1 for the rest. So `weighting_scheme` says both the draw and the loss weight, and only sigma_sqrt trains
ours' velocity loss (ours: library/models/flow_matching.py, the velocity error weighted by none / sigma_sqrt /
cosmap). Ours draws sigma continuously in (0, 1] (never 0: sd-scripts' sigma 0 is a loss of exactly 0, and with
sigma_sqrt 0 x 1/0, a NaN, in about 0.1 % / k of its samples).
"""

from __future__ import annotations

from library.models.registry import mode_scale_unfit

KEPT, RENAMED, DROPPED, NOT_CARRIED = "kept", "renamed", "dropped", "not carried"  # library/training/peers/rules.py
ARGS = ("weighting_scheme", "logit_mean", "logit_std", "mode_scale", "training_shift", "min_timestep", "max_timestep")
UNIFORM_DENSITY = ("uniform", "none", "sigma_sqrt", "cosmap")  # its density for these: U[0, 1)
FLOOR = "sd-scripts floors 1000 sigma to a whole timestep (0 included); ours draws sigma continuously"


def _draw(values: dict) -> tuple[dict | None, str]:
    """Ours' draw keys of the same law as its draw ({timestep_sampling, sigmoid_scale, sigmoid_mean, mode_scale,
    discrete_flow_shift, shifted_draw}), or (None, why ours has none). Its sigma is u itself (shifted): its logit_mean
    is ours' sigmoid_mean as it is."""
    scheme, k = values["weighting_scheme"], float(values["training_shift"])
    shifted = {} if k == 1 else {"discrete_flow_shift": k}
    if scheme in UNIFORM_DENSITY:
        if k == 1:
            return {"timestep_sampling": "uniform"}, ""
        return {"timestep_sampling": "shift", "shifted_draw": "uniform", **shifted}, ""
    if scheme == "logit_normal":
        mean, std = float(values["logit_mean"]), float(values["logit_std"])
        keys = {"sigmoid_scale": std, **({"sigmoid_mean": mean} if mean else {})}
        return {"timestep_sampling": "sigmoid" if k == 1 else "shift", **keys, **shifted}, ""
    scale = float(values["mode_scale"])
    if why := mode_scale_unfit(scale):
        return None, f"its `mode` density at mode_scale {scale:g}: {why}"
    if k == 1:
        return {"timestep_sampling": "mode", "mode_scale": scale}, ""
    return {"timestep_sampling": "shift", "shifted_draw": "mode", "mode_scale": scale, **shifted}, ""


def _loss(scheme: str) -> tuple[str, str, dict]:
    """Its loss weight as ours' weighting_scheme: sigma_sqrt's sigma^-2 cancels its x0 loss's sigma^2."""
    if scheme == "sigma_sqrt":
        return RENAMED, ("weighting_scheme = \"none\": its x0 loss, sigma^2 x the velocity loss, times sigma^-2 is "
                         "ours' velocity loss"), {"weighting_scheme": "none"}
    if scheme != "cosmap":
        return RENAMED, ("weighting_scheme = \"sigma_sq\": its x0 loss (weight 1) is sigma^2 x the velocity loss"), \
            {"weighting_scheme": "sigma_sq"}
    return NOT_CARRIED, ("sd-scripts' loss is the x0 error, sigma^2 x the velocity error, times 2 / (pi (1 - 2 sigma "
                         "+ 2 sigma^2)) (cosmap); ours weighs the velocity error by one of none / sigma_sqrt / cosmap "
                         "/ sigma_sq, not by their product"), {}


def sd3_draw(values: dict) -> dict[str, tuple[str, str, dict]]:
    """{the report's line key: (verdict, text, {our key: value})} for its draw arguments (ARGS) at `values`."""
    scheme = values["weighting_scheme"]
    if scheme not in (*UNIFORM_DENSITY, "logit_normal", "mode"):
        choices = ", ".join((*UNIFORM_DENSITY, "logit_normal", "mode"))
        raise ValueError(f"weighting_scheme {scheme!r}: expected one of {choices} (sd-scripts' choices)")
    keys, why = _draw(values)
    k = float(values["training_shift"])
    if keys is None:
        lines = {"weighting_scheme (draw)": (NOT_CARRIED, why, {})}
    else:
        extra = ", ".join(f'{name} = "{value}"' if isinstance(value, str) else f"{name} = {value:g}"
                          for name, value in keys.items() if name != "timestep_sampling")
        lines = {"weighting_scheme (draw)": (RENAMED, f"timestep_sampling = \"{keys['timestep_sampling']}\""
                                             + (f" with {extra}" if extra else "") + f" (the same law; {FLOOR})", keys)}
    lines["weighting_scheme (loss)"] = _loss(scheme)
    carried = "goes with its draw (weighting_scheme), not carried: said there"
    if keys is None:
        lines["training_shift"] = (DROPPED, "1: no shift" if k == 1 else carried, {})
    else:
        lines["training_shift"] = ((RENAMED, "discrete_flow_shift", {"discrete_flow_shift": k}) if k != 1
                                   else (DROPPED, "1: no shift", {}))
    for name, density, ours in (("logit_mean", "logit_normal", "sigmoid_mean"),
                                ("logit_std", "logit_normal", "sigmoid_scale"), ("mode_scale", "mode", "mode_scale")):
        if scheme != density:
            lines[name] = (DROPPED, f"read only with weighting_scheme {density}", {})
        elif keys is None:
            lines[name] = (DROPPED, carried, {})
        elif name == "logit_mean" and float(values[name]) == 0:
            lines[name] = (DROPPED, "0: ours' sigmoid draw is centred too", {})
        else:
            lines[name] = (KEPT if name == ours else RENAMED, ours, {ours: float(values[name])})
    bounds = {"min_timestep": 0, "max_timestep": 1000}
    for name, whole in bounds.items():
        given = values[name]
        whole_range = given is None or int(given) == whole
        # its t = floor(u' (max - min) + min): the law scaled into the range, ours' min_timestep / max_timestep
        # (preserve_distribution_shape off), floored to a whole timestep
        lines[name] = ((DROPPED, f"{whole}: its draw's whole range, as ours", {}) if whole_range else
                       (KEPT, name, {name: int(given)}))
    return lines
