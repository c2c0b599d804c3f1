"""HunyuanImage-2.1 as a trainable family on the tiny models: train_lora.py trains from configs/hunyuan_image.toml's
settings (hunyuan_image_shift, fp8 scaled base) and saves a kohya LoRA in sd-scripts' names (every double / single
block Linear, modulation included); a dataset off the 32-px token grid is refused before caching; the LoRA converted
by tools/convert_lora.py to ComfyUI's names (img_mlp.0, img_mod.lin: what its key map takes) and to diffusers' split
rows loads with our runtime output (diffusers' HunyuanImageTransformer2DModel.load_lora_adapter); each layout is told
from FLUX.1's; our sampling equals diffusers' HunyuanImagePipeline (shift 5, CFG); a batch mixing captions with and
without quoted text predicts each as alone; merge_lora merges into Tencent's file and ComfyUI's renamed one."""

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import train_lora
from library.data.dataset import _pad_stack
from library.models.family import stack_text
from library.models.hunyuan_image.family import HunyuanImageFamily
from networks.lora import LoRANetwork
from tests import test_lora_clients as lora_clients
from tests.model_checks import lora_read_back
from tests.test_hunyuan_image_model import diffusers_twin
from tests.test_train_lora import read_losses, sample_png

H, W = 2, 3  # the tiny targets' latent grid (one token per latent pixel)
TEXT, GLYPH = 64, 32  # the tiny Qwen2.5-VL's and byT5's widths (the tiny transformer's text inputs)


def family_of(tiny_set, **paths) -> HunyuanImageFamily:
    return HunyuanImageFamily(tiny_set["hunyuan_image"], tiny_set["hunyuan_image_vae_single"],
                              text_encoder=tiny_set["hunyuan_image_text_encoder"],
                              byt5=tiny_set["hunyuan_image_glyph_encoder"], **paths)


def dataset_on_32px(tiny_set, folder) -> str:
    """The tiny dataset with its buckets on the 32-px token grid (its own steps are 16)."""
    text = open(tiny_set["dataset_config"], encoding="utf-8").read()
    path = folder / "dataset32.toml"
    path.write_text(text.replace("bucket_reso_steps = 16", "bucket_reso_steps = 32"), encoding="utf-8")
    return str(path)


def run_args(tiny_set, out, dataset: str) -> list[str]:
    return ["--model_type", "hunyuan_image", "--pretrained_model_name_or_path", tiny_set["hunyuan_image"],
            "--ae", tiny_set["hunyuan_image_vae_single"], "--text_encoder", tiny_set["hunyuan_image_text_encoder"],
            "--byt5", tiny_set["hunyuan_image_glyph_encoder"], "--dataset_config", dataset,
            "--sample_prompts", tiny_set["sample_prompts"], "--output_dir", str(out), "--output_name", "hy",
            "--max_train_steps", "3", "--mixed_precision", "no", "--fp8_base", "--fp8_scaled", "--network_dim", "4",
            "--network_alpha", "4", "--optimizer_type", "AdamW", "--learning_rate", "3e-3", "--save_every_n_steps", "0"]


@pytest.fixture(scope="module")
def trained(tiny_set, tmp_path_factory):
    """Three steps from configs/hunyuan_image.toml's settings (its fp8_scaled base, the family's draw), fp32 compute,
    samples at the end: the output folder."""
    out = tmp_path_factory.mktemp("hunyuan_image_run")
    assert train_lora.main(run_args(tiny_set, out, dataset_on_32px(tiny_set, out))) == 0
    return out


def test_hunyuan_image_lora_trains_saves_and_samples(trained):
    losses = read_losses(trained, "hy")
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    names = {k.split(".")[0] for k in load_file(trained / "hy.safetensors")}
    # sd-scripts' default: every Linear of the 2 double blocks (qkv, proj, fc1, fc2 of each stream, the two
    # modulations) and of the 2 single blocks (linear1, linear2, modulation); no refiner, embedder or final layer
    assert {"lora_unet_double_blocks_0_img_attn_qkv", "lora_unet_double_blocks_1_txt_mlp_fc2",
            "lora_unet_double_blocks_0_img_mod_linear", "lora_unet_single_blocks_1_linear1",
            "lora_unet_single_blocks_0_modulation_linear"} <= names
    assert len(names) == 2 * 10 + 2 * 3
    with safe_open(str(trained / "hy.safetensors"), "pt") as f:
        meta = f.metadata()
    assert (meta["ss_base_model_version"], meta["ss_timestep_sampling"]) == ("hunyuan-image-2.1", "hunyuan_image_shift")
    assert meta["modelspec.architecture"] == "hunyuan-image-2.1/lora"
    assert sample_png(trained, "hy", "final").stat().st_size > 0


