"""FLUX.2 with reference images (multi-reference editing) against diffusers' pipelines on the tiny set: the
references' sizes and pixels (Flux2ImageProcessor's rule), their latents and positions (t = 10, 20, ...), the
sampler with references in both CFG passes (Flux2KleinPipeline, image=[...]), the training loss on the target's
tokens only; a tiny training run with a control_directory that samples with --ci."""

import csv
import os

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel
from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor
from diffusers.pipelines.flux2.pipeline_flux2_klein import Flux2KleinPipeline
from PIL import Image

import train_lora
from library.models.flux2.family import Flux2Family, reference_tokens
from library.models.latents import pack_latents
from tests.test_flux2_family import FLUX2_SCHEDULER


def picture(width: int, height: int, seed: int) -> Image.Image:
    """Smooth colours plus noise: a crop one pixel off, or a resample, changes it."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack((x * 255 / width, y * 255 / height, (x + y) * 127 / (width + height)), axis=-1)
    return Image.fromarray(np.clip(base + rng.integers(-40, 40, base.shape), 0, 255).astype(np.uint8))


def pipeline_size(size: tuple[int, int]) -> tuple[int, int]:
    """The (w, h) Flux2KleinPipeline encodes a condition image of `size` at (its __call__'s step 4)."""
    image = Image.new("L", size)  # the size alone matters
    if size[0] * size[1] > 1024 * 1024:
        image = Flux2ImageProcessor._resize_to_target_area(image, 1024 * 1024)
    return image.width // 16 * 16, image.height // 16 * 16


@pytest.mark.parametrize("size", [(64, 48), (100, 72), (768, 512), (1024, 1024), (1025, 1024), (2048, 1536),
                                  (1500, 1000), (3000, 500)])
def test_references_keep_their_size_as_the_pipelines_in_training_and_samples(size):
    """Up to 1 MP a reference keeps its size (sides floored to 16), larger ones are scaled to 1 MP; whatever the
    target's (the other families' default fits them to the target's bucket)."""
    family = Flux2Family.__new__(Flux2Family)  # the rule reads no files
    for target in ((64, 64), (1024, 1024), (768, 1344)):
        assert family.control_bucket(target, size) == pipeline_size(size)
        assert family.sample_control_bucket(target, size) == pipeline_size(size)


@pytest.mark.parametrize("size", [(100, 72), (1100, 1000)])
def test_sample_references_are_the_pipelines_pixels(tmp_path, size):
    """Pixel for pixel Flux2ImageProcessor's: resized (Lanczos) to 1 MP only when larger, then centre-cropped."""
    family = Flux2Family.__new__(Flux2Family)
    image = picture(*size, 5)
    image.save(tmp_path / "ref.png")
    processor = Flux2ImageProcessor(vae_scale_factor=16, vae_latent_channels=32)
    resized = processor._resize_if_exceeds_area(image, 1024 * 1024)
    theirs = processor.preprocess(resized, height=resized.height // 16 * 16, width=resized.width // 16 * 16,
                                  resize_mode="crop")
    width, height, (ours,) = family.sample_references([str(tmp_path / "ref.png")], 80, 64)
    assert (width, height) == (80, 64) and torch.equal(ours, theirs.float())


@pytest.mark.parametrize("family_name, area, large", [("flux2", 1024 * 1024, (1072, 976)),
                                                       ("zimage_omni", 32 * 32, (32, 16))])
def test_training_references_are_the_pipelines_pixels_cached_or_not(tmp_path, family_name, area, large):
    """A 100 x 72 reference (cropped to 96 x 64) and a 1100 x 1000 one (resized first: to 1 MP for FLUX.2, to the
    32 x 32 target's area for Z-Image Omni) beside a 32 x 32 target: the pixels the VAE caches and the uncached
    batches' are Flux2ImageProcessor's, which both pipelines use. Training covered them (a box-filter shrink by
    0.96 for the first) where samples and the pipelines crop."""
    from library.data import caches
    from library.data import dataset as D
    from library.models.family import family_class
    from library.training.diffusion_task import scan_family_images
    from tests.test_paired_dataset import paired_blueprint

    (tmp_path / "img").mkdir()
    (tmp_path / "ctrl").mkdir()
    picture(32, 32, 0).save(tmp_path / "img" / "a.png")
    for k, size in enumerate(((100, 72), (1100, 1000))):
        picture(*size, k + 1).save(tmp_path / "ctrl" / f"a_{k}.png")
    processor = Flux2ImageProcessor(vae_scale_factor=16, vae_latent_channels=32)
    expected = []
    for k in range(2):
        image = Image.open(tmp_path / "ctrl" / f"a_{k}.png").convert("RGB")
        image = processor._resize_to_target_area(image, area) if image.width * image.height > 1024 * 1024 else image
        expected.append(processor.preprocess(image, height=image.height // 16 * 16, width=image.width // 16 * 16,
                                             resize_mode="crop")[0].float())
    bp = paired_blueprint(tmp_path)
    cls = family_class(family_name)
    items = scan_family_images(bp, cls.__new__(cls))  # the rule reads no model file
    assert items[0].control_buckets == [(96, 64), large]
    uncached = D.ImageDataset(bp, items=items)[0]["control_images"]
    assert all(torch.equal(ours, theirs) for ours, theirs in zip(uncached, expected, strict=True))
    encoded = []
    caches.cache_latents(items, lambda images: encoded.append(images) or images[:, :, ::8, ::8], "flux2")
    assert [tuple(e.shape) for e in encoded] == [(1, 3, 32, 32), (1, 3, 64, 96), (1, 3, large[1], large[0])]
    assert all(torch.equal(ours[0], theirs) for ours, theirs in zip(encoded[1:], expected, strict=True))


def test_reference_positions_are_the_pipelines():
    """Target at t = 0, reference k at t = 10 + 10 k, each its own row / column grid (_prepare_image_ids)."""
    g = torch.Generator().manual_seed(0)
    x_t = torch.randn(2, 6, 128, generator=g)  # a 2 x 3 patch target
    refs = [torch.randn(2, 32, 4, 4, generator=g), torch.randn(2, 32, 6, 2, generator=g)]
    tokens, ids = reference_tokens(x_t, 2, 3, refs)
    patchified = [Flux2KleinPipeline._patchify_latents(r[:1]) for r in refs]
    theirs = Flux2KleinPipeline._prepare_image_ids(patchified)[0]
    assert ids.dtype == torch.int64 and torch.equal(ids[0, 6:], theirs.to(torch.int64))
    assert torch.equal(ids[0, :6, 0], torch.zeros(6, dtype=torch.int64))
    packed = torch.cat([Flux2KleinPipeline._pack_latents(p) for p in
                        (Flux2KleinPipeline._patchify_latents(r) for r in refs)], dim=1)
    assert torch.equal(tokens[:, 6:], packed) and torch.equal(tokens[:, :6], x_t)
    with pytest.raises(ValueError, match=r"reference latent 0 has shape \(2, 16, 4, 4\); expected \[2, 32, h, w\]"):
        reference_tokens(x_t, 2, 3, [torch.zeros(2, 16, 4, 4)])


@pytest.fixture(scope="module")
def klein(tiny_set):
    family = Flux2Family(tiny_set["flux2_tiny"], tiny_set["flux2_vae"], text_encoder=tiny_set["flux2_text_encoder"])
    pipe = Flux2KleinPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**FLUX2_SCHEDULER),
        vae=AutoencoderKLFlux2.from_pretrained(tiny_set["flux2_vae"]).eval(), text_encoder=None, tokenizer=None,
        transformer=Flux2Transformer2DModel.from_pretrained(tiny_set["flux2_diffusers"]).eval(), is_distilled=False)
    return family, pipe, family.load_transformer(torch.float32), family.load_vae()


