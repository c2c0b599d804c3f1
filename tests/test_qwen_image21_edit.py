"""Qwen-Image-2.1 with reference images (its edit use, one model with text-to-image): the family's text
encoder puts the references' vision tokens in the prompt and their latents take those slots in the
transformer; sampling with a reference equals QwenImage21Pipeline.__call__(image=[...]); training on paired
data (control_directory) runs from the defaults and samples with --ci."""

import os

import numpy as np
import pytest
import torch
from PIL import Image

import train_lora
from library.models.family import stack_text
from library.models.qwen_image21.family import QwenImage21Family, reference_size
from tools.make_tiny_dataset import make_tiny_edit_dataset
from tests.test_train_lora import sample_png

RESOLUTION = 64  # reference_resolution (the pipeline's output_resolution): 64 x 64 references, 4 slots each


@pytest.fixture(scope="module")
def edit_set(tiny_set, tmp_path_factory):
    return {**tiny_set, **make_tiny_edit_dataset(str(tmp_path_factory.mktemp("qi21_edit")), count=6, size=64)}


def family_of(tiny_set):
    return QwenImage21Family(tiny_set["qwen_image21"], tiny_set["qwen_image21_vae"], reference_resolution=RESOLUTION,
                             text_encoder=tiny_set["qwen_image21_text_encoder"])


def test_reference_size_is_the_pipelines_calculate_dimensions():
    from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import calculate_dimensions

    for w, h in ((640, 480), (1000, 1500), (64, 64), (333, 777)):
        expected = calculate_dimensions(1024 * 1024, w / h)[:2]
        assert reference_size(w, h) == expected, (w, h)


