"""FLUX.2 transformer: parity with diffusers' Flux2Transformer2DModel, BFL <-> diffusers names,
released sizes on `meta`, checkpoint formats."""

import pytest
import torch
from diffusers import Flux2Transformer2DModel
from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers
from diffusers.pipelines.flux2.pipeline_flux2_klein import Flux2KleinPipeline

from library.models.flux2.checkpoint import (
    diffusers_config,
    diffusers_to_flux2_state_dict,
    flux2_diffusers_module_map,
    flux2_to_diffusers_state_dict,
)
from library.models.flux2.model import FLUX2_CONFIGS, Flux2, Flux2Config, make_img_ids, make_txt_ids

# head_dim 32 = 4 x 8, FLUX.2's four equal RoPE axes scaled down; context 96 = 3 stacked layers x 32.
TINY = dict(in_channels=128, context_in_dim=96, hidden_size=64, num_heads=2, depth=2, depth_single=2, axes_dim=(8, 8, 8, 8))
H, W, T, B = 6, 8, 7, 2  # latent grid in 2x2 patches (non-square), text length, batch


def tiny_config(guidance: bool) -> Flux2Config:
    return Flux2Config(**TINY, guidance_embed=guidance)


def tiny_diffusers(guidance: bool) -> Flux2Transformer2DModel:
    config = {k: v for k, v in diffusers_config(tiny_config(guidance)).items() if not k.startswith("_")}
    return randomize(Flux2Transformer2DModel(**config))


def randomize(model: torch.nn.Module) -> torch.nn.Module:
    """Every parameter random, norms around 1 (FLUX.2 has no biases: every 1-D tensor is a norm)."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g) if p.dim() == 1 else 0.15 * torch.randn(p.shape, generator=g))
    return model.eval()


def inputs(guidance: bool):
    g = torch.Generator().manual_seed(2)
    return dict(
        img=torch.randn(B, H * W, 128, generator=g),
        img_ids=make_img_ids(B, H, W),
        txt=torch.randn(B, T, 96, generator=g),
        txt_ids=make_txt_ids(B, T),
        timesteps=torch.tensor([0.3, 0.85]),
        guidance=torch.tensor([4.0, 1.5]) if guidance else None,
    )


def diffusers_forward(model: Flux2Transformer2DModel, x: dict) -> torch.Tensor:
    # As Flux2KleinPipeline calls it: sigma (timestep / 1000), guidance None for [klein] (Flux2Pipeline
    # passes the raw scale for [dev]), ids from the pipeline's own helpers.
    img_ids = Flux2KleinPipeline._prepare_latent_ids(torch.zeros(B, 128, H, W))
    txt_ids = Flux2KleinPipeline._prepare_text_ids(x["txt"])
    assert torch.equal(img_ids, x["img_ids"]) and torch.equal(txt_ids, x["txt_ids"])
    with torch.no_grad():
        return model(
            hidden_states=x["img"], encoder_hidden_states=x["txt"], timestep=x["timesteps"], img_ids=img_ids,
            txt_ids=txt_ids, guidance=x["guidance"], return_dict=False,
        )[0]  # fmt: skip


@pytest.mark.parametrize("variant", ["klein", "dev"])
def test_flux2_matches_diffusers_fp32(variant):
    guidance = variant == "dev"
    reference = tiny_diffusers(guidance)
    model = Flux2(tiny_config(guidance))
    model.load_state_dict(diffusers_to_flux2_state_dict(reference.state_dict()), strict=True)
    x = inputs(guidance)
    expected = diffusers_forward(reference, x)
    with torch.no_grad():
        out = model(**x)
    assert out.shape == (B, H * W, 128) and out.dtype == torch.float32
    assert expected.abs().mean() > 0.1  # a real signal, not a vanishing one
    assert (out - expected).abs().max().item() <= 1e-5


def test_bfl_names_are_what_diffusers_single_file_reads():
    """Our (BFL) state dict through diffusers' own single-file converter gives diffusers' names and
    shapes, and the same weights: an oracle for the name map independent of our converter."""
    model = randomize(Flux2(tiny_config(True)))
    bfl = {k: v.clone() for k, v in model.state_dict().items()}
    theirs = convert_flux2_transformer_checkpoint_to_diffusers(dict(bfl))
    ours = flux2_to_diffusers_state_dict(bfl)
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    tiny_diffusers(True).load_state_dict(ours, strict=True)
    back = diffusers_to_flux2_state_dict(ours)
    assert back.keys() == bfl.keys() and all(torch.equal(back[k], bfl[k]) for k in bfl)


def test_guidance_required_for_dev_and_changes_output():
    model = randomize(Flux2(tiny_config(True)))
    x = inputs(True)
    with pytest.raises(ValueError, match="guidance"):
        model(**{**x, "guidance": None})
    with torch.no_grad():
        delta = (model(**x) - model(**{**x, "guidance": x["guidance"] + 1})).abs().max()
    assert delta > 1e-3


def test_module_map_covers_every_linear_with_matching_rows():
    model, reference = Flux2(tiny_config(True)), tiny_diffusers(True)
    ours = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    theirs = {n: m for n, m in reference.named_modules() if isinstance(m, torch.nn.Linear)}
    table = flux2_diffusers_module_map(2, 2, 64, 192, out_channels=128, guidance=True)
    assert table.keys() == ours.keys()
    rows_per_target: dict[str, int] = {}
    for name, parts in table.items():
        assert sorted((s, e) for _, s, e in parts)[-1][1] == ours[name].out_features
        for target, start, end in parts:
            assert theirs[target].in_features == ours[name].in_features
            rows_per_target[target] = rows_per_target.get(target, 0) + end - start
    assert rows_per_target == {n: m.out_features for n, m in theirs.items()}


# Parameter counts of the released sizes (diffusers' Flux2Transformer2DModel on meta gives the same).
RELEASED = {"dev": 32_223_281_152, "klein_4b": 3_875_544_576, "klein_9b": 9_078_581_248}


@pytest.mark.parametrize("name", sorted(RELEASED))
def test_released_sizes_on_meta_match_diffusers(name):
    config = FLUX2_CONFIGS[name]
    with torch.device("meta"):
        ours = Flux2(config)
        reference = Flux2Transformer2DModel(**{k: v for k, v in diffusers_config(config).items() if not k.startswith("_")})
    count = sum(p.numel() for p in ours.parameters())
    assert count == sum(p.numel() for p in reference.parameters()) == RELEASED[name]
    converted = flux2_to_diffusers_state_dict(ours.state_dict())
    expected = reference.state_dict()
    assert converted.keys() == expected.keys()
    assert all(converted[k].shape == expected[k].shape for k in converted)