@torch.no_grad()
@pytest.mark.parametrize("sizes", [[(80, 64)], [(100, 72), (64, 96)]])
def test_sampling_with_references_equals_flux2_klein_pipeline(klein, tmp_path, sizes):
    """Three steps with CFG 3 on a 64 x 48 target, one reference (64 px: the pipeline takes no smaller) or two
    (one it crops): our pixels and latents of the references, and the image sampled with them, against
    Flux2KleinPipeline(image=[...])."""
    family, pipe, model, vae = klein
    images = [picture(*size, k) for k, size in enumerate(sizes)]
    captured = {}
    real = pipe.prepare_image_latents

    def capture(images, *args, **kwargs):
        captured["pixels"], captured["latents"] = images, real(images, *args, **kwargs)
        return captured["latents"]

    pipe.prepare_image_latents = capture
    g = torch.Generator().manual_seed(5)
    text, negative = ({"embeds": torch.randn(1, 12, 96, generator=g)} for _ in range(2))
    expected = pipe(image=images, prompt_embeds=text["embeds"], negative_prompt_embeds=negative["embeds"], height=48,
                    width=64, num_inference_steps=3, guidance_scale=3.0, generator=torch.Generator().manual_seed(7),
                    output_type="pt").images
    paths = []
    for k, image in enumerate(images):
        paths.append(str(tmp_path / f"ref{k}.png"))
        image.save(paths[-1])
    width, height, pixels = family.sample_references(paths, 64, 48)
    assert all(torch.equal(ours, theirs.float()) for ours, theirs in zip(pixels, captured["pixels"], strict=True))
    control = [vae.encode(p) for p in pixels]
    packed = torch.cat([pack_latents(c) for c in control], dim=1)
    assert (packed - captured["latents"][0]).abs().max().item() < 1e-5
    ours = (vae.decode(family.sample_latents(model, text, width, height, 3, 7, 3.0, negative, control=control)) + 1) / 2
    without = (vae.decode(family.sample_latents(model, text, width, height, 3, 7, 3.0, negative)) + 1) / 2
    err, effect = ((ours - expected).abs().max().item(), (without - expected).abs().max().item())
    print(f"FLUX.2 [klein] with {len(sizes)} reference(s) vs Flux2KleinPipeline: max abs {err:.2e} "
          f"(without the references {effect:.2e})")
    assert effect > 1e-3 and err <= 1e-5, (err, effect)


