"""Which modules a LoRA trains, and the network_args that say so: each architecture's LoRA targets (its
spec's LORA section, library/models/<folder>/spec.py) and the sd-scripts-style network_args checked
and parsed against them, with no model needed (the config check finds a bad key before caching).
networks/lora.py builds the network from them; networks/lycoris_network.py passes them on.
"""

from __future__ import annotations

import math
import re
import warnings

from library.models.registry import arch_specs
from library.models.spec import LoRATargets, load_symbol

# ----------------------------------------------------------------------------------------------
# Targets: each architecture's spec (library/models/<folder>/spec.py, LORA) names them: module type
# -> regex, full-matched against qualified module names, the named group giving the block kind and
# its index. Every architecture takes the COMMON_ARGS network_args; its spec adds its own.

COMMON_ARGS = {
    "dropout", "rank_dropout", "module_dropout", "include_patterns", "exclude_patterns",
    "loraplus_lr_ratio", "dora", "use_dora", "network_reg_dims", "network_reg_lrs",
}  # train_modulation: only where the spec has modulation_types (elsewhere it would switch nothing)
# The network_args that choose which modules train (beside the <type>_dim / in_dims ranks): a LyCORIS
# network passes them to our selection; a network built from a file's modules (dim_from_weights) has none.
SELECTION_ARGS = {"train_blocks", "train_modulation", "include_patterns", "exclude_patterns"}
SELECTION_ARGS |= {key for spec in arch_specs().values() if spec.lora for key in spec.lora.block_args}


def lora_targets(arch: str) -> LoRATargets:
    """The LoRA section of `arch`'s spec: targets, selection args, kohya prefix, module map."""
    sections = {name: spec.lora for name, spec in arch_specs().items() if spec.lora is not None}
    if arch not in sections:
        raise ValueError(f"LoRA family '{arch}': expected one of {', '.join(sections)}")
    return sections[arch]


def diffusers_module_map(arch: str, config) -> dict | None:
    """BFL <-> diffusers module map of a model of `arch` built from `config` (its `.config`), or None
    for an architecture with one naming."""
    builder = lora_targets(arch).diffusers_module_map
    return load_symbol(builder)(config) if builder else None


# ----------------------------------------------------------------------------------------------
# network_args parsing (values may arrive as strings from `key=value` command lines)


def check_lora_args(arch: str, args: dict) -> None:
    """network_args keys known to this architecture's LoRA, and none it refuses; needs no model, so
    the config check finds a bad one before caching."""
    spec = lora_targets(arch)
    known = (COMMON_ARGS | set(spec.block_args) | set(spec.extra_args) | set(spec.refused_args)
             | {f"{t}_dim" for t in list(spec.targets) + list(spec.type_groups)}
             | ({"train_modulation"} if spec.modulation_types else set()))
    unknown = sorted(k for k in args if k not in known)
    if unknown:
        raise ValueError(f"network_args: unknown key '{unknown[0]}' for family '{arch}' (known: {', '.join(sorted(known))})")
    for key, why in spec.refused_args.items():
        if _as_bool(key, args.get(key, False)):
            raise ValueError(f"network_args '{key}=true' is not supported: {why}")
    _check_lora_values(spec, args)


def _check_lora_values(spec: LoRATargets, args: dict) -> None:
    """Each value of its type and range (the network reads them after minutes of caching): a rate
    of 1 or more would divide by zero (rank_dropout) or never train (module_dropout)."""
    for key in ("dropout", "rank_dropout", "module_dropout"):
        _as_probability(key, args.get(key))
    ratio = _as_float("loraplus_lr_ratio", args.get("loraplus_lr_ratio"))
    if ratio is not None and not 0 < ratio < math.inf:  # inf gave NaN at step 2, after caching
        raise ValueError(f"network_args 'loraplus_lr_ratio': expected a finite number > 0, got {args['loraplus_lr_ratio']!r}")
    for key in ("dora", "use_dora", "train_modulation"):
        if key in args:
            _as_bool(key, args[key])
    if "dora" in args and "use_dora" in args and _as_bool("dora", args["dora"]) != _as_bool("use_dora", args["use_dora"]):
        raise ValueError(f"network_args 'dora' = {args['dora']!r} and 'use_dora' = {args['use_dora']!r} disagree: give one")
    _refuse_indices_of_blocks_off(spec, args)
    for key in ("include_patterns", "exclude_patterns"):
        _as_patterns(key, args.get(key))
    regex_values("network_reg_dims", args.get("network_reg_dims"))
    regex_values("network_reg_lrs", args.get("network_reg_lrs"))
    for key in args:
        if key.endswith("_dim") and _as_int(key, args[key]) < 0:
            raise ValueError(f"network_args '{key}': expected a rank >= 0 (0 skips the type), got {args[key]!r}")
    if spec.in_dim_types and args.get("in_dims") is not None:
        _in_dims(spec, args["in_dims"])
    for key in spec.block_args:
        if key in args:
            parse_indices(key, args[key], None)


