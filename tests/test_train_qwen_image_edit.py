"""Qwen-Image-Edit LoRA end to end on the tiny real-format models: a paired dataset (grey shape ->
red shape, "make the shape red") trains with the references' latents in every step and the text
encoded with the references, the loss falls, the LoRA loads in tools/generate.py, the sample
renders target | reference; the text cache is per (caption, references); wrong reference counts
fail in one line."""

import os
import shutil

import pytest
import torch
from PIL import Image
from safetensors import safe_open

import train_lora
from library.models.qwen_image.edit_family import QwenImageEditFamily
from tests.test_train_lora import ROOT, read_losses, sample_png
from tools.make_tiny_dataset import make_tiny_edit_dataset


@pytest.fixture(scope="module")
def edit_set(tiny_set, tmp_path_factory):
    return {**tiny_set, **make_tiny_edit_dataset(str(tmp_path_factory.mktemp("qedit")), count=8, size=32)}


@pytest.fixture(autouse=True)
def tiny_vae_area(monkeypatch):
    """Samples encode a reference at the pipelines' ~1024x1024 area (sample_control_bucket); here at the
    tiny set's 32x32, as the training references are (a 1 MP reference made these runs minutes long)."""
    from library.models.qwen_image import edit

    monkeypatch.setattr(edit, "VAE_IMAGE_AREA", 32 * 32)


def edit_args(edit_set, out, *extra):
    return [
        # the Qwen-Image quickstart's keys (a FLUX.1 config's clip_l / t5xxl would be refused: edit reads neither)
        "--config_file", os.path.join(ROOT, "configs", "quickstart_qwen_image.toml"), "--model_type", "qwen_image_edit",
        "--timestep_sampling", "shift", "--discrete_flow_shift", "3.0",
        "--pretrained_model_name_or_path", edit_set["qwen_image_edit"], "--ae", edit_set["qwen_image_vae"],
        "--text_encoder", edit_set["qwen_image_edit_text_encoder"],
        "--dataset_config", edit_set["edit_dataset_config"], "--sample_prompts", edit_set["edit_sample_prompts"],
        "--output_dir", str(out), "--output_name", "qedit", "--sample_at_first", "false",
        "--save_every_n_steps", "0", "--mixed_precision", "no", *extra,
    ]  # fmt: skip


def test_qwen_image_edit_lora_loss_falls_with_references_in_every_step(edit_set, tmp_path, monkeypatch):
    seen, validated = [], []
    real = QwenImageEditFamily.loss_at

    def recording(self, model, latents, text, *args, control=None, **kwargs):  # training steps and val_loss
        (seen if torch.is_grad_enabled() else validated).append(
            ([tuple(c.shape) for c in control or []], text["embeds"].shape[1]))
        return real(self, model, latents, text, *args, control=control, **kwargs)

    monkeypatch.setattr(QwenImageEditFamily, "loss_at", recording)
    with open(edit_set["edit_dataset_config"]) as f:  # 2 of the 8 pairs held out for val_loss
        (tmp_path / "ds.toml").write_text(f.read().replace("[general]\n", "[general]\nvalidation_split = 0.25\n"))
    out = tmp_path / "run"
    code = train_lora.main(edit_args(edit_set, out, "--max_train_steps", "40", "--optimizer_type", "AdamW",
                                     "--optimizer_args", "--learning_rate", "3e-3", "--dataset_config",
                                     str(tmp_path / "ds.toml"), "--validate_every_n_steps", "40"))
    assert code == 0
    # batch 2, one 32x32 reference each; the text holds the reference's vision tokens (> the caption's ~10)
    assert len(seen) == 40 and all(s[0] == [(2, 16, 4, 4)] and s[1] > 40 for s in seen), seen[:2]
    assert len(validated) == 2 * 5 and all(v[0] == [(1, 16, 4, 4)] and v[1] > 40 for v in validated)
    losses = read_losses(out, "qedit")
    first, last = sum(losses[:8]) / 8, sum(losses[-8:]) / 8
    print(f"qwen_image_edit tiny edit run: loss {first:.4f} -> {last:.4f}")
    assert last < 0.9 * first, (first, last)
    lora = out / "qedit.safetensors"
    with safe_open(str(lora), "pt") as f:
        assert f.metadata()["ss_base_model_version"] == "qwen-image-edit-2509"
        assert f.metadata()["modelspec.architecture"] == "Qwen-Image-Edit-Plus/lora"  # musubi-tuner's for 2509
        assert any("transformer_blocks" in k for k in f.keys())
    with Image.open(sample_png(out, "qedit", "final")) as sample:
        panels = sample.text["panels"].split(",")  # the target, then the reference
        assert panels[-1] == "reference" and sample.size[0] == 32 * len(panels)

    from tools import generate  # the saved LoRA loads and changes the edit

    def run(name, *extra):
        grey = os.path.join(edit_set["edit_control_dir"], "000.png")
        assert generate.main(["--model_type", "qwen_image_edit", "--model", edit_set["qwen_image_edit"],
                              "--ae", edit_set["qwen_image_vae"], "--text_encoder", edit_set["qwen_image_edit_text_encoder"],
                              "--prompt", "make the shape red", "--control_image", grey, "--width", "32", "--height", "32",
                              "--steps", "2", "--dtype", "fp32", "--out", str(tmp_path / name), *extra]) == 0
        (file,) = os.listdir(tmp_path / name)
        with Image.open(tmp_path / name / file) as image:
            return torch.tensor(list(image.getdata()), dtype=torch.float32)

    assert (run("with", "--lora", str(lora)) - run("without")).abs().mean() > 1.0


