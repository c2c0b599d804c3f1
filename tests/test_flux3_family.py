"""FLUX.3 as a trainable family on the tiny models: train_lora.py trains from the family's defaults (flux3_shift, fp8
scaled base) and saves a kohya LoRA in BFL names; a LoRA converted by tools/convert_lora.py to diffusers' names or
BFL's `diffusion_model.*` layout loads in diffusers' Flux3LoraLoaderMixin with our runtime output (references
included); merge_lora merges into both checkpoint layouts; the distilled model samples as diffusers' flow-map loop;
generate.py renders both releases."""

import csv
import os

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import train_lora
from library.models.family import stack_text
from library.models.flux3.family import Flux3Family
from library.models.latents import pack_latents
from networks.lora import LoRANetwork
from tests.test_train_lora import sample_png

H, W, T = 3, 4, 7  # patch grid of the target, text tokens
CONTEXT = 8 * 32  # the tiny text encoder's 8 stacked layers of width 32


def read_losses(out, name):
    with open(os.path.join(out, f"{name}_log.csv")) as f:
        return [float(r["loss"]) for r in csv.DictReader(f)]


@pytest.fixture(scope="module")
def trained(tiny_set, tmp_path_factory):
    """Three steps from configs/flux3.toml's settings (fp8_scaled base, the family's flux3_shift), fp32 compute,
    samples at the end: the output folder."""
    out = tmp_path_factory.mktemp("flux3_run")
    assert train_lora.main([
        "--model_type", "flux3", "--pretrained_model_name_or_path", tiny_set["flux3_tiny"],
        "--ae", tiny_set["flux2_vae"], "--text_encoder", tiny_set["flux3_text_encoder"],
        "--dataset_config", tiny_set["dataset_config"], "--sample_prompts", tiny_set["sample_prompts"],
        "--output_dir", str(out), "--output_name", "flux3", "--max_train_steps", "3", "--mixed_precision", "no",
        "--fp8_base", "--fp8_scaled", "--network_dim", "4", "--network_alpha", "4", "--optimizer_type", "AdamW",
        "--learning_rate", "3e-3", "--save_every_n_steps", "0",
    ]) == 0
    return out


def test_flux3_lora_trains_saves_and_samples(trained):
    losses = read_losses(trained, "flux3")
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    names = {k.split(".")[0] for k in load_file(trained / "flux3.safetensors")}
    # every block Linear: 3 modes x 2 per-mode blocks x 6, 2 single blocks x 6; no modulation, embedder, final layer
    assert {"lora_unet_single_blocks_0_q_proj", "lora_unet_content_mode_blocks_image_1_mlp_in",
            "lora_unet_content_mode_blocks_image_cond_0_attn_out", "lora_unet_txt_mode_blocks_1_mlp_out"} <= names
    assert len(names) == 3 * 2 * 6 + 2 * 6
    with safe_open(str(trained / "flux3.safetensors"), "pt") as f:
        meta = f.metadata()
    assert (meta["ss_base_model_version"], meta["ss_timestep_sampling"]) == ("flux3", "flux3_shift")
    assert meta["modelspec.architecture"] == "Flux.3/lora"
    assert sample_png(trained, "flux3", "final").stat().st_size > 0


