"""FLUX.1 Kontext edit LoRA end to end on the tiny real-format FLUX: a paired dataset (grey shape
-> red shape, "make the shape red") trains with the references in every step, the loss falls,
and the sample renders target | reference."""

import os

import pytest
import torch
from PIL import Image
from safetensors import safe_open

import train_lora
from library.models.flux1.kontext import FluxKontextFamily
from tests.test_train_lora import ROOT, read_losses, sample_png
from tools.make_tiny_dataset import make_tiny_edit_dataset


@pytest.fixture(scope="module")
def edit_set(tiny_set, tmp_path_factory):
    return {**tiny_set, **make_tiny_edit_dataset(str(tmp_path_factory.mktemp("edit")), count=8, size=32)}


@pytest.fixture(autouse=True)
def tiny_preferred_resolutions(monkeypatch):
    """Samples fit a reference to Kontext's preferred ~1 MP sizes (sample_control_bucket); here to the tiny
    set's 32x32, as the training references are (a 1 MP reference made these runs minutes long)."""
    from library.models.flux1 import kontext

    monkeypatch.setattr(kontext, "PREFERRED_RESOLUTIONS", [(32, 32)])


def kontext_args(edit_set, out, *extra):
    return [
        "--config_file", os.path.join(ROOT, "configs", "quickstart.toml"), "--model_type", "flux_kontext",
        "--pretrained_model_name_or_path", edit_set["flux_bfl"], "--ae", edit_set["flux_vae_single"],
        "--clip_l", edit_set["clip_l"], "--t5xxl", edit_set["t5xxl"],
        "--dataset_config", edit_set["edit_dataset_config"], "--sample_prompts", edit_set["edit_sample_prompts"],
        "--output_dir", str(out), "--output_name", "kontext", "--sample_at_first", "false",
        "--save_every_n_steps", "0", *extra,
    ]  # fmt: skip


def test_kontext_edit_lora_loss_falls_with_references_in_every_step(edit_set, tmp_path, monkeypatch):
    seen, validated = [], []
    real = FluxKontextFamily.loss_at

    def recording(self, *args, control=None, **kwargs):  # training steps (grad) and val_loss (no grad)
        (seen if torch.is_grad_enabled() else validated).append([tuple(c.shape) for c in control or []])
        return real(self, *args, control=control, **kwargs)

    monkeypatch.setattr(FluxKontextFamily, "loss_at", recording)
    with open(edit_set["edit_dataset_config"]) as f:  # 2 of the 8 pairs held out for val_loss
        (tmp_path / "ds.toml").write_text(f.read().replace("[general]\n", "[general]\nvalidation_split = 0.25\n"))
    out = tmp_path / "run"
    code = train_lora.main(kontext_args(edit_set, out, "--max_train_steps", "40", "--optimizer_type", "AdamW",
                                        "--optimizer_args", "--learning_rate", "3e-3", "--dataset_config",
                                        str(tmp_path / "ds.toml"), "--validate_every_n_steps", "20"))
    assert code == 0
    assert len(seen) == 40 and all(s == [(2, 16, 4, 4)] for s in seen)  # batch 2, one 32x32 reference each
    assert len(validated) == 2 * 2 * 5 and all(v == [(1, 16, 4, 4)] for v in validated)  # 2 images x 5 sigmas, twice
    losses = read_losses(out, "kontext")
    first, last = sum(losses[:8]) / 8, sum(losses[-8:]) / 8
    print(f"kontext tiny edit run: loss {first:.4f} -> {last:.4f}")
    assert last < 0.9 * first, (first, last)
    with safe_open(str(out / "kontext.safetensors"), "pt") as f:
        assert f.metadata()["ss_base_model_version"] == "flux1-kontext-dev"
        assert f.metadata()["modelspec.architecture"] == "Flux.1-dev/lora"  # musubi-tuner's for its Kontext LoRAs
    with Image.open(sample_png(out, "kontext", "final")) as sample:
        panels = sample.text["panels"].split(",")  # the target on each sampled base, then the reference
        assert panels[-1] == "reference" and len(panels) >= 2 and sample.size[0] == 32 * len(panels)


def test_flux_refuses_a_paired_dataset_in_one_line(edit_set, tmp_path, capsys):
    args = kontext_args(edit_set, tmp_path / "run", "--model_type", "flux", "--max_train_steps", "1")
    assert train_lora.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model_type flux takes no reference images" in err[0], err


def test_sample_prompts_with_references_for_a_model_without_them_are_refused_before_any_model_loads(edit_set, tmp_path,
                                                                                                    capsys):
    """Old: an edit model's prompt file (--ci) on FLUX.1 was refused only once train_lora.py had loaded the text
    encoders (~13 s at tiny size, minutes at full size); the web UI's Validate and tools/plan_memory.py passed it.
    check_before_caching, the one function all three run first, refuses it now."""
    import toml

    from library.ui.config_check import check
    from tests.ui_support import tiny_job_settings
    from tools import plan_memory

    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"make the shape red --ci {os.path.join(edit_set['edit_control_dir'], '000.png')}\n")
    line = f"{prompts}: prompt 'make the shape red' has 1 --ci image(s), but model_type flux takes no reference images"
    settings = tiny_job_settings(edit_set, steps=1, sample_prompts=str(prompts), sample_every_n_steps=1)
    answer = check(toml.dumps(settings), str(tmp_path / "out"))
    assert (answer["ok"], answer["error"]) == (False, line), answer
    config = tmp_path / "config.toml"
    config.write_text(toml.dumps({**settings, "output_dir": str(tmp_path / "out")}))
    capsys.readouterr()
    assert plan_memory.main(["--config_file", str(config), "--vram", "8", "--base_precision", "bf16"]) == 2
    assert capsys.readouterr().err.strip() == f"error: {line}"


