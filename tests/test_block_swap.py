"""Block swap on CPU: the same loss and LoRA gradients bit for bit, the transfer schedule, and
swapped weights absent from the device between uses (library/models/block_swap.py)."""

import copy
import importlib

import pytest
import torch

from library.models.block_swap import enable_block_swap
from library.models import block_checkpoint, core
from library.models.core import compile_block
from library.precision.fp8 import quantize_module
from networks.lora import LoRANetwork
from library.models.registry import arch_spec
from tests.test_train_lora import sample_png

flux = importlib.import_module("library.models.flux1.model")
qwen = importlib.import_module("library.models.qwen_image.model")


def tiny_flux(depth: int = 2):
    cfg = flux.FluxConfig(hidden_size=32, num_heads=2, depth=depth, depth_single=depth, axes_dim=(4, 6, 6),
                          context_in_dim=8, vec_in_dim=8, guidance_embed=True)
    inputs = dict(img=torch.randn(2, 16, 64), img_ids=flux.make_img_ids(2, 4, 4), txt=torch.randn(2, 3, 8),
                  txt_ids=flux.make_txt_ids(2, 3), timesteps=torch.tensor([0.3, 0.7]), y=torch.randn(2, 8),
                  guidance=torch.tensor([1.0, 1.0]))
    return flux.Flux(cfg), "flux", inputs


def tiny_qwen(depth: int = 2):
    cfg = qwen.QwenImageConfig(num_layers=2 * depth, attention_head_dim=32, num_attention_heads=1, joint_attention_dim=16,
                               axes_dims_rope=(8, 12, 12))
    inputs = dict(img=torch.randn(2, 16, 64), txt=torch.randn(2, 5, 16), txt_mask=torch.tensor([[1] * 5, [1] * 3 + [0] * 2]),
                  timesteps=torch.tensor([0.3, 0.7]), img_shapes=[(1, 4, 4)] * 2)
    return qwen.QwenImage(cfg), "qwen_image", inputs


def two_blocks(make):
    """The compiled tests' model: FLUX.1 with one double and one single block, Qwen-Image with two
    (compiling traces every block, in every mode: one of each kind proves what four do, in half the time)."""
    return make(depth=1)


def with_lora(model, family, base, fp8_gemms: bool = False):
    """fp8_gemms: the quantized base's Linears as fp8 GEMMs (fp8_compute; enabled before the LoRA wraps them)."""
    if base != "fp32":
        model = quantize_module(model, base, arch_spec(family).fp8)
    if fp8_gemms:
        from library.precision.fp8_compute import enable_fp8_compute

        assert enable_fp8_compute(model) > 0
    net = LoRANetwork(model, family, rank=4, alpha=2.0)
    for m in net.lora_modules():  # a non-zero LoRA, so its gradients flow through every path
        torch.nn.init.normal_(m.lora_up.weight, std=0.1)
    net.apply()
    return model, net


def step(model, net, inputs):
    net.zero_grad(set_to_none=True)
    loss = model(**inputs).float().square().mean()
    loss.backward()
    # (Qwen-Image's last block's text stream feeds nothing: its LoRA gets no gradient, None on both sides)
    return loss.detach(), {n: p.grad for n, p in net.named_parameters()}


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])  # CUDA: the side stream and pinned copies


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("make", [tiny_flux, tiny_qwen])
@pytest.mark.parametrize("base", ["fp32", "fp8_scaled"])
@pytest.mark.parametrize("checkpointing", [False, True, core.checkpointing(True, True, True)],
                         ids=["plain", "checkpointing", "keeping"])  # keeping: projections and attention kept
def test_swapping_gives_the_same_loss_and_lora_gradients_bit_for_bit(make, base, checkpointing, device):
    model, family, inputs = make()
    reference = copy.deepcopy(model)
    model, net = with_lora(model, family, base)
    reference, ref_net = with_lora(reference, family, base)
    ref_net.load_state_dict(net.state_dict())
    for m in (model, reference):
        m.gradient_checkpointing = checkpointing
    swap = enable_block_swap(model, 3, device)
    model.to(device), net.to(device), reference.to(device), ref_net.to(device)
    inputs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in inputs.items()}
    for _ in range(2):  # a second step: everything came back after the first
        loss, grads = step(model, net, inputs)
        ref_loss, ref_grads = step(reference, ref_net, inputs)
        assert torch.equal(loss, ref_loss)
        assert grads.keys() == ref_grads.keys() and all(
            (grads[k] is None and ref_grads[k] is None) or torch.equal(grads[k], ref_grads[k]) for k in grads)
        assert sum(g is not None for g in grads.values()) > len(grads) // 2
    assert not swap.resident and not swap.pending
    with torch.no_grad():  # sampling: forward only
        assert torch.equal(model(**inputs), reference(**inputs))
        swap.restore()  # back on the device for good: no transfers after
        transfers = len(swap.log)
        assert torch.equal(model(**inputs), reference(**inputs)) and len(swap.log) == transfers


