"""Training arguments: one schema, read from a TOML file and overridden from the command line.

Every key is declared once in config_schema.py with its type, default and a one-line description;
unknown keys, wrong types and impossible combinations are errors that name the key and the file.
Booleans in TOML are TOML booleans; on the command line they are `--flag` / `--flag true|false`.

This module is the command line's parser, so it imports nothing heavy (no torch): train_lora.py
parses its arguments with it before loading torch, and --help or a bad flag answer at once.
"""

from __future__ import annotations

import argparse
import ast
import math
import os
from typing import Any

import toml

from library.errors import ConfigError, blame, where_set  # where_set: re-exported for the checks after load
from library.models.registry import FAMILIES, MODE_SCALES, arch_specs
from library.text_files import read_number_list, read_utf8, toml_loads
from library.training.config_schema import FAMILY_KEYS, KEEPING_KEYS, PATH_KEYS, PRECISION_NAMES, SCHEMA
from library.training.output_names import check_name_length
from library.training.preservation import validate_preservation
from library.training.run_length import check_decay, check_ema_start, check_warmup


def __getattr__(name: str):
    """PRECISION_DTYPES (PRECISION_NAMES -> torch dtypes) is made on first use: the parser loads without torch."""
    if name != "PRECISION_DTYPES":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import torch

    globals()[name] = dict(zip(PRECISION_NAMES, (torch.float32, torch.bfloat16, torch.float16)))
    return globals()[name]


def compute_dtype(args) -> torch.dtype:
    """mixed_precision -> the dtype models compute in (and high-precision weights are kept in)."""
    import torch

    return {"no": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[args.mixed_precision]


def slow_cpu_compute_line(args, device) -> str | None:
    """One line for bf16 / fp16 compute on a CPU without native GEMMs in that dtype (precision/dequantized_linear.py):
    a quantized base's products take the fallback's fast layout, yet float32 runs them faster; a plain base's
    backward cannot (autograd's own product). None elsewhere. Both trainers say it before caching or reading data."""
    from library.precision.dequantized_linear import native_cpu_matmul

    mp = args.mixed_precision
    if device.type != "cpu" or native_cpu_matmul(compute_dtype(args)):
        return None
    return (f"{where_set(args, 'mixed_precision')}: mixed_precision = \"{mp}\" on a CPU without native {mp} matrix "
            f"products (oneDNN needs AVX-512{' FP16' if mp == 'fp16' else ''}): a quantized base's step runs ~1.1x "
            f"float32's, a {mp} base's backward ~20x slower; \"no\" (float32 compute) is the fastest here")


def _fp8_keys_precision(args) -> str:
    return ("fp8_scaled" if args.fp8_scaled else "fp8") if args.fp8_base else "bf16"


def base_precision(args) -> str:
    """How the frozen base is stored: bf16 (i.e. the compute dtype), fp8, fp8_scaled, nf4, nf4_dq or
    int8 (the base_precision key, else the fp8_base / fp8_scaled keys). A pre-quantized checkpoint is
    used as it is stored: DiffusionTask.metadata() names its layout instead
    (stored_layouts.config_precision: e.g. ComfyUI's fp8_tensor_scaled needs fp8_scaled, GGUF bf16)."""
    return getattr(args, "base_precision", None) or _fp8_keys_precision(args)


def base_precision_key(args) -> str:
    """The key the config said the base's precision with, for an error line's advice: base_precision, else fp8_base."""
    return "base_precision" if getattr(args, "base_precision", None) else "fp8_base"


def check_stored_precision(args, stored: str | None, path: str | None = None) -> None:
    """A pre-quantized checkpoint (layout `stored`; None: a high-precision one) is used as it is stored: a
    ConfigError naming it (`path`, default the config's model) unless the config's base precision says so, the
    advice in the keys the config used (base_precision, or fp8_base / fp8_scaled); sample_bf16_reference = true
    on it too: it has no bf16 base to render beside (memory_plan.renders_bf16_reference). train_lora.py's tasks
    and tools/plan_memory.py."""
    from library.precision.stored_layouts import check_config_precision

    path = path or args.pretrained_model_name_or_path
    check_fp8_compute_layout(args, stored, path)
    check_config_precision(path, stored, base_precision(args), getattr(args, "base_precision", None) is not None)
    if stored and getattr(args, "sample_bf16_reference", None):
        raise ConfigError(f"{path}: sample_bf16_reference = true, but the checkpoint stores a pre-quantized {stored} "
                          f"base, which loads as stored in any precision: there is no bf16 base to render beside it; "
                          f"remove the key, or give the bf16 checkpoint")


def check_fp8_compute_layout(args, layout: str | None, path: str | None = None) -> None:
    """fp8_compute runs an fp8 base's codes as fp8 GEMMs: a checkpoint stored in another layout (GGUF, BFL's
    fp8r / nvfp4, a plain e5m2 file widened to bf16) has none, a ConfigError naming it. Checked before the
    precision advice of check_stored_precision, which (fp8_base = false) would only meet fp8_compute's refusal."""
    from library.precision.stored_layouts import config_precision

    if layout and getattr(args, "fp8_compute", False) and config_precision(layout) not in ("fp8", "fp8_scaled"):
        raise ConfigError(f"{path or args.pretrained_model_name_or_path}: fp8_compute = true runs an fp8 base's codes "
                          f"as fp8 GEMMs, but the checkpoint stores its base as {layout} (used as it is), with no fp8 "
                          f"codes; remove fp8_compute, or give a bf16 or fp8 checkpoint")


def _validate_base_precision(args, origins: dict[str, str], where: str) -> None:
    """base_precision and the older fp8_base / fp8_scaled keys must not ask for two different bases.
    Then the fp8 keys are set to match base_precision (so a state saved with either spelling resumes)."""
    chosen = args.base_precision
    if chosen is None:
        return
    fp8_keys = [k for k in ("fp8_base", "fp8_scaled") if k in origins]
    said = _fp8_keys_precision(args)
    conflict = (args.fp8_base and said != chosen) or (chosen in ("fp8", "fp8_scaled") and (
        ("fp8_base" in origins and not args.fp8_base) or ("fp8_scaled" in origins and args.fp8_scaled != (chosen == "fp8_scaled"))))
    if conflict:
        given = " and ".join(f"{k} = {str(getattr(args, k)).lower()}" for k in fp8_keys)
        raise ConfigError(f"{blame(origins, where, 'base_precision', *fp8_keys)}: base_precision = \"{chosen}\" and {given} "
                          f"ask for two different bases ({chosen} vs {said}); set base_precision alone (fp8_base / "
                          f"fp8_scaled are its older spelling)")
    if chosen in ("fp8", "fp8_scaled"):
        args.fp8_base, args.fp8_scaled = True, chosen == "fp8_scaled"
    else:
        args.fp8_base = False


# Steps or a fraction of max_train_steps, also written as a percentage (sd-scripts' --lr_warmup_steps 10%)
PERCENT_KEYS = ("lr_warmup_steps", "lr_decay_steps")


def _percentage(key: str, value: Any, where: str) -> Any:
    """"10%" as 0.1 for PERCENT_KEYS; other values as given."""
    if key not in PERCENT_KEYS or not isinstance(value, str) or not value.strip().endswith("%"):
        return value
    try:
        fraction = float(value.strip()[:-1]) / 100
    except ValueError:
        fraction = -1.0
    if not 0 <= fraction < 1:
        raise ConfigError(f"{where}: key '{key}' must be steps, a fraction of max_train_steps (< 1) or a percentage "
                          f"of it (0% to under 100%), got {value!r}")
    return fraction


def _coerce(key: str, value: Any, where: str) -> Any:
    spec = SCHEMA[key]
    value = _percentage(key, value, where)
    if value is None:
        return None
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        str: isinstance(value, str),
        list: isinstance(value, list) and all(isinstance(v, str) for v in value),
    }[spec.type]
    if not ok:
        want = {bool: "a boolean (true/false)", int: "an integer", float: "a number", str: "a string", list: "a list of strings"}[spec.type]
        raise ConfigError(f"{where}: key '{key}' must be {want}, got {value!r}")
    value = float(value) if spec.type is float else value
    if spec.choices and value not in spec.choices:
        raise ConfigError(f"{where}: key '{key}' must be one of {', '.join(spec.choices)}, got {value!r}")
    return value


