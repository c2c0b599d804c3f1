"""bench/bench_peers.py's checkout flags: a folder that is no sd-scripts / musubi-tuner checkout is one
line naming the flag and the file expected, before anything of theirs is imported (it was an import
traceback from deep inside importlib)."""

import argparse
import importlib
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("flag,family,marker", [
    ("musubi", "qwen_image", "src/musubi_tuner/qwen_image/qwen_image_model.py"),
    ("sd_scripts", "flux", "library/flux_models.py"),
])
def test_a_folder_that_is_no_checkout_is_one_line(tmp_path, monkeypatch, flag, family, marker):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "bench"))
    bench_peers = importlib.import_module("bench_peers")
    monkeypatch.setattr(sys, "path", list(sys.path))  # the importers below would add the checkout
    args = argparse.Namespace(**{"device": "cpu", "sd_scripts": None, "musubi": None, flag: str(tmp_path)})
    with pytest.raises(SystemExit) as stop:
        bench_peers.load_peers(args, [family])
    repo = "kohya-ss/" + bench_peers.PEER[family]
    assert str(stop.value) == (f"--{flag} {tmp_path}: no {marker} there; expected a {repo} checkout "
                               f"(git clone https://github.com/{repo})")


def test_the_comparison_names_the_attention_kernels_each_side_ran(monkeypatch):
    """bench_peers prints which fused attention kernel each side's step-0 forward ran (torch picks per call:
    flash on the CPU, cuDNN first on Hopper; a float mask with grad on the CPU falls back to the math path)."""
    import torch
    import torch.nn.functional as F
    monkeypatch.syspath_prepend(os.path.join(ROOT, "bench"))
    op_counts = importlib.import_module("op_counts")
    q = torch.randn(1, 2, 8, 16)
    with op_counts.AttentionKernels() as fused:
        F.scaled_dot_product_attention(q, q, q)
        F.scaled_dot_product_attention(q, q, q)
    assert str(fused) == "flash_attention_for_cpu x2"
    with op_counts.AttentionKernels() as none:
        F.scaled_dot_product_attention(q, q, q, attn_mask=torch.zeros(8, 8, requires_grad=True))
    assert str(none) == "math (no fused kernel)"
