"""Caching under concurrency: runs over the same images cache and train at once, each holding its
cache folders' .caches.lock shared, and remove unused caches only in a folder no other run holds
(they would remove the files another one reads); the processes of one run each encode their share
of the files, once, and wait for the others'."""

import contextlib
import fcntl
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import train_lora
from library.data import caches, dataset as D
from library import io
from library.data.caches import CACHE_LOCK
from library.data.dataset_config import parse_dataset_config
from library.io import SharedLock, save_safetensors
from library.training.diffusion_task import DiffusionTask
from tests.test_cache_freshness import dataset, encode
from tests.test_dataset import CountingEncoder, make_image, write
from tests.test_train_lora import ROOT, flux_args, free_port


def hold(path: str, held, release):
    """Another run over the same images: holds the lock file `path` shared until `release` is set."""
    lock = SharedLock(path)
    held.set()
    release.wait(30)
    lock.close()


def two_images(tiny_set, tmp_path):
    """(dataset TOML, its image folder with an unused flux latent cache an older run left there)."""
    folder = tmp_path / "img"
    folder.mkdir()
    for name in ("000.png", "000.txt", "002.png", "002.txt"):
        shutil.copy(os.path.join(tiny_set["image_dir"], name), folder / name)
    toml = tmp_path / "ds.toml"
    toml.write_text(f'[[datasets]]\nresolution = 64\n[[datasets.subsets]]\nimage_dir = "{folder}"\n')
    old = folder / "000_flux_0123456789_00000000_48x48.safetensors"
    save_safetensors({"latents": torch.zeros(1)}, str(old), {"content_hash": "0", "model_key": "flux_0123456789"})
    return str(toml), folder, old


def stop_after_caching(monkeypatch):
    """The run ends (exit 130, as a Ctrl-C) where the transformer would load: caching is done."""
    def interrupted(self):
        raise KeyboardInterrupt
    monkeypatch.setattr(DiffusionTask, "_load_base", interrupted)


def test_a_run_beside_another_on_its_cache_folder_trains_and_leaves_the_unused_caches(tiny_set, tmp_path,
                                                                                         monkeypatch, capsys):
    """Two runs over one dataset at once (two learning rates on two GPUs) both train. The old line
    (an exclusive .caches.lock) stopped the second at once, exit 2; before it, the second removed
    the caches the first trains from (here: an older run's 48x48 latents, which neither uses)."""
    toml, folder, old = two_images(tiny_set, tmp_path)
    argv = flux_args(tiny_set, tmp_path / "out", "--dataset_config", toml, "--sample_prompts", "",
                     "--max_train_steps", "1")
    fork = multiprocessing.get_context("fork")
    held, release = fork.Event(), fork.Event()
    holder = fork.Process(target=hold, args=(str(folder / CACHE_LOCK), held, release))
    holder.start()
    try:
        assert held.wait(10)
        assert train_lora.main(argv) == 0
    finally:
        release.set()
        holder.join(10)
    out = capsys.readouterr().out
    assert (f"{folder}: another run is using these caches; unused cache files are left for a run that has the "
            f"folder alone") in out
    assert old.exists() and "files no entry uses were removed" not in out
    assert sum(name.endswith("_te.safetensors") for name in os.listdir(folder)) == 2  # cached beside the other

    # alone in the folder (the other run ended; the lock file it left is no lock): removed as before
    stop_after_caching(monkeypatch)
    assert train_lora.main(argv) == 130
    out = capsys.readouterr().out
    assert "caches: 1 files no entry uses were removed" in out and "another run" not in out and not old.exists()


