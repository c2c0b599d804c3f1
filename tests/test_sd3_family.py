"""SD3 / SD3.5 as a trainable family on the tiny models: train_lora.py trains from configs/sd3.toml's settings
(sd3_shift, fp8 scaled base) and saves a kohya LoRA in sd-scripts' names (every joint-block Linear, modulation and
MMDiT-X's attn2 included); the LoRA converted by tools/convert_lora.py to diffusers' names loads in
StableDiffusion3Pipeline.load_lora_weights with our runtime output; each layout is told from FLUX.1's; our sampling
equals diffusers' StableDiffusion3Pipeline (shift 3, CFG); merge_lora merges into SAI's single file; an image past the
position table is refused before caching."""

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import train_lora
from library.models.latents import pack_latents
from library.models.sd3.family import SD3Family
from networks.lora import LoRANetwork
from tests import test_lora_clients as lora_clients
from tests.model_checks import lora_read_back
from tests.test_train_lora import read_losses, sample_png

H, W = 2, 3  # the tiny targets' patch grid (latent 4 x 6)
CONTEXT, POOLED = 64, 64  # the tiny encoders' joint context and pooled widths (the tiny transformer's inputs)


def family_of(tiny_set) -> SD3Family:
    return SD3Family(tiny_set["sd3"], tiny_set["sd3_vae"], clip_l=tiny_set["sd3_clip_l"],
                     clip_g=tiny_set["sd3_clip_g"], t5xxl=tiny_set["sd3_t5xxl"])


def run_args(tiny_set, out) -> list[str]:
    return ["--model_type", "sd3", "--pretrained_model_name_or_path", tiny_set["sd3"], "--ae", tiny_set["sd3_vae"],
            "--clip_l", tiny_set["sd3_clip_l"], "--clip_g", tiny_set["sd3_clip_g"], "--t5xxl", tiny_set["sd3_t5xxl"],
            "--t5xxl_max_token_length", "32", "--dataset_config", tiny_set["dataset_config"],
            "--sample_prompts", tiny_set["sample_prompts"], "--output_dir", str(out), "--output_name", "sd3",
            "--max_train_steps", "3", "--mixed_precision", "no", "--fp8_base", "--fp8_scaled", "--network_dim", "4",
            "--network_alpha", "4", "--optimizer_type", "AdamW", "--learning_rate", "3e-3", "--save_every_n_steps", "0"]


@pytest.fixture(scope="module")
def trained(tiny_set, tmp_path_factory):
    """Three steps from configs/sd3.toml's settings (its fp8_scaled base, the family's draw), fp32 compute, samples
    at the end: the output folder."""
    out = tmp_path_factory.mktemp("sd3_run")
    assert train_lora.main(run_args(tiny_set, out)) == 0
    return out


def test_sd3_lora_trains_saves_and_samples(trained):
    losses = read_losses(trained, "sd3")
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    names = {k.split(".")[0] for k in load_file(trained / "sd3.safetensors")}
    # sd-scripts' default: every Linear of the 3 joint blocks (qkv, proj, fc1, fc2, adaLN of each stream; block 0's
    # attn2 qkv and proj; the last block's pre-only text stream: its qkv and adaLN), no embedder or final layer
    assert {"lora_unet_joint_blocks_0_x_block_attn_qkv", "lora_unet_joint_blocks_0_x_block_attn2_proj",
            "lora_unet_joint_blocks_1_context_block_mlp_fc2", "lora_unet_joint_blocks_1_x_block_adaLN_modulation_1",
            "lora_unet_joint_blocks_2_context_block_attn_qkv"} <= names
    assert len(names) == 12 + 10 + 7
    with safe_open(str(trained / "sd3.safetensors"), "pt") as f:
        meta = f.metadata()
    assert (meta["ss_base_model_version"], meta["ss_timestep_sampling"]) == ("sd3.5-medium", "sd3_shift")
    assert meta["modelspec.architecture"] == "stable-diffusion-3-5-medium/lora"
    assert sample_png(trained, "sd3", "final").stat().st_size > 0


def inputs(seed=0, length=7):
    """Patch tokens [1, 6, 64] and one caption's cached text (the joint context, the pooled vector)."""
    g = torch.Generator().manual_seed(seed)
    text = {"context": torch.randn(1, length, CONTEXT, generator=g), "pooled": torch.randn(1, POOLED, generator=g)}
    return torch.randn(1, H * W, 64, generator=g), text


def diffusers_velocity(reference, x, sigma, text) -> torch.Tensor:
    """diffusers' transformer on our tokens and cached text (t = 1000 sigma; its latents [B, 16, 2H, 2W])."""
    from library.models.latents import unpack_latents

    out = reference(hidden_states=unpack_latents(x, 2 * H, 2 * W), timestep=1000 * sigma,
                    encoder_hidden_states=text["context"], pooled_projections=text["pooled"], return_dict=False)[0]
    return pack_latents(out)


