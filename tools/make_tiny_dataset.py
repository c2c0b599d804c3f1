"""Write a small captioned image dataset for the quickstart and the tests: coloured shapes on
plain backgrounds, one caption file per image, a kohya dataset TOML and a sample-prompt file.

    python tools/make_tiny_dataset.py --out DIR [--count 8] [--size 64]
    python tools/make_tiny_dataset.py --out DIR --edit    # a paired edit task (reference images) for edit models
    python tools/make_tiny_dataset.py --out DIR --layered # composites with their RGBA layers (layered models)
    python tools/make_tiny_dataset.py --out DIR --scenes  # every scene the learned tiny base was trained on
    python tools/make_tiny_dataset.py --out DIR --concept [--count 10] [--trigger zxq]
        # a new concept for the learned base (tools/concept_demo.py): "zxq" = a purple star

Each set has its own image folders under --out (images/, edit_images/ and edit_control/, ...), so
the sets share one --out. A set whose folders already hold files is refused unless --overwrite,
which first deletes the .png and .txt files in that set's folders (an earlier, larger --count's
images would otherwise stay in the dataset); other sets' folders and other files are left.

The scenes (--scenes, --concept) are library/data/shapes.py's: circles, squares, triangles and stars
in five colours, at three positions, in two sizes, on white, black and striped backgrounds, each
captioned with all five ("a big red circle on the left, striped background").

Nothing is downloaded; images are drawn with PIL, deterministically.
"""

from __future__ import annotations

import argparse
import os
import random
import sys

from PIL import Image, ImageDraw

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.cli import Parser, check_command_line, check_out_folder, one_line, exit_without_collecting  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--count", type=int, default=None, help="images (default 8; --concept: 10)")
    p.add_argument("--size", type=int, default=64, help="image side in pixels (a multiple of 16)")
    p.add_argument("--seed", type=int, default=0)
    kind = p.add_mutually_exclusive_group()
    kind.add_argument("--edit", action="store_true", help="a paired edit task (grey shape -> red shape) instead")
    kind.add_argument("--layered", action="store_true", help="composites and their RGBA layers (background, shape) "
                      "in musubi-tuner's multiple_target layout instead")
    kind.add_argument("--scenes", action="store_true", help="every base scene of the learned tiny base instead")
    kind.add_argument("--concept", action="store_true", help="a new concept (purple stars) under a trigger word instead")
    p.add_argument("--trigger", default=None, help="--concept: the trigger word (default zxq)")
    p.add_argument("--overwrite", action="store_true", help="write over an earlier set of this kind: delete the "
                   ".png and .txt files in its image folders first")
    return p


# The image folders under --out that each set writes (its TOML points at them).
FOLDERS = {"plain": ("images",), "edit": ("edit_images", "edit_control"), "layered": ("layered_images",),
           "scenes": ("scenes",), "concept": ("concept", "reg")}


def kind(args) -> str:
    return next((k for k in ("edit", "layered", "scenes", "concept") if getattr(args, k)), "plain")


def set_folders(args) -> list[str]:
    return [os.path.join(args.out, folder) for folder in FOLDERS[kind(args)]]


COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 80, 220), "yellow": (230, 210, 40)}
BACKGROUNDS = {"white": (245, 245, 245), "black": (15, 15, 15)}
SHAPES = ("circle", "square")