def config_path(path: str) -> str:
    """--config_file as given, or with .toml appended where it does not end in .toml and does not exist
    (sd-scripts appends it: `--config_file configs/quickstart`, `configs/my_run_v1.5`)."""
    if not os.path.exists(path) and not path.lower().endswith(".toml") and os.path.exists(path + ".toml"):
        return path + ".toml"
    return path


def _check_steps_override(values: dict[str, Any], origins: dict[str, str]) -> None:
    """--max_train_steps on the command line under the file's max_train_epochs, which overrides it:
    the run would train the file's epochs without a word."""
    file, steps = origins.get("max_train_epochs"), values["max_train_steps"]
    if origins.get("max_train_steps") == "command line" and file not in (None, "command line"):
        raise ConfigError(f"{file} and command line: --max_train_steps {steps} would be ignored: max_train_epochs = "
                          f"{values['max_train_epochs']} in {file} overrides it; add --max_train_epochs none to train "
                          f"{steps} step{'s' if steps != 1 else ''}")


def read_toml(path: str) -> dict:
    try:
        text = read_utf8(path, "config file")
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a folder; expected a training config (.toml) file") from None
    except ValueError as e:  # not UTF-8: read_utf8 names the file and the byte
        raise ConfigError(str(e)) from None
    try:
        return toml_loads(text)
    except toml.TomlDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None


def _flatten(config: dict, where: str) -> dict:
    """Accept keys at top level or grouped in tables ([model], [network], ...): group names are
    for readability only; every leaf key must be a schema key, set once in the whole file (TOML
    itself refuses a key twice only within one table; across tables the last one would win)."""
    flat, tables = {}, {}
    for key, value, table in _leaves(config, ""):
        if key in flat:
            raise ConfigError(f"{where}: key '{key}' given twice (in {tables[key]} and in {table})")
        flat[key], tables[key] = value, table
    return flat


def _leaves(config: dict, table: str):
    """(key, value, "[table]" or "the top level") for every non-table value, in file order."""
    for key, value in config.items():
        if isinstance(value, dict):
            yield from _leaves(value, f"{table}.{key}" if table else key)
        else:
            yield key, value, f"[{table}]" if table else "the top level"


