"""LoRA network: low-rank adapters applied unmerged on top of a frozen base model.

One adapter per target module: a Linear-like module's is a `LoRAModule` (networks/lora_module.py: the forward
patch, DoRA, precision), a packed weight's (a mixture's experts) a `PackedLoRAModule` inside its packed_bmm
(networks/lora_packed.py). Which modules get a LoRA is decided in one place per architecture, the targets of its spec
(library/models/<folder>/spec.py, LORA), refined by sd-scripts-style network_args (`LoRANetwork`).
"""

from __future__ import annotations

import math
import re

import torch
import torch.nn as nn

from library.io import CheckpointError
from networks.lora_args import (
    _as_bool,
    _as_float,
    _as_int,
    _as_patterns,
    _block_kinds,
    _in_dims,
    _train_blocks,
    _warn_rank_above_width,
    check_lora_args,
    diffusers_module_map,
    first_match,
    lora_targets,
    parse_indices,
    regex_values,
)
from networks.lora_files import (
    LoRAWeights,
    build_metadata,
    is_lycoris_file,
    kohya_name,
    lora_reader,
    non_finite_factor,
    write_kohya,
)
from networks.lora_module import LoRAModule
from networks.lora_packed import PackedLoRAModule, PackedTarget, packed_targets
from networks.lora_peft_folder import peft_target_modules, write_peft_folder
from networks.lora_reader import leave_out_text_encoders, read_for_model


