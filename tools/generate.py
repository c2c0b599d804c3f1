"""Text-to-image with any registered diffusion family (--model_type), with the same model, sampler and
LoRA code as the training samples: the way to check a LoRA under the base precision you will deploy.

    python tools/generate.py --model_type TYPE --model transformer.safetensors --ae ae.safetensors \\
        --text_encoder te --prompt "a cat" --width 1024 --height 1024 --steps 20 \\
        --base_precision fp8_scaled --lora my_lora.safetensors:0.8 --out out/
        # the text encoder flags the model type loads: --text_encoder, or --clip_l and --t5xxl
    python tools/generate.py ... --prompt_file prompts.txt      # sd-scripts syntax, one per line
    python tools/generate.py --model_type EDIT_TYPE ... --prompt "make it red" --control_image in.png
        # edit models: the reference image(s) (also per prompt: --ci in.png, musubi-tuner's flag)

Writes one PNG per prompt, NNN_SEED.png numbered after the images already in --out, with the
settings in its text chunks (the size is the one rendered: --width / --height and a prompt's --w / --h
are rounded down to a multiple of 16, with a warning, as sd-scripts' samples are). LoRAs are applied unmerged (the base is never modified, so an fp8
base keeps the LoRA's small deltas intact); a ratio is a finite number in [-100, 100].
Bad input is one `error: ...` line on stderr and exit status 2 (arguments, and each LoRA's header and module
names, are checked before any model is loaded).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from library.models.registry import BASE_PRECISIONS, FAMILIES, arch_specs  # noqa: E402
from library.training.config_schema import FAMILY_KEYS, PRECISION_NAMES  # noqa: E402
from library.training.config_keys import family_key_bounds, unread_family_keys  # noqa: E402
from tools.cli import Parser, check_command_line, check_out_folder, exit_without_collecting  # noqa: E402


def _true_or_false(text: str) -> bool:
    if text.lower() not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"takes true or false, got {text!r}")
    return text.lower() == "true"


def _per_release(defaults: str) -> str:
    """Each release's default `defaults` ("sample_steps", "sample_guidance") from the family specs,
    for --help (torch is not loaded for it)."""
    return "; ".join(f"{spec.title}: " + ", ".join(f"{name} {value:g}" for name, value in getattr(spec, defaults).items())
                     for spec in arch_specs().values() if getattr(spec, defaults))


# musubi-tuner's *_generate_image.py and sd-scripts' minimal-inference script's flags -> ours
PEER_FLAGS = {"--dit": "--model", "--ckpt_path": "--model", "--vae": "--ae", "--from_file": "--prompt_file",
              "--save_path": "--out", "--output_dir": "--out", "--infer_steps": "--steps",
              "--image_size": "--height H --width W", "--negative_prompt": "--negative",
              "--guidance_scale": "--guidance", "--cfg_scale": "--guidance (where the model samples with true CFG; "
              "none over an embedded guidance: sd-scripts' true CFG there)",
              "--control_image_path": "--control_image",
              "--lora_weight": "--lora PATH:RATIO", "--lora_multiplier": "--lora PATH:RATIO",
              "--lora_weights": "--lora PATH:RATIO", "--merge_lora_weights": "--lora PATH:RATIO (applied unmerged)",
              "--fp8": "--base_precision fp8", "--fp8_scaled": "--base_precision fp8_scaled",
              "--vae_enable_tiling": "--vae_tiling", "--embedded_cfg_scale": "--guidance",
              "--ref_images": "--control_image", "--output_image": "--out (a folder)", "--image_width": "--width",
              "--image_height": "--height", "--discrete_flow_shift": "--flow_shift",
              "--pretrained_model_name_or_path": "--model", "--ae_path": "--ae",
              "--mu": "--flow_shift (e^mu: a fixed shift k = e^mu)",
              "--cpu_noise": "none: the noise is always drawn on the CPU"}


def peer_flags() -> dict[str, str]:
    """PEER_FLAGS with the CFG scale's reading per model where musubi-tuner's differs (spec MusubiModels.sample_cfg):
    its --guidance_scale g is ours' g - offset, and runs CFG only above 1 (ours above 0)."""
    cfgs = [(spec.title, musubi.sample_cfg) for spec in arch_specs().values()
            if (musubi := spec.peer_models.get("musubi-tuner")) is not None and getattr(musubi, "sample_cfg", None)]
    said = "; ".join(f"{title}: its value{f' - {cfg.offset:g}' if cfg.offset else ''}, CFG only above 1 there"
                     for title, cfg in cfgs)
    return {**PEER_FLAGS, "--guidance_scale": f"--guidance ({said})" if said else "--guidance"}


