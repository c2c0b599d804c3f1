"""The one small interface through which a diffusion family plugs into
training, sampling and the tools: load (transformer, VAE, text encoders), encode (images,
captions), predict (one denoiser call on packed latents) and sample (Euler flow matching, the same
code for training samples and tools/generate.py).

A family lives in its own folder (library/models/<family>/family.py) and is registered with one
line in FAMILIES (library/models/registry.py); nothing else in the trainer or the tools names a family.

Edit families also take reference images: `control`, a list of reference
latents [B, 16, h_k, w_k] float32 (unpacked; the family packs them and gives them positions), the
same list from the dataset (control_directory), validation and sample prompts (--ci). Families
without references never see it (control is None). An edit family whose text encoder sees the
references too (text_sees_controls) has an encoder callable
encode(captions, condition_images) instead of encode(captions); its text is cached per
(caption, references).

Dtypes at the boundaries: latents and text embeddings are float32 (bf16 on disk); the model
casts its inputs to its `compute_dtype`; sigmas and positions stay float32/int64.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import importlib
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn as nn

from library.errors import SpecError
from library.io import safetensors_files
from library.data.controls import reference_images
from library.data.images import verified_image_size
from library.data.dataset_config import PIXELS_PER_TOKEN_SIDE
from library.data.prompts import NegativePrompt, rendered_side
from library.data.masks import on_latent_grid
from library.models import flow_matching as fm
from library.models.registry import BASE_PRECISIONS, FAMILIES, LOWBIT_PRECISIONS, arch_spec, spec_of  # noqa: F401  (their importers find them here too)
from library.models.spec import TextWeights, load_symbol
from library.models.latents import pack_latents, unpack_latents


def file_fingerprint(*paths: str | None) -> str:
    """Short id of model files (names, sizes, mtimes in nanoseconds) for cache keys: a changed model
    file invalidates the caches made with it without hashing gigabytes (whole seconds missed a
    same-size file rewritten within the second). A file counts with what its loader reads: the shards
    a .safetensors.index.json lists and a config.json beside it (a replaced shard kept the key)."""
    h = hashlib.sha256()
    for path in paths:
        if not path:
            continue
        if os.path.isfile(path):  # with what the loaders read beside it: an index's shards, a config.json
            folder, files = os.path.dirname(path), [path]
            files += safetensors_files(path) if path.endswith(".index.json") else []
            files += [c for c in [os.path.join(folder, "config.json")] if os.path.isfile(c) and c != path]
        else:
            folder = path
            files = sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs if f.endswith((".safetensors", ".json")))
        for f in files:
            st = os.stat(f)
            h.update(f"{os.path.relpath(f, folder)}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:10]


def fp8_prepare(mode: str | None, arch: str):
    """The `prepare` hook of the checkpoint loaders for a base precision (BASE_PRECISIONS): on the
    meta-built model, swap the Linears that arch's fp8 keep rules (its spec) do not keep for FP8Linear
    (fp8, fp8_scaled) or bitsandbytes' NF4Linear / Int8Linear (nf4, nf4_dq, int8), and return the
    per-tensor quantizing converter (quantization while loading)."""
    if mode in (None, "bf16"):
        return None
    rules = arch_spec(arch).fp8
    if mode in LOWBIT_PRECISIONS:
        from library.precision.bnb_weights import bnb_load_converter, prepare_bnb

        return lambda model: bnb_load_converter(prepare_bnb(model, mode, rules))
    from library.precision.fp8 import fp8_load_converter, prepare_fp8

    return lambda model: fp8_load_converter(prepare_fp8(model, mode, rules))


@dataclass
class Preservation:
    """Output preservation's second prompt for a batch (library/training/preservation.py): its text
    (as `text`), weights [B] (1: the sample has the term, 0: not), the multiplier, and base_off(), a
    context in which the model predicts as the base (the trained network off). `loss` keeps the last term."""
    text: dict
    weights: torch.Tensor
    multiplier: float
    base_off: Callable[[], contextlib.AbstractContextManager]
    loss: torch.Tensor | None = None


@dataclass
class ModelFile:
    """A file a family loads besides its transformer, as the training config names it, and how its
    safetensors header shows what it is (library/io.py check_model_file)."""

    key: str  # the config key: "ae", "clip_l", ...
    path: str
    what: str  # what it must be, for the error: "a CLIP-L text encoder"
    component: str  # its folder when `path` is a diffusers pipeline folder: "vae", "text_encoder", ...
    # key ending (a tuple: alternatives, as layouts name the tensor) -> its shape (None: any); every such file has them
    markers: dict[str | tuple[str, ...], tuple | None]
    # A text encoder's tokenizer as its loader looks for it (text_encoders.tokenizer_folder's arguments
    # after the weights): (tokenizer folder or None, sibling, kind[, beside_file]); None: the file has none
    tokenizer: tuple[str | None, str, str] | tuple[str | None, str, str, bool] | None = None


# A text encoder's token embedding as T5 (shared / encoder.embed_tokens), CLIP and the LLMs name it: [vocab, width]
TEXT_EMBEDDINGS = ("embed_tokens.weight", "shared.weight", "token_embedding.weight")


@dataclass(frozen=True)
class CheckpointNames:
    """How a transformer checkpoint names its tensors (tools/merge_lora.py reads a base by them): the
    answer of the family whose architecture it is (DiffusionFamily.checkpoint_names)."""

    naming: str  # the key layout: "bfl", "diffusers", ...
    prefix: str = ""  # before every transformer key (a ComfyUI file's "model.diffusion_model."); others are not its
    module_map: dict | None = None  # fused modules: model module -> [(module in the other naming, row0, row1)]
    native: bool = True  # the model's own module names (False: the other naming of module_map, converted)
    # module_map's keys are the checkpoint's modules and its parts the model's own (a single file that fuses
    # or renames the model's modules): the spec's LoRA targets and fp8 rules name the parts
    parts_are_model: bool = False


def input_perturbation(noise: torch.Tensor, args, generators: list[torch.Generator]) -> torch.Tensor | None:
    """The noise of the model's input under the config's ip_noise_gamma (flow_matching.perturbed_noise), or None."""
    return fm.perturbed_noise(noise, getattr(args, "ip_noise_gamma", 0.0),
                              getattr(args, "ip_noise_gamma_random_strength", False), generators)


def takes(key, value) -> bool:
    """Whether a family ConfigKey takes `value` as the config check would (its type; an int >= 1 and <= most)."""
    if key.type is int:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 1 and value <= (key.most or value)
    return isinstance(value, key.type)


class DiffusionFamily:
    name: str  # the model_type of the training config: the name the family is registered under
    text_path_keys: tuple[str, ...] = ()  # config keys of the text encoder files
    optional_path_keys: tuple[str, ...] = ()  # config keys of files the family finds itself when unset
    # Further config keys its __init__ takes by their names (None where the config gives none): from_args passes them
    option_keys: tuple[str, ...] = ()
    sample_guidance: float = 4.0  # default --g of sample prompts
    sample_steps: int = 20  # default --s of sample prompts: each family's own, from its spec's sample_steps
    true_cfg = False  # samples run a negative prompt (classifier-free guidance)
    cfg_above = 1.0  # a true-CFG family runs the negative prompt only where guidance > this (its pipeline's test)
    empty_negative = ""  # what a sample without --n encodes as its negative prompt (the model card's: sample_negative)
    render_size = 1024  # generate.py's side without --width / --height: the pipeline's default image size
    sample_seed_offset = 0  # samples draw their noise from seed + this (a pipeline that seeds its generator so)
    vae: str  # "module:Class" of its VAE wrapper (library/models/vae.py's kind: Class(path, dtype), built on meta too)
    # Its VAE loads from a file, the config key `ae`. False: the wrapper reads none (vae.py's PixelVAE: a
    # pixel-space model's); `ae` is then neither required nor taken (unread_files) and no file keys its latent cache
    vae_file = True
    vae_downsample = 8
    patch = 2
    latent_channels = 16  # VAE latent channels: the latents are [B, latent_channels, H/8, W/8]
    max_controls = 0  # reference images a sample may carry (0: the family takes none)
    min_controls = 0  # reference images every training image needs
    # An edit model's type that also runs without references (min_controls 0): a training set of none is most likely
    # a forgotten control_directory, and the LoRA learns text-to-image (one warning before caching)
    edits_without_references_warn = False
    text_sees_controls = False  # the text encoder takes the reference images with the captions
    plan_controls = 0  # references the memory planner sizes a training sample for
    takes_layers = False  # trains on layered targets (a dataset's multiple_target: library/data/layers.py)
    # The text encoders can take turns on a card that cannot hold them together (load_text_encoder(...,
    # one_at_a_time=True)): the first of text_encoder_weights() stays, each other comes in for its own stage
    text_encoders_take_turns = False
    # References resized to their control_bucket without a crop (Lanczos), as the family's pipeline fits them
    # (False: covered and centre-cropped, as the images)
    stretches_references = False
    # The same for a sample's references (--ci), where the family's pipeline fits them otherwise than training does
    stretches_sample_references = property(lambda self: self.stretches_references)
    # The PIL mode reference images load in for the VAE, in training and samples alike: "RGBA" where the VAE reads
    # alpha and the family's pipeline feeds it the condition image's (alpha 255 for a file without)
    reference_mode = "RGB"

    # The transformer architecture: key of the LoRA targets, fp8 rules and flow-matching constants.
    # It is the family's name unless the class names another: a variant with the same transformer
    # (an edit variant) trains and loads LoRAs exactly as its base architecture.
    arch: str

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "name" in cls.__dict__ and "arch" not in cls.__dict__:
            cls.arch = cls.name

    def __init__(self, model_path: str, vae_path: str | None = None, **text_paths):
        self.model_path, self.vae_path, self.text_paths = model_path, vae_path, text_paths

    @classmethod
    def required_paths(cls) -> tuple[str, ...]:
        """Config keys naming the files training needs (checked before anything is loaded)."""
        return ("pretrained_model_name_or_path", *(("ae",) if cls.vae_file else ())) + cls.text_path_keys

    @classmethod
    def unread_files(cls) -> dict[str, str]:
        """File keys this model never reads -> why: a training config (unread_training_keys) or a generate.py flag
        that gives one is refused, not ignored."""
        if cls.vae_file:
            return {}
        return {"ae": f"model_type {cls.name} takes the image's pixels and has no VAE file"}

    @classmethod
    def from_args(cls, args) -> "DiffusionFamily":
        options = {k: getattr(args, k, None) for k in cls.option_keys}
        return cls(args.pretrained_model_name_or_path, args.ae, **options,
                   **{k: getattr(args, k) for k in cls.text_path_keys})

    def model_files(self) -> list[ModelFile]:
        """The files besides the transformer and what each must be: the family's own facts."""
        return []

    def check_model_files(self) -> None:
        """Before anything is loaded or cached (a VAE given as the transformer or a missing encoder
        would otherwise show after minutes of caching): the transformer through its own loader on
        meta, from its header, and every model_files() entry by its markers, its folder's config.json and
        its tokenizer (a CLIP-L beside only T5's). No tensor is read; a file that is missing, broken or not
        what it must be, or a tokenizer not found, is one CheckpointError naming its path."""
        from library.io import check_model_file, component_folder, read_json_file
        from library.models.text_encoders import tokenizer_folder

        files = self.model_files()
        widths = self.text_widths(self.load_transformer(torch.float32, read_weights=False).config)
        assert set(widths) <= {f.key for f in files}, f"text_widths names no model file: {sorted(widths)}"
        for f in files:
            path = component_folder(f.path, f.component)
            check_model_file(path, f.key, f.what, f.markers)
            if os.path.isfile(os.path.join(path, "config.json")):  # a broken one failed at the load, after caching
                read_json_file(os.path.join(path, "config.json"))
            if f.key in widths:  # another size of the right kind (Qwen3-4B for -8B) fails only at the first step
                check_model_file(path, f.key, f"{f.what} of width {widths[f.key]} (what the transformer's text input "
                                 f"takes)", {TEXT_EMBEDDINGS: (None, widths[f.key])})
            if f.tokenizer:
                tokenizer_folder(path, *f.tokenizer)

    def text_widths(self, config) -> dict[str, int]:
        """Config key of a text encoder -> the width of its hidden states the transformer (its `config`,
        read on meta) takes, which its token embedding has; check_model_files compares them. {}: none."""
        return {}

    def swappable_block_count(self) -> int:
        """The transformer's swappable_blocks(), counted on meta from its header (no tensor read)."""
        return len(list(self.load_transformer(torch.float32, read_weights=False).swappable_blocks()))

    def text_options(self, args) -> dict:
        """Encoder settings from the training config that change the embeddings (they are part of
        the text cache key and passed to load_text_encoder)."""
        return {}

    def stored_layout(self) -> str | None:
        """"fp8" / "fp8_scaled" / "fp8_tensor_scaled" / "gguf_q8_0" ... when the transformer checkpoint
        is pre-quantized (used as it is), else None."""
        from library.io import CheckpointReader, component_folder
        from library.precision.stored_layouts import stored_layout

        path = component_folder(self.model_path, "transformer")
        return stored_layout(CheckpointReader(path), path)

    def widened_layout(self, base_precision: str) -> str | None:
        """"fp8_e5m2" when the transformer checkpoint is a plain float8_e5m2 file (it loads widened to the
        compute dtype, exactly), else None; a base_precision other than bf16 asked of it is a
        ConfigError naming the file and its first e5m2 tensor."""
        from library.io import component_folder
        from library.precision.stored_layouts import widened_layout

        return widened_layout(component_folder(self.model_path, "transformer"), base_precision)

    def model_version(self, model: nn.Module) -> str:
        """The base model's name for LoRA metadata (modelspec-style: the release, e.g. its "-dev")."""
        return self.name

    def lora_release_note(self, metadata: dict) -> str | None:
        """Where a LoRA's header names another release of this family than the one this renders, read from the files
        and not from a flag (its own steps, guidance and shift): what renders and the flag for the other, for
        tools/generate.py's note (a LoRA may be meant for another release: said, not changed). None: nothing to say."""
        return None

    def other_release_note(self, trained: str, why: str) -> str:
        """lora_release_note's words: the release the LoRA names, the one this renders and `why` the files read as it."""
        return (f"was trained on {trained}; this renders {self.version} ({why}): give --model_version {trained} if "
                f"--model is that release")

    @classmethod
    def lora_trained_options(cls, metadata: dict) -> dict[str, tuple]:
        """Sampling options a LoRA's header says it was trained with and renders right only with, config key ->
        (value, the header's words for it): ss_trained_keys' (the family's ConfigKey.renders keys set, a text
        length), an edit LoRA's attention mask its references need. tools/generate.py sets them where its flag is
        left at the default. A value the key does not take (another tool's header) is left out."""
        try:
            trained = json.loads(metadata.get("ss_trained_keys") or "{}")
        except ValueError:
            return {}
        keys = {k.key: k for k in spec_of(cls.name).config_keys if k.renders} if cls.name in FAMILIES else {}
        pairs = trained.items() if isinstance(trained, dict) else ()
        return {name: (value, "ss_trained_keys") for name, value in pairs if name in keys and takes(keys[name], value)}

    # -- loading -------------------------------------------------------------------------------
    def load_transformer(self, dtype: torch.dtype, base_precision: str = "bf16", read_weights: bool = True) -> nn.Module:
        """The frozen transformer on the CPU through its spec's load hook (transformer.load), the base quantized while
        loading (fp8_prepare: fp8 / nf4 / int8); read_weights=False: on meta from the file's header."""
        load = load_symbol(arch_spec(self.arch).transformer.load)
        return load(self.model_path, dtype=dtype, prepare=fp8_prepare(base_precision, self.arch),
                    read_weights=read_weights)

    def load_vae(self, dtype: torch.dtype = torch.float32):
        """The family's VAE wrapper (`vae`) from vae_path (None without a file: vae_file), in `dtype`."""
        return load_symbol(self.vae)(self.vae_path, dtype)

    def load_text_encoder(self, precision: str = "bf16", device=None, **options):
        """-> callable(captions: list[str]) -> list of per-caption dicts of float32 tensors (cacheable).
        precision: text_encoder_precision (fp32 / fp16 / bf16 / fp8 / fp8_scaled: weights loaded
        tensor by tensor straight into it); device: where the encoders run (None: the CPU).
        options: what text_options() returns."""
        raise NotImplementedError

    def caption_token_limit(self, args):
        """-> library.data.check.TokenLimit: how the text encoder counts a caption's tokens and how
        many it keeps (the dataset check warns about captions it cuts), from the tokenizer alone;
        None where the encoder keeps every token."""
        return None

    def largest_image(self) -> tuple[int, int] | None:
        """(width, height) in pixels of the largest image the transformer takes, from its config (the header, no
        tensor read): training images and sample prompts over it are refused before caching. None: any size (RoPE
        computed for every position, as most families do)."""
        return None

    def control_bucket(self, bucket: tuple[int, int], size: tuple[int, int],
                       resolution: tuple[int, int] | None = None) -> tuple[int, int]:
        """(w, h) a reference image of `size` is fitted to when its target's bucket is `bucket`; resolution: the
        target's dataset `resolution` (w, h), None where unknown (then the bucket stands for it).
        Default: the target's bucket."""
        return bucket

    def largest_reference(self, bucket: tuple[int, int]) -> tuple[int, int]:
        """(w, h) of the largest reference image control_bucket encodes for a target `bucket`: the memory
        planner's reference where it knows none (a preset, plan_memory's --references). Default: the bucket."""
        return bucket

    def reference_resize(self, bucket: tuple[int, int], size: tuple[int, int]) -> tuple[int, int] | None:
        """(w, h) a reference image of `size` is resized to (Lanczos) before a centre crop to its control_bucket
        (sample_control_bucket in samples), where the family's pipeline crops without resizing to that size (an
        image processor that floors the sides by a crop); None (default): covered and cropped, or stretched where
        stretches_references."""
        return None

    def sample_control_bucket(self, target: tuple[int, int], size: tuple[int, int]) -> tuple[int, int]:
        """(w, h) a sample's reference image of `size` is fitted to for a `target` (w, h) render
        (tools/generate.py, training samples). Default: the training rule, control_bucket."""
        return self.control_bucket(target, size)

    def sample_size(self, width: int, height: int, references: list[tuple[int, int]]) -> tuple[int, int]:
        """(w, h) a sample renders at for a prompt's --w x --h and the (w, h) of its --ci images. Default: the
        prompt's size (a family whose pipeline sizes its output from the condition image says otherwise)."""
        return width, height

    def sample_references(self, paths, width: int, height: int) -> tuple[int, int, list[torch.Tensor]]:
        """(w, h, references) of a sample prompt with --ci images `paths` and size width x height: the size it
        renders at (sample_size) and its references as the VAE encodes them (library/data/controls.py
        reference_images: sample_control_bucket, stretches_sample_references, reference_mode). tools/generate.py and
        training samples both render from this. A side off the family's token grid (vae_downsample x patch: 32 px
        for a 32x VAE of patch 1, past the prompt parser's 16) is rounded down to it, with a warning."""
        width, height = self.sample_size(width, height, [verified_image_size(p) for p in paths])
        if (side := self.vae_downsample * self.patch) > PIXELS_PER_TOKEN_SIDE:
            width, height = (rendered_side(f"sample {name}", value, side) for name, value in (("width", width),
                                                                                              ("height", height)))
        return width, height, reference_images(paths, self.sample_control_bucket, width, height,
                                               self.stretches_sample_references, self.reference_mode,
                                               self.reference_resize)

    def sample_text_size(self, paths, width: int, height: int) -> tuple[int, int] | None:
        """The (w, h) a sample prompt's text encoder fits its --ci images `paths` to (encode(captions, views,
        sample_size)) at size width x height; None (default): its own rule, the same as training's."""
        return None

    def reference_vl_size(self, width: int, height: int) -> tuple[int, int] | None:
        """(w, h) the text encoder resizes a reference image of width x height to for its Qwen-VL image processor,
        whose aspect ratio limit (library/data/vlm_inputs.py check_aspect_ratio) the scan and the sample prompts
        check it against before caching; None: no Qwen-VL image processor sees the references."""
        return None

    def reference_text_tokens(self, width: int, height: int) -> int:
        """Tokens a reference image of width x height adds to the text sequence (the memory planner):
        none unless the text encoder sees the references (text_sees_controls)."""
        return 0

    def text_encoder_weights(self) -> list[TextWeights]:
        """The text encoders' parameters as load_text_encoder keeps them (the memory planner's caching
        phase, from the files' headers): every tensor of the text encoder files, none fp8 or kept
        float32, unless the family reads fewer or its loader stores them so."""
        from library.io import CheckpointReader, component_folder

        # A key's path may be a pipeline folder holding the component under the key's name (a
        # text_encoder key naming the whole repository, its text_encoder/ and tokenizer/ inside), as
        # the loaders take it.
        return [TextWeights(CheckpointReader(component_folder(p, key)).numel()) for key, p in self.text_paths.items() if p]

    def text_encoder_params(self) -> int:
        """Parameters load_text_encoder reads (text_encoder_weights')."""
        return sum(w.params for w in self.text_encoder_weights())

    def text_on_meta(self, model: nn.Module, batch: int, tokens: int) -> dict:
        """The cached text a training batch carries (float32, as encode gives it, `tokens` long),
        on meta, sized for `model` (the memory planner)."""
        raise NotImplementedError

    def vae_on_meta(self):
        """load_vae's wrapper around the diffusers VAE built on meta from the config at vae_path (the
        released VAE's without one): no weight is read (the memory planner). A wrapper without a file holds no
        weights: it is its own."""
        from library.models.vae import vae_on_meta

        return vae_on_meta(load_symbol(self.vae), self.vae_path) if self.vae_file else self.load_vae()

    @classmethod
    def checkpoint_names(cls, keys: list[str], shape) -> CheckpointNames | None:
        """How a transformer checkpoint with tensor names `keys` (shape(key): its shape) names its
        modules when it is one of this architecture's, else None (tools/merge_lora.py asks every
        architecture). No tensor is read."""
        return None

    def latent_cache_key(self) -> str:
        """Family + fingerprint of the VAE files (the preprocessing is hashed per image); without a file, the
        wrapper's class name."""
        return f"{self.name}_{file_fingerprint(self.vae_path) if self.vae_file else self.vae.rpartition(':')[2]}"

    def text_cache_key(self, options: dict, precision: str) -> str:
        """Family + fingerprint of the encoder files + every other input of the encoding: the
        text_options (token lengths, encoder precision, ...), the dtype the encoders run in and
        the family's fixed prompt handling (text_encoding_constants), and the tokenizer files (text_files).
        Change any, re-encode."""
        settings = (sorted(options.items()), str(precision), sorted(self.text_encoding_constants().items()))
        if precision == "fp16" and "t5_max_length" in options:  # a T5 family's: its fp16 caches before
            settings += ("t5 wo float32",)  # 2026-11-27 ran wo in the file's fp16 / bf16 (load_t5): encoded anew
        digest = hashlib.sha256(repr(settings).encode()).hexdigest()[:8]  # apart: a constant named as an option hid it
        return f"{self.name}_{file_fingerprint(*self.text_files())}_{digest}"

    def text_files(self) -> list[str]:
        """The files the prompt encoding reads (text_cache_key fingerprints them): the text encoder paths, then the
        tokenizer files in or beside them (a single encoder file's tokenizer lies beside it, and a folder's
        spiece.model is no .json)."""
        from library.models.text_encoders import tokenizer_files

        paths = [p for p in self.text_paths.values() if p]
        return [*paths, *sorted({f for p in paths if os.path.exists(p) for f in tokenizer_files(p)})]

    def text_encoding_constants(self) -> dict:
        """Fixed inputs of the prompt encoding (templates, dropped tokens, maximum lengths)."""
        return {}

    # -- the denoiser --------------------------------------------------------------------------
    def pack_target(self, latents: torch.Tensor) -> torch.Tensor:
        """A training target's latents -> the tokens predict takes: [B, C, H, W] -> [B, H*W/4, 4C]
        (a layered family's frames [B, C, F, H, W]: packed frame after frame)."""
        return pack_latents(latents)

    def unpack_target(self, tokens: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """The inverse of pack_target: tokens -> latents of `shape`."""
        return unpack_latents(tokens, shape[-2], shape[-1])

    def target_on_meta(self, batch: int, lh: int, lw: int, layers: int | None = None) -> torch.Tensor:
        """A training batch's latents at lh x lw on meta (the memory planner); layers: a layered target's
        (takes_layers families; None: the family's own)."""
        return torch.empty(batch, self.latent_channels, lh, lw, device="meta")

    def predict(self, model: nn.Module, x_t: torch.Tensor, sigmas: torch.Tensor, text: dict, h: int, w: int,
                guidance: float | None, control: list[torch.Tensor] | None = None) -> torch.Tensor:
        """x_t: packed latents [B, h*w, 4C] float32 (h, w in patches); sigmas [B] float32;
        control: reference latents (edit families only). Returns the predicted velocity of the
        target tokens, packed, in the model's compute dtype."""
        raise NotImplementedError

    # -- training objective --------------------------------------------------------------------
    def training_loss(self, model, latents: torch.Tensor, text: dict, args, generators: list[torch.Generator],
                      mask: torch.Tensor | None = None, sample_weights: torch.Tensor | None = None,
                      control: list[torch.Tensor] | None = None, preservation: Preservation | None = None,
                      strata: list[int] | None = None):
        """Flow-matching loss for a batch of latents [B, C, H/8, W/8] (float32). One CPU
        generator per sample draws its noise and sigma, so a sample's draw does not depend on its
        batch position or process. mask: [B, 1, H/8, W/8] loss masks; sample_weights: [B] (e.g.
        prior_loss_weight on regularization images); control: reference latents (edit families).
        Layered targets: latents [B, C, F, H/8, W/8] (pack_target). Returns the scalar float32 loss
        and the sigmas. A family whose VAE downsamples more (16x) gets the masks area-averaged to
        its latent grid, one without a VAE (pixels) repeated onto it (they are cached on the 8-pixel grid:
        they broadcast nowhere else).
        preservation: a second prompt's term added to the loss (Preservation). strata: each sample's stratum of
        num_timestep_buckets (its sigma's quantile drawn within it: fm.stratified_quantiles)."""
        lh, lw = latents.shape[-2:]
        if mask is not None:
            mask = on_latent_grid(mask, (lh, lw))
        noise = torch.stack([torch.randn(latents.shape[1:], generator=g, dtype=torch.float32) for g in generators])
        lo, hi = fm.timestep_range(args)
        preserve = getattr(args, "preserve_distribution_shape", False)
        quantiles = ([None] * len(generators) if strata is None else
                     fm.stratified_quantiles(strata, args.num_timestep_buckets, generators))
        sigmas = torch.cat([fm.sigmas_in_range(lambda n, g=g, q=q: self.draw_sigmas(model, args, g, lh, lw, n, q), 1,
                                               lo, hi, preserve) for g, q in zip(generators, quantiles)])
        noise, sigmas = noise.to(latents.device), sigmas.to(latents.device)
        if getattr(args, "timestep_loss_weights", None):  # a table of weights over sigma (ai-toolkit's "weighted")
            table = fm.table_weights(sigmas, fm.loss_table(args.timestep_loss_weights))
            sample_weights = table if sample_weights is None else sample_weights.float() * table
        loss = self.loss_at(model, latents, text, noise, sigmas, args.guidance_scale, args.weighting_scheme,
                            args.loss_type, args.huber_c, mask, sample_weights, control=control,
                            preservation=preservation, input_noise=input_perturbation(noise, args, generators))
        return loss, sigmas

    def draw_sigmas(self, model, args, generator: torch.Generator, lh: int, lw: int, count: int,
                    quantiles: torch.Tensor | None = None) -> torch.Tensor:
        """`count` sigmas of this model's training law (timestep_sampling, or the model's own; its shift at one
        lh x lw latent frame's token count), float32 [count], from one sample's generator, or of its given uniform
        quantiles [count] (num_timestep_buckets); training_loss keeps them in min_timestep / max_timestep
        (fm.sigmas_in_range). qinglong: the mixture, its mid draw qinglong_mid's law (unset: the model's own)."""
        method = args.timestep_sampling or self.default_timestep_sampling(model)
        if method != "qinglong":
            return self.law_sigmas(model, args, method, generator, lh, lw, count, quantiles)
        mid = getattr(args, "qinglong_mid", None) or self.default_timestep_sampling(model)
        return fm.qinglong_sigmas(count, generator,
                                  lambda: self.law_sigmas(model, args, mid, generator, lh, lw, count, quantiles),
                                  (args.qinglong_logsnr_share, args.qinglong_detail_share),
                                  (args.logsnr_mean, args.logsnr_std), getattr(args, "timestep_bias", "none"),
                                  quantiles)

    def law_sigmas(self, model, args, method: str, generator: torch.Generator, lh: int, lw: int, count: int,
                   quantiles: torch.Tensor | None = None) -> torch.Tensor:
        """`count` sigmas of one law (a timestep_sampling value but qinglong) at lh x lw, as draw_sigmas says;
        a family whose own law is not flow_matching's (its default_timestep_sampling's) overrides this."""
        return fm.sample_sigmas(count, method, generator=generator, shift=args.discrete_flow_shift,
                                sigmoid_scale=args.sigmoid_scale, image_seq_len=(lh // self.patch) * (lw // self.patch),
                                bias=getattr(args, "timestep_bias", "none"),
                                logsnr=(getattr(args, "logsnr_mean", fm.LOGSNR[0]),
                                        getattr(args, "logsnr_std", fm.LOGSNR[1])), quantiles=quantiles,
                                shifted=getattr(args, "shifted_draw", "sigmoid"),
                                sigmoid_mean=getattr(args, "sigmoid_mean", 0.0),
                                mode_scale=getattr(args, "mode_scale", fm.MODE_SCALE))

    def loss_at(self, model, latents: torch.Tensor, text: dict, noise: torch.Tensor, sigmas: torch.Tensor,
                guidance: float | None, weighting: str = "none", loss_type: str = "l2", huber_c: float = 0.1,
                mask: torch.Tensor | None = None, sample_weights: torch.Tensor | None = None,
                control: list[torch.Tensor] | None = None, preservation: Preservation | None = None,
                input_noise: torch.Tensor | None = None):
        """The flow-matching loss at given noise (float32, latents' shape) and sigmas (float32 [B]),
        all on the latents' device: scalar float32. training_loss draws them; validation fixes them.
        Only the target's tokens are in the loss (predict returns no reference tokens). input_noise: the
        noise of the model's input where it is not `noise` (ip_noise_gamma: input_perturbation). Both pass
        through model_noise before x_t and the target are made of them."""
        h, w = latents.shape[-2] // self.patch, latents.shape[-1] // self.patch
        noise, input_noise = self.model_noises(noise, input_noise, sigmas)
        x_t = self.pack_target(fm.noisy_input(latents, noise if input_noise is None else input_noise, sigmas))
        pred = self.predict(model, x_t, sigmas, text, h, w, guidance, **control_kwargs(control))
        target = self.pack_target(fm.flow_target(latents, noise))
        if mask is not None:  # one weight per latent element, packed like the latents
            mask = self.pack_target(mask.expand_as(latents))
        weights = fm.loss_weighting(sigmas, weighting)
        if sample_weights is not None:
            weights = sample_weights.float() if weights is None else weights * sample_weights.float()
        loss = fm.flow_loss(pred, target, weights, loss_type, huber_c, mask)
        if preservation is not None:
            loss = loss + self.preservation_term(model, x_t, sigmas, h, w, guidance, control, preservation)
        return loss

    def model_noise(self, noise: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
        """The noise the model was trained to remove, made of a standard normal draw `noise` (float32, the latents'
        shape) at sigmas (float32 [B]): x_t and the flow target are made of it (loss_at, so validation too). The
        draw itself (the same tensor: every family's loss bit for bit) unless the family's model was trained on
        other noise (a pixel-space model's scaled, clipped noise)."""
        return noise

    def model_noises(self, noise: torch.Tensor, input_noise: torch.Tensor | None,
                     sigmas: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """model_noise of loss_at's noise and of its input_noise (None stays None)."""
        return self.model_noise(noise, sigmas), None if input_noise is None else self.model_noise(input_noise, sigmas)

    def preservation_term(self, model, x_t: torch.Tensor, sigmas: torch.Tensor, h: int, w: int, guidance: float | None,
                          control: list[torch.Tensor] | None, preservation: Preservation) -> torch.Tensor:
        """multiplier * the batch mean of each sample's mean squared difference between the prediction for
        the second prompt with the trained network and without it (no gradient), at the same packed noisy
        input x_t and sigmas: scalar float32. Samples of weight 0 add 0."""
        p = preservation
        with torch.no_grad(), p.base_off():
            prior = self.predict(model, x_t, sigmas, p.text, h, w, guidance, **control_kwargs(control))
        pred = self.predict(model, x_t, sigmas, p.text, h, w, guidance, **control_kwargs(control))
        per_sample = (pred.float() - prior.float()).pow(2).flatten(1).mean(1)
        term = p.multiplier * (per_sample * p.weights.float()).mean()
        p.loss = term.detach()
        return term

    # -- sampling ------------------------------------------------------------------------------
    @torch.no_grad()
    def sample_latents(self, model, text: dict, width: int, height: int, steps: int, seed: int,
                       guidance: float | None, negative_text: dict | None = None,
                       control: list[torch.Tensor] | None = None, flow_shift: float | None = None) -> torch.Tensor:
        """Euler flow-matching sampling; returns unpacked latents [B, C, height/8, width/8] float32.
        control: reference latents (edit families), on the text's device. flow_shift: a prompt's --fs."""
        lh, lw = height // self.vae_downsample, width // self.vae_downsample
        h, w = lh // self.patch, lw // self.patch
        batch = next(iter(text.values())).shape[0]
        device = next(iter(text.values())).device
        gen = torch.Generator("cpu").manual_seed(seed + self.sample_seed_offset)
        noise = self.initial_noise(batch, lh, lw, gen).to(device)
        sigmas = fm.inference_sigmas(steps, h * w, self.arch, dynamic_shift=self.dynamic_shift(model),
                                     sampling=self.inference_sampling(), shift=flow_shift)

        def velocity(x, s):
            return self.guided_velocity(model, x, s, text, negative_text, h, w, guidance, **control_kwargs(control))

        def fresh_noise():  # a re-noising scheduler's draw: the starting noise's generator, in its shape
            return self.pack_target(torch.randn(noise.shape, generator=gen, dtype=torch.float32).to(device))

        return self.unpack_target(self.integrate(velocity, self.pack_target(noise), sigmas, fresh_noise), noise.shape)

    def integrate(self, velocity, noise: torch.Tensor, sigmas: torch.Tensor, fresh_noise) -> torch.Tensor:
        """The pipeline's scheduler over the sigmas, on packed latents: Euler (FlowMatchEulerDiscreteScheduler); a
        release that samples otherwise overrides it (fresh_noise(): packed noise, for a scheduler that re-noises)."""
        return fm.euler_sample(velocity, noise, sigmas)

    def sample_model_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of the weights sample_latents loads onto the device beside the trained transformer (a
        second transformer it guides with), from the files' headers, the rest in `dtype` (the memory
        planner's sampling phase); 0: none."""
        return 0

    def release_sample_models(self) -> None:
        """Free what sample_latents loaded for itself (DiffusionTask.render_samples, after each round
        of samples: nothing of it may stay on the device through the training steps)."""

    def initial_noise(self, batch: int, lh: int, lw: int, generator: torch.Generator) -> torch.Tensor:
        """Sampling's starting noise [B, C, lh, lw] float32 (a layered family's [B, C, F, lh, lw]), drawn
        in the order the family's diffusers pipeline draws it (the same seed on a CPU generator gives the
        pipeline's noise)."""
        return torch.randn(batch, self.latent_channels, lh, lw, generator=generator, dtype=torch.float32)

    @classmethod
    def sample_negative(cls, negative: str) -> NegativePrompt:
        """A sample's negative prompt as its text encoder takes it: --n, else empty_negative (the model card's:
        a space where the card passes one, as musubi-tuner's samples do; a cache keys its text, so a change of it is
        a new entry, never a stale one)."""
        return NegativePrompt(negative or cls.empty_negative)

    def guided_velocity(self, model, x, s, text, negative_text, h, w, guidance, control=None):
        """The conditional velocity in float32; a true-CFG family's, with a negative prompt and guidance above
        cfg_above, the pipelines' classifier-free guidance uncond + g (cond - uncond) (diffusers'
        ClassifierFreeGuidance, no rescale), the references in both passes. A pipeline that guides otherwise
        overrides it."""
        refs = control_kwargs(control)
        cond = self.predict(model, x, s, text, h, w, guidance, **refs).float()
        if not self.true_cfg or negative_text is None or guidance is None or guidance <= self.cfg_above:
            return cond
        uncond = self.predict(model, x, s, negative_text, h, w, guidance, **refs).float()
        return uncond + guidance * (cond - uncond)

    def reads_training_guidance(self) -> bool:
        """The model takes guidance_scale in training (a guidance-distilled model's embedding): its
        spec's sampling names a training guidance."""
        return fm.sampling_of(self.arch).guidance_scale is not None

    def unread_training_keys(self, args) -> dict[str, str]:
        """Training-config keys this model's training never reads with `args` -> why: set off their
        default, the run refuses them before caching (a loss or header that claims what was not done)."""
        unread = dict(self.unread_files())
        if not self.reads_training_guidance():
            unread["guidance_scale"] = f"model_type {self.name} has no guidance embedding to feed it to"
        return unread

    def unread_sample_options(self) -> dict[str, str]:
        """Sampling options this model never reads ("negative", "guidance", "flow_shift") -> why, from the class and
        the checkpoint's header (no weights): tools/generate.py refuses them as flags."""
        if self.true_cfg:
            return {}
        return {"negative": f"model_type {self.name} samples without a negative prompt (no true CFG)"}

    def guidance_is_cfg_scale(self) -> bool:
        """The sample guidance is a CFG scale (sd-scripts' --l), not an embedded guidance (its --g): the
        model samples with CFG, as a negative prompt it reads says (prompts.settle_scale reads --l by it)."""
        return self.true_cfg and "negative" not in self.unread_sample_options()

    def unread_prompt_options(self, negative: str, guidance: float | None,
                              flow_shift: float | None = None) -> dict[str, str]:
        """A sample prompt's options this model would not read ("negative", "guidance", "flow_shift") -> why: a
        negative where unread_sample_options says so or where its guidance runs no CFG (guidance <=
        cfg_above: a turbo release's 0), a guidance other than the default on a model without one, a flow
        shift on a model whose schedule is no shift."""
        unread, found = self.unread_sample_options(), {}
        if flow_shift is not None and "flow_shift" in unread:
            found["flow_shift"] = unread["flow_shift"]
        if negative and "negative" in unread:
            found["negative"] = unread["negative"]
        elif negative and guidance is not None and guidance <= self.cfg_above:
            found["negative"] = (f"model_type {self.name} runs CFG (the negative prompt) only at guidance above "
                                 f"{self.cfg_above:g}, and this prompt's is {guidance:g}")
        if "guidance" in unread and guidance != self.sample_guidance:
            found["guidance"] = unread["guidance"]
        return found

    def rendered_settings(self, prompt, width: int, height: int, seed: int) -> dict:
        """What a rendered prompt's PNG text records of it (tools/generate.py's images, training samples): a
        negative the model did not read (no true CFG, or a guidance that runs none) is not recorded as used;
        flow_shift "" is the release's shift (none given, or one the model does not read)."""
        unread = self.unread_prompt_options(prompt.negative, prompt.guidance, prompt.flow_shift)
        shift = prompt.flow_shift if prompt.flow_shift is not None and "flow_shift" not in unread else ""
        return {"prompt": prompt.prompt, "negative": "" if "negative" in unread else prompt.negative,
                "size": f"{width}x{height}", "steps": prompt.steps, "seed": seed, "guidance": prompt.guidance,
                "flow_shift": shift, "control_images": ",".join(os.path.basename(p) for p in prompt.control_images)}

    def dynamic_shift(self, model) -> bool:
        return True

    def default_timestep_sampling(self, model) -> str:
        """timestep_sampling unset: sigmas drawn as the release's scheduler runs at inference (the
        architecture's shift), unshifted for a release whose scheduler has no shift (dynamic_shift)."""
        return fm.sampling_of(self.arch).method if self.dynamic_shift(model) else "sigmoid"

    def inference_sampling(self):
        """The release's own inference schedule (a spec Sampling) where it differs from the
        architecture's (one release of several with the same transformer); None: the architecture's."""
        return None


class NamedReleases:
    """A family's releases that share one file layout (no header tells them apart): the release is `model_version`,
    else the one the model path's name says (release_in_name), else the first of `releases`; the spec's
    sample_steps / sample_guidance are per release. Mixed into the family class before DiffusionFamily; its
    __init__ calls set_release."""

    releases: tuple[str, ...] = ()  # the model_version values; the first is the default

    @staticmethod
    def release_in_name(path: str) -> str | None:
        """The release a file or folder name says, else None."""
        raise NotImplementedError

    def set_release(self, model_version: str | None) -> None:
        if model_version is not None and model_version not in self.releases:
            raise ValueError(f"model_version {model_version!r}: expected {', '.join(self.releases[:-1])} or "
                             f"{self.releases[-1]}")
        self._version = model_version

    @cached_property
    def version(self) -> str:
        """model_version, else the release the model path's name says, else the first release."""
        return self._version or self.release_in_name(self.model_path) or self.releases[0]

    def model_version(self, model) -> str:
        return self.version

    def lora_release_note(self, metadata: dict) -> str | None:
        """Where the release was guessed (no model_version, a path naming none) and the LoRA says another."""
        trained = metadata.get("ss_base_model_version")
        guessed = self._version is None and self.release_in_name(self.model_path) is None
        if not guessed or trained not in self.releases or trained == self.version:
            return None
        return self.other_release_note(trained, f"a path naming no release is read as {self.releases[0]}")

    @property
    def sample_guidance(self) -> float:
        """The release's default --g (the spec's sample_guidance)."""
        return spec_of(self.name).sample_guidance[self.version]

    @property
    def sample_steps(self) -> int:
        """The release's default --s (the spec's sample_steps)."""
        return spec_of(self.name).sample_steps[self.version]


# how a prompt sets each option: a line's flag (generate.py's option), a .json / .toml prompt object's key
PROMPT_FLAGS = {"negative": "--n (--negative)", "guidance": "--g (--guidance)", "flow_shift": "--fs (--flow_shift)"}
PROMPT_KEYS = {"negative": "negative_prompt", "guidance": "guidance_scale", "flow_shift": "flow_shift"}


def warn_unread_prompt_options(family: DiffusionFamily, prompts, where: str) -> None:
    """One warning line per option the sample prompts set and the model would not read (as the
    prompt flags are a file's, shared between models, they are warned about, not refused), naming the
    prompt's line or object where it was read from a file (its source), else `where`."""
    names = PROMPT_KEYS if where.lower().endswith((".json", ".toml")) else PROMPT_FLAGS  # read_prompt_file's kinds
    for prompt in prompts:
        source = getattr(prompt, "source", "") or where
        for option, why in family.unread_prompt_options(prompt.negative, prompt.guidance, prompt.flow_shift).items():
            warnings.warn(f"{source}: {names[option]} is not read: {why}", stacklevel=2)


def control_kwargs(control: list[torch.Tensor] | None) -> dict:
    """`control=` only when there are references: a family without them keeps its signature."""
    return {"control": control} if control else {}


def stack_text(per_caption: list[dict]) -> dict:
    """Per-caption encoder outputs (as cached) -> one batch dict [B, ...]."""
    return {k: torch.stack([d[k] for d in per_caption]) for k in per_caption[0]}


def lora_arch(model_type: str) -> str:
    """The architecture whose LoRA layout a model_type's LoRAs have (an edit variant's: its base's); other
    model types (llm) are their own."""
    return family_class(model_type).arch if model_type in FAMILIES else model_type


def family_class(model_type: str) -> type[DiffusionFamily]:
    if model_type not in FAMILIES:
        raise ValueError(f"model_type {model_type!r} is not a diffusion family (expected one of {', '.join(FAMILIES)})")
    module, _, name = FAMILIES[model_type].partition(":")
    cls = getattr(importlib.import_module(module), name)
    _check_adapter(cls, model_type, module.replace(".", "/") + ".py")
    return cls


def _check_adapter(cls, model_type: str, file: str) -> None:
    """The adapter's `name` is the model_type it is registered under, and its `arch` its folder's spec arch:
    configs, caches and LoRA metadata say the name, and the arch finds the spec's LoRA targets, fp8 rules and
    sampling (otherwise an error far off naming neither)."""
    if getattr(cls, "name", None) != model_type:
        raise SpecError(f"{file}: {cls.__name__}.name is {getattr(cls, 'name', None)!r}, registered in "
                        f"registry.FAMILIES as {model_type!r}: the two must be the same")
    spec_arch = spec_of(model_type).arch
    if cls.arch != spec_arch:
        raise SpecError(f"{file}: {cls.__name__}.arch is {cls.arch!r}, its folder's spec.py says arch {spec_arch!r}: "
                        f"the two must be the same (a variant sets arch = its base family's name)")


def get_family(args) -> DiffusionFamily:
    return family_class(args.model_type).from_args(args)