class LoRANetwork(nn.Module):
    """LoRA modules for one model of one architecture (arch). Submodules are registered under their
    kohya names, so `state_dict()` is the kohya file layout (`lora_unet_<path>.lora_down.weight`, ...).
    The network starts in eval mode (no dropout); the trainer switches it to train mode.

    network_args (sd-scripts names and meanings; unknown keys are an error). Which ones an
    architecture takes beyond the common ones is in its spec's LORA (library/models/spec.py LoRATargets):
      block_args (e.g. train_double_block_indices, block_indices): the indices of one block kind,
          "0-5,10", "all", "none" or a list of ints
      train_blocks (extra_args): "all" or one block kind, "double" | "single"; block indices or a rank of
          only the kind it switches off are refused (they would do nothing)
      <type>_dim: rank per module type of the spec's targets; 0 skips the type. <group>_dim sets
          the types of one of the spec's type_groups (unless a type's own _dim is given).
      in_dims (extra_args): "[r1, r2, ...]" ranks of the spec's in_dim_types, in order (default off)
      <type>_dim of the spec's packed_types (a mixture's experts: networks/lora_packed.py): off, and of rank 0 for
          include_patterns, unless given
      train_modulation: train the spec's modulation_types (default: its modulation_default)
      include_patterns / exclude_patterns: regexes matching the whole qualified module name (fullmatch, as
          musubi-tuner and sd-scripts: ".*txt_.*", not "txt_"). A module
          is trained if (its type and block are on and no exclude matches) or an include matches, at its type's
          rank: an include matching only types of rank 0 is refused.
      dropout, rank_dropout, module_dropout: see LoRAModule
      loraplus_lr_ratio: lora_up learning rate = lr * ratio (LoRA+)
      network_reg_dims / network_reg_lrs: "regex=value,..." (sd-scripts'): the first regex that re.search-es a
          trained module's kohya name gives its rank (0 drops it; over the *_dim ranks) / its learning rate (in
          place of learning_rate, LoRA+'s ratio still on lora_up); a regex matching no trained module is refused
      dora / use_dora: weight-decomposed LoRA (DoRA, see LoRAModule); the magnitudes train at lr
      refused_args (sd-scripts args): accepted when false; true is refused with the spec's reason
    select=False builds an empty network that load_weights() fills with the modules a file names.
    """

    def __init__(self, model: nn.Module, arch: str, rank: int, alpha=None, multiplier=1.0,
                 network_args: dict | None = None, lora_dtype=torch.float32, select: bool = True):
        super().__init__()
        self.spec = lora_targets(arch)  # the architecture's LoRATargets
        self.arch, self.rank, self.multiplier, self.lora_dtype = arch, int(rank), multiplier, lora_dtype
        self.alpha = float(self.rank if alpha is None or alpha == 0 else alpha)
        # 0 / None (alpha = rank) reaches each module as such: a module of its own rank (a *_dim or in_dims
        # network_arg) takes alpha = that rank, scale 1, as sd-scripts and musubi-tuner; not network_dim
        self._module_alpha = None if alpha is None or alpha == 0 else self.alpha
        self.network_args = dict(network_args or {})
        self._model = [model]  # not a submodule: the network's state_dict holds LoRA tensors only
        self._applied = False
        args = self._check_args(self.network_args)
        self.loraplus_lr_ratio = _as_float("loraplus_lr_ratio", args.get("loraplus_lr_ratio"))
        self.reg_lrs = regex_values("network_reg_lrs", args.get("network_reg_lrs"))
        self.dropouts = {k: _as_float(k, args.get(k)) for k in ("dropout", "rank_dropout", "module_dropout")}
        self.dora = _as_bool("dora", args.get("dora", args.get("use_dora", False)))
        selected = self._select(model, args) if select else []
        for path, module, module_rank in selected:
            self._add(path, module, module_rank, self._module_alpha)
        _warn_rank_above_width(selected)
        self.eval()

    def _add(self, path: str, module: nn.Module, rank: int, alpha: float, dora: bool | None = None) -> LoRAModule:
        kind = PackedLoRAModule if isinstance(module, PackedTarget) else LoRAModule
        lora = kind(path, module, rank, alpha, self.multiplier, lora_dtype=self.lora_dtype,
                    dora=self.dora if dora is None else dora, **self.dropouts)
        lora.train(self.training)
        self.add_module(kohya_name(path, self.spec.kohya_prefix), lora)
        if self._applied:
            lora.apply_to_base()
        return lora

    def _check_args(self, args: dict) -> dict:
        check_lora_args(self.arch, args)
        return args

    def _candidates(self, model):
        """(path, module, type, block kind, block index) for every module the targets name, and every packed weight
        (networks/lora_packed.py: its parameter path, a PackedTarget); modules outside the blocks (embedders) get
        block kind "embed", index 0."""
        compiled = {t: re.compile(p) for t, p in self.spec.targets.items()}
        found = []
        for path, module in [*model.named_modules(), *packed_targets(model)]:  # packed weights: by parameter path
            for mtype, pattern in compiled.items():
                m = pattern.fullmatch(path)
                if m:
                    kind, index = next(((k, int(v)) for k, v in m.groupdict().items() if v is not None), ("embed", 0))
                    found.append((path, module, mtype, kind, index))
                    break
        if not found:
            raise ValueError(f"LoRA: the model has no module that the {self.arch} LoRA targets name (is it a {self.arch} model?)")
        return found

    def _refuse_absent_types(self, args, present: set[str]) -> None:
        """A rank for a type the model has no module of would train nothing there without a word (a target
        regex with a typo, a model of another variant); a 0 (skip the type) asks for nothing and passes."""
        asked = [(f"{t}_dim", t, _as_int(f"{t}_dim", args[f"{t}_dim"])) for t in self.spec.targets if f"{t}_dim" in args]
        if self.spec.in_dim_types and args.get("in_dims") is not None:  # in_dims [0, 0, 0, 8, 0]: guidance_in 8
            asked += [("in_dims", t, rank) for t, rank in _in_dims(self.spec, args["in_dims"]).items()]
        for key, mtype, rank in asked:
            if mtype not in present and rank > 0:
                raise ValueError(f"network_args '{key}': this {self.arch} model has no {mtype} module (the spec's "
                                 f"LoRA target {self.spec.targets[mtype]!r} matches none of its modules)")

    def _type_ranks(self, args) -> dict[str, tuple[int, bool, str]]:
        """{module type: (rank, on by default, the key that set the rank)} from the network rank and network_args."""
        spec, types = self.spec, self.spec.targets
        dims = {t: (_as_int(f"{t}_dim", args[f"{t}_dim"]), f"{t}_dim") for t in types if f"{t}_dim" in args}
        for group, members in spec.type_groups.items():
            if f"{group}_dim" in args:
                for t in members:
                    dims.setdefault(t, (_as_int(f"{group}_dim", args[f"{group}_dim"]), f"{group}_dim"))
        in_types = spec.in_dim_types
        if in_types and args.get("in_dims") is not None:
            dims.update({t: (rank, "in_dims") for t, rank in _in_dims(spec, args["in_dims"]).items()})
        train_mod = _as_bool("train_modulation", args.get("train_modulation", spec.modulation_default))
        ranks = {}
        for t in types:
            on = t in dims or (t not in in_types and t not in spec.packed_types
                               and (train_mod or t not in spec.modulation_types))
            # a packed type takes no rank from network_dim: an include pattern reaching it asks for its own
            rank, key = dims.get(t, (0, f"{t}_dim") if t in spec.packed_types else (self.rank, "network_dim"))
            ranks[t] = (rank, on, key)
        return ranks

    def _select(self, model, args):
        candidates = self._candidates(model)
        self._refuse_absent_types(args, {c[2] for c in candidates})
        blocks = self._blocks_on(args, candidates)
        ranks = self._type_ranks(args)
        include = _as_patterns("include_patterns", args.get("include_patterns"))
        exclude = _as_patterns("exclude_patterns", args.get("exclude_patterns"))
        for pattern in include + exclude:
            if not any(pattern.fullmatch(c[0]) for c in candidates):
                example = next((c[0] for c in candidates if c[3] != "embed"), candidates[0][0])  # a block's, not img_in
                raise ValueError(f"network_args pattern {pattern.pattern!r} matches no LoRA target module "
                                 f"(a whole name: targets look like '{example}')")
        self._refuse_includes_of_rank_0(include, candidates, ranks)
        selected, selected_types = [], set()
        for path, module, mtype, kind, index in candidates:
            rank, type_on, _ = ranks[mtype]
            default_on = type_on and index in blocks.get(kind, {0}) and not any(p.fullmatch(path) for p in exclude)
            if rank > 0 and (default_on or any(p.fullmatch(path) for p in include)):
                selected.append((path, module, rank))
                selected_types.add(mtype)
        self._refuse_ranks_of_blocks_off(args, ranks, selected_types)
        selected = self._regex_ranked(selected, regex_values("network_reg_dims", args.get("network_reg_dims")))
        self._refuse_regexes_matching_none("network_reg_lrs", self.reg_lrs, selected)
        if not selected:
            raise ValueError(f"LoRA: network_args {self.network_args} select no module of the {self.arch} model")
        return selected

    def _regex_ranked(self, selected: list, regexes: list) -> list:
        """The selected modules at network_reg_dims' ranks where a regex searches their kohya name (sd-scripts:
        over the type ranks), a rank of 0 dropping the module."""
        self._refuse_regexes_matching_none("network_reg_dims", regexes, selected)
        ranked = []
        for path, module, rank in selected:
            match = first_match(regexes, kohya_name(path, self.spec.kohya_prefix))
            rank = rank if match is None else match[1]
            if rank > 0:
                ranked.append((path, module, rank))
        return ranked

    def _refuse_regexes_matching_none(self, key: str, regexes: list, selected: list) -> None:
        """A regex that searches no trained module's name would set nothing (a typo, dotted names for kohya's)."""
        names = [kohya_name(path, self.spec.kohya_prefix) for path, _, _ in selected]
        for pattern, _ in regexes:
            if not any(pattern.search(name) for name in names):
                raise ValueError(f"network_args '{key}': {pattern.pattern!r} searches no trained module's name "
                                 f"(kohya names, e.g. '{names[0] if names else '-'}')")

    @staticmethod
    def _refuse_includes_of_rank_0(include, candidates, ranks) -> None:
        """An include is trained at its type's rank: one matching only types of rank 0 would include nothing."""
        for pattern in include:
            matched = {c[2] for c in candidates if pattern.fullmatch(c[0])}
            if all(ranks[t][0] == 0 for t in matched):
                said = ", ".join(sorted({f"'{ranks[t][2]}' gives {t} rank 0" for t in matched}))
                raise ValueError(f"network_args 'include_patterns': {pattern.pattern!r} matches only modules of rank 0 "
                                 f"({said}): it includes nothing; give their type a rank")

    def _refuse_ranks_of_blocks_off(self, args, ranks, selected_types: set[str]) -> None:
        """A rank key (<type>_dim, <group>_dim) acting only on block kinds that train_blocks switches off does nothing,
        unless an include pattern turned some of its modules back on."""
        train_blocks = _train_blocks(args)
        if train_blocks == "all":
            return
        for key in sorted({key for _, _, key in ranks.values()} - {"network_dim", "in_dims"}):
            types = {t for t, (rank, _, k) in ranks.items() if k == key and rank > 0}
            kinds = set().union(*(_block_kinds(self.spec.targets[t]) for t in types))
            if kinds and train_blocks not in kinds and not types & selected_types:
                raise ValueError(f"network_args '{key}' = {args[key]!r} ranks modules of the {', '.join(sorted(kinds))} "
                                 f"blocks only, which 'train_blocks' = {train_blocks!r} switches off: give one or the other")

    def _blocks_on(self, args, candidates) -> dict[str, set[int]]:
        count = {}
        for _, _, _, kind, index in candidates:
            count[kind] = max(count.get(kind, 0), index + 1)
        on = {kind: set(range(n)) for kind, n in count.items()}
        train_blocks = _train_blocks(args)
        if train_blocks != "all":
            on = {kind: (s if kind in (train_blocks, "embed") else set()) for kind, s in on.items()}
        for key, kind in self.spec.block_args.items():
            if key in args:
                on[kind] = on.get(kind, set()) & parse_indices(key, args[key], count.get(kind, 0))
        return on

    # -- switching ---------------------------------------------------------------------------

    def lora_modules(self) -> list[LoRAModule]:
        return [m for m in self.children() if isinstance(m, LoRAModule)]

    def apply(self):
        """Patch every target's forward and freeze the base model (only LoRA params train)."""
        self._model[0].requires_grad_(False)
        self._applied = True
        for m in self.lora_modules():
            m.apply_to_base()

    def remove(self):
        self._applied = False
        for m in self.lora_modules():
            m.remove_from_base()

    def set_multiplier(self, multiplier: float):
        for m in self.lora_modules():
            m.multiplier = multiplier

    @property
    def enabled(self) -> bool:
        return all(m.enabled for m in self.lora_modules())

    @enabled.setter
    def enabled(self, value: bool):
        for m in self.lora_modules():
            m.enabled = bool(value)

    # -- training ----------------------------------------------------------------------------

    @torch.no_grad()
    def scale_weight_norms(self, max_norm: float) -> dict[str, float]:
        """sd-scripts' max-norm regularization (scale_weight_norms): each module whose delta
        ||(alpha / rank) * up @ down|| (Frobenius, float32) is over max_norm gets up and down multiplied by
        sqrt(max_norm / norm), so the delta's norm is max_norm; the others are left bit for bit. Returns
        the log's keys_scaled, average_key_norm and max_key_norm (the norms after scaling). DoRA: it
        bounds the direction's update s * BA; the magnitude trains free."""
        norms, scaled = [], 0
        for m in self.lora_modules():
            up, down = m.lora_up.weight, m.lora_down.weight
            norm = m.delta_norm()  # a packed weight's: over all its experts
            if norm > max_norm:
                root = math.sqrt(max_norm / norm)
                up.mul_(root)
                down.mul_(root)
                scaled, norm = scaled + 1, max_norm
            norms.append(norm)
        if not norms:
            return {}
        return {"keys_scaled": scaled, "average_key_norm": sum(norms) / len(norms), "max_key_norm": max(norms)}

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for m in self.lora_modules() for p in m.parameters_to_train()]

    def param_groups(self, lr: float) -> list[dict]:
        """One named group, or two with LoRA+ (lora_up at lr * loraplus_lr_ratio); network_reg_lrs adds one (two)
        per regex matching a module, named reg<i> (reg<i>_down / reg<i>_up), at its rate, as sd-scripts."""
        by_rate: dict[int | None, list[LoRAModule]] = {}
        for m in self.lora_modules():
            match = first_match(self.reg_lrs, kohya_name(m.name, self.spec.kohya_prefix))
            by_rate.setdefault(None if match is None else match[0], []).append(m)
        groups = []
        for index, modules in sorted(by_rate.items(), key=lambda item: -1 if item[0] is None else item[0]):
            name, rate = ("lora", lr) if index is None else (f"reg{index}", self.reg_lrs[index][1])
            for group in self._module_groups(modules, name, rate):
                # what the run's first lines say of the group its log names lr/reg<i>
                groups.append(group if index is None else {**group, "matches": self.reg_lrs[index][0].pattern,
                                                           "modules": len(modules)})
        return groups

    def _module_groups(self, modules: list[LoRAModule], name: str, lr: float) -> list[dict]:
        downs = [m.lora_down.weight for m in modules]
        downs += [m.dora_scale for m in modules if m.dora_scale is not None]  # magnitudes at lr
        ups = [m.lora_up.weight for m in modules]
        if not self.loraplus_lr_ratio:
            return [{"name": name, "params": downs + ups, "lr": lr}]
        return [
            {"name": f"{name}_down", "params": downs, "lr": lr},
            {"name": f"{name}_up", "params": ups, "lr": lr * self.loraplus_lr_ratio},
        ]

    # -- files -------------------------------------------------------------------------------

    def lora_weights(self) -> dict[str, LoRAWeights]:
        """Canonical form {module path: LoRAWeights} (tensors detached, in the LoRA dtype)."""
        return {m.name: m.weights() for m in self.lora_modules()}

    @torch.no_grad()
    def load_weights(self, source, strict: bool = True):
        """Load a LoRA from a path or a tensor dict, in any layout networks/lora_reader.py reads (kohya,
        PEFT/diffusers, ComfyUI; either naming of the architecture, converted to this model's). Alphas
        come from the file.

        The network adapts to the file: a module the file names that the network lacks is added
        (any Linear of the model, at the file's rank), as sd-scripts' files adapt modules our
        defaults may leave out; a module whose rank a fused <-> split conversion set (parts with their
        own downs joined: rank summed) is rebuilt at that rank, the only exact form. strict: every
        network module must be in the file (resume, reference copies); otherwise modules the file
        lacks keep their initial weights.
        A packed weight (networks/lora_packed.py) is named by its parameter path and takes a file of its layout.
        A name that is no Linear of the model, or a module of another rank or shape, is an error."""
        name = source if isinstance(source, str) else "state dict"
        linears = {p: m for p, m in self._model[0].named_modules()
                   if hasattr(m, "in_features") and hasattr(m, "out_features") and not isinstance(m, LoRAModule)}
        packed = dict(packed_targets(self._model[0]))
        weights, regrouped = self._read(source, name, {**linears, **packed}, {p: t.experts for p, t in packed.items()})
        linears.update(packed)
        if problem := non_finite_factor(weights):  # else every output it touches is NaN, first seen as "loss is nan"
            raise CheckpointError(f"{name}: {problem}: a broken LoRA (a diverged training's?), which would make the "
                                  f"outputs of the layers it adapts NaN")
        by_path = {m.name: m for m in self.lora_modules()}
        foreign = [p for p in weights if p not in linears]
        if foreign:
            raise CheckpointError(f"{name}: LoRA module '{foreign[0]}' is not a Linear of this {self.arch} model")
        if unpacked := next((p for p, w in weights.items() if w.experts and p not in packed), None):
            raise CheckpointError(f"{name}: LoRA module '{unpacked}' is a packed weight's of "
                                  f"{weights[unpacked].experts} experts in the file (its header), a Linear in this "
                                  f"{self.arch} model")
        missing = [p for p in by_path if p not in weights]
        if strict and missing:
            raise CheckpointError(f"{name}: no weights for LoRA module '{missing[0]}' ({len(missing)} missing)")
        resized = 0
        for path, w in weights.items():
            m = by_path.get(path)
            if m is not None and path in regrouped and m.rank != w.rank and (m.dora_scale is None) == (w.magnitude is None):
                m.remove_from_base()  # a rank the fused <-> split conversion set: the module is rebuilt at it
                m, resized = None, resized + 1
            m = m or self._add(path, linears[path], w.rank, w.alpha, dora=w.magnitude is not None)
            if (w.magnitude is None) != (m.dora_scale is None):
                kinds = ("DoRA", "plain LoRA") if w.magnitude is not None else ("plain LoRA", "DoRA")
                raise CheckpointError(f"{name}: LoRA module '{path}' is {kinds[0]} in the file, {kinds[1]} in the network "
                                      f"(network_args dora={self.dora})")
            if w.down.shape != m.lora_down.weight.shape or w.up.shape != m.lora_up.weight.shape:
                other_rank = (w.down.shape[1], w.up.shape[0]) == (m.lora_down.weight.shape[1], m.lora_up.weight.shape[0])
                raise CheckpointError(
                    f"{name}: LoRA module '{path}' has down {tuple(w.down.shape)} / up {tuple(w.up.shape)}, "
                    f"the network expects {tuple(m.lora_down.weight.shape)} / {tuple(m.lora_up.weight.shape)}"
                    + (f" (rank {w.rank}, not {m.rank}: the network keeps the ranks network_dim and the *_dim "
                       f"network_args give it; dim_from_weights = true takes the file's)" if other_rank else "")
                )
            m.lora_down.weight.copy_(w.down)  # cast to the LoRA dtype
            m.lora_up.weight.copy_(w.up)
            if w.magnitude is not None:
                m.dora_scale.copy_(w.magnitude.reshape(-1, 1))
            m.set_alpha(w.alpha)
        return {"loaded": len(weights), "added": len(set(weights) - set(by_path)), "missing": len(missing),
                "resized": resized}

    def _read(self, source, name: str, linears, experts: dict[str, int]) -> tuple[dict[str, LoRAWeights], set[str]]:
        """({module path: LoRAWeights}, the modules whose rank a fused <-> split conversion set) of a file
        or state dict; a diffusion LoRA's text-encoder modules (sd-scripts' lora_te1_ / lora_te3_) are
        left out with a warning: this network adapts the denoiser. experts: {path: E} of the model's packed
        weights (what a file without the header entry is read by)."""
        if is_lycoris_file(lora_reader(source)[0].keys() if isinstance(source, str) else source):
            raise CheckpointError(f"{name}: a LyCORIS file (LoKr / LoHa / ...); networks.lora reads down/up LoRAs: "
                                  f"set network_module = \"lycoris.kohya\" to load it")
        module_map = self._module_map if self.spec.diffusers_module_map else None
        read = read_for_model(source, self.arch, linears, module_map, name=name, strict=True, experts=experts)
        leave_out_text_encoders(name, read.text_encoders, bool(read.weights), self.arch, stacklevel=4)
        return read.weights, read.regrouped

    @staticmethod
    def describe_loaded(counts: dict, kind: str = "LoRA") -> str:
        """load_weights' counts as one line for the log; kind: what the modules are (LycorisNetwork
        names its LyCORIS algos)."""
        resized = f", {counts['resized']} rebuilt at the rank of their fused / split form" if counts.get("resized") else ""
        return (f"{counts['loaded']} {kind} modules loaded ({counts['added']} added for modules the file names{resized}), "
                f"{counts['missing']} start from their initial weights")

    @classmethod
    def from_weights(cls, model: nn.Module, arch: str, source, multiplier: float = 1.0,
                     network_args: dict | None = None) -> "LoRANetwork":
        """A network holding exactly the modules a LoRA file names (generate, doctor, tools)."""
        weights_rank = 1  # placeholder: every module takes its rank from the file
        network = cls(model, arch, weights_rank, multiplier=multiplier, network_args=network_args, select=False)
        network.load_weights(source, strict=False)
        return network

    def _module_map(self) -> dict:
        """BFL <-> diffusers module map for this model's sizes (the spec's diffusers_module_map)."""
        cfg = getattr(self._model[0], "config", None)
        if cfg is None:
            raise CheckpointError(f"a diffusers-named {self.arch} LoRA needs our BFL-named model (with .config) to convert")
        return diffusers_module_map(self.arch, cfg)

    def merge_into_model(self, weight_dtype: torch.dtype | None = None):
        """Merge every LoRA into its base weight (float32 math) and unpatch the forwards."""
        for m in self.lora_modules():
            m.merge_into_base(weight_dtype)

    def _header(self, metadata: dict | None) -> dict:
        header = build_metadata(
            network_module="networks.lora", network_dim=self.rank, network_alpha=self.alpha,
            network_args=self.network_args,
        )
        header.update(metadata or {})
        return header

    def save(self, path: str, dtype=torch.float32, metadata: dict | None = None):
        """kohya safetensors; network dim/alpha/module/args are added to the header unless given."""
        write_kohya(self.lora_weights(), path, dtype, self._header(metadata), prefix=self.spec.kohya_prefix)

    def save_peft(self, folder: str, dtype=torch.float32, metadata: dict | None = None, base_model: str | None = None,
                  rename=None):
        """A PEFT adapter folder (LLMs: PeftModel.from_pretrained, vLLM, llama.cpp read it); the
        header of adapter_model.safetensors carries the same metadata as `save`. rename: our module
        path -> the base class's own (its target_modules are then full paths: names could match
        modules the model has beside ours, a vision tower's)."""
        linears = [p for p, m in self._model[0].named_modules()
                   if hasattr(m, "in_features") and hasattr(m, "out_features") and not isinstance(m, LoRAModule)]
        weights = self.lora_weights()
        if rename is not None:
            weights = {rename(p): w for p, w in weights.items()}
        targets = peft_target_modules(weights, None if rename else linears)
        # sd-scripts' dropout (on down(x)) is the nearest to PEFT's lora_dropout (on x): rank / module dropout have none
        write_peft_folder(weights, folder, dtype, self._header(metadata), base_model, targets,
                          lora_dropout=self.dropouts["dropout"] or 0.0)
