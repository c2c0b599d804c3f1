"""Bad input data and model files (issue 24, round 2), in tests/test_reliability.py's style: a bad
file is one `error: ...` line naming it and what was expected, exit status 2, found before any
model is loaded or any cache written; odd but usable data (16-bit PNGs, images far from the
buckets' sizes) is read correctly or warned about per image."""

import errno
import io
import os
import shutil
import struct
import zlib

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

import train_lora
from library.data import image_folders
from library.data.dataset import ImageDataset
from library.data.controls import reference_views
from library.data.images import load_image
from library.data.masks import load_mask
from tests.test_dataset import blueprint, make_image
from tests.test_reliability import copy_dataset, files_under, flux_args, one_error_line
from tests.test_train_llm import llm_args

MID_GREY_16 = 0x8080  # 32896 = 128 * 257: mid grey in 16 bits, 128 in 8


# ----------------------------------------------------------------------------------------------
# 16-bit PNGs


def png16(path, pixels: np.ndarray) -> str:
    """A 16-bit PNG of `pixels` (uint16 [H, W] grey or [H, W, 3] RGB), written byte by byte: Pillow
    writes 16-bit grey but not 16-bit RGB."""
    h, w = pixels.shape[:2]
    colour_type = 0 if pixels.ndim == 2 else 2
    rows = pixels.astype(">u2").reshape(h, -1)
    raw = b"".join(b"\x00" + row.tobytes() for row in rows)  # filter 0 per row

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", w, h, 16, colour_type, 0, 0, 0)
    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))
    return str(path)


def test_16_bit_grey_and_rgb_pngs_load_as_mid_grey_8_bit(tmp_path):
    grey = png16(tmp_path / "grey16.png", np.full((32, 32), MID_GREY_16, dtype=np.uint16))
    rgb = png16(tmp_path / "rgb16.png", np.full((32, 32, 3), MID_GREY_16, dtype=np.uint16))
    with Image.open(grey) as img:
        assert img.mode == "I;16"  # what Pillow 13 opens it as; convert("RGB") would clip it to 255
    mid = 128 / 127.5 - 1.0
    for path in (grey, rgb):  # Pillow opens 16-bit RGB as 8-bit RGB (the high byte) itself
        x = load_image(path, (32, 32))
        assert x.shape == (3, 32, 32) and float((x - mid).abs().max()) < 1e-6, (path, float(x.mean()))
        assert np.asarray(reference_views([path])[0].convert("RGB")).tolist() == np.full((32, 32, 3), 128).tolist()
    mask = load_mask(str(tmp_path / "image.png"), grey, (32, 32), flip=False)  # a 16-bit grey mask file
    assert float((mask - 128 / 255).abs().max()) < 1e-6


def test_32_bit_integer_pixels_beyond_16_bits_are_refused_naming_the_file():
    from library.data.images import to_8_bit

    img = Image.fromarray(np.array([[0, 70000]], dtype=np.int32))
    assert img.mode == "I"
    with pytest.raises(ValueError) as e:
        to_8_bit(img, "deep.png")
    assert str(e.value) == "deep.png: pixel values 0..70000 do not fit 16 bits; expected an 8- or 16-bit image"


# ----------------------------------------------------------------------------------------------
# Images far from the buckets' sizes: a warning per image and a count per subset, or skipped


def bad_size_set(folder):
    make_image(folder / "dot.png", 1, 1)  # below min_bucket_reso: would be upscaled 64x
    make_image(folder / "strip.png", 4000, 16)  # 250:1, beyond the widest bucket's 4: cropped to 1.6%
    make_image(folder / "fine.png", 64, 48)
    return dict(resolution=64, enable_bucket=True, min_bucket_reso=32, max_bucket_reso=128, bucket_reso_steps=16,
                class_tokens="x")


def test_images_below_the_smallest_bucket_side_or_beyond_the_bucket_aspect_warn_per_image_and_count(tmp_path):
    keys = bad_size_set(tmp_path / "img")
    with pytest.warns(UserWarning) as caught:
        items = image_folders.scan_images(blueprint(tmp_path / "img", **keys))
    messages = [str(w.message) for w in caught]
    assert f"{tmp_path / 'img' / 'dot.png'}: 1x1 is smaller than min_bucket_reso 32 (it is upscaled)" in messages[0]
    assert (f"{tmp_path / 'img' / 'strip.png'}: 4000x16 is smaller than min_bucket_reso 32 (it is upscaled) and has "
            f"aspect ratio 250.0, beyond the widest bucket, 128x32 = 4.0 (it is cropped)") in messages[1]
    assert messages[2] == (f"{tmp_path / 'img'}: 2 of 3 images are smaller than min_bucket_reso or beyond the widest "
                           f"bucket in aspect ratio; they are trained as they are (skip_bad_size_images = "
                           f"true leaves them out)")
    assert len(messages) == 3 and sorted(os.path.basename(i.image_path) for i in items) == ["dot.png", "fine.png", "strip.png"]

    with pytest.warns(UserWarning) as caught:
        items = image_folders.scan_images(blueprint(tmp_path / "img", skip_bad_size_images=True, **keys))
    assert [os.path.basename(i.image_path) for i in items] == ["fine.png"]
    assert str(caught[-1].message) == (f"{tmp_path / 'img'}: 2 of 3 images are smaller than min_bucket_reso or beyond "
                                       f"the widest bucket in aspect ratio; skipped (skip_bad_size_images)")


