"""Tokenizers: load a Hugging Face `tokenizer.json` folder, or train a small byte-level BPE locally.

Both return a transformers fast tokenizer (`encode`, `decode`, `eos_token_id`, `pad_token_id`,
`apply_chat_template` when the folder has a template). Nothing is downloaded.
"""

from __future__ import annotations

import json
import os
from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from library.io import atomic_path, write_text

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"


def load_tokenizer(path: str) -> PreTrainedTokenizerFast:
    """Load the tokenizer in folder `path` (or the folder of a tokenizer.json file). Special
    tokens and the chat template come from tokenizer_config.json when the folder has one."""
    folder = os.path.dirname(path) if os.path.isfile(path) else path
    if not os.path.isfile(os.path.join(folder, "tokenizer.json")):
        raise ValueError(f"{path}: no tokenizer.json here (expected a Hugging Face tokenizer folder)")
    return PreTrainedTokenizerFast.from_pretrained(folder, local_files_only=True)


def build_bpe_tokenizer(
    texts: Iterable[str],
    vocab_size: int,
    save_dir: str,
    eos_token: str = EOS_TOKEN,
    pad_token: str = PAD_TOKEN,
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE (GPT-2 style: any byte sequence encodes, no unknown tokens) of
    `vocab_size` entries on `texts` and save tokenizer.json + tokenizer_config.json into save_dir,
    so that `load_tokenizer(save_dir)` and `AutoTokenizer.from_pretrained(save_dir)` load it."""
    if vocab_size < 256 + 2:
        raise ValueError(f"build_bpe_tokenizer: vocab_size {vocab_size}: expected >= 258 (256 bytes + eos + pad)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[eos_token, pad_token],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    os.makedirs(save_dir, exist_ok=True)
    with atomic_path(os.path.join(save_dir, "tokenizer.json")) as tmp:
        tok.save(tmp)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": eos_token,
        "pad_token": pad_token,
        "model_max_length": 1 << 30,
        "clean_up_tokenization_spaces": False,
    }
    write_text(os.path.join(save_dir, "tokenizer_config.json"), json.dumps(config, indent=2) + "\n")
    return load_tokenizer(save_dir)
