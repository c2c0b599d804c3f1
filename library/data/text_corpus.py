"""The LLM's training text: .txt documents -> one token stream (documents joined by EOS) -> a
train / validation split -> fixed windows of max_length + 1 tokens."""

from __future__ import annotations

import os
from typing import Callable

import torch

from library.io import read_utf8


# ----------------------------------------------------------------------------------------------
# LLM text: documents -> one token stream -> fixed windows


def load_text_corpus(paths: str | list[str]) -> list[str]:
    """The documents (one per .txt file) from files and/or folders (their *.txt, sorted)."""
    files = []
    for p in [paths] if isinstance(paths, str) else paths:
        if os.path.isdir(p):
            files += sorted(os.path.join(p, f) for f in os.listdir(p) if f.endswith(".txt"))
        elif os.path.isfile(p):
            files.append(p)
        else:
            raise ValueError(f"{p}: no such text file or folder")
    if not files:
        raise ValueError(f"{paths}: no .txt files found")
    documents = [read_utf8(f) for f in files]
    if not any(d.strip() for d in documents):
        raise ValueError(f"{paths}: all text files are empty")
    return documents


def tokenize_documents(documents: list[str], encode: Callable[[str], list[int]], eos_id: int | None) -> torch.Tensor:
    """One int64 token stream; eos_id (if given) ends each document so windows see the border."""
    ids: list[int] = []
    for doc in documents:
        ids += list(encode(doc)) + ([eos_id] if eos_id is not None else [])
    return torch.tensor(ids, dtype=torch.long)


def train_val_split(ids: torch.Tensor, val_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The last val_fraction of the stream is validation: a contiguous tail, so no window of
    validation text also appears in training."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    n_val = int(round(len(ids) * val_fraction))
    return ids[: len(ids) - n_val], ids[len(ids) - n_val :]


class TextWindowDataset(torch.utils.data.Dataset):
    """Windows of max_length tokens every `stride` tokens (default: max_length, no overlap).
    Item i is (input_ids, targets), both int64 [max_length], targets = inputs shifted by one.
    Tokens after the last full window are not used."""

    def __init__(self, token_ids, max_length: int, stride: int | None = None):
        self.ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()
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
        window = self.ids[s : s + self.max_length + 1]
        return window[:-1], window[1:]
