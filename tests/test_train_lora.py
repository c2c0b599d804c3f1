"""train_lora.py end to end on the tiny real-format FLUX: the quickstart learns, the LoRA changes
the output, 2 DDP processes equal 1 process with the doubled batch, Ctrl-C saves and a resume
finishes bit-identical, a NaN loss stops after saving, and Qwen-Image trains too."""

import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import train_lora
from library.models.flux1.family import FluxFamily
from library.data.dataset_config import load_dataset_config
from networks.lora import LoRANetwork

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def flux_args(tiny_set, out, *extra):
    return [
        "--config_file", os.path.join(ROOT, "configs", "quickstart.toml"),
        "--pretrained_model_name_or_path", tiny_set["flux_bfl"], "--ae", tiny_set["flux_vae_single"],
        "--clip_l", tiny_set["clip_l"], "--t5xxl", tiny_set["t5xxl"],
        "--dataset_config", tiny_set["dataset_config"], "--sample_prompts", tiny_set["sample_prompts"],
        "--output_dir", str(out), "--sample_at_first", "false", "--save_every_n_steps", "0",
        *extra,
    ]


def sample_png(folder, name: str, tag: str, index: int = 0):
    """The one sample <name>_<tag>_<NN>_<YYYYmmddHHMMSS>_<seed>.png in folder (a pathlib.Path)."""
    (path,) = folder.glob(f"{name}_{tag}_{index:02d}_" + "[0-9]" * 14 + "_*.png")
    return path


def free_port() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def read_losses(out, name="tiny_flux_lora"):
    with open(os.path.join(out, f"{name}_log.csv")) as f:
        return [float(r["loss"]) for r in csv.DictReader(f)]


def test_quickstart_short_loss_falls_and_lora_changes_output(tiny_set, tmp_path):
    out = tmp_path / "run"
    code = train_lora.main(flux_args(tiny_set, out, "--max_train_steps", "40", "--optimizer_type", "AdamW",
                                     "--optimizer_args", "--learning_rate", "3e-3"))
    assert code == 0
    losses = read_losses(out)
    assert len(losses) == 40
    first, last = sum(losses[:8]) / 8, sum(losses[-8:]) / 8
    assert last < 0.92 * first, (first, last)
    for path in (out / "tiny_flux_lora.safetensors", out / "tiny_flux_lora_lr.png", sample_png(out, "tiny_flux_lora", "final")):
        assert path.stat().st_size > 0

    # The LoRA changes the model's prediction on the training data (fp32 base here, unmerged LoRA).
    family = FluxFamily(tiny_set["flux_bfl"])
    model = family.load_transformer(torch.float32)
    torch.manual_seed(0)
    x = torch.randn(1, 16, 64)
    text = {"t5": torch.randn(1, 32, 32), "clip_pooled": torch.randn(1, 32)}
    with torch.no_grad():
        before = family.predict(model, x, torch.tensor([0.5]), text, 4, 4, 1.0)
        network = LoRANetwork(model, "flux", 8, 8.0)
        network.load_weights(str(out / "tiny_flux_lora.safetensors"))
        network.apply()
        after = family.predict(model, x, torch.tensor([0.5]), text, 4, 4, 1.0)
    change = ((after - before).norm() / before.norm()).item()
    assert change > 0.01, change


def write_ddp_datasets(tiny_set, tmp_path):
    """ds1.toml / ds2.toml: batch 1 and 2 over one bucket (no bucketing, square resize), so the
    single process and the two DDP processes see the same samples."""
    data = load_dataset_config(tiny_set["dataset_config"])
    image_dir = data.datasets[0].subsets[0].image_dir
    for bs in (1, 2):
        (tmp_path / f"ds{bs}.toml").write_text(
            f'[general]\nresolution = 64\nbatch_size = {bs}\n[[datasets]]\n[[datasets.subsets]]\nimage_dir = "{image_dir}"\n'
        )


def train_single(argv: list[str], monkeypatch):
    """The one-process reference run, in this process (no interpreter to start): on the CPU with one
    thread, as the processes it is compared with run."""
    monkeypatch.setenv("ACCELERATE_USE_CPU", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert train_lora.main(argv) == 0
    finally:
        torch.set_num_threads(threads)


def launch(launcher: list[str], runs: list, folder) -> subprocess.CompletedProcess:
    """`runs` ([fault, argv], ...) in turn in each of 2 gloo processes on the CPU, one launch
    (tests/launched_runs.py: the processes' start and imports are paid once)."""
    (folder / "runs.json").write_text(json.dumps(runs))
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", *launcher, os.path.join(ROOT, "tests", "launched_runs.py"),
                           str(folder / "runs.json")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)


def launched_log(out) -> str:
    """What both processes of a launched run (launch) wrote."""
    return "".join(open(f"{out}.rank{rank}.log").read() for rank in (0, 1) if os.path.exists(f"{out}.rank{rank}.log"))


def returned(out) -> list[int]:
    """Each process's exit status of a launched run, [process 0's, process 1's]."""
    return [int(m) for m in re.findall(r"rank \d returned (-?\d+) at", launched_log(out))]


DDP_EQUALITY = ["--max_train_steps", "3", "--optimizer_type", "AdamW", "--optimizer_args", "--learning_rate", "1e-3",
                "--sample_prompts", ""]
QWEN_EQUALITY = ["--output_name", "qwen", "--max_train_steps", "2", "--sample_prompts", ""]


