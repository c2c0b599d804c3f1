"""HunyuanImage-2.1 transformer: parity with diffusers' HunyuanImageTransformer2DModel on the same weights (converted
by checkpoint.to_diffusers_state_dict) on square and non-square grids, with and without glyph text, a batch of
captions of different real lengths (each row equal to diffusers' run alone), the distilled release's guidance and
MeanFlow embeddings, the sigma / velocity convention, the released size on `meta`, the checkpoint layouts (Tencent's
single file, ComfyUI's prefix and names, a diffusers folder) loading the same weights, a FLUX.1 file refused in one
line, gradient checkpointing and the RoPE positions.

The convention: our forward takes sigma in [0, 1] and returns the flow velocity noise - x0 on tokens [B, h*w, C];
diffusers' transformer takes the scheduler's t = 1000 sigma on latents [B, C, h, w] and returns the same velocity
(FlowMatchEulerDiscreteScheduler steps x + (sigma_next - sigma) v): ours(x, sigma) == diffusers(x, 1000 sigma)."""

import pytest
import torch
from diffusers import HunyuanImageTransformer2DModel
from diffusers.models.transformers.transformer_hunyuanimage import HunyuanImageByT5TextProjection
from safetensors.torch import load_file, save_file

from library.io import CheckpointError
from library.models.hunyuan_image import model as hunyuan_model
from library.models.hunyuan_image.checkpoint import (
    comfy_key, diffusers_config, load_hunyuan_image, module_map, save_hunyuan_image_diffusers,
    save_hunyuan_image_single_file, to_diffusers_state_dict,
)
from library.models.hunyuan_image.model import HUNYUAN_IMAGE, HunyuanImage, HunyuanImageConfig, random_inputs
from library.models.hunyuan_image.tiny import tiny_config, write_hunyuan_image, write_sized_hunyuan_image
from tests.model_checks import checkpointing_gradients, randomized

# 2 heads of 32, RoPE 16 + 16; the text (40) and glyph (24) widths differ from the model's (64) and from each other,
# byt5_in's hidden (48) from both, so a swapped embedder cannot pass
TINY = dict(in_channels=16, out_channels=16, hidden_size=64, num_heads=2, depth=2, depth_single=2, text_dim=40,
            glyph_dim=24, glyph_hidden=48, refiner_depth=2, axes_dim=(16, 16))
S, G = 7, 6  # Qwen and glyph tokens, padded


def random_model(config: HunyuanImageConfig, seed: int = 0) -> HunyuanImage:
    """Every parameter random (the references zero-init the modulation and the final layer): norms around 1."""
    return randomized(HunyuanImage(config), seed)


def diffusers_twin(model: HunyuanImage) -> HunyuanImageTransformer2DModel:
    """diffusers' class at the model's config with its weights (its byT5 projection at our hidden width: diffusers
    fixes 2048)."""
    cfg = model.config
    reference = HunyuanImageTransformer2DModel(**{k: v for k, v in diffusers_config(cfg).items() if k != "_class_name"})
    reference.context_embedder_2 = HunyuanImageByT5TextProjection(cfg.glyph_dim, cfg.glyph_hidden, cfg.hidden_size)
    reference.load_state_dict(to_diffusers_state_dict(model.state_dict(), cfg), strict=True)
    return reference.eval()


