"""HiDream-I1 as a trainable family on the tiny models: train_lora.py trains from configs/hidream.toml's settings
(hidream_shift, fp8 scaled base) and saves a kohya LoRA in the released names (every block Linear: both streams'
attention, the routed and shared experts, the text feed-forward, the adaLN modulation); the LoRA converted by
tools/convert_lora.py to diffusers' and ai-toolkit's layouts loads in HiDreamImagePipeline.load_lora_weights with our
runtime output; our sampling equals diffusers' HiDreamImagePipeline (shift 3, CFG); merge_lora merges into the single
file and writes ComfyUI-GGUF's hidream layout; the release names its sample defaults."""

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import train_lora
from library.models.family import DiffusionFamily
from library.models.hidream.family import HiDreamFamily, release_in_name
from library.models.latents import pack_latents, unpack_latents
from networks.lora import LoRANetwork
from tests import test_lora_clients as lora_clients
from tests.model_checks import lora_read_back
from tests.test_train_lora import read_losses, sample_png

H, W = 2, 3  # the tiny targets' patch grid (latent 4 x 6)
T5, LLAMA, POOLED, LAYERS = 64, 64, 64, 3  # the tiny encoders' widths and Llama layers (the transformer's inputs)


def text_paths(tiny_set) -> dict[str, str]:
    return {k: tiny_set[f"hidream_{k}"] for k in ("clip_l", "clip_g", "t5xxl", "llama")}


def family_of(tiny_set, path=None, version=None) -> HiDreamFamily:
    return HiDreamFamily(path or tiny_set["hidream"], tiny_set["flux_vae_single"], version, **text_paths(tiny_set))


def run_args(tiny_set, out) -> list[str]:
    files = [a for k, v in text_paths(tiny_set).items() for a in (f"--{k}", v)]
    return ["--model_type", "hidream", "--pretrained_model_name_or_path", tiny_set["hidream"], "--ae",
            tiny_set["flux_vae_single"], *files, "--dataset_config", tiny_set["dataset_config"],
            "--sample_prompts", tiny_set["sample_prompts"], "--output_dir", str(out), "--output_name", "hidream",
            "--max_train_steps", "3", "--mixed_precision", "no", "--fp8_base", "--fp8_scaled", "--network_dim", "4",
            "--network_alpha", "4", "--optimizer_type", "AdamW", "--learning_rate", "3e-3", "--save_every_n_steps", "0"]


@pytest.fixture(scope="module")
def trained(tiny_set, tmp_path_factory):
    """Three steps from configs/hidream.toml's settings (its fp8_scaled base, the family's draw), fp32 compute, samples
    at the end: the output folder."""
    out = tmp_path_factory.mktemp("hidream_run")
    assert train_lora.main(run_args(tiny_set, out)) == 0
    return out


def test_hidream_lora_trains_saves_and_samples(trained):
    losses = read_losses(trained, "hidream")
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    names = {k.split(".")[0] for k in load_file(trained / "hidream.safetensors")}
    # ai-toolkit's default: every Linear of the 2 double and 2 single blocks (double: 8 attention, 1 adaLN, 4 x 3
    # routed + 3 shared experts, 3 text feed-forward; single: 4 + 1 + 15), no embedder, projection or final layer
    assert {"lora_unet_double_stream_blocks_0_block_attn1_to_q_t", "lora_unet_double_stream_blocks_1_block_ff_t_w2",
            "lora_unet_double_stream_blocks_0_block_ff_i_experts_3_w1",
            "lora_unet_single_stream_blocks_1_block_ff_i_shared_experts_w3",
            "lora_unet_single_stream_blocks_0_block_adaLN_modulation_1"} <= names
    assert len(names) == 2 * 27 + 2 * 20
    with safe_open(str(trained / "hidream.safetensors"), "pt") as f:
        meta = f.metadata()
    assert (meta["ss_base_model_version"], meta["ss_timestep_sampling"]) == ("hidream-i1-full", "hidream_shift")
    assert meta["modelspec.architecture"] == "hidream-i1/lora"
    assert sample_png(trained, "hidream", "final").stat().st_size > 0


