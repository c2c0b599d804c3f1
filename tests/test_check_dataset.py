"""The dataset check (library/data/check.py, tools/check_dataset.py) on a fixture with one of each
problem, built here from tiny PIL images; the warnings train_lora.py adds before caching; a truncated
image in training."""

import json
import os
import re
import shutil

import numpy as np
import pytest
from PIL import Image

import train_lora
from library.data import check
from library.data.dataset_config import load_dataset_config, parse_dataset_config
from tests.test_dataset import make_image
from tests.test_reliability import copy_dataset, files_under, flux_args, one_error_line
from tests.test_reliability_inputs import MID_GREY_16, png16
from tools import check_dataset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LONG_CAPTION = "a very long caption " * 10  # 40 words: beyond the 16 tokens the fixture's tokenizer limit keeps


def truncated_jpeg(path, size=(64, 48), keep=0.5) -> str:
    """A JPEG of noise cut (to `keep` of its bytes): its header verifies (what the training scan checks), its pixels do not decode."""
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.random.RandomState(0).randint(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(path)
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    return str(path)


def one_of_each(root) -> str:
    """A dataset TOML whose images have one problem each (the names say which); returns its path."""
    a, masks, b, refs, val = (root / d for d in ("a", "masks", "b", "refs", "val"))
    colours = iter(range(10, 250, 7))  # every image its own colour: no accidental duplicates

    def image(folder, name, w=64, h=48, caption="a red circle", mask=True):
        path = make_image(folder / name, w, h, (next(colours), 40, 40))
        if caption is not None:
            (folder / name).with_suffix(".txt").write_text(caption)
        if mask:
            Image.new("L", (w, h), 255).save(masks / (os.path.splitext(name)[0] + ".png"))
        return path

    masks.mkdir(parents=True)
    good = image(a, "good.png")
    image(a, "small.png", 1, 1)  # warning: size
    (a / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\nnot an image")  # error: image (unreadable)
    truncated_jpeg(a / "truncated.jpg")  # error: image (does not decode)
    upside_down = Image.Exif()
    upside_down[0x0112] = 3  # EXIF orientation: shown turned 180 degrees (its size and bucket unchanged)
    Image.new("RGB", (64, 48), (5, 200, 5)).convert("CMYK").save(a / "cmyk.jpg", exif=upside_down.tobytes())  # notes
    (a / "cmyk.txt").write_text("a green field")
    Image.new("L", (64, 48), 255).save(masks / "cmyk.png")
    png16(a / "grey16.png", np.full((48, 64), MID_GREY_16, dtype=np.uint16))  # note: 16-bit
    (a / "grey16.txt").write_text("grey")
    Image.new("L", (64, 48), 255).save(masks / "grey16.png")
    image(a, "no_caption.png", caption=None)  # error: caption (missing)
    Image.new("RGBA", (64, 48), (0, 0, 0, 0)).save(a / "transparent.png")  # note: trained black
    (a / "transparent.txt").write_text("a cut-out")
    Image.new("L", (64, 48), 255).save(masks / "transparent.png")
    image(a, "two_lines.png", caption="a red circle\r\non white")  # note: several lines
    image(a, "colour_mask.png", mask=False)
    Image.new("RGB", (64, 48), (255, 0, 0)).save(masks / "colour_mask.png")  # error: mask (in colour)
    image(a, "empty_caption.png", caption="")  # error: caption (empty)
    image(a, "bad_utf8.png")
    (a / "bad_utf8.txt").write_bytes(b"a red \xff circle")  # error: caption (not UTF-8)
    image(a, "long_caption.png", caption=LONG_CAPTION)  # warning: tokens
    shutil.copy(good, a / "good_copy.png")  # warning: duplicate
    (a / "good_copy.txt").write_text("the same")
    Image.new("L", (64, 48), 255).save(masks / "good_copy.png")
    image(a, "mask_size.png", mask=False)
    Image.new("L", (32, 32), 255).save(masks / "mask_size.png")  # error: mask (size)
    image(a, "no_mask.png", mask=False)  # error: mask (missing)
    image(b, "paired.png", mask=False)
    image(refs, "paired.png", caption=None, mask=False)
    image(b, "unpaired.png", mask=False)  # error: reference (missing)
    image(b, "cut_reference.png", mask=False)
    truncated_jpeg(refs / "cut_reference.jpg")  # error: reference (does not decode; its header verifies)
    val.mkdir()
    shutil.copy(good, val / "leak.png")  # warning: duplicate (training -> validation)
    (val / "leak.txt").write_text("a red circle")
    toml = root / "dataset.toml"
    toml.write_text(
        "[general]\nresolution = 64\nenable_bucket = true\nmin_bucket_reso = 32\nmax_bucket_reso = 128\n"
        "bucket_reso_steps = 16\n"
        f'[[datasets]]\n[[datasets.subsets]]\nimage_dir = "{a}"\nmask_dir = "{masks}"\n'
        f'[[datasets.subsets]]\nimage_dir = "{b}"\ncontrol_directory = "{refs}"\n'
        f'[[validation_datasets]]\n[[validation_datasets.subsets]]\nimage_dir = "{val}"\n'
    )
    return str(toml)


EXPECTED = [  # (severity, kind, file): the fixture's problems in report order
    ("error", "image", "broken.png"), ("error", "caption", "empty_caption.txt"), ("error", "caption", "bad_utf8.txt"),
    ("error", "mask", "colour_mask.png"),
    ("error", "mask", "mask_size.png"), ("error", "caption", "no_caption.png"), ("error", "mask", "no_mask.png"),
    ("warning", "size", "small.png"), ("error", "image", "truncated.jpg"), ("warning", "tokens", "long_caption.txt"),
    ("warning", "duplicate", "good_copy.png"), ("error", "reference", "unpaired.png"), ("warning", "duplicate", "leak.png"),
    ("error", "reference", "cut_reference.jpg"),
]


def found(report) -> list[tuple[str, str, str]]:
    return [(p.severity, p.kind, os.path.basename(p.message.split(": ")[0])) for p in report.problems()]


def test_check_finds_one_of_each_problem(tmp_path):
    toml = one_of_each(tmp_path)
    limit = check.TokenLimit("whitespace", 16, lambda text: len(text.split()))
    report = check.check_dataset(load_dataset_config(toml), limit)
    assert sorted(found(report)) == sorted(EXPECTED)
    truncated = next(p.message for p in report.problems() if "truncated.jpg" in p.message)
    assert truncated.endswith("truncated.jpg: cannot be decoded as an image (OSError: image file is truncated "
                              "(151 bytes not processed))"), truncated
    a, b, val = report.subsets
    assert (a.images, a.trained, b.images, b.trained, val.images, val.trained, val.held_out) == (16, 14, 3, 3, 1, 0, 1)
    assert a.buckets == {"80x48": 13, "64x64": 1} and a.sizes == {"64x48": 13, "1x1": 1}  # the 1x1 is upscaled
    notes = {what.split(",")[0]: [os.path.basename(f) for f in files] for what, files in a.notes.items()}
    assert notes == {"CMYK images": ["cmyk.jpg"], "16-bit grey images": ["grey16.png"],
                     "images turned upright by their EXIF orientation": ["cmyk.jpg"],
                     "images with transparent pixels": ["transparent.png"], "captions of several lines": ["two_lines.txt"]}
    messages = {p.kind + os.path.basename(p.message.split(": ")[0]): p.message for p in report.problems()}
    assert messages["tokenslong_caption.txt"].endswith(": caption is 40 whitespace tokens; the encoder keeps 16, the rest is cut")
    assert messages["duplicateleak.png"] == f"{tmp_path / 'val' / 'leak.png'}: the same file as {tmp_path / 'a' / 'good.png'}"
    assert messages["maskmask_size.png"].endswith(f"mask is 32x32, its image {tmp_path / 'a' / 'mask_size.png'} is 64x48")


def test_check_tool_report_json_and_strict(tmp_path, capsys):
    """A dataset with 9 errors exited 0 without --strict, so a script's `check && train` trained on
    it (and stopped at the first error); now errors exit 1 (one line each on stderr), --strict adds
    the warnings."""
    toml = one_of_each(tmp_path)
    assert check_dataset.main([toml]) == 1
    captured = capsys.readouterr()
    out = captured.out
    assert len(captured.err.splitlines()) == 10 and all(line.startswith("error: ") for line in captured.err.splitlines())
    assert "caption tokens: not counted (no tokenizer: pass --config_file or --tokenizer)" in out
    assert "datasets 1, subset 1: " in out and "buckets: 80x48 x13, 64x64 x1" in out
    assert "10 errors, 3 warnings: training stops at the first error" in out  # no tokenizer: no token warning
    assert check_dataset.main([toml, "--json", "--strict"]) == 1
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    assert (data["errors"], data["warnings"]) == (10, 3) and len(data["subsets"]) == 3
    lines = captured.err.splitlines()
    assert len(lines) == 13 and all(line.startswith(("error: ", "warning: ")) for line in lines)


def t5_tokens(tiny_set, text: str) -> int:
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(tiny_set["t5xxl"])(text, verbose=False).input_ids)


def test_check_tool_counts_caption_tokens_with_a_tokenizer_or_a_training_config(tiny_set, tmp_path, capsys):
    toml = one_of_each(tmp_path)
    assert check_dataset.main([toml, "--tokenizer", tiny_set["t5xxl"], "--max_tokens", "16", "--strict"]) == 1
    n = t5_tokens(tiny_set, LONG_CAPTION.strip())  # as read: caption files are stripped
    assert (f"warning: {tmp_path / 'a' / 'long_caption.txt'}: caption is {n} t5xxl tokenizer tokens; the encoder keeps "
            f"16, the rest is cut") in capsys.readouterr().err.splitlines()
    cfg = copy_dataset(tiny_set, tmp_path / "run", lambda d: (d / "000.txt").write_text("word " * 600))
    config = tmp_path / "run.toml"
    config.write_text(f'model_type = "flux"\npretrained_model_name_or_path = "{tiny_set["flux_bfl"]}"\n'
                      f'ae = "{tiny_set["flux_vae_single"]}"\nclip_l = "{tiny_set["clip_l"]}"\n'
                      f't5xxl = "{tiny_set["t5xxl"]}"\ndataset_config = "{cfg}"\n')
    assert check_dataset.main(["--config_file", str(config), "--strict"]) == 1
    captured = capsys.readouterr()
    assert "caption tokens: T5-XXL, 512 tokens kept" in captured.out
    n = t5_tokens(tiny_set, ("word " * 600).strip())  # the tiny T5's vocabulary splits "word": n > 600
    assert captured.err.splitlines() == [f"warning: {tmp_path / 'run' / 'images' / '000.txt'}: caption is {n} T5-XXL "
                                         f"tokens; the encoder keeps 512, the rest is cut"]


def test_a_bucket_over_zimages_rope_positions_is_a_check_error_per_image_as_in_training(tiny_set, tmp_path, capsys):
    """check_dataset --config_file passed 8224 px wide buckets (0 errors) that training refuses before caching
    (refuse_large_buckets: Z-Image's RoPE takes 8192 px a side)."""
    from tools.make_tiny_models import tiny_config

    for name, colour in (("wide.png", (200, 0, 0)), ("wide2.png", (0, 200, 0))):
        make_image(tmp_path / "img" / name, 8224, 16, colour)
    toml = tmp_path / "ds.toml"
    toml.write_text(f'[general]\nresolution = [8224, 16]\n[[datasets]]\n[[datasets.subsets]]\n'
                    f'image_dir = "{tmp_path / "img"}"\nclass_tokens = "a stripe"\n')
    config = tmp_path / "run.toml"
    config.write_text(tiny_config("zimage", {**tiny_set, "dataset_config": str(toml)}))
    assert check_dataset.main(["--config_file", str(config)]) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"error: {tmp_path / 'img' / name}: its bucket 8224x16 is over the largest image the model takes, 8192 wide by "
        f"8192 high (the positions its RoPE was built for); {toml}'s resolution, max_bucket_reso or bucket_no_upscale set it"
        for name in ("wide.png", "wide2.png")]


