"""LyCORIS networks (LoKr, LoHa, (IA)^3, LoCon, full/diff ...) through the lycoris-lora package.

The algorithms are LyCORIS' own: the network is built by `lycoris.kohya.create_network` with the
network_args sd-scripts passes it (algo=lokr, factor, preset, dora_wd, ...), and files are
LyCORIS' own state dict (`lora_unet_<path>.lokr_w1`, `.lokr_w2`, `.alpha`, ...), the layout
ComfyUI loads. This module only adapts LyCORIS to our models and trainer:

- Targets: unless a LyCORIS `preset` is given, the network adapts exactly the modules our LoRA
  would (the targets of the architecture's spec + its selection args: networks.lora.lora_targets),
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
import logging
import os
import re

import torch
import torch.nn as nn

from library.io import CheckpointError, CheckpointReader, save_safetensors
from networks.lora import (SELECTION_ARGS, LoRANetwork, _as_bool, _as_float, _as_int, _as_probability, check_lora_args,
                           lora_targets)
from networks.lora_files import build_metadata, is_lycoris_file, lycoris_kind, tensor_hash  # noqa: F401 (the tools import them from here)
from networks.lora_files import lycoris_kohya_names, naming, split_text_encoders
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
PRESET_ONLY_ARGS = {"conv_dim": "convolution layers", "conv_alpha": "convolution layers",
                    "train_norm": "norm layers"}
# Their value types: LyCORIS reads them with int() / float() / str_bool (which takes every word but
# "false" as true) and looks algo up in a dict, so bad values are named here and typed values passed.
LYCORIS_INT_ARGS = {"conv_dim", "block_size", "factor"}
LYCORIS_FLOAT_ARGS = {"conv_alpha", "dropout", "rank_dropout", "module_dropout", "constraint"}
LYCORIS_BOOL_ARGS = LYCORIS_ARGS - LYCORIS_INT_ARGS - LYCORIS_FLOAT_ARGS - {"algo", "preset"}
# Our target-selection args (networks.lora), used to build the target list when no preset is given:
# these and every architecture's block_args (its spec's LORA).
_PRESET_NAME = "_networks_lycoris_targets"  # our per-network preset, registered only while building


class FP8LinearView(nn.Linear):
    """An nn.Linear face of a quantized Linear (FP8Linear, ...) for LyCORIS: no parameters of its
    own, `weight` is the dequantized float32 weight (no grad), forward is the layer's (its stored
    codes, no base grad)."""

    def __init__(self, layer: nn.Module):
        nn.Module.__init__(self)  # not nn.Linear.__init__: it would allocate a weight
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self._layer = [layer]  # a list: not a submodule

    @property
    def weight(self) -> torch.Tensor:
        return self._layer[0].dequantized_weight(torch.float32)

    @property
    def bias(self):
        return self._layer[0].bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return type(self._layer[0]).forward(self._layer[0], x)  # the class forward: the instance one is patched


def is_quantized_linear(module: nn.Module) -> bool:
    """A Linear whose weight is stored quantized (FP8Linear, GGUFLinear, NF4Linear, Int8Linear): it
    computes like a Linear and gives its weight through dequantized_weight(dtype), but is no nn.Linear."""
    return not isinstance(module, nn.Linear) and callable(getattr(module, "dequantized_weight", None))


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


@contextlib.contextmanager
def _quiet_lycoris():
    logger = logging.getLogger("LyCORIS")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def check_lycoris_args(args: dict, arch: str | None = None) -> None:
    """network_args keys LyCORIS or our selection reads, with values of its types; needs no model.
    arch: the selection args are also checked as our LoRA checks them for that architecture."""
    unknown = sorted(k for k in args if k not in LYCORIS_ARGS | SELECTION_ARGS)
    if unknown:
        raise ValueError(f"network_args: unknown key '{unknown[0]}' for lycoris.kohya "
                         f"(known: {', '.join(sorted(LYCORIS_ARGS | SELECTION_ARGS))})")
    typed = _typed_lycoris_args(args)
    if arch is not None:
        check_lora_args(arch, {k: v for k, v in args.items() if k in SELECTION_ARGS})
    algo = str(typed.get("algo", "lora")).lower()
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
    idle = [k for k, layers in PRESET_ONLY_ARGS.items() if typed.get(k) and "preset" not in args]
    if idle:
        raise ValueError(f"network_args '{idle[0]}' acts on {PRESET_ONLY_ARGS[idle[0]]}, and without a LyCORIS "
                         f"'preset' the targets are the LoRA's Linear layers: give a preset that names them, or leave it out")


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
        selection = {k: v for k, v in self.network_args.items() if k in SELECTION_ARGS}
        te = lora_targets(self.arch).kohya_prefix == "lora_te"
        if "preset" not in lyco_args:
            picker = LoRANetwork(model, self.arch, self.rank, network_args=selection, select=False)
            paths = [path for path, _, _ in picker._select(model, selection)]
            kohya.PRESET[_PRESET_NAME] = _target_preset(paths, te)
            lyco_args["preset"] = _PRESET_NAME
        elif selection:
            raise ValueError(f"network_args '{sorted(selection)[0]}' selects our targets; with a LyCORIS "
                             f"'preset' the preset selects them (give one or the other)")
        try:
            with _fp8_views(model) as views, _quiet_lycoris():
                # An empty module, not None, where the model is the other part: lycoris scans the "unet" always
                # (None: AttributeError, every LLM LyCORIS run stopped as its network was built)
                lyco = kohya.create_network(self.multiplier, self.rank, self.alpha, None,
                                            model if te else nn.Module(), nn.Module() if te else model, **lyco_args)
        finally:
            kohya.PRESET.pop(_PRESET_NAME, None)
        loras = lyco.text_encoder_loras + lyco.unet_loras
        if not loras:
            raise ValueError(f"lycoris.kohya: network_args {self.network_args} select no module of the {self.arch} model")
        self.loraplus_lr_ratio = lyco_args.get("loraplus_lr_ratio")
        return [(lora, views.get(lora.org_module[0])) for lora in loras]

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
            lora.apply_to()  # patches the module LyCORIS holds (an FP8LinearView for fp8 targets)
            if lora in self._fp8_targets:
                self._fp8_targets[lora].forward = lora.forward  # the model calls the FP8Linear

    def remove(self):
        self._applied = False
        for lora in self.lycoris_modules():
            lora.restore()
            self._fp8_targets.get(lora, nn.Module()).__dict__.pop("forward", None)

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
        tensors = {k: v.detach().to(dtype) for k, v in self.state_dict().items()}
        header["sshs_model_hash"] = tensor_hash(tensors)
        save_safetensors(tensors, path, header)


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
    from lycoris.modules import get_module, make_module

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
            module = make_module(algo, params, name, base) if algo is not None else None
            if module is None:
                raise CheckpointError(f"LyCORIS module '{name}': LyCORIS does not recognise its keys")
            if getattr(module, "wd", False):  # LyCORIS' loader picks bypass for a non-`Linear` class, which drops dora_wd
                module.bypass_mode = False
            module.multiplier = multiplier
            modules.append((module, target if base is not target else None) if with_fp8 else module)
    return modules





class LycorisDelta:
    """One module of a LyCORIS file, merged into a weight by LyCORIS' own code (tools/merge_lora.py).

    LyCORIS rebuilds the module from the file's tensors around the weight. The merged weight is
    what the module's forward applies (the training and ComfyUI semantics). lycoris-lora 4.1.3's
    get_merged_weight disagrees with its own forward for LoKr and LoHa (alpha / rank applied twice,
    and DoRA's dora_wd), so those take W + get_weight() (the forward's delta; dora_wd through
    LyCORIS' apply_weight_decompose), LoCon takes get_merged_weight (it agrees). Other algos ((IA)^3,
    full/diff with its bias deltas, OFT, ...) are refused: this merge writes weights only."""

    MERGEABLE = ("LokrModule", "LohaModule", "LoConModule")

    def __init__(self, name: str, tensors: dict[str, torch.Tensor]):
        from lycoris.modules import get_module

        self.name = name
        self.algo, params = get_module(tensors, name)
        if self.algo is None:
            raise CheckpointError(f"LyCORIS module '{name}': LyCORIS does not recognise its keys")
        if self.algo.__name__ not in self.MERGEABLE:
            raise CheckpointError(f"LyCORIS module '{name}' is a {self.algo.__name__}: merging supports LoKr, LoHa "
                                  f"and LoCon (with or without dora_wd) only")
        # float32 for the merge math, whatever the file stored
        self.params = tuple(p.float() if isinstance(p, torch.Tensor) and p.is_floating_point() else p for p in params)

    @torch.no_grad()
    def merged(self, weight: torch.Tensor, multiplier: float = 1.0) -> torch.Tensor:
        """weight [out, in] float32 -> the merged weight, float32."""
        from lycoris.modules import make_module

        holder = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
        holder.weight = nn.Parameter(weight.float(), requires_grad=False)
        with _quiet_lycoris():
            module = make_module(self.algo, self.params, self.name, holder).eval()
        module.multiplier = multiplier
        try:
            return self._merged(module, holder.weight).float()
        except RuntimeError as e:
            raise CheckpointError(f"LyCORIS module '{self.name}' does not fit a weight of shape {tuple(weight.shape)}: {e}") from None

    @staticmethod
    def _merged(module, w: torch.Tensor) -> torch.Tensor:
        from lycoris.modules import LoConModule

        if isinstance(module, LoConModule):
            return module.get_merged_weight(module.multiplier, shape=tuple(w.shape), device=w.device)[0]
        adapted = w + module.get_weight(tuple(w.shape)).to(w.dtype) * module.scalar  # LoKr, LoHa
        if module.wd:
            return module.apply_weight_decompose(adapted, module.multiplier)
        return w + module.multiplier * (adapted - w)


def lycoris_deltas(tensors: dict[str, torch.Tensor]) -> dict[str, LycorisDelta]:
    """{kohya module name: LycorisDelta} for every module of a LyCORIS file."""
    return {name: LycorisDelta(name, tensors) for name in sorted({k.split(".")[0] for k in tensors})}
