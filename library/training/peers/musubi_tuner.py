"""musubi-tuner's LoRA training configs for its image models, read into ours (tools/convert_config.py).

musubi-tuner names the model by its script (<model>_train_network.py); a config file says it only through its
LoRA module (networks.lora_<model>) and version keys (model_version, a script's own version argument, and switches
such as edit / edit_plus). The model comes from whichever of these, and --model_type, say it (they must agree);
from none of them it is one ValueError asking for --model_type. RULES holds every argument the image scripts
accept: the common parser (training/parser_common.py), hv_train_network.py's (a HunyuanVideo config copied over),
and the image scripts' own with their *_utils version arguments (a model's own options that ours reads at one
value: its spec's peer_options). Where musubi-tuner's default differs from ours and changes the training
(network_alpha 1, the sigma draw, fp8_scaled off ...), the translation writes theirs (settle_defaults). Its
dataset TOML: musubi_dataset.py. Which script, module, version and draw is which model's the family specs say
(peer_models["musubi-tuner"], read through musubi_models.py): this module names no model."""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import partial
from typing import Any

from library.models.registry import MODE_SCALE, arch_specs, mode_scale_unfit, spec_of
from library.models.spec import MusubiModels
from library.training.config_keys import REX_KEYS, SCHEDULE_KEY_READERS
from library.training.config_schema import SCHEMA
from library.training.peers import musubi_models as models
from library.training.peers.musubi_dataset import translate_dataset
from library.training.peers.rules import (
    KEPT,
    RENAMED,
    Line,
    Rule,
    Translation,
    adafactor_refusal,
    apply_rules,
    carry_schedule,
    copy_prompts_without,
    fixed_option,
    flatten_tables,
    ignored,
    implied,
    is_off,
    is_true,
    renamed,
    same,
    sample_when,
    schedule_key,
    unless_schedule_free,
    unsupported,
    warmup_steps,
)

PEER = "musubi-tuner"

# -- the models: which script, LoRA module and version trains which of ours (the specs': musubi_models.py)

LYCORIS_MODULES = {"networks.loha": "loha", "networks.lokr": "lokr"}  # musubi-tuner's own, after LyCORIS
GENERIC_DRAWS = ("uniform", "sigmoid", "shift")  # its draws that are ours by the same name on every model
SCRIPTS = models.scripts()  # tools/convert_config.py tells the peer of a --command by them
MODEL_TYPES = models.model_types()


def sigmoid_draws() -> tuple[str, ...]:
    """Its draws that read sigmoid_scale."""
    return ("sigmoid", "shift", *(name for name, (_, draw) in models.draws().items() if draw.reads_sigmoid_scale))


def choose_model(flat: dict, source: str, script: str | None, model_type: str | None) -> tuple[str, str]:
    """(our model_type, what said it) from the script, network_module, the version keys and --model_type; two that
    disagree, or none at all, are one ValueError. A script or module says the family; the version keys or
    --model_type the variant (none: the script's own model_type)."""
    said: list[tuple[str, str]] = []  # (who, model_type)
    scripts, lora_modules = models.scripts(), models.lora_modules()
    if script is not None:
        name = os.path.basename(script)
        if name not in scripts:
            raise ValueError(f"{name}: not one of musubi-tuner's image LoRA scripts, which are what this translates "
                             f"({', '.join(scripts)})")
        said.append((name, scripts[name]))
    module = flat.get("network_module")
    if isinstance(module, str) and module in lora_modules:
        said.append((f"network_module {module}", lora_modules[module]))
    version = version_said(flat, source)
    if version:
        said.append(version[:2])
    model_types = models.model_types()
    if model_type is not None:
        if model_type not in model_types:
            raise ValueError(f"--model_type {model_type}: not a model musubi-tuner trains LoRAs for (expected one of "
                             f"{', '.join(model_types)})")
        said.append(("--model_type", model_type))
    if not said:
        raise ValueError(f"{source}: musubi-tuner's config does not say the model (its training script does): add "
                         f"its network_module to it ({', '.join(lora_modules)}), or give --model_type (one of "
                         f"{', '.join(model_types)})")  # the web UI's Load has no --model_type: the key is its way
    for who, told in said[1:]:
        if models.family(told) != models.family(said[0][1]):
            raise ValueError(f"{source}: {said[0][0]} trains {said[0][1]}, {who} {told}: they disagree")
    exact = [(who, told) for who, told in said if who == "--model_type" or (version and who == version[0])]
    if len({told for _, told in exact}) > 1:
        raise ValueError(f"{source}: {exact[0][0]} says {exact[0][1]}, {exact[1][0]} {exact[1][1]}: they disagree")
    return (exact or said)[0][1], " / ".join(who for who, _ in said)


def version_said(flat: dict, source: str) -> tuple[str, str, str | None] | None:
    """(the key as written, our model_type, our model_version) of the version keys, in musubi-tuner's order
    (model_version, a script's own version argument, then the switches as their spec lists them); None where none
    is given."""
    for key in models.version_keys():
        value, versions = flat.get(key), models.versions(key)
        if not isinstance(value, str):
            continue
        if value.lower() in versions:
            keys = versions[value.lower()][1]
            return f"{key} {value}", keys["model_type"], keys.get("model_version")
        listed = "; ".join(f"{spec.title}: {', '.join(m.versions)}" for spec in arch_specs().values()
                           if isinstance(m := spec.peer_models.get(models.PEER), MusubiModels)
                           and m.versions and m.version_key == key)
        raise ValueError(f"{source}: {key} {value!r}: not one of musubi-tuner's ({listed})")
    for key, (m, version) in models.version_switches().items():
        if is_true(flat.get(key)):
            keys = m.versions[version]
            return f"{key} = true", keys["model_type"], keys.get("model_version")
    return None