def build_parser() -> argparse.ArgumentParser:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, peer_flags=peer_flags())
    p.add_argument("--model_type", required=True, choices=tuple(FAMILIES))
    p.add_argument("--model", required=True, help="transformer checkpoint (single file / diffusers folder / ComfyUI "
                                                   "file, fp8 and scaled fp8 ones used as they are)")
    p.add_argument("--ae", help="VAE (required by every model type with a VAE file; one taking the pixels has none)")
    for key, arg in FAMILY_KEYS.items():  # each family's text encoder files and options, as in training configs
        kind = _true_or_false if arg.type is bool else arg.type  # bool("false") would be True
        p.add_argument(f"--{key}", type=kind, default=arg.default, help=arg.help)
    p.add_argument("--prompt", action="append", default=[], help="a prompt (sd-scripts flags allowed); repeatable")
    p.add_argument("--prompt_file", help="prompt file, one per line, sd-scripts syntax")
    p.add_argument("--control_image", "--ci", action="append", default=[],
                   help="edit models: a reference image for every prompt without its own --ci; repeatable (--ci: the "
                        "prompts' own name for it)")
    p.add_argument("--negative", default="",
                   help="negative prompt, for the models that sample with true CFG (default: empty; such a model runs CFG "
                        "by default, with its model card's empty negative (\" \" where the card passes a space), "
                        "as musubi-tuner's samples and ComfyUI's templates do, where a diffusers pipeline runs none "
                        "without a negative; a guidance at or under the "
                        "model's CFG threshold (1, or 0 where its pipeline tests > 0) runs none, with a warning where a "
                        "negative is given; refused on a model without CFG)")
    p.add_argument("--width", type=int, default=None, help="default: the model's pipeline's (1024; 2048 for the 2K "
                                                            "models)")
    p.add_argument("--height", type=int, default=None, help="default: as --width's")
    p.add_argument("--steps", type=int, default=None,
                   help="default: the release's own, its diffusers pipeline's num_inference_steps (a step-distilled "
                        f"one's count) - {_per_release('sample_steps')}; a prompt's --s wins")
    p.add_argument("--seed", type=int, default=None,
                   help="for every prompt without its own --d (default: a random one per image, as sd-scripts "
                        "and musubi-tuner; the file name and the PNG's info record it)")
    p.add_argument("--flow_shift", "--fs", type=float, default=None,
                   help="a fixed flow shift k of the sampler's sigmas, k s / (1 + (k - 1) s), in place of the release's "
                        "own schedule (musubi-tuner's --flow_shift; default: the release's, its scheduler's resolution or "
                        "constant shift); a prompt's --fs wins")
    p.add_argument("--guidance", type=float, default=None,
                   help="embedded guidance, or the CFG scale of models that sample with true CFG (default: the "
                        f"release's - {_per_release('sample_guidance')}; a prompt's --g wins, on a CFG model its --l, "
                        "sd-scripts' CFG scale, over both)")
    p.add_argument("--base_precision", default="bf16", choices=BASE_PRECISIONS)
    p.add_argument("--dtype", default="bf16", choices=PRECISION_NAMES, help="compute dtype")
    p.add_argument("--text_encoder_precision", default="bf16", choices=("fp32", "fp16", "bf16", "fp8", "fp8_scaled"))
    p.add_argument("--blocks_to_swap", type=int, default=0, help="keep the last N blocks' weights in CPU memory")
    p.add_argument("--vae_tiling", action="store_true", help="decode in tiles (the decode's peak memory 3-8x lower "
                   "at 1024 px; the image differs near the seams)")
    # extend: `--lora A --lora B` applies both (nargs="*" alone kept B only, without a word)
    p.add_argument("--lora", nargs="+", action="extend", default=[],  # `--lora $EMPTY` rendered the bare base
                   help="LoRA files, each FILE or FILE:RATIO (--lora A B, or --lora A --lora B)")
    p.add_argument("--out", default="generated", help="output folder")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    return p


# The arguments are checked before torch and the library load (seconds): --help and a bad flag answer at once.
if __name__ == "__main__":
    check_command_line(build_parser)

