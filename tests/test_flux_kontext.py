"""FLUX.1 Kontext: our family's predict against diffusers' FluxTransformer2DModel called the way
FluxKontextPipeline calls it (target tokens, then the reference's with first id axis 1, output
cut to the target), fp32, on the same weights."""

import pytest
import torch
from diffusers import FluxKontextPipeline

from library.models.family import family_class
from library.models.flux1.checkpoint import load_flux
from library.models.flux1.kontext import kontext_tokens
from tests.test_flux import tiny_diffusers

B, T = 2, 7
H, W = 6, 8  # target grid in 2x2 patches
RH, RW = 4, 10  # reference grid: another size (the pipeline may resize the reference)


def kontext_inputs():
    g = torch.Generator().manual_seed(3)
    return dict(
        x_t=torch.randn(B, H * W, 64, generator=g),
        reference=torch.randn(B, 16, 2 * RH, 2 * RW, generator=g),
        text={"t5": torch.randn(B, T, 32, generator=g), "clip_pooled": torch.randn(B, 16, generator=g)},
        sigmas=torch.tensor([0.3, 0.85]),
    )


def diffusers_kontext_forward(model, x: dict, guidance: float) -> torch.Tensor:
    """FluxKontextPipeline.__call__'s transformer call (prepare_latents' ids and packing)."""
    pipe = FluxKontextPipeline
    latent_ids = pipe._prepare_latent_image_ids(B, H, W, "cpu", torch.float32)
    image_ids = pipe._prepare_latent_image_ids(B, RH, RW, "cpu", torch.float32)
    image_ids[..., 0] = 1
    image_latents = pipe._pack_latents(x["reference"], B, 16, 2 * RH, 2 * RW)
    with torch.no_grad():
        out = model(
            hidden_states=torch.cat([x["x_t"], image_latents], dim=1), timestep=x["sigmas"],
            guidance=torch.full([B], guidance), pooled_projections=x["text"]["clip_pooled"],
            encoder_hidden_states=x["text"]["t5"], txt_ids=torch.zeros(T, 3),
            img_ids=torch.cat([latent_ids, image_ids], dim=0), return_dict=False,
        )[0]  # fmt: skip
    return out[:, : x["x_t"].shape[1]]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    reference = tiny_diffusers(True)
    folder = tmp_path_factory.mktemp("kontext")
    reference.save_pretrained(folder)
    return load_flux(str(folder)), reference


def test_flux_kontext_matches_diffusers_fp32(pair):
    ours, theirs = pair
    family = family_class("flux_kontext")("unused")
    x = kontext_inputs()
    expected = diffusers_kontext_forward(theirs, x, 2.5)
    with torch.no_grad():
        out = family.predict(ours, x["x_t"], x["sigmas"], x["text"], H, W, 2.5, control=[x["reference"]])
        plain = family.predict(ours, x["x_t"], x["sigmas"], x["text"], H, W, 2.5)
    assert out.shape == (B, H * W, 64) and out.dtype == torch.float32
    assert expected.abs().mean() > 0.1
    err = (out - expected).abs().max().item()
    print(f"kontext parity max abs error {err:.3g}")
    assert err <= 1e-5
    assert (plain - expected).abs().max().item() > 1e-2  # the reference really conditions the target


def test_kontext_without_reference_is_flux1(pair):
    ours, _ = pair
    x = kontext_inputs()
    with torch.no_grad():
        kontext = family_class("flux_kontext")("unused").predict(ours, x["x_t"], x["sigmas"], x["text"], H, W, 3.5)
        flux = family_class("flux")("unused").predict(ours, x["x_t"], x["sigmas"], x["text"], H, W, 3.5)
    assert torch.equal(kontext, flux)