def test_the_aspect_limit_is_the_widest_buckets_not_max_over_min_bucket_reso(tmp_path):
    """Resolution 512 with buckets 256..2048: the area keeps the widest bucket at 1024x256 (4:1),
    so an 8:1 image loses half its width; max_bucket_reso / min_bucket_reso says 8."""
    make_image(tmp_path / "img" / "wide.png", 4096, 512)
    keys = dict(resolution=512, enable_bucket=True, min_bucket_reso=256, max_bucket_reso=2048, class_tokens="x")
    with pytest.warns(UserWarning) as caught:
        (item,) = image_folders.scan_images(blueprint(tmp_path / "img", **keys))
    assert item.bucket == (1024, 256)
    assert str(caught[0].message) == (f"{tmp_path / 'img' / 'wide.png'}: 4096x512 has aspect ratio 8.0, beyond the widest "
                                      f"bucket, 1024x256 = 4.0 (it is cropped)")


def test_without_buckets_a_non_square_resolution_judges_each_image_against_its_own_shape(tmp_path):
    """resolution 128x32 without buckets: a 32x128 image is upscaled 4x and keeps 6% of itself; the old check
    compared its short side with min(resolution) and its ratio with 1:1, so neither warned."""
    make_image(tmp_path / "img" / "tall.png", 32, 128)
    make_image(tmp_path / "img" / "wide.png", 128, 32)
    with pytest.warns(UserWarning) as caught:
        image_folders.scan_images(blueprint(tmp_path / "img", resolution=[128, 32], class_tokens="x"))
    messages = [str(w.message) for w in caught]
    assert messages[0] == (f"{tmp_path / 'img' / 'tall.png'}: 32x128 is smaller than resolution 128x32 (it is upscaled) "
                           f"and has aspect ratio 4.0 against resolution 128x32's 4.00 (x16.0), beyond max_bucket_reso / "
                           f"min_bucket_reso = 4.0 (it is cropped)")
    assert len(messages) == 2 and "1 of 2 images" in messages[1]  # the wide one fits


def test_bucket_no_upscale_without_buckets_is_refused(tmp_path):
    """It did nothing there: every image was resized to the resolution (a 300x200 image enlarged 2.56x)."""
    make_image(tmp_path / "img" / "a.png", 64, 64)
    with pytest.raises(ValueError, match="key 'bucket_no_upscale' = true does nothing without enable_bucket = true"):
        blueprint(tmp_path / "img", bucket_no_upscale=True, class_tokens="x")


def test_a_subset_whose_every_image_is_skipped_is_an_error(tmp_path):
    keys = bad_size_set(tmp_path / "img")
    os.remove(tmp_path / "img" / "fine.png")
    with pytest.warns(UserWarning), pytest.raises(ValueError) as e:
        image_folders.scan_images(blueprint(tmp_path / "img", skip_bad_size_images=True, **keys))
    assert str(e.value) == (f"{tmp_path / 'img'}: every image was skipped (skip_bad_size_images): none is at least "
                            f"min_bucket_reso 32 per side within the widest bucket, 128x32 = 4.0")


# ----------------------------------------------------------------------------------------------
# Text that is not UTF-8


def test_caption_file_with_invalid_utf8_is_one_line_naming_the_file_and_offset(tiny_set, tmp_path, capsys):
    cfg = copy_dataset(tiny_set, tmp_path / "data", lambda d: (d / "003.txt").write_bytes(b"a red \xff circle"))
    out = tmp_path / "out"
    capsys.readouterr()
    line = one_error_line(capsys, train_lora.main(flux_args(tiny_set, out, "--dataset_config", cfg)))
    assert f"{tmp_path / 'data' / 'images' / '003.txt'}: caption file is not valid UTF-8: byte 0xff at offset 6" in line, line
    assert files_under(out) == []