def two_reference_set(edit_set, tmp_path, every: int = 1):
    """The edit set with each target's reference given twice (name_0, name_1); every: only each every-th
    target's (the others keep their one)."""
    control = tmp_path / "control2"
    control.mkdir()
    for i, name in enumerate(sorted(os.listdir(edit_set["edit_control_dir"]))):
        stem, ext = os.path.splitext(name)
        for k in range(2) if i % every == 0 else ():
            shutil.copy(os.path.join(edit_set["edit_control_dir"], name), control / f"{stem}_{k}{ext}")
        if i % every:
            shutil.copy(os.path.join(edit_set["edit_control_dir"], name), control / name)
    ds = tmp_path / "ds2.toml"
    with open(edit_set["edit_dataset_config"]) as f:
        ds.write_text(f.read().replace(edit_set["edit_control_dir"], str(control)))
    return ds


def test_edit_version_refuses_two_references_in_one_line(edit_set, tmp_path, capsys):
    args = edit_args(edit_set, tmp_path / "run", "--model_version", "qwen-image-edit", "--max_train_steps", "1",
                     "--dataset_config", str(two_reference_set(edit_set, tmp_path)))
    assert train_lora.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model_type qwen_image_edit takes at most 1 reference image(s)" in err[0], err


def test_targets_with_one_and_two_references_train_in_batches_of_one_count(edit_set, tmp_path, monkeypatch):
    """musubi-tuner trains such a folder; ours refused it ("every image of a subset needs the same number")."""
    counts = []
    real = QwenImageEditFamily.loss_at

    def recording(self, model, latents, text, *args, control=None, **kwargs):
        counts.append(len(control))
        return real(self, model, latents, text, *args, control=control, **kwargs)

    monkeypatch.setattr(QwenImageEditFamily, "loss_at", recording)
    args = edit_args(edit_set, tmp_path / "run", "--max_train_steps", "4", "--sample_prompts", "",
                     "--dataset_config", str(two_reference_set(edit_set, tmp_path, every=2)))
    assert train_lora.main(args) == 0
    assert sorted(set(counts)) == [1, 2] and len(counts) == 4, counts  # batch 2, 4 batches an epoch


