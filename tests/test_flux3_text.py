"""FLUX.3 prompt encoding: Qwen3-VL's language model on our LLM core against diffusers'
Flux3TextEncoderStep._get_qwen3_vl_prompt_embeds (one prompt per call) on a tiny transformers
Qwen3VLForConditionalGeneration of 33 layers (the released taps 4..32 are not the last layer, as in
Qwen3-VL-4B's 36), saved as FLUX.3's repo holds it: text_encoder/ + tokenizer/ (the processor's files)."""

import os
import shutil

import pytest
import torch

from library.models.flux3.text_encoder import (
    FLUX3_NEGATIVE_PROMPT, FLUX3_TAPS, QWEN3_VL_USER_PROMPT, flux3_tokenizer_folder, load_flux3_text_encoder,
)  # fmt: skip

LAYERS = 33
SHORT = "a photo of a cat sitting on a red chair"
LONG = " ".join([SHORT] * 12)  # 128 tokens with the template: a window of 160
MEDIUM = " ".join([SHORT] * 8)  # 88 tokens


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """text_encoder/ (Qwen3VLForConditionalGeneration: the tiny vision tower and a 33-layer Qwen3 language model
    of width 32) and tokenizer/ (a Qwen3VLProcessor's files, the chat template in chat_template.jinja as
    transformers 5 saves a processor)."""
    from transformers import Qwen3VLForConditionalGeneration

    from library.models.qwen_image21.tiny import QWEN3_VL_CHAT_TEMPLATE
    from library.models.tiny_files import build_qwen_tokenizer, save_vl_processor, tiny_qwen3_vl_config

    out = str(tmp_path_factory.mktemp("flux3_text"))
    tokenizer = build_qwen_tokenizer(vision_templates=(QWEN3_VL_USER_PROMPT,))
    torch.manual_seed(0)
    Qwen3VLForConditionalGeneration(tiny_qwen3_vl_config(tokenizer, LAYERS, images=True)).save_pretrained(
        os.path.join(out, "text_encoder"), safe_serialization=True)
    save_vl_processor(os.path.join(out, "tokenizer"), {"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
                                                       "min_pixels": 32 * 32, "max_pixels": 256 * 256},
                      "Qwen3VLProcessor", tokenizer)
    with open(os.path.join(out, "tokenizer", "chat_template.jinja"), "w") as f:
        f.write(QWEN3_VL_CHAT_TEMPLATE)
    return out


@pytest.fixture(scope="module")
def reference(root):
    """(transformers' model, the processor) as the modular pipeline's components text_encoder / tokenizer."""
    from transformers import Qwen3VLForConditionalGeneration, Qwen3VLProcessor

    from tests.test_vlm_inputs import processor_without_video

    model = Qwen3VLForConditionalGeneration.from_pretrained(os.path.join(root, "text_encoder")).eval()
    processor = processor_without_video(Qwen3VLProcessor, os.path.join(root, "tokenizer"))
    processor.chat_template = processor.tokenizer.chat_template  # chat_template.jinja (no video check needed)
    return model, processor


def diffusers_embeds(reference, prompt: str, **kwargs) -> torch.Tensor:
    """[1, W, taps * D] float32 (the tiny model's dtype)."""
    from diffusers.modular_pipelines.flux3.encoders import Flux3TextEncoderStep

    with torch.no_grad():
        return Flux3TextEncoderStep._get_qwen3_vl_prompt_embeds(*reference, prompt, **kwargs)


def assert_windows_match(reference, ours, prompts, **kwargs) -> float:
    """Our batch encode against diffusers one prompt at a time; returns the max abs diff."""
    embeds, mask = ours.encode(prompts)
    assert embeds.dtype == torch.float32 and embeds.shape[-1] == len(ours.taps) * 32
    diffs = []
    for i, prompt in enumerate(prompts):
        expected = diffusers_embeds(reference, prompt, **kwargs)[0]
        assert int(mask[i].sum()) == expected.shape[0] and mask[i, : expected.shape[0]].all()
        assert (embeds[i, expected.shape[0]:] == 0).all()
        diffs.append((embeds[i, : expected.shape[0]] - expected).abs().max().item())
        assert diffs[-1] <= 1e-5 * expected.abs().max().item() and expected.abs().mean() > 1e-3
    return max(diffs)


