"""core.residual_projection: in checkpointing's recompute the block's last projection into the residual
(`x + gate * proj(h)`) runs its base GEMM on one token, since nothing saves its output there.

The oracle is autograd itself: the LoRA gradients with the skip equal those without it bit for bit (a
wrong value saved in the recompute would change them; a changed save order fails checkpoint's own
check), and torch's FLOP counter sees the skipped GEMM gone from backward."""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from library.models import block_checkpoint, core, eager_checkpoint
from library.models.registry import FAMILIES, arch_specs
from library.models.spec import load_symbol
from library.precision.fp8 import quantize_module
from networks.lora import LoRANetwork
from networks.lora_module import LoRAModule

DIFFUSION_ARCHS = sorted({arch_specs()[a].arch for a in arch_specs()} - {"llm"})
# Families whose blocks end in `x + gate * proj(h)` with an untrained gate by default; FLUX.1 and Nucleus-Image train
# their modulation by default (sd-scripts' / ai-toolkit's targets), Z-Image, Lumina 2 and Ideogram-4 norm the
# projection's output.
SKIPPING = {"anima", "chroma", "ernie_image", "flux2", "flux3", "krea2", "qwen_image", "qwen_image21"}
# (a family added later: the bits alone, until it joins a set)
NOT_SKIPPING = {"flux", "zimage", "ideogram4", "nucleus_image", "lumina2"}


def tiny_model(arch: str, tiny_set):
    from tools import precision_doctor as doctor

    model = doctor.disk_variant(tiny_set[arch_specs()[arch].tiny.transformer], arch, "fp32")
    inputs = doctor.make_inputs(arch, model.config, 64, 48, seed=0, text_len=8)
    return model.requires_grad_(False).train(), inputs.make_kwargs(0.5)


def one_block_each(model):
    """The tiny FLUX.1 with its first double and first single block only: one of each compiled region
    proves what the four do (the compiled tests trace every block and mode; half the blocks, half the time)."""
    del model.double_blocks[1:], model.single_blocks[1:]
    return model


def with_lora(model, arch: str, network_args=None, seed: int = 0):
    torch.manual_seed(seed)
    net = LoRANetwork(model, arch, rank=4, alpha=2.0, network_args=network_args)
    for m in net.lora_modules():  # a non-zero LoRA, so every path carries gradient
        torch.nn.init.normal_(m.lora_up.weight, std=0.1)
    net.apply()
    return net


def lora_grads(model, net, kwargs, skip: bool, autocast: bool = False, monkeypatch=None):
    """(LoRA gradients, base GEMMs skipped) of one checkpointed step, with the skip on or patched off."""
    skipped = []
    real, real_stand_in = block_checkpoint.on_one_token, block_checkpoint._stand_in
    monkeypatch.setattr(block_checkpoint, "on_one_token", lambda f, h: skipped.append(h.shape) or real(f, h))

    def stand_in(f, h):  # a low-bit layer's stand-in runs no base at all: a skip too
        before = len(skipped)
        out = real_stand_in(f, h)
        if len(skipped) == before:
            skipped.append(h.shape)
        return out

    monkeypatch.setattr(block_checkpoint, "_stand_in", stand_in)
    if not skip:
        monkeypatch.setattr(block_checkpoint, "recomputing", lambda: False)
    net.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(**kwargs)
    out.float().square().mean().backward()
    monkeypatch.undo()
    return {n: p.grad for n, p in net.named_parameters()}, skipped