def test_llm_corpus_with_invalid_utf8_is_one_line_naming_the_file_and_offset(tiny_set, tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    good = "a photo of a caf\u00e9. ".encode() * 20  # 400 bytes of valid UTF-8, then a broken 2-byte sequence
    corpus.write_bytes(good + b"\xc3\x28 broken")
    out = tmp_path / "out"
    capsys.readouterr()
    code = train_lora.main(llm_args(tiny_set, out, "--pretrained_model_name_or_path", tiny_set["llm"],
                                    "--train_data", str(corpus), "--max_train_steps", "1"))
    line = one_error_line(capsys, code)
    assert f"{corpus}: text file is not valid UTF-8: byte 0xc3 at offset {len(good)}" in line, line
    assert files_under(out) == []


# ----------------------------------------------------------------------------------------------
# output_name


@pytest.mark.parametrize("name", ["sub/name", "..", "", "a\\b"])
def test_output_name_that_is_not_a_plain_file_name_is_refused_at_validation(tiny_set, tmp_path, capsys, name):
    out = tmp_path / "out"
    capsys.readouterr()
    line = one_error_line(capsys, train_lora.main(flux_args(tiny_set, out, "--output_name", name)))
    assert (f"command line: key 'output_name' must be a plain file name (not empty, no path separator, not '.' or "
            f"'..'), got {name!r}") in line, line
    assert files_under(out) == []


# ----------------------------------------------------------------------------------------------
# Model files of the wrong kind or missing: found from the headers, before any caching


def vae_as_transformer(ts, tmp):
    return ["--pretrained_model_name_or_path", ts["flux_vae_single"]], ["ae.safetensors: not a FLUX.1 transformer"]


def flux2_transformer_for_flux(ts, tmp):
    return (["--pretrained_model_name_or_path", ts["flux2_tiny"]],
            ["flux2-tiny.safetensors: key 'double_stream_modulation_img.lin.weight' belongs to a FLUX.2 transformer, "
             "not FLUX.1"])


def krea2_transformer_for_flux(ts, tmp):
    """Old: the loader's line alone (what key is missing), never which model the file is."""
    return (["--pretrained_model_name_or_path", ts["krea2"]],
            ["krea2-tiny.safetensors: not a FLUX.1 transformer (no double_blocks./img_in. or transformer_blocks. "
             "keys); its keys are a krea2 transformer's: set model_type = \"krea2\" or \"krea2_edit\""])


def qwen_image21_transformer_for_flux(ts, tmp):
    return (["--pretrained_model_name_or_path", ts["qwen_image21_comfy"]],
            ["cannot infer the FLUX config, key 'single_blocks.0.norm.query_norm.scale' is missing; its keys are a "
             "qwen_image21 transformer's: set model_type = \"qwen_image21\""])


def clip_l_missing(ts, tmp):
    return (["--clip_l", str(tmp / "clip_l")],
            [f"{tmp / 'clip_l'}: no such file or folder (clip_l: expected a CLIP-L text encoder)"])


def t5_as_clip_l(ts, tmp):
    return (["--clip_l", ts["t5xxl"]],
            [f"{ts['t5xxl']}: clip_l is not a CLIP-L text encoder: no key ends in 'embeddings.token_embedding.weight'"])


def flux2_vae_as_ae(ts, tmp):
    return (["--ae", ts["flux2_vae"]],
            [f"{ts['flux2_vae']}: ae is not a FLUX.1 VAE (16 latent channels): 'encoder.conv_out.weight' has shape "
             f"(64, 16, 3, 3), expected (32, *, 3, 3)"])


def clip_l_beside_only_t5s_tokenizer(ts, tmp):
    """ComfyUI's one folder of single files with T5's tokenizer alone: CLIP-L's tokenizer was looked for
    only when the encoder loaded, after the latents were cached (minutes at full size)."""
    import shutil

    folder = tmp / "text_encoders"
    folder.mkdir()
    for key in ("clip_l", "t5xxl"):
        shutil.copy(os.path.join(ts[key], "model.safetensors"), folder / f"{key}.safetensors")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(ts["t5xxl"], name), folder / name)
    clip_l = str(folder / "clip_l.safetensors")
    return (["--clip_l", clip_l, "--t5xxl", str(folder / "t5xxl.safetensors")],
            [f"{clip_l}: no CLIP tokenizer found in {[str(folder), str(tmp / 'tokenizer')]}; skipped {folder}: a T5 "
             f"tokenizer; put the CLIP tokenizer's files in one of those folders"])


def wider_text_input(path: str, key: str, out) -> str:
    """The BFL-layout transformer at `path` with `key` (a Linear taking text) twice as wide, no config metadata."""
    from library.io import CheckpointReader

    reader = CheckpointReader(path)
    tensors = {k: reader.get(k) for k in reader.keys()}
    tensors[key] = torch.cat([tensors[key], tensors[key]], dim=1)
    save_file(tensors, str(out))
    return str(out)


def t5_of_another_width(ts, tmp):
    """A T5 of another size (the transformer's txt_in takes 64, the encoder gives 32) cached every latent and
    caption and failed at the first step: a traceback, 'mat1 and mat2 shapes cannot be multiplied'."""
    path = wider_text_input(ts["flux_bfl"], "txt_in.weight", tmp / "flux1-wide.safetensors")
    return (["--pretrained_model_name_or_path", path],
            [f"{ts['t5xxl']}: t5xxl is not a T5 encoder of width 64 (what the transformer's text input takes): "
             f"'shared.weight' has shape (", ", 32), expected (*, 64)"])


MODEL_FILE_CASES = {
    "vae_as_transformer": vae_as_transformer,
    "flux2_transformer_for_flux": flux2_transformer_for_flux,
    "krea2_transformer_for_flux": krea2_transformer_for_flux,
    "qwen_image21_transformer_for_flux": qwen_image21_transformer_for_flux,
    "clip_l_missing": clip_l_missing,
    "t5_as_clip_l": t5_as_clip_l,
    "flux2_vae_as_ae": flux2_vae_as_ae,
    "clip_l_beside_only_t5s_tokenizer": clip_l_beside_only_t5s_tokenizer,
    "t5_of_another_width": t5_of_another_width,
}


@pytest.mark.parametrize("case", list(MODEL_FILE_CASES))
def test_wrong_or_missing_model_file_is_one_line_before_any_caching(tiny_set, tmp_path, capsys, case):
    cfg = copy_dataset(tiny_set, tmp_path / "data")
    extra, fragments = MODEL_FILE_CASES[case](tiny_set, tmp_path)
    out = tmp_path / "out"
    capsys.readouterr()
    line = one_error_line(capsys, train_lora.main(flux_args(tiny_set, out, "--dataset_config", cfg, *extra)))
    for fragment in fragments:
        assert fragment in line, (fragment, line)
    assert files_under(out) == []
    assert not [f for f in files_under(tmp_path / "data" / "images") if f.endswith(".safetensors")]  # no cache written


# ----------------------------------------------------------------------------------------------
# Text files a person wrote: invalid UTF-8, a TOML syntax error, a Windows BOM


