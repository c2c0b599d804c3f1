"""Lumina 2 transformer (NextDiT): parity with diffusers' Lumina2Transformer2DModel on the same weights (converted by
checkpoint.to_diffusers_state_dict) on square and non-square grids and a batch of captions of different real
lengths, the sigma / velocity convention, the released size on `meta`, checkpoint layouts (the released single file,
ComfyUI's prefix, a diffusers folder) loading the same weights, a Z-Image file refused in one line, and gradient
checkpointing."""

import pytest
import torch
from diffusers import Lumina2Transformer2DModel
from safetensors.torch import load_file, save_file

from library.io import CheckpointError
from library.models.latents import pack_latents, unpack_latents
from library.models.lumina2 import model as lumina2_model
from library.models.lumina2.checkpoint import (
    diffusers_config, load_lumina2, save_lumina2_diffusers, save_lumina2_single_file, to_diffusers_state_dict,
)
from library.models.lumina2.model import LUMINA2, Lumina2, Lumina2Config, random_inputs
from library.models.lumina2.tiny import tiny_config, write_lumina2, write_sized_lumina2
from tests.model_checks import checkpointing_gradients, randomized

# 3 query heads of 32 sharing one key/value head (GQA as released: 24 / 8); the caption width (40) differs from the
# model's (96), so a swapped embedder cannot pass
TINY = dict(in_channels=16, dim=96, n_layers=2, n_refiner_layers=2, n_heads=3, n_kv_heads=1, cap_feat_dim=40,
            axes_dims=(12, 10, 10))
S = 7  # caption tokens, padded


def random_model(config: Lumina2Config, seed: int = 0) -> Lumina2:
    """Every parameter random (the references zero-init the modulation and the final layer): norms around 1."""
    return randomized(Lumina2(config), seed)


def diffusers_twin(model: Lumina2) -> Lumina2Transformer2DModel:
    """diffusers' class at the model's config with its weights."""
    reference = Lumina2Transformer2DModel(**{k: v for k, v in diffusers_config(model.config).items()
                                             if not k.startswith("_")})
    reference.load_state_dict(to_diffusers_state_dict(model.state_dict(), model.config), strict=True)
    return reference.eval()