def test_a_dataset_off_the_32px_grid_is_refused_before_caching(tiny_set, tmp_path, capsys):
    """The tiny dataset's bucket_reso_steps 16: one line naming the file and the key, before anything is encoded."""
    assert train_lora.main(run_args(tiny_set, tmp_path, tiny_set["dataset_config"])) != 0
    err = capsys.readouterr()
    assert "key 'bucket_reso_steps' = 16" in err.err and "multiples of 32 px" in err.err
    assert "encoded" not in err.out + err.err


def inputs(seed=0, length=5, glyph=0):
    """Latent tokens [1, 6, 64] and one caption's cached text (Qwen states with the mask; glyph states: 0 rows for
    none)."""
    g = torch.Generator().manual_seed(seed)
    text = {"embeds": torch.randn(1, length, TEXT, generator=g), "mask": torch.ones(1, length, dtype=torch.bool),
            "glyph": torch.randn(1, glyph, GLYPH, generator=g), "glyph_mask": torch.ones(1, glyph, dtype=torch.bool)}
    return torch.randn(1, H * W, 64, generator=g), text


def random_lora(model, **args) -> LoRANetwork:
    """rank 4, alpha 2, up ~ N(0, 0.5): a delta near the size of the weights, so any mistake shows."""
    return lora_clients.random_lora(model, "hunyuan_image", up_std=0.5, **args)


def diffusers_velocity(reference, x, sigma, text) -> torch.Tensor:
    """diffusers' transformer on our tokens and cached text (t = 1000 sigma; its latents [B, 64, H, W])."""
    from library.models.latents import from_tokens, to_tokens

    glyph = text["glyph"] if text["glyph"].shape[1] else torch.zeros(1, 1, GLYPH)
    glyph_mask = text["glyph_mask"] if text["glyph"].shape[1] else torch.zeros(1, 1, dtype=torch.bool)
    out = reference(hidden_states=from_tokens(x, H, W), timestep=1000 * sigma, encoder_hidden_states=text["embeds"],
                    encoder_attention_mask=text["mask"], encoder_hidden_states_2=glyph,
                    encoder_attention_mask_2=glyph_mask, return_dict=False)[0]
    return to_tokens(out)


@torch.no_grad()
def test_converted_loras_load_in_comfy_names_and_diffusers_with_our_output(tiny_set, tmp_path):
    """Our kohya file (sd-scripts' names; every kind of module) -> convert_lora --to comfy (ComfyUI's model names:
    img_mlp.0, img_mod.lin, modulation.lin, txt_in.t_embedder.in_layer) and --to diffusers (q / k / v rows split):
    ours reads each back as the kohya one; diffusers' HunyuanImageTransformer2DModel.load_lora_adapter loads the
    diffusers file with our runtime output. Each file is HunyuanImage's by its names or its header, not FLUX.1's."""
    from networks import lora_files as lf
    from tools import convert_lora

    family = family_of(tiny_set)
    ours = family.load_transformer(torch.float32)
    x, text = inputs(glyph=3)
    sigma = torch.tensor([0.4])
    net = random_lora(ours, refiner_dim=4, txt_in_dim=4, byt5_in_dim=4, time_in_dim=4, final_layer_dim=4)
    net.save(str(tmp_path / "kohya.safetensors"))
    for layout in ("comfy", "diffusers"):
        assert convert_lora.main([str(tmp_path / "kohya.safetensors"), str(tmp_path / f"{layout}.safetensors"),
                                  "--to", layout]) == 0
    comfy = set(load_file(tmp_path / "comfy.safetensors"))
    assert {"diffusion_model.double_blocks.0.img_mlp.0.lora_A.weight", "diffusion_model.double_blocks.1.txt_mod.lin"
            ".lora_B.weight", "diffusion_model.single_blocks.0.modulation.lin.lora_A.weight",
            "diffusion_model.txt_in.t_embedder.in_layer.lora_A.weight"} <= comfy
    assert not any(".fc1." in k and "byt5_in" not in k or "_mod.linear" in k for k in comfy)  # byt5_in: as ours
    for layout in ("kohya", "comfy", "diffusers"):
        tensors, metadata, _ = lf.read_lora_tensors(str(tmp_path / f"{layout}.safetensors"))
        assert convert_lora.detect_arch(tensors, metadata) == "hunyuan_image", layout
        if layout == "kohya":  # Tencent's names alone say it (a tiny width says nothing)
            assert convert_lora.detect_arch(tensors, {}) == "hunyuan_image"
    files = {layout: tmp_path / f"{layout}.safetensors" for layout in ("comfy", "diffusers")}
    base, want, diffs = lora_read_back(ours, "hunyuan_image", net, files,
                                       lambda: family.predict(ours, x, sigma, text, H, W, None))
    reference = diffusers_twin(ours)
    assert (diffusers_velocity(reference, x, sigma, text) - base).abs().max() <= 1e-5
    reference.load_lora_adapter(load_file(tmp_path / "diffusers.safetensors"), adapter_name="ours")  # transformer.*
    diffs["diffusers"] = (diffusers_velocity(reference, x, sigma, text) - want).abs().max().item()
    print("HunyuanImage LoRA, max abs diff:", diffs, "effect", (want - base).abs().max().item())
    assert (want - base).abs().max() > 1e-2 and max(diffs.values()) <= 1e-5, diffs