def test_prompt_file_with_invalid_utf8_names_the_file_and_offset(tmp_path):
    from library.data.prompts import read_prompt_file

    path = tmp_path / "prompts.txt"
    path.write_bytes(b"a red square\na caf\xe9 --w 64\n")  # Latin-1, not UTF-8
    with pytest.raises(ValueError) as e:
        read_prompt_file(str(path))
    assert str(e.value).startswith(f"{path}: prompt file is not valid UTF-8: byte 0xe9 at offset 18"), str(e.value)


def test_a_prompt_line_splits_at_newlines_alone(tmp_path):
    """A U+2028 (or \x0b, \x0c, \x85) inside a line made two prompts (str.splitlines), the first without
    its --flags; sd-scripts' readlines splits at newlines alone."""
    from library.data.prompts import SamplePrompt, prompt_texts, read_prompt_file

    path = tmp_path / "prompts.txt"
    path.write_text("a cat,\u2028 in a red\x0chat --w 64 --h 64 --d 1\r\na dog --w 32 --h 32\n", encoding="utf-8")
    assert read_prompt_file(str(path)) == [SamplePrompt("a cat,\u2028 in a red\x0chat", 64, 64, seed=1),
                                           SamplePrompt("a dog", 32, 32)]
    assert prompt_texts(str(path)) == ["a cat,\u2028 in a red\x0chat", "a dog"]


def test_sd_scripts_json_and_toml_prompt_files_are_read_as_prompts(tmp_path):
    """The old line read a .json or .toml prompt file line by line: '[' and '{"prompt": ...' were
    rendered as prompts."""
    from library.data.prompts import SamplePrompt, read_prompt_file

    (tmp_path / "p.json").write_text('[{"prompt": "a zxq star", "width": 64, "height": 64, "sample_steps": 4, '
                                     '"seed": 1, "scale": 2.0, "negative_prompt": "blurry"},\n "a red circle --w 64 --h 64"]')
    assert read_prompt_file(str(tmp_path / "p.json"), guidance_is_cfg=True) == [
        SamplePrompt("a zxq star", 64, 64, 4, 1, 2.0, "blurry"), SamplePrompt("a red circle", 64, 64)]
    (tmp_path / "p.toml").write_text('[prompt]\nwidth = 64\nheight = 64\nsample_steps = 4\n[[prompt.subset]]\n'
                                     'prompt = "a zxq star"\nguidance_scale = 3.0\n[[prompt.subset]]\nprompt = "a square"\n'
                                     'seed = 5\nheight = 128\n')
    assert read_prompt_file(str(tmp_path / "p.toml")) == [
        SamplePrompt("a zxq star", 64, 64, 4, None, 3.0), SamplePrompt("a square", 64, 128, 4, 5)]
    # flow_shift: the key sd-scripts writes for a line's --fs, refused as "not read" where --fs was read
    (tmp_path / "fs.json").write_text('[{"prompt": "a cat", "flow_shift": 3.0}]')
    assert read_prompt_file(str(tmp_path / "fs.json"))[0].flow_shift == 3.0


def test_a_prompt_line_reads_sd_scripts_l_scale_and_flags_in_any_case():
    """sd-scripts' --l (its CFG scale) was an unknown flag in a line while a .json's "scale" was read,
    and --W 512 was unknown where sd-scripts reads it as --w."""
    from library.data.prompts import SamplePrompt, parse_prompt_line

    line = parse_prompt_line("a cat --W 512 --H 256 --l 6.5 --S 3 --N blurry", "p.txt:1", guidance_is_cfg=True)
    assert line == SamplePrompt("a cat", 512, 256, 3, None, 6.5, "blurry")


def test_seed_minus_one_is_a_random_seed():
    """The "random" of UIs' seed boxes (sd-scripts' --d reads no sign: no seed, so random): was refused."""
    from library.data.prompts import parse_prompt_line

    assert parse_prompt_line("a cat --d -1", "p.txt:1").seed is None
    assert parse_prompt_line("a cat --d 7", "p.txt:1").seed == 7
    with pytest.raises(ValueError, match="seed -2: expected 0 to 2"):
        parse_prompt_line("a cat --d -2", "p.txt:1")


def test_musubi_tuners_fs_flag_is_a_prompts_flow_shift_and_ideogram4_warns_it_unread(tmp_path):
    """musubi-tuner's prompt files set a flow shift with --fs ("unknown flag '--fs'" until 2026-11-30); a shift that is
    not a number > 0 is one line naming the file and line; Ideogram 4, whose schedule is no shift, warns it unread."""
    from library.data.prompts import read_prompt_file
    from library.models.family import warn_unread_prompt_options
    from library.models.ideogram4.family import Ideogram4Family

    path = tmp_path / "p.txt"
    path.write_text("a cat --fs 2.2 --s 8\na dog\n")
    prompts = read_prompt_file(str(path))
    assert [(p.flow_shift, p.steps) for p in prompts] == [(2.2, 8), (None, 20)]
    for bad in ("0", "-1", "inf", "x"):
        path.write_text(f"a cat --fs {bad}\n")
        with pytest.raises(ValueError, match=rf"^{path}:1: (--fs must be a number > 0|flag '--fs' needs float)"):
            read_prompt_file(str(path))
    # the line (the file alone until 2026-12-01), and in a .json the key written, not the line's flag
    (tmp_path / "p.json").write_text('[{"prompt": "a cat"}, {"prompt": "a dog", "flow_shift": 2.2}]')
    with pytest.warns(UserWarning) as caught:
        warn_unread_prompt_options(Ideogram4Family("unused"), prompts, str(path))
        warn_unread_prompt_options(Ideogram4Family("unused"), read_prompt_file(str(tmp_path / "p.json")),
                                   str(tmp_path / "p.json"))
    why = ("is not read: Ideogram 4 samples on its pipeline's logit-normal schedule at the image's resolution, "
           "not a shifted one")
    assert [str(w.message) for w in caught] == [f"{path}:1: --fs (--flow_shift) {why}",
                                                f"{tmp_path / 'p.json'}: prompt 1: flow_shift {why}"]  # 0-based: NN


