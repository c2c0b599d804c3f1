"""Post-hoc EMA: one LoRA averaged from a run's saves after training, as ema_decay averages during it.

    python tools/post_hoc_ema.py out/lora-step*.safetensors out/lora.safetensors --save_to out/lora_phema.safetensors \
        [--decay_per_step 0.999 | --beta 0.95 [--beta_end 0.99] | --sigma_rel 0.1] [--save_precision fp32|bf16|fp16]

The saves are put in the order of the optimizer steps each header records (ss_steps); a file whose header has
none keeps the command line's order for all (and only --beta applies). A save the run also wrote as its EMA
(ss_ema: <name>_ema) is left out, and of two files of one step with equal tensors (a run's last step save and
its final LoRA) the second; two different files of one step are refused. Then, per tensor, in float32:

    e_1 = w_1;   e_i = b_i e_(i-1) + (1 - b_i) w_i,   i = 2 .. n  (the last save weighs most)

    --decay_per_step d   b_i = d ** (s_i - s_(i-1)), s_i the save's step: the training EMA of decay d sampled at
                         the saves; with a save every step it is ema_decay = d started at the first save's step
                         (ema_start_step = s_1), bit for bit (tests/test_post_hoc_ema.py)
    --beta b             b_i = b for every save, or from b to --beta_end linearly over them (musubi-tuner's
                         lora_post_hoc_ema.py)
    --sigma_rel r        Karras et al.'s power-function EMA (EDM2, arXiv 2312.02696: the profile's width
                         relative to the run, r < 0.2887): gamma from r (their Algorithm 2) and
                         b_i = (s_(i-1) / s_i) ** (gamma + 1), which with a save every step is their
                         (1 - 1 / t) ** (gamma + 1). musubi-tuner counts the files instead (its second file
                         gets b = 0 and replaces the first).

Every float tensor is averaged (the LoRA factors, DoRA magnitudes, LyCORIS's); `.alpha` and integer tensors must
be equal in every save (they are the network's settings) and are kept. The saves must hold the same tensors
(names, shapes): saves of one run. A PEFT adapter folder in gives a folder out (its adapter_config.json). The
header is the last save's (its alpha headers too: the layout is the same), with ss_output_name (and
modelspec.title) the output's name and `ss_post_hoc_ema` saying which saves at which weights; sshs_model_hash
is that of the new tensors.
Errors are one line on stderr, exit status 2, and nothing is written.
"""

from __future__ import annotations

import json
import os
import sys

if __package__ in (None, ""):  # run as a script: make `library` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.cli import Parser, check_command_line, exit_without_collecting, one_line, save_precision_name  # noqa: E402

PEER_FLAGS = {"--output_file": "--save_to", "--beta2": "--beta_end",
              "--no_sort": "none: the saves are ordered by the steps in their headers, else as given"}
SIGMA_REL_MAX = 12 ** -0.5  # gamma = 0 (a uniform average over the run): the widest profile


def build_parser() -> Parser:
    parser = Parser(description=__doc__.split("\n\n")[0], peer_flags=PEER_FLAGS)
    parser.add_argument("saves", nargs="+", help="the run's LoRA saves (.safetensors files or PEFT adapter folders)")
    parser.add_argument("--save_to", required=True, help="output .safetensors (or a folder, for PEFT folders)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--decay_per_step", type=float, help="EMA decay per optimizer step (e.g. 0.999)")
    mode.add_argument("--beta", type=float, help="decay per save (musubi-tuner's --beta; its default 0.95)")
    mode.add_argument("--sigma_rel", type=float, help=f"power-function EMA width, 0 < r < {SIGMA_REL_MAX:.4f}")
    parser.add_argument("--beta_end", type=float, help="with --beta: the last save's decay (linear in between)")
    parser.add_argument("--save_precision", type=save_precision_name, choices=["fp32", "bf16", "fp16"], default=None,
                        help="default: the saves' dtype")
    return parser


if __name__ == "__main__":
    check_command_line(build_parser)

import torch  # noqa: E402

from library.io import atomic_folder, write_text  # noqa: E402
from networks.lora_files import (PEFT_CONFIG_FILE, PEFT_WEIGHTS_FILE, peft_folder_of, read_lora_tensors,  # noqa: E402
                                 write_lora_tensors)
from tools.lora_common import check_output_path, check_peft_folder_output, named_as, save_dtype  # noqa: E402


