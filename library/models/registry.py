"""The diffusion families by name, how a frozen base may be stored and how training draws sigmas:
the names configs and command lines choose from. Nothing here imports torch, so the command lines
check these names before the seconds it takes to load it; library/models/family.py holds the
interface itself.

One word for one thing:
- model_type: the config key's value, and for a diffusion family the name it is registered under
  here (flux, flux_kontext, qwen_image_edit, ...); llm is the one model_type without a family.
- family: the adapter class a model_type names (DiffusionFamily; its `name` is the model_type).
- arch: the transformer architecture a family shares with its variants (flux_kontext's is flux,
  qwen_image_edit's is qwen_image; llm's is llm). LoRA targets and key prefixes, fp8 keep rules and
  flow-matching constants are per arch: networks and precision take an `arch`, never a model_type.
"""

# A spec that does not register fails every command as it imports this module: a contributor's error, raised as
# a SpecError whose line names the file and the field (the traceback's last line).
from library.errors import SpecError

# model_type -> "module:class" of its adapter; imported on first use (family.family_class).
FAMILIES = {
    "flux": "library.models.flux1.family:FluxFamily",
    # nucleus_image before qwen_image: Nucleus-Image's blocks hold Qwen-Image's img_mod.1 (and img_mlp.net in its
    # dense blocks): tools/lora_info.py asks the architectures in this order, Nucleus-Image's own names first
    "nucleus_image": "library.models.nucleus_image.family:NucleusImageFamily",
    "qwen_image": "library.models.qwen_image.family:QwenImageFamily",
    "flux_kontext": "library.models.flux1.kontext:FluxKontextFamily",
    # flux3 before flux2: LoRAs in FLUX.1's names are asked of their variants in this order, and FLUX.3's diffusers
    # names hold FLUX.2's markers (ff.linear_in, *_stream_modulation*): FLUX.3's own checks decide first
    "flux3": "library.models.flux3.family:Flux3Family",
    "flux2": "library.models.flux2.family:Flux2Family",
    "qwen_image_edit": "library.models.qwen_image.edit_family:QwenImageEditFamily",
    "qwen_image_layered": "library.models.qwen_image.layered:QwenImageLayeredFamily",
    # ernie_image before zimage: ERNIE-Image's layers.N.self_attention.to_q holds Z-Image's names
    # (`attention_to_q`): tools/lora_info.py asks the architectures in this order, ERNIE-Image's own names first
    "ernie_image": "library.models.ernie_image.family:ErnieImageFamily",
    # lumina2 before zimage: Lumina 2's single-file names are Z-Image's single file's (layers.N.attention.qkv), its
    # own (the layers' adaLN_modulation.1) asked first
    "lumina2": "library.models.lumina2.family:Lumina2Family",
    "zimage": "library.models.zimage.family:ZImageFamily",
    "zimage_omni": "library.models.zimage.omni_family:ZImageOmniFamily",
    "chroma": "library.models.chroma.family:ChromaFamily",
    "krea2": "library.models.krea2.family:Krea2Family",
    "krea2_edit": "library.models.krea2.edit_family:Krea2EditFamily",
    "ideogram4": "library.models.ideogram4.family:Ideogram4Family",
    "qwen_image21": "library.models.qwen_image21.family:QwenImage21Family",
    "anima": "library.models.anima.family:AnimaFamily",
    "hunyuan_image": "library.models.hunyuan_image.family:HunyuanImageFamily",
    "sd3": "library.models.sd3.family:SD3Family",
    "hidream": "library.models.hidream.family:HiDreamFamily",
    "hidream_o1": "library.models.hidream_o1.family:HiDreamO1Family",
}

# How the frozen base is stored (config base_precision): the compute dtype, fp8 (library/precision/fp8.py),
# or bitsandbytes' 4- and 8-bit formats (library/precision/bnb_weights.py).
LOWBIT_PRECISIONS = ("nf4", "nf4_dq", "int8")
BASE_PRECISIONS = ("bf16", "fp8", "fp8_scaled", *LOWBIT_PRECISIONS)