# -- one translation's context: the whole config, for the keys whose meaning another key decides


@dataclass
class Run:
    flat: dict[str, Any]  # musubi-tuner's keys as read
    source: str
    model_type: str
    draw: tuple[str | None, str] = (None, "")  # our timestep_sampling (None: not carried) and the note / why
    dataset_read: bool = False  # its dataset TOML was translated (t.dataset None then: none of it carried)

    def peer_draw(self) -> str:
        """musubi-tuner's timestep_sampling, given or its script's default."""
        return self.flat.get("timestep_sampling") or models.models_of(self.model_type).default_draw


def joint(handler) -> Rule:
    """A key whose meaning another key decides: handler(t, key, value, run), bound to the Run by translate."""
    return Rule("custom", handle=handler)


def timestep_draw(flat: dict, model_type: str, peer: str) -> tuple[str | None, str]:
    """(our timestep_sampling, a note) for musubi-tuner's draw on this model; (None, why) where we have none."""
    if peer == "sigma":  # FlowMatchDiscreteScheduler's 1000 unshifted sigmas, indexed by weighting_scheme's density
        scheme = flat.get("weighting_scheme", "none")  # (its sigma: 1 - u, the timesteps run from sigma 1 down)
        if scheme == "mode":
            scale = float(flat.get("mode_scale", MODE_SCALE))
            if why := mode_scale_unfit(scale):
                return None, f"its sigma draw by weighting_scheme mode at mode_scale {scale:g}: {why}"
            return "mode", f"its sigma draw by weighting_scheme mode: the mode law at mode_scale {scale:g}, unshifted"
        if scheme == "logit_normal":
            return "sigmoid", ("its sigma draw by weighting_scheme logit_normal: sigmoid(logit_std * randn - "
                               "logit_mean)")
        return "uniform", "its sigma draw: uniform over 1000 steps, unshifted (discrete_flow_shift unread)"
    if peer == "logsnr":  # logit_mean / logit_std: the log-SNR's (_logit)
        return "logsnr", ""
    if peer in models.mixtures():  # ours' qinglong, its mid draw this one's as carried on the model
        mixture = models.mixtures()[peer]
        mid, why = timestep_draw(flat, model_type, mixture.mid)
        if mid is None:
            return None, f"its mid draw, {mixture.mid}: {why}"
        return "qinglong", (f"its mid draw {mid} (qinglong_mid), logsnr share {mixture.logsnr_share:g}, detail share "
                            f"{mixture.detail_share:g}")
    if peer in models.draws():  # one model's resolution shift: its own, or another's on these latents
        owner, draw = models.draws()[peer]
        if owner is models.models_of(model_type):
            return draw.ours, draw.note
        if draw.elsewhere:
            return None, f"{draw.elsewhere}: ours has no such draw"
        if models.models_of(model_type).other_draws:
            return None, models.models_of(model_type).other_draws
        if models.models_of(model_type).token_grid:  # the draw counts (h // 2) * (w // 2) tokens of 2x2 patches
            return None, f"on this model its {peer} counts a quarter of the tokens: ours has no such draw"
        return peer, ""
    if peer in GENERIC_DRAWS:
        return peer, ""
    return None, "not one of musubi-tuner's timestep_sampling values"


def _timestep_sampling(t: Translation, key: str, value: Any, run: Run) -> None:
    ours, text = run.draw
    if ours is None:
        t.refuse(key, value, text)
        return
    t.set("timestep_sampling", ours, key, value, KEPT if ours == value else RENAMED, note=text)
    if ours == "qinglong":
        mixture = models.mixtures()[value]
        t.config.update(qinglong_mid=timestep_draw(run.flat, run.model_type, mixture.mid)[0],
                        qinglong_logsnr_share=mixture.logsnr_share, qinglong_detail_share=mixture.detail_share)


def _discrete_flow_shift(t: Translation, key: str, value: Any, run: Run) -> None:
    if run.draw[0] == "shift":
        t.set(key, float(value), key, value)
    else:
        t.drop(key, value, f"read by the shift draw only; timestep_sampling is {run.peer_draw()}")


def _sigmoid_scale(t: Translation, key: str, value: Any, run: Run) -> None:
    if run.peer_draw() in sigmoid_draws() and run.draw[0] is not None:
        t.set(key, float(value), key, value)
    else:
        t.drop(key, value, f"unread by musubi-tuner's {run.peer_draw()} draw")


def _weighting_scheme(t: Translation, key: str, value: Any, run: Run) -> None:
    m = models.models_of(run.model_type)
    if m.weighting:  # the script takes these only, each ours' by another name where its loss is another's
        if value in m.weighting:
            ours = m.weighting[value]
            t.set(key, ours, key, value, KEPT if ours == value else RENAMED, f"{key} = {ours!r}", m.weighting_note)
        else:
            t.refuse(key, value, f"{m.script} refuses it (it takes {', '.join(m.weighting)})")
    elif value in ("none", "sigma_sqrt", "cosmap"):  # by the drawn sigma there too (k / 1000 of the unshifted schedule)
        t.set(key, value, key, value)
    elif run.peer_draw() == "sigma":
        t.drop(key, value, "its density is the sigma draw's: timestep_sampling's line says what that became")
    else:
        t.drop(key, value, f"unread by musubi-tuner's {run.peer_draw()} draw (no loss weighting)")


