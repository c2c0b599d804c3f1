"""Z-Image Omni trains from configs/zimage_omni.toml on the tiny Omni repo with a control_directory
dataset (the references' latents and SigLIP features in every step), saves a LoRA that diffusers'
ZImageOmniPipeline.load_lora_weights loads with our runtime output, renders with tools/generate.py
--control_image, and the planner's zimage-omni preset counts references."""

import csv
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import train_lora
from library.models.zimage.omni_family import ZImageOmniFamily
from networks.lora import LoRANetwork
from tools.make_tiny_dataset import make_tiny_edit_dataset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def trained(tiny_set, tmp_path_factory):
    """Three steps from configs/zimage_omni.toml (AdamW, fp32 compute, fp8_scaled base as configured),
    a sample with its --ci reference at the end; every loss_at call recorded."""
    data = make_tiny_edit_dataset(str(tmp_path_factory.mktemp("omni_data")), count=4, size=32)
    prompts = tmp_path_factory.mktemp("omni_prompts") / "prompts.txt"  # 2 steps with CFG 2: the sample is not timed here
    prompts.write_text(f"make the shape red --ci {data['edit_control_dir']}/000.png --w 32 --h 32 --s 2 --g 2.0 --n blurry\n")
    out = tmp_path_factory.mktemp("omni_run")
    seen = []
    real = ZImageOmniFamily.loss_at

    def recording(self, model, latents, text, *args, control=None, **kwargs):
        seen.append(([tuple(c.shape) for c in control or []], sorted(text), text["siglip_grid"].tolist()))
        return real(self, model, latents, text, *args, control=control, **kwargs)

    root = tiny_set["zimage_omni"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ZImageOmniFamily, "loss_at", recording)
        code = train_lora.main([
            "--config_file", os.path.join(ROOT, "configs", "zimage_omni.toml"),
            "--pretrained_model_name_or_path", root, "--ae", tiny_set["flux_vae"], "--text_encoder", root,
            "--dataset_config", data["edit_dataset_config"], "--sample_prompts", str(prompts),
            "--output_dir", str(out), "--logging_dir", str(out / "logs"), "--output_name", "omni", "--max_train_steps", "3", "--optimizer_type", "AdamW",
            "--learning_rate", "3e-3", "--mixed_precision", "no", "--save_every_n_steps", "0",
            "--sample_every_n_steps", "0", "--validate_every_n_steps", "0", "--save_state", "false",
            "--cache_latents_to_disk", "false", "--cache_text_encoder_outputs_to_disk", "false",
            "--network_dim", "4", "--network_alpha", "4", "--lr_warmup_steps", "0"])
    assert code == 0
    return out, seen


def test_omni_lora_trains_from_its_config_with_references(trained):
    out, seen = trained
    with open(out / "omni_log.csv") as f:
        losses = [float(r["loss"]) for r in csv.DictReader(f)]
    print("zimage_omni tiny losses", losses)
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    # batch 2, one 32x32 reference each: its latents [2, 16, 4, 4] and its 4x4 SigLIP grid (8-pixel patches)
    assert len(seen) == 3 and all(s == ([(2, 16, 4, 4)], ["embeds", "segments", "siglip", "siglip_grid"],
                                        [[[4, 4]], [[4, 4]]]) for s in seen), seen[0]
    tensors = load_file(out / "omni.safetensors")
    assert any(k.startswith("lora_unet_layers_0_attention_to_q.") for k in tensors)
    with safe_open(str(out / "omni.safetensors"), "pt") as f:
        meta = f.metadata()
    assert meta["ss_base_model_version"] == "zimage-omni" and meta["ss_base_precision"] == "fp8_scaled"
    assert meta["modelspec.architecture"] == "Z-Image-Omni/lora"  # ours, in musubi-tuner's style
    assert any(p.endswith(".png") for p in os.listdir(out))  # the sample (target | reference)


@torch.no_grad()
def test_converted_lora_loads_in_omni_pipeline_and_matches_runtime(tiny_set, trained, tmp_path):
    """convert_lora --to diffusers -> ZImageOmniPipeline.load_lora_weights on diffusers' transformer with
    the same weights: its omni-mode output (one reference) equals ours with the runtime LoRA."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImageOmniPipeline, ZImageTransformer2DModel

    from tests.test_zimage_omni import diffusers_omni, omni_inputs, ours_omni
    from tools import convert_lora

    lora = trained[0] / "omni.safetensors"
    converted = tmp_path / "diffusers.safetensors"
    assert convert_lora.main([str(lora), str(converted), "--to", "diffusers"]) == 0
    x = omni_inputs(1, (4, 5), [(3, 4)], [[5, 9, 3]], [[(4, 4)]])
    model = ZImageOmniFamily(tiny_set["zimage_omni"]).load_transformer(torch.float32)
    base = ours_omni(model, *x)
    LoRANetwork.from_weights(model, "zimage", str(lora)).apply()
    ours = ours_omni(model, *x)

    reference = ZImageTransformer2DModel.from_pretrained(os.path.join(tiny_set["zimage_omni"], "transformer")).eval()
    pipe = ZImageOmniPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=None, text_encoder=None, tokenizer=None,
                              transformer=reference, siglip=None, siglip_processor=None)
    pipe.load_lora_weights(str(converted))
    theirs = diffusers_omni(reference, *x)
    rel = ((theirs - ours).norm() / ours.norm()).item()
    effect = ((ours - base).norm() / base.norm()).item()
    print(f"ZImageOmniPipeline.load_lora_weights: relative error {rel:.2e}, LoRA effect {effect:.2e}")
    assert effect > 1e-4, effect  # the LoRA does something, so the comparison means something
    assert rel < 1e-5, rel


def test_generate_renders_with_a_reference(tiny_set, trained, tmp_path):
    from tools import generate
    from tools.make_tiny_dataset import draw

    reference = tmp_path / "ref.png"
    draw("circle", (128, 128, 128), (255, 255, 255), (48, 32)).save(reference)
    out = tmp_path / "gen"
    root = tiny_set["zimage_omni"]
    code = generate.main(["--model_type", "zimage_omni", "--model", root, "--ae", tiny_set["flux_vae"],
                          "--text_encoder", root, "--prompt", "make the shape red", "--control_image", str(reference),
                          "--width", "48", "--height", "32", "--steps", "2", "--dtype", "fp32", "--out", str(out),
                          "--lora", f"{trained[0] / 'omni.safetensors'}:0.8"])
    assert code == 0
    assert len([p for p in os.listdir(out) if p.endswith(".png")]) == 1


def test_planner_preset_counts_references():
    """The zimage-omni preset (6.51 B transformer on meta) plans one step with and without a reference:
    a reference adds its latent tokens, one caption segment and 256 SigLIP tokens to every block, and
    its SigLIP refiner blocks are in the swap order. (tools/plan_memory.py --preset zimage-omni --vram 24
    --references 2: training peak 15.1 GiB fp8_scaled with checkpointing, 21.0 GiB bf16.)"""
    from library.training.memory_plan import text_tokens_for, training_plan
    from tools.plan_memory import PresetFamily, default_args

    family = PresetFamily("zimage-omni")
    args = default_args("zimage_omni")
    plans = [training_plan(family, args, 256, 256, 1, text_tokens_for(family, args, n, 256, 256), references=n)
             for n in (0, 1)]
    assert len(plans[0].block_bytes) == 2 + 2 + 2 + 30  # noise, context, SigLIP refiners, main layers
    print("zimage-omni activations at 256 px without / with a reference (MiB):",
          [round(p.activations / 2**20) for p in plans])
    assert plans[1].activations > 1.5 * plans[0].activations
