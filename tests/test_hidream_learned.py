"""The learned tiny HiDream-I1 base (library/models/hidream/learned.py, learned/hidream/): its T5 and Llama tokenizers
say model_max_length 48, which the family honours as HiDreamImagePipeline does (min(128, model_max_length)), and
every caption the scenes and the concept give fits in it uncut."""

import torch
from transformers import AutoTokenizer

from library.data.shapes import COLOURS, SHAPES, all_scenes
from library.models.hidream.learned import TEXT_TOKENS
from tools.learned_base import encode_prompts, learned_family, learned_paths


def test_shipped_base_encodes_its_tokenizers_length_and_every_caption_fits():
    paths = learned_paths("hidream")
    captions = [s.caption() for s in all_scenes(shapes=SHAPES, colours=tuple(COLOURS))]
    longest = max(captions, key=len)
    for folder in (paths["t5xxl"].replace("text_encoder_3", "tokenizer_3"), paths["llama"]):
        tokenizer = AutoTokenizer.from_pretrained(folder)
        assert tokenizer.model_max_length == TEXT_TOKENS, folder
        # the trigger word in front (the concept's captions are shorter): 39 T5 and 40 Llama tokens
        assert max(len(tokenizer("zxq, " + c).input_ids) for c in captions) < TEXT_TOKENS, folder
    text = encode_prompts(learned_family("hidream"), [longest])
    assert text["t5"].shape == (1, TEXT_TOKENS, 64) and text["llama"].shape == (1, 3, TEXT_TOKENS, 64)
    assert text["pooled"].shape == (1, 64) and torch.isfinite(text["llama"]).all()
