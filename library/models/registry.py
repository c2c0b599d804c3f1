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

# model_type -> "module:class" of its adapter; imported on first use (family.family_class).
FAMILIES = {
    "flux": "library.models.flux1.family:FluxFamily",
    "qwen_image": "library.models.qwen_image.family:QwenImageFamily",
    "flux_kontext": "library.models.flux1.kontext:FluxKontextFamily",
    "flux2": "library.models.flux2.family:Flux2Family",
    "qwen_image_edit": "library.models.qwen_image.edit_family:QwenImageEditFamily",
    "qwen_image_layered": "library.models.qwen_image.layered:QwenImageLayeredFamily",
    "zimage": "library.models.zimage.family:ZImageFamily",
    "zimage_omni": "library.models.zimage.omni_family:ZImageOmniFamily",
    "chroma": "library.models.chroma.family:ChromaFamily",
    "krea2": "library.models.krea2.family:Krea2Family",
    "krea2_edit": "library.models.krea2.edit_family:Krea2EditFamily",
    "ideogram4": "library.models.ideogram4.family:Ideogram4Family",
    "qwen_image21": "library.models.qwen_image21.family:QwenImage21Family",
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


def arch_specs() -> dict:
    """arch -> ArchSpec of every architecture (families first, in registration order)."""
    from library.models.spec import load_symbol

    specs = [load_symbol(module + ":SPEC") for module in _spec_modules()]
    return {s.arch: s for s in specs}


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
SAMPLING_METHODS = ("uniform", "sigmoid", "shift") + tuple(dict.fromkeys(
    s.sampling.method for s in arch_specs().values() if s.sampling))
