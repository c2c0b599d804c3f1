"""Lumina Image 2.0 as a trainable family on the tiny models: train_lora.py trains from configs/lumina2.toml's settings
(lumina2_shift, fp8 scaled base) and saves a kohya LoRA in sd-scripts' names; a LoRA converted by tools/convert_lora.py
to diffusers' layout (the fused qkv split into to_q / to_k / to_v) loads in diffusers' Lumina2LoraLoaderMixin with our
runtime output, and ours reads every layout back; such a LoRA is told from Z-Image's (the same single-file names);
our sampling equals diffusers' Lumina2Pipeline (shift 6, CFG with its normalisation); a batch of captions of other
lengths predicts as each alone; merge_lora merges into the released single file; the cached text is the system-
prompted caption's, the negative's without it."""

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import train_lora
from library.models.family import stack_text
from library.models.lumina2.family import Lumina2Family
from networks.lora import LoRANetwork
from tests import test_lora_clients as lora_clients
from tests.model_checks import lora_read_back
from tests.test_lumina2_model import diffusers_twin
from tests.test_train_lora import read_losses, sample_png

H, W = 3, 4  # patch grid of the target
WIDTH = 64  # the tiny Gemma 2's (the transformer's caption width)


@pytest.fixture(scope="module")
def trained(tiny_set, tmp_path_factory):
    """Three steps from configs/lumina2.toml's settings (its fp8_scaled base, the family's lumina2_shift), fp32
    compute, samples at the end: the output folder."""
    out = tmp_path_factory.mktemp("lumina2_run")
    assert train_lora.main([
        "--model_type", "lumina2", "--pretrained_model_name_or_path", tiny_set["lumina2"],
        "--ae", tiny_set["flux_vae_single"], "--text_encoder", tiny_set["lumina2_text_encoder"],
        "--dataset_config", tiny_set["dataset_config"], "--sample_prompts", tiny_set["sample_prompts"],
        "--output_dir", str(out), "--output_name", "lumina2", "--max_train_steps", "3", "--mixed_precision", "no",
        "--fp8_base", "--fp8_scaled", "--network_dim", "4", "--network_alpha", "4", "--optimizer_type", "AdamW",
        "--learning_rate", "3e-3", "--save_every_n_steps", "0",
    ]) == 0
    return out


def test_lumina2_lora_trains_saves_and_samples(trained):
    losses = read_losses(trained, "lumina2")
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    names = {k.split(".")[0] for k in load_file(trained / "lumina2.safetensors")}
    # the default: the 2 layers' attention (fused qkv, out) and feed-forward (w1-w3); no refiner, modulation,
    # embedder or final layer
    assert {"lora_unet_layers_0_attention_qkv", "lora_unet_layers_1_attention_out",
            "lora_unet_layers_0_feed_forward_w1", "lora_unet_layers_1_feed_forward_w3"} <= names
    assert len(names) == 2 * 5
    with safe_open(str(trained / "lumina2.safetensors"), "pt") as f:
        meta = f.metadata()
    assert (meta["ss_base_model_version"], meta["ss_timestep_sampling"]) == ("lumina2", "lumina2_shift")
    assert meta["modelspec.architecture"] == "lumina-2/lora"
    assert sample_png(trained, "lumina2", "final").stat().st_size > 0


def inputs(seed=0, length=5):
    """A packed target [1, 12, 64] and one caption's cached text (Gemma states [1, length, 64] with its mask)."""
    g = torch.Generator().manual_seed(seed)
    text = {"embeds": torch.randn(1, length, WIDTH, generator=g), "mask": torch.ones(1, length, dtype=torch.bool)}
    return torch.randn(1, H * W, 64, generator=g), text


def random_lora(model, **args) -> LoRANetwork:
    """rank 4, alpha 2, up ~ N(0, 0.5): a delta near the size of the weights, so any mistake shows."""
    return lora_clients.random_lora(model, "lumina2", up_std=0.5, **args)