def diffusers_twin(model):
    from diffusers import SD3Transformer2DModel

    from library.models.sd3.checkpoint import diffusers_config, to_diffusers_state_dict

    reference = SD3Transformer2DModel(**diffusers_config(model.config))
    reference.load_state_dict(to_diffusers_state_dict(model.state_dict(), model.config))
    return reference.eval()


@torch.no_grad()
def test_converted_loras_load_in_diffusers_with_our_output(tiny_set, tmp_path):
    """Our kohya file (sd-scripts' names; every kind of module, the two adaLNs diffusers swaps too) -> convert_lora --to
    diffusers (q / k / v rows split): ours reads it back as the kohya one; StableDiffusion3Pipeline.load_lora_weights
    loads it with our runtime output. Each file is SD3's, not FLUX.1's: the kohya one by its names,
    the diffusers one (FLUX.1's double-block names) by its header (a released width would tell it too)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    from networks import lora_files as lf
    from tools import convert_lora

    family = family_of(tiny_set)
    ours = family.load_transformer(torch.float32)
    x, text = inputs()
    sigma = torch.tensor([0.4])
    net = lora_clients.random_lora(ours, "sd3", up_std=0.5, context_embedder_dim=4, t_embedder_dim=4,
                                   y_embedder_dim=4, final_layer_dim=4)
    net.save(str(tmp_path / "kohya.safetensors"), metadata={"ss_base_model_version": "sd3.5-medium"})  # as we write
    assert convert_lora.main([str(tmp_path / "kohya.safetensors"), str(tmp_path / "diffusers.safetensors"),
                              "--to", "diffusers"]) == 0
    keys = set(load_file(tmp_path / "diffusers.safetensors"))
    assert {"transformer.transformer_blocks.0.attn.to_q.lora_A.weight",
            "transformer.transformer_blocks.0.attn2.to_v.lora_B.weight",
            "transformer.transformer_blocks.1.attn.add_k_proj.lora_A.weight",
            "transformer.transformer_blocks.1.ff_context.net.0.proj.lora_A.weight",
            "transformer.time_text_embed.text_embedder.linear_1.lora_A.weight",
            "transformer.transformer_blocks.2.norm1_context.linear.lora_B.weight",
            "transformer.norm_out.linear.lora_B.weight"} <= keys
    for layout in ("kohya", "diffusers"):
        tensors, metadata, _ = lf.read_lora_tensors(str(tmp_path / f"{layout}.safetensors"))
        assert convert_lora.detect_arch(tensors, metadata) == "sd3", layout
    tensors, _, _ = lf.read_lora_tensors(str(tmp_path / "kohya.safetensors"))
    assert convert_lora.detect_arch(tensors, {}) == "sd3"  # SAI's names alone say it (a tiny width says nothing)
    base, want, diffs = lora_read_back(ours, "sd3", net, {"diffusers": tmp_path / "diffusers.safetensors"},
                                       lambda: family.predict(ours, x, sigma, text, H, W, None))
    reference = diffusers_twin(ours)
    assert (diffusers_velocity(reference, x, sigma, text) - base).abs().max() <= 1e-5
    pipe = StableDiffusion3Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=None, text_encoder=None,
                                    tokenizer=None, text_encoder_2=None, tokenizer_2=None, text_encoder_3=None,
                                    tokenizer_3=None, transformer=reference)
    pipe.load_lora_weights(str(tmp_path / "diffusers.safetensors"), adapter_name="ours")  # SD3LoraLoaderMixin
    diffs["diffusers"] = (diffusers_velocity(reference, x, sigma, text) - want).abs().max().item()
    print("SD3 LoRA, max abs diff:", diffs, "effect", (want - base).abs().max().item())
    assert (want - base).abs().max() > 1e-2 and max(diffs.values()) <= 1e-5, diffs


@torch.no_grad()
def test_sampling_equals_diffusers_sd3_pipeline(tiny_set):
    """diffusers' StableDiffusion3Pipeline with the same weights, our text and noise, FlowMatchEulerDiscreteScheduler at
    the release's shift 3 and CFG 4.5 against a negative prompt, 8 steps: our latents. At shift 1 they differ."""
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    from library.models.sd3.vae import SD3VAE

    family = family_of(tiny_set)
    model = family.load_transformer(torch.float32)
    (_, text), (_, negative) = inputs(2, 9), inputs(3, 9)
    steps, guidance, size = 8, 4.5, (32, 48)  # a 2 x 3 patch grid
    ours = family.sample_latents(model, text, size[1], size[0], steps, seed=7, guidance=guidance,
                                 negative_text=negative)
    diffs = {}
    for name, shift in (("release", 3.0), ("shift 1", 1.0)):
        pipe = StableDiffusion3Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(shift=shift),
                                        vae=SD3VAE(tiny_set["sd3_vae"]).vae, text_encoder=None, tokenizer=None,
                                        text_encoder_2=None, tokenizer_2=None, text_encoder_3=None, tokenizer_3=None,
                                        transformer=diffusers_twin(model))
        (theirs,) = pipe(prompt_embeds=text["context"], pooled_prompt_embeds=text["pooled"],
                         negative_prompt_embeds=negative["context"], negative_pooled_prompt_embeds=negative["pooled"],
                         guidance_scale=guidance, height=size[0], width=size[1], num_inference_steps=steps,
                         generator=torch.Generator().manual_seed(7), output_type="latent", return_dict=False)
        vae = pipe.vae.config  # the pipeline's latents are the VAE's normalised ones, as ours
        assert (vae.scaling_factor, vae.shift_factor) == (1.5305, 0.0609) or tiny_set["sd3_vae"]
        diffs[name] = (ours - theirs).abs().max().item()
    print("StableDiffusion3Pipeline vs ours, max abs diff:", diffs)
    assert diffs["release"] <= 1e-5 and diffs["shift 1"] > 1e-2, diffs


