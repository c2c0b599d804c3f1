"""tools/generate.py: bad input is one `error: ...` line, exit status 2, and no image; outputs are
numbered after the ones already in the folder; a PNG records the size it was rendered at."""

import os
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from tests.test_reliability import files_under, lora_past_the_blocks, lora_with_a_nan, one_error_line
from tools import generate


def generate_args(tiny_set, out, *extra):
    """One 1-step 64x64 image on the tiny FLUX.1; `extra` (flag, value) pairs override, a value of
    None leaves the flag out."""
    args = {
        "--model_type": "flux", "--model": tiny_set["flux_bfl"], "--ae": tiny_set["flux_vae_single"],
        "--clip_l": tiny_set["clip_l"], "--t5xxl": tiny_set["t5xxl"], "--t5xxl_max_token_length": "32",
        "--prompt": "a red square", "--width": "64", "--height": "64", "--steps": "1", "--dtype": "fp32", "--out": str(out),
    }  # fmt: skip
    args.update(zip(extra[::2], extra[1::2]))
    return [item for flag, value in args.items() if value is not None for item in (flag, value)]


def text_named_safetensors(tmp):
    (tmp / "notes.safetensors").write_text("not a LoRA\n")
    return ["--lora", str(tmp / "notes.safetensors")], ["notes.safetensors: not a safetensors file"]


def small_lora(tmp) -> str:
    """A valid rank-4 LoRA of one module of the tiny FLUX.1."""
    from networks import lora_files

    weights = {"double_blocks.0.img_attn.proj": lora_files.LoRAWeights(torch.ones(4, 64), torch.ones(64, 4), 4.0)}
    lora_files.write_kohya(weights, str(tmp / "l.safetensors"))
    return str(tmp / "l.safetensors")


def lora_ratio(tmp, ratio):
    spec = f"{small_lora(tmp)}:{ratio}"
    return ["--lora", spec], [f"--lora '{spec}': ratio '{ratio}' is not"]


def truncated_lora(tmp):
    data = open(small_lora(tmp), "rb").read()
    (tmp / "cut.safetensors").write_bytes(data[: len(data) - 100])
    return ["--lora", str(tmp / "cut.safetensors")], ["cut.safetensors: tensor '", "truncated or not safetensors"]


def out_is_a_file(tmp):
    (tmp / "taken.png").write_bytes(b"an image")
    return ["--out", str(tmp / "taken.png")], [f"--out {tmp / 'taken.png'}: is a file, expected a folder"]


def schnell_like(tmp, tiny_set):
    """The tiny FLUX.1 without its guidance embedding: what a schnell checkpoint's header shows."""
    from safetensors.torch import load_file, save_file

    weights = {k: v for k, v in load_file(tiny_set["flux_bfl"]).items() if not k.startswith("guidance_in.")}
    save_file(weights, str(tmp / "schnell.safetensors"))
    return ["--model", str(tmp / "schnell.safetensors"), "--guidance", "3.5"], [
        "--guidance is not read: ", "schnell.safetensors has no guidance embedding (a FLUX.1 schnell checkpoint)"]


def control_image(tmp):
    Image.new("RGB", (64, 64)).save(tmp / "in.png")
    return ["--control_image", str(tmp / "in.png")], [
        "--control_image is not read: model_type flux takes no reference images"]