def _parse_cli_value(key: str, text: str) -> Any:
    spec = SCHEMA[key]
    if spec.default is None and text.lower() == "none":  # unset again: clears the file's value
        return None
    if spec.type is bool:
        if text.lower() not in ("true", "false"):
            raise ConfigError(f"command line: --{key} takes true or false, got {text!r}")
        return text.lower() == "true"
    if key in PERCENT_KEYS and text.strip().endswith("%"):
        return _percentage(key, text, "command line")
    try:
        return spec.type(text) if spec.type is not list else text
    except ValueError:
        raise ConfigError(f"command line: --{key} must be {spec.type.__name__}, got {text!r}") from None


class _Parser(argparse.ArgumentParser):
    """argparse whose error is one ConfigError line ("command line: ..."), not its usage (80 lines of
    flags) and the error beneath it."""

    def error(self, message):
        hint = ""
        if message.startswith("unrecognized arguments:"):  # a peer's flags (--dit): the command translating them
            from library.training.peers import peer_flag_hint
            hint = peer_flag_hint(message.split(":", 1)[1].split())
        raise ConfigError(f"command line: {message}{hint or ' (python train_lora.py --help lists the keys)'}")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(description=f"LoRA training for {', '.join(s.title for s in arch_specs().values())}",
                                allow_abbrev=False)
    p.add_argument("--config_file", help="training TOML; command-line values override it")
    for key, spec in SCHEMA.items():
        text = spec.help.replace("%", "%%")  # argparse formats help with %: a "10%" ended --help in a ValueError
        if spec.type is bool:
            p.add_argument(f"--{key}", nargs="?", const="true", help=f"{text} (default {spec.default})")
        elif spec.type is list:
            p.add_argument(f"--{key}", nargs="*", help=text)
        else:
            p.add_argument(f"--{key}", help=f"{text} (default {spec.default})")
    return p


def load_config(argv: list[str] | None = None) -> argparse.Namespace:
    """Defaults <- TOML file <- command line; then validated as a whole."""
    cli = build_parser().parse_args(argv)
    values = {k: s.default for k, s in SCHEMA.items()}
    origins: dict[str, str] = {}  # key -> the file or "command line" that set it
    if cli.config_file:
        where = cli.config_file = config_path(os.path.expanduser(cli.config_file))
        flat = _flatten(read_toml(where), where)
        unknown = [key for key in flat if key not in SCHEMA]
        if unknown:  # all at once: an sd-scripts config brings several
            from library.training.peers import peer_key_hint

            raise ConfigError(f"{where}: unknown key{'s' if len(unknown) > 1 else ''} "
                              f"{', '.join(repr(k) for k in unknown)}{peer_key_hint(unknown, where)}")
        for key, value in flat.items():
            values[key] = _coerce(key, value, where)
            origins[key] = where
    for key in SCHEMA:
        raw = getattr(cli, key)
        if raw is None:
            continue
        value = [str(v) for v in raw] if SCHEMA[key].type is list else _parse_cli_value(key, raw)
        values[key] = _coerce(key, value, "command line")
        origins[key] = "command line"
        if value is None:  # `none`: the key is unset, as if no one had given it
            del origins[key]
    _check_steps_override(values, origins)
    for key in PATH_KEYS & values.keys():
        values[key] = _expand_home(values[key])
    args = argparse.Namespace(**values, config_file=cli.config_file, key_origins=origins)
    where = cli.config_file or "command line"
    from library.training.optim import check_optimizer, check_scheduler, optimizer_class  # here: it loads torch
    from library.training.schedule_free import check_schedule_free_run, is_schedule_free_class

    try:  # the type alone first: its error is the one key's
        optimizer = optimizer_class(args.optimizer_type)
    except ConfigError as e:
        raise ConfigError(f"{blame(origins, where, 'optimizer_type')}: {e}") from None
    if is_schedule_free_class(optimizer):  # before validate, whose lr_warmup_steps line names another schedule
        check_schedule_free_run(args, origins, where)
    validate(args, where, origins)
    group_lrs = _group_lrs(lora_network_args(args))
    try:  # fail now, not after minutes of caching
        check_optimizer(args.optimizer_type, args.learning_rate, optimizer_kwargs(args), group_lrs,
                        blame(origins, where, "learning_rate"))
    except ConfigError as e:
        keys = ("optimizer_type", "optimizer_args") + (("network_args",) if group_lrs else ())
        raise ConfigError(f"{blame(origins, where, *keys)}: {e}") from None
    try:
        check_scheduler(args.lr_scheduler, args.learning_rate, args.lr_scheduler_power, args.lr_scheduler_min_lr_ratio,
                        args.lr_scheduler_timescale, (args.lr_scheduler_rex_alpha, args.lr_scheduler_rex_beta))
    except ConfigError as e:
        keys = ("lr_scheduler_rex_alpha", "lr_scheduler_rex_beta") if args.lr_scheduler == "rex" else ("learning_rate",)
        raise ConfigError(f"{blame(origins, where, *keys, 'lr_scheduler')}: {e}") from None
    return args


