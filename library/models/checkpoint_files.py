"""The steps every family's transformer loader (library/models/<family>/checkpoint.py) takes the same way, with
only the family's names changed. Each family keeps its own public functions, messages and the steps where it
differs (name maps, views of fused tensors, which keys tell its files apart); what it passes in is its own
constants: the diffusers class name its config.json must name (CLASS_NAME), the key prefixes a single file may
carry (PREFIXES: ComfyUI's `model.diffusion_model.` / `diffusion_model.`, none) with the one key that tells its
files from every other family's (MARKER), the safetensors metadata key our writers store its config under
(CONFIG_KEY) with the two readers of a config (config_from_diffusers, the JSON reader), and its fp8 keep rules
(its spec's FP8).

The order a loader goes in: the file opened (open_transformer: the dtype checked, the pipeline's component folder,
the reader), the file's prefix (marked_prefix), the config it states (diffusers_config_json, then stated_config; a
`config=` given wins, but a foreign config.json is refused all the same), the model built on `meta` and every key
and shape checked against the header (the family's, as its names differ), then fill_meta_model: the weights
streamed in (or the meta model cast, for the memory planner). A family's inference of its config from the shapes
counts its blocks with block_count.
"""

from __future__ import annotations

import os
import re
from typing import Callable, TypeVar

import torch
import torch.nn as nn

from library.io import CheckpointError, CheckpointReader, component_folder, load_streaming, metadata_config, \
    prepared_convert, read_json_file
from library.precision.fp8 import KeepRules
from library.precision.stored_layouts import StoredLayout, stored_converter

Config = TypeVar("Config")
Model = TypeVar("Model", bound=nn.Module)


COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_compute_dtype(loader: str, dtype: torch.dtype, fp8_via: str | None = "prepare=") -> None:
    """One ValueError naming the public `loader` when `dtype` is no compute dtype; fp8_via: the hook fp8 goes
    through instead, as the loader's message names it (None: the message names none)."""
    if dtype not in COMPUTE_DTYPES:
        via = f" (fp8 goes through {fp8_via})" if fp8_via else ""
        raise ValueError(f"{loader} dtype must be float32/bfloat16/float16{via}, got {dtype}")


def open_transformer(path: str, loader: str, dtype: torch.dtype, *, component: str = "transformer",
                     fp8_via: str | None = "prepare=") -> tuple[str, CheckpointReader]:
    """A loader's first steps: `dtype` checked (check_compute_dtype), `path/component` taken for a pipeline folder,
    its header read. Returns (the file or folder read, its reader); the loader goes on in its own order (its stored
    layout, its config.json, its marker), so that each keeps the order its errors come in. No weight is read."""
    check_compute_dtype(loader, dtype, fp8_via)
    path = component_folder(path, component)
    return path, CheckpointReader(path)


def marked_prefix(path: str, keys: list[str], prefixes: tuple[str, ...], marker: str, what: str) -> str:
    """The first of `prefixes` under which `keys` hold `marker`; else one CheckpointError naming the file, the marker
    and the prefixes. what: the model the family loads, with its article ("a ... transformer")."""
    for prefix in prefixes:
        if prefix + marker in keys:
            return prefix
    raise CheckpointError(f"{path}: not {what} (no key '{marker}', plain or under "
                          f"{' / '.join(p for p in prefixes if p)})")


def diffusers_config_json(path: str, class_name: str) -> dict | None:
    """A diffusers folder's config.json (None for a single file or a folder without one); one naming another
    `_class_name` than the family's is refused (a missing one is taken as the family's)."""
    config_json = os.path.join(path, "config.json")
    if not (os.path.isdir(path) and os.path.isfile(config_json)):
        return None
    cfg = read_json_file(config_json)
    if cfg.get("_class_name") not in (None, class_name):
        raise CheckpointError(f"{config_json}: _class_name is {cfg['_class_name']!r}, expected {class_name!r}")
    return cfg


def stated_config(
    path: str,
    reader: CheckpointReader,
    diffusers_json: dict | None,
    from_diffusers: Callable[[dict, str], Config],
    config_key: str,
    from_json: Callable[[str], Config],
    from_shapes: Callable[[], Config],
) -> Config:
    """The config a checkpoint states, the first that says one: its folder's config.json (diffusers_json, as
    diffusers_config_json read it; from_diffusers(it, the file's path)), else the JSON our writers keep in the
    safetensors metadata under `config_key` (from_json; a broken one names the file and the key), else
    from_shapes() (the family's inference from the tensors' shapes, under its own names)."""
    if diffusers_json is not None:
        return from_diffusers(diffusers_json, os.path.join(path, "config.json"))
    if config_key in reader.metadata:
        return metadata_config(reader, config_key, from_json)
    return from_shapes()


