"""Qwen-Image-2.1 as a trainable family on the tiny models: train_lora.py trains from the family's
defaults (flux_shift: the pipeline's mu line) and saves a kohya LoRA with diffusers module names; the
LoRA converted with tools/convert_lora.py --to diffusers loads in QwenImage21Pipeline (load_lora_weights)
and gives our runtime output; merge_lora merges it into both checkpoint layouts; generate.py renders;
the sample schedule is the pipeline's."""

import csv
import os

import numpy as np
import torch
import pytest
from safetensors import safe_open
from safetensors.torch import load_file

import train_lora
from library.models.qwen_image21.family import QwenImage21Family
from networks.lora import LoRANetwork
from tests.test_train_lora import sample_png


def read_losses(out, name):
    with open(os.path.join(out, f"{name}_log.csv")) as f:
        return [float(r["loss"]) for r in csv.DictReader(f)]


@pytest.fixture(scope="module")
def trained(tiny_set, tmp_path_factory):
    """Four steps from qwen_image21's defaults, samples at the end: the output folder."""
    out = tmp_path_factory.mktemp("qi21_run")
    args = ["--model_type", "qwen_image21", "--pretrained_model_name_or_path", tiny_set["qwen_image21"],
            "--ae", tiny_set["qwen_image21_vae"], "--text_encoder", tiny_set["qwen_image21_text_encoder"],
            "--dataset_config", tiny_set["dataset_config"], "--output_dir", str(out), "--output_name", "qi21",
            "--max_train_steps", "4", "--mixed_precision", "no", "--network_dim", "4", "--network_alpha", "4",
            "--optimizer_type", "AdamW", "--learning_rate", "3e-3", "--save_every_n_steps", "0",
            "--sample_prompts", tiny_set["sample_prompts"]]
    assert train_lora.main(args) == 0
    return out


def test_qwen_image21_lora_trains_saves_and_samples(trained):
    losses = read_losses(trained, "qi21")
    print("qwen_image21 tiny losses", losses)
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))
    names = {k.split(".")[0] for k in load_file(trained / "qi21.safetensors")}
    # diffusers module paths as kohya names: 2 blocks x (4 attention + 3 SwiGLU) Linears by default
    assert "lora_unet_transformer_blocks_0_attn_to_q" in names and "lora_unet_transformer_blocks_1_img_mlp_gate_layer" in names
    assert len(names) == 14 and not any("modulation" in n or "img_in" in n for n in names)
    with safe_open(str(trained / "qi21.safetensors"), "pt") as f:
        meta = f.metadata()
    assert meta["ss_base_model_version"] == "qwen-image-2.1" and meta["ss_timestep_sampling"] == "flux_shift"
    assert meta["modelspec.architecture"] == "Qwen-Image-2.1/lora"  # ours, in musubi-tuner's style
    assert sample_png(trained, "qi21", "final").stat().st_size > 0


def runtime_velocity(model, tokens, txt, sigma, h, w):
    return model(tokens, txt, sigma, h, w)