def assert_same(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert (a[k] is None and b[k] is None) or torch.equal(a[k], b[k]), k
    assert sum(g is not None for g in a.values()) > len(a) // 2


@pytest.mark.parametrize("arch", DIFFUSION_ARCHS)
def test_every_family_trains_the_same_bits_with_the_skip(arch, tiny_set, monkeypatch):
    model, kwargs = tiny_model(arch, tiny_set)
    model.gradient_checkpointing = True
    net = with_lora(model, arch)
    with_skip, skipped = lora_grads(model, net, kwargs, True, monkeypatch=monkeypatch)
    without, none = lora_grads(model, net, kwargs, False, monkeypatch=monkeypatch)
    assert_same(with_skip, without)
    assert not none
    # Every skip is in the recompute (never the forward) of a block's last projection.
    if arch in SKIPPING | NOT_SKIPPING:
        assert bool(skipped) == (arch in SKIPPING), skipped


def test_bf16_autocast_and_a_trained_gate(tiny_set, monkeypatch):
    """Under bf16 autocast the same bits; with the modulation trained the gate needs the projection's
    output (FLUX.1's default targets: the generic test above), and DoRA's delta reads it: nothing is
    skipped."""
    model, kwargs = tiny_model("qwen_image", tiny_set)
    model.gradient_checkpointing = True
    net = with_lora(model, "qwen_image")
    with_skip, skipped = lora_grads(model, net, kwargs, True, autocast=True, monkeypatch=monkeypatch)
    assert skipped
    assert_same(with_skip, lora_grads(model, net, kwargs, False, autocast=True, monkeypatch=monkeypatch)[0])
    for args in ({"train_modulation": True}, {"dora": True}):  # DoRA's delta reads the base output
        net.remove()
        net = with_lora(model, "qwen_image", args)
        grads, skipped = lora_grads(model, net, kwargs, True, monkeypatch=monkeypatch)
        assert not skipped, args
        assert_same(grads, lora_grads(model, net, kwargs, False, monkeypatch=monkeypatch)[0])


@pytest.mark.parametrize("base", ["fp8", "fp8_scaled"])
def test_a_quantized_base_and_a_tail_without_lora(base, tiny_set, monkeypatch):
    """The tail's own Linear (no adapter on it) is skipped in the recompute too: an fp8 base saves its codes,
    which do not depend on the token count (eager checkpointing: zeros stand in, no dequantization)."""
    model, kwargs = tiny_model("qwen_image", tiny_set)
    model = quantize_module(model, base, arch_specs()["qwen_image"].fp8)
    model.gradient_checkpointing = True
    net = with_lora(model, "qwen_image")
    for module in net.lora_modules():
        if module.name.endswith("_net_2"):
            module.remove_from_base()
    with_skip, skipped = lora_grads(model, net, kwargs, True, monkeypatch=monkeypatch)
    assert skipped
    assert_same(with_skip, lora_grads(model, net, kwargs, False, monkeypatch=monkeypatch)[0])


def tail_gemm_flops(model, kwargs, tails: list, tokens_less: int) -> int:
    """FLOPs of the tails' base GEMMs in one forward (B = 1), each run for `tokens_less` tokens fewer
    (1: what the one-token run leaves); their token counts from an eager no-grad forward."""
    tokens = {}
    hooks = [m.register_forward_hook(lambda m, i, o: tokens.__setitem__(m, i[0].shape[:-1].numel())) for m in tails]
    with torch.no_grad():
        model(**kwargs)
    for h in hooks:
        h.remove()
    return sum(2 * (tokens[m] - tokens_less) * m.in_features * m.out_features for m in tails)


def test_the_recompute_no_longer_runs_the_tail_gemm(tiny_set):
    """torch's FLOP counter over backward: the skipped GEMMs are the tails' forward, less one token."""
    model, kwargs = tiny_model("qwen_image", tiny_set)
    model.gradient_checkpointing = True
    net = with_lora(model, "qwen_image")

    def backward_flops(skip: bool) -> int:
        out = model(**kwargs).float().square().mean()
        saved = block_checkpoint.recomputing
        block_checkpoint.recomputing = saved if skip else (lambda: False)
        try:
            with FlopCounterMode(display=False) as counter:
                out.backward()
        finally:
            block_checkpoint.recomputing = saved
        return counter.get_total_flops()

    tails = [m for name, m in model.named_modules() if name.endswith("mlp.net.2")]
    gemm = tail_gemm_flops(model, kwargs, tails, tokens_less=1)
    assert gemm > 0 and backward_flops(False) - backward_flops(True) == gemm


def test_the_llm_decoder_layer_skips_its_down_projection(monkeypatch):
    """The decoder layer's MLP output only meets the residual add: down_proj is a tail too."""
    from library.models.llm import LLM, LLMConfig

    torch.manual_seed(0)
    model = LLM(LLMConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                          intermediate_size=48)).requires_grad_(False).train()
    model.gradient_checkpointing = True
    net = with_lora(model, "llm")
    kwargs = {"input_ids": torch.randint(0, 64, (2, 7)), "attention_mask": torch.ones(2, 7, dtype=torch.long)}
    with_skip, skipped = lora_grads(model, net, kwargs, True, monkeypatch=monkeypatch)
    assert len(skipped) == 2
    assert_same(with_skip, lora_grads(model, net, kwargs, False, monkeypatch=monkeypatch)[0])


