"""Sample-prompt files in sd-scripts syntax, one prompt per line:

    a photo of a cat --w 1024 --h 1024 --s 20 --d 42 --g 3.5 --n blurry, lowres

Flags: --w width, --h height (each rounded down to a multiple of 16 with a warning, as sd-scripts'
samples are: the size a model renders; below 16 is an error), --s steps, --d seed (-1: a random one, as
without --d), --g guidance (the
embedded guidance of a guidance-distilled model, the CFG scale of a true-CFG one), --l sd-scripts' CFG
scale (a CFG model's guidance, winning over a --g beside it; unread by a model without CFG), --n
negative prompt, --ci a reference (control) image for edit models (musubi-tuner's flag; repeat it for
several, in order), --fs a fixed flow shift k of the sampler's sigmas (musubi-tuner's flag: sigma' = k sigma /
(1 + (k - 1) sigma) in place of the release's resolution or constant shift). Flags are read in any case (--W
is --w, as in sd-scripts). Lines starting with # and blank lines are skipped. An unknown flag or a bad value is an error naming the file and line.

sd-scripts' structured files load too: a `.json` list of prompt objects (or prompt lines), and a
`.toml` with a [prompt] table of defaults and its [[prompt.subset]] entries. Their keys: prompt,
negative_prompt, width, height, sample_steps, seed, guidance_scale (--g), scale (sd-scripts' --l, read as
--l is), flow_shift (--fs, which sd-scripts writes for its --fs) and controlnet_image (--ci). Any other key
(sample_sampler, ...) is an error naming it: we sample
with the family's own flow-matching sampler, and a setting read and ignored would lie; so is a value of
another type (a list as negative_prompt, true as a number).
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import warnings
from dataclasses import dataclass, field, replace

import toml

from library.data.dataset_config import PIXELS_PER_TOKEN_SIDE
from library.text_files import read_utf8, toml_loads


@dataclass(frozen=True)
class SamplePrompt:
    prompt: str
    width: int = 1024
    height: int = 1024
    steps: int = 20
    seed: int | None = None
    guidance: float = 3.5
    negative: str = ""
    control_images: tuple[str, ...] = ()  # --ci paths, in order
    flow_shift: float | None = None  # --fs: a fixed shift of the sigmas; None: the release's own schedule
    source: str = field(default="", compare=False)  # where read_prompt_file read it: "p.txt:5", "p.json: prompt 2"


class NegativePrompt(str):
    """A sample prompt's negative text as it reaches a family's text encoder: the same string, marked, for the
    pipelines that encode it otherwise than a caption (a system prompt put only before the positive prompt). Its
    prompt cache is its own (caches.prompt_cache_path): the empty negative is not the empty caption there."""


FLAGS = {"w": ("width", int), "h": ("height", int), "s": ("steps", int), "d": ("seed", int), "g": ("guidance", float),
         "n": ("negative", str), "l": ("scale", float), "fs": ("flow_shift", float)}


def split_prompt_line(line: str) -> list[str]:
    """[prompt text, 'w 1024', 'n blurry', ...]: a flag is "--" after whitespace and before a
    non-space, so a caption's own " -- " or "a--b" stays in its text."""
    parts = re.split(r"\s--(?=\S)", " " + line.strip())
    return [parts[0].strip(), *parts[1:]]


def parse_prompt_line(line: str, where: str, defaults: SamplePrompt | None = None,
                      guidance_is_cfg: bool | None = None) -> SamplePrompt:
    """guidance_is_cfg: the family's guidance is a CFG scale (settle_scale says what that changes)."""
    parts = split_prompt_line(line)
    fields, controls = {}, []
    for part in parts[1:]:
        flag, _, value = part.partition(" ")
        flag = flag.lower()  # sd-scripts reads --W as --w
        if flag == "ci":
            controls.append(value.strip())
            continue
        if flag not in FLAGS:
            raise ValueError(f"{where}: unknown flag '--{flag}' (allowed: {', '.join('--' + f for f in FLAGS)}, --ci)")
        name, kind = FLAGS[flag]
        try:
            fields[name] = kind(value.strip())
        except ValueError:
            raise ValueError(f"{where}: flag '--{flag}' needs {kind.__name__}, got {value.strip()!r}") from None
    settle_scale(fields, where, guidance_is_cfg, "--g", "--l")
    return _checked(parts[0], fields, controls, where, defaults)


