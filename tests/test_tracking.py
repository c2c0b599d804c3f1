"""Trackers (library/training/tracking.py): sample images reach TensorBoard beside the scalars, at
the step they were rendered, equal to the PNGs on disk; log_with is checked when the config loads."""

import csv
import glob
import os
import time

import numpy as np
import torch
import pytest
from PIL import Image

import train_lora
from library.training import tracking
from tests.test_train_lora import flux_args, sample_png


def runs(logging_dir) -> dict[str, str]:
    """{run folder name: the folder of its scalar events} (<logging_dir>/<run>/<project>/, not hparams/)."""
    found = glob.glob(os.path.join(logging_dir, "*", "*", "events.out.tfevents.*"))
    return {os.path.relpath(p, logging_dir).split(os.sep)[0]: os.path.dirname(p) for p in found}


def events(logging_dir, run=None):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folders = runs(logging_dir)
    if run is None:  # the one run
        (run,) = folders
    acc = EventAccumulator(folders[run], size_guidance={"images": 0, "scalars": 0})
    acc.Reload()
    return acc


def test_samples_are_logged_to_tensorboard_beside_loss_at_their_step(tiny_set, tmp_path):
    out, logs = tmp_path / "run", tmp_path / "logs"
    code = train_lora.main(flux_args(tiny_set, out, "--max_train_steps", "4", "--sample_every_n_steps", "2",
                                     "--logging_dir", str(logs), "--sample_bf16_reference", "false"))
    assert code == 0
    acc = events(logs)
    assert "loss" in acc.Tags()["scalars"]
    prompts = sorted({p.split("_")[-3] for p in os.listdir(out) if p.endswith(".png") and "_step" in p})  # their NN
    assert acc.Tags()["images"] == [f"samples/{i:02d}" for i in range(len(prompts))]
    first = acc.Images("samples/00")
    assert [e.step for e in first] == [2, 4]  # step 2, then the final samples (step 4's)
    decoded = np.asarray(Image.open(__import__("io").BytesIO(first[0].encoded_image_string)).convert("RGB"))
    on_disk = np.asarray(Image.open(sample_png(out, "tiny_flux_lora", "step000002")).convert("RGB"))
    assert np.array_equal(decoded, on_disk)


def test_each_fresh_run_logs_into_its_own_folder_and_a_resume_continues_its_own(tiny_set, tmp_path, monkeypatch):
    """Two fresh runs with one logging_dir and output_name wrote into one logs/<output_name>/ folder, which
    TensorBoard drew as one run with two loss values per step; now each gets <output_name>_<start time>
    (sd-scripts' log_prefix + YYYYmmddHHMMSS; _2 when the second is taken), and a run resumed from a
    state continues the folder of the run that wrote it, each step once."""
    monkeypatch.setattr(tracking.time, "strftime", lambda fmt, *t: "20260105143000")  # both start in one second
    logs = tmp_path / "logs"
    common = ("--logging_dir", str(logs), "--sample_prompts", "", "--save_state", "true")
    for out in ("a", "b"):
        assert train_lora.main(flux_args(tiny_set, tmp_path / out, "--max_train_steps", "2", *common)) == 0
    state = tmp_path / "b" / "tiny_flux_lora-state"
    assert train_lora.main(flux_args(tiny_set, tmp_path / "b", "--max_train_steps", "4", *common,
                                     "--resume", str(state))) == 0
    first, second = "tiny_flux_lora_20260105143000", "tiny_flux_lora_20260105143000_2"
    assert sorted(runs(logs)) == [first, second]
    assert [e.step for e in events(logs, first).Scalars("loss")] == [1, 2]
    # sorted: TensorBoard reads a folder's event files by name (<seconds>.<host>.<pid>.<counter>), and two in
    # one second and one process sort by the counter as text (10 before 9): the order of files, not of steps
    assert sorted(e.step for e in events(logs, second).Scalars("loss")) == [1, 2, 3, 4]


def test_two_runs_starting_together_claim_different_folders(tmp_path, monkeypatch):
    """Two runs of one config launched together (two learning rates on two GPUs) both checked the name
    before either's TensorBoard writer made the folder: both took it, their curves mixed in one run. The
    main process now claims the folder as it names it (mkdir); the other processes of a run claim nothing."""
    monkeypatch.setattr(tracking.time, "strftime", lambda fmt, *t: "20260105143000")
    logs = tmp_path / "logs"
    names = [tracking.run_folder(str(logs), None, "lora", claim=True) for _ in range(2)]
    assert names == ["lora_20260105143000", "lora_20260105143000_2"]
    assert sorted(os.listdir(logs)) == names
    assert tracking.run_folder(str(logs), None, "lora") == "lora_20260105143000_3"  # a non-main process
    assert sorted(os.listdir(logs)) == names