def _expand_home(value):
    """A path key's value (or list of them) with a leading ~ as the home folder."""
    if isinstance(value, list):
        return [os.path.expanduser(v) if isinstance(v, str) else v for v in value]
    return os.path.expanduser(value) if isinstance(value, str) else value


_WORD_LITERALS = {"true": True, "false": False, "none": None, "null": None,
                   "inf": math.inf, "-inf": -math.inf, "nan": math.nan}  # words ast.literal_eval refuses
_WORD_BOOLS = {"yes": True, "no": False, "on": True, "off": False}


def parse_kv_literals(items: list[str], key: str, where: str, any_text: bool = False) -> dict[str, Any]:
    """['lr=1e-3', 'betas=(0.9,0.99)', 'mode=scaled'] -> dict. Values are Python literals
    (ast.literal_eval, never eval); true / false / none in any case are True / False / None (TOML's
    and JSON's spelling: 'false' kept as a string is truthy), and so are yes / no / on / off unless
    any_text (the optimizer took 'use_bias_correction=no' as the truthy string); another bare word
    stays a string (an optimizer may take one). any_text: any other text stays a string too
    (network_args, which the network checks key by key, its booleans yes / no included: sd-scripts'
    block ranges '0-5,10', a bare regex)."""
    words = _WORD_LITERALS if any_text else {**_WORD_LITERALS, **_WORD_BOOLS}
    out = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"{where}: {key} entry {item!r} must be 'name=value'")
        name, text = (s.strip() for s in item.split("=", 1))
        if text.lower() in words:
            out[name] = words[text.lower()]
            continue
        try:
            out[name] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            if not (any_text or text.replace("_", "").replace("-", "").isalnum()):
                raise ConfigError(f"{where}: {key} value {item!r} is not a Python literal") from None
            out[name] = text
    return out


def optimizer_kwargs(args, where: str | None = None) -> dict[str, Any]:
    """optimizer_args of the config as the optimizer's keyword arguments (where: the file or
    "command line" that gave them, for the error)."""
    return parse_kv_literals(args.optimizer_args, "optimizer_args", where or where_set(args, "optimizer_args"))


def network_modules_from(args) -> str | None:
    """The LoRA file whose modules, ranks and alphas the network takes (dim_from_weights), or None: the
    network selects its modules itself, at network_dim's ranks."""
    return args.network_weights if args.dim_from_weights else None


def _validate_dim_from_weights(args, origins: dict[str, str], where: str) -> None:
    """dim_from_weights builds the network from network_weights' modules: the keys that would select modules
    or ranks mean nothing then; one line names the first (sd-scripts ignores them)."""
    if not args.dim_from_weights:
        return
    where = origins.get("dim_from_weights", where)
    if not args.network_weights:
        raise ConfigError(f"{where}: key 'dim_from_weights' needs network_weights (the file whose modules, ranks "
                          f"and alphas the network takes)")
    if args.network_module != "networks.lora":
        raise ConfigError(f"{where}: key 'dim_from_weights' is for network_module networks.lora (a LyCORIS network "
                          f"is built by its network_args)")
    from networks.lora_args import SELECTION_ARGS

    chosen = [k for k in lora_network_args(args)
              if k in SELECTION_ARGS or k.endswith("_dim") or k in ("in_dims", "network_reg_dims")]
    if chosen:
        raise ConfigError(f"{origins.get('network_args', where)}: network_args '{chosen[0]}' selects modules or "
                          f"ranks; with dim_from_weights the network holds network_weights' modules at their ranks")


def _group_lrs(network_args: dict) -> str | None:
    """The network_args that give parameter groups their own learning rates (said where an optimizer refuses them)."""
    ratio = network_args.get("loraplus_lr_ratio")
    if ratio not in (None, 1, "1"):
        return f"network_args 'loraplus_lr_ratio={ratio}'"
    if network_args.get("network_reg_lrs"):
        return f"network_args 'network_reg_lrs={network_args['network_reg_lrs']}'"
    return None


def lora_network_args(args, where: str | None = None) -> dict[str, Any]:
    """network_args of the config as a dict, with network_dropout as the LoRA `dropout` (sd-scripts):
    what the network is built with, and what its file's metadata records."""
    where = where or where_set(args, "network_args")
    net_args = parse_kv_literals(args.network_args, "network_args", where, any_text=True)
    if args.network_dropout and "dropout" in net_args:  # one would silently win over the other
        raise ConfigError(f"{where}: network_dropout = {args.network_dropout:g} and network_args 'dropout={net_args['dropout']}' "
                          f"set the same dropout: keep one")
    if args.network_dropout:
        net_args["dropout"] = args.network_dropout
    return net_args


