"""A family's declarative facts: one frozen `ArchSpec` per transformer architecture, in its own
folder (library/models/<folder>/spec.py, the module-level SPEC), found through the registry
(library/models/registry.py arch_spec / spec_of). Everything outside the folder that needs a fact
about an architecture (LoRA targets and key names, fp8 keep-high-precision rules, timestep sampling
defaults, the memory planner's shapes and presets, converters' key tables, the tiny test models, the
config keys of its files, the default config) reads it here and never names the family. The
repeated blocks (compile, block swap, FSDP) are each model's own `swappable_blocks()`.

Nothing here imports torch: the command lines check names and defaults before loading it. Where a
fact is code (a module map built from a model config, a tiny-model writer) the spec holds a
"module:function" string that the consumer imports when it needs it (`load_symbol`).

Each part below is one concern, read by one place (named in the comment above it).
"""

from __future__ import annotations

import functools
import importlib
import types
import typing
from dataclasses import dataclass, field, fields, is_dataclass


def load_symbol(path: str):
    """"package.module:name" -> the object (imported on first use)."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


# ----------------------------------------------------------------------------------------------
# LoRA: targets and key names (networks/lora_args.py, networks/lora.py, networks/lycoris_network.py)


@dataclass(frozen=True)
class LoRATargets:
    """Which modules of the architecture's model carry a LoRA, the network_args that pick them, and
    the names the LoRA's modules are saved under."""

    # module type -> regex full-matched against qualified module paths. A named group gives the block
    # kind and its index (`(?P<double>\d+)`); a module outside the blocks (an embedder) has none.
    targets: dict[str, str]
    block_args: dict[str, str]  # network_args key -> the block kind whose indices it selects
    kohya_prefix: str = "lora_unet"  # kohya module names: <prefix>_<module path, '.' -> '_'>
    modulation_types: tuple[str, ...] = ()  # the types `train_modulation` switches
    modulation_default: bool = False  # train_modulation's default
    in_dim_types: tuple[str, ...] = ()  # types trained only when given a rank, by `in_dims` in this order
    # types whose targets are packed weights ([E, K, N] Parameters of a precision.fp8_packed.PackedWeights, matched
    # by parameter path; networks/lora_packed.py): trained only when given a rank by their own `<type>_dim`
    packed_types: tuple[str, ...] = ()
    type_groups: dict[str, tuple[str, ...]] = field(default_factory=dict)  # `<group>_dim` -> its member types
    extra_args: tuple[str, ...] = ()  # network_args the architecture takes beyond the common ones
    refused_args: dict[str, str] = field(default_factory=dict)  # sd-scripts args accepted when false: key -> why not true
    # "module:function" (model config) -> {BFL module path: [(diffusers path, row_start, row_end)]},
    # for a model built with BFL names whose diffusers LoRAs name modules otherwise; None: one naming.
    diffusers_module_map: str | None = None
    diffusers_blocks: tuple[str, ...] = ()  # module path prefixes that mark a diffusers-named LoRA


# ----------------------------------------------------------------------------------------------
# LoRA files: converters' and inspectors' key tables (tools/convert_lora.py, tools/lora_info.py, ...)


@dataclass(frozen=True)
class Release:
    """A released model size, as tools/lora_info.py names the model a LoRA fits."""

    name: str
    width: int
    blocks: dict[str, int]  # block kind -> count


