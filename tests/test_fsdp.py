"""FSDP (library/training/fsdp.py): `accelerate launch --config_file configs/accelerate/fsdp.yaml`
on 2 CPU gloo processes shards the frozen fp8 base in halves and trains exactly what 1 process
trains with the doubled batch (losses, val_loss, the saved LoRA); and the pieces on their own."""

import csv
import os
import re
import shutil
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from library.models.flux1.family import FluxFamily
from library.precision.fp8 import quantize_module
from library.training import fsdp
from library.training.config import ConfigError
from library.training.fsdp import check_fsdp, stored_buffers_to_parameters
from networks.lora import LoRANetwork
from tests.test_train_lora import ROOT, flux_args, free_port, launch, launched_log, returned, train_single
from library.models.registry import arch_spec


def read_log(out, column, name="tiny_flux_lora"):
    with open(os.path.join(out, f"{name}_log.csv")) as f:
        return [float(r[column]) if r[column] else None for r in csv.DictReader(f)]


def write_datasets(tiny_set, tmp_path, validation: bool):
    """ds1.toml / ds2.toml: batch 1 and 2 over one bucket, so both runs see the same samples."""
    held_out = tmp_path / "held_out"  # 3 validation images: 2 + 1 forwards per process unless padded
    held_out.mkdir()
    for stem in ("000", "001", "002"):
        for ext in (".png", ".txt"):
            shutil.copy(os.path.join(tiny_set["image_dir"], stem + ext), held_out / (stem + ext))
    extra = (f'[[validation_datasets]]\nbatch_size = 1\n[[validation_datasets.subsets]]\nimage_dir = "{held_out}"\n'
             if validation else "")
    for bs in (1, 2):
        (tmp_path / f"ds{bs}.toml").write_text(
            f'[general]\nresolution = 64\nbatch_size = {bs}\n[[datasets]]\n[[datasets.subsets]]\n'
            f'image_dir = "{tiny_set["image_dir"]}"\n' + extra)


FLUX_EQUALITY = ["--max_train_steps", "3", "--optimizer_type", "AdamW", "--optimizer_args", "--learning_rate", "1e-3",
                 "--sample_prompts", "", "--validate_every_n_steps", "2"]  # quickstart: fp8_scaled base, fp32 compute


LOWBIT_STEP = ["--max_train_steps", "1", "--optimizer_type", "AdamW", "--optimizer_args", "--learning_rate", "1e-3",
               "--sample_prompts", "", "--fp8_base", "false"]


def qwen_equality(tiny_set):
    return ["--model_type", "qwen_image", "--pretrained_model_name_or_path", tiny_set["qwen_image"],
            "--ae", tiny_set["qwen_image_vae"], "--text_encoder", tiny_set["qwen_image_text_encoder"],
            "--output_name", "qwen", "--max_train_steps", "2", "--mixed_precision", "no", "--fp8_base",
            "--network_dim", "4", "--optimizer_type", "AdamW", "--learning_rate", "1e-3"]


@pytest.fixture(scope="module")
def fsdp_runs(tiny_set, tmp_path_factory):
    """This file's 2-process runs, in one launch through configs/accelerate/fsdp.yaml (2 gloo processes): the
    flux (with validation) and Qwen-Image runs the equality tests compare with 1 process, one step on an nf4 and
    a GGUF base, and last the SIGTERM to process 1 during the samples. -> (the folder with run <name>'s output
    in <name>/, the launch)."""
    from tests.test_gguf import tiny_gguf

    folder = tmp_path_factory.mktemp("fsdp")
    for datasets, validation in (("validated", True), ("plain", False)):
        (folder / datasets).mkdir()
        write_datasets(tiny_set, folder / datasets, validation)
    plain = ["--dataset_config", str(folder / "plain" / "ds1.toml")]
    runs = [(None, flux_args(tiny_set, folder / "doubled_batch", "--dataset_config",
                             str(folder / "validated" / "ds1.toml"), *FLUX_EQUALITY)),
            (None, [*qwen_equality(tiny_set), *plain, "--output_dir", str(folder / "qwen")]),
            (None, flux_args(tiny_set, folder / "nf4", *plain, *LOWBIT_STEP, "--base_precision", "nf4")),
            (None, flux_args(tiny_set, folder / "gguf", *plain, *LOWBIT_STEP, "--pretrained_model_name_or_path",
                             tiny_gguf(tiny_set, folder / "flux1-tiny-Q8_0.gguf")[0])),
            ("sigterm_to_process_1_in_a_render", flux_args(tiny_set, folder / "render", *plain, "--max_train_steps", "2",
                                                           "--sample_every_n_steps", "1"))]
    return folder, launch(["accelerate.commands.launch", "--config_file",
                           os.path.join(ROOT, "configs", "accelerate", "fsdp.yaml"), "--num_processes", "2",
                           "--mixed_precision", "no", "--main_process_port", free_port()], runs, folder)