def test_qwen_image_edit_split_modulation(tiny_set, monkeypatch):
    """zero_cond_t (Edit-2511): the image stream's gate is split at the target's tokens; the condition
    image's tokens take the t = 0 modulation. Same bits, and the split tail is skipped too."""
    import dataclasses

    model, kwargs = tiny_model("qwen_image", tiny_set)
    model.config = dataclasses.replace(model.config, zero_cond_t=True)
    shape = kwargs["img_shapes"][0]
    kwargs = dict(kwargs, img=torch.cat([kwargs["img"]] * 2, dim=1), img_shapes=[[tuple(shape)] * 2])
    model.gradient_checkpointing = True
    net = with_lora(model, "qwen_image")
    with_skip, skipped = lora_grads(model, net, kwargs, True, monkeypatch=monkeypatch)
    assert any(s[-2] == kwargs["img"].shape[1] for s in skipped), skipped  # the split image stream's tail
    assert_same(with_skip, lora_grads(model, net, kwargs, False, monkeypatch=monkeypatch)[0])


def tail_modules(model) -> list:
    """The blocks' last projections into the residual (FLUX.1: MLP out, linear2; Qwen-Image: MLP out)."""
    return [m for name, m in model.named_modules() if name.endswith(("mlp.2", "mlp.net.2", "linear2"))]


@contextlib.contextmanager
def checkpointed_by(kind: str):
    """A patch context in which run_block checkpoints with eager_checkpoint ("eager", one process) or
    torch's non-reentrant checkpoint ("torch", what a process group gets). Its own MonkeyPatch:
    lora_grads undoes the test's."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(eager_checkpoint, "usable", lambda: kind == "eager")
        yield patch


@pytest.mark.parametrize("kind", ["eager", "torch"])
@pytest.mark.parametrize("arch", ["flux", "qwen_image"])
def test_saved_projections_train_the_same_bits(arch, kind, tiny_set, monkeypatch):
    """checkpoint_saves_projections: where the gate trains (train_modulation; FLUX.1's default targets),
    the forward keeps the tail's base output and the recompute skips its GEMM (eager_checkpoint: the
    kept output with the base's input gradient, eager_checkpoint.output_given) or runs it on one token (torch's
    checkpoint, in a process group). The LoRA gradients equal plain checkpointing's bit for bit, and
    every stashed output is taken back. A block's first checkpointed call runs torch's checkpoint,
    whose forward says which outputs are needed: the second step is the eager one."""
    model, kwargs = tiny_model(arch, tiny_set)
    net = with_lora(model, arch, {"train_modulation": True})
    model.gradient_checkpointing = True
    with checkpointed_by(kind) as patch:
        plain, none = lora_grads(model, net, kwargs, True, monkeypatch=monkeypatch)
        assert not none  # the trained gate needs the output: plain checkpointing recomputes it in full
        model.gradient_checkpointing = core.checkpointing(True, save_projections=True)
        first, _ = lora_grads(model, net, kwargs, True, monkeypatch=monkeypatch)
        stashes, given = [], []
        real, apply = block_checkpoint._checkpoint_contexts, eager_checkpoint._OutputGiven.apply
        patch.setattr(block_checkpoint, "_checkpoint_contexts",
                      lambda keep, *a, **k: stashes.append(keep) or real(keep, *a, **k))
        patch.setattr(eager_checkpoint._OutputGiven, "apply", lambda *a: given.append(a) or apply(*a))
        saved, skipped = lora_grads(model, net, kwargs, True, monkeypatch=monkeypatch)
    assert_same(first, plain)
    assert_same(saved, plain)
    assert stashes and all(stashes)
    tails = len(tail_modules(model))
    assert (len(given), len(skipped)) == ((tails, 0) if kind == "eager" else (0, tails)), skipped


@pytest.mark.parametrize("kind", ["eager", "torch"])
def test_saved_projections_with_module_dropout_train_as_without_checkpointing(kind, tiny_set, monkeypatch):
    """module_dropout returned the kept base output (detached) where the recompute dropped a module:
    one tensor fewer saved than in the forward, a CheckpointError in backward at the first step. Two
    steps each (the second is eager_checkpoint's, where one process checkpoints)."""
    model, kwargs = tiny_model("flux", tiny_set)
    net = with_lora(model, "flux", {"train_modulation": True, "module_dropout": 0.3, "rank_dropout": 0.25})
    net.train()
    grads = {}
    with checkpointed_by(kind):
        for mode in (False, core.checkpointing(True, save_projections=True)):
            model.gradient_checkpointing = mode
            for step in range(2):
                torch.manual_seed(3 + step)  # the same draws in both runs (the recompute: its RNG restored)
                grads[bool(mode), step], _ = lora_grads(model, net, kwargs, True, monkeypatch=monkeypatch)
    for step in range(2):
        plain, kept = grads[False, step], grads[True, step]
        dropped = [k for k, g in plain.items() if g is None]
        assert 0 < len(dropped) < len(plain), dropped  # some modules dropped, some trained
        assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(kept.values(), plain.values()))


