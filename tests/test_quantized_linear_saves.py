"""Every quantized base Linear (fp8, bitsandbytes nf4 / int8, GGUF blocks, BFL fp8r / nvfp4) keeps no
dequantized weight for backward and passes nothing through autograd's saved-tensor hooks: its stored
tensors are its own resident buffers, held by the one autograd Function they share
(precision/dequantized_linear.py). Under checkpointing each saved tensor costs a Python pack hook in
forward and in the recompute and an unpack in backward (issue 29's host cost). An input that needs no gradient runs plain ops, with the same bits."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from library.precision import bfl_weights as bfl, bnb_weights as bnb, fp8, gguf_weights as gg
from library.precision.dequantized_linear import DequantizedLinearFunction
from tests.test_gguf import random_blocks

IN, OUT = 256, 96


def fp8_layer():
    return fp8.FP8Linear.from_linear(nn.Linear(IN, OUT), "fp8_scaled")


def bnb_layer(mode):
    return lambda: bnb.from_linear(nn.Linear(IN, OUT), mode)


def gguf_layer(qtype):
    def make():
        layer = gg.GGUFLinear(IN, OUT, True, qtype)
        layer.weight = random_blocks(qtype, OUT, IN, seed=3)
        layer.bias = nn.Parameter(torch.randn(OUT) * 0.1, requires_grad=False)
        return layer
    return make


def bfl_layer(kind):
    def make():
        layer = bfl.BFLLinear(IN, OUT, True, kind)
        if kind == "fp8r":
            layer.weight = torch.randn(OUT, IN).to(torch.float8_e4m3fn)
            layer.weight_scale = torch.rand(OUT) * 0.01 + 0.001
        else:
            layer.weight = torch.randint(0, 256, (OUT, IN // 2), dtype=torch.uint8)
            layer.weight_scale = (torch.rand(OUT, IN // bfl.NVFP4_BLOCK) + 0.5).to(torch.float8_e4m3fn)
            layer.weight_scale_2 = torch.tensor(0.01)
        layer.bias = nn.Parameter(torch.randn(OUT) * 0.1, requires_grad=False)
        return layer
    return make


LAYERS = {"fp8_scaled": fp8_layer, "nf4": bnb_layer("nf4"), "nf4_dq": bnb_layer("nf4_dq"), "int8": bnb_layer("int8"),
          "gguf_Q8_0": gguf_layer("Q8_0"), "gguf_Q4_K": gguf_layer("Q4_K"), "bfl_fp8r": bfl_layer("fp8r"),
          "bfl_nvfp4": bfl_layer("nvfp4")}


@pytest.mark.parametrize("name", list(LAYERS))
def test_backward_saves_nothing_through_autograd_and_gives_the_dequantized_grad(name):
    """Before, the stored tensors went through a pack hook each (bnb, GGUF, BFL): the test fails on that."""
    torch.manual_seed(0)
    layer = LAYERS[name]()
    saved = []
    x = torch.randn(2, 8, IN, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        y = layer(x)
    assert saved == [] and y.grad_fn is not None
    y.square().sum().backward()
    x_ref = x.detach().clone().requires_grad_(True)
    expected = F.linear(x_ref, layer.dequantized_weight(torch.float32), layer.bias.float())
    expected.square().sum().backward()
    assert torch.equal(y, expected) and torch.equal(x.grad, x_ref.grad)


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("name", list(LAYERS))
def test_an_input_without_backward_runs_plain_ops_with_the_same_bits(monkeypatch, name, autocast):
    """A modulation Linear's timestep embedding, sampling: no backward to dequantize again for, so no
    autograd Function, and the output bits of the Function's forward."""
    torch.manual_seed(0)
    layer = LAYERS[name]()
    calls = []
    apply = DequantizedLinearFunction.apply
    monkeypatch.setattr(DequantizedLinearFunction, "apply", lambda *a: calls.append(1) or apply(*a))
    x = torch.randn(3, 7, IN, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        plain = layer(x)
        with torch.no_grad():
            plain_no_grad = layer(x.requires_grad_(True))
        assert calls == []
        through_function = layer(x)
    assert calls == [1] and through_function.grad_fn is not None
    assert plain.dtype == torch.bfloat16 and plain.grad_fn is None
    assert torch.equal(plain, through_function) and torch.equal(plain_no_grad, through_function)
