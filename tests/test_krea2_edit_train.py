"""Krea 2 edit (model_type krea2_edit) end to end on the tiny models: a paired dataset (control_directory)
trains with the references' latents in every step and saves a LoRA whose base version says edit; the
sample and tools/generate.py --control_image render with the reference; the references' sizes are
ai-toolkit's rule."""

import os

import pytest
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file

import train_lora
from library.models.krea2.edit_encoder import Krea2ImageTextEncoder
from library.models.krea2.edit_family import Krea2EditFamily, reference_size
from library.models.krea2.tiny import write_krea2_edit_text_encoder
from tests.test_train_lora import sample_png
from tools.make_tiny_dataset import make_tiny_edit_dataset


@pytest.fixture(scope="module")
def edit_set(tiny_set, tmp_path_factory):
    """The paired set and a tiny Qwen3-VL with its vision tower and image processor (the captions see the references)."""
    out = str(tmp_path_factory.mktemp("krea2_edit"))
    return {**tiny_set, **make_tiny_edit_dataset(out, count=4, size=32), **write_krea2_edit_text_encoder(out, 0)}


def test_reference_size_is_aitoolkits_rule():
    assert reference_size(32, 32) == (32, 32)  # small: kept (never upscaled), sides multiples of 16
    assert reference_size(40, 24) == (32, 32)  # 2.5 and 1.5 sixteens: Python's round (ai-toolkit's) to even
    assert reference_size(56, 24) == (64, 32)  # 3.5 -> 4
    assert reference_size(2048, 1024) == (1456, 720)  # 1 MP at 2:1: h sqrt(2^20 / 2) = 724.1 -> 720, w 1448.2 -> 1456
    assert reference_size(8, 8) == (16, 16)
    assert reference_size(2048, 2048, resolution=512) == (512, 512)


@pytest.fixture(scope="module")
def trained(edit_set, tmp_path_factory):
    """Two steps from configs/krea2_edit.toml with kv_cache: (output folder, the references each predict saw)."""
    seen = []
    real = Krea2EditFamily.predict

    def recording(self, *args, control=None, **kwargs):
        seen.append([tuple(c.shape) for c in control or []])
        return real(self, *args, control=control, **kwargs)

    out = tmp_path_factory.mktemp("krea2_edit_run")
    args = [
        "--config_file", os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs", "krea2_edit.toml"),
        "--pretrained_model_name_or_path", edit_set["krea2_diffusers"], "--ae", edit_set["qwen_image_vae"],
        "--text_encoder", edit_set["krea2_edit_text_encoder"], "--dataset_config", edit_set["edit_dataset_config"],
        "--sample_prompts", edit_set["edit_sample_prompts"], "--output_dir", str(out), "--output_name", "k2edit",
        "--logging_dir", str(out / "logs"),  # the config's is relative to the working directory
        "--max_train_steps", "2", "--mixed_precision", "no", "--network_dim", "4", "--network_alpha", "4",
        "--optimizer_type", "AdamW", "--learning_rate", "3e-3", "--save_every_n_steps", "0", "--sample_every_n_steps",
        "0", "--validate_every_n_steps", "0", "--fp8_base", "false", "--gradient_checkpointing", "false",
        "--save_state", "false", "--reference_kv_cache", "true",
    ]  # fmt: skip
    encoded = []  # (captions, references per caption) the text encoder saw with images
    real_encode = Krea2ImageTextEncoder.encode_with_images

    def encoding(self, prompts, images):
        encoded.append((list(prompts), [len(i) for i in images]))
        return real_encode(self, prompts, images)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Krea2EditFamily, "predict", recording)
        patch.setattr(Krea2ImageTextEncoder, "encode_with_images", encoding)
        assert train_lora.main(args) == 0
    assert encoded and all(n == 1 for _, counts in encoded for n in counts), encoded  # captions saw their reference
    return out, seen


def test_krea2_edit_trains_with_references_and_samples(trained):
    out, seen = trained
    train_steps = [s for s in seen[:2]]
    assert train_steps and all(s == [(s[0][0], 16, 4, 4)] for s in train_steps), seen  # one 32 x 32 reference
    with safe_open(str(out / "k2edit.safetensors"), "pt") as f:
        assert f.metadata()["ss_base_model_version"] == "krea2-raw-edit-kv_cache"
        assert f.metadata()["modelspec.architecture"] == "Krea-2-Edit/lora"  # ours, in musubi-tuner's style
    # the final sample by its name: the output folder also holds the lr plot (k2edit_lr.png)
    with Image.open(sample_png(out, "k2edit", "final")) as sample:
        assert sample.text["panels"].split(",")[-1] == "reference"


