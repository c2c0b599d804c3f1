"""tools/caption_images.py on tiny random VLMs (the captions are gibberish; the files, counts, skips,
resumes and the model's inputs are what is checked): Qwen2.5-VL as the Qwen-Image-Edit text encoder
of the tiny set (model and processor folders apart), Qwen3-VL in one folder with its chat template."""

import os
import signal

import numpy as np
import pytest
import torch
from PIL import Image

from library.io import umask_mode
from tests.test_reliability import files_under, one_error_line
from tools import caption_images
from tools.caption_images import PRESETS, load_captioner
from tools.make_tiny_models import write_qwen3_vl


@pytest.fixture(scope="module")
def qwen3_vl(tmp_path_factory):
    return write_qwen3_vl(str(tmp_path_factory.mktemp("captioner")), 0)["qwen3_vl"]


def qwen2_5_vl_args(tiny_set) -> list[str]:
    return ["--model", tiny_set["qwen_image_edit_text_encoder"], "--processor", tiny_set["qwen_image_edit_processor"]]


def make_images(folder, count: int, first: int = 0) -> list[str]:
    """`count` small random RGB images of different sizes, every second one in a subfolder."""
    paths = []
    for i in range(first, first + count):
        path = folder / ("sub" if i % 2 else "") / f"img{i}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        pixels = np.random.RandomState(i).randint(0, 256, (40 + 8 * i, 64, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(path)
        paths.append(str(path))
    return paths


def captions(folder) -> dict[str, str]:
    return {os.path.relpath(os.path.join(d, f), folder): open(os.path.join(d, f), encoding="utf-8").read()
            for d, _, fs in os.walk(folder) for f in fs if f.endswith(".txt")}


def run(tiny_set, folder, *extra) -> int:
    return caption_images.main([*qwen2_5_vl_args(tiny_set), "--images", str(folder), "--max_new_tokens", "4",
                                "--batch_size", "2", *extra])


def test_captions_every_image_once_and_keeps_existing_ones(tiny_set, tmp_path):
    make_images(tmp_path, 3)
    assert run(tiny_set, tmp_path, "--prefix", "ohwx caf\u00e9") == 0
    first = captions(tmp_path)
    assert sorted(first) == ["img0.txt", "img2.txt", "sub/img1.txt"]
    assert all(c.startswith("ohwx caf\u00e9, ") and c.endswith("\n") and c.count("\n") == 1 for c in first.values())
    assert all(os.stat(tmp_path / f).st_mode & 0o777 == umask_mode(0o666) for f in first)
    assert not [f for f in files_under(tmp_path) if f.endswith(".tmp")]

    (tmp_path / "img0.txt").write_text("my own caption\n")
    make_images(tmp_path, 1, first=3)  # a new image: the only one the second run captions
    stamps = {f: os.stat(tmp_path / f).st_mtime_ns for f in first}
    assert run(tiny_set, tmp_path, "--prefix", "ohwx caf\u00e9") == 0
    second = captions(tmp_path)
    assert sorted(second) == ["img0.txt", "img2.txt", "sub/img1.txt", "sub/img3.txt"]
    assert second["img0.txt"] == "my own caption\n" and {f: os.stat(tmp_path / f).st_mtime_ns for f in first} == stamps

    assert run(tiny_set, tmp_path, "--overwrite") == 0
    third = captions(tmp_path)
    assert third["img0.txt"] != "my own caption\n" and not third["img0.txt"].startswith("ohwx")  # no --prefix this time
    assert all(os.stat(tmp_path / f).st_mtime_ns != t for f, t in stamps.items())


def test_an_interrupted_run_leaves_whole_captions_and_the_next_run_captions_the_rest(tiny_set, tmp_path, monkeypatch,
                                                                                      capsys):
    make_images(tmp_path, 5)
    written, write = [], caption_images.write_text

    def killed_after_two(path, text):  # a second Ctrl-C while the third caption is being written
        if len(written) == 2:
            raise KeyboardInterrupt
        write(path, text)
        written.append(path)

    monkeypatch.setattr(caption_images, "write_text", killed_after_two)
    assert run(tiny_set, tmp_path) == 130
    assert "run the same command again" in capsys.readouterr().err
    assert len(captions(tmp_path)) == 2 and not [f for f in files_under(tmp_path) if f.endswith(".tmp")]
    kept = {f: os.stat(tmp_path / f).st_mtime_ns for f in captions(tmp_path)}

    monkeypatch.setattr(caption_images, "write_text", write)
    assert run(tiny_set, tmp_path) == 0
    assert "5 images, 2 already captioned, 3 to caption" in capsys.readouterr().out
    assert len(captions(tmp_path)) == 5 and all(os.stat(tmp_path / f).st_mtime_ns == t for f, t in kept.items())


