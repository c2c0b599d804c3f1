"""Chroma transformer and prompt encoding: parity with diffusers, both file layouts, the released size."""

import json
import os
import warnings

import pytest
import torch
from diffusers import ChromaPipeline, ChromaTransformer2DModel
from safetensors.torch import load_file, save_file

from library.io import CheckpointError
from library.models.chroma.checkpoint import (
    chroma_to_diffusers_state_dict, diffusers_config, diffusers_to_chroma_state_dict, load_chroma, save_chroma_bfl,
    save_chroma_diffusers,
)
from library.models.chroma.model import CHROMA, Chroma, ChromaConfig, make_img_ids, make_txt_ids, modulation_rows
from library.models.chroma.text_encoder import chroma_text_mask, encode_chroma_prompts
from library.models.chroma.tiny import tiny_chroma_config, write_chroma, write_t5
from library.models.text_encoders import load_t5
from tests.test_train_lora import sample_png

T, B = 9, 2  # text length, batch
TEXT_MASK = torch.tensor([[True] * 4 + [False] * 5, [True] * 9])  # a padded prompt and a full one


def tiny_diffusers() -> ChromaTransformer2DModel:
    c = tiny_chroma_config()
    model = ChromaTransformer2DModel(
        in_channels=c.in_channels, num_layers=c.depth, num_single_layers=c.depth_single, attention_head_dim=c.head_dim,
        num_attention_heads=c.num_heads, joint_attention_dim=c.context_in_dim, axes_dims_rope=c.axes_dim,
        approximator_num_channels=c.approximator_in_dim, approximator_hidden_dim=c.approximator_hidden,
        approximator_layers=c.approximator_layers,
    )  # fmt: skip
    return randomize(model)


