"""Krea 2 edit prompts with reference images (library/models/krea2/edit_encoder.py) against what ai-toolkit
computes (its encode_krea_prompt with images): transformers' Qwen3VLForConditionalGeneration called with the
processor's input_ids + the suffix, pixel_values, image_grid_thw and mm_token_type_ids, output_hidden_states,
the taps stacked and the 34 prefix tokens dropped, on a tiny Qwen3-VL with a vision tower and deepstack."""

import pytest
import torch
from PIL import Image

from library.models.krea2.edit_encoder import edit_prompt, vlm_size, with_vision
from library.models.krea2.text_encoder import KREA2_DROP_TOKENS, load_krea2_text_encoder
from library.models.krea2.tiny import TEXT_TAPS, write_krea2_edit_text_encoder


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_krea2_edit_text_encoder(str(tmp_path_factory.mktemp("k2e_text")), 0)["krea2_edit_text_encoder"]


@pytest.fixture(scope="module")
def encoder(folder):
    return with_vision(load_krea2_text_encoder(folder, taps=TEXT_TAPS), folder)


def pictures():
    g = torch.Generator().manual_seed(0)
    a = Image.fromarray((torch.rand(64, 96, 3, generator=g) * 255).to(torch.uint8).numpy())
    b = Image.fromarray((torch.rand(48, 48, 3, generator=g) * 255).to(torch.uint8).numpy())
    return [a, b]


def aitoolkit_states(folder, inputs):
    """ai-toolkit's call: qwen(input_ids, attention_mask, output_hidden_states=True, **vision inputs) with
    mm_token_type_ids zero over the appended suffix; hidden_states[taps] stacked, the prefix dropped."""
    from transformers import Qwen3VLForConditionalGeneration

    model = Qwen3VLForConditionalGeneration.from_pretrained(folder, torch_dtype=torch.float32).eval()
    ids = inputs["input_ids"]
    types = torch.cat((inputs["mm_token_type_ids"], torch.zeros(1, ids.shape[1] - inputs["mm_token_type_ids"].shape[1],
                                                                 dtype=torch.long)), dim=1)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True,
                    pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"], mm_token_type_ids=types)
    return torch.stack([out.hidden_states[i] for i in TEXT_TAPS], dim=2)[0, KREA2_DROP_TOKENS:]


def test_vlm_size_is_aitoolkits():
    assert vlm_size(1024, 1024) == (384, 384)
    assert vlm_size(2048, 1024) == (543, 272)  # sqrt(384^2 / 2^21) = 0.2652: 543.1, 271.5 -> round half even 272
    assert vlm_size(200, 100) == (200, 100)  # never upscaled
    assert vlm_size(4000, 20) == (4000, 28)  # a side at least 28 (80,000 pixels: not scaled)
    assert edit_prompt("x", 2).endswith("Picture 1: <|vision_start|><|image_pad|><|vision_end|>Picture 2: "
                                        "<|vision_start|><|image_pad|><|vision_end|>x")


def test_prompt_with_references_matches_transformers(folder, encoder):
    images = pictures()
    ours = encoder.encode_one("make the shape red", images)
    theirs = aitoolkit_states(folder, encoder.vl_inputs("make the shape red", images))
    assert ours.shape == theirs.shape and ours.shape[1] == len(TEXT_TAPS)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    inputs = encoder.vl_inputs("x", images)
    image_tokens = int((inputs["input_ids"] == encoder.image_token_id).sum())
    assert image_tokens == int(inputs["image_grid_thw"].prod(-1).sum()) // 4 > 0  # merged 2 x 2 patches


def test_batch_with_and_without_references(encoder):
    images = pictures()
    embeds, mask = encoder.encode_with_images(["make the shape red", "a cat"], [images[:1], []])
    alone = encoder.encode_one("make the shape red", images[:1])
    text, text_mask = encoder.encode(["a cat"])
    n = int(mask[0].sum())
    assert n == alone.shape[0] and torch.equal(embeds[0, :n], alone)
    m = int(text_mask[0].sum())
    assert int(mask[1].sum()) == m and torch.equal(embeds[1, :m], text[0, :m])
    assert (alone[: m] - text[0, :m]).abs().max() > 1e-4  # the references change the conditioning


@pytest.mark.parametrize("constant, value", [("IMAGE_SLOT", "Image {}: <|vision_start|><|image_pad|><|vision_end|>"),
                                             ("VLM_AREA", 512 * 512), ("VLM_MIN_SIDE", 32)])
def test_how_references_are_shown_to_the_encoder_is_in_the_text_cache_key(monkeypatch, constant, value):
    """The edit prompt's image slots and the references' pixel budget shape the cached text; the old
    key held only the base family's constants, so a change there kept the stale encodings."""
    from library.models.krea2 import edit_encoder as ee
    from library.models.krea2.edit_family import Krea2EditFamily

    family = Krea2EditFamily("m.safetensors", "ae.safetensors", text_encoder="te")
    key = family.text_cache_key({}, "bf16")
    monkeypatch.setattr(ee, constant, value)
    assert family.text_cache_key({}, "bf16") != key


def test_the_token_warning_is_only_for_captions_encoded_without_references(folder, encoder, tmp_path):
    """Krea 2 edit inherited Krea 2's limit (541 with the prefix, 512 kept): the check and training warned
    "the rest is cut" for a long caption that the edit encoder keeps whole with its reference. Only the
    text-only encoding (an image without references) cuts it."""
    from library.data import check
    from library.data.dataset_config import load_dataset_config
    from library.data.image_folders import scan_images
    from library.models.krea2.edit_family import Krea2EditFamily
    from tests.test_dataset import make_image

    caption = " ".join(f"w{i % 7}" for i in range(400))
    for name, colour in (("paired", (200, 30, 30)), ("alone", (30, 200, 30))):
        make_image(tmp_path / name / f"{name}.png", 64, 64, colour)
        (tmp_path / name / f"{name}.txt").write_text(caption)
    make_image(tmp_path / "refs" / "paired.png", 64, 64, (30, 30, 200))
    toml = tmp_path / "dataset.toml"
    toml.write_text(f'[general]\nresolution = 64\n[[datasets]]\n[[datasets.subsets]]\nimage_dir = "{tmp_path / "paired"}"\n'
                    f'control_directory = "{tmp_path / "refs"}"\n[[datasets.subsets]]\nimage_dir = "{tmp_path / "alone"}"\n')
    limit = Krea2EditFamily("unused", text_encoder=folder).caption_token_limit(None)
    cut = (f"{tmp_path / 'alone' / 'alone.txt'}: caption is {limit.count(caption)} Qwen3-VL tokens; the encoder "
           f"keeps 541, the rest is cut")
    blueprint = load_dataset_config(str(toml))
    assert [(p.severity, p.message) for p in check.check_dataset(blueprint, limit).problems()] == [("warning", cut)]
    assert [p.message for p in check.training_warnings(scan_images(blueprint), [], limit)] == [cut]
    _, with_reference = encoder.encode_with_images([caption], [pictures()[:1]])
    _, text_only = encoder.encode([caption])
    assert int(with_reference.sum()) > limit.count(caption) - KREA2_DROP_TOKENS and int(text_only.sum()) == 512