def test_a_shared_lock_is_alone_only_without_other_holders_and_keeps_its_file(tmp_path):
    """A failed try to be alone lets go of the shared lock under Linux's flock; SharedLock takes it
    back, so the other holder, trying next, is not let in alone either."""
    path = str(tmp_path / "cache" / CACHE_LOCK)
    first, second = SharedLock(path), SharedLock(path)  # two descriptors: two holders to flock
    for lock in (first, second, first):
        with lock.alone() as alone:
            assert alone is False
    second.close()
    probe = os.open(path, os.O_RDONLY)
    with first.alone() as alone:
        assert alone is True
        with pytest.raises(BlockingIOError):  # exclusive: a new holder waits
            fcntl.flock(probe, fcntl.LOCK_SH | fcntl.LOCK_NB)
    fcntl.flock(probe, fcntl.LOCK_SH | fcntl.LOCK_NB)  # shared again after the block
    os.close(probe)
    first.close()
    assert os.path.exists(path)  # never removed (another holder could still hold it)


def try_alone(path: str, both, results, tries: int = 2000):
    """A run that tries alone() `tries` times while another holds the lock too; puts how often it was let in."""
    lock = SharedLock(path)
    both.wait()  # the other holds it from here
    alone = 0
    for _ in range(tries):
        with lock.alone() as ok:
            alone += ok
    both.wait()  # ... to here
    results.put(alone)
    lock.close()


def test_two_holders_trying_to_be_alone_at_once_never_are(tmp_path):
    """Their tries go one at a time (the folder's flock): without it, one's failed try (which lets go
    of its shared lock for microseconds) let the other in alone 311 to 1278 times in 2 x 2000 tries."""
    fork = multiprocessing.get_context("fork")
    both, results = fork.Barrier(2), fork.Queue()
    runs = [fork.Process(target=try_alone, args=(str(tmp_path / CACHE_LOCK), both, results)) for _ in range(2)]
    for run in runs:
        run.start()
    counts = [results.get(timeout=30) for _ in runs]
    for run in runs:
        run.join(10)
    assert counts == [0, 0]


def four_images(root):
    for name in "abcd":
        make_image(root / "img" / f"{name}.png", 32, 32)
        write(root / "img" / f"{name}.txt", f"caption {name}")


def test_one_folder_spelt_two_ways_in_a_run_is_held_once_and_the_run_alone_removes_its_unused_caches(tmp_path):
    """A symlink and its target in one run's datasets: the run held the folder's .caches.lock twice (its
    abspath spellings), its own shared lock kept its exclusive one out, and the cleanup said 'another run
    is using these caches' with no other run. Keyed by the real folder, the run holds it once; the
    removal there keeps the files the symlink's dataset uses (their paths name the same folder)."""
    four_images(tmp_path)
    os.symlink(tmp_path / "img", tmp_path / "link")
    bp = parse_dataset_config({"datasets": [{"resolution": 32, "subsets": [{"image_dir": str(tmp_path / "img")}]},
                                            {"resolution": 16, "min_bucket_reso": 16, "subsets": [
                                                {"image_dir": str(tmp_path / "link")}]}]})
    items = D.ImageDataset(bp).items
    assert caches.cache_latents(items, CountingEncoder().latents, "flux_0123456789", batch_size=2) == 8
    old = tmp_path / "img" / "a_flux_0123456789_00000000_48x48.safetensors"  # an older run's, no entry's
    save_safetensors({"latents": torch.zeros(1)}, str(old), {"content_hash": "0", "model_key": "flux_0123456789"})
    printed = []
    task = SimpleNamespace(args=SimpleNamespace(keep_cache=False, cache_latents_to_disk=True,
                                                cache_text_encoder_outputs_to_disk=False),
                           dataset=SimpleNamespace(items=items), validation_set=SimpleNamespace(items=[]),
                           family=SimpleNamespace(name="flux"),
                           accelerator=SimpleNamespace(is_main_process=True, num_processes=1, print=printed.append))
    with contextlib.ExitStack() as held:
        DiffusionTask._hold_cache_folders(task, held)
        assert list(task._cache_locks) == [os.path.realpath(tmp_path / "img")]  # was both spellings
        DiffusionTask._remove_unused_caches(task, items, [])
    assert not old.exists() and all(os.path.exists(item.latent_cache) for item in items)
    assert len(printed) == 1 and printed[0].startswith("caches: 1 files no entry uses were removed"), printed