def test_each_step_moves_every_swapped_block_in_twice_in_run_order_and_reverse_but_the_last():
    """The training forward keeps its last block (prefetch 1) for the backward, which starts with it: one copy a
    step fewer, the one nothing hid. A forward without a graph releases it as the others."""
    model, family, inputs = tiny_qwen()  # 4 blocks, the last 3 swapped
    model, net = with_lora(model, family, "fp8")
    swap = enable_block_swap(model, 3, "cpu")
    step(model, net, inputs)
    forward = [("load", 1), ("load", 2), ("release", 1), ("load", 3), ("release", 2)]
    backward = [("load", 2), ("release", 3), ("load", 1), ("release", 2), ("release", 1)]
    assert list(swap.log) == forward + backward
    swap.log.clear()
    with torch.no_grad():
        model(**inputs)
    assert list(swap.log) == forward + [("release", 3)]


def test_a_deeper_prefetch_keeps_its_depth_of_last_blocks_and_a_forward_without_backward_releases_them():
    """Prefetch 2 keeps blocks 2 and 3 through the turn (2 copies a step fewer, 4 of 6); a graph that is never
    backpropagated leaves them kept until the next forward starts, which releases them first: at most p + 1
    swapped blocks on the device throughout, and the next step trains as before."""
    model, family, inputs = tiny_qwen()  # 4 blocks, the last 3 swapped
    model, net = with_lora(model, family, "fp8")
    swap = enable_block_swap(model, 3, "cpu", prefetch=2)
    step(model, net, inputs)
    assert [e for e in swap.log if e[0] == "load"] == [("load", 1), ("load", 2), ("load", 3), ("load", 1)]
    held = []
    before = swap.before_forward
    swap.before_forward = lambda i: (before(i), held.append(len(swap.resident) + len(swap.pending)))
    model(**inputs).square().mean()  # a graph, no backward
    assert swap.kept == {2, 3} and swap.resident == {2, 3}
    swap.log.clear()
    loss, _ = step(model, net, inputs)
    assert list(swap.log)[:2] == [("release", 2), ("release", 3)] and max(held) <= 3
    assert not swap.resident and not swap.kept and torch.isfinite(loss)


def test_a_deeper_prefetch_loads_earlier_holds_at_most_p_plus_one_and_changes_nothing():
    """block_swap_prefetch = 2: block 1 and 2 start coming in before block 0 (never swapped) runs, each
    block waits for nothing it did not ask for, at most 3 swapped blocks are on the device, and loss and
    LoRA gradients are bit-identical to the resident model's."""
    model, family, inputs = tiny_qwen()  # 4 blocks, the last 3 swapped
    reference = copy.deepcopy(model)
    model, net = with_lora(model, family, "fp8_scaled")
    reference, ref_net = with_lora(reference, family, "fp8_scaled")
    ref_net.load_state_dict(net.state_dict())
    swap = enable_block_swap(model, 3, "cpu", prefetch=2)
    held = []

    def watching(method):
        def call(i):
            method(i)
            held.append(len(swap.resident) + len(swap.pending))  # after the prefetches it started
        return call

    swap.before_forward, swap.enter_backward = watching(swap.before_forward), watching(swap.enter_backward)
    for _ in range(2):
        loss, grads = step(model, net, inputs)
        ref_loss, ref_grads = step(reference, ref_net, inputs)
        assert torch.equal(loss, ref_loss)
        assert all((grads[k] is None and ref_grads[k] is None) or torch.equal(grads[k], ref_grads[k]) for k in grads)
    first = list(swap.log)[:swap.log.index(("release", 1))]
    assert first == [("load", 1), ("load", 2), ("load", 3)]  # 3 asked while 1 ran: before 1 was released
    assert max(held) <= 3 and max(held) == 3
    assert not swap.resident and not swap.pending
    with pytest.raises(ValueError, match="block_swap_prefetch must be >= 1, got 0"):
        enable_block_swap(model, 2, "cpu", prefetch=0)