def test_several_references_are_placed_as_comfyui_offsets_them():
    """ComfyUI's default for FLUX.1 references ("offset", comfy/ldm/flux/model.py): every reference at
    first axis 1, the next one right of the box the earlier ones cover where that box plus it is taller
    than wide, else below. By hand for 2x1, 1x1 and 1x2 patches: (0, 0), right at column 1, below at
    row 2. The old ids gave references 2 and 3 first axes 2 and 3 at (0, 0)."""
    x_t = torch.zeros(1, 4, 64)
    refs = [torch.zeros(1, 16, 4, 2), torch.zeros(1, 16, 2, 2), torch.zeros(1, 16, 2, 4)]
    tokens, ids = kontext_tokens(x_t, 2, 2, refs)
    assert tokens.shape == (1, 4 + 2 + 1 + 2, 64) and ids.dtype == torch.int64
    assert ids[0, 4:].tolist() == [[1, 0, 0], [1, 1, 0], [1, 0, 1], [1, 2, 0], [1, 2, 1]]
    _, one = kontext_tokens(x_t, 2, 2, refs[:1])  # one reference: FluxKontextPipeline's (1, row, col)
    assert one[0, 4:].tolist() == [[1, 0, 0], [1, 1, 0]]
    with pytest.raises(ValueError, match=r"reference latent 0 has shape \(1, 16, 3, 2\)"):
        kontext_tokens(x_t, 2, 2, [torch.zeros(1, 16, 3, 2)])


def _flux_scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                                           max_image_seq_len=4096, shift=3.0)  # FLUX.1-dev's scheduler_config.json


def test_sample_reference_takes_the_preferred_resolution_nearest_its_aspect():
    """A sample's reference is sized as FluxKontextPipeline(_auto_resize) sizes it: our table is the
    pipeline's, and the pick is the pipeline's min((|ratio - w / h|, w, h)) whatever the target (it was
    the target's bucket: a 1200 x 800 reference for a 512 x 512 sample was cropped to 512 x 512, the
    pipeline renders it at 1248 x 832). The ratio is of the sides the pipeline's image processor rounds down
    to multiples of 16 (the raw ratio picked 1024 x 1024 for 600 x 642, the pipeline 944 x 1104: 4.8% of the
    sizes 600-1700 px)."""
    from diffusers.image_processor import VaeImageProcessor
    from diffusers.pipelines.flux import pipeline_flux_kontext as theirs
    from PIL import Image

    from library.models.flux1.kontext import PREFERRED_RESOLUTIONS

    assert PREFERRED_RESOLUTIONS == theirs.PREFERRED_KONTEXT_RESOLUTIONS
    family = family_class("flux_kontext")("unused.safetensors")
    processor = VaeImageProcessor(vae_scale_factor=16)  # FluxKontextPipeline's (the VAE's 8 x the 2 x 2 patches)
    for size in [(1200, 800), (800, 1200), (1000, 1000), (4000, 1000), (1000, 4000), (1500, 1100), (1023, 977),
                 (600, 642), (1095, 1009), (1000, 1250)]:
        height, width = processor.get_default_height_width(Image.new("RGB", size))
        _, w, h = min((abs(width / height - w / h), w, h) for w, h in theirs.PREFERRED_KONTEXT_RESOLUTIONS)
        assert family.sample_control_bucket((512, 512), size) == (w, h), size
    picks = [family.sample_control_bucket((512, 512), s) for s in [(600, 642), (1095, 1009)]]
    assert picks == [(944, 1104), (1024, 1024)]
    assert family.sample_control_bucket((512, 512), (1200, 800)) == (1248, 832)
    assert family.control_bucket((512, 512), (1200, 800)) == (512, 512)  # training: the target's bucket (musubi-tuner's)


def test_sample_reference_pixels_are_the_pipelines_stretch(tmp_path):
    """The pipeline stretches a reference to its preferred resolution with its image processor's Lanczos resize:
    ours cropped it to cover that size with a box filter (a 70 x 29 reference's rows and columns cut off)."""
    import numpy as np
    from diffusers.image_processor import VaeImageProcessor
    from PIL import Image

    image = Image.fromarray(np.random.RandomState(3).randint(0, 256, (29, 70, 3), dtype=np.uint8))
    image.save(tmp_path / "ref.png")
    family = family_class("flux_kontext")("unused.safetensors")
    w, h = family.sample_control_bucket((512, 512), image.size)
    processor = VaeImageProcessor(vae_scale_factor=16)  # FluxKontextPipeline's
    theirs = processor.preprocess(processor.resize(image, h, w), h, w)
    assert torch.equal(family.sample_references([str(tmp_path / "ref.png")], 512, 512)[2][0], theirs.float())