def test_generate_takes_the_control_image_and_aitoolkits_lora_layout(edit_set, trained, tmp_path):
    # ai-toolkit saves Krea 2 LoRAs as diffusion_model.<our module path>.lora_A / lora_B (PEFT names,
    # alpha = rank): the same LoRA in that layout renders the same picture as our kohya file.
    from library.models.krea2.lora_files import module_paths
    from networks.lora_files import peft_state_dict, read_lora, write_lora_tensors

    paths = module_paths({"blocks": 2, "layerwise_blocks": 2, "refiner_blocks": 2})
    weights, _, fmt = read_lora(str(trained[0] / "k2edit.safetensors"), paths)
    assert fmt == "kohya"
    aitk = tmp_path / "aitk.safetensors"
    write_lora_tensors(peft_state_dict(weights, prefix="diffusion_model"), str(aitk))
    assert all(k.startswith("diffusion_model.blocks.") or k.startswith("diffusion_model.txtfusion.")
               for k in load_file(aitk))

    from tools import generate

    def run(name, *extra):
        out = tmp_path / name
        assert generate.main(["--model_type", "krea2_edit", "--model", edit_set["krea2"], "--ae",
                              edit_set["qwen_image_vae"], "--text_encoder", edit_set["krea2_edit_text_encoder"],
                              "--prompt", "make the shape red --s 2", "--width", "32", "--height", "32",
                              "--dtype", "fp32", "--seed", "0", "--out", str(out), *extra]) == 0
        (png,) = [p for p in os.listdir(out) if p.endswith(".png")]
        with Image.open(out / png) as image:
            return torch.tensor(list(image.getdata()), dtype=torch.float32)

    grey = os.path.join(edit_set["edit_control_dir"], "000.png")
    plain, with_ref = run("plain"), run("ref", "--control_image", grey)
    assert (with_ref - plain).abs().mean() > 0.1  # the reference changes the picture (0 if ignored)
    isolated = run("kv", "--control_image", grey, "--reference_kv_cache", "true")
    assert (isolated - with_ref).abs().max() > 0  # the kv_cache mask reaches sampling
    # (ai-toolkit's file has no header saying kv_cache: the flag, which ours implies, for both)
    ours = run("ours", "--control_image", grey, "--lora", f"{trained[0] / 'k2edit.safetensors'}:1.0")
    theirs = run("theirs", "--control_image", grey, "--lora", f"{aitk}:1.0", "--reference_kv_cache", "true")
    assert torch.equal(ours, theirs) and (ours - isolated).abs().mean() > 0


def test_generate_reads_reference_kv_cache_as_true_or_false():
    from tools import generate

    parse = generate.build_parser().parse_args
    base = ["--model_type", "krea2_edit", "--model", "m", "--ae", "a"]
    assert parse(base).reference_kv_cache is False
    assert parse([*base, "--reference_kv_cache", "false"]).reference_kv_cache is False
    assert parse([*base, "--reference_kv_cache", "true"]).reference_kv_cache is True


def test_a_text_encoder_without_its_image_processor_is_refused_before_caching(edit_set, tmp_path):
    """The old line checked the transformer and VAE only: a Qwen3-VL folder without preprocessor_config.json
    failed after the latents were cached, at the first caption with a reference."""
    import shutil

    from library.io import CheckpointError

    encoder = tmp_path / "text_encoder"
    shutil.copytree(edit_set["krea2_edit_text_encoder"], encoder,
                    ignore=shutil.ignore_patterns("preprocessor_config.json"))
    family = Krea2EditFamily(edit_set["krea2_diffusers"], edit_set["qwen_image_vae"], text_encoder=str(encoder))
    with pytest.raises(CheckpointError, match="preprocessor_config.json"):
        family.check_model_files()
    Krea2EditFamily(edit_set["krea2_diffusers"], edit_set["qwen_image_vae"],
                    text_encoder=edit_set["krea2_edit_text_encoder"]).check_model_files()