def test_a_bucket_step_off_the_models_token_grid_is_refused_by_the_check_as_by_training(tiny_set, tmp_path, capsys):
    """HunyuanImage's 32x VAE takes sides in multiples of 32 px; the tiny dataset's bucket_reso_steps 16 passed the
    check (0 errors) and training refused it before caching. Both refuse it now, in one line naming the key."""
    from tools.make_tiny_models import tiny_config

    config = tmp_path / "run.toml"
    config.write_text(tiny_config("hunyuan_image", tiny_set))
    assert check_dataset.main(["--config_file", str(config)]) == 2
    err = capsys.readouterr().err
    assert "key 'bucket_reso_steps' = 16" in err and "multiples of 32 px" in err and len(err.splitlines()) == 1


def test_an_edit_model_type_without_any_reference_is_the_checks_warning_as_trainings(tiny_set, tmp_path, capsys):
    """Training warns that a Kontext LoRA on a dataset without control_directory learns text-to-image; the check
    said nothing."""
    from tools.make_tiny_models import tiny_config

    config = tmp_path / "run.toml"
    config.write_text(tiny_config("flux", tiny_set).replace('model_type = "flux"', 'model_type = "flux_kontext"'))
    assert check_dataset.main(["--config_file", str(config), "--strict"]) == 1
    assert "model_type flux_kontext is an edit model, but no training image has a reference" in capsys.readouterr().err


