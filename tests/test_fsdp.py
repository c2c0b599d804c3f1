"""FSDP (library/training/fsdp.py): `accelerate launch --config_file configs/accelerate/fsdp.yaml`
on 2 CPU gloo processes shards the frozen fp8 base in halves and trains exactly what 1 process
trains with the doubled batch (losses, val_loss, the saved LoRA); and the pieces on their own."""

import csv
import os
import re
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from library.models.flux1.family import FluxFamily
from library.precision.fp8 import quantize_module
from library.training import fsdp
from library.training.config import ConfigError
from library.training.fsdp import check_fsdp, fp8_buffers_to_parameters
from networks.lora import LoRANetwork
from tests.test_train_lora import ROOT, flux_args, free_port, train_single
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


def run_single_and_fsdp(single: list[str], multi: list[str], monkeypatch) -> str:
    """1 plain process (this one), then 2 gloo processes through configs/accelerate/fsdp.yaml; their output."""
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    train_single(single, monkeypatch)
    run = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                          os.path.join(ROOT, "configs", "accelerate", "fsdp.yaml"), "--num_processes", "2",
                          "--mixed_precision", "no", "--main_process_port", free_port(), "train_lora.py", *multi],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, [l for l in run.stderr.splitlines() if "error" in l.lower()][:5]
    return run.stdout + run.stderr


def assert_same_lora(a_path, b_path):
    """Within the DDP test's tolerance: 2% of the largest up weight."""
    a, b = load_file(a_path), load_file(b_path)
    up = max(a[k].abs().max().item() for k in a if "lora_up" in k)
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    assert sorted(a) == sorted(b) and up > 1e-3 and diff <= 0.02 * up, (diff, up)


def test_two_fsdp_processes_shard_the_base_and_equal_one_process_with_doubled_batch(tiny_set, tmp_path, monkeypatch):
    write_datasets(tiny_set, tmp_path, validation=True)
    common = ["--max_train_steps", "3", "--optimizer_type", "AdamW", "--optimizer_args", "--learning_rate", "1e-3",
              "--sample_prompts", "", "--validate_every_n_steps", "2"]  # quickstart: fp8_scaled base, fp32 compute
    single = flux_args(tiny_set, tmp_path / "single", "--dataset_config", str(tmp_path / "ds2.toml"), *common)
    multi = flux_args(tiny_set, tmp_path / "multi", "--dataset_config", str(tmp_path / "ds1.toml"), *common)
    output = run_single_and_fsdp(single, multi, monkeypatch)

    # Each process holds half of the base: the whole is what the fp8_scaled base weighs unsharded.
    # (The two processes share one pipe: both lines can land on one, so the pattern stops at "(".)
    held = {int(m[0]): (int(m[1]), int(m[2])) for m in
            re.findall(r"fsdp: process (\d) of 2 holds [^()]*\((\d+) of (\d+) bytes\)", output)}
    base = FluxFamily(tiny_set["flux_bfl"]).load_transformer(torch.float32, "fp8_scaled")
    whole = sum(t.numel() * t.element_size() for t in [*base.parameters(), *base.buffers()])
    assert sorted(held) == [0, 1] and all(w == whole for _, w in held.values()), (held, whole)
    assert all(h <= 0.51 * whole for h, _ in held.values()) and sum(h for h, _ in held.values()) >= whole, held

    single_out, multi_out = tmp_path / "single", tmp_path / "multi"
    assert read_log(multi_out, "loss") == pytest.approx(read_log(single_out, "loss"), abs=1e-5)
    val_single, val_multi = read_log(single_out, "val_loss"), read_log(multi_out, "val_loss")
    assert val_single[1] is not None and val_multi == pytest.approx(val_single, abs=1e-5)
    assert_same_lora(single_out / "tiny_flux_lora.safetensors", multi_out / "tiny_flux_lora.safetensors")
    LoRANetwork(base, "flux", 8, 8.0).load_weights(str(multi_out / "tiny_flux_lora.safetensors"))  # a normal file