def settle_scale(fields: dict, where: str, guidance_is_cfg: bool | None, g_name: str, l_name: str) -> None:
    """sd-scripts' two numbers onto a family's one guidance: its --l (a .json's scale) is the CFG scale run with
    the negative prompt, its --g (guidance_scale) a guidance-distilled model's embedded guidance. Where the family's
    guidance is a CFG scale (DiffusionFamily.guidance_is_cfg_scale) --l sets it and wins over a --g beside it, as
    the line '--l 4.0 --g 0.0' sd-scripts' docs give a CFG model means; a family without CFG reads no --l. The
    number left unread is one warning line, as other unread options are (prompt files are shared between models).
    None: the prompts are read for their sizes and references only (the memory planner, the web UI's checks), --l
    unread and unsaid."""
    scale = fields.pop("scale", None)
    if scale is None or guidance_is_cfg is None:
        return
    if not guidance_is_cfg:
        warnings.warn(f"{where}: {l_name} is not read: it is sd-scripts' CFG scale, and this model samples without CFG")
        return
    if "guidance" in fields:
        warnings.warn(f"{where}: {g_name} is not read: {l_name} is given and sets this model's guidance, a CFG scale")
    fields["guidance"] = scale


def _checked(prompt: str, fields: dict, controls: list[str], where: str, defaults: SamplePrompt | None) -> SamplePrompt:
    if not prompt:
        raise ValueError(f"{where}: empty prompt")
    for path in controls:
        if not os.path.isfile(path):
            raise ValueError(f"{where}: --ci {path!r} is not an image file")
    for side in ("width", "height"):
        if side in fields:
            fields[side] = rendered_side(f"{where}: {side}", fields[side])
    if "steps" in fields and fields["steps"] < 1:
        raise ValueError(f"{where}: steps must be >= 1")
    if "guidance" in fields:
        check_guidance(f"{where}: guidance", fields["guidance"])
    if fields.get("seed") == -1:  # the "random" of UIs' seed boxes; sd-scripts' --d reads no sign, so no seed
        fields["seed"] = None
    if "seed" in fields and fields["seed"] is not None:
        check_seed(f"{where}: seed", fields["seed"])
    if "flow_shift" in fields:
        check_flow_shift(f"{where}: --fs", fields["flow_shift"])
    if controls:  # a line's own --ci replace the defaults' (e.g. generate.py --control_image)
        fields["control_images"] = tuple(controls)
    return replace(defaults or SamplePrompt(prompt), prompt=prompt, **fields)


def decode_references(prompts: list[tuple[str, SamplePrompt]]) -> None:
    """Each reference image of the (where, prompt)s decoded whole, once, as a sample decodes it: one that does not
    decode is one line naming the prompt, as the prompts are read, not after caching or at every render
    (2026-11-27). Not in the line parser: the web UI parses prompt lines in its torch-free process."""
    from library.data.images import load_rgb

    seen = set()
    for where, prompt in prompts:
        for path in (p for p in prompt.control_images if p not in seen):
            seen.add(path)
            try:
                load_rgb(path)
            except ValueError as e:
                raise ValueError(f"{where}: --ci {e}") from None


def check_flow_shift(what: str, shift: float) -> None:
    """A finite shift > 0: k = 0 made every sigma 0 (nothing denoised), a negative one sigmas outside [0, 1]."""
    if not (math.isfinite(shift) and shift > 0):
        raise ValueError(f"{what} must be a number > 0 (a flow shift), got {shift}")


def check_guidance(what: str, guidance: float) -> None:
    """A finite guidance: NaN or infinity rendered a NaN image (2026-11-27)."""
    if not math.isfinite(guidance):
        raise ValueError(f"{what} must be a finite number, got {guidance}")


def check_seed(what: str, seed: int) -> None:
    """A seed a torch generator takes as itself: 0 to 2^64 - 1 (a larger one failed only when the sample
    rendered; -1 is no 'random' here, as in sd-scripts' --d, which reads digits only)."""
    if not 0 <= seed < 2**64:
        raise ValueError(f"{what} {seed}: expected 0 to 2^64 - 1")


def seed_or_random(seed: int | None) -> int:
    """The seed a sample renders with: its own (--d, generate.py's --seed), or where none is given a
    random one drawn for this image, as sd-scripts' and musubi-tuner's samples do (musubi:
    random.randint(0, 2^32 - 1)). Drawn from the OS, not from an RNG a run seeds (accelerate's
    set_seed seeds Python's), so two runs differ; the file name records it."""
    return seed if seed is not None else secrets.randbelow(2**32)


# A training sample is <output_name>_<tag>_<NN>_<YYYYmmddHHMMSS>_<seed>.png, as sd-scripts names them
# (<NN> the prompt's number; sd-scripts' step or epoch is our tag: start, stepNNNNNN, epochNNNN, final).
# The render's time keeps a later run, or a resumed one, from replacing samples already there; names
# written before it (<name>_<tag>_<NN>.png) still read.
SAMPLE_NAME = re.compile(r"_(start|final|step(\d+)|epoch(\d+))_(\d+)(?:_(\d{14})_(\d+))?\.png$")