def inputs(seed=0):
    """Patch tokens [1, 6, 64] and one caption's cached text (T5's and every Llama layer's states, pooled)."""
    g = torch.Generator().manual_seed(seed)
    text = {"t5": torch.randn(1, 9, T5, generator=g), "llama": torch.randn(1, LAYERS, 7, LLAMA, generator=g),
            "pooled": torch.randn(1, POOLED, generator=g)}
    return torch.randn(1, H * W, 64, generator=g), text


def diffusers_twin(model):
    from diffusers import HiDreamImageTransformer2DModel

    from library.models.hidream.checkpoint import diffusers_config

    reference = HiDreamImageTransformer2DModel(**{**diffusers_config(model.config),
                                                  "llama_layers": list(model.llama_layer_indices(LAYERS))})
    reference.load_state_dict(model.state_dict())
    return reference.eval()


def diffusers_velocity(reference, x, sigma, text, h, w) -> torch.Tensor:
    """diffusers' transformer on our tokens and cached text (t = 1000 sigma, its output negated as the pipeline does;
    latents [B, 16, 2h, 2w], square here: diffusers pads a non-square grid to 4096 tokens, ours does not)."""
    out = reference(hidden_states=unpack_latents(x, 2 * h, 2 * w), timesteps=1000 * sigma,
                    encoder_hidden_states_t5=text["t5"], encoder_hidden_states_llama3=text["llama"].transpose(0, 1),
                    pooled_embeds=text["pooled"], return_dict=False)[0]
    return -pack_latents(out)