def test_saved_projections_leave_the_recompute(tiny_set):
    """torch's FLOP counter over backward: with the gate trained, saving drops the tail GEMMs from the
    recompute: less one token each at a block's first checkpointed call (torch's checkpoint, whose
    recompute runs the base on one token for what it saves), whole from the second (eager_checkpoint)."""
    model, kwargs = tiny_model("flux", tiny_set)
    net = with_lora(model, "flux")  # FLUX.1's default targets train the modulation

    def backward_flops(mode) -> int:
        model.gradient_checkpointing = mode
        out = model(**kwargs).float().square().mean()
        with FlopCounterMode(display=False) as counter:
            out.backward()
        return counter.get_total_flops()

    gemm = tail_gemm_flops(model, kwargs, tail_modules(model), tokens_less=1)
    whole = tail_gemm_flops(model, kwargs, tail_modules(model), tokens_less=0)
    plain = backward_flops(True)
    assert net and gemm > 0 and plain - backward_flops(core.SAVE_PROJECTIONS) == gemm
    assert plain - backward_flops(core.SAVE_PROJECTIONS) == whole


def graph_gemm_flops(gm) -> int:
    """FLOPs of the mm / addmm nodes of an FX graph (their shapes from node.meta)."""
    total = 0
    for node in gm.graph.nodes:
        if node.target in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            out, a = node.meta["val"], node.args[-2].meta["val"]
            total += 2 * out.numel() * a.shape[-1]
    return total


class _OwnBaseOutput(torch.nn.Linear):
    """A layer that offers forward_with_base_output as its own class's method (LoRA sets it per instance)."""

    def forward(self, x):
        return super().forward(x) * 2

    def forward_with_base_output(self, x, base_call):
        return base_call(super().forward, x) * 2


@pytest.mark.parametrize("owner", ["lora", "class"])
def test_compiled_region_marks_the_base_call(owner):
    """Under torch.compile residual_projection routes a needed output through the adapter's
    forward_with_base_output, so the base GEMM carries the mark that compile_block's saving policy keeps:
    the check that the adapter owns the forward held in eager but read False under dynamo (torch 2.11
    for LoRA's instance routing, 2.13 for a class's own method), and nothing was kept."""
    torch.manual_seed(0)
    if owner == "class":
        proj = _OwnBaseOutput(8, 8).requires_grad_(False)
    else:
        proj = torch.nn.Linear(8, 8).requires_grad_(False)
        adapter = LoRAModule("proj", proj, rank=2)  # routes proj's calls by an instance forward
        torch.nn.init.normal_(adapter.lora_up.weight)
        adapter.apply_to_base()
    marked = []

    def backend(gm, example_inputs):
        marked.extend(n for n in gm.graph.nodes if n.meta.get("custom", {}).get(block_checkpoint._KEEP_OUTPUT))
        return gm.forward

    h = torch.randn(4, 8)
    eager = core.residual_projection(proj, h, True)
    compiled = torch.compile(core.residual_projection, backend=backend, fullgraph=True)(proj, h, True)
    torch._dynamo.reset()
    assert marked and torch.equal(compiled, eager)