@pytest.mark.parametrize("kind", ["txt", "json"])
def test_sd_scripts_l_is_a_cfg_models_guidance_and_unread_without_cfg(tmp_path, kind):
    """sd-scripts' --l is its CFG scale, --g FLUX.1's embedded guidance; its docs give Chroma '--l 4.0 --g 0.0'.
    Old: --l was only a fallback for --g, dropped silently beside it (Chroma sampled at 0: no CFG) and read as
    FLUX.1 dev's embedded guidance without one. Now a CFG model's --l wins, a model without CFG reads none; the
    number left unread is one warning line naming the file and line (a .json's 'scale' / 'guidance_scale' alike)."""
    from library.data.prompts import read_prompt_file

    path = tmp_path / f"p.{kind}"
    if kind == "txt":
        path.write_text("a cat --l 4 --g 0\na dog --l 4\n")
        g, l, where = "--g", "--l", [f"{path}:1", f"{path}:2"]
    else:
        path.write_text('[{"prompt": "a cat", "scale": 4, "guidance_scale": 0}, {"prompt": "a dog", "scale": 4}]')
        g, l, where = "key 'guidance_scale'", "key 'scale'", [f"{path}: prompt 0", f"{path}: prompt 1"]
    with pytest.warns(UserWarning) as caught:
        assert [p.guidance for p in read_prompt_file(str(path), guidance_is_cfg=True)] == [4.0, 4.0]
    assert [str(w.message) for w in caught] == [
        f"{where[0]}: {g} is not read: {l} is given and sets this model's guidance, a CFG scale"]
    with pytest.warns(UserWarning) as caught:
        assert [p.guidance for p in read_prompt_file(str(path), guidance_is_cfg=False)] == [0.0, 3.5]
    assert [str(w.message) for w in caught] == [
        f"{w}: {l} is not read: it is sd-scripts' CFG scale, and this model samples without CFG" for w in where]


def test_prompt_sizes_round_down_to_16_with_a_warning_as_generate_does(tmp_path):
    """sd-scripts renders --w 1000 at 992; a prompt file refused it, while generate.py rounded --width."""
    from library.data.prompts import read_prompt_file

    (tmp_path / "p.txt").write_text("a cat --w 1000 --h 64\n")
    (tmp_path / "p.json").write_text('[{"prompt": "a cat", "height": 70}]')
    with pytest.warns(UserWarning, match="p.txt:1: width 1000 is not a multiple of 16: rendering 992"):
        (cat,) = read_prompt_file(str(tmp_path / "p.txt"))
    assert (cat.width, cat.height) == (992, 64)
    with pytest.warns(UserWarning, match="p.json: prompt 0: height 70 is not a multiple of 16: rendering 64"):
        assert read_prompt_file(str(tmp_path / "p.json"))[0].height == 64


@pytest.mark.parametrize("name, content, fragment", [
    ("p.json", '[{"prompt": "x", "sample_sampler": "euler"}]', "p.json: prompt 0: key 'sample_sampler' is not read"),
    ("p.json", '[{"prompt": "x",', "p.json: not valid JSON"),
    ("p.json", '{"prompt": "x"}', "p.json: expected a list of prompts"),
    ("p.json", '[{"prompt": "x", "width": 8}]', "p.json: prompt 0: width 8: expected at least 16 pixels"),
    ("p.json", '[{"prompt": "x", "seed": "a"}]', "p.json: prompt 0: key 'seed' needs int, got 'a'"),
    ("p.json", '[{"width": 64}]', "p.json: prompt 0: empty prompt"),
    # these three rendered NaN images or were a traceback until 2026-11-27
    ("p.json", '[{"prompt": "x", "width": NaN}]', "p.json: prompt 0: key 'width' needs int, got nan"),
    ("p.json", '[{"prompt": "x", "guidance_scale": Infinity}]', "p.json: prompt 0: key 'guidance_scale' needs float, got inf"),
    ("p.json", '[{"prompt": "x", "controlnet_image": 5}]',
     "p.json: prompt 0: key 'controlnet_image' needs a path or a list of paths, got 5"),
    # these were taken silently until 2026-11-28: scale ignored or read as 1.0, a list negative encoded as
    # its Python text, a number prompt called empty
    ("p.json", '[{"prompt": "x", "scale": "7"}]', "p.json: prompt 0: key 'scale' needs float, got '7'"),
    ("p.json", '[{"prompt": "x", "scale": [7]}]', "p.json: prompt 0: key 'scale' needs float, got [7]"),
    ("p.json", '[{"prompt": "x", "scale": true}]', "p.json: prompt 0: key 'scale' needs float, got True"),
    ("p.json", '[{"prompt": "x", "negative_prompt": ["a", "b"]}]',
     "p.json: prompt 0: key 'negative_prompt' needs str, got ['a', 'b']"),
    ("p.json", '[{"prompt": 5}]', "p.json: prompt 0: key 'prompt' needs str, got 5"),
    ("p.txt", 'a cat --g nan\n', "p.txt:1: guidance must be a finite number, got nan"),
    ("p.toml", 'prompt = "x"\n', "p.toml: expected a [prompt] table with [[prompt.subset]] entries"),
])
def test_a_bad_structured_prompt_file_is_one_line_naming_file_and_entry(tmp_path, name, content, fragment):
    from library.data.prompts import read_prompt_file

    (tmp_path / name).write_text(content)
    with pytest.raises(ValueError) as e:
        read_prompt_file(str(tmp_path / name))
    assert fragment in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("content, fragment", [
    (b"learning_rate = 1e-4\n# caf\xe9\n", "config file is not valid UTF-8: byte 0xe9 at offset 26"),
    (b"learning_rate = = 1e-4\n", "not valid TOML"),
    (b"optimizer_args = {d0 = 1", "not valid TOML: cannot be read (IndexError"),  # toml's IndexError: a traceback
])
def test_config_toml_with_invalid_utf8_or_bad_syntax_is_one_line_naming_the_file(tmp_path, capsys, content, fragment):
    path = tmp_path / "my.toml"
    path.write_bytes(content)
    capsys.readouterr()
    line = one_error_line(capsys, train_lora.main(["--config_file", str(path), "--output_dir", str(tmp_path / "out")]))
    assert line.startswith(f"error: {path}: ") and fragment in line, line
    assert files_under(tmp_path / "out") == []