def test_log_with_is_checked_when_the_config_loads(tiny_set, tmp_path, capsys, monkeypatch):
    assert train_lora.main(flux_args(tiny_set, tmp_path / "a", "--log_with", "tensorboard")) == 2
    assert "log_with = 'tensorboard' logs TensorBoard events to logging_dir, which is not set" in capsys.readouterr().err
    monkeypatch.setattr(tracking.importlib.util, "find_spec", lambda name: None)
    assert train_lora.main(flux_args(tiny_set, tmp_path / "b", "--log_with", "wandb")) == 2
    assert "needs the wandb package, which is not installed" in capsys.readouterr().err
    assert train_lora.main(flux_args(tiny_set, tmp_path / "c", "--log_with", "mlflow")) == 2
    assert "key 'log_with' must be one of tensorboard, wandb, all, got 'mlflow'" in capsys.readouterr().err


def test_wandb_gets_pil_images_and_tensorboard_nhwc_arrays(tmp_path):
    path = tmp_path / "s.png"
    Image.new("RGB", (24, 16), (10, 200, 30)).save(path)

    class Tracker:
        def __init__(self, name):
            self.name, self.calls = name, []

        def log_images(self, values, step, **kwargs):
            self.calls.append((values, step, kwargs))

    class Acc:
        is_main_process = True
        trackers = [Tracker("tensorboard"), Tracker("wandb")]

    tracking.log_sample_images(Acc, [str(path)], 7)
    (tb_values, tb_step, tb_kwargs), = Acc.trackers[0].calls
    assert tb_step == 7 and tb_kwargs == {"dataformats": "NHWC"} and tb_values["samples/00"].shape == (1, 16, 24, 3)
    (wb_values, wb_step, _), = Acc.trackers[1].calls
    assert wb_step == 7 and wb_values["samples/00"][0].size == (24, 16)
    assert tracking.trackers(None, None) == [] and tracking.trackers(None, "x") == ["tensorboard"]
    assert tracking.trackers("all", "x") == ["tensorboard", "wandb"]


