"""Z-Image Omni (model_type zimage_omni): the transformer's omni mode against diffusers'
ZImageTransformer2DModel (with and without references, ragged batches), the released size on meta,
the conditioning (caption segments, SigLIP features, reference latents) and a few sampling steps
against ZImageOmniPipeline on the tiny Omni repo, the fp8 keep rule of the SigLIP embedder."""

import dataclasses

import pytest
import torch
from diffusers import ZImageTransformer2DModel
from PIL import Image

import library.models.zimage.omni as omni
from library.models.vae import pack_latents, unpack_latents
from library.models.zimage.checkpoint import diffusers_config
from library.models.zimage.omni import ZIMAGE_OMNI, ZImageOmni, zimage_transformer
from library.models.zimage.omni_family import ZImageOmniFamily
from library.models.zimage.tiny import SIGLIP_HIDDEN, tiny_config
from tests.test_zimage import randomize

CONFIG = dataclasses.replace(tiny_config(), siglip_feat_dim=SIGLIP_HIDDEN)


def diffusers_model(config=CONFIG) -> ZImageTransformer2DModel:
    return ZImageTransformer2DModel(**{k: v for k, v in diffusers_config(config).items() if not k.startswith("_")})


@pytest.fixture(scope="module")
def pair():
    reference = randomize(diffusers_model())
    model = ZImageOmni(CONFIG).eval()
    model.load_state_dict(reference.state_dict(), strict=True)  # diffusers' names are ours
    return reference, model


def omni_inputs(b, grid, ref_grids, segments, siglip_grids):
    """Target latents [B, 16, 2h, 2w], reference latents, per row caption segments and SigLIP grids, sigmas."""
    g = torch.Generator().manual_seed(2)
    h, w = grid
    target = torch.randn(b, 16, 2 * h, 2 * w, generator=g)
    refs = [torch.randn(b, 16, 2 * rh, 2 * rw, generator=g) for rh, rw in ref_grids]
    caps = [[torch.randn(n, CONFIG.cap_feat_dim, generator=g) for n in row] for row in segments]
    sig = [[torch.randn(sh, sw, SIGLIP_HIDDEN, generator=g) for sh, sw in row] for row in siglip_grids] if refs else None
    return target, refs, caps, sig, torch.rand(b, generator=g)


@torch.no_grad()
def diffusers_omni(model, target, refs, caps, sig, sigmas):
    # As ZImageOmniPipeline calls it: per row [references..., target] as [C, 1, H, W], noise mask
    # [0] * N + [1], SigLIP [grids..., None] (None without references), t = 1 - sigma, output negated.
    b, n = target.shape[0], len(refs)
    out = model(x=[[r[i][:, None] for r in refs] + [target[i][:, None]] for i in range(b)], t=1 - sigmas, cap_feats=caps,
                siglip_feats=[row + [None] for row in sig] if sig else [None] * b,
                image_noise_mask=[[0] * n + [1]] * b, return_dict=False)[0]
    return -torch.stack(out).squeeze(2)


@torch.no_grad()
def ours_omni(model, target, refs, caps, sig, sigmas):
    h, w = target.shape[2] // 2, target.shape[3] // 2
    return unpack_latents(model(pack_latents(target), sigmas, h, w, caps, refs, sig), 2 * h, 2 * w)


# (batch, target grid, reference grids, caption segments per row, SigLIP grids per row): text-to-image
# (one segment) in a ragged batch; one reference; two references of other sizes in a batch whose rows
# differ in caption segments (one padded past 32) and SigLIP grids.
CASES = [
    (2, (4, 6), [], [[7], [40]], None),
    (1, (4, 6), [(3, 5)], [[5, 9, 3]], [[(4, 6)]]),
    (2, (5, 4), [(3, 5), (4, 4)], [[5, 4, 9, 3], [6, 4, 40, 3]], [[(4, 6), (3, 3)], [(5, 5), (3, 3)]]),
]


@pytest.mark.parametrize("case", CASES, ids=["no_reference", "one_reference", "two_references_ragged"])
def test_omni_matches_diffusers_fp32(pair, case):
    x = omni_inputs(*case)
    expected, out = diffusers_omni(pair[0], *x), ours_omni(pair[1], *x)
    assert out.shape == expected.shape and out.dtype == torch.float32
    diff = (out - expected).abs().max().item()
    print(f"Z-Image Omni {case[2]} references: max abs diff {diff:.2e} (outputs up to {expected.abs().max():.2f})")
    assert diff <= 1e-5  # measured 1.9e-6 to 3.1e-6, all from the RoPE angle rounding (next test)


def test_omni_is_bitwise_diffusers_with_its_rope_rounding(pair, monkeypatch):
    """With diffusers' float32-rounded RoPE angles our output is identical: every position (the
    shifted caption positions, the rescaled SigLIP ones), pad and per-token time is diffusers'."""
    monkeypatch.setattr(omni, "rope_tables", rounded_rope_tables)
    x = omni_inputs(*CASES[2])
    assert torch.equal(ours_omni(pair[1], *x), diffusers_omni(pair[0], *x))


def rounded_rope_tables(positions, axes_dims, theta):
    """diffusers' RopeEmbedder: each angle rounded to float32 before cos / sin (complex64 polar)."""
    cos, sin = [], []
    for i, dim in enumerate(axes_dims):
        freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        angles = (positions[..., i : i + 1].double() * freqs).float()
        rotation = torch.polar(torch.ones_like(angles), angles)
        cos.append(rotation.real)
        sin.append(rotation.imag)
    return torch.cat(cos, -1), torch.cat(sin, -1)


def test_references_condition_the_target(pair):
    """The references reach the target: other reference latents or other SigLIP features change it."""
    target, refs, caps, sig, sigmas = omni_inputs(*CASES[1])
    out = ours_omni(pair[1], target, refs, caps, sig, sigmas)
    assert (ours_omni(pair[1], target, [r.flip(-1) for r in refs], caps, sig, sigmas) - out).abs().max() > 1e-2
    assert (ours_omni(pair[1], target, refs, caps, [[s.flip(0) for s in row] for row in sig], sigmas) - out).abs().max() > 1e-2


def test_omni_released_parameter_count_on_meta():
    """Z-Image Base's sizes with the SigLIP2 so400m width (1152): diffusers ships no Omni config."""
    with torch.device("meta"):
        ours, theirs = zimage_transformer(ZIMAGE_OMNI), diffusers_model(ZIMAGE_OMNI)
    assert isinstance(ours, ZImageOmni)
    count = sum(p.numel() for p in ours.parameters())
    print(f"Z-Image Omni parameters: {count:,}")
    assert count == sum(p.numel() for p in theirs.parameters()) == 6_513_266_880  # Base 6,154,908,736 + SigLIP embedder, 2 refiner blocks, pad token
    assert ours.state_dict().keys() == theirs.state_dict().keys()


def test_wrong_segment_count_is_one_error(pair):
    target, refs, caps, sig, sigmas = omni_inputs(*CASES[1])
    with pytest.raises(ValueError, match="1 reference\\(s\\) need 3 caption segment"):
        ours_omni(pair[1], target, refs, [row[:2] for row in caps], sig, sigmas)