def test_qwen_image_under_fsdp_equals_one_process(tiny_set, tmp_path, monkeypatch):
    """Qwen-Image's last block leaves LoRAs without a gradient (its text stream feeds nothing)."""
    write_datasets(tiny_set, tmp_path, validation=False)
    args = ["--model_type", "qwen_image", "--pretrained_model_name_or_path", tiny_set["qwen_image"],
            "--ae", tiny_set["qwen_image_vae"], "--text_encoder", tiny_set["qwen_image_text_encoder"],
            "--output_name", "qwen", "--max_train_steps", "2", "--mixed_precision", "no", "--fp8_base",
            "--network_dim", "4", "--optimizer_type", "AdamW", "--learning_rate", "1e-3"]
    single, multi = tmp_path / "single", tmp_path / "multi"
    run_single_and_fsdp([*args, "--dataset_config", str(tmp_path / "ds2.toml"), "--output_dir", str(single)],
                        [*args, "--dataset_config", str(tmp_path / "ds1.toml"), "--output_dir", str(multi)], monkeypatch)
    assert read_log(multi, "loss", "qwen") == pytest.approx(read_log(single, "loss", "qwen"), abs=1e-5)
    assert_same_lora(single / "qwen.safetensors", multi / "qwen.safetensors")


SIGTERM_IN_A_RENDER = """
import os, signal, sys
sys.path.insert(0, os.getcwd())
from library.models.family import DiffusionFamily
import train_lora

signal.alarm(150)  # a deadlocked worker (blocked in a collective) is ended by the kernel: nothing left behind
real, calls = DiffusionFamily.sample_latents, []


def signalled(self, *a, **k):  # process 1 gets a SIGTERM inside its first sample (of 2 prompts)
    calls.append(1)
    if len(calls) == 1 and os.environ["RANK"] == "1":
        os.kill(os.getpid(), signal.SIGTERM)
    return real(self, *a, **k)


DiffusionFamily.sample_latents = signalled
sys.exit(train_lora.main(sys.argv[1:]))
"""


def test_a_sigterm_to_one_fsdp_process_during_samples_stops_both_at_the_same_prompt_with_the_save(tiny_set, tmp_path):
    """Old: process 1 left the render before prompt 2 for the step's all-reduce while process 0 waited in
    prompt 2's all-gather of the sharded base: a deadlock, nothing saved. The render's stop is agreed now."""
    write_datasets(tiny_set, tmp_path, validation=False)
    (tmp_path / "script.py").write_text(SIGTERM_IN_A_RENDER)
    out = tmp_path / "multi"
    argv = flux_args(tiny_set, out, "--dataset_config", str(tmp_path / "ds1.toml"), "--max_train_steps", "2",
                     "--sample_every_n_steps", "1")
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                          os.path.join(ROOT, "configs", "accelerate", "fsdp.yaml"), "--num_processes", "2",
                          "--mixed_precision", "no", "--main_process_port", free_port(), str(tmp_path / "script.py"),
                          *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=200)
    log = run.stdout + run.stderr
    assert "a signal to another process: saved" in log and re.search(r"exitcode\s+: 130", log), log[-2000:]
    assert (out / "tiny_flux_lora-step000001.safetensors").exists() and (out / "tiny_flux_lora-state").is_dir()
    assert [p.name.split("_")[4] for p in out.glob("*_step000001_*.png")] == ["00"]  # both stopped before prompt 2


def test_fp8_codes_become_frozen_parameters_with_the_same_values(tiny_set):
    model = quantize_module(FluxFamily(tiny_set["flux_bfl"]).load_transformer(torch.float32), "fp8_scaled", arch_spec("flux").fp8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    moved = fp8_buffers_to_parameters(model)
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
    with pytest.raises(ConfigError, match=words):
        check_fsdp(accelerator, args)
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(ConfigError, match="fsdp_version: 2"):
        check_fsdp(accelerator, SimpleNamespace(config_file=None))
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "false")
    assert not fsdp.uses_fsdp(accelerator)