@pytest.mark.parametrize("key, said", [
    ("prior_loss_weight = 0.5", "key 'prior_loss_weight' = 0.5 does nothing: no subset has is_reg = true"),
    ("validate_every_n_steps = 2", "validate_every_n_steps is set but no image is held out")])
def test_the_configs_keys_the_data_cannot_serve_are_refused_by_the_check_as_by_training(tiny_set, tmp_path, capsys,
                                                                                       key, said):
    """check_dataset --config_file passed them (0 errors); training refuses them before caching."""
    from tools.make_tiny_models import tiny_config

    config = tmp_path / "run.toml"
    config.write_text(tiny_config("flux", tiny_set) + f"\n{key}\n")
    assert check_dataset.main(["--config_file", str(config)]) == 2
    err = capsys.readouterr().err
    assert said in err and len(err.splitlines()) == 1, err


def test_an_image_skipped_for_its_size_is_no_duplicate_of_its_copy(tmp_path):
    """Two copies of an image too small for its buckets, skipped (skip_bad_size_images): training never reads them,
    the check warned that one was the same file as the other."""
    for folder in ("a", "b"):
        make_image(tmp_path / folder / "tiny.png", 16, 16, (200, 0, 0))
        make_image(tmp_path / folder / "big.png", 64, 64, (0, 0, 200) if folder == "a" else (0, 200, 0))
    subsets = [{"image_dir": str(tmp_path / f), "class_tokens": "x", "skip_bad_size_images": True} for f in "ab"]
    bp = parse_dataset_config({"datasets": [{"resolution": 64, "min_bucket_reso": 32, "enable_bucket": True,
                                             "subsets": subsets}]}, source="ds.toml")
    truncated_jpeg(tmp_path / "a" / "thin.jpg", size=(16, 128))  # skipped by its header: training decodes none
    report = check.check_dataset(bp)
    assert not [p for p in report.problems() if "the same file" in p.line()], [p.line() for p in report.problems()]
    assert [p.line().split(": ")[1] for p in report.problems() if "skipped (skip_bad_size_images)" in p.line()] == [
        str(tmp_path / "a" / name) for name in ("thin.jpg", "tiny.png")] + [str(tmp_path / "b" / "tiny.png")]
    assert not [p for p in report.problems() if p.severity == "error"], [p.line() for p in report.problems()]


def test_a_caption_path_that_is_a_folder_is_one_error_of_the_report(tmp_path, capsys):
    """Its OSError discarded the whole report: one errno line, exit 2 as for an unreadable config."""
    for i in range(2):
        make_image(tmp_path / "img" / f"{i}.png", 32, 32, (90 * i, 0, 0))
    (tmp_path / "img" / "0.txt").write_text("a red square")
    (tmp_path / "img" / "1.txt").mkdir()
    toml = tmp_path / "ds.toml"
    toml.write_text(f'[[datasets]]\nresolution = 32\n[[datasets.subsets]]\nimage_dir = "{tmp_path / "img"}"\n')
    assert check_dataset.main([str(toml)]) == 1
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [f"error: {tmp_path / 'img' / '1.txt'}: cannot read caption file (Is a directory)"]
    assert "images: 2, trained: 2" in captured.out


def test_check_tool_bad_input_is_one_line_exit_2(tmp_path, capsys):
    (tmp_path / "bad.toml").write_text("[[datasets]]\nresolution = 64\nbogus = 1\n")
    (tmp_path / "ok.toml").write_text(f'[[datasets]]\nresolution = 64\n[[datasets.subsets]]\nimage_dir = "{tmp_path}"\n')
    (tmp_path / "no_tokenizer").mkdir()
    for argv, fragment in (([str(tmp_path / "bad.toml")], "unknown key 'bogus'"),
                           ([str(tmp_path / "none.toml")], "no such dataset config file"),
                           ([], "no dataset: give a dataset TOML or --config_file"),
                           ([str(tmp_path / "bad.toml"), "--max_tokens", "5"], "--max_tokens needs --tokenizer"),
                           # Old: 0 was read as unset (the tokenizer's limit), -3 as a limit of -3
                           ([str(tmp_path / "bad.toml"), "--tokenizer", str(tmp_path), "--max_tokens", "0"],
                            "--max_tokens 0: expected the tokens the encoder keeps, >= 1"),
                           # Old: transformers' own line, naming no folder ("Couldn't instantiate the backend tokenizer")
                           ([str(tmp_path / "ok.toml"), "--tokenizer", str(tmp_path / "no_tokenizer")],
                            f"--tokenizer {tmp_path / 'no_tokenizer'}: no tokenizer can be loaded from this folder"),
                           # the old line: "no tokenizer found in ['models', 'tokenizer']; pass tokenizer=<folder>"
                           (["--config_file", os.path.join(ROOT, "configs", "qwen_image.toml")],
                            "error: models/Qwen-Image: no such file or folder")):
        line = one_error_line(capsys, check_dataset.main(argv))
        assert fragment in line, line


