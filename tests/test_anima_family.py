"""Anima as a trainable family on the tiny models: train_lora.py trains from configs/anima.toml's settings
(anima_shift, fp8 scaled base) and saves a kohya LoRA in sd-scripts' names; a LoRA converted by tools/convert_lora.py
to ComfyUI's `diffusion_model.*` (the adapter's modules too) or diffusers' layout loads in diffusers'
AnimaLoraLoaderMixin with our runtime output, and ours reads them back; a batch of captions of other lengths predicts
as each alone; merge_lora merges into the released single file; the cached text is what the encoder gives."""

import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import train_lora
from library.models.anima.family import AnimaFamily
from library.models.family import stack_text
from networks.lora import LoRANetwork
from tests import test_lora_clients as lora_clients
from tests.model_checks import lora_read_back
from tests.test_anima_model import diffusers_forward, diffusers_pair, no_torchvision
from tests.test_train_lora import read_losses, sample_png

H, W = 3, 4  # patch grid of the target
WIDTH = 64  # the tiny Qwen3 text encoder's (the adapter's source dim)


@pytest.fixture(scope="module")
def trained(tiny_set, tmp_path_factory):
    """Three steps from configs/anima.toml's settings (its fp8_scaled option, the family's anima_shift), fp32
    compute, samples at the end: the output folder."""
    out = tmp_path_factory.mktemp("anima_run")
    assert train_lora.main([
        "--model_type", "anima", "--pretrained_model_name_or_path", tiny_set["anima"],
        "--ae", tiny_set["qwen_image_vae"], "--text_encoder", tiny_set["anima_text_encoder"],
        "--dataset_config", tiny_set["dataset_config"], "--sample_prompts", tiny_set["sample_prompts"],
        "--output_dir", str(out), "--output_name", "anima", "--max_train_steps", "3", "--mixed_precision", "no",
        "--fp8_base", "--fp8_scaled", "--network_dim", "4", "--network_alpha", "4", "--optimizer_type", "AdamW",
        "--learning_rate", "3e-3", "--save_every_n_steps", "0",
    ]) == 0
    return out


def test_anima_lora_trains_saves_and_samples(trained):
    losses = read_losses(trained, "anima")
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    names = {k.split(".")[0] for k in load_file(trained / "anima.safetensors")}
    # sd-scripts' default: every attention and MLP Linear of the 2 blocks (4 self + 4 cross + 2 MLP); no
    # modulation, adapter, embedder or final layer
    assert {"lora_unet_blocks_0_self_attn_q_proj", "lora_unet_blocks_1_cross_attn_output_proj",
            "lora_unet_blocks_0_mlp_layer1", "lora_unet_blocks_1_mlp_layer2"} <= names
    assert len(names) == 2 * 10
    with safe_open(str(trained / "anima.safetensors"), "pt") as f:
        meta = f.metadata()
    assert (meta["ss_base_model_version"], meta["ss_timestep_sampling"]) == ("anima", "anima_shift")
    assert meta["modelspec.architecture"] == "anima-preview/lora"
    assert sample_png(trained, "anima", "final").stat().st_size > 0


def inputs(seed=0, lengths=(5, 4)):
    """A packed target [1, 12, 64] and one caption's cached text (Qwen3 states [1, 5, 64], T5 ids [1, 4])."""
    g = torch.Generator().manual_seed(seed)
    nq, nt = lengths
    text = {"qwen": torch.randn(1, nq, WIDTH, generator=g), "qwen_mask": torch.ones(1, nq, dtype=torch.bool),
            "t5_ids": torch.randint(1, 32128, (1, nt), generator=g), "t5_mask": torch.ones(1, nt, dtype=torch.bool)}
    return torch.randn(1, H * W, 64, generator=g), text


def random_lora(model, **args) -> LoRANetwork:
    """rank 4, alpha 2, up ~ N(0, 0.5): a delta near the size of the weights, so any mistake shows."""
    return lora_clients.random_lora(model, "anima", up_std=0.5, **args)