def _timestep_buckets(t: Translation, key: str, value: Any, run: Run) -> None:
    """Stratified draws, where musubi-tuner stratifies: not its sigma draw (weighting_scheme's density ignores
    them), not 0 / 1 (off); ours refuses them with preserve_distribution_shape's cut range."""
    ranged = run.flat.get("min_timestep") is not None or run.flat.get("max_timestep") is not None
    if value is None or value < 2:
        t.drop(key, value, "off (below 2): each sample's own draw, ours' default")
    elif run.peer_draw() == "sigma":
        t.drop(key, value, "unread by musubi-tuner's sigma draw (weighting_scheme's density)")
    elif ranged and is_true(run.flat.get("preserve_distribution_shape")):
        t.refuse(key, value, "with preserve_distribution_shape's cut range (musubi-tuner redraws stratified): ours "
                             "stratifies the whole law only")
    else:
        t.set(key, value, key, value)


def reads_logsnr(run: Run) -> bool:
    """Whether the carried draw reads logit_mean / logit_std as its log-SNR's: logsnr, or a hybrid one with a
    logsnr share."""
    draw = run.peer_draw()
    return run.draw[0] is not None and (draw == "logsnr" or draw in models.mixtures() and
                                        models.mixtures()[draw].logsnr_share > 0)


def _logit(t: Translation, key: str, value: Any, run: Run) -> None:
    """logit_mean / logit_std: the logit_normal sigma draw's (logit_std is our sigmoid_scale there) and logsnr's."""
    draw = run.peer_draw()
    if draw == "sigma" and run.flat.get("weighting_scheme") == "logit_normal" and run.draw[0] == "sigmoid":
        if key == "logit_std":
            t.set("sigmoid_scale", float(value), key, value, RENAMED, note="the logit_normal sigma draw's scale")
        elif float(value) == 0:
            t.drop(key, value, "0: the sigmoid draw is centred too")
        else:  # its sigma 1 - sigmoid(N(mean, std)) is sigmoid(N(-mean, std))
            t.set("sigmoid_mean", -float(value), key, value, RENAMED,
                  note="negated: its draw indexes its scheduler's timesteps from sigma 1 down")
    elif reads_logsnr(run):
        t.set(key.replace("logit", "logsnr"), float(value), key, value, RENAMED, note="the log-SNR's")
    elif draw in models.mixtures() and run.draw[0]:
        t.drop(key, value, f"its {draw} draws no logsnr sigmas (share 0)")
    elif draw == "sigma" or draw in models.mixtures():  # (logsnr is always carried: reads_logsnr)
        t.drop(key, value, "read by the draw timestep_sampling's line names, which is not carried")
    else:
        t.drop(key, value, f"unread by musubi-tuner's {draw} draw")


def _timestep_bound(t: Translation, key: str, value: Any, run: Run) -> None:
    """min_timestep / max_timestep: the sigmas trained, in thousandths (ours' reading), but its sigma draw indexes its
    scheduler's timesteps, from sigma 1 down, at u (max - min) + min: it trains sigmas from 1 - max / 1000 to
    1 - min / 1000, the range mirrored (ours' then bounds the other way round)."""
    if run.peer_draw() != "sigma" or value is None:
        t.set(key, value, key, value)
        return
    ours = "max_timestep" if key == "min_timestep" else "min_timestep"
    t.set(ours, 1000 - int(value), key, value, RENAMED,
          note=f"its sigma draw trains sigma up to {1 - int(value) / 1000:g}" if key == "min_timestep" else
          f"its sigma draw trains sigma from {1 - int(value) / 1000:g}")
    t.lines[-1].note += " (it indexes its scheduler's timesteps from sigma 1 down: the range mirrored)"


def _preserve_shape(t: Translation, key: str, value: Any, run: Run) -> None:
    if run.peer_draw() == "sigma" and is_true(value):
        t.drop(key, value, "unread by its sigma draw, which scales its density into the range whatever this says")
    else:
        t.set(key, value, key, value)


def _mode_scale(t: Translation, key: str, value: Any, run: Run) -> None:
    """weighting_scheme mode's scale: read by its sigma draw with that scheme only (carried as ours' mode draw)."""
    if run.peer_draw() == "sigma" and run.flat.get("weighting_scheme") == "mode" and run.draw[0] == "mode":
        t.set("mode_scale", float(value), key, value)
    elif run.peer_draw() == "sigma" and run.flat.get("weighting_scheme") == "mode":
        t.drop(key, value, "read by the draw timestep_sampling's line names, which is not carried")
    else:
        t.drop(key, value, "read only by its sigma draw with weighting_scheme mode")


def _blocks_to_swap(t: Translation, key: str, value: Any, run: Run) -> None:
    scale = models.models_of(run.model_type).swap_scale  # 2: sd-scripts' count, N // 2 double, 2 (N - N // 2) single
    if scale != 1 and value:
        t.set(key, scale * int(value), key, value, RENAMED,
              note=f"their {value} swaps ~{scale * int(value)} single blocks' bytes; ours counts each block "
                   f"(tools/plan_memory.py says what fits)")
    else:
        t.set(key, int(value or 0), key, value)


def _text_encoder_file(t: Translation, key: str, value: Any, run: Run) -> None:
    """text_encoder1 / text_encoder2: the model's text encoder files where its spec names them; HunyuanVideo's
    elsewhere."""
    ours = models.models_of(run.model_type).text_encoder_files.get(key)
    if ours:
        t.set(ours, value, key, value, RENAMED)
    else:
        t.refuse(key, value, "HunyuanVideo's text encoder: not this model's")