def test_two_processes_encode_disjoint_shares_and_every_file_once(tmp_path):
    """The old line had no share: each process of an N-process run encoded every stale file (here
    2 x 4 images and 2 x 4 captions for 4 files each, both writing the same files). The share goes
    by the item's place in the run's list, not among the stale ones: process 1 looks after process 0
    wrote its files (here: one after the other), and still encodes exactly the other half."""
    four_images(tmp_path)
    shares = []
    for process in (0, 1):
        enc, items = CountingEncoder(), D.ImageDataset(dataset(tmp_path)).items
        assert caches.cache_latents(items, enc.latents, "vae-1", batch_size=2, share=(process, 2)) == 2
        assert caches.cache_text(items, enc.text, "te-1", share=(process, 2)) == 2
        assert all(isinstance(item.latent_cache, str) and isinstance(item.text_cache, str) for item in items)
        shares.append((enc.images, sorted(enc.captions)))
    assert shares == [(2, ["caption a", "caption c"]), (2, ["caption b", "caption d"])]
    assert encode(tmp_path, CountingEncoder()) == (0, 0)  # every file written, by one of them
    memory = CountingEncoder()  # kept in memory: each process needs every tensor itself
    assert caches.cache_latents(D.ImageDataset(dataset(tmp_path)).items, memory.latents, "vae-1", to_disk=False,
                                share=(1, 2)) == 4


def test_two_gloo_processes_cache_their_shares_and_the_main_one_the_prompts(tmp_path):
    """DiffusionTask._fill_caches on 2 CPU processes (torch.distributed.run): each encodes 2 of the 4
    images and captions and both print the run's count; the sample prompt ("a dog" and its empty
    negative) is encoded by the main process and read from its file by the other."""
    four_images(tmp_path)
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                          free_port(), "-m", "tests.caching_processes", str(tmp_path)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    # the children's own lines come first in stderr, torchrun's summary of the failure last
    assert run.returncode == 0, run.stderr[:3000] + "\n[...]\n" + run.stderr[-1000:]
    reports = sorted((json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")),
                     key=lambda r: r["process"])
    main, other = reports
    # the sample prompt's negative (the stand-in family's empty one, " "), the prompt, the main process's share
    assert (main["images"], main["captions"]) == (2, [" ", "a dog", "caption a", "caption c"])
    assert (other["images"], other["captions"]) == (2, ["caption b", "caption d"])
    for report in reports:
        assert report["loads"] == ["vae", "text"]
        assert "latents: 4 encoded, 0 reused from disk" in report["printed"]
        assert "captions: 4 encoded, 0 reused from disk" in report["printed"]


def test_the_run_locks_the_cache_folders_it_can_write_until_its_end(tmp_path, monkeypatch):
    """A read-only folder of current caches trains (test_cache_freshness): it is not locked (its lock
    file could not be made); a run whose caches all live in memory locks nothing, and neither does a
    process other than the main one (the lock is the run's). The lock goes at the run's end, its file
    stays."""
    writable, read_only = tmp_path / "a", tmp_path / "b"
    for root in (writable, read_only):
        four_images(root)
    items = [*D.ImageDataset(dataset(writable)).items, *D.ImageDataset(dataset(read_only)).items]
    access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: path != str(read_only / "img") and access(path, mode))
    lock = writable / "img" / CACHE_LOCK
    for to_disk, main, locked in ((False, True, False), (True, False, False), (True, True, True)):
        args = SimpleNamespace(cache_latents_to_disk=to_disk, cache_text_encoder_outputs_to_disk=False)
        task = SimpleNamespace(args=args, dataset=SimpleNamespace(items=items),
                               validation_set=SimpleNamespace(items=[]),
                               accelerator=SimpleNamespace(is_main_process=main, num_processes=1, print=print))
        with contextlib.ExitStack() as held:
            DiffusionTask._hold_cache_folders(task, held)
            assert sorted(task._cache_locks) == ([str(writable / "img")] if locked else [])
            assert lock.exists() == locked and not (read_only / "img" / CACHE_LOCK).exists()
        assert lock.exists() == locked
    probe = os.open(lock, os.O_RDONLY)
    fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)  # let go: a run alone may take it exclusive
    os.close(probe)
    # Where the read-only folder's owner made its lock file, this run holds it too: the owner's run, alone
    # there with another setting, would remove the caches this one reads (it was not locked before).
    (read_only / "img" / CACHE_LOCK).touch()
    with contextlib.ExitStack() as held:
        DiffusionTask._hold_cache_folders(task, held)
        assert sorted(task._cache_locks) == [str(writable / "img"), str(read_only / "img")]
        probe = os.open(read_only / "img" / CACHE_LOCK, os.O_RDONLY)
        with pytest.raises(BlockingIOError):
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.close(probe)