@torch.no_grad()
def test_converted_loras_load_in_diffusers_lumina2_loader_with_our_output(tiny_set, tmp_path):
    """Our kohya file (every kind: layers, refiners, modulation, embedders, final layer) -> convert_lora --to diffusers
    (transformer.*, the qkv's rows split 3 : 1 : 1 as its grouped-query heads) and --to comfy -> diffusers'
    Lumina2LoraLoaderMixin.lora_state_dict + load_lora_into_transformer on its class with the same weights: its
    velocity equals ours with the runtime LoRA; each file is told to be Lumina 2's (not Z-Image's, whose single-file
    names it has), and ours reads each back as the kohya one."""
    from diffusers.loaders.lora_pipeline import Lumina2LoraLoaderMixin

    from networks import lora_files as lf
    from tests.test_lumina2_model import diffusers_velocity
    from tools import convert_lora

    family = Lumina2Family(tiny_set["lumina2"])
    ours = family.load_transformer(torch.float32)
    x, text = inputs()
    sigma = torch.tensor([0.4])
    net = random_lora(ours, refiner_dim=4, refiner_mod_dim=4, train_modulation="true", x_embedder_dim=4,
                      t_embedder_dim=4, cap_embedder_dim=4, final_layer_dim=4)
    net.save(str(tmp_path / "kohya.safetensors"))
    for layout in ("kohya", "comfy", "diffusers"):
        if layout != "kohya":
            assert convert_lora.main([str(tmp_path / "kohya.safetensors"), str(tmp_path / f"{layout}.safetensors"),
                                      "--to", layout]) == 0
        tensors, metadata, _ = lf.read_lora_tensors(str(tmp_path / f"{layout}.safetensors"))
        assert convert_lora.detect_arch(tensors, {}) == "lumina2", layout  # by its shapes, no header
    files = {layout: tmp_path / f"{layout}.safetensors" for layout in ("comfy", "diffusers")}
    base, want, diffs = lora_read_back(ours, "lumina2", net, files,
                                       lambda: family.predict(ours, x, sigma, text, H, W, None))

    reference = diffusers_twin(ours)
    call = dict(img=x, txt=text["embeds"], txt_mask=text["mask"], timesteps=sigma, h=H, w=W)
    assert (diffusers_velocity(reference, call) - base).abs().max() <= 1e-5
    state = Lumina2LoraLoaderMixin.lora_state_dict(str(tmp_path / "diffusers.safetensors"))
    Lumina2LoraLoaderMixin.load_lora_into_transformer(state, reference, adapter_name="ours")
    diffs["diffusers"] = (diffusers_velocity(reference, call) - want).abs().max().item()
    print("Lumina 2 LoRA, max abs diff:", diffs, "effect", (want - base).abs().max().item())
    assert (want - base).abs().max() > 1e-2 and max(diffs.values()) <= 1e-5, diffs