# A family's name table: (compiled regex of our module path, its module in the other naming, or a tuple of the
# modules a fused one's rows come from in row order), backreferences allowed (r"transformer_blocks.\1.attn.to_q")
NameTable = tuple[tuple[re.Pattern, str | tuple[str, ...]], ...]


def renamed_modules(table: NameTable, module: str) -> tuple[str, ...]:
    """Our module path -> its module in the table's naming, or the modules a fused one's rows come from (in row
    order); a path no entry matches keeps its name."""
    for pattern, theirs in table:
        if m := pattern.fullmatch(module):
            return tuple(m.expand(t) for t in theirs) if isinstance(theirs, tuple) else (m.expand(theirs),)
    return (module,)


def renamed_keys(table: NameTable, key: str) -> tuple[str, ...]:
    """Our tensor key -> its key(s) in the table's naming (renamed_modules of its module, the leaf kept)."""
    module, _, leaf = key.rpartition(".")
    return tuple(f"{name}.{leaf}" for name in renamed_modules(table, module))


def block_count(keys, prefix: str) -> int:
    """How many blocks `keys` hold under `prefix` ("layers.", "transformer_blocks."): the highest index + 1, 0 for
    none (a missing block in between is the key check's to name)."""
    found = {int(m.group(1)) for k in keys if (m := re.match(re.escape(prefix) + r"(\d+)\.", k))}
    return max(found) + 1 if found else 0


def without_prefix(prefix: str) -> Callable[[str], str | None]:
    """load_streaming's rename for a single file under `prefix`: the key without it; keys under any other prefix (a
    bundled VAE or text encoder) are not read."""
    return lambda key: key[len(prefix) :] if key.startswith(prefix) else None


def spec_fp8_rules(path: str, stored: StoredLayout, family: str, title: str) -> KeepRules:
    """The fp8 keep rules of the family in package `family` (its spec.py FP8), imported when a pre-quantized file is
    loaded: the spec names the family's loader, so the loader reads the spec only then; before the spec exists (a
    family being written) one CheckpointError saying what to pass."""
    import importlib

    module = family + ".spec"
    try:
        return importlib.import_module(module).FP8
    except ModuleNotFoundError as e:
        if e.name != module:
            raise
        raise CheckpointError(f"{path}: a pre-quantized ({stored.layout}) {title} file needs the family's fp8 keep "
                              f"rules ({module.replace('.', '/')}.py FP8), or pass fp8_rules=") from None


def fill_meta_model(
    model: Model,
    source: CheckpointReader,
    rename: Callable[[str], str | None],
    path: str,
    dtype: torch.dtype,
    *,
    stored: StoredLayout | None,
    keep_rules: KeepRules | None,
    prepare: Callable[[Model], Callable | None] | None,
    convert: Callable[[str, torch.Tensor], dict[str, torch.Tensor]] | None,
    read_weights: bool,
    loader: str,
) -> Model:
    """A loader's last steps, once `model` is built on `meta` and the file's keys and shapes are checked: the weights
    of `source` (the reader, or the family's view of it under model names) streamed in under `rename`, floating ones
    cast to `dtype`, which becomes model.compute_dtype (read_weights=False: the meta model cast instead, as it would
    load: the memory planner).

    stored (read_stored_layout's answer for `source`): a pre-quantized file is used as it is stored, whatever
    `prepare` asks (fp8 layouts keep the family's `keep_rules` Linears in high precision; GGUF and BFL's layouts
    follow the file alone). prepare / convert: the meta-model and per-tensor hooks (fp8 while loading); loader names
    the public function in the error for a hook given both ways."""
    if stored:  # the file's own layout wins over a requested base precision
        prepare = lambda m: stored_converter(m, stored, keep_rules, dtype, source, path)  # noqa: E731
    convert = prepared_convert(model, prepare, convert, loader)
    if read_weights:
        load_streaming(model, source, rename, dtype=dtype, convert=convert)
    else:  # the memory planner: the model as it would load, on meta, from the file's header alone
        model.to(dtype)
    model.compute_dtype = dtype
    return model