def _fp8_text_encoder(value: Any) -> str:
    return "fp8" if is_true(value) else "bf16"


def _version_key(t: Translation, key: str, value: Any, run: Run) -> None:
    """model_version and the version switches: which model (model_type's line) and ours where it has one."""
    said = version_said(run.flat, run.source)
    if key != "model_version" and is_off(value):
        t.drop(key, value, "off")
    elif said is None or not said[0].startswith(key + " "):
        t.drop(key, value, f"{said[0].split()[0]} decides the version" if said else "off")
    elif said[2] is not None and run.model_type == said[1]:
        t.set("model_version", said[2], key, value, RENAMED)
    elif said[2] is None and models.models_of(said[1]).versions_unread:
        t.drop(key, value, models.models_of(said[1]).versions_unread)
    else:
        t.drop(key, value, f"says model_type {said[1]}")


def release_of(run: Run) -> str | None:
    """Our model_version of the release it trains: its version key's, else its script's default version's (None:
    ours decides from the model's files)."""
    said, m = version_said(run.flat, run.source), models.models_of(run.model_type)
    if said is not None:
        return said[2]
    return m.versions[m.default_version].get("model_version") if m.default_version else None


def precision(t: Translation, key: str, value: Any, model_type: str) -> None:
    """mixed_precision: its LoRA's dtype and autocast; its script keeps the DiT in bf16 whatever this says (but
    float32_dit_without_mixed_precision's), so its "no" is a float32 LoRA over the bf16 DiT: ours' bf16 (ours' "no"
    computes the whole base in float32, twice its memory). Unset (key "... (unset)"): accelerate's, "no" unless
    `accelerate launch --mixed_precision` says otherwise."""
    unset = key.endswith(" (unset)")
    if value in ("bf16", "fp16"):
        t.set("mixed_precision", value, key, value, KEPT)
    elif value != "no":
        raise ValueError("expected no, fp16 or bf16")
    elif models.models_of(model_type).float32_dit_without_mixed_precision:
        t.set("mixed_precision", "no", key, value, KEPT, note="its DiT in float32 as ours'" + (
            " (unset, its script reads it before accelerate: an `accelerate launch --mixed_precision bf16` runs that "
            "float32 DiT under bf16 autocast)" if unset else ""))
    else:
        t.set("mixed_precision", "bf16", key, value, RENAMED, "mixed_precision = \"bf16\"", note=(
            "its DiT stays in bf16 there, only its LoRA runs in float32; ours' \"no\" would compute the whole base "
            "in float32 (twice its memory)" + (" (unset: accelerate's, \"no\" unless `accelerate launch "
                                              "--mixed_precision` says bf16: then as here)" if unset else "")))


def _option(t: Translation, key: str, value: Any, run: Run) -> None:
    """A model's own option ours reads at one value (its spec's peer_options): dropped at it, else not carried."""
    option = models.options(run.model_type).get(key)
    if option is None:
        t.refuse(key, value, f"not an argument of {models.models_of(run.model_type).script}")
        return
    fixed_option(t, key, value, option, release_of(run))


def _network_module(t: Translation, key: str, value: Any, run: Run) -> None:
    name = module_of(run)
    if name in models.lora_modules():
        t.set(key, "networks.lora", key, value, RENAMED, note="ours selects the model's targets itself")
    elif name in LYCORIS_MODULES:
        t.set(key, "lycoris.kohya", key, value, RENAMED,
              note=f"LyCORIS' {LYCORIS_MODULES[name]} (network_args algo=), which musubi-tuner's follows")
    elif name == "networks.lora":
        t.refuse(key, value, "HunyuanVideo's LoRA module (its targets): ours trains this model's own")
    else:
        t.refuse(key, value, "not a network module musubi-tuner's image scripts load")


# network_args of musubi-tuner's networks/lora.py (and loha.py / lokr.py) ours takes with the same meaning
NETWORK_ARGS_SAME = ("exclude_patterns", "include_patterns", "rank_dropout", "module_dropout", "loraplus_lr_ratio")
LYCORIS_ARGS = ("factor",)


def _network_args(t: Translation, key: str, value: Any, run: Run) -> None:
    """Each `name=value` by its name; then what ours needs to train the modules musubi-tuner's module does."""
    items = value if isinstance(value, list) else [value] if isinstance(value, str) else []
    lycoris = module_of(run) in LYCORIS_MODULES
    kept = []
    if not items and key in run.flat:
        t.drop(key, value, "empty")
    for item in items:
        name = str(item).split("=", 1)[0].strip()
        label = f"{key} {name}"
        if name in NETWORK_ARGS_SAME or (lycoris and name in LYCORIS_ARGS):
            kept.append(str(item))
            t.lines.append(Line(label, item, KEPT))
        elif name == "verbose":
            t.drop(label, item, "a log of the modules: ours lists them in the LoRA's header")
        elif name in ("conv_dim", "conv_alpha"):
            t.drop(label, item, "no convolution among these models' LoRA targets")
        else:
            t.refuse(label, item, "not an argument of musubi-tuner's LoRA module")
    extras = network_extras(run, kept)
    for item, note in extras:
        t.lines.append(Line(f"{key} (added)", item, RENAMED, "network_args", note))
    if kept or extras:
        t.config["network_args"] = kept + [item for item, _ in extras]


