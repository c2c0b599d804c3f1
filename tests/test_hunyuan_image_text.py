"""HunyuanImage-2.1's prompt encoding (library/models/hunyuan_image/text_encoder.py) on the tiny files (tiny_text.py):
equal to diffusers' HunyuanImagePipeline.encode_prompt run with transformers' Qwen2_5_VLForConditionalGeneration,
T5EncoderModel and the tokenizers (captions of different lengths, with and without quoted text, Chinese quotes, one
cut at 1000 tokens, a glyph text cut at 128, the empty negative prompt), the state read is hidden_states[-3], the
ComfyUI single files give the same, the errors, the glyph tokenizer's added tokens, and the planner's counts."""

import shutil

import pytest
import torch

from library.io import CheckpointError
from library.models.hunyuan_image.text_encoder import (
    HUNYUAN_IMAGE_DROP_TOKENS, HUNYUAN_IMAGE_MAX_TOKENS, HUNYUAN_IMAGE_TEMPLATE, HunyuanImageTextEncoder,
    extract_glyph_text, glyph_t5_config, hunyuan_image_caption_token_limit, hunyuan_image_text_weights,
    load_hunyuan_image_text_encoder,
)

CAPTIONS = [
    "a photo of a cat sitting on a red chair",
    'a shop sign that says "OPEN 24h" above a door, and \'SALE\' on the window',
    "一张海报，上面写着“你好世界”，下面有‘新年快乐’",
    "",  # the pipeline's default negative prompt
    "a small blue star in the centre, white background " * 120,  # cut at 1000 tokens after the drop
    'a banner reading "' + "the quick brown fox jumps over the lazy dog " * 4 + '"',  # its glyph text cut at 128
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from library.models.hunyuan_image.tiny_text import write_hunyuan_image_text_encoders

    return write_hunyuan_image_text_encoders(str(tmp_path_factory.mktemp("tiny")), seed=0)


@pytest.fixture(scope="module")
def reference(tiny):
    """transformers' models of the tiny files and diffusers' pipeline around them (no transformer, no VAE)."""
    from diffusers import HunyuanImagePipeline
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration, T5EncoderModel

    qwen = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny["hunyuan_image_text_encoder"]).eval()
    glyph = T5EncoderModel.from_pretrained(tiny["hunyuan_image_glyph_encoder"]).eval()
    return HunyuanImagePipeline(
        scheduler=None, vae=None, transformer=None, text_encoder=qwen,
        tokenizer=AutoTokenizer.from_pretrained(tiny["hunyuan_image_tokenizer"]), text_encoder_2=glyph,
        tokenizer_2=AutoTokenizer.from_pretrained(tiny["hunyuan_image_glyph_tokenizer"]))


@pytest.fixture(scope="module")
def encoded(tiny):
    encoder = load_hunyuan_image_text_encoder(tiny["hunyuan_image_text_encoder"], dtype=torch.float32)
    return encoder, encoder.encode(CAPTIONS)


def largest_difference(ours: list[dict], embeds, mask, glyph, glyph_mask) -> tuple[float, float]:
    """Ours (real tokens per caption) against encode_prompt's padded batch: masks exact (real tokens first, nothing
    real past ours), states on the real tokens; a caption without glyph text has none where the pipeline has zeros
    and an all-False mask. -> the largest differences of the Qwen and the byT5 states."""
    text_diff = glyph_diff = 0.0
    for item, e, m, g, gm in zip(ours, embeds, mask, glyph, glyph_mask):
        n = item["embeds"].shape[0]
        assert item["mask"].dtype == torch.bool and item["mask"].all() and item["mask"].shape == (n,)
        assert m[:n].all() and not m[n:].any()
        text_diff = max(text_diff, (item["embeds"] - e[:n]).abs().max().item())
        if "glyph" not in item:
            assert not gm.any() and not g.any()
            continue
        k = item["glyph"].shape[0]
        assert item["glyph_mask"].all() and item["glyph_mask"].shape == (k,)
        assert gm[:k].all() and not gm[k:].any()
        glyph_diff = max(glyph_diff, (item["glyph"] - g[:k]).abs().max().item())
    return text_diff, glyph_diff


