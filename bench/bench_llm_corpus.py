"""Peak RSS of reading and tokenizing an LLM's train_data: the base commit's load_text_corpus +
tokenize_documents (every document held as one str, the token parts joined by one torch.cat) against
this tree's check_corpus + tokenize_corpus (read a piece at a time, blocks joined freeing each).

A generated text file of --mb MB (one document: lines of words, numbers, punctuation and a few
characters outside Latin-1, as real text has, so Python holds it 2 bytes a character) is tokenized
in a fresh process per side, alternated --repeats times; each process reports its RSS after imports
(the base) and its peak (VmHWM), and the token count. The base commit's library comes from
`git archive` of --base into a temporary folder. The encoder is a stand-in that is fast in Python
(runs of up to 4 word characters, punctuation marks: ~1 token per 4 characters, as a real BPE on
English); the memory measured is the pipeline's, not the tokenizer's (the tiny byte-level BPE runs at
~250 KB/s on this CPU: 200 MB would take 13 minutes a side).

    python bench/bench_llm_corpus.py [--mb 200] [--base 3b1f94a] [--repeats 1]
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
import json, re, sys, time
sys.path.insert(0, sys.argv[1])
import torch
from library.data import text_corpus

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key)) / 1024

TOKEN = re.compile(r"\w{1,4}|[^\w\s]")
encode = lambda text: [len(t) for t in TOKEN.findall(text)]
base, start = status("VmRSS:"), time.perf_counter()
if sys.argv[2] == "old":
    ids = text_corpus.tokenize_documents(text_corpus.load_text_corpus([sys.argv[3]]), encode, 0, encode)
else:
    files, _ = text_corpus.check_corpus([sys.argv[3]], None, False)
    ids = text_corpus.tokenize_corpus(files, encode, encode, 0).ids
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


def run_side(library: str, side: str, path: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, library, side, path], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=200, help="size of the generated text file, MB")
    parser.add_argument("--base", default="3b1f94a", help="the commit whose text_corpus is 'old'")
    parser.add_argument("--repeats", type=int, default=1, help="old / new runs, alternated")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        old_root = os.path.join(tmp, "old")
        os.makedirs(old_root)
        archive = subprocess.run(["git", "-C", ROOT, "archive", args.base, "library"], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", old_root], input=archive, check=True)
        path = os.path.join(tmp, "corpus.txt")
        start = time.perf_counter()
        size = write_text_file(path, args.mb)
        print(f"corpus.txt: {size / 2**20:.0f} MB written in {time.perf_counter() - start:.0f} s")
        results = {"old": [], "new": []}
        for _ in range(args.repeats):
            for side, library in (("old", old_root), ("new", ROOT)):
                r = run_side(library, side, path)
                results[side].append(r)
                print(f"{side}: base {r['base_mb']:.0f} MB, peak {r['peak_mb']:.0f} MB (+{r['peak_mb'] - r['base_mb']:.0f}), "
                      f"{r['tokens']} tokens ({r['ids_mb']:.0f} MB int32), {r['seconds']:.1f} s")
    old, new = (min(r["peak_mb"] - r["base_mb"] for r in results[s]) for s in ("old", "new"))
    print(f"SUMMARY: {size / 2**20:.0f} MB text file, peak RSS above imports: old {old:.0f} MB, new {new:.0f} MB "
          f"(new / old {new / old:.2f}); the token ids themselves {results['new'][0]['ids_mb']:.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