def inputs(config: HunyuanImageConfig, h: int, w: int, lengths=(3, S), glyphs=(4, 0), seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    b = len(lengths)
    x = dict(img=torch.randn(b, h * w, config.in_channels, generator=g),
             txt=torch.randn(b, S, config.text_dim, generator=g),
             txt_mask=torch.arange(S)[None] < torch.tensor(lengths)[:, None], timesteps=torch.rand(b, generator=g),
             h=h, w=w)
    if glyphs is not None:
        x["glyph"] = torch.randn(b, G, config.glyph_dim, generator=g)
        x["glyph_mask"] = torch.arange(G)[None] < torch.tensor(glyphs)[:, None]
    return x


def diffusers_velocity(reference: HunyuanImageTransformer2DModel, x: dict, **extra) -> torch.Tensor:
    """Our convention through theirs: tokens -> latents, t = 1000 sigma; a prompt without glyph text gets the
    pipeline's zeros (128 byT5 tokens) with an all-False mask."""
    b, c = x["img"].shape[0], x["img"].shape[-1]
    latents = x["img"].transpose(1, 2).reshape(b, c, x["h"], x["w"])
    glyph = x.get("glyph", torch.zeros(b, 128, reference.config.text_embed_2_dim))
    glyph_mask = x.get("glyph_mask", torch.zeros(b, 128, dtype=torch.bool))
    out = reference(latents, 1000 * x["timesteps"], x["txt"], x["txt_mask"].long(), encoder_hidden_states_2=glyph,
                    encoder_attention_mask_2=glyph_mask.long(), return_dict=False, **extra)[0]
    return out.flatten(2).transpose(1, 2)


@pytest.mark.parametrize("grid", [(4, 4), (3, 5)])
@pytest.mark.parametrize("glyphs", [(4, 0), None])
def test_hunyuan_image_matches_diffusers_fp32(grid, glyphs):
    """Square and non-square grids; captions of 3 and 7 real tokens; glyph text in row 0 only, or in none (glyph=None
    against the pipeline's zeros with an all-False mask). A sigma fed unscaled (not x 1000) differs: the test can
    fail."""
    model = random_model(HunyuanImageConfig(**TINY))
    reference = diffusers_twin(model)
    x = inputs(model.config, *grid, glyphs=glyphs)
    with torch.no_grad():
        ours, theirs = model(**x), diffusers_velocity(reference, x)
        unscaled = diffusers_velocity(reference, {**x, "timesteps": x["timesteps"] / 1000})
    diff = (ours - theirs).abs().max().item()
    print(f"grid {grid}, glyphs {glyphs}: max abs diff {diff:.2e}, output scale {theirs.abs().max().item():.2f}")
    assert ours.shape == (2, grid[0] * grid[1], 16) and diff <= 1e-5
    assert (ours - unscaled).abs().max().item() > 1e-2


def test_rows_of_different_lengths_match_each_alone():
    """Row 0 (3 real Qwen tokens of 7, 4 glyph tokens of 6) equals diffusers' run of row 0 alone on its real tokens;
    what the padding holds does not matter; the masks are read."""
    model = random_model(HunyuanImageConfig(**TINY))
    reference = diffusers_twin(model)
    x = inputs(model.config, 3, 4)
    alone = {**x, "img": x["img"][:1], "txt": x["txt"][:1, :3], "txt_mask": x["txt_mask"][:1, :3],
             "glyph": x["glyph"][:1, :4], "glyph_mask": x["glyph_mask"][:1, :4], "timesteps": x["timesteps"][:1]}
    padded = {**x, "txt": x["txt"].clone(), "glyph": x["glyph"].clone()}
    padded["txt"][0, 3:], padded["glyph"][0, 4:], padded["glyph"][1] = 100.0, 100.0, 100.0
    with torch.no_grad():
        ours, theirs_alone, changed = model(**x), diffusers_velocity(reference, alone), model(**padded)
        unmasked = model(**{**x, "txt_mask": None})
    diff = (ours[:1] - theirs_alone).abs().max().item()
    print(f"row 0 alone: max abs diff {diff:.2e}; padding changed: {(changed - ours).abs().max().item():.2e}")
    assert diff <= 1e-5 and (changed - ours).abs().max().item() <= 1e-5
    assert (ours[0] - unmasked[0]).abs().max().item() > 1e-2


def test_no_glyph_equals_all_masked_glyph():
    """glyph=None is exactly a glyph input whose mask is all False (the pipeline's zeros for a prompt without
    quotes)."""
    model = random_model(HunyuanImageConfig(**TINY))
    x = inputs(model.config, 3, 4, glyphs=None)
    with torch.no_grad():
        none = model(**x)
        zeros = model(**x, glyph=torch.zeros(2, G, 24), glyph_mask=torch.zeros(2, G, dtype=torch.bool))
    assert torch.equal(none, zeros)


def test_distilled_guidance_and_meanflow_match_diffusers():
    """The distilled release's guidance_in (scale x 1000) and time_r_in (MeanFlow: the mean of t's and r's
    embeddings)."""
    config = HunyuanImageConfig(**{**TINY, "guidance_embeds": True, "use_meanflow": True})
    model = random_model(config)
    x = inputs(config, 3, 4)
    guidance, sigma_r = torch.tensor([3.25, 1.0]), x["timesteps"] * 0.5
    with torch.no_grad():
        ours = model(**x, guidance=guidance, sigma_r=sigma_r)
        theirs = diffusers_velocity(diffusers_twin(model), x, guidance=1000 * guidance, timestep_r=1000 * sigma_r)
    diff = (ours - theirs).abs().max().item()
    print(f"distilled: max abs diff {diff:.2e}")
    assert diff <= 1e-5
    with pytest.raises(ValueError, match="embeds guidance"):
        model(**x)


RELEASED_PARAMETERS = 17_425_795_520  # on meta, the same as diffusers' class at the released config


def test_released_size_on_meta_matches_diffusers():
    with torch.device("meta"):
        ours = HunyuanImage(HUNYUAN_IMAGE)
        theirs = HunyuanImageTransformer2DModel(text_embed_2_dim=1472)  # the release: diffusers' defaults + byT5
    count = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
    print(f"HunyuanImage-2.1: {count(ours):,} parameters")
    assert count(ours) == count(theirs) == RELEASED_PARAMETERS
    assert {k: v.shape for k, v in to_diffusers_state_dict(ours.state_dict(), HUNYUAN_IMAGE).items()} == {
        k: v.shape for k, v in theirs.state_dict().items()}
    assert (HUNYUAN_IMAGE.head_dim, HUNYUAN_IMAGE.mlp_hidden, ours.single_blocks[0].linear1.out_features) == (
        128, 14336, 25088)
    with torch.device("meta"):
        out = ours(**{**inputs(HUNYUAN_IMAGE, 4, 4, glyphs=None), "txt_mask": None})
    assert out.shape == (2, 16, 64) and out.device.type == "meta"


def test_moving_the_rope_positions_changes_the_output(monkeypatch):
    """The positions the model feeds rope_tables are random_inputs' (int64 (row, column)); shifted by one the output
    differs (RoPE is read)."""
    seen = []
    original = hunyuan_model.rope_tables
    monkeypatch.setattr(hunyuan_model, "rope_tables", lambda pos, *a: seen.append(pos) or original(pos, *a))
    config = HunyuanImageConfig(**TINY)
    model = random_model(config)
    conditioning = random_inputs(config, 3, 4, 8, torch.Generator().manual_seed(0))
    x = dict(img=torch.randn(1, 12, 16, generator=torch.Generator().manual_seed(2)), timesteps=torch.tensor([0.5]),
             **conditioning.fixed)
    with torch.no_grad():
        out = model(**x)
    assert len(seen) == 1 and seen[0].dtype == torch.int64 and torch.equal(seen[0], conditioning.positions)
    assert conditioning.axes_dim == (16, 16) and conditioning.theta == 256.0
    monkeypatch.setattr(hunyuan_model, "image_positions", lambda h, w, device=None: original_positions(h, w) + 1)
    with torch.no_grad():
        moved = model(**x)
    print(f"positions + 1: output moves by {(moved - out).abs().max().item():.2e}")
    assert (moved - out).abs().max().item() > 1e-3


original_positions = hunyuan_model.image_positions


# ----------------------------------------------------------------------------------------------
# Checkpoints


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The tiny Tencent file (bf16, no metadata); its weights under ComfyUI's prefix beside a VAE tensor, in
    ComfyUI's names (prefixed and plain), and a diffusers folder written by diffusers' own save_pretrained (sharded)."""
    folder = tmp_path_factory.mktemp("hunyuan_image")
    tencent = write_hunyuan_image(str(folder), seed=0)["hunyuan_image"]
    sd = load_file(tencent)
    save_file({**{"model.diffusion_model." + k: v for k, v in sd.items()}, "vae.decoder.conv_in.weight": torch.ones(2)},
              folder / "prefixed.safetensors")
    save_hunyuan_image_single_file(sd, str(folder / "comfy.safetensors"), prefix="model.diffusion_model.",
                                   comfy_names=True)
    save_hunyuan_image_single_file(sd, str(folder / "comfy_plain.safetensors"), comfy_names=True)
    model = HunyuanImage(tiny_config())
    model.load_state_dict(sd)
    diffusers_twin(model).save_pretrained(folder / "pipeline" / "transformer", max_shard_size="200KB")
    return {"tencent": tencent, "prefixed": str(folder / "prefixed.safetensors"),
            "comfy": str(folder / "comfy.safetensors"), "comfy_plain": str(folder / "comfy_plain.safetensors"),
            "diffusers": str(folder / "pipeline"), "transformer": str(folder / "pipeline" / "transformer")}


def test_every_layout_loads_the_same_model(files):
    kinds = ("tencent", "prefixed", "comfy", "comfy_plain", "diffusers", "transformer")
    models = [load_hunyuan_image(files[kind]) for kind in kinds]
    assert all(m.config == tiny_config() for m in models), [m.config for m in models]
    weights = [m.state_dict() for m in models]
    assert all(w.keys() == weights[0].keys() and all(torch.equal(w[k], weights[0][k]) for k in w) for w in weights)
    assert "double_blocks.0.img_attn.qkv.weight" in load_file(files["comfy_plain"])  # ComfyUI's names were written
    bf16 = load_hunyuan_image(files["tencent"], dtype=torch.bfloat16)  # the file's own dtype: the same weights
    x = inputs(tiny_config(), 2, 3, glyphs=None)
    x["txt"] = torch.randn(2, S, 64)
    with torch.no_grad():
        full, half = models[0](**x), bf16(**x)
    assert half.dtype == torch.bfloat16 and (half.float() - full).abs().max() <= 0.05 * full.abs().max()
    meta = load_hunyuan_image(files["comfy"], dtype=torch.bfloat16, read_weights=False)
    assert meta.compute_dtype == torch.bfloat16 and next(meta.parameters()).device.type == "meta"


def test_our_saves_reload_and_module_maps(files, tmp_path):
    model = load_hunyuan_image(files["tencent"])
    save_hunyuan_image_diffusers(model, None, str(tmp_path / "transformer"))
    reloaded = load_hunyuan_image(str(tmp_path / "transformer"))
    assert all(torch.equal(v, reloaded.state_dict()[k]) for k, v in model.state_dict().items())
    odd = HunyuanImageConfig(**{**TINY, "axes_dim": (20, 12), "mlp_ratio": 3.0})  # the metadata keeps the RoPE split
    save_hunyuan_image_single_file(random_model(odd), str(tmp_path / "odd.safetensors"))
    assert load_hunyuan_image(str(tmp_path / "odd.safetensors")).config == odd
    sized = load_hunyuan_image(write_sized_hunyuan_image(str(tmp_path), 256, 2, seed=0), read_weights=False)
    assert (sized.config.hidden_size, sized.config.num_heads, sized.config.depth, sized.config.depth_single) == (
        256, 2, 2, 4)
    sd = load_file(str(tmp_path / "transformer" / "diffusion_pytorch_model.safetensors"))
    table = module_map(sd.keys(), lambda k: tuple(sd[k].shape), "diffusers")
    assert table["single_blocks.1.linear1"] == [(f"single_transformer_blocks.1.attn.to_{p}", 64 * i, 64 * (i + 1))
                                                for i, p in enumerate("qkv")] + [
        ("single_transformer_blocks.1.proj_mlp", 192, 448)]
    assert table["double_blocks.0.txt_attn_qkv"][2] == ("transformer_blocks.0.attn.add_v_proj", 128, 192)
    assert table["txt_in.c_embedder.linear_2"] == [("context_embedder.time_text_embed.text_embedder.linear_2", 0, 64)]
    comfy = load_file(files["comfy_plain"])
    comfy_table = module_map(comfy.keys(), lambda k: tuple(comfy[k].shape), "comfy")
    assert comfy_table["double_blocks.1.img_mod.linear"] == [("double_blocks.1.img_mod.lin", 0, 384)]
    assert comfy_table["time_in.mlp.2"] == [("time_in.out_layer", 0, 64)]
    assert len(comfy_table) == len(table) == sum(isinstance(m, torch.nn.Linear) for m in model.modules()) - 1
    assert comfy_key("single_blocks.3.k_norm.weight") == "single_blocks.3.norm.key_norm.scale"


def test_wrong_files_are_one_error_naming_the_key(files, tmp_path):
    from library.models.flux1.model import Flux, FluxConfig

    flux = FluxConfig(in_channels=16, vec_in_dim=8, context_in_dim=8, hidden_size=32, num_heads=2, depth=1,
                      depth_single=1, axes_dim=(4, 6, 6))
    save_file(Flux(flux).state_dict(), tmp_path / "flux.safetensors")
    with pytest.raises(CheckpointError, match=r"flux.safetensors: not a HunyuanImage-2.1 transformer \(no key "
                                              r"'txt_in.individual_token_refiner.blocks.0.self_attn_qkv.weight'"):
        load_hunyuan_image(str(tmp_path / "flux.safetensors"))
    sd = load_file(files["tencent"])
    save_file({**sd, "img_in.proj.weight": sd["img_in.proj.weight"][..., None]}, tmp_path / "video.safetensors")
    with pytest.raises(CheckpointError, match=r"a 3-D patch \(a HunyuanVideo"):
        load_hunyuan_image(str(tmp_path / "video.safetensors"))
    save_file({k: v for k, v in sd.items() if k != "single_blocks.1.linear2.bias"}, tmp_path / "a.safetensors")
    with pytest.raises(CheckpointError, match=r"a.safetensors: missing keys: single_blocks.1.linear2.bias"):
        load_hunyuan_image(str(tmp_path / "a.safetensors"))
    save_file({**sd, "double_blocks.0.extra.weight": torch.ones(1)}, tmp_path / "b.safetensors")
    with pytest.raises(CheckpointError, match=r"b.safetensors: unexpected key 'double_blocks.0.extra.weight'"):
        load_hunyuan_image(str(tmp_path / "b.safetensors"))


def test_checkpointing_gives_the_same_gradients():
    """Gradient checkpointing through core.run_block (refiner, double and single blocks): the same gradients for every
    parameter as the plain backward."""
    config = HunyuanImageConfig(**TINY)
    model = random_model(config).train()
    x = inputs(config, 3, 4)
    plain, checkpointed = checkpointing_gradients(model, x)
    assert plain.keys() == checkpointed.keys() and all(g.abs().max() > 0 for g in plain.values())
    diff = max((plain[k] - checkpointed[k]).abs().max().item() for k in plain)
    print(f"checkpointing: max gradient diff {diff:.1e}")
    assert diff <= 1e-6