# Architectures that are not a diffusion family but have the same kind of facts (LoRA targets, key
# names): arch -> the module holding its SPEC.
OTHER_ARCHS = {"llm": "library.models.llm_spec"}


def family_folder(model_type: str) -> str:
    """The package of a registered family's folder ("library.models.flux1"): its spec.py is there."""
    return FAMILIES[model_type].partition(":")[0].rpartition(".")[0]


def _spec_modules() -> dict[str, str]:
    """Every spec module, each once: one per family folder (its variants share it), then the others."""
    modules = {}
    for model_type in FAMILIES:
        modules.setdefault(family_folder(model_type) + ".spec", None)
    return {**modules, **{m: None for m in OTHER_ARCHS.values()}}


# The parts every spec gives (networks/, tools/ and precision/ read them for any arch), then those a
# family's adds (its sampling, the precision doctor, the memory planner, the tiny set, its LoRAs' ModelSpec names).
REQUIRED_PARTS = ("lora", "lora_files", "fp8")
FAMILY_PARTS = REQUIRED_PARTS + ("sampling", "transformer", "planner", "tiny", "modelspec")


# The specs last checked, under the registration and the spec objects they were checked for: a LoRA's reader asks
# for them per module name (40,000 calls checking one test's 45 files: 36 s of checks, 0.9 ms a call).
_checked: dict = {}


def arch_specs() -> dict:
    """arch -> ArchSpec of every architecture (families first, in registration order). Every command
    reads this first, so a spec that would replace another's or fail late is refused here, in one line
    naming its file. Checked once per registration and set of spec objects (a new one is checked again)."""
    loaded = [(module, _load_spec(module)) for module in _spec_modules()]
    key = (tuple(FAMILIES.items()), tuple(OTHER_ARCHS.items()), tuple((module, id(spec)) for module, spec in loaded))
    if _checked.get("key") != key:
        specs, files, presets = {}, {}, {}
        for module, spec in loaded:
            file = _spec_file(module)
            _check_spec(spec, module, files, presets)
            specs[spec.arch], files[spec.arch] = spec, file
            presets.update(dict.fromkeys(spec.planner.presets if spec.planner else (), file))
        _checked.update(key=key, specs=specs)  # the specs held here: their ids stay theirs while the key names them
    return dict(_checked["specs"])


def _spec_file(module: str) -> str:
    return module.replace(".", "/") + ".py"


def _load_spec(module: str):
    """The module's SPEC; one that cannot be built (a missing or mistyped field: spec.py checks the types)
    is a SpecError naming the file."""
    from library.models.spec import ArchSpec, load_symbol

    try:
        spec = load_symbol(module + ":SPEC")
    except (TypeError, ValueError) as e:
        raise SpecError(f"{_spec_file(module)}: {' '.join(str(e).split())}") from None
    if not isinstance(spec, ArchSpec):
        raise SpecError(f"{_spec_file(module)}: SPEC is a {type(spec).__name__}, expected an ArchSpec")
    return spec