def gamma_of(sigma_rel: float) -> float:
    """EDM2's Algorithm 2: the gamma whose power-function profile has relative width sigma_rel, the root of
    (gamma + 2)^2 (gamma + 3) / (gamma + 1) = sigma_rel^-2 (increasing in gamma >= 0: bisection)."""
    if not 0 < sigma_rel < SIGMA_REL_MAX:
        raise ValueError(f"--sigma_rel {sigma_rel}: expected 0 < r < {SIGMA_REL_MAX:.4f} (r = {SIGMA_REL_MAX:.4f} is a "
                         f"plain average of the whole run, EDM2 uses 0.05-0.10)")
    target, low, high = sigma_rel ** -2, 0.0, 1.0
    width = lambda g: (g + 2) ** 2 * (g + 3) / (g + 1)  # noqa: E731
    while width(high) < target:
        high *= 2
    for _ in range(200):
        mid = (low + high) / 2
        low, high = (mid, high) if width(mid) < target else (low, mid)
    return (low + high) / 2


class Save:
    """One save: its tensors, header, the step it records (None: unknown) and the PEFT folder it is (or None)."""

    def __init__(self, path: str):
        self.path, self.folder = path, peft_folder_of(path)
        self.tensors, self.metadata, _ = read_lora_tensors(path)
        steps = self.metadata.get("ss_steps", "")
        self.step = int(steps) if steps.isdigit() else None


def ordered(saves: list[Save]) -> tuple[list[Save], list[str]]:
    """The saves in step order without EMA files and repeated steps; the lines saying what was left out."""
    emas = [s for s in saves if s.metadata.get("ss_ema") == "true"]
    said = [f"left out {s.path}: an EMA save (ss_ema in its header)" for s in emas]
    saves = [s for s in saves if s not in emas]
    if any(s.step is None for s in saves):
        return saves, said + ["the saves in the command line's order (a header without ss_steps)"]
    kept: dict[int, Save] = {}
    for save in saves:
        other = kept.setdefault(save.step, save)
        if other is save:
            continue
        if not (other.tensors.keys() == save.tensors.keys()
                and all(torch.equal(other.tensors[k], save.tensors[k]) for k in save.tensors)):
            raise ValueError(f"{other.path} and {save.path}: two different saves of step {save.step} (of two runs?)")
        said.append(f"left out {save.path}: the same tensors as {other.path} (step {save.step})")
    return [kept[step] for step in sorted(kept)], said


def decays(saves: list[Save], decay_per_step, beta, beta_end, sigma_rel) -> list[float]:
    """b_2 .. b_n (see the module docstring)."""
    n, steps = len(saves), [s.step for s in saves]
    if (decay_per_step is not None or sigma_rel is not None) and None in steps:
        raise ValueError(f"{saves[steps.index(None)].path}: no ss_steps in its header; --decay_per_step and "
                         f"--sigma_rel weigh the saves by their steps (--beta weighs each save alike)")
    if decay_per_step is not None:
        if not 0 <= decay_per_step < 1:
            raise ValueError(f"--decay_per_step {decay_per_step}: expected 0 <= d < 1")
        return [decay_per_step ** (steps[i] - steps[i - 1]) for i in range(1, n)]
    if sigma_rel is not None:
        if steps[0] < 1:
            raise ValueError(f"{saves[0].path}: a save of step 0 (the initial weights); the power-function EMA starts "
                             f"at step 1: leave it out")
        gamma = gamma_of(sigma_rel)
        return [(steps[i - 1] / steps[i]) ** (gamma + 1) for i in range(1, n)]
    first = 0.95 if beta is None else beta
    last = first if beta_end is None else beta_end
    for flag, b in (("--beta", first), ("--beta_end", last)):
        if not 0 <= b < 1:
            raise ValueError(f"{flag} {b}: expected 0 <= b < 1")
    return [first + (last - first) * (i - 1) / max(n - 2, 1) for i in range(1, n)]