def network_extras(run: Run, kept: list[str]) -> list[tuple[str, str]]:
    """(network_args item, why) that make our network train the modules musubi-tuner's module trains (the
    spec's lora_args)."""
    module = module_of(run)
    extras = [(f"algo={LYCORIS_MODULES[module]}", "its module's algorithm")] if module in LYCORIS_MODULES else []
    patterns = any(item.startswith("exclude_patterns") for item in kept)
    for arg in models.models_of(run.model_type).lora_args:
        if (arg.unless == "exclude_patterns" and patterns) or (arg.unless == "lora" and module in LYCORIS_MODULES):
            continue
        item = arg.item
        if item == "in_dims=network_dim":  # every embedder at the rank
            rank = int(run.flat.get("network_dim") or 4)
            count = len(spec_of(run.model_type).lora.in_dim_types)
            item = f"in_dims=[{', '.join([str(rank)] * count)}]"
        extras.append((item, arg.why))
    return extras


def module_of(run: Run) -> str | None:
    """Its network_module, where it is one name."""
    module = run.flat.get("network_module")
    return module if isinstance(module, str) else None


def _base_weights(t: Translation, key: str, value: Any, run: Run) -> None:
    paths = value if isinstance(value, list) else [value]
    ratios = run.flat.get("base_weights_multiplier") or [1.0] * len(paths)
    ratios = ratios if isinstance(ratios, list) else [ratios]
    if len(ratios) != len(paths):
        t.refuse(key, value, f"{len(paths)} files, {len(ratios)} base_weights_multiplier values")
        return
    t.set("base_loras", [f"{p}:{float(r):g}" for p, r in zip(paths, ratios)], key, value, RENAMED,
          note="merged into the base before training, as there")


def _save_last_n(t: Translation, key: str, value: Any, run: Run) -> None:
    """save_last_n_epochs: the N newest epoch saves; save_last_n_steps: the saves of the last N steps."""
    if key == "save_last_n_epochs":
        if run.flat.get("save_every_n_epochs"):
            t.set("save_last_n_saves", int(value), key, value, RENAMED)
        else:
            t.drop(key, value, "read with save_every_n_epochs only")
    elif run.flat.get("save_every_n_steps"):
        kept = int(value) // int(run.flat["save_every_n_steps"]) + 1
        t.set("save_last_n_saves", kept, key, value, RENAMED, note=f"the saves of the last {value} steps: {kept}")
    else:
        t.drop(key, value, "read with save_every_n_steps only")


def _sample_when(t: Translation, key: str, value: Any, run: Run) -> None:
    sample_when(t, key, value, run.flat, epochs_only=False)  # should_sample_images: either interval


# musubi-tuner's prompt flags ours does not read: video frames, I2V images, control videos, FramePack's one-frame
# mode (its --fs, the flow shift its samples read, ours reads too)
UNREAD_PROMPT_FLAGS = ("f", "i", "ei", "cn", "of")


def _sample_prompts(t: Translation, key: str, value: Any, run: Run) -> None:
    """The prompt file; a copy without the flags ours does not read where it has any (ours refuses them), with
    each line's --l as ours reads it where its samples read --l otherwise (the model's MusubiModels.sample_cfg)."""
    rewrite = None
    if cfg := models.models_of(run.model_type).sample_cfg:
        runs = "above 1 and with a --n" if cfg.needs_negative else "above 1"
        rewrite = (partial(_cfg_as_ours, cfg=cfg), f"with --l as ours reads it (its samples run CFG only {runs})")
    copy_prompts_without(t, key, value, _read_prompt_flag, "ours does not read them (--fs 0: the model's own "
                         "schedule there, which ours samples without --fs)", rewrite, objects=prompt_object_lines)


# its prompt objects' keys (sampling_prompts.line_to_prompt_dict's) -> the flag of its line syntax
OBJECT_FLAGS = {"width": "w", "height": "h", "frame_count": "f", "seed": "d", "sample_steps": "s",
                "guidance_scale": "g", "discrete_flow_shift": "fs", "cfg_scale": "l", "negative_prompt": "n",
                "image_path": "i", "end_image_path": "ei", "control_video_path": "cn", "control_image_path": "ci",
                "one_frame": "of"}


def prompt_object_lines(path: str) -> list[str]:
    """Its .toml ([prompt] with [[prompt.subset]]: each subset over the table's keys) or .json (a list of objects or
    lines) prompt file as lines of its syntax (load_prompts), which the line rules then carry; a key its sampling
    reads none of is left out, as it leaves it."""
    import json

    import toml

    from library.text_files import read_utf8

    text = read_utf8(path, "sample prompts")
    if path.lower().endswith(".toml"):
        table = toml.loads(text).get("prompt", {})
        shared = {k: v for k, v in table.items() if k != "subset"}
        entries = [{**shared, **subset} for subset in table.get("subset", [])]
    else:
        entries = json.loads(text)
    if not isinstance(entries, list):
        raise ValueError(f"{path}: expected a list of prompts (musubi-tuner's load_prompts)")
    return [entry if isinstance(entry, str) else _object_line(entry) for entry in entries]


def _object_line(entry: dict) -> str:
    parts = [str(entry.get("prompt", ""))]
    for key, value in entry.items():
        if key in OBJECT_FLAGS:
            parts += [f"--{OBJECT_FLAGS[key]} {v}" for v in (value if isinstance(value, list) else [value])]
    return " ".join(parts)


def _read_prompt_flag(part: str) -> bool:
    """A prompt line's flag ours reads as musubi-tuner does: not its UNREAD_PROMPT_FLAGS, nor --fs 0 (its "no shift
    of mine": ours refuses a shift of 0)."""
    flag, _, value = part.partition(" ")
    if flag.lower() == "fs":
        try:
            return float(value) != 0
        except ValueError:
            return True  # ours says what is wrong with it
    return flag.lower() not in UNREAD_PROMPT_FLAGS