def _validate_ema(args, origins: dict[str, str], where: str) -> None:
    if not 0.0 <= args.ema_decay < 1.0:
        raise ConfigError(f"{origins.get('ema_decay', where)}: key 'ema_decay' must be in [0, 1) (0 = off), "
                          f"got {args.ema_decay}")
    if args.ema_start_step < 0:
        raise ConfigError(f"{origins.get('ema_start_step', where)}: key 'ema_start_step' must be >= 0, "
                          f"got {args.ema_start_step}")
    if not args.max_train_epochs:  # else the steps come from the dataset (DiffusionTask, Trainer)
        check_ema_start(args, args.max_train_steps, blame(origins, where, "ema_start_step", "max_train_steps"))
    if not args.ema_decay:  # the EMA keys mean nothing without it: say so instead of ignoring them
        for key in ("ema_warmup", "sample_with_ema", "ema_start_step"):
            if getattr(args, key):
                raise ConfigError(f"{origins.get(key, where)}: key '{key}' needs ema_decay > 0 (e.g. 0.999)")
    for key in ("ema_inv_gamma", "ema_power"):
        if getattr(args, key) <= 0:
            raise ConfigError(f"{origins.get(key, where)}: key '{key}' must be > 0, got {getattr(args, key)}")
        if key in origins and not args.ema_warmup:
            raise ConfigError(f"{origins[key]}: key '{key}' needs ema_warmup = true (it shapes the warmup)")


def _validate_fp8_compute(args, origins: dict[str, str], where: str) -> None:
    """fp8_compute runs the base's fp8 codes as fp8 GEMMs with bf16 outputs: it needs both."""
    if not args.fp8_compute:
        return
    if args.model_type == "llm":
        raise ConfigError(f"{blame(origins, where, 'fp8_compute', 'model_type')}: key 'fp8_compute' is for the "
                          f"diffusion transformers ({', '.join(FAMILIES)}), not llm")
    if base_precision(args) not in ("fp8", "fp8_scaled"):
        key = base_precision_key(args)
        raise ConfigError(f"{blame(origins, where, 'fp8_compute', key)}: fp8_compute needs an fp8 base "
                          f"(base_precision = \"fp8_scaled\" or \"fp8\"), got {base_precision(args)}")
    if args.mixed_precision != "bf16":
        raise ConfigError(f"{blame(origins, where, 'fp8_compute', 'mixed_precision')}: fp8_compute gives bf16 outputs; "
                          f"it needs mixed_precision = \"bf16\", got \"{args.mixed_precision}\"")


def _validate_base_loras(args, origins: dict[str, str], where: str) -> None:
    """Each base_loras entry parses as path[:ratio] and names a file (before minutes of caching)."""
    from library.lora_spec import parse_lora_spec

    if args.base_loras and args.model_type == "llm":
        raise ConfigError(f"{blame(origins, where, 'base_loras', 'model_type')}: key 'base_loras' is for the diffusion "
                          f"families ({', '.join(FAMILIES)}), not llm")
    for entry in args.base_loras:
        try:
            spec = parse_lora_spec(entry, "base_loras")
        except ValueError as e:
            raise ConfigError(f"{origins.get('base_loras', where)}: {e}") from None
        if not os.path.isfile(spec.path):
            raise ConfigError(f"{origins.get('base_loras', where)}: base_loras {entry!r}: no file {spec.path!r}")


def validate(args: argparse.Namespace, where: str, origins: dict[str, str] | None = None) -> None:
    """Impossible values and combinations, each named with where its values were set. origins:
    key -> the file or "command line" that set it; where: the config file (or "command line"),
    blamed for keys that are missing."""
    origins = origins or {}
    if args.model_type is None:
        raise ConfigError(f"{where}: key 'model_type' is required ({', '.join((*FAMILIES, 'llm'))})")
    if args.pretrained_model_name_or_path is None:
        raise ConfigError(f"{where}: key 'pretrained_model_name_or_path' is required")
    for key in ("pretrained_model_name_or_path", "dataset_config", "output_dir"):  # "": "error: : no such file or
        if getattr(args, key, None) == "":  # folder" (naming neither), or the current folder written into
            raise ConfigError(f"{origins.get(key, where)}: key '{key}' is empty; expected a path")
    if args.model_type != "llm" and args.dataset_config is None:
        raise ConfigError(f"{where}: key 'dataset_config' is required for model_type {args.model_type}")
    if args.model_type == "llm" and not args.train_data:
        raise ConfigError(f"{where}: key 'train_data' is required for model_type llm")
    if args.pretrain and args.model_type != "llm":
        raise ConfigError(f"{blame(origins, where, 'pretrain', 'model_type')}: key 'pretrain' is only for model_type llm")
    _validate_base_precision(args, origins, where)
    if args.pretrain and base_precision(args) != "bf16":
        key = base_precision_key(args)
        raise ConfigError(f"{blame(origins, where, 'pretrain', key)}: 'pretrain' trains the base weights, which "
                          f"cannot be stored in {base_precision(args)} ('{key}')")
    if "scaled_residual_init" in origins and not args.pretrain:  # it would be ignored: say so
        raise ConfigError(f"{origins['scaled_residual_init']}: key 'scaled_residual_init' is for llm pretraining "
                          f"(pretrain = true)")
    _validate_counts(args, origins, where)
    if (args.save_format.startswith("peft") and args.model_type != "llm") or (args.pretrain and args.save_format != "auto"):
        raise ConfigError(f"{origins.get('save_format', where)}: save_format '{args.save_format}' is for LLM LoRAs "
                          f"(model_type llm without pretrain); diffusion LoRAs convert with tools/convert_lora.py --to diffusers")
    if args.scale_weight_norms is not None and args.network_module != "networks.lora":  # LyCORIS scales its own scalar
        raise ConfigError(f"{blame(origins, where, 'scale_weight_norms', 'network_module')}: scale_weight_norms needs "
                          f"network_module networks.lora (LoRA, DoRA); {args.network_module} is not scaled by it")
    if args.save_format.startswith("peft") and args.network_module != "networks.lora":
        raise ConfigError(f"{origins.get('save_format', where)}: save_format '{args.save_format}' needs network_module "
                          f"networks.lora (LyCORIS files have no PEFT LoRA form)")
    _validate_ema(args, origins, where)
    _validate_fp8_compute(args, origins, where)
    validate_preservation(args, origins, where)
    for key in KEEPING_KEYS:
        if getattr(args, key) and not args.gradient_checkpointing:
            raise ConfigError(f"{origins.get(key, where)}: key '{key}' needs gradient_checkpointing = true "
                              f"(it changes what the recompute runs)")
    if args.checkpoint_saves_dequantized and args.torch_compile:
        raise ConfigError(f"{blame(origins, where, 'checkpoint_saves_dequantized', 'torch_compile')}: "
                          f"checkpoint_saves_dequantized is an eager lever (a compiled region plans its own "
                          f"recompute); set torch_compile = false or leave it unset")
    _validate_base_loras(args, origins, where)
    from library.training.tracking import check_trackers

    if problem := check_trackers(args.log_with, args.logging_dir):
        raise ConfigError(f"{origins.get('log_with', where)}: {problem}")
    if args.model_type != "llm":
        from library.models.family import family_class

        missing = [k for k in family_class(args.model_type).required_paths() if getattr(args, k) is None]
        if missing:
            raise ConfigError(f"{where}: key '{missing[0]}' is required for model_type {args.model_type} "
                              f"(missing: {', '.join(missing)})")
    optimizer_kwargs(args, origins.get("optimizer_args", where))  # each: its syntax, before the values' checks
    lora_network_args(args, origins.get("network_args", where))
    from networks.factory import check_network_module

    try:  # an unknown value used to train a plain LoRA silently
        check_network_module(args.network_module)
    except ValueError as e:
        from library.training.peers import peer_lora_modules

        source = origins.get("network_module", where)
        peer = peer_lora_modules().get(args.network_module)
        hint = (f": {peer}'s LoRA module, ours networks.lora; `python tools/convert_config.py {source}` writes "
                f"that config as ours" if peer and source != "command line" else "")
        raise ConfigError(f"{source}: {e}{hint}") from None
    _validate_dim_from_weights(args, origins, where)
    _validate_input_paths(args, origins, where)
    _validate_output(args, origins, where)