def averaged(saves: list[Save], weights: list[float], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """The EMA of the saves' float tensors (float32, then dtype or the first save's); the rest checked equal."""
    first = saves[0]
    for save in saves[1:]:
        if save.tensors.keys() != first.tensors.keys():
            extra = sorted(save.tensors.keys() ^ first.tensors.keys())[0]
            raise ValueError(f"{save.path}: not the tensors of {first.path} ('{extra}' is in one of them): saves of "
                             f"one run are averaged")
    out = {}
    for key, tensor in first.tensors.items():
        for save in saves[1:]:
            if save.tensors[key].shape != tensor.shape:
                raise ValueError(f"{save.path}: '{key}' has shape {tuple(save.tensors[key].shape)}, {first.path} "
                                 f"{tuple(tensor.shape)}")
        if key.endswith(".alpha") or not tensor.is_floating_point():
            changed = next((s for s in saves[1:] if not torch.equal(s.tensors[key], tensor)), None)
            if changed is not None:
                raise ValueError(f"{changed.path}: '{key}' differs from {first.path}'s (a network setting: saves of "
                                 f"one run keep it)")
            out[key] = tensor
            continue
        ema = tensor.to(torch.float32, copy=True)
        for save, b in zip(saves[1:], weights):  # ema + (1 - b) (w - ema), as the training EMA's lerp
            ema.lerp_(save.tensors[key].to(torch.float32), 1.0 - b)
        out[key] = ema.to(dtype or tensor.dtype)
    return out


def post_hoc_ema(paths: list[str], save_to: str, decay_per_step=None, beta=None, beta_end=None, sigma_rel=None,
                 precision: str | None = None) -> list[str]:
    """Writes the averaged LoRA; returns the lines to print."""
    if beta_end is not None and beta is None:
        raise ValueError("--beta_end goes with --beta (the first save's decay)")
    if save_to.endswith(".safetensors"):  # (a folder: check_peft_folder_output below)
        check_output_path(save_to, *paths)
    saves, said = ordered([Save(p) for p in paths])
    if len(saves) < 2:
        raise ValueError(f"{len(saves)} save{'s' if len(saves) != 1 else ''} left to average (give two or more)")
    folder = saves[-1].folder
    if len({s.folder is None for s in saves}) > 1 or (folder is None) != save_to.endswith(".safetensors"):
        raise ValueError(f"--save_to {save_to}: expected a .safetensors file for .safetensors saves, a folder for PEFT "
                         f"adapter folders (and saves of one kind)")
    if folder is not None:
        if os.path.exists(save_to) and not os.path.isdir(save_to):
            raise ValueError(f"--save_to {save_to}: a file; PEFT saves average into a folder")
        check_peft_folder_output(save_to, *(s.path for s in saves))
    weights = decays(saves, decay_per_step, beta, beta_end, sigma_rel)
    tensors = averaged(saves, weights, save_dtype(precision, None) if precision else None)
    # the saves' own keys and layout: their alpha headers (a diffusers file's adapter config, the PEFT fold mark)
    # describe the average too; write_lora_tensors renews the tensors' hashes
    metadata = named_as(saves[-1].metadata, save_to)
    mode = ({"decay_per_step": decay_per_step} if decay_per_step is not None else
            {"sigma_rel": sigma_rel, "gamma": gamma_of(sigma_rel)} if sigma_rel is not None else
            {"beta": weights[0], "beta_end": weights[-1]})
    metadata["ss_post_hoc_ema"] = json.dumps({**mode, "saves": [
        {"file": os.path.basename(s.path.rstrip(os.sep)), "step": s.step, "decay": b}
        for s, b in zip(saves, [None, *weights])]})
    if folder is None:
        write_lora_tensors(tensors, save_to, metadata)
    else:
        with atomic_folder(save_to) as tmp:
            write_lora_tensors(tensors, os.path.join(tmp, PEFT_WEIGHTS_FILE), metadata)
            with open(os.path.join(folder, PEFT_CONFIG_FILE), encoding="utf-8") as f:
                write_text(os.path.join(tmp, PEFT_CONFIG_FILE), f.read())
    share = final_shares(weights)
    steps = ", ".join(f"{s.step if s.step is not None else os.path.basename(s.path)}: {w:.1%}"
                      for s, w in zip(saves, share))
    return said + [f"{len(saves)} saves -> {save_to} (each save's share of the average, by step: {steps})"]


def final_shares(weights: list[float]) -> list[float]:
    """What each save weighs in the result: w_1 prod(b), then (1 - b_i) prod(b after i)."""
    shares, rest = [], 1.0
    for b in reversed(weights):
        shares.append(rest * (1 - b))
        rest *= b
    return [rest, *reversed(shares)]


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
        lines = post_hoc_ema(args.saves, args.save_to, args.decay_per_step, args.beta, args.beta_end, args.sigma_rel,
                             args.save_precision)
    except (ValueError, OSError) as e:  # CheckpointError is a ValueError
        print(one_line(e), file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    exit_without_collecting(main)