@dataclass(frozen=True)
class LoRAFiles:
    """How the tools recognise, convert and describe the architecture's LoRA files. Module names are
    matched '_'-flattened, so kohya and dotted names alike."""

    # convert_lora: substrings of module names only this architecture has (a variant's count as its base's)
    markers: tuple[str, ...] = ()
    names_of: str | None = None  # the arch whose module names this one shares (its LoRAs are told apart: lora_arch.variant_of)
    # "module:function" (tensors) -> True for a LoRA with names_of's names whose shapes only this arch has; its
    # markers and its header (model_versions) claim one first (lora_arch.variant_of)
    recognise: str | None = None
    # "module:function" (tensors) -> True for a LoRA with names_of's names whose shapes only names_of's model has
    refuses: str | None = None
    # prefixes of ss_base_model_version / modelspec.architecture in this arch's LoRAs, case and separators aside
    # (lora_arch.begins_release); those of its variants that share its names are told apart from them: a
    # variant's model refuses them
    model_versions: tuple[str, ...] = ()
    # why this arch's model takes a LoRA of names_of's less the modules of names_of it lacks (its blocks are the
    # base's, fine-tuned: the rest applies), as ComfyUI loads one: those are left out with one warning saying how
    # many. None: a LoRA naming them, or whose header names the base, is names_of's and refused
    takes_base_loras: str | None = None
    # kohya text-encoder prefixes whose encoder in this architecture's files is another than sd-scripts' names
    # say (networks/lora_files.py TEXT_ENCODER_PREFIXES): prefix -> the encoder, as the tools print what a file holds
    text_encoders: dict[str, str] = field(default_factory=dict)
    block_pattern: str = ""  # regex, groups (block kind, index): the blocks a LoRA names
    module_paths: str | None = None  # "module:function" (block counts) -> every Linear path (resolves kohya names)
    module_map: str | None = None  # "module:function" (weights, block counts) -> BFL <-> diffusers module map from the LoRA's shapes
    layouts: tuple[str, ...] = ("kohya", "diffusers")  # the layouts --to writes ("peft": a PEFT adapter folder,
    #   "comfy": `diffusion_model.<the module path ComfyUI's key map takes>.lora_A/B`, alpha folded)
    # "module:function" (weights, block counts) -> {module path in ComfyUI's own model: [(our module path, row0,
    # row1)]} where ComfyUI's model names or fuses modules otherwise than ours (a fused attention qkv): a LoRA in
    # ComfyUI's names reads as ours, a fused module split by rows (its module_paths lists those names too)
    comfy_map: str | None = None
    # "module:function" (our module path) -> ComfyUI's, where its model renames ours and its LoRA key map takes only
    # its own names (--to comfy writes those); None: ComfyUI takes ours (or the BFL names) as they are
    comfy_names: str | None = None
    # "module:function" (weights, block counts) -> {ComfyUI's module path: [(our module path, row0, row1)]} where
    # ComfyUI's model fuses modules ours has apart (an attention qkv) and its key map takes only its own names:
    # --to comfy stacks ours into them (networks.lora_module_map.diffusers_to_bfl); None: no fusing
    comfy_fuse: str | None = None
    diffusers_lokr: str | None = None  # the name diffusers' LoKr loader knows the model by, when it loads LoKr for it
    # "module:function" (module paths) -> why a LoRA naming them cannot be written in the diffusers layout (a module
    # the pipeline holds in another component than the transformer), or None: convert_lora refuses --to diffusers so
    diffusers_refuses: str | None = None
    # lora_info
    info_markers: tuple[tuple[str, str], ...] = ()  # (naming, regex): a module name matching it is this arch's
    info_blocks: tuple[tuple[str, str], ...] = ()  # (block kind, regex with the index as a group); a kind may repeat
    width_modules: str = ""  # regex of module name endings whose down input is the model width
    releases: tuple[Release, ...] = ()
    fits_text: str | None = None  # what a LoRA fits when there are no releases, formatted with width and block counts


# ----------------------------------------------------------------------------------------------
# ModelSpec: the trained LoRA's modelspec.* header keys (training/saves.py lora_metadata)


@dataclass(frozen=True)
class ModelSpecNames:
    """A release's names in Stability's ModelSpec (github.com/Stability-AI/ModelSpec), as sd-scripts' and
    musubi-tuner's sai_model_spec.build_metadata write them into a LoRA's header, where SwarmUI and LoRA
    managers read which model the LoRA is for: modelspec.architecture (the LoRA's is this + "/lora") and
    modelspec.implementation (the reference code base, a URL). Each family's comment says whose strings they are."""

    architecture: str
    implementation: str


# ----------------------------------------------------------------------------------------------
# fp8: which modules stay in high precision (library/precision/fp8.py)


STORED_FP8 = ("fp8", "fp8_scaled", "fp8_tensor_scaled")  # every fp8 layout precision/stored_layouts.py reads (fp8.MODES)


@dataclass(frozen=True)
class FP8Rules:
    """The Linears that stay in high precision (bf16 / fp32) when the base is stored in fp8, as
    regexes full-matched against qualified module names, and the fp8 checkpoints its loader reads as
    stored. library/precision/fp8.py takes this object itself (it sits below the registry and never
    looks an architecture up by name)."""

    keep: tuple[str, ...]  # always kept: embedders, input / output projections, the final layer
    # Per-block modulation Linears: quantized while fp8.QUANTIZE_MODULATION is True (the default,
    # measured where it was decided: the first family's FP8 comment), kept otherwise.
    modulation: tuple[str, ...] = ()
    # The fp8 layouts (fp8.MODES) the transformer's loader reads as they are stored, per checkpoint naming
    # (CheckpointNames.naming): tools/merge_lora.py writes fp8 only where they load back. A naming left out
    # reads none (a loader that quantizes while loading, or whose fused rows a stored scale would not survive).
    stored: dict[str, tuple[str, ...]] = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------
# GGUF: ComfyUI-GGUF's layout of the transformer's files (library/precision/gguf_writer.py)