def test_generate_takes_references_from_the_option_and_the_prompt_line(edit_set, tmp_path, capsys):
    from tools import generate

    def run(out, *extra):
        common = ["--model_type", "flux_kontext", "--model", edit_set["flux_bfl"], "--ae", edit_set["flux_vae_single"],
                  "--clip_l", edit_set["clip_l"], "--t5xxl", edit_set["t5xxl"], "--t5xxl_max_token_length", "32",
                  "--width", "32", "--height", "32", "--steps", "2", "--dtype", "fp32", "--seed", "0", "--out", str(tmp_path / out)]
        assert generate.main([*common, *extra]) == 0
        (name,) = os.listdir(tmp_path / out)
        with Image.open(tmp_path / out / name) as image:
            return torch.tensor(list(image.getdata()), dtype=torch.float32), image.text["control_images"]

    grey = os.path.join(edit_set["edit_control_dir"], "000.png")
    plain, none = run("plain", "--prompt", "make the shape red")
    option, named = run("option", "--prompt", "make the shape red", "--control_image", grey)
    line, _ = run("line", "--prompt", f"make the shape red --ci {grey}")
    assert (none, named) == ("", "000.png") and torch.equal(option, line)
    assert (option - plain).abs().mean() > 0.1  # the reference changes the picture (0 if ignored)
    code = generate.main(["--model_type", "flux", "--model", edit_set["flux_bfl"], "--ae", edit_set["flux_vae_single"],
                          "--clip_l", edit_set["clip_l"], "--t5xxl", edit_set["t5xxl"], "--prompt", f"x --ci {grey}"])
    assert code == 2 and "model_type flux takes no reference images" in capsys.readouterr().err


def test_references_trained_at_another_size_than_the_pipeline_gives_them_are_said(edit_set, tmp_path, capsys,
                                                                                 monkeypatch):
    """Kontext trains a reference at its target's bucket, and its pipeline (ComfyUI's FluxKontextImageScale too)
    fits it to ~1 MP: trained at 512 px, the LoRA learned references of a quarter of the tokens it renders with,
    without a word (on the learned tiny base an edit LoRA then rendered 0 of 12 held-out references right). One
    warning now; none where the sizes agree (at the pipeline's resolution; FLUX.2 keeps a reference's own size
    both ways)."""
    from types import SimpleNamespace

    from library.data.check import references_sized_apart
    from library.models import flux1
    from library.models.flux2.family import Flux2Family

    monkeypatch.setattr(flux1.kontext, "PREFERRED_RESOLUTIONS", [(1024, 1024)])
    kontext = FluxKontextFamily("model", "vae")
    at_512 = [SimpleNamespace(bucket=(512, 512), control_buckets=[(512, 512)]) for _ in range(3)]
    assert references_sized_apart(at_512, kontext.sample_control_bucket) == (
        "3 of 3 reference images train at another size than samples and the model's pipeline give them (the first: "
        "512x512 in training, 1024x1024 to render): the LoRA learns references of 0.25x the tokens it renders with; "
        "train at the pipeline's resolution (its references' ~1.0 MP) for an edit LoRA that renders as trained")
    at_1024 = [SimpleNamespace(bucket=(1024, 1024), control_buckets=[(1024, 1024)])]
    assert references_sized_apart(at_1024, kontext.sample_control_bucket) is None
    flux2 = Flux2Family("model", "vae", text_encoder="te")
    assert references_sized_apart(at_512, flux2.sample_control_bucket) is None
    monkeypatch.setattr(flux1.kontext, "PREFERRED_RESOLUTIONS", [(64, 64)])  # the tiny set's 32 px: a quarter
    with pytest.warns(UserWarning, match="8 of 8 reference images train at another size than samples") as said:
        assert train_lora.main(kontext_args(edit_set, tmp_path / "run", "--max_train_steps", "1", "--sample_prompts",
                                            "")) == 0
    assert sum("reference images train at another size" in str(w.message) for w in said) == 1
    from tools import check_dataset  # with the training config: as training warns

    config = tmp_path / "kontext.toml"
    config.write_text("\n".join(f'{k} = "{v}"' for k, v in {
        "model_type": "flux_kontext", "pretrained_model_name_or_path": edit_set["flux_bfl"],
        "ae": edit_set["flux_vae_single"], "clip_l": edit_set["clip_l"], "t5xxl": edit_set["t5xxl"],
        "dataset_config": edit_set["edit_dataset_config"], "output_dir": tmp_path / "out"}.items()))
    capsys.readouterr()
    assert check_dataset.main(["--config_file", str(config)]) == 0
    assert "8 of 8 reference images train at another size than samples" in capsys.readouterr().out
