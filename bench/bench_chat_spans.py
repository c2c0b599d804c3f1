"""Time of encoding one chat conversation with the loss on the replies (chat_records.chat_encoder: the
template's render, the assistant spans, the tokens and their trained flags) against its number of turns:
the base commit's code against this tree's, each in a fresh process (the base's library from `git
archive` of --base into a temporary folder).

The conversation is the tests' many-turn one (tests/test_llm_jsonl.py many_turn_chat: a system message,
`turns` user questions, every third answered through a tool call with two tool results, a last user
message), rendered by the tiny Qwen2 tokenizer with Qwen2.5's ChatML template (QWEN2_CHAT_TEMPLATE).
Each side reports, per turn count, the best of --repeats timings (ms per conversation), the renders
it made and whether its ids and flags equal the base's.

    python bench/bench_chat_spans.py [--base 1308fd2] [--turns 1 3 10 30 100] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The child imports only its side's library: the conversations come from this tree as JSON (the tests'
# module imports train_lora.py, whose imports an old library may lack).
CHILD = r"""
import hashlib, json, sys, time
sys.path.insert(0, sys.argv[1])
from library.data import chat_records
from library.models.tiny_files import QWEN2_CHAT_TEMPLATE, build_qwen_tokenizer

tok = build_qwen_tokenizer()
tok.chat_template = QWEN2_CHAT_TEMPLATE
renders, apply = [0], tok.apply_chat_template
def counted(messages, **kwargs):
    renders[0] += 1
    return apply(messages, **kwargs)
tok.apply_chat_template = counted
encode = chat_records.chat_encoder(tok, all_tokens=False)
out = {}
for turns, chat in json.load(open(sys.argv[2])).items():
    best = float("inf")
    for _ in range(int(sys.argv[3])):
        renders[0] = 0
        start = time.perf_counter()
        ids, trained = encode(chat, "bench.jsonl:1")
        best = min(best, time.perf_counter() - start)
    digest = hashlib.sha256(json.dumps([ids, trained]).encode()).hexdigest()[:12]
    out[turns] = {"messages": len(chat), "ms": best * 1000, "renders": renders[0], "digest": digest}
print(json.dumps(out))
"""


def run_side(library: str, chats: str, repeats: int) -> dict:
    """The child's timings with `library` first on its path; `chats`: a JSON file {turns: conversation}."""
    out = subprocess.run([sys.executable, "-c", CHILD, library, chats, str(repeats)], capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"error: the side with {library}/library failed:\n{out.stderr.strip()}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="1308fd2", help="the commit whose chat_records is 'old'")
    parser.add_argument("--turns", type=int, nargs="+", default=[1, 3, 10, 30, 100])
    parser.add_argument("--repeats", type=int, default=3, help="timings per conversation (the best is kept)")
    args = parser.parse_args()
    sys.path.insert(0, ROOT)
    from tests.test_llm_jsonl import many_turn_chat

    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "-C", ROOT, "archive", args.base, "library"], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        chats = os.path.join(tmp, "chats.json")
        with open(chats, "w") as f:
            json.dump({t: many_turn_chat(t, system=True) for t in args.turns}, f)
        old, new = run_side(tmp, chats, args.repeats), run_side(ROOT, chats, args.repeats)
    print("| turns | messages | old ms (renders) | new ms (renders) | old / new | same ids and flags |")
    print("|---|---|---|---|---|---|")
    for t in map(str, args.turns):
        o, n = old[t], new[t]
        print(f"| {t} | {n['messages']} | {o['ms']:.1f} ({o['renders']}) | {n['ms']:.1f} ({n['renders']}) | "
              f"{o['ms'] / n['ms']:.1f} | {o['digest'] == n['digest']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
