"""Krea 2 as a trainable family on the tiny models: train_lora.py trains from the family's defaults and
saves a kohya LoRA with musubi-tuner's names; the LoRA converted with tools/convert_lora.py --to
diffusers loads in Krea2Pipeline (load_lora_weights) and gives our runtime output; merge_lora merges it
into both checkpoint layouts; generate.py renders; the Raw / Turbo schedules are the pipeline's."""

import csv
import os

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import train_lora
from library.models.krea2.family import Krea2Family
from library.models.latents import pack_latents, unpack_latents
from networks.lora import LoRANetwork
from tests.test_train_lora import sample_png


def read_losses(out, name):
    with open(os.path.join(out, f"{name}_log.csv")) as f:
        return [float(r["loss"]) for r in csv.DictReader(f)]


def train_args(tiny_set, out, name, steps=2, extra=()):
    return [
        "--model_type", "krea2", "--pretrained_model_name_or_path", tiny_set["krea2_diffusers"],
        "--ae", tiny_set["qwen_image_vae"], "--text_encoder", tiny_set["krea2_text_encoder"],
        "--dataset_config", tiny_set["dataset_config"], "--output_dir", str(out), "--output_name", name,
        "--max_train_steps", str(steps), "--mixed_precision", "no", "--network_dim", "4", "--network_alpha", "4",
        "--optimizer_type", "AdamW", "--learning_rate", "3e-3", "--save_every_n_steps", "0", *extra,
    ]


@pytest.fixture(scope="module")
def trained(tiny_set, tmp_path_factory):
    """Four steps from krea2's defaults (krea2_shift), samples at the end: the output folder."""
    out = tmp_path_factory.mktemp("krea2_run")
    args = train_args(tiny_set, out, "krea2", steps=4, extra=("--sample_prompts", tiny_set["sample_prompts"]))
    assert train_lora.main(args) == 0
    return out


def test_krea2_lora_trains_saves_and_samples(trained):
    losses = read_losses(trained, "krea2")
    print("krea2 tiny losses", losses)
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))
    tensors = load_file(trained / "krea2.safetensors")
    names = {k.split(".")[0] for k in tensors}
    # musubi-tuner's kohya names: the main and the text-fusion blocks' Linears by default, 2 x 8 + 4 x 8
    assert "lora_unet_blocks_0_attn_wq" in names and "lora_unet_blocks_1_mlp_down" in names
    assert "lora_unet_txtfusion_layerwise_blocks_0_attn_gate" in names and len(names) == 48
    assert not any(n.startswith(("lora_unet_first", "lora_unet_last", "lora_unet_tproj")) for n in names)
    with safe_open(str(trained / "krea2.safetensors"), "pt") as f:
        meta = f.metadata()
    assert meta["ss_base_model_version"] == "krea2-raw" and meta["ss_timestep_sampling"] == "krea2_shift"
    assert meta["modelspec.architecture"] == "Krea-2/lora"  # musubi-tuner's
    assert sample_png(trained, "krea2", "final").stat().st_size > 0


def runtime_velocity(model, latents, txt, sigma):
    h, w = latents.shape[2] // 2, latents.shape[3] // 2
    return unpack_latents(model(pack_latents(latents), txt, sigma, h, w), 2 * h, 2 * w)


