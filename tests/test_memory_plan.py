"""The memory planner (library/training/memory_plan.py, tools/plan_memory.py): its training-step
prediction against a measured step on this CPU (peak RSS of a fresh process), and the tool's output."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import toml
from library.data.image_folders import LargestStep
from tests.test_train_lora import sample_png

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A mid-width FLUX (hidden 1536, `blocks` double + `blocks` single blocks, ~125 M parameters a pair) trained one LoRA step
# by the family's own training_loss, as train_lora.py does (the optimizer's state made first, as in
# every step after the first). Prints "planned measured" in bytes:
# the planner's training peak, and the process's peak RSS during the step above its RSS just before
# the model exists (a model quantized in memory starts in fp32: that is not the step, so the peak is reset).
STEP = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {root!r})
    from library.training.host_memory import return_freed_buffers
    return_freed_buffers(65536)  # freed tensors leave the RSS at once
    torch.set_num_threads({threads})  # the test process's (conftest: 2 alone, 1 under make test's two workers)
    from library.models.flux1.family import FluxFamily
    from library.models.flux1.model import Flux, FluxConfig
    from library.precision.fp8 import prepare_fp8, quantize_module
    from library.models.registry import arch_spec
    from library.training.memory_plan import training_plan
    from networks.lora import LoRANetwork
    from tools.plan_memory import default_args
    base, ckpt, swap = {base!r}, {ckpt!r}, 0
    cfg = FluxConfig(hidden_size=1536, num_heads=12, depth={blocks}, depth_single={blocks}, guidance_embed=True)
    class Mid(FluxFamily):
        def __init__(self):
            self.name = "flux"
        def load_transformer(self, dtype, base_precision="bf16", read_weights=True):
            with torch.device("meta" if not read_weights else "cpu"):
                model = Flux(cfg)
            if base_precision != "bf16":
                (prepare_fp8 if not read_weights else quantize_module)(model, base_precision, arch_spec("flux").fp8)
            model.to(dtype); model.compute_dtype = dtype
            return model
    args = default_args("flux")
    args.mixed_precision, args.fp8_base, args.gradient_checkpointing = "no", base == "fp8_scaled", ckpt
    family, batch, side, tokens = Mid(), 1, {side}, 128
    planned = training_plan(family, args, side, side, batch, tokens).phase(0).peak
    rss = lambda: int(open("/proc/self/statm").read().split()[1]) * 4096
    latents = torch.randn(batch, 16, side // 8, side // 8)
    text = {{"t5": torch.randn(batch, tokens, 4096), "clip_pooled": torch.randn(batch, 768)}}
    gens = [torch.Generator().manual_seed(0)]
    before = rss()
    model = family.load_transformer(torch.float32, "fp8_scaled" if base == "fp8_scaled" else "bf16").requires_grad_(False)
    model.gradient_checkpointing = ckpt
    net = LoRANetwork(model, "flux", 16, 16); net.apply(); net.train()
    opt = torch.optim.AdamW(net.trainable_parameters(), lr=1e-4)
    for p in net.trainable_parameters():  # the optimizer's state exists from the first step on: make it now
        p.grad = torch.zeros_like(p)
    opt.step(); opt.zero_grad(set_to_none=True)
    open("/proc/self/clear_refs", "w").write("5")  # peak RSS := now: building the fp32 model to quantize is not the step
    loss, _ = family.training_loss(model, latents, text, args, gens)  # one step, as a later step runs
    loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
    peak = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM"))
    print(planned, peak - before)
""")