def _refuse_indices_of_blocks_off(spec: LoRATargets, args: dict) -> None:
    """Block indices of a kind that train_blocks switches off select nothing, whatever they say ('none' passes)."""
    train_blocks = _train_blocks(args)
    for key, kind in spec.block_args.items():
        if train_blocks == "all" or kind == train_blocks or key not in args:
            continue
        if str(args[key]).strip().lower() == "all" or parse_indices(key, args[key], None):
            raise ValueError(f"network_args '{key}' = {args[key]!r} selects {kind} blocks, which 'train_blocks' = "
                             f"{train_blocks!r} switches off: give one or the other")


def _block_kinds(pattern: str) -> set[str]:
    """The block kinds a target regex names (its named groups); none for a module outside the blocks."""
    return set(re.compile(pattern).groupindex)


def _train_blocks(args: dict) -> str:
    train_blocks = str(args.get("train_blocks", "all")).lower()
    if train_blocks not in ("all", "double", "single"):
        raise ValueError(f"network_args 'train_blocks': expected all, double or single, got {train_blocks!r}")
    return train_blocks


def _in_dims(spec: LoRATargets, value) -> dict[str, int]:
    """in_dims "[r1, r2, ...]" (or a list): {type: rank} for the spec's in_dim_types, in order."""
    values = value if isinstance(value, (list, tuple)) else str(value).strip("[] ").split(",")
    if len(values) != len(spec.in_dim_types):
        raise ValueError(f"network_args 'in_dims': expected {len(spec.in_dim_types)} ranks "
                         f"[{', '.join(spec.in_dim_types)}], got {value!r}")
    ranks = {t: _as_int("in_dims", v) for t, v in zip(spec.in_dim_types, values)}
    if any(r < 0 for r in ranks.values()):
        raise ValueError(f"network_args 'in_dims': expected ranks >= 0, got {value!r}")
    return ranks


def _as_float(key, value):
    try:
        return None if value is None else float(value)
    except (TypeError, ValueError):
        raise ValueError(f"network_args '{key}': expected a number, got {value!r}") from None


def _as_probability(key, value) -> float | None:
    """A dropout rate in [0, 1): 1 drops everything (rank_dropout's 1 / (1 - p) divides by zero)."""
    p = _as_float(key, value)
    if p is not None and not 0 <= p < 1:
        raise ValueError(f"network_args '{key}': expected a probability in [0, 1), got {value!r}")
    return p


def _as_int(key, value) -> int:
    """An int, or its digits as a string ('4', '-1'); 4.5, '4.0' and True are refused, not truncated."""
    if isinstance(value, bool) or not re.fullmatch(r"[+-]?\d+", str(value).strip()):
        raise ValueError(f"network_args '{key}': expected an integer, got {value!r}")
    return int(value)


def _as_bool(key, value):
    if isinstance(value, bool):
        return value
    if str(value).lower() in ("true", "1", "yes"):
        return True
    if str(value).lower() in ("false", "0", "no"):
        return False
    raise ValueError(f"network_args '{key}': expected true/false, got {value!r}")


def _as_patterns(key, value) -> list[re.Pattern]:
    if value is not None and not isinstance(value, (str, list, tuple)):
        raise ValueError(f"network_args '{key}': expected a regex or a list of regexes, got {value!r}")
    values = [value] if isinstance(value, str) else list(value or [])
    compiled = []
    for v in values:
        if not isinstance(v, str):  # re.compile(1) raised a raw TypeError
            raise ValueError(f"network_args '{key}': item {v!r} is not a regex string, got {value!r}")
        try:
            compiled.append(re.compile(v))
        except re.error as e:
            raise ValueError(f"network_args '{key}': bad regex {v!r}: {e}") from None
    return compiled