def inputs(seed=0):
    """A packed target [1, 12, 128], text, a reference latent [1, 32, 4, 6] (2 x 3 patches)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, H * W, 128, generator=g), {"embeds": torch.randn(1, T, CONTEXT, generator=g)},
            torch.randn(1, 32, 4, 6, generator=g))


def random_lora(model) -> LoRANetwork:
    """rank 4, alpha 2, up ~ N(0, 0.5): a delta near the size of the weights, so any mistake shows."""
    torch.manual_seed(3)
    net = LoRANetwork(model, "flux3", rank=4, alpha=2)
    with torch.no_grad():
        for m in net.lora_modules():
            m.lora_up.weight.normal_(0, 0.5)
    return net


@torch.no_grad()
def test_converted_loras_load_in_diffusers_flux3_loader_with_our_output(tiny_set, tmp_path):
    """Our kohya file -> convert_lora --to diffusers / --to comfy -> Flux3LoraLoaderMixin.lora_state_dict +
    load_lora_into_transformer on diffusers' Flux3Transformer2DModel with the same weights: its velocity equals
    ours with the runtime LoRA, the reference tokens (image_cond blocks and their LoRA) included; each file is told
    to be FLUX.3's, the diffusers one although it holds FLUX.2's markers."""
    from diffusers import Flux3Transformer2DModel
    from diffusers.loaders.lora_pipeline import Flux3LoraLoaderMixin
    from diffusers.modular_pipelines.flux3.before_denoise import Flux3TextRoPEInputsStep, _prepare_image_ids

    from networks import lora_files as lf
    from tools import convert_lora

    family = Flux3Family(tiny_set["flux3_tiny"])
    ours = family.load_transformer(torch.float32)
    x, text, ref = inputs()
    net = random_lora(ours)
    net.save(str(tmp_path / "kohya.safetensors"))
    for layout in ("diffusers", "comfy"):
        assert convert_lora.main([str(tmp_path / "kohya.safetensors"), str(tmp_path / f"{layout}.safetensors"),
                                  "--to", layout]) == 0
        tensors, metadata, _ = lf.read_lora_tensors(str(tmp_path / f"{layout}.safetensors"))
        assert convert_lora.detect_arch(tensors, metadata) == "flux3", layout
    base = family.predict(ours, x, torch.tensor([0.4]), text, H, W, None, control=[ref])
    net.apply()
    want = family.predict(ours, x, torch.tensor([0.4]), text, H, W, None, control=[ref])

    theirs = Flux3Transformer2DModel.from_pretrained(tiny_set["flux3_diffusers"]).eval()
    kwargs = dict(hidden_states=x, encoder_hidden_states=text["embeds"], timestep=torch.tensor([0.4]),
                  img_ids=_prepare_image_ids(H, W, 0.5), image_cond_hidden_states=pack_latents(ref),
                  txt_ids=Flux3TextRoPEInputsStep._prepare_text_ids(text["embeds"]),
                  image_cond_ids=_prepare_image_ids(2, 3, 0.5, l_coord=-1), return_dict=False)
    assert (theirs(**kwargs)[0] - base).abs().max() <= 1e-5  # the family's positions and packing are the pipeline's
    diffs = {}
    for layout in ("diffusers", "comfy"):
        state = Flux3LoraLoaderMixin.lora_state_dict(str(tmp_path / f"{layout}.safetensors"))
        Flux3LoraLoaderMixin.load_lora_into_transformer(state, theirs, adapter_name=layout)
        theirs.set_adapters(layout)
        diffs[layout] = (theirs(**kwargs)[0] - want).abs().max().item()
        theirs.delete_adapters(layout)
    print("FLUX.3 LoRA in diffusers, max abs diff:", diffs, "effect", (want - base).abs().max().item())
    assert (want - base).abs().max() > 1e-2 and max(diffs.values()) <= 1e-5, diffs


@torch.no_grad()
@pytest.mark.parametrize("base_key", ["flux3_tiny", "flux3_diffusers"])
def test_merge_lora_into_both_layouts_equals_the_runtime_lora(tiny_set, trained, tmp_path, base_key):
    from tools import merge_lora

    lora = str(trained / "flux3.safetensors")
    merged = str(tmp_path / ("merged.safetensors" if base_key == "flux3_tiny" else "merged"))
    assert merge_lora.main(["--model", tiny_set[base_key], "--lora", f"{lora}:0.7", "--save_to", merged]) == 0
    family = Flux3Family(tiny_set["flux3_tiny"])
    model = family.load_transformer(torch.float32)
    x, text, _ = inputs(1)
    base = family.predict(model, x, torch.tensor([0.3]), text, H, W, None)
    LoRANetwork.from_weights(model, "flux3", lora, multiplier=0.7).apply()
    want = family.predict(model, x, torch.tensor([0.3]), text, H, W, None)
    got = family.predict(Flux3Family(merged).load_transformer(torch.float32), x, torch.tensor([0.3]), text, H, W, None)
    assert (want - base).abs().max() > 1e-6 and (got - want).abs().max() <= 1e-5


@torch.no_grad()
def test_distilled_samples_as_diffusers_flow_map_loop(tiny_set, tmp_path):
    """The step-distilled model: the scheduler's constant shift 6.93 over linspace(1, 1/N, N), each step given
    the next sigma (0 after the last) as target_timestep, no CFG: Flux3DistilledLoopDenoiser + the scheduler's step
    on diffusers' transformer with the same weights give our latents. The base's schedule is the same."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux3Transformer2DModel
    from diffusers.modular_pipelines.flux3.before_denoise import Flux3TextRoPEInputsStep, _prepare_image_ids

    from library.models import flow_matching as fm
    from library.models.flux3.checkpoint import save_flux3_diffusers

    family = Flux3Family(tiny_set["flux3_distilled_tiny"])
    model = family.load_transformer(torch.float32)
    assert (family.is_distilled, family.sample_steps, family.model_version(model)) == (True, 16, "flux3-distilled")
    assert set(family.unread_sample_options()) == {"negative", "guidance"}
    text = {"embeds": torch.randn(1, T, CONTEXT, generator=torch.Generator().manual_seed(4))}
    steps, size = 3, 48  # 3 x 3 patches
    ours = family.sample_latents(model, text, size, size, steps, seed=7, guidance=None)

    save_flux3_diffusers(model, model.config, str(tmp_path / "transformer"))
    theirs = Flux3Transformer2DModel.from_pretrained(str(tmp_path / "transformer")).eval()
    scheduler = FlowMatchEulerDiscreteScheduler(shift=6.93)
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps))
    assert (fm.inference_sigmas(steps, 9, "flux3") - scheduler.sigmas).abs().max() < 1e-6
    latents = torch.randn(1, 128, 3, 3, generator=torch.Generator().manual_seed(7)).flatten(2).transpose(1, 2)
    timesteps = scheduler.timesteps
    for i, t in enumerate(timesteps):
        target = timesteps[i + 1] if i + 1 < len(timesteps) else torch.zeros_like(t)
        v = theirs(hidden_states=latents, encoder_hidden_states=text["embeds"], timestep=(t / 1000).expand(1),
                   target_timestep=(target / 1000).expand(1), img_ids=_prepare_image_ids(3, 3, 0.5),
                   txt_ids=Flux3TextRoPEInputsStep._prepare_text_ids(text["embeds"]), return_dict=False)[0]
        latents = scheduler.step(v, t, latents, return_dict=False)[0]
    assert (pack_latents(ours) - latents).abs().max() <= 1e-5


