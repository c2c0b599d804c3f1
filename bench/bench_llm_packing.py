"""Best-fit packing (library/data/packing.py) against the stream's windows on a chat-shaped corpus: how many of
the trained (reply) tokens train in a window that does not hold their conversation's first token (a reply cut
from its prompt), the windows a epoch (the compute), the share of window tokens the documents fill, and the
host time of packing (best_fit's segment tree) and of reading every window once.

Conversations: a prompt of 20-200 tokens and a reply of 10-300 (uniform, seed 0), the reply trained; no model,
no tokenizer (ids drawn at random): what is measured is the layout, not the text.

    python bench/bench_llm_packing.py [--conversations 20000] [--max_length 256,1024,2048]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from library.data.packing import PackedWindowDataset  # noqa: E402
from library.data.text_corpus import IGNORE, TextWindowDataset  # noqa: E402


def chat_corpus(conversations: int, seed: int = 0):
    """(ids int32 [N], trained bool [N], starts int64 [D])."""
    rng = random.Random(seed)
    prompts = [rng.randint(20, 200) for _ in range(conversations)]
    replies = [rng.randint(10, 300) for _ in range(conversations)]
    lengths = torch.tensor([p + r for p, r in zip(prompts, replies)])
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]])
    trained = torch.zeros(int(lengths.sum()), dtype=torch.bool)
    for s, p, r in zip(starts.tolist(), prompts, replies):
        trained[s + p : s + p + r] = True
    ids = torch.randint(1, 30000, (len(trained),), dtype=torch.int32)
    return ids, trained, starts


def stream_cut_replies(dataset: TextWindowDataset, trained: torch.Tensor, starts: torch.Tensor) -> int:
    """Trained targets whose window does not hold their conversation's first token."""
    cut = 0
    for s in dataset.starts:
        s = int(s)
        first_target, last_target = s + 1, s + dataset.max_length
        opened = int(torch.searchsorted(starts, torch.tensor(s), right=True)) - 1  # the conversation at s
        if int(starts[opened]) == s:
            continue  # the window opens at a conversation's first token
        end = int(starts[opened + 1]) if opened + 1 < len(starts) else len(trained)
        cut += int(trained[first_target : min(end, last_target + 1)].sum())
    return cut


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=20000)
    parser.add_argument("--max_length", default="256,1024,2048")
    a = parser.parse_args()
    ids, trained, starts = chat_corpus(a.conversations)
    print(f"{a.conversations} conversations, {len(ids)} tokens, {int(trained.sum())} trained (replies); "
          f"torch {torch.__version__}")
    print("| max_length | layout | windows | filled | replies' tokens cut from their prompt | pack s | read all s |")
    print("|---|---|---|---|---|---|---|")
    for length in map(int, a.max_length.split(",")):
        t = time.perf_counter()
        stream = TextWindowDataset(ids, length, trained=trained, document_starts=starts)
        stream_s = time.perf_counter() - t
        t = time.perf_counter()
        packed = PackedWindowDataset(ids, length, trained, starts)
        packed_s = time.perf_counter() - t
        rows = []
        for name, dataset, pack_s in (("stream", stream, stream_s), ("best_fit", packed, packed_s)):
            t = time.perf_counter()
            targets = sum(int((dataset[i][1] != IGNORE).sum()) for i in range(len(dataset)))
            read_s = time.perf_counter() - t
            if name == "stream":
                cut = stream_cut_replies(dataset, trained, starts)
                filled = 1.0
            else:  # a piece that does not open at its conversation's first token: a longer one's continuation
                continued = ~torch.isin(dataset.first, starts)
                cut = sum(int(trained[f + 1 : f + n].sum()) for f, n in
                          zip(dataset.first[continued].tolist(), dataset.sizes[continued].tolist()))
                filled = dataset.filled()
            rows.append(f"| {length} | {name} | {len(dataset)} | {filled:.1%} | {cut} of {targets} "
                        f"({cut / max(targets, 1):.1%}) | {pack_s:.2f} | {read_s:.2f} |")
        print("\n".join(rows))


if __name__ == "__main__":
    main()