# Each number key's allowed range, checked on every run (a key the run does not read included: it is
# refused elsewhere). Floats must also be finite. sd-scripts takes most of these unchecked; some then
# run wrong without a word: a negative max_grad_norm flips the gradient (clip_grad_norm_ scales by
# it), a negative save_last_n_saves deletes each save as it is written.
RANGES = {
    ">= 1": ("network_dim", "max_train_steps", "max_train_epochs", "gradient_accumulation_steps",
             "text_encoder_batch_size", "vae_batch_size", "block_swap_prefetch", "lr_scheduler_num_cycles",
             "lr_scheduler_timescale", "num_timestep_buckets",
             "max_length", "stride", "batch_size", "sample_max_new_tokens",
             *(k for k, a in FAMILY_KEYS.items() if a.type is int)),  # the families' counts and sizes: tokens, layers, px
    ">= 0": ("blocks_to_swap", "validate_every_n_steps", "validate_every_n_epochs", "save_every_n_steps",
             "save_every_n_epochs",
             "save_last_n_saves", "sample_every_n_steps", "sample_every_n_epochs", "max_grad_norm",
             "lr_scheduler_rex_alpha", "lr_scheduler_rex_beta",
             "lr_warmup_steps", "max_data_loader_n_workers", "ema_start_step", "prior_loss_weight", "eval_every_n_steps",
             "guidance_scale", "temperature", "top_k", "ip_noise_gamma"),
    "> 0": ("learning_rate", "scale_weight_norms", "discrete_flow_shift", "sigmoid_scale", "logsnr_std", "huber_c",
            "lr_scheduler_power",
            "lr_decay_steps",
            "diff_output_preservation_multiplier", "blank_prompt_preservation_multiplier"),
    "in [0, 1)": ("network_dropout", "val_fraction", "lr_scheduler_min_lr_ratio"),  # (a ratio of 1: constant)
}
_IN_RANGE = {">= 1": lambda v: v >= 1, ">= 0": lambda v: v >= 0, "> 0": lambda v: v > 0,
             "in [0, 1)": lambda v: 0 <= v < 1}