def bad_value(args) -> str | None:
    """The first argument that cannot make a dataset, as one line (None: all can)."""
    if args.count is not None and args.count < 1:
        return f"--count {args.count}: must be >= 1"
    plain = len(COLOURS) * len(SHAPES) * len(BACKGROUNDS)  # what the plain and layered sets draw from
    if (args.layered or not (args.edit or args.scenes or args.concept)) and (args.count or 0) > plain:
        return f"--count {args.count}: the {'layered' if args.layered else 'plain'} set has {plain} different images at most"
    if args.size < 16 or args.size % 16:
        return f"--size {args.size}: the side must be a multiple of 16 and >= 16 (the VAE's 8 x the 2x2 patch)"
    if args.trigger is not None and not args.concept:  # it was ignored without a word
        return f"--trigger {args.trigger}: for --concept sets (the plain set's captions name no trigger)"
    if args.trigger is not None and (not args.trigger.strip() or any(c.isspace() for c in args.trigger)):
        return f"--trigger {args.trigger!r}: one word (it is the caption's trigger)"
    if not args.out:  # "" wrote the dataset into the current folder
        return "--out '': expected a folder to write the dataset into"
    try:
        check_out_folder("--out", args.out, "the dataset is written into it")
    except ValueError as e:
        return str(e)
    for folder in set_folders(args):
        if not args.overwrite and os.path.isdir(folder) and os.listdir(folder):
            return (f"--out {args.out}: {folder} already holds files (an earlier set's images would stay beside the "
                    f"new ones): add --overwrite to delete its .png and .txt files first, or choose another --out")
    return None


def clear_set_folders(args) -> None:
    """--overwrite: the .png and .txt files in the set's image folders (nothing else) go."""
    for folder in filter(os.path.isdir, set_folders(args)):
        for entry in os.scandir(folder):
            if entry.is_file() and entry.name.lower().endswith((".png", ".txt")):
                os.remove(entry.path)


# The arguments are checked before torch and the library load (seconds): --help and a bad flag answer at once.
if __name__ == "__main__":
    check_command_line(build_parser)

from library.data import shapes  # noqa: E402
from library.io import write_text  # noqa: E402
from library.text_files import toml_string  # noqa: E402


def write_dataset_toml(path: str, what: str, size: int, subsets: list[tuple[str, list[str]]], batch_size: int = 2,
                       general: tuple[str, ...] = ()) -> None:
    """A dataset TOML as these generators write them: `what` follows "make_tiny_dataset.py" in the
    heading comment; `general` lines go between batch_size and caption_extension; each subset is
    (a comment after its [[datasets.subsets]] header, or "", its key lines)."""
    blocks = "\n".join(f"  [[datasets.subsets]]{comment}\n" + "".join(f"  {line}\n" for line in lines)
                       for comment, lines in subsets)
    write_text(path, f"# Generated by tools/make_tiny_dataset.py{what}.\n[general]\nresolution = {size}\n"
                     f"batch_size = {batch_size}\n" + "".join(f"{line}\n" for line in general) +
                     f'caption_extension = ".txt"\n\n[[datasets]]\n\n{blocks}')


