"""Peak RSS and time of reading and tokenizing an LLM's train_data: the base commit's code against this
tree's check_corpus + tokenize_corpus (read a piece or a line at a time, blocks joined freeing each).
The base's API is told by what it has: 3b1f94a's load_text_corpus + tokenize_documents (every document
held as one str, the token parts joined by one torch.cat; .txt only), then check_corpus(paths,
no_template, all_tokens) + tokenize_corpus (each .jsonl file checked whole, then parsed again while
tokenizing), then check_corpus(paths) + tokenize_corpus (each .jsonl file parsed once).

--format txt: a generated text file of --mb MB (one document: lines of words, numbers, punctuation and a
few characters outside Latin-1, as real text has, so Python holds it 2 bytes a character). --format
jsonl: a .jsonl file of --mb MB, about half {"text": ...} records (5-40 such lines) and half
{"messages": [...]} records (2-8 user / assistant messages), the loss on the replies (a 1-byte mask a
token). Each side runs in a fresh process, alternated --repeats times; each reports its RSS after
imports (the base) and its peak (VmHWM), the token count and the time. The base commit's library comes
from `git archive` of --base into a temporary folder. The encoder is a stand-in that is fast in Python
(runs of up to 4 word characters, punctuation marks: ~1 token per 4 characters, as a real BPE on
English), and so is the chat encoder (each message '<|role|>content<|end|>', the replies' tokens
trained; check_conversation run on each where the side has it, as the whole-file check ran it); the
memory measured is the pipeline's, not the tokenizer's (the tiny byte-level BPE runs at ~250 KB/s on
this CPU: 200 MB would take 13 minutes a side).

    python bench/bench_llm_corpus.py [--mb 200] [--format txt|jsonl] [--base 3b1f94a] [--repeats 1]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import inspect, json, re, sys, time
sys.path.insert(0, sys.argv[1])
import torch
from library.data import text_corpus
try:
    from library.data import chat_records
except ImportError:  # 3b1f94a: no .jsonl records
    chat_records = None

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key)) / 1024

TOKEN = re.compile(r"\w{1,4}|[^\w\s]")
encode = lambda text: [len(t) for t in TOKEN.findall(text)]

def chat(messages, where):
    if hasattr(chat_records, "check_conversation"):  # the checks the whole-file pass made, where they are made now
        chat_records.check_conversation(messages, where, None, False)
    ids, trained = [], []
    for m in messages:
        part = encode("<|" + m["role"] + "|>" + m["content"] + "<|end|>")
        ids += part
        trained += [m["role"] == "assistant"] * len(part)
    return ids, trained

base, start = status("VmRSS:"), time.perf_counter()
if hasattr(text_corpus, "load_text_corpus"):  # 3b1f94a: every document held whole
    ids = text_corpus.tokenize_documents(text_corpus.load_text_corpus([sys.argv[3]]), encode, 0, encode)
elif "no_template" in inspect.signature(text_corpus.check_corpus).parameters:  # a whole-file check, then a read
    files, _ = text_corpus.check_corpus([sys.argv[3]], None, False)
    ids = text_corpus.tokenize_corpus(files, encode, encode, 0, chat)[0]
else:  # each file read once
    ids = text_corpus.tokenize_corpus(text_corpus.check_corpus([sys.argv[3]]), encode, encode, 0, chat)[0]
print(json.dumps({"base_mb": base, "peak_mb": status("VmHWM:"), "tokens": len(ids),
                  "ids_mb": ids.numel() * ids.element_size() / 2**20, "seconds": time.perf_counter() - start}))
"""


def write_text_file(path: str, mb: int) -> int:
    """mb MB of varied lines, written a 4 MB block at a time (each block its own random lines)."""
    rng = random.Random(0)
    words = ["the", "Quick", "brown", "fox's", "12", "3456", "\u00fcber", "caf\u00e9", "--", "...", "it'll", "(x)",
             "model", "training", "window", "tokens", "data\u2014set", "\u20ac5", "loss"]
    written = 0
    with open(path, "w", encoding="utf-8") as f:
        while written < mb << 20:
            block = "\n".join(" ".join(rng.choice(words) for _ in range(rng.randint(0, 14))) for _ in range(80_000)) + "\n"
            f.write(block)
            written += len(block.encode())
    return written


def write_jsonl_file(path: str, mb: int) -> int:
    """mb MB of records, about half "text" (5-40 lines) and half "messages" (2-8 user / assistant turns),
    written a block of 2000 records at a time."""
    rng = random.Random(0)
    words = ["the", "Quick", "brown", "fox's", "12", "3456", "\u00fcber", "caf\u00e9", "--", "...", "it'll", "(x)",
             "model", "training", "window", "tokens", "data\u2014set", "\u20ac5", "loss"]
    line = lambda: " ".join(rng.choice(words) for _ in range(rng.randint(1, 14)))  # noqa: E731
    written = 0
    with open(path, "w", encoding="utf-8") as f:
        while written < mb << 20:
            records = []
            for _ in range(2000):
                if rng.random() < 0.5:
                    records.append({"text": "\n".join(line() for _ in range(rng.randint(5, 40)))})
                else:
                    turns = rng.randint(1, 4)
                    records.append({"messages": [{"role": role, "content": " ".join(line() for _ in range(rng.randint(1, 6)))}
                                                 for _ in range(turns) for role in ("user", "assistant")]})
            block = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
            f.write(block)
            written += len(block.encode())
    return written


def run_side(library: str, side: str, path: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, library, side, path], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=200, help="size of the generated text file, MB")
    parser.add_argument("--base", default="3b1f94a", help="the commit whose text_corpus is 'old'")
    parser.add_argument("--format", default="txt", choices=("txt", "jsonl"), help="one .txt document or .jsonl records")
    parser.add_argument("--repeats", type=int, default=1, help="old / new runs, alternated")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        old_root = os.path.join(tmp, "old")
        os.makedirs(old_root)
        archive = subprocess.run(["git", "-C", ROOT, "archive", args.base, "library"], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", old_root], input=archive, check=True)
        path = os.path.join(tmp, f"corpus.{args.format}")
        start = time.perf_counter()
        size = (write_text_file if args.format == "txt" else write_jsonl_file)(path, args.mb)
        print(f"corpus.{args.format}: {size / 2**20:.0f} MB written in {time.perf_counter() - start:.0f} s")
        results = {"old": [], "new": []}
        for _ in range(args.repeats):
            for side, library in (("old", old_root), ("new", ROOT)):
                r = run_side(library, side, path)
                results[side].append(r)
                print(f"{side}: base {r['base_mb']:.0f} MB, peak {r['peak_mb']:.0f} MB (+{r['peak_mb'] - r['base_mb']:.0f}), "
                      f"{r['tokens']} tokens ({r['ids_mb']:.0f} MB int32), {r['seconds']:.1f} s")
    old, new = (min(r["peak_mb"] - r["base_mb"] for r in results[s]) for s in ("old", "new"))
    old_s, new_s = (min(r["seconds"] for r in results[s]) for s in ("old", "new"))
    print(f"SUMMARY: {size / 2**20:.0f} MB .{args.format} file, peak RSS above imports: old {old:.0f} MB, new {new:.0f} MB "
          f"(new / old {new / old:.2f}); the token ids themselves {results['new'][0]['ids_mb']:.0f} MB; "
          f"time old {old_s:.1f} s, new {new_s:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