@torch.no_grad()
def test_merge_lora_into_sais_single_file_equals_the_runtime_lora(tiny_set, trained, tmp_path):
    """Into SAI's file (model.diffusion_model. names, its pos_embed kept): the layout kept, the merged model equal to
    the runtime LoRA."""
    from tools import merge_lora

    lora = str(trained / "sd3.safetensors")
    merged = str(tmp_path / "merged.safetensors")
    assert merge_lora.main(["--model", tiny_set["sd3"], "--lora", f"{lora}:0.7", "--save_to", merged,
                            "--save_precision", "fp32"]) == 0
    with safe_open(merged, "pt") as f:
        assert {"model.diffusion_model.joint_blocks.0.x_block.attn.qkv.weight",
                "model.diffusion_model.pos_embed"} <= set(f.keys())
    family = family_of(tiny_set)
    model = family.load_transformer(torch.float32)
    x, text = inputs(1)
    base = family.predict(model, x, torch.tensor([0.3]), text, H, W, None)
    LoRANetwork.from_weights(model, "sd3", lora, multiplier=0.7).apply()
    want = family.predict(model, x, torch.tensor([0.3]), text, H, W, None)
    got = family.predict(SD3Family(merged).load_transformer(torch.float32), x, torch.tensor([0.3]), text, H, W, None)
    assert (want - base).abs().max() > 1e-6 and (got - want).abs().max() <= 1e-5


def test_the_release_names_its_sample_defaults_and_largest_image(tiny_set):
    """The tiny model is SD3.5-Medium's shape (MMDiT-X in block 0): the card's 40 steps at 4.5; its 32-patch table
    holds 512 px a side."""
    family = family_of(tiny_set)
    assert (family.sample_steps, family.sample_guidance) == (40, 4.5)
    assert family.largest_image() == (512, 512)


def test_cached_text_is_the_joint_context_and_pooled(tiny_set):
    cached = family_of(tiny_set).load_text_encoder("fp32", t5_max_length=32)(["a red circle", "a blue square"])
    assert all(set(c) == {"context", "pooled"} for c in cached)
    assert cached[0]["context"].shape == (77 + 32, CONTEXT) and cached[0]["pooled"].shape == (POOLED,)


@torch.no_grad()
def test_merge_lora_writes_a_comfyui_gguf_our_loader_reads(tiny_set, trained, tmp_path):
    """--save_precision gguf_q8_0: ComfyUI-GGUF's "sd3" layout (SAI's names without the prefix; the blocks Q8_0, the
    embedders, final layer and position table as city96's patch leaves them), which our loader reads back to the
    runtime LoRA's output within Q8_0's rounding."""
    import gguf

    from tools import merge_lora

    lora, out = str(trained / "sd3.safetensors"), str(tmp_path / "merged.gguf")
    assert merge_lora.main(["--model", tiny_set["sd3"], "--lora", lora, "--save_to", out,
                            "--save_precision", "gguf_q8_0"]) == 0
    reader = gguf.GGUFReader(out)
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert bytes(reader.fields["general.architecture"].parts[-1]).decode() == "sd3"
    assert types["joint_blocks.0.x_block.attn.qkv.weight"] == "Q8_0" and types["pos_embed"] in ("F32", "BF16")
    assert types["context_embedder.weight"] != "Q8_0" and types["final_layer.linear.weight"] != "Q8_0"
    family = family_of(tiny_set)
    model = family.load_transformer(torch.float32)
    x, text = inputs(4)
    LoRANetwork.from_weights(model, "sd3", lora).apply()
    want = family.predict(model, x, torch.tensor([0.6]), text, H, W, None)
    got = family.predict(SD3Family(out).load_transformer(torch.float32), x, torch.tensor([0.6]), text, H, W, None)
    assert 0 < ((got - want).norm() / want.norm()).item() < 0.01
