"""Train a tiny LLM from scratch on CPU (4.4 minutes on a busy 2-core machine), with nothing downloaded.

    python tools/llm_quickstart.py --output_dir out/quickstart

The corpus is the docstrings of standard-library modules (present on every Python install),
tokenized with a byte-level BPE trained on the spot (library/data/tokenizer.py). The model is the
project's LLM (library/models/llm.py) at toy size. Each evaluation prints train loss, validation loss and
perplexity; at the end a sample is generated and output_dir receives log.csv, loss.png and a
Hugging Face model folder (model.safetensors, config.json, generation_config.json, tokenizer),
loadable with library.models.llm.load_llm and with transformers' AutoModelForCausalLM / AutoTokenizer.
"""

from __future__ import annotations

import argparse
import csv
import importlib
import inspect
import io
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tools.cli import Parser, check_command_line, check_out_folder, exit_without_collecting  # noqa: E402

# Pure-Python, well-documented modules that import without side effects on every platform.
CORPUS_MODULES = (
    "argparse", "ast", "asyncio", "base64", "bisect", "calendar", "collections", "configparser",
    "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "email.message",
    "enum", "fractions", "functools", "gettext", "glob", "gzip", "heapq", "hmac", "html.parser",
    "http.client", "http.server", "imaplib", "inspect", "ipaddress", "json", "logging", "mailbox",
    "numbers", "operator", "optparse", "os", "pathlib", "pickle", "pprint", "pydoc", "queue",
    "random", "re", "sched", "shlex", "shutil", "smtplib", "socket", "statistics", "string",
    "subprocess", "tarfile", "tempfile", "textwrap", "threading", "tokenize", "traceback",
    "typing", "unittest.case", "urllib.parse", "urllib.request", "uuid", "warnings",
    "weakref", "xml.dom.minidom", "zipfile",
)  # fmt: skip