def test_the_planner_counts_prefetch_plus_one_swapped_blocks():
    from library.training.memory_plan import resident_parts

    blocks = [10, 20, 30, 40]  # the largest run of prefetch + 1 consecutive swapped blocks (the schedule's)
    assert resident_parts(100, blocks, 1, 2, 2)["swap buffers"] == 30 + 40
    assert resident_parts(100, blocks, 1, 2, 2, prefetch=3)["swap buffers"] == 30 + 40  # only 2 are swapped
    assert resident_parts(100, blocks, 1, 2, 4, prefetch=2)["swap buffers"] == 20 + 30 + 40
    assert resident_parts(100, blocks, 1, 2, 0, prefetch=3)["swap buffers"] == 0


def test_swapped_weights_are_not_resident_between_uses():
    model, family, inputs = tiny_flux()  # blocks: double 0, 1, single 2, 3; the last 3 swapped
    model, net = with_lora(model, family, "fp8_scaled")
    model.gradient_checkpointing = True
    swap = enable_block_swap(model, 3, "cpu")
    blocks = model.swappable_blocks()
    tensor_count = sum(1 for _ in blocks[0].buffers())
    assert tensor_count > 0
    seen = []

    def watch(index):
        def hook(module, args, output=None):
            on_device = [i for i in range(1, 4) if all(t.numel() > 0 for t in blocks[i].buffers())]
            seen.append((index, on_device, sorted(swap.pending)))
        return hook

    for i, block in enumerate(blocks):
        block.register_forward_pre_hook(watch(i))
    loss = model(**inputs).square().mean()
    # After forward, before backward: no swapped block holds its weights (0-element placeholders) but the last,
    # which the backward starts with.
    assert all(t.numel() == 0 for i in range(1, 3) for t in blocks[i].buffers())
    assert all(t.numel() > 0 for t in blocks[3].buffers())
    assert all(t.numel() > 0 for t in blocks[0].buffers())  # block 0 is never swapped
    loss.backward()
    # Each block runs with only itself resident and the next one's copy in flight; in backward, the
    # recompute of block i runs with i resident and i - 1 in flight (i + 1 may still be held: <= 2).
    assert seen[:4] == [(0, [], [1]), (1, [1], [2]), (2, [2], [3]), (3, [3], [])]
    assert [s[0] for s in seen[4:]] == [3, 2, 1, 0]  # the checkpoint recomputes, in reverse
    assert all(i in on or i == 0 for i, on, _ in seen) and all(len(on) + len(p) <= 2 for _, on, p in seen)
    assert all(t.numel() == 0 for i in range(1, 4) for t in blocks[i].buffers())


def test_blocks_to_swap_out_of_range_is_one_clear_error():
    model, _, _ = tiny_qwen()
    with pytest.raises(ValueError, match="blocks_to_swap must be between 1 and 3 .*got 4"):
        enable_block_swap(model, 4, "cpu")
    assert enable_block_swap(model, 0, "cpu") is None and model.block_swap is None


def test_train_lora_with_blocks_to_swap_equals_the_run_without(tiny_set, tmp_path, capsys):
    """The whole trainer (fp8_scaled base, checkpointing, DoRA, a sample at the end) with the last
    3 of 4 FLUX blocks swapped writes the same LoRA, bit for bit, and the same sample image. On the CPU one
    line says swapping saves nothing there."""
    import train_lora
    from safetensors.torch import load_file
    from test_train_lora import flux_args

    files = {}
    for swap in ("0", "3"):
        out = tmp_path / f"swap{swap}"
        code = train_lora.main(flux_args(tiny_set, out, "--max_train_steps", "3", "--fp8_base", "true",
                                         "--gradient_checkpointing", "true", "--blocks_to_swap", swap,
                                         "--network_args", "dora=True", "--sample_bf16_reference", "true"))
        assert code == 0
        files[swap] = (load_file(str(out / "tiny_flux_lora.safetensors")), sample_png(out, "tiny_flux_lora", "final").read_bytes())
        said = "blocks_to_swap = 3 on the CPU saves no memory" in capsys.readouterr().err
        assert said == (swap == "3")
    assert files["0"][0].keys() == files["3"][0].keys() and any(k.endswith("dora_scale") for k in files["0"][0])
    assert all(torch.equal(files["0"][0][k], files["3"][0][k]) for k in files["0"][0])
    assert files["0"][1] == files["3"][1]