# Planned / measured on this CPU: fp32 without checkpointing at 512 px 0.979 with one pair of blocks (0.988 with two,
# in 15 s against 26); fp8_scaled with checkpointing keeps two pairs (checkpoints between blocks) at 256 px, 0.955
# in 12 s (0.965 at 512 px in 28 s; 0.92-0.94 before fp8_to looked its pairs up by chunks: a CPU-only index of 2
# bytes a weight element beside each dequantized weight).
@pytest.mark.parametrize("base,ckpt,blocks,side", [("fp32", False, 1, 512), ("fp8_scaled", True, 2, 256)])
def test_planned_training_peak_is_within_10_percent_of_the_measured_cpu_step(base, ckpt, blocks, side):
    step = STEP.format(root=ROOT, base=base, ckpt=ckpt, blocks=blocks, side=side, threads=torch.get_num_threads())
    out = subprocess.run([sys.executable, "-c", step],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    planned, measured = map(int, out.stdout.split()[-2:])
    print(f"{base} checkpointing={ckpt}: planned {planned / 2**30:.3f} GiB, measured {measured / 2**30:.3f} GiB, "
          f"ratio {planned / measured:.3f}")
    assert abs(planned / measured - 1) <= 0.10


def write_config(path, **keys) -> str:
    """A train_lora.py TOML config holding `keys`; returns its path."""
    path.write_text(toml.dumps(keys))
    return str(path)


def test_plan_memory_on_the_tiny_config_prints_every_phase_and_what_fits(tiny_set, tmp_path, capsys):
    from tools import plan_memory

    config = write_config(tmp_path / "tiny.toml", model_type="flux", pretrained_model_name_or_path=tiny_set["flux_bfl"],
                          ae=tiny_set["flux_vae_single"], clip_l=tiny_set["clip_l"], t5xxl=tiny_set["t5xxl"],
                          dataset_config=tiny_set["dataset_config"], output_dir=str(tmp_path / "out"), fp8_base=True,
                          blocks_to_swap=2)
    too_many = write_config(tmp_path / "swap.toml", **{**toml.load(config), "blocks_to_swap": 50})
    assert plan_memory.main(["--config_file", too_many, "--vram", "12"]) == 2  # planned as 50 - 4 blocks wrapped round
    # train_lora.py's line (diffusion_checks.check_before_caching): it names the model whose blocks it counted
    assert f"{tiny_set['flux_bfl']}: blocks_to_swap must be between 1 and 3" in capsys.readouterr().err
    assert plan_memory.main(["--config_file", config, "--vram", "12"]) == 0
    out = capsys.readouterr().out
    for phase in ("caching", "training", "sampling"):
        assert phase in out
    assert "swap buffers" in out and "fits with blocks_to_swap = 0" in out  # a tiny model fits anything
    # --base_precision plans the card's rows of that base only, each as the whole plan has it
    assert plan_memory.main(["--config_file", config, "--vram", "12", "--base_precision", "int8"]) == 0
    only = capsys.readouterr().out
    rows = [line for line in out.splitlines() if "gradient_checkpointing=" in line]
    assert len(rows) >= 8 and {line.split()[0] for line in rows} == {"bf16", "fp8_scaled", "nf4", "int8"}
    for key in ("checkpoint_saves_projections", "checkpoint_saves_attention"):  # low-bit up to 16 GiB, each base
        assert [line.split()[0] for line in rows if f"{key} = true (+" in line] == ["bf16", "fp8_scaled", "nf4", "int8"]
    # a keeping key the config sets false gets no row (old: offered as if unset)
    off = write_config(tmp_path / "off.toml", **{**toml.load(config), "checkpoint_saves_projections": False})
    assert plan_memory.main(["--config_file", off, "--vram", "12", "--base_precision", "int8"]) == 0
    rows_off = capsys.readouterr().out
    assert "checkpoint_saves_projections = true (+" not in rows_off
    assert "checkpoint_saves_attention = true (+" in rows_off
    assert [line for line in only.splitlines() if "gradient_checkpointing=" in line] == [
        line for line in rows if line.split()[0] == "int8"]
    assert only.split("\nOn a ")[0] == out.split("\nOn a ")[0]  # the run's own phases, as its config sets them


def test_a_full_size_preset_needs_swap_on_a_small_card(capsys):
    """Each base planned alone (--base_precision: a full-size plan is seconds of simulation a setting; the card's
    low-bit rows below 16 GiB: the tiny config's test above)."""
    from tools import plan_memory

    swaps, held = {}, {}
    for base in ("bf16", "fp8_scaled"):
        assert plan_memory.main(["--preset", "flux1-schnell", "--vram", "12", "--resolution", "512",
                                 "--base_precision", base]) == 0
        out = capsys.readouterr().out
        row = next(line for line in out.splitlines() if line.split()[:1] == [base] and "checkpointing=true :" in line)
        swaps[base] = int(row.split("blocks_to_swap = ")[1].split()[0])
        # the swapped blocks' host memory (was said nowhere): a 12 GiB card's Qwen-Image swap needs 33 GiB of RAM
        held[base] = float(row.split("its swapped blocks hold ")[1].split()[0])
        # FLUX.1 trains its gates: the rows with checkpoint_saves_projections, each needing at least as much swap
        for key in ("checkpoint_saves_projections", "checkpoint_saves_attention"):  # (and attention, as any family)
            saved = [line for line in out.splitlines() if f"{key} = true (+" in line]
            assert [line.split()[0] for line in saved] == [base], out
            assert int(saved[0].split("blocks_to_swap = ")[1].split()[0]) >= swaps[base]
    assert 0 < swaps["fp8_scaled"] < swaps["bf16"]  # 11.9 B parameters: 22 GiB in bf16, 11.5 GiB in fp8 on 12 GiB
    # the last 46 of the 57 blocks in run order (19 double of 0.63 GiB, 38 single of 0.26 GiB in bf16): 8 + 38
    assert swaps["bf16"] == 46 and held["bf16"] == round((8 * 339_831_296 + 38 * 141_591_808) * 2 / 2**30, 1)
    assert 0 < held["fp8_scaled"] < held["bf16"] / 2 + 0.5


# ----------------------------------------------------------------------------------------------
# Issue 23: the caching phase's VAE batch, edit models' references, the bf16 reference in samples


def tiny_flux(tiny_set):
    from library.models.flux1.family import FluxFamily

    return FluxFamily(tiny_set["flux_bfl"], tiny_set["flux_vae_single"], clip_l=tiny_set["clip_l"], t5xxl=tiny_set["t5xxl"])


# ----------------------------------------------------------------------------------------------
# The memoized meta kernels (library/training/meta_cache.py)


def test_a_repeated_meta_op_is_answered_with_a_fresh_tensor_of_the_same_layout_and_views_always_run():
    import torch

    from library.training.meta_cache import MetaKernelCache

    cache, aten = MetaKernelCache(), torch.ops.aten
    x = torch.empty(4, 6, device="meta")
    first, again = (cache(aten.mm.default, (x, torch.empty(6, 8, device="meta")), {}) for _ in range(2))
    assert (cache.misses, cache.hits) == (1, 1)
    assert (again.shape, again.stride(), again.dtype) == (first.shape, first.stride(), first.dtype) == ((4, 8), (8, 1), torch.float32)
    assert again.untyped_storage() is not first.untyped_storage() and again.untyped_storage().nbytes() == 4 * 8 * 4
    half = cache(aten.mm.default, (x.half(), torch.empty(6, 8, device="meta", dtype=torch.half)), {})
    assert half.dtype == torch.half and cache.misses == 2  # another dtype: another key
    views = [cache(aten.view.default, (x, [24]), {}) for _ in range(2)]
    assert all(v.untyped_storage() is x.untyped_storage() for v in views) and cache.hits == 1


def test_the_memoized_plan_equals_the_plan_of_the_meta_kernels_themselves(tiny_set, monkeypatch):
    from library.training import memory_plan
    from tools import plan_memory

    family, args = tiny_flux(tiny_set), plan_memory.default_args("flux")
    plans = [memory_plan.training_plan(family, args, 64, 64, 1, 8) for _ in range(2)]  # the second from the cache
    monkeypatch.setattr(memory_plan, "META_KERNELS", lambda func, args, kwargs: func(*args, **kwargs))
    assert plans[0] == plans[1] == memory_plan.training_plan(family, args, 64, 64, 1, 8)


def test_the_plan_counts_the_ema_on_the_device_drops_no_module_and_swaps_only_real_blocks(tiny_set):
    """Until 2026-11-27: the EMA's float32 copy (and sample_with_ema's raw weights) were not planned; with
    module_dropout the meta step drew modules to skip (a random plan, below the step that drops none); a
    blocks_to_swap past the blocks wrapped round the list; one swapped block counted prefetch + 1 buffers."""
    import copy

    from library.training import memory_plan
    from library.training.memory_plan import resident_parts, sampling_phase, training_plan
    from tools import plan_memory

    family, args = tiny_flux(tiny_set), plan_memory.default_args("flux")
    plain = training_plan(family, args, 64, 64, 1, 8)
    ema = copy.copy(args)
    ema.ema_decay, ema.ema_device, ema.sample_with_ema = 0.999, "same", True
    with_ema = training_plan(family, ema, 64, 64, 1, 8)
    assert with_ema.ema == plain.lora_grads and with_ema.phase(0).peak == plain.phase(0).peak + plain.lora_grads
    parts = sampling_phase(family, ema, 64, 64, 8).parts  # the EMA resident, sample_with_ema's raw weights beside it
    sampled = parts["resident (base, lora, optimizer)"] + parts["raw weights (sample_with_ema)"]
    assert sampled == sampling_phase(family, args, 64, 64, 8).parts["resident (base, lora, optimizer)"] + 2 * plain.lora_grads
    ema.ema_device = "cpu"  # off the card: only sample_with_ema's raw weights are
    assert training_plan(family, ema, 64, 64, 1, 8).ema == 0
    dropped = copy.copy(args)
    dropped.network_args = ["module_dropout=0.9"]
    with memory_plan.reusing_meta_models():
        peaks = {training_plan(family, dropped, 64, 64, 1, 8).activations for _ in range(3)}
    assert peaks == {plain.activations}
    blocks = plain.block_bytes
    assert resident_parts(0, blocks, 0, 0, 1, prefetch=2)["swap buffers"] == blocks[-1]  # one block, not 3
    with pytest.raises(ValueError, match=f"blocks_to_swap {len(blocks) + 1}: the model has {len(blocks)} blocks"):
        plain.phase(len(blocks) + 1)


def test_caching_plans_the_vae_batch_that_cache_latents_encodes(tiny_set):
    from library.training.memory_plan import GiB, vae_pass_peak, caching_phase
    from tools import plan_memory

    family, args = tiny_flux(tiny_set), plan_memory.default_args("flux")
    args.vae_batch_size = 3  # the training batch below is 1
    caching = plan_memory.plan_run(family, args, LargestStep(64, 64, 1, None))[0]
    encode = next(v for k, v in caching.parts.items() if k.startswith("vae encode"))
    assert encode == vae_pass_peak(family.vae_on_meta(), 64, 64, 3, decode=False)
    # Qwen-Image at 1328 px: cache_latents' default batch of 4 needs 25.88 GiB (batch 1: 6.82)
    qwen = plan_memory.PresetFamily("qwen-image")
    assert round(caching_phase(qwen, plan_memory.default_args("qwen_image"), 1328, 1328).peak / GiB, 2) == 25.88


def test_the_card_verdict_needs_the_samples_to_fit_and_caching_says_what_brings_it_under(tiny_set):
    """The swap chosen for the training step alone left the first sample over the card (Qwen-Image fp8 on 24 GB:
    swap 6, sampling 26.8 GiB of 22.2 usable). The verdict's swap fits both; the sample's peak at a swap is its
    resident training state plus what sampling_phase adds (the same sum), and caching over the card names the
    vae_batch_size that fits."""
    import copy

    from library.training.memory_plan import (CUDA_CONTEXT_BYTES, GiB, TrainingPlan, caching_phase, sampling_phase,
                                              text_tokens_for)
    from tools import plan_memory

    family, args = tiny_flux(tiny_set), plan_memory.default_args("flux")
    args.t5xxl_max_token_length = 8
    ema = copy.copy(args)  # sample_with_ema: the raw weights wait beside the EMA's render (0.4 GiB lost before)
    ema.ema_decay, ema.sample_with_ema = 0.99, True
    # sample_bf16_reference = true on an fp8 base: the trainer renders the bf16 copy too, swapped as the base is
    # (the rows left it out: FLUX.1-dev's on 16 GB, swap 5, planned at 13.3 GiB, rendering 36.9)
    reference = copy.copy(args)
    reference.base_precision, reference.sample_bf16_reference = "fp8_scaled", True
    for run in (args, ema, reference):
        base = run.base_precision or "bf16"
        plan = plan_memory.setting_plans(family, run, LargestStep(64, 64, 1, None), bases=(base,))[base, True]
        extra = plan_memory.sampling_extra(family, run, 128, 128, 0)
        for swap in (0, 2):
            trial = copy.copy(run)
            trial.blocks_to_swap = swap
            phase = sampling_phase(family, trial, 128, 128, text_tokens_for(family, trial, 0, 128, 128), 0)
            assert plan_memory.sampling_peak(plan, swap, extra, float("inf")) == (phase.peak, False), run
        assert ("raw weights (sample_with_ema)" in phase.parts) == (run is ema)
        assert ("bf16 reference (base, lora)" in phase.parts) == (run is reference)
    # 12 blocks of 1 GiB in a 14 GiB base, a step's activations 1 GiB, a sample's VAE decode and forward 3 GiB, on
    # a card of 12 GiB usable: the samples need two more blocks swapped than the step alone
    synthetic = TrainingPlan(base=14 * GiB, block_bytes=[GiB] * 12, lora=0, lora_grads=0, optimizer=0,
                             activations=GiB, inputs=0)
    vram = (CUDA_CONTEXT_BYTES + 12 * GiB / 0.95) / GiB
    extra = plan_memory.SampleExtra(3 * GiB, None)  # vae_tiling = false
    alone, with_samples = plan_memory.fewest_swaps(synthetic, vram), plan_memory.fewest_swaps(synthetic, vram, extra)
    assert alone is not None and with_samples == alone + 2, (alone, with_samples)
    assert plan_memory.sampling_peak(synthetic, alone, extra, plan_memory.usable(vram))[0] > plan_memory.usable(vram)
    # caching over the card: the advice names the largest vae_batch_size whose encode fits
    args.vae_batch_size = 4
    caching = caching_phase(family, args, 64, 64, 0)
    one = copy.copy(args)
    one.vae_batch_size = 1
    room = (caching_phase(family, one, 64, 64, 0).parts["vae encode (batch 1)"] + caching.parts["vae encode (batch 4)"]) / 2
    vram = (CUDA_CONTEXT_BYTES + room / 0.95) / GiB
    advice = plan_memory.caching_advice(family, args, LargestStep(64, 64, 1, 0), vram, caching)
    assert advice.startswith(f"caching does not fit a {vram:g} GiB card") and "set vae_batch_size = " in advice
    # text encoders over the card even in fp8: no fp8 advice that would fail as well
    text = next(v for k, v in caching.parts.items() if k.startswith("text"))
    tiny_card = (CUDA_CONTEXT_BYTES + text / 1000 / 0.95) / GiB
    step = LargestStep(64, 64, 1, 0)
    assert "a larger card for the text encoders" in plan_memory.caching_advice(family, args, step, tiny_card, caching)


def test_a_samples_forward_is_simulated_once_per_model_and_size_and_answers_as_before(tiny_set, monkeypatch):
    """plan_memory asks sampling_extra of each base with checkpointing off and on, each decoded whole and in
    tiles: four full-size forwards on meta of one model (a quarter of a preset's plan). A sample runs no backward
    and its decode is the VAE's: within reusing_meta_models the forward is simulated once, the answers equal."""
    from library.training import memory_plan
    from library.training.memory_plan import reusing_meta_models
    from tools import plan_memory

    family, args = tiny_flux(tiny_set), plan_memory.default_args("flux")
    planned = {("bf16", False): None, ("bf16", True): None, ("fp8_scaled", False): None, ("fp8_scaled", True): None}
    alone = plan_memory.sampling_extras(family, args, planned, (128, 128), 0)
    forwards, predict = [], family.predict
    monkeypatch.setattr(family, "predict", lambda *a, **k: forwards.append(1) or predict(*a, **k))
    with reusing_meta_models():
        reused = plan_memory.sampling_extras(family, args, planned, (128, 128), 0)
        assert memory_plan.sampling_phase(family, args, 128, 128, 8, 0).parts["forward (peak)"] > 0
    assert reused == alone and len(forwards) == 3  # bf16 and fp8_scaled, then another text length
    assert all(extra.whole > 0 and extra.tiled > 0 for extra in reused.values())  # vae_tiling unset: both


def test_latent_caching_encodes_vae_batch_size_images_at_a_time(monkeypatch):
    from types import SimpleNamespace

    import torch

    from library.training import diffusion_task
    from library.training.config_schema import SCHEMA

    assert SCHEMA["vae_batch_size"].default == 4  # sd-scripts' name; cache_latents' batch so far
    seen = {}
    monkeypatch.setattr(diffusion_task, "cache_latents", lambda items, encode, key, **kw: seen.update(kw) or 0)
    vae = SimpleNamespace(vae=torch.nn.Linear(1, 1), encode=None)
    task = SimpleNamespace(dataset=SimpleNamespace(items=[], drawn_items=lambda: []), validation_set=SimpleNamespace(items=[]),
                           family=SimpleNamespace(latent_cache_key=lambda: "k", load_vae=lambda dtype: vae),
                           device=torch.device("cpu"),
                           accelerator=SimpleNamespace(print=lambda *a, **k: None, process_index=0, num_processes=1),
                           args=SimpleNamespace(vae_batch_size=3, cache_latents_to_disk=False))
    diffusion_task.DiffusionTask._cache_latents(task)
    assert seen.get("batch_size") == 3


def test_planned_qwen_vae_encode_is_the_live_tensor_peak_of_a_real_cpu_encode():
    # The Qwen-Image VAE's causal convolutions pad the time axis and keep a per-layer feat_cache: the
    # plan (meta) must hold every such tensor a real encode holds. What the RSS holds beyond them is
    # the CPU kernels' workspace (bench/RESULTS.md, bench_planner_cpu.py --live-tensors).
    import torch
    from diffusers import AutoencoderKLQwenImage

    from library.models.qwen_image.vae import QwenImageVAE
    from library.models.vae import _build
    from library.training.memory_plan import LiveBytes, vae_pass_peak

    config = {"base_dim": 4, "z_dim": 16}
    planned = vae_pass_peak(QwenImageVAE(_build(AutoencoderKLQwenImage, config)), 64, 64, 1, decode=False)
    torch.manual_seed(0)
    real = QwenImageVAE(AutoencoderKLQwenImage(**config))
    with LiveBytes("cpu") as live:
        for t in (*real.vae.parameters(), *real.vae.buffers()):
            live.track(t)
        real.encode(torch.zeros(1, 3, 64, 64))
    assert planned == live.peak == 1740476


def test_edit_plan_counts_the_references_of_the_dataset(tiny_set, tmp_path, capsys):
    from library.models.qwen_image.edit_family import QwenImageEditFamily
    from library.training import memory_plan
    from tests.test_train_qwen_image_edit import two_reference_set
    from tools import plan_memory
    from tools.make_tiny_dataset import make_tiny_edit_dataset

    dataset = two_reference_set(make_tiny_edit_dataset(str(tmp_path / "edit"), count=2, size=32), tmp_path)
    config = write_config(tmp_path / "edit.toml", model_type="qwen_image_edit", ae=tiny_set["qwen_image_vae"],
                          pretrained_model_name_or_path=tiny_set["qwen_image_edit"], dataset_config=str(dataset),
                          text_encoder=tiny_set["qwen_image_edit_text_encoder"], output_dir=str(tmp_path / "out"))
    assert plan_memory.main(["--config_file", config, "--vram", "24"]) == 0
    out = capsys.readouterr().out
    assert "32x32, batch 2, 2 reference(s) per image" in out, out
    assert "vae encode of 2 reference(s)" in out, out
    family, args = QwenImageEditFamily(tiny_set["qwen_image_edit"]), plan_memory.default_args("qwen_image_edit")
    plans = [memory_plan.training_plan(family, args, 64, 64, 1, 8, references=n) for n in (1, 3)]
    assert plans[1].inputs - plans[0].inputs == 2 * 4 * 16 * 8 * 8  # two more float32 [1, 16, 8, 8] latents
    assert plans[1].activations > 1.5 * plans[0].activations  # their tokens ride along in every block
    # 2509 / 2511: the VL encoder sees each reference at ~384x384 area, 14 x 14 tokens of 28 px
    assert memory_plan.text_tokens_for(family, args, 3, 1024, 1024) == 512 + 3 * 14 * 14


def test_sampling_counts_the_bf16_reference_an_fp8_run_loads(tiny_set):
    import torch

    from library.training.memory_plan import module_bytes, sampling_phase, tensor_bytes
    from networks.lora import LoRANetwork
    from tools import plan_memory

    family, args = tiny_flux(tiny_set), plan_memory.default_args("flux")
    args.fp8_base = True  # sample_bf16_reference unset: on
    with_copy = sampling_phase(family, args, 64, 64, 8, 0)
    args.sample_bf16_reference = False
    without = sampling_phase(family, args, 64, 64, 8, 0)
    bf16 = module_bytes(family.load_transformer(torch.bfloat16, "bf16", read_weights=False))
    lora = tensor_bytes(LoRANetwork(family.load_transformer(torch.float32), "flux", 16, 16).state_dict().values())
    assert with_copy.parts["bf16 reference (base, lora)"] == bf16 + lora
    assert with_copy.peak - without.peak == bf16 + lora


def test_a_bf16_reference_that_does_not_fit_the_card_is_turned_off_unless_set_true(tiny_set):
    from library.training.memory_plan import CUDA_CONTEXT_BYTES, sampling_phase, settle_sampling
    from tools import plan_memory

    family, args = tiny_flux(tiny_set), plan_memory.default_args("flux")
    args.fp8_base, args.t5xxl_max_token_length = True, 8
    phase = sampling_phase(family, args, 64, 64, 8, 0)
    copy = phase.parts["bf16 reference (base, lora)"]
    card = CUDA_CONTEXT_BYTES + (phase.peak - copy / 2) / 0.95  # the rest fits, the copy does not
    assert settle_sampling(family, args, card + copy, 64, 64) is None and args.sample_bf16_reference is None
    warning = settle_sampling(family, args, card, 64, 64)
    assert warning.startswith("warning: sample_bf16_reference turned off: sampling with the bf16 reference base")
    assert args.sample_bf16_reference is False
    args.sample_bf16_reference = True  # explicit: kept, with a clear warning
    warning = settle_sampling(family, args, card, 64, 64)
    assert warning.startswith("warning: sample_bf16_reference = true, but sampling with the bf16 reference base")
    assert "will likely run out of memory" in warning and args.sample_bf16_reference is True


def test_a_sample_over_the_card_is_said_before_caching_with_or_without_the_bf16_reference(tiny_set):
    """The planner's training verdict says nothing of the VAE decode at the sample size (Qwen-Image fp8 at the
    swap plan_memory chose for 24 GB: sampling 26.8 GiB of 22.2 usable); the old check looked at the bf16
    copy alone and said nothing where the sample without it was over the card too."""
    from library.training.memory_plan import CUDA_CONTEXT_BYTES, sampling_phase, settle_sampling
    from tools import plan_memory

    family, args = tiny_flux(tiny_set), plan_memory.default_args("flux")
    args.t5xxl_max_token_length = 8
    phase = sampling_phase(family, args, 64, 64, 8, 0)  # a bf16 base: no copy
    card = CUDA_CONTEXT_BYTES + phase.peak / 2 / 0.95
    assert settle_sampling(family, args, CUDA_CONTEXT_BYTES + phase.peak / 0.95 + 1, 64, 64) is None
    assert settle_sampling(family, args, card, 64, 64).startswith(
        f"warning: sampling at 64x64 is planned to peak at {phase.peak / 2**30:.2f} GiB, over the ")
    args.fp8_base = True  # the copy turned off, and the rest still over: both said, in one line
    warning = settle_sampling(family, args, card, 64, 64)
    assert warning.startswith("warning: sample_bf16_reference turned off") and "; even so: the first sample will " \
        "likely run out of memory" in warning and args.sample_bf16_reference is False


def test_an_unset_vae_tiling_decodes_samples_in_tiles_where_the_whole_decode_is_over_the_card(tiny_set, monkeypatch):
    """A 1024 px float32 decode held 7.2 GiB of a 20 B model's sample on 24 GB; the planner swapped 14 more blocks
    for it. Unset vae_tiling is turned on where the whole decode is over the card and tiles fit (as ComfyUI falls
    back to a tiled decode); false stays false and is warned of; the planner's swap counts the tiles."""
    import copy

    from library.models import vae
    from library.training.memory_plan import CUDA_CONTEXT_BYTES, GiB, TrainingPlan, sampling_phase, settle_sampling
    from tools import plan_memory

    monkeypatch.setattr(vae, "TILE_PIXELS", 32)  # the tiny VAE's decode at 128 px: 3.4 MB whole, 1.1 MB in tiles
    family, args = tiny_flux(tiny_set), plan_memory.default_args("flux")
    args.t5xxl_max_token_length = 8
    whole = sampling_phase(family, args, 128, 128, 8, 0)
    tiled_args = copy.copy(args)
    tiled_args.vae_tiling = True
    tiled = sampling_phase(family, tiled_args, 128, 128, 8, 0)
    assert tiled.parts["vae decode in tiles (peak)"] < whole.parts["vae decode (peak)"] / 2 and tiled.peak < whole.peak
    card = CUDA_CONTEXT_BYTES + (whole.peak + tiled.peak) / 2 / 0.95
    assert settle_sampling(family, args, card, 128, 128) == (
        f"vae_tiling turned on: samples at 128x128 decode in tiles (the decode's peak "
        f"{whole.parts['vae decode (peak)'] / GiB:.2f} -> {tiled.parts['vae decode in tiles (peak)'] / GiB:.2f} GiB; "
        f"set vae_tiling = false to decode them whole)") and args.vae_tiling is True
    args.vae_tiling = False
    assert settle_sampling(family, args, card, 128, 128).startswith("warning: sampling at 128x128 is planned to peak")
    assert args.vae_tiling is False
    # an fp8 base: the bf16 reference copy goes first; where the whole decode then fits, no tiles (they were
    # turned on while the copy was still counted, and the copy dropped after: tiles the plan had not asked for)
    args.vae_tiling, args.fp8_base = None, True
    with_copy = sampling_phase(family, args, 128, 128, 8, 0)
    args.sample_bf16_reference = False
    without = sampling_phase(family, args, 128, 128, 8, 0)
    args.sample_bf16_reference = None
    assert with_copy.peak > without.peak
    said = settle_sampling(family, args, CUDA_CONTEXT_BYTES + (without.peak + 1) / 0.95, 128, 128)
    assert said.startswith("warning: sample_bf16_reference turned off") and "\n" not in said
    assert args.sample_bf16_reference is False and args.vae_tiling is None
    # the planner: 12 blocks of 1 GiB, a sample's extra 3 GiB whole, 1 GiB in tiles, 12 GiB usable
    synthetic = TrainingPlan(base=14 * GiB, block_bytes=[GiB] * 12, lora=0, lora_grads=0, optimizer=0,
                             activations=GiB, inputs=0)
    vram = (CUDA_CONTEXT_BYTES + 12 * GiB / 0.95) / GiB
    whole_only = plan_memory.fewest_swaps(synthetic, vram, plan_memory.SampleExtra(3 * GiB, None))
    with_tiles = plan_memory.fewest_swaps(synthetic, vram, plan_memory.SampleExtra(3 * GiB, GiB))
    assert with_tiles == plan_memory.fewest_swaps(synthetic, vram) and whole_only == with_tiles + 2
    peak, tiles = plan_memory.sampling_peak(synthetic, with_tiles, plan_memory.SampleExtra(3 * GiB, GiB),
                                            plan_memory.usable(vram))
    assert tiles and plan_memory.fit_text(with_tiles, 0, (peak, tiles), (1024, 1024)).endswith(
        f"samples at 1024x1024 peak at {peak / GiB:.1f} GiB (decoded in tiles: vae_tiling)")
    assert plan_memory.sampling_peak(synthetic, whole_only, plan_memory.SampleExtra(3 * GiB, GiB),
                                     plan_memory.usable(vram))[1] is False  # the whole decode fits there


def test_train_lora_renders_no_bf16_reference_that_does_not_fit_and_says_so(tiny_set, tmp_path, capsys, monkeypatch):
    """... and decodes the samples in tiles (vae_tiling unset), both said before caching."""
    import contextlib

    import train_lora
    from library.models import vae
    from library.models.flux1.family import FluxFamily
    from library.training import memory_plan
    from tests.test_train_lora import flux_args

    monkeypatch.setattr(memory_plan, "device_memory", lambda device: memory_plan.CUDA_CONTEXT_BYTES + 2**20,
                        raising=False)  # a 0.6 GiB card: nothing fits
    monkeypatch.setattr(vae, "TILE_PIXELS", 32)  # tiles that cut the 64 px sample (its decode over its forward)
    tiled, tiles = [], vae.decoding_in_tiles

    @contextlib.contextmanager
    def recorded(module, on=True, tile_pixels=None):
        if on:
            tiled.append(module)
        with tiles(module, on, tile_pixels):
            yield

    monkeypatch.setattr(vae, "decoding_in_tiles", recorded)
    loads, load = [], FluxFamily.load_transformer
    monkeypatch.setattr(FluxFamily, "load_transformer", lambda self, dtype, base="bf16", read_weights=True: (
        loads.append(base) if read_weights else None) or load(self, dtype, base, read_weights))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle --w 64 --h 64 --s 2 --d 1\n")
    assert train_lora.main(flux_args(tiny_set, tmp_path, "--max_train_steps", "1", "--sample_prompts", str(prompts))) == 0
    assert loads == ["fp8_scaled"], loads  # quickstart's fp8 base only: no bf16 copy for the sample
    err = capsys.readouterr().err.splitlines()
    warnings = [line for line in err if "sample_bf16_reference" in line]
    assert len(warnings) == 1 and warnings[0].startswith("warning: sample_bf16_reference turned off"), warnings
    assert sum(line.startswith("vae_tiling turned on: samples at 64x64 decode in tiles") for line in err) == 1
    rendered = [m for m in tiled if next(m.parameters()).device.type != "meta"]  # (the plan's decodes: on meta)
    assert sample_png(tmp_path, "tiny_flux_lora", "final").exists() and len(rendered) == 1  # one prompt, one base


@pytest.mark.parametrize("argv, message", [
    (["--preset", "flux1-dev", "--vram", "-5"], "--vram -5: the card's memory in GiB must be a number > 0"),
    (["--preset", "flux1-dev", "--vram", "0.5"],
     "--vram 0.5: the card's memory in GiB must be more than the 0.6 GiB the CUDA context takes"),
    (["--preset", "flux1-dev", "--resolution", "1000"],
     "--resolution 1000: the side must be a multiple of 16 (the VAE's 8 x the 2x2 patch), e.g. 992 or 1008"),
    (["--preset", "flux1-dev", "--batch_size", "0"], "--batch_size 0: must be >= 1"),
    (["--preset", "flux1-dev", "--resolution", "32768"], "--resolution 32768: the side must be 16 to 16384 pixels"),
    (["--preset", "flux1-dev", "--resolution", "0"], "--resolution 0: the side must be 16 to 16384 pixels"),
    (["--preset", "qwen-image-edit", "--references", "4"],
     "--references: 4 reference image(s), but qwen_image_edit takes 1 to 3 per image"),
    (["--preset", "flux1-dev", "--references", "1"], "--references: 1 reference image(s), but flux takes none"),
    (["--preset", "flux1-dev", "--gguf", "Q4_K", "--base_precision", "bf16"],
     "--base_precision bf16: this base is stored as gguf_q4_k and is planned as stored"),
])
def test_plan_memory_refuses_a_bad_value_in_one_line_before_planning(argv, message, capsys, monkeypatch):
    from tests.test_reliability import one_error_line
    from tools import plan_memory

    def planned(*args, **kwargs):
        raise AssertionError("planned before refusing")

    monkeypatch.setattr(plan_memory, "plan_run", planned)
    line = one_error_line(capsys, plan_memory.main(argv))
    assert line.startswith(f"error: {message}"), line


def test_the_plan_counts_the_projections_checkpointing_saves(tiny_set):
    """checkpoint_saves_projections keeps each block's last projection output (FLUX.1's gates train) from
    the forward to its block's recompute: the planned step grows, by at most those tensors (one
    [tokens, hidden] per stream and block in bf16; the last block's is taken back before the peak)."""
    import copy

    from library.training import memory_plan
    from tools import plan_memory

    family, args = tiny_flux(tiny_set), plan_memory.default_args("flux")
    saving = copy.copy(args)
    saving.checkpoint_saves_projections = True
    plain, saved = (memory_plan.training_plan(family, a, 256, 256, 1, 8).phase(0).peak for a in (args, saving))
    model = memory_plan.meta_model_and_network(family, args)[0]
    tokens = (len(model.double_blocks) + len(model.single_blocks)) * ((256 // 16) ** 2 + 8)
    assert 0 < saved - plain <= tokens * model.config.hidden_size * 2


def test_plan_memory_plans_the_samples_at_the_prompts_size(tiny_set, tmp_path, capsys):
    """Training at 64 px, a prompt at 128: the old line planned sampling at the training bucket (a 256 px run
    sampling at 1024 px: 0.80 GiB planned, 3.61 at the prompt's size), where train_lora plans the largest prompt."""
    from tools import plan_memory

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat --w 64 --h 64\na dog --w 128 --h 96\n")
    config = write_config(tmp_path / "tiny.toml", model_type="flux", pretrained_model_name_or_path=tiny_set["flux_bfl"],
                          ae=tiny_set["flux_vae_single"], clip_l=tiny_set["clip_l"], t5xxl=tiny_set["t5xxl"],
                          dataset_config=tiny_set["dataset_config"], output_dir=str(tmp_path / "out"),
                          sample_prompts=str(prompts))
    assert plan_memory.main(["--config_file", config, "--vram", "12", "--base_precision", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "training and samples of 128x96:" in out and "samples at 128x96 peak at" in out, out


def test_plan_memory_plans_the_shipped_qwen_image_quickstart(tmp_path, capsys):
    """Its text_encoder is the repository folder (text_encoder/ and tokenizer/ inside): the old line
    read the folder itself as a checkpoint, a traceback ending 'folder holds no .safetensors file'."""
    from tools import plan_memory
    from tools.make_tiny_dataset import make_concept_dataset

    concept = make_concept_dataset(str(tmp_path / "concept"), count=2)  # what `make demo` writes first
    with open(os.path.join(ROOT, "configs", "quickstart_qwen_image.toml")) as f:
        text = f.read().replace('"learned/', f'"{ROOT}/learned/')
    text = text.replace('"tiny_models/concept/concept.toml"', f'"{concept["concept_dataset_config"]}"')
    (tmp_path / "quickstart_qwen_image.toml").write_text(text)
    assert plan_memory.main(["--config_file", str(tmp_path / "quickstart_qwen_image.toml"), "--vram", "16"]) == 0
    assert "fits with blocks_to_swap = 0" in capsys.readouterr().out


def test_plan_memory_with_a_missing_model_file_is_one_line_before_any_plan(capsys):
    """The old line printed the plan's header, then a traceback ending in the CheckpointError."""
    from tests.test_reliability import one_error_line
    from tools import plan_memory

    line = one_error_line(capsys, plan_memory.main(["--config_file", os.path.join(ROOT, "configs", "chroma.toml"),
                                                    "--vram", "16"]))
    assert line == "error: models/Chroma1-HD.safetensors: no such file or folder", line
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("case", ["network_args", "stored base"])
def test_plan_memory_refuses_what_train_lora_checks_first_in_one_line_before_any_plan(tiny_set, tmp_path, capsys, case):
    """The planner skipped train_lora's first checks: an fp8 base asked of a stored file planned and exited 0
    (train_lora refuses it), bad network_args printed the plan's header, then an error naming no file."""
    from tests.test_fp8_checkpoints import tiny_comfy_flux
    from tools import plan_memory

    keys = dict(model_type="flux", pretrained_model_name_or_path=tiny_set["flux_bfl"], ae=tiny_set["flux_vae_single"],
                clip_l=tiny_set["clip_l"], t5xxl=tiny_set["t5xxl"], dataset_config=tiny_set["dataset_config"],
                output_dir=str(tmp_path / "out"))
    if case == "network_args":
        config = write_config(tmp_path / "run.toml", **keys, network_args=["dora=maybe"])
        want = f"error: {config}: network_args 'dora': expected true/false, got 'maybe'"
    else:
        stored = tiny_comfy_flux(tiny_set, tmp_path)
        config = write_config(tmp_path / "run.toml", **{**keys, "pretrained_model_name_or_path": stored},
                              fp8_base=True, fp8_scaled=False)
        want = (f"error: {stored}: the checkpoint stores a pre-quantized fp8_tensor_scaled base (used as it is), but the "
                f"config asks for fp8; set fp8_base = true and fp8_scaled = true (what fp8_tensor_scaled files need), "
                f"or give the bf16 checkpoint")
    capsys.readouterr()
    code = plan_memory.main(["--config_file", config, "--vram", "12"])
    out, err = capsys.readouterr()
    assert (code, out, err.splitlines()) == (2, "", [want])


# ----------------------------------------------------------------------------------------------
# Text encoders as their loaders keep them; the swap buffers as the schedule holds them


def _built_bytes(model, dtype, fp8, rules, float32_in_fp16=()):
    """A meta-built text encoder's bytes as its loader leaves it: `dtype`, these modules float32 in fp16, fp8 Linears."""
    from library.precision.fp8 import prepare_fp8

    model.to(dtype)
    if dtype == torch.float16:
        for name, module in model.named_modules():
            if name.endswith(float32_in_fp16):
                module.to(torch.float32)
    if fp8:
        prepare_fp8(model, fp8, rules)
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}.values()  # a tied weight once
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("precision", ["fp16", "fp8", "fp8_scaled"])
def test_planned_text_encoders_are_the_bytes_their_loaders_keep_at_full_size(precision):
    """Until 2026-11-28 the caching phase took one constant per precision: fp16 2 bytes a parameter (T5-XXL keeps
    its 1 B `wo` float32: FLUX.1 planned 9.10 GiB, 10.97 built) and fp8 1.2 for every encoder (T5 5.46 planned,
    5.72 built; Qwen2.5-VL 8.51 planned, 8.11 built). Built here as load_t5 / load_clip_l / load_llm build them, on meta."""
    from accelerate import init_empty_weights
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    from library.models.llm import LLM, QWEN2_5_7B
    from library.models.registry import arch_spec
    from library.models.text_encoders import CLIP_L_CONFIG, T5_FP8, T5_XXL_CONFIG, encoder_precision
    from library.training.memory_plan import caching_phase
    from tools import plan_memory

    def planned(preset, model_type):
        args = plan_memory.default_args(model_type)
        args.text_encoder_precision, args.vae_batch_size = precision, 1
        parts = caching_phase(plan_memory.PresetFamily(preset), args, 64, 64).parts
        return next(v for k, v in parts.items() if k.startswith("text encoders"))

    dtype, fp8 = encoder_precision(precision)
    with init_empty_weights():
        t5, clip = T5EncoderModel(T5Config(**T5_XXL_CONFIG)), CLIPTextModel(CLIPTextConfig(**CLIP_L_CONFIG))
    t5.encoder.embed_tokens.weight = t5.shared.weight  # one tensor, as load_t5 fills both
    flux = _built_bytes(t5, dtype, fp8, T5_FP8, (".wo",)) + _built_bytes(clip, dtype, None, None)
    assert planned("flux1-dev", "flux") == pytest.approx(flux, rel=0.01)
    if fp8:
        with torch.device("meta"):
            qwen = _built_bytes(LLM(QWEN2_5_7B), dtype, fp8, arch_spec("llm").fp8)
        assert planned("qwen-image", "qwen_image") == pytest.approx(qwen, rel=0.01)


def test_a_qwen_image_plan_counts_the_text_encoder_its_loader_loads(tiny_set):
    """A Qwen-Image repo's text_encoder/ holds Qwen2.5-VL's vision tower, which load_qwen_image_text_encoder skips and
    the caching phase counted (full size: 8.29 B for 7.62 B loaded); the edit encoder loads it, and is planned with it."""
    from library.models.qwen_image.edit_encoder import load_qwen_image_edit_text_encoder
    from library.models.qwen_image.edit_family import QwenImageEditFamily
    from library.models.qwen_image.family import QwenImageFamily
    from library.models.qwen_image.text_encoder import load_qwen_image_text_encoder

    path = tiny_set["qwen_image_edit_text_encoder"]  # with visual.* keys
    family = QwenImageFamily(tiny_set["qwen_image"], tiny_set["qwen_image_vae"], text_encoder=path)
    loaded = load_qwen_image_text_encoder(path, dtype=torch.bfloat16).llm
    assert family.text_encoder_params() == sum(p.numel() for p in loaded.parameters())
    edit = QwenImageEditFamily(tiny_set["qwen_image_edit"], tiny_set["qwen_image_vae"], text_encoder=path)
    both = load_qwen_image_edit_text_encoder(path, edit.version, dtype=torch.bfloat16)
    assert edit.text_encoder_params() == sum(p.numel() for m in (both.llm, both.visual) for p in m.parameters())


def test_the_planned_peak_never_rises_with_blocks_to_swap():
    """The swap holds a block and the next block_swap_prefetch in run order: the swap buffers are the largest run of
    prefetch + 1 consecutive swapped blocks. Until 2026-11-28 they were prefetch + 1 of the largest, and FLUX.1 at
    blocks_to_swap 39 (its last double block and 38 single ones) planned two double blocks: more than at 38."""
    from library.training.memory_plan import resident_parts, step_plan
    from tools import plan_memory

    family = plan_memory.PresetFamily("flux1-dev")
    args = plan_memory.setting_args(family, plan_memory.default_args("flux"), "bf16", True)
    plan = step_plan(family, args, LargestStep(256, 256, 1, None))
    peaks = [plan.phase(n).peak for n in range(len(plan.block_bytes))]
    assert all(later <= earlier for earlier, later in zip(peaks, peaks[1:])), peaks
    assert resident_parts(0, [4, 1, 1, 9, 1, 2], 0, 0, 5, prefetch=1)["swap buffers"] == 10  # 9 + 1, not 9 + 9


@pytest.mark.parametrize("name, tight, kwargs", [
    ("AdamW", True, {}), ("Prodigy", True, {}), ("AdamW8bit", True, {}), ("PagedLion8bit", True, {}),
    ("AdEMAMix8bit", True, {}), ("PagedAdamW", True, {}), ("torch.optim.RMSprop", True, {}),
    ("torch.optim.Adagrad", True, {}), ("torch.optim.SGD", False, {}),
    # the args that add a buffer (planned 8 and 4 bytes before: 12 kept)
    ("AdamW", True, {"amsgrad": True}), ("torch.optim.RMSprop", True, {"momentum": 0.9, "centered": True}),
])
def test_planned_optimizer_state_holds_what_the_optimizer_keeps_after_a_step(name, tight, kwargs):
    """The table's names against the state each optimizer holds after one step on LoRA-shaped fp32
    parameters (a zero lora_up as a fresh LoRA's): PagedLion8bit and AdEMAMix8bit fell back to 8 bytes (1.02
    and 3.05 kept), the 8-bit optimizers' absmax blocks were missing (2.04 kept, 2 planned). `tight`: the
    state does not hang on the optimizer's args, so the plan is within 15% (Prodigy plans p0 whole); 1% over
    the plan is each tensor's step count and quantization maps, nothing at a real LoRA's size."""
    from library.training.memory_plan import optimizer_state_bytes
    from library.training.optim import create_optimizer

    params = [torch.nn.Parameter(torch.randn(64, 3072) * 0.01), torch.nn.Parameter(torch.zeros(3072, 64))]
    optimizer = create_optimizer([{"params": params}], name, 1e-4, kwargs)
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()
    storages = {v.untyped_storage().data_ptr(): v.untyped_storage().nbytes()
                for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)}
    kept = sum(storages.values()) / sum(p.numel() for p in params)
    planned = optimizer_state_bytes(name, kwargs)
    assert kept <= 1.01 * planned and (not tight or planned <= 1.15 * kept), (kept, planned)  # (+ a step count, maps)