def stdlib_docstrings(max_chars: int) -> str:
    """Docstrings of CORPUS_MODULES and their public classes, functions and methods, in a fixed
    order (module list order, then names sorted by inspect.getmembers), deduplicated."""
    seen, parts, total = set(), [], 0
    for name in CORPUS_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:  # e.g. turtle without tkinter: skip, the order of the rest holds
            continue
        objects = [module]
        for member_name, obj in inspect.getmembers(module):
            if member_name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                continue
            objects.append(obj)
            if inspect.isclass(obj):
                objects += [m for n, m in sorted(vars(obj).items()) if not n.startswith("_") and callable(m)]
        for obj in objects:
            doc = inspect.getdoc(obj)
            if doc and len(doc) > 40 and doc not in seen:
                seen.add(doc)
                parts.append(doc)
                total += len(doc) + 2
                if total >= max_chars:
                    return "\n\n".join(parts)[:max_chars]
    return "\n\n".join(parts)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output_dir", default="out/quickstart", help="where log.csv, loss.png, the model and tokenizer go")
    p.add_argument("--corpus_chars", type=int, default=500_000, help="characters of stdlib docstrings to use")
    p.add_argument("--vocab_size", type=int, default=1024, help="BPE vocabulary size")
    p.add_argument("--context", type=int, default=128, help="tokens per training sequence")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv_heads", type=int, default=2)
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--max_steps", type=int, default=400)
    p.add_argument("--eval_every", type=int, default=50)
    p.add_argument("--eval_batches", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight_decay", type=float, default=0.1)
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sample_tokens", type=int, default=60)
    return p


def parse_args(argv=None):
    """The arguments, with the model shape checked (a bad one is refused before the tokenizer trains)."""
    try:
        args = build_parser().parse_args(argv)
    except ValueError as e:  # a bad flag (Parser's)
        refuse(str(e))
    if args.heads < 1 or args.kv_heads < 1 or args.heads % args.kv_heads or args.hidden % args.heads:
        refuse(f"--hidden {args.hidden}, --heads {args.heads}, --kv_heads {args.kv_heads}: expected --hidden a multiple "
               f"of --heads and --heads a multiple of --kv_heads")
    if (args.hidden // args.heads) % 2:  # RoPE turns pairs of a head's dimensions (a traceback after the tokenizer)
        refuse(f"--hidden {args.hidden} / --heads {args.heads} = {args.hidden // args.heads}: a head's width must be even")
    if mlp_width(args.hidden) < 32:  # (--hidden 8 trained a model whose MLPs had width 0)
        refuse(f"--hidden {args.hidden}: expected at least 12 (the MLP is 8/3 x hidden, rounded down to a multiple of 32)")
    for key in ("max_steps", "eval_every", "eval_batches", "batch_size", "context", "threads", "layers"):  # 0: a
        if getattr(args, key) < 1:  # division by zero after the tokenizer trained, or nothing trained (no layers)
            refuse(f"--{key} {getattr(args, key)}: expected at least 1")
    if args.vocab_size < 258:  # a traceback from the tokenizer's training
        refuse(f"--vocab_size {args.vocab_size}: expected at least 258 (256 bytes + eos + pad)")
    if not (math.isfinite(args.lr) and args.lr > 0):  # AdamW's traceback, after the tokenizer was written
        refuse(f"--lr {args.lr}: expected a number above 0")
    if not (math.isfinite(args.weight_decay) and args.weight_decay >= 0):
        refuse(f"--weight_decay {args.weight_decay}: expected a number of at least 0")
    try:  # NotADirectoryError's traceback
        check_out_folder("--output_dir", args.output_dir, "the model, tokenizer and log go there")
    except ValueError as e:
        refuse(str(e))
    return args


def mlp_width(hidden: int) -> int:
    """The MLP's width: 8/3 x hidden (a SwiGLU's), rounded down to a multiple of 32."""
    return int(8 * hidden / 3) // 32 * 32


def refuse(message: str):
    """A bad setting: one line on stderr, exit status 2 (as tools/cli.py answers a bad flag)."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


# The arguments are checked before torch and the library load (seconds): --help and a bad flag answer at once.
if __name__ == "__main__":
    check_command_line(build_parser)

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from library.io import atomic_path, write_text  # noqa: E402
from library.models.llm import LLM, LLMConfig, cross_entropy_loss, generate, perplexity, save_hf_folder  # noqa: E402
from library.data.tokenizer import build_bpe_tokenizer  # noqa: E402


def random_batch(tokens: torch.Tensor, batch_size: int, context: int, gen: torch.Generator):
    """(inputs, targets), each [B, context] int64, targets shifted by one token; any start whose window of
    context + 1 tokens fits, the last one included."""
    starts = torch.randint(0, len(tokens) - context, (batch_size,), generator=gen)
    x = torch.stack([tokens[s : s + context] for s in starts.tolist()])
    y = torch.stack([tokens[s + 1 : s + context + 1] for s in starts.tolist()])
    return x, y


@torch.no_grad()
def evaluate(model, tokens, args) -> float:
    """Mean loss over fixed batches (same generator seed each time, so evals are comparable)."""
    model.eval()
    gen = torch.Generator().manual_seed(args.seed + 1)
    losses = [cross_entropy_loss(model(x), y).item() for x, y in (random_batch(tokens, args.batch_size, args.context, gen) for _ in range(args.eval_batches))]
    model.train()
    return sum(losses) / len(losses)


def write_outputs(out_dir: str, rows: list[dict]):
    """log.csv and loss.png, each written atomically."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    write_text(os.path.join(out_dir, "log.csv"), buf.getvalue())

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["step"] for r in rows], [r["train_loss"] for r in rows], label="train")
    ax.plot([r["step"] for r in rows], [r["val_loss"] for r in rows], label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.legend()
    fig.tight_layout()
    with atomic_path(os.path.join(out_dir, "loss.png")) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)