@torch.no_grad()
def test_sampling_equals_diffusers_lumina2_pipeline(tiny_set):
    """diffusers' Lumina2Pipeline with the same weights, our text embeddings and noise: FlowMatchEulerDiscreteScheduler
    at the release's shift 6 (use_dynamic_shifting false: the pipeline's mu unused), timestep 1 - t / 1000 and the
    output negated, CFG 4 with a negative prompt of another length and its cfg_normalization: our latents. Without
    the normalisation, or at shift 1, they differ."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Lumina2Pipeline

    family = Lumina2Family(tiny_set["lumina2"])
    model = family.load_transformer(torch.float32)
    (_, text), (_, negative) = inputs(2, 6), inputs(3, 2)
    steps, size, guidance = 3, 48, 4.0  # a 6 x 6 latent, 3 x 3 patches
    ours = family.sample_latents(model, text, size, size, steps, seed=7, guidance=guidance, negative_text=negative)
    latents = torch.randn(1, 16, 6, 6, generator=torch.Generator().manual_seed(7))
    pad = text["mask"].shape[1] - negative["mask"].shape[1]  # the pipeline takes both at one length (it pads to 256)
    negative_embeds = torch.nn.functional.pad(negative["embeds"], (0, 0, 0, pad))
    negative_mask = torch.nn.functional.pad(negative["mask"], (0, pad))
    diffs = {}
    for shift, normalise in ((6.0, True), (6.0, False), (1.0, True)):
        scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
        pipe = Lumina2Pipeline(transformer=diffusers_twin(model), scheduler=scheduler, vae=None, text_encoder=None,
                               tokenizer=None)
        (theirs,) = pipe(prompt_embeds=text["embeds"], prompt_attention_mask=text["mask"],
                         negative_prompt_embeds=negative_embeds, negative_prompt_attention_mask=negative_mask,
                         latents=latents.clone(), height=size, width=size, num_inference_steps=steps,
                         guidance_scale=guidance, cfg_normalization=normalise, output_type="latent", return_dict=False)
        diffs[(shift, normalise)] = (ours - theirs).abs().max().item()
    print("Lumina2Pipeline vs ours, max abs diff:", diffs)
    assert diffs[(6.0, True)] <= 1e-5 and min(diffs[(6.0, False)], diffs[(1.0, True)]) > 1e-2, diffs


@torch.no_grad()
def test_a_batch_of_captions_of_other_lengths_predicts_each_as_alone(tiny_set):
    """Captions of other lengths in one batch (collate zero-pads them, the mask says where): each row's prediction is
    the one it gets alone; without the mask the zeros would count."""
    from library.data.dataset import _pad_stack

    family = Lumina2Family(tiny_set["lumina2"])
    model = family.load_transformer(torch.float32)
    captions = [{k: v[0] for k, v in inputs(i, n)[1].items()} for i, n in enumerate((5, 9, 1))]
    batch = {k: _pad_stack([c[k] for c in captions]) for k in captions[0]}
    g = torch.Generator().manual_seed(5)
    x, sigmas = torch.randn(3, H * W, 64, generator=g), torch.tensor([0.2, 0.5, 0.9])
    together = family.predict(model, x, sigmas, batch, H, W, None)
    for i, caption in enumerate(captions):
        alone = family.predict(model, x[i : i + 1], sigmas[i : i + 1], stack_text([caption]), H, W, None)
        assert (together[i : i + 1] - alone).abs().max() <= 1e-5, i
    unmasked = {"embeds": batch["embeds"]}
    assert (family.predict(model, x, sigmas, unmasked, H, W, None) - together)[2].abs().max() > 1e-4


@torch.no_grad()
def test_merge_lora_into_the_single_file_equals_the_runtime_lora(tiny_set, trained, tmp_path):
    from tools import merge_lora

    lora = str(trained / "lumina2.safetensors")
    merged = str(tmp_path / "merged.safetensors")
    # the tiny file is bf16 as released: the merged weights in float32, so that only the merge is compared
    assert merge_lora.main(["--model", tiny_set["lumina2"], "--lora", f"{lora}:0.7", "--save_to", merged,
                            "--save_precision", "fp32"]) == 0
    with safe_open(merged, "pt") as f:
        assert "layers.0.attention.qkv.weight" in f.keys()  # the released layout kept
    family = Lumina2Family(tiny_set["lumina2"])
    model = family.load_transformer(torch.float32)
    x, text = inputs(1)
    base = family.predict(model, x, torch.tensor([0.3]), text, H, W, None)
    LoRANetwork.from_weights(model, "lumina2", lora, multiplier=0.7).apply()
    want = family.predict(model, x, torch.tensor([0.3]), text, H, W, None)
    got = family.predict(Lumina2Family(merged).load_transformer(torch.float32), x, torch.tensor([0.3]), text, H, W,
                         None)
    assert (want - base).abs().max() > 1e-6 and (got - want).abs().max() <= 1e-5


def test_cached_text_is_the_system_prompted_captions_and_the_negative_plain(tiny_set):
    """load_text_encoder's per-caption dicts: each caption's real tokens of '<system> <Prompt Start> <caption>' (the
    config's system prompt, else the pipeline's; "" none), equal to the encoder's rows; a sample's negative
    (NegativePrompt) is encoded as it is, as the pipeline encodes it."""
    from library.data.prompts import NegativePrompt
    from library.models.lumina2.text_encoder import LUMINA2_SYSTEM_PROMPT, load_lumina2_text_encoder

    family = Lumina2Family(tiny_set["lumina2"], text_encoder=tiny_set["lumina2_text_encoder"])
    encoder = load_lumina2_text_encoder(tiny_set["lumina2_text_encoder"], dtype=torch.float32)
    captions = ["a red circle on the left", ""]
    for system, expected in ((None, LUMINA2_SYSTEM_PROMPT), ("an anime painter", "an anime painter"), ("", None)):
        cached = family.load_text_encoder("fp32", system_prompt=system)(captions + [NegativePrompt("")])
        embeds, mask = encoder.encode(captions, expected)
        for i in range(2):
            n = int(mask[i].sum())
            assert torch.equal(cached[i]["embeds"], embeds[i, :n]) and cached[i]["mask"].all(), (system, i)
        plain, _ = encoder.encode([""], None)  # <bos> alone
        assert torch.equal(cached[2]["embeds"], plain[0]), system
    assert cached[1]["embeds"].shape[0] == 1  # no system prompt: the empty caption is <bos> alone too


def test_generate_renders_with_cfg_and_the_lora(tiny_set, trained, tmp_path):
    """The pipeline's CFG (the empty negative prompt at its default 4.0), the trained LoRA."""
    from PIL import Image

    from tools import generate

    out = tmp_path / "gen"
    assert generate.main(["--model_type", "lumina2", "--model", tiny_set["lumina2"],
                          "--ae", tiny_set["flux_vae_single"], "--text_encoder", tiny_set["lumina2_text_encoder"],
                          "--prompt", "a red square --s 2",
                          "--width", "48", "--height", "32", "--dtype", "fp32", "--seed", "0", "--out", str(out),
                          "--lora", f"{trained / 'lumina2.safetensors'}:0.8"]) == 0
    (png,) = out.glob("*.png")
    with Image.open(png) as image:
        assert image.size == (48, 32) and image.text["steps"] == "2" and float(image.text["guidance"]) == 4.0