def test_training_warns_once_before_caching_about_duplicates_and_cut_captions(tiny_set, tmp_path, monkeypatch, capsys):
    """The check's warnings train_lora adds (the scan warns about sizes itself, not again here)."""
    from library.training import diffusion_task

    def mutate(images):
        shutil.copy(images / "001.png", images / "copy.png")
        (images / "copy.txt").write_text(LONG_CAPTION)  # beyond the t5xxl_max_token_length 32 set below
        make_image(images / "strip.png", 512, 16, (1, 2, 3))  # a bad size: the scan's own warning
        (images / "strip.txt").write_text("a strip")
        make_image(images / "small.png", 32, 32, (4, 5, 6))  # within the bucket limits: said once, upscaled 2x
        (images / "small.txt").write_text("a small one")

    cfg = copy_dataset(tiny_set, tmp_path / "data", mutate)
    events, warn, cache = [], diffusion_task.warn, diffusion_task.cache_latents
    monkeypatch.setattr(diffusion_task, "warn", lambda problems: (events.append([p.message for p in problems]),
                                                                  warn(problems)))
    monkeypatch.setattr(diffusion_task, "cache_latents", lambda *a, **k: (events.append("caching"), cache(*a, **k))[1])
    with pytest.warns(UserWarning) as caught:
        assert train_lora.main(flux_args(tiny_set, tmp_path / "out", "--dataset_config", cfg,
                                        "--t5xxl_max_token_length", "32")) == 0
    images = tmp_path / "data" / "images"
    expected = [f"{images / 'copy.png'}: the same file as {images / '001.png'}",
                f"{images / 'copy.txt'}: caption is {t5_tokens(tiny_set, LONG_CAPTION.strip())} T5-XXL tokens; the encoder keeps 32, "
                f"the rest is cut"]
    assert events == [expected, "caching"]
    messages = [str(w.message) for w in caught]
    assert all(messages.count(m) == 1 for m in expected)
    assert sum("strip.png: 512x16" in m for m in messages) == 1  # the scan's size warning, not repeated by the check
    upscaled = [line for line in capsys.readouterr().out.splitlines() if "upscaled to their bucket" in line]
    assert upscaled == [f"{cfg}: 1 of 11 images are upscaled to their bucket, by up to 2.00x ({images / 'small.png'}: "
                        f"32x32 -> 64x64); enable_bucket with bucket_no_upscale = true trains them at their own size"]


def test_a_truncated_image_is_one_error_line_naming_it(tiny_set, tmp_path, capsys):
    """Its header verifies, so the scan takes it; caching decodes it: the error names the file."""
    cfg = copy_dataset(tiny_set, tmp_path / "data", lambda d: truncated_jpeg(d / "bad.jpg") and
                       (d / "bad.txt").write_text("a cut file"))
    out = tmp_path / "out"
    capsys.readouterr()
    line = one_error_line(capsys, train_lora.main(flux_args(tiny_set, out, "--dataset_config", cfg)))
    assert f"{tmp_path / 'data' / 'images' / 'bad.jpg'}: cannot be decoded as an image (OSError: image file is " \
           f"truncated" in line, line
    assert files_under(out) == []


def encoder_kept_tokens(name: str, tiny_set):
    """(the family, kept(caption) -> how many of the caption's tokens its text encoder keeps)."""
    from library.models.flux1.family import FluxFamily
    from library.models.flux2 import dev_text_encoder, text_encoder
    from library.models.flux2.family import Flux2Family
    from library.models.qwen_image.family import QwenImageFamily
    from library.models.qwen_image.text_encoder import load_qwen_image_text_encoder

    if name == "qwen_image":
        encoder = load_qwen_image_text_encoder(tiny_set["qwen_image_text_encoder"])
        return (QwenImageFamily(tiny_set["qwen_image"], None, text_encoder=tiny_set["qwen_image_text_encoder"]),
                lambda caption: int(encoder.encode([caption])[1].sum()))
    if name == "flux":
        family = FluxFamily(tiny_set["flux_bfl"], None, clip_l=tiny_set["clip_l"], t5xxl=tiny_set["t5xxl"])
        from library.models.text_encoders import load_t5

        t5 = load_t5(tiny_set["t5xxl"])
        return family, lambda caption: int(t5.tokenizer([caption], padding="max_length", max_length=512,
                                                        truncation=True, return_tensors="pt")["attention_mask"].sum())
    dev = name == "flux2_dev"
    path = tiny_set["flux2_dev_text_encoder" if dev else "flux2_text_encoder"]
    encoder = (dev_text_encoder.load_dev_text_encoder if dev else text_encoder.load_klein_text_encoder)(path)
    family = Flux2Family(tiny_set["flux2_dev_tiny" if dev else "flux2_tiny"], None, text_encoder=path)
    return family, lambda caption: int(encoder.tokenize([caption])["attention_mask"].sum())


@pytest.mark.parametrize("name", ["flux", "qwen_image", "flux2", "flux2_dev"])
def test_caption_token_limits_count_as_the_text_encoders_do(tiny_set, name):
    """A short caption counts exactly the tokens the encoder keeps (its template's included where it
    keeps them); a long one counts more than the limit, and the encoder keeps the limit."""
    from types import SimpleNamespace

    family, kept = encoder_kept_tokens(name, tiny_set)
    limit = family.caption_token_limit(SimpleNamespace(t5xxl_max_token_length=None))
    assert limit.max_tokens == {"flux": 512, "qwen_image": 1024, "flux2": 512, "flux2_dev": 512}[name]
    short, long = "a red circle on a white background", "a red circle on a white background " * 150
    assert limit.count(short) == kept(short) < limit.max_tokens
    assert limit.count(long) > limit.max_tokens == kept(long)


def test_edit_families_keep_every_token():
    from library.models.qwen_image.edit import EDIT_2509
    from library.models.qwen_image.edit_family import QwenImageEditFamily

    assert QwenImageEditFamily("unused", model_version=EDIT_2509, text_encoder="unused").caption_token_limit(None) is None


def test_layered_images_layer_problems_are_errors_in_the_check_as_in_training(tmp_path):
    """multiple_target: a missing layer, another layer count and a layer of another size than its composite
    (fitted to the bucket on its own, it would be cropped out of register) are errors in both."""
    from library.data.image_folders import scan_images
    from tools.make_tiny_dataset import make_tiny_layered_dataset

    toml = make_tiny_layered_dataset(str(tmp_path), count=3, size=32)["layered_dataset_config"]
    folder = tmp_path / "layered_images"
    (folder / "001_2.png").unlink()
    Image.new("RGBA", (32, 16)).save(folder / "002_2.png")
    report = check.check_dataset(load_dataset_config(toml))
    # was 0 errors: the check did not look at layers, training stopped at 001.png
    assert found(report) == [("error", "layers", "001.png"), ("error", "layers", "002_2.png")]
    assert "layer is 32x16, its composite 002.png is 32x32" in report.problems()[1].message
    (folder / "001_2.png").write_bytes((folder / "000_2.png").read_bytes())
    with pytest.raises(ValueError, match="002_2.png: layer is 32x16"):  # was trained, scaled to cover 32x32 and cropped out of register
        scan_images(load_dataset_config(toml))
    # A layer whose pixels do not decode (its header verifies) passed the check; caching then stopped on it.
    (folder / "000_1.png").unlink()
    truncated_jpeg(folder / "000_1.jpg", size=(32, 32), keep=0.8)  # half: verify() finds it
    assert found(check.check_dataset(load_dataset_config(toml))) == [("error", "layers", "000_1.jpg"),
                                                                     ("error", "layers", "002_2.png")]


