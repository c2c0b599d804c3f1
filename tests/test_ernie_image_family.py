"""ERNIE-Image as a trainable family on the tiny models: train_lora.py trains from configs/ernie_image.toml's settings
(ernie_shift, fp8 scaled base) and saves a kohya LoRA in diffusers' names; a LoRA converted by tools/convert_lora.py
to diffusers' layout or ai-toolkit's `diffusion_model.*` loads in diffusers' ErnieImageLoraLoaderMixin with our
runtime output, and ours reads the latter back; our sampling equals ErnieImagePipeline's loop (shift 4, CFG 4);
merge_lora merges into both checkpoint layouts; a batch of captions of other lengths predicts as each alone;
generate.py renders."""

import csv
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import train_lora
from library.models.ernie_image.family import ErnieImageFamily
from library.models.family import stack_text
from library.models.latents import patchify
from networks.lora import LoRANetwork
from tests.test_train_lora import sample_png

H, W, T = 3, 4, 7  # patch grid of the target, text tokens
WIDTH = 32  # the tiny text encoder's (text_in_dim)


def read_losses(out, name):
    with open(os.path.join(out, f"{name}_log.csv")) as f:
        return [float(r["loss"]) for r in csv.DictReader(f)]


@pytest.fixture(scope="module")
def trained(tiny_set, tmp_path_factory):
    """Three steps from configs/ernie_image.toml's settings (its fp8_scaled option, the family's ernie_shift), fp32
    compute, samples at the end: the output folder."""
    out = tmp_path_factory.mktemp("ernie_image_run")
    assert train_lora.main([
        "--model_type", "ernie_image", "--pretrained_model_name_or_path", tiny_set["ernie_image"],
        "--ae", tiny_set["flux2_vae"], "--text_encoder", tiny_set["ernie_image_text_encoder"],
        "--dataset_config", tiny_set["dataset_config"], "--sample_prompts", tiny_set["sample_prompts"],
        "--output_dir", str(out), "--output_name", "ernie", "--max_train_steps", "3", "--mixed_precision", "no",
        "--fp8_base", "--fp8_scaled", "--network_dim", "4", "--network_alpha", "4", "--optimizer_type", "AdamW",
        "--learning_rate", "3e-3", "--save_every_n_steps", "0",
    ]) == 0
    return out


def test_ernie_image_lora_trains_saves_and_samples(trained):
    losses = read_losses(trained, "ernie")
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    names = {k.split(".")[0] for k in load_file(trained / "ernie.safetensors")}
    # every block Linear (2 blocks x 4 attention + 3 MLP); no embedder, modulation or final layer
    assert {"lora_unet_layers_0_self_attention_to_q", "lora_unet_layers_1_self_attention_to_out_0",
            "lora_unet_layers_0_mlp_gate_proj", "lora_unet_layers_1_mlp_linear_fc2"} <= names
    assert len(names) == 2 * 7
    with safe_open(str(trained / "ernie.safetensors"), "pt") as f:
        meta = f.metadata()
    assert (meta["ss_base_model_version"], meta["ss_timestep_sampling"]) == ("ernie-image", "ernie_shift")
    assert meta["modelspec.architecture"] == "ERNIE-Image/lora"
    assert sample_png(trained, "ernie", "final").stat().st_size > 0