@pytest.mark.parametrize("kontext", [False, True])
def test_sampling_matches_flux_and_kontext_pipelines(tiny_set, tmp_path, monkeypatch, kontext):
    """sample_latents (resolution-shifted sigmas, guidance embedding, 3 Euler steps, 64 x 48) equals
    FluxPipeline.__call__ on the same weights, noise and embeddings; Kontext's with a 64 x 32 reference
    image (our file -> sample_control_bucket -> VAE -> control) equals FluxKontextPipeline.__call__(image=...)
    with its _auto_resize on, both preferred-resolution tables patched down to 32 x 64 / 64 x 32 (CPU
    seconds; max_area the target's). The reference was fitted to the 64 x 48 target before (6 x 8 latents, not 4 x 8)."""
    import numpy as np
    from diffusers import AutoencoderKL, FluxPipeline, FluxTransformer2DModel
    from PIL import Image

    from library.data.controls import reference_images
    from library.models.latents import pack_latents

    width, height, steps, seed, guidance = 64, 48, 3, 7, 2.5
    family = family_class("flux_kontext" if kontext else "flux")(tiny_set["flux_bfl"], tiny_set["flux_vae"])
    model = family.load_transformer(torch.float32)
    g = torch.Generator().manual_seed(1)
    text = {"t5": torch.randn(1, 7, model.config.context_in_dim, generator=g),
            "clip_pooled": torch.randn(1, model.config.vec_in_dim, generator=g)}
    reference = FluxTransformer2DModel.from_pretrained(tiny_set["flux_diffusers"]).eval()
    noise = pack_latents(family.initial_noise(1, height // 8, width // 8, torch.Generator().manual_seed(seed)))
    call = dict(prompt_embeds=text["t5"], pooled_prompt_embeds=text["clip_pooled"], latents=noise, height=height,
                width=width, num_inference_steps=steps, guidance_scale=guidance, output_type="latent")
    control = None
    if kontext:
        from diffusers.pipelines.flux import pipeline_flux_kontext

        from library.models.flux1 import kontext as ours_kontext

        for module, name in ((pipeline_flux_kontext, "PREFERRED_KONTEXT_RESOLUTIONS"), (ours_kontext, "PREFERRED_RESOLUTIONS")):
            monkeypatch.setattr(module, name, [(32, 64), (64, 32)])
        image = Image.fromarray((np.random.default_rng(0).random((32, 64, 3)) * 255).astype(np.uint8))
        image.save(tmp_path / "reference.png")
        vae = family.load_vae(torch.float32)
        control = [vae.encode(r) for r in reference_images([str(tmp_path / "reference.png")], family.sample_control_bucket,
                                                           width, height)]
        assert control[0].shape[-2:] == (4, 8)  # 64 x 32 px, as the pipeline encodes it
        pipe = FluxKontextPipeline(scheduler=_flux_scheduler(), vae=AutoencoderKL.from_pretrained(tiny_set["flux_vae"]).eval(),
                                   text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None, transformer=reference)
        call.update(image=image, max_area=width * height)
    else:
        pipe = FluxPipeline(scheduler=_flux_scheduler(), vae=None, text_encoder=None, tokenizer=None, text_encoder_2=None,
                            tokenizer_2=None, transformer=reference)
    ours = pack_latents(family.sample_latents(model, text, width, height, steps, seed, guidance, control=control))
    with torch.no_grad():
        theirs = pipe(**call).images
    relative = ((ours - theirs).norm() / theirs.norm()).item()
    print(f"{family.name} sampling vs its pipeline: relative {relative:.3g}")
    assert relative <= 1e-5


def test_an_edit_model_type_trained_without_any_reference_is_warned(tiny_set, tmp_path, monkeypatch):
    """Kontext on a dataset with no control_directory trained text-to-image to the end without a word (musubi-tuner
    stops on it): a forgotten control_directory. One warning before caching; none where a subset has references."""
    import train_lora
    from library.data.controls import references_missing
    from library.training.diffusion_task import DiffusionTask
    from tests.test_reliability import flux_args

    class BeforeCaching(Exception):
        pass

    def stop(self):
        raise BeforeCaching

    monkeypatch.setattr(DiffusionTask, "_fill_caches", stop)
    said = "model_type flux_kontext is an edit model, but no training image has a reference image"
    with pytest.warns(UserWarning, match=said), pytest.raises(BeforeCaching):
        train_lora.main(flux_args(tiny_set, tmp_path / "out", "--model_type", "flux_kontext"))

    class Subset:
        def __init__(self, control_directory):
            self.control_directory = control_directory

    assert references_missing([Subset(None), Subset("ctrl")], "flux_kontext") is None
    assert said in references_missing([Subset(None), Subset(None)], "flux_kontext")
    assert family_class("flux_kontext").edits_without_references_warn
    assert not family_class("flux").edits_without_references_warn
