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
from tests.test_train_lora import ROOT, read_losses
from tools.make_tiny_dataset import make_tiny_edit_dataset


@pytest.fixture(scope="module")
def edit_set(tiny_set, tmp_path_factory):
    return {**tiny_set, **make_tiny_edit_dataset(str(tmp_path_factory.mktemp("edit")), count=8, size=32)}


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
    seen = []
    real = FluxKontextFamily.predict

    def recording(self, model, x_t, sigmas, text, h, w, guidance, control=None):
        if torch.is_grad_enabled():  # training steps, not the sample
            seen.append([tuple(c.shape) for c in control or []])
        return real(self, model, x_t, sigmas, text, h, w, guidance, control)

    monkeypatch.setattr(FluxKontextFamily, "predict", recording)
    out = tmp_path / "run"
    code = train_lora.main(kontext_args(edit_set, out, "--max_train_steps", "40", "--optimizer_type", "AdamW",
                                        "--optimizer_args", "--learning_rate", "3e-3"))
    assert code == 0
    assert len(seen) == 40 and all(s == [(2, 16, 4, 4)] for s in seen)  # batch 2, one 32x32 reference each
    losses = read_losses(out, "kontext")
    first, last = sum(losses[:8]) / 8, sum(losses[-8:]) / 8
    print(f"kontext tiny edit run: loss {first:.4f} -> {last:.4f}")
    assert last < 0.9 * first, (first, last)
    with safe_open(str(out / "kontext.safetensors"), "pt") as f:
        assert f.metadata()["ss_base_model_version"] == "flux1-kontext-dev"
    with Image.open(out / "kontext_final_00.png") as sample:
        panels = sample.text["panels"].split(",")  # the target on each sampled base, then the reference
        assert panels[-1] == "reference" and len(panels) >= 2 and sample.size[0] == 32 * len(panels)


def test_flux_refuses_a_paired_dataset_in_one_line(edit_set, tmp_path, capsys):
    args = kontext_args(edit_set, tmp_path / "run", "--model_type", "flux", "--max_train_steps", "1")
    assert train_lora.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model_type flux takes no reference images" in err[0], err
