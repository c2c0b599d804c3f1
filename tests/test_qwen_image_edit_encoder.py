"""The Qwen-Image-Edit text encoder (prompt + condition images through Qwen2.5-VL: transformers'
vision tower and image processor, our LLM core with M-RoPE) against diffusers' edit pipelines'
`_get_qwen_prompt_embeds` on a tiny Qwen2_5_VLForConditionalGeneration saved in the HF format.

The reference forwards the processor's mm_token_type_ids to the text encoder (diffusers PR #14189):
without them transformers 5 gives image tokens 1-D positions (diffusers issue #14194).
"""

import numpy as np
import pytest
import torch
from diffusers import QwenImageEditPipeline, QwenImageEditPlusPipeline
from PIL import Image
from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor

from library.models.qwen_image.edit import EDIT, EDIT_2509, EDIT_2511
from library.models.qwen_image.edit_encoder import (
    EDIT_DROP_TOKENS,
    expand_image_tokens,
    load_qwen_image_edit_text_encoder,
    mrope_position_ids,
)
from tests.test_qwen_image import randomize_
from tests.test_vlm_inputs import processor_without_video
from library.models.qwen_image.tiny import write_qwen_vl_text_encoder


def image(width: int, height: int, seed: int) -> Image.Image:
    pixels = np.random.RandomState(seed).randint(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny edit text encoder as make_tiny_models writes it, its weights randomized (O(1)
    activations), saved back in place; plus the transformers model and processor."""
    out = tmp_path_factory.mktemp("tiny")
    paths = write_qwen_vl_text_encoder(str(out), 0)
    folder, processor_folder = paths["qwen_image_edit_text_encoder"], paths["qwen_image_edit_processor"]
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(folder)
    randomize_(hf, torch.Generator().manual_seed(3))
    hf.save_pretrained(folder)
    hf.eval()
    return out / "qwen_image_edit", hf, processor_folder


@pytest.fixture(scope="module")
def hf_processor(tiny):
    """transformers' Qwen2_5_VLProcessor (its text and image parts: the video part needs torchvision)."""
    _, _, folder = tiny
    return processor_without_video(Qwen2_5_VLProcessor, folder)


class ForwardTokenTypes(torch.nn.Module):
    """The text encoder as diffusers PR #14189 calls it: with mm_token_type_ids (1 = image token)."""

    def __init__(self, model):
        super().__init__()
        self.model, self.dtype = model, model.dtype

    def forward(self, input_ids, **kwargs):
        types = (input_ids == self.model.config.image_token_id).int()
        return self.model(input_ids=input_ids, mm_token_type_ids=types, **kwargs)


def diffusers_embeds(pipeline_class, text_encoder, processor, prompt, images):
    """pipeline_class._get_qwen_prompt_embeds on a pipeline holding only the text encoder and processor."""
    pipe = pipeline_class.__new__(pipeline_class)
    pipeline_class.__init__(pipe, None, None, None, None, None, None)  # sets the templates and drop index
    for name, value in (("text_encoder", text_encoder), ("processor", processor)):
        object.__setattr__(pipe, name, value)
    with torch.no_grad():
        return pipe._get_qwen_prompt_embeds(prompt, images, device=torch.device("cpu"), dtype=torch.float32)


def test_edit_template_constants_match_diffusers():
    pipe = QwenImageEditPipeline.__new__(QwenImageEditPipeline)
    QwenImageEditPipeline.__init__(pipe, None, None, None, None, None, None)
    plus = QwenImageEditPlusPipeline.__new__(QwenImageEditPlusPipeline)
    QwenImageEditPlusPipeline.__init__(plus, None, None, None, None, None, None)
    from library.models.qwen_image import edit_encoder as te

    assert te.EDIT_PROMPT_TEMPLATE == pipe.prompt_template_encode
    assert te.EDIT_PLUS_PROMPT_TEMPLATE == plus.prompt_template_encode
    assert EDIT_DROP_TOKENS == pipe.prompt_template_encode_start_idx == plus.prompt_template_encode_start_idx


def test_tiny_tokenizer_drops_exactly_the_system_prompt(tiny):
    """As with the real Qwen2.5-VL tokenizer, the template's system part + '<|im_start|>user\\n' is 64 tokens."""
    _, _, folder = tiny
    from library.models.qwen_image.edit_encoder import EDIT_PLUS_PROMPT_TEMPLATE

    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert len(tokenizer(EDIT_PLUS_PROMPT_TEMPLATE.split("{}")[0]).input_ids) == EDIT_DROP_TOKENS


def test_edit_encoder_matches_diffusers_edit_pipeline(tiny, hf_processor):
    """Qwen-Image-Edit: one image per prompt inline in the template. Our batch of two prompts (padded
    to the longer) against the pipeline's one-prompt calls."""
    root, hf, _ = tiny
    ours = load_qwen_image_edit_text_encoder(str(root), EDIT)
    prompts, images = ["make the cat blue", "a dog on a red chair, in the style of an oil painting"], [image(84, 56, 1), image(56, 112, 2)]
    embeds, mask = ours.encode(prompts, [[img] for img in images])
    for i, (prompt, img) in enumerate(zip(prompts, images)):
        expected, expected_mask = diffusers_embeds(QwenImageEditPipeline, ForwardTokenTypes(hf), hf_processor, prompt, img)
        n = expected.shape[1]
        assert int(mask[i].sum()) == n and bool(expected_mask.all())
        error = (embeds[i, :n] - expected[0]).abs().max().item()
        print(f"edit prompt {i}: {n} tokens, max |ours - diffusers| = {error:.2e}")
        assert error <= 1e-5 and not embeds[i, n:].any()


@pytest.mark.parametrize("version", [EDIT_2509, EDIT_2511])
def test_edit_plus_encoder_matches_diffusers_plus_pipeline(tiny, hf_processor, version):
    """Edit-2509 / 2511: 'Picture i: ...' per condition image (two, of different sizes) before the prompt."""
    root, hf, _ = tiny
    ours = load_qwen_image_edit_text_encoder(str(root), version)
    images = [image(84, 56, 3), image(56, 56, 4)]
    expected, _ = diffusers_embeds(QwenImageEditPlusPipeline, ForwardTokenTypes(hf), hf_processor, ["put both in one room"], images)
    embeds, mask = ours.encode(["put both in one room"], [images])
    error = (embeds - expected).abs().max().item()
    print(f"{version}: {expected.shape[1]} tokens, max |ours - diffusers| = {error:.2e}")
    assert embeds.shape == expected.shape and bool(mask.all()) and error <= 1e-5


def test_image_tokens_need_3d_positions(tiny, hf_processor):
    """The diffusers call without mm_token_type_ids (1-D positions) differs: M-RoPE is in effect."""
    root, hf, _ = tiny
    images = [image(84, 56, 3), image(56, 56, 4)]
    plain, _ = diffusers_embeds(QwenImageEditPlusPipeline, hf, hf_processor, ["put both in one room"], images)
    embeds, _ = load_qwen_image_edit_text_encoder(str(root), EDIT_2509).encode(["put both in one room"], [images])
    assert (embeds - plain).abs().max().item() > 1e-3


def test_positions_and_token_expansion_match_transformers(tiny, hf_processor):
    """Our expansion + tokenization equal Qwen2_5_VLProcessor's; our ids equal get_rope_index's,
    with padding and two images in one row."""
    root, hf, _ = tiny
    ours = load_qwen_image_edit_text_encoder(str(root), EDIT_2509)
    texts = ["Picture 1: <|vision_start|><|image_pad|><|vision_end|>hi",
             "a <|vision_start|><|image_pad|><|vision_end|> and <|vision_start|><|image_pad|><|vision_end|> end"]
    images = [[image(56, 84, 5)], [image(112, 56, 6), image(56, 56, 7)]]
    ids, mask, pixels, grid = ours._inputs(texts, images)
    ref = hf_processor(text=texts, images=[i for s in images for i in s], padding=True, return_tensors="pt")
    assert torch.equal(ids, ref["input_ids"]) and torch.equal(mask, ref["attention_mask"])
    assert torch.equal(grid, ref["image_grid_thw"]) and torch.equal(pixels, ref["pixel_values"])
    expected, _ = hf.model.get_rope_index(ids, mm_token_type_ids=ref["mm_token_type_ids"], image_grid_thw=grid,
                                          attention_mask=mask)  # [3, B, L]
    got = mrope_position_ids(ids, mask, grid, ours.image_token_id, ours.merge_size)
    assert got.dtype == torch.int64 and torch.equal(got.permute(2, 0, 1), expected)


def test_image_token_count_mismatch_is_one_clear_error():
    with pytest.raises(ValueError, match="2 <\\|image_pad\\|> tokens in the prompt but 1 images"):
        expand_image_tokens("<|image_pad|><|image_pad|>", [4])
    with pytest.raises(ValueError, match="do not match image_grid_thw"):
        mrope_position_ids(torch.tensor([[1, 9, 9, 2]]), None, torch.tensor([[1, 4, 4]]), 9, 2)  # 4 tokens expected


def test_family_text_encoder_sizes_images_as_the_plus_pipeline(tiny):
    """The family's encode takes images at any size and resizes each to the version's VL size
    (384^2 area for 2509/2511) before the encoder: the same as encoding pre-sized images."""
    from library.models.qwen_image.edit import edit_sizes, resize_condition
    from library.models.qwen_image.edit_family import QwenImageEditFamily

    root, _, _ = tiny
    family = QwenImageEditFamily("unused", model_version=EDIT_2509, text_encoder=str(root))
    encode = family.load_text_encoder("fp32")
    images = [image(500, 300, 8)]
    got = encode(["make it red"], [images])
    size = edit_sizes(EDIT_2509, [images[0].size]).encoder[0]
    assert size == (480, 288)
    embeds, mask = load_qwen_image_edit_text_encoder(str(root), EDIT_2509).encode(["make it red"], [[resize_condition(images[0], size)]])
    assert len(got) == 1 and torch.equal(got[0]["embeds"], embeds[0]) and bool(got[0]["mask"].all())


def test_the_picture_slot_of_the_plus_versions_is_in_the_text_cache_key(monkeypatch):
    """2509 / 2511 name each reference 'Picture k: <vision tokens>' before the caption; the old key
    held the template and drop count only, so a changed slot kept the stale encodings."""
    from library.models.qwen_image import edit_encoder
    from library.models.qwen_image.edit_family import QwenImageEditFamily

    plus = QwenImageEditFamily("missing.safetensors", "ae.safetensors", EDIT_2509, text_encoder="te")
    edit = QwenImageEditFamily("missing.safetensors", "ae.safetensors", EDIT, text_encoder="te")
    keys = plus.text_cache_key({}, "bf16"), edit.text_cache_key({}, "bf16")
    monkeypatch.setattr(edit_encoder, "PICTURE_TEMPLATE", "Image {}: <|vision_start|><|image_pad|><|vision_end|>")
    assert plus.text_cache_key({}, "bf16") != keys[0] and edit.text_cache_key({}, "bf16") == keys[1]
