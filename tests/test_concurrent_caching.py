"""Caching under concurrency: a run holds its cache folders (.caches.lock) while it caches and
trains, so a second run over them stops at once (or waits, with cache_lock_wait) instead of
removing the files the first one reads; the processes of one run each encode their share of the
files, once, and wait for the others'."""

import json
import multiprocessing
import os
import shutil
import socket
import subprocess
import sys
import threading

import pytest
import torch

import train_lora
from library.data import caches, dataset as D
from library.io import held_lock, save_safetensors
from library.training import run_locks
from library.training.diffusion_task import CACHE_LOCK, DiffusionTask
from tests.test_cache_freshness import dataset, encode
from tests.test_dataset import CountingEncoder, make_image, write
from tests.test_train_lora import ROOT, flux_args, free_port


def hold(path: str, held, release):
    """Another run: holds the lock file `path` until `release` is set."""
    with held_lock(path, "another run's advice"):
        held.set()
        release.wait(30)


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


def test_a_second_run_stops_at_once_on_a_held_cache_folder_and_waits_when_told(tiny_set, tmp_path, monkeypatch,
                                                                                 capsys):
    """The old line had no cache lock: the second run cached beside the first and removed the caches
    the first one trains from (here: the older run's 48x48 latents, which it does not use)."""
    toml, folder, old = two_images(tiny_set, tmp_path)
    argv = flux_args(tiny_set, tmp_path / "out", "--dataset_config", toml, "--sample_prompts", "")
    lock = str(folder / CACHE_LOCK)
    fork = multiprocessing.get_context("fork")
    held, release = fork.Event(), fork.Event()
    holder = fork.Process(target=hold, args=(lock, held, release))
    holder.start()
    try:
        assert held.wait(10)
        files = sorted(os.listdir(folder))
        assert train_lora.main(argv) == 2
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert line.startswith(f"error: {lock}: held by pid {holder.pid} on host {socket.gethostname()} (since ")
        assert line.endswith("set cache_lock_wait = true to wait for it, or give this run another cache_dir")
        assert sorted(os.listdir(folder)) == files  # nothing cached, nothing removed

        # cache_lock_wait: the run waits until the other one ends, then caches (and removes the old file)
        monkeypatch.setattr(run_locks, "WAIT_POLL_S", 0.05)
        stop_after_caching(monkeypatch)
        threading.Timer(0.5, release.set).start()
        assert train_lora.main([*argv, "--cache_lock_wait", "true"]) == 130
    finally:
        release.set()
        holder.join(10)
    out = capsys.readouterr().out
    assert f"{lock}: held by pid {holder.pid}" in out and "waiting for it to end (cache_lock_wait = true)" in out
    assert "caches: 1 files no entry uses were removed" in out and not old.exists()
    assert not os.path.exists(lock)  # let go at the run's end (here a Ctrl-C)


def test_a_lock_file_left_by_a_killed_run_does_not_block(tiny_set, tmp_path, monkeypatch, capsys):
    toml, folder, _ = two_images(tiny_set, tmp_path)
    (folder / CACHE_LOCK).write_text('{"pid": 999999, "host": "gone"}')  # no process holds its flock
    stop_after_caching(monkeypatch)
    assert train_lora.main(flux_args(tiny_set, tmp_path / "out", "--dataset_config", toml, "--sample_prompts", "")) == 130
    assert "taking over the lock of pid 999999 on host gone" in capsys.readouterr().err
    assert not (folder / CACHE_LOCK).exists() and any(name.endswith("_te.safetensors") for name in os.listdir(folder))


def four_images(root):
    for name in "abcd":
        make_image(root / "img" / f"{name}.png", 32, 32)
        write(root / "img" / f"{name}.txt", f"caption {name}")


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
    assert run.returncode == 0, run.stderr[-2000:]
    reports = sorted((json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")),
                     key=lambda r: r["process"])
    main, other = reports
    assert (main["images"], main["captions"]) == (2, ["", "a dog", "caption a", "caption c"])
    assert (other["images"], other["captions"]) == (2, ["caption b", "caption d"])
    for report in reports:
        assert report["loads"] == ["vae", "text"]
        assert "latents: 4 encoded, 0 reused from disk" in report["printed"]
        assert "captions: 4 encoded, 0 reused from disk" in report["printed"]


def test_the_run_locks_the_cache_folders_it_can_write_until_its_end(tmp_path, monkeypatch):
    """A read-only folder of current caches trains (test_cache_freshness): it is not locked (its lock
    file could not be made), and a run whose caches all live in memory locks nothing."""
    import contextlib
    from types import SimpleNamespace

    writable, read_only = tmp_path / "a", tmp_path / "b"
    for root in (writable, read_only):
        four_images(root)
    items = [*D.ImageDataset(dataset(writable)).items, *D.ImageDataset(dataset(read_only)).items]
    access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: path != str(read_only / "img") and access(path, mode))
    for to_disk, locked in ((False, False), (True, True)):
        args = SimpleNamespace(cache_latents_to_disk=to_disk, cache_text_encoder_outputs_to_disk=False,
                               cache_lock_wait=False)
        task = SimpleNamespace(args=args, dataset=SimpleNamespace(items=items), validation_set=SimpleNamespace(items=[]),
                               accelerator=SimpleNamespace(is_main_process=True, num_processes=1, print=print))
        with contextlib.ExitStack() as held:
            DiffusionTask._hold_cache_folders(task, held)
            assert (writable / "img" / CACHE_LOCK).exists() == locked
            assert not (read_only / "img" / CACHE_LOCK).exists()
        assert not (writable / "img" / CACHE_LOCK).exists()