def test_unpaired_dataset_is_refused_in_one_line(edit_set, tmp_path, capsys):
    args = edit_args(edit_set, tmp_path / "run", "--max_train_steps", "1", "--dataset_config",
                     edit_set["dataset_config"], "--sample_prompts", "")
    assert train_lora.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model_type qwen_image_edit needs at least 1 per image" in err[0], err


@pytest.mark.parametrize("count, message", [(4, "4 --ci image(s), but model_type qwen_image_edit takes at most 3"),
                                            (0, "0 --ci image(s), but model_type qwen_image_edit needs at least 1")])
def test_sample_prompt_reference_count_is_checked_before_training(edit_set, tmp_path, capsys, count, message):
    grey = os.path.join(edit_set["edit_control_dir"], "000.png")
    prompts = tmp_path / "p.txt"
    prompts.write_text("make it red" + f" --ci {grey}" * count + "\n")
    args = edit_args(edit_set, tmp_path / "run", "--max_train_steps", "1", "--sample_prompts", str(prompts))
    assert train_lora.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_text_cache_is_per_caption_and_references_with_the_dropped_caption_seeing_them(edit_set, tmp_path):
    """Same caption, other reference -> other text; a changed reference file re-encodes that entry
    only; caption dropout substitutes "" encoded with the item's own references."""
    import numpy as np

    from library.data.caches import cache_text
    from library.data.dataset import ImageDataset
    from library.data.image_folders import scan_images
    from library.data.dataset_config import load_dataset_config

    control = shutil.copytree(edit_set["edit_control_dir"], tmp_path / "control")
    images = shutil.copytree(edit_set["edit_image_dir"], tmp_path / "images")
    ds = tmp_path / "ds.toml"
    ds.write_text(f'[general]\nresolution = 32\ncaption_extension = ".txt"\n[[datasets]]\n[[datasets.subsets]]\n'
                  f'image_dir = "{images}"\ncontrol_directory = "{control}"\ncaption_dropout_rate = 1.0\n')
    blueprint = load_dataset_config(str(ds))
    calls = []

    def encode(captions, views):  # a stand-in encoder: caption length and the reference's mean grey level
        calls.append(captions)
        return [{"embeds": torch.tensor([[float(len(c)), float(np.asarray(v[0]).mean())]])} for c, v in zip(captions, views)]

    items = scan_images(blueprint)
    assert cache_text(items, encode, "k", with_references=True) == 8 and sum(map(len, calls)) == 16  # caption + ""
    texts = [ImageDataset(blueprint, items=items, validation=True)[i]["text"]["embeds"] for i in range(8)]
    assert len({round(t[0, 1].item(), 2) for t in texts}) > 1  # "make the shape red" with each own reference
    dropped = [ImageDataset(blueprint, items=items)[i] for i in range(8)]
    assert all(s["caption"] == "" and s["text"]["embeds"][0, 0] == 0 for s in dropped)
    by_path = {s["image_path"]: s["text"]["embeds"][0, 1] for s in dropped}  # "" still sees its reference
    assert all(by_path[p] == t[0, 1] for p, t in zip([it.image_path for it in items], texts))

    Image.new("RGB", (32, 32), (7, 7, 7)).save(control / "003.png")
    items = scan_images(blueprint)
    assert cache_text(items, encode, "k", with_references=True) == 1  # only the changed pair re-encodes