import torch  # noqa: E402

from library.models.family import family_class, stack_text, warn_unread_prompt_options  # noqa: E402
from library.io import CheckpointError  # noqa: E402
from networks.lora_arch import check_model_files  # noqa: E402
from library.models.vae import decoding_in_tiles  # noqa: E402
from library.data.controls import check_prompt_controls, encode_prompts  # noqa: E402
from library.data.prompts import (SamplePrompt, check_flow_shift, check_guidance,  # noqa: E402
                                  check_seed, decode_references, parse_prompt_line, read_prompt_file,
                                  refuse_large_prompts, refuse_long_prompts, rendered_side, seed_or_random)
from library.training.config import PRECISION_DTYPES  # noqa: E402
from tools.devices import device_from_flag  # noqa: E402
from tools.lora_common import one_line, parse_lora_spec  # noqa: E402


def check_args(args) -> torch.device:
    """Values that would fail (or mislead) only after the models are loaded, named first; returns
    the compute device."""
    cls = family_class(args.model_type)
    missing = [k for k in cls.required_paths() if k != "pretrained_model_name_or_path" and getattr(args, k) is None]
    if missing:
        raise ValueError(f"--{missing[0]} is required for --model_type {args.model_type}")
    for key, why in cls.unread_files().items():
        if getattr(args, key) is not None:
            raise ValueError(f"--{key} is not read: {why}")
    for key, readers in unread_family_keys(args.model_type).items():  # as the training config refuses them
        if getattr(args, key) != FAMILY_KEYS[key].default:
            raise ValueError(f"--{key} is read by {readers}, not by --model_type {args.model_type}")
    if args.steps is not None and args.steps < 1:
        raise ValueError(f"--steps {args.steps}: expected at least 1")
    for key in (k for k, a in FAMILY_KEYS.items() if a.type is int):  # counts and sizes, as the training config's
        if getattr(args, key) is not None and getattr(args, key) < 1:
            raise ValueError(f"--{key} {getattr(args, key)}: expected at least 1")
    for key, most in family_key_bounds(args.model_type).items():  # as the training config's
        if getattr(args, key) is not None and getattr(args, key) > most:
            raise ValueError(f"--{key} {getattr(args, key)}: expected at most {most} for --model_type {args.model_type}")
    if args.seed is not None:
        check_seed("--seed", args.seed)
    if args.guidance is not None:
        check_guidance("--guidance", args.guidance)
    if args.flow_shift is not None:
        check_flow_shift("--flow_shift", args.flow_shift)
    check_out_folder("--out", args.out, "the images are written into it")  # now, not after the models are loaded
    return device_from_flag(args.device)


def check_model_options(args, family) -> None:
    """A flag the model would not read (--negative without true CFG, --guidance on a model without
    guidance, --control_image on a family that takes no references) is refused, not ignored; and
    --blocks_to_swap is checked against the model's blocks, from its header."""
    unread = family.unread_sample_options()
    given = {"negative": args.negative != "", "guidance": args.guidance is not None, "flow_shift": args.flow_shift is not None}
    for flag in unread:
        if given[flag]:
            raise ValueError(f"--{flag} is not read: {unread[flag]}")
    if args.control_image and not family.max_controls:
        raise ValueError(f"--control_image is not read: model_type {family.name} takes no reference images")
    if args.blocks_to_swap:  # counted on meta now, not found after the text encoders ran and the model loaded
        from library.models.block_swap import check_swap_count

        check_swap_count(args.blocks_to_swap, family.swappable_block_count(), "--blocks_to_swap")


def check_stored_base(args, family) -> None:
    """A pre-quantized file (ours, ComfyUI's fp8 / scaled fp8, GGUF) renders as it is stored: a --base_precision
    other than the default that another base would need is refused, as train_lora.py refuses it
    (stored_layouts.config_precision), not rendered on the stored base without a word."""
    from library.precision.stored_layouts import config_precision

    stored = family.stored_layout()
    if stored and args.base_precision != "bf16" and config_precision(stored) != args.base_precision:
        raise ValueError(f"--base_precision {args.base_precision}: {args.model} stores a pre-quantized {stored} base, "
                         f"which renders as it is stored; leave --base_precision out")


