"""Nucleus-Image as a trainable family on the tiny models: train_lora.py trains from configs/nucleus_image.toml's
settings (nucleus_shift, the fp8_scaled base, checkpointing, blocks swapped) and saves a kohya LoRA in diffusers'
names; a LoRA converted by tools/convert_lora.py to diffusers' layout or ai-toolkit's `diffusion_model.*` loads in
diffusers' NucleusMoEImageTransformer2DModel.load_lora_adapter with our runtime output, and ours reads the latter
back; our sampling equals NucleusMoEImagePipeline's loop (unshifted, CFG 4 with the norm rescale, the prediction
negated); merge_lora merges into both checkpoint layouts; a batch of captions of other lengths predicts as each
alone; generate.py renders."""

import csv
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import train_lora
from library.models.family import stack_text
from library.models.latents import pack_latents
from library.models.nucleus_image.family import NucleusImageFamily
from networks.lora import LoRANetwork
from tests.test_train_lora import sample_png

H, W, T = 3, 4, 7  # patch grid of the target, text tokens
WIDTH = 32  # the tiny text encoder's (joint_attention_dim)


def read_losses(out, name):
    with open(os.path.join(out, f"{name}_log.csv")) as f:
        return [float(r["loss"]) for r in csv.DictReader(f)]


@pytest.fixture(scope="module")
def trained(tiny_set, tmp_path_factory):
    """Three steps from configs/nucleus_image.toml's settings (its fp8_scaled base, the packed experts in fp8 too, with
    checkpointing; the last blocks swapped as on 16 GB; the family's nucleus_shift), fp32 compute, samples at the end:
    the output folder."""
    out = tmp_path_factory.mktemp("nucleus_image_run")
    assert train_lora.main([
        "--model_type", "nucleus_image", "--pretrained_model_name_or_path", tiny_set["nucleus_image"],
        "--ae", tiny_set["qwen_image_vae"], "--text_encoder", tiny_set["nucleus_image_text_encoder"],
        "--dataset_config", tiny_set["dataset_config"], "--sample_prompts", tiny_set["sample_prompts"],
        "--output_dir", str(out), "--output_name", "nucleus", "--max_train_steps", "3", "--mixed_precision", "no",
        "--fp8_base", "--fp8_scaled", "--gradient_checkpointing", "true", "--blocks_to_swap", "2",
        "--network_dim", "4", "--network_alpha", "4",
        "--optimizer_type", "AdamW", "--learning_rate", "3e-3", "--save_every_n_steps", "0",
    ]) == 0
    return out


def test_nucleus_image_lora_trains_saves_and_samples(trained):
    losses = read_losses(trained, "nucleus")
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    names = {k.split(".")[0] for k in load_file(trained / "nucleus.safetensors")}
    # every block Linear: 3 dense blocks x (attention 4, context 3, modulation 1, MLP 2) + 2 MoE blocks x (8, the
    # shared expert's 2, the router); no embedder or final layer, no packed expert
    assert {"lora_unet_transformer_blocks_0_attn_to_q", "lora_unet_transformer_blocks_1_encoder_proj",
            "lora_unet_transformer_blocks_2_img_mlp_net_0_proj", "lora_unet_transformer_blocks_3_img_mlp_gate",
            "lora_unet_transformer_blocks_4_img_mlp_shared_expert_net_2", "lora_unet_transformer_blocks_4_img_mod_1",
            "lora_unet_transformer_blocks_4_attn_add_v_proj"} <= names
    assert len(names) == 3 * 10 + 2 * 11
    with safe_open(str(trained / "nucleus.safetensors"), "pt") as f:
        meta = f.metadata()
    assert (meta["ss_base_model_version"], meta["ss_timestep_sampling"]) == ("nucleus-image", "nucleus_shift")
    assert meta["ss_base_precision"] == "fp8_scaled"
    assert meta["modelspec.architecture"] == "nucleus-image/lora"  # sd-scripts' style
    assert sample_png(trained, "nucleus", "final").stat().st_size > 0


