"""library/data/vlm_inputs.py against transformers' own processors: Qwen3VLProcessor (patch 16, its
image processor settings) and Qwen2_5_VLProcessor with the left padding generation uses. The
processors are built with their text and image parts only: their video processor needs torchvision,
which does not import beside our CPU torch."""

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoTokenizer, Qwen2_5_VLProcessor, Qwen2VLImageProcessor, Qwen3VLProcessor
from transformers.processing_utils import ProcessorMixin

from library.data.controls import check_vl_views
from library.data.vlm_inputs import IMAGE_PLACEHOLDER, check_aspect_ratio, qwen_vl_inputs
from tools.make_tiny_models import write_qwen3_vl


def image(width: int, height: int, seed: int) -> Image.Image:
    pixels = np.random.RandomState(seed).randint(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def processor_without_video(processor_class, folder: str):
    """transformers' `processor_class` from the image processor and tokenizer in `folder`. Its
    constructor checks the video processor's class, which needs torchvision: that check is skipped
    for the absent video processor only."""
    check = ProcessorMixin.check_argument_for_proper_class

    def skip_absent_video(self, name, argument):
        return None if name == "video_processor" and argument is None else check(self, name, argument)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ProcessorMixin, "check_argument_for_proper_class", skip_absent_video)
        return processor_class(image_processor=Qwen2VLImageProcessor.from_pretrained(folder),
                               tokenizer=AutoTokenizer.from_pretrained(folder))


@pytest.fixture(scope="module")
def qwen3_vl(tmp_path_factory):
    return write_qwen3_vl(str(tmp_path_factory.mktemp("vlm")), 0)["qwen3_vl"]


def assert_equal_inputs(ours: dict, reference) -> None:
    assert sorted(ours) == sorted(reference.keys())
    for key in ours:
        assert ours[key].dtype == reference[key].dtype and torch.equal(ours[key], reference[key]), key


def test_qwen3_vl_inputs_equal_qwen3_vl_processor(qwen3_vl):
    """Patch 16 (grids of 32-pixel merged cells), two prompts of different lengths, images of three sizes."""
    processor = processor_without_video(Qwen3VLProcessor, qwen3_vl)
    assert processor.image_processor.patch_size == 16
    texts = [f"<|im_start|>user\n{IMAGE_PLACEHOLDER}a short one<|im_end|>\n",
             f"<|im_start|>user\nfirst {IMAGE_PLACEHOLDER} then {IMAGE_PLACEHOLDER} and a longer prompt<|im_end|>\n"]
    images = [[image(100, 60, 1)], [image(64, 130, 2), image(96, 96, 3)]]
    for side in ("left", "right"):
        ours = qwen_vl_inputs(texts, images, processor.image_processor, processor.tokenizer, padding_side=side)
        reference = processor(text=texts, images=[i for s in images for i in s], padding=True, padding_side=side,
                              return_tensors="pt")
        assert_equal_inputs(ours, reference)
    assert ours["image_grid_thw"].tolist() == [[1, 4, 6], [1, 8, 4], [1, 6, 6]]  # 64x64 minimum area, 16-pixel patches
    assert int(ours["mm_token_type_ids"].sum()) == (24 + 32 + 36) // 4


def test_qwen2_5_vl_inputs_padded_left_equal_qwen2_5_vl_processor(tiny_set):
    """The captioner's batches: the tiny Qwen-Image-Edit processor files, left padding."""
    processor = processor_without_video(Qwen2_5_VLProcessor, tiny_set["qwen_image_edit_processor"])
    texts = [f"{IMAGE_PLACEHOLDER}Describe this image.", f"{IMAGE_PLACEHOLDER}Describe this image in one sentence."]
    images = [[image(84, 56, 4)], [image(56, 112, 5)]]
    ours = qwen_vl_inputs(texts, images, processor.image_processor, processor.tokenizer, padding_side="left")
    reference = processor(text=texts, images=[i for s in images for i in s], padding=True, padding_side="left",
                          return_tensors="pt")
    assert_equal_inputs(ours, reference)
    assert int(ours["attention_mask"][0].sum()) < ours["attention_mask"].shape[1] and ours["attention_mask"][0, 0] == 0