@dataclass(frozen=True)
class GgufLayout:
    """How city96's tools write this transformer as GGUF, in the file's own tensor names (the single-file
    names ComfyUI-GGUF's convert.py reads): general.architecture (what convert.py detects from the keys),
    the substrings of names its llama.cpp patch leaves unquantized for that arch (tools/lcpp.patch), and
    convert.py's keys_hiprec (kept F32). gguf_writer.GgufRules reads this object."""

    arch: str
    unquantized: tuple[str, ...] = ()
    hiprec: tuple[str, ...] = ()


# ----------------------------------------------------------------------------------------------
# Timestep sampling and shift defaults (library/models/flow_matching.py)


@dataclass(frozen=True)
class MuLine:
    """mu of the resolution shift on the line through (base_seq_len, base_shift) and (max_seq_len,
    max_shift) in the image token count (diffusers' calculate_shift; not clamped outside it)."""

    base_seq_len: int
    max_seq_len: int
    base_shift: float
    max_shift: float


@dataclass(frozen=True)
class Sampling:
    """How the released model's scheduler shifts sigmas, which training follows by default:
    timestep_sampling = `method` draws sigmoid(randn) and time-shifts it with this mu, as the
    scheduler does at inference for the image's token count; samples use the same mu.

    A scheduler without a resolution shift (use_dynamic_shifting false) shifts every schedule by one
    constant k: s' = k s / (1 + (k - 1) s), which is the time shift with mu = ln k. `shift` gives that
    k (inference); `mu` is then None. `train_shift` is the k training draws with by default where the
    peers train with another constant than the scheduler samples with (None: `shift`)."""

    method: str  # the timestep_sampling name that draws this way (the architecture's default)
    # mu: a MuLine, or "module:function" (image_seq_len, steps) -> mu for a mu that also depends on
    # the step count; training, which has no step count, evaluates it at train_mu_steps.
    mu: MuLine | str | None = None
    shift: float | None = None  # a constant shift k (mu = ln k at every resolution) instead of mu
    train_shift: float | None = None  # training's constant k where it differs from `shift`
    train_mu_steps: int | None = None
    shift_terminal: float | None = None  # the inference schedule is stretched to end here (None: no stretch)
    guidance_scale: float | None = None  # guidance fed to a guidance-distilled model in training (None: none)
    # the pipeline leaves the spacing to FlowMatchEulerDiscreteScheduler.set_timesteps (it passes no sigmas):
    # linspace(1, the scheduler's shifted 1/1000, steps), not the linspace(1, 1/steps, steps) most pipelines pass
    scheduler_spacing: bool = False


# ----------------------------------------------------------------------------------------------
# Config keys of the family's own files and options (library/training/config.py)


@dataclass(frozen=True)
class ConfigKey:
    """A training-config key the family reads (its text encoder files, a version), added to the one
    schema. Families may declare the same key (one file role): the types must agree, the helps join."""

    key: str
    type: type  # str, int, float, bool
    help: str
    default: object = None
    model_types: tuple = ()  # the model_types of the folder that read it (empty: every one); the others refuse it
    most: int | None = None  # an int key's largest value the family takes (None: no bound beyond >= 1)
    # A LoRA trained with it set renders right only with it (a text length: other embeddings): its header records
    # it (ss_trained_keys) and tools/generate.py sets it where left unset, with a note.
    renders: bool = False


# ----------------------------------------------------------------------------------------------
# The transformer, for tools that hold only a checkpoint (tools/precision_doctor.py)


@dataclass(frozen=True)
class TransformerHooks:
    """load: "module:function" (path, dtype=, prepare=) -> the transformer from a checkpoint file or
    folder (prepare: the fp8 hook, as family.fp8_prepare gives it). random_inputs: "module:function"
    (config, h, w, text_len, generator) -> RandomInputs: the conditioning of one forward at an h x w
    patch grid with random text, everything but the image tokens and the sigma."""

    load: str
    random_inputs: str


@dataclass(frozen=True)
class RandomInputs:
    fixed: dict  # forward keyword arguments besides img / timesteps (tensors float32, positions int64)
    positions: object  # [1, L, axes] the positions the model feeds to core.rope_tables, text then image
    axes_dim: tuple[int, ...]
    theta: float


# ----------------------------------------------------------------------------------------------
# Memory planner: shapes and presets (library/training/memory_plan.py, tools/plan_memory.py)


