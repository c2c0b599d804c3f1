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
from library.models.latents import pack_latents, unpack_latents
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


@pytest.mark.parametrize("case", [CASES[0], CASES[1]], ids=["no_reference", "one_reference"])
def test_block_swap_gives_the_same_output_with_and_without_siglip_rows(pair, case):
    """Text to image (no references, no SigLIP rows): the main layers ran under swap indices that left the
    SigLIP refiner out, so a swapped layer kept its empty placeholder weights ("mat2 must be a matrix",
    in training and in sampling). Swap indices are swappable_blocks' positions now, whatever runs."""
    import copy

    from library.models.block_swap import enable_block_swap

    x = omni_inputs(*case)
    expected = ours_omni(pair[1], *x)
    model = copy.deepcopy(pair[1]).requires_grad_(False)
    blocks = len(model.swappable_blocks())
    for swap in (1, blocks - 1):
        enable_block_swap(model, swap, "cpu")
        assert torch.equal(ours_omni(model, *x), expected), swap
        assert not model.block_swap.resident and not model.block_swap.pending
    model.block_swap.restore()


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


# ----------------------------------------------------------------------------------------------
# The conditioning and sampling against ZImageOmniPipeline on the tiny Omni repo


@pytest.fixture(scope="module")
def omni_pipeline(tiny_set):
    """ZImageOmniPipeline from the tiny repo's components (the tiny FLUX.1 VAE in bf16: the pipeline
    encodes condition images in bf16) and our family on the same files."""
    import os

    from diffusers import FlowMatchEulerDiscreteScheduler, ZImageOmniPipeline
    from transformers import AutoTokenizer, Qwen3ForCausalLM, Siglip2ImageProcessor, Siglip2VisionModel

    from library.models.flux1.vae import load_flux_vae

    root = tiny_set["zimage_omni"]
    pipe = ZImageOmniPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(os.path.join(root, "scheduler")),
        vae=load_flux_vae(tiny_set["flux_vae"], torch.bfloat16).vae,
        text_encoder=Qwen3ForCausalLM.from_pretrained(os.path.join(root, "text_encoder")).eval(),
        tokenizer=AutoTokenizer.from_pretrained(os.path.join(root, "tokenizer")),
        transformer=ZImageTransformer2DModel.from_pretrained(os.path.join(root, "transformer")).eval(),
        siglip=Siglip2VisionModel.from_pretrained(os.path.join(root, "siglip")).eval(),
        siglip_processor=Siglip2ImageProcessor.from_pretrained(os.path.join(root, "siglip_processor")))
    family = ZImageOmniFamily(root, tiny_set["flux_vae"], text_encoder=root)
    return pipe, family, family.load_text_encoder("fp32")


def picture(w, h, seed=0):
    g = torch.Generator().manual_seed(seed)
    return Image.fromarray((torch.rand(h, w, 3, generator=g) * 255).to(torch.uint8).numpy())


def test_omni_conditioning_matches_the_pipeline(omni_pipeline):
    """encode_prompt with two condition images (segments, hidden_states[-2], real tokens) and
    prepare_siglip_embeds, against our encoder; the vision markers are one token each."""
    pipe, family, encode = omni_pipeline
    assert len(pipe.tokenizer("<|vision_start|><|vision_end|>").input_ids) == 2
    prompts = ["make the cube red", "a much longer instruction: paint the left shape blue and the right one green"]
    theirs, negative = pipe.encode_prompt(list(prompts), device="cpu", do_classifier_free_guidance=True, num_condition_images=2)
    images = [picture(40, 56), picture(72, 24, 1)]
    ours = encode(prompts + [""], [images, images, images])
    for expected, entry in zip(theirs + negative[:1], ours):
        got = entry["embeds"].split(entry["segments"].tolist())
        assert [s.shape for s in got] == [s.shape for s in expected] and len(got) == 4
        assert max((a - b).abs().max().item() for a, b in zip(got, expected)) < 1e-5
    siglip = pipe.prepare_siglip_embeds(images, 1, "cpu", torch.float32)[0]
    grids = ours[0]["siglip"].split([h * w for h, w in ours[0]["siglip_grid"].tolist()])
    for expected, flat, (h, w) in zip(siglip, grids, ours[0]["siglip_grid"].tolist()):
        assert expected.shape == (h, w, SIGLIP_HIDDEN)
        assert (flat.view(h, w, -1) - expected).abs().max().item() < 1e-6


def test_siglip_sees_large_images_at_the_pipelines_area():
    from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor

    from library.models.zimage.omni_encoder import siglip_view

    large = picture(1100, 1000)
    expected = Flux2ImageProcessor._resize_to_target_area(large, 1024 * 1024)
    assert siglip_view(large).size == expected.size and siglip_view(large).tobytes() == expected.tobytes()
    small = picture(64, 48)
    assert siglip_view(small) is small


@torch.no_grad()
def test_sample_siglip_sees_a_large_reference_as_the_pipeline_given_a_size(omni_pipeline, tmp_path):
    """A --ci over 1 MP with a sample size: ZImageOmniPipeline (height / width given) shows SigLIP the image
    resized to the output's area, the one its VAE path takes; the sample prompt cache encodes it so."""
    from library.data.caches import cache_prompts

    pipe, family, encode = omni_pipeline
    image = picture(1100, 1000, 4)
    captured = {}
    real = pipe.prepare_siglip_embeds

    def capture(images, *args, **kwargs):
        captured["siglip"] = real(images, *args, **kwargs)[0]
        return [captured["siglip"]]  # batch 1

    pipe.prepare_siglip_embeds = capture
    pipe(image=[image], prompt="make the shape red", height=64, width=80, num_inference_steps=1,
         generator=torch.Generator().manual_seed(7), output_type="latent")
    path = str(tmp_path / "ref.png")
    image.save(path)
    jobs = [("make the shape red", (path,), family.sample_text_size((path,), 80, 64))]
    (ours,), _ = cache_prompts(jobs, encode, "key", None, with_references=True)
    (expected,) = captured["siglip"]
    assert tuple(ours["siglip_grid"][0].tolist()) == expected.shape[:2]
    assert (ours["siglip"].view(expected.shape) - expected).abs().max().item() < 1e-6