@torch.no_grad()
@pytest.mark.parametrize("adapter", [False, True])
def test_converted_loras_load_in_diffusers_anima_loader_with_our_output(tiny_set, tmp_path, monkeypatch, capsys,
                                                                         adapter):
    """Our kohya file -> convert_lora --to comfy (diffusion_model.*) and, without adapter modules, --to diffusers
    (transformer.*; with them refused in one line) -> AnimaLoraLoaderMixin.lora_state_dict +
    load_lora_into_transformer / _text_conditioner on diffusers' two classes with the same weights: their velocity equals ours with the runtime LoRA; each file is told
    to be Anima's, and ours reads each back as the kohya one."""
    from diffusers.loaders.lora_pipeline import AnimaLoraLoaderMixin

    from networks import lora_files as lf
    from tools import convert_lora

    no_torchvision(monkeypatch)
    family = AnimaFamily(tiny_set["anima"])
    ours = family.load_transformer(torch.float32)
    x, text = inputs()
    sigma = torch.tensor([0.4])
    net = random_lora(ours, **({"adapter_dim": 4} if adapter else {}))
    net.save(str(tmp_path / "kohya.safetensors"))
    layouts = ("comfy",) if adapter else ("comfy", "diffusers")
    for layout in layouts:
        assert convert_lora.main([str(tmp_path / "kohya.safetensors"), str(tmp_path / f"{layout}.safetensors"),
                                  "--to", layout]) == 0
        tensors, metadata, _ = lf.read_lora_tensors(str(tmp_path / f"{layout}.safetensors"))
        assert convert_lora.detect_arch(tensors, metadata) == "anima", layout
    if adapter:  # the adapter is the pipeline's text_conditioner: no transformer.* file holds it
        assert convert_lora.main([str(tmp_path / "kohya.safetensors"), str(tmp_path / "diffusers.safetensors"),
                                  "--to", "diffusers"]) == 2
        assert "use --to comfy" in capsys.readouterr().err and not (tmp_path / "diffusers.safetensors").exists()
    files = {layout: tmp_path / f"{layout}.safetensors" for layout in layouts}
    base, want, diffs = lora_read_back(ours, "anima", net, files,
                                       lambda: family.predict(ours, x, sigma, text, H, W, None))

    transformer, conditioner = diffusers_pair(ours)
    call = dict(img=x, qwen=text["qwen"], t5_ids=text["t5_ids"], timesteps=sigma, h=H, w=W,
                qwen_mask=text["qwen_mask"], t5_mask=text["t5_mask"])
    assert (diffusers_forward(transformer, conditioner, call) - base).abs().max() <= 1e-5
    for layout in layouts:
        state = AnimaLoraLoaderMixin.lora_state_dict(str(tmp_path / f"{layout}.safetensors"))
        dit = {k: v for k, v in state.items() if k.startswith("transformer.")}
        AnimaLoraLoaderMixin.load_lora_into_transformer(dit, transformer, adapter_name=layout)
        transformer.set_adapters(layout)
        cond = {k: v for k, v in state.items() if k.startswith("text_conditioner.")}
        assert bool(cond) == adapter, layout
        if cond:
            AnimaLoraLoaderMixin.load_lora_into_text_conditioner(cond, conditioner, adapter_name=layout)
            conditioner.set_adapters(layout)
        diffs[layout] = (diffusers_forward(transformer, conditioner, call) - want).abs().max().item()
        transformer.delete_adapters(layout)
        if cond:
            conditioner.delete_adapters(layout)
    print("Anima LoRA, max abs diff:", diffs, "effect", (want - base).abs().max().item())
    assert (want - base).abs().max() > 1e-2 and max(diffs.values()) <= 1e-5, diffs


