"""LyCORIS networks (LoKr, LoHa, LoCon, full/diff, OFT ...) through the lycoris-lora package.

The algorithms are LyCORIS' own: the network is built by `lycoris.kohya.create_network` with the
network_args sd-scripts passes it (algo=lokr, factor, preset, dora_wd, ...), and files are
LyCORIS' own state dict (`lora_unet_<path>.lokr_w1`, `.lokr_w2`, `.alpha`, ...), the layout
ComfyUI loads. This module only adapts LyCORIS to our models and trainer:

- Targets: unless a LyCORIS `preset` is given, the network adapts exactly the modules our LoRA
  would (the targets of the architecture's spec + its selection args: networks.lora_args.lora_targets),
  handed to LyCORIS as a preset of exact module names.
- quantized bases (fp8, GGUF, nf4 / int8): LyCORIS wraps only `nn.Linear` (and a class literally
  named `Fp8Linear` with per-channel scales). Our FP8Linear (GGUFLinear, NF4Linear, Int8Linear) is
  neither, so while LyCORIS builds its modules each such target is shown to it as an
  `FP8LinearView`: an nn.Linear subclass with no parameters whose
  `weight` is the dequantized float32 weight (a fresh tensor without grad, for weight-decomposed
  algos and merging) and whose forward is the FP8Linear's. LyCORIS treats a non-`Linear` linear
  class as quantized and runs it in bypass mode (base output + delta(x)), so the fp8 codes are
  never rebuilt into a full weight per step and no gradient reaches them.
- bypass_mode defaults to true for every base: LyCORIS' rebuild mode computes
  ((W + dW) - W) in the base weight's dtype, which rounds a bf16 base's small deltas away.

Precision: LyCORIS parameters are float32; in bypass mode LyCORIS casts them to the input dtype
(the compute dtype) for the delta.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import io
import logging
import os
import re
import sys

import torch
import torch.nn as nn

from library.io import CheckpointError, CheckpointReader
from networks.lora import LoRANetwork
from networks.lycoris_views import (MERGEABLE, FP8LinearView, check_lycoris_weight,  # noqa: F401
                                    dora_at_comfyui_strength, is_quantized_linear, lycoris_delta, lycoris_wrapped,
                                    merged_weight)
from networks.lora_args import SELECTION_ARGS, _as_bool, _as_float, _as_int, _as_probability, check_lora_args, lora_targets
from networks.lora_files import build_metadata, is_lycoris_file, lycoris_kind, tensor_hash  # noqa: F401 (the tools import them from here)
from networks.lora_files import lycoris_kohya_names, naming, split_text_encoders, write_lora_tensors
from networks.lora_reader import leave_out_text_encoders, without_base_only

# network_args LyCORIS' create_network reads (lycoris-lora 4.1.3, lycoris/kohya.py), passed as given.
LYCORIS_ARGS = {
    "algo", "conv_dim", "conv_alpha", "dropout", "rank_dropout", "module_dropout", "use_tucker",
    "use_cp", "use_conv_cp", "disable_conv_cp", "use_scalar", "block_size", "train_norm", "constraint",
    "rescaled", "dora_wd", "wd_on_output", "full_matrix", "bypass_mode", "rs_lora",
    "unbalanced_factorization", "decompose_both", "factor", "preset",
}  # not loraplus_*: our param_groups do not split LyCORIS parameters, so they are refused as unknown;
# not rank_dropout_scale: its modules take it, but create_network never reads it (it would be dropped)
# Without a `preset` the targets are our LoRA's, Linear layers named one by one: these would act on
# no module (convolutions; norm layers), so they need a preset that names such modules.
# Algos whose modules (lycoris-lora 4.1.3) never read rank_dropout, though create_network hands it to them; LoKr's
# bypass forward neither (its weight rebuild does).
NO_RANK_DROPOUT = ("ia3", "dylora", "tlora", "boft")
# Algos with a bypass forward (base output + delta(x)), the only LyCORIS forward of theirs that applies `dropout`.
BYPASS_ALGOS = ("lora", "locon", "loha", "lokr")
PRESET_ONLY_ARGS = {"conv_dim": "convolution layers", "conv_alpha": "convolution layers"}
# Algos refused before caching, algo -> why: each trains what its file does not apply, or writes a file that
# our readers (network_weights, generate, merge_lora, lora_info) cannot read back (lycoris-lora 4.1.3).
REFUSED_ALGOS = {
    "dylora": "LyCORIS' DyLoRA trains a random rank every forward (samples and validation too) at alpha / (rank + 1), "
              "but saves a plain LoRA that every loader applies at alpha / network_dim (1/4 to 1/16 of what was trained)",
    "glora": "its file (a1 / a2 / b1 / b2) reads as no LyCORIS file here: network_weights, generate and lora_info "
             "take it for a broken LoRA",
    "tlora": "its file (p_layer / q_layer / lambda_layer) reads as no LyCORIS file here (network_weights, generate, "
             "lora_info), nor in ComfyUI",
    "ia3": "LyCORIS' own loader cannot rebuild its modules from the file (IA3Module.make_module_from_state_dict), so "
           "generate cannot apply it, nor can ComfyUI",
}
# Their value types: LyCORIS reads them with int() / float() / str_bool (which takes every word but
# "false" as true) and looks algo up in a dict, so bad values are named here and typed values passed.
LYCORIS_INT_ARGS = {"conv_dim", "block_size", "factor"}
LYCORIS_FLOAT_ARGS = {"conv_alpha", "dropout", "rank_dropout", "module_dropout", "constraint"}
LYCORIS_BOOL_ARGS = LYCORIS_ARGS - LYCORIS_INT_ARGS - LYCORIS_FLOAT_ARGS - {"algo", "preset"}
# Our target-selection args (networks.lora), used to build the target list when no preset is given:
# these and every architecture's block_args (its spec's LORA).
_PRESET_NAME = "_networks_lycoris_targets"  # our per-network preset, registered only while building


@contextlib.contextmanager
def _fp8_views(model: nn.Module):
    """Within the block, every FP8Linear of `model` is replaced by its FP8LinearView; yields
    {view: fp8 layer}. The model tree is restored on exit, whatever happens."""
    swapped = []
    for path, module in list(model.named_modules()):
        if is_quantized_linear(module):
            parent_path, _, name = path.rpartition(".")
            parent = model.get_submodule(parent_path)
            view = FP8LinearView(module)
            parent._modules[name] = view
            swapped.append((parent, name, module, view))
    try:
        yield {view: layer for _, _, layer, view in swapped}
    finally:
        for parent, name, layer, _ in swapped:
            parent._modules[name] = layer


# LoHa's and LoKr's modules print this once per module (hundreds of lines at full size) whenever `dropout` is set,
# though their bypass forward, the only one check_lycoris_args lets dropout train with, does apply it.
_FALSE_DROPOUT_WARNING = "[WARN]LoHa/LoKr haven't implemented normal dropout yet."


@contextlib.contextmanager
def _quiet_lycoris():
    """LyCORIS' info logging off, and its false dropout print dropped; any other line it prints passes through."""
    logger = logging.getLogger("LyCORIS")
    level = logger.level
    logger.setLevel(logging.WARNING)
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            yield
    finally:
        logger.setLevel(level)
        kept = [line for line in printed.getvalue().splitlines(keepends=True) if line.strip() != _FALSE_DROPOUT_WARNING]
        sys.stdout.write("".join(kept))