def test_layers_numbered_twice_or_with_a_gap_are_errors_in_the_check_as_in_training(tmp_path):
    """multiple_target: 000_01.png beside 000_1.png made two layers 1, and 001_1.png, 001_3.png (no 001_2.png)
    trained layer 3 in slot 2, each without a word when the layer counts matched; references refuse both."""
    from library.data.image_folders import scan_images
    from tools.make_tiny_dataset import make_tiny_layered_dataset

    toml = make_tiny_layered_dataset(str(tmp_path), count=3, size=32)["layered_dataset_config"]
    folder = tmp_path / "layered_images"
    (folder / "000_2.png").rename(folder / "000_01.png")  # as many layers as the others, two of them layer 1
    (folder / "001_2.png").rename(folder / "001_3.png")
    report = check.check_dataset(load_dataset_config(toml))
    assert found(report) == [("error", "layers", "000.png"), ("error", "layers", "001.png")]
    assert report.problems()[0].message.endswith("000.png: '000_01.png' and '000_1.png' are both its layer 1; keep one")
    assert report.problems()[1].message.endswith("001.png: no layer '001_2.<ext>' beside it, though it has '001_3.png' "
                                                 "(layers are numbered from 0 or 1 without gaps)")
    (folder / "000_01.png").rename(folder / "000_2.png")
    with pytest.raises(ValueError, match="no layer '001_2.<ext>' beside it"):
        scan_images(load_dataset_config(toml))
    (folder / "001_3.png").rename(folder / "001_2.png")
    assert found(check.check_dataset(load_dataset_config(toml))) == []


def test_a_mask_added_between_two_checks_in_one_process_is_seen(tmp_path, capsys):
    """The web UI runs check_dataset.py in one long-lived process: each mask_dir was listed once for its life,
    so a mask added after "no mask 'b.png'" was still missing at every later check (and one removed was found)."""
    for name in ("a", "b"):
        make_image(tmp_path / "img" / f"{name}.png", 32, 32, (200, 0, 0))
        (tmp_path / "img" / f"{name}.txt").write_text("a red square")
    (tmp_path / "masks").mkdir()
    Image.new("L", (32, 32), 255).save(tmp_path / "masks" / "a.png")
    toml = tmp_path / "ds.toml"
    toml.write_text(f'[[datasets]]\nresolution = 32\n[[datasets.subsets]]\nimage_dir = "{tmp_path / "img"}"\n'
                    f'mask_dir = "{tmp_path / "masks"}"\n')
    assert check_dataset.main([str(toml)]) == 1
    assert "no mask 'b.png'" in capsys.readouterr().err
    Image.new("L", (32, 32), 255).save(tmp_path / "masks" / "b.png")
    assert check_dataset.main([str(toml)]) == 0, capsys.readouterr().err
    (tmp_path / "masks" / "a.png").unlink()
    assert check_dataset.main([str(toml)]) == 1
    assert "no mask 'a.png'" in capsys.readouterr().err


def test_layered_images_of_one_name_are_that_error_alone_their_layers_are_still_layers(tmp_path):
    """001.png and 001.jpg beside 001_1.png, 001_2.png: the check went on listing every file as an image,
    11 errors more (layers without captions or layers of their own, composites without layers)."""
    from tools.make_tiny_dataset import make_tiny_layered_dataset

    toml = make_tiny_layered_dataset(str(tmp_path), count=2, size=32)["layered_dataset_config"]
    shutil.copy(tmp_path / "layered_images" / "001.png", tmp_path / "layered_images" / "001.jpg")
    report = check.check_dataset(load_dataset_config(toml))
    assert found(report) == [("error", "folder", "layered_images"), ("warning", "duplicate", "001.png")]
    assert "images '001.jpg' and '001.png' share the name '001'" in report.problems()[0].message
    assert report.subsets[0].images == 3


def test_a_numbered_image_with_layers_of_its_own_is_a_composite_not_a_layer(tmp_path):
    """multiple_target: a_1.png was taken as the first of a.png's three layers, and a_1's own layers
    (a_1_1.png, a_1_2.png) were dropped, without a word. Captions on layers (a captioning tool run over the
    folder) change nothing. a.png is then refused: its layer 1 is no layer (training a_2 as its first would
    shift every layer one slot)."""
    from library.data.image_folders import scan_images
    from library.data.layers import split_layers

    for name in ("a", "a_1", "a_2", "a_3", "a_1_1", "a_1_2"):
        Image.new("RGBA", (32, 32)).save(tmp_path / f"{name}.png")
        (tmp_path / f"{name}.txt").write_text("a poster")
    composites, layers = split_layers(sorted(str(p) for p in tmp_path.glob("*.png")))
    names = {os.path.basename(c): [os.path.basename(p) for p in layers[c]] for c in composites}
    assert names == {"a.png": ["a_2.png", "a_3.png"], "a_1.png": ["a_1_1.png", "a_1_2.png"]}
    bp = parse_dataset_config({"datasets": [{"resolution": 32, "subsets": [
        {"image_dir": str(tmp_path), "multiple_target": True}]}]})
    with pytest.raises(ValueError, match=r"a\.png: no layer 'a_1\.<ext>' beside it, though it has 'a_3\.png'"):
        scan_images(bp)
    (tmp_path / "a_3.png").rename(tmp_path / "a_0.png")  # layers 0 and 2 with a_1.png a composite: still a gap
    with pytest.raises(ValueError, match=r"a\.png: no layer 'a_1\.<ext>' beside it, though it has 'a_2\.png'"):
        scan_images(bp)