def assert_same_lora(a_path, b_path):
    """Within the DDP test's tolerance: 2% of the largest up weight."""
    a, b = load_file(a_path), load_file(b_path)
    up = max(a[k].abs().max().item() for k in a if "lora_up" in k)
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    assert sorted(a) == sorted(b) and up > 1e-3 and diff <= 0.02 * up, (diff, up)


def test_two_fsdp_processes_shard_the_base_and_equal_one_process_with_doubled_batch(fsdp_runs, tiny_set, tmp_path,
                                                                                    monkeypatch):
    folder, launched = fsdp_runs
    multi_out, single_out = folder / "doubled_batch", tmp_path
    output = launched_log(multi_out)
    assert returned(multi_out) == [0, 0], (output or launched.stderr)[-2000:]
    train_single(flux_args(tiny_set, single_out, "--dataset_config", str(folder / "validated" / "ds2.toml"),
                           *FLUX_EQUALITY), monkeypatch)

    # Each process holds half of the base: the whole is what the fp8_scaled base weighs unsharded.
    held = held_bytes(output)
    base = FluxFamily(tiny_set["flux_bfl"]).load_transformer(torch.float32, "fp8_scaled")
    whole = sum(t.numel() * t.element_size() for t in [*base.parameters(), *base.buffers()])
    assert sorted(held) == [0, 1] and all(w == whole for _, w in held.values()), (held, whole)
    assert all(h <= 0.51 * whole for h, _ in held.values()) and sum(h for h, _ in held.values()) >= whole, held

    assert read_log(multi_out, "loss") == pytest.approx(read_log(single_out, "loss"), abs=1e-5)
    val_single, val_multi = read_log(single_out, "val_loss"), read_log(multi_out, "val_loss")
    assert val_single[1] is not None and val_multi == pytest.approx(val_single, abs=1e-5)
    assert_same_lora(single_out / "tiny_flux_lora.safetensors", multi_out / "tiny_flux_lora.safetensors")
    LoRANetwork(base, "flux", 8, 8.0).load_weights(str(multi_out / "tiny_flux_lora.safetensors"))  # a normal file


def held_bytes(output: str) -> dict[int, tuple[int, int]]:
    """process -> (bytes of the base it holds, bytes of the whole base), from the launched run's fsdp lines."""
    return {int(m[0]): (int(m[1]), int(m[2])) for m in
            re.findall(r"fsdp: process (\d) of 2 holds [^()]*\((\d+) of (\d+) bytes\)", output)}


@pytest.mark.parametrize("base", ["nf4", "gguf"])
def test_an_nf4_or_gguf_base_is_sharded_too_and_trains_as_one_process(fsdp_runs, tiny_set, tmp_path, monkeypatch, base):
    """Their stored tensors were buffers, which FSDP replicates: each of 2 processes held 72% (nf4) / 79% (GGUF)
    of the tiny base (at full size nearly all of it), without a word. Now half, and the step's loss is one
    process's with the doubled batch."""
    folder, launched = fsdp_runs
    out = folder / base
    output = launched_log(out)
    assert returned(out) == [0, 0], (output or launched.stderr)[-2000:]
    held = held_bytes(output)
    assert sorted(held) == [0, 1] and all(h <= 0.51 * w for h, w in held.values()), held
    lowbit = (["--base_precision", "nf4"] if base == "nf4" else
              ["--pretrained_model_name_or_path", str(folder / "flux1-tiny-Q8_0.gguf")])
    train_single(flux_args(tiny_set, tmp_path, "--dataset_config", str(folder / "plain" / "ds2.toml"), *LOWBIT_STEP,
                           *lowbit), monkeypatch)
    assert read_log(out, "loss") == pytest.approx(read_log(tmp_path, "loss"), abs=1e-5)


def test_qwen_image_under_fsdp_equals_one_process(fsdp_runs, tiny_set, tmp_path, monkeypatch):
    """Qwen-Image's last block leaves LoRAs without a gradient (its text stream feeds nothing)."""
    folder, launched = fsdp_runs
    multi = folder / "qwen"
    assert returned(multi) == [0, 0], (launched_log(multi) or launched.stderr)[-2000:]
    train_single([*qwen_equality(tiny_set), "--dataset_config", str(folder / "plain" / "ds2.toml"),
                  "--output_dir", str(tmp_path)], monkeypatch)
    assert read_log(multi, "loss", "qwen") == pytest.approx(read_log(tmp_path, "loss", "qwen"), abs=1e-5)
    assert_same_lora(tmp_path / "qwen.safetensors", multi / "qwen.safetensors")