@pytest.fixture(scope="module")
def ddp_runs(tiny_set, tmp_path_factory):
    """This file's 2-process runs, in one torchrun launch (2 gloo DDP processes): the flux and Qwen-Image runs
    the equality tests compare with 1 process, then the faults: a NaN loss and a SIGTERM in process 1, and
    last the SIGTERM to the main process, whose slow save the launcher must not cut when process 1 exits.
    -> (the folder with run <name>'s output in <name>/, the launch)."""
    from tests.test_captions import qwen_args

    folder = tmp_path_factory.mktemp("ddp")
    write_ddp_datasets(tiny_set, folder)
    one_prompt = folder / "one_prompt.txt"
    one_prompt.write_text("a red square --w 64 --h 64 --s 1 --d 1 --n blurry\n")  # a negative FLUX.1 does not read
    ds1 = ["--dataset_config", str(folder / "ds1.toml")]

    def flux(name, *extra):
        return flux_args(tiny_set, folder / name, *ds1, "--sample_prompts", "", *extra)

    runs = [(None, flux("doubled_batch", *DDP_EQUALITY)), (None, qwen_args(tiny_set, folder / "qwen", *QWEN_EQUALITY, *ds1)),
            ("nan_loss_in_process_1", flux("nan", "--max_train_steps", "3", "--save_every_n_steps", "1")),
            ("sigterm_to_process_1", flux("sigterm", "--max_train_steps", "4")),
            ("full_disk_at_the_main_process_first_save", flux("full_disk", "--max_train_steps", "3",
                                                              "--save_every_n_steps", "1")),
            ("out_of_memory_in_process_1_loading_its_first_render",
             flux("render_oom", "--max_train_steps", "2", "--sample_every_n_steps", "1",
                  "--sample_prompts", str(one_prompt))),
            ("sigterm_to_main_and_a_slow_save", flux("slow_save", "--max_train_steps", "4"))]
    return folder, launch(["torch.distributed.run", "--nproc_per_node", "2", "--master_port", free_port()], runs, folder)


def assert_close_loras(a_path, b_path):
    """DDP averages gradients in another order than one process sums them: 2% of the largest up weight."""
    a, b = load_file(a_path), load_file(b_path)
    up = max(a[k].abs().max().item() for k in a if "lora_up" in k)
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    assert sorted(a) == sorted(b) and up > 1e-3 and diff <= 0.02 * up, (diff, up)