def test_text_without_images_has_no_pixels():
    class Tokenizer:
        def convert_tokens_to_ids(self, token):
            return 7

        def __call__(self, texts, **kwargs):
            return {"input_ids": torch.tensor([[1, 2]]), "attention_mask": torch.tensor([[1, 1]])}

    out = qwen_vl_inputs(["hi"], [[]], None, Tokenizer())
    assert sorted(out) == ["attention_mask", "input_ids", "mm_token_type_ids"] and not out["mm_token_type_ids"].any()
    with pytest.raises(ValueError, match="2 prompts but images for 1"):
        qwen_vl_inputs(["a", "b"], [[]], None, Tokenizer())


@pytest.mark.parametrize("size", [(8000, 16), (6000, 20), (4200, 20), (20, 4200)])
def test_the_reference_check_says_what_the_processor_says_of_the_encoders_view(tiny_set, size):
    """Qwen-Image-Edit-2509 shows a reference at ~384x384 area, sides rounded to 32, and the processor checks
    that view: 8000 x 16 (aspect 500) is 268 there and 6000 x 20 (300) 208, both refused; 4200 x 20 (210) is 174,
    taken, though its own aspect is over 200."""
    from library.models.qwen_image.edit_family import QwenImageEditFamily

    seen = QwenImageEditFamily(tiny_set["qwen_image_edit"], model_version="qwen-image-edit-2509").reference_vl_size(*size)
    processor = Qwen2VLImageProcessor.from_pretrained(tiny_set["qwen_image_edit_processor"])
    try:
        processor(images=[Image.new("RGB", seen)], return_tensors="pt")
        taken = True
    except ValueError as e:
        assert "aspect ratio must be smaller than 200" in str(e)
        taken = False
    assert taken == (max(size) == 4200), (size, seen)
    if taken:
        check_aspect_ratio("r.png", size, seen)
    else:
        with pytest.raises(ValueError, match=f"r.png: {size[0]} x {size[1]} pixels, {seen[0]} x {seen[1]} as the text "
                                             f"encoder resizes it, an aspect ratio of"):
            check_aspect_ratio("r.png", size, seen)


def test_each_family_checks_its_own_view_of_a_reference(tmp_path):
    """Krea 2 edit shows a reference at most 384^2 pixels, sides at least 28 (8000 x 16 -> 8000 x 28: 286);
    Qwen-Image-2.1 at 1024^2 pixels in 32-pixel steps (-> 22912 x 32: 716); Z-Image Omni's SigLIP has no such
    limit (reference_vl_size None)."""
    from library.models.krea2.edit_family import Krea2EditFamily
    from library.models.qwen_image21.family import QwenImage21Family
    from library.models.zimage.omni_family import ZImageOmniFamily

    long, wide = str(tmp_path / "long.png"), str(tmp_path / "wide.png")
    Image.new("RGB", (8000, 16)).save(long)
    Image.new("RGB", (4000, 30)).save(wide)  # 133
    for family, view in ((Krea2EditFamily("m"), "8000 x 28"), (QwenImage21Family("m"), "22912 x 32")):
        check_vl_views([wide], family.reference_vl_size)
        with pytest.raises(ValueError, match=f"long.png: 8000 x 16 pixels, {view} as the text encoder resizes it"):
            check_vl_views([long], family.reference_vl_size)
    check_vl_views([long], ZImageOmniFamily("m").reference_vl_size)


def test_an_image_the_processor_refuses_is_named_by_its_place():
    """The processor's own line ("absolute aspect ratio must be smaller than 200, got 200.1") named no image."""
    with pytest.raises(ValueError, match="image 2 of 2: 10 x 2001 pixels, an aspect ratio of 200.1; the Qwen-VL image "
                                         "processor takes at most 200"):
        qwen_vl_inputs([IMAGE_PLACEHOLDER * 2], [[image(10, 10, 0), image(10, 2001, 0)]], None, None)