def check_lora_modules(family, loras, base_precision: str) -> None:
    """Each --lora read onto the transformer built on meta from its header at the render's base precision, as the
    load reads it: a module the checkpoint lacks (a LoRA of a model with more blocks), or a weight's `.diff` on an
    fp8 base (its codes take no delta), is one CheckpointError naming the file and the module now, not after the
    text encoders ran and the transformer loaded (minutes)."""
    import warnings

    from networks.factory import network_from_file
    from networks.lora import LoRANetwork
    from networks.lora_reader import merge_whole_deltas, whole_deltas_only

    if not loras:
        return
    skeleton = family.load_transformer(torch.float32, family.stored_layout() or base_precision, read_weights=False)
    with warnings.catch_warnings():  # the load below says them once
        warnings.simplefilter("ignore")
        for spec in loras:
            if whole_deltas_only(spec.path) or isinstance(
                    network_from_file(skeleton, family.arch, spec.path, multiplier=spec.ratio), LoRANetwork):
                merge_whole_deltas(skeleton, family.arch, spec.path, spec.ratio)  # its .diff / .diff_b: names, shapes


def collect_prompts(args, family) -> list[SamplePrompt]:
    """The prompts with the flags' values as defaults, and the family's where a flag is not given: the
    instance's, which know the release (a step-distilled one samples with fewer steps and no CFG)."""
    guidance = args.guidance if args.guidance is not None else family.sample_guidance
    steps = args.steps if args.steps is not None else family.sample_steps
    for path in args.control_image:
        if not os.path.isfile(path):
            raise ValueError(f"--control_image {path!r} is not an image file")
    multiple = family.vae_downsample * family.patch  # a prompt's own --w / --h is rounded alike (to 16)
    width, height = (rendered_side(flag, family.render_size if side is None else side, multiple)
                     for flag, side in (("--width", args.width), ("--height", args.height)))
    defaults = SamplePrompt("", width, height, steps, args.seed, guidance, args.negative, tuple(args.control_image),
                            args.flow_shift)
    cfg = family.guidance_is_cfg_scale()  # a prompt's --l is its guidance, or unread
    prompts = [parse_prompt_line(p, "--prompt", defaults, cfg) for p in args.prompt]
    decode_references([("--prompt", p) for p in prompts])
    # a text the encoder refuses is named now, from its tokenizer, not after the encoder loads (a negative is encoded
    # for true CFG only)
    limit = family.caption_token_limit(args)
    refuse_long_prompts([("--prompt", p) for p in prompts], limit, family.true_cfg)
    largest = family.largest_image()  # a size the transformer refuses, from its header, before any model loads
    refuse_large_prompts([("--prompt", p) for p in prompts], largest)
    if args.prompt_file:
        prompts += read_prompt_file(args.prompt_file, defaults, guidance_is_cfg=cfg, token_limit=limit,
                                    negatives=family.true_cfg, largest=largest)
    if not prompts:
        raise ValueError("give --prompt or --prompt_file")
    return prompts


def base_loras_notes(loras, headers: list[dict]) -> list[str]:
    """One note line per --lora file trained with base_loras (its header's ss_base_loras) not also given at their
    ratios: its training samples rendered base + base_loras + LoRA, these images render without them (a
    de-distillation adapter is left out to deploy, as ai-toolkit's samples leave it out)."""
    from networks.lora_files import METADATA_KEYS

    given = {(os.path.basename(s.path), s.ratio) for s in loras}
    notes = []
    for spec, header in zip(loras, headers):
        try:
            merged = [(e["file"], float(e["ratio"])) for e in json.loads(header.get(METADATA_KEYS["base_loras"]) or "[]")]
        except (ValueError, TypeError, KeyError):  # a header another tool wrote: nothing to say
            continue
        if missing := [f"{file}:{ratio:g}" for file, ratio in merged if (file, ratio) not in given]:
            notes.append(f"note: {spec.path} was trained with base_loras {', '.join(missing)} merged into its base, "
                         f"which its training samples include: give them to --lora too to render those")
    return notes


def lora_metadata(path: str) -> dict:
    from networks.lora_files import lora_reader

    return lora_reader(path)[0].metadata  # a file, or a PEFT folder's weights file


