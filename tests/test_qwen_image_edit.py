"""Qwen-Image-Edit / Edit-2509 / Edit-2511: the transformer with condition latents appended, against
diffusers' QwenImageTransformer2DModel called as each edit pipeline calls it, and the pipelines'
condition-image sizes.

Tiny random models (2 blocks, 2 heads x 32, RoPE axes (8, 12, 12)) with each release's config flags.
"""

import pytest
import torch
from diffusers import QwenImageTransformer2DModel
from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit as edit_pipe
from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as plus_pipe

from library.models.qwen_image.edit import (
    EDIT,
    EDIT_2509,
    EDIT_2511,
    EDIT_VERSIONS,
    TRANSFORMER_FLAGS,
    area_size,
    edit_sizes,
    version_from_flags,
)
from library.models.qwen_image.model import QwenImageConfig, load_qwen_image
from tests.test_qwen_image import randomize_

TEXT, VALID = 7, 4


def tiny_config(version: str) -> QwenImageConfig:
    return QwenImageConfig(num_layers=2, attention_head_dim=32, num_attention_heads=2, joint_attention_dim=32,
                           axes_dims_rope=(8, 12, 12), **TRANSFORMER_FLAGS[version])


# What each pipeline passes: Edit one condition image (its ~1024^2 size, here a smaller grid than
# the target), batch 2; Edit-2509/2511 (Plus) several condition images of different sizes, batch 1.
CASES = {
    EDIT: (2, [(1, 6, 8), (1, 4, 6)]),
    EDIT_2509: (1, [(1, 6, 8), (1, 4, 6), (1, 5, 3)]),
    EDIT_2511: (1, [(1, 6, 8), (1, 4, 6), (1, 5, 3)]),
}


def save_reference(version: str, root):
    """A random diffusers transformer with the release's flags, saved as a pipeline folder."""
    config = tiny_config(version)
    ref = QwenImageTransformer2DModel(**{k: v for k, v in config.to_diffusers().items() if not k.startswith("_")})
    randomize_(ref, torch.Generator().manual_seed(11))
    ref.save_pretrained(root / "transformer")
    return ref