@dataclass(frozen=True)
class TextWeights:
    """A text encoder's parameters as its loader keeps them (the caching phase's bytes per text_encoder_precision):
    all of them; those of the Linear weights fp8 / fp8_scaled store as float8_e4m3fn (the rest, the Linears its
    fp8 rules keep among them, stays bf16) and the elements of fp8_scaled's bf16 scales of those; and those
    kept float32 in fp16."""

    params: int
    fp8_weights: int = 0
    fp8_scales: int = 0
    fp32_in_fp16: int = 0

    def bytes(self, precision: str) -> int:
        wide = 2 * self.params  # bf16 / fp16, and every precision's unquantized rest
        sizes = {"fp32": 4 * self.params, "fp16": wide + 2 * self.fp32_in_fp16, "bf16": wide,
                 "fp8": wide - self.fp8_weights, "fp8_scaled": wide - self.fp8_weights + 2 * self.fp8_scales}
        if precision not in sizes:
            raise ValueError(f"text_encoder_precision must be one of {', '.join(sizes)}, got {precision!r}")
        return sizes[precision]


@dataclass(frozen=True)
class PlannerPreset:
    """A released model planned without its files (tools/plan_memory.py --preset NAME): the family
    it trains as, its transformer's config, and what its files would tell the family."""

    model_type: str  # the family it plans as
    transformer: str  # "module:NAME" of the released transformer's config (Planner.transformer builds it)
    text_params: dict[str, TextWeights]  # per text-encoder file key: the parameters its loader reads
    text_options: dict = field(default_factory=dict)  # the family's text_options for a config that sets none
    attributes: dict = field(default_factory=dict)  # other family attributes its files would give (a version)


@dataclass(frozen=True)
class Planner:
    transformer: str  # "module:Class" of the transformer a preset's config builds (on meta)
    text_tokens: int = 512  # text tokens a planned caption carries (the length the encoder pads to)
    # The family's text_options key holding that length where the config or the checkpoint sets it.
    text_length_option: str | None = None
    presets: dict[str, PlannerPreset] = field(default_factory=dict)  # --preset name -> preset


# ----------------------------------------------------------------------------------------------
# Tiny models for tests and the quickstart (tools/make_tiny_models.py)


@dataclass(frozen=True)
class TinySpec:
    """The architecture's part of the tiny real-format model set. writers: "module:function" strings,
    each writer(out_dir, seed) -> {component name: path}, run in this order (each seeds its own
    generator: the order sets only the manifest's); dims: (name, value) of its own toy sizes, recorded
    in manifest.json after the shared ones (library/models/tiny_files.py TINY)."""

    writers: tuple[str, ...] = ()
    dims: tuple[tuple[str, int], ...] = ()
    transformer: str = ""  # the manifest key of its transformer file (the generic tests load it through `transformer.load`)
    # A training config on the tiny set (tools/make_tiny_models.py tiny_config: the precision matrix's
    # tests and bench): config key -> the manifest key of the file it names (the transformer aside),
    # and the other keys such a config sets (short T5 captions).
    config_files: dict[str, str] = field(default_factory=dict)
    config_values: dict[str, object] = field(default_factory=dict)
    # "module:function" (folder, hidden, depth, seed) -> path: the transformer at width `hidden` (heads
    # of 128, the released RoPE axes) with `depth` setting its block counts, random N(0, 0.02) weights
    # and the tiny encoders' context widths, in its own file format (bench/bench_precision_matrix.py).
    sized: str = ""


@dataclass(frozen=True)
class LearnedBase:
    """The architecture's tiny base that has learned the synthetic scenes (library/data/shapes.py):
    tools/pretrain_tiny_base.py trains it, learned/<model_type>/ ships it, the concept demo and the
    learning tests use it. Functions are "module:function" strings (imported on use); the four that
    every family writes for itself default to the functions of those names in `module`."""

    files: tuple[tuple[str, str], ...]  # (training-config key, its file or folder inside the base's folder)
    module: str  # the learned.py that declares it (its __name__): where the four defaults below are found
    # The VAE's functions, no default: a VAE recipe (a learned.py's VAE_RECIPE) names them for the
    # families that share that VAE
    new_vae: str  # new_vae(image_size) -> the family's VAE class, tiny, random, float32
    save_vae: str  # save_vae(vae, paths, diffusers: bool): as released (diffusers folders too)
    family: str = ""  # family(paths: {config key: path}) -> the DiffusionFamily on those files
    encode_kwargs: tuple[tuple[str, int], ...] = ()  # the family's load_text_encoder keywords (sequence lengths)
    write_text_encoders: str = ""  # write_text_encoders(paths): the frozen tiny encoders
    new_transformer: str = ""  # new_transformer(text: {name: [N, ...] embeddings}) -> tiny model, float32
    save_transformer: str = ""  # save_transformer(model, paths, diffusers: bool): as released
    config: str = ""  # configs/<file>: the quickstart that teaches this base the concept ("zxq" = a purple star)
    vae_lr: float = 1.5e-3  # the pretrainer's peak learning rate for the VAE (cosine schedule)
    vae_steps: int = 1500  # the pretrainer's VAE steps (batch 16) unless --vae_steps says otherwise
    compile_vae: bool = False  # the pretrainer's VAE step under torch.compile (CPU: where fused kernels repay the compile)
    # The family's VAE format holds a latent shift (latents = (z - shift) * scale); False: scale only
    # (z * scaling_factor), and the pretrainer's scale is 1 / the RMS of z, not 1 / its std
    latent_shift: bool = True
    # The pretrainer's sigma draw for the transformer (flow_matching.sample_sigmas' method and shift): "" = the
    # family's default timestep sampling. For a family whose default draws few high-noise sigmas at the scenes'
    # 16 tokens, where a render's layout is decided (its learned.py says what it measured)
    dit_sampling: str = ""
    dit_shift: float = 3.0
    # tests/test_learning.py's concept LoRA on this base (AdamW at 3e-3, rank 8, the bf16 base, fp32 compute):
    # (steps, share of the trigger prompts rendered with the concept after at least, share of the unrelated prompts
    # the base renders right kept right at least); the learned.py says what it measured
    learning_test: tuple[int, float, float] = (60, 0.5, 0.7)
    before_at_most: float = 0.1  # share of the trigger prompts the base may render as the concept by chance

    def __post_init__(self):  # the four left out: the module's functions of those names
        for name in ("family", "write_text_encoders", "new_transformer", "save_transformer"):
            if not getattr(self, name):
                object.__setattr__(self, name, f"{self.module}:{name}")


