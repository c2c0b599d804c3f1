"""Reliability through whole runs (tests/test_reliability.py's helpers): the image caches redone for exactly the
edited entries, two runs into one output, processes without a process group, and every output written with the
umask's mode."""

import json
import os
import socket
import subprocess
import sys

import torch
from PIL import Image

import train_lora
from tests.test_reliability import copy_dataset, files_under, flux_args, fp8_checkpoint, one_error_line
from tests.test_train_lora import sample_png
from tools import merge_lora

# ----------------------------------------------------------------------------------------------
# Caches through the trainer: an edited caption or a replaced image redoes exactly that entry


def test_edited_caption_and_replaced_image_re_encode_exactly_those_entries(tiny_set, tmp_path, capsys):
    cfg = copy_dataset(tiny_set, tmp_path / "data")
    images = tmp_path / "data" / "images"
    args = flux_args(tiny_set, tmp_path / "out", "--dataset_config", cfg)
    assert train_lora.main(args) == 0
    assert "latents: 8 encoded, 0 reused from disk" in capsys.readouterr().out
    caches = {f: (images / f).stat().st_mtime_ns for f in os.listdir(images) if f.endswith(".safetensors")}
    assert len(caches) == 16  # one latent and one text cache per image

    (images / "003.txt").write_text("a purple triangle on a grey background")
    with Image.open(images / "004.png") as img:  # same size, so the same bucket: other pixels
        Image.new("RGB", img.size, (90, 10, 200)).save(images / "004.png")
    assert train_lora.main(args) == 0
    out = capsys.readouterr().out
    assert "latents: 1 encoded, 7 reused from disk" in out and "captions: 1 encoded, 7 reused from disk" in out, out
    rewritten = sorted(f for f, t in caches.items() if (images / f).stat().st_mtime_ns != t)
    assert len(rewritten) == 2 and rewritten[0].startswith("003_") and rewritten[0].endswith("_te.safetensors")
    assert rewritten[1].startswith("004_") and not rewritten[1].endswith("_te.safetensors"), rewritten


def test_an_image_in_two_datasets_is_one_file_encoded_not_reused_from_disk(tiny_set, tmp_path, capsys):
    """The same folder as two datasets at one resolution: 16 items, 8 files of each kind, all encoded by this run.
    The count was of items: "8 encoded, 8 reused from disk" on a first run with no cache on disk."""
    cfg = copy_dataset(tiny_set, tmp_path / "data")
    with open(cfg, "a") as f:
        f.write(f'[[datasets]]\n[[datasets.subsets]]\nimage_dir = "{tmp_path / "data" / "images"}"\n')
    assert train_lora.main(flux_args(tiny_set, tmp_path / "out", "--dataset_config", cfg)) == 0
    out = capsys.readouterr().out
    assert "latents: 8 encoded, 0 reused from disk" in out and "captions: 8 encoded, 0 reused from disk" in out, out
    assert train_lora.main(flux_args(tiny_set, tmp_path / "out", "--dataset_config", cfg,
                                     "--cache_latents_to_disk", "false")) == 0
    assert "latents: 16 encoded (kept in memory)" in capsys.readouterr().out


def test_a_pre_quantized_fp8_checkpoint_trains_as_it_is(tiny_set, tmp_path):
    extra, _ = fp8_checkpoint(tiny_set, tmp_path, "true")
    out = tmp_path / "out"
    assert train_lora.main(flux_args(tiny_set, out, *extra, "--fp8_scaled", "false", "--max_train_steps", "2",
                                     "--sample_prompts", "")) == 0
    assert (out / "tiny_flux_lora.safetensors").exists()


# ----------------------------------------------------------------------------------------------
# Two runs into one output, processes without a process group, a full disk, files others read


