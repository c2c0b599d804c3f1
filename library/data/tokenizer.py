"""Tokenizers: load a Hugging Face `tokenizer.json` folder, train a small byte-level BPE locally,
and save a tokenizer the way both transformers 4.x and 5.x load it.

Both loaders return a transformers fast tokenizer (`encode`, `decode`, `eos_token_id`,
`pad_token_id`, `apply_chat_template` when the folder has a template). Nothing is downloaded.

Why the scratch BPE pre-splits like Qwen2: transformers 5.x `AutoTokenizer` on a folder whose
config.json says `qwen2` always builds its own Qwen2Tokenizer from the vocabulary and merges (NFC,
the Qwen2 split pattern, byte-level without regex) and ignores the pre-tokenizer in tokenizer.json,
whatever tokenizer_config.json names. A tokenizer trained with exactly that pipeline encodes the
same ids through our loader, AutoTokenizer 5.x (Qwen2Tokenizer) and 4.x (PreTrainedTokenizerFast).
"""

from __future__ import annotations

import json
import os
from typing import Iterable

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from library.io import atomic_path, write_text

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
# The Qwen2 / Qwen2.5 pre-tokenizer pattern (their tokenizer.json; transformers' Qwen2Tokenizer).
QWEN2_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


def load_tokenizer(path: str) -> PreTrainedTokenizerFast:
    """Load the tokenizer in folder `path` (or the folder of a tokenizer.json file). Special
    tokens and the chat template come from tokenizer_config.json when the folder has one."""
    folder = os.path.dirname(path) if os.path.isfile(path) else path
    if not os.path.isfile(os.path.join(folder, "tokenizer.json")):
        raise ValueError(f"{path}: no tokenizer.json here (expected a Hugging Face tokenizer folder)")
    return PreTrainedTokenizerFast.from_pretrained(folder, local_files_only=True)


def qwen2_pre_tokenization(tok: Tokenizer) -> Tokenizer:
    """Set Qwen2's normalizer, pre-tokenizer, decoder and post-processor on `tok` (in place)."""
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def build_bpe_tokenizer(
    texts: Iterable[str],
    vocab_size: int,
    save_dir: str,
    eos_token: str = EOS_TOKEN,
    pad_token: str = PAD_TOKEN,
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE (any byte sequence encodes, no unknown tokens) of `vocab_size`
    entries on `texts`, pre-split as Qwen2 does (module docstring), and save tokenizer.json +
    tokenizer_config.json into save_dir, so that `load_tokenizer(save_dir)` and
    `AutoTokenizer.from_pretrained(save_dir)` (beside a qwen2 or llama config.json) agree."""
    if vocab_size < 256 + 2:
        raise ValueError(f"build_bpe_tokenizer: vocab_size {vocab_size}: expected >= 258 (256 bytes + eos + pad)")
    tok = qwen2_pre_tokenization(Tokenizer(models.BPE()))
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[eos_token, pad_token],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos_token, pad_token=pad_token,
                                   model_max_length=1 << 30, clean_up_tokenization_spaces=False)
    save_tokenizer(fast, save_dir)
    return load_tokenizer(save_dir)


def tokenizer_config(tokenizer: PreTrainedTokenizerFast) -> dict:
    """The tokenizer_config.json fields transformers 4.x and 5.x both read. `tokenizer_class`
    PreTrainedTokenizerFast means "exactly tokenizer.json" in both (5.x maps it to its
    TokenizersBackend); transformers 5's own save writes `TokenizersBackend`, `backend`, `is_local`
    and `local_files_only`, which 4.x cannot resolve or should not persist, so they are not written."""
    config = {"tokenizer_class": "PreTrainedTokenizerFast"}
    for key in SPECIAL_TOKEN_KEYS:
        value = getattr(tokenizer, key, None)
        if value is not None:
            config[key] = str(value)
    max_length = getattr(tokenizer, "model_max_length", None)
    if isinstance(max_length, int) and max_length < 1 << 40:  # transformers' "no limit" is ~1e30, not json-friendly
        config["model_max_length"] = max_length
    config["clean_up_tokenization_spaces"] = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False))
    if getattr(tokenizer, "chat_template", None):
        config["chat_template"] = tokenizer.chat_template
    return config


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, folder: str) -> None:
    """tokenizer.json (the tokenizers pipeline, unchanged) + tokenizer_config.json
    (`tokenizer_config`), each written atomically; nothing else (no special_tokens_map.json)."""
    os.makedirs(folder, exist_ok=True)
    with atomic_path(os.path.join(folder, "tokenizer.json")) as tmp:
        tokenizer.backend_tokenizer.save(tmp)
    write_text(os.path.join(folder, "tokenizer_config.json"), json.dumps(tokenizer_config(tokenizer), indent=2) + "\n")


def folder_chat_template(tokenizer) -> str | None:
    """The tokenizer's chat template, else the processor's saved beside it (chat_template.jinja, or
    chat_template.json of processors saved by transformers 4.x)."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.chat_template
    folder = getattr(tokenizer, "name_or_path", "") or ""
    jinja, legacy = os.path.join(folder, "chat_template.jinja"), os.path.join(folder, "chat_template.json")
    if os.path.isfile(jinja):
        with open(jinja) as f:
            return f.read()
    if os.path.isfile(legacy):
        with open(legacy) as f:
            return json.load(f).get("chat_template")
    return None