def test_with_a_training_config_references_the_family_does_not_take_are_errors_as_in_training(tmp_path):
    """check_dataset --config_file passes its family's (model_type, min, max) references: an edit dataset
    checked for a text-to-image family was 0 errors, and training stopped on its first image."""
    from tools.make_tiny_dataset import make_tiny_edit_dataset, make_tiny_layered_dataset

    edit = load_dataset_config(make_tiny_edit_dataset(str(tmp_path / "e"), count=2, size=32)["edit_dataset_config"])
    assert found(check.check_dataset(edit)) == []
    assert found(check.check_dataset(edit, takes=("t2i", 0, 0, False))) == [("error", "reference", "000.png"),
                                                                      ("error", "reference", "001.png")]
    assert "but model_type t2i takes no reference images" in check.check_dataset(edit, takes=("t2i", 0, 0, False)).problems()[0].message
    assert found(check.check_dataset(edit, takes=("edit", 1, 3, False))) == []
    for i in range(2):
        make_image(tmp_path / "plain" / f"{i}.png", 32, 32, (90 * i, 0, 0))
    plain = parse_dataset_config({"datasets": [{"resolution": 32, "subsets": [
        {"image_dir": str(tmp_path / "plain"), "class_tokens": "x"}]}]})
    assert "needs at least 1 per image" in check.check_dataset(plain, takes=("edit", 1, 3, False)).problems()[0].message
    layered = make_tiny_layered_dataset(str(tmp_path / "l"), count=2, size=32)["layered_dataset_config"]
    assert found(check.check_dataset(load_dataset_config(layered), takes=("layered", 1, 1, True))) == []  # the composite
    # Old: an edit family took the composite as its one reference (caching then met RGBA in its VAE), and a
    # text-to-image family's error named a control_directory the subset never set
    for takes in (("edit", 1, 3, False), ("t2i", 0, 0, False)):
        problems = check.check_dataset(load_dataset_config(layered), takes=takes).problems()
        assert problems and all(f"but model_type {takes[0]} trains no layers" in p.message for p in problems), problems


def test_the_validation_split_share_is_counted_as_held_out_not_trained(tmp_path):
    from library.data.image_folders import scan_images, split_validation

    for i in range(5):
        make_image(tmp_path / "a" / f"{i}.png", 32, 32, (40 * i, 0, 0))
    bp = parse_dataset_config({"datasets": [{"resolution": 32, "validation_split": 0.4, "subsets": [
        {"image_dir": str(tmp_path / "a"), "class_tokens": "x"}]}]})
    (subset,) = check.check_dataset(bp).subsets
    train, held_out = split_validation(scan_images(bp), bp)
    assert (subset.trained, subset.held_out) == (len(train), len(held_out)) == (3, 2)  # was trained 5
    assert "images: 5, trained: 3, held out for validation: 2\n" in check.report_text(check.check_dataset(bp))
    bp = parse_dataset_config({"datasets": [{"resolution": 32, "subsets": [{"image_dir": str(tmp_path / "a")}]}],
                               "validation_datasets": [{"resolution": 32, "subsets": [
                                   {"image_dir": str(tmp_path / "a"), "class_tokens": "x"}]}]})
    held = check.check_dataset(bp).subsets[1]
    assert (held.trained, held.held_out) == (0, 5)  # a [[validation_datasets]] subset said 'trained: 5'


def test_regularization_images_training_leaves_out_are_not_trained_and_one_warning_as_in_training(tmp_path, capsys):
    """Until 2026-12-01 the check said 'trained: 5, 0 warnings' for 5 reg images against 2 training images,
    of which training draws 2 (dataset.reg_repeats, as sd-scripts) and warns about the other 3."""
    import warnings

    from library.data.dataset import ImageDataset

    for i in range(7):
        make_image(tmp_path / ("train" if i < 2 else "reg") / f"{i}.png", 32, 32, (30 * i, 0, 0))
    toml = tmp_path / "ds.toml"
    toml.write_text(f'[[datasets]]\nresolution = 32\n[[datasets.subsets]]\nimage_dir = "{tmp_path / "train"}"\n'
                    f'class_tokens = "x"\n[[datasets.subsets]]\nimage_dir = "{tmp_path / "reg"}"\nclass_tokens = "y"\n'
                    f'is_reg = true\n')
    bp = load_dataset_config(str(toml))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        drawn = ImageDataset(bp).drawn_items()
    unused_line = [str(w.message) for w in said if "regularization images are not used" in str(w.message)]
    train, reg = check.check_dataset(bp).subsets
    assert (train.trained, reg.images, reg.trained) == (2, 5, sum(item.subset.is_reg for item in drawn)) == (2, 5, 2)
    assert [(p.severity, p.message) for p in reg.problems] == [("warning", m) for m in unused_line]
    assert len(unused_line) == 1 and unused_line[0].startswith("dataset 0: 3 of 5 regularization images are not used")
    assert check_dataset.main([str(toml), "--strict"]) == 1  # exit 0 before
    assert "images: 5, trained: 2" in capsys.readouterr().out


def test_regularization_images_the_balance_leaves_out_are_counted_apart_from_unreadable_ones(tmp_path):
    """Until 2026-12-02 the report said '(4 unreadable or skipped)' for readable reg images never drawn."""
    for i in range(6):
        make_image(tmp_path / ("train" if i < 2 else "reg") / f"{i}.png", 32, 32, (30 * i, 0, 0))
    (tmp_path / "reg" / "broken.png").write_bytes(b"not an image")
    bp = parse_dataset_config({"datasets": [{"resolution": 32, "subsets": [
        {"image_dir": str(tmp_path / "train"), "class_tokens": "x"},
        {"image_dir": str(tmp_path / "reg"), "class_tokens": "y", "is_reg": True}]}]})
    text = check.report_text(check.check_dataset(bp))
    assert "  images: 5, trained: 2, not drawn by the regularization balance: 2 (1 unreadable or skipped)\n" in text