def test_a_sigterm_to_one_fsdp_process_during_samples_stops_both_at_the_same_prompt_with_the_save(fsdp_runs):
    """Old: process 1 left the render before prompt 2 for the step's all-reduce while process 0 waited in
    prompt 2's all-gather of the sharded base: a deadlock, nothing saved. The render's stop is agreed now.
    (The launch's last run: its processes' exits are the ones the launcher sees.)"""
    out, launched = fsdp_runs[0] / "render", fsdp_runs[1]
    log = launched_log(out)
    assert "a signal to another process: saved" in log and returned(out) == [130, 130], (
        log or launched.stderr)[-2000:]
    assert re.search(r"exitcode\s+: 130", launched.stderr), launched.stderr[-2000:]
    assert (out / "tiny_flux_lora-step000001.safetensors").exists() and (out / "tiny_flux_lora-state").is_dir()
    assert [p.name.split("_")[4] for p in out.glob("*_step000001_*.png")] == ["00"]  # both stopped before prompt 2


def test_a_render_failing_in_one_fsdp_process_stops_the_run_with_its_line_not_a_hang(monkeypatch, capsys):
    """Under FSDP the others wait for a failed process in the sampling forward's all-gather: its warning ("training
    goes on") left them there, a hang with no line (its print was the main process's alone). It stops the run now,
    one error line from each process, exit 1; under DDP it stays a warning, from whichever process failed."""
    import train_lora

    trainer = train_lora.Trainer.__new__(train_lora.Trainer)
    trainer.accelerator = SimpleNamespace(process_index=1, num_processes=2)
    monkeypatch.setattr(fsdp, "uses_fsdp", lambda accelerator: True)
    with pytest.raises(train_lora.SamplesFailed) as stopped:
        trainer.render_failed("samples step000001 at step 1", ", training goes on", torch.OutOfMemoryError("CUDA oom"))
    assert str(stopped.value) == ("samples step000001 at step 1 failed in process 1 under FSDP, whose other processes "
                                  "wait for it in the sampling forward: the run stops (its last save is the one to "
                                  "resume from): OutOfMemoryError: CUDA oom")
    monkeypatch.setattr(train_lora, "train", lambda args: (_ for _ in ()).throw(stopped.value))
    monkeypatch.setattr(train_lora, "load_config", lambda argv: SimpleNamespace())
    capsys.readouterr()
    assert train_lora.main([]) == 1
    assert capsys.readouterr().err == f"error: {stopped.value}\n"
    monkeypatch.setattr(fsdp, "uses_fsdp", lambda accelerator: False)
    trainer.render_failed("samples step000001 at step 1", ", training goes on", torch.OutOfMemoryError("CUDA oom"))
    assert capsys.readouterr().err == ("warning: samples step000001 at step 1 failed in process 1 and are skipped, "
                                       "training goes on: OutOfMemoryError: CUDA oom\n")


def test_fp8_codes_become_frozen_parameters_with_the_same_values(tiny_set):
    model = quantize_module(FluxFamily(tiny_set["flux_bfl"]).load_transformer(torch.float32), "fp8_scaled", arch_spec("flux").fp8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    moved = stored_buffers_to_parameters(model)
    after = model.state_dict()
    assert moved > 0 and moved == sum(1 for k, v in after.items() if v.dtype == torch.float8_e4m3fn) * 2
    assert sorted(after) == sorted(before)
    assert all(after[k].dtype == v.dtype and torch.equal(after[k].view(torch.uint8) if v.dtype.itemsize == 1 else
                                                         after[k], v.view(torch.uint8) if v.dtype.itemsize == 1 else v)
               for k, v in before.items())
    params = dict(model.named_parameters())
    codes = params["double_blocks.0.img_attn.qkv.weight"]
    assert codes.dtype == torch.float8_e4m3fn and not codes.requires_grad
    assert not params["double_blocks.0.img_attn.qkv.weight_scale"].requires_grad


@pytest.mark.parametrize("key, value, words", [
    ("blocks_to_swap", 2, "blocks_to_swap = 2 under FSDP"), ("torch_compile", True, "torch_compile"),
    ("mixed_precision", "fp16", "fp16"), ("model_type", "llm", "llm"),
])
def test_what_the_sharded_base_does_not_support_is_one_clear_error(monkeypatch, key, value, words):
    from accelerate.utils import DistributedType

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    accelerator = SimpleNamespace(distributed_type=DistributedType.MULTI_CPU)
    args = SimpleNamespace(config_file="x.toml", model_type="flux", blocks_to_swap=0, torch_compile=False,
                           mixed_precision="bf16")
    check_fsdp(accelerator, args)  # the defaults pass
    setattr(args, key, value)
    with pytest.raises(ConfigError, match=words) as refused:
        check_fsdp(accelerator, args)
    assert str(refused.value).startswith(f"x.toml: {key} = "), refused.value
    args.key_origins = {key: "command line"}  # the line named the config file for a command-line value
    with pytest.raises(ConfigError, match=f"^command line: {key} = "):
        check_fsdp(accelerator, args)
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(ConfigError, match="fsdp_version: 2"):
        check_fsdp(accelerator, SimpleNamespace(config_file=None))
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "false")
    assert not fsdp.uses_fsdp(accelerator)
