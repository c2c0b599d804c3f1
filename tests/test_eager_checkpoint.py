"""library/models/eager_checkpoint.py: checkpointing whose forward records no graph trains the bits of
torch's non-reentrant checkpoint (the oracle: the same ops under autograd's own bookkeeping).

Each comparison runs two steps per kind without an optimizer step (the second is where a block that
keeps projections checkpoints eagerly: its first call runs torch's checkpoint, which says which outputs
are needed) and compares predictions and every LoRA gradient, None where one is None."""

import collections
import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from library.models import block_checkpoint, core, eager_checkpoint
from library.models.flux1.family import FluxFamily
from library.models.flux1.model import Flux, FluxConfig
from library.models.qwen_image.family import QwenImageFamily
from library.models.qwen_image.model import QwenImage, QwenImageConfig
from library.models.registry import arch_spec
from library.precision.fp8 import quantize_module
from library.precision.fp8_compute import enable_fp8_compute
from networks.lora import LoRANetwork
from networks.lycoris_network import LycorisNetwork

L, T = 16, 4  # 4 x 4 image patches, 4 text tokens
KEEPS = {"plain": True, "attention": core.Checkpointing(False, True), "both": core.Checkpointing(True, True)}


def _model(family: str):
    torch.manual_seed(0)
    if family == "flux":
        return Flux(FluxConfig(in_channels=64, vec_in_dim=16, context_in_dim=32, hidden_size=64, num_heads=2,
                               depth=2, depth_single=2, axes_dim=(4, 14, 14), guidance_embed=True))
    return QwenImage(QwenImageConfig(num_layers=2, attention_head_dim=32, num_attention_heads=2,
                                     joint_attention_dim=32, axes_dims_rope=(8, 12, 12)))


def _trainer(family: str, network_args: dict | None = None, device: str = "cpu", fp8_compute: bool = False):
    """(model, network, step): step(autocast) -> (prediction, {name: LoRA gradient or None}).
    network_args with "algo": a LyCORIS network (LoKr ...), else LoRA (DoRA with "dora"); fp8_compute:
    an fp8_scaled base whose bf16 calls run as fp8 GEMMs."""
    model = _model(family).requires_grad_(False).train().to(device)
    if fp8_compute:
        quantize_module(model, "fp8_scaled", arch_spec(family).fp8)
        assert enable_fp8_compute(model) > 0
    if network_args and "algo" in network_args:
        network = LycorisNetwork(model, family, 4, 2.0, network_args=network_args)
        with torch.no_grad():  # non-zero factors: every path carries gradient
            for p in network.parameters():
                p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(2)))
    else:
        network = LoRANetwork(model, family, 4, alpha=4, network_args=network_args)
        for m in network.lora_modules():
            torch.nn.init.normal_(m.lora_up.weight, std=0.1)  # non-zero: every path carries gradient
    network.apply()
    network.train().to(device)
    g = torch.Generator().manual_seed(1)
    ctx = model.config.context_in_dim if family == "flux" else model.config.joint_attention_dim
    x_t, txt, sigma = torch.randn(1, L, 64, generator=g), torch.randn(1, T, ctx, generator=g), torch.tensor([0.5])
    if family == "flux":
        text, predict = {"t5": txt, "clip_pooled": torch.randn(1, 16, generator=g)}, FluxFamily("unused").predict
    else:
        text, predict = {"embeds": txt, "mask": torch.ones(1, T, dtype=torch.bool)}, QwenImageFamily("unused").predict
    x_t, sigma, text = x_t.to(device), sigma.to(device), {k: v.to(device) for k, v in text.items()}

    def step(autocast: bool):
        network.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            pred = predict(model, x_t, sigma, text, 4, 4, 1.0)
        pred.float().square().mean().backward()
        return pred.detach(), {n: p.grad for n, p in network.named_parameters()}

    return model, network, step