@torch.no_grad()
def test_converted_lora_loads_in_the_pipeline_and_matches_runtime(tiny_set, trained, tmp_path):
    """convert_lora --to diffusers -> QwenImage21Pipeline.load_lora_weights on diffusers' transformer with
    the same weights: its velocity equals ours with the runtime (unmerged) LoRA."""
    from diffusers import QwenImage21Transformer2DModel
    from tests.test_qwen_image21_text import pipeline

    from tools import convert_lora

    lora = trained / "qi21.safetensors"
    converted = tmp_path / "diffusers.safetensors"
    assert convert_lora.main([str(lora), str(converted), "--to", "diffusers"]) == 0
    assert all(k.startswith("transformer.") for k in load_file(converted))

    g = torch.Generator().manual_seed(0)
    h, w = 4, 6
    tokens, txt, sigma = torch.randn(1, h * w, 64, generator=g), torch.randn(1, 5, 32, generator=g), torch.tensor([0.4])
    model = QwenImage21Family(tiny_set["qwen_image21"]).load_transformer(torch.float32)
    base = runtime_velocity(model, tokens, txt, sigma, h, w)
    LoRANetwork.from_weights(model, "qwen_image21", str(lora)).apply()
    ours = runtime_velocity(model, tokens, txt, sigma, h, w)

    reference = QwenImage21Transformer2DModel.from_pretrained(tiny_set["qwen_image21"]).eval()
    pipe = pipeline({"qwen_image21_text_encoder": tiny_set["qwen_image21_text_encoder"],
                     "qwen_image21_processor": os.path.join(os.path.dirname(tiny_set["qwen_image21"]), "processor")},
                    transformer=reference)
    pipe.load_lora_weights(str(converted))
    img_mask = torch.cat([torch.zeros(5, dtype=torch.bool), torch.ones(h * w // 4, dtype=torch.bool)])[None]
    theirs = reference(tokens, txt, sigma, [[(1, h, w)]], img_mask, return_dict=False)[0][:, -h * w:]
    rel = ((theirs - ours).norm() / ours.norm()).item()
    effect = ((ours - base).norm() / base.norm()).item()
    print(f"Qwen-Image-2.1 load_lora_weights: relative error {rel:.2e}, LoRA effect {effect:.2e}")
    assert effect > 1e-4, effect  # the LoRA does something, so the comparison means something
    assert rel < 1e-5, rel


@torch.no_grad()
def test_merge_lora_into_both_layouts_equals_the_runtime_lora(tiny_set, trained, tmp_path):
    from library.models.qwen_image21.checkpoint import load_qwen_image21
    from tools import merge_lora

    lora = trained / "qi21.safetensors"
    g = torch.Generator().manual_seed(1)
    h, w = 2, 6
    tokens, txt, sigma = torch.randn(1, h * w, 64, generator=g), torch.randn(1, 4, 32, generator=g), torch.tensor([0.7])
    model = load_qwen_image21(tiny_set["qwen_image21"])
    LoRANetwork.from_weights(model, "qwen_image21", str(lora), multiplier=0.8).apply()
    want = runtime_velocity(model, tokens, txt, sigma, h, w)
    for name, base in (("folder", tiny_set["qwen_image21"]), ("single.safetensors", tiny_set["qwen_image21_comfy"])):
        merged = tmp_path / name
        assert merge_lora.main(["--model", base, "--lora", f"{lora}:0.8", "--save_to", str(merged)]) == 0
        got = runtime_velocity(load_qwen_image21(str(merged)), tokens, txt, sigma, h, w)
        assert ((got - want).norm() / want.norm()).item() < 1e-5, name


def test_generate_renders_with_the_tiny_model(tiny_set, trained, tmp_path):
    from tools import generate

    out = tmp_path / "gen"
    code = generate.main(["--model_type", "qwen_image21", "--model", tiny_set["qwen_image21_comfy"],
                          "--ae", tiny_set["qwen_image21_vae"], "--text_encoder", tiny_set["qwen_image21_text_encoder"],
                          "--prompt", "a red square --s 3", "--width", "64", "--height", "48", "--dtype", "fp32",
                          "--out", str(out), "--lora", f"{trained / 'qi21.safetensors'}:0.8"])
    assert code == 0
    pngs = [p for p in os.listdir(out) if p.endswith(".png")]
    assert len(pngs) == 1 and (out / pngs[0]).stat().st_size > 0


def test_sample_schedule_is_the_pipelines():
    """QwenImage21Pipeline's schedule: linspace(1, 1/n, n) through FlowMatchEulerDiscreteScheduler with dynamic
    shifting, mu from its calculate_shift (fallbacks 256, 4096, 0.5, 1.15) for the latent-pixel count."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import calculate_shift

    from library.models import flow_matching as fm

    for tokens in (64 * 64, 48 * 80):  # 1024 px; 768 x 1280 px
        steps = 40
        ours = fm.inference_sigmas(steps, tokens, "qwen_image21")
        scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True)
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=calculate_shift(tokens))
        assert float((ours - scheduler.sigmas).abs().max()) < 1e-6


def test_kohya_diffusers_kohya_round_trip_and_lora_info(trained, tmp_path):
    """convert_lora kohya -> diffusers -> kohya gives back the tensors (a prefix change), and lora_info
    names the architecture and its blocks."""
    from tools import convert_lora, lora_info

    lora, there, back = trained / "qi21.safetensors", tmp_path / "d.safetensors", tmp_path / "k.safetensors"
    assert convert_lora.main([str(lora), str(there), "--to", "diffusers"]) == 0
    assert convert_lora.main([str(there), str(back), "--to", "kohya"]) == 0
    a, b = load_file(lora), load_file(back)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for path in (lora, there):
        modules = lora_info._modules(list(load_file(path)))
        assert lora_info.arch_of(modules)[0] == "qwen_image21"
        assert lora_info.info_block_counts(modules, "qwen_image21") == {"block": 2}


def test_planner_sizes_the_16x_vae_and_its_tokens(capsys):
    """The planner's latents follow the family's VAE (16x) and patch (1): at 512 px the sample's decode is
    of a 32 x 32 latent (a 512 px image), not 64 x 64 as an 8x VAE's would be (4x the memory)."""
    from library.training.memory_plan import vae_pass_peak
    from tools import plan_memory

    assert plan_memory.main(["--preset", "qwen-image-2.1", "--vram", "24", "--resolution", "512",
                             "--base_precision", "fp8_scaled"]) == 0
    out = capsys.readouterr().out
    planned = float(out.split("vae decode (peak) ")[1].split(")")[0].split(",")[0])
    vae = QwenImage21Family("unused").vae_on_meta()
    right, wrong = (vae_pass_peak(vae, 512, 512, 1, decode=True, downsample=d) / 2**30 for d in (16, 8))
    assert abs(planned - right) < 0.01 and wrong > 3 * right


def test_trains_from_configs_qwen_image21_toml(tiny_set, tmp_path):
    """configs/qwen_image21.toml itself (fp8_scaled base, gradient checkpointing, flux_shift) with the tiny
    files in its paths: two steps, fp32 compute, AdamW (AdamW8bit needs CUDA), the tiny sample prompts."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "configs", "qwen_image21.toml")) as f:
        text = f.read()
    text = (text.replace('"models/Qwen-Image-2.1/vae"', f'"{tiny_set["qwen_image21_vae"]}"')
                .replace('"models/Qwen-Image-2.1"', f'"{os.path.dirname(tiny_set["qwen_image21"])}"')
                .replace('"configs/dataset_example.toml"', f'"{tiny_set["dataset_config"]}"'))
    assert text.count(tiny_set["qwen_image21_vae"]) == 1 and "models/Qwen-Image-2.1" not in text
    config = tmp_path / "qwen_image21.toml"
    config.write_text(text)
    out = tmp_path / "run"
    assert train_lora.main(["--config_file", str(config), "--output_dir", str(out), "--logging_dir", str(out / "logs"),
                            "--max_train_steps", "2", "--mixed_precision", "no", "--optimizer_type", "AdamW",
                            "--network_dim", "4", "--network_alpha", "4", "--sample_every_n_steps", "0",
                            "--validate_every_n_steps", "0", "--save_every_n_steps", "0", "--save_state", "false",
                            "--sample_prompts", tiny_set["sample_prompts"]]) == 0  # the config's are 1024 px
    losses = read_losses(out, "my_qwen_image21_lora")
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    with safe_open(str(out / "my_qwen_image21_lora.safetensors"), "pt") as f:
        meta = f.metadata()
    assert meta["ss_base_precision"] == "fp8_scaled" and meta["ss_timestep_sampling"] == "flux_shift"


@torch.no_grad()
def test_sampling_equals_the_pipelines_denoising_loop(tiny_set):
    """family.sample_latents (true CFG 4, 3 steps, 64 x 96 px) against QwenImage21Pipeline.__call__ on the same
    tiny transformer, prompt embeddings and seed (output_type="latent"; its KV cache of the prompt's keys
    on, as by default): the same latents."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImage21Transformer2DModel

    from library.models.latents import to_tokens
    from tests.test_qwen_image21_text import pipeline

    g = torch.Generator().manual_seed(3)
    cond, neg = torch.randn(1, 7, 32, generator=g), torch.randn(1, 4, 32, generator=g)
    family = QwenImage21Family(tiny_set["qwen_image21"])
    model = family.load_transformer(torch.float32)
    ours = family.sample_latents(model, {"embeds": cond}, 96, 64, 3, 11, 4.0, negative_text={"embeds": neg})

    reference = QwenImage21Transformer2DModel.from_pretrained(tiny_set["qwen_image21"]).eval()
    pipe = pipeline({"qwen_image21_text_encoder": tiny_set["qwen_image21_text_encoder"],
                     "qwen_image21_processor": os.path.join(os.path.dirname(tiny_set["qwen_image21"]), "processor")},
                    transformer=reference, scheduler=FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True))
    theirs = pipe(prompt_embeds=cond, negative_prompt_embeds=neg, true_cfg_scale=4.0, height=64, width=96,
                  num_inference_steps=3, generator=torch.Generator().manual_seed(11), output_type="latent").images
    rel = ((to_tokens(ours) - theirs).norm() / theirs.norm()).item()
    print(f"Qwen-Image-2.1 sampling vs QwenImage21Pipeline: relative error {rel:.2e}")
    assert ours.shape == (1, 64, 4, 6) and rel < 1e-5



@torch.no_grad()
@pytest.mark.parametrize("scheduler", [{}, {"use_dynamic_shifting": False, "shift": 2.0}])
def test_a_shipped_sample_grid_and_scheduler_config_sample_as_the_pipeline(tiny_set, tmp_path, scheduler):
    """A folder whose model_index.json ships `sample_sigmas` (the Turbo checkpoint's few-step grid) samples on
    it, its length the default steps, and the folder's scheduler config shifts it, as QwenImage21Pipeline does
    (we ran 40 linspace steps with the spec's shift: 3.8e-2 relative on the tiny model)."""
    import json

    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImage21Transformer2DModel

    from library.models.latents import to_tokens
    from tests.test_qwen_image21_text import pipeline

    grid = [1.0, 0.9, 0.6, 0.3]
    (tmp_path / "transformer").symlink_to(tiny_set["qwen_image21"])
    index = {"_class_name": "QwenImage21Pipeline", "sample_sigmas": grid}
    (tmp_path / "model_index.json").write_text(json.dumps(index))
    config = {"use_dynamic_shifting": True, **scheduler}
    (tmp_path / "scheduler").mkdir()
    (tmp_path / "scheduler" / "scheduler_config.json").write_text(json.dumps(config))
    family = QwenImage21Family(str(tmp_path / "transformer"))
    cond = torch.randn(1, 7, 32, generator=torch.Generator().manual_seed(3))
    ours = family.sample_latents(family.load_transformer(torch.float32), {"embeds": cond}, 96, 64, family.sample_steps,
                                 11, family.sample_guidance)
    pipe = pipeline({"qwen_image21_text_encoder": tiny_set["qwen_image21_text_encoder"],
                     "qwen_image21_processor": os.path.join(os.path.dirname(tiny_set["qwen_image21"]), "processor")},
                    transformer=QwenImage21Transformer2DModel.from_pretrained(tiny_set["qwen_image21"]).eval(),
                    scheduler=FlowMatchEulerDiscreteScheduler(**config))
    pipe.register_to_config(sample_sigmas=grid)
    theirs = pipe(prompt_embeds=cond, height=64, width=96, generator=torch.Generator().manual_seed(11),
                  output_type="latent").images
    rel = ((to_tokens(ours) - theirs).norm() / theirs.norm()).item()
    assert family.sample_steps == pipe.num_timesteps == 4 and rel < 1e-5, rel

def test_a_comfyui_lora_on_the_fused_gate_up_converts_to_ours_by_rows(tmp_path):
    """A ComfyUI / ai-toolkit LoRA on `diffusion_model.transformer_blocks.N.img_mlp.gate_up` (the released
    file's fused SwiGLU, gate rows first) converts to kohya gate_layer (the first half of up's rows) and
    proj (the second half), one shared down; its attention modules convert by name."""
    from safetensors.torch import save_file

    from tools import convert_lora

    g = torch.Generator().manual_seed(5)
    down, up = torch.randn(4, 64, generator=g), torch.randn(2 * 192, 4, generator=g)
    q_down, q_up = torch.randn(4, 64, generator=g), torch.randn(64, 4, generator=g)
    comfy = tmp_path / "comfy.safetensors"
    save_file({"diffusion_model.transformer_blocks.1.img_mlp.gate_up.lora_A.weight": down,
               "diffusion_model.transformer_blocks.1.img_mlp.gate_up.lora_B.weight": up,
               "diffusion_model.transformer_blocks.1.attn.to_q.lora_A.weight": q_down,
               "diffusion_model.transformer_blocks.1.attn.to_q.lora_B.weight": q_up}, str(comfy))
    kohya = tmp_path / "kohya.safetensors"
    assert convert_lora.main([str(comfy), str(kohya), "--to", "kohya"]) == 0
    out = load_file(kohya)
    gate, proj = "lora_unet_transformer_blocks_1_img_mlp_gate_layer", "lora_unet_transformer_blocks_1_img_mlp_proj"
    scale = lambda name: float(out[f"{name}.alpha"]) / out[f"{name}.lora_down.weight"].shape[0]  # noqa: E731
    for name, rows in ((gate, slice(0, 192)), (proj, slice(192, 384))):
        delta = scale(name) * out[f"{name}.lora_up.weight"].float() @ out[f"{name}.lora_down.weight"].float()
        assert torch.allclose(delta, up[rows] @ down, atol=1e-5), name
    q = "lora_unet_transformer_blocks_1_attn_to_q"
    assert torch.allclose(scale(q) * out[f"{q}.lora_up.weight"] @ out[f"{q}.lora_down.weight"], q_up @ q_down, atol=1e-5)


def test_loss_masks_are_pooled_to_the_16x_latent_grid(tiny_set, monkeypatch):
    """Old: masks are cached on the 8-pixel grid (alpha_mask, mask_dir), and Qwen-Image-2.1's 16x VAE
    gives latents half that size: every masked run stopped at its first step (expand_as). The loss
    now gets each mask's 2 x 2 means, one per latent element."""
    from types import SimpleNamespace

    family = QwenImage21Family(tiny_set["qwen_image21"])
    seen = {}
    monkeypatch.setattr(family, "loss_at", lambda *a, **k: seen.setdefault("mask", a[9]))
    masks = torch.zeros(1, 1, 8, 8)
    masks[..., :3] = 1.0  # the left 3 of 8 columns: latent columns 0 (1.0) and 1 (0.5)
    latents = torch.zeros(1, family.latent_channels, 4, 4)
    args = SimpleNamespace(timestep_sampling="uniform", discrete_flow_shift=1.0, sigmoid_scale=1.0, guidance_scale=1.0,
                           weighting_scheme="none", loss_type="l2", huber_c=0.1)
    family.training_loss(None, latents, {}, args, [torch.Generator().manual_seed(0)], masks)
    assert seen["mask"].shape == (1, 1, 4, 4)
    assert seen["mask"][0, 0, 0].tolist() == [1.0, 0.5, 0.0, 0.0]