@torch.no_grad()
@pytest.mark.parametrize("glyph", [0, 4], ids=["plain", "quoted"])
def test_sampling_equals_diffusers_hunyuan_image_pipeline(tiny_set, glyph):
    """diffusers' HunyuanImagePipeline with the same weights, our text (a prompt with or without glyph text, a negative
    without) and noise, FlowMatchEulerDiscreteScheduler at the release's shift 5 and the release's guiders
    (AdaptiveProjectedMixGuidance: CFG 3.5, then adaptive projected guidance from step 5; its ocr_guider from step 38
    for the quoted prompt), 8 steps: our latents. At shift 1, or with plain CFG throughout, the plain prompt's
    differ."""
    from diffusers import (
        AdaptiveProjectedMixGuidance, ClassifierFreeGuidance, FlowMatchEulerDiscreteScheduler, HunyuanImagePipeline,
    )

    from library.models.hunyuan_image.vae import load_hunyuan_image_vae

    family = family_of(tiny_set)
    model = family.load_transformer(torch.float32)
    (_, text), (_, negative) = inputs(2, 6, glyph=glyph), inputs(3, 2)
    steps, guidance, size = 8, 3.5, (64, 96)  # a 2 x 3 latent grid
    ours = family.sample_latents(model, text, size[1], size[0], steps, seed=7, guidance=guidance,
                                 negative_text=negative)

    def glyph_of(t):  # the pipeline's zeros with an all-False mask where nothing is quoted
        return (t["glyph"], t["glyph_mask"]) if t["glyph"].shape[1] else (torch.zeros(1, 1, GLYPH),
                                                                          torch.zeros(1, 1, dtype=torch.long))
    release = dict(guider=AdaptiveProjectedMixGuidance(guidance_scale=guidance),
                   ocr_guider=AdaptiveProjectedMixGuidance(guidance_scale=guidance,
                                                           adaptive_projected_guidance_start_step=38))
    diffs = {}
    for name, shift, guiders in (("release", 5.0, release), ("shift 1", 1.0, release),
                                 ("plain cfg", 5.0, dict(guider=ClassifierFreeGuidance(guidance_scale=guidance)))):
        pipe = HunyuanImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(shift=shift),
                                    vae=load_hunyuan_image_vae(tiny_set["hunyuan_image_vae_single"]).vae,
                                    text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None,
                                    transformer=diffusers_twin(model), **guiders)
        (g, gm), (ng, ngm) = glyph_of(text), glyph_of(negative)
        (theirs,) = pipe(prompt_embeds=text["embeds"], prompt_embeds_mask=text["mask"].long(), prompt_embeds_2=g,
                         prompt_embeds_mask_2=gm.long(), negative_prompt_embeds=negative["embeds"],
                         negative_prompt_embeds_mask=negative["mask"].long(), negative_prompt_embeds_2=ng,
                         negative_prompt_embeds_mask_2=ngm.long(), height=size[0], width=size[1],
                         num_inference_steps=steps, generator=torch.Generator().manual_seed(7), output_type="latent",
                         return_dict=False)
        diffs[name] = (ours - theirs).abs().max().item()
    print(f"HunyuanImagePipeline vs ours ({'quoted' if glyph else 'plain'}), max abs diff:", diffs)
    assert diffs["release"] <= 1e-5 and diffs["shift 1"] > 1e-2, diffs
    if not glyph:  # adaptive projected guidance from step 5: steps 6 and 7 of 8
        assert diffs["plain cfg"] > 1e-3, diffs