def check_lycoris_args(args: dict, arch: str | None = None, base_precision: str = "bf16",
                       precision_key: str = "base_precision") -> None:
    """network_args keys LyCORIS or our selection reads, with values of its types, and a `preset` without our
    selection args (one or the other selects the targets); needs no model files.
    arch: the selection args are also checked as our LoRA checks them for that architecture, and a `preset`
    against its released transformer's blocks. base_precision: how the frozen base is stored, which the
    config said with `precision_key` (base_precision, or fp8_base)."""
    unknown = sorted(k for k in args if k not in LYCORIS_ARGS | SELECTION_ARGS)
    if unknown:
        raise ValueError(f"network_args: unknown key '{unknown[0]}' for lycoris.kohya "
                         f"(known: {', '.join(sorted(LYCORIS_ARGS | SELECTION_ARGS))})")
    typed = _typed_lycoris_args(args)
    selection = sorted(k for k in args if k in SELECTION_ARGS)
    if arch is not None:
        check_lora_args(arch, {k: args[k] for k in selection})
    if "preset" in args and selection:
        raise ValueError(f"network_args '{selection[0]}' selects our targets; with a LyCORIS "
                         f"'preset' the preset selects them (give one or the other)")
    algo = str(typed.get("algo", "lora")).lower()
    if algo in REFUSED_ALGOS:
        raise ValueError(f"network_args 'algo={algo}' is refused: {REFUSED_ALGOS[algo]}; use algo=lokr, loha or locon")
    _check_read_back(typed, algo)
    _check_full(typed, algo, base_precision, precision_key)
    bypass = typed.get("bypass_mode", _default_bypass(typed))
    lokr_bypass = algo == "lokr" and bypass
    if typed.get("rank_dropout") and (algo in NO_RANK_DROPOUT or lokr_bypass):
        where = "LyCORIS' LoKr bypass forward (the default here)" if algo == "lokr" else f"LyCORIS' {algo} module"
        raise ValueError(f"network_args 'rank_dropout' with algo={algo}: {where} never reads it (it would train "
                         f"without rank dropout): " + ("set 'bypass_mode=false', or use " if algo == "lokr" else "use ")
                         + "'dropout' / 'module_dropout'")
    if typed.get("dropout") and algo in BYPASS_ALGOS and not bypass:  # rebuild: W + delta, no dropout anywhere
        why = "dora_wd=true needs that forward, so leave dropout out" if typed.get("dora_wd") else "set 'bypass_mode=true' or leave it out"
        raise ValueError(f"network_args 'dropout' (network_dropout) with algo={algo}: LyCORIS' weight-rebuild forward "
                         f"(bypass_mode=false) never applies it (it would train without dropout): {why}")
    if typed.get("train_norm"):  # NormModule takes nn.LayerNorm / nn.GroupNorm (or a `_norm` holder): no model here has one
        raise ValueError("network_args 'train_norm': LyCORIS trains only nn.LayerNorm / nn.GroupNorm layers, and this "
                         "model's norms are its own classes, so it would train no norm: leave it out")
    idle = [k for k, layers in PRESET_ONLY_ARGS.items() if typed.get(k) and "preset" not in args]
    if idle:
        raise ValueError(f"network_args '{idle[0]}' acts on {PRESET_ONLY_ARGS[idle[0]]}, and without a LyCORIS "
                         f"'preset' the targets are the LoRA's Linear layers: give a preset that names them, or leave it out")
    if "preset" in args and arch is not None:
        _check_preset_reaches_blocks(str(args["preset"]), arch)