def test_encode_matches_diffusers_fp32(root, reference):
    """A short prompt (window 80), one of 128 tokens (window 160) and the empty negative prompt, in one batch."""
    ours = load_flux3_text_encoder(root)
    assert ours.taps == FLUX3_TAPS and len(ours.llm.model.layers) == 32 and ours.llm.lm_head is None
    prompts = [SHORT, LONG, FLUX3_NEGATIVE_PROMPT]
    assert ours.windows(prompts) == [80, 160, 80] and len(ours.token_ids([LONG])[0]) == 128
    diff = assert_windows_match(reference, ours, prompts)
    print(f"FLUX.3 prompt_embeds, taps 4..32: max abs diff {diff:.2e}")


def test_cut_at_max_sequence_length(root, reference):
    """max_sequence_length 100: 128 tokens are cut to a window of 100 with no pad; 88 get a capped window of 100."""
    ours = load_flux3_text_encoder(root, max_length=100)
    assert ours.windows([LONG, MEDIUM]) == [100, 100] and len(ours.token_ids([MEDIUM])[0]) == 88
    diff = assert_windows_match(reference, ours, [LONG, MEDIUM], max_sequence_length=100)
    print(f"FLUX.3 prompt_embeds cut at 100 tokens: max abs diff {diff:.2e}")


def test_pads_share_one_state_whatever_the_window(reference):
    """In diffusers' own output every pad of a prompt has the same state, and a longer window (pad_multiple 160)
    is the shorter one extended with copies of it: what our encode computes from one pad."""
    n = len(reference[1].tokenizer(QWEN3_VL_USER_PROMPT.format(SHORT)).input_ids)  # 18 real tokens, 62 pads
    at_80 = diffusers_embeds(reference, SHORT)[0]
    at_160 = diffusers_embeds(reference, SHORT, pad_multiple=160)[0]
    pad = at_80[-1]
    spread = (at_80[n:] - pad).abs().max().item()
    extended = (at_160 - torch.cat([at_80, pad.expand(80, -1)])).abs().max().item()
    print(f"FLUX.3 pad states: spread {spread:.2e}, window 160 vs 80 + copies {extended:.2e}")
    assert spread <= 1e-6 * pad.abs().max() and extended <= 1e-6 * pad.abs().max()
    assert n == 18 and (at_80[n - 1] - pad).abs().max() > 1e-2  # the last real token differs: the test can tell


def test_taps_are_a_parameter_and_the_last_is_normed(root, reference):
    """Taps (1, 2, 33): every layer is loaded and the last state comes after the final norm, as transformers has it."""
    ours = load_flux3_text_encoder(root, taps=(1, 2, LAYERS))
    assert len(ours.llm.model.layers) == LAYERS
    diff = assert_windows_match(reference, ours, [SHORT], hidden_states_layers=(1, 2, LAYERS))
    print(f"FLUX.3 prompt_embeds, taps 1, 2, 33: max abs diff {diff:.2e}")


def test_tokenizer_beside_the_text_encoder(root, tmp_path):
    """tokenizer/ (FLUX.3's repo), processor/ (Qwen-Image-2.1's naming), or the text encoder's own folder."""
    assert flux3_tokenizer_folder(root) == os.path.join(root, "tokenizer")
    assert flux3_tokenizer_folder(os.path.join(root, "text_encoder")) == os.path.join(root, "tokenizer")
    shutil.copytree(os.path.join(root, "tokenizer"), tmp_path / "processor")
    os.symlink(os.path.join(root, "text_encoder"), tmp_path / "text_encoder")
    assert flux3_tokenizer_folder(str(tmp_path)) == str(tmp_path / "processor")