def _validate_timestep_range(args: argparse.Namespace, origins: dict[str, str], where: str) -> None:
    """min_timestep in 0-999, max_timestep in 1-1000, the first below the second (musubi-tuner takes any)."""
    lo, hi = args.min_timestep, args.max_timestep
    for key, value, least, most in (("min_timestep", lo, 0, 999), ("max_timestep", hi, 1, 1000)):
        if value is not None and not least <= value <= most:
            raise ConfigError(f"{blame(origins, where, key)}: key '{key}' must be {least} to {most} (thousandths of "
                              f"the noise level sigma), got {value}")
    if lo is not None and hi is not None and lo >= hi:
        raise ConfigError(f"{blame(origins, where, 'min_timestep', 'max_timestep')}: min_timestep ({lo}) must be below "
                          f"max_timestep ({hi})")
    shares = (args.qinglong_logsnr_share, args.qinglong_detail_share)
    if not all(0 <= share <= 1 for share in shares) or sum(shares) > 1:
        raise ConfigError(f"{blame(origins, where, 'qinglong_logsnr_share', 'qinglong_detail_share')}: the qinglong "
                          f"draw's logsnr and detail shares must be in [0, 1] with a sum <= 1 (the mid draw takes the "
                          f"rest), got {shares[0]:g} and {shares[1]:g}")
    if args.timestep_loss_weights:  # read now, not at the first step after caching
        try:
            read_number_list(args.timestep_loss_weights, "timestep_loss_weights table")
        except (OSError, ValueError) as e:
            raise ConfigError(f"{blame(origins, where, 'timestep_loss_weights')}: key 'timestep_loss_weights': "
                              f"{e.strerror + ': ' + str(e.filename) if isinstance(e, OSError) else e}") from None
    least, most = MODE_SCALES
    if not least < args.mode_scale <= most:  # (the peers take any: one outside leaves [0, 1] or folds back)
        raise ConfigError(f"{blame(origins, where, 'mode_scale')}: key 'mode_scale' must be > {least:g} and <= "
                          f"{most:g} (the mode law's map from a uniform draw is monotone in [0, 1] there), got "
                          f"{args.mode_scale:g}")
    if not math.isfinite(args.sigmoid_mean):
        raise ConfigError(f"{blame(origins, where, 'sigmoid_mean')}: key 'sigmoid_mean' must be finite")
    if (args.num_timestep_buckets or 0) > 1 and args.preserve_distribution_shape and (lo, hi) != (None, None):
        raise ConfigError(f"{blame(origins, where, 'num_timestep_buckets', 'preserve_distribution_shape')}: "
                          f"num_timestep_buckets stratifies the whole sigma law, preserve_distribution_shape redraws "
                          f"the sigmas outside min_timestep / max_timestep: set one of them (the range scaled: "
                          f"preserve_distribution_shape = false)")


def _validate_counts(args: argparse.Namespace, origins: dict[str, str], where: str) -> None:
    """Numbers in range (RANGES), and no key set that this model_type does not read."""
    if not 0 <= args.network_alpha < math.inf:  # a negative alpha flips the update's sign (sd-scripts takes it)
        raise ConfigError(f"{blame(origins, where, 'network_alpha')}: key 'network_alpha' must be > 0 (or 0 for alpha = rank), "
                          f"got {args.network_alpha:g}")
    for rule, keys in RANGES.items():
        for key in keys:
            value = getattr(args, key)
            if value is not None and not (_IN_RANGE[rule](value) and math.isfinite(value)):
                raise ConfigError(f"{blame(origins, where, key)}: key '{key}' must be {rule}"
                                  f"{'' if math.isfinite(value) else ' and finite'}, got {value:g}")
    from library.training.config_keys import family_key_bounds

    for key, most in ({} if args.model_type == "llm" else family_key_bounds(args.model_type)).items():
        if getattr(args, key) is not None and getattr(args, key) > most:  # else the encoder refuses it, after caching
            raise ConfigError(f"{blame(origins, where, key)}: key '{key}' must be <= {most} for model_type "
                              f"{args.model_type}, got {getattr(args, key)}")
    for key in ("lr_warmup_steps", "lr_decay_steps"):  # 1.5 steps: int() would cut it (sd-scripts refuses it)
        value = getattr(args, key)
        if value is not None and value >= 1 and not float(value).is_integer():
            raise ConfigError(f"{blame(origins, where, key)}: key '{key}' must be a whole number of "
                              f"steps (>= 1) or a fraction of max_train_steps (< 1), got {value:g}")
    if not args.max_train_epochs:  # else the steps come from the dataset (DiffusionTask, Trainer)
        check_warmup(args, args.max_train_steps, blame(origins, where, "lr_warmup_steps", "max_train_steps"))
        check_decay(args, args.max_train_steps, blame(origins, where, "lr_warmup_steps", "lr_decay_steps",
                                                      "max_train_steps"))
    _validate_timestep_range(args, origins, where)
    if not 0 <= args.seed < 2**64:  # torch.manual_seed's range (beyond it: "Overflow when unpacking long long")
        raise ConfigError(f"{blame(origins, where, 'seed')}: key 'seed' must be 0 to 2^64 - 1, got {args.seed}")
    for key, arg in SCHEMA.items():  # the rest: any finite number
        if arg.type is float and getattr(args, key) is not None and not math.isfinite(getattr(args, key)):
            raise ConfigError(f"{blame(origins, where, key)}: key '{key}' must be a finite number, got {getattr(args, key)}")
    from library.training.config_keys import validate_idle_keys, validate_unread_keys

    validate_unread_keys(args, origins)
    validate_idle_keys(args, origins, where, SCHEMA)