@pytest.mark.parametrize("content, fragment", [
    (b"[[datasets]]\n# caf\xe9\n", "dataset config is not valid UTF-8: byte 0xe9 at offset 18"),
    (b"[[datasets]\n", "not valid TOML"),
])
def test_dataset_toml_with_invalid_utf8_or_bad_syntax_names_the_file(tmp_path, content, fragment):
    from library.data.dataset_config import load_dataset_config

    path = tmp_path / "dataset.toml"
    path.write_bytes(content)
    with pytest.raises(ValueError) as e:
        load_dataset_config(str(path))
    assert str(e.value).startswith(f"{path}: ") and fragment in str(e.value), str(e.value)


def test_caption_and_prompt_files_saved_with_a_utf8_bom_read_without_it(tmp_path):
    from library.data.prompts import read_prompt_file

    make_image(tmp_path / "img" / "a.png", 64, 64)
    (tmp_path / "img" / "a.txt").write_bytes(b"\xef\xbb\xbfa red square\r\n")  # as Windows Notepad saves it
    assert ImageDataset(blueprint(tmp_path / "img")).items[0].caption == "a red square"
    (tmp_path / "prompts.txt").write_bytes(b"\xef\xbb\xbfa red square --w 64\r\n")
    assert read_prompt_file(str(tmp_path / "prompts.txt"))[0].prompt == "a red square"


# ----------------------------------------------------------------------------------------------
# --device cuda without CUDA: one line before any file is read (tools/generate.py in test_generate.py)


DEVICE_TOOLS = {  # tool -> its arguments besides --device (files that need not exist: the device is checked first)
    "precision_doctor": ["--model_type", "flux", "--model", "missing.safetensors"],
    "caption_images": ["--model", "missing", "--images", "."],
    "combine_loras": ["--lora", "a.safetensors", "b.safetensors", "--save_to", "c.safetensors"],
    "extract_lora": ["--model", "missing.safetensors", "--tuned", "tuned.safetensors", "--save_to", "c.safetensors",
                     "--rank", "4"],
    "resize_lora": ["--lora", "a.safetensors", "--save_to", "c.safetensors", "--new_rank", "4"],
}


@pytest.mark.parametrize("tool", list(DEVICE_TOOLS))
def test_tool_device_cuda_without_cuda_is_one_line_before_any_file_is_read(tool, tmp_path, capsys, monkeypatch):
    import importlib

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same answer with or without a GPU
    monkeypatch.chdir(tmp_path)
    main = importlib.import_module(f"tools.{tool}").main
    capsys.readouterr()
    line = one_error_line(capsys, main([*DEVICE_TOOLS[tool], "--device", "cuda"]))
    assert "--device cuda: CUDA is not available on this machine" in line, line
    line = one_error_line(capsys, main([*DEVICE_TOOLS[tool], "--device", "gpu0"]))
    assert "--device 'gpu0': not a device name" in line, line
    assert os.listdir(tmp_path) == []


# ----------------------------------------------------------------------------------------------
# A full disk while appending to a CSV log


class FullDiskFile(io.StringIO):
    def write(self, text):
        raise OSError(errno.ENOSPC, "No space left on device")


def full_disk_at(monkeypatch, path) -> None:
    """Every open() of `path` gives a file whose writes fail as on a full disk."""
    real_open = open
    monkeypatch.setattr("builtins.open", lambda f, *a, **k: FullDiskFile() if str(f) == str(path) else real_open(f, *a, **k))


def test_full_disk_while_logging_names_the_csv_file(tmp_path, monkeypatch):
    import torch

    from library.training import optim

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    logger = optim.LRLogger(str(tmp_path / "run_log.csv"))
    logger.log(1, 0, 0.5, optimizer)
    full_disk_at(monkeypatch, tmp_path / "run_log.csv")
    with pytest.raises(OSError) as e:
        logger.log(2, 0, 0.4, optimizer)
    assert str(e.value).startswith(f"{tmp_path / 'run_log.csv'}: cannot be written, no space left on device"), str(e.value)