@torch.no_grad()
def test_sampling_equals_the_modular_pipelines_loop_with_cfg(tiny_set, monkeypatch):
    """The modular pipeline's loop on diffusers' classes with the same weights: AnimaSetTimestepsStep's sigmas
    linspace(1, 1/N, N) through FlowMatchEulerDiscreteScheduler at the release's shift 3, the noise [1, 16, 1, lh, lw]
    from the seed, AnimaLoopBeforeDenoiser's timestep t / 1000, ClassifierFreeGuidance 4.0 with a negative prompt of
    other lengths, a zero padding mask: our latents. A shift of 1 (the scheduler's default) would differ."""
    import numpy as np
    from diffusers import FlowMatchEulerDiscreteScheduler

    no_torchvision(monkeypatch)
    family = AnimaFamily(tiny_set["anima"])
    model = family.load_transformer(torch.float32)
    (_, text), (_, negative) = inputs(2), inputs(3, (2, 1))
    steps, size, guidance = 3, 48, 4.0  # a 6 x 6 latent, 3 x 3 patches
    ours = family.sample_latents(model, text, size, size, steps, seed=7, guidance=guidance, negative_text=negative)

    transformer, conditioner = diffusers_pair(model)
    contexts = [conditioner(source_hidden_states=t["qwen"], target_input_ids=t["t5_ids"],
                            target_attention_mask=t["t5_mask"], source_attention_mask=t["qwen_mask"])
                for t in (text, negative)]
    latents = torch.randn(1, 16, 1, 6, 6, generator=torch.Generator().manual_seed(7))
    for shift in (3.0, 1.0):
        scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps))
        x = latents
        for t in scheduler.timesteps:
            cond, uncond = (transformer(hidden_states=x, timestep=t.expand(1) / 1000, encoder_hidden_states=c,
                                        padding_mask=torch.zeros(1, 1, size, size), return_dict=False)[0]
                            for c in contexts)
            x = scheduler.step(uncond + guidance * (cond - uncond), t, x, return_dict=False)[0]
        diff = (ours - x[:, :, 0]).abs().max().item()
        print(f"shift {shift}: max abs diff {diff:.1e}")
        assert diff <= 1e-5 if shift == 3.0 else diff > 1e-2, (shift, diff)


@torch.no_grad()
def test_a_batch_of_captions_of_other_lengths_predicts_each_as_alone(tiny_set):
    """Captions of other Qwen3 and T5 lengths in one batch (collate zero-pads them, the masks say where), the empty
    caption's one masked token among them: each row's prediction is the one it gets alone; without the masks the
    zeros would count."""
    from library.data.dataset import _pad_stack

    family = AnimaFamily(tiny_set["anima"])
    model = family.load_transformer(torch.float32)
    captions = [{k: v[0] for k, v in inputs(i, n)[1].items()} for i, n in enumerate(((5, 4), (9, 2), (2, 7)))]
    captions.append({"qwen": torch.zeros(1, WIDTH), "qwen_mask": torch.zeros(1, dtype=torch.bool),
                     "t5_ids": torch.tensor([1]), "t5_mask": torch.ones(1, dtype=torch.bool)})  # "": </s> only
    batch = {k: _pad_stack([c[k] for c in captions]) for k in captions[0]}
    g = torch.Generator().manual_seed(5)
    x, sigmas = torch.randn(4, H * W, 64, generator=g), torch.tensor([0.2, 0.5, 0.9, 0.7])
    together = family.predict(model, x, sigmas, batch, H, W, None)
    assert bool(together.isfinite().all())
    for i, caption in enumerate(captions):
        alone = family.predict(model, x[i : i + 1], sigmas[i : i + 1], stack_text([caption]), H, W, None)
        assert (together[i : i + 1] - alone).abs().max() <= 1e-5, i
    unmasked = {k: v for k, v in batch.items() if not k.endswith("_mask")}
    assert (family.predict(model, x, sigmas, unmasked, H, W, None) - together)[2].abs().max() > 1e-4