def _check_read_back(typed: dict, algo: str) -> None:
    """Args whose files LyCORIS' loader (generate, merge_lora) misreads, or that train another scale than the file
    applies: a ValueError naming the arg."""
    if algo == "lokr" and typed.get("rs_lora") and typed.get("full_matrix"):
        raise ValueError("network_args 'rs_lora=true' with algo=lokr and full_matrix=true: LyCORIS trains full-matrix "
                         "LoKr at scale sqrt(network_dim), ComfyUI and LyCORIS' own loader apply its file at 1 "
                         "(1/sqrt(rank) of what was trained): leave rs_lora out")
    if algo == "lokr" and typed.get("unbalanced_factorization"):
        raise ValueError("network_args 'unbalanced_factorization=true': LyCORIS' loader (generate, merge_lora) infers "
                         "LoKr's factors from the saved shapes as balanced ones and cannot read the file back: leave it out")
    if typed.get("dora_wd") and typed.get("wd_on_output") is False:
        raise ValueError("network_args 'wd_on_output=false' with dora_wd=true: LyCORIS' loader (generate, merge_lora) "
                         "reads dora_scale as the output axis's and cannot read the file back: leave wd_on_output out")


def _check_full(typed: dict, algo: str, base_precision: str, precision_key: str) -> None:
    """algo=full replaces each target's weight by a trained full-size copy: no bypass, and a weight to copy."""
    if algo != "full":
        return
    if typed.get("bypass_mode"):
        raise ValueError("network_args 'bypass_mode=true' with algo=full: LyCORIS' full module has no bypass forward "
                         "(it refuses it when the network is built): leave bypass_mode out")
    if base_precision != "bf16":
        fix = 'base_precision = "bf16"' if precision_key == "base_precision" else "fp8_base = false"
        raise ValueError(f"network_args 'algo=full' trains a full copy of each target weight, which needs a high-precision "
                         f"base; '{precision_key}' stores it in {base_precision}: set {fix}")


def _preset_of(value: str) -> dict:
    """A LyCORIS preset by name, or read from its file as create_network reads it, with LyCORIS' defaults for the
    keys it leaves out: create_network would keep the previous network's values for those (ours: the LoRA's
    targets). An unreadable file is a ValueError."""
    from lycoris.config import PRESET
    from lycoris.utils.preset import read_preset

    if value in PRESET:
        preset = PRESET[value]
    else:
        said = io.StringIO()
        with contextlib.redirect_stdout(said):  # read_preset prints its reason and returns None
            preset = read_preset(value)
        if preset is None:
            raise ValueError(f"network_args 'preset': {value}: not a LyCORIS preset file ({' '.join(said.getvalue().split())})")
    # LycorisNetworkKohya's class defaults: the "full" preset's targets, no algo maps, regex names, no exclusions
    return {**PRESET["full"], "module_algo_map": {}, "name_algo_map": {}, "use_fnmatch": False, "exclude_name": [], **preset}


def _block_classes(model: nn.Module) -> list[str]:
    return sorted({type(block).__name__ for block in model.swappable_blocks()})