def honour_lora_options(args, loras, headers: list[dict]) -> list[str]:
    """The sampling options a --lora's header (`headers`: each one's) says it was trained with
    (DiffusionFamily.lora_trained_options), set where their flag is left at its default; one note line each. Such
    a LoRA rendered without them (an edit LoRA trained with a reference mask, rendered with full attention) said
    nothing."""
    cls, notes, honoured = family_class(args.model_type), [], {}
    for spec, header in zip(loras, headers):
        for key, (value, source) in cls.lora_trained_options(header).items():
            shown = str(value).lower() if isinstance(value, bool) else value
            given = getattr(args, key)
            if key in honoured and honoured[key] != value:  # two LoRAs of other settings: the first one's is kept
                notes.append(f"note: {spec.path} was trained with {key} {shown} ({source}); rendering with "
                             f"{honoured[key]}, as the LoRA before it")
            elif given == FAMILY_KEYS[key].default and value != FAMILY_KEYS[key].default:
                setattr(args, key, honoured.setdefault(key, value))
                notes.append(f"note: {spec.path} was trained with {key} {shown} ({source}): rendering with it")
            elif given != value and key not in honoured:  # the flag given wins, said (the web UI passes a job's)
                notes.append(f"note: {spec.path} was trained with {key} {shown} ({source}); rendering with the "
                             f"{key} given, {given}")
    return notes


def first_free_index(folder: str) -> int:
    """1 + the highest NNN of the NNN_*.png images already in `folder` (0 for none): a later call
    adds images after them instead of overwriting 000_*.png."""
    names = os.listdir(folder) if os.path.isdir(folder) else []
    return 1 + max((int(m.group(1)) for n in names if (m := re.fullmatch(r"(\d+)_.*\.png", n))), default=-1)


def apply_loras(model, arch: str, loras: list, device) -> None:
    """Each LoRA patched on top of the previous, unmerged (on the CPU base: DoRA reads it); a DoRA's norm is of the
    base with the LoRAs before it (networks/lora_module.py forward_weight), as ComfyUI and a base_loras run take it.
    A LoRA's `.diff` / `.diff_b` tensors (ComfyUI's extraction) are added to the weights and biases they name, as
    ComfyUI patches them (a LyCORIS network applies its own). A file of them alone (full_diff, LyCORIS' full type) is
    added the same way, from the file's pages: LyCORIS' full modules held the delta and a copy of each weight."""
    import warnings

    from networks.factory import network_from_file
    from networks.lora import LoRANetwork
    from networks.lora_reader import WholeDeltasLeftOut, merge_whole_deltas, whole_deltas_only

    for spec in loras:
        if whole_deltas_only(spec.path):
            merge_whole_deltas(model, arch, spec.path, spec.ratio)
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", WholeDeltasLeftOut)
            network = network_from_file(model, arch, spec.path, multiplier=spec.ratio)  # LoRA, DoRA or LyCORIS
        network.apply()
        network.to(device)
        if isinstance(network, LoRANetwork):
            merge_whole_deltas(model, arch, spec.path, spec.ratio)