CASES = {
    "lora_ratio_nan": lambda tmp, tiny: lora_ratio(tmp, "nan"),
    "lora_ratio_huge": lambda tmp, tiny: lora_ratio(tmp, "1e30"),
    "lora_text_file": lambda tmp, tiny: text_named_safetensors(tmp),
    "lora_truncated": lambda tmp, tiny: truncated_lora(tmp),
    "steps_0": lambda tmp, tiny: (["--steps", "0"], ["--steps 0: expected at least 1"]),
    # was an OverflowError traceback from the tokenizer, after the models loaded
    "t5_tokens_negative": lambda tmp, tiny: (["--t5xxl_max_token_length", "-5"], ["--t5xxl_max_token_length -5: expected at least 1"]),
    "guidance_nan": lambda tmp, tiny: (["--guidance", "nan"], ["--guidance must be a finite number, got nan"]),  # a NaN image
    "flow_shift_0": lambda tmp, tiny: (["--flow_shift", "0"], ["--flow_shift must be a number > 0 (a flow shift), got 0.0"]),
    "prompt_flow_shift_nan": lambda tmp, tiny: (["--prompt", "a cat --fs nan"], ["--prompt: --fs must be a number > 0"]),
    "width_negative": lambda tmp, tiny: (["--width", "-64"], ["--width -64: expected at least 16 pixels"]),
    "seed_too_large": lambda tmp, tiny: (["--seed", str(2**64)], [f"--seed {2**64}: expected 0 to 2^64 - 1"]),
    "prompt_seed_negative": lambda tmp, tiny: (["--prompt", "a cat --d -2"], ["--prompt: seed -2: expected 0 to 2^64"]),
    "blocks_to_swap_too_many": lambda tmp, tiny: (["--blocks_to_swap", "99"], [
        "--blocks_to_swap must be between 1 and ", "got 99"]),
    "prompt_width_8": lambda tmp, tiny: (["--prompt", "a cat --w 8"], ["--prompt: width 8: expected at least 16 pixels"]),
    "device_cuda_without_cuda": lambda tmp, tiny: (["--device", "cuda"], ["--device cuda: CUDA is not available"]),
    "t5xxl_missing": lambda tmp, tiny: (["--t5xxl", None], ["--t5xxl is required for --model_type flux"]),
    # the VAE file: required by every model type with one (a pixel-space one has none: test_pixel_space.py)
    "ae_missing": lambda tmp, tiny: (["--ae", None], ["--ae is required for --model_type flux"]),
    "out_is_a_file": lambda tmp, tiny: out_is_a_file(tmp),
    # options the model type never reads: refused as the training config refuses its keys
    "negative_without_true_cfg": lambda tmp, tiny: (["--negative", "blurry"], [
        "--negative is not read: model_type flux samples without a negative prompt (no true CFG)"]),
    "guidance_without_embedding": lambda tmp, tiny: schnell_like(tmp, tiny),
    "control_image_without_references": lambda tmp, tiny: control_image(tmp),
    # --ci, the docs' and the prompts' name: "unrecognized arguments" until 2026-11-27
    "ci_without_references": lambda tmp, tiny: (["--ci", *control_image(tmp)[0][1:]], control_image(tmp)[1]),
    "another_familys_key": lambda tmp, tiny: (["--text_encoder", "te"], [
        "--text_encoder is read by model_type ", "not by --model_type flux"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_generate_bad_input_is_one_error_line_exit_2_and_no_image(tiny_set, tmp_path, capsys, monkeypatch, case):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same answer with or without a GPU
    extra, fragments = CASES[case](tmp_path, tiny_set)
    capsys.readouterr()
    line = one_error_line(capsys, generate.main(generate_args(tiny_set, tmp_path / "out", *extra)))
    for fragment in fragments:
        assert fragment in line, (fragment, line)
    assert files_under(tmp_path / "out") == []


def test_the_png_records_the_model_settings_that_change_the_pixels(tiny_set, tmp_path):
    """The PNG text left out settings that change the pixels (the T5 length, the text encoders' precision, the
    release rendered, the model type) and named a diffusers component folder "transformer": it could not render
    the image again. Rendered again from what it records, the image is the same."""
    folder = tmp_path / "FLUX.1-tiny"
    shutil.copytree(tiny_set["flux_diffusers"], folder / "transformer")
    out = tmp_path / "out"
    assert generate.main(generate_args(tiny_set, out, "--model", str(folder / "transformer"), "--seed", "3",
                                       "--text_encoder_precision", "fp32", "--t5xxl_max_token_length", "48")) == 0
    with Image.open(out / "000_3.png") as png:
        text, first = dict(png.text), np.asarray(png)
    assert {k: text[k] for k in ("model", "model_type", "model_version", "text_encoder_precision",
                                 "t5xxl_max_token_length", "clip_l", "t5xxl")} == {
        "model": os.path.join("FLUX.1-tiny", "transformer"), "model_type": "flux", "model_version": "flux1-dev",
        "text_encoder_precision": "fp32", "t5xxl_max_token_length": "48",
        "clip_l": os.path.basename(tiny_set["clip_l"]), "t5xxl": os.path.basename(tiny_set["t5xxl"])}, text
    assert generate.main(generate_args(tiny_set, out, "--model", str(folder / "transformer"), "--seed", "3",
                                       "--text_encoder_precision", text["text_encoder_precision"],
                                       "--t5xxl_max_token_length", text["t5xxl_max_token_length"])) == 0
    with Image.open(out / "001_3.png") as png:
        assert np.array_equal(np.asarray(png), first)


def test_generate_numbers_after_existing_images_and_records_the_rendered_size(tiny_set, tmp_path, capsys):
    out = tmp_path / "out"
    for _ in range(2):
        with pytest.warns(UserWarning, match="--width 70 is not a multiple of 16: rendering 64"):
            assert generate.main(generate_args(tiny_set, out, "--width", "70", "--seed", "0")) == 0
    assert sorted(os.listdir(out)) == ["000_0.png", "001_0.png"]  # the second call keeps the first image
    with Image.open(out / "001_0.png") as png:
        assert png.size == (64, 64) and png.text["size"] == "64x64"


def test_flux2_dev_reads_no_negative_and_klein_base_reads_both(tiny_set):
    from library.models.family import family_class

    flux2 = family_class("flux2")
    assert set(flux2(tiny_set["flux2_dev_tiny"]).unread_sample_options()) == {"negative"}
    assert flux2(tiny_set["flux2_tiny"]).unread_sample_options() == {}


def test_schnell_renders_its_own_4_steps_by_default_and_dev_28(tiny_set, tmp_path):
    """Without --steps a FLUX.1 schnell checkpoint (no guidance embedding) samples with its 4 steps, as
    diffusers' FluxPipeline example calls schnell; dev FluxPipeline's 28 (it rendered 20 before)."""
    from diffusers.pipelines.flux.pipeline_flux import EXAMPLE_DOC_STRING

    assert "FLUX.1-schnell" in EXAMPLE_DOC_STRING and "num_inference_steps=4" in EXAMPLE_DOC_STRING
    schnell = schnell_like(tmp_path, tiny_set)[0][1]
    for model, steps in ((schnell, "4"), (tiny_set["flux_bfl"], "28")):
        out = tmp_path / f"out_{steps}"
        assert generate.main(generate_args(tiny_set, out, "--model", model, "--steps", None)) == 0
        (png,) = out.glob("*.png")
        with Image.open(png) as image:
            assert image.text["steps"] == steps


def test_vae_tiling_decodes_the_image_in_tiles(tiny_set, tmp_path, monkeypatch):
    """--vae_tiling: the decode in tiles (library.models.vae.decoding_in_tiles), the same latents."""
    from library.models import vae

    monkeypatch.setattr(vae, "TILE_PIXELS", 32)  # tiles that cut the 64 px image
    images = []
    for k, flag in enumerate(((), ("--vae_tiling",))):
        assert generate.main(generate_args(tiny_set, tmp_path / "out", "--seed", "3") + list(flag)) == 0
        with Image.open(tmp_path / "out" / f"00{k}_3.png") as png:
            images.append(torch.tensor(list(png.getdata()), dtype=torch.float32))
    assert (images[0] - images[1]).abs().max() > 2


def test_a_prompts_flow_shift_samples_on_the_fixed_shift_schedule(tiny_set, tmp_path, monkeypatch):
    """--fs (musubi-tuner's prompt flag) and --flow_shift: the sampler's sigmas are the fixed shift's, not the
    release's resolution shift; a prompt's --fs wins over --flow_shift, a prompt without one takes it."""
    from library.models import flow_matching

    seen, euler = [], flow_matching.euler_sample
    monkeypatch.setattr(flow_matching, "euler_sample", lambda f, x, sigmas: seen.append(sigmas) or euler(f, x, sigmas))
    args = generate_args(tiny_set, tmp_path / "out", "--steps", "3", "--flow_shift", "2.5") + ["--prompt", "a dog --fs 7"]
    assert generate.main(args) == 0
    fixed = [flow_matching.inference_sigmas(3, 16, "flux", shift=k).tolist() for k in (2.5, 7.0)]
    assert [s.tolist() for s in seen] == fixed and fixed[0] != fixed[1]
    assert fixed[0] != flow_matching.inference_sigmas(3, 16, "flux").tolist()  # 64 px: 16 tokens, the release's shift
    from PIL import Image  # the PNG says which (old: two renders differing in --fs carried the same settings)

    shifts = []
    for name in sorted(os.listdir(tmp_path / "out")):
        with Image.open(tmp_path / "out" / name) as image:
            shifts.append(image.text["flow_shift"])
    assert shifts == ["2.5", "7.0"]


def test_a_repeated_lora_flag_applies_every_lora():
    """`--lora A --lora B` kept B alone (nargs="*" replaces), rendering without A and without a word."""
    from tools.generate import build_parser

    need = ["--model_type", "flux", "--model", "m", "--ae", "ae", "--prompt", "p"]
    args = build_parser().parse_args([*need, "--lora", "a.safetensors:0.9",
                                      "--lora", "b.safetensors:0.5", "c.safetensors"])
    assert args.lora == ["a.safetensors:0.9", "b.safetensors:0.5", "c.safetensors"]
    assert build_parser().parse_args(need).lora == []
    with pytest.raises(ValueError, match="argument --lora: expected at least one argument"):
        build_parser().parse_args([*need, "--lora"])  # `--lora $UNSET` rendered the bare base without a word


@pytest.mark.parametrize("given", ["clip_l", "flux_diffusers"])
def test_a_wrong_ae_is_one_line_before_any_model_loads(tiny_set, tmp_path, capsys, monkeypatch, given):
    """A text encoder's or the transformer's folder given as --ae was found after the text encoders ran and the
    transformer loaded (minutes full size), as a TypeError traceback, exit 1: checked by its header first now,
    as train_lora.py checks every model file."""
    from library.models.flux1.family import FluxFamily

    monkeypatch.setattr(FluxFamily, "load_text_encoder", lambda *a, **k: pytest.fail("a model loaded"))
    capsys.readouterr()
    line = one_error_line(capsys, generate.main(generate_args(tiny_set, tmp_path / "out", "--ae", tiny_set[given])))
    assert line.startswith(f"error: {tiny_set[given]}: ae is not a FLUX.1 VAE (16 latent channels): no key ends in "), line
    assert files_under(tmp_path / "out") == []


def test_another_familys_transformer_is_named_with_its_model_type(tiny_set, tmp_path, capsys):
    """Old: the loader's line alone (a missing key), as train_lora.py's check said it."""
    capsys.readouterr()
    line = one_error_line(capsys, generate.main(generate_args(tiny_set, tmp_path / "out", "--model", tiny_set["zimage"])))
    assert line.endswith("; its keys are a zimage transformer's: set model_type = \"zimage\" or \"zimage_omni\""), line


@pytest.mark.parametrize("precision", ["nf4", "fp8_scaled"])
def test_an_explicit_base_precision_on_a_gguf_is_refused_before_any_model_loads(tiny_set, tmp_path, capsys,
                                                                                 monkeypatch, precision):
    """A pre-quantized file renders as it is stored: the images were written from its GGUF blocks without a word
    (train_lora.py, plan_memory and precision_doctor refuse the same combination)."""
    from library.models.flux1.family import FluxFamily
    from tests.test_gguf import tiny_gguf

    path, _ = tiny_gguf(tiny_set, tmp_path / "flux1-tiny-Q8_0.gguf")
    monkeypatch.setattr(FluxFamily, "load_text_encoder", lambda *a, **k: pytest.fail("a model loaded"))
    capsys.readouterr()
    line = one_error_line(capsys, generate.main(generate_args(tiny_set, tmp_path / "out", "--model", path,
                                                              "--base_precision", precision)))
    assert line == (f"error: --base_precision {precision}: {path} stores a pre-quantized gguf_q8_0+q4_k base, which "
                    f"renders as it is stored; leave --base_precision out"), line
    assert files_under(tmp_path / "out") == []


def test_a_lora_naming_modules_the_checkpoint_lacks_is_refused_before_any_model_loads(tiny_set, tmp_path, capsys,
                                                                                      monkeypatch):
    """A LoRA of a model with more blocks (FLUX.1's double block 18 on the tiny FLUX.1's 2) was refused only after
    the text encoders ran and the transformer loaded, minutes on a real model: now from the transformer built on
    meta, before either loads."""
    from library.models.flux1.family import FluxFamily

    path = lora_past_the_blocks(tmp_path)
    monkeypatch.setattr(FluxFamily, "load_text_encoder", lambda *a, **k: pytest.fail("a model loaded"))
    capsys.readouterr()
    line = one_error_line(capsys, generate.main(generate_args(tiny_set, tmp_path / "out", "--lora", path)))
    assert line == f"error: {path}: LoRA module 'double_blocks.18.img_attn.proj' is not a Linear of this flux model", line
    assert files_under(tmp_path / "out") == []


def test_a_lora_holding_a_nan_is_one_line_before_any_model_loads(tiny_set, tmp_path, capsys, monkeypatch):
    """Old: the NaN reached every layer it adapts and generate wrote a black image, exit 0."""
    from library.models.flux1.family import FluxFamily

    path = lora_with_a_nan(tmp_path)
    monkeypatch.setattr(FluxFamily, "load_text_encoder", lambda *a, **k: pytest.fail("a model loaded"))
    capsys.readouterr()
    line = one_error_line(capsys, generate.main(generate_args(tiny_set, tmp_path / "out", "--lora", path)))
    assert line.startswith(f"error: {path}: module 'double_blocks.0.img_attn.proj' up holds 1 non-finite value"), line
    assert files_under(tmp_path / "out") == []


def assert_release_note(args, key: str, in_dim: int, trained: str, rendered: str, why: str, tmp_path, capsys):
    """generate's note lines for a LoRA of one module `key` whose header says ss_base_model_version `trained`: exactly
    one, naming `rendered` and `why` the files read as it; for a LoRA of `rendered`, none. The run stops before the
    text encoder loads (the tests patch it to raise)."""
    from networks import lora_files

    for version in (trained, rendered):
        weights = {key: lora_files.LoRAWeights(torch.ones(4, in_dim), torch.ones(64, 4), 4.0)}
        path = str(tmp_path / f"{version}.safetensors")
        lora_files.write_kohya(weights, path, metadata={"ss_base_model_version": version})
        capsys.readouterr()
        assert generate.main([*args, "--lora", path]) == 2  # stopped before the text encoder loads
        notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")]
        expected = [f"note: {path} was trained on {trained}; this renders {rendered} ({why}): give --model_version "
                    f"{trained} if --model is that release"] if version == trained else []
        assert notes == expected, notes


def test_a_zimage_base_lora_on_a_file_read_as_turbo_says_how_to_render_base(tiny_set, tmp_path, capsys, monkeypatch):
    """A Z-Image single file is read as Turbo (8 steps, no CFG, shift 3): a LoRA whose header says it was trained on
    zimage-base rendered a Base file with Turbo's settings without a word. Now one note line says which release
    this renders and the flag that renders the other; a LoRA of the release rendered says nothing."""
    from library.models.zimage.family import ZImageFamily

    monkeypatch.setattr(ZImageFamily, "load_text_encoder", lambda *a, **k: (_ for _ in ()).throw(ValueError("stop")))
    args = ["--model_type", "zimage", "--model", tiny_set["zimage"], "--ae", tiny_set["flux_vae"],
            "--text_encoder", tiny_set["zimage_text_encoder"], "--prompt", "a cat", "--out", str(tmp_path / "out")]
    assert_release_note(args, "layers.0.feed_forward.w2", 170, "zimage-base", "zimage-turbo",
                        "a file without its pipeline folder's scheduler is read as Turbo", tmp_path, capsys)


def test_a_qwen_image_edit_lora_on_a_folder_read_as_2509_says_how_to_render_its_release(tiny_set, tmp_path, capsys,
                                                                                        monkeypatch):
    """Qwen-Image-Edit and 2509 share their config.json, so a folder is read as 2509 (the Plus template, 3 references):
    a LoRA whose header says qwen-image-edit rendered with 2509's template without a word. Now one note line."""
    from library.models.qwen_image.edit_family import QwenImageEditFamily

    monkeypatch.setattr(QwenImageEditFamily, "load_text_encoder", lambda *a, **k: (_ for _ in ()).throw(ValueError("x")))
    Image.new("RGB", (64, 64)).save(tmp_path / "in.png")
    args = ["--model_type", "qwen_image_edit", "--model", tiny_set["qwen_image_edit"], "--ae", tiny_set["qwen_image_vae"],
            "--text_encoder", tiny_set["qwen_image_edit_text_encoder"], "--prompt", "make it red", "--control_image",
            str(tmp_path / "in.png"), "--out", str(tmp_path / "out")]
    assert_release_note(args, "transformer_blocks.0.attn.to_q", 64, "qwen-image-edit", "qwen-image-edit-2509",
                        "read from its config.json, which Edit and 2509 share", tmp_path, capsys)


def test_a_krea2_turbo_lora_on_a_file_read_as_raw_says_how_to_render_turbo(tiny_set, tmp_path, capsys, monkeypatch):
    """A Krea 2 file whose name does not say turbo is read as Raw (its 50 steps with CFG): a LoRA whose header says
    krea2-turbo rendered with Raw's settings without a word. Now one note line."""
    from library.models.krea2.family import Krea2Family

    monkeypatch.setattr(Krea2Family, "load_text_encoder", lambda *a, **k: (_ for _ in ()).throw(ValueError("stop")))
    alone = tmp_path / "models" / "krea2-tiny.safetensors"  # away from the tiny set's model_index.json
    alone.parent.mkdir()
    shutil.copy(tiny_set["krea2"], alone)
    args = ["--model_type", "krea2", "--model", str(alone), "--ae", tiny_set["qwen_image_vae"],
            "--text_encoder", tiny_set["krea2_text_encoder"], "--prompt", "a cat", "--out", str(tmp_path / "out")]
    assert_release_note(args, "blocks.0.attn.wq", 64, "krea2-turbo", "krea2-raw",
                        "read from its file name, which does not say turbo", tmp_path, capsys)


def test_a_png_records_no_negative_prompt_the_model_did_not_read(tiny_set, tmp_path):
    """FLUX.1 samples without a negative prompt (a line's --n is a warning): its PNG recorded 'blurry' as the negative
    all the same, a setting the image never had."""
    with pytest.warns(UserWarning, match="--n"):
        assert generate.main(generate_args(tiny_set, tmp_path / "out", "--prompt", "a dog --n blurry", "--seed",
                                           "1")) == 0
    with Image.open(tmp_path / "out" / "000_1.png") as png:
        assert png.text["prompt"] == "a dog" and png.text["negative"] == "", png.text


@pytest.mark.parametrize("model_type, side", [("flux", 1024), ("hunyuan_image", 2048), ("hidream_o1", 2048)])
def test_the_default_size_is_the_models_pipelines(model_type, side):
    """Every model rendered 1024 x 1024 without --width / --height, the 2K models too (HunyuanImagePipeline and
    musubi-tuner's HiDream-O1 script default to 2048)."""
    from types import SimpleNamespace

    from library.models.family import family_class

    family = family_class(model_type)
    stand_in = SimpleNamespace(sample_guidance=1.0, sample_steps=4, vae_downsample=8, patch=2,
                               render_size=family.render_size, true_cfg=False,
                               guidance_is_cfg_scale=lambda: False, caption_token_limit=lambda args: None,
                               largest_image=lambda: None)
    args = generate.build_parser().parse_args(["--model_type", model_type, "--model", "m", "--prompt", "a cat"])
    prompt = generate.collect_prompts(args, stand_in)[0]
    assert (prompt.width, prompt.height) == (side, side)