@pytest.fixture(scope="module", params=EDIT_VERSIONS)
def saved(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    return request.param, save_reference(request.param, root), root


def edit_inputs(version: str):
    batch, shapes = CASES[version]
    g = torch.Generator().manual_seed(5)
    tokens = sum(f * h * w for f, h, w in shapes)
    latents = torch.randn(batch, tokens, 64, generator=g)  # [target, condition 1, ...] packed
    txt = torch.randn(batch, TEXT, 32, generator=g)
    mask = torch.ones(batch, TEXT, dtype=torch.long)
    mask[0, VALID:] = 0
    sigma = torch.full((batch,), 0.63)  # the pipelines: t.expand(batch) / 1000
    return latents, txt, mask, sigma, [list(shapes)] * batch


@pytest.mark.parametrize("sigma_value", [0.63, 0.05])
def test_edit_transformer_matches_diffusers_fp32(saved, sigma_value):
    version, ref, root = saved
    ours = load_qwen_image(str(root))
    assert ours.config == tiny_config(version)
    latents, txt, mask, sigma, img_shapes = edit_inputs(version)
    sigma = torch.full_like(sigma, sigma_value)
    with torch.no_grad():  # as pipeline_qwenimage_edit(_plus): guidance None, img_shapes with every image
        expected = ref(hidden_states=latents, timestep=sigma, guidance=None, encoder_hidden_states_mask=mask,
                       encoder_hidden_states=txt, img_shapes=img_shapes, return_dict=False)[0]
        got = ours(latents, txt, mask.bool(), sigma, img_shapes)
    error = (got - expected).abs().max().item()
    print(f"{version} sigma {sigma_value}: max |ours - diffusers| = {error:.2e}")
    assert got.shape == expected.shape and error <= 1e-5


def test_zero_cond_t_changes_the_prediction(tmp_path):
    """2511's flag matters: the same weights without zero_cond_t predict otherwise."""
    version, root = EDIT_2511, tmp_path
    save_reference(version, root)
    ours = load_qwen_image(str(root))
    plain = load_qwen_image(str(root), config=tiny_config(EDIT_2509))
    latents, txt, mask, sigma, img_shapes = edit_inputs(version)
    with torch.no_grad():
        diff = (ours(latents, txt, mask.bool(), sigma, img_shapes) - plain(latents, txt, mask.bool(), sigma, img_shapes))
    assert diff.abs().max().item() > 1e-3


def test_zero_cond_t_needs_one_target_size_per_batch(tmp_path):
    save_reference(EDIT_2511, tmp_path)
    ours = load_qwen_image(str(tmp_path))
    txt = torch.zeros(2, TEXT, 32)
    shapes = [[(1, 2, 4), (1, 2, 2)], [(1, 2, 2), (1, 2, 4)]]  # same token total, different targets
    with pytest.raises(ValueError, match="target images differ"):
        ours(torch.zeros(2, 12, 64), txt, None, torch.full((2,), 0.5), shapes)


def test_additional_t_cond_matches_diffusers(tmp_path):
    """use_additional_t_cond (Qwen-Image-Layered's flag): a learned row added to the time embedding."""
    config = QwenImageConfig(num_layers=1, attention_head_dim=32, num_attention_heads=2, joint_attention_dim=32,
                             axes_dims_rope=(8, 12, 12), use_additional_t_cond=True)
    ref = QwenImageTransformer2DModel(**{k: v for k, v in config.to_diffusers().items() if not k.startswith("_")})
    randomize_(ref, torch.Generator().manual_seed(4))
    ref.save_pretrained(tmp_path)
    ours = load_qwen_image(str(tmp_path))
    g = torch.Generator().manual_seed(6)
    img, txt, cond = torch.randn(2, 24, 64, generator=g), torch.randn(2, TEXT, 32, generator=g), torch.tensor([0, 1])
    shapes, sigma = [[(1, 4, 6)]] * 2, torch.tensor([0.3, 0.7])
    with torch.no_grad():
        expected = ref(hidden_states=img, encoder_hidden_states=txt, timestep=sigma, img_shapes=shapes,
                       additional_t_cond=cond, return_dict=False)[0]
        got = ours(img, txt, None, sigma, shapes, additional_t_cond=cond)
    assert (got - expected).abs().max().item() <= 1e-5
    with pytest.raises(ValueError, match="additional_t_cond"):
        ours(img, txt, None, sigma, shapes)


def test_version_from_transformer_flags():
    assert version_from_flags({"zero_cond_t": True}) == EDIT_2511
    assert version_from_flags({}) == EDIT_2509


# ----------------------------------------------------------------------------------------------
# Condition-image sizes

IMAGE_SIZES = [(1024, 1024), (1920, 1080), (1080, 1920), (640, 480), (333, 777), (4000, 3000), (97, 1203)]


@pytest.mark.parametrize("size", IMAGE_SIZES)
def test_area_size_matches_pipelines_calculate_dimensions(size):
    ratio = size[0] / size[1]
    assert area_size(*size, plus_pipe.VAE_IMAGE_SIZE) == plus_pipe.calculate_dimensions(plus_pipe.VAE_IMAGE_SIZE, ratio)
    assert area_size(*size, plus_pipe.CONDITION_IMAGE_SIZE) == plus_pipe.calculate_dimensions(
        plus_pipe.CONDITION_IMAGE_SIZE, ratio)
    assert area_size(*size, 1024 * 1024) == edit_pipe.calculate_dimensions(1024 * 1024, ratio)[:2]


@pytest.mark.parametrize("size", IMAGE_SIZES)
def test_edit_sizes_follow_edit_pipeline(size):
    """QwenImageEditPipeline.__call__: one image resized to calculate_dimensions(1024^2) for the VL
    prompt and the VAE; the output is that size floored to vae_scale_factor * 2 = 16."""
    w, h, _ = edit_pipe.calculate_dimensions(1024 * 1024, size[0] / size[1])
    sizes = edit_sizes(EDIT, [size])
    assert sizes.encoder == [(w, h)] and sizes.vae == [(w, h)]
    assert sizes.output == (w // 16 * 16, h // 16 * 16)
    assert sizes.img_shapes() == [(1, h // 16, w // 16), (1, h // 16, w // 16)]  # the pipeline's img_shapes


@pytest.mark.parametrize("version", [EDIT_2509, EDIT_2511])
def test_edit_plus_sizes_follow_plus_pipeline(version):
    images = IMAGE_SIZES[1:4]
    sizes = edit_sizes(version, images)
    calc = plus_pipe.calculate_dimensions
    assert sizes.encoder == [calc(plus_pipe.CONDITION_IMAGE_SIZE, w / h) for w, h in images]
    assert sizes.vae == [calc(plus_pipe.VAE_IMAGE_SIZE, w / h) for w, h in images]
    out_w, out_h = calc(1024 * 1024, images[-1][0] / images[-1][1])  # the last image sets the output
    assert sizes.output == (out_w // 16 * 16, out_h // 16 * 16)
    expected = [(1, sizes.output[1] // 16, sizes.output[0] // 16)] + [(1, vh // 16, vw // 16) for vw, vh in sizes.vae]
    assert sizes.img_shapes() == expected


@pytest.mark.parametrize("bucket", [(512, 512), (1024, 1024), (768, 1344)])
def test_sample_reference_is_encoded_at_the_pipelines_vae_area_whatever_the_target(bucket):
    """A sample's reference is encoded at the Plus pipeline's calculate_dimensions(VAE_IMAGE_SIZE, its ratio)
    for any target: a 2000 x 1000 reference for a 512 x 512 sample was 736 x 352 (the target's area), the
    pipeline encodes it at 1440 x 736. Training (control_bucket without a resolution) keeps the target bucket's area."""
    from library.models.qwen_image.edit_family import QwenImageEditFamily

    family = QwenImageEditFamily("unused.safetensors", model_version=EDIT_2509)
    for size in IMAGE_SIZES + [(2000, 1000)]:
        w, h = plus_pipe.calculate_dimensions(plus_pipe.VAE_IMAGE_SIZE, size[0] / size[1])
        assert family.sample_control_bucket(bucket, size) == (w, h)
        assert family.control_bucket(bucket, size) == area_size(*size, bucket[0] * bucket[1])
    assert family.control_bucket((1024, 1024), (2000, 1000)) == family.sample_control_bucket((512, 512), (2000, 1000))


def test_edit_sizes_refuse_bad_input():
    with pytest.raises(ValueError, match="one condition image"):
        edit_sizes(EDIT, [(512, 512), (512, 512)])
    with pytest.raises(ValueError, match="expected one of"):
        edit_sizes("qwen-image-edit-2600", [(512, 512)])
    with pytest.raises(ValueError, match="at least one"):
        edit_sizes(EDIT_2509, [])


def test_resize_condition_matches_pipeline_image_processor():
    import numpy as np
    from diffusers.image_processor import VaeImageProcessor
    from PIL import Image

    from library.models.qwen_image.edit import resize_condition

    img = Image.fromarray(np.random.RandomState(0).randint(0, 256, (61, 97, 3), dtype=np.uint8))
    w, h = edit_sizes(EDIT_2509, [img.size]).encoder[0]
    expected = VaeImageProcessor(vae_scale_factor=16).resize(img, h, w)  # the Plus pipeline's condition image
    assert np.array_equal(np.asarray(resize_condition(img, (w, h))), np.asarray(expected))


# ----------------------------------------------------------------------------------------------
# The family adapter


def test_family_version_from_config_or_model_version(tmp_path):
    from library.models.qwen_image.edit_family import QwenImageEditFamily

    for version in (EDIT, EDIT_2511):
        save_reference(version, tmp_path / version)
    assert QwenImageEditFamily(str(tmp_path / EDIT_2511)).version == EDIT_2511
    assert QwenImageEditFamily(str(tmp_path / EDIT)).version == EDIT_2509  # Edit and 2509 share a config
    assert QwenImageEditFamily(str(tmp_path / EDIT), model_version=EDIT).version == EDIT
    with pytest.raises(ValueError, match="zero_cond_t=False but model_version qwen-image-edit-2511"):
        QwenImageEditFamily(str(tmp_path / EDIT), model_version=EDIT_2511).version


def test_family_single_file_takes_flags_from_model_version(tmp_path):
    """A ComfyUI-style single file (no config.json): shapes give the config, model_version the flags."""
    from library.io import save_safetensors
    from library.models.qwen_image.edit_family import QwenImageEditFamily
    from library.models.qwen_image.model import QwenImage

    config = QwenImageConfig(num_layers=1, attention_head_dim=128, num_attention_heads=1, joint_attention_dim=32,
                             zero_cond_t=True)  # head dim 128: the RoPE axes are inferable from shapes
    weights = QwenImage(config).state_dict()
    file = tmp_path / "qwen_image_edit_2511.safetensors"
    save_safetensors({"model.diffusion_model." + k: v for k, v in weights.items()}, str(file))
    with pytest.raises(ValueError, match="set model_version"):
        QwenImageEditFamily(str(file)).version
    model = QwenImageEditFamily(str(file), model_version=EDIT_2511).load_transformer(torch.float32)
    assert model.config == config
    assert not QwenImageEditFamily(str(file), model_version=EDIT_2509).load_transformer(torch.float32).config.zero_cond_t


def test_family_predict_matches_pipeline_call(tmp_path):
    """predict(control=[...]) = the transformer on [target, conditions] with img_shapes listing
    all, the output cut to the target's tokens, as QwenImageEditPlusPipeline does."""
    from library.models.qwen_image.edit_family import QwenImageEditFamily
    from library.models.latents import pack_latents

    ref = save_reference(EDIT_2511, tmp_path)
    family = QwenImageEditFamily(str(tmp_path))
    model = family.load_transformer(torch.float32)
    g = torch.Generator().manual_seed(9)
    x_t = torch.randn(1, 6 * 8, 64, generator=g)  # target 6 x 8 patches
    conditions = [torch.randn(1, 16, 8, 12, generator=g), torch.randn(1, 16, 10, 6, generator=g)]
    text = {"embeds": torch.randn(1, TEXT, 32, generator=g), "mask": torch.ones(1, TEXT, dtype=torch.bool)}
    sigma = torch.tensor([0.4])
    with torch.no_grad():
        got = family.predict(model, x_t, sigma, text, 6, 8, None, control=conditions)
        expected = ref(hidden_states=torch.cat([x_t, *map(pack_latents, conditions)], 1), timestep=sigma, guidance=None,
                       encoder_hidden_states=text["embeds"], encoder_hidden_states_mask=text["mask"].long(),
                       img_shapes=[[(1, 6, 8), (1, 4, 6), (1, 5, 3)]], return_dict=False)[0][:, :48]
    assert got.shape == (1, 48, 64) and (got - expected).abs().max().item() <= 1e-5
    with pytest.raises(ValueError, match="condition images' latents"):
        family.predict(model, x_t, sigma, text, 6, 8, None)


QWEN_SCHEDULER = dict(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=8192, max_shift=0.9, shift=1.0,
                      shift_terminal=0.02, time_shift_type="exponential", use_dynamic_shifting=True)  # Qwen-Image's


@pytest.mark.parametrize("name", ["qwen_image", "qwen_image_edit_2511"])
def test_sampling_matches_qwen_image_and_edit_plus_pipelines(tiny_set, tmp_path, monkeypatch, name):
    """sample_latents (true CFG 4 with the norm rescale, shift_terminal 0.02, 3 steps, 64 x 48) equals
    QwenImagePipeline.__call__ on the same weights, seed and embeddings; Edit-2511's with a 64 x 64
    reference (fitted by our sample_control_bucket, encoded by our VAE) equals
    QwenImageEditPlusPipeline.__call__(image=...) with the VAE area (1024^2) set to 128^2 in both (CPU
    seconds): the reference is encoded at 128 x 128 whatever the 64 x 48 target (at the target's area it was
    64 x 64 before)."""
    import numpy as np
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageEditPlusPipeline, QwenImagePipeline
    from PIL import Image

    from library.data.controls import reference_images
    from library.models.family import family_class

    width, height, steps, seed, guidance = 64, 48, 3, 7, 4.0
    family = family_class("qwen_image_edit" if name != "qwen_image" else "qwen_image")(tiny_set[name], tiny_set["qwen_image_vae"])
    model = family.load_transformer(torch.float32)
    reference = QwenImageTransformer2DModel.from_pretrained(tiny_set[name]).eval()
    g = torch.Generator().manual_seed(1)
    dim = reference.config.joint_attention_dim
    text = {"embeds": torch.randn(1, 9, dim, generator=g), "mask": torch.ones(1, 9, dtype=torch.long)}
    negative = {"embeds": torch.randn(1, 5, dim, generator=g), "mask": torch.ones(1, 5, dtype=torch.long)}
    call = dict(prompt_embeds=text["embeds"], prompt_embeds_mask=text["mask"], negative_prompt_embeds=negative["embeds"],
                negative_prompt_embeds_mask=negative["mask"], height=height, width=width, num_inference_steps=steps,
                true_cfg_scale=guidance, generator=torch.Generator().manual_seed(seed), output_type="latent")
    scheduler, control = FlowMatchEulerDiscreteScheduler(**QWEN_SCHEDULER), None
    if name == "qwen_image":
        pipe = QwenImagePipeline(scheduler=scheduler, vae=None, text_encoder=None, tokenizer=None, transformer=reference)
    else:
        from library.models.qwen_image import edit

        monkeypatch.setattr(plus_pipe, "VAE_IMAGE_SIZE", 128 * 128)
        monkeypatch.setattr(edit, "VAE_IMAGE_AREA", 128 * 128)
        image = Image.fromarray((np.random.default_rng(0).random((64, 64, 3)) * 255).astype(np.uint8))
        image.save(tmp_path / "reference.png")
        vae = family.load_vae(torch.float32)
        control = [vae.encode(r) for r in reference_images([str(tmp_path / "reference.png")], family.sample_control_bucket,
                                                           width, height)]
        assert control[0].shape[-2:] == (16, 16)  # 128 x 128 px, as the pipeline encodes it
        pipe = QwenImageEditPlusPipeline(scheduler=scheduler, vae=AutoencoderKLQwenImage.from_pretrained(tiny_set["qwen_image_vae"]).eval(),
                                         text_encoder=None, tokenizer=None, processor=None, transformer=reference)
        call["image"] = image
    ours = family.pack_target(family.sample_latents(model, text, width, height, steps, seed, guidance, negative, control=control))
    with torch.no_grad():
        theirs = pipe(**call).images
    relative = ((ours - theirs).norm() / theirs.norm()).item()
    print(f"{name} sampling vs its pipeline: relative {relative:.3g}")
    assert relative <= 1e-5


def test_sample_references_are_stretched_as_the_pipelines_resize_them(tmp_path):
    """Old: a reference was covered and centre-cropped to the pipeline's size (up to ~9 px off at 1000 x 700,
    mean |diff| 0.14 in [-1, 1]) while the VL encoder saw it whole: QwenImageEditPlusPipeline and
    QwenImage21Pipeline stretch it (VaeImageProcessor.resize, Lanczos); ComfyUI's node does too."""
    import numpy as np
    from PIL import Image
    from diffusers.image_processor import VaeImageProcessor

    from library.data.controls import reference_images
    from library.models.qwen_image.edit_family import QwenImageEditFamily
    from library.models.qwen_image21.family import QwenImage21Family

    rng = np.random.default_rng(0)
    image = Image.fromarray((rng.random((70, 100, 3)) * 255).astype(np.uint8)).resize((1000, 700), Image.BICUBIC)
    path = tmp_path / "ref.png"
    image.save(path)
    processor = VaeImageProcessor(vae_scale_factor=16)
    for family in (QwenImageEditFamily("unused.safetensors", model_version="qwen-image-edit-2511"),
                   QwenImage21Family("unused.safetensors")):
        assert family.stretches_references
        ours = reference_images([str(path)], family.sample_control_bucket, 1024, 1024, family.stretches_references)[0][0]
        h, w = ours.shape[1:]
        assert (w, h) != (1000, 700) and abs(w / h - 1000 / 700) > 1e-3  # the size's ratio is not the image's: a crop differed
        theirs = processor.preprocess(processor.resize(image, h, w), h, w)[0]
        assert float((ours - theirs).abs().max()) < 1e-5, family.name


@pytest.mark.parametrize("resolution", [1024, 512])
def test_training_reference_is_encoded_at_the_resolutions_area_whatever_the_bucket(tmp_path, resolution):
    """A scanned training reference is sized at the dataset resolution's area with its own ratio: at 1024 the Plus
    pipeline's calculate_dimensions(1024 * 1024, ratio) for any target bucket, at 512 the same rule at 512^2.
    Old: the target bucket's area, under 1024^2 for a non-square bucket: a 1920 x 1080 reference in a 1344 x 768
    bucket was encoded at 1344 x 768, the pipeline's 1376 x 768."""
    from PIL import Image

    from library.data.dataset_config import load_dataset_config
    from library.data.image_folders import scan_images
    from library.models.qwen_image.edit_family import QwenImageEditFamily

    targets, references = tmp_path / "targets", tmp_path / "references"
    targets.mkdir(), references.mkdir()
    sizes = [(1920, 1080), (4032, 3024), (3024, 4032), (1500, 1000), (1216, 832)]
    for i, size in enumerate(sizes):  # each target in the bucket of its reference's ratio
        Image.new("RGB", size).save(targets / f"{i}.png")
        Image.new("RGB", size).save(references / f"{i}.png")
        (targets / f"{i}.txt").write_text("edit")
    config = tmp_path / "dataset.toml"
    config.write_text(f"[general]\nresolution = {resolution}\nenable_bucket = true\nmin_bucket_reso = 256\n"
                      f"max_bucket_reso = 2048\nbucket_reso_steps = 64\ncaption_extension = \".txt\"\n\n"
                      f"[[datasets]]\n  [[datasets.subsets]]\n  image_dir = \"{targets}\"\n"
                      f"  control_directory = \"{references}\"\n")
    family = QwenImageEditFamily("unused.safetensors", model_version=EDIT_2509)
    items = scan_images(load_dataset_config(str(config)), control_bucket=family.control_bucket)
    encoded = {item.size: (item.bucket, item.control_buckets[0]) for item in items}
    assert any(b[0] * b[1] < resolution ** 2 for b, _ in encoded.values())  # non-square buckets of a smaller area
    for w, h in sizes:
        assert encoded[(w, h)][1] == tuple(plus_pipe.calculate_dimensions(resolution * resolution, w / h)), (w, h)