@torch.no_grad()
def test_merge_lora_into_the_single_file_equals_the_runtime_lora(tiny_set, trained, tmp_path):
    from tools import merge_lora

    lora = str(trained / "anima.safetensors")
    merged = str(tmp_path / "merged.safetensors")
    # the tiny file is bf16 as released: the merged weights in float32, so that only the merge is compared
    assert merge_lora.main(["--model", tiny_set["anima"], "--lora", f"{lora}:0.7", "--save_to", merged,
                            "--save_precision", "fp32"]) == 0
    with safe_open(merged, "pt") as f:
        assert "net.llm_adapter.embed.weight" in f.keys()  # the released layout kept
    family = AnimaFamily(tiny_set["anima"])
    model = family.load_transformer(torch.float32)
    x, text = inputs(1)
    base = family.predict(model, x, torch.tensor([0.3]), text, H, W, None)
    LoRANetwork.from_weights(model, "anima", lora, multiplier=0.7).apply()
    want = family.predict(model, x, torch.tensor([0.3]), text, H, W, None)
    got = family.predict(AnimaFamily(merged).load_transformer(torch.float32), x, torch.tensor([0.3]), text, H, W, None)
    assert (want - base).abs().max() > 1e-6 and (got - want).abs().max() <= 1e-5


def test_cached_text_is_each_captions_own_tokens(tiny_set):
    """load_text_encoder's per-caption dicts: each caption's real tokens only (the empty one keeps its one masked
    Qwen3 token and T5's </s>), equal to the batch encoding's rows."""
    from library.models.anima.text_encoder import load_anima_text_encoder

    family = AnimaFamily(tiny_set["anima"], text_encoder=tiny_set["anima_text_encoder"])
    captions = ["a red circle on the left", "", "zxq"]
    cached = family.load_text_encoder("fp32")(captions)
    qwen, qwen_mask, t5_ids, t5_mask = load_anima_text_encoder(tiny_set["anima_text_encoder"],
                                                               dtype=torch.float32).encode(captions)
    for i, c in enumerate(cached):
        nq, nt = max(1, int(qwen_mask[i].sum())), int(t5_mask[i].sum())
        assert set(c) == {"qwen", "qwen_mask", "t5_ids", "t5_mask"} and c["t5_ids"].shape == (nt,)
        assert torch.equal(c["qwen"], qwen[i, :nq]) and torch.equal(c["t5_ids"], t5_ids[i, :nt])
    assert cached[1]["qwen_mask"].tolist() == [False] and cached[1]["t5_ids"].tolist() == [1]


def test_generate_renders_with_cfg_and_the_lora(tiny_set, trained, tmp_path):
    """The pipeline's CFG (the empty negative prompt at its default 4.0), the T5 tokenizer beside the encoder, the
    trained LoRA."""
    from PIL import Image

    from tools import generate

    out = tmp_path / "gen"
    assert generate.main(["--model_type", "anima", "--model", tiny_set["anima"], "--ae", tiny_set["qwen_image_vae"],
                          "--text_encoder", tiny_set["anima_text_encoder"], "--prompt", "a red square --s 2",
                          "--width", "48", "--height", "32", "--dtype", "fp32", "--seed", "0", "--out", str(out),
                          "--lora", f"{trained / 'anima.safetensors'}:0.8"]) == 0
    (png,) = out.glob("*.png")
    with Image.open(png) as image:
        assert image.size == (48, 32) and image.text["steps"] == "2" and float(image.text["guidance"]) == 4.0


def test_the_text_cache_key_follows_the_t5_tokenizer(tiny_set, tmp_path):
    """The T5 ids are cached with the Qwen3 states: another T5 tokenizer (t5_tokenizer/ beside the encoder, or the
    t5_tokenizer key) is another key, so stale ids are never reused."""
    import shutil

    root = tmp_path / "repo"
    shutil.copytree(os.path.dirname(tiny_set["anima_text_encoder"]), root)
    encoder = str(root / os.path.basename(tiny_set["anima_text_encoder"]))
    key = AnimaFamily(tiny_set["anima"], text_encoder=encoder).text_cache_key({}, "bf16")
    other = tmp_path / "other_t5"
    shutil.copytree(root / "t5_tokenizer", other)
    with open(other / "tokenizer_config.json", "a") as f:
        f.write("\n")
    assert AnimaFamily(tiny_set["anima"], None, str(other), text_encoder=encoder).text_cache_key({}, "bf16") != key
    with open(root / "t5_tokenizer" / "tokenizer_config.json", "a") as f:
        f.write("\n")
    assert AnimaFamily(tiny_set["anima"], text_encoder=encoder).text_cache_key({}, "bf16") != key
