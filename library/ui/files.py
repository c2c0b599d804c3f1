"""The folders the UI may read and write (its configured roots): every path a page reads (a config to
load, a dataset's images and captions, a LoRA to inspect) or writes (a caption, a tool's output) is
resolved, links included, and refused unless it lies inside one of them."""

from __future__ import annotations

import os

from library.atomic_files import write_text


def write_whole(path: str, text: str) -> None:
    """`text` written to `path` (UTF-8) through a fresh temporary beside it renamed over it: a reader (a
    running trainer, training's caption scan) sees the old text or the new, never half of it. (A fixed
    `<path>.tmp` name followed a link placed there out of the roots, and two tabs saving shared it.)"""
    write_text(path, text)


def within(real: str, root: str) -> bool:
    """Whether the real path `real` is `root` or lies below it (a root of "/" too: its "//" prefix matched nothing)."""
    return real == root or real.startswith(root.rstrip(os.sep) + os.sep)


class OutsideRoots(ValueError):
    """A path outside the configured roots; the message names it and the roots."""


class Roots:
    def __init__(self, roots: list[str], workdir: str):
        self.workdir = os.path.realpath(workdir)
        self.roots = [os.path.realpath(os.path.join(self.workdir, r)) for r in roots]

    def resolve(self, path: str, what: str = "path") -> str:
        """The real path of `path` (relative to the working folder), if inside a root; else OutsideRoots."""
        if not path or "\0" in path:
            raise OutsideRoots(f"{what}: no path given")
        real = os.path.realpath(os.path.join(self.workdir, os.path.expanduser(path)))
        if not any(within(real, root) for root in self.roots):
            raise OutsideRoots(f"{what} {path!r} is outside the folders this UI may open ({', '.join(self.roots)}); "
                               f"start tools/webui.py with --root FOLDER to add one")
        return real

    def listing(self, suffixes: tuple[str, ...] = (), folders: bool = False, limit: int = 400,
                depth: int = 5) -> list[str]:
        """Files with one of `suffixes` (and/or folders) under the roots, as the picker's choices:
        relative to the working folder where they lie under it."""
        found: list[str] = []
        seen: set[str] = set()  # a root below another (--root data --root data/set) is walked twice
        for root in self.roots:
            base = root.count(os.sep)
            for folder, dirs, files in os.walk(root):
                dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
                if folder.count(os.sep) - base >= depth:
                    dirs[:] = []
                names = sorted(dirs) if folders else []
                names += sorted(f for f in files if f.endswith(suffixes)) if suffixes else []
                for name in names:
                    if (shown := self.shown(os.path.join(folder, name))) in seen:
                        continue
                    seen.add(shown)
                    found.append(shown)
                    if len(found) >= limit:
                        return found
        return found

    def shown(self, path: str) -> str:
        real = os.path.realpath(path)
        return os.path.relpath(real, self.workdir) if within(real, self.workdir) and real != self.workdir else real