def test_a_second_run_into_the_same_output_is_refused_and_a_stale_lock_is_taken_over(tiny_set, tmp_path, monkeypatch,
                                                                                     capsys):
    from library.training.diffusion_task import DiffusionTask

    out = tmp_path / "out"
    out.mkdir()
    lock = out / ".tiny_flux_lora.lock"
    ended = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                               text=True, check=True).stdout)
    lock.write_text(json.dumps({"pid": ended, "host": socket.gethostname()}))  # left by a killed run
    second = {}

    def after_step(self, step, output_dir):  # while the first run trains, a second one starts into its folder
        if not second:
            second["first_err"] = capsys.readouterr().err
            second["line"] = one_error_line(capsys, train_lora.main(flux_args(tiny_set, out)))

    monkeypatch.setattr(DiffusionTask, "after_step", after_step)
    capsys.readouterr()
    assert train_lora.main(flux_args(tiny_set, out, "--max_train_steps", "2")) == 0
    assert f"{lock}: held by pid {os.getpid()} on host {socket.gethostname()}" in second["line"], second["line"]
    assert "choose another output_dir or output_name" in second["line"]
    warnings = [line for line in second["first_err"].splitlines() if line.startswith("warning: ")]
    assert warnings == [f"warning: {lock}: taking over the lock of pid {ended} on host {socket.gethostname()}, "
                        f"which ended without releasing it"], second["first_err"]
    with open(out / "tiny_flux_lora_log.csv") as f:
        assert [int(row.split(",")[0]) for row in f.read().splitlines()[1:]] == [1, 2]  # the first run's rows only
    assert not lock.exists()


def test_processes_started_without_a_process_group_are_refused(tiny_set, tmp_path, monkeypatch, capsys):
    """What torchrun (or accelerate launch with the multi-GPU yaml) sets in its second process on a
    machine without GPUs: accelerate finds no backend and each process would train alone."""
    for name, value in {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    # accelerate joins torch's default group there (under torchrun both processes meet) and then
    # ignores it; here there is no second process to meet, so the joining is skipped.
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda *args, **kwargs: None)
    out = tmp_path / "out"
    capsys.readouterr()
    line = one_error_line(capsys, train_lora.main(flux_args(tiny_set, out)))
    assert "WORLD_SIZE=2 but no process group was set up" in line, line
    assert "ACCELERATE_USE_CPU=1" in line and "gloo" in line, line
    assert files_under(out) == []


def test_the_umask_is_read_without_being_set(monkeypatch):
    """Old: os.umask(0) then back: a file another thread (the web UI's runner, a handler) made in between came
    out 0o666 / a folder 0o777. Read from /proc/self/status now (set and put back only without /proc)."""
    from library.atomic_files import umask_mode

    umask = os.umask(0o027)
    try:
        set_to = []
        monkeypatch.setattr(os, "umask", lambda mask: set_to.append(mask) or 0o027)
        assert (umask_mode(0o666), umask_mode(0o777), set_to) == (0o640, 0o750, [])
    finally:
        monkeypatch.undo()
        os.umask(umask)


def test_every_output_is_written_with_the_umask_mode(tiny_set, tmp_path):
    """umask 027 (group reads, others nothing): neither mkstemp's 0600 nor a hard-coded 0644."""
    cfg = copy_dataset(tiny_set, tmp_path / "data")  # caches of its own, written by this run
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle --w 32 --h 32 --s 1\n")
    out, merged = tmp_path / "out", tmp_path / "merged.safetensors"
    umask = os.umask(0o027)
    try:
        assert train_lora.main(flux_args(tiny_set, out, "--dataset_config", cfg, "--save_state", "true",
                                         "--sample_prompts", str(prompts))) == 0
        assert merge_lora.main(["--model", tiny_set["flux_bfl"], "--lora", str(out / "tiny_flux_lora.safetensors"),
                                "--save_to", str(merged)]) == 0
    finally:
        os.umask(umask)
    written = [out / f for f in files_under(out)] + [merged]
    written += [p for p in (tmp_path / "data" / "images").iterdir() if p.suffix == ".safetensors"]
    for path in [out / n for n in ("tiny_flux_lora.safetensors", "tiny_flux_lora_log.csv",
                                   "tiny_flux_lora-state/trainable.safetensors", "tiny_flux_lora-state/optimizer.pt")] + [
            sample_png(out, "tiny_flux_lora", "final")]:
        assert path in written, path
    assert sum(p.name.endswith("_te.safetensors") for p in written) == 8 + 1 and len(written) >= 16 + 6
    modes = {str(p.relative_to(tmp_path)): oct(p.stat().st_mode & 0o777) for p in written}
    assert modes == dict.fromkeys(modes, "0o640")
    assert oct((out / "tiny_flux_lora-state").stat().st_mode & 0o777) == "0o750"