@torch.no_grad()
def test_a_batch_mixing_quoted_and_plain_captions_predicts_each_as_alone(tiny_set):
    """Captions of other lengths, some quoting text (glyph rows) and some not, in one batch (collate zero-pads both
    kinds, the masks say where): each row's prediction is the one it gets alone."""
    family = family_of(tiny_set)
    model = family.load_transformer(torch.float32)
    captions = [{k: v[0] for k, v in inputs(i, n, glyph)[1].items()} for i, (n, glyph) in enumerate(((5, 0), (9, 4),
                                                                                                       (1, 2)))]
    batch = {k: _pad_stack([c[k] for c in captions]) for k in captions[0]}
    g = torch.Generator().manual_seed(5)
    x, sigmas = torch.randn(3, H * W, 64, generator=g), torch.tensor([0.2, 0.5, 0.9])
    together = family.predict(model, x, sigmas, batch, H, W, None)
    for i, caption in enumerate(captions):
        alone = family.predict(model, x[i : i + 1], sigmas[i : i + 1], stack_text([caption]), H, W, None)
        assert (together[i : i + 1] - alone).abs().max() <= 1e-5, i


@torch.no_grad()
@pytest.mark.parametrize("comfy", [False, True], ids=["tencent", "comfyui"])
def test_merge_lora_into_the_single_file_equals_the_runtime_lora(tiny_set, trained, tmp_path, comfy):
    """Into Tencent's file and ComfyUI's renamed one (img_mlp.0, img_mod.lin under model.diffusion_model.): the
    released layout kept, the merged model equal to the runtime LoRA."""
    from library.models.hunyuan_image.checkpoint import save_hunyuan_image_single_file
    from tools import merge_lora

    base_file = tiny_set["hunyuan_image"]
    if comfy:
        base_file = str(tmp_path / "comfy.safetensors")
        save_hunyuan_image_single_file(load_file(tiny_set["hunyuan_image"]), base_file,
                                       prefix="model.diffusion_model.", comfy_names=True)
    lora = str(trained / "hy.safetensors")
    merged = str(tmp_path / "merged.safetensors")
    assert merge_lora.main(["--model", base_file, "--lora", f"{lora}:0.7", "--save_to", merged,
                            "--save_precision", "fp32"]) == 0
    with safe_open(merged, "pt") as f:
        key = ("model.diffusion_model.double_blocks.0.img_mlp.0.weight" if comfy
               else "double_blocks.0.img_mlp.fc1.weight")
        assert key in f.keys()  # the layout kept
    family = family_of(tiny_set)
    model = family.load_transformer(torch.float32)
    x, text = inputs(1)
    base = family.predict(model, x, torch.tensor([0.3]), text, H, W, None)
    LoRANetwork.from_weights(model, "hunyuan_image", lora, multiplier=0.7).apply()
    want = family.predict(model, x, torch.tensor([0.3]), text, H, W, None)
    got = family.predict(HunyuanImageFamily(merged).load_transformer(torch.float32), x, torch.tensor([0.3]), text,
                         H, W, None)
    assert (want - base).abs().max() > 1e-6 and (got - want).abs().max() <= 1e-5


def test_cached_text_has_one_key_set_and_the_glyph_only_where_quoted(tiny_set):
    """load_text_encoder's per-caption dicts: Qwen's real tokens with their mask, and byT5's of the quoted text ('...',
    "...", Chinese quotes) or an empty [0, 32] glyph (collate stacks one key set)."""
    family = family_of(tiny_set)
    cached = family.load_text_encoder("fp32")(["a sign saying \"open\"", "a red circle", "“你好” on a wall"])
    assert all(set(c) == {"embeds", "mask", "glyph", "glyph_mask"} for c in cached)
    assert [c["glyph"].shape[0] > 0 for c in cached] == [True, False, True]
    assert cached[1]["glyph"].shape == (0, GLYPH) and cached[0]["embeds"].shape[1] == TEXT


def test_the_distilled_release_is_refused_before_a_weight_is_read(tmp_path):
    from library.io import CheckpointError
    from library.models.hunyuan_image.checkpoint import save_hunyuan_image_single_file
    from library.models.hunyuan_image.model import HunyuanImage
    from library.models.hunyuan_image.tiny import tiny_config
    import dataclasses

    config = dataclasses.replace(tiny_config(), guidance_embeds=True, use_meanflow=True)
    path = str(tmp_path / "distilled.safetensors")
    save_hunyuan_image_single_file(HunyuanImage(config).state_dict(), path)
    with pytest.raises(CheckpointError, match="distilled"):
        HunyuanImageFamily(path).load_transformer(torch.float32)


def test_a_sample_side_off_the_32px_grid_is_rounded_down_with_a_warning(tiny_set):
    """A sample prompt's --w 48 --h 80 renders at 32 x 64 (the prompt parser's 16-px rounding left it; the latent
    grid would have floored it without a word)."""
    with pytest.warns(UserWarning, match="sample width 48 is not a multiple of 32: rendering 32"):
        width, height, references = family_of(tiny_set).sample_references([], 48, 80)
    assert (width, height, references) == (32, 64, [])