def test_references_are_planned_at_the_size_the_trainer_encodes_them(edit_set, tmp_path, monkeypatch):
    """A reference keeps its own size up to reference_resolution^2, whatever the target's: the memory plan sized it
    as the target (32 px targets with 64 px references: planned 4 x 4 latents, encoded 8 x 8; at full size, 512 px
    targets with 1024 px references: 16.05 GiB planned, 18.69 with them). Now the plan's step and caching take the
    dataset's largest reference, and without one (a preset, --references) the largest the family encodes."""
    from library.data.dataset_config import parse_dataset_config
    from library.data.image_folders import LargestStep, largest_step, scan_images
    from library.training.memory_plan import caching_phase, step_plan
    from tools import plan_memory

    control = tmp_path / "control"
    control.mkdir()
    for name in os.listdir(edit_set["edit_control_dir"]):  # the 32 px references at 64 px
        with Image.open(os.path.join(edit_set["edit_control_dir"], name)) as image:
            image.resize((64, 64)).save(control / name)
    blueprint = parse_dataset_config({"datasets": [{"resolution": 32, "batch_size": 2, "subsets": [
        {"image_dir": edit_set["edit_image_dir"], "control_directory": str(control)}]}]})
    seen, real = [], Krea2EditFamily.predict

    def recording(self, *args, control=None, **kwargs):
        seen.append({tuple(c.shape[2:]) for c in control or []})
        return real(self, *args, control=control, **kwargs)

    monkeypatch.setattr(Krea2EditFamily, "predict", recording)
    family = Krea2EditFamily(edit_set["krea2_diffusers"], edit_set["qwen_image_vae"],
                             text_encoder=edit_set["krea2_edit_text_encoder"])
    encoded = {tuple(b) for item in scan_images(blueprint, control_bucket=family.control_bucket)
               for b in item.control_buckets}
    assert encoded == {(64, 64)}
    args, step = plan_memory.default_args("krea2_edit"), largest_step(blueprint)
    assert step.reference_size == (64, 64)
    step = step._replace(width=32, height=32, batch=2)
    step_plan(family, args, step)
    assert seen == [{(8, 8)}], seen  # 64 px / the 8x VAE
    assert "(64x64, batch 4, each)" in str(caching_phase(family, args, 32, 32, step.references, step.reference_size).parts)

    seen.clear()  # a reference of unknown size: the largest the family encodes, 48 x 48 here
    family = Krea2EditFamily(edit_set["krea2_diffusers"], edit_set["qwen_image_vae"], reference_resolution=48,
                             text_encoder=edit_set["krea2_edit_text_encoder"])
    step_plan(family, args, LargestStep(32, 32, 2, 1))
    assert seen == [{(6, 6)}], seen


def test_generate_renders_a_kv_cache_lora_with_the_mask_it_was_trained_with(edit_set, trained, tmp_path, capsys):
    """A LoRA trained with reference_kv_cache (its ss_base_model_version says -kv_cache) rendered without the flag
    used the full attention it was never trained with, without a word: now the header sets it, with one note line."""
    from tools import generate

    lora = str(trained[0] / "k2edit.safetensors")
    grey = os.path.join(edit_set["edit_control_dir"], "000.png")

    def run(name, *extra):
        out = tmp_path / name
        assert generate.main(["--model_type", "krea2_edit", "--model", edit_set["krea2"], "--ae",
                              edit_set["qwen_image_vae"], "--text_encoder", edit_set["krea2_edit_text_encoder"],
                              "--prompt", "make the shape red --s 2", "--width", "32", "--height", "32", "--dtype",
                              "fp32", "--seed", "0", "--out", str(out), "--control_image", grey, "--lora", lora,
                              *extra]) == 0
        (png,) = [p for p in os.listdir(out) if p.endswith(".png")]
        with Image.open(out / png) as image:
            return torch.tensor(list(image.getdata()), dtype=torch.float32)

    capsys.readouterr()
    honoured = run("honoured")
    said = capsys.readouterr().out
    flagged = run("flag", "--reference_kv_cache", "true")
    assert torch.equal(honoured, flagged), (honoured - flagged).abs().max()  # old: 1 of 255
    assert (f"note: {lora} was trained with reference_kv_cache true (ss_base_model_version krea2-raw-edit-kv_cache): "
            f"rendering with it") in said