@torch.no_grad()
def test_converted_lora_loads_in_krea2_pipeline_and_matches_runtime(tiny_set, trained, tmp_path):
    """convert_lora --to diffusers -> Krea2Pipeline.load_lora_weights on diffusers' transformer with the
    same weights: its velocity equals ours with the runtime (unmerged) LoRA."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Krea2Pipeline, Krea2Transformer2DModel

    from library.models.krea2.model import joint_positions
    from tools import convert_lora

    lora = trained / "krea2.safetensors"
    converted = tmp_path / "diffusers.safetensors"
    assert convert_lora.main([str(lora), str(converted), "--to", "diffusers"]) == 0
    assert all(k.startswith("transformer.") for k in load_file(converted))

    g = torch.Generator().manual_seed(0)
    latents, txt, sigma = torch.randn(1, 16, 6, 8, generator=g), torch.randn(1, 5, 3, 32, generator=g), torch.tensor([0.4])
    model = Krea2Family(tiny_set["krea2_diffusers"]).load_transformer(torch.float32)
    base = runtime_velocity(model, latents, txt, sigma)
    LoRANetwork.from_weights(model, "krea2", str(lora)).apply()
    ours = runtime_velocity(model, latents, txt, sigma)

    reference = Krea2Transformer2DModel.from_pretrained(tiny_set["krea2_diffusers"]).eval()
    pipe = Krea2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=None, text_encoder=None, tokenizer=None,
                         transformer=reference)
    pipe.load_lora_weights(str(converted))
    out = reference(pack_latents(latents), txt, sigma, joint_positions(5, 3, 4).float(), return_dict=False)[0]
    theirs = unpack_latents(out, 6, 8)
    rel = ((theirs - ours).norm() / ours.norm()).item()
    effect = ((ours - base).norm() / base.norm()).item()
    print(f"Krea 2 load_lora_weights: relative error {rel:.2e}, LoRA effect {effect:.2e}")
    assert effect > 1e-4, effect  # the LoRA does something, so the comparison means something
    assert rel < 1e-5, rel


@torch.no_grad()
def test_merge_lora_into_both_layouts_equals_the_runtime_lora(tiny_set, trained, tmp_path):
    from library.models.krea2.checkpoint import load_krea2
    from tools import merge_lora

    lora = trained / "krea2.safetensors"
    g = torch.Generator().manual_seed(1)
    latents, txt, sigma = torch.randn(1, 16, 4, 6, generator=g), torch.randn(1, 4, 3, 32, generator=g), torch.tensor([0.7])
    model = load_krea2(tiny_set["krea2"])
    LoRANetwork.from_weights(model, "krea2", str(lora), multiplier=0.8).apply()
    want = runtime_velocity(model, latents, txt, sigma)
    for name, base in (("single.safetensors", tiny_set["krea2"]), ("folder", tiny_set["krea2_diffusers"])):
        merged = tmp_path / name
        assert merge_lora.main(["--model", base, "--lora", f"{lora}:0.8", "--save_to", str(merged)]) == 0
        got = runtime_velocity(load_krea2(str(merged)), latents, txt, sigma)
        assert ((got - want).norm() / want.norm()).item() < 1e-5, name


def test_generate_renders_with_the_tiny_model(tiny_set, trained, tmp_path):
    from tools import generate

    out = tmp_path / "gen"
    code = generate.main(["--model_type", "krea2", "--model", tiny_set["krea2"], "--ae", tiny_set["qwen_image_vae"],
                          "--text_encoder", tiny_set["krea2_text_encoder"], "--prompt", "a red square --s 3",
                          "--width", "64", "--height", "48", "--dtype", "fp32", "--out", str(out),
                          "--lora", f"{trained / 'krea2.safetensors'}:0.8"])
    assert code == 0
    pngs = [p for p in os.listdir(out) if p.endswith(".png")]
    assert len(pngs) == 1 and (out / pngs[0]).stat().st_size > 0


def test_generate_takes_the_releases_sample_defaults(tiny_set, tmp_path):
    """Without --steps / --guidance, Turbo renders as its pipeline (8 steps, no CFG): generate.py read the
    class's defaults, Raw's 28 steps at CFG 4.5, whatever model_version said."""
    from PIL import Image

    from tools import generate

    out = tmp_path / "gen"
    assert generate.main(["--model_type", "krea2", "--model", tiny_set["krea2"], "--ae", tiny_set["qwen_image_vae"],
                          "--text_encoder", tiny_set["krea2_text_encoder"], "--model_version", "krea2-turbo",
                          "--prompt", "a red square", "--width", "32", "--height", "32", "--dtype", "fp32",
                          "--seed", "0", "--out", str(out)]) == 0
    with Image.open(out / "000_0.png") as png:
        assert (png.text["steps"], png.text["guidance"]) == ("8", "0.0")


@pytest.mark.parametrize("version", ["krea2-raw", "krea2-turbo"])
def test_sample_schedule_is_the_pipelines(tiny_set, version):
    """Krea2Pipeline's schedule: FlowMatchEulerDiscreteScheduler with dynamic shifting on linspace(1, 1/n, n),
    mu from the 256 / 6400 token line (Raw) or fixed at 1.15 (Turbo, is_distilled)."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.krea2.pipeline_krea2 import calculate_shift

    from library.models import flow_matching as fm

    family = Krea2Family(tiny_set["krea2"], model_version=version)
    tokens, steps = 4096, 8  # 1024 px
    ours = fm.inference_sigmas(steps, tokens, family.arch, sampling=family.inference_sampling())
    mu = 1.15 if version == "krea2-turbo" else calculate_shift(tokens, 256, 6400, 0.5, 1.15)
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True)
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
    assert float((ours - scheduler.sigmas).abs().max()) < 1e-6
    assert (family.sample_steps, family.sample_guidance) == ((8, 0.0) if version == "krea2-turbo" else (28, 4.5))


def test_version_from_the_files(tiny_set, tmp_path):
    """model_index.json's is_distilled (the tiny pipeline folder: Raw), else a file named turbo."""
    assert Krea2Family(tiny_set["krea2_diffusers"]).version == "krea2-raw"
    turbo = tmp_path / "turbo.safetensors"
    turbo.write_bytes(open(tiny_set["krea2"], "rb").read())
    assert Krea2Family(str(turbo)).version == "krea2-turbo"
    with pytest.raises(ValueError, match="model_version 'krea2-dev': expected krea2-raw or krea2-turbo"):
        Krea2Family(str(turbo), model_version="krea2-dev")


def test_kohya_diffusers_kohya_round_trip_and_lora_info(trained, tmp_path):
    """convert_lora kohya -> diffusers -> kohya gives back the tensors (a rename, nothing fused), and
    lora_info names the architecture and block counts in both namings."""
    from tools import convert_lora, lora_info

    lora, there, back = trained / "krea2.safetensors", tmp_path / "d.safetensors", tmp_path / "k.safetensors"
    assert convert_lora.main([str(lora), str(there), "--to", "diffusers"]) == 0
    assert convert_lora.main([str(there), str(back), "--to", "kohya"]) == 0
    a, b = load_file(lora), load_file(back)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for path in (lora, there):
        modules = lora_info._modules(list(load_file(path)))
        assert lora_info.arch_of(modules)[0] == "krea2"
        assert lora_info.info_block_counts(modules, "krea2") == {"block": 2, "layerwise": 2, "refiner": 2}
