"""train_lora.py on the tiny FLUX.2 [klein]: trains, saves a LoRA that changes the output, renders
samples; the saved LoRA, merged or converted by the tools, gives the runtime LoRA's prediction."""

import csv
import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import train_lora
from library.models.flux2.family import Flux2Family
from networks.lora import LoRANetwork
from tests.test_train_lora import sample_png

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read_losses(out, name):
    with open(os.path.join(out, f"{name}_log.csv")) as f:
        return [float(r["loss"]) for r in csv.DictReader(f)]


@pytest.fixture(scope="module")
def trained(tiny_set, tmp_path_factory):
    """One short run (fp8_scaled base, fp32 compute): the output folder."""
    out = tmp_path_factory.mktemp("flux2_run")
    code = train_lora.main([
        "--model_type", "flux2", "--pretrained_model_name_or_path", tiny_set["flux2_tiny"],
        "--ae", tiny_set["flux2_vae"], "--text_encoder", tiny_set["flux2_text_encoder"],
        "--dataset_config", tiny_set["dataset_config"], "--sample_prompts", tiny_set["sample_prompts"],
        "--output_dir", str(out), "--output_name", "klein", "--max_train_steps", "6", "--mixed_precision", "no",
        "--fp8_base", "--fp8_scaled", "--network_dim", "4", "--network_alpha", "4", "--optimizer_type", "AdamW",
        "--learning_rate", "3e-3", "--sample_at_first", "false", "--save_every_n_steps", "0",
        "--max_sequence_length", "48",
    ])
    assert code == 0
    return out


def test_flux2_klein_lora_trains_saves_and_samples(trained):
    losses = read_losses(trained, "klein")
    assert len(losses) == 6 and all(torch.isfinite(torch.tensor(losses)))
    tensors = load_file(trained / "klein.safetensors")
    assert any(k.startswith("lora_unet_double_blocks_0_img_attn_qkv.") for k in tensors)
    assert any(k.startswith("lora_unet_single_blocks_1_linear1.") for k in tensors)
    assert not any("modulation" in k or "_in_" in k for k in tensors)  # shared modulation, embedders: off
    assert sample_png(trained, "klein", "final").stat().st_size > 0


def tiny_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 12, 128, generator=g), {"embeds": torch.randn(1, 7, 96, generator=g)}


def test_flux2_saved_lora_loads_and_changes_the_prediction(tiny_set, trained):
    family = Flux2Family(tiny_set["flux2_tiny"])
    model = family.load_transformer(torch.float32)
    x, text = tiny_inputs()
    with torch.no_grad():
        before = family.predict(model, x, torch.tensor([0.5]), text, 3, 4, None)
        network = LoRANetwork(model, "flux2", 4, 4.0)
        network.load_weights(str(trained / "klein.safetensors"))
        network.apply()
        after = family.predict(model, x, torch.tensor([0.5]), text, 3, 4, None)
    change = ((after - before).norm() / before.norm()).item()
    assert change > 1e-4, change  # 6 steps from a zero lora_up: small, but not 0


@pytest.mark.parametrize("base_key", ["flux2_tiny", "flux2_diffusers"])
def test_flux2_merged_checkpoint_equals_runtime_lora(tiny_set, trained, tmp_path, base_key):
    """merge_lora.py into the BFL file and into the diffusers folder (the kohya LoRA's fused qkv split
    by rows there): load_flux2 of the result gives the runtime (unmerged) LoRA's prediction; and
    extract_lora.py recovers a LoRA from merged vs base that gives it again."""
    from tools import extract_lora, merge_lora

    lora = str(trained / "klein.safetensors")
    out = str(tmp_path / ("merged.safetensors" if base_key == "flux2_tiny" else "merged"))
    assert merge_lora.main(["--model", tiny_set[base_key], "--lora", f"{lora}:0.7", "--save_to", out]) == 0
    family = Flux2Family(tiny_set["flux2_tiny"])
    x, text = tiny_inputs(1)
    with torch.no_grad():
        model = family.load_transformer(torch.float32)
        network = LoRANetwork(model, "flux2", 4, 4.0, multiplier=0.7)
        network.load_weights(lora)
        network.apply()
        runtime = family.predict(model, x, torch.tensor([0.3]), text, 3, 4, None)
        merged = family.predict(Flux2Family(out).load_transformer(torch.float32), x, torch.tensor([0.3]), text, 3, 4, None)
    err = (merged - runtime).abs().max().item()
    assert err <= 1e-5, err

    extracted = str(tmp_path / "extracted.safetensors")  # kohya (BFL base) or diffusers names (folder)
    assert extract_lora.main(["--model", tiny_set[base_key], "--tuned", out, "--save_to", extracted, "--rank", "4"]) == 0
    with torch.no_grad():
        model = family.load_transformer(torch.float32)
        LoRANetwork.from_weights(model, "flux2", extracted).apply()
        again = family.predict(model, x, torch.tensor([0.3]), text, 3, 4, None)
    err = (again - merged).abs().max().item()
    assert err <= 1e-5, err


