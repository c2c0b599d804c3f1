"""torch_compile unset: compiled on CUDA where it was measured faster (bench/RESULTS.md, H100), eager
elsewhere; an explicit true / false wins. CPU here: the CUDA branches take the device type as given."""

import collections
import warnings
from types import SimpleNamespace

import pytest
import torch

from library.training.config_schema import SCHEMA
from library.training.diffusion_task import DiffusionTask, compile_by_default


BIG = 12 * 10**9  # FLUX.1-dev's transformer


def lora_args(**kw):
    base = dict(network_module="networks.lora", network_args=[], network_dropout=None, base_precision=None,
                fp8_base=False, fp8_scaled=False, fp8_compute=False, checkpoint_saves_dequantized=False,
                torch_compile=None, config_file="x.toml")
    return SimpleNamespace(**{**base, **kw})


def test_the_key_is_unset_by_default():
    assert SCHEMA["torch_compile"].default is None


@pytest.mark.parametrize("precision", [dict(), dict(fp8_base=True), dict(fp8_base=True, fp8_scaled=True),
                                       dict(fp8_base=True, fp8_compute=True),
                                       dict(fp8_base=True, fp8_scaled=True, fp8_compute=True)])
def test_compiled_on_cuda_with_triton_for_lora_on_a_bf16_or_fp8_base(precision):
    """fp8_compute too: compiled on the H200 its fused quantizers made the step x0.88 / x0.91 of the compiled
    dequantizing fp8 step (bench/RESULTS.md, 2026-12-04), where eager it was x1.18-1.45 of bf16's."""
    on, why = compile_by_default(lora_args(**precision), "cuda", True, None, 1, BIG, False)
    assert on, why


def test_dora_is_the_networks_not_the_spelling_of_its_argument():
    """network_args 'dora=no' is no DoRA (LoRANetwork reads it so): compiled; the built network's flag decides."""
    assert compile_by_default(lora_args(network_args=["dora=no"]), "cuda", True, None, 1, BIG, False)[0]


@pytest.mark.parametrize("args, device, triton, stored, processes, reason", [
    (lora_args(), "cpu", True, None, 1, "not on CUDA"),
    (lora_args(), "cuda", True, None, 1, "a 5 M-parameter model"),
    (lora_args(), "cuda", False, None, 1, "Triton"),
    (lora_args(), "cuda", True, None, 2, "2 processes"),
    (lora_args(network_module="networks.lycoris"), "cuda", True, None, 1, "networks.lycoris"),
    (lora_args(network_args=["dora=True"]), "cuda", True, None, 1, "with DoRA"),
    (lora_args(base_precision="nf4"), "cuda", True, None, 1, "a nf4 base"),
    (lora_args(), "cuda", True, "gguf_q8_0", 1, "a gguf_q8_0 base"),
])
def test_eager_where_compile_was_not_measured(args, device, triton, stored, processes, reason):
    on, why = compile_by_default(args, device, triton, stored, processes, 5_000_000 if "5 M" in reason else BIG,
                                 reason == "with DoRA")
    assert not on and reason in why, why


class FakeTask:
    """DiffusionTask._compiles on a stand-in: the device, the accelerator and the stored layout."""

    _compiles = DiffusionTask._compiles

    def __init__(self, args, device_type="cpu"):
        self.args, self.stored_precision = args, None
        self.base, self.network = torch.nn.Linear(4, 4), SimpleNamespace(dora=False)
        self.device = SimpleNamespace(type=device_type)
        self.accelerator = SimpleNamespace(num_processes=1, is_main_process=True)


@pytest.mark.parametrize("value", [True, False])
def test_an_explicit_value_wins(value, capsys):
    task = FakeTask(lora_args(torch_compile=value), "cuda")
    assert task._compiles() is value
    assert capsys.readouterr().out == ""


def test_unset_on_the_cpu_is_eager_and_silent(capsys):
    task = FakeTask(lora_args())
    assert task._compiles() is False and task.args.torch_compile is False
    assert capsys.readouterr().out == ""


def test_unset_on_cuda_says_what_it_chose(monkeypatch, capsys):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "triton" else object())
    task = FakeTask(lora_args(), "cuda")
    assert task._compiles() is False
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "torch_compile unset: off (Triton is not installed" in out, out


def test_a_recompile_limit_hit_is_said_once_a_run(monkeypatch):
    """Past dynamo's recompile_limit the blocks' new variants run eager, slower than no compile at all
    (a full-size step 1.55x eager's on an H200 until 2026-11-27): the run says it in one warning, once,
    at the step it happened by (block_checkpoint.compile_limit_hits reads dynamo's counters: tests/test_block_swap.py
    makes a real hit); a hit of an earlier run in the same process (the web UI's) is not this run's."""
    from torch._dynamo.utils import counters

    class Task(FakeTask):
        after_step, _compile_blocks = DiffusionTask.after_step, DiffusionTask._compile_blocks
        _said_compile_limit, _compile_limit_hits = DiffusionTask._said_compile_limit, DiffusionTask._compile_limit_hits

    limit_hit = "Dynamo recompile limit exceeded\n  Explanation: ..."
    monkeypatch.setitem(counters, "unimplemented", collections.Counter({limit_hit: 1}))  # an earlier run's
    task, eager = Task(lora_args(torch_compile=True)), Task(lora_args(torch_compile=False))
    task.base = SimpleNamespace(swappable_blocks=lambda: [])
    task._compile_blocks()  # (no blocks here) takes note of the hits so far
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        task.after_step(1, "out")
        counters["unimplemented"][limit_hit] += 1
        for step in (2, 3):
            task.after_step(step, "out")
            eager.after_step(step, "out")
    said = [str(w.message) for w in caught]
    assert len(said) == 1 and said[0].startswith("torch_compile: torch._dynamo hit its recompile_limit (") and \
        ") by step 2: " in said[0], said