def test_blocks_to_swap_config_errors_are_one_line(tiny_set, tmp_path, capsys):
    import train_lora
    from test_train_lora import flux_args

    for extra, message in ((["--blocks_to_swap", "4"], "blocks_to_swap must be between 1 and 3 for this model (4 blocks), got 4"),
                           (["--blocks_to_swap", "-1"], "key 'blocks_to_swap' must be >= 0, got -1"),
                           (["--block_swap_prefetch", "0"], "key 'block_swap_prefetch' must be >= 1, got 0")):
        assert train_lora.main(flux_args(tiny_set, tmp_path / "bad", "--max_train_steps", "1", *extra)) == 2
        out, err = capsys.readouterr()
        assert message in err and len(err.strip().splitlines()) == 1, err
        assert "captions:" not in out  # before caching (blocks_to_swap 4 was found after it, when the model loaded)


@pytest.mark.parametrize("make", [tiny_flux, tiny_qwen])
def test_compiled_checkpointed_blocks_swap_bit_for_bit_and_train_like_eager(make, monkeypatch, base="fp8_scaled"):
    """torch.compile'd blocks (train_lora's torch_compile: core.compile_block, the block and its checkpointed
    call compiled, the checkpoint inside: the recompute fuses into the compiled backward) with block swap:
    the same loss and LoRA gradients as the same compiled blocks resident, three steps, checkpointing on, an
    fp8_scaled base, no recompilation and no graph break (fp8_to's CPU table broke the graph on its storage
    checks until it stepped aside under compile); both within float rounding of the eager blocks, and the
    checkpointed step goes through the compiled region, never the eager checkpoint (which would run the
    compiled forward again); without grad the block's own compiled call runs. The swap reloads weights into
    the same tensor objects with the same shapes, so the compiled graphs' guards hold. Backend aot_eager:
    dynamo and AOTAutograd (where guards and saved tensors live) without a C++ build; inductor measured the
    same (bit-identical, no recompiles) by hand on this CPU. (Two tests until 2026-11-30, the second with an
    fp32 base and no swap: each traced the same blocks, 15 s a family.)"""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model, family, inputs = two_blocks(make)
    reference, eager = copy.deepcopy(model), copy.deepcopy(model)
    model, net = with_lora(model, family, base)
    reference, ref_net = with_lora(reference, family, base)
    eager, eager_net = with_lora(eager, family, base)
    ref_net.load_state_dict(net.state_dict()), eager_net.load_state_dict(net.state_dict())
    swap = enable_block_swap(model, 1, "cpu")
    for m in (model, reference, eager):
        m.gradient_checkpointing = True
    for m in (model, reference):
        for block in m.swappable_blocks():
            compile_block(block, backend="aot_eager")
    eager_loss, eager_grads = step(eager, eager_net, inputs)  # (no optimizer step: every step is the same)
    monkeypatch.setattr(block_checkpoint, "checkpoint", lambda *a, **k: pytest.fail("the eager checkpoint ran"))
    counters.clear()
    for _ in range(3):
        loss, grads = step(model, net, inputs)
        ref_loss, ref_grads = step(reference, ref_net, inputs)
        assert torch.equal(loss, ref_loss)
        assert all((grads[k] is None and ref_grads[k] is None) or torch.equal(grads[k], ref_grads[k]) for k in grads)
    torch.testing.assert_close(loss, eager_loss, rtol=1e-6, atol=1e-7)
    for k, g in eager_grads.items():  # (the compiled graph gives zeros where eager's unused text stream gives None)
        zero = torch.zeros_like(dict(net.named_parameters())[k])
        torch.testing.assert_close(grads[k] if grads[k] is not None else zero, g if g is not None else zero,
                                   rtol=1e-5, atol=1e-7)
    assert sum(counters["recompiles"].values()) == 0 and sum(counters["graph_break"].values()) == 0
    assert counters["stats"]["unique_graphs"] > 0  # the blocks did run compiled
    assert not swap.resident and ("load", swap.first) in swap.log
    with torch.no_grad():
        torch.testing.assert_close(reference(**inputs), eager(**inputs), rtol=1e-6, atol=1e-6)
    assert all(b._compiled_call_impl is not None for b in model.swappable_blocks())