def inputs(config: Lumina2Config, h: int, w: int, lengths=(S, S), seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    b = len(lengths)
    return dict(img=torch.randn(b, h * w, 4 * config.in_channels, generator=g),
                txt=torch.randn(b, S, config.cap_feat_dim, generator=g),
                txt_mask=torch.arange(S)[None] < torch.tensor(lengths)[:, None],
                timesteps=torch.rand(b, generator=g), h=h, w=w)


def diffusers_velocity(reference: Lumina2Transformer2DModel, x: dict) -> torch.Tensor:
    """Our convention through theirs: ours(x, sigma) == -diffusers(x, t = 1 - sigma), in our packed layout."""
    latents = unpack_latents(x["img"], 2 * x["h"], 2 * x["w"])
    out = reference(latents, 1 - x["timesteps"], x["txt"], x["txt_mask"], return_dict=False)[0]
    return -pack_latents(out)


@pytest.mark.parametrize("grid", [(4, 4), (3, 5)])
def test_lumina2_matches_diffusers_fp32(grid):
    """Square and non-square patch grids, every caption token real (no mask anywhere, as diffusers)."""
    model = random_model(Lumina2Config(**TINY))
    x = inputs(model.config, *grid)
    with torch.no_grad():
        ours, theirs = model(**x), diffusers_velocity(diffusers_twin(model), x)
    diff = (ours - theirs).abs().max().item()
    print(f"grid {grid}: max abs diff {diff:.2e}, output scale {theirs.abs().max().item():.2f}")
    assert ours.shape == (2, grid[0] * grid[1], 64) and diff <= 1e-5


def test_captions_of_different_lengths_match_each_alone():
    """Row 0 has 3 real tokens of 7, row 1 all 7: each row of ours equals diffusers' batch and diffusers' row run
    alone on its real tokens (the padding has zero weight; the image's RoPE starts after the real tokens)."""
    model = random_model(Lumina2Config(**TINY))
    reference = diffusers_twin(model)
    x = inputs(model.config, 3, 4, lengths=(3, S))
    with torch.no_grad():
        ours = model(**x)
        batch = diffusers_velocity(reference, x)
        short = {**x, "img": x["img"][:1], "txt": x["txt"][:1, :3], "txt_mask": x["txt_mask"][:1, :3],
                 "timesteps": x["timesteps"][:1]}
        alone = diffusers_velocity(reference, short)
        x_changed = {**x, "txt": x["txt"].clone()}
        x_changed["txt"][0, 3:] = 100.0  # what the padding holds must not matter
        changed = model(**x_changed)
    # (relative to the output's largest: float32 summation order alone; an absolute 1e-5 was 1.01e-5 on an AMX Xeon)
    scale = ours.abs().max().item()
    diffs = [(ours - batch).abs().max().item() / scale, (ours[:1] - alone).abs().max().item() / scale]
    print(f"masked batch: max diff {diffs[0]:.2e} (batch), {diffs[1]:.2e} (row 0 alone) of the output's max {scale:.3g}")
    assert max(diffs) <= 5e-6 and (changed - ours).abs().max().item() <= 5e-6 * scale
    assert (ours[0] - model(**{**x, "txt_mask": None})[0]).abs().max().item() > 1e-2  # the mask is read


RELEASED_PARAMETERS = 2_609_769_152  # on meta; the released file holds 2304 more (the unused norm_final.weight)


def test_released_size_on_meta_matches_diffusers():
    with torch.device("meta"):
        ours = Lumina2(LUMINA2)
        theirs = Lumina2Transformer2DModel(cap_feat_dim=2304)  # diffusers' defaults are the release but 1024 here
    count = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
    print(f"Lumina 2: {count(ours):,} parameters")
    assert count(ours) == count(theirs) == RELEASED_PARAMETERS
    assert {k: v.shape for k, v in to_diffusers_state_dict(ours.state_dict(), LUMINA2).items()} == {
        k: v.shape for k, v in theirs.state_dict().items()}
    qkv = ours.layers[0].attention.qkv
    assert (qkv.out_features, LUMINA2.head_dim, LUMINA2.ffn_hidden, LUMINA2.adaln_dim) == (3840, 96, 9216, 1024)
    with torch.device("meta"):
        out = ours(**{**inputs(LUMINA2, 4, 4), "txt_mask": None})
    assert out.shape == (2, 16, 64) and out.device.type == "meta"


def test_random_inputs_positions_are_what_the_model_feeds_rope(monkeypatch):
    """The precision doctor's expected positions are the image's rope_tables call: (L, r, c), L = real tokens."""
    seen = []
    original = lumina2_model.rope_tables
    monkeypatch.setattr(lumina2_model, "rope_tables", lambda pos, *a: seen.append(pos) or original(pos, *a))
    config = Lumina2Config(**TINY)
    conditioning = random_inputs(config, 3, 4, 8, torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = Lumina2(config)(img=torch.randn(1, 12, 64), timesteps=torch.tensor([0.5]), **conditioning.fixed)
    assert out.shape == (1, 12, 64) and len(seen) == 2 and all(pos.dtype == torch.int64 for pos in seen)
    assert torch.equal(seen[1], conditioning.positions) and int(conditioning.positions[0, 0, 0]) == 6
    assert conditioning.axes_dim == (12, 10, 10) and conditioning.theta == 10000.0


# ----------------------------------------------------------------------------------------------
# Checkpoints


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The tiny released file (bf16, norm_final.weight, no metadata), the same weights under ComfyUI's prefix beside
    a VAE tensor, and a diffusers folder written by diffusers' own save_pretrained (sharded)."""
    folder = tmp_path_factory.mktemp("lumina2")
    released = write_lumina2(str(folder), seed=0)["lumina2"]
    sd = load_file(released)
    save_file({**{"model.diffusion_model." + k: v for k, v in sd.items()}, "vae.decoder.conv_in.weight": torch.ones(2)},
              folder / "comfy.safetensors")
    model = Lumina2(tiny_config())
    model.load_state_dict({k: v for k, v in sd.items() if k != "norm_final.weight"})
    diffusers_twin(model).save_pretrained(folder / "pipeline" / "transformer", max_shard_size="200KB")
    return {"released": released, "comfy": str(folder / "comfy.safetensors"), "diffusers": str(folder / "pipeline"),
            "transformer": str(folder / "pipeline" / "transformer")}


def test_every_layout_loads_the_same_model(files):
    models = [load_lumina2(files[kind]) for kind in ("released", "comfy", "diffusers", "transformer")]
    assert all(m.config == tiny_config() for m in models)
    assert models[0].config.n_kv_heads == 1 and models[0].config.ffn_hidden == 512
    weights = [m.state_dict() for m in models]
    assert all(w.keys() == weights[0].keys() and all(torch.equal(w[k], weights[0][k]) for k in w) for w in weights)
    bf16 = load_lumina2(files["released"], dtype=torch.bfloat16)  # the file's own dtype: the same weights
    x = inputs(tiny_config(), 2, 3, lengths=(2, S))
    with torch.no_grad():
        full, half = models[0](**x), bf16(**x)
    assert half.dtype == torch.bfloat16 and (half.float() - full).abs().max() <= 0.05 * full.abs().max()
    meta = load_lumina2(files["released"], dtype=torch.bfloat16, read_weights=False)
    assert meta.compute_dtype == torch.bfloat16 and next(meta.parameters()).device.type == "meta"


def test_our_saves_reload(files, tmp_path):
    model = load_lumina2(files["released"])
    save_lumina2_diffusers(model, None, str(tmp_path / "transformer"))
    reference = Lumina2Transformer2DModel.from_pretrained(str(tmp_path / "transformer")).eval()
    x = inputs(model.config, 2, 3, lengths=(2, S))
    x["txt"] = x["txt"][..., :64]
    with torch.no_grad():
        assert (model(**x) - diffusers_velocity(reference, x)).abs().max().item() <= 1e-5
    odd = Lumina2Config(**{**TINY, "axes_dims": (8, 12, 12), "ffn_dim_multiplier": 1.5})  # the metadata keeps these
    save_lumina2_single_file(random_model(odd), str(tmp_path / "odd.safetensors"))
    assert load_lumina2(str(tmp_path / "odd.safetensors")).config == odd
    sized = load_lumina2(write_sized_lumina2(str(tmp_path), 384, 2, seed=0), read_weights=False)
    assert (sized.config.dim, sized.config.n_heads, sized.config.n_kv_heads, sized.config.n_layers) == (384, 4, 1, 4)


def test_wrong_files_are_one_error_naming_the_key(files, tmp_path):
    from library.models.zimage.checkpoint import save_zimage_single_file
    from library.models.zimage.model import ZImage
    from library.models.zimage.tiny import tiny_config as zimage_tiny_config

    save_zimage_single_file(ZImage(zimage_tiny_config()), str(tmp_path / "z.safetensors"))
    with pytest.raises(CheckpointError, match=r"z.safetensors: not a Lumina 2 transformer: it holds "
                                              r"'(x|cap)_pad_token', a Z-Image"):
        load_lumina2(str(tmp_path / "z.safetensors"))
    sd = load_file(files["released"])
    save_file({k: v for k, v in sd.items() if k != "layers.1.feed_forward.w3.weight"}, tmp_path / "a.safetensors")
    with pytest.raises(CheckpointError, match=r"a.safetensors: missing keys: layers.1.feed_forward.w3.weight"):
        load_lumina2(str(tmp_path / "a.safetensors"))
    save_file({**sd, "layers.0.extra.weight": torch.ones(1)}, tmp_path / "b.safetensors")
    with pytest.raises(CheckpointError, match=r"b.safetensors: unexpected key 'layers.0.extra.weight'"):
        load_lumina2(str(tmp_path / "b.safetensors"))
    save_file({k: v for k, v in sd.items() if "adaLN" not in k}, tmp_path / "c.safetensors")
    with pytest.raises(CheckpointError, match=r"c.safetensors: not a Lumina 2 transformer \(no key "
                                              r"'layers.0.adaLN_modulation.1.weight'"):
        load_lumina2(str(tmp_path / "c.safetensors"))


def test_checkpointing_gives_the_same_gradients():
    """Gradient checkpointing through core.run_block (refiners and joint blocks): the same gradients for every
    parameter as the plain backward."""
    config = Lumina2Config(**TINY)
    model = random_model(config).train()
    x = inputs(config, 3, 4, lengths=(3, S))
    plain, checkpointed = checkpointing_gradients(model, x)
    assert plain.keys() == checkpointed.keys() and all(g.abs().max() > 0 for g in plain.values())
    diff = max((plain[k] - checkpointed[k]).abs().max().item() for k in plain)
    print(f"checkpointing: max gradient diff {diff:.1e}")
    assert diff <= 1e-6
