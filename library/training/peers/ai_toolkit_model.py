"""ai-toolkit's model, network and save sections read into ours (library/training/peers/ai_toolkit.py
names the keys and runs the translation), and what its other parts share: Job, the Translation that
carries the process while its keys are read, and the small rules built over it."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

from library.training.peers.rules import (DROPPED, KEPT, RENAMED, Line, Rule, Translation, custom,
                                          fixed_option, ignored, implied, is_off, renamed, unsupported)

PEER = "ai-toolkit"
# the older model switches -> ai-toolkit's arch (toolkit/config_modules.py ModelConfig): is_v<N> -> sd<N>, is_xl ->
# sdxl, is_<arch> for the rest
LEGACY_VERSION = re.compile(r"is_v(\d)")
SAVE_EVERY = 1000  # ai-toolkit's save.save_every where the key is left out


@dataclass
class Job(Translation):
    """A Translation with what ai-toolkit's keys read from each other while they are translated."""
    process: dict = field(default_factory=dict)
    model_type: str | None = None
    network_args: list = field(default_factory=list)
    optimizer_args: dict = field(default_factory=dict)
    micro_steps: int = 1  # gradient_accumulation_steps (its older key): ai-toolkit's steps are micro-batches
    summed_micro_batches: int = 1  # gradient_accumulation: their gradients summed

    def section(self, name: str) -> dict:
        value = self.process.get(name)
        return value if isinstance(value, dict) else {}


def read_elsewhere(t, key, value) -> None:  # read with another key, which says what it became
    pass


def read_as(text: str) -> Rule:
    """A key another part reads (the datasets, the samples): its line says what it became there."""
    return custom(lambda t, key, value: t.lines.append(Line(key, value, RENAMED, text)))


# A model entry's keys that are no config keys of ours (library/models/spec.py peer_models): the network_args that
# make ours train what its transformer_only LoRA (its default) wraps, those for its whole-model LoRA
# (transformer_only false), and the substrings of its module names whose Linears no training step runs (a LoRA on
# them stays zero), space-separated; lokr_format "peft" where ai-toolkit's model writes its LoKr in the PEFT format
# whatever old_lokr_format says (its use_old_lokr_format = False); file_note: how its model reads name_or_path where
# that is not a diffusers folder (said on its line); assistant_file: the file its model reads from an
# assistant_lora_path naming a folder or a Hub repository (its other models take a file, or repo/file);
# same_module_names: its LoRA's module names are ours (only_if_contains / ignore_if_contains carry as patterns);
# fixed_shift: its training scheduler's fixed shift (use_dynamic_shifting off); shift_method: our timestep_sampling
# whose resolution shift its dynamic one is (the same mu line at the same token count)
ENTRY_ARGS = ("network_args", "whole_network_args", "idle_modules", "lokr_format", "file_note", "assistant_file",
              "same_module_names", "fixed_shift", "shift_method")


def entry_of(model_type: str) -> dict[str, str]:
    """The spec's entry of ai-toolkit's arch for `model_type`."""
    from library.models.registry import spec_of

    return next(k for k in spec_of(model_type).peer_models[PEER].values() if k["model_type"] == model_type)


def _peer_models() -> dict[str, dict[str, str]]:
    """ai-toolkit's arch names -> our config keys naming that model (the family specs' peer_models)."""
    from library.models.registry import arch_specs

    return {name: keys for spec in arch_specs().values() for name, keys in spec.peer_models.get(PEER, {}).items()}