def test_compiled_saved_projections_leave_the_recompute(tiny_set, monkeypatch):
    """compile_block's saving region (torch_compile with checkpoint_saves_projections): the checkpoint
    policy keeps the marked base GEMMs' outputs, so the compiled backward graphs hold exactly the tail
    GEMMs fewer than the same region whose policy keeps nothing (in full: the partitioner needs no
    one-token run), with that region's LoRA gradients bit for bit (and eager checkpointing's to rounding),
    and no graph break. The backends are aot_eager's with the backward graphs recorded (train_lora: inductor
    on the same graphs); the reference is the policy region rather than the plain one because torch 2.11's
    default partitioner keeps the plain region's GEMM outputs under this backend (inductor recomputes
    them in 2.11 and 2.13 alike). On this fp8_scaled base the weight's dequantization around the marked
    GEMM is recomputed, never saved (same GEMM count). (Each mode compiles both blocks, ~8 s on 2 cores:
    two modes, not three.)"""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.utils import counters

    backward_flops = []

    def counted(gm, example_inputs):  # a compiled backward that adds its GEMM FLOPs on every run
        flops = graph_gemm_flops(gm)
        return make_boxed_func(lambda *args: backward_flops.append(flops) or gm.forward(*args))

    backend = aot_autograd(fw_compiler=lambda gm, example_inputs: make_boxed_func(gm.forward), bw_compiler=counted)
    model, kwargs = tiny_model("flux", tiny_set)
    model = quantize_module(one_block_each(model), "fp8_scaled", arch_specs()["flux"].fp8)
    net = with_lora(model, "flux")  # FLUX.1's default targets train the modulation
    gemm = tail_gemm_flops(model, kwargs, tail_modules(model), tokens_less=0)  # eager, before compiling

    def step(mode):
        model.gradient_checkpointing = mode
        net.zero_grad(set_to_none=True)
        backward_flops.clear()
        model(**kwargs).float().square().mean().backward()
        return sum(backward_flops), {n: p.grad for n, p in net.named_parameters()}

    eager = step(True)[1]  # plain checkpointing, before compiling
    for block in model.swappable_blocks():
        core.compile_block(block, backend=backend, dynamic=False)  # (two modes, one process: static shapes)
    torch._dynamo.reset()  # every block shares checkpoint's code object: a fresh cache per model
    counters.clear()
    with monkeypatch.context() as patch:
        patch.setattr(block_checkpoint, "_GEMMS", ())  # the policy keeps no marked GEMM
        full_flops, full = step(core.SAVE_PROJECTIONS)
    torch._dynamo.reset()  # (the policy's globals are read while tracing: no guard sees them change)
    saved_flops, saved = step(core.SAVE_PROJECTIONS)
    assert gemm > 0 and full_flops - saved_flops == gemm
    assert_same(saved, full)
    for k, g in eager.items():
        if g is not None:
            torch.testing.assert_close(saved[k], g, rtol=1e-5, atol=1e-7)
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_train_lora_with_saved_projections_trains_the_same_lora(tiny_set, tmp_path, monkeypatch):
    """The config keys end to end (FLUX.1's quickstart, its gates trained): 3 steps with
    checkpoint_saves_projections, and with checkpoint_saves_attention too, give the losses and LoRA of
    plain checkpointing bit for bit."""
    import train_lora
    from safetensors.torch import load_file

    from tests.test_train_lora import flux_args, read_losses

    modes, real = [], block_checkpoint._checkpoint_contexts
    monkeypatch.setattr(block_checkpoint, "_checkpoint_contexts",
                        lambda keep, *a, **k: modes.append(keep) or real(keep, *a, **k))
    common = ("--max_train_steps", "3", "--sample_prompts", "", "--gradient_checkpointing", "true")
    runs = {"plain": ((), core.Checkpointing()),
            "saved": (("--checkpoint_saves_projections", "true"), core.SAVE_PROJECTIONS),
            "both": (("--checkpoint_saves_projections", "true", "--checkpoint_saves_attention", "true"),
                      core.Checkpointing(True, True))}
    for name, (extra, keep) in runs.items():
        modes.clear()
        assert train_lora.main(flux_args(tiny_set, tmp_path / name, *common, *extra)) == 0
        assert modes and set(modes) == {keep}
    lora = {n: load_file(str(tmp_path / n / "tiny_flux_lora.safetensors")) for n in runs}
    for name in ("saved", "both"):
        assert read_losses(tmp_path / "plain") == read_losses(tmp_path / name)
        assert lora["plain"].keys() == lora[name].keys()
        assert all(torch.equal(lora["plain"][k], lora[name][k]) for k in lora["plain"])


@pytest.mark.parametrize("key", ["checkpoint_saves_projections", "checkpoint_saves_attention",
                                 "checkpoint_saves_dequantized"])
def test_config_refuses_saved_projections_without_checkpointing(key, tiny_set, tmp_path, capsys):
    import train_lora

    from tests.test_train_lora import flux_args

    code = train_lora.main(flux_args(tiny_set, tmp_path, f"--{key}", "true"))
    err = capsys.readouterr().err.strip()
    assert code == 2 and key in err and "needs gradient_checkpointing = true" in err
    assert len(err.splitlines()) == 1