def test_fp16_loss_scale_is_in_the_state(tiny_set, tmp_path, monkeypatch):
    """fp16's GradScaler was not saved: a resumed run started at 65536 again and skipped the steps until the scale
    fell back (steps 6-9 of 10 where the straight run applied them). A CPU GradScaler stands in for CUDA's (accelerate
    makes none on a CPU); growing every step, a fresh one holds another scale than the state's."""
    from library.training.diffusion_task import DiffusionTask

    scalers, real = [], train_lora.make_accelerator

    def with_scaler(args):
        accelerator = real(args)
        accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
        scalers.append(accelerator.scaler)
        return accelerator

    monkeypatch.setattr(train_lora, "make_accelerator", with_scaler)
    steps = ["--max_train_steps", "4", "--mixed_precision", "fp16", "--sample_prompts", ""]
    assert train_lora.main(flux_args(tiny_set, tmp_path / "straight", *steps)) == 0
    monkeypatch.setattr(DiffusionTask, "after_step", lambda self, step, out: step == 2 and os.kill(os.getpid(), signal.SIGINT))
    assert train_lora.main(flux_args(tiny_set, tmp_path / "cut", *steps)) == 130
    monkeypatch.setattr(DiffusionTask, "after_step", lambda self, step, out: None)
    state = str(tmp_path / "cut" / "tiny_flux_lora-state")
    assert train_lora.main(flux_args(tiny_set, tmp_path / "cut", *steps, "--resume", state)) == 0
    assert scalers[0].get_scale() == scalers[2].get_scale() == 2.0**14, [s.get_scale() for s in scalers]
    a, b = load_file(tmp_path / "straight" / "tiny_flux_lora.safetensors"), load_file(tmp_path / "cut" / "tiny_flux_lora.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_step_the_fp16_scaler_skips_leaves_the_schedule_where_it_was(tiny_set, tmp_path, monkeypatch):
    """A step fp16's grad scaler skips (inf gradients: no update) advanced the schedule all the same: k skipped steps
    early on ended the warmup k updates early and the decay k steps short of its end. accelerate's scheduler, which
    sd-scripts and musubi-tuner step, stays where it was on such a step; so does ours."""
    skipped, real = [], train_lora.Trainer.optimizer_step

    def skipping_the_first(self):
        if skipped:
            return real(self)
        skipped.append(self.step)  # as GradScaler.step on inf gradients: no optimizer.step()
        self.step_ds = train_lora.step_ds(self.optimizer)
        return False

    monkeypatch.setattr(train_lora.Trainer, "optimizer_step", skipping_the_first)
    out = tmp_path / "run"
    assert train_lora.main(flux_args(tiny_set, out, "--max_train_steps", "4", "--sample_prompts", "",
                                     "--optimizer_type", "AdamW", "--optimizer_args", "--learning_rate", "1e-3",
                                     "--lr_scheduler", "linear", "--lr_warmup_steps", "2")) == 0
    with open(out / "tiny_flux_lora_log.csv") as f:
        lrs = [float(r["lr/lora"]) for r in csv.DictReader(f)]
    assert skipped == [0] and lrs == pytest.approx([0.0, 0.0, 5e-4, 1e-3]), lrs  # was [0, 5e-4, 1e-3, 5e-4]


def test_a_state_at_an_epochs_end_resumed_on_longer_epochs_starts_the_next_epoch(tiny_set, tmp_path, monkeypatch):
    """A state written at an epoch's last step (a step save, a Ctrl-C) held batches_done = that epoch's batches; on data
    with more batches an epoch (num_repeats 2) the resumed run trained the rest of the new order as the same epoch (4
    more steps of epoch 0, two images never seen), where a state from the epoch save went on with epoch 1."""
    from library.training.diffusion_task import DiffusionTask

    def ds(repeats):
        image_dir = load_dataset_config(tiny_set["dataset_config"]).datasets[0].subsets[0].image_dir
        path = tmp_path / f"ds{repeats}.toml"
        path.write_text(f'[general]\nresolution = 64\nbatch_size = 2\n[[datasets]]\n[[datasets.subsets]]\n'
                        f'image_dir = "{image_dir}"\nnum_repeats = {repeats}\n')
        return str(path)

    steps = ["--max_train_steps", "8", "--sample_prompts", ""]
    monkeypatch.setattr(DiffusionTask, "after_step",
                        lambda self, step, out: step == self.batches_per_epoch() and os.kill(os.getpid(), signal.SIGINT))
    out = tmp_path / "run"
    assert train_lora.main(flux_args(tiny_set, out, *steps, "--dataset_config", ds(1))) == 130
    monkeypatch.setattr(DiffusionTask, "after_step", lambda self, step, out: None)
    assert train_lora.main(flux_args(tiny_set, out, *steps, "--dataset_config", ds(2),
                                     "--resume", str(out / "tiny_flux_lora-state"))) == 0
    with open(out / "tiny_flux_lora_log.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["epoch"] for r in rows] == ["0"] * 4 + ["1"] * 4, [(r["step"], r["epoch"]) for r in rows]


def test_max_train_epochs_resumed_on_longer_epochs_ends_after_that_many_epochs(tiny_set, tmp_path, monkeypatch, capsys):
    """max_train_epochs 2, stopped at the end of epoch 0 (4 steps), resumed on 8-step epochs (num_repeats 2): the
    resumed run planned 2 x 8 = 16 steps, so it trained 4 steps of a third epoch (epoch 2). It ends with epoch 1 now."""
    from library.training.diffusion_task import DiffusionTask

    image_dir = load_dataset_config(tiny_set["dataset_config"]).datasets[0].subsets[0].image_dir
    for repeats in (1, 2):
        (tmp_path / f"ds{repeats}.toml").write_text(f'[general]\nresolution = 64\nbatch_size = 2\n[[datasets]]\n'
                                                    f'[[datasets.subsets]]\nimage_dir = "{image_dir}"\nnum_repeats = {repeats}\n')
    epochs = ["--max_train_epochs", "2", "--sample_prompts", ""]
    monkeypatch.setattr(DiffusionTask, "after_step",
                        lambda self, step, out: step == self.batches_per_epoch() and os.kill(os.getpid(), signal.SIGINT))
    out = tmp_path / "run"
    assert train_lora.main(flux_args(tiny_set, out, *epochs, "--dataset_config", str(tmp_path / "ds1.toml"))) == 130
    monkeypatch.setattr(DiffusionTask, "after_step", lambda self, step, out: None)
    capsys.readouterr()
    assert train_lora.main(flux_args(tiny_set, out, *epochs, "--dataset_config", str(tmp_path / "ds2.toml"),
                                     "--resume", str(out / "tiny_flux_lora-state"))) == 0
    with open(out / "tiny_flux_lora_log.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["epoch"] for r in rows] == ["0"] * 4 + ["1"] * 8, [(r["step"], r["epoch"]) for r in rows]
    assert ("max_train_epochs = 2: 12 optimizer steps (8 an epoch, 8 of them after the resumed step 4), in place of "
            "max_train_steps") in capsys.readouterr().out


def test_a_resumed_run_on_longer_epochs_writes_its_epoch_counts_in_the_header(tiny_set, tmp_path):
    """2 epochs of 2 steps, resumed at that end on 4-step epochs (num_repeats 2) with max_train_epochs 3: the
    header's ss_epoch / ss_num_epochs were step / 4 rounded up (2 and 2), as if every epoch had had 4 steps;
    the run's own count is 3 (and 3 planned), for the step-6 save inside epoch 3 and for the final one."""
    image_dir = load_dataset_config(tiny_set["dataset_config"]).datasets[0].subsets[0].image_dir
    for repeats in (1, 2):
        (tmp_path / f"ds{repeats}.toml").write_text(f'[general]\nresolution = 64\nbatch_size = 4\n[[datasets]]\n'
                                                    f'[[datasets.subsets]]\nimage_dir = "{image_dir}"\nnum_repeats = {repeats}\n')
    out, run = tmp_path / "run", ["--sample_prompts", "", "--save_state", "true"]
    assert train_lora.main(flux_args(tiny_set, out, *run, "--max_train_epochs", "2",
                                     "--dataset_config", str(tmp_path / "ds1.toml"))) == 0
    assert train_lora.main(flux_args(tiny_set, out, *run, "--max_train_epochs", "3", "--save_every_n_steps", "2",
                                     "--dataset_config", str(tmp_path / "ds2.toml"),
                                     "--resume", str(out / "tiny_flux_lora-state"))) == 0
    for name, steps in (("tiny_flux_lora-step000006", "6"), ("tiny_flux_lora", "8")):
        with safe_open(str(out / f"{name}.safetensors"), "pt") as f:
            meta = f.metadata()
        assert (meta["ss_steps"], meta["ss_epoch"], meta["ss_num_epochs"]) == (steps, "3", "3"), (name, meta)


def test_a_finished_run_trained_on_keeps_its_final_lora_as_its_steps_save(tiny_set, tmp_path, capsys):
    """A finished run (2 steps, its state saved) resumed with max_train_steps 4: the new final LoRA was written over
    the finished one (as sd-scripts does), whose result was gone. It is kept as tiny_flux_lora-step000002 now,
    the name a step save there takes; a final LoRA of another step (not the state's run) is still written over."""
    out, run = tmp_path / "run", ["--sample_prompts", "", "--save_state", "true"]
    assert train_lora.main(flux_args(tiny_set, out, *run, "--max_train_steps", "2")) == 0
    finished = (out / "tiny_flux_lora.safetensors").read_bytes()
    resume = ["--resume", str(out / "tiny_flux_lora-state")]
    assert train_lora.main(flux_args(tiny_set, out, *run, "--max_train_steps", "4", *resume)) == 0
    assert (out / "tiny_flux_lora-step000002.safetensors").read_bytes() == finished
    kept = f"kept {out / 'tiny_flux_lora.safetensors'}, the final save of the run resumed, as "
    assert kept in capsys.readouterr().out
    for name, steps in (("tiny_flux_lora-step000002", "2"), ("tiny_flux_lora", "4")):
        with safe_open(str(out / f"{name}.safetensors"), "pt") as f:
            assert f.metadata()["ss_steps"] == steps
    (out / "tiny_flux_lora-step000002.safetensors").unlink()
    assert train_lora.main(flux_args(tiny_set, out, *run, "--max_train_steps", "2", "--output_name", "other")) == 0
    (out / "tiny_flux_lora-state").rename(out / "old-state")
    (out / "other-state").rename(out / "tiny_flux_lora-state")  # a state of step 2 beside a final LoRA of step 4
    assert train_lora.main(flux_args(tiny_set, out, *run, "--max_train_steps", "3", *resume)) == 0
    assert not (out / "tiny_flux_lora-step000002.safetensors").exists()


def test_save_precision_float_is_sd_scripts_name_for_fp32(tiny_set, tmp_path):
    """sd-scripts' save_precision choices are float / fp16 / bf16: a migrated config's "float" was refused
    (key 'save_precision' must be one of fp32, bf16, fp16). It saves float32 tensors now."""
    from types import SimpleNamespace

    from library.training.config import load_config

    class Task:  # what Saver.lora asks of a task; save records the dtype it is given
        def metadata(self):
            return {"base_model_version": "flux1", "base_precision": "bf16", "resolution": "64x64", "batch_size": 2,
                    "timestep_sampling": "shift", "dataset": []}

        def batches_per_epoch(self):
            return 4

        def save(self, path, metadata, dtype):
            saved.append(dtype)

    saved = []
    args = load_config(flux_args(tiny_set, tmp_path / "run", "--save_precision", "float"))
    train_lora.Saver(args, Task(), SimpleNamespace(is_main_process=True, num_processes=1), 0.0, 1, 1).lora(
        1, 1, final=True)
    assert saved == [torch.float32]


def test_two_ddp_processes_equal_one_process_with_doubled_batch(ddp_runs, tiny_set, tmp_path, monkeypatch):
    folder, launched = ddp_runs
    multi = folder / "doubled_batch"
    assert returned(multi) == [0, 0], (launched_log(multi) or launched.stderr)[-2000:]
    train_single(flux_args(tiny_set, tmp_path, "--dataset_config", str(folder / "ds2.toml"), *DDP_EQUALITY), monkeypatch)
    assert read_losses(multi) == pytest.approx(read_losses(tmp_path), abs=1e-6)
    assert_close_loras(tmp_path / "tiny_flux_lora.safetensors", multi / "tiny_flux_lora.safetensors")


def test_qwen_image_under_ddp_equals_one_process(ddp_runs, tiny_set, tmp_path, monkeypatch):
    """Qwen-Image's last block leaves LoRAs without a gradient (its text stream feeds nothing): DDP
    must not wait for their reduction ("Expected to have finished reduction" without the fix)."""
    from tests.test_captions import qwen_args

    folder, launched = ddp_runs
    multi = folder / "qwen"
    assert returned(multi) == [0, 0], (launched_log(multi) or launched.stderr)[-2000:]
    train_single(qwen_args(tiny_set, tmp_path, *QWEN_EQUALITY, "--dataset_config", str(folder / "ds2.toml")), monkeypatch)
    assert read_losses(multi, "qwen") == pytest.approx(read_losses(tmp_path, "qwen"), abs=1e-5)
    assert_close_loras(tmp_path / "qwen.safetensors", multi / "qwen.safetensors")


def test_interrupt_saves_and_resume_is_bit_identical(tiny_set, tmp_path, monkeypatch):
    """With dropout too: until 2026-11-27 each epoch's DataLoader drew its base seed from the global RNG, which
    the resumed run restores first, so every dropout mask after the resume moved (LoRA max diff ~4e-4)."""
    steps = ["--max_train_steps", "9", "--optimizer_type", "Prodigy", "--optimizer_args", "d0=1e-4",
             "--sample_prompts", "", "--network_dropout", "0.1"]
    assert train_lora.main(flux_args(tiny_set, tmp_path / "straight", *steps)) == 0

    # A real SIGINT, delivered to this process after optimizer step 4.
    from library.training.diffusion_task import DiffusionTask

    def after_step(self, step, output_dir):
        if step == 4:
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(DiffusionTask, "after_step", after_step)
    interrupted = tmp_path / "interrupted"
    assert train_lora.main(flux_args(tiny_set, interrupted, *steps)) == 130
    with safe_open(str(interrupted / "tiny_flux_lora-step000004.safetensors"), "pt") as f:
        meta = f.metadata()  # sd-scripts' keys: the steps trained, and the steps the run was set to
    assert (meta["ss_steps"], meta["ss_max_train_steps"]) == ("4", "9"), meta
    state = interrupted / "tiny_flux_lora-state"
    assert (state / "train_state.json").exists()
    monkeypatch.undo()
    assert train_lora.main(flux_args(tiny_set, interrupted, *steps, "--resume", str(state))) == 0
    straight = (tmp_path / "straight" / "tiny_flux_lora.safetensors")
    resumed = (interrupted / "tiny_flux_lora.safetensors")
    a, b = load_file(straight), load_file(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert read_losses(interrupted) == read_losses(tmp_path / "straight")


@pytest.fixture(scope="module")
def one_step_flux(tiny_set, tmp_path_factory) -> str:
    """The LoRA of one step with network_alpha 0 (the header tests below read it)."""
    out = tmp_path_factory.mktemp("one_step")
    assert train_lora.main(flux_args(tiny_set, out, "--max_train_steps", "1", "--network_alpha", "0", "--sample_prompts", "")) == 0
    return str(out / "tiny_flux_lora.safetensors")


def test_network_alpha_0_is_written_as_the_alpha_it_means(one_step_flux):
    """0 means alpha = rank (the .alpha tensors hold the rank); the header said ss_network_alpha 0.0 until 2026-11-27."""
    with safe_open(one_step_flux, "pt") as f:
        meta, alphas = f.metadata(), {f.get_tensor(k).item() for k in f.keys() if k.endswith(".alpha")}
    assert alphas == {float(meta["ss_network_dim"])} and float(meta["ss_network_alpha"]) in alphas, meta["ss_network_alpha"]


def test_a_saved_lora_carries_the_modelspec_keys_sd_scripts_writes(one_step_flux):
    """The header had no modelspec.* keys (Stability's ModelSpec, which sd-scripts' and musubi-tuner's saves carry
    and SwarmUI and LoRA managers read to tell a LoRA's model): now sd-scripts' own for FLUX.1 [dev]
    (flux_train_network: flux-1-dev/lora, IMPL_FLUX), the title output_name, the dataset's resolution "WxH", the
    save's date, and the hash of the tensors written (sshs_model_hash with "0x")."""
    import datetime
    import hashlib

    with safe_open(one_step_flux, "pt") as f:
        meta = f.metadata()
    written = {k: v for k, v in meta.items() if k.startswith("modelspec.")}
    assert {k: written.pop(k) for k in ("modelspec.date", "modelspec.hash_sha256")} and written == {
        "modelspec.sai_model_spec": "1.0.0", "modelspec.architecture": "flux-1-dev/lora",
        "modelspec.implementation": "https://github.com/black-forest-labs/flux", "modelspec.title": "tiny_flux_lora",
        "modelspec.resolution": "64x64"}
    assert meta["modelspec.date"] == datetime.datetime.fromtimestamp(int(meta["ss_training_finished_at"])).isoformat()
    with open(one_step_flux, "rb") as f:  # ModelSpec's hash: sha256 of the bytes after the header
        data = f.read()
    assert meta["modelspec.hash_sha256"] == "0x" + hashlib.sha256(data[8 + int.from_bytes(data[:8], "little"):]).hexdigest()


def test_ctrl_c_before_the_loop_exits_130_in_one_line(tiny_set, tmp_path, monkeypatch, capsys):
    """A Ctrl-C while the models load or the caches fill (before Interrupts is installed) ends the run
    with one line and exit status 130, as inside the loop, not a traceback."""
    from library.training.diffusion_task import DiffusionTask

    def interrupted(self, *a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(DiffusionTask, "__init__", interrupted)
    try:
        code = train_lora.main(flux_args(tiny_set, tmp_path / "run", "--sample_prompts", ""))
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C before the training loop escaped main() as a traceback")
    assert code == 130
    assert capsys.readouterr().err.strip().startswith("interrupted: stopped before the next save")
    assert not (tmp_path / "run" / "tiny_flux_lora.safetensors").exists()


def test_ctrl_c_while_the_final_lora_is_saved_lets_it_finish(tiny_set, tmp_path, monkeypatch, capsys):
    """A Ctrl-C after the last step (here: as the final LoRA is written) is still train_lora's: the
    LoRA and state are written whole and the final samples are skipped. It exits 130 as every run a
    Ctrl-C cut short (the samples), and the web UI reads a 130 after the final save as done. The UI's
    stop can land there on a fast machine; it once left exit 130 and no final LoRA."""
    save = train_lora.Saver.lora

    def lora(self, step, epoch, final=False):
        if final:
            os.kill(os.getpid(), signal.SIGINT)
        return save(self, step, epoch, final)

    monkeypatch.setattr(train_lora.Saver, "lora", lora)
    out = tmp_path / "run"
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN where the suite runs in a background job (nohup ... &)
    assert train_lora.main(flux_args(tiny_set, out, "--max_train_steps", "2", "--save_state", "true")) == 130
    assert "final samples skipped" in capsys.readouterr().out
    assert (out / "tiny_flux_lora.safetensors").exists() and (out / "tiny_flux_lora-state" / "train_state.json").exists()
    assert [p.name for p in out.rglob("*.png")] == ["tiny_flux_lora_lr.png"]  # no final samples
    assert signal.getsignal(signal.SIGINT) is before  # train_lora's handler removed again


def test_resume_from_another_run_config_is_refused(tiny_set, tmp_path):
    out = tmp_path / "run"
    args = ["--max_train_steps", "2", "--save_state", "true", "--sample_prompts", ""]
    assert train_lora.main(flux_args(tiny_set, out, *args)) == 0
    code = train_lora.main(flux_args(tiny_set, out, *args, "--network_dim", "4", "--resume", str(out / "tiny_flux_lora-state")))
    assert code == 2


def test_epoch_save_with_save_state_writes_a_state_that_resumes(tiny_set, tmp_path, monkeypatch):
    """save_every_n_epochs with save_state: a state is written with the epoch's LoRA (at the end of
    epoch 1, batch 0 of epoch 2), and a run resumed from it ends with the straight run's LoRA."""
    epochs = ["--max_train_epochs", "2", "--save_every_n_epochs", "1", "--save_state", "true",
              "--gradient_accumulation_steps", "8", "--optimizer_type", "AdamW", "--optimizer_args",
              "--learning_rate", "1e-3", "--sample_prompts", ""]  # one optimizer step per epoch
    copies, real_state = [], train_lora.Saver.state

    def copy_each_state(self, *args):  # the final state takes the same folder: keep each one
        folder = real_state(self, *args)
        copies.append(shutil.copytree(folder, tmp_path / f"state{len(copies)}"))
        return folder

    monkeypatch.setattr(train_lora.Saver, "state", copy_each_state)
    straight = tmp_path / "straight"
    assert train_lora.main(flux_args(tiny_set, straight, *epochs)) == 0
    assert (straight / "tiny_flux_lora-step000001.safetensors").exists()
    assert len(copies) == 2, "no state beside the epoch's LoRA"
    with open(copies[0] / "train_state.json") as f:
        progress = json.load(f)
    assert (progress["step"], progress["epoch"], progress["batches_done"]) == (1, 1, 0)
    monkeypatch.undo()
    resumed = tmp_path / "resumed"
    assert train_lora.main(flux_args(tiny_set, resumed, *epochs, "--resume", str(copies[0]))) == 0
    a, b = load_file(straight / "tiny_flux_lora.safetensors"), load_file(resumed / "tiny_flux_lora.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert read_losses(resumed) == read_losses(straight)[1:]
    # The header counts the epochs run: the old line left the last one out when the run ended with it.
    batch = load_dataset_config(tiny_set["dataset_config"]).datasets[0].batch_size
    with safe_open(str(straight / "tiny_flux_lora.safetensors"), "pt") as f:
        meta = f.metadata()
    assert meta["ss_num_epochs"] == "2" and meta["ss_total_batch_size"] == str(min(batch, 8) * 8), meta
    assert json.loads(meta["ss_dataset_dirs"]) and json.loads(meta["ss_tag_frequency"]), meta  # sd-scripts' folder keys
    # sd-scripts' step keys (the old header had none: accumulation could not be read back from the total batch)
    assert (meta["ss_gradient_accumulation_steps"], meta["ss_max_grad_norm"], meta["ss_lr_warmup_steps"]) == \
        ("8", "1.0", "0"), meta


def test_a_step_is_saved_once_when_its_step_save_ends_an_epoch_or_a_ctrl_c_follows(tiny_set, tmp_path, monkeypatch,
                                                                                   capsys):
    """save_every_n_steps and save_every_n_epochs firing at the same step wrote its LoRA (same name) and its state
    twice, and a Ctrl-C after a step's save wrote both again: each step's LoRA and state are written once now."""
    written, lora, state = [], train_lora.Saver.lora, train_lora.Saver.state

    def count_lora(self, step, epoch, final=False, prune=True):
        written.append(("lora", step, final))
        if step == 2 and not final:  # a Ctrl-C as step 2's save is written: the run stops after it, at step 2
            os.kill(os.getpid(), signal.SIGINT)
        return lora(self, step, epoch, final, prune)

    def count_state(self, optimizer, scheduler, progress):
        written.append(("state", progress["step"]))
        return state(self, optimizer, scheduler, progress)

    monkeypatch.setattr(train_lora.Saver, "lora", count_lora)
    monkeypatch.setattr(train_lora.Saver, "state", count_state)
    epochs = ["--max_train_epochs", "3", "--save_every_n_epochs", "1", "--save_every_n_steps", "1",
              "--save_state", "true", "--gradient_accumulation_steps", "8", "--sample_prompts", ""]  # a step an epoch
    assert train_lora.main(flux_args(tiny_set, tmp_path / "run", *epochs)) == 130
    assert written == [("lora", 1, False), ("state", 1), ("lora", 2, False), ("state", 2)], written
    assert "saved" in capsys.readouterr().err


class _InfGradient(torch.autograd.Function):
    """The identity forward; an inf gradient backward (a finite loss whose update would poison the LoRA)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("inf")


@pytest.mark.parametrize("poison, clip, expected", [
    # a NaN loss on finite weights: they are kept under their step's name, not as the result
    ("nan_loss", "1.0", "the LoRA of step 2 gave it (its weights are finite: check it before use)"),
    # an inf gradient, clipped: stopped before the update, so the weights that gave a finite loss are saved
    ("inf_grad", "1.0", "the gradient norm is"),
    # an inf gradient, unclipped: the update makes the weights NaN and the next loss shows it
    ("inf_grad", "0", "the LoRA's weights are no longer finite after step 3: not saved"),
])
def test_a_diverged_run_never_saves_broken_weights_as_good(tiny_set, tmp_path, monkeypatch, capsys, poison, clip,
                                                           expected):
    """The old line saved the current weights as the result ("the last good LoRA") on any NaN loss:
    after an unclipped inf gradient that file was all NaN."""
    from library.models.family import DiffusionFamily

    real = DiffusionFamily.training_loss
    calls = {"n": 0}

    def poisoned(self, *a, **k):
        loss, sigmas = real(self, *a, **k)
        calls["n"] += 1
        if calls["n"] == 3:
            loss = loss * float("nan") if poison == "nan_loss" else _InfGradient.apply(loss)
        return loss, sigmas

    monkeypatch.setattr(DiffusionFamily, "training_loss", poisoned)
    out = tmp_path / "run"
    code = train_lora.main(flux_args(tiny_set, out, "--max_train_steps", "6", "--sample_prompts", "",
                                     "--save_every_n_steps", "1", "--max_grad_norm", clip))
    err = capsys.readouterr().err
    assert code == 3 and expected in err, err
    assert "last good" not in err
    final = out / "tiny_flux_lora.safetensors"
    if (poison, clip) == ("inf_grad", "1.0"):  # the one case where the weights are known good
        assert "step 3 (epoch 0), not applied: the LoRA of step 2 (its loss was finite)" in err
        assert final.exists()
    else:
        assert not final.exists()
    for path in out.glob("*.safetensors"):  # nothing written holds a non-finite value
        assert all(torch.isfinite(t).all() for t in load_file(path).values()), path
    if clip == "0":
        assert "the last save before it: step 2" in err and not (out / "tiny_flux_lora-step000003.safetensors").exists()


def test_qwen_image_lora_trains_from_diffusers_folders(tiny_set, tmp_path):
    out = tmp_path / "qwen"
    code = train_lora.main([
        "--model_type", "qwen_image", "--pretrained_model_name_or_path", tiny_set["qwen_image"],
        "--ae", tiny_set["qwen_image_vae"], "--text_encoder", tiny_set["qwen_image_text_encoder"],
        "--dataset_config", tiny_set["dataset_config"], "--output_dir", str(out), "--output_name", "qwen",
        "--max_train_steps", "6", "--mixed_precision", "no", "--fp8_base", "--network_dim", "4",
        "--optimizer_type", "AdamW", "--learning_rate", "1e-3",
    ])
    assert code == 0
    tensors = load_file(out / "qwen.safetensors")
    with safe_open(str(out / "qwen.safetensors"), "pt") as f:  # musubi-tuner's ModelSpec names (ARCH_QWEN_IMAGE)
        meta = f.metadata()
    assert (meta["modelspec.architecture"], meta["modelspec.implementation"], meta["modelspec.title"]) == (
        "Qwen-Image/lora", "https://github.com/QwenLM/Qwen-Image", "qwen")
    assert any(k.startswith("lora_unet_transformer_blocks_0_attn_to_q") for k in tensors)
    assert len(read_losses(out, "qwen")) == 6


def test_unknown_config_key_is_one_line_and_exit_2(tmp_path, capsys):
    cfg = tmp_path / "bad.toml"
    cfg.write_text('model_type = "flux"\nnetwork_dimm = 4\n')
    assert train_lora.main(["--config_file", str(cfg)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {cfg}: unknown key 'network_dimm'"]


def test_tensorboard_gets_loss_lr_and_d_times_lr_once_per_step(tiny_set, tmp_path, monkeypatch):
    """d*lr is the one each step applied: prodigyopt computes its step from d, then leaves the next step's d in
    the group; the old line read it after the step and logged each step the next one's (2-3x early on)."""
    from prodigyopt import Prodigy
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    applied, after, real_step = [], [], Prodigy.step

    def recording(self, *args, **kwargs):
        applied.append(self.param_groups[0]["d"] * self.param_groups[0]["lr"])
        result = real_step(self, *args, **kwargs)
        after.append(self.param_groups[0]["d"] * self.param_groups[0]["lr"])
        return result

    monkeypatch.setattr(Prodigy, "step", recording)
    out, logs = tmp_path / "run", tmp_path / "tb"
    code = train_lora.main(flux_args(tiny_set, out, "--max_train_steps", "3", "--sample_prompts", "",
                                     "--logging_dir", str(logs), "--log_prefix", "probe",
                                     "--optimizer_args", "d0=1e-4", "d_coef=2.0"))
    assert code == 0
    applied, after = applied[-3:], after[-3:]  # (the config check steps a stand-in optimizer first)
    assert applied != after  # d grew: the test tells the two apart
    with open(out / "tiny_flux_lora_log.csv") as f:
        assert [float(r["d*lr/lora"]) for r in csv.DictReader(f)] == pytest.approx(applied, rel=1e-6)
    events = [os.path.join(d, f) for d, _, fs in os.walk(logs) for f in fs if f.startswith("events.out")]
    assert events
    acc = EventAccumulator(os.path.dirname(events[0]))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"loss", "lr/lora", "d*lr/lora"} <= tags
    assert [e.step for e in acc.Scalars("d*lr/lora")] == [1, 2, 3]
    assert [e.value for e in acc.Scalars("d*lr/lora")] == pytest.approx(applied, rel=1e-6)


def test_bf16_compute_on_fp8_base_trains_fp32_lora(tiny_set, tmp_path):
    """The real configs' path: bf16 compute (accelerate autocast), fp8_scaled base, fp32 LoRA."""
    out = tmp_path / "bf16"
    code = train_lora.main(flux_args(tiny_set, out, "--mixed_precision", "bf16", "--max_train_steps", "20",
                                     "--optimizer_type", "AdamW", "--optimizer_args", "--learning_rate", "3e-3",
                                     "--sample_prompts", ""))
    assert code == 0
    tensors = load_file(out / "tiny_flux_lora.safetensors")
    assert {t.dtype for t in tensors.values()} == {torch.float32}
    assert any(t.abs().max() > 0 for k, t in tensors.items() if "lora_up" in k)
    losses = read_losses(out)
    assert all(v == v for v in losses) and sum(losses[-4:]) < sum(losses[:4])


def test_moved_dataset_trains_identically(tiny_set, tmp_path):
    """Noise seeds come from each image's path inside its subset, not from where the dataset
    lives: the same data in another folder gives the same LoRA tensors."""
    from tools.make_tiny_dataset import make_tiny_dataset

    tensors = []
    for where in ("a", "b"):
        data = make_tiny_dataset(str(tmp_path / where / "data"))
        out = tmp_path / where / "out"
        assert train_lora.main(flux_args(tiny_set, out, "--dataset_config", data["dataset_config"], "--max_train_steps", "3",
                                         "--sample_prompts", "", "--optimizer_type", "AdamW", "--optimizer_args", "--learning_rate", "1e-3")) == 0
        tensors.append(load_file(out / "tiny_flux_lora.safetensors"))
    assert tensors[0].keys() == tensors[1].keys() and all(torch.equal(tensors[0][k], tensors[1][k]) for k in tensors[0])


def test_the_last_step_renders_its_samples_once_as_the_final_ones(tiny_set, tmp_path, monkeypatch):
    """The old line rendered step 2's samples and then the same images again as the final ones."""
    from library.training.diffusion_task import DiffusionTask

    tags = []
    monkeypatch.setattr(DiffusionTask, "render_samples",
                        lambda self, out_dir, tag, stop=None, first=0: tags.append(tag) or [])
    assert train_lora.main(flux_args(tiny_set, tmp_path, "--max_train_steps", "2", "--sample_every_n_steps", "1")) == 0
    assert tags == ["step000001", "final"]


def test_a_nan_loss_in_another_process_stops_every_process_with_the_line_and_the_save(ddp_runs):
    """Old: process 1's NaN stopped process 1 alone; the main process (which saves and prints) died in
    the next all-reduce: no line, no LoRA, exit 1 through torchrun's traceback."""
    out, launched = ddp_runs[0] / "nan", ddp_runs[1]
    log = launched_log(out)
    assert "error: another process's loss is not finite at step 2" in log and returned(out) == [3, 3], (
        log or launched.stderr)[-2000:]
    assert (out / "tiny_flux_lora-step000001.safetensors").exists()


def test_a_full_disk_at_the_main_process_save_is_every_process_line_not_a_traceback(ddp_runs):
    """Only the main process saves, so only it met the full disk: its line, then process 1's ~40-line gloo
    traceback ("Connection closed by peer") from the next all-reduce and torchrun's summary, exit 1. The save's
    error is every process's now: each says the line and exits 2, as one process does."""
    out, launched = ddp_runs[0] / "full_disk", ddp_runs[1]
    log = launched_log(out)
    line = (f"error: {out / 'tiny_flux_lora-step000001.safetensors'}: cannot be written, no space left on device "
            f"(nothing was written)")
    assert returned(out) == [2, 2] and log.count(line) == 2, (log or launched.stderr)[-2000:]
    assert "Traceback" not in log and not (out / "tiny_flux_lora-step000001.safetensors").exists()


def test_a_render_failing_in_another_process_is_its_warning_line_and_every_process_trains_on(ddp_runs):
    """Process 1 out of memory loading its first render's VAE: process 0 waited in the render's broadcast of its
    names, process 1 in the next step's all-reduce, a deadlock until the launcher's timeout; and its warning line
    was never printed (the main process's alone were). Now the names come first: process 1 says why its samples
    are skipped, both train on to the end and save."""
    out, launched = ddp_runs[0] / "render_oom", ddp_runs[1]
    log = launched_log(out)
    assert returned(out) == [0, 0], (log or launched.stderr)[-2000:]
    assert ("warning: samples step000001 at step 1 failed in process 1 and are skipped, training goes on: "
            "OutOfMemoryError: CUDA out of memory (a test's)") in log, log[-2000:]
    assert (out / "tiny_flux_lora.safetensors").exists() and list(out.glob("*_step000001_*.png"))
    # A warning every process meets alike (the prompt file's unread --n) is the main process's alone, once: it
    # was printed by each process (as every dataset-scan warning), the main one's warnings holding it once.
    warned = [open(f"{out}.rank{rank}.log").read().count("--n (--negative) is not read") for rank in (0, 1)]
    assert warned == [1, 0], warned


def test_a_sigterm_to_one_process_stops_every_process_at_that_step_with_the_save(ddp_runs):
    """A SIGTERM to one worker's pid (taken from top or nvidia-smi) stopped that worker alone (exit 130, no
    line: only the main process prints); the main one failed in the next all-reduce, nothing saved. The
    flag is agreed every step now: both stop at step 2, the main process saves the LoRA and the state."""
    out, launched = ddp_runs[0] / "sigterm", ddp_runs[1]
    log = launched_log(out)
    assert "a signal to another process: saved" in log and returned(out) == [130, 130], (
        log or launched.stderr)[-2000:]
    assert (out / "tiny_flux_lora-step000002.safetensors").exists() and (out / "tiny_flux_lora-state").is_dir()


def test_a_stop_waits_for_the_main_processs_slow_save_and_a_second_signal_does_not_cut_it(ddp_runs):
    """Old: process 1 left (exit 130) as soon as it stopped; torchrun then SIGTERMed the main one, whose save was
    still being written: KeyboardInterrupt (a second signal), no state. A second Ctrl-C cut it alike. Every process
    waits for the main one's save now, and a second signal during it does not cut it. (The launch's last run: its
    processes' exits are the ones torchrun sees.)"""
    out, launched = ddp_runs[0] / "slow_save", ddp_runs[1]
    log = launched_log(out)
    assert "SIGTERM: saved" in log and (out / "tiny_flux_lora-state").is_dir(), (log or launched.stderr)[-2000:]
    written = float(re.search(r"state written at ([\d.]+)", log).group(1))
    # Process 1 waited: it passed its last barrier after the save. (Its "returned" line is not the proof: when
    # process 0 ends first, torchrun SIGTERMs process 1 in its end_training, before it prints that line.)
    passed = [float(t) for t in re.findall(r"rank 1 past a barrier at ([\d.]+)", log)]
    assert passed and passed[-1] >= written, f"{log[-3000:]}\n{launched.stderr[-2000:]}"
    assert re.search(r"exitcode\s+: 130", launched.stderr) and launched.returncode == 1, launched.stderr[-2000:]


def test_each_process_draws_its_own_dropout_masks_and_a_resume_the_same_ones():
    """network_dropout / rank_dropout draw from the global RNG, seeded alike in every process: 2 processes drew
    one mask for their 2 samples. Seeded by (seed, step, process) at each step now."""
    from types import SimpleNamespace

    def masks(rank, step):
        trainer = SimpleNamespace(args=SimpleNamespace(seed=7), step=step, accelerator=SimpleNamespace(process_index=rank))
        train_lora.Trainer.seed_dropout(trainer)
        return torch.nn.functional.dropout(torch.ones(64), 0.5) != 0

    assert not torch.equal(masks(0, 3), masks(1, 3)) and not torch.equal(masks(0, 3), masks(0, 4))
    assert torch.equal(masks(1, 3), masks(1, 3))


def test_a_trainer_started_with_sigint_ignored_still_stops_on_it(tiny_set, tmp_path):
    """A script's background job starts with SIGINT ignored (a web UI started with `... &` launches its jobs so):
    Stop during loading / caching was lost and the run trained to its end. SIGINT is handled from the start."""
    argv = [sys.executable, os.path.join(ROOT, "train_lora.py"), *flux_args(tiny_set, tmp_path, "--max_train_steps", "400")]
    process = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    first = process.stdout.readline()  # its first line: loading, before the loop's handler
    process.send_signal(signal.SIGINT)
    out = first + process.communicate(timeout=300)[0]
    assert process.returncode == 130 and "interrupted: stopped before the next save" in out, out[-400:]
