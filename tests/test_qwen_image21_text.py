"""Qwen-Image-2.1 prompt encoding (Qwen3-VL's language model on our LLM core) against
QwenImage21Pipeline.encode_prompt on a tiny transformers Qwen3VLForConditionalGeneration, and the VAE
wrapper against the pipeline's own _encode_vae_image and its decode."""

from types import SimpleNamespace

import pytest
import torch

from library.models.qwen_image21.tiny import write_qwen_image21_text_encoder, write_qwen_image21_vae

PROMPTS = ["a photo of a cat sitting on a red chair", "a dog", ""]


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("qi21_text"))
    return {**write_qwen_image21_text_encoder(out, 0), **write_qwen_image21_vae(out, 0), "root": out + "/qwen_image21"}


def pipeline(tiny_files, vae=None, transformer=None, scheduler=None):
    """QwenImage21Pipeline with the tiny text side. Its Qwen3VLProcessor is built by hand: transformers
    checks the video processor's class, which needs torchvision (not installed; text never uses it)."""
    from diffusers import QwenImage21Pipeline
    from transformers import AutoTokenizer, Qwen2VLImageProcessor, Qwen3VLForConditionalGeneration, Qwen3VLProcessor
    from transformers.processing_utils import ProcessorMixin

    text_encoder = Qwen3VLForConditionalGeneration.from_pretrained(tiny_files["qwen_image21_text_encoder"]).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_files["qwen_image21_processor"])
    image_processor = Qwen2VLImageProcessor.from_pretrained(tiny_files["qwen_image21_processor"])
    check = ProcessorMixin.check_argument_for_proper_class
    try:
        ProcessorMixin.check_argument_for_proper_class = lambda self, name, arg: None if arg is None else check(self, name, arg)
        processor = Qwen3VLProcessor(image_processor=image_processor, tokenizer=tokenizer, video_processor=None,
                                     chat_template=tokenizer.chat_template)
    finally:
        ProcessorMixin.check_argument_for_proper_class = check
    return QwenImage21Pipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, processor=processor,
                               transformer=transformer)


def test_encode_prompt_matches_pipeline(tiny_files):
    from library.models.qwen_image21.text_encoder import load_qwen_image21_text_encoder

    pipe = pipeline(tiny_files)
    with torch.no_grad():  # [B, T, 32] real tokens first, zeros after; the mask; no image slots
        expected, expected_mask, image_slots = pipe.encode_prompt(PROMPTS, device="cpu")
    ours = load_qwen_image21_text_encoder(tiny_files["root"])
    assert ours.drop == pipe._drop_idx and ours.llm.lm_head is None
    embeds, mask = ours.encode(PROMPTS)
    assert embeds.dtype == torch.float32 and embeds.shape == expected.shape and not image_slots.any()
    assert torch.equal(mask, expected_mask.bool())
    diff, scale = (embeds - expected).abs().max().item(), expected.abs().max().item()
    print(f"Qwen-Image-2.1 encode_prompt: max abs diff {diff:.2e} (values up to {scale:.2e})")
    assert diff <= 1e-5 * scale and expected.abs().mean() > 1e-3


def test_hidden_state_is_the_last_layer_before_the_final_norm(tiny_files):
    """The pipeline hooks the final RMSNorm away; with it the states differ (a test that can fail)."""
    from library.models.qwen_image21.text_encoder import load_qwen_image21_text_encoder

    ours = load_qwen_image21_text_encoder(tiny_files["root"])
    embeds, mask = ours.encode(PROMPTS[:1])
    normed = ours.llm.model.norm(embeds)
    assert (normed - embeds).abs().max() > 1e-2


def test_vae_matches_the_pipelines_encode_and_decode(tiny_files):
    from diffusers import AutoencoderKLQwenImage21, QwenImage21Pipeline

    from library.models.qwen_image21.vae import load_qwen_image21_vae

    reference = AutoencoderKLQwenImage21.from_pretrained(tiny_files["qwen_image21_vae"]).eval()
    ours = load_qwen_image21_vae(tiny_files["root"])
    g = torch.Generator().manual_seed(0)
    rgb = torch.rand(1, 3, 64, 96, generator=g) * 2 - 1
    rgba = torch.cat([rgb, torch.ones_like(rgb[:, :1])], 1)[:, :, None]  # an opaque picture, preprocessed
    fake = SimpleNamespace(vae=reference, latent_channels=reference.config.z_dim)
    with torch.no_grad():
        expected = QwenImage21Pipeline._encode_vae_image(fake, rgba, None)[:, :, 0]  # [1, 64, 4, 6]
        latents = ours.encode(rgb)
        assert latents.shape == (1, 64, 4, 6) and torch.equal(latents, expected)
        std = torch.tensor(reference.config.latents_std).view(1, -1, 1, 1, 1)
        mean = torch.tensor(reference.config.latents_mean).view(1, -1, 1, 1, 1)
        image = reference.decode(latents[:, :, None] * std + mean, return_dict=False)[0][:, :, 0]  # as __call__
        assert torch.equal(ours.decode(latents), image[:, :3])