def _check_spec(spec, module: str, files: dict[str, str], presets: dict[str, str]) -> None:
    """A spec against the registration and the specs before it (files: arch -> spec file; presets: planner
    preset name -> spec file). A repeated arch or preset name would replace the other's without a word; a
    family's arch is the model_type its base family is registered under (its FAMILIES key, the adapter's
    `name`): the adapter finds its LoRA targets, fp8 rules and sampling by that arch."""
    file, family = _spec_file(module), module not in OTHER_ARCHS.values()
    if spec.arch in files:
        raise SpecError(f"{file}: arch {spec.arch!r} is already {files[spec.arch]}'s: each spec names its own")
    taken = [name for name in (spec.planner.presets if spec.planner else ()) if name in presets]
    if taken:
        raise SpecError(f"{file}: planner preset {taken[0]!r} is already {presets[taken[0]]}'s: each name is one model")
    model_types = [m for m in FAMILIES if family_folder(m) + ".spec" == module]
    if family and spec.arch not in model_types:
        raise SpecError(f"{file}: arch {spec.arch!r} is no model_type this folder registers in registry.FAMILIES "
                        f"({', '.join(model_types)}): a family's arch is its base family's FAMILIES name")
    parts = FAMILY_PARTS if family else REQUIRED_PARTS
    missing = [part for part in parts if getattr(spec, part) is None]
    if missing:
        raise SpecError(f"{file}: SPEC gives no {missing[0]} (every {'family ' if family else ''}spec gives "
                        f"{', '.join(parts)}: library/models/spec.py)")


def arch_spec(arch: str):
    """The ArchSpec of `arch` (flux_kontext's arch is its base's; see spec_of)."""
    specs = arch_specs()
    if arch not in specs:
        raise ValueError(f"unknown architecture {arch!r}: expected one of {', '.join(specs)}")
    return specs[arch]


def spec_of(model_type: str):
    """The ArchSpec a model_type trains with: its folder's (variants share their base's), or an
    other arch's (llm)."""
    from library.models.spec import load_symbol

    if model_type in FAMILIES:
        return load_symbol(family_folder(model_type) + ".spec:SPEC")
    return arch_spec(model_type)


# timestep_sampling values (library/models/flow_matching.py implements them): the generic draws, then
# each architecture's resolution shift (its spec's sampling.method: flux_shift, qwen_shift, ...), each
# once: an architecture whose released scheduler shifts with another's constants names that method.
SAMPLING_METHODS = ("uniform", "sigmoid", "shift", "logsnr", "mode") + tuple(dict.fromkeys(
    s.sampling.method for s in arch_specs().values() if s.sampling)) + ("qinglong",)  # (a mixture of the others: last)
# timestep_bias values: the draw's quantile q = 1 - u^3 (high_noise) or u^3 (low_noise) in place of a uniform one,
# as ai-toolkit's content_or_style "content" / "style" (its UI's Timestep Bias: High Noise / Low Noise) indexes its
# timesteps with u^3 (diffusers' T2I-Adapter training's cubic sampling); the law is the method's as without it
TIMESTEP_BIASES = ("none", "high_noise", "low_noise")
# shifted_draw: the draw a shift (timestep_sampling "shift" or an architecture's) moves: sigmoid(sigmoid_scale randn),
# or uniform, as sd-scripts' "sigma" draw picks one of a shifted scheduler's 1000 sigmas and its nextdit_shift shifts,
# or the mode law (SD3's), as that sigma draw with weighting_scheme mode does
SHIFTED_DRAWS = ("sigmoid", "uniform", "mode")
# the draws no shift moves (a shift's shifted_draw is one of SHIFTED_DRAWS)
UNSHIFTED_DRAWS = ("uniform", "sigmoid", "logsnr", "mode")
# timestep_sampling = "mode" (flow_matching.mode_sigmas: the mode law of Esser et al. 2024, eq. 20; diffusers' /
# sd-scripts' / musubi-tuner's weighting_scheme mode): its default scale, and the scales whose map from a uniform
# quantile is monotone and inside [0, 1] (its slope (1 + s) - s (pi / 2) sin(pi u) > 0: -1 < s < 1 / (pi / 2 - 1))
MODE_SCALE = 1.29
MODE_SCALES = (-1.0, 1.75)


def mode_scale_unfit(scale: float) -> str:
    """Why ours' mode draw does not take a peer's mode_scale ("" where it does): the converters' one line."""
    least, most = MODE_SCALES
    return "" if least < scale <= most else f"ours' mode draw takes ({least:g}, {most:g}] (monotone)"