def test_caption_files_of_another_extension_beside_class_token_images_are_one_warning_in_the_check_and_in_training(
        tmp_path, capsys):
    """Until 2026-12-02 an sd-scripts dataset's .caption files (its default caption_extension; ours is .txt)
    beside images of a subset with class_tokens trained every image on the class tokens, said only as a note."""
    from library.data.image_folders import scan_images

    for i in range(3):
        make_image(tmp_path / "img" / f"{i}.png", 32, 32, (60 * i, 0, 0))
        (tmp_path / "img" / f"{i}.caption").write_text(f"caption {i}")
    make_image(tmp_path / "plain" / "p.png", 32, 32, (0, 90, 0))  # no caption file of any kind: stays a note
    toml = tmp_path / "ds.toml"
    toml.write_text(f'[[datasets]]\nresolution = 32\n[[datasets.subsets]]\nimage_dir = "{tmp_path / "img"}"\n'
                    f'class_tokens = "ohwx person"\n[[datasets.subsets]]\nimage_dir = "{tmp_path / "plain"}"\n'
                    f'class_tokens = "x"\n')
    line = (f"{tmp_path / 'img'}: 3 images have no .txt caption file but a .caption one (first 0.png), so they train "
            f"on class_tokens 'ohwx person'; set caption_extension = \".caption\" in this subset to train on those captions")
    bp = load_dataset_config(str(toml))
    with pytest.warns(UserWarning) as said:
        scan_images(bp)
    assert [str(w.message) for w in said] == [line]  # once for the subset, none for the plain one
    with_caption_files, plain = check.check_dataset(bp).subsets
    assert [(p.severity, p.message) for p in with_caption_files.problems] == [("warning", line)]
    assert with_caption_files.notes == {}
    assert list(plain.notes) == ["images without a caption file, trained on class_tokens 'x'"]
    assert check_dataset.main([str(toml), "--strict"]) == 1  # 0 before: a note
    capsys.readouterr()
    bp = parse_dataset_config({"datasets": [{"resolution": 32, "subsets": [  # the reverse: .txt files, .caption asked
        {"image_dir": str(tmp_path / "plain"), "class_tokens": "x", "caption_extension": ".caption"}]}]})
    (tmp_path / "plain" / "p.txt").write_text("a green square")
    assert 'set caption_extension = ".txt"' in check.check_dataset(bp).problems()[0].message


def test_images_both_trained_and_held_out_are_one_warning_in_the_check_and_in_training(tmp_path):
    """Until 2026-11-27 the same file trained and validated on passed (only a copy of it was a duplicate):
    [[validation_datasets]] over the training folder, or validation_split in one of two datasets over it."""
    from library.data.image_folders import scan_images, split_validation

    for i in range(5):
        make_image(tmp_path / "a" / f"{i}.png", 32, 32, (40 * i, 0, 0))
    a = {"image_dir": str(tmp_path / "a"), "class_tokens": "x"}
    same_folder = {"datasets": [{"resolution": 32, "subsets": [a]}], "validation_datasets": [{"resolution": 32, "subsets": [a]}]}
    one_split = {"datasets": [{"resolution": 32, "validation_split": 0.4, "subsets": [a]},
                              {"resolution": 16, "min_bucket_reso": 16, "subsets": [a]}]}
    both_split = {"datasets": [{**d, "validation_split": 0.4} for d in one_split["datasets"]]}
    for config, leaked in ((same_folder, 5), (one_split, 2), (both_split, 0)):
        bp = parse_dataset_config(config)
        train, held_out = split_validation(scan_images(bp), bp)
        held_out += scan_images(bp, held_out_sets=True)
        said = [p.message for p in check.training_warnings(train, held_out, None)]
        report = check.check_dataset(bp)
        found = [(s.section, p.message) for s in report.subsets for p in s.problems]
        if not leaked:
            assert said == found == []
            continue
        first = sorted({item.image_path for item in held_out})[0]
        assert said == [m for _, m in found] and len(said) == 1 and said[0].startswith(f"{leaked} validation image(s) "
                                                                                       f"also trained: {first}")
        assert found[0][0] == ("validation_datasets 1, subset 1" if config is same_folder else "datasets 1, subset 1")


def test_a_subset_whose_folder_is_missing_is_one_error_of_the_check():
    bp = parse_dataset_config({"datasets": [{"resolution": 32, "subsets": [{"image_dir": "/nonexistent/x", "class_tokens": "x"}]}]})
    assert [p.message for p in check.check_dataset(bp).problems()] == ["/nonexistent/x: image_dir does not exist or is not a folder"]


def test_a_validation_split_that_holds_out_nothing_is_the_checks_error_as_in_training(tmp_path):
    from library.data.image_folders import scan_images, split_validation

    for i in range(3):
        make_image(tmp_path / "a" / f"{i}.png", 32, 32, (40 * i, 0, 0))
    bp = parse_dataset_config({"datasets": [{"resolution": 32, "validation_split": 0.2, "subsets": [
        {"image_dir": str(tmp_path / "a"), "class_tokens": "x"}]}]})
    with pytest.raises(ValueError) as raised:
        split_validation(scan_images(bp), bp)
    problems = check.check_dataset(bp).problems()  # passed with 0 errors until 2026-11-27
    assert [(p.severity, p.message) for p in problems] == [("error", str(raised.value))]
    assert "validation_split 0.2 holds out no image" in str(raised.value)


def test_images_in_subfolders_are_a_warning_of_the_check(tmp_path):
    """The scan's warning about images below image_dir is in the check's report (the web UI shows it),
    not only on stderr."""
    folder = tmp_path / "imgs"
    for name in ("a.png", "sub/b.png"):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (32, 32)).save(folder / name)
    (folder / "a.txt").write_text("a cat")
    toml = tmp_path / "d.toml"
    toml.write_text(f'[[datasets]]\nresolution = 32\n[[datasets.subsets]]\nimage_dir = "{folder}"\n')
    report = check.check_dataset(load_dataset_config(str(toml)))
    assert found(report) == [("warning", "folder", "imgs")]
    assert "1 images are not trained: its subfolders hold 1 (e.g. sub/b.png)" in report.problems()[0].message