def test_hunyuan_image_encode_matches_diffusers_encode_prompt_fp32(encoded, reference):
    encoder, ours = encoded
    assert len(encoder.llm.model.layers) == 2  # hidden_states[-3] of 4 layers: the last two are never loaded
    with torch.no_grad():
        pipe_out = reference.encode_prompt(CAPTIONS, device=torch.device("cpu"), batch_size=len(CAPTIONS))
    assert [item["embeds"].shape[0] for item in ours] == [11, 50, 76, 1, 1000, 51]  # "" -> the closing <|im_end|>
    assert [item["embeds"].dtype for item in ours] == [torch.float32] * 6
    assert ["glyph" in item for item in ours] == [False, True, True, False, False, True]
    assert [item["glyph"].shape for item in ours if "glyph" in item] == [(31, 32), (43, 32), (128, 32)]
    text_diff, glyph_diff = largest_difference(ours, *pipe_out)
    assert text_diff <= 1e-5 and glyph_diff <= 1e-5, (text_diff, glyph_diff)  # measured 1.5e-8, 0 (8.6e-7 batched)


def test_hunyuan_image_reads_hidden_states_minus_3_not_the_last_two(encoded, reference, tiny):
    """hidden_states[-3] of transformers' run; [-2] and [-1] (what a Qwen-Image-style encoder reads) differ by far
    more than the tolerance, so this fails if either were taken."""
    encoder, ours = encoded
    assert HUNYUAN_IMAGE_TEMPLATE == reference.prompt_template_encode  # not Qwen-Image's: no assistant turn
    assert (HUNYUAN_IMAGE_DROP_TOKENS, HUNYUAN_IMAGE_MAX_TOKENS) == (reference.prompt_template_encode_start_idx,
                                                                     reference.tokenizer_max_length) == (34, 1000)
    tokens = reference.tokenizer([HUNYUAN_IMAGE_TEMPLATE.format(CAPTIONS[0])], return_tensors="pt")
    with torch.no_grad():
        states = reference.text_encoder(**tokens, output_hidden_states=True).hidden_states
    assert len(states) == 5
    read = ours[0]["embeds"]
    gaps = {k: (read - states[k][0, 34:]).abs().max().item() for k in (-1, -2, -3)}
    assert gaps[-3] <= 1e-5 and gaps[-2] > 1e-2 and gaps[-1] > 1.0, gaps  # measured 1e-8, 0.047, 2.7


def test_hunyuan_image_comfyui_single_files_give_the_same(encoded, tiny, tmp_path):
    """ComfyUI's key layouts (qwen_2.5_vl_7b: `model.*`, `visual.*`, `lm_head.weight`; byt5_small_glyphxl:
    `shared.weight`, `encoder.*`, no config.json: shaped from its tensors, the plain ByT5Tokenizer) load to the very
    same states as the diffusers folders."""
    _, ours = encoded
    glyph_file = tmp_path / "byt5_small_glyphxl_tiny.safetensors"  # alone, as in ComfyUI's models/text_encoders/
    shutil.copy(tiny["hunyuan_image_glyph_single_file"], glyph_file)
    config = glyph_t5_config(str(glyph_file))
    assert (config["d_model"], config["vocab_size"], config["num_layers"], config["d_kv"]) == (32, 384, 2, 8)
    single = load_hunyuan_image_text_encoder(tiny["hunyuan_image_qwen_single_file"], str(glyph_file),
                                             dtype=torch.float32, tokenizer=tiny["hunyuan_image_tokenizer"])
    assert type(single.glyph_tokenizer).__name__ == "ByT5Tokenizer"  # transformers' own: no tokenizer_2/ beside
    for a, b in zip(single.encode(CAPTIONS), ours):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_hunyuan_image_errors_name_the_file(encoded, tiny, tmp_path):
    encoder, _ = encoded
    qwen_file = tmp_path / "qwen.safetensors"  # alone: no tokenizer beside it, no config.json (read as the 7B)
    shutil.copy(tiny["hunyuan_image_qwen_single_file"], qwen_file)
    with pytest.raises(CheckpointError, match="no Qwen2 tokenizer found"):
        load_hunyuan_image_text_encoder(str(qwen_file), tiny["hunyuan_image_glyph_encoder"])
    with pytest.raises(CheckpointError, match="qwen.safetensors"):  # the tiny shapes are not Qwen2.5-VL-7B's
        load_hunyuan_image_text_encoder(str(qwen_file), tiny["hunyuan_image_glyph_encoder"],
                                        tokenizer=tiny["hunyuan_image_tokenizer"])
    with pytest.raises(CheckpointError, match="not a T5 encoder"):  # the Qwen file given as the glyph encoder
        load_hunyuan_image_text_encoder(tiny["hunyuan_image_text_encoder"], str(qwen_file))
    with pytest.raises(CheckpointError, match="needs ByT5's tokenizer"):
        load_hunyuan_image_text_encoder(tiny["hunyuan_image_text_encoder"],
                                        glyph_tokenizer=tiny["hunyuan_image_tokenizer"])
    from transformers import ByT5Tokenizer

    with pytest.raises(ValueError, match="expected 34"):  # a tokenizer that splits the template otherwise
        HunyuanImageTextEncoder(encoder.llm, ByT5Tokenizer(), encoder.glyph_model, ByT5Tokenizer())


