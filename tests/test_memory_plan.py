"""The memory planner (library/training/memory_plan.py, tools/plan_memory.py): its training-step
prediction against a measured step on this CPU (peak RSS of a fresh process), and the tool's output."""

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A mid-width FLUX (hidden 1536, 2 double + 2 single blocks, ~250 M parameters) trained one LoRA step
# by the family's own training_loss, as train_lora.py does. Prints "planned measured" in bytes:
# the planner's training peak, and the process's peak RSS during the steps above its RSS just before
# the model exists (a model quantized in memory starts in fp32: that is not the step, so the peak is reset).
STEP = textwrap.dedent("""
    import ctypes, sys, torch
    ctypes.CDLL("libc.so.6").mallopt(-3, 65536)  # M_MMAP_THRESHOLD: freed tensors leave RSS at once
    torch.set_num_threads(2)
    sys.path.insert(0, {root!r})
    from library.models.flux1.family import FluxFamily
    from library.models.flux1.model import Flux, FluxConfig
    from library.precision.fp8 import prepare_fp8, quantize_module
    from library.training.memory_plan import training_plan
    from networks.lora import LoRANetwork
    from tools.plan_memory import default_args
    base, ckpt, swap = {base!r}, {ckpt!r}, 0
    cfg = FluxConfig(hidden_size=1536, num_heads=12, depth=2, depth_single=2, guidance_embed=True)
    class Mid(FluxFamily):
        def __init__(self):
            self.name = "flux"
        def load_transformer(self, dtype, base_precision="bf16", read_weights=True):
            with torch.device("meta" if not read_weights else "cpu"):
                model = Flux(cfg)
            if base_precision != "bf16":
                (prepare_fp8 if not read_weights else quantize_module)(model, base_precision, "flux")
            model.to(dtype); model.compute_dtype = dtype
            return model
    args = default_args("flux")
    args.mixed_precision, args.fp8_base, args.gradient_checkpointing = "no", base == "fp8_scaled", ckpt
    family, batch, side, tokens = Mid(), 1, 512, 128
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
    open("/proc/self/clear_refs", "w").write("5")  # peak RSS := now: building the fp32 model to quantize is not the step
    for _ in range(2):
        loss, _ = family.training_loss(model, latents, text, args, gens)
        loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
    peak = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM"))
    print(planned, peak - before)
""")


@pytest.mark.parametrize("base,ckpt", [("fp32", False), ("fp8_scaled", True)])
def test_planned_training_peak_is_within_10_percent_of_the_measured_cpu_step(base, ckpt):
    out = subprocess.run([sys.executable, "-c", STEP.format(root=ROOT, base=base, ckpt=ckpt)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    planned, measured = map(int, out.stdout.split()[-2:])
    print(f"{base} checkpointing={ckpt}: planned {planned / 2**30:.3f} GiB, measured {measured / 2**30:.3f} GiB, "
          f"ratio {planned / measured:.3f}")
    assert abs(planned / measured - 1) <= 0.10


def test_plan_memory_on_the_tiny_config_prints_every_phase_and_what_fits(tiny_set, tmp_path, capsys):
    from tools import plan_memory

    config = tmp_path / "tiny.toml"
    config.write_text(textwrap.dedent(f"""
        model_type = "flux"
        pretrained_model_name_or_path = "{tiny_set['flux_bfl']}"
        ae = "{tiny_set['flux_vae_single']}"
        clip_l = "{tiny_set['clip_l']}"
        t5xxl = "{tiny_set['t5xxl']}"
        dataset_config = "{tiny_set['dataset_config']}"
        output_dir = "{tmp_path / 'out'}"
        fp8_base = true
        blocks_to_swap = 2
    """))
    assert plan_memory.main(["--config_file", str(config), "--vram", "12"]) == 0
    out = capsys.readouterr().out
    for phase in ("caching", "training", "sampling"):
        assert phase in out
    assert "swap buffers" in out and "fits with blocks_to_swap = 0" in out  # a tiny model fits anything


def test_a_full_size_preset_needs_swap_on_a_small_card(capsys):
    from tools import plan_memory

    assert plan_memory.main(["--preset", "flux1-schnell", "--vram", "12", "--resolution", "512"]) == 0
    out = capsys.readouterr().out
    bf16 = next(line for line in out.splitlines() if "bf16" in line and "checkpointing=true" in line)
    fp8 = next(line for line in out.splitlines() if "fp8_scaled" in line and "checkpointing=true" in line)
    n_bf16, n_fp8 = (int(line.split("blocks_to_swap = ")[1].split()[0]) for line in (bf16, fp8))
    assert 0 < n_fp8 < n_bf16  # 11.9 B parameters: 22 GiB in bf16, 11.5 GiB in fp8 on a 12 GiB card