def randomize(model: torch.nn.Module) -> torch.nn.Module:
    """Every parameter random, norms around 1: zero-initialised gates and norms must matter too."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            is_norm = p.dim() == 1 and "norm" in name
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g) if is_norm else 0.15 * torch.randn(p.shape, generator=g))
    return model.eval()


def inputs(h: int, w: int, mask: torch.Tensor | None):
    g = torch.Generator().manual_seed(2)
    c = tiny_chroma_config()
    return dict(
        img=torch.randn(B, h * w, c.in_channels, generator=g), img_ids=make_img_ids(B, h, w),
        txt=torch.randn(B, T, c.context_in_dim, generator=g), txt_ids=make_txt_ids(B, T),
        timesteps=torch.tensor([0.3, 0.85]), txt_mask=mask,
    )  # fmt: skip


def diffusers_forward(model: ChromaTransformer2DModel, x: dict, h: int, w: int) -> torch.Tensor:
    # ChromaPipeline passes timestep / 1000 (sigma), 2-D ids, and the text mask extended by the image
    # tokens (_prepare_attention_mask); boolean here, see test_pipeline_mask_is_float_in_diffusers.
    img_ids = ChromaPipeline._prepare_latent_image_ids(B, h, w, "cpu", torch.float32)
    mask = x["txt_mask"]
    if mask is not None:
        mask = torch.cat((mask, torch.ones(B, h * w, dtype=torch.bool)), dim=1)
    with torch.no_grad():
        return model(
            hidden_states=x["img"], encoder_hidden_states=x["txt"], timestep=x["timesteps"], img_ids=img_ids,
            txt_ids=torch.zeros(T, 3), attention_mask=mask, return_dict=False,
        )[0]  # fmt: skip


@pytest.mark.parametrize("h, w, masked", [(4, 4, True), (3, 5, True), (3, 5, False)])
def test_chroma_matches_diffusers_fp32(h, w, masked):
    reference = tiny_diffusers()
    config = tiny_chroma_config()
    model = Chroma(config).eval()
    model.load_state_dict(diffusers_to_chroma_state_dict(reference.state_dict(), config))
    x = inputs(h, w, TEXT_MASK if masked else None)
    expected = diffusers_forward(reference, x, h, w)
    with torch.no_grad():
        out = model(**x)
    assert out.shape == (B, h * w, config.in_channels) and out.dtype == torch.float32
    assert expected.abs().mean() > 0.1
    diff = (out - expected).abs().max().item()
    print(f"chroma vs diffusers fp32 {h}x{w} masked={masked}: max abs diff {diff:.3g}")
    assert diff <= 1e-5  # measured 0.0: the same operations in the same order


def test_text_mask_changes_only_the_padded_prompt():
    model = randomize(Chroma(tiny_chroma_config()))
    with torch.no_grad():
        masked, unmasked = model(**inputs(3, 5, TEXT_MASK)), model(**inputs(3, 5, None))
    assert (masked[0] - unmasked[0]).abs().max() > 1e-3  # padding masked out
    assert torch.equal(masked[1], unmasked[1])  # nothing to mask: the same computation


def test_modulation_rows_follow_diffusers_order():
    rows = modulation_rows(CHROMA)
    assert CHROMA.modulation_rows == 344
    assert rows["single_blocks.37"] == (111, 3)  # single blocks first
    assert rows["double_blocks.0.img"] == (114, 6) and rows["double_blocks.0.txt"] == (228, 6)
    assert rows["final_layer"] == (342, 2)


def test_released_size_on_meta():
    with torch.device("meta"):
        model, reference = Chroma(CHROMA), ChromaTransformer2DModel()
    count = sum(p.numel() for p in model.parameters())
    assert count == sum(p.numel() for p in reference.parameters()) == 8_899_983_424  # "8.9 B"
    assert sum(p.numel() for p in model.distilled_guidance_layer.parameters()) == 278_285_312


def test_state_dict_conversion_round_trip_and_fits_diffusers():
    config = tiny_chroma_config()
    bfl = randomize(Chroma(config)).state_dict()
    converted = chroma_to_diffusers_state_dict(bfl, config)
    tiny_diffusers().load_state_dict(converted, strict=True)  # every name and shape diffusers expects
    back = diffusers_to_chroma_state_dict(converted, config)
    assert back.keys() == bfl.keys() and all(torch.equal(back[k], bfl[k]) for k in bfl)


def test_single_file_layout_is_diffusers_converter_input():
    """Our BFL names are what diffusers' single-file converter reads (at its hard-wired 3072 width,
    so checked by key names on the released size, built on meta)."""
    from diffusers.loaders.single_file_utils import convert_chroma_transformer_checkpoint_to_diffusers

    with torch.device("meta"):
        sd = Chroma(CHROMA).state_dict()
        expected = ChromaTransformer2DModel().state_dict()
    converted = convert_chroma_transformer_checkpoint_to_diffusers({"model.diffusion_model." + k: v for k, v in sd.items()})
    assert set(converted) == set(expected)


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("chroma_tiny"))
    return {**write_chroma(out, seed=0), **write_t5(out, seed=0)}


def test_both_layouts_load_identical_weights(tiny_files, tmp_path):
    single, folder = load_chroma(tiny_files["chroma_bfl"]), load_chroma(tiny_files["chroma_diffusers"])
    assert single.config == folder.config == tiny_chroma_config()
    a, b = single.state_dict(), folder.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # A ComfyUI-prefixed file without our config metadata: sizes from the shapes, RoPE axes given.
    prefixed = str(tmp_path / "comfy.safetensors")
    save_file({"model.diffusion_model." + k: v.contiguous() for k, v in a.items()}, prefixed)
    comfy = load_chroma(prefixed, config=tiny_chroma_config())
    assert all(torch.equal(comfy.state_dict()[k], a[k]) for k in a)
    # The pipeline folder (transformer/ inside) loads too, in bf16.
    pipeline = load_chroma(os.path.dirname(tiny_files["chroma_diffusers"]), dtype=torch.bfloat16)
    assert pipeline.compute_dtype == torch.bfloat16 and pipeline.img_in.weight.dtype == torch.bfloat16


def test_header_only_load_builds_on_meta_and_prepare_runs_first(tiny_files):
    seen = []

    def prepare(model):
        assert model.img_in.weight.is_meta
        return lambda key, tensor: seen.append(key) or {key: tensor}

    meta = load_chroma(tiny_files["chroma_bfl"], dtype=torch.bfloat16, read_weights=False)
    assert meta.img_in.weight.is_meta and meta.img_in.weight.dtype == torch.bfloat16
    load_chroma(tiny_files["chroma_diffusers"], prepare=prepare)
    assert "distilled_guidance_layer.in_proj.weight" in seen and "single_blocks.0.linear1.weight" in seen


def test_flux_file_is_one_error_naming_key_and_file(tmp_path):
    from library.models.flux1.checkpoint import save_flux_bfl
    from library.models.flux1.model import Flux, FluxConfig

    path = str(tmp_path / "flux1-schnell.safetensors")
    save_flux_bfl(Flux(FluxConfig(in_channels=64, vec_in_dim=8, context_in_dim=32, hidden_size=64, num_heads=2,
                                  depth=1, depth_single=1, axes_dim=(8, 12, 12))), path)
    with pytest.raises(CheckpointError) as error:
        load_chroma(path)
    message = str(error.value)
    assert path in message and "_mod.lin" in message and "\n" not in message
    folder = tmp_path / "transformer"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"_class_name": "FluxTransformer2DModel"}))
    save_file({"x_embedder.weight": torch.zeros(2, 2)}, str(folder / "diffusion_pytorch_model.safetensors"))
    with pytest.raises(CheckpointError, match="_class_name is 'FluxTransformer2DModel'"):
        load_chroma(str(tmp_path))


def test_wrong_shape_names_key_and_file(tiny_files, tmp_path):
    from library.io import CheckpointReader

    reader = CheckpointReader(tiny_files["chroma_bfl"])
    sd = {k: reader.get(k) for k in reader.keys()}
    sd["txt_in.weight"] = torch.zeros(64, 16)
    path = str(tmp_path / "bad.safetensors")
    save_chroma_bfl(sd, path, tiny_chroma_config())
    with pytest.raises(CheckpointError, match=r"bad\.safetensors.*'txt_in\.weight' has shape \(64, 16\)"):
        load_chroma(path)


def test_merge_lora_merges_a_flux1_lora_less_the_modulation_chroma_lacks(tiny_files, tmp_path, capsys):
    """tools/merge_lora.py refused a FLUX.1 LoRA whose header says so (ss_base_model_version flux1-dev) when merging
    into Chroma ('its deltas were learned on other weights'), though training and generate take it. Now it merges
    the 20 block modules, leaving out the 6 modulation Linears Chroma lacks with one warning line on stderr, as
    merge_lora's own (it was a Python warning, raised: run in-process, stderr had none); a file of those modules
    alone is still one line, exit 2."""
    from library.models.flux1.model import Flux, FluxConfig
    from networks import lora_files as lf
    from networks.lora import LoRANetwork
    from tools import merge_lora

    c = tiny_chroma_config()
    flux = Flux(FluxConfig(in_channels=c.in_channels, vec_in_dim=16, context_in_dim=c.context_in_dim, hidden_size=c.hidden_size,
                           num_heads=c.num_heads, depth=c.depth, depth_single=c.depth_single, axes_dim=c.axes_dim))
    net = LoRANetwork(flux, "flux", rank=2, alpha=1.0, network_args={"train_modulation": "true"})
    weights = {m.name: m.weights() for m in net.lora_modules()}
    for w in weights.values():
        w.up.normal_(0, 0.2)
    modulation = {p for p in weights if "mod" in p}
    assert (len(weights), len(modulation)) == (26, 6)
    lora, only_mod = str(tmp_path / "flux1.safetensors"), str(tmp_path / "mod.safetensors")
    lf.write_kohya(weights, lora, metadata={"ss_base_model_version": "flux1-dev"})
    lf.write_kohya({p: weights[p] for p in modulation}, only_mod, metadata={"ss_base_model_version": "flux1-dev"})
    out = tmp_path / "merged.safetensors"
    capsys.readouterr()
    with warnings.catch_warnings(record=True) as raised:  # printed as merge_lora's own warning lines, not raised
        warnings.simplefilter("always")
        assert merge_lora.main(["--model", tiny_files["chroma_bfl"], "--lora", lora, "--save_to", str(out)]) == 0
    assert [str(w.message) for w in raised] == []
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: ")]
    assert len(lines) == 1 and lines[0].startswith(f"warning: {lora}: a FLUX.1 LoRA (its header says so): left out its 6 "
                                                   f"modules this Chroma model lacks") and lines[0].endswith("kept the other 20")
    base, merged = load_file(tiny_files["chroma_bfl"]), load_file(str(out))
    assert merged.keys() == base.keys()
    for path, w in weights.items():
        if path not in modulation:
            key = f"{path}.weight"
            assert (merged[key] - base[key] - w.delta()).abs().max() <= 1e-6 * base[key].abs().max()
    assert sum(not torch.equal(merged[k], base[k]) for k in base) == 20
    assert merge_lora.main(["--model", tiny_files["chroma_bfl"], "--lora", only_mod, "--save_to", str(tmp_path / "m.safetensors")]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith(f"error: {only_mod}: a LoRA for FLUX.1") and "its 6 modules are all ones this model lacks" in error
    assert "\n" not in error and not os.path.exists(tmp_path / "m.safetensors")


# ----------------------------------------------------------------------------------------------
# Prompt encoding


def tiny_pipeline(t5_folder: str) -> ChromaPipeline:
    from transformers import AutoTokenizer, T5EncoderModel

    encoder = T5EncoderModel.from_pretrained(t5_folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(t5_folder)
    return ChromaPipeline(scheduler=None, vae=None, text_encoder=encoder, tokenizer=tokenizer, transformer=None)


def test_t5_of_a_flux1_repo_layout_reads_its_own_tokenizer_not_clips(tiny_set, tmp_path):
    """A FLUX.1 / Flex.1 repo (ai-toolkit's Chroma takes its T5 from ostris/Flex.1-alpha) keeps T5 in
    text_encoder_2/ with tokenizer_2/, CLIP in text_encoder/ with tokenizer/: given text_encoder_2/, the
    T5 took CLIP's tokenizer (its ids into T5, without a word); given the repo, CLIP's text_encoder/."""
    import shutil

    from transformers import AutoTokenizer

    from library.models.chroma.text_encoder import t5_paths, t5_tokenizer

    repo = tmp_path / "Flex.1-alpha"
    shutil.copytree(tiny_set["t5xxl"], repo / "text_encoder_2", ignore=shutil.ignore_patterns("tokenizer*"))
    shutil.copytree(tiny_set["t5xxl"], repo / "tokenizer_2", ignore=shutil.ignore_patterns("*.safetensors", "config*"))
    shutil.copytree(tiny_set["clip_l"], repo / "text_encoder")
    shutil.copytree(tiny_set["clip_l"], repo / "tokenizer", ignore=shutil.ignore_patterns("*.safetensors", "config*"))
    t5_ids = AutoTokenizer.from_pretrained(tiny_set["t5xxl"])("a red cat").input_ids
    assert t5_ids != AutoTokenizer.from_pretrained(tiny_set["clip_l"])("a red cat").input_ids
    for given in (repo / "text_encoder_2", repo):
        assert t5_paths(str(given)) == (str(repo / "text_encoder_2"), str(repo / "tokenizer_2"))
        assert t5_tokenizer(str(given))("a red cat").input_ids == t5_ids


def test_encode_prompt_matches_pipeline(tiny_files):
    prompts = ["a photo of a cat", "a painting of a house by the sea at sunset, oil on canvas, " * 3]
    t5 = load_t5(tiny_files["chroma_t5xxl"])
    pipe = tiny_pipeline(tiny_files["chroma_t5xxl"])
    length = 24  # the second prompt fills it: no padding, so no mask
    with torch.no_grad():  # as in ChromaPipeline.__call__ (with grad on, SDPA picks another kernel: ~1e-6)
        embeds, _, mask, negative, _, negative_mask = pipe.encode_prompt(
            prompts, negative_prompt="", device=torch.device("cpu"), max_sequence_length=length
        )
    ours, our_mask = encode_chroma_prompts(prompts, t5, max_length=length)
    assert ours.shape == embeds.shape == (2, length, 32) and our_mask.dtype == torch.bool
    assert (ours - embeds).abs().max().item() == 0.0
    assert torch.equal(our_mask, mask.bool())
    tokens = t5.tokenizer(prompts[0]).input_ids
    assert our_mask[0].sum().item() == len(tokens) + 1 and our_mask[1].all()  # one padding token kept
    ours_negative, ours_negative_mask = encode_chroma_prompts(["", ""], t5, max_length=length)
    assert torch.equal(ours_negative, negative) and torch.equal(ours_negative_mask, negative_mask.bool())
    # The mask the pipeline hands its transformer (_prepare_attention_mask) is ours plus the image tokens.
    full = pipe._prepare_attention_mask(2, 6, torch.float32, mask)
    assert torch.equal(full[:, :length] != 0, our_mask) and (full[:, length:] != 0).all()


def test_pipeline_mask_is_float_in_diffusers(tiny_files):
    """diffusers 0.42.1 keeps the mask in the text encoder's dtype, so its transformer gets 0/1
    floats that SDPA adds as a bias instead of masking (diffusers issue #12116). We pass booleans."""
    pipe = tiny_pipeline(tiny_files["chroma_t5xxl"])
    _, _, mask, _, _, _ = pipe.encode_prompt(["a cat"], device=torch.device("cpu"), max_sequence_length=8,
                                             do_classifier_free_guidance=False)
    full = pipe._prepare_attention_mask(1, 4, torch.float32, mask)
    assert full.dtype == torch.float32


def test_text_mask_rule():
    token_mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    assert chroma_text_mask(token_mask).int().tolist() == [[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]]


# ----------------------------------------------------------------------------------------------
# Training hooks


def test_gradient_checkpointing_gives_same_grads_and_swappable_blocks():
    model = randomize(Chroma(tiny_chroma_config())).train()
    x = inputs(3, 5, TEXT_MASK)
    grads = []
    for use_checkpoint in (False, True):
        model.zero_grad()
        model.gradient_checkpointing = use_checkpoint
        model(**x).square().mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert all(torch.allclose(grads[0][n], grads[1][n], atol=1e-6) for n in grads[0])
    assert grads[0]["distilled_guidance_layer.in_proj.weight"].abs().max() > 0
    blocks = model.swappable_blocks()
    assert len(blocks) == 4 and blocks[0] is model.double_blocks[0] and blocks[-1] is model.single_blocks[-1]


def test_bf16_positions_and_sinusoids_stay_float32():
    model = randomize(Chroma(tiny_chroma_config()))
    fp32_sd = model.state_dict()
    model.to(torch.bfloat16)
    model.compute_dtype = torch.bfloat16
    x = inputs(3, 5, TEXT_MASK)
    with torch.no_grad():
        out = model(**x)
        reference = Chroma(tiny_chroma_config())
        reference.load_state_dict(fp32_sd)
        expected = reference(**x)
    assert out.dtype == torch.bfloat16
    assert ((out.float() - expected).norm() / expected.norm()).item() < 0.05


def test_block_swap_gives_the_same_output():
    from library.models.block_swap import enable_block_swap

    model = randomize(Chroma(tiny_chroma_config())).requires_grad_(False)
    x = inputs(3, 5, TEXT_MASK)
    with torch.no_grad():
        expected = model(**x)
        assert enable_block_swap(model, 3, "cpu") is model.block_swap is not None  # the last 3 of 4 blocks
        assert torch.equal(model(**x), expected)


# ----------------------------------------------------------------------------------------------
# The registered family: training, LoRA files in diffusers, merging, sampling and generate.py


def read_losses(out, name):
    import csv

    with open(os.path.join(out, f"{name}_log.csv")) as f:
        return [float(r["loss"]) for r in csv.DictReader(f)]


@pytest.fixture(scope="module")
def trained(tiny_set, tmp_path_factory):
    """Two steps from configs/chroma.toml's settings (fp8_scaled base, fp32 compute) on the tiny set,
    with a final true-CFG sample: the output folder."""
    import train_lora

    out = tmp_path_factory.mktemp("chroma_run")
    code = train_lora.main([
        "--model_type", "chroma", "--pretrained_model_name_or_path", tiny_set["chroma_bfl"], "--ae", tiny_set["flux_vae"],
        "--t5xxl", tiny_set["chroma_t5xxl"], "--t5xxl_max_token_length", "32", "--dataset_config", tiny_set["dataset_config"],
        "--sample_prompts", tiny_set["sample_prompts"], "--output_dir", str(out), "--output_name", "chroma",
        "--max_train_steps", "2", "--mixed_precision", "no", "--fp8_base", "--fp8_scaled", "--network_dim", "4",
        "--network_alpha", "4", "--optimizer_type", "AdamW", "--learning_rate", "3e-3", "--sample_at_first", "false",
        "--save_every_n_steps", "0",
    ])  # fmt: skip
    assert code == 0
    return out


def test_chroma_lora_trains_saves_and_samples(trained):
    from safetensors import safe_open

    losses = read_losses(trained, "chroma")
    print(f"Chroma tiny training loss: {losses}")
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    with safe_open(str(trained / "chroma.safetensors"), "pt") as f:
        keys, metadata = list(f.keys()), f.metadata()
    assert "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight" in keys
    assert "lora_unet_single_blocks_1_linear2.lora_up.weight" in keys
    assert not any("_mod" in k or "distilled" in k or "_in." in k for k in keys)  # no modulation, approximator, embedders
    assert metadata["ss_base_model_version"] == "chroma" and metadata["ss_timestep_sampling"] == "flux_shift"
    assert metadata["modelspec.architecture"] == "chroma/lora"  # sd-scripts' (flux_train_network, chroma)
    assert sample_png(trained, "chroma", "final").stat().st_size > 0


def test_lora_tools_tell_a_chroma_lora_from_flux(trained):
    from tools import lora_info
    from tools.convert_lora import detect_arch

    path = str(trained / "chroma.safetensors")
    info = lora_info.read_info(path)
    assert info["arch"] == "chroma" and info["fits"].startswith("a Chroma model of width 64")
    tensors = dict(load_file(path))
    assert detect_arch(tensors, {"ss_base_model_version": "chroma"}) == "chroma"
    assert detect_arch(tensors, {}) == "flux"  # FLUX.1's names and shapes alone: FLUX.1's (--model_type settles it)
    assert detect_arch({"lora_unet_distilled_guidance_layer_in_proj.lora_down.weight": torch.zeros(1, 1)}, {}) == "chroma"


def lora_outputs(ours, theirs, seed=2):
    """(our Chroma, diffusers ChromaTransformer2DModel) on the same packed latents and masked text."""
    g = torch.Generator().manual_seed(seed)
    h, w, t = 3, 4, 6
    img = torch.randn(1, h * w, 64, generator=g)
    txt = torch.randn(1, t, 32, generator=g)
    mask = torch.tensor([[True] * 4 + [False] * 2])
    with torch.no_grad():
        mine = ours(img, make_img_ids(1, h, w), txt, make_txt_ids(1, t), torch.tensor([0.6]), mask)
        full = torch.cat((mask, torch.ones(1, h * w, dtype=torch.bool)), dim=1)
        reference = theirs(hidden_states=img, encoder_hidden_states=txt, timestep=torch.tensor([0.6]),
                           img_ids=ChromaPipeline._prepare_latent_image_ids(1, h, w, "cpu", torch.float32),
                           txt_ids=torch.zeros(t, 3), attention_mask=full, return_dict=False)[0]  # fmt: skip
    return mine, reference


def test_lora_converted_to_diffusers_loads_in_chroma_pipeline_with_our_output(tiny_set, tmp_path):
    """A kohya LoRA of ours (random, as large as the weights), converted with convert_lora --to diffusers,
    loads in ChromaPipeline.load_lora_weights (FluxLoraLoaderMixin) and gives our runtime output."""
    from peft.tuners.lora import LoraLayer

    from networks.lora import LoRANetwork
    from tools import convert_lora

    ours = randomize(load_chroma(tiny_set["chroma_bfl"]))
    folder = tmp_path / "transformer"
    save_chroma_diffusers(ours, ours.config, str(folder))
    theirs = ChromaTransformer2DModel.from_pretrained(folder).eval()
    base, base_reference = lora_outputs(ours, theirs)
    assert (base - base_reference).abs().max().item() <= 1e-5

    torch.manual_seed(3)
    net = LoRANetwork(ours, "chroma", rank=4, alpha=2)
    with torch.no_grad():
        for m in net.lora_modules():
            m.lora_up.weight.normal_(0, 1.0)
    net.save(str(tmp_path / "kohya.safetensors"))
    net.apply()
    with_lora, _ = lora_outputs(ours, theirs)
    assert ((with_lora - base).norm() / base.norm()).item() > 0.5  # the LoRA changes the output a lot

    diffusers_file = str(tmp_path / "diffusers.safetensors")
    kohya_file = str(tmp_path / "kohya.safetensors")
    assert convert_lora.main([kohya_file, diffusers_file, "--to", "diffusers", "--model_type", "chroma"]) == 0
    pipe = ChromaPipeline(scheduler=None, vae=None, text_encoder=None, tokenizer=None, transformer=theirs)
    pipe.load_lora_weights(diffusers_file)
    # qkv split into to_q/to_k/to_v and add_*_proj, linear1 into to_q/to_k/to_v/proj_mlp: 2 x 12 + 2 x 5 layers
    assert sum(isinstance(m, LoraLayer) for m in theirs.modules()) == 34
    _, reference = lora_outputs(ours, theirs)
    relative = ((with_lora - reference).norm() / with_lora.norm()).item()
    print(f"Chroma LoRA in diffusers: relative error {relative:.3g}, max abs {(with_lora - reference).abs().max().item():.3g}")
    assert relative <= 1e-5


@pytest.mark.parametrize("base_key", ["chroma_bfl", "chroma_diffusers"])
def test_merged_checkpoint_equals_runtime_lora(tiny_set, trained, tmp_path, base_key):
    """merge_lora.py takes a Chroma base (told from FLUX.1's by its approximator) in both layouts."""
    from networks.lora import LoRANetwork
    from tools import merge_lora

    lora = str(trained / "chroma.safetensors")
    assert merge_lora.open_base(tiny_set[base_key]).family == "chroma"
    out = str(tmp_path / ("merged.safetensors" if base_key == "chroma_bfl" else "merged"))
    assert merge_lora.main(["--model", tiny_set[base_key], "--lora", f"{lora}:0.7", "--save_to", out]) == 0
    x = inputs(3, 4, TEXT_MASK)
    with torch.no_grad():
        model = load_chroma(tiny_set["chroma_bfl"])
        LoRANetwork.from_weights(model, "chroma", lora, multiplier=0.7).apply()
        runtime = model(**x)
        merged = load_chroma(out)(**x)
    assert (merged - runtime).abs().max().item() <= 1e-5


def test_sampling_matches_chroma_pipeline_euler_steps(tiny_set):
    """sample_latents (true CFG, the FLUX.1-dev resolution shift) equals ChromaPipeline's Euler steps on
    the same weights, noise and prompt embeddings (the cached attended prefix: an all-True mask, which
    the pipeline's float mask leaves unchanged)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from library.models.chroma.family import ChromaFamily
    from library.models.family import stack_text
    from library.models.latents import pack_latents

    family = ChromaFamily(tiny_set["chroma_bfl"], tiny_set["flux_vae"], t5xxl=tiny_set["chroma_t5xxl"])
    encode = family.load_text_encoder("fp32", t5_max_length=32)
    text, negative = stack_text(encode(["a red cat on a chair"])), stack_text(encode(["blurry"]))
    model = family.load_transformer(torch.float32)
    width, height, steps, guidance, seed = 64, 48, 3, 4.0, 7
    ours = family.sample_latents(model, text, width, height, steps, seed, guidance, negative)

    reference = ChromaTransformer2DModel(**{k: v for k, v in diffusers_config(model.config).items() if not k.startswith("_")})
    reference.load_state_dict(chroma_to_diffusers_state_dict(model.state_dict(), model.config))
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                base_image_seq_len=256, max_image_seq_len=4096)  # FLUX.1-dev's, ai-toolkit's Chroma
    pipe = ChromaPipeline(scheduler=scheduler, vae=None, text_encoder=None, tokenizer=None, transformer=reference.eval())
    noise = family.initial_noise(1, height // 8, width // 8, torch.Generator().manual_seed(seed))
    theirs = pipe(prompt_embeds=text["t5"], prompt_attention_mask=text["mask"].float(), negative_prompt_embeds=negative["t5"],
                  negative_prompt_attention_mask=negative["mask"].float(), latents=pack_latents(noise), height=height,
                  width=width, num_inference_steps=steps, guidance_scale=guidance, output_type="latent").images
    ours_packed = pack_latents(ours)
    relative = ((ours_packed - theirs).norm() / theirs.norm()).item()
    print(f"Chroma sampling vs ChromaPipeline ({steps} Euler steps, CFG {guidance}): relative {relative:.3g}, "
          f"max abs {(ours_packed - theirs).abs().max().item():.3g}")
    assert relative <= 1e-5
    unguided = pack_latents(family.sample_latents(model, text, width, height, steps, seed, 1.0, negative))
    assert ((unguided - theirs).norm() / theirs.norm()).item() > 100 * relative  # the negative prompt mattered


def test_generate_renders_with_negative_prompt_and_lora(tiny_set, trained, tmp_path):
    from tools import generate

    code = generate.main([
        "--model_type", "chroma", "--model", tiny_set["chroma_bfl"], "--ae", tiny_set["flux_vae"],
        "--t5xxl", tiny_set["chroma_t5xxl"], "--prompt", "a red cat --w 64 --h 48 --s 2 --g 4 --n blurry",
        "--dtype", "fp32", "--text_encoder_precision", "fp32", "--lora", f"{trained / 'chroma.safetensors'}:0.8",
        "--out", str(tmp_path), "--device", "cpu",
    ])  # fmt: skip
    assert code == 0
    (png,) = tmp_path.glob("*.png")
    assert png.stat().st_size > 0


def test_memory_planner_takes_a_chroma_config_and_the_preset(tiny_set, tmp_path, capsys):
    from library.models.chroma.family import ChromaFamily
    from tools import plan_memory

    config = tmp_path / "tiny.toml"
    config.write_text("\n".join(f'{k} = "{v}"' for k, v in {
        "model_type": "chroma", "pretrained_model_name_or_path": tiny_set["chroma_bfl"], "ae": tiny_set["flux_vae"],
        "t5xxl": tiny_set["chroma_t5xxl"], "dataset_config": tiny_set["dataset_config"],
        "output_dir": tmp_path / "out"}.items()))  # fmt: skip
    assert plan_memory.main(["--config_file", str(config), "--vram", "12"]) == 0
    assert "fits with blocks_to_swap = 0" in capsys.readouterr().out
    assert plan_memory.main(["--preset", "chroma", "--vram", "24", "--resolution", "1024",
                             "--base_precision", "bf16"]) == 0
    out = capsys.readouterr().out
    assert f"base {8_899_983_424 * 2 / 2**30:.2f}" in out  # bf16 base: 2 bytes a weight (test_released_size_on_meta)
    assert "checkpoint_saves_projections" not in out  # Chroma's gates do not train: nothing to keep
    assert "with checkpoint_saves_attention = true (+" in out  # attention is kept in any family
    limit = ChromaFamily(tiny_set["chroma_bfl"], t5xxl=tiny_set["chroma_t5xxl"]).caption_token_limit(
        type("Args", (), {"t5xxl_max_token_length": None})())
    assert limit.max_tokens == 512 and limit.count("a cat") >= 2  # the words and </s>


def test_t5_tokens_above_512_are_refused_naming_the_key_before_caching(tiny_set, tmp_path, capsys):
    """t5xxl_max_token_length 1024 was refused only when the encoder loaded (after the latents were
    cached), in a line naming no key; FLUX.1, which reads the same key, takes it."""
    import train_lora
    from library.training.config import load_config
    from tests.test_reliability import files_under, one_error_line
    from tools import generate

    out = tmp_path / "out"
    code = train_lora.main([
        "--model_type", "chroma", "--pretrained_model_name_or_path", tiny_set["chroma_bfl"], "--ae", tiny_set["flux_vae"],
        "--t5xxl", tiny_set["chroma_t5xxl"], "--t5xxl_max_token_length", "1024", "--dataset_config",
        tiny_set["dataset_config"], "--output_dir", str(out), "--max_train_steps", "1",
    ])  # fmt: skip
    line = one_error_line(capsys, code)
    assert line == "error: command line: key 't5xxl_max_token_length' must be <= 512 for model_type chroma, got 1024"
    assert files_under(out) == []
    code = generate.main([
        "--model_type", "chroma", "--model", tiny_set["chroma_bfl"], "--ae", tiny_set["flux_vae"],
        "--t5xxl", tiny_set["chroma_t5xxl"], "--t5xxl_max_token_length", "1024", "--prompt", "a cat",
        "--out", str(tmp_path / "images"),
    ])  # fmt: skip
    line = one_error_line(capsys, code)
    assert line == "error: --t5xxl_max_token_length 1024: expected at most 512 for --model_type chroma"
    flux = load_config(["--model_type", "flux", "--pretrained_model_name_or_path", tiny_set["flux_bfl"],
                        "--ae", tiny_set["flux_vae_single"], "--clip_l", tiny_set["clip_l"], "--t5xxl", tiny_set["t5xxl"],
                        "--dataset_config", tiny_set["dataset_config"], "--output_dir", str(out),
                        "--t5xxl_max_token_length", "1024"])
    assert flux.t5xxl_max_token_length == 1024


def test_a_chroma_file_given_as_flux1_names_chroma(tiny_files):
    from library.models.flux1.checkpoint import load_flux

    with pytest.raises(CheckpointError) as error:
        load_flux(tiny_files["chroma_bfl"])
    assert str(error.value) == (f"{tiny_files['chroma_bfl']}: key 'distilled_guidance_layer.in_proj.weight' belongs to "
                                f"a Chroma transformer, not FLUX.1; set model_type = \"chroma\"")