def test_a_reference_the_vl_processor_refuses_is_named_before_caching(edit_set, tmp_path, capsys, monkeypatch):
    """An 8000 x 16 reference (aspect 500) is 8576 x 32 at the VL encoder's ~384x384 area: aspect 268, over the
    Qwen-VL image processor's 200. It passed check_dataset; training cached every latent, then the processor's
    line named no file. Now the scan, check_dataset, a sample prompt's --ci and generate.py name it first."""
    from tools import check_dataset, generate

    control = tmp_path / "long_control"
    shutil.copytree(edit_set["edit_control_dir"], control)
    long = str(control / "003.png")
    Image.new("RGB", (8000, 16), "grey").save(long)
    ds = tmp_path / "long.toml"
    with open(edit_set["edit_dataset_config"]) as f:
        ds.write_text(f.read().replace(edit_set["edit_control_dir"], str(control)))
    refused = (f"{long}: 8000 x 16 pixels, 8576 x 32 as the text encoder resizes it, an aspect ratio of 268; "
               f"the Qwen-VL image processor takes at most 200")
    monkeypatch.setattr(QwenImageEditFamily, "load_vae", lambda *a, **k: pytest.fail("the VAE loaded: caching began"))

    def one_line(code):
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1, (code, err)
        return err[0]

    assert refused in one_line(train_lora.main(edit_args(edit_set, tmp_path / "run", "--max_train_steps", "1",
                                                         "--dataset_config", str(ds), "--sample_prompts", "")))
    prompts = tmp_path / "p.txt"
    prompts.write_text(f"make it red --ci {long}\n")
    line = one_line(train_lora.main(edit_args(edit_set, tmp_path / "run", "--max_train_steps", "1",
                                              "--sample_prompts", str(prompts))))
    assert f"{prompts}: prompt 'make it red': --ci {refused}" in line, line
    line = one_line(generate.main(["--model_type", "qwen_image_edit", "--model", edit_set["qwen_image_edit"],
                                   "--ae", edit_set["qwen_image_vae"], "--text_encoder", edit_set["qwen_image_edit_text_encoder"],
                                   "--prompt", "make it red", "--control_image", long, "--out", str(tmp_path / "gen")]))
    assert refused in line, line
    run = tmp_path / "run.toml"
    run.write_text(f'model_type = "qwen_image_edit"\npretrained_model_name_or_path = "{edit_set["qwen_image_edit"]}"\n'
                   f'ae = "{edit_set["qwen_image_vae"]}"\ntext_encoder = "{edit_set["qwen_image_edit_text_encoder"]}"\n'
                   f'dataset_config = "{ds}"\noutput_dir = "{tmp_path / "out"}"\noutput_name = "t"\n')
    assert check_dataset.main(["--config_file", str(run)]) == 1
    out = capsys.readouterr()
    assert f"error: {refused}" in out.out and "1 errors" in out.out, out.out


def test_blank_prompt_preservation_encodes_the_empty_prompt_with_each_items_references(edit_set, tmp_path):
    """An encoder that sees the references encodes the second prompt "" with the item's own references (what the
    pipeline encodes for an empty prompt with these images), cached per item as `@preserve`; the run trains."""
    out = tmp_path / "run"
    assert train_lora.main(edit_args(edit_set, out, "--blank_prompt_preservation", "true", "--max_train_steps", "2",
                                     "--sample_prompts", "", "--cache_text_encoder_outputs_to_disk", "true",
                                     "--dataset_config", copy_edit_dataset(edit_set, tmp_path))) == 0
    from library.data.caches import read_text_cache

    caches = sorted((tmp_path / "images").glob("0*_te.safetensors"))
    kept = [read_text_cache(str(c), "preserve")["embeds"] for c in caches]
    own = [read_text_cache(str(c), None)["embeds"] for c in caches]
    assert len(caches) == 8 and all(k.shape[0] < o.shape[0] for k, o in zip(kept, own))  # "" is shorter than its caption
    assert len({round(k.float().mean().item(), 4) for k in kept}) > 1  # each sees its own reference
    with open(out / "qedit_log.csv") as f:
        assert "loss_preservation" in f.readline()


def copy_edit_dataset(edit_set, tmp_path) -> str:
    control = shutil.copytree(edit_set["edit_control_dir"], tmp_path / "control")
    images = shutil.copytree(edit_set["edit_image_dir"], tmp_path / "images")
    ds = tmp_path / "ds.toml"
    ds.write_text(f'[general]\nresolution = 32\ncaption_extension = ".txt"\n[[datasets]]\n[[datasets.subsets]]\n'
                  f'image_dir = "{images}"\ncontrol_directory = "{control}"\n')
    return str(ds)