def build_model_and_optimizer(vocab_size: int, args):
    """A toy Llama-style LLM (no biases, untied head), AdamW with decay on matrices only, and a
    linear warmup then linear decay to 10% of the learning rate."""
    config = LLMConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        intermediate_size=mlp_width(args.hidden),
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        qkv_bias=False,
        max_position_embeddings=args.context,
    )
    model = LLM(config)
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    for p in matrices:  # GPT-2 style init; norm weights stay at 1
        torch.nn.init.normal_(p, std=0.02)
    norms = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": matrices, "weight_decay": args.weight_decay}, {"params": norms, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))
    warmup = max(1, args.max_steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) * max(0.1, 1 - s / args.max_steps))
    return model, opt, sched


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t0 = time.time()
    os.makedirs(args.output_dir, exist_ok=True)

    text = stdlib_docstrings(args.corpus_chars)
    tokenizer = build_bpe_tokenizer([text], args.vocab_size, args.output_dir)
    tokens = torch.tensor(tokenizer.encode(text, add_special_tokens=False), dtype=torch.long)
    split = int(0.9 * len(tokens))
    train_tokens, val_tokens = tokens[:split], tokens[split:]
    if len(val_tokens) < args.context + 1:  # the validation tenth must hold one window (the train part is 9x it)
        refuse(f"--corpus_chars {args.corpus_chars}: {len(tokens)} tokens leave the validation tenth {len(val_tokens)}, "
               f"fewer than --context + 1 = {args.context + 1} (raise --corpus_chars or lower --context)")
    print(f"corpus: {len(text):,} chars -> {len(tokens):,} tokens (train {len(train_tokens):,}, val {len(val_tokens):,})")

    model, opt, sched = build_model_and_optimizer(len(tokenizer), args)
    print(f"model: {sum(p.numel() for p in model.parameters()):,} parameters, {model.config}")

    gen = torch.Generator().manual_seed(args.seed)
    rows, recent = [], []
    model.train()
    bar = tqdm(range(1, args.max_steps + 1), desc="train", mininterval=2.0)
    for step in bar:
        x, y = random_batch(train_tokens, args.batch_size, args.context, gen)
        loss = cross_entropy_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        recent.append(loss.item())
        if step == 1 or step % args.eval_every == 0 or step == args.max_steps:
            val = evaluate(model, val_tokens, args)
            train_loss = sum(recent) / len(recent)
            recent = []
            rows.append({"step": step, "train_loss": round(train_loss, 4), "val_loss": round(val, 4), "val_ppl": round(perplexity(val), 2), "lr": f"{sched.get_last_lr()[0]:.3g}", "elapsed_s": round(time.time() - t0, 1)})
            tqdm.write(f"step {step:4d}  train loss {train_loss:.3f}  val loss {val:.3f}  val ppl {perplexity(val):8.1f}")
            write_outputs(args.output_dir, rows)

    model.eval()
    prompt = torch.tensor([tokenizer.encode("Return the", add_special_tokens=False)])
    sample = generate(model, prompt, args.sample_tokens, args.context, temperature=0.8, top_k=40, eos_id=tokenizer.eos_token_id)
    sample_text = tokenizer.decode(sample[0].tolist(), skip_special_tokens=True)
    print(f"sample: {sample_text!r}")
    save_hf_folder(model, args.output_dir, tokenizer)  # loads with load_llm and with transformers' Auto classes
    wall = time.time() - t0
    result = {"val_loss_start": rows[0]["val_loss"], "val_loss_end": rows[-1]["val_loss"], "wall_s": round(wall, 1), "sample": sample_text}
    print(f"val loss {result['val_loss_start']:.3f} -> {result['val_loss_end']:.3f} in {wall:.0f} s; outputs in {args.output_dir}")
    return result


if __name__ == "__main__":
    exit_without_collecting(main)
