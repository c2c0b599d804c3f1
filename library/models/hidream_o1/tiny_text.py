"""HiDream-O1-Image's tiny prompt files (tools/make_tiny_models.py, once the family lists the writer): the processor
files of the HF repo's root, which is where the tokenizer comes from (the model has no separate text encoder):

  hidream_o1/tokenizer/   a Qwen2-style tokenizer (tiny_files.build_qwen_tokenizer, with Qwen-VL's vision tokens,
                          trained on HiDream-O1's template), Qwen3-VL's chat template (in tokenizer_config.json),
                          HiDream-O1's five added tokens after the vision tokens in the released order
                          (boi, bor, eor, bot, tms: 151669-151673 there), and a Qwen3-VL preprocessor_config.json
                          (patch 16, temporal 2, merge 2); save_hidream_o1_processor writes the same files into
                          another folder (an HF layout's root, beside config.json)

The tiny transformer's vocabulary must hold the tokenizer's ids: round_up(len(build_hidream_o1_tokenizer())).
Seed offset 141 is this writer's (HiDream-O1's writers take 140-146).
"""

from __future__ import annotations

import os

from library.models.hidream_o1.text_encoder import BOI_TOKEN, TMS_TOKEN

# HiDream-O1's added tokens in their released order (ComfyUI's text_encoders/hidream_o1.py ids 151669-151673)
HIDREAM_O1_TOKENS = (BOI_TOKEN, "<|bor_token|>", "<|eor_token|>", "<|bot_token|>", TMS_TOKEN)
TEMPLATE = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"  # what the vocabulary learns whole
# Qwen3-VL's image processor settings, the tiny sizes of qwen_image21/tiny.py
PROCESSOR_SETTINGS = {"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
                      "min_pixels": 32 * 32, "max_pixels": 256 * 256}


def build_hidream_o1_tokenizer():
    """The tiny tokenizer with the chat template and HiDream-O1's added tokens (module docstring)."""
    from library.models.qwen_image21.tiny import QWEN3_VL_CHAT_TEMPLATE
    from library.models.tiny_files import build_qwen_tokenizer

    tokenizer = build_qwen_tokenizer(vision_templates=(TEMPLATE,))
    tokenizer.add_tokens(list(HIDREAM_O1_TOKENS), special_tokens=True)
    tokenizer.chat_template = QWEN3_VL_CHAT_TEMPLATE
    return tokenizer


def save_hidream_o1_processor(folder: str, tokenizer=None) -> None:
    """The processor's files (preprocessor_config.json naming Qwen3VLProcessor, the tokenizer) into `folder`."""
    from library.models.tiny_files import save_vl_processor

    save_vl_processor(folder, PROCESSOR_SETTINGS, "Qwen3VLProcessor", tokenizer or build_hidream_o1_tokenizer())


def write_hidream_o1_tokenizer(out: str, seed: int) -> dict[str, str]:
    """out/hidream_o1/tokenizer/ (module docstring); returns its path."""
    from library.models.tiny_files import seed_component

    seed_component(seed, 141)  # the tokenizer is trained deterministically; seeded as every component is
    folder = os.path.join(out, "hidream_o1", "tokenizer")
    save_hidream_o1_processor(folder)
    return {"hidream_o1_tokenizer": folder}