def _cfg_as_ours(flags: list[str], cfg) -> list[str]:
    """A line's flags with its --l (the last one, as both read it) as ours reads the scale it renders with."""
    given = [f.split(" ", 1)[1] if " " in f else "" for f in flags if f.split(" ", 1)[0].lower() == "l"]
    try:
        peer_l = float(given[-1]) if given else None
    except ValueError:  # ours refuses it naming the line
        return flags
    has_negative = any(f.split(" ", 1)[0].lower() == "n" for f in flags)
    kept = [f for f in flags if f.split(" ", 1)[0].lower() != "l"]
    return [*kept, f"l {cfg.ours(peer_l, has_negative):g}"]


SCHEDULERS = SCHEMA["lr_scheduler"].choices  # ours: diffusers' six, and transformers' three as musubi-tuner calls them
# musubi-tuner's scheduler keys -> the schedulers that read them (its get_scheduler: sd-scripts' get_scheduler_fix,
# and its rex, which ours lacks, reads the min lr ratio).
SCHEDULER_KEYS = {key: readers for key, readers in SCHEDULE_KEY_READERS.items() if key not in REX_KEYS}


def _lr_scheduler(t: Translation, key: str, value: Any, run: Run) -> None:
    carry_schedule(t, key, value, run.flat, SCHEDULERS)


def _scheduler_key(t: Translation, key: str, value: Any, run: Run) -> None:
    schedule_key(t, key, value, run.flat, run.flat.get("lr_scheduler", "constant"), SCHEDULER_KEYS[key])


def _scheduler_args(t: Translation, key: str, value: Any, run: Run) -> None:
    """lr_scheduler_args: its rex's rex_alpha / rex_beta are ours' lr_scheduler_rex_alpha / _beta; others go to a
    scheduler class of its own (lr_scheduler_type) or to diffusers' schedule function, which ours does not take."""
    args = dict(str(a).partition("=")[::2] for a in _as_list(value)) if not is_off(value) else {}
    if not args:
        t.drop(key, value, "none given")
    elif run.flat.get("lr_scheduler") != "rex" or run.flat.get("lr_scheduler_type"):
        t.refuse(key, value, "that scheduler's arguments: ours reads its schedules' own keys")
    elif set(args) - {"rex_alpha", "rex_beta"}:
        other = sorted(set(args) - {"rex_alpha", "rex_beta"})[0]
        t.refuse(key, value, f"rex takes rex_alpha and rex_beta (musubi-tuner stops on {other})")
    else:
        for name, text in args.items():
            t.set(f"lr_scheduler_{name}", float(text), key, value, RENAMED)


def _dataset_config(t: Translation, key: str, value: Any, run: Run) -> None:
    if t.dataset is not None:
        t.lines.append(Line(key, value, RENAMED, "dataset_config", "its translation, written beside ours"))
    elif run.dataset_read:
        t.refuse(key, value, "none of its datasets is carried (their lines say why): ours needs image folders")
    else:
        t.set(key, value, key, value, note="a musubi-tuner dataset TOML: translate it too (--dataset_config)")


def _as_list(value: Any) -> list[str]:
    return [str(v) for v in value] if isinstance(value, list) else [str(value)]


def _optimizer(t: Translation, key: str, value: Any, run) -> None:
    """optimizer_type / optimizer_args, but not its Adafactor with relative_step (its default: trainer_base's
    get_optimizer), which sets its own lr; ours refuses it (the written config failed our check)."""
    given = run.flat.get("optimizer_args")
    why = adafactor_refusal(run.flat.get("optimizer_type"), None if given is None else _as_list(given), "musubi-tuner")
    if why:
        t.refuse(key, value, why if key == "optimizer_type" else "goes with optimizer_type Adafactor, not carried")
    else:
        t.set(key, (value or "AdamW") if key == "optimizer_type" else _as_list(value), key, value)


def _always(value: Any) -> bool:
    return True


SDPA = "ours runs PyTorch SDPA: the same attention, another kernel"
COMPILE = "torch.compile's settings: ours compiles each block its own way"
DYNAMO = "accelerate's whole-model compile: ours compiles per block (torch_compile)"
HUB = "an upload to the Hugging Face Hub: ours writes local files only"
METADATA = "the header's ModelSpec resolution / architecture: ours writes its own (the model's, the dataset's)"
HUNYUAN = "HunyuanVideo's VAE: memory only"
SAMPLES = "how samples render: ours samples the trained base with the pipeline's schedule"