def test_full_disk_while_writing_the_llm_eval_log_names_the_file(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from library.training import llm_task

    accelerator = SimpleNamespace(is_main_process=True, trackers=[], print=lambda *a: None)
    task = SimpleNamespace(accelerator=accelerator, eval_log=str(tmp_path / "eval_log.csv"),
                           evaluate=lambda: {"val_loss": 1.0, "val_perplexity": 2.7, "sample": "a"})
    full_disk_at(monkeypatch, tmp_path / "eval_log.csv")
    with pytest.raises(OSError) as e:
        llm_task.LLMTask.report_eval(task, 1)
    assert str(e.value).startswith(f"{tmp_path / 'eval_log.csv'}: cannot be written, no space left on device"), str(e.value)


def test_prompts_without_a_size_sample_at_the_resolution_on_the_16_pixel_grid(tmp_path):
    """With buckets a dataset's resolution may lie off the 16-pixel grid; a prompt line without --w / --h
    took it as it was, and the first sample failed (after the caching, or after the training with
    sample_at_first off): 'pack_latents: latent height and width must be even, got 9x9' for 72."""
    from types import SimpleNamespace

    from library.data.dataset_config import parse_dataset_config
    from library.training.diffusion_task import DiffusionTask

    (tmp_path / "p.txt").write_text("a red circle\nwide --w 96\n")
    bp = parse_dataset_config({"datasets": [{"resolution": [72, 1000], "enable_bucket": True, "min_bucket_reso": 64,
                                             "max_bucket_reso": 1024, "bucket_reso_steps": 16,
                                             "subsets": [{"image_dir": str(tmp_path)}]}]})
    task = SimpleNamespace(args=SimpleNamespace(sample_prompts=str(tmp_path / "p.txt")), blueprint=bp,
                           family=SimpleNamespace(sample_steps=4, sample_guidance=1.0, name="any", max_controls=0, true_cfg=True,
                                                  min_controls=0, unread_prompt_options=lambda *options: {},
                                                  guidance_is_cfg_scale=lambda: True, reference_vl_size=lambda w, h: None))
    prompts = DiffusionTask._read_prompts(task, None)
    assert [(p.width, p.height) for p in prompts] == [(64, 992), (96, 992)]  # was (72, 1000), (96, 1000)


@pytest.mark.parametrize("model_type,key,value,why", [
    ("qwen_image", "guidance_scale", "7", "model_type qwen_image has no guidance embedding"),
    ("zimage", "guidance_scale", "3.5", "model_type zimage has no guidance embedding"),
    ("ideogram4", "sigmoid_scale", "3", "draws sigma = expit(mu + 1.5 n), its pipeline's law")])
def test_a_training_key_the_model_never_reads_is_refused_before_caching(tiny_set, tmp_path, capsys, model_type, key,
                                                                        value, why):
    """Old: guidance_scale on a model without a guidance embedding, and sigmoid_scale on Ideogram 4's own
    sigma law, trained bit-identically to their defaults, and the LoRA's header recorded the value."""
    from tools.make_tiny_models import tiny_config

    cfg = copy_dataset(tiny_set, tmp_path / "data")
    config = tmp_path / "config.toml"
    config.write_text(tiny_config(model_type, tiny_set, dataset_config=cfg))
    out = tmp_path / "out"
    capsys.readouterr()
    code = train_lora.main(["--config_file", str(config), "--output_dir", str(out), "--max_train_steps", "1",
                            "--mixed_precision", "no", f"--{key}", value])
    line = one_error_line(capsys, code)
    assert f"key '{key}' = {float(value)} does nothing: " in line and why in line, line
    assert not [f for f in files_under(tmp_path / "data" / "images") if f.endswith(".safetensors")]  # no cache written


def test_a_guidance_distilled_model_reads_guidance_scale(tiny_set, tmp_path):
    """FLUX.1 dev's guidance embedding takes it in training: not refused (schnell's checkpoint has none)."""
    from library.models.family import get_family
    from library.training.config import load_config
    from tools.make_tiny_models import tiny_config

    config = tmp_path / "config.toml"
    config.write_text(tiny_config("flux", tiny_set, guidance_scale=3.5, output_dir=str(tmp_path)))
    args = load_config(["--config_file", str(config)])
    family = get_family(args)
    assert family.has_guidance_embedding() and family.unread_training_keys(args) == {}


def test_sd_scripts_guidance_scale_0_for_a_model_without_guidance_is_taken(tiny_set, tmp_path):
    """sd-scripts' Chroma docs ask for guidance_scale = 0.0 ("to disable guidance"): a ported config runs."""
    from library.models.family import get_family
    from library.training.config import load_config
    from library.training.diffusion_checks import check_unread_keys
    from tools.make_tiny_models import tiny_config

    config = tmp_path / "config.toml"
    config.write_text(tiny_config("chroma", tiny_set, guidance_scale=0.0, output_dir=str(tmp_path)))
    args = load_config(["--config_file", str(config)])
    check_unread_keys(args, get_family(args))
    args.guidance_scale = 2.0
    with pytest.raises(ValueError, match="key 'guidance_scale' = 2.0 does nothing"):
        check_unread_keys(args, get_family(args))



@pytest.mark.parametrize("written", ['{"depth": 2', '{"no_such_field": 1}'])
def test_a_broken_config_in_a_checkpoints_header_is_one_line_naming_the_file_and_key(tiny_set, tmp_path, capsys,
                                                                                     written):
    """A BFL file whose flux_config (save_with_config's) is not JSON printed json's bare "error: Expecting ','
    delimiter: line 1 column 12 (char 11)", naming neither the file nor the key; one with a field FluxConfig lacks,
    a TypeError traceback. Now one line naming both, exit 2, before caching."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(tiny_set["flux_bfl"], framework="pt") as f:
        metadata = {**(f.metadata() or {}), "flux_config": written}
    path = str(tmp_path / "flux1-broken.safetensors")
    save_file(load_file(tiny_set["flux_bfl"]), path, metadata=metadata)
    argv = flux_args(tiny_set, tmp_path / "out", "--pretrained_model_name_or_path", path)
    line = one_error_line(capsys, train_lora.main(argv))
    assert line.startswith(f"error: {path}: metadata 'flux_config' is not the model's config as this trainer "
                           f"writes it ("), line
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


@pytest.mark.parametrize("damage", ["missing", "integers"])
@pytest.mark.parametrize("base", ["flux", "qwen_image"])
def test_a_base_missing_a_tensor_is_refused_before_caching(tiny_set, tmp_path, capsys, monkeypatch, base, damage):
    """A single file without one of the model's tensors (or with another shape) loaded its header, cached every
    latent and caption, and only then failed in the load ("missing keys: ..."): the header is checked against the
    model on meta before caching now. A weight stored as integers (a merge tool's int32) likewise, which the load
    met as torch's traceback "Only Tensors of floating point and complex dtype can require gradients"."""
    from safetensors.torch import load_file

    from library.training import diffusion_task
    from tests.test_captions import qwen_args

    if base == "flux":  # a BFL single file
        source, path = tiny_set["flux_bfl"], str(tmp_path / "flux-missing.safetensors")
    else:  # a diffusers transformer folder (its config.json beside)
        path = str(tmp_path / "transformer")
        shutil.copytree(tiny_set["qwen_image"], path)
        source = next(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors"))
    tensors = load_file(source)
    dropped = next(k for k in sorted(tensors) if k.endswith(("attn.to_out.0.weight", "img_attn.proj.weight")))
    if damage == "missing":
        del tensors[dropped]
    else:
        tensors[dropped] = (tensors[dropped].float() * 100).to(torch.int32)
    save_file(tensors, path if base == "flux" else source)
    for name in ("cache_latents", "cache_text"):
        monkeypatch.setattr(diffusion_task, name, lambda *a, **k: pytest.fail("cached before the refusal"))
    args = (flux_args(tiny_set, tmp_path / "out", "--pretrained_model_name_or_path", path) if base == "flux" else
            qwen_args(tiny_set, tmp_path / "out", "--pretrained_model_name_or_path", path, "--dataset_config",
                      tiny_set["dataset_config"], "--max_train_steps", "1"))
    line = one_error_line(capsys, train_lora.main(args))
    if damage == "missing":
        assert line.startswith(f"error: {path}: missing keys: ") and dropped.split("diffusion_model.")[-1] in line, line
    else:
        named = path if base == "flux" else f"{path}: {os.path.basename(source)}"
        key = dropped.split("diffusion_model.")[-1]
        assert line == f"error: {named}: key '{key}' holds I32 integers, expected floating-point weights", line


def test_a_weight_stored_as_integers_is_named_by_the_streaming_load(tmp_path):
    """Files read without a header check (a VAE, a text encoder) meet the same line in the load itself."""
    from library.io import CheckpointError, CheckpointReader, load_streaming

    path = str(tmp_path / "linear.safetensors")
    save_file({"weight": torch.ones(2, 3, dtype=torch.int64), "bias": torch.zeros(2)}, path)
    with torch.device("meta"):
        model = torch.nn.Linear(3, 2)
    with pytest.raises(CheckpointError, match=r"linear.safetensors: key 'weight' holds torch.int64 integers, the model "
                                              r"expects floating-point weights for 'weight'"):
        load_streaming(model, CheckpointReader(path), lambda key: key)


@pytest.mark.parametrize("damage", ["config", "vocabulary"])
def test_a_broken_text_encoder_folder_is_one_line_before_caching(tiny_set, tmp_path, capsys, monkeypatch, damage):
    """A CLIP folder whose config.json is not JSON, or whose tokenizer has its tokenizer_config.json but no
    tokenizer.json, cached every latent and then printed json's bare "Expecting value: line 1 column 1 (char 0)"
    or transformers' 5 lines on sentencepiece. Now one line naming the file or folder, before caching."""
    from library.training import diffusion_task

    clip = tmp_path / "clip_l"
    shutil.copytree(tiny_set["clip_l"], clip)
    if damage == "config":
        (clip / "config.json").write_text("{'hidden_size': 32}")
        expected = f"error: {clip / 'config.json'}: not valid JSON (Expecting property name enclosed in double quotes"
    else:
        (clip / "tokenizer.json").unlink()
        expected = f"error: {clip}: tokenizer_config.json but no vocabulary (tokenizer.json, "
    for name in ("cache_latents", "cache_text"):
        monkeypatch.setattr(diffusion_task, name, lambda *a, **k: pytest.fail("cached before the refusal"))
    line = one_error_line(capsys, train_lora.main(flux_args(tiny_set, tmp_path / "out", "--clip_l", str(clip))))
    assert line.startswith(expected), line