@torch.no_grad()
def test_converted_loras_load_in_diffusers_with_our_output(tiny_set, tmp_path):
    """Our kohya file (every kind of module, the embedders, caption projections and final layer too) -> convert_lora
    --to diffusers (transformer.*) and --to comfy (ai-toolkit's diffusion_model.*): ours reads each back as the kohya
    one; HiDreamImagePipeline.load_lora_weights loads each with our runtime output (diffusers' padded forward, which
    the square grid here leaves equal to ours)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, HiDreamImagePipeline

    from networks import lora_files as lf
    from tools import convert_lora

    family = family_of(tiny_set)
    ours = family.load_transformer(torch.float32)
    g = torch.Generator().manual_seed(1)
    x, text = torch.randn(1, 9, 64, generator=g), inputs()[1]  # a 3 x 3 grid: square, as diffusers runs it unpadded
    sigma = torch.tensor([0.4])
    net = lora_clients.random_lora(ours, "hidream", up_std=0.5, x_embedder_dim=4, t_embedder_dim=4, p_embedder_dim=4,
                                   caption_projection_dim=4, final_layer_dim=4)
    net.save(str(tmp_path / "kohya.safetensors"), metadata={"ss_base_model_version": "hidream-i1-full"})
    for layout in ("diffusers", "comfy"):
        assert convert_lora.main([str(tmp_path / "kohya.safetensors"), str(tmp_path / f"{layout}.safetensors"),
                                  "--to", layout]) == 0
    keys = set(load_file(tmp_path / "diffusers.safetensors")) | set(load_file(tmp_path / "comfy.safetensors"))
    assert {"transformer.double_stream_blocks.0.block.attn1.to_q.lora_A.weight",
            "transformer.single_stream_blocks.1.block.ff_i.experts.2.w3.lora_B.weight",
            "transformer.caption_projection.3.linear.lora_A.weight",
            "diffusion_model.double_stream_blocks.1.block.ff_t.w1.lora_A.weight"} <= keys
    for layout in ("kohya", "diffusers", "comfy"):
        tensors, metadata, _ = lf.read_lora_tensors(str(tmp_path / f"{layout}.safetensors"))
        assert convert_lora.detect_arch(tensors, {}) == "hidream", layout  # the names alone say it

    base, want, diffs = lora_read_back(ours, "hidream", net, {k: tmp_path / f"{k}.safetensors"
                                                              for k in ("diffusers", "comfy")},
                                       lambda: family.predict(ours, x, sigma, text, 3, 3, None))
    assert (diffusers_velocity(diffusers_twin(ours), x, sigma, text, 3, 3) - base).abs().max() <= 1e-5
    for layout in ("diffusers", "comfy"):
        reference = diffusers_twin(family.load_transformer(torch.float32))  # the base weights, then the LoRA
        pipe = HiDreamImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=None, text_encoder=None,
                                    tokenizer=None, text_encoder_2=None, tokenizer_2=None, text_encoder_3=None,
                                    tokenizer_3=None, text_encoder_4=None, tokenizer_4=None, transformer=reference)
        pipe.load_lora_weights(str(tmp_path / f"{layout}.safetensors"), adapter_name="ours")
        diffs[f"pipeline {layout}"] = (diffusers_velocity(reference, x, sigma, text, 3, 3) - want).abs().max().item()
    print("HiDream LoRA, max abs diff:", diffs, "effect", (want - base).abs().max().item())
    assert (want - base).abs().max() > 1e-2 and max(diffs.values()) <= 1e-5, diffs


@torch.no_grad()
def test_sampling_equals_diffusers_hidream_pipeline(tiny_set):
    """diffusers' HiDreamImagePipeline with the same weights, our text and noise, FlowMatchEulerDiscreteScheduler at
    Full's shift 3 and CFG 5 against a negative prompt, 8 steps, a square 3 x 3 grid (unpadded in both): our
    latents. At shift 1 they differ."""
    from diffusers import FlowMatchEulerDiscreteScheduler, HiDreamImagePipeline

    from library.models.flux1.vae import FluxVAE

    family = family_of(tiny_set)
    model = family.load_transformer(torch.float32)
    (_, text), (_, negative) = inputs(2), inputs(3)
    steps, guidance, size = 8, 5.0, (48, 48)  # a 3 x 3 patch grid
    ours = family.sample_latents(model, text, size[1], size[0], steps, seed=7, guidance=guidance,
                                 negative_text=negative)
    diffs = {}
    for name, shift in (("release", 3.0), ("shift 1", 1.0)):
        pipe = HiDreamImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(shift=shift),
                                    vae=FluxVAE(tiny_set["flux_vae_single"]).vae, text_encoder=None, tokenizer=None,
                                    text_encoder_2=None, tokenizer_2=None, text_encoder_3=None, tokenizer_3=None,
                                    text_encoder_4=None, tokenizer_4=None, transformer=diffusers_twin(model))
        pipe.default_sample_size = size[0] // 8  # the pipeline rescales every request to this area (1024^2 released)
        (theirs,) = pipe(prompt_embeds_t5=text["t5"], prompt_embeds_llama3=text["llama"].transpose(0, 1),
                         pooled_prompt_embeds=text["pooled"], negative_prompt_embeds_t5=negative["t5"],
                         negative_prompt_embeds_llama3=negative["llama"].transpose(0, 1),
                         negative_pooled_prompt_embeds=negative["pooled"], guidance_scale=guidance,
                         height=size[0], width=size[1], num_inference_steps=steps,
                         generator=torch.Generator().manual_seed(7), output_type="latent", return_dict=False)
        diffs[name] = (ours - theirs).abs().max().item()
    print("HiDreamImagePipeline vs ours, max abs diff:", diffs)
    assert diffs["release"] <= 1e-5 and diffs["shift 1"] > 1e-2, diffs


@torch.no_grad()
@pytest.mark.parametrize("version, steps, shift", [("hidream-i1-dev", 6, 6.0), ("hidream-i1-fast", 4, 3.0)])
def test_dev_and_fast_sample_as_the_pipeline_with_their_flash_scheduler(tiny_set, monkeypatch, version, steps, shift):
    """Dev and Fast sample with the flash scheduler (the official inference.py's, diffusers' FlowMatchLCMScheduler):
    x0 re-noised to the next sigma each step. HiDreamImagePipeline with it, its fresh noise drawn from the starting
    noise's generator (the pipeline passes none to step: the global one), no guidance: our latents. Euler (what ours
    ran) differs."""
    from diffusers import FlowMatchLCMScheduler, HiDreamImagePipeline
    from diffusers.schedulers import scheduling_flow_match_lcm

    from library.models.flux1.vae import FluxVAE

    family = family_of(tiny_set, version=version)
    model = family.load_transformer(torch.float32)
    _, text = inputs(2)
    size = (48, 48)
    ours = family.sample_latents(model, text, size[1], size[0], steps, seed=7, guidance=0.0)
    generator = torch.Generator().manual_seed(7)  # the starting noise's, then each step's fresh noise
    monkeypatch.setattr(scheduling_flow_match_lcm, "randn_tensor",
                        lambda shape, **_: torch.randn(shape, generator=generator))
    pipe = HiDreamImagePipeline(scheduler=FlowMatchLCMScheduler(shift=shift),
                                vae=FluxVAE(tiny_set["flux_vae_single"]).vae, text_encoder=None, tokenizer=None,
                                text_encoder_2=None, tokenizer_2=None,
                                text_encoder_3=None, tokenizer_3=None, text_encoder_4=None, tokenizer_4=None,
                                transformer=diffusers_twin(model))
    pipe.default_sample_size = size[0] // 8
    (theirs,) = pipe(prompt_embeds_t5=text["t5"], prompt_embeds_llama3=text["llama"].transpose(0, 1),
                     pooled_prompt_embeds=text["pooled"], guidance_scale=0.0, height=size[0], width=size[1],
                     num_inference_steps=steps, generator=generator, output_type="latent", return_dict=False)
    assert (ours - theirs).abs().max().item() <= 1e-5
    monkeypatch.setattr(HiDreamFamily, "integrate", DiffusionFamily.integrate)  # Euler, as before
    plain = family.sample_latents(model, text, size[1], size[0], steps, seed=7, guidance=0.0)
    assert (plain - theirs).abs().max().item() > 1e-2


@torch.no_grad()
def test_merge_lora_into_the_single_file_equals_the_runtime_lora(tiny_set, trained, tmp_path):
    from tools import merge_lora

    lora = str(trained / "hidream.safetensors")
    merged = str(tmp_path / "merged.safetensors")
    assert merge_lora.main(["--model", tiny_set["hidream"], "--lora", f"{lora}:0.7", "--save_to", merged,
                            "--save_precision", "fp32"]) == 0
    with safe_open(merged, "pt") as f:
        assert "double_stream_blocks.0.block.ff_i.gate.weight" in set(f.keys())
    family = family_of(tiny_set)
    model = family.load_transformer(torch.float32)
    x, text = inputs(1)
    base = family.predict(model, x, torch.tensor([0.3]), text, H, W, None)
    LoRANetwork.from_weights(model, "hidream", lora, multiplier=0.7).apply()
    want = family.predict(model, x, torch.tensor([0.3]), text, H, W, None)
    got = family.predict(family_of(tiny_set, merged).load_transformer(torch.float32), x, torch.tensor([0.3]), text,
                         H, W, None)
    assert (want - base).abs().max() > 1e-6 and (got - want).abs().max() <= 1e-5


@torch.no_grad()
def test_merge_lora_writes_a_comfyui_gguf_our_loader_reads(tiny_set, trained, tmp_path):
    """--save_precision gguf_q8_0: ComfyUI-GGUF's "hidream" layout (the blocks Q8_0; the embedders, caption
    projections, final layer and the MoE gates as city96's tools leave them), which our loader reads back to the
    runtime LoRA's output within Q8_0's rounding."""
    import gguf

    from tools import merge_lora

    lora, out = str(trained / "hidream.safetensors"), str(tmp_path / "merged.gguf")
    assert merge_lora.main(["--model", tiny_set["hidream"], "--lora", lora, "--save_to", out,
                            "--save_precision", "gguf_q8_0"]) == 0
    reader = gguf.GGUFReader(out)
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert bytes(reader.fields["general.architecture"].parts[-1]).decode() == "hidream"
    assert types["double_stream_blocks.0.block.ff_i.experts.0.w1.weight"] == "Q8_0"
    assert types["double_stream_blocks.0.block.ff_i.gate.weight"] == "F32"
    assert types["caption_projection.0.linear.weight"] != "Q8_0" and types["final_layer.linear.weight"] != "Q8_0"
    family = family_of(tiny_set)
    model = family.load_transformer(torch.float32)
    x, text = inputs(4)
    LoRANetwork.from_weights(model, "hidream", lora).apply()
    want = family.predict(model, x, torch.tensor([0.6]), text, H, W, None)
    got = family.predict(family_of(tiny_set, out).load_transformer(torch.float32), x, torch.tensor([0.6]), text,
                         H, W, None)
    assert 0 < ((got - want).norm() / want.norm()).item() < 0.01


def test_the_release_names_its_sample_defaults_and_shift(tiny_set):
    """model_version, else the path's name, else Full: Full 50 steps at CFG 5 (shift 3), Dev 28 at 0 (shift 6), Fast
    16 at 0 (shift 3)."""
    assert release_in_name("models/hidream_i1_dev_fp8.safetensors") == "hidream-i1-dev"
    assert release_in_name("/x/HiDream-I1-Fast") == "hidream-i1-fast" and release_in_name("/x/model") is None
    full, dev = family_of(tiny_set), family_of(tiny_set, version="hidream-i1-dev")
    assert (full.version, full.sample_steps, full.sample_guidance) == ("hidream-i1-full", 50, 5.0)
    assert full.inference_sampling() is None
    assert (dev.sample_steps, dev.sample_guidance, dev.inference_sampling().shift) == (28, 0.0, 6.0)
    fast = family_of(tiny_set, version="hidream-i1-fast")
    assert (fast.sample_steps, fast.sample_guidance, fast.inference_sampling()) == (16, 0.0, None)
    with pytest.raises(ValueError, match="hidream-i1-full"):
        family_of(tiny_set, version="hidream-i1")


def test_cached_text_is_t5_every_llama_layer_and_pooled(tiny_set):
    cached = family_of(tiny_set).load_text_encoder("fp32")(["a red circle", "a blue square"])
    assert all(set(c) == {"t5", "llama", "pooled"} for c in cached)
    assert cached[0]["t5"].shape == (128, T5) and cached[0]["llama"].shape == (LAYERS, 128, LLAMA)
    assert cached[0]["pooled"].shape == (POOLED,)


def test_ai_toolkits_hidream_job_is_ours_with_its_llama():
    """model.arch hidream: our hidream at its 16 px buckets; the Llama from model_kwargs.llama_model_path, else
    ai-toolkit's default (unsloth/Meta-Llama-3.1-8B-Instruct, in models/), never the HiDream folder (which has none);
    the kwargs that name no file of ours are not carried."""
    from library.training.peers import ai_toolkit
    from library.training.peers.rules import NOT_CARRIED, RENAMED
    from tests.test_convert_config_ai_toolkit import job, verdict

    for kwargs, llama in (({"llama_model_path": "/m/llama", "other": 1}, "/m/llama"),
                          ({}, "models/Meta-Llama-3.1-8B-Instruct")):
        config = job()
        config["config"]["process"][0]["model"] = {"name_or_path": "HiDream-ai/HiDream-I1-Full", "arch": "hidream",
                                                   "model_kwargs": kwargs}
        t = ai_toolkit.translate(config, "run.yaml")
        assert (t.config["model_type"], t.config["llama"]) == ("hidream", llama)
        assert t.config["t5xxl"] == t.config["pretrained_model_name_or_path"] == "models/HiDream-I1-Full"
        assert [d["bucket_reso_steps"] for d in t.dataset["datasets"]] == [16]
    t = ai_toolkit.translate(job(model={"arch": "hidream", "name_or_path": "/x", "model_kwargs": {
        "llama_model_path": "/m/llama", "other": 1}}), "run.yaml")
    assert verdict(t, "model.model_kwargs.llama_model_path") == (RENAMED, "llama")
    assert verdict(t, "model.model_kwargs")[0] == NOT_CARRIED


def test_the_planner_steps_the_mixture_of_experts_on_meta(tiny_set):
    """On meta no token is routed (bincount has no values to count): the planner's step splits the (token, expert)
    pairs evenly, and its peak grows with the image, as a real step's does."""
    from library.training import memory_plan
    from tools import plan_memory

    family = family_of(tiny_set)
    args = plan_memory.default_args("hidream")
    small, large = (memory_plan.training_plan(family, args, side, side, 1, 16) for side in (64, 128))
    assert 0 < small.activations < large.activations