def test_ctrl_c_finishes_the_batch_in_progress_and_stops(tiny_set, tmp_path, monkeypatch, capsys):
    make_images(tmp_path, 5)
    caption = caption_images.Captioner.caption

    def ctrl_c_during_the_first_batch(self, images, prompt):
        os.kill(os.getpid(), signal.SIGINT)  # train_lora's Interrupts (installed by main) only sets a flag
        return caption(self, images, prompt)

    monkeypatch.setattr(caption_images.Captioner, "caption", ctrl_c_during_the_first_batch)
    assert run(tiny_set, tmp_path) == 130
    assert "SIGINT: stopped with 3 images left" in capsys.readouterr().err
    assert sorted(captions(tmp_path)) == ["img0.txt", "img2.txt"]  # the first batch (paths sorted), whole


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen3_vl"])
def test_the_prompt_and_each_image_reach_the_model(tiny_set, qwen3_vl, kind, tmp_path):
    paths = make_images(tmp_path, 2)
    model, processor = ((tiny_set["qwen_image_edit_text_encoder"], tiny_set["qwen_image_edit_processor"])
                        if kind == "qwen2_5_vl" else (qwen3_vl, None))
    captioner = load_captioner(model, processor, torch.float32, None, torch.device("cpu"), 4)
    calls, generate = [], captioner.model.generate

    def recording(**inputs):
        calls.append(inputs)
        return generate(**inputs)

    captioner.model.generate = recording
    caption_images.caption_images(captioner, paths, PRESETS["tags"], "", ".caption", batch_size=2)
    (inputs,) = calls
    ids, tokenizer = inputs["input_ids"], captioner.tokenizer
    preset = tokenizer(PRESETS["tags"], add_special_tokens=False)["input_ids"]
    for row in ids.tolist():  # the preset's tokens, in order, in each row
        assert any(row[i : i + len(preset)] == preset for i in range(len(row))), tokenizer.decode(row)
    grid = inputs["image_grid_thw"]
    image_tokens = (ids == tokenizer.convert_tokens_to_ids("<|image_pad|>")).sum(1)
    assert image_tokens.tolist() == (grid.prod(-1) // 4).tolist() == inputs["mm_token_type_ids"].sum(1).tolist()
    first, second = inputs["pixel_values"].split(grid.prod(-1).tolist())
    assert first.shape != second.shape or not torch.equal(first, second)  # each image its own pixels
    assert inputs["max_new_tokens"] == 4 and (inputs["attention_mask"][:, -1] == 1).all()  # padded on the left
    assert sorted(f for f in files_under(tmp_path) if not f.endswith(".png")) == ["img0.caption", "sub/img1.caption"]


@pytest.mark.parametrize("mode", ["fp8_scaled", "nf4"])
def test_quantized_language_model_captions(tmp_path, mode):
    """fp8: our FP8Linear in the language model; nf4: bitsandbytes' 4-bit Linears (its CPU kernels need
    inputs of a multiple of 64: a Qwen3-VL of width 64). The vision tower and lm_head keep their dtype."""
    folder = write_qwen3_vl(str(tmp_path / "model"), 0, width=64)["qwen3_vl"]
    captioner = load_captioner(folder, None, torch.float32, mode, torch.device("cpu"), 4)
    layer = type(captioner.model.model.language_model.layers[0].mlp.down_proj).__name__
    assert layer == {"fp8_scaled": "FP8Linear", "nf4": "Linear4bit"}[mode]
    assert type(captioner.model.lm_head).__name__ == "Linear"
    assert type(captioner.model.model.visual.blocks[0].mlp.linear_fc1).__name__ == "Linear"
    paths = make_images(tmp_path / "images", 2)
    counts = caption_images.caption_images(captioner, paths, PRESETS["sentence"], "x", ".txt", batch_size=2)
    assert counts == {"written": 2, "empty": 0, "left": 0}


def not_a_model(tiny_set, tmp_path):
    return ["--model", str(tmp_path), "--images", str(tmp_path / "images")], [f"{tmp_path}: no config.json"]


def missing_model(tiny_set, tmp_path):  # a Hub name where a downloaded folder belongs: the old line said "no config.json"
    return (["--model", "Qwen2.5-VL-7B-Instruct", "--images", str(tmp_path / "images")],
            ["Qwen2.5-VL-7B-Instruct: no such folder; --model is a downloaded"])


def corrupt_image(tiny_set, tmp_path):
    (tmp_path / "images" / "img1.png").write_bytes(b"\x89PNG\r\n\x1a\nnot an image")
    return [*qwen2_5_vl_args(tiny_set), "--images", str(tmp_path / "images")], ["img1.png: cannot be read as an image"]


def truncated_image(tiny_set, tmp_path):  # its header verifies: the old line loaded the model, then a traceback
    from tests.test_check_dataset import truncated_jpeg

    path = truncated_jpeg(tmp_path / "images" / "cut.jpg")
    return [*qwen2_5_vl_args(tiny_set), "--images", str(tmp_path / "images")], [f"{path}: cannot be decoded as an image"]


def no_images(tiny_set, tmp_path):
    (tmp_path / "empty").mkdir()
    return [*qwen2_5_vl_args(tiny_set), "--images", str(tmp_path / "empty")], [f"{tmp_path / 'empty'}: no images"]


def not_a_captioner(tiny_set, tmp_path):
    return (["--model", tiny_set["llm"], "--images", str(tmp_path / "images")],
            ["config.json: model_type 'qwen2' is not a supported captioner"])


def no_new_tokens(tiny_set, tmp_path):
    return ([*qwen2_5_vl_args(tiny_set), "--images", str(tmp_path / "images"), "--max_new_tokens", "0"],
            ["--max_new_tokens and --batch_size must be >= 1, got 0, 1"])


def image_caption_extension(tiny_set, tmp_path):  # the old line wrote each caption over its image (exit 0)
    return ([*qwen2_5_vl_args(tiny_set), "--images", str(tmp_path / "images"), "--caption_extension", ".PNG",
             "--overwrite"], ["--caption_extension .PNG: an image extension; captions would replace the images"])


def images_is_a_file(tiny_set, tmp_path):  # the old line said 'no such folder' of a file that is there
    return ([*qwen2_5_vl_args(tiny_set), "--images", str(tmp_path / "images" / "img0.png")],
            [f"--images {tmp_path / 'images' / 'img0.png'}: is a file, expected a folder of images"])


def two_images_one_caption(tiny_set, tmp_path):  # the old line captioned both, the second into the first's img0.txt
    Image.open(tmp_path / "images" / "img0.png").save(tmp_path / "images" / "img0.jpg")
    return ([*qwen2_5_vl_args(tiny_set), "--images", str(tmp_path / "images")],
            [f"{tmp_path / 'images' / 'img0.jpg'} and img0.png: both would be captioned in "
             f"{tmp_path / 'images' / 'img0.txt'}"])


def a_folder_where_a_caption_goes(tiny_set, tmp_path):  # the old line loaded the model, then failed at the write
    (tmp_path / "images" / "img0.txt").mkdir()
    return ([*qwen2_5_vl_args(tiny_set), "--images", str(tmp_path / "images")],
            [f"{tmp_path / 'images' / 'img0.txt'}: a folder where the caption of img0.png goes"])


def aspect_ratio_over_200(tiny_set, tmp_path):  # the old line captioned the others, then the processor's traceback
    strip = tmp_path / "images" / "zz_strip.png"
    Image.fromarray(np.zeros((10, 2001, 3), dtype=np.uint8)).save(strip)
    return ([*qwen2_5_vl_args(tiny_set), "--images", str(tmp_path / "images")],
            [f"{strip}: 2001 x 10 pixels, an aspect ratio of 200.1; the Qwen-VL image processor takes at most 200"])


def prompt_and_preset(tiny_set, tmp_path):  # the old line dropped --preset without a word
    return ([*qwen2_5_vl_args(tiny_set), "--images", str(tmp_path / "images"), "--prompt", "Describe it.", "--preset", "tags"],
            ["--prompt and --preset tags: give one"])


@pytest.mark.parametrize("case", [not_a_model, missing_model, corrupt_image, truncated_image, no_images, not_a_captioner, no_new_tokens,
                                  image_caption_extension, images_is_a_file, two_images_one_caption,
                                  a_folder_where_a_caption_goes, aspect_ratio_over_200, prompt_and_preset])
def test_bad_input_is_one_line_exit_2_and_no_caption(tiny_set, tmp_path, capsys, case):
    make_images(tmp_path / "images", 2)
    argv, fragments = case(tiny_set, tmp_path)
    capsys.readouterr()
    images = {p: p.read_bytes() for p in (tmp_path / "images").rglob("*.png")}
    line = one_error_line(capsys, caption_images.main(argv))
    assert all(f in line for f in fragments), line
    assert captions(tmp_path) == {} and {p: p.read_bytes() for p in (tmp_path / "images").rglob("*.png")} == images


def test_the_aspect_ratio_limit_is_the_processors(tiny_set):
    """MAX_ASPECT_RATIO is where the Qwen-VL processor stops: 200 passes, just over it is its error."""
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(tiny_set["qwen_image_edit_processor"], local_files_only=True)
    processor(images=[Image.new("RGB", (2000, 10))], return_tensors="pt")
    caption_images.check_aspect_ratio("ok.png", (2000, 10))
    with pytest.raises(ValueError, match="aspect ratio must be smaller than 200"):
        processor(images=[Image.new("RGB", (10, 2001))], return_tensors="pt")
    with pytest.raises(ValueError, match="long.png: 10 x 2001 pixels"):
        caption_images.check_aspect_ratio("long.png", (10, 2001))


def test_hidden_folders_are_not_captioned(tmp_path, monkeypatch, capsys):
    """Training never reads .ipynb_checkpoints/ or .Trash-1000/: the old line captioned the images there,
    and a truncated file in the trash stopped the whole run."""
    class Echo:
        def caption(self, images, prompt):
            return ["an image"] * len(images)

    monkeypatch.setattr(caption_images, "load_captioner", lambda *args: Echo())
    make_images(tmp_path, 1)
    (tmp_path / ".ipynb_checkpoints").mkdir()
    Image.open(tmp_path / "img0.png").save(tmp_path / ".ipynb_checkpoints" / "img0-checkpoint.png")
    (tmp_path / ".Trash-1000" / "files").mkdir(parents=True)
    (tmp_path / ".Trash-1000" / "files" / "old.png").write_bytes((tmp_path / "img0.png").read_bytes()[:60])
    assert caption_images.main(["--model", str(tmp_path), "--images", str(tmp_path)]) == 0
    assert "1 images, 0 already captioned, 1 to caption" in capsys.readouterr().out
    assert captions(tmp_path) == {"img0.txt": "an image\n"}


def test_an_empty_caption_file_is_no_caption_and_gets_one(tmp_path, monkeypatch, capsys):
    """A placeholder .txt (empty, or blank lines) counted as 'already captioned' and was kept; training then
    stopped on it ('caption file is empty')."""
    class Echo:
        def caption(self, images, prompt):
            return [f"a {img.width} px wide image" for img in images]

    monkeypatch.setattr(caption_images, "load_captioner", lambda *args: Echo())
    make_images(tmp_path, 3)
    (tmp_path / "img0.txt").write_text("\n \n")
    (tmp_path / "img2.txt").write_text("kept\n")
    assert caption_images.main(["--model", str(tmp_path), "--images", str(tmp_path)]) == 0
    assert "3 images, 1 already captioned, 2 to caption" in capsys.readouterr().out  # was 2 already, 1 to caption
    assert captions(tmp_path) == {"img0.txt": "a 64 px wide image\n", "img2.txt": "kept\n",
                                  "sub/img1.txt": "a 64 px wide image\n"}
