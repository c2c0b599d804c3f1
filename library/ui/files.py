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


WALK_LIMIT = 20_000  # entries a picker's walk collects in each root before it keeps the newest of them


def _modified(path: str) -> float:
    try:
        return os.stat(path).st_mtime
    except OSError:  # gone since the walk, a link to nothing
        return 0.0


def read_from(path: str, base: str) -> str:
    """Where a relative path was read from, for a refusal: the folder the UI runs in (the repository), not a
    root (the refusal said only "--root FOLDER": a path relative to a root was refused unexplained)."""
    if os.path.isabs(os.path.expanduser(path)):
        return ""
    return f" (relative: read from {base}, so {os.path.realpath(os.path.join(base, os.path.expanduser(path)))})"


class OutsideRoots(ValueError):
    """A path outside the configured roots; the message names it and the roots."""


class Roots:
    def __init__(self, roots: list[str], workdir: str):
        self.workdir = os.path.realpath(workdir)
        # each once: a default root given again with --root was listed (and walked) twice
        self.roots = list(dict.fromkeys(os.path.realpath(os.path.join(self.workdir, r)) for r in roots))

    def resolve(self, path: str, what: str = "path") -> str:
        """The real path of `path` (relative to the working folder), if inside a root; else OutsideRoots."""
        if not path or "\0" in path:
            raise OutsideRoots(f"{what}: no path given")
        real = os.path.realpath(os.path.join(self.workdir, os.path.expanduser(path)))
        if not any(within(real, root) for root in self.roots):
            raise OutsideRoots(f"{what} {path!r}{read_from(path, self.workdir)} is outside the folders this UI may "
                               f"open ({', '.join(self.roots)}); start tools/webui.py with --root FOLDER to add one")
        return real

    def listing(self, suffixes: tuple[str, ...] = (), folders: bool = False, limit: int = 400,
                depth: int = 5) -> list[str]:
        """Files with one of `suffixes` (and/or folders) under the roots, as the picker's choices:
        relative to the working folder where they lie under it. Over `limit`, the newest `limit` of them (the
        first 400 in walk order left out the LoRAs of the newest jobs: the jobs folder is the last root)."""
        found: dict[str, str] = {}  # shown -> path; a root below another (--root data --root data/set) walked twice
        for root in self.roots:
            base, before = root.count(os.sep), len(found)
            for folder, dirs, files in os.walk(root):
                dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
                if folder.count(os.sep) - base >= depth:
                    dirs[:] = []
                names = sorted(dirs) if folders else []
                names += sorted(f for f in files if f.endswith(suffixes)) if suffixes else []
                for name in names:
                    found.setdefault(self.shown(os.path.join(folder, name)), os.path.join(folder, name))
                if len(found) - before >= WALK_LIMIT:  # a root of "/" stops its own walk, not the roots after it
                    break
        if len(found) <= limit:
            return list(found)
        kept = set(sorted(found, key=lambda shown: _modified(found[shown]), reverse=True)[:limit])
        return [shown for shown in found if shown in kept]

    def shown(self, path: str) -> str:
        real = os.path.realpath(path)
        return os.path.relpath(real, self.workdir) if within(real, self.workdir) and real != self.workdir else real