def _steps(family: str, keep, autocast: bool, eager: bool, monkeypatch, network_args=None, seed: int | None = None,
           device: str = "cpu", fp8_compute: bool = False):
    """Two steps' (prediction, gradients) under eager_checkpoint (eager) or torch's checkpoint."""
    monkeypatch.setattr(eager_checkpoint, "usable", lambda: eager)
    model, _, step = _trainer(family, network_args, device, fp8_compute)
    model.gradient_checkpointing = keep
    out = []
    for i in range(2):
        if seed is not None:
            torch.manual_seed(seed + i)
        out.append(step(autocast))
    return out


def _assert_same(a, b):
    (pred_a, grads_a), (pred_b, grads_b) = a, b
    assert torch.equal(pred_a, pred_b)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        ga, gb = grads_a[name], grads_b[name]
        assert (ga is None and gb is None) or (ga is not None and gb is not None and torch.equal(ga, gb)), name
    assert sum(g is not None for g in grads_a.values()) > len(grads_a) // 2


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("keep", list(KEEPS))
@pytest.mark.parametrize("family", ["flux", "qwen_image"])
def test_eager_checkpoint_trains_the_bits_of_torch_checkpoint(family, keep, autocast, monkeypatch):
    """Plain, attention kept, projections and attention kept (CUDA's default where it fits); fp32 and bf16
    autocast. Qwen-Image's last text stream feeds nothing: its LoRAs get None (not zeros) in both."""
    eager = _steps(family, KEEPS[keep], autocast, True, monkeypatch)
    torch_ = _steps(family, KEEPS[keep], autocast, False, monkeypatch)
    for a, b in zip(eager, torch_):
        _assert_same(a, b)
    if family == "qwen_image":
        assert any(g is None for g in eager[1][1].values())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("backend", ["default", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION"])
@pytest.mark.parametrize("family", ["flux", "qwen_image"])
def test_eager_checkpoint_on_cuda_trains_the_bits_of_torch_checkpoint(family, backend, monkeypatch):
    """On CUDA SDPA's kernels differ (flash, memory-efficient, cuDNN; torch's default puts cuDNN first on
    Hopper): the no_grad forward keeping attention asks the memory-efficient and cuDNN ones for the
    log-sum-exp, and a recompute whose kernel differs from the kept one runs it (block_checkpoint._AttentionStash).
    Each kernel alone, and torch's choice; bf16 autocast, each way of keeping, against torch's checkpoint and
    against no checkpointing (what a stash shared by both paths could get wrong)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with contextlib.nullcontext() if backend == "default" else sdpa_kernel(getattr(SDPBackend, backend)):
        try:
            plain = _steps(family, False, True, True, monkeypatch, device="cuda")  # no checkpointing: the kernels' own
            for keep in KEEPS.values():
                eager = _steps(family, keep, True, True, monkeypatch, device="cuda")
                torch_ = _steps(family, keep, True, False, monkeypatch, device="cuda")
                for a, b, c in zip(eager, torch_, plain):
                    _assert_same(a, b)
                    _assert_same(a, c)
        except RuntimeError as e:
            if not any(s in str(e) for s in ("No available kernel", "No viable backend")):  # CUDA's, torch's
                raise
            pytest.skip(f"{backend} cannot run these shapes on {torch.cuda.get_device_name()}")


@pytest.mark.parametrize("network_args", [{"dora": True}, {"algo": "lokr", "factor": 4}], ids=["dora", "lokr"])
def test_dora_and_lycoris_train_the_bits_of_torch_checkpoint(network_args, monkeypatch):
    """Adapters that route the base's calls otherwise (DoRA reads the base output; LyCORIS' own modules):
    the tail runs in full, the rest as LoRA's, both keys on."""
    eager = _steps("flux", KEEPS["both"], True, True, monkeypatch, network_args)
    torch_ = _steps("flux", KEEPS["both"], True, False, monkeypatch, network_args)
    for a, b in zip(eager, torch_):
        _assert_same(a, b)


@pytest.mark.parametrize("keep", ["plain", "both"])
@pytest.mark.parametrize("family", ["flux", "qwen_image"])
def test_an_fp8_compute_base_trains_the_bits_of_torch_checkpoint(family, keep, monkeypatch):
    """fp8_compute's Linears take their input gradient as an fp8 GEMM: a tail whose output is given
    (kept, or the one-token stand-in) gets that one (FP8ComputeLinear.input_gradient), not g @ W in bf16,
    which moved the gradients of every earlier block by ~1-3%."""
    eager = _steps(family, KEEPS[keep], True, True, monkeypatch, fp8_compute=True)
    torch_ = _steps(family, KEEPS[keep], True, False, monkeypatch, fp8_compute=True)
    for a, b in zip(eager, torch_):
        _assert_same(a, b)


@pytest.mark.parametrize("keep", ["plain", "both"])
def test_lora_dropouts_draw_the_same_in_the_recompute(keep, monkeypatch):
    """The recompute runs under the forward's RNG state: dropout, rank_dropout and module_dropout draw
    what the forward drew (a different draw trains other units and fails the bits), as without
    checkpointing."""
    args = {"dropout": 0.2, "rank_dropout": 0.25, "module_dropout": 0.3, "train_modulation": True}
    eager = _steps("flux", KEEPS[keep], False, True, monkeypatch, args, seed=5)
    plain = _steps("flux", False, False, True, monkeypatch, args, seed=5)
    for a, b in zip(eager, plain):
        _assert_same(a, b)
    assert any(g is None for g in eager[0][1].values())  # module_dropout dropped some


def test_the_forward_records_one_node_a_block(monkeypatch):
    """What the host time is saved on: each block's forward builds no graph inside, its output hangs on
    one _BlockCheckpoint node (the first block too, whose inputs need no gradient)."""
    model, _, step = _trainer("qwen_image")
    model.gradient_checkpointing = True
    calls = []
    apply = eager_checkpoint._BlockCheckpoint.apply
    monkeypatch.setattr(eager_checkpoint._BlockCheckpoint, "apply", lambda *a: calls.append(a) or apply(*a))
    pred, grads = step(False)
    assert len(calls) == len(model.transformer_blocks)
    assert grads["lora_unet_transformer_blocks_0_attn_to_q.lora_down.weight"] is not None


def test_a_process_group_checkpoints_with_torch(tmp_path, monkeypatch):
    """DDP with find_unused_parameters (train_lora's multi-process runs) would see no parameter of a block
    in the forward's graph: in a process group run_block takes torch's checkpoint."""
    assert eager_checkpoint.usable()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert not eager_checkpoint.usable()
        model, _, step = _trainer("qwen_image")
        model.gradient_checkpointing = True
        monkeypatch.setattr(eager_checkpoint._BlockCheckpoint, "apply", None)  # would fail if called
        step(False)
    finally:
        dist.destroy_process_group()


def test_the_attention_stash_runs_a_kernel_call_unlike_the_kept_one():
    """The recompute takes a kept attention output back only for the same kernel and arguments; another
    call (a kernel chosen otherwise with grad on than in a no_grad forward) runs the kernel."""
    q, k, v = (torch.randn(1, 2, 8, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    for scale, kept in ((None, True), (0.5, False)):
        stash = collections.deque()
        with torch.no_grad(), block_checkpoint._AttentionStash(stash, False):
            F.scaled_dot_product_attention(q, k, v)
        entry = stash[0]
        assert len(entry) == 1
        entry[0] = (*entry[0][:2], tuple(torch.zeros_like(t) for t in entry[0][2]))  # marks the kept output
        with block_checkpoint._AttentionStash(stash, True):
            out = F.scaled_dot_product_attention(q, k, v, scale=scale)
        assert torch.equal(out, torch.zeros_like(out) if kept else F.scaled_dot_product_attention(q, k, v, scale=scale))