def refused_open(monkeypatch, path, error=PermissionError(13, "Permission denied"), flags: int = 0):
    """os.open of the lock file `path` (with all of `flags`) raises `error`: another user's 0600 file
    (the tests run as root, who may open anything), a read-only mount."""
    real = os.open

    def opener(name, how, *mode):
        if os.fspath(name) == os.fspath(path) and how & flags == flags:
            raise error
        return real(name, how, *mode)
    monkeypatch.setattr(os, "open", opener)


def test_a_run_whose_cache_lock_cannot_be_opened_caches_and_leaves_the_unused_caches(tiny_set, tmp_path,
                                                                                    monkeypatch, capsys):
    """Another user's lock file that this user cannot open at all: the old line stopped the run before
    caching (exit 2, 'error: [Errno 13] Permission denied: ...'; tools/precision_matrix.py: a
    traceback). Now it caches without the lock, says so in one warning line naming the file, why, and
    that the runs holding it cannot see this one (one alone there may remove the caches it reads), and
    removes nothing there (it cannot know who else uses the folder)."""
    toml, folder, old = two_images(tiny_set, tmp_path)
    refused_open(monkeypatch, folder / CACHE_LOCK)
    stop_after_caching(monkeypatch)
    argv = flux_args(tiny_set, tmp_path / "out", "--dataset_config", toml, "--sample_prompts", "")
    assert train_lora.main(argv) == 130
    out, err = capsys.readouterr()
    warnings = [line for line in err.splitlines() if CACHE_LOCK in line]
    assert warnings == [f"warning: cannot open {folder / CACHE_LOCK}: Permission denied; going on without it: a "
                        f"run holding it would not see this one and could remove the caches it reads, and unused "
                        f"caches in {folder} are left as they are"]
    assert old.exists() and "files no entry uses were removed" not in out and "another run" not in out
    assert sum(name.endswith("_te.safetensors") for name in os.listdir(folder)) == 2  # cached all the same


def test_a_run_on_a_file_system_without_flock_leaves_the_unused_caches(tiny_set, tmp_path, monkeypatch, capsys):
    """Some network and FUSE file systems refuse flock (ENOLCK): no other run can be seen there. The old
    line took that for being alone and removed the unused caches, which may be the files another run
    over the same folder reads. Now it warns once and removes nothing there."""
    toml, folder, old = two_images(tiny_set, tmp_path)
    real = fcntl.flock
    def no_flock(fd, operation):
        if os.fstat(fd).st_ino == os.stat(folder / CACHE_LOCK).st_ino:
            raise OSError(37, "No locks available")
        return real(fd, operation)
    monkeypatch.setattr(fcntl, "flock", no_flock)
    stop_after_caching(monkeypatch)
    argv = flux_args(tiny_set, tmp_path / "out", "--dataset_config", toml, "--sample_prompts", "")
    assert train_lora.main(argv) == 130
    out, err = capsys.readouterr()
    assert old.exists() and "files no entry uses were removed" not in out and "another run" not in out
    warnings = [line for line in err.splitlines() if CACHE_LOCK in line]
    assert warnings == [f"warning: {folder / CACHE_LOCK}: this file system cannot lock files; another run using "
                        f"{folder} at the same time would not be seen, so unused caches there are left as they are"]
    assert sum(name.endswith("_te.safetensors") for name in os.listdir(folder)) == 2  # cached all the same