@torch.no_grad()
def test_sampling_with_a_reference_equals_the_pipeline(tiny_set):
    """One 64 x 64 reference, true CFG 4 (the negative prompt encoded with the reference too), 3 steps."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImage21Transformer2DModel, AutoencoderKLQwenImage21

    from library.models.latents import to_tokens
    from tests.test_qwen_image21_text import pipeline

    rng = np.random.default_rng(1)
    image = Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8))
    family = family_of(tiny_set)
    encode = family.load_text_encoder("fp32")
    text, negative = (stack_text(encode([p], [[image]])) for p in ("make the shape red", ""))
    assert int(text["slots"].sum()) == 4  # (64 / 32)^2 merged vision tokens
    pixels = torch.from_numpy(np.array(image)).permute(2, 0, 1)[None].float() / 255 * 2 - 1
    reference = family.load_vae().encode(pixels)  # [1, 64, 4, 4]
    model = family.load_transformer(torch.float32)
    ours = family.sample_latents(model, text, 64, 64, 3, 5, 4.0, negative_text=negative, control=[reference])

    pipe = pipeline({"qwen_image21_text_encoder": tiny_set["qwen_image21_text_encoder"],
                     "qwen_image21_processor": os.path.join(os.path.dirname(tiny_set["qwen_image21"]), "processor")},
                    vae=AutoencoderKLQwenImage21.from_pretrained(tiny_set["qwen_image21_vae"]).eval(),
                    transformer=QwenImage21Transformer2DModel.from_pretrained(tiny_set["qwen_image21"]).eval(),
                    scheduler=FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True))
    theirs = pipe(prompt="make the shape red", negative_prompt="", image=[image], true_cfg_scale=4.0, height=64,
                  width=64, num_inference_steps=3, generator=torch.Generator().manual_seed(5), output_type="latent",
                  output_resolution=RESOLUTION).images
    rel = ((to_tokens(ours) - theirs).norm() / theirs.norm()).item()
    print(f"Qwen-Image-2.1 sampling with a reference vs QwenImage21Pipeline: relative error {rel:.2e}")
    assert rel < 1e-5


def test_a_step_with_references_is_planned_at_the_references_size(tiny_set, monkeypatch):
    """The memory plan of a step with a reference on meta: its prompt's slots are the planner's (text_on_meta
    gives none: KeyError 'slots' stopped plan_memory --references and a CUDA run's settle_keeping_keys), and the
    reference's latents are at reference_resolution^2 (the pipeline resizes it so at any target size), not at the
    128 px target's size."""
    from library.data.image_folders import LargestStep
    from library.training.memory_plan import step_plan
    from tools import plan_memory

    family, args = family_of(tiny_set), plan_memory.default_args("qwen_image21")
    seen, real = [], QwenImage21Family.predict

    def recording(self, model, x_t, sigmas, text, h, w, guidance, control=None):
        seen.append([tuple(c.shape) for c in control or []])
        return real(self, model, x_t, sigmas, text, h, w, guidance, control=control)

    monkeypatch.setattr(QwenImage21Family, "predict", recording)
    assert step_plan(family, args, LargestStep(128, 128, 2, 1)).activations > 0
    assert seen == [[(2, 64, 4, 4)]], seen  # 64 px / the 16x VAE


def test_a_run_on_a_card_plans_its_references_before_caching(edit_set, tmp_path, planned_on_a_card):
    """train_lora on a CUDA card (its size answered on the CPU) plans the keeping keys with the step's reference:
    the plan stopped it before caching (KeyError 'slots') where gradient checkpointing left them unset."""
    planned = planned_on_a_card  # each step train_lora plans: (references, the largest one's size, layers)
    out = tmp_path / "run"
    args = ["--model_type", "qwen_image21", "--pretrained_model_name_or_path", edit_set["qwen_image21"],
            "--ae", edit_set["qwen_image21_vae"], "--text_encoder", edit_set["qwen_image21_text_encoder"],
            "--reference_resolution", str(RESOLUTION), "--dataset_config", edit_set["edit_dataset_config"],
            "--output_dir", str(out), "--output_name", "edit", "--max_train_steps", "1", "--mixed_precision", "no",
            "--network_dim", "4", "--network_alpha", "4", "--optimizer_type", "AdamW",
            "--gradient_checkpointing", "true"]
    assert train_lora.main(args) == 0
    assert planned and set(planned) == {(1, (64, 64), None)}, planned


def test_trains_on_paired_data_and_samples_with_a_reference(edit_set, tmp_path):
    out = tmp_path / "run"
    args = ["--model_type", "qwen_image21", "--pretrained_model_name_or_path", edit_set["qwen_image21"],
            "--ae", edit_set["qwen_image21_vae"], "--text_encoder", edit_set["qwen_image21_text_encoder"],
            "--reference_resolution", str(RESOLUTION), "--dataset_config", edit_set["edit_dataset_config"],
            "--sample_prompts", edit_set["edit_sample_prompts"], "--output_dir", str(out), "--output_name", "edit",
            "--max_train_steps", "2", "--mixed_precision", "no", "--network_dim", "4", "--network_alpha", "4",
            "--optimizer_type", "AdamW", "--learning_rate", "3e-3", "--save_every_n_steps", "0"]
    assert train_lora.main(args) == 0
    assert (out / "edit.safetensors").stat().st_size > 0 and sample_png(out, "edit", "final").stat().st_size > 0


def test_a_reference_resolution_its_image_processor_resizes_again_is_refused_before_caching(edit_set, tmp_path,
                                                                                               capsys):
    """Old: a reference_resolution whose square lies outside the image processor's pixels (the tiny one's 32^2 to
    256^2; Qwen3-VL's 256^2 to 4096^2) cached every latent and caption, then stopped at the first step in the
    model's words ("128 image slots hold 512 latent tokens ..."), naming no key; the default 1024 did on the tiny
    models. Refused before caching now, the range named; generate.py's --ci the same way."""
    line = ("error: key 'reference_resolution' = {side}: a reference resized to {px} x {px} pixels lies outside the "
            "1024-65536 pixels the text encoder's image processor takes (")
    for side, px in ((1024, 1024), (300, 288)):
        args = ["--model_type", "qwen_image21", "--pretrained_model_name_or_path", edit_set["qwen_image21"],
                "--ae", edit_set["qwen_image21_vae"], "--text_encoder", edit_set["qwen_image21_text_encoder"],
                "--reference_resolution", str(side), "--dataset_config", edit_set["edit_dataset_config"],
                "--output_dir", str(tmp_path / "run"), "--max_train_steps", "1", "--mixed_precision", "no",
                "--network_dim", "4", "--optimizer_type", "AdamW"]
        assert train_lora.main(args) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(line.format(side=side, px=px)), err
        assert err.endswith("give a reference_resolution from 32 to 256") and "\n" not in err, err
        assert not os.path.exists(tmp_path / "run" / "cache")  # nothing cached


@torch.no_grad()
def test_references_reach_the_vae_with_their_alpha_in_samples_and_training(tiny_set, tmp_path):
    """QwenImage21Pipeline converts every condition image to RGBA and its VAE reads all four channels (only the
    vision tower's copy is white-backed). A transparent cut-out reference is encoded so from a sample's --ci and
    into the training cache (control_directory), in a cache entry of its own (the RGB-loaded one's is not reused).
    Old: loaded as RGB (alpha +1), 0.106 relative off the pipeline's latents."""
    from diffusers.image_processor import VaeImageProcessor

    from library.data.caches import cache_latents, latent_entry, read_cache
    from library.data.dataset_config import load_dataset_config
    from library.data.image_folders import scan_images

    data = make_tiny_edit_dataset(str(tmp_path), count=1, size=64)
    reference = os.path.join(data["edit_control_dir"], "000.png")
    pixels = np.zeros((64, 64, 4), np.uint8)
    pixels[:, :32] = (10, 200, 10, 255)  # the right half: a transparent cut-out, its hidden colour black
    Image.fromarray(pixels, "RGBA").save(reference)
    family, processor = family_of(tiny_set), VaeImageProcessor(vae_scale_factor=16, vae_latent_channels=64)
    vae = family.load_vae()
    with Image.open(reference) as image:  # the pipeline's VAE input
        theirs = processor.preprocess(image.convert("RGBA"), width=64, height=64).float()
    expected = vae.encode(theirs)

    _, _, (sample,) = family.sample_references([reference], 64, 64)
    assert sample.shape == (1, 4, 64, 64) and (sample - theirs).abs().max().item() <= 1e-6

    blueprint = load_dataset_config(data["edit_dataset_config"])
    (item,) = scan_images(blueprint, control_bucket=family.control_bucket, stretch_controls=family.stretches_references,
                          control_mode=family.reference_mode)  # as training scans
    (rgb_item,) = scan_images(blueprint, control_bucket=family.control_bucket, stretch_controls=True)
    assert latent_entry(item) != latent_entry(rgb_item)
    assert cache_latents([item], vae.encode, "qi21", to_disk=False) == 1
    cached = read_cache(item.latent_cache)["control_0"].float()
    rel = ((cached - expected[0]).norm() / expected.norm()).item()
    assert rel < 1e-2, rel  # bf16 rounding of the cache (the RGB load: 0.106)