def generate(args) -> list[str]:
    from library.data.images import save_png, to_pil
    from library.models.block_swap import enable_block_swap
    from networks.lora_reader import check_lora_arch

    loras = [parse_lora_spec(s) for s in args.lora]
    device = check_args(args)
    for spec in loras:  # headers only: an unreadable file, or another model's LoRA, is named before any model loads
        check_lora_arch(spec.path, family_class(args.model_type).arch)
    headers = [lora_metadata(spec.path) for spec in loras]
    for note in base_loras_notes(loras, headers) + honour_lora_options(args, loras, headers):
        print(note)
    family = family_class(args.model_type).from_args(argparse.Namespace(**vars(args), pretrained_model_name_or_path=args.model))
    for spec, header in zip(loras, headers):  # a LoRA of another release than the files say (lora_release_note)
        if note := family.lora_release_note(header):
            print(f"note: {spec.path} {note}")
    check_model_options(args, family)
    check_model_files(family, args.model)  # every file by its header (a VAE, encoders of its width), as training does
    check_stored_base(args, family)  # before any model loads
    check_lora_modules(family, loras, args.base_precision)
    prompts = collect_prompts(args, family)
    check_prompt_controls(prompts, args.prompt_file or "--prompt", family.name, family.max_controls, family.min_controls,
                          family.reference_vl_size)
    warn_unread_prompt_options(family, prompts, args.prompt_file or "--prompt")
    encode = family.load_text_encoder(args.text_encoder_precision, device, **family.text_options(args))
    def encode_one(text: str, prompt) -> dict:  # with the references where the text encoder sees them
        size = family.sample_text_size(prompt.control_images, prompt.width, prompt.height)
        return stack_text(encode_prompts(encode, [text], [prompt.control_images], family.text_sees_controls, size))

    texts = [(encode_one(p.prompt, p), encode_one(family.sample_negative(p.negative), p) if family.true_cfg else None)
             for p in prompts]
    del encode  # text encoders are freed before the transformer is loaded
    # A pre-quantized file (ours, ComfyUI's fp8 / scaled fp8, GGUF) is used as it is stored, whatever --base_precision says.
    base_precision = family.stored_layout() or args.base_precision
    model = family.load_transformer(PRECISION_DTYPES[args.dtype], base_precision).requires_grad_(False).eval()
    # A plain e5m2 file loaded (widened exactly, so bf16 was asked): the images name it as its LoRAs do.
    base_name = family.widened_layout(base_precision) or base_precision
    apply_loras(model, family.arch, loras, device)
    enable_block_swap(model, args.blocks_to_swap, device)  # before the move: swapped weights stay on the CPU
    model.to(device)
    vae = family.load_vae(torch.float32)
    vae.vae.to(device)
    os.makedirs(args.out, exist_ok=True)
    first = first_free_index(args.out)
    written = []
    for i, (prompt, (text, negative)) in enumerate(zip(prompts, texts)):
        seed = seed_or_random(prompt.seed)  # (the defaults' is --seed)
        to_device = lambda d: {k: v.to(device) for k, v in d.items()} if d else None  # noqa: E731
        width, height, references = family.sample_references(prompt.control_images, prompt.width, prompt.height)
        if (width, height) != (prompt.width, prompt.height):
            print(f"{prompt.prompt!r}: rendering {width}x{height}: model_type {family.name} takes the --ci image's "
                  f"aspect ratio at the area of --w {prompt.width} x --h {prompt.height}")
        control = [vae.encode(r.to(device)) for r in references] or None  # float32 [1, 16, h, w] each
        latents = family.sample_latents(model, to_device(text), width, height, prompt.steps, seed,
                                        prompt.guidance, to_device(negative), control=control,
                                        flow_shift=prompt.flow_shift)
        with decoding_in_tiles(vae.vae, args.vae_tiling):
            image = to_pil(vae.decode(latents)[0])
            # A layered family's latents are frames [B, C, F, h, w]: besides the preview strip, each frame
            # (the composite, then every layer) as the RGBA PNG its VAE decodes.
            frames = vae.decode_rgba(latents) if latents.dim() == 5 else []
        path = os.path.join(args.out, f"{first + i:03d}_{seed}.png")
        info = {**family.rendered_settings(prompt, width, height, seed), **model_settings(args, family, model),
                "base_precision": base_name, "dtype": args.dtype,
                "loras": ",".join(f"{os.path.basename(spec.path)}:{spec.ratio}" for spec in loras)}
        save_png(image, path, info)
        for k, frame in enumerate(frames):
            save_png(to_pil(frame[0]), os.path.join(args.out, f"{first + i:03d}_{seed}_layer{k}.png"), info)
        written.append(path)
        print(f"wrote {path}" + (f" and its {len(frames)} RGBA frames (_layer0 = the composite)" if frames else ""))
    return written


def model_settings(args, family, model) -> dict[str, str]:
    """What an image's PNG text records of the model beside the prompt's settings, enough to render it again:
    the model (a component folder with its pipeline folder's name: "<pipeline>/transformer", not "transformer"),
    its type and the release rendered, the text encoders' precision and every family key given (files by name,
    values as given: t5xxl_max_token_length, layers, reference_resolution, ... change the pixels)."""
    path = os.path.normpath(args.model)
    name = os.path.join(*path.split(os.sep)[-2:]) if os.path.isdir(path) and os.sep in path else os.path.basename(path)
    settings = {"model": name, "model_type": args.model_type, "model_version": family.model_version(model),
                "text_encoder_precision": args.text_encoder_precision}
    for key in FAMILY_KEYS:
        value = getattr(args, key)
        if value is not None and value != FAMILY_KEYS[key].default:
            settings[key] = os.path.basename(value) if isinstance(value, str) and os.path.exists(value) else str(value)
    return settings


def main(argv=None) -> int:
    try:
        generate(build_parser().parse_args(argv))
    except (ValueError, CheckpointError, FileNotFoundError) as e:
        print(one_line(e), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    exit_without_collecting(main)