def test_a_lock_file_on_a_read_only_mount_is_held_read_only(tmp_path, monkeypatch):
    """Opening a file for writing on a read-only mount fails with EROFS, not PermissionError: the old
    line raised it instead of holding the file through a read-only descriptor."""
    path = tmp_path / CACHE_LOCK
    path.touch()
    refused_open(monkeypatch, path, OSError(30, "Read-only file system"), flags=os.O_RDWR)
    lock = SharedLock(str(path))
    monkeypatch.undo()
    probe = os.open(path, os.O_RDONLY)
    with pytest.raises(BlockingIOError):  # held shared: no one else is alone
        fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.close(probe)
    lock.close()


def test_an_unopened_lock_is_never_alone(tmp_path, monkeypatch, capsys):
    path = tmp_path / CACHE_LOCK
    refused_open(monkeypatch, path)
    lock = SharedLock(str(path))
    with lock.alone() as alone:
        assert alone is False and lock.fd is None  # not opened
    lock.close()
    assert capsys.readouterr().err.count("warning: cannot open") == 1


def test_a_shared_lock_closed_twice_leaves_the_next_file_open(tmp_path):
    """The old second close() closed whatever file had the descriptor's number by then."""
    path = str(tmp_path / CACHE_LOCK)
    lock = SharedLock(path)
    lock.close()
    other = os.open(path, os.O_RDONLY)  # the lowest free number: the lock's old one
    lock.close()
    os.fstat(other)  # still open (the old line: EBADF)
    os.close(other)


def test_an_interrupt_while_waiting_for_the_lock_leaves_no_descriptor_open(tmp_path, monkeypatch):
    """Ctrl-C while a holder is alone (SharedLock waits for it): the old line left the file open."""
    def interrupted(fd, operation, wait=True):
        raise KeyboardInterrupt
    monkeypatch.setattr(io, "_flock", interrupted)
    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(KeyboardInterrupt):
        SharedLock(str(tmp_path / CACHE_LOCK))
    assert len(os.listdir("/proc/self/fd")) == before


def test_the_precision_matrix_holds_the_cache_folders_it_reads(tmp_path, monkeypatch):
    """tools/precision_matrix.py caches and reads the config's images outside a training run: the old
    line held no lock, so a run alone in the folder could remove the files it was reading."""
    from library.data import dataset as dataset_module
    from tools import precision_matrix

    four_images(tmp_path)
    toml = tmp_path / "ds.toml"
    toml.write_text(f'[[datasets]]\nresolution = 32\n[[datasets.subsets]]\nimage_dir = "{tmp_path / "img"}"\n')
    enc, held = CountingEncoder(), []
    real = dataset_module.read_cache

    def read_cache(cache):
        probe = os.open(tmp_path / "img" / CACHE_LOCK, os.O_RDONLY | os.O_CREAT)
        try:
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
            held.append(False)
        except BlockingIOError:
            held.append(True)
        os.close(probe)
        return real(cache)
    monkeypatch.setattr(dataset_module, "read_cache", read_cache)
    family = SimpleNamespace(load_vae=lambda dtype: SimpleNamespace(encode=enc.latents), latent_cache_key=lambda: "vae-1",
                             text_options=lambda args: {}, load_text_encoder=lambda precision: enc.text,
                             text_cache_key=lambda options, precision: "te-1", name="stub", max_controls=0,
                             min_controls=0, takes_layers=False, text_sees_controls=False, stretches_references=False,
                             reference_mode="RGB", control_bucket=lambda bucket, size, resolution: bucket,  # no edit family
                             reference_resize=lambda bucket, size: None)
    args = SimpleNamespace(dataset_config=str(toml), seed=0, vae_batch_size=2, text_encoder_precision="bf16",
                           cache_latents_to_disk=True, cache_text_encoder_outputs_to_disk=True)
    data = precision_matrix.eval_data(args, family, max_items=2)
    assert len(data) == 2 and held == [True, True]
    probe = os.open(tmp_path / "img" / CACHE_LOCK, os.O_RDONLY)
    fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)  # let go once read
    os.close(probe)