def sample_file_name(output_name: str, tag: str, index: int, stamp: str, seed: int) -> str:
    return f"{output_name}_{tag}_{index:02d}_{stamp}_{seed}.png"


def rendered_side(what: str, value: int, multiple: int = PIXELS_PER_TOKEN_SIDE) -> int:
    """The image side a model renders for a requested `value` (`what`: how the error names it):
    rounded down to `multiple` (VAE downsampling x patch, 16 for every family), as sd-scripts'
    sample images are, with a warning where that changes it; below `multiple` is an error."""
    if value < multiple:
        raise ValueError(f"{what} {value}: expected at least {multiple} pixels")
    side = value // multiple * multiple
    if side != value:
        warnings.warn(f"{what} {value} is not a multiple of {multiple}: rendering {side}")
    return side


# sd-scripts' prompt-object keys -> (our field, type); "scale" is settled beside guidance_scale (settle_scale).
DICT_KEYS = {"prompt": ("prompt", str), "width": ("width", int), "height": ("height", int),
             "sample_steps": ("steps", int), "seed": ("seed", int), "guidance_scale": ("guidance", float),
             "scale": ("scale", float), "negative_prompt": ("negative", str), "flow_shift": ("flow_shift", float)}


def prompt_from_dict(entry: dict, where: str, defaults: SamplePrompt | None = None,
                     guidance_is_cfg: bool | None = None) -> SamplePrompt:
    """One sd-scripts prompt object (a .json entry, a .toml subset merged over its defaults)."""
    known = {*DICT_KEYS, "controlnet_image"}
    if unknown := sorted(k for k in entry if k not in known):
        raise ValueError(f"{where}: key '{unknown[0]}' is not read (known: {', '.join(sorted(known))})")
    fields = {}
    for key, (name, kind) in DICT_KEYS.items():
        value = entry.get(key)
        if value is None:
            continue
        if not _is_a(value, kind):  # a list or a bool taken as text or a number rendered another prompt silently
            raise ValueError(f"{where}: key '{key}' needs {kind.__name__}, got {value!r}")
        fields[name] = kind(value)
    settle_scale(fields, where, guidance_is_cfg, "key 'guidance_scale'", "key 'scale'")
    prompt = fields.pop("prompt", "").strip()
    image = entry.get("controlnet_image")
    controls = [image] if isinstance(image, str) else image or []
    if not (isinstance(controls, list) and all(isinstance(c, str) for c in controls)):
        raise ValueError(f"{where}: key 'controlnet_image' needs a path or a list of paths, got {image!r}")
    return _checked(prompt, fields, controls, where, defaults)


def _is_a(value, kind: type) -> bool:
    """A JSON / TOML value of the type a prompt key needs: a string for text; a finite number, not a bool
    (JSON's true is no guidance), for a number; a whole one for an int."""
    if kind is str:
        return isinstance(value, str)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return False
    return kind is not int or value == int(value)


def default_sample_size(resolution: tuple[int, int]) -> tuple[int, int]:
    """(width, height) of a prompt line without --w / --h: the first dataset's resolution on the 16-pixel grid.
    With buckets a resolution may lie off it (72, 1000); a sample needs whole 2x2 latent patches (the dataset
    config refuses a side under PIXELS_PER_TOKEN_SIDE, so none floors to 0)."""
    side = PIXELS_PER_TOKEN_SIDE
    return resolution[0] // side * side, resolution[1] // side * side


def read_prompt_file(path: str, defaults: SamplePrompt | None = None, decode: bool = True,
                     guidance_is_cfg: bool | None = None, token_limit=None,
                     negatives: bool = True, largest: tuple[int, int] | None = None) -> list[SamplePrompt]:
    """A prompt file: sd-scripts' text lines, or its .json / .toml prompt objects (by extension), its
    reference images decoded (decode=False: the web UI's check reads none before its roots check);
    guidance_is_cfg: the family's guidance is a CFG scale (settle_scale); token_limit, negatives:
    refuse_long_prompts'; largest: refuse_large_prompts'."""
    try:
        text = read_utf8(path, "prompt file")
    except OSError as e:
        raise ValueError(f"{path}: cannot read prompt file ({e.strerror})") from None
    kind = os.path.splitext(path)[1].lower()
    if kind in (".json", ".toml"):
        found = _structured_prompts(text, path, kind, defaults, guidance_is_cfg)
    else:
        found = [(f"{path}:{i}", parse_prompt_line(line, f"{path}:{i}", defaults, guidance_is_cfg))
                 for i, line in enumerate(prompt_lines(text), 1) if line.strip() and not line.lstrip().startswith("#")]
    if not found:
        raise ValueError(f"{path}: no prompts")
    if decode:
        decode_references(found)
    refuse_long_prompts(found, token_limit, negatives)
    refuse_large_prompts(found, largest)
    return [replace(prompt, source=where) for where, prompt in found]