# ----------------------------------------------------------------------------------------------
# Peer trainers' names for a folder's models (tools/convert_config.py, library/training/peers/)


@dataclass(frozen=True)
class PeerDraw:
    """A peer's timestep_sampling value that is one family's resolution shift (musubi-tuner's qwen_shift ...)."""
    ours: str  # our timestep_sampling for it on this family's latents
    note: str = ""  # the line's note where ours is named otherwise
    # why another model takes none of it ("": a model of the same token layout takes it as is, a token-grid one
    # refuses it: there it counts a quarter of the tokens)
    elsewhere: str = ""
    reads_sigmoid_scale: bool = True  # the draw is sigmoid(sigmoid_scale * randn), shifted


@dataclass(frozen=True)
class PeerMixture:
    """A peer's hybrid timestep_sampling named after this family's model (musubi-tuner's qinglong_<model>): ours'
    timestep_sampling = "qinglong" with these shares, its mid draw the peer's `mid` draw as carried on the model."""
    mid: str  # the peer's timestep_sampling value its mid draw is
    logsnr_share: float
    detail_share: float


@dataclass(frozen=True)
class PeerFixed:
    """A peer's own option for this family's models (musubi-tuner's script argument, ai-toolkit's model_kwargs entry)
    that ours reads at one value: given at it, dropped; given otherwise, not carried (with `why` for both)."""
    why: str
    # the value ours trains at; a dict: per release (our model_version -> value); None: none (ours reads nothing of
    # it, whatever it is: dropped)
    ours: object = None
    peer_default: object = None  # the peer's value where the option is left out (None: ours' at each release)


@dataclass(frozen=True)
class PeerAsKeys:
    """A peer's own option that ours trains as config keys: its value sets `key`, `with_keys` beside it (the rest of
    how the peer reads it). Where that is the release's own (`released`: our model_version -> {key: value}), nothing
    is written and the line says so; peer_default: the peer's value where the option is left out."""
    why: str
    key: str
    with_keys: dict = field(default_factory=dict)
    released: dict = field(default_factory=dict)
    peer_default: object = None

    def keys(self, value: float) -> dict:
        return {self.key: float(value), **self.with_keys}


@dataclass(frozen=True)
class PeerSampleCfg:
    """How a peer's samples read a prompt line's --l on this model where ours reads it otherwise: the peer runs
    standard CFG (uncond + l (cond - uncond)) only above l = 1, and only with a --n where needs_negative; its l is
    ours + offset (ours: the release's guidance g in cond + g (cond - uncond), on whenever g > 0, the empty prompt
    the negative without a --n); default: its l where a line has none."""
    default: float
    offset: float = 0.0
    needs_negative: bool = False

    def ours(self, peer_l: float | None, has_negative: bool) -> float:
        """Our --l for a line the peer renders with `peer_l` (None: none given): 0 where it runs no CFG."""
        scale = self.default if peer_l is None else peer_l
        return scale - self.offset if scale > 1.0 and (has_negative or not self.needs_negative) else 0.0


@dataclass(frozen=True)
class PeerLoRAArg:
    """A network_args item ours needs to train the modules a peer's LoRA module trains on this model."""
    item: str  # the item; "in_dims=network_dim": every embedder of the spec's lora.in_dim_types at the config's rank
    why: str
    # "": always; "exclude_patterns": not where the config gives them (they replace the peer's default, which this
    # item stands for); "lora": with the peer's LoRA module only (not its LyCORIS ones)
    unless: str = ""


