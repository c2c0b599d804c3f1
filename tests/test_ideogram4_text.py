"""Ideogram 4 prompt encoding: Qwen3-VL's language model on our LLM core against
Ideogram4Pipeline.encode_prompt (a tiny transformers Qwen3VLModel, taps moved onto its 4 layers)."""

import os

import pytest
import torch

from library.models.ideogram4.text_encoder import load_ideogram4_text_encoder
from library.models.ideogram4.tiny import TINY_TAPS, write_ideogram4_text_encoder

PROMPTS = ["a photo of a cat sitting on a red chair", "a dog"]


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    return write_ideogram4_text_encoder(str(tmp_path_factory.mktemp("ideogram4_text")), 0)


def pipeline_encode(tiny_files, monkeypatch, max_len: int):
    import diffusers.pipelines.ideogram4.pipeline_ideogram4 as module
    from diffusers import FlowMatchEulerDiscreteScheduler, Ideogram4Pipeline
    from transformers import AutoTokenizer, Qwen3VLModel

    monkeypatch.setattr(module, "QWEN3_VL_ACTIVATION_LAYERS", TINY_TAPS)  # the released 13 taps need 36 layers
    text_encoder = Qwen3VLModel.from_pretrained(tiny_files["ideogram4_text_encoder"]).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_files["ideogram4_tokenizer"])
    pipe = Ideogram4Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=None, text_encoder=text_encoder,
                             tokenizer=tokenizer, transformer=None, unconditional_transformer=None)
    with torch.no_grad():
        embeds, _, _, indicator = pipe.encode_prompt(PROMPTS, 2, 3, max_len, torch.device("cpu"))
    return embeds[:, :max_len], indicator[:, :max_len] == 3  # text region, left-padded; LLM_TOKEN_INDICATOR


def test_encode_prompt_matches_pipeline(tiny_files, monkeypatch):
    expected, expected_mask = pipeline_encode(tiny_files, monkeypatch, 40)
    ours = load_ideogram4_text_encoder(os.path.dirname(tiny_files["ideogram4_text_encoder"]), taps=TINY_TAPS, max_length=40)
    features, mask = ours.encode(PROMPTS)
    assert features.dtype == torch.float32 and mask.sum(1).tolist() == expected_mask.sum(1).tolist()
    real = [e[m] for e, m in zip(expected, expected_mask)]
    assert features.shape == (2, real[0].shape[0], 3 * 32)
    diffs = [(f[m] - r).abs().max().item() for f, m, r in zip(features, mask, real)]
    scale = real[0].abs().max().item()
    print(f"Ideogram 4 encode_prompt: max abs diff {max(diffs):.2e} (values up to {scale:.2e})")
    assert max(diffs) <= 1e-5 * scale and real[0].abs().mean() > 1e-3
    assert (features[1][~mask[1]] == 0).all() and (expected[1][~expected_mask[1]] == 0).all()


def test_too_long_prompt_is_an_error_as_in_the_pipeline(tiny_files):
    ours = load_ideogram4_text_encoder(os.path.dirname(tiny_files["ideogram4_text_encoder"]), taps=TINY_TAPS, max_length=8)
    with pytest.raises(ValueError, match="exceeds max_sequence_length=8"):
        ours.encode(PROMPTS)


def test_caption_token_limit_counts_the_chat_prompt(tiny_files):
    from library.models.ideogram4.family import Ideogram4Family
    from library.models.ideogram4.text_encoder import load_ideogram4_text_encoder

    folder = os.path.dirname(tiny_files["ideogram4_text_encoder"])
    limit = Ideogram4Family("unused", text_encoder=folder).caption_token_limit(None)
    ours = load_ideogram4_text_encoder(folder, taps=TINY_TAPS, max_length=40)
    assert limit.max_tokens == 2048 and limit.count(PROMPTS[0]) == len(ours.token_ids([PROMPTS[0]])[0])