def test_hunyuan_image_glyph_text_is_the_pipelines_and_added_tokens_keep_plain_ids():
    """extract_glyph_text equals the pipeline's; Glyph-SDXL-v2's 1126 color / font tokens (sd-scripts'
    add_special_token: the released vocabulary 1510) leave plain text's byte ids unchanged."""
    from diffusers.pipelines.hunyuan_image.pipeline_hunyuanimage import extract_glyph_text as pipeline_glyph_text
    from transformers import ByT5Tokenizer

    prompts = CAPTIONS + ["it's a dog's life", 'mixed "a" ‘b’ “c” \'d\' "e"', "no quotes at all"]
    assert [extract_glyph_text(p) for p in prompts] == [pipeline_glyph_text(p) for p in prompts]
    assert extract_glyph_text(CAPTIONS[1]) == 'Text "SALE". Text "OPEN 24h". '  # single quotes first, as the pipeline
    plain, glyph = ByT5Tokenizer(), ByT5Tokenizer()
    glyph.add_tokens([f"<color-{i}>" for i in range(138)] + [f"<en-font-{i}>" for i in range(988)],
                     special_tokens=True)
    assert len(glyph) == 1510
    texts = [t for p in prompts if (t := extract_glyph_text(p))]
    assert glyph(texts).input_ids == plain(texts).input_ids
    assert glyph("<color-3>").input_ids != plain("<color-3>").input_ids  # only a literal token's spelling differs


def test_hunyuan_image_text_weights_count_what_the_loader_keeps(encoded, tiny):
    qwen, byt5 = hunyuan_image_text_weights()  # Qwen2.5-VL-7B (26 of 28 layers, no head) and byT5-small (1510)
    assert (qwen.params, qwen.fp8_weights, qwen.fp8_scales) == (6_604_503_552, 6_059_196_416, 94_674_944)
    assert (byt5.params, byt5.fp8_weights, byt5.fp32_in_fp16) == (219_314_944, 0, 63_307_776)
    encoder, _ = encoded
    tiny_qwen, tiny_byt5 = hunyuan_image_text_weights(encoder.llm.config,
                                                      glyph_t5_config(tiny["hunyuan_image_glyph_encoder"]))
    for weights, model in ((tiny_qwen, encoder.llm), (tiny_byt5, encoder.glyph_model)):
        stored = {p.data_ptr(): p.numel() for p in model.parameters()}  # `shared` and the embedding: one storage
        assert weights.params == sum(stored.values())


def test_hunyuan_image_caption_token_limit(encoded, tiny):
    _, ours = encoded
    limit = hunyuan_image_caption_token_limit(tiny["hunyuan_image_text_encoder"])
    assert limit.max_tokens == 1000
    assert [limit.count(c) for c in CAPTIONS[:4]] == [item["embeds"].shape[0] for item in ours[:4]]
    assert limit.count(CAPTIONS[4]) > 1000