def test_flux2_generate_with_the_lora(tiny_set, trained, tmp_path, capsys):
    """The LoRA trained at max_sequence_length 48 renders at 48 where --max_sequence_length is left unset, with a
    note (its header's ss_trained_keys): it rendered at the default 512 without a word, other text embeddings."""
    from PIL import Image

    from tools import generate

    with safe_open(str(trained / "klein.safetensors"), "pt") as f:
        assert json.loads(f.metadata()["ss_trained_keys"]) == {"max_sequence_length": 48}
    code = generate.main([
        "--model_type", "flux2", "--model", tiny_set["flux2_tiny"], "--ae", tiny_set["flux2_vae"],
        "--text_encoder", tiny_set["flux2_text_encoder"], "--prompt", "a red cat --w 64 --h 48 --s 2 --g 2.5",
        "--dtype", "fp32", "--text_encoder_precision", "fp32", "--lora", f"{trained / 'klein.safetensors'}:0.8",
        "--out", str(tmp_path), "--device", "cpu",
    ])
    assert code == 0
    (png,) = tmp_path.glob("*.png")
    assert "was trained with max_sequence_length 48 (ss_trained_keys): rendering with it" in \
        capsys.readouterr().out
    assert Image.open(png).text["max_sequence_length"] == "48"  # the settings it rendered with


def test_memory_planner_takes_flux2_config_and_klein_presets(tiny_set, tmp_path, capsys):
    from library.models.flux2.model import FLUX2_KLEIN_4B, Flux2
    from tools import plan_memory

    config = tmp_path / "tiny.toml"
    config.write_text("\n".join(f'{k} = "{v}"' for k, v in {
        "model_type": "flux2", "pretrained_model_name_or_path": tiny_set["flux2_tiny"], "ae": tiny_set["flux2_vae"],
        "text_encoder": tiny_set["flux2_text_encoder"], "dataset_config": tiny_set["dataset_config"],
        "output_dir": tmp_path / "out"}.items()))
    assert plan_memory.main(["--config_file", str(config), "--vram", "12"]) == 0
    assert "fits with blocks_to_swap = 0" in capsys.readouterr().out
    assert plan_memory.main(["--preset", "flux2-klein-4b", "--vram", "16", "--resolution", "512",
                             "--base_precision", "bf16"]) == 0
    out = capsys.readouterr().out
    with torch.device("meta"):
        params = sum(p.numel() for p in Flux2(FLUX2_KLEIN_4B).parameters())
    assert 3.8e9 < params < 4.0e9 and f"base {params * 2 / 2**30:.2f}" in out  # bf16 base: 2 bytes a weight


def test_precision_doctor_runs_on_flux2_with_the_lora(tiny_set, trained, tmp_path, capsys):
    import json

    from tools import precision_doctor

    out = tmp_path / "report"
    rc = precision_doctor.main([
        "--model_type", "flux2", "--model", tiny_set["flux2_tiny"], "--lora", f"{trained / 'klein.safetensors'}:1.0",
        "--resolution", "64x48", "--timesteps", "0.7", "--text_len", "8", "--out", str(out), "--device", "cpu"])
    assert rc == 0 and "== LoRA ==" in capsys.readouterr().out
    data = json.loads((out / "report.json").read_text())
    assert data["grid"] == [3, 4] and set(data["modes"]) == set(precision_doctor.report_modes("cpu", with_lora=True))
    assert "NaN" not in json.dumps(data) and "lora_effect" in data  # every mode measured, the LoRA's survival too
