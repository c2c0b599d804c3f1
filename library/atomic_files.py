"""Files written whole or not at all, torch-free (the web UI writes configs and captions with them
without importing torch; library.io re-exports them beside its checkpoint readers and writers): a
temporary beside the target renamed over it, made as the umask says, a full disk named."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import tempfile


class DiskFullError(OSError):
    """A write that ran out of space; the message names the file and what is left of it."""


def make_parent_folder(path: str) -> str:
    """Create the folder `path` goes in (and its parents); returns it. A file where a folder must
    be is named in the error (os.makedirs would only say 'File exists')."""
    folder = os.path.dirname(os.path.abspath(path))
    blocker = folder
    while not os.path.exists(blocker):
        blocker = os.path.dirname(blocker)
    if not os.path.isdir(blocker):
        raise NotADirectoryError(f"{path}: cannot be written, '{blocker}' is a file, not a folder")
    os.makedirs(folder, exist_ok=True)
    return folder


def umask_mode(mode: int) -> int:
    """`mode` (0o666 for a file, 0o777 for a folder) as the process umask leaves it. The umask is read from
    /proc (Linux): os.umask can only read it by setting it, and a file another thread made meanwhile (the
    web UI's handlers and runners) came out 0o666 / 0o777."""
    with contextlib.suppress(OSError, ValueError, StopIteration):
        with open("/proc/self/status") as f:
            return mode & ~int(next(line for line in f if line.startswith("Umask:")).split()[1], 8)
    umask = os.umask(0)  # no /proc (macOS): set and put back
    os.umask(umask)
    return mode & ~umask


NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


@contextlib.contextmanager
def naming_a_full_disk(path: str, kept: str = "the previous one is kept"):
    """A write of `path` that runs out of space raises DiskFullError naming `path` and saying what
    is `kept` of it (the callers remove their temporaries; whatever was under `path` before is
    still there)."""
    try:
        yield
    except OSError as e:
        if not isinstance(e, DiskFullError) and e.errno not in NO_SPACE:
            raise
        kept = kept if os.path.exists(path) else "nothing was written"
        raise DiskFullError(f"{path}: cannot be written, no space left on device ({kept})") from None


@contextlib.contextmanager
def atomic_path(path: str):
    """Yield a temporary path beside `path`; on success it is renamed over `path` (atomic on
    POSIX), on failure removed. A crash leaves either the old file or the new one, never half."""
    folder = make_parent_folder(path)
    with naming_a_full_disk(path):
        fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=folder)
        os.close(fd)
        try:
            yield tmp
            # After the writer: mkstemp makes 0600, and some writers (safetensors' save_file) rename
            # a 0600 file of their own over `tmp`; the result should look like any written file.
            os.chmod(tmp, umask_mode(0o666))
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)


# The names tempfile gives atomic_path's and atomic_folder's temporaries: "." + the target's name + "." +
# 8 random [a-z0-9_] + ".tmp" (".old": a folder atomic_folder moved aside). Read back by these helpers alone.
LEFT_BEHIND = re.compile(r"\.(.+)\.[a-z0-9_]{8}\.(tmp|old)")


def temporary_name(name: str) -> str:
    """The name of the temporary atomic_path / atomic_folder make for `name`: the longest name a save of
    `name` puts in its folder (the file system's name limit counts it, not `name` alone)."""
    return f".{name}.{'x' * 8}.tmp"


def name_limit(folder: str) -> int:
    """The longest file name (bytes) the file system holding `folder` (or its nearest existing parent)
    takes; 255 (ext4, XFS, btrfs, NTFS) where it does not say."""
    folder = os.path.abspath(folder)
    while not os.path.exists(folder):
        folder = os.path.dirname(folder)
    try:
        return os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


def atomic_target(name: str) -> str | None:
    """The file name an atomic_path temporary named `name` (`.<name>.<random>.tmp`) was written for;
    None where `name` is no such temporary."""
    match = LEFT_BEHIND.fullmatch(name)
    return match.group(1) if match and match.group(2) == "tmp" else None


def left_behind(folder: str, is_target) -> dict[str, list[str]]:
    """What atomic_path / atomic_folder made in `folder` (temporaries, folders moved aside) for the target
    names `is_target(name)` accepts: target name -> those entries' names. All dead where nothing else
    writes those names (a run holding its output lock)."""
    found: dict[str, list[str]] = {}
    for entry in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if (match := LEFT_BEHIND.fullmatch(entry)) and is_target(match.group(1)):
            found.setdefault(match.group(1), []).append(entry)
    return found


def synced_folder(path: str):
    """fsync a folder: the names made, renamed or removed in it are on the disk."""
    if os.name == "nt":  # Windows opens no folder to fsync (NTFS journals its renames)
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def synced_tree(path: str):
    """fsync every file and folder under `path`. A writer's plain open() (torch.save, json.dump) leaves its bytes in
    the page cache: after a power cut the renamed folder could hold empty files (ext4's delayed allocation), and
    the folder it replaced would be gone."""
    for root, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())
        synced_folder(root)


@contextlib.contextmanager
def atomic_folder(path: str):
    """Yield a temporary folder beside `path` to fill; on success it takes the place of `path` (an
    older folder there is moved aside first and removed after), on failure it is removed. A crash
    leaves the old folder, the new one, or the old one under a hidden `.old` name, never a mix."""
    folder = make_parent_folder(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise NotADirectoryError(f"{path}: a file is there; expected a folder (or nothing)")
    with naming_a_full_disk(path):
        tmp = tempfile.mkdtemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=folder)
        os.chmod(tmp, umask_mode(0o777))  # mkdtemp makes 0700
        old = None
        try:
            yield tmp
            synced_tree(tmp)  # the new folder's bytes are on the disk before the old one may go
            if os.path.isdir(path):
                old = tempfile.mkdtemp(prefix="." + os.path.basename(path) + ".", suffix=".old", dir=folder)
                os.replace(path, os.path.join(old, "folder"))
            os.replace(tmp, path)
            synced_folder(folder)  # and so are the renames, before the old folder is removed
        finally:
            if os.path.exists(tmp):
                shutil.rmtree(tmp)
            if old and os.path.isdir(path):  # the old folder goes only once the new one is in place
                shutil.rmtree(old)


def recover_folder(path: str) -> list[str]:
    """Set right what a process killed inside atomic_folder(path) left (SIGKILL, a power cut): the old folder
    put back where it was moved aside and its replacement never took its place (a training state then
    vanished from where --resume looks), the temporaries removed. Only where nothing else writes `path`
    (a run holding its output lock). Returns one line per folder put back."""
    folder, name = os.path.dirname(os.path.abspath(path)), os.path.basename(path)
    said = []
    for entry in left_behind(folder, name.__eq__).get(name, []):
        if not os.path.isdir(hidden := os.path.join(folder, entry)):
            continue
        if entry.endswith(".old") and os.path.isdir(os.path.join(hidden, "folder")) and not os.path.exists(path):
            os.replace(os.path.join(hidden, "folder"), path)
            said.append(f"{path}: put back from {hidden} (a save was killed while it replaced this folder)")
        shutil.rmtree(hidden)
    return said


def write_text(path: str, text: str):
    with atomic_path(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:  # what read_utf8 reads back, whatever the locale
            f.write(text)