def test_training_loss_is_on_the_target_tokens_with_the_references_seen(klein):
    family, _, model, _ = klein
    g = torch.Generator().manual_seed(1)
    latents, noise = torch.randn(2, 32, 4, 6, generator=g), torch.randn(2, 32, 4, 6, generator=g)
    control = [torch.randn(2, 32, 6, 4, generator=g)]
    text = {"embeds": torch.randn(2, 5, 96, generator=g)}
    sigmas = torch.tensor([0.2, 0.9])
    loss = family.loss_at(model, latents, text, noise, sigmas, None, control=control)
    x_t = pack_latents((1 - sigmas.view(-1, 1, 1, 1)) * latents + sigmas.view(-1, 1, 1, 1) * noise)
    img, img_ids = reference_tokens(x_t, 2, 3, control)
    with torch.no_grad():  # by hand: the model over target + reference tokens, the target's velocity kept
        out = model(img=img, img_ids=img_ids, txt=text["embeds"], txt_ids=torch.zeros(2, 5, 4, dtype=torch.int64)
                    + torch.tensor([0, 0, 0, 1]) * torch.arange(5)[:, None], timesteps=sigmas)
    expected = ((out[:, :6] - pack_latents(noise - latents)) ** 2).mean()
    assert abs(loss.item() - expected.item()) <= 1e-6 * expected.item()
    with torch.no_grad():
        without = family.predict(model, x_t, sigmas, text, 2, 3, None)
    change = ((out[:, :6] - without).norm() / without.norm()).item()
    assert change > 1e-3, change  # the references change the prediction


def test_klein_lora_trains_on_references_and_samples_with_them(tiny_set, tmp_path):
    """Four steps (one epoch, batch 2) over a control_directory subset (a 32 x 32 reference per target) and a
    subset without references: two batches see the references' latents at their own size, two none; the
    sample's --ci reference renders; the LoRA is saved."""
    from PIL import Image

    from tools.make_tiny_dataset import make_tiny_edit_dataset

    data = make_tiny_edit_dataset(str(tmp_path / "data"), count=4, size=32)
    plain = tmp_path / "plain"
    plain.mkdir()
    for i in range(4):
        Image.new("RGB", (32, 32), (60 * i, 200, 30)).save(plain / f"p{i}.png")
        (plain / f"p{i}.txt").write_text("a green square")
    dataset = tmp_path / "dataset.toml"
    dataset.write_text(f'[general]\nresolution = 32\nbatch_size = 2\n[[datasets]]\n[[datasets.subsets]]\n'
                       f'image_dir = "{data["edit_image_dir"]}"\ncontrol_directory = "{data["edit_control_dir"]}"\n'
                       f'[[datasets.subsets]]\nimage_dir = "{plain}"\n')
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"make the shape red --ci {data['edit_control_dir']}/000.png --w 32 --h 32 --s 2 --g 2.0\n")
    seen = []
    real = Flux2Family.loss_at

    def recording(self, model, latents, text, *args, control=None, **kwargs):
        seen.append([tuple(c.shape) for c in control or []])
        return real(self, model, latents, text, *args, control=control, **kwargs)

    out = tmp_path / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Flux2Family, "loss_at", recording)
        code = train_lora.main([
            "--model_type", "flux2", "--pretrained_model_name_or_path", tiny_set["flux2_tiny"],
            "--ae", tiny_set["flux2_vae"], "--text_encoder", tiny_set["flux2_text_encoder"],
            "--dataset_config", str(dataset), "--sample_prompts", str(prompts),
            "--output_dir", str(out), "--output_name", "edit", "--max_train_steps", "4", "--mixed_precision", "no",
            "--network_dim", "4", "--network_alpha", "4", "--optimizer_type", "AdamW", "--learning_rate", "3e-3",
            "--sample_at_first", "false", "--sample_every_n_steps", "0", "--save_every_n_steps", "0",
            "--save_state", "false", "--cache_latents_to_disk", "false",
            "--cache_text_encoder_outputs_to_disk", "false"])
    assert code == 0
    with open(out / "edit_log.csv") as f:
        losses = [float(r["loss"]) for r in csv.DictReader(f)]
    assert len(losses) == 4 and all(np.isfinite(losses))
    assert sorted(seen) == [[], [], [(2, 32, 4, 4)], [(2, 32, 4, 4)]], seen
    assert (out / "edit.safetensors").is_file()
    assert any(p.endswith(".png") for p in os.listdir(out))  # the final sample, with its reference