RULES: dict[str, Rule] = {
    # general, attention, compile
    "config_file": ignored("the config file itself"),
    "dataset_config": joint(_dataset_config),
    "sdpa": implied(_always, "ours always runs PyTorch SDPA"),
    "flash_attn": implied(_always, SDPA), "flash3": implied(_always, SDPA), "xformers": implied(_always, SDPA),
    "sage_attn": unsupported("SageAttention's 8-bit approximation: ours runs exact SDPA"),
    "split_attn": ignored("memory only: ours runs attention over the whole batch"),
    "compile": renamed("torch_compile"),
    **dict.fromkeys(("compile_backend", "compile_mode", "compile_dynamic", "compile_fullgraph",
                     "compile_cache_size_limit"), ignored(COMPILE)),
    "cuda_allow_tf32": renamed("allow_tf32"),
    "cuda_cudnn_benchmark": ignored("cuDNN autotuning: speed only"),
    **dict.fromkeys(("dynamo_backend", "dynamo_mode", "dynamo_fullgraph", "dynamo_dynamic"), ignored(DYNAMO)),
    # training
    **dict.fromkeys(("max_train_steps", "max_train_epochs", "max_data_loader_n_workers", "persistent_data_loader_workers",
                     "seed", "gradient_checkpointing", "gradient_accumulation_steps", "save_precision"), same()),
    "mixed_precision": joint(lambda t, key, value, run: precision(t, key, value, run.model_type)),
    "gradient_checkpointing_cpu_offload": ignored("memory only (activations in CPU memory): tools/plan_memory.py "
                                                  "says what fits ours"),
    # logging, DDP
    **dict.fromkeys(("logging_dir", "log_with", "log_prefix"), same()),
    "log_tracker_name": ignored("the tracker's run name: ours takes log_prefix"),
    "wandb_run_name": ignored("the wandb run's name: ours takes log_prefix"),
    "log_tracker_config": ignored("the tracker's own config file"),
    "wandb_api_key": ignored("a login: ours uses wandb's own"),
    "log_config": ignored("the settings in the log: ours writes them into the LoRA's header"),
    **dict.fromkeys(("ddp_timeout", "ddp_gradient_as_bucket_view", "ddp_static_graph"),
                    ignored("accelerate's DDP settings: ours sets its own")),
    # samples
    "sample_prompts": joint(_sample_prompts),
    **dict.fromkeys(("sample_every_n_steps", "sample_every_n_epochs", "sample_at_first"), joint(_sample_when)),
    # optimizer and schedule
    **dict.fromkeys(("optimizer_type", "optimizer_args"), Rule("custom", handle=_optimizer)),
    "learning_rate": same(), "max_grad_norm": same(),
    **{key: unless_schedule_free(rule) for key, rule in {  # (a schedule-free optimizer_type reads none of them)
        "lr_scheduler": joint(_lr_scheduler),
        "lr_warmup_steps": joint(lambda t, key, value, run: warmup_steps(t, key, value, run.flat)),
        **{key: joint(_scheduler_key) for key in SCHEDULER_KEYS},
        "lr_scheduler_type": unsupported("a scheduler class of its own: ours offers the lr_scheduler schedules"),
        "lr_scheduler_args": joint(_scheduler_args),
    }.items()},
    # memory
    "fp8_base": same(), "fp8_scaled": same(),
    "blocks_to_swap": joint(_blocks_to_swap),
    "use_pinned_memory_for_block_swap": implied(_always, "ours keeps swapped blocks in pinned memory"),
    "block_swap_h2d_only": implied(_always, "ours copies frozen blocks host to device only"),
    "block_swap_ring_size": ignored("block swap's buffers: ours prefetches block_swap_prefetch blocks"),
    "img_in_txt_in_offloading": ignored("memory only"),
    "disable_numpy_memmap": ignored("how files load: speed only"),
    # timesteps and loss
    # its guidance-distilled models' training feeds the guidance embedding 1.0 (ours' default too); the key is
    # only written into the header (ss_guidance_scale): ours would train at it
    "guidance_scale": ignored("unread by its image training (the guidance embedding gets 1.0, as ours by default)"),
    "timestep_sampling": joint(_timestep_sampling),
    "discrete_flow_shift": joint(_discrete_flow_shift),
    "sigmoid_scale": joint(_sigmoid_scale),
    "weighting_scheme": joint(_weighting_scheme),
    "logit_mean": joint(_logit), "logit_std": joint(_logit),
    "mode_scale": joint(_mode_scale),
    "min_timestep": joint(_timestep_bound),
    "max_timestep": joint(_timestep_bound),
    "preserve_distribution_shape": joint(_preserve_shape),
    "num_timestep_buckets": joint(_timestep_buckets),
    "show_timesteps": unsupported("plots the timesteps and exits: nothing is trained (ours: tools/plot_timesteps.py)"),
    # network
    "no_metadata": ignored("ours always writes the header's metadata"),
    **dict.fromkeys(("network_weights", "network_dim", "network_alpha", "network_dropout", "dim_from_weights",
                     "scale_weight_norms"), same()),
    "network_module": joint(_network_module),
    "network_args": joint(_network_args),
    "training_comment": same(),
    "base_weights": joint(_base_weights),
    "base_weights_multiplier": ignored("read with base_weights (base_loras' :ratio)"),
    # saves
    **dict.fromkeys(("output_dir", "output_name", "save_every_n_epochs", "save_every_n_steps", "save_state",
                     "save_state_on_train_end"), same()),
    "resume": unsupported("a musubi-tuner state folder: ours resumes its own states only"),
    "save_last_n_epochs": joint(_save_last_n), "save_last_n_steps": joint(_save_last_n),
    **dict.fromkeys(("save_last_n_epochs_state", "save_last_n_steps_state"),
                    ignored("ours keeps one state, the newest (<output_name>-state)")),
    **dict.fromkeys(("metadata_title", "metadata_author", "metadata_description", "metadata_license", "metadata_tags"),
                    same()),  # ModelSpec's text in the header, the same keys
    **dict.fromkeys(("metadata_reso", "metadata_arch"), ignored(METADATA)),
    **dict.fromkeys(("huggingface_repo_id", "huggingface_repo_type", "huggingface_path_in_repo", "huggingface_token",
                     "huggingface_repo_visibility", "save_state_to_huggingface", "resume_from_huggingface",
                     "async_upload"), ignored(HUB)),
    # model files and their precision
    "dit": renamed("pretrained_model_name_or_path"),
    "vae": renamed("ae"),
    "text_encoder": same(),
    "text_encoder1": joint(_text_encoder_file),
    "text_encoder2": joint(_text_encoder_file),
    **dict.fromkeys(("fp8_llm", "fp8_vl", "fp8_t5", "fp8_text_encoder"),
                    renamed("text_encoder_precision", convert=_fp8_text_encoder)),
    "vae_dtype": ignored("the VAE's dtype while caching: ours encodes in float32"),
    "dit_dtype": ignored("ours keeps the base in the compute dtype (mixed_precision) or base_precision"),
    "num_layers": ignored("ours reads the layer count from the checkpoint"),
    **dict.fromkeys(models.version_keys(), joint(_version_key)), "edit": joint(_version_key),
    "edit_plus": joint(_version_key),
    # HunyuanVideo's parser (a config copied from a video run)
    "dit_in_channels": unsupported("HunyuanVideo's (SkyReels I2V): not a model of ours"),
    "text_encoder_dtype": ignored("HunyuanVideo's text encoder dtype: ours is text_encoder_precision"),
    **dict.fromkeys(("vae_tiling", "vae_chunk_size", "vae_spatial_tile_sample_min_size"), ignored(HUNYUAN)),
    # the models' own
    "remove_first_image_from_target": unsupported("not offered: ours trains every frame, the composite too"),
    "use_32bit_attention": unsupported("float32 attention: ours computes it in the compute dtype"),
    **dict.fromkeys(("turbo_dit", "turbo_dit_cache", "unconditional_dit", "use_unconditional_dit_for_lora_sampling",
                     "sampler_preset", "initial_sigma"), ignored(SAMPLES)),
    "log_loss_stats": ignored("diagnostics in the log"),
    **{name: ignored(why) for name, why in models.ignored_args().items()},  # the scripts' own, from the specs
    **dict.fromkeys(models.same_args(), same()),
    **dict.fromkeys(models.option_names(), joint(_option)),
    **dict.fromkeys(("validate_caption_structure", "warn_on_caption_issues"),
                    ignored("a check of sample prompts' JSON structure")),
}