@dataclass(frozen=True)
class MusubiModels:
    """How musubi-tuner names this folder's models (library/training/peers/musubi_tuner.py, musubi_dataset.py):
    one training script and LoRA module per family, its version keys the variant."""
    script: str  # its training script ("<name>_train_network.py")
    lora_module: str  # its LoRA module ("networks.lora_<name>")
    model_type: str  # our model_type its script and module train (without a version key)
    # its version key's values -> our keys (model_type, and model_version where ours has one)
    versions: dict[str, dict[str, str]] = field(default_factory=dict)
    version_key: str = "model_version"  # its script's argument that names the version
    # its script's version where the key is left out, written as ours' model_version ("": ours decides, as there)
    default_version: str = ""
    # its version switches (edit_plus = true) -> the model_version value each stands for, in the order it reads them
    version_switches: dict[str, str] = field(default_factory=dict)
    versions_unread: str = ""  # why a version without our model_version is left to ours ("" : model_type says it)
    # our model_types that train on its control_directory -> how ours sizes a reference: "target" (to its target's
    # bucket, musubi-tuner's default there), "area" (at the resolution's area, its own aspect), "own" (its own size
    # up to 1 MP)
    references: dict[str, str] = field(default_factory=dict)
    layered: dict[str, str] = field(default_factory=dict)  # our model_types that train on its multiple_target -> name
    # its per-model dataset keys it renames (load_user_config) -> the name it reads them by
    dataset_renames: dict[str, str] = field(default_factory=dict)
    text_encoder_files: dict[str, str] = field(default_factory=dict)  # its text_encoder1 / 2 -> our key
    # ours' blocks_to_swap per one of its (it swaps N // 2 double blocks and 2 (N - N // 2) single: ~2 N single)
    swap_scale: int = 1
    draws: dict[str, PeerDraw] = field(default_factory=dict)  # its timestep_sampling values that are this model's
    default_draw: str = "sigma"  # its script's timestep_sampling default
    # why other models' resolution-shift draws (another spec's `draws`) do not carry to this one ("": each by its
    # PeerDraw, on a token layout like theirs)
    other_draws: str = ""
    # its weighting_scheme values its script takes -> ours (empty: every value, as ours reads it), with why
    weighting: dict[str, str] = field(default_factory=dict)
    weighting_note: str = ""
    token_grid: bool = False  # its latents are the token grid (else a 2x2 patch of them is one token)
    mixtures: dict[str, PeerMixture] = field(default_factory=dict)  # its hybrid draws named after this model
    lora_args: tuple[PeerLoRAArg, ...] = ()
    ignored_args: dict[str, str] = field(default_factory=dict)  # its script's own arguments ours reads nothing of -> why
    same_args: tuple[str, ...] = ()  # its script's own arguments that are this folder's config_keys of the same meaning
    sample_cfg: PeerSampleCfg | None = None  # its samples' --l where ours reads it otherwise (None: as ours)
    # its script loads the DiT in float32 unless mixed_precision says bf16 / fp16 (as given: unset is not accelerate's);
    # False: in bf16 whatever it says (fp16 for "fp16" on some), its "no" then a float32 LoRA over the bf16 DiT
    float32_dit_without_mixed_precision: bool = False


