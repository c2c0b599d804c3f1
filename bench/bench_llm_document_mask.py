"""What the default attend_across_documents = false costs a training step: forward + backward of a small
Llama-style LLM (fp32, CPU) on one batch of windows, three ways, alternated --repeats times, median:

  one document  every window inside one document: documents None, no mask (SDPA's is_causal path)
  packed        every window holding --documents documents: a [B, 1, L, L] bool block-diagonal mask
                and positions restarting at each (what a batch with any border gets)
  mask only     the same mask machinery with one document a window (the mask's cost alone, had the
                fast path not skipped it)

Prints milliseconds a step and the ratios to "one document" (median, and min: on a CPU that other jobs
share, the min is the steadier of the two).

    python bench/bench_llm_document_mask.py [--length 512] [--batch 4] [--documents 8] [--repeats 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from library.models.llm import LLM, LLMConfig  # noqa: E402


def step_seconds(model: LLM, ids: torch.Tensor, documents: torch.Tensor | None) -> float:
    start = time.perf_counter()
    logits = model(ids, documents=documents)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--documents", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = LLMConfig(vocab_size=2048, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4,
                       intermediate_size=688, qkv_bias=False, max_position_embeddings=args.length)
    model = LLM(config)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.length))
    per = args.length // args.documents
    packed = (torch.arange(args.length) // per).clamp(max=args.documents - 1).expand(args.batch, -1)
    ways = {"one document": None, "packed": packed, "mask only": torch.zeros_like(packed)}
    for documents in ways.values():  # warm-up
        step_seconds(model, ids, documents)
    times = {name: [] for name in ways}
    for _ in range(args.repeats):
        for name, documents in ways.items():
            times[name].append(step_seconds(model, ids, documents))
    base, fastest = statistics.median(times["one document"]), min(times["one document"])
    print(f"LLM 4x256 fp32, batch {args.batch} x {args.length} tokens, {args.documents} documents a packed window, "
          f"{args.threads} thread(s), {args.repeats} alternated repeats: median (and min, steadier on a busy CPU)")
    for name, t in times.items():
        print(f"  {name:13s} {statistics.median(t) * 1e3:8.1f} ms  x{statistics.median(t) / base:.3f}   "
              f"(min {min(t) * 1e3:8.1f} ms  x{min(t) / fastest:.3f})")


if __name__ == "__main__":
    main()