def settle_defaults(t: Translation, run: Run) -> None:
    """musubi-tuner's defaults where they differ from ours and change the training, for the keys its config
    leaves out (their line: '<key> (unset)')."""
    flat = run.flat

    def default(ours, value, key, note):
        t.set(ours, value, f"{key} (unset)", value, KEPT, note=f"musubi-tuner's default{note}")

    m = models.models_of(run.model_type)
    if m.default_version and version_said(flat, run.source) is None and release_of(run):
        t.set("model_version", release_of(run), f"{m.version_key} (unset)", m.default_version, RENAMED,
              note=f"its script's default ({m.default_version}); ours would read the release from the file name")
    if "weighting_scheme" not in flat and m.weighting.get("none", "none") != "none":
        t.set("weighting_scheme", m.weighting["none"], "weighting_scheme (unset)", "none", RENAMED,
              f"weighting_scheme = {m.weighting['none']!r}", f"musubi-tuner's default; {m.weighting_note}")
    if "mixed_precision" not in flat:  # accelerate's (its launch flag, else "no"), read as its "no" would be
        precision(t, "mixed_precision (unset)", "no", run.model_type)
    if "network_alpha" not in flat:
        default("network_alpha", 1.0, "network_alpha", "; ours is 16 (scale alpha / rank)")
    if "network_dim" not in flat:
        default("network_dim", 4, "network_dim", "; ours is 16")
    if "learning_rate" not in flat:
        default("learning_rate", 2e-6, "learning_rate", "; ours is 1e-4")
    if "timestep_sampling" not in flat and models.models_of(run.model_type).default_draw == "sigma":
        ours, text = run.draw
        if ours is None:
            t.refuse("timestep_sampling (unset)", "sigma", text)
        else:
            default("timestep_sampling", ours, "timestep_sampling", f", {text}; ours is the model's own")
    for key, ours, value in (("logit_mean", "logsnr_mean", 0.0), ("logit_std", "logsnr_std", 1.0)):
        if reads_logsnr(run) and key not in flat:  # its defaults, not ours (the Style-Friendly paper's)
            default(ours, value, key, f" (its log-SNR's); ours is {SCHEMA[ours].default:g}")
    if run.draw[0] == "shift" and "discrete_flow_shift" not in flat:
        default("discrete_flow_shift", 1.0, "discrete_flow_shift", "; ours is 3")
    if is_true(flat.get("fp8_base")) and "fp8_scaled" not in flat:
        default("fp8_scaled", False, "fp8_scaled", " (a plain fp8 cast); ours is per-block scales")
    if is_true(flat.get("persistent_data_loader_workers")) and "max_data_loader_n_workers" not in flat:
        default("max_data_loader_n_workers", 8, "max_data_loader_n_workers", "; ours is 0")
    if "network_args" not in flat and network_extras(run, []):
        _network_args(t, "network_args", [], run)


def translate(config: dict, source: str, *, model_type=None, dataset=None, dataset_source=None, script=None) -> Translation:
    flat = flatten_tables(config)
    chosen, who = choose_model(flat, source, script, model_type)
    run = Run(flat, source, chosen)
    run.draw = timestep_draw(flat, chosen, run.peer_draw())
    t = Translation(PEER, source, given=flat)
    t.set("model_type", chosen, who, chosen, RENAMED)
    if dataset is not None:
        t.dataset = translate_dataset(t, dataset, dataset_source or "dataset config", chosen)
        run.dataset_read = True
    rules = {key: Rule("custom", handle=partial(rule.handle, run=run)) if rule.kind == "custom" else rule
             for key, rule in RULES.items()}
    apply_rules(t, flat, rules)
    settle_defaults(t, run)
    return t