@dataclass(frozen=True)
class SdScriptsModels:
    """How sd-scripts names this folder's models (library/training/peers/sd_scripts.py): the script that trains
    them, its LoRA module, and its --model_type values (or, for a script of its own, that script's arguments)."""
    script: str  # its training script ("<name>_train_network.py"); specs may share one (with --model_type values)
    lora_module: str  # its LoRA module of the model's blocks (ours: networks.lora)
    models: dict[str, dict[str, str]]  # its --model_type values -> our keys (model_type)
    default: str = ""  # its --model_type default where it is one of these (every spec that lists sd-scripts: one)
    draws: tuple[str, ...] = ()  # its timestep_sampling values named after this model: our draws of the same name
    # its LoRA-merge script's flags named after this model -> ours (tools/merge_lora.py names them for the user)
    merge_flags: dict[str, str] = field(default_factory=dict)
    # A script of its own (one that takes no --model_type): what its parser has beside train_network's, which
    # library/training/peers/sd_scripts_script.py reads. The first script the registry lists is sd_scripts.RULES'.
    model_type: str = ""  # our model_type its script trains where `models` is empty (the script says the model)
    lacks: tuple[str, ...] = ()  # sd_scripts.RULES' arguments its parser does not take (unknown in its configs)
    files: dict[str, str] = field(default_factory=dict)  # its model-file arguments -> our config keys
    defaults: dict[str, object] = field(default_factory=dict)  # its parser's defaults that differ from THEIR_DEFAULTS
    token_lengths: dict[str, int] = field(default_factory=dict)  # its tokenizer-length arguments -> the count ours runs
    ignored_args: dict[str, str] = field(default_factory=dict)  # its own arguments ours reads nothing of -> why
    refused_args: dict[str, str] = field(default_factory=dict)  # its own arguments not carried unless empty -> why
    # "": its loss compares velocities, as ours; else why its huber is not ours' (a loss on the predicted clean
    # latent: huber of sigma x the velocity error, where ours' x0 weighting is sigma^2 x huber of the error)
    huber_not_ours: str = ""
    # Its samples' CFG scale without --l where they read --l alone (their --g unread, where ours reads a lone --g as
    # the CFG scale): sd_scripts_samples drops --g and writes this --l on a line without one. None: as ours reads them
    sample_scale: float | None = None
    sample_flags: tuple[str, ...] = ()  # prompt flags its samples read beyond --w --h --s --d --l --g --n (--fs)
    lora_module_args: tuple[str, ...] = ()  # the network_args its LoRA module reads (empty: sd_scripts.LORA_ARGS)
    # its LoRA module's switches (network_args "name=true") -> ours' item, "{network_dim}" standing for the rank
    lora_switches: dict[str, str] = field(default_factory=dict)
    same_args: tuple[str, ...] = ()  # its own arguments ours reads by the same name and meaning
    # its timestep_sampling values ours has no equal draw of -> why, with ours' closest setting
    draws_refused: dict[str, str] = field(default_factory=dict)
    draws_carried: dict[str, dict[str, str]] = field(default_factory=dict)  # its own timestep_sampling -> our keys
    # "module:function" (its network_args {name: text}, network_dim) -> (ours' network_args items, {its arg: (verdict
    # "renamed" / "dropped" / "not carried", why)}): where its LoRA module's default or rank arguments train other
    # modules than ours' by the same names; called with no arguments too (its default). "": the args one by one
    lora_args: str = ""
    text_lora_when_cached: bool = False  # its script trains the text encoder's LoRA on cached outputs (else it stops)
    fp8_base_off: str = ""  # why its script turns fp8_base off for this model ("": it casts the transformer)
    one_block_kind: bool = False  # blocks_to_swap N swaps N blocks (else N // 2 double and 2 (N - N // 2) single)
    # its own fp8 switches -> the "key=value" of ours they set (base_precision=fp8_scaled); one that sets
    # base_precision on makes its script ignore fp8_base / fp8_base_unet
    fp8_args: dict[str, str] = field(default_factory=dict)
    makes_text_lora: bool = True  # its LoRA module makes a text encoder LoRA where the script trains one
    timestep_feed: str = ""  # how its script feeds the drawn timestep where ours feeds it otherwise (a note)
    # its model-file arguments that default to pretrained_model_name_or_path where not given (its loader reads them
    # from an all-in-one checkpoint; ours' loaders take that checkpoint as each key's path)
    files_in_model: tuple[str, ...] = ()
    # A draw of its own (its script takes no timestep_sampling): the arguments that draw the timestep and weigh the
    # loss, and "module:function" ({each of draw_args: the config's value, else its default}) -> {the report's line
    # key (an argument, or "<argument> (<part>)"): (verdict, text, {our key: value})} that says what each became
    draw_args: tuple[str, ...] = ()
    draw: str = ""


# ----------------------------------------------------------------------------------------------
# The spec