def draw(shape: str, colour, background, size: tuple[int, int]) -> Image.Image:
    image = Image.new("RGB", size, background)
    w, h = size
    box = (w // 4, h // 4, 3 * w // 4, 3 * h // 4)
    pen = ImageDraw.Draw(image)
    (pen.ellipse if shape == "circle" else pen.rectangle)(box, fill=colour)
    return image


def wide_bucket(size: int) -> tuple[int, int] | None:
    """The landscape image of the plain set: one 16-pixel step wider than `size`, as tall as the area
    of a size x size image allows on the 16-pixel grid, so it is a bucket of its dataset (80x48 for
    64; 48x16 for 32); None where no such bucket exists (size 16)."""
    w = size + 16
    h = size * size // w // 16 * 16
    return (w, h) if h else None


def make_tiny_dataset(out: str, count: int = 8, size: int = 64, seed: int = 0) -> dict[str, str]:
    rng = random.Random(seed)
    image_dir = os.path.join(out, *FOLDERS["plain"])
    os.makedirs(image_dir, exist_ok=True)
    combos = [(s, c, b) for s in SHAPES for c in COLOURS for b in BACKGROUNDS]
    rng.shuffle(combos)
    wide = wide_bucket(size)
    for i, (shape, colour, background) in enumerate(combos[:count]):
        # Two aspect ratios, so the quickstart exercises aspect-ratio buckets.
        dims = wide if i % 2 and wide else (size, size)
        path = os.path.join(image_dir, f"{i:03d}.png")
        draw(shape, COLOURS[colour], BACKGROUNDS[background], dims).save(path)
        write_text(os.path.join(image_dir, f"{i:03d}.txt"), f"a {colour} {shape} on a {background} background")
    dataset_toml = os.path.join(out, "dataset.toml")
    smallest = min(32, *(wide or (size,)))  # every image is a bucket of its own size: none is upscaled
    write_dataset_toml(dataset_toml, f": {count} captioned images", size, [("", [f"image_dir = {toml_string(image_dir)}", "num_repeats = 1"])],
                       general=("enable_bucket = true", f"min_bucket_reso = {smallest}", f"max_bucket_reso = {2 * size}",
                                "bucket_reso_steps = 16"))
    prompts = os.path.join(out, "prompts.txt")
    write_text(prompts, f"a red circle on a white background --w {size} --h {size} --s 8 --d 1 --g 1.0\n"
                        f"a blue square on a black background --w {size} --h {size} --s 8 --d 2 --g 1.0\n")
    return {"dataset_config": dataset_toml, "sample_prompts": prompts, "image_dir": image_dir, **make_text_corpus(out)}


def make_tiny_edit_dataset(out: str, count: int = 8, size: int = 64, seed: int = 0) -> dict[str, str]:
    """A paired edit task: references (control/) are grey shapes, targets (images/) the same shapes
    red, every caption "make the shape red"; a dataset TOML with control_directory and a prompt
    file whose prompts take a reference (--ci)."""
    rng = random.Random(seed)
    image_dir, control_dir = (os.path.join(out, folder) for folder in FOLDERS["edit"])
    os.makedirs(image_dir, exist_ok=True)
    os.makedirs(control_dir, exist_ok=True)
    scenes = edit_scenes(count, rng)
    for i, scene in enumerate(scenes):
        for folder, colour in ((control_dir, (128, 128, 128)), (image_dir, COLOURS["red"])):
            shapes.draw_scene(scene, size, fill=colour).save(os.path.join(folder, f"{i:03d}.png"))
        write_text(os.path.join(image_dir, f"{i:03d}.txt"), "make the shape red")
    dataset_toml = os.path.join(out, "edit_dataset.toml")
    write_dataset_toml(dataset_toml, f" --edit: {count} (reference, target) pairs", size, [("", [
        f"image_dir = {toml_string(image_dir)}", f"control_directory = {toml_string(control_dir)}   # reference per target, same file name",
        "num_repeats = 1"])])
    prompts = os.path.join(out, "edit_prompts.txt")
    write_text(prompts, f"make the shape red --ci {os.path.join(control_dir, '000.png')} --w {size} --h {size} --s 8 --d 1 --g 1.0\n")
    return {"edit_dataset_config": dataset_toml, "edit_sample_prompts": prompts, "edit_image_dir": image_dir,
            "edit_control_dir": control_dir}


def edit_scenes(count: int, rng: random.Random) -> list:
    """`count` different scenes of the edit set (shape x position x size x plain background, 48, in
    an order drawn from rng; beyond 48 repeated with another jitter): a draw with replacement from 4
    combinations had made 5 of 8 pairs the same pair."""
    pool = shapes.all_scenes(shapes=shapes.SHAPES, colours=("red",), backgrounds=tuple(shapes.PLAIN))
    rng.shuffle(pool)
    return [shapes.jittered(pool[i % len(pool)], rng) if i >= len(pool) else pool[i] for i in range(count)]


def make_tiny_layered_dataset(out: str, count: int = 4, size: int = 64, seed: int = 0) -> dict[str, str]:
    """Decomposition targets in musubi-tuner's multiple_target layout: NNN.png, a shape on a background
    (the composite, captioned), NNN_1.png the background alone (opaque), NNN_2.png the shape alone on a
    transparent canvas; a dataset TOML with multiple_target = true and a prompt file that decomposes
    the first composite (--ci)."""
    rng = random.Random(seed)
    image_dir = os.path.join(out, *FOLDERS["layered"])
    os.makedirs(image_dir, exist_ok=True)
    combos = [(s, c, b) for s in SHAPES for c in COLOURS for b in BACKGROUNDS]
    rng.shuffle(combos)  # drawn without replacement: a draw with it had made 2 pairs of 8 composites the same
    for i, (shape, colour, background) in enumerate(combos[:count]):
        draw(shape, COLOURS[colour], BACKGROUNDS[background], (size, size)).save(os.path.join(image_dir, f"{i:03d}.png"))
        Image.new("RGBA", (size, size), BACKGROUNDS[background] + (255,)).save(os.path.join(image_dir, f"{i:03d}_1.png"))
        layer = Image.new("RGBA", (size, size), (0, 0, 0, 0))
        box = (size // 4, size // 4, 3 * size // 4, 3 * size // 4)
        (ImageDraw.Draw(layer).ellipse if shape == "circle" else ImageDraw.Draw(layer).rectangle)(box, fill=COLOURS[colour] + (255,))
        layer.save(os.path.join(image_dir, f"{i:03d}_2.png"))
        write_text(os.path.join(image_dir, f"{i:03d}.txt"), f"a {colour} {shape} on a {background} background")
    dataset_toml = os.path.join(out, "layered_dataset.toml")
    write_dataset_toml(dataset_toml, f" --layered: {count} composites, 2 layers each", size, [("", [
        f"image_dir = {toml_string(image_dir)}", "multiple_target = true   # NNN.png + NNN.txt, its layers NNN_1.png, NNN_2.png",
        "num_repeats = 1"])])
    prompts = os.path.join(out, "layered_prompts.txt")
    write_text(prompts, f"a shape on a background --ci {os.path.join(image_dir, '000.png')} --w {size} --h {size} --s 8 --d 1 --g 1.0\n")
    return {"layered_dataset_config": dataset_toml, "layered_sample_prompts": prompts, "layered_image_dir": image_dir}


# The concept the demo teaches (the learned base never saw purple, nor a star) and how it is checked.
CONCEPT = ("purple", "star")


def concept_prompts(trigger: str) -> dict[str, list[str]]:
    """The demo's prompts: every trigger scene (3 positions x 2 sizes x 3 backgrounds) and twelve scenes
    of the base (every base shape and colour, each at one position, size and background)."""
    trigger_scenes = shapes.all_scenes(shapes=(CONCEPT[1],), colours=(CONCEPT[0],))
    positions, sizes = list(shapes.POSITIONS), list(shapes.SIZES)
    unrelated = [shapes.Scene(shape, colour, positions[i % 3], sizes[i % 2], shapes.BACKGROUNDS[i % 3])
                 for i, (shape, colour) in enumerate((s, c) for s in shapes.BASE_SHAPES for c in shapes.BASE_COLOURS)]
    return {"trigger_prompts": [s.caption(trigger) for s in trigger_scenes], "unrelated_prompts": [s.caption() for s in unrelated]}


def write_scene_images(image_dir: str, scenes: list, size: int, trigger: str | None = None) -> None:
    os.makedirs(image_dir, exist_ok=True)
    for i, scene in enumerate(scenes):
        shapes.draw_scene(scene, size).save(os.path.join(image_dir, f"{i:03d}.png"))
        write_text(os.path.join(image_dir, f"{i:03d}.txt"), scene.caption(trigger))


def scene_dataset_toml(path: str, image_dir: str, size: int, what: str, reg_dir: str | None = None,
                       batch_size: int = 2, num_repeats: int = 1) -> None:
    subsets = [("", [f"image_dir = {toml_string(image_dir)}", f"num_repeats = {num_repeats}"])]
    if reg_dir is not None:
        subsets.append(("  # regularization images: what the base already draws, so the trigger stays a word",
                        [f"image_dir = {toml_string(reg_dir)}", "is_reg = true"]))
    write_dataset_toml(path, f": {what}", size, subsets, batch_size)


def make_scenes_dataset(out: str, size: int = 64, seed: int = 0) -> dict[str, str]:
    """Every base scene (library/data/shapes.py), jittered, captioned, with a dataset TOML."""
    rng = random.Random(seed)
    scenes = [shapes.jittered(s, rng) for s in shapes.all_scenes()]
    image_dir, toml = os.path.join(out, *FOLDERS["scenes"]), os.path.join(out, "scenes.toml")
    write_scene_images(image_dir, scenes, size)
    scene_dataset_toml(toml, image_dir, size, f"{len(scenes)} scenes of the learned base")
    return {"scenes_dataset_config": toml, "scenes_image_dir": image_dir}


# The concept's images repeat CONCEPT_REPEATS times per epoch and as many regularization images (base
# scenes) are drawn beside them: sd-scripts' is_reg uses reg images in file order until they match
# the training images with repeats, so with 10 images x 1 repeat only the first 10 of any reg set
# were ever seen. Measured (120 steps, batch 8, training seeds 42/1/2/3, fp8_scaled base): 10 reg
# images kept 7-8 of 10 unrelated prompts; 200 (x20 repeats) kept 9-10 of 10, concept 15-18 of 18.
CONCEPT_REPEATS = 20
REG_IMAGES = 200


def balanced_order(scenes) -> list:
    """The 18 position x size x background scenes ordered so that every prefix covers them evenly (the
    first 10: 5 small and 5 big, each background 3-4 times, each position 3-4 times), as a person
    picks the photos of a new concept: a random pick of 10 had drawn 8 big and 2 small stars, none
    small on black, and the LoRA then drew small stars on black blue (3 of the 4 misses of the demo)."""
    by_combo = {(s.size, s.background, s.position): s for s in scenes}
    sizes, backgrounds, positions = list(shapes.SIZES), list(shapes.BACKGROUNDS), list(shapes.POSITIONS)
    return [by_combo[sizes[k % 2], backgrounds[k % 3], positions[(k // 6 + k) % 3]] for k in range(len(by_combo))]


def make_concept_dataset(out: str, count: int = 10, size: int = 64, seed: int = 0, trigger: str = "zxq") -> dict[str, str]:
    """`count` purple stars (of the 18 position x size x background scenes, balanced_order, jittered) captioned with the
    trigger word for the colour and shape ("a big zxq on the left, white background"), a dataset TOML,
    the sample prompts (every trigger scene and twelve unrelated base scenes, 8 steps, guidance 1.0)
    and concept.json (the trigger, its meaning, the prompts) for tools/concept_demo.py."""
    import json

    rng = random.Random(seed)
    pool = balanced_order(shapes.Scene(CONCEPT[1], CONCEPT[0], p, z, b) for p in shapes.POSITIONS
                          for z in shapes.SIZES for b in shapes.BACKGROUNDS)
    scenes = [shapes.jittered(s, rng) for s in (pool * (count // len(pool) + 1))[:count]]
    image_dir, reg_dir = (os.path.join(out, folder) for folder in FOLDERS["concept"])
    toml = os.path.join(out, "concept.toml")
    write_scene_images(image_dir, scenes, size, trigger)
    prompts = concept_prompts(trigger)
    base = [s for s in shapes.all_scenes() if s.caption() not in prompts["unrelated_prompts"]]  # the demo's are unseen
    rng.shuffle(base)
    write_scene_images(reg_dir, [shapes.jittered(s, rng) for s in base[:REG_IMAGES]], size)
    scene_dataset_toml(toml, image_dir, size, f"{count} images of a new concept, '{trigger}' = a {' '.join(CONCEPT)}, "
                       f"and {REG_IMAGES} regularization images of the base's scenes", reg_dir, batch_size=8,
                       num_repeats=CONCEPT_REPEATS)
    prompt_file = os.path.join(out, "concept_prompts.txt")
    write_text(prompt_file, "".join(f"{p} --w {size} --h {size} --s 8 --d {i} --g 1.0\n"
                                    for i, p in enumerate(prompts["trigger_prompts"][:3] + prompts["unrelated_prompts"][:3])))
    manifest = os.path.join(out, "concept.json")
    write_text(manifest, json.dumps({"trigger": trigger, "colour": CONCEPT[0], "shape": CONCEPT[1], "size": size,
                                     **prompts}, indent=2) + "\n")
    return {"concept_dataset_config": toml, "concept_sample_prompts": prompt_file, "concept_image_dir": image_dir,
            "concept": manifest}


def make_text_corpus(out: str, max_chars: int = 200_000) -> dict[str, str]:
    """corpus.txt (standard-library docstrings: on every machine with Python, never downloaded)
    and llm_scratch/ (config.json of a ~1M-parameter Qwen2-style model + a BPE tokenizer trained
    on the corpus, no weights) for LLM LoRA and pretraining runs."""
    import json

    from library.data.tokenizer import build_bpe_tokenizer
    from tools.llm_quickstart import stdlib_docstrings

    text = stdlib_docstrings(max_chars)
    corpus = os.path.join(out, "corpus.txt")
    write_text(corpus, text)
    scratch = os.path.join(out, "llm_scratch")
    tokenizer = build_bpe_tokenizer([text], 1024, scratch)
    config = {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": len(tokenizer),
        "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 256, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True, "eos_token_id": tokenizer.eos_token_id,
    }
    write_text(os.path.join(scratch, "config.json"), json.dumps(config, indent=2) + "\n")
    return {"corpus": corpus, "llm_scratch": scratch}


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
        if problem := bad_value(args):
            raise ValueError(problem)
        write(args)
    except (ValueError, OSError) as e:  # OSError: an --out under a file, a full disk
        print(one_line(e), file=sys.stderr)
        return 2
    return 0


def write(args) -> None:
    args.count = args.count or (10 if args.concept else 8)
    if args.overwrite:
        clear_set_folders(args)
    if args.concept:
        trigger = args.trigger or "zxq"
        paths = make_concept_dataset(args.out, args.count, args.size, args.seed, trigger)
        print(f"wrote {args.count} images of '{trigger}' to {paths['concept_image_dir']}, "
              f"{paths['concept_dataset_config']}, {paths['concept_sample_prompts']}, {paths['concept']}")
        return
    if args.scenes:
        paths = make_scenes_dataset(args.out, args.size, args.seed)
        print(f"wrote the base scenes to {paths['scenes_image_dir']}, {paths['scenes_dataset_config']}")
        return
    if args.layered:
        paths = make_tiny_layered_dataset(args.out, args.count, args.size, args.seed)
        print(f"wrote {args.count} composites with their layers to {paths['layered_image_dir']}, "
              f"{paths['layered_dataset_config']}, {paths['layered_sample_prompts']}")
        return
    if args.edit:
        paths = make_tiny_edit_dataset(args.out, args.count, args.size, args.seed)
        print(f"wrote {args.count} pairs to {paths['edit_image_dir']} / {paths['edit_control_dir']}, "
              f"{paths['edit_dataset_config']}, {paths['edit_sample_prompts']}")
        return
    paths = make_tiny_dataset(args.out, args.count, args.size, args.seed)
    print(f"wrote {args.count} images to {paths['image_dir']}, {paths['dataset_config']}, {paths['sample_prompts']}")


if __name__ == "__main__":
    exit_without_collecting(main)