def test_text_encoders_take_turns_on_a_card_that_cannot_hold_them(tiny_set, tmp_path, monkeypatch):
    """Over the card together, the four encoders take turns (text_encoders_take_turns): CLIP-L stays, CLIP-G, T5-XXL and
    Llama come in for their own stage and leave after it (one at a time), and each caption's outputs are the same bit
    for bit.
    The planner's caching phase and train_lora.py decide it from the card alike: together over its usable memory."""
    from library.training import memory_plan
    from tools import plan_memory

    family, captions = family_of(tiny_set), ["a red circle", "a blue square on a long white table"]
    together = family.load_text_encoder("fp32")(captions)
    encode = family.load_text_encoder("fp32", "cpu", one_at_a_time=True)
    for _ in range(2):
        assert all(torch.equal(a[k], b[k]) for a, b in zip(together, encode(captions)) for k in a)
    encoder = encode.__self__
    assert list(encoder.placement.swap.log) == [(do, i) for i in (1, 2, 3) for do in ("load", "release")] * 2
    assert encoder.t5.model.shared.weight.numel() == encoder.llama.model.embed_tokens.weight.numel() == 0
    assert encoder.clip_g.model.text_model.embeddings.token_embedding.weight.numel() == 0
    assert encoder.clip_l.model.text_model.embeddings.token_embedding.weight.numel() > 0

    all_of, turns = memory_plan.text_encoder_bytes(family, "fp32")
    card = (all_of + turns) / 2 / 0.95 + memory_plan.CUDA_CONTEXT_BYTES  # usable between the two
    assert [memory_plan.text_encoders_one_at_a_time(family, all_of, c) for c in (card, 2 * card, None)] == [
        True, False, False]
    planned = plan_memory.default_args("hidream")
    planned.text_encoder_precision = "fp32"
    parts = memory_plan.caching_phase(family, planned, 64, 64, card_bytes=card).parts
    assert parts["text encoders (fp32, one at a time)"] == turns
    said = []
    monkeypatch.setattr(memory_plan, "device_memory", lambda device: card)
    monkeypatch.setattr(HiDreamFamily, "load_text_encoder", lambda self, *a, **kw: said.append(kw) or (
        lambda texts: together[:1] * len(texts)))
    args = [a for a in run_args(tiny_set, tmp_path) if a != "--sample_prompts" and a != tiny_set["sample_prompts"]]
    assert train_lora.main([*args, "--max_train_steps", "1", "--text_encoder_precision", "fp32"]) == 0
    assert said and all(kw == {"one_at_a_time": True} for kw in said)