def test_a_compiled_checkpointed_block_before_every_adapter_runs_without_a_graph(monkeypatch):
    """A block holding no adapter, whose inputs need no grad (FLUX.1's double blocks with train_blocks = single,
    Z-Image's refiners with its default targets), sent into the compiled checkpoint region failed the first step:
    "Activation checkpoint rematerialization ... does not support RNG ops in recompute regions" (AOTAutograd's
    inference path). It runs under no_grad now, and the step equals eager's."""
    import torch._dynamo

    torch._dynamo.reset()
    model, family, inputs = two_blocks(tiny_flux)
    eager = copy.deepcopy(model)
    nets = []
    for m in (model, eager):
        net = LoRANetwork(m, family, rank=4, alpha=2.0, network_args={"train_blocks": "single"})
        for lora in net.lora_modules():
            torch.nn.init.normal_(lora.lora_up.weight, std=0.1)
        net.apply()
        m.gradient_checkpointing = True
        nets.append(net)
    nets[1].load_state_dict(nets[0].state_dict())
    assert not any(n.startswith("double") for n, _ in nets[0].named_parameters())
    for block in model.swappable_blocks():
        compile_block(block, backend="aot_eager")
    loss, grads = step(eager, nets[1], inputs)
    compiled_loss, compiled_grads = step(model, nets[0], inputs)
    torch.testing.assert_close(compiled_loss, loss, rtol=1e-6, atol=1e-7)
    for k, g in grads.items():
        torch.testing.assert_close(compiled_grads[k], g, rtol=1e-5, atol=1e-7)


def test_compiled_checkpointed_blocks_share_their_compiled_code():
    """Every block's checkpointed region runs one code object (torch.utils.checkpoint's), so dynamo's
    recompile_limit counts all blocks' variants together. A region compiles once per kind of block and
    input (Qwen-Image: the first block, whose input needs no grad, and the rest), never once per block:
    the selective-checkpoint policy built per block failed its identity guard at every block, so a
    60-block model compiled 8 and ran the rest eager (Qwen-Image on an H200: 2.03 s a step against
    0.65 s); four blocks under a limit of 3 prove it. The regions that keep tensors carry the policy on
    every torch. A kind then compiles again with the token count dynamic (a second bucket) and the batch
    dynamic (a smaller last batch): FLUX.1's three kinds make 9 variants (measured on this CPU), past
    torch's default 8, so compile_block raises the limit (a test of the 9 compiles took 31-66 s)."""
    import torch._dynamo

    torch._dynamo.reset()
    model, family, inputs = tiny_qwen(depth=2)
    model, net = with_lora(model, family, "fp32")
    model.gradient_checkpointing = core.Checkpointing(projections=True, attention=True)
    with torch._dynamo.config.patch(recompile_limit=8):  # torch's default
        for block in model.swappable_blocks():
            compile_block(block, backend="aot_eager")
        assert torch._dynamo.config.recompile_limit >= 3 * 3
    with torch._dynamo.config.patch(recompile_limit=3, fail_on_recompile_limit_hit=True):
        for _ in range(2):
            loss, grads = step(model, net, inputs)
    assert torch.isfinite(loss) and any(g is not None for g in grads.values())
    hits = block_checkpoint.compile_limit_hits()  # what the trainer's warning reads: a real hit counts
    with torch._dynamo.config.patch(recompile_limit=2):
        step(model, net, dict(inputs, txt=inputs["txt"][:, :4], txt_mask=inputs["txt_mask"][:, :4]))
    assert block_checkpoint.compile_limit_hits() > hits


@pytest.mark.parametrize("device", DEVICES)
def test_swapping_frees_the_device_copy_of_views_too(device):
    """fp8 codes are views of a [out, in / 64, 64] tensor: replacing only the view's data would leave
    its base, the whole storage, on the device (seen on an H100: no memory saved at all)."""
    model, family, inputs = tiny_flux()
    model, net = with_lora(model, family, "fp8_scaled")
    model.to(device)
    blocks = model.swappable_blocks()
    if device == "cpu":  # the case this guards (a move to CUDA makes fresh copies; memory is checked there)
        assert any(t._base is not None for t in blocks[3].buffers())
    swapped_bytes = sum(t.numel() * t.element_size() for b in blocks[1:] for t in (*b.parameters(), *b.buffers()))
    before = torch.cuda.memory_allocated() if device == "cuda" else 0
    enable_block_swap(model, 3, device)
    for b in blocks[1:]:
        assert all(t.numel() == 0 and t._base is None for t in (*b.parameters(), *b.buffers()))
    if device == "cuda":
        assert before - torch.cuda.memory_allocated() >= swapped_bytes


def test_the_transfer_log_keeps_only_its_last_records(monkeypatch):
    """The log is the tests' and benches' window on the schedule: in a training run it grew by 4 records a
    swapped block a step without end (a 100k-step run of 20 swapped blocks: ~0.5 GB of tuples)."""
    from library.models import block_swap

    monkeypatch.setattr(block_swap, "LOG_RECORDS", 8)
    model, family, inputs = tiny_qwen()
    model, net = with_lora(model, family, "fp8")
    swap = enable_block_swap(model, 3, "cpu")
    for _ in range(3):
        step(model, net, inputs)
    assert len(swap.log) == 8 and swap.log[-1] == ("release", 1)