def prompt_lines(text: str) -> list[str]:
    """A prompt file's lines as sd-scripts' readlines() splits them: at newlines alone (read_utf8 made
    CR LF and CR newlines). str.splitlines() also split at U+2028, form feeds, U+001C-U+001E and U+0085:
    one prompt with one of those inside became two, the first without its --flags."""
    return text.split("\n")


def refuse_long_prompts(prompts: list[tuple[str, SamplePrompt]], limit, negatives: bool = True) -> None:
    """ValueError naming the first of the (where, prompt)s whose text, or negative (negatives: they are encoded),
    is longer than a text encoder that refuses long texts takes (limit: the family's check.TokenLimit, counted as
    captions are; None or one that cuts: nothing refused). Encoding stopped on it only after the latents were
    cached (training) or the text encoder loaded (generate.py), in a line naming no file."""
    if limit is None or not limit.refuses:
        return
    for where, prompt in prompts:
        texts = [("prompt", prompt.prompt)] + ([("negative prompt", prompt.negative)] if negatives else [])
        for what, text in texts:
            n = limit.count(text) if text else 0
            if n > limit.max_tokens:
                raise ValueError(f"{where}: {what} is {n} {limit.encoder} tokens; the encoder takes at most "
                                 f"{limit.max_tokens} and refuses longer ones")


def refuse_large_prompts(prompts: list[tuple[str, SamplePrompt]], largest: tuple[int, int] | None) -> None:
    """ValueError naming the first of the (where, prompt)s larger than the family's largest image (width, height;
    DiffusionFamily.largest_image; None: any size). The forward refused it only when the sample rendered, minutes
    into training (a warning at every sample round) or after the models loaded (generate.py)."""
    if largest is None:
        return
    for where, prompt in prompts:
        if prompt.width > largest[0] or prompt.height > largest[1]:
            raise ValueError(f"{where}: size {prompt.width}x{prompt.height} is over the largest image the model "
                             f"takes, {largest[0]} wide by {largest[1]} high (the positions its RoPE was built for)")


def _structured_prompts(text: str, path: str, kind: str, defaults: SamplePrompt | None,
                        guidance_is_cfg: bool | None) -> list[tuple[str, SamplePrompt]]:
    """sd-scripts' load_prompts: a JSON list (objects or prompt lines), or a TOML [prompt] table whose
    keys are the defaults of its [[prompt.subset]] entries; each (where, prompt)."""
    try:
        data = json.loads(text) if kind == ".json" else _toml_subsets(text, path)
    except (json.JSONDecodeError, toml.TomlDecodeError) as e:
        raise ValueError(f"{path}: not valid {kind[1:].upper()}: {e}") from None
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a list of prompts (objects or lines)")
    prompts = []
    for i, entry in enumerate(data):
        where = f"{path}: prompt {i}"
        if isinstance(entry, str):
            prompts.append((where, parse_prompt_line(entry, where, defaults, guidance_is_cfg)))
        elif isinstance(entry, dict):
            prompts.append((where, prompt_from_dict(entry, where, defaults, guidance_is_cfg)))
        else:
            raise ValueError(f"{where}: expected an object or a prompt line, got {type(entry).__name__}")
    return prompts


def prompt_texts(path: str) -> list[str]:
    """Each prompt's text, in the order the samples number them, read without checking the rest (the
    web UI's captions): a text file's lines without their --flags, a .json / .toml's prompt entries."""
    text = read_utf8(path, "prompt file")
    kind = os.path.splitext(path)[1].lower()
    if kind not in (".json", ".toml"):
        lines = [line.strip() for line in prompt_lines(text)]
        return [split_prompt_line(line)[0] for line in lines if line and not line.startswith("#")]
    entries = json.loads(text) if kind == ".json" else _toml_subsets(text, path)
    if not isinstance(entries, list):
        raise ValueError(f"{path}: expected a list of prompts (objects or lines)")
    return [str(e.get("prompt", "")) if isinstance(e, dict) else split_prompt_line(str(e))[0] for e in entries]


def _toml_subsets(text: str, path: str) -> list:
    table = toml_loads(text).get("prompt")
    if not isinstance(table, dict) or not isinstance(table.get("subset"), list):
        raise ValueError(f"{path}: expected a [prompt] table with [[prompt.subset]] entries (sd-scripts' layout)")
    shared = {k: v for k, v in table.items() if k != "subset"}
    return [{**shared, **subset} if isinstance(subset, dict) else subset for subset in table["subset"]]
