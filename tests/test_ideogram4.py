"""Ideogram 4 transformer: parity with diffusers' Ideogram4Transformer2DModel in fp32 (masked batches,
odd grids, the image-only unconditional call), the released size on `meta`."""

import dataclasses

import pytest
import torch
from diffusers import Ideogram4Transformer2DModel
from diffusers.pipelines.ideogram4.pipeline_ideogram4 import Ideogram4Pipeline

from library.models.ideogram4.model import IDEOGRAM4, Ideogram4, Ideogram4Config

# A tiny config with the released structure: 2 heads of 64 keep M-RoPE's interleave (3 * 20 <= 32 would
# not), so the sections shrink with head_dim: (6, 5, 5) over 32 frequencies, frequencies 18..31 on t.
TINY = Ideogram4Config(in_channels=128, num_layers=2, attention_head_dim=64, num_attention_heads=2,
                       intermediate_size=96, adaln_dim=32, llm_features_dim=48, mrope_section=(6, 5, 5))


def diffusers_config(cfg: Ideogram4Config) -> dict:
    return {k: v for k, v in dataclasses.asdict(cfg).items()}


def loaded_pair(cfg=TINY):
    g = torch.Generator().manual_seed(1)
    reference = Ideogram4Transformer2DModel(**diffusers_config(cfg))
    with torch.no_grad():
        for p in reference.parameters():
            p.copy_(0.2 * torch.randn(p.shape, generator=g))
    model = Ideogram4(cfg)
    model.load_state_dict(reference.state_dict(), strict=True)  # diffusers' names are ours
    return reference.eval(), model.eval()


def inputs(h: int, w: int, lengths: tuple[int, ...], cfg=TINY):
    """Packed latents [B, h*w, 128], left-padded text features [B, T, F] with a mask, sigmas."""
    g = torch.Generator().manual_seed(2)
    b, t = len(lengths), max(lengths, default=0)
    img = torch.randn(b, h * w, cfg.in_channels, generator=g)
    txt = torch.randn(b, t, cfg.llm_features_dim, generator=g)
    mask = torch.arange(t)[None] >= t - torch.tensor(lengths)[:, None]
    return img, txt, mask, torch.rand(b, generator=g)


def diffusers_velocity(model, img, txt, mask, sigmas, h, w):
    """As Ideogram4Pipeline calls it: [left pad][text][image] packed, t = 1 - sigma, -v is the step."""
    t = txt.shape[1]
    lengths = [int(n) for n in mask.sum(1)]
    position_ids, segment_ids, indicator = Ideogram4Pipeline._prepare_ids(lengths, h, w, t, img.device)
    features = torch.cat((txt * mask[..., None], torch.zeros(img.shape[0], h * w, txt.shape[-1])), dim=1)
    z = torch.cat((torch.zeros(img.shape[0], t, img.shape[-1]), img), dim=1)
    with torch.no_grad():
        out = model(z, 1.0 - sigmas, features, position_ids, segment_ids, indicator, return_dict=False)[0]
    return -out[:, t:]


# (h, w) in 2x2 patches and caption lengths: ragged captions (masked), equal captions (no mask), an odd
# grid with one caption, and the unconditional transformer's image-only call (no text).
CASES = [((3, 5), (7, 4)), ((4, 4), (6, 6)), ((5, 7), (9,)), ((3, 3), (0, 0))]


@pytest.mark.parametrize("grid,lengths", CASES)
def test_ideogram4_matches_diffusers_fp32(grid, lengths):
    reference, model = loaded_pair()
    img, txt, mask, sigmas = inputs(*grid, lengths)
    expected = diffusers_velocity(reference, img, txt, mask, sigmas, *grid)
    with torch.no_grad():
        out = model(img, txt, sigmas, *grid, txt_mask=mask)
    assert out.shape == expected.shape and out.dtype == torch.float32
    assert expected.abs().mean() > 0.1  # a real signal
    diff = (out - expected).abs().max().item()
    print(f"Ideogram 4 {grid} captions {lengths}: max abs diff {diff:.2e}")
    assert diff <= 1e-5


def test_padding_counts_for_nothing():
    """The left-padded 4-token row gives what its 4 real tokens alone give."""
    _, model = loaded_pair()
    img, txt, mask, sigmas = inputs(3, 5, (7, 4))
    with torch.no_grad():
        padded = model(img, txt, sigmas, 3, 5, txt_mask=mask)[1:]
        alone = model(img[1:], txt[1:, 3:], sigmas[1:], 3, 5)
    assert (padded - alone).abs().max() <= 1e-5 * padded.abs().max()


def test_released_parameter_count_on_meta():
    with torch.device("meta"):
        ours = Ideogram4(IDEOGRAM4)
        theirs = Ideogram4Transformer2DModel()  # diffusers' defaults are the released config
    count = sum(p.numel() for p in ours.parameters())
    print(f"Ideogram 4 released transformer: {count:,} parameters")
    assert count == sum(p.numel() for p in theirs.parameters()) == 9_279_288_448
    assert set(ours.state_dict()) == set(theirs.state_dict())
    assert len(ours.swappable_blocks()) == 34