@torch.no_grad()
@pytest.mark.parametrize("reference", [(80, 64), (128, 64), (100, 72)])
def test_omni_sampling_matches_the_pipeline(omni_pipeline, tmp_path, reference):
    """Three Euler steps with CFG 5 on an 80x64 target and one reference (the target's size, larger than it,
    or one the pipeline crops to 96 x 64): ZImageOmniPipeline (output_type latent) against our family's
    sample_latents with our conditioning; our reference pixels (sample_references) and latents against the
    pipeline's (the cropped one was shrunk to cover before: up to 0.69 off)."""
    from library.models.family import stack_text

    pipe, family, encode = omni_pipeline
    image = picture(*reference, 3)  # the pipeline takes at least 64 pixels a side
    captured = {}
    real = pipe.prepare_image_latents

    def capture(images, *args, **kwargs):
        captured["pixels"], captured["latents"] = images[0], real(images, *args, **kwargs)[0]
        return [list(captured["latents"])]  # batch 1

    pipe.prepare_image_latents = capture
    expected = pipe(image=[image], prompt="make the shape red", height=64, width=80, num_inference_steps=3,
                    guidance_scale=5.0, generator=torch.Generator().manual_seed(7), output_type="latent").images
    path = tmp_path / "ref.png"
    image.save(path)
    pixels = family.sample_references([str(path)], 80, 64)[2][0]
    assert torch.equal(pixels, captured["pixels"].float())  # the same [-1, 1] reference, at the same size
    vae = family.load_vae(torch.bfloat16)
    ref_latent = captured["latents"][0].squeeze(1)[None].float()  # [1, 16, h / 8, w / 8]
    assert (vae.encode(pixels) - ref_latent).abs().max().item() < 2e-2  # bf16 VAE; the pipeline rounds to bf16 after the scale

    model = family.load_transformer(torch.float32)
    text = stack_text(encode(["make the shape red"], [[image]]))
    negative = stack_text(encode([""], [[image]]))
    ours = family.sample_latents(model, text, 80, 64, 3, 7, 5.0, negative, control=[ref_latent])
    diff = (ours - expected).abs().max().item()
    print(f"Z-Image Omni 3 CFG steps vs ZImageOmniPipeline: max abs diff {diff:.2e} (latents up to {expected.abs().max():.2f})")
    assert ours.shape == expected.shape and diff < 1e-4


def pipeline_condition_size(target, size):
    """The (w, h) at which ZImageOmniPipeline encodes a condition image of `size` for a `target` (w, h)
    render: its own helper above 1024 x 1024 pixels, then each side floored to vae_scale_factor * 2."""
    from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor

    image = Image.new("RGB", size)
    if size[0] * size[1] > 1024 * 1024:
        image = Flux2ImageProcessor._resize_to_target_area(image, target[0] * target[1])
    return image.width // 16 * 16, image.height // 16 * 16


@pytest.mark.parametrize("target, size", [
    ((64, 64), (128, 64)), ((1024, 1024), (768, 512)), ((1024, 1024), (100, 72)), ((1024, 1024), (512, 512)),
    ((1024, 1024), (2048, 1536)), ((768, 1344), (1500, 1000)), ((1344, 768), (1025, 1024)), ((512, 512), (1030, 1100))])
def test_omni_references_are_sized_as_the_pipeline_in_training_and_samples(target, size):
    """References smaller than 1 MP keep their size (floored to 16), larger ones take the target's area. Training
    scaled every one to its target's area (1024 x 1024 for a 512 x 512 one), where samples and the pipeline keep it."""
    family = ZImageOmniFamily.__new__(ZImageOmniFamily)  # the rule reads no files
    assert family.sample_control_bucket(target, size) == pipeline_condition_size(target, size)
    assert family.control_bucket(target, size) == pipeline_condition_size(target, size)


def test_fp8_base_keeps_the_siglip_embedder(tiny_set):
    from library.precision.fp8 import FP8Linear

    model = ZImageOmniFamily(tiny_set["zimage_omni"]).load_transformer(torch.float32, "fp8_scaled")
    assert type(model.siglip_embedder[1]) is torch.nn.Linear
    assert isinstance(model.siglip_refiner[0].attention.to_q, FP8Linear)


def test_omni_sample_references_over_1_mp_are_the_pipelines_pixels(tmp_path):
    """A condition image over 1024 x 1024 pixels: resized to the output's area (Lanczos), then centre-cropped to
    sides floored to 16, as ZImageOmniPipeline's Flux2ImageProcessor prepares it (pixel for pixel)."""
    from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor

    family = ZImageOmniFamily.__new__(ZImageOmniFamily)  # the rule reads no files
    image = picture(1100, 1000, 5)
    image.save(tmp_path / "ref.png")
    processor = Flux2ImageProcessor(vae_scale_factor=16, vae_latent_channels=32)
    resized = processor._resize_to_target_area(image, 80 * 64)
    theirs = processor.preprocess(resized, height=resized.height // 16 * 16, width=resized.width // 16 * 16,
                                  resize_mode="crop")
    assert torch.equal(family.sample_references([str(tmp_path / "ref.png")], 80, 64)[2][0], theirs.float())