@torch.no_grad()
def test_a_batch_of_different_windows_runs_each_caption_at_its_own(tiny_set):
    """Captions of 80 and 160 tokens in one batch (collate zero-pads the shorter, its mask says where): each row's
    prediction is the one it gets alone, as the transformer sees no text mask (the pads it would see change it)."""
    from library.data.dataset import _pad_stack

    family = Flux3Family(tiny_set["flux3_tiny"])
    model = family.load_transformer(torch.float32)
    g = torch.Generator().manual_seed(5)
    captions = [{"embeds": torch.randn(n, CONTEXT, generator=g), "mask": torch.ones(n, dtype=torch.bool)}
                for n in (160, 80, 160)]
    batch = {k: _pad_stack([c[k] for c in captions]) for k in captions[0]}
    x, sigmas = torch.randn(3, H * W, 128, generator=g), torch.tensor([0.2, 0.5, 0.9])
    together = family.predict(model, x, sigmas, batch, H, W, None)
    for i, caption in enumerate(captions):
        alone = family.predict(model, x[i : i + 1], sigmas[i : i + 1], stack_text([caption]), H, W, None)
        assert (together[i : i + 1] - alone).abs().max() <= 1e-6, i
    padded = family.predict(model, x[1:2], sigmas[1:2], {"embeds": batch["embeds"][1:2]}, H, W, None)
    assert (padded - together[1:2]).abs().max() > 1e-4  # without the grouping, the zeros would count


@pytest.mark.parametrize("key", ["flux3_tiny", "flux3_distilled_tiny"])
def test_generate_renders_both_releases(tiny_set, trained, tmp_path, key):
    """The base with CFG (the empty negative prompt at its default 3.5), the distilled model without; the LoRA
    trained on the base applies to both."""
    from PIL import Image

    from tools import generate

    out = tmp_path / "gen"
    assert generate.main(["--model_type", "flux3", "--model", tiny_set[key], "--ae", tiny_set["flux2_vae"],
                          "--text_encoder", tiny_set["flux3_text_encoder"], "--prompt", "a red square --s 2",
                          "--width", "48", "--height", "32", "--dtype", "fp32", "--seed", "0", "--out", str(out),
                          "--lora", f"{trained / 'flux3.safetensors'}:0.8"]) == 0
    (png,) = out.glob("*.png")
    with Image.open(png) as image:
        assert image.size == (48, 32) and image.text["steps"] == "2"