def _validate_input_paths(args: argparse.Namespace, origins: dict[str, str], where: str) -> None:
    """A file the run reads only after caching (and after loading the models): missing, found now.
    (sample_prompts is read before caching, with the dataset: a config that names files a tool
    writes later, as the quickstart's, still loads.)"""
    path = args.network_weights
    if path and not os.path.exists(path):
        raise ConfigError(f"{origins.get('network_weights', where)}: key 'network_weights' = {path}: no such file or "
                          f"folder (expected a LoRA file or PEFT adapter folder)")


def _validate_output(args: argparse.Namespace, origins: dict[str, str], where: str) -> None:
    """output_name and output_dir, found now rather than when the first file is written."""
    name = args.output_name  # it names files and a state folder in output_dir: one plain name, found now
    if name in ("", ".", "..") or any(c in name for c in ("/", "\\", "\0")):
        raise ConfigError(f"{blame(origins, where, 'output_name')}: key 'output_name' must be a plain file name (not empty, "
                          f"no path separator, not '.' or '..'), got {name!r}")
    prefix = args.log_prefix  # a run folder's name in logging_dir (and accelerate's project name): one plain name
    if prefix and (prefix in (".", "..") or any(c in prefix for c in ("/", "\\", "\0"))):
        raise ConfigError(f"{blame(origins, where, 'log_prefix')}: key 'log_prefix' must be a plain name (no path "
                          f"separator, not '.' or '..'), got {prefix!r}")
    if args.logging_dir:  # TensorBoard's folder: a file there failed after caching ('Not a directory')
        _check_creatable(args.logging_dir, "logging_dir", origins.get("logging_dir", where))
    if args.output_dir:
        where = origins.get("output_dir", where)
        _check_creatable(args.output_dir, "output_dir", where)
        check_name_length(args, origins.get("output_name", where), lora_formats(args))
        _validate_output_paths(args, where)


def _check_creatable(folder: str, key: str, where: str) -> None:
    """A folder the run creates (or writes into): below a file, or in a folder it cannot write, found now."""
    parent = os.path.abspath(folder)
    while not os.path.exists(parent):
        if os.path.islink(parent):  # a link to a missing target (an unmounted disk): makedirs fails on it
            raise ConfigError(f"{where}: {key} '{folder}' cannot be created: '{parent}' is a link to "
                              f"'{os.readlink(parent)}', which does not exist")
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):  # root ignores permissions, but not this
        raise ConfigError(f"{where}: {key} '{folder}' cannot be created: '{parent}' is a file, not a folder")
    if not os.access(parent, os.W_OK):
        raise ConfigError(f"{where}: {key} '{folder}' is not writable")


def _check_not_the_base(args: argparse.Namespace, where: str) -> None:
    """Pretraining writes <output_dir>/<output_name>/; where that is the base's folder, the save would
    write model.safetensors over (or beside the shards of) the model it started from, and the next
    run from that folder would start from the trained weights, not from what the folder held."""
    folder = os.path.join(args.output_dir, args.output_name)
    base = args.pretrained_model_name_or_path
    if base and os.path.realpath(folder) == os.path.realpath(base):
        raise ConfigError(f"{where}: output_dir '{args.output_dir}' with output_name '{args.output_name}' is the "
                          f"base's folder (pretrained_model_name_or_path '{base}'): pretraining would write the "
                          f"model over the one it starts from; choose another output_name or output_dir")


def lora_formats(args) -> list[str]:
    """save_format -> the LoRA forms the run writes: ["peft"], ["kohya"] or both. auto is a PEFT
    adapter folder for an LLM's networks.lora LoRA (what the LLM ecosystem loads), the kohya file for
    the rest (a diffusion family's LoRA, a LyCORIS network: it has no PEFT form)."""
    fmt = args.save_format
    if fmt == "auto":
        peft = args.model_type == "llm" and not args.pretrain and args.network_module == "networks.lora"
        fmt = "peft" if peft else "kohya"
    return fmt.split("+")


def _validate_output_paths(args: argparse.Namespace, where: str) -> None:
    """A folder where the run writes a file, or a file where it writes a folder, failed only at the save,
    after every step had trained (os.replace: 'Is a directory'); a folder where the log CSV goes failed at
    the first step, after caching, and one where the lr plot goes after the LoRA was saved (exit 2)."""
    name = args.output_name
    writes = [(f"{name}.safetensors", "the LoRA file", os.path.isdir),
              (f"{name}_log.csv", "the log CSV", os.path.isdir),
              (f"{name}_lr.png", "the learning-rate plot", os.path.isdir)]
    if args.model_type == "llm":
        writes.append((f"{name}_eval.csv", "the evaluations' CSV", os.path.isdir))
    if args.pretrain:  # the whole model, as a Hugging Face folder (no LoRA file)
        writes = [(name, "the pretrained model's folder", os.path.isfile)]
        _check_not_the_base(args, where)
    elif "peft" in lora_formats(args):
        writes.append((name, "the PEFT adapter folder", os.path.isfile))
    if args.save_state or args.save_state_on_train_end:
        writes.append((f"{name}-state", "the training state folder", os.path.isfile))
    for entry, what, wrong_kind in writes:
        path = os.path.join(args.output_dir, entry)
        if wrong_kind(path):
            kind = "a folder" if os.path.isdir(path) else "a file"
            raise ConfigError(f"{where}: output_dir '{args.output_dir}' holds {kind} '{entry}' where {what} goes; move "
                              f"it, or choose another output_name")