def inputs(seed=0):
    """A packed target [1, 12, 128] and text [1, 7, 32]."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, H * W, 128, generator=g), {"embeds": torch.randn(1, T, WIDTH, generator=g)}


def random_lora(model) -> LoRANetwork:
    """rank 4, alpha 2, up ~ N(0, 0.5): a delta near the size of the weights, so any mistake shows."""
    torch.manual_seed(3)
    net = LoRANetwork(model, "ernie_image", rank=4, alpha=2)
    with torch.no_grad():
        for m in net.lora_modules():
            m.lora_up.weight.normal_(0, 0.5)
    return net


def diffusers_call(model, x, sigma, text):
    """ErnieImageTransformer2DModel on our packed tokens: the patchified grid [B, 128, H, W], timestep 1000 sigma,
    text_lens from the mask (all tokens without one); back to packed tokens."""
    grid = x.transpose(1, 2).unflatten(-1, (H, W))
    lens = text["mask"].sum(1) if "mask" in text else torch.full((x.shape[0],), text["embeds"].shape[1])
    out = model(hidden_states=grid, timestep=1000 * sigma, text_bth=text["embeds"], text_lens=lens, return_dict=False)
    return out[0].flatten(2).transpose(1, 2)


@torch.no_grad()
def test_converted_loras_load_in_diffusers_ernie_image_loader_with_our_output(tiny_set, tmp_path):
    """Our kohya file -> convert_lora --to diffusers (transformer.*) / --to comfy (diffusion_model.*, ai-toolkit's
    layout) -> ErnieImageLoraLoaderMixin.lora_state_dict + load_lora_into_transformer on diffusers' transformer with
    the same weights: its velocity equals ours with the runtime LoRA; each file is told to be ERNIE-Image's, and
    ours reads the diffusion_model.* file back as the kohya one."""
    from diffusers import ErnieImageTransformer2DModel
    from diffusers.loaders.lora_pipeline import ErnieImageLoraLoaderMixin

    from networks import lora_files as lf
    from tools import convert_lora

    family = ErnieImageFamily(tiny_set["ernie_image"])
    ours = family.load_transformer(torch.float32)
    x, text = inputs()
    sigma = torch.tensor([0.4])
    net = random_lora(ours)
    net.save(str(tmp_path / "kohya.safetensors"))
    for layout in ("diffusers", "comfy"):
        assert convert_lora.main([str(tmp_path / "kohya.safetensors"), str(tmp_path / f"{layout}.safetensors"),
                                  "--to", layout]) == 0
        tensors, metadata, _ = lf.read_lora_tensors(str(tmp_path / f"{layout}.safetensors"))
        assert convert_lora.detect_arch(tensors, metadata) == "ernie_image", layout
    base = family.predict(ours, x, sigma, text, H, W, None)
    net.apply()
    want = family.predict(ours, x, sigma, text, H, W, None)
    net.remove()
    LoRANetwork.from_weights(ours, "ernie_image", str(tmp_path / "comfy.safetensors")).apply()
    read_back = family.predict(ours, x, sigma, text, H, W, None)

    theirs = ErnieImageTransformer2DModel.from_pretrained(tiny_set["ernie_image_diffusers"]).eval()
    assert (diffusers_call(theirs, x, sigma, text) - base).abs().max() <= 1e-5  # positions and packing as theirs
    diffs = {"ours_from_comfy": (read_back - want).abs().max().item()}
    for layout in ("diffusers", "comfy"):
        state = ErnieImageLoraLoaderMixin.lora_state_dict(str(tmp_path / f"{layout}.safetensors"))
        ErnieImageLoraLoaderMixin.load_lora_into_transformer(state, theirs, adapter_name=layout)
        theirs.set_adapters(layout)
        diffs[layout] = (diffusers_call(theirs, x, sigma, text) - want).abs().max().item()
        theirs.delete_adapters(layout)
    print("ERNIE-Image LoRA, max abs diff:", diffs, "effect", (want - base).abs().max().item())
    assert (want - base).abs().max() > 1e-2 and max(diffs.values()) <= 1e-5, diffs


@torch.no_grad()
def test_sampling_equals_the_pipelines_loop_with_cfg(tiny_set):
    """ErnieImagePipeline (the tiny transformer folder, FlowMatchEulerDiscreteScheduler with the released config's
    shift 4.0, 3 steps, guidance 4.0 with a negative prompt of another length, the noise from the same seed) gives
    our latents (patchified, normalised: output_type latent)."""
    from diffusers import AutoencoderKLFlux2, ErnieImagePipeline, ErnieImageTransformer2DModel
    from diffusers import FlowMatchEulerDiscreteScheduler

    family = ErnieImageFamily(tiny_set["ernie_image"])
    model = family.load_transformer(torch.float32)
    g = torch.Generator().manual_seed(4)
    text, negative = torch.randn(1, T, WIDTH, generator=g), torch.randn(1, 2, WIDTH, generator=g)
    steps, size = 3, 48  # 3 x 3 patches
    ours = family.sample_latents(model, {"embeds": text}, size, size, steps, seed=7, guidance=4.0,
                                 negative_text={"embeds": negative})

    transformer = ErnieImageTransformer2DModel.from_pretrained(tiny_set["ernie_image_diffusers"])
    pipe = ErnieImagePipeline(transformer=transformer, vae=AutoencoderKLFlux2.from_pretrained(tiny_set["flux2_vae"]),
                              text_encoder=None, tokenizer=None, scheduler=FlowMatchEulerDiscreteScheduler(shift=4.0))
    theirs = pipe(prompt_embeds=[text[0]], negative_prompt_embeds=[negative[0]], height=size, width=size,
                  num_inference_steps=steps, guidance_scale=4.0, generator=torch.Generator().manual_seed(7),
                  output_type="latent").images
    assert (patchify(ours) - theirs).abs().max() <= 1e-5


@torch.no_grad()
def test_a_batch_of_captions_of_other_lengths_predicts_each_as_alone(tiny_set):
    """Captions of 5, 9 and 2 tokens in one batch (collate zero-pads them, the mask says where): each row's
    prediction is the one it gets alone; without the mask the zeros would count."""
    from library.data.dataset import _pad_stack

    family = ErnieImageFamily(tiny_set["ernie_image"])
    model = family.load_transformer(torch.float32)
    g = torch.Generator().manual_seed(5)
    captions = [{"embeds": torch.randn(n, WIDTH, generator=g), "mask": torch.ones(n, dtype=torch.bool)}
                for n in (5, 9, 2)]
    batch = {k: _pad_stack([c[k] for c in captions]) for k in captions[0]}
    x, sigmas = torch.randn(3, H * W, 128, generator=g), torch.tensor([0.2, 0.5, 0.9])
    together = family.predict(model, x, sigmas, batch, H, W, None)
    for i, caption in enumerate(captions):
        alone = family.predict(model, x[i : i + 1], sigmas[i : i + 1], stack_text([caption]), H, W, None)
        assert (together[i : i + 1] - alone).abs().max() <= 1e-5, i
    padded = family.predict(model, x[2:], sigmas[2:], {"embeds": batch["embeds"][2:]}, H, W, None)
    assert (padded - together[2:]).abs().max() > 1e-4


@torch.no_grad()
@pytest.mark.parametrize("base_key", ["ernie_image", "ernie_image_diffusers"])
def test_merge_lora_into_both_layouts_equals_the_runtime_lora(tiny_set, trained, tmp_path, base_key):
    from tools import merge_lora

    lora = str(trained / "ernie.safetensors")
    merged = str(tmp_path / ("merged.safetensors" if base_key == "ernie_image" else "merged"))
    assert merge_lora.main(["--model", tiny_set[base_key], "--lora", f"{lora}:0.7", "--save_to", merged]) == 0
    family = ErnieImageFamily(tiny_set["ernie_image"])
    model = family.load_transformer(torch.float32)
    x, text = inputs(1)
    base = family.predict(model, x, torch.tensor([0.3]), text, H, W, None)
    LoRANetwork.from_weights(model, "ernie_image", lora, multiplier=0.7).apply()
    want = family.predict(model, x, torch.tensor([0.3]), text, H, W, None)
    got = family.predict(ErnieImageFamily(merged).load_transformer(torch.float32), x, torch.tensor([0.3]), text,
                         H, W, None)
    assert (want - base).abs().max() > 1e-6 and (got - want).abs().max() <= 1e-5


def test_generate_renders_with_cfg_and_the_lora(tiny_set, trained, tmp_path):
    """The pipeline's CFG (the empty negative prompt at its default 4.0) and the trained LoRA."""
    from PIL import Image

    from tools import generate

    out = tmp_path / "gen"
    assert generate.main(["--model_type", "ernie_image", "--model", tiny_set["ernie_image"], "--ae",
                          tiny_set["flux2_vae"], "--text_encoder", tiny_set["ernie_image_text_encoder"], "--prompt",
                          "a red square --s 2", "--width", "48", "--height", "32", "--dtype", "fp32", "--seed", "0",
                          "--out", str(out), "--lora", f"{trained / 'ernie.safetensors'}:0.8"]) == 0
    (png,) = out.glob("*.png")
    with Image.open(png) as image:
        assert image.size == (48, 32) and image.text["steps"] == "2" and float(image.text["guidance"]) == 4.0