def test_every_name_collision_and_the_folders_warnings_are_in_the_check_training_stops_at_the_first(tmp_path):
    """a.png and a.jpg hid b.png and b.webp's collision and the warnings on sub/ and the .gif: the check
    said one error of the folder, though it lists them all. Training still stops on the first, one line."""
    from library.data.image_folders import scan_images

    folder = tmp_path / "imgs"
    for i, name in enumerate(("a.png", "a.jpg", "b.png", "b.webp", "c.png", "sub/inner.png", "anim.gif")):
        make_image(folder / name, 32, 32, (30 * i, 0, 0))
    bp = parse_dataset_config({"datasets": [{"resolution": 32, "subsets": [
        {"image_dir": str(folder), "class_tokens": "x"}]}]})
    problems = check.check_dataset(bp).problems()
    said = [(p.severity, p.message.replace(f"{folder}: ", "").split(":")[0]) for p in problems]
    assert said == [("error", "images 'a.jpg' and 'a.png' share the name 'a'"),
                    ("error", "images 'b.png' and 'b.webp' share the name 'b'"),
                    ("warning", "1 images are not trained"),
                    ("warning", "1 files of a type not read (.gif; e.g. anim.gif) are not trained")]
    with pytest.warns(UserWarning), pytest.raises(ValueError) as raised:
        scan_images(bp)
    assert str(raised.value) == f"<dict>: {problems[0].message}"


def test_images_upscaled_to_their_bucket_are_one_line_with_the_count_and_largest_factor(tmp_path, capsys):
    """Within the bucket limits, so no size warning: a 32 px image in a 64 px bucket is enlarged 2x."""
    for name, side in (("small.png", 32), ("mid.png", 48), ("full.png", 64), ("big.png", 96)):
        make_image(tmp_path / "img" / name, side, side)
    toml = tmp_path / "ds.toml"
    toml.write_text(f'[[datasets]]\nresolution = 64\nenable_bucket = true\nmin_bucket_reso = 32\n'
                    f'[[datasets.subsets]]\nimage_dir = "{tmp_path / "img"}"\nclass_tokens = "x"\n')
    line = (f"2 of 4 images are upscaled to their bucket, by up to 2.00x ({tmp_path / 'img' / 'small.png'}: 32x32 -> "
            f"64x64); enable_bucket with bucket_no_upscale = true trains them at their own size")
    report = check.check_dataset(load_dataset_config(str(toml)))
    assert report.problems() == [] and report.subsets[0].upscaled == line
    assert check_dataset.main([str(toml)]) == 0
    out = capsys.readouterr().out
    assert out.count("images are upscaled") == 1 and f"  note: {line}\n" in out


def test_an_image_with_alpha_is_decoded_as_often_as_one_without(tmp_path, monkeypatch):
    """The pixel check (load_rgb) and the transparency note each decoded an image with alpha: an RGBA
    or palette-with-transparency PNG was decoded once more than an RGB one (3 times against 2, when the
    size check's EXIF read decoded every PNG); now as often (the note reads the pixel check's decode)."""
    from PIL import ImageFile

    Image.new("RGBA", (32, 32), (9, 9, 9, 0)).save(tmp_path / "cut.png")
    Image.new("P", (32, 32), 0).save(tmp_path / "pal.png", transparency=0)
    Image.new("RGBA", (32, 32), (9, 9, 9, 255)).save(tmp_path / "opaque.png")
    Image.new("RGB", (32, 32), (9, 9, 9)).save(tmp_path / "rgb.png")
    for name in ("cut", "pal", "opaque", "rgb"):
        (tmp_path / f"{name}.txt").write_text("a cut-out")
    decodes = []
    real_load = ImageFile.ImageFile.load
    monkeypatch.setattr(ImageFile.ImageFile, "load",
                        lambda self: (decodes.append(os.path.basename(self.filename)) if self.tile else None, real_load(self))[1])
    bp = parse_dataset_config({"datasets": [{"resolution": 32, "subsets": [{"image_dir": str(tmp_path)}]}]})
    report = check.check_dataset(bp)
    assert [decodes.count(f"{name}.png") for name in ("cut", "pal", "opaque")] == [decodes.count("rgb.png")] * 3
    (files,) = [files for what, files in report.subsets[0].notes.items() if "transparent pixels" in what]
    assert sorted(os.path.basename(f) for f in files) == ["cut.png", "pal.png"]


def test_a_caption_whose_augmented_variants_are_too_long_is_refused_before_caching(tmp_path):
    """caption_variants join the tags with ', ': with caption_separator = ' ' they are longer than the caption as
    written. The check counted only the caption, so Ideogram 4's encoder stopped text caching on a variant (after the
    latents), in a line naming no file; a truncating encoder's warning gave the caption's count, not the variants'."""
    from library.data.image_folders import scan_images

    make_image(tmp_path / "a" / "0.png", 32, 32, (200, 0, 0))
    (tmp_path / "a" / "0.txt").write_text("red square small bright")  # 23 characters; a variant: 26
    bp = parse_dataset_config({"datasets": [{"resolution": 32, "subsets": [{
        "image_dir": str(tmp_path / "a"), "shuffle_caption": True, "caption_separator": " ", "caption_variants": 2}]}]})
    limit = check.TokenLimit("character", 25, len, refuses=True)
    message = (f"{tmp_path / 'a' / '0.txt'}: caption is 26 character tokens in an augmented variant (caption_variants "
               f"join its tags with ', '; as written it is 23); the encoder takes at most 25 and refuses longer ones")
    assert [(p.severity, p.message) for p in check.check_dataset(bp, limit).problems()] == [("error", message)]
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        check.refuse_long_captions(scan_images(bp), limit)
    limit.refuses = False
    assert check.training_warnings(scan_images(bp), [], limit)[0].message == message.replace(
        "takes at most 25 and refuses longer ones", "keeps 25, the rest is cut")


def test_a_file_name_that_is_no_utf8_is_one_line_naming_it_before_caching(tiny_set, tmp_path, capsys):
    """café.png written in Latin-1 (a copy from an older system): training cached every latent, then stopped on
    "'utf-8' codec can't encode character '\\udce9' ..." naming no file; the check said nothing."""
    def latin1(images):
        name = os.fsdecode(bytes(images / "caf") + b"\xe9")
        Image.new("RGB", (40, 32), (200, 40, 40)).save(name + ".png")
        shutil.copy(images / "000.txt", name + ".txt")

    toml = copy_dataset(tiny_set, tmp_path / "data", latin1)
    assert check_dataset.main([toml]) == 1
    assert "b'caf\\xe9.png' (images) is not a UTF-8 file name" in capsys.readouterr().err
    line = one_error_line(capsys, train_lora.main(flux_args(tiny_set, tmp_path / "out", "--dataset_config", toml)))
    assert "b'caf\\xe9.png' (images) is not a UTF-8 file name" in line and "latents:" not in line
    cache = tmp_path / "data" / "images" / "cache"
    assert not os.path.exists(cache) or not os.listdir(cache)