@dataclass(frozen=True)
class ArchSpec:
    arch: str  # the architecture's name: LoRA metadata, fp8 rules, caches (a variant's is its base's)
    title: str  # how messages and reports name it
    # Regexes (case-insensitive) of the names the family goes by in code and text; the name-scan
    # test (tests/test_family_names.py) fails on any of them outside the family's folder.
    names: tuple[str, ...] = ()
    # lora, lora_files and fp8 every spec gives, a family's also sampling to tiny (registry.REQUIRED_PARTS)
    lora: LoRATargets | None = None  # LoRA targets and key names (section above)
    lora_files: LoRAFiles | None = None  # converters' key tables
    fp8: FP8Rules | None = None  # keep-high-precision rules
    gguf: GgufLayout | None = None  # ComfyUI-GGUF's layout (merge_lora --save_precision gguf_*); None: not written
    sampling: Sampling | None = None  # timestep sampling and shift defaults (diffusion architectures)
    transformer: TransformerHooks | None = None  # loading and driving the transformer from a checkpoint
    config_keys: tuple[ConfigKey, ...] = ()  # the family's own training-config keys
    planner: Planner | None = None  # memory planner shapes and presets
    tiny: TinySpec | None = None  # tiny model writers
    learned: str = ""  # "module:NAME" of its LearnedBase (the tiny base that has learned), if it has one
    default_config: str | None = None  # configs/<file>: the config the README points a new user to
    # release -> the sample steps it renders with where a prompt has no --s (tools/generate.py --help lists
    # them; the family reads them): its diffusers pipeline's num_inference_steps default, a step-distilled
    # release's own count.
    sample_steps: dict = field(default_factory=dict)
    # release -> its default sample guidance (--g): the embedded guidance, or the CFG scale of a model that
    # runs a negative prompt (each family's comment says where it is not its pipeline's default); a release
    # that reads no guidance is not listed.
    sample_guidance: dict = field(default_factory=dict)
    # release -> its ModelSpec names (a family's spec gives them: registry.FAMILY_PARTS). A key is a release as the
    # family's model_version writes it (ss_base_model_version), or its beginning up to a "-": the longest key that
    # is the release or begins it followed by "-" names it (modelspec_of).
    modelspec: dict[str, ModelSpecNames] | None = None
    # peer (library/training/peers PEERS name) -> {the peer's name for one of this folder's models (ai-toolkit's
    # model.arch, ...): the config keys that name that model here (model_type, and model_version
    # where the peer's name says it)}, or for musubi-tuner its MusubiModels, for sd-scripts its SdScriptsModels:
    # tools/convert_config.py reads a peer's config by it, and refuses a name no spec lists. Adding a family a peer
    # trains is a line here, not in the peer.
    peer_models: dict[str, dict[str, dict[str, str]] | MusubiModels | SdScriptsModels] = field(default_factory=dict)
    # peer -> the bucket step (px) it trains this folder's models at whatever its config says (ai-toolkit: the
    # model's get_bucket_divisibility, which replaces a dataset's bucket_tolerance; musubi-tuner: its
    # BucketSelector's step for the model, 16 where a spec gives none)
    peer_bucket_steps: dict[str, int] = field(default_factory=dict)
    # peer -> {its own option for these models (musubi-tuner's script argument; ai-toolkit's
    # "model.model_kwargs.<name>"): the value ours reads it at (PeerFixed), or the keys ours trains it as (PeerAsKeys)}
    peer_options: dict[str, dict[str, PeerFixed | PeerAsKeys]] = field(default_factory=dict)
    # its text encoder's padding is masked in attention (its pipeline's rule: a peer's mask switch is read by it)
    masks_text_padding: bool = False

    def __post_init__(self):
        _check_type(self, ArchSpec, "SPEC")

    def modelspec_of(self, release: str) -> ModelSpecNames | None:
        """The ModelSpec names of `release` (a model_version: "<key>" or "<key>-..."), None where no key names it."""
        keys = [k for k in (self.modelspec or {}) if release == k or release.startswith(k + "-")]
        return self.modelspec[max(keys, key=len)] if keys else None


# ----------------------------------------------------------------------------------------------
# Type checks of a spec as it is built: a mistyped field (a tuple for a MuLine, a string for a tuple of
# rules) is one error naming it at import, not a crash in the code that reads it minutes into a run.


@functools.cache
def _field_types(cls) -> dict:
    return typing.get_type_hints(cls)


def _fits(value, hint) -> bool:
    """value is of hint at its top level (a union: of one member; a float field takes an int)."""
    if hint is object:
        return True
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_fits(value, member) for member in typing.get_args(hint))
    return isinstance(value, (int, float) if hint is float else typing.get_origin(hint) or hint)


def _check_type(value, hint, path: str) -> None:
    """value is of hint, and so are its items and, for a spec part, its fields; else a TypeError naming `path`
    (SPEC.sampling.mu)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next((member for member in typing.get_args(hint) if _fits(value, member)), hint)
    if not _fits(value, hint):
        expected = hint.__name__ if isinstance(hint, type) else str(hint).replace(f"{__name__}.", "")
        raise TypeError(f"{path}: expected {expected}, got {value!r}")
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is tuple and args:
        items = args[:1] * len(value) if args[-1] is Ellipsis else args
        if len(items) != len(value):
            raise TypeError(f"{path}: expected {len(items)} items, got {value!r}")
        for i, (item, item_hint) in enumerate(zip(value, items)):
            _check_type(item, item_hint, f"{path}[{i}]")
    elif origin is dict and args:
        for key, item in value.items():
            _check_type(key, args[0], f"{path} key")
            _check_type(item, args[1], f"{path}[{key!r}]")
    elif is_dataclass(value):
        for f in fields(value):
            _check_type(getattr(value, f.name), _field_types(type(value))[f.name], f"{path}.{f.name}")
