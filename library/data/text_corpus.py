"""The LLM's training text: .txt documents (folders searched recursively) -> one token stream (documents joined by EOS) -> a
train / validation split -> fixed windows of max_length + 1 tokens."""

from __future__ import annotations

import os
import re
from typing import Callable

import torch

from library.errors import ConfigError
from library.io import read_utf8


# ----------------------------------------------------------------------------------------------
# LLM text: documents -> one token stream -> fixed windows


RECORD_FILES = (".json", ".jsonl", ".parquet", ".arrow")  # records, not text: refused when named as train_data


def text_files(folder: str) -> list[str]:
    """Every .txt file (the extension in any case: .TXT too) in `folder` and its subfolders, in path
    order (a folder's own files, then each subfolder's); hidden files and folders ('.name') are skipped."""
    found = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))  # os.walk descends into these, in order
        found += [os.path.join(root, f) for f in sorted(files) if f.lower().endswith(".txt") and not f.startswith(".")]
    return found


def load_text_corpus(paths: str | list[str]) -> list[str]:
    """The documents (one per file) of train_data: files as given (any name but a RECORD_FILES one) and
    the .txt files of folders, searched recursively (text_files). A missing path, a data file, a folder
    without a .txt file and a corpus of empty files are ConfigErrors naming the train_data entry."""
    entries, files = [paths] if isinstance(paths, str) else paths, []
    for p in entries:
        if os.path.isdir(p):
            found = text_files(p)
            if not found:
                raise ConfigError(f"train_data {p}: no .txt file in this folder or its subfolders")
            files += found
        elif os.path.isfile(p):
            if p.lower().endswith(RECORD_FILES):
                raise ConfigError(f"train_data {p}: a {os.path.splitext(p)[1]} data file would be trained on as raw text "
                                  f"(its keys and quotes too); give plain text files, one document each")
            files.append(p)
        else:
            raise ConfigError(f"train_data {p}: no such text file or folder")
    documents = [read_utf8(f) for f in files]
    if not any(d.strip() for d in documents):
        raise ConfigError(f"train_data {', '.join(entries)}: every text file is empty")
    return documents


TOKEN_DTYPE = torch.int32  # 4 bytes a stored token (every vocab fits); windows widen to int64 as they are read
PIECE_CHARS = 1 << 18  # a document is tokenized in pieces of about this many characters (a piece's encoding: ~100 B a token)
# Where a piece may end: after a newline that a non-space follows, else before a space that a letter follows. A
# byte-level BPE's pre-tokenizer (GPT-2 / Llama-3 / Qwen2 split patterns) never joins the two sides of either;
# a tokenizer that does (SentencePiece's dummy prefix) fails the probe below and gets whole documents.
CUT = re.compile(r"\n(?=\S)|(?<=\S)(?= [A-Za-z])")
PROBE = "Title: a test.\nFirst line, with words 123 and 4567.\n\n  Indented  line\n\tTabbed it's\r\nCRLF line. \u00fcber caf\u00e9\nend"


def text_pieces(text: str, budget: int | None = None) -> list[str]:
    """text cut into pieces of at least `budget` (None: PIECE_CHARS) characters, the last maybe shorter, at CUT points."""
    pieces, start, budget = [], 0, budget or PIECE_CHARS
    while len(text) - start > budget:
        cut = CUT.search(text, start + budget)
        if cut is None:
            break
        pieces.append(text[start : cut.end()])
        start = cut.end()
    return pieces + [text[start:]]


def pieces_keep_tokens(encode: Callable[[str], list[int]], encode_more: Callable[[str], list[int]]) -> bool:
    """True when PROBE, cut at every CUT point, encodes to the tokens of PROBE whole."""
    first, *rest = text_pieces(PROBE, 1)
    return list(encode(first)) + [t for piece in rest for t in encode_more(piece)] == list(encode(PROBE))


def tokenize_documents(documents: list[str], encode: Callable[[str], list[int]], eos_id: int | None,
                       encode_more: Callable[[str], list[int]] | None = None) -> torch.Tensor:
    """One TOKEN_DTYPE token stream; eos_id (if given) ends each document so windows see the border.
    encode: a document's start (with the tokenizer's special tokens); encode_more: text continuing it (none).
    With encode_more and a tokenizer whose tokens do not change at CUT points (pieces_keep_tokens), a document
    is encoded a piece of ~PIECE_CHARS at a time, each piece's ids a compact tensor at once: a Python list
    (~36 bytes a token) never holds more than one piece, however large the document. Otherwise each whole
    document is one list while it is encoded."""
    pieces = text_pieces if encode_more is not None and pieces_keep_tokens(encode, encode_more) else lambda d: [d]
    end = torch.tensor([eos_id] if eos_id is not None else [], dtype=TOKEN_DTYPE)
    parts = []
    for doc in documents:
        for i, piece in enumerate(pieces(doc)):
            parts.append(torch.tensor(list((encode if i == 0 else encode_more)(piece)), dtype=TOKEN_DTYPE))
        parts.append(end)
    return torch.cat(parts) if parts else torch.zeros(0, dtype=TOKEN_DTYPE)


def train_val_split(ids: torch.Tensor, val_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The last val_fraction of the stream is validation: a contiguous tail, so no window of
    validation text also appears in training."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    n_val = int(round(len(ids) * val_fraction))
    return ids[: len(ids) - n_val], ids[len(ids) - n_val :]


class TextWindowDataset(torch.utils.data.Dataset):
    """Windows of max_length tokens every `stride` tokens (default: max_length, no overlap).
    Item i is (input_ids, targets), both int64 [max_length], targets = inputs shifted by one; the
    stream itself is held as TOKEN_DTYPE. Tokens after the last full window are not used."""

    def __init__(self, token_ids, max_length: int, stride: int | None = None):
        self.ids = torch.as_tensor(token_ids).to(TOKEN_DTYPE).flatten()
        self.max_length, self.stride = max_length, stride or max_length
        if max_length < 1 or self.stride < 1:
            raise ValueError(f"max_length and stride must be >= 1, got {max_length}, {self.stride}")
        if len(self.ids) < max_length + 1:
            raise ValueError(f"text has {len(self.ids)} tokens, fewer than max_length + 1 = {max_length + 1}")
        self.starts = range(0, len(self.ids) - max_length, self.stride)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.starts[i]
        window = self.ids[s : s + self.max_length + 1].long()  # int64 [max_length + 1]
        return window[:-1], window[1:]