def regex_values(key, value) -> list[tuple[re.Pattern, int | float]]:
    """sd-scripts' network_reg_dims / network_reg_lrs: "regex=value,regex=value" (its split: a regex holds no
    ',' or '='; a TOML table / dict literal {regex: value} takes any) -> [(pattern, value)] in order, the first
    pattern that re.search-es a module's kohya name (lora_unet_double_blocks_0_img_attn_qkv) giving its value.
    Dims are ranks >= 0 (0 drops the module), lrs finite rates > 0. sd-scripts skips a malformed pair with a
    log line; here it is refused."""
    if value is None:
        return []
    if isinstance(value, str):
        pairs = [pair.split("=", 1) for pair in value.split(",") if pair.strip()]
        if any(len(pair) != 2 for pair in pairs):
            raise ValueError(f"network_args '{key}': expected 'regex=value,regex=value', got {value!r}")
    elif isinstance(value, dict):
        pairs = list(value.items())
    else:
        raise ValueError(f"network_args '{key}': expected 'regex=value,...' or a table of regex = value, got {value!r}")
    out = []
    for pattern, number in pairs:
        pattern = str(pattern).strip()
        try:
            compiled = re.compile(pattern)
        except re.error as e:
            raise ValueError(f"network_args '{key}': bad regex {pattern!r}: {e}") from None
        if key == "network_reg_dims":
            number = _as_int(key, number.strip() if isinstance(number, str) else number)
            if number < 0:
                raise ValueError(f"network_args '{key}': {pattern!r} = {number}: expected a rank >= 0 (0 drops)")
        else:
            number = _as_float(key, number)
            if not 0 < number < math.inf:
                raise ValueError(f"network_args '{key}': {pattern!r} = {number!r}: expected a finite rate > 0")
        out.append((compiled, number))
    return out


def first_match(regexes: list[tuple[re.Pattern, int | float]], name: str) -> tuple[int, int | float] | None:
    """(index, value) of the first of regex_values' pairs whose pattern searches `name`, else None."""
    return next(((i, value) for i, (pattern, value) in enumerate(regexes) if pattern.search(name)), None)


def parse_indices(key, value, count: int | None) -> set[int]:
    """'0-5,10' / 'all' / 'none' (or None) / [0, 3] / 7 -> set of block indices below `count`
    (None: the format alone is checked, any index >= 0 taken; 'all' is then empty)."""
    if value is None:
        return set()
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, (str, list, tuple)) or (not isinstance(value, str) and not all(
            isinstance(i, int) and not isinstance(i, bool) for i in value)):
        raise ValueError(f"network_args '{key}': expected block indices like '0-5,10', 'all', 'none', "
                         f"an integer or a list of integers, got {value!r}")
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "all":
            return set(range(count or 0))
        if text in ("none", ""):
            return set()
        indices = []
        for part in text.split(","):
            # "10-" (open range; was block 10 alone), "-5", "5-2" (empty) and "²" (isdigit, not int) are refused
            bounds = re.fullmatch(r"([0-9]+)(?:-([0-9]+))?", part.strip())
            lo, hi = (int(bounds[1]), int(bounds[2] or bounds[1])) if bounds else (0, -1)
            if hi < lo:
                raise ValueError(f"network_args '{key}': bad range {part!r} in {value!r} "
                                 "(expected like '0-5,10', 'all' or 'none')")
            indices.extend(range(lo, hi + 1))
        value = indices
    bad = [i for i in value if not 0 <= int(i) < (math.inf if count is None else count)]
    if bad:
        raise ValueError(f"network_args '{key}': index {bad[0]} is out of range, the model has {count} such blocks")
    return {int(i) for i in value}


def _warn_rank_above_width(selected) -> None:
    """One warning for the targets whose rank exceeds min(in, out): up @ down cannot use the extra
    rank. The rank is kept (sd-scripts keeps it), so the file's shapes and alpha / rank stay as configured."""
    over = [(path, module, rank) for path, module, rank in selected if rank > min(module.in_features, module.out_features)]
    if over:
        path, module, rank = over[0]
        warnings.warn(f"LoRA rank {rank} exceeds min(in, out) of {len(over)} target layers (first '{path}': "
                      f"{module.in_features} in, {module.out_features} out): their update has rank at most "
                      f"{min(module.in_features, module.out_features)}; the extra rank only adds parameters", stacklevel=3)