def condition_images():
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 255, (64, 96, 3), dtype=np.uint8)),  # 2 x 3 merged vision tokens
            Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8))]  # 2 x 2


def test_encode_prompt_with_condition_images_matches_pipeline(tiny_files, monkeypatch):
    """Two condition images per prompt: transformers' Qwen3-VL vision tower, its features at the image tokens,
    M-RoPE ids of the images' grids and the deepstack features added after the first layer, our LLM core for
    the rest: embeddings and the image-slot mask equal the pipeline's. Without deepstack they differ."""
    from library.models.qwen_image21.text_encoder import load_qwen_image21_image_text_encoder

    images, prompts = condition_images(), ["make the cat red", "a dog"]
    with torch.no_grad():
        expected, _, expected_slots = pipeline(tiny_files).encode_prompt(prompts, image=images, device="cpu")
    ours = load_qwen_image21_image_text_encoder(tiny_files["root"])
    embeds, mask, slots = ours.encode_with_images(prompts, [images, images])
    assert torch.equal(slots, expected_slots.bool()) and slots.sum(1).tolist() == [10, 10]
    diff, scale = (embeds - expected).abs().max().item(), expected.abs().max().item()
    print(f"Qwen-Image-2.1 encode_prompt with 2 images: max abs diff {diff:.2e} (values up to {scale:.2e})")
    assert diff <= 1e-5 * scale
    forward = ours.llm.selected_hidden_states
    monkeypatch.setattr(ours.llm, "selected_hidden_states", lambda *a, deepstack=None, **k: forward(*a, **k))
    assert (ours.encode_with_images(prompts, [images, images])[0] - expected).abs().max() > 1e-3 * scale


def test_a_transparent_reference_of_another_size_reaches_the_encoder_as_the_pipelines(tiny_files, tmp_path):
    """The family's encode on the reference file (reference_views): a 150 x 90 cut-out (right half transparent,
    black under it) at reference_resolution 64 -> 96 x 64. The pipeline resizes the RGBA picture with Lanczos
    and composites it over white; the old view was RGB (alpha dropped: 0.11 off, values up to 0.08) resized
    bicubic (2.4e-3 off)."""
    import numpy as np
    from diffusers.image_processor import VaeImageProcessor
    from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import calculate_dimensions
    from PIL import Image

    from library.data.controls import reference_views
    from library.models.qwen_image21.family import QwenImage21Family, reference_size

    rng = np.random.default_rng(1)
    rgba = rng.integers(0, 255, (90, 150, 4), dtype=np.uint8)
    rgba[:, 75:, 3], rgba[:, 75:, :3] = 0, 0
    Image.fromarray(rgba, "RGBA").save(tmp_path / "cutout.png")
    family = QwenImage21Family("unused", None, 64, text_encoder=tiny_files["root"])
    (ours,) = family.load_text_encoder("fp32")(["make the cat red"], [reference_views([str(tmp_path / "cutout.png")])])
    picture = Image.open(tmp_path / "cutout.png")
    w, h, _ = calculate_dimensions(64 * 64, picture.size[0] / picture.size[1])
    assert (w, h) == reference_size(*picture.size, 64) == (96, 64)
    sized = VaeImageProcessor(vae_scale_factor=16, vae_latent_channels=64).resize(picture, width=w, height=h)
    with torch.no_grad():
        expected, _, _ = pipeline(tiny_files).encode_prompt(["make the cat red"], image=[sized], device="cpu")
    diff, scale = (ours["embeds"] - expected[0]).abs().max().item(), expected.abs().max().item()
    print(f"Qwen-Image-2.1 family encode of a resized cut-out: max abs diff {diff:.2e} (values up to {scale:.2e})")
    assert diff <= 1e-5 * scale