def test_each_step_logs_its_time_and_the_data_loaders_share_of_it(tiny_set, tmp_path, monkeypatch, capsys):
    """step_s and data_wait_s per log row (CSV and trackers); a data loader made slow by 0.1 s a batch
    shows as at least that much wait per step, and the run's summary line gives the wait's share."""
    from library.training.diffusion_task import DiffusionTask

    slow = DiffusionTask.epoch_batches

    def epoch_batches(self, epoch, skip=0):
        for batch in slow(self, epoch, skip):
            time.sleep(0.1)
            yield batch

    monkeypatch.setattr(DiffusionTask, "epoch_batches", epoch_batches)
    out = tmp_path / "run"
    assert train_lora.main(flux_args(tiny_set, out, "--max_train_steps", "3", "--sample_prompts", "")) == 0
    with open(out / "tiny_flux_lora_log.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 3
    for row in rows:
        step, wait = float(row["step_s"]), float(row["data_wait_s"])
        assert 0.1 <= wait < step, row
    share = next(line for line in capsys.readouterr().out.splitlines() if "waiting for data" in line)
    assert "s per step (median)" in share and share.endswith("of the steps' time")


def test_step_clock_counts_only_the_time_blocked_on_the_iterable():
    clock = tracking.StepClock()

    def items():
        time.sleep(0.05)
        yield 1
        yield 2

    got = []
    for item in clock.batches(items()):
        got.append(item)
        time.sleep(0.05)  # work on the batch: not waiting
    lap = clock.lap()
    assert got == [1, 2] and 0.05 <= lap["data_wait_s"] < 0.09 and lap["step_s"] >= 0.15
    clock.restart()
    assert clock.lap()["data_wait_s"] == 0.0


def test_samples_leave_the_training_rng_alone(tiny_set, tmp_path, monkeypatch):
    """A sample's bf16 reference base gets a LoRA network whose init draws from the CPU RNG, which
    shifted every later module_dropout draw: a run with samples trained other weights than the same run
    without. Sampling now restores the RNG states (as sd-scripts does), so both end equal. (The prompt's
    --fs, musubi-tuner's flow shift, is the samples' schedule.)"""
    from safetensors.torch import load_file

    from library.models import flow_matching

    seen, euler = [], flow_matching.euler_sample
    monkeypatch.setattr(flow_matching, "euler_sample", lambda f, x, sigmas: seen.append(sigmas) or euler(f, x, sigmas))
    (tmp_path / "p.txt").write_text("a red circle --w 32 --h 32 --s 2 --fs 3\n")
    common = ("--max_train_steps", "2", "--network_args", "module_dropout=0.5", "--mixed_precision", "no")
    assert train_lora.main(flux_args(tiny_set, tmp_path / "a", *common, "--sample_prompts", str(tmp_path / "p.txt"),
                                     "--sample_at_first", "true")) == 0
    assert seen and all(s.tolist() == [1.0, 0.75, 0.0] for s in seen)  # 3 * 0.5 / (1 + 2 * 0.5)
    assert train_lora.main(flux_args(tiny_set, tmp_path / "b", *common, "--sample_prompts", "")) == 0
    a, b = (load_file(tmp_path / run / "tiny_flux_lora.safetensors") for run in ("a", "b"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_failed_sample_render_is_a_warning_and_training_goes_on(tiny_set, tmp_path, monkeypatch, capsys):
    """An out-of-memory render at step 1 ended the run there (no LoRA unless a save came before); now it
    is one warning line, the run trains its 2 steps and saves its LoRA and the final samples."""
    from library.training.diffusion_task import DiffusionTask

    render = DiffusionTask.render_samples

    def out_of_memory_at_step_1(self, out_dir, tag, stop=None, first=0):
        if tag == "step000001":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return render(self, out_dir, tag, stop)

    monkeypatch.setattr(DiffusionTask, "render_samples", out_of_memory_at_step_1)
    (tmp_path / "p.txt").write_text("a red circle --w 32 --h 32 --s 1\n")
    out = tmp_path / "run"
    assert train_lora.main(flux_args(tiny_set, out, "--max_train_steps", "2", "--sample_every_n_steps", "1",
                                     "--sample_prompts", str(tmp_path / "p.txt"), "--sample_bf16_reference", "false")) == 0
    assert ("warning: samples step000001 at step 1 failed and are skipped, training goes on: OutOfMemoryError: CUDA out "
            "of memory. Tried to allocate 2.00 GiB") in capsys.readouterr().err
    assert sorted(p for p in os.listdir(out) if p.endswith((".png", ".safetensors"))) == [
        "tiny_flux_lora.safetensors", sample_png(out, "tiny_flux_lora", "final").name, "tiny_flux_lora_lr.png"]


def test_a_failed_renders_tensors_are_freed_before_the_cuda_cache_is_emptied(monkeypatch, capsys):
    """The render's exception (its traceback holds the failed render's frames and their tensors) must be gone
    when torch.cuda.empty_cache() runs, or the cache keeps what the out-of-memory render allocated."""
    import contextlib
    import weakref
    from types import SimpleNamespace

    held = []

    class Activations:  # stands in for the render's tensors, alive while its frame is
        pass

    def render_samples(out_dir, tag, stop=None, first=0):
        activations = Activations()
        held.append(weakref.ref(activations))
        raise torch.OutOfMemoryError("CUDA out of memory")

    trainer = train_lora.Trainer.__new__(train_lora.Trainer)
    trainer.accelerator = SimpleNamespace(device=SimpleNamespace(type="cuda"), num_processes=1, process_index=0)
    trainer.task, trainer.args, trainer.step = SimpleNamespace(render_samples=render_samples), SimpleNamespace(
        output_dir="unused"), 1
    monkeypatch.setattr(train_lora.Trainer, "sampling", lambda self: contextlib.nullcontext())
    monkeypatch.setattr(train_lora.fsdp, "uses_fsdp", lambda accelerator: False)
    alive_at_empty = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: alive_at_empty.append(held[0]() is not None))
    trainer.render_samples("step000001")
    assert alive_at_empty == [False]
    assert "warning: samples step000001 at step 1 failed and are skipped, training goes on" in capsys.readouterr().err


def test_a_failed_final_render_is_a_warning_and_the_finished_run_exits_0(tiny_set, tmp_path, monkeypatch, capsys):
    """The final samples come after the final LoRA: a render failing there (out of memory, a sample wider than
    the model's RoPE table) ended a finished run with an error line and exit 2 (1 for out of memory), the
    trackers left open. Now one warning line, as the samples during training."""
    from library.training.diffusion_task import DiffusionTask

    def disk_full(self, out_dir, tag, stop=None, first=0):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(DiffusionTask, "render_samples", disk_full)
    (tmp_path / "p.txt").write_text("a red circle --w 32 --h 32 --s 1\n")
    out = tmp_path / "run"
    assert train_lora.main(flux_args(tiny_set, out, "--max_train_steps", "1", "--sample_prompts", str(tmp_path / "p.txt"),
                                     "--sample_bf16_reference", "false")) == 0
    captured = capsys.readouterr()
    assert ("warning: the final samples failed and are skipped; the LoRA is final: OSError: [Errno 28] No space left "
            "on device") in captured.err, captured.err
    assert "saved " in captured.out and (out / "tiny_flux_lora.safetensors").exists()