def inputs(seed=0):
    """A packed target [1, 12, 64] and text [1, 7, 32]."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, H * W, 64, generator=g), {"embeds": torch.randn(1, T, WIDTH, generator=g)}


def random_lora(model, **network_args) -> LoRANetwork:
    """rank 4, alpha 2, up ~ N(0, 0.3): a delta near the size of the weights, so any mistake shows."""
    torch.manual_seed(3)
    net = LoRANetwork(model, "nucleus_image", rank=4, alpha=2, network_args=network_args)
    with torch.no_grad():
        for m in net.lora_modules():
            m.lora_up.weight.normal_(0, 0.3)
    return net


def diffusers_velocity(model, x, sigma, text):
    """NucleusMoEImageTransformer2DModel on our packed tokens as the pipeline calls it (img_shapes, timestep =
    sigma, the text mask), negated as the pipeline negates it: the flow velocity."""
    out = model(hidden_states=x, img_shapes=[(1, H, W)] * x.shape[0], encoder_hidden_states=text["embeds"],
                encoder_hidden_states_mask=text.get("mask"), timestep=sigma, return_dict=False)
    return -out[0]


@torch.no_grad()
def test_converted_loras_load_in_diffusers_nucleus_transformer_with_our_output(tiny_set, tmp_path):
    """Our kohya file (every default target and the embedders / final layer through in_dims) -> convert_lora
    --to diffusers (transformer.*) / --to comfy (diffusion_model.*, ai-toolkit's layout) -> diffusers'
    NucleusMoEImageTransformer2DModel.load_lora_adapter (PeftAdapterMixin; diffusers has no Nucleus-Image loader
    mixin: ai-toolkit swaps diffusion_model. for transformer., the prefix argument here) on diffusers' transformer
    with the same weights: its velocity equals ours with the runtime LoRA; each file is told to be
    Nucleus-Image's, and ours reads the diffusion_model.* file back as the kohya one."""
    from diffusers import NucleusMoEImageTransformer2DModel

    from networks import lora_files as lf
    from tools import convert_lora

    family = NucleusImageFamily(tiny_set["nucleus_image"])
    ours = family.load_transformer(torch.float32)
    x, text = inputs()
    sigma = torch.tensor([0.4])
    net = random_lora(ours, in_dims="[4, 4, 4]")
    net.save(str(tmp_path / "kohya.safetensors"))
    for layout in ("diffusers", "comfy"):
        assert convert_lora.main([str(tmp_path / "kohya.safetensors"), str(tmp_path / f"{layout}.safetensors"),
                                  "--to", layout]) == 0
        tensors, metadata, _ = lf.read_lora_tensors(str(tmp_path / f"{layout}.safetensors"))
        assert convert_lora.detect_arch(tensors, metadata) == "nucleus_image", layout
    base = family.predict(ours, x, sigma, text, H, W, None)
    net.apply()
    want = family.predict(ours, x, sigma, text, H, W, None)
    net.remove()
    LoRANetwork.from_weights(ours, "nucleus_image", str(tmp_path / "comfy.safetensors")).apply()
    read_back = family.predict(ours, x, sigma, text, H, W, None)

    theirs = NucleusMoEImageTransformer2DModel.from_pretrained(tiny_set["nucleus_image_diffusers"]).eval()
    assert (diffusers_velocity(theirs, x, sigma, text) - base).abs().max() <= 1e-5  # negation, packing as theirs
    diffs = {"ours_from_comfy": (read_back - want).abs().max().item()}
    for layout, prefix in (("diffusers", "transformer"), ("comfy", "diffusion_model")):
        theirs.load_lora_adapter(str(tmp_path / f"{layout}.safetensors"), prefix=prefix, adapter_name=layout)
        theirs.set_adapters(layout)
        diffs[layout] = (diffusers_velocity(theirs, x, sigma, text) - want).abs().max().item()
        theirs.delete_adapters(layout)
    print("Nucleus-Image LoRA, max abs diff:", diffs, "effect", (want - base).abs().max().item())
    assert (want - base).abs().max() > 1e-2 and max(diffs.values()) <= 1e-5, diffs


@torch.no_grad()
def test_sampling_equals_the_pipelines_loop_with_cfg(tiny_set):
    """NucleusMoEImagePipeline (the tiny transformer folder, FlowMatchEulerDiscreteScheduler as released: shift 1.0,
    no dynamic shifting; 3 steps, guidance 4.0 with a negative prompt of another length and the per-token norm
    rescale, the noise from the same seed; the prompt padded with a mask) gives our latents (packed, normalised:
    output_type latent)."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, NucleusMoEImagePipeline
    from diffusers import NucleusMoEImageTransformer2DModel

    family = NucleusImageFamily(tiny_set["nucleus_image"])
    model = family.load_transformer(torch.float32)
    g = torch.Generator().manual_seed(4)
    text, negative = torch.randn(1, T, WIDTH, generator=g), torch.randn(1, 2, WIDTH, generator=g)
    text_mask = torch.arange(T)[None] < 5  # two padded tokens, as a batch's shorter caption has them
    steps, size = 3, 48  # 3 x 3 patches
    ours = family.sample_latents(model, {"embeds": text, "mask": text_mask}, size, size, steps, seed=7, guidance=4.0,
                                 negative_text={"embeds": negative, "mask": torch.ones(1, 2, dtype=torch.bool)})

    transformer = NucleusMoEImageTransformer2DModel.from_pretrained(tiny_set["nucleus_image_diffusers"])
    scheduler = FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=False)
    pipe = NucleusMoEImagePipeline(transformer=transformer, scheduler=scheduler, text_encoder=None, processor=None,
                                   vae=AutoencoderKLQwenImage.from_pretrained(tiny_set["qwen_image_vae"]))
    theirs = pipe(prompt_embeds=text, prompt_embeds_mask=text_mask, negative_prompt_embeds=negative,
                  negative_prompt_embeds_mask=torch.ones(1, 2, dtype=torch.long), height=size, width=size,
                  num_inference_steps=steps, guidance_scale=4.0, generator=torch.Generator().manual_seed(7),
                  output_type="latent").images
    diff = (pack_latents(ours) - theirs).abs().max().item()
    print("Nucleus-Image sampling vs NucleusMoEImagePipeline, max abs diff:", diff)
    assert diff <= 1e-5


@torch.no_grad()
def test_a_batch_of_captions_of_other_lengths_predicts_each_as_alone(tiny_set):
    """Captions of 5, 9 and 2 tokens in one batch (collate zero-pads them, the mask says where): each row's
    prediction is the one it gets alone (the routing is per sample: the text is no MoE token); without the mask the
    zeros would count."""
    from library.data.dataset import _pad_stack

    family = NucleusImageFamily(tiny_set["nucleus_image"])
    model = family.load_transformer(torch.float32)
    g = torch.Generator().manual_seed(5)
    captions = [{"embeds": torch.randn(n, WIDTH, generator=g), "mask": torch.ones(n, dtype=torch.bool)}
                for n in (5, 9, 2)]
    batch = {k: _pad_stack([c[k] for c in captions]) for k in captions[0]}
    x, sigmas = torch.randn(3, H * W, 64, generator=g), torch.tensor([0.2, 0.5, 0.9])
    together = family.predict(model, x, sigmas, batch, H, W, None)
    for i, caption in enumerate(captions):
        alone = family.predict(model, x[i : i + 1], sigmas[i : i + 1], stack_text([caption]), H, W, None)
        assert (together[i : i + 1] - alone).abs().max() <= 1e-5, i
    padded = family.predict(model, x[2:], sigmas[2:], {"embeds": batch["embeds"][2:]}, H, W, None)
    assert (padded - together[2:]).abs().max() > 1e-4


@torch.no_grad()
@pytest.mark.parametrize("base_key", ["nucleus_image", "nucleus_image_diffusers"])
def test_merge_lora_into_both_layouts_equals_the_runtime_lora(tiny_set, trained, tmp_path, base_key):
    from tools import merge_lora

    lora = str(trained / "nucleus.safetensors")
    merged = str(tmp_path / ("merged.safetensors" if base_key == "nucleus_image" else "merged"))
    assert merge_lora.main(["--model", tiny_set[base_key], "--lora", f"{lora}:0.7", "--save_to", merged]) == 0
    family = NucleusImageFamily(tiny_set["nucleus_image"])
    model = family.load_transformer(torch.float32)
    x, text = inputs(1)
    base = family.predict(model, x, torch.tensor([0.3]), text, H, W, None)
    LoRANetwork.from_weights(model, "nucleus_image", lora, multiplier=0.7).apply()
    want = family.predict(model, x, torch.tensor([0.3]), text, H, W, None)
    got = family.predict(NucleusImageFamily(merged).load_transformer(torch.float32), x, torch.tensor([0.3]), text,
                         H, W, None)
    assert (want - base).abs().max() > 1e-6 and (got - want).abs().max() <= 1e-5


def test_generate_renders_with_cfg_and_the_lora(tiny_set, trained, tmp_path):
    """The pipeline's CFG (the empty negative prompt at its default 4.0) and the trained LoRA."""
    from PIL import Image

    from tools import generate

    out = tmp_path / "gen"
    assert generate.main(["--model_type", "nucleus_image", "--model", tiny_set["nucleus_image"], "--ae",
                          tiny_set["qwen_image_vae"], "--text_encoder", tiny_set["nucleus_image_text_encoder"],
                          "--prompt", "a red square --s 2", "--width", "48", "--height", "32", "--dtype", "fp32",
                          "--seed", "0", "--out", str(out), "--lora", f"{trained / 'nucleus.safetensors'}:0.8"]) == 0
    (png,) = out.glob("*.png")
    with Image.open(png) as image:
        assert image.size == (48, 32) and image.text["steps"] == "2" and float(image.text["guidance"]) == 4.0


def test_lora_files_module_paths_are_the_models_linears_and_packed_experts():
    """convert_lora resolves kohya names against lora_files.module_paths: the released model's Linears (dense blocks
    0-2, then routers and shared experts) and packed expert weights (the experts LoRA type's modules, by parameter
    path), and the tiny one's, built on meta."""
    import torch.nn as nn

    from library.models.nucleus_image.lora_files import module_paths
    from library.models.nucleus_image.model import NUCLEUS_IMAGE, NucleusImage
    from library.models.nucleus_image.tiny import tiny_config
    from networks.lora_packed import packed_targets

    for config in (NUCLEUS_IMAGE, tiny_config()):
        with torch.device("meta"):
            model = NucleusImage(config)
        linears = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
        packed = {n for n, _ in packed_targets(model)}
        assert len(packed) == 2 * len(config.moe_blocks)
        assert set(module_paths({"transformer_blocks": config.num_layers})) == linears | packed, config.num_layers


def test_lora_info_names_a_nucleus_lora_and_its_release_and_not_qwen_images(tmp_path):
    """Released shapes (width 2048, text 4096, 32 blocks): Nucleus-Image by its own names and by shapes alone (an
    attention-only file); a file of its dense blocks' img_mlp.net and img_mod.1 only (Qwen-Image's names) is told by
    no marker of either."""
    from networks import lora_files as lf
    from networks.lora_arch import base_arch_of_names
    from tools import lora_info

    def w(width_in, width_out):
        return lf.LoRAWeights(torch.zeros(1, width_in), torch.zeros(width_out, 1), 1.0)

    own = {"transformer_blocks.31.encoder_proj": w(4096, 2048), "transformer_blocks.0.attn.to_q": w(2048, 2048),
           "transformer_blocks.3.img_mlp.gate": w(4096, 64)}
    attention = {f"transformer_blocks.{i}.attn.{n}": w(2048, 512 if n in ("to_k", "to_v") else 2048)
                 for i in range(32) for n in ("to_q", "to_k", "to_v")}
    shared = {f"transformer_blocks.{i}.{n}": w(2048, 8192 if "mod" in n else 10752)
              for i in range(3) for n in ("img_mod.1", "img_mlp.net.0.proj")}
    for name, modules in (("own", own), ("attention", attention), ("shared", shared)):
        lf.write_kohya(modules, str(tmp_path / f"{name}.safetensors"))
    assert lora_info.read_info(str(tmp_path / "own.safetensors"))["arch"] == "nucleus_image"
    got = lora_info.read_info(str(tmp_path / "attention.safetensors"))
    assert (got["arch"], got["fits"]) == ("nucleus_image", "Nucleus-Image")
    with pytest.raises(ValueError, match="cannot tell"):
        base_arch_of_names([f"lora_unet_{m.replace('.', '_')}.lora_down.weight" for m in shared])
