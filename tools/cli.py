"""What the command lines of train_lora.py and tools/ share. Nothing heavy is imported here (no
torch): a script builds its parser and checks its arguments (check_command_line) before it imports
torch and the library, which takes seconds, so --help and a bad flag answer at once.

Abbreviated flags are refused everywhere (argparse's allow_abbrev): `--save_t` for `--save_to` or
`--learning_rat` for `--learning_rate` would otherwise be taken silently, and a flag added later
could change what an old abbreviation means.

The `path[:ratio]` LoRA arguments (generate, merge_lora, combine_loras, precision_doctor) go through
library/lora_spec.py's parser, the one the training config's base_loras uses.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import signal
import sys
from typing import Callable

from library.errors import exit_without_collecting, one_line_warnings  # noqa: F401  (the tools' exit)
from library.lora_spec import MAX_LORA_RATIO, LoRASpec, parse_lora_spec  # noqa: F401  (the tools' --lora: one parser)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Parser(argparse.ArgumentParser):
    """argparse whose errors are a ValueError (one line and exit status 2 through the tool's main)
    and which refuses abbreviated flags. peer_flags: {a peer tool's flag: ours}, for a command line
    brought from sd-scripts or musubi-tuner (--dit, --from_file). A value starting with `~/` is in the
    home folder (home_folder_words)."""

    def __init__(self, *args, peer_flags: dict[str, str] | None = None, **kwargs):
        super().__init__(*args, **{"allow_abbrev": False, **kwargs})
        self.peer_flags = peer_flags or {}

    def parse_known_args(self, args=None, namespace=None):
        """A peer's flag is one line naming ours, before argparse's "required: --model" or "unrecognized"."""
        words = sys.argv[1:] if args is None else list(args)
        theirs = [w.split("=", 1)[0] for w in words if w.split("=", 1)[0] in self.peer_flags]
        theirs = [flag for flag in dict.fromkeys(theirs) if flag not in self._option_string_actions]
        if theirs:
            self.error(f"sd-scripts / musubi-tuner flag{'s' if len(theirs) > 1 else ''}, which this tool names "
                       f"otherwise: " + ", ".join(f"{flag} -> {self.peer_flags[flag]}" for flag in theirs))
        return super().parse_known_args(home_folder_words(words), namespace)

    def error(self, message):
        raise ValueError(message)


# Free text, never a path: a prompt reading "~/..." stays as typed.
TEXT_FLAGS = ("--prompt", "--negative_prompt", "--prefix", "--trigger")


def home_folder_words(words: list[str]) -> list[str]:
    """`~` and `~/x` as the home folder, in a word and in `--flag=~/x`. The shell expands an unquoted `--out ~/x`
    but not `--out=~/x`, and the web UI starts a tool without a shell, passing a job's TOML paths as written (the
    trainer reads `~` in them: config_schema.PATH_KEYS), so generate.py was handed `--model ~/base.safetensors`
    and said it found no such file. `~name` stays (a word, not a home folder)."""
    out, text_value = [], False
    for word in words:
        flag, eq, value = word.partition("=") if word.startswith("--") else ("", "", word)
        if not text_value and flag not in TEXT_FLAGS and (value == "~" or value.startswith("~/")):
            word = flag + eq + os.path.expanduser(value)
        out.append(word)
        text_value = word in TEXT_FLAGS
    return out


def save_precision_name(value: str) -> str:
    """--save_precision's argparse type: sd-scripts' and musubi-tuner's `float` is our fp32 (the training config
    takes it too); argparse checks the choices after this."""
    return "fp32" if value == "float" else value


def one_line(error: Exception) -> str:
    return f"error: {' '.join(str(error).split())}"


def check_png_out(out: str) -> None:
    """A plot's --out is a .png file name, checked before the work: a folder failed after the drawing, naming a
    temporary file."""
    if not out.lower().endswith(".png") or os.path.isdir(out):
        raise ValueError(f"--out {out}: expected a .png file name (the plot is written as a PNG)")


def check_out_folder(flag: str, path: str, what: str) -> None:
    """The folder a tool writes into: a file at `path`, or a file where one of its parents goes, is one
    line before the work, not an OSError after it ('File exists', 'Not a directory')."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{flag} {path}: is a file, expected a folder ({what})")
    blocker = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(blocker):
        blocker = os.path.dirname(blocker)
    if not os.path.isdir(blocker):
        raise ValueError(f"{flag} {path}: cannot be created, '{blocker}' is a file, not a folder")


def check_command_line(build_parser: Callable[[], argparse.ArgumentParser]) -> None:
    """A script run from the shell calls this before its heavy imports: --help prints and exits 0, a
    bad flag prints one line and exits 2. main() parses the same arguments again afterwards. Its
    warnings print as one line each from here on. Output into a pipe its reader closed (`| head`) ends the
    script as it ends `cat`, by SIGPIPE, where Python's default printed a BrokenPipeError traceback (after a
    tool's file was written, say) and exited 1. SIGTERM (the web UI's Stop, `kill`) exits 143 through the
    script's clean-ups (exit_on_sigterm)."""
    if hasattr(signal, "SIGPIPE"):  # POSIX
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    one_line_warnings()
    try:
        build_parser().parse_args()
    except ValueError as e:  # Parser's errors (a plain argparse parser exits by itself)
        print(one_line(e), file=sys.stderr)
        sys.exit(2)


def exit_on_sigterm(signum, frame) -> None:
    """SIGTERM as sys.exit(128 + 15): the `finally` clauses run, so a half-written output's temporary is
    removed (library/atomic_files.atomic_path); Python's default ended the process where it stood and left
    it, hidden (`.merged.safetensors.x1y2.tmp`, a whole checkpoint's size)."""
    raise SystemExit(128 + signum)


def command_line_scripts() -> list[str]:
    """train_lora.py and every tools/*.py that parses a command line, relative to the repository root."""
    tools = sorted(glob.glob(os.path.join(ROOT, "tools", "*.py")))
    return ["train_lora.py"] + [os.path.relpath(p, ROOT) for p in tools if _has_command_line(p)]


def _has_command_line(path: str) -> bool:
    with open(path) as f:
        source = f.read()
    return re.search(r'^if __name__ == "__main__":', source, re.M) is not None and "parse_args(" in source