def as_number(value: Any) -> float:
    """A YAML number (PyYAML reads 1e-4, without a dot, as text; ai-toolkit float()s it)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"expected a number, got {value!r}") from None


def our_key(name: str, when: str | None = None, convert=None) -> Rule:
    """Our key `name` (ai-toolkit's of the same name sits in a section: "train.<name>"); when: the train key
    that must be on for ours to be read (the rest is dropped, as ours refuses a key that does nothing)."""
    def handle(t: Job, key: str, value: Any) -> None:
        if when and not t.section("train").get(when):
            t.drop(key, value, f"train.{when} is off")
            return
        try:
            converted = convert(value) if convert else value
        except ValueError as e:
            t.refuse(key, value, str(e))
            return
        t.set(name, converted, key, value, KEPT if key.split(" (")[0].endswith("." + name) else RENAMED, name)
    return custom(handle)


# ----------------------------------------------------------------------------------------------
# model


def _arch(t: Job, key: str, value: Any) -> None:
    keys = _peer_models()[_arch_name(t.section("model"))]
    said = []
    for k, v in entry_config(keys).items():  # (its network args: said where they are added)
        hub = _local(keys[k])[1] if isinstance(keys[k], str) else None
        said.append(f"{k} = {v!r}" + (f" (ai-toolkit's own file for it, a Hub id, which ours does not download: "
                                      f"`hf download {hub} --local-dir {v}`)" if hub else ""))
    t.lines.append(Line(key, value, RENAMED, ", ".join(said)))


def fixed_shift(t: Job) -> float | None:
    """The fixed shift of the arch's training scheduler (its spec entry's fixed_shift: use_dynamic_shifting off),
    which its shift timestep types apply to evenly spaced sigmas; None where it shifts by the image size."""
    keys = _peer_models().get(_arch_name(t.section("model")), {})
    return float(keys["fixed_shift"]) if "fixed_shift" in keys else None


def shift_method(t: Job) -> str | None:
    """Our architecture shift method equal to the arch's dynamic training shift (its spec entry's shift_method), which
    its shift timestep types apply to evenly spaced sigmas; None where ours has none."""
    return _peer_models().get(_arch_name(t.section("model")), {}).get("shift_method")


def entry_config(keys: dict) -> dict:
    """The config keys an arch's entry (spec peer_models) sets: its Hub ids (the files ai-toolkit reads whatever the
    YAML says) as the folders under models/ that ours reads."""
    return {k: _local(v)[0] if isinstance(v, str) else v for k, v in keys.items() if k not in ENTRY_ARGS}


def _arch_name(model: dict) -> str:
    """ai-toolkit's arch of the model section: `arch` (without a UI tag "arch:tag"), else the is_<arch>
    switch that is on, else its default sd1."""
    if model.get("arch"):
        return str(model["arch"]).split(":")[0]
    on = [k for k, v in model.items() if k.startswith("is_") and k != "is_v_pred" and v is True]
    if not on:
        return "sd1"
    version = LEGACY_VERSION.fullmatch(on[0])
    return f"sd{version.group(1)}" if version else "sdxl" if on[0] == "is_xl" else on[0][len("is_"):]


def _model_switch(t: Job, key: str, value: Any) -> None:
    if value is True and "arch" not in t.section("model"):
        _arch(t, key, value)
    else:
        t.drop(key, value, "off" if not value else "model.arch names the model")


def model_keys(t: Job, source: str, asked: str | None) -> dict[str, str]:
    """Our keys naming the model (model_type, model_version) from model.arch, or --model_type where the YAML
    names no arch; an arch we do not train is one ValueError naming it."""
    model, models = t.section("model"), _peer_models()
    arch = _arch_name(model)
    if asked and arch == "sd1" and not model.get("arch"):  # the YAML names none: ai-toolkit's default sd1
        return {"model_type": asked}
    if arch not in models:
        raise ValueError(f"{source}: model.arch {arch!r}: not a model we train (ai-toolkit's archs we train: "
                         f"{', '.join(models)})")
    keys = models[arch]
    if asked and asked != keys["model_type"]:
        raise ValueError(f"{source}: --model_type {asked} disagrees with model.arch {arch!r} (our {keys['model_type']})")
    return keys


def _name_or_path(t: Job, key: str, value: Any) -> None:
    """The model's files: a diffusers folder names every file key of ours (each loader takes its subfolder);
    a single file only the transformer; a Hub id a folder under models/ that the user downloads."""
    from library.models.family import family_class  # (torch: the converter checks the written config with it too)

    if not isinstance(value, str) or not value:
        raise ValueError(f"{t.source}: model.name_or_path must name the model, got {value!r}")
    model = t.section("model")
    # a file key the arch's entry already names (ai-toolkit's own default file for it) is not in the folder; a
    # text file ours finds beside the model where not given (optional) is extras_name_or_path's where that is given
    cls = family_class(t.model_type)
    extras_given = bool(model.get("extras_name_or_path"))
    optional = [k for k in cls.text_path_keys if k not in cls.required_paths()] if extras_given else []
    others = [k for k in [*cls.required_paths()[1:], *optional]
              if not (k == "ae" and model.get("vae_path")) and k not in t.config]
    path, hub = _local(value)
    t.config["pretrained_model_name_or_path"] = path
    extras = _local(model["extras_name_or_path"])[0] if model.get("extras_name_or_path") else path
    te = _local(model["te_name_or_path"])[0] if model.get("te_name_or_path") else None
    folder = not path.endswith((".safetensors", ".sft", ".gguf")) and (not os.path.exists(path) or _is_pipeline(path))
    derived = []
    for k in others:
        source = te if te and k != "ae" else extras
        if source != path or folder:
            t.config[k] = source
            derived.append(k)
    missing = [k for k in others if k not in derived]
    text = ", ".join(["pretrained_model_name_or_path", *derived])
    text += " (a diffusers folder: each its subfolder, transformer/, vae/, text_encoder/ ...)" if folder else ""
    if hub:
        text += f"; a Hub id, which ours does not download: `hf download {value} --local-dir {path}`"
    if missing:
        text += f"; give {', '.join(missing)} yourself (a single file holds the transformer only)"
    if note := entry_of(t.model_type).get("file_note"):
        text += f"; {note}"
    t.lines.append(Line(key, value, RENAMED, text))


def _model_kwargs(t: Job, key: str, value: Any) -> None:
    """A model's own options: those naming one of its files by our key (`<key>_model_path`, e.g. llama_model_path
    for a Llama text encoder) set that key, in place of the arch entry's default; those its spec's peer_options
    name, by them (model_option); the others are not carried."""
    from library.models.family import family_class

    files, rest, options = family_class(t.model_type).required_paths(), {}, model_options(t.model_type)
    for name, path in (value.items() if isinstance(value, dict) else ()):
        ours = name.removesuffix("_model_path")
        if f"{key}.{name}" in options:
            model_option(t, f"{key}.{name}", path)
        elif ours in files and ours != name and isinstance(path, str) and path:
            local, hub = _local(path)
            t.config[ours] = local  # replaces the arch entry's default file (no conflict: that was ours)
            t.lines.append(Line(f"{key}.{name}", path, RENAMED, ours + (f"; a Hub id, which ours does not download: "
                                                                         f"`hf download {hub} --local-dir {local}`"
                                                                         if hub else "")))
        else:
            rest[name] = path
    if rest or not isinstance(value, dict):
        t.refuse(key, rest or value, "a model's own options in ai-toolkit: set ours by their keys")


def model_options(model_type: str) -> dict:
    """ai-toolkit's own options for the model that ours reads at one value (its spec's peer_options), by key."""
    from library.models.registry import spec_of

    return spec_of(model_type).peer_options.get(PEER, {})


def model_option(t: Job, key: str, value: Any) -> None:
    """One such option: dropped at ours' value (the release's, where it is per release), else not carried."""
    fixed_option(t, key, value, model_options(t.model_type)[key.split(" (")[0]], release_of(t))


def unset_model_options(t: Job) -> None:
    """The options left out whose ai-toolkit default (peer_default) is not ours: their line says so (not carried, or
    the keys ours trains it as)."""
    given = t.section("model").get("model_kwargs")
    given = given if isinstance(given, dict) else {}
    for key, option in model_options(t.model_type).items():
        name = key.removeprefix("model.model_kwargs.")
        if option.peer_default is None or name in given:
            continue
        lines = len(t.lines)
        model_option(t, f"{key} (ai-toolkit's default)", option.peer_default)
        if t.lines[-1].verdict == DROPPED:  # its default is ours: no line
            del t.lines[lines:]


def release_of(t: Job) -> str | None:
    """Our model_version of the release ai-toolkit trains (it names none): the one our config says, else the one
    the model's path names, else the family's first (NamedReleases); None for a family of one release."""
    from library.models.family import family_class

    cls = family_class(t.model_type)
    if t.config.get("model_version") or not getattr(cls, "releases", ()):
        return t.config.get("model_version")
    return cls.release_in_name(str(t.section("model").get("name_or_path", ""))) or cls.releases[0]


def _local(value: str) -> tuple[str, str | None]:
    """(the path ours reads, the Hub id where `value` is one: owner/name not on this machine)."""
    if not os.path.exists(value) and re.fullmatch(r"[\w.-]+/[\w.-]+", value) and not value.startswith("."):
        return os.path.join("models", value.split("/")[1]), value
    return value, None


def _is_pipeline(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "model_index.json")) or os.path.isdir(os.path.join(path, "transformer"))


def _path_read_with_name(t: Job, key: str, value: Any) -> None:
    if is_off(value):
        t.drop(key, value, "off")
    else:
        t.lines.append(Line(key, value, RENAMED, "the model's other file keys (read with model.name_or_path)"))


def _assistant_lora(t: Job, key: str, value: Any) -> None:
    """ai-toolkit's assistant LoRA (a de-distillation adapter) is applied while training, off in its samples;
    ours merges base_loras into the frozen base for both. A folder or a Hub repository is read as its model reads
    it (the entry's assistant_file inside it); the UI's adapters name a repository and its file."""
    merged = "base_loras (merged while training, as there; our samples keep it too, ai-toolkit's leave it out)"
    path, inside = str(value), entry_of(t.model_type).get("assistant_file")
    if inside and not is_off(value) and (os.path.isdir(path) or _local(path)[1]):
        path = f"{path.rstrip('/')}/{inside}"
    hub_file = re.fullmatch(r"([\w.-]+/[\w.-]+)/([\w.-]+\.safetensors)", path)
    if is_off(value):
        t.drop(key, value, "off")
    elif hub_file and not os.path.exists(path):
        repo, name = hub_file.groups()
        folder = os.path.join("models", repo.split("/")[1])
        t.set("base_loras", [f"{os.path.join(folder, name)}:1.0"], key, value, RENAMED,
              f"{merged}; a Hub file, which ours does not download: `hf download {repo} {name} --local-dir {folder}`")
    elif _local(path)[1]:
        t.refuse(key, value, f"a Hub repository, which ours does not download: `hf download {value} --local-dir "
                             f"{_local(path)[0]}`, then base_loras = [\"<its .safetensors>:1.0\"]")
    else:
        t.set("base_loras", [f"{path}:1.0"], key, value, RENAMED, merged)


# quantize's qtype -> our base_precision (quanto's qfloat8 keeps a scale per output channel, ours per 64 weights)
QTYPES = {"qfloat8": "fp8_scaled", "float8": "fp8_scaled", "qint8": "int8", "int8": "int8"}
TE_QTYPES = {"qfloat8": "fp8_scaled", "float8": "fp8_scaled"}


def _quantize(t: Job, key: str, value: Any) -> None:
    """model.quantize with model.qtype -> base_precision; model.quantize_te (default: quantize) with qtype_te
    -> text_encoder_precision."""
    model, te = t.section("model"), key.split(" (")[0].endswith("_te")
    qtype = str(model.get("qtype_te" if te else "qtype", "qfloat8"))
    ours = "text_encoder_precision" if te else "base_precision"
    if not value:
        t.drop(key, value, "off")
    elif qtype in (TE_QTYPES if te else QTYPES):  # ("qfloat8|<adapter>" is not: the adapter is not ours)
        t.set(ours, (TE_QTYPES if te else QTYPES)[qtype], key, value, RENAMED, f"{ours} ({qtype})")
    else:
        nearest = "\"fp8_scaled\"" if te else "\"nf4\" (4 bits) or \"fp8_scaled\""
        adapter = ", with ai-toolkit's accuracy recovery adapter" if "|" in qtype else ""
        t.refuse(key, value, f"qtype {qtype.split('|')[0]!r} (torchao's low-bit weights{adapter}) is not ours: "
                             f"the nearest is {ours} = {nearest}")


def _qtype(t: Job, key: str, value: Any) -> None:
    model, te = t.section("model"), key.endswith("_te")
    on = model.get("quantize_te", model.get("quantize", False)) if te else model.get("quantize", False)
    t.drop(key, value, f"read with model.quantize{'_te' if te else ''}" if on else "quantizing is off")


MODEL_RULES: dict[str, Rule] = {f"model.{k}": r for k, r in {
    "arch": custom(_arch),
    "name_or_path": custom(_name_or_path),
    "extras_name_or_path": custom(_path_read_with_name),
    "te_name_or_path": custom(_path_read_with_name),
    "vae_path": renamed("ae"),
    "quantize": custom(_quantize),
    "quantize_te": custom(_quantize),
    "qtype": custom(_qtype),
    "qtype_te": custom(_qtype),
    "assistant_lora_path": custom(_assistant_lora),
    "dtype": ignored("ai-toolkit replaces it with train.dtype"),
    "low_vram": ignored("memory while quantizing only: ours quantizes tensor by tensor while loading"),
    "layer_offloading": ignored("memory only (ours: blocks_to_swap)"),
    "layer_offloading_transformer_percent": ignored("memory only (ours: blocks_to_swap)"),
    "layer_offloading_text_encoder_percent": ignored("memory only"),
    "auto_memory": ignored("memory only (ours: blocks_to_swap)"),
    "split_model_over_gpus": ignored("memory only (ours: FSDP shards the base)"),
    "split_model_other_module_param_count_scale": ignored("memory only"),
    "quantize_kwargs": ignored("which modules quanto skips: ours keeps each model's own list in high precision"),
    "compile": ignored("speed only (ours: torch_compile, on where measured faster)"),
    **{k: ignored("speed only") for k in ("block_compile", "compile_mode", "compile_fullgraph", "compile_dynamic",
                                          "cache_size_limit")},
    **{k: ignored("where ai-toolkit runs or keeps the VAE / text encoder: ours caches with them, then frees them")
       for k in ("vae_device", "te_device", "vae_dtype", "te_dtype", "text_encoder_bits")},
    "inference_lora_path": ignored("a LoRA for ai-toolkit's samples only"),
    "lora_path": unsupported("a LoRA loaded into the base: ours merges base_loras (with their ratio)"),
    "unconditional_lora_path": unsupported("a LoRA for the negative prompt only: not ours"),
    "accuracy_recovery_adapter": unsupported("ai-toolkit's accuracy recovery adapter for its low-bit bases: not ours"),
    "attn_masking": unsupported("ai-toolkit's attention mask over the text padding: ours follows each model's pipeline"),
    "is_v_pred": unsupported("v-prediction: ours trains flow matching"),
    "use_*_cfg": unsupported("a guidance-distilled model trained with CFG: not ours"),
    "latent_space_version": unsupported("another latent space: not ours"),
    "refiner_name_or_path": unsupported("a refiner model: not ours"),
    "refiner_start_at": ignored("a refiner model's key"),
    "unet_path": unsupported("a separate denoiser file: ours takes it as name_or_path"),
    "unet_sample_size": ignored("older models' key"),
    "use_text_encoder_1": ignored("older models' key"),
    "use_text_encoder_2": ignored("older models' key"),
    "experimental_xl": ignored("older models' key"),
    "in_context": unsupported("in-context training: not ours"),
    "model_kwargs": custom(_model_kwargs),
    "model_paths": unsupported("a model's extra files in ai-toolkit: set ours by their keys"),
    "ignore_if_contains": unsupported("frozen parameters of a full fine-tune: ours trains a LoRA"),
    "only_if_contains": unsupported("trained parameters of a full fine-tune: ours trains a LoRA"),
    "is_*": custom(_model_switch),
}.items()}


# ----------------------------------------------------------------------------------------------
# network


def _network_type(t: Job, key: str, value: Any) -> None:
    """lora -> our LoRA; lokr -> LyCORIS' LoKr with ai-toolkit's factor, full rank (its default: w2 a full matrix,
    scale 1) or the rank of network.linear."""
    network = t.section("network")
    kind = str(value).lower()
    if kind == "lora":
        t.set("network_module", "networks.lora", key, value, RENAMED, "network_module")
        return
    if kind != "lokr":
        raise ValueError(f"{t.source}: network.type {value!r}: ours trains lora and lokr (ai-toolkit's {kind} is not ours)")
    t.set("network_module", "lycoris.kohya", key, value, RENAMED, "network_module (network_args algo=lokr)")
    t.network_args += ["algo=lokr", f"factor={int(network.get('lokr_factor', -1))}"]
    if _full_rank_lokr(network):
        t.network_args.append("full_matrix=True")


def _lokr_key(t: Job, key: str, value: Any) -> None:
    if str(t.section("network").get("type", "lora")).lower() != "lokr":
        t.drop(key, value, "network.type is not lokr")
    else:
        t.lines.append(Line(key, value, RENAMED, "network_args (factor / full_matrix)"))


def _full_rank_lokr(network: dict) -> bool:
    """ai-toolkit's LoKr at its default lokr_full_rank: w2 a full matrix, no rank, scale 1."""
    return str(network.get("type", "lora")).lower() == "lokr" and bool(network.get("lokr_full_rank", True))


def _rank(t: Job, key: str, value: Any) -> None:
    network = t.section("network")
    if _full_rank_lokr(network):
        t.drop(key, value, "full-rank LoKr (lokr_full_rank): no rank")
    elif key == "network.linear" and network.get("rank") is not None:  # NetworkConfig reads rank first
        t.drop(key, value, "network.rank sets it (ai-toolkit reads rank before linear)")
    else:
        t.set("network_dim", value, key, value, RENAMED, "network_dim")


def _alpha(t: Job, key: str, value: Any) -> None:
    network = t.section("network")
    if _full_rank_lokr(network):
        t.drop(key, value, "full-rank LoKr (lokr_full_rank): scale 1")
    elif key == "network.alpha" and "linear_alpha" in network:
        t.drop(key, value, "network.linear_alpha sets it")
    elif _old_format_lokr(t, network):
        t.set("network_alpha", float(value), key, value, RENAMED, "network_alpha")
    else:  # a LoRA trained at linear_alpha / rank here would learn at another scale than there
        rank = next((network[k] for k in ("rank", "linear") if network.get(k) is not None), 4)  # NetworkConfig's
        note = (f"= the rank {rank}: ai-toolkit trains these models' networks at alpha = rank (scale 1) whatever "
                f"linear_alpha says (toolkit/lora_special.py, its PEFT format)") if float(value) != rank else ""
        t.set("network_alpha", float(rank), key, value, RENAMED, "network_alpha", note=note)


def _old_format_lokr(t: Job, network: dict) -> bool:
    """A LoKr in ai-toolkit's old format, the one network of these models it trains at linear_alpha / rank: asked
    for (old_lokr_format) on a model that keeps that format (the entry does not say lokr_format "peft")."""
    entry = _peer_models().get(_arch_name(t.section("model"))) or entry_of(t.model_type)
    return (str(network.get("type", "lora")).lower() == "lokr" and bool(network.get("old_lokr_format"))
            and entry.get("lokr_format") != "peft")


def _transformer_only(t: Job, key: str, value: Any) -> None:
    """On (its default): the transformer blocks' Linears, ours' default (with the entry's network_args). Off: every
    Linear of the model, ours' where the entry gives whole_network_args."""
    if value:
        t.drop(key, value, "ours trains the transformer's blocks only")
    elif entry_of(t.model_type).get("whole_network_args"):
        t.lines.append(Line(key, value, RENAMED, "network_args (every Linear of the model: the line added says which)"))
    else:
        t.refuse(key, value, "ours trains the transformer's blocks only")


def _module_names(t: Job, key: str, value: Any) -> None:
    words = [value] if isinstance(value, str) else list(value or [])
    if not words:
        t.drop(key, value, "off")
        return
    idle = entry_of(t.model_type).get("idle_modules", "").split()
    if key.endswith("ignore_if_contains") and all(str(w) in idle for w in words):
        t.drop(key, value, f"leaves out modules no training step of this model runs ({', '.join(idle)}): a LoRA on "
                           f"them stays zero, and ours has none")
        return
    alternatives = "|".join(re.escape(str(w)) for w in words)
    pattern = f".*(?:{alternatives}).*" if key.endswith("ignore_if_contains") else f"(?!.*(?:{alternatives})).*"
    if entry_of(t.model_type).get("same_module_names"):
        t.network_args.append(f"exclude_patterns=[{pattern!r}]")
        t.lines.append(Line(key, value, RENAMED, f"network_args exclude_patterns=[{pattern!r}] (its module names are "
                                                 f"ours on this model)"))
        return
    t.refuse(key, value, f"substrings of ai-toolkit's module names; ours takes regexes over ours (which may be named "
                         f"otherwise: docs/configuration.md, network): e.g. network_args exclude_patterns=[{pattern!r}]")


NETWORK_RULES: dict[str, Rule] = {f"network.{k}": r for k, r in {
    "type": custom(_network_type),
    "linear": custom(_rank),
    "rank": custom(_rank),
    "linear_alpha": custom(_alpha),
    "alpha": custom(_alpha),
    "lokr_factor": custom(_lokr_key),
    "lokr_full_rank": custom(_lokr_key),
    "dropout": renamed("network_dropout", lambda v: float(v or 0.0)),
    "pretrained_lora_path": renamed("network_weights"),
    "transformer_only": custom(_transformer_only),
    # the rank of Conv2d layers: these models' transformers have none (the UI writes conv: 16 into every job)
    "conv": ignored("no convolution layer in these models' transformers: ai-toolkit's conv rank wraps none"),
    "conv_alpha": ignored("no convolution layer in these models' transformers: ai-toolkit's conv rank wraps none"),
    "all_layers": unsupported("full-weight training of the other layers: ours trains LoRA modules"),
    "lorm": unsupported("ai-toolkit's LoRM: not ours"),
    "layer_offloading": ignored("memory only"),
    "split_multistage_loras": ignored("two-stage video models only"),
    "old_lokr_format": ignored("ai-toolkit's older LoKr file keys: ours writes LyCORIS' own (the alpha line says "
                               "which alpha it trained at)"),
    "network_kwargs": implied(lambda v: not v, "none given"),  # given as a mapping: its keys below
    "network_kwargs.only_if_contains": custom(_module_names),
    "network_kwargs.ignore_if_contains": custom(_module_names),
}.items()}


# ----------------------------------------------------------------------------------------------
# save


def _save_count(t: Job, key: str, value: Any) -> None:
    """max_step_saves_to_keep: ours prunes only where there are intermediate saves (save_every)."""
    every = t.section("save").get("save_every", SAVE_EVERY)
    if not every:
        t.drop(key, value, "no intermediate saves (save.save_every 0)")
    else:
        t.set("save_last_n_saves", value, key, value, RENAMED, "save_last_n_saves")


def one_of(names: dict[str, str], what: str):
    """A convert for a name ai-toolkit spells several ways (float16, fp16 ...): ours, or ValueError(what)."""
    def convert(value: Any) -> str:
        if str(value).lower() not in names:
            raise ValueError(f"{value!r}: {what}")
        return names[str(value).lower()]
    return convert


PRECISIONS = {"float16": "fp16", "fp16": "fp16", "half": "fp16", "bfloat16": "bf16", "bf16": "bf16",
              "float32": "fp32", "fp32": "fp32", "float": "fp32"}


SAVE_RULES: dict[str, Rule] = {f"save.{k}": r for k, r in {
    "dtype": renamed("save_precision", one_of(PRECISIONS, "ours saves fp32, bf16 or fp16")),
    "save_every": renamed("save_every_n_steps"),
    "max_step_saves_to_keep": custom(_save_count),
    # a full model's save format: ai-toolkit saves a network as one .safetensors whatever it says (the UI writes
    # diffusers, and ai-toolkit forces it for one arch)
    "save_format": ignored("unread for a LoRA, saved as one .safetensors there too (ours in kohya keys; "
                           "tools/convert_lora.py converts)"),
    "push_to_hub": ignored("a Hub upload: ours does not upload (huggingface-cli upload does)"),
    "hf_repo_id": ignored("a Hub upload: ours does not upload"),
    "hf_private": ignored("a Hub upload: ours does not upload"),
}.items()}