def _block_linears(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """{path of each Linear inside a transformer block (swappable_blocks): the class names from the model down to it}."""
    blocks = {id(block) for block in model.swappable_blocks()}
    modules = dict(model.named_modules())
    out = {}
    for path, module in modules.items():
        if isinstance(module, nn.Linear) or is_quantized_linear(module):
            parts = path.split(".")
            chain = [modules[".".join(parts[:i])] for i in range(len(parts) + 1)]  # "" is the model
            if any(id(m) in blocks for m in chain):
                out[path] = tuple(type(m).__name__ for m in chain)
    return out


@functools.cache
def _released_blocks(arch: str) -> tuple[list[str], dict[str, tuple[str, ...]]] | None:
    """(_block_classes, _block_linears) of the architecture's released transformer, built on meta from the memory
    planner's first preset config (no files, the classes every size shares); None for an arch without one (llm)."""
    from library.models.registry import arch_spec
    from library.models.spec import load_symbol

    planner = arch_spec(arch).planner
    if planner is None or not planner.presets:
        return None
    config = load_symbol(next(iter(planner.presets.values())).transformer)
    with torch.device("meta"):
        model = load_symbol(planner.transformer)(config)
    return _block_classes(model), _block_linears(model)


def _preset_selects(preset: dict, path: str, classes: tuple[str, ...]) -> bool:
    """Whether LyCORIS (kohya.py create_modules) adapts the transformer's Linear at `path` under `preset`: a module
    from the model down to it is of a class the preset names, or the path matches a name (re.match, or fnmatch)."""
    names = preset.get("unet_target_name") or []
    match = fnmatch.fnmatch if preset.get("use_fnmatch") else re.match
    named = set(preset.get("unet_target_module") or [])
    return bool(named.intersection(classes)) or path in names or any(match(n, path) for n in names)


def _no_block_error(preset: str, arch: str, block_classes: list[str], adapted: str = "") -> ValueError:
    return ValueError(f"network_args 'preset': {preset!r} adapts {adapted}no Linear inside the {arch} model's "
                      f"transformer blocks (LyCORIS selects by class name; the blocks are {', '.join(block_classes)}): "
                      f"give a preset file whose unet_target_module names them, or leave preset out to train the "
                      f"LoRA's targets")


def _check_preset_reaches_blocks(preset: str, arch: str) -> None:
    """LyCORIS' presets name diffusers' block classes, which ours are not: a preset that adapts
    no Linear of the released model's blocks is refused before caching. Diffusion transformers only (the "unet")."""
    released = _released_blocks(arch)
    if released is None:
        return
    block_classes, linears = released
    table = _preset_of(preset)
    if not any(_preset_selects(table, path, classes) for path, classes in linears.items()):
        raise _no_block_error(preset, arch, block_classes)


def lycoris_targets(model: nn.Module, arch: str, rank: int, network_args: dict) -> list[str] | None:
    """The paths of the Linears LycorisNetwork hands LyCORIS: our LoRA's targets under the selection args, with
    networks.lora's errors (block indices past the model's blocks, a pattern matching no module, a selection of
    none); None where a `preset` selects them. Reads no weight: on a meta model it is the run's check before caching
    (LyCORIS itself cannot build on one: dora_wd and algo=full copy the target weights)."""
    if "preset" in network_args:
        return None
    selection = {k: v for k, v in network_args.items() if k in SELECTION_ARGS}
    picker = LoRANetwork(model, arch, rank, network_args=selection, select=False)
    return [path for path, _, _ in picker._select(model, selection)]


class _MetaCopiesStayMeta(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.cpu and args[0].is_meta:
            return args[0]
        return func(*args, **(kwargs or {}))


def _cpu_copies_of_meta_stay_meta(model: nn.Module):
    """LyCORIS copies a target's weight to the CPU as it builds and applies (dora_wd's weight norms, algo=full's
    frozen copy): on a meta model (the memory planner's, a run's plan before caching) `.cpu()` raised "Cannot copy out of
    meta tensor". There the copy stays on meta: its shape is all a plan needs."""
    on_meta = any(t.is_meta for t in (*model.parameters(), *model.buffers()))  # (an FP8Linear's codes are a buffer)
    return _MetaCopiesStayMeta() if on_meta else contextlib.nullcontext()


def _typed_lycoris_args(args: dict) -> dict:
    """The LYCORIS_ARGS of `args`, each checked and converted to the type LyCORIS reads; a bad value
    is a ValueError naming the key, the value and what is allowed."""
    from lycoris.config import PRESET
    from lycoris.wrapper import network_module_dict

    typed = {}
    for key, value in args.items():
        if key in LYCORIS_INT_ARGS:
            typed[key] = _as_int(key, value)
        elif key in LYCORIS_FLOAT_ARGS:
            typed[key] = (_as_probability if key.endswith("dropout") else _as_float)(key, value)
        elif key in LYCORIS_BOOL_ARGS:
            typed[key] = _as_bool(key, value)
        elif key == "algo" and str(value).lower() not in network_module_dict:
            raise ValueError(f"network_args 'algo': {value!r} is not a LyCORIS algo "
                             f"(allowed: {', '.join(sorted(network_module_dict))})")
        elif key == "preset" and value not in PRESET and not os.path.isfile(str(value)):
            raise ValueError(f"network_args 'preset': {value!r} is neither a LyCORIS preset "
                             f"({', '.join(sorted(PRESET))}) nor a preset file")
        elif key in LYCORIS_ARGS:
            typed[key] = value
    return typed


def _default_bypass(lyco_args: dict) -> bool:
    """Bypass (base output + delta(x)) where LyCORIS has it and it means the same: not for
    dora_wd, which LyCORIS' bypass forward ignores on an nn.Linear; not for algos without one."""
    from lycoris.utils import str_bool

    dora = str_bool(lyco_args.get("dora_wd", False))
    if dora and str_bool(lyco_args.get("bypass_mode", False)):
        raise ValueError("network_args 'bypass_mode=true' with 'dora_wd=true': LyCORIS' bypass forward "
                         "ignores dora_wd (it would train a plain update but save dora_scale)")
    return not dora and str(lyco_args.get("algo", "lora")).lower() in BYPASS_ALGOS


def _target_preset(paths: list[str], te: bool) -> dict:
    """A LyCORIS preset naming exactly `paths` (anchored regexes), no class-based targets."""
    names = [re.escape(p) + "$" for p in paths]
    preset = {"enable_conv": False, "unet_target_module": [], "unet_target_name": [],
              "text_encoder_target_module": [], "text_encoder_target_name": [],
              "module_algo_map": {}, "name_algo_map": {}, "use_fnmatch": False, "exclude_name": []}
    preset["text_encoder_target_name" if te else "unet_target_name"] = names
    return preset


class LycorisNetwork(nn.Module):
    """LyCORIS modules for one model, registered under their kohya names (state_dict() is the
    file layout). Same interface as networks.lora.LoRANetwork for the trainer and the tools."""

    network_module = "lycoris.kohya"

    def __init__(self, model: nn.Module, arch: str, rank: int, alpha=None, multiplier=1.0,
                 network_args: dict | None = None):
        super().__init__()
        self.arch, self.rank, self.multiplier = arch, int(rank), multiplier
        self.alpha = float(self.rank if alpha is None or alpha == 0 else alpha)
        self.network_args = dict(network_args or {})
        self._model = [model]
        self._fp8_targets: dict[nn.Module, nn.Module] = {}  # LyCORIS module -> the quantized Linear it wraps
        self._applied = False
        check_lycoris_args(self.network_args, arch)
        self._add_all(self._build(model))
        self.eval()

    def _build(self, model: nn.Module):
        from lycoris import kohya

        lyco_args = _typed_lycoris_args(self.network_args)
        lyco_args.setdefault("bypass_mode", _default_bypass(lyco_args))
        te = lora_targets(self.arch).kohya_prefix == "lora_te"
        targets = lycoris_targets(model, self.arch, self.rank, self.network_args)
        preset = _preset_of(lyco_args["preset"]) if targets is None else _target_preset(targets, te)
        kohya.PRESET[_PRESET_NAME] = preset
        lyco_args["preset"] = _PRESET_NAME
        try:
            with _fp8_views(model) as views, _quiet_lycoris(), _cpu_copies_of_meta_stay_meta(model):
                # An empty module, not None, where the model is the other part: lycoris scans the "unet" always
                # (None: AttributeError, every LLM LyCORIS run stopped as its network was built)
                lyco = kohya.create_network(self.multiplier, self.rank, self.alpha, None,
                                            model if te else nn.Module(), nn.Module() if te else model, **lyco_args)
        finally:
            kohya.PRESET.pop(_PRESET_NAME, None)
        loras = lyco.text_encoder_loras + lyco.unet_loras
        for lora in loras:
            dora_at_comfyui_strength(lora)
        if not loras:
            raise ValueError(f"lycoris.kohya: network_args {self.network_args} select no module of the {self.arch} model")
        pairs = [(lora, views.get(lora.org_module[0])) for lora in loras]
        self._check_built(model, pairs)
        self.loraplus_lr_ratio = lyco_args.get("loraplus_lr_ratio")
        return pairs

    def _check_built(self, model: nn.Module, pairs: list) -> None:
        """What only the built modules tell (after caching in a run): a preset that adapts nothing inside the
        model's blocks, algo=full on a quantized Linear (a GGUF base), LoKr that layer shapes force into full-matrix
        mode under rs_lora (the rank against the module's Kronecker factors)."""
        from lycoris.modules import FullModule, LokrModule

        if "preset" in self.network_args and callable(getattr(model, "swappable_blocks", None)):
            inside = {id(m) for block in model.swappable_blocks() for m in block.modules()}
            if not any(id(fp8 or lora.org_module[0]) in inside for lora, fp8 in pairs):
                raise _no_block_error(str(self.network_args["preset"]), self.arch, _block_classes(model),
                                      f"{len(pairs)} modules but ")
        quantized = [lora.lora_name for lora, fp8 in pairs if fp8 is not None and isinstance(lora, FullModule)]
        if quantized:
            raise ValueError(f"network_args 'algo=full' trains a full copy of each target weight; '{quantized[0]}' "
                             f"is stored quantized ({len(quantized)} such modules): train on a high-precision base")
        full = [lora.lora_name for lora, _ in pairs if isinstance(lora, LokrModule) and lora.rs_lora and lora.use_w1 and lora.use_w2]
        if full:
            raise ValueError(f"network_args 'rs_lora=true' with algo=lokr: '{full[0]}' is full-matrix LoKr ({len(full)} "
                             f"such modules: network_dim {self.rank} is at least half the larger side of its lokr_w2), which "
                             f"LyCORIS trains at scale sqrt(network_dim) and ComfyUI and LyCORIS' loader apply at 1: leave "
                             f"rs_lora out, or lower network_dim")

    def _add_all(self, loras):
        for lora, fp8 in loras:
            if fp8 is not None:
                self._fp8_targets[lora] = fp8
            self.add_module(lora.lora_name, lora)
            lora.train(self.training)

    # -- switching ---------------------------------------------------------------------------

    def lycoris_modules(self) -> list[nn.Module]:
        return list(self.children())

    def apply(self):
        """Route each target through its LyCORIS module and freeze the base model."""
        self._model[0].requires_grad_(False)
        self._applied = True
        for lora in self.lycoris_modules():
            with _cpu_copies_of_meta_stay_meta(lora):  # algo=full keeps a CPU copy of the weight it replaces
                lora.apply_to()  # patches the module LyCORIS holds (an FP8LinearView for fp8 targets)
            if lora in self._fp8_targets:  # the model calls the FP8Linear; an earlier network's forward stays inside
                layer = self._fp8_targets[lora]
                lora.org_module[0]._patched = layer.__dict__.get("forward")
                layer.forward = lora.forward

    def remove(self):
        self._applied = False
        for lora in self.lycoris_modules():
            lora.restore()
            if lora in self._fp8_targets:  # back to what it was: an earlier network's forward, or the class's
                layer, view = self._fp8_targets[lora], lora.org_module[0]
                layer.__dict__.pop("forward", None)
                if view._patched is not None:
                    layer.forward = view._patched
                view._patched = None

    def set_multiplier(self, multiplier: float):
        for lora in self.lycoris_modules():
            lora.multiplier = multiplier

    # -- training ----------------------------------------------------------------------------

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    def param_groups(self, lr: float) -> list[dict]:
        return [{"name": "lycoris", "params": self.trainable_parameters(), "lr": lr}]

    # -- files -------------------------------------------------------------------------------

    @torch.no_grad()
    def load_weights(self, source, strict: bool = True):
        """Load a LyCORIS file (path or tensor dict) into this network's modules. Every key must
        belong to a module of the network; strict: every module must be in the file."""
        name = source if isinstance(source, str) else "state dict"
        source = lycoris_kohya_names(_tensors_of(source), lora_targets(self.arch).kohya_prefix)
        own = self.state_dict()
        foreign = [k for k in source if k not in own]
        if foreign:
            raise CheckpointError(f"{name}: key '{foreign[0]}' is not a tensor of this LyCORIS network "
                                  f"({self.network_args or 'default args'}; is it the same algo and targets?)")
        modules = {k.split(".")[0] for k in own}
        missing = sorted(m for m in modules if not any(k.startswith(m + ".") for k in source))
        if strict and missing:
            raise CheckpointError(f"{name}: no weights for LyCORIS module '{missing[0]}' ({len(missing)} missing)")
        bad = [k for k in source if source[k].shape != own[k].shape]
        if bad:
            raise CheckpointError(f"{name}: '{bad[0]}' has shape {tuple(source[bad[0]].shape)}, the network expects {tuple(own[bad[0]].shape)}")
        self.load_state_dict({**own, **source})
        return {"loaded": len(modules) - len(missing), "added": 0, "missing": len(missing)}

    def describe_loaded(self, counts: dict) -> str:
        """LoRANetwork's line naming the modules' LyCORIS kinds ('LyCORIS lokr modules', not 'LoRA
        modules'), from the modules: a network read from a file has no algo in its network_args."""
        kinds = sorted({type(m).__name__.removesuffix("Module").lower() for m in self.lycoris_modules()})
        return LoRANetwork.describe_loaded(counts, kind=f"LyCORIS {' / '.join(kinds)}")

    @classmethod
    def from_weights(cls, model: nn.Module, arch: str, source, multiplier: float = 1.0) -> "LycorisNetwork":
        """A network of exactly the modules a LyCORIS file names, rebuilt by LyCORIS from the
        file (any algo and shape it holds); for generate and the tools. As LoRANetwork.from_weights reads
        a LoRA: sd-scripts' text-encoder modules and the base's modules a variant lacks are left out, each
        with one warning, and an error names the file."""
        name = source if isinstance(source, str) else "state dict"
        source, te = split_text_encoders(_tensors_of(source))
        source = lycoris_kohya_names(source, lora_targets(arch).kohya_prefix)  # ai-toolkit's names (convert_lora --to comfy)
        leave_out_text_encoders(name, te, bool(source), arch, stacklevel=2)
        source = without_base_only(name, source, {}, arch)
        network = cls.__new__(cls)
        nn.Module.__init__(network)
        network.arch, network.rank, network.alpha, network.multiplier = arch, 0, 0.0, multiplier
        network.network_args, network.loraplus_lr_ratio = {}, None
        network._model, network._fp8_targets, network._applied = [model], {}, False
        try:
            network._add_all(read_lycoris_modules(model, source, multiplier, lora_targets(arch).kohya_prefix, with_fp8=True))
        except CheckpointError as e:
            raise naming(name, e) from None
        network.eval()
        return network

    def save(self, path: str, dtype=torch.float32, metadata: dict | None = None):
        """LyCORIS' own keys (`lora_unet_<path>.lokr_w1` ...), as its save_weights writes them."""
        header = build_metadata(network_module=self.network_module, network_dim=self.rank,
                                network_alpha=self.alpha, network_args=self.network_args)
        header.update(metadata or {})
        # the one writer of LoRA files: sshs_model_hash and modelspec.hash_sha256 of these tensors, a stale
        # sshs_legacy_hash dropped
        write_lora_tensors({k: v.detach().to(dtype) for k, v in self.state_dict().items()}, path, header)


def _tensors_of(source) -> dict[str, torch.Tensor]:
    """A tensor dict as given, or a file's tensors read through CheckpointReader (a truncated or
    non-safetensors file is one CheckpointError naming it)."""
    return dict(CheckpointReader(source).items()) if isinstance(source, str) else source


def read_lycoris_modules(model: nn.Module, tensors: dict[str, torch.Tensor], multiplier: float = 1.0,
                         prefix: str = "lora_unet", with_fp8: bool = False) -> list:
    """LyCORIS modules rebuilt from a file's tensors by LyCORIS itself (any algo it knows), each
    bound to the model module it names (FP8Linears through an FP8LinearView); not applied.
    with_fp8: (module, the FP8Linear it wraps or None) pairs, as LycorisNetwork keeps them. Keys in kohya names or
    ai-toolkit's `diffusion_model.<path>.<part>` (lycoris_kohya_names)."""
    from lycoris.modules import get_module

    tensors = lycoris_kohya_names(tensors, prefix)
    names = sorted({k.split(".")[0] for k in tensors})
    by_name = {f"{prefix}_{p}".replace(".", "_"): m for p, m in model.named_modules() if p}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise CheckpointError(f"LyCORIS module '{unknown[0]}' names no module of this model")
    modules = []
    with _quiet_lycoris():
        for name in names:
            target = by_name[name]
            base = FP8LinearView(target) if is_quantized_linear(target) else target
            algo, params = get_module(tensors, name)
            module = _rebuilt(algo, params, name, base, target) if algo is not None else None
            if module is None:
                raise CheckpointError(f"LyCORIS module '{name}': LyCORIS does not recognise its keys")
            if getattr(module, "wd", False):  # LyCORIS' loader picks bypass for a non-`Linear` class, which drops dora_wd
                module.bypass_mode = False
            module.multiplier = multiplier
            modules.append((module, target if base is not target else None) if with_fp8 else module)
    return modules


def _rebuilt(algo, params, name: str, base: nn.Module, target: nn.Module):
    """LyCORIS' make_module, its failures (a shape or signature error deep in LyCORIS) one CheckpointError naming
    the module: LyCORIS' loader re-infers LoKr's factors and DoRA's axis from the shapes, which some files defeat."""
    from lycoris.modules import make_module

    if algo.__name__ == "FullModule" and isinstance(base, FP8LinearView):  # LyCORIS: "Quant Linear is not supported"
        raise CheckpointError(f"LyCORIS module '{name}' (FullModule): a whole delta of the weight, which an fp8 base's codes "
                              f"cannot take: render on a bf16 base (base_precision bf16), or merge the file into a bf16 "
                              f"checkpoint with tools/merge_lora.py")
    if "alpha" in algo.weight_list and params[algo.weight_list.index("alpha")] is None:
        # No alpha stored: rank, scale 1, as ComfyUI reads the file and as LyCORIS' modules read an alpha of 0;
        # its loader's float(None) refused the file
        at = algo.weight_list.index("alpha")
        params = (*params[:at], torch.tensor(0.0), *params[at + 1:])
    try:
        # dora_wd and algo=full copy the weight to the CPU as they build: on meta (generate.py's check) it stays meta
        with _cpu_copies_of_meta_stay_meta(target):
            module = make_module(algo, params, name, base)
    except (RuntimeError, TypeError, ValueError, AttributeError, KeyError) as e:  # AttributeError: a low-rank
        # lokr_w2 its shapes make it build full-matrix (another trainer's file)
        on = f" on a weight of shape {tuple(base.weight.shape)}" if isinstance(base, nn.Linear) else ""
        raise CheckpointError(f"LyCORIS module '{name}' ({algo.__name__}): LyCORIS' loader cannot rebuild it{on} "
                              f"({' '.join(str(e).split())}): a file for another model, or one it misreads (LoKr with "
                              f"unbalanced_factorization, DoRA with wd_on_output=false)") from None
    dora_at_comfyui_strength(module)
    return module


class LycorisDelta:
    """One module of a LyCORIS file, merged into a weight by LyCORIS' own code (tools/merge_lora.py).

    LyCORIS rebuilds the module from the file's tensors around the weight. The merged weight is
    what the module's forward applies (the training and ComfyUI semantics). lycoris-lora 4.1.3's
    get_merged_weight disagrees with its own forward for LoKr and LoHa (alpha / rank applied twice,
    and DoRA's dora_wd), so those take W + get_weight() (the forward's delta; dora_wd through
    LyCORIS' apply_weight_decompose, at ComfyUI's strength: dora_at_comfyui_strength), LoCon takes
    get_merged_weight (it agrees). The full type's `diff` / `diff_b` merge as whole deltas
    (networks/lora_reader.py WholeDelta), never here; other algos ((IA)^3, OFT, ...) are refused."""

    MERGEABLE = MERGEABLE

    def __init__(self, name: str, tensors: dict[str, torch.Tensor], source: str = "LyCORIS file"):
        """source: the file, as errors name it."""
        from lycoris.modules import get_module

        self.name, self.source = name, source
        self.weight_decomposed = f"{name}.dora_scale" in tensors  # dora_wd: the delta depends on the weight
        self.algo, params = get_module(tensors, name)
        if self.algo is None:
            raise CheckpointError(f"{source}: LyCORIS module '{name}': LyCORIS does not recognise its keys")
        if self.algo.__name__ not in self.MERGEABLE:
            raise CheckpointError(f"{source}: LyCORIS module '{name}' is a {self.algo.__name__}: merging supports LoKr, "
                                  f"LoHa and LoCon (with or without dora_wd) and full (diff / diff_b) only")
        # float32 for the merge math, whatever the file stored
        self.params = tuple(p.float() if isinstance(p, torch.Tensor) and p.is_floating_point() else p for p in params)

    @torch.no_grad()
    def merged(self, weight: torch.Tensor, multiplier: float = 1.0) -> torch.Tensor:
        """weight [out, in] float32 -> the merged weight, float32."""
        holder = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
        holder.weight = nn.Parameter(weight.float(), requires_grad=False)
        try:
            with _quiet_lycoris():
                module = _rebuilt(self.algo, self.params, self.name, holder, holder).eval()
        except CheckpointError as e:
            raise naming(self.source, e) from None
        module.multiplier = multiplier
        try:
            return self._merged(module, holder.weight).float()
        except RuntimeError as e:
            raise CheckpointError(f"{self.source}: LyCORIS module '{self.name}' does not fit a weight of shape "
                                  f"{tuple(weight.shape)}: {e}") from None
        finally:
            # LyCORIS' module is a reference cycle (its hooks hold its bound methods) that holds the holder: left
            # there, each merged weight stayed in memory until Python's cycle collector ran, several modules later
            holder.weight = None

    _merged = staticmethod(merged_weight)


def lycoris_deltas(tensors: dict[str, torch.Tensor], source: str = "LyCORIS file") -> dict[str, LycorisDelta]:
    """{kohya module name: LycorisDelta} for every module of a LyCORIS file (`source`, as errors name it)."""
    return {name: LycorisDelta(name, tensors, source) for name in sorted({k.split(".")[0] for k in tensors})}
