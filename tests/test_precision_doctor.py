"""The precision doctor tells position damage (uneven error map), weight quantization (flat map)
and LoRA deltas lost in fp8 merges apart, on tiny FLUX / Qwen-Image models built here.

The tiny models have one block, hidden 64 (2 heads x 32), RoPE axes (8, 12, 12), weights N(0, 0.02)
like real DiT weights, open gates, and attention made local (q and k share a bias, QK-norm weight 5),
as trained DiT heads are: only then do positions shape the output. The grid is 48 x 48 patches, so
positions exceed 16, where float8_e4m3fn stops holding integers exactly.
"""

import copy
import json
import os

import pytest
import torch
import torch.nn as nn

from library.models import precision_doctor as precision
from library.models.flux1.model import Flux, FluxConfig
from library.precision.fp8 import FP8Linear, is_high_precision, quantize_weight
from library.models.qwen_image.model import QwenImage, QwenImageConfig
from networks.lora import LoRANetwork
from networks.lora_module import LoRAModule
from tools import precision_doctor as doctor
from tests.test_fp8_compute import cpu_rowwise
from library.models.registry import arch_spec

GRID_PX = 48 * 16  # 48 x 48 patches
BASE = ("bf16", "fp8", "fp8_scaled")


def realistic(model: nn.Module, gate: float = 2.0, qk_norm: float = 5.0, seed: int = 0) -> nn.Module:
    """Weights N(0, 0.02), biases 0, modulation gates `gate`; q and k of each stream share one
    random bias and QK-norm weights are `qk_norm`, so attention is sharp and local in position."""
    g = torch.Generator().manual_seed(seed)
    hidden = 64
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
            elif name.endswith("bias"):
                p.zero_()
                if "mod" in name and "norm_out" not in name:  # (shift, scale, gate) triples: open the gates
                    for chunk in range(2, p.numel() // hidden, 3):
                        p[chunk * hidden : (chunk + 1) * hidden] = gate
        for m in model.modules():
            pairs = [(m.to_q, m.to_k), (m.add_q_proj, m.add_k_proj)] if hasattr(m, "to_q") else []
            for fused in (getattr(m, "qkv", None), getattr(m, "linear1", None)):
                if fused is not None:
                    pairs.append((fused, None))
            for q, k in pairs:
                bias = torch.randn(hidden, generator=g)
                if k is None:  # fused [q | k | v | ...] rows
                    q.bias[:hidden], q.bias[hidden : 2 * hidden] = bias, bias
                else:
                    q.bias.copy_(bias), k.bias.copy_(bias)
            for norm in ("norm_q", "norm_k", "norm_added_q", "norm_added_k", "query_norm", "key_norm"):
                if hasattr(m, norm):
                    next(getattr(m, norm).parameters()).fill_(qk_norm)
    return model


def tiny_qwen() -> QwenImage:
    cfg = QwenImageConfig(num_layers=1, attention_head_dim=32, num_attention_heads=2, joint_attention_dim=32,
                          axes_dims_rope=(8, 12, 12))
    return realistic(QwenImage(cfg))


def tiny_flux() -> Flux:
    cfg = FluxConfig(vec_in_dim=32, context_in_dim=32, hidden_size=64, num_heads=2, depth=1, depth_single=1,
                     axes_dim=(8, 12, 12), guidance_embed=True)
    return realistic(Flux(cfg))


def run(family: str, model: nn.Module, bug: bool, modes=BASE, lora=None) -> dict:
    inputs = doctor.make_inputs(family, model.config, GRID_PX, GRID_PX, seed=0, text_len=8)
    models = {m: (lambda m=m: doctor.in_memory_variant(model, family, m, lora)) for m in modes}
    return precision.diagnose(models, inputs, timesteps=(0.5,), inject_position_bug=bug)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These models are tiny: one intra-op thread avoids waiting on a busy second core (measured:
    a [200, 64] x [64, 256] matmul takes 0.09 ms on one thread, 1.9 ms on two when the other core is loaded)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def results():
    """{(family, bug): diagnose result} for bf16 / fp8 / fp8_scaled (fp32 too on the correct Qwen)."""
    torch.manual_seed(0)
    qwen, flux = tiny_qwen(), tiny_flux()
    return {
        ("qwen_image", False): run("qwen_image", qwen, False, ("fp32",) + BASE),
        ("qwen_image", True): run("qwen_image", qwen, True),
        ("flux", False): run("flux", flux, False),
        ("flux", True): run("flux", flux, True),
    }


def _ratios(result, key):
    return {m: round(result["modes"][m]["map"][key], 2) for m in ("fp8", "fp8_scaled")}


# ----------------------------------------------------------------------------------------------
# (a) position damage vs flat weight damage


def test_map_ratios_on_synthetic_maps():
    flat = precision.map_ratios(torch.full((48, 48), 0.02))
    assert flat["border_centre_ratio"] == 1.0 and flat["region_ratio"] == 1.0
    framed = torch.ones(48, 48)
    framed[:6], framed[-6:], framed[:, :6], framed[:, -6:] = 4.0, 4.0, 4.0, 4.0  # the outer 1/8 band
    assert precision.map_ratios(framed)["border_centre_ratio"] == 4.0
    corner = torch.ones(48, 48)
    corner[24:, 24:] = 3.0  # FLUX-like: damage away from position 0
    r = precision.map_ratios(corner)
    assert r["region_ratio"] == 3.0 and r["regions"][0][0] == 1.0 and r["regions"][3][3] == 3.0
    assert precision.verdict(r, 0.1, 0.05).startswith("POSITION DAMAGE: error concentrated at the high-index side")
    assert precision.verdict(flat, 0.1, 0.05).startswith("WEIGHT QUANTIZATION")
    assert precision.verdict(flat, 0.01, 0.05).startswith("OK")


def test_the_verdict_follows_the_position_audit_where_the_error_map_is_flat():
    """On a base that has learned, the e4m3 bug spreads its error over the image (border / centre ~1 on the
    learned FLUX base at 768 px, 1520 positions changed): the old verdict read the map alone and said "OK" or
    "WEIGHT QUANTIZATION: use fp8_scaled" for the fp8_scaled row. The audit's changed positions decide now."""
    flat_error = torch.full((1, 16, 4), 1.0)
    runs = {"bf16": precision.ModeRun([flat_error]),
            "fp8_scaled": precision.ModeRun([flat_error * 1.03], positions={"positions_changed": 11,
                                                                            "table_max_abs_diff": 1.68}),
            "fp8": precision.ModeRun([flat_error * 1.03], positions={"positions_changed": 0,
                                                                     "table_max_abs_diff": 3e-8})}
    inputs = precision.DoctorInputs("flux", (4, 4), None, None, (2,), 1.0)
    modes = precision.summarise(runs, inputs, [0.5], 0.05)["modes"]
    assert modes["fp8_scaled"]["map"]["border_centre_ratio"] == 1.0
    assert modes["fp8_scaled"]["verdict"].startswith("POSITION DAMAGE: 11 positions reached the RoPE tables changed "
                                                     "(table error 1.7; output error 0.0300"), modes["fp8_scaled"]["verdict"]
    assert modes["fp8"]["verdict"].startswith("OK: output error 0.0300")
    bf16_table = {"positions_changed": 0, "table_max_abs_diff": 0.12}  # positions right, tables computed in bf16
    assert precision.verdict(modes["fp8"]["map"], 0.03, 0.05, bf16_table).startswith("POSITION DAMAGE: the RoPE tables are off")


def test_e4m3_position_bug_on_qwen_image_concentrates_error_at_the_borders(results):
    correct, buggy = results[("qwen_image", False)], results[("qwen_image", True)]
    print("qwen border/centre correct", _ratios(correct, "border_centre_ratio"), "bug", _ratios(buggy, "border_centre_ratio"))
    for mode in ("fp8", "fp8_scaled"):
        assert buggy["modes"][mode]["map"]["border_centre_ratio"] > 3.0
        assert buggy["modes"][mode]["verdict"].startswith("POSITION DAMAGE: ")
        assert correct["modes"][mode]["map"]["border_centre_ratio"] < 1.5
        assert correct["modes"][mode]["map"]["region_ratio"] < 1.5
        assert not correct["modes"][mode]["verdict"].startswith("POSITION")
        # the bug adds error on top of the weight quantization, it does not replace it
        assert buggy["modes"][mode]["output_error"] > 2 * correct["modes"][mode]["output_error"]


def test_e4m3_position_bug_on_flux_damages_the_high_index_side(results):
    correct, buggy = results[("flux", False)], results[("flux", True)]
    print("flux regions max/min correct", _ratios(correct, "region_ratio"), "bug", _ratios(buggy, "region_ratio"))
    for mode in ("fp8", "fp8_scaled"):
        regions = buggy["modes"][mode]["map"]["regions"]  # 4 x 4 blocks of 12 x 12 patches
        assert buggy["modes"][mode]["map"]["region_ratio"] > 3.0
        # ids start at 0: the top-left block (positions 0..11, exact in e4m3) is the cleanest,
        # the bottom-right one (36..47, steps of 4) the worst
        flat = [v for row in regions for v in row]
        assert regions[0][0] == min(flat) and regions[3][3] == max(flat)
        assert buggy["modes"][mode]["verdict"].startswith("POSITION DAMAGE")
        assert correct["modes"][mode]["map"]["region_ratio"] < 1.5
        assert not correct["modes"][mode]["verdict"].startswith("POSITION")


# ----------------------------------------------------------------------------------------------
# (b) the position audit


def test_position_audit_sees_int64_positions_and_the_values_e4m3_collapses(results):
    # Qwen-Image, 48 x 48 centred grid: rows/cols -24..23 plus 8 text ids 24..31 -> 56 values per axis.
    correct, buggy = results[("qwen_image", False)]["modes"], results[("qwen_image", True)]["modes"]
    for mode in ("fp32",) + BASE:
        audit = correct[mode]["positions"]
        assert audit["dtype"] == "int64" and audit["distinct"] == audit["expected_distinct"] == [9, 56, 56]
        assert audit["positions_changed"] == 0 and audit["table_max_abs_diff"] < 1e-6
        assert correct[mode]["low_precision_position_tensors"] == []
    for mode in ("fp8", "fp8_scaled"):
        audit = buggy[mode]["positions"]
        # e4m3: -16..16 exact, then +-18, 20, 22, 24, text 26..32 in steps of 2: 45 of the 56 survive
        assert audit["dtype"] == "float32" and audit["distinct"] == [6, 45, 45]
        assert audit["positions_changed"] > 0 and audit["max_position_error"] == 1.0
        assert audit["table_max_abs_diff"] > 0.5
    # The same bug with a bf16 model (bf16 holds integers up to 256) changes nothing here.
    assert buggy["bf16"]["positions"]["distinct"] == [9, 56, 56] and buggy["bf16"]["positions"]["positions_changed"] == 0
    # FLUX ids 0..47: 17 exact values, then 18..32 in steps of 2 and 36..48 in steps of 4.
    assert results[("flux", True)]["modes"]["fp8"]["positions"]["distinct"] == [1, 29, 29]
    assert results[("flux", False)]["modes"]["fp8"]["positions"]["distinct"] == [1, 48, 48]


def test_scan_lists_position_buffers_that_model_to_dtype_rounded():
    model = tiny_flux()
    model.register_buffer("pe_freqs", torch.ones(4))  # a RoPE table kept as a buffer: .to(bf16) rounds it
    model.register_buffer("inv_freq_fp32", torch.ones(4), persistent=False)
    model.register_buffer("postnorm_scale", torch.ones(4))  # Krea 2's blocks.N.postnorm.scale: not a position
    model.to(torch.bfloat16)
    model.inv_freq_fp32 = model.inv_freq_fp32.float()
    found = precision.low_precision_position_tensors(model)
    assert [(f["name"], f["dtype"]) for f in found] == [("pe_freqs", "bfloat16")]


def test_rope_tables_patch_reaches_the_models_and_is_undone():
    import library.models.core as core
    import library.models.flux1.model as flux_module

    original = core.rope_tables
    with precision.patched_rope_tables(precision.position_bug(torch.bfloat16)):
        assert core.rope_tables is not original and flux_module.rope_tables is core.rope_tables
        cos, _ = core.rope_tables(torch.tensor([[257]]), (2,), 10000.0)  # bf16: 257 -> 256
        assert torch.allclose(cos, torch.cos(torch.tensor([[256.0]])), atol=1e-6)
    assert core.rope_tables is original and flux_module.rope_tables is original


# ----------------------------------------------------------------------------------------------
# (c) plain fp8 vs fp8_scaled per layer, and the bf16 floor


def test_plain_fp8_layers_err_more_than_scaled_and_bf16_floor_is_reported(results):
    for family in ("qwen_image", "flux"):
        modes = results[(family, False)]["modes"]
        plain, scaled = modes["fp8"]["layers"], modes["fp8_scaled"]["layers"]
        blocks = results[(family, False)]["blocks"]
        quantized = [n for n in plain if n not in blocks and not is_high_precision(n, arch_spec(family).fp8)]
        mean_plain = sum(plain[n] for n in quantized) / len(quantized)
        mean_scaled = sum(scaled[n] for n in quantized) / len(quantized)
        worse = sum(plain[n] > scaled[n] for n in quantized) / len(quantized)
        print(f"{family}: mean layer error plain {mean_plain:.4f} scaled {mean_scaled:.4f}, plain worse in {worse:.0%}")
        assert mean_plain > 1.15 * mean_scaled and worse >= 0.8
        assert modes["fp8"]["output_error"] > modes["fp8_scaled"]["output_error"]
    qwen = results[("qwen_image", False)]["modes"]
    assert 0 < qwen["fp32"]["output_error"] < qwen["fp8_scaled"]["output_error"]  # the bf16 floor, under fp8's error
    assert qwen["fp8"]["first_layer_over_threshold"] is not None


@cpu_rowwise
def test_fp8_compute_mode_runs_fp8_gemms_and_reports_a_flat_error_above_fp8_scaled():
    """The doctor's fp8_compute mode: the fp8_scaled base requantized per row with activations in e4m3
    (FP8ComputeLinear layers), a flat error map, a larger error than fp8_scaled's storage alone."""
    from library.precision.fp8_compute import FP8ComputeLinear

    torch.manual_seed(0)
    flux = tiny_flux()
    variant = doctor.in_memory_variant(flux, "flux", "fp8_compute")
    assert any(isinstance(m, FP8ComputeLinear) for m in variant.modules())
    modes = run("flux", flux, False, ("bf16", "fp8_scaled", "fp8_compute"))["modes"]
    scaled, computed = modes["fp8_scaled"]["output_error"], modes["fp8_compute"]["output_error"]
    print(f"flux output error: fp8_scaled {scaled:.4f}, fp8_compute {computed:.4f}")
    assert scaled < computed < 0.2
    assert modes["fp8_compute"]["map"]["border_centre_ratio"] < 1.5
    with pytest.raises(ValueError, match="computes in bfloat16"):
        doctor._finish(copy.deepcopy(variant), torch.float32, "cpu", "fp8_compute")


# ----------------------------------------------------------------------------------------------
# (d) LoRA survival


def test_small_lora_delta_vanishes_when_rounded_into_fp8_weights_and_survives_stochastic_rounding():
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(256, 256, generator=g) * 0.02
    delta = (torch.randn(256, 4, generator=g) * 1e-3) @ (torch.randn(4, 256, generator=g) * 0.05)  # ~1e-4, 0.5% of |w|
    s = precision.lora_survival(weight, delta, "fp8", generator=g)
    print({k: round(v["kept"], 3) for k, v in s.items()})
    assert s["into_fp8_nearest"]["kept"] < 0.05 and s["into_fp8_nearest"]["changed"] < 0.01  # below half a step: gone
    assert s["runtime"] == {"kept": 1.0, "error": 0.0, "norm_ratio": 1.0, "changed": 1.0}
    assert abs(s["into_fp8_stochastic"]["kept"] - 1) < 0.1  # unbiased: kept in expectation, noisy per weight
    assert abs(s["merge_fp32_stochastic"]["kept"] - 1) < 0.1
    assert s["into_fp8_stochastic"]["error"] > 1  # ... with noise larger than the delta itself
    # merging in fp32 then rounding to nearest keeps it on average (W sits anywhere in its step) but not per weight
    assert abs(s["merge_fp32_nearest"]["kept"] - 1) < 0.15 and s["merge_fp32_nearest"]["error"] > 1
    assert precision.lora_survival(weight, delta, "fp8_scaled", generator=g)["into_fp8_nearest"]["kept"] < 0.5


def test_runtime_lora_on_an_fp8_layer_adds_the_exact_delta():
    torch.manual_seed(0)
    linear = nn.Linear(128, 64)
    nn.init.normal_(linear.weight, std=0.02)
    layer = FP8Linear.from_linear(linear, "fp8")
    x = torch.randn(8, 128)
    base = layer(x)
    lora = LoRAModule("layer", layer, rank=4, alpha=4)
    with torch.no_grad():
        lora.lora_down.weight.normal_(0, 0.05)
        lora.lora_up.weight.normal_(0, 1e-3)
    delta = lora.weights().delta()
    lora.apply_to_base()
    added = layer(x) - base
    assert precision.relative_error(added, x @ delta.T) < 1e-5  # runtime: the delta, exactly (fp32)
    merged = doctor.merged_codes(linear.weight.float(), delta, "fp8", "merge_into_fp8", None)[0]
    assert torch.equal(merged.float(), quantize_weight(linear.weight, "fp8")[0].float())  # merged: not a code moved


def test_the_lora_effect_is_measured_against_fp32s_where_it_ran():
    """Old: against the bf16 effect, whose rounding noise sits in the denominator: a runtime LoRA on fp8, which
    keeps all of it, read kept ~|t|^2 / (|t|^2 + |noise|^2) (0.91 for a LoRA at 3x the floor). Synthetic runs: the
    true effect t, each bf16-compute run its own noise of t's size."""
    g = torch.Generator().manual_seed(0)
    base, t = torch.randn(4, 64, 16, generator=g), 0.05 * torch.randn(4, 64, 16, generator=g)

    def noisy(x):
        return x + 0.05 * torch.randn(x.shape, generator=g)

    runs = {"fp32": base, "fp32+lora": base + t, "bf16": noisy(base), "bf16+lora": noisy(base + t),
            "fp8": noisy(base), "fp8+lora": noisy(base + t)}
    runs = {name: precision.ModeRun([pred]) for name, pred in runs.items()}
    effects = precision.lora_effects(runs)
    assert abs(effects["fp8+lora"]["kept"] - 1) < 0.1 and effects["reference"] == "fp32+lora", effects
    assert abs(effects["bf16+lora"]["kept"] - 1) < 0.1
    del runs["fp32+lora"]  # --skip_fp32: the bf16 reference, biased low alike (its note says so)
    biased = precision.lora_effects(runs)
    assert biased["reference"] == "bf16+lora" and biased["fp8+lora"]["kept"] < 0.7, biased


# ----------------------------------------------------------------------------------------------
# (e) the CLI end to end


def _tiny_lora(model, family, path, up_std):
    net = LoRANetwork(model, family, rank=4, alpha=4)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in net.lora_modules():
            m.lora_down.weight.normal_(0, 0.05, generator=g)
            m.lora_up.weight.normal_(0, up_std, generator=g)
    net.save(path)


@pytest.mark.parametrize("fp8_gemms", [True, False])
def test_cli_writes_report_json_and_heatmaps_for_a_tiny_flux_file(tmp_path, capsys, monkeypatch, fp8_gemms):
    """The whole report; where the device has no fp8 GEMMs with per-row scales (an RTX 3090, the CPU under
    torch 2.11) the fp8_compute modes are skipped with one line and the rest is reported."""
    from library.models.flux1.checkpoint import save_flux_bfl

    if not fp8_gemms:
        monkeypatch.setattr(doctor, "fp8_gemm_available", lambda device: False)
    elif not doctor.fp8_gemm_available("cpu"):
        pytest.skip("this torch's CPU _scaled_mm takes no per-row scales")

    model = tiny_flux()
    save_flux_bfl(model, str(tmp_path / "flux.safetensors"))
    _tiny_lora(model, "flux", str(tmp_path / "lora.safetensors"), up_std=1e-3)
    out = tmp_path / "report"
    rc = doctor.main(["--model_type", "flux", "--model", str(tmp_path / "flux.safetensors"), "--lora",
                      f"{tmp_path / 'lora.safetensors'}:1.0", "--resolution", "256x192", "--timesteps", "0.7",
                      "--text_len", "8", "--out", str(out), "--device", "cpu"])
    printed = capsys.readouterr().out
    assert rc == 0 and "== LoRA ==" in printed and "== Positions fed to core.rope_tables" in printed
    data = json.loads((out / "report.json").read_text())
    assert data["grid"] == [12, 16] and data["timesteps"] == [0.7]
    computed = {m for m in doctor.BASE_MODES + doctor.LORA_MODES if m.split("+")[0] in doctor.COMPUTED}
    assert set(data["modes"]) == (set(doctor.BASE_MODES) | set(doctor.LORA_MODES)) - (set() if fp8_gemms else computed)
    assert ("skipped: the fp8_compute modes (cpu has no fp8 GEMMs" in printed) != fp8_gemms
    assert len(data["maps"]["fp8"]) == 12 and len(data["maps"]["fp8"][0]) == 16
    # a LoRA this small is wholly lost when added to fp8 weights: the model is the fp8 base itself
    assert data["lora_effect"]["fp8+merge_into_fp8"]["kept"] == 0.0
    assert data["lora_survival"]["summary"]["fp8 into_fp8_nearest"]["median_kept"] < 0.5
    assert (out / "report.txt").read_text() in printed
    pngs = sorted(p.name for p in out.iterdir() if p.suffix == ".png")
    assert len(pngs) == len(data["maps"]) == (11 if fp8_gemms else 9) and "heatmap_fp8_merge_sr.png" in pngs
    assert all((out / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)
    assert not [p for p in os.listdir(out) if p.endswith(".tmp")]


@pytest.mark.parametrize("args, message", [
    (["--resolution", "1000"], "multiples of 16"),
    (["--timesteps", "0.5,2"], "(0, 1]"),
    (["--model", "/nonexistent.safetensors"], "no such file"),
    (["--lora", "missing.safetensors"], "missing.safetensors"),
])
def test_cli_bad_input_is_one_line_and_exit_2(tmp_path, capsys, args, message):
    from library.models.flux1.checkpoint import save_flux_bfl

    save_flux_bfl(tiny_flux(), str(tmp_path / "flux.safetensors"))
    base = ["--model_type", "flux", "--model", str(tmp_path / "flux.safetensors"), "--resolution", "64",
            "--text_len", "4", "--out", str(tmp_path / "r"), "--skip_fp32"]
    rc = doctor.main(base + args)
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("error: ") and message in err and len(err.splitlines()) == 1



def test_cli_refuses_a_pre_quantized_model_instead_of_reporting_no_damage(tmp_path, capsys):
    """A ComfyUI scaled-fp8 file loads as stored in every mode: the old doctor compared that base with
    itself and reported fp8 and fp8_scaled 'OK: output error 0.0000'."""
    from tests.test_fp8_checkpoints import comfy_state_dict, write_comfy

    model = tiny_flux()
    path = write_comfy(comfy_state_dict(model, "flux", "marker"), tmp_path / "c.safetensors", "flux", config=model.config)
    rc = doctor.main(["--model_type", "flux", "--model", path, "--resolution", "64", "--text_len", "4",
                      "--out", str(tmp_path / "r"), "--skip_fp32", "--device", "cpu"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert f"--model {path}: the transformer is stored pre-quantized (fp8_tensor_scaled)" in err
    assert not (tmp_path / "r").exists()

def test_cli_lora_of_another_model_is_one_line_before_the_model_loads(tmp_path, capsys, monkeypatch):
    """The old doctor loaded the bf16 model, then said "... convert_lora.py IN OUT --to kohya"."""
    qwen = str(tmp_path / "qwen.safetensors")
    LoRANetwork(tiny_qwen(), "qwen_image", 4, 4.0).save(qwen)
    monkeypatch.setattr(doctor, "disk_variant", lambda *a, **k: pytest.fail("the model loaded before the LoRA was checked"))
    rc = doctor.main(["--model_type", "flux", "--model", qwen, "--lora", f"{qwen}:0.5", "--out", str(tmp_path / "r")])
    assert rc == 2 and capsys.readouterr().err.strip() == (
        f"error: {qwen}: a LoRA for Qwen-Image (tools/lora_info.py: arch qwen_image, diffusers names), not for this FLUX.1 model")


@pytest.mark.parametrize("out, message", [
    ("taken", "--out {tmp}/taken: is a file, expected a folder (the report folder)"),
    ("taken/r", "--out {tmp}/taken/r: cannot be created, '{tmp}/taken' is a file, not a folder"),
])
def test_cli_out_where_no_folder_can_be_is_one_line_before_the_model_loads(tmp_path, capsys, monkeypatch, out, message):
    """The old doctor ran every mode (minutes on a real model), then failed writing the report:
    'error: [Errno 17] File exists: .../taken' ('[Errno 20] Not a directory' under a file)."""
    from library.models.flux1.checkpoint import save_flux_bfl

    save_flux_bfl(tiny_flux(), str(tmp_path / "flux.safetensors"))
    (tmp_path / "taken").write_text("notes")
    monkeypatch.setattr(doctor, "disk_variant", lambda *a, **k: pytest.fail("the model loaded before --out was checked"))
    rc = doctor.main(["--model_type", "flux", "--model", str(tmp_path / "flux.safetensors"), "--out", str(tmp_path / out)])
    assert rc == 2 and capsys.readouterr().err.strip() == "error: " + message.format(tmp=tmp_path)


def test_a_loras_text_encoder_modules_are_left_out_with_a_warning(tmp_path):
    """Old: dropped without a word, so the report's LoRA numbers measured part of the file as if all of it."""
    from safetensors.torch import load_file, save_file

    model = tiny_flux()
    _tiny_lora(model, "flux", str(tmp_path / "lora.safetensors"), up_std=2e-3)
    tensors = load_file(str(tmp_path / "lora.safetensors"))
    te = "lora_te1_text_model_encoder_layers_0_self_attn_q_proj"
    tensors.update({f"{te}.lora_down.weight": torch.randn(4, 32), f"{te}.lora_up.weight": torch.randn(32, 4),
                    f"{te}.alpha": torch.tensor(4.0)})
    save_file(tensors, str(tmp_path / "with_te.safetensors"))
    with pytest.warns(UserWarning, match=r"with_te.safetensors: left out 1 text-encoder modules \(CLIP-L lora_te1_ x1\)"):
        lora = doctor.read_lora_for(model, "flux", str(tmp_path / "with_te.safetensors"))
    assert len(lora) == len(doctor.read_lora_for(model, "flux", str(tmp_path / "lora.safetensors")))


@pytest.mark.parametrize("mode", ["fp8", "fp8_scaled"])
def test_merging_while_loading_from_disk_gives_the_in_memory_merged_codes(tmp_path, mode):
    from library.models.flux1.checkpoint import save_flux_bfl

    model = tiny_flux()
    save_flux_bfl(model, str(tmp_path / "flux.safetensors"))
    _tiny_lora(model, "flux", str(tmp_path / "lora.safetensors"), up_std=2e-3)
    lora = doctor.read_lora_for(model, "flux", str(tmp_path / "lora.safetensors"))
    moved_share = {}
    for how in ("merge_rtn", "merge_into_fp8"):
        disk = doctor.disk_variant(str(tmp_path / "flux.safetensors"), "flux", f"{mode}+{how}", lora)
        memory = doctor.in_memory_variant(model, "flux", f"{mode}+{how}", lora)
        base = doctor.in_memory_variant(model, "flux", mode)
        layer = "double_blocks.0.img_attn.qkv"
        codes = {name: dict(m.named_modules())[layer].weight.float()
                 for name, m in (("disk", disk), ("memory", memory), ("base", base))}
        assert torch.equal(codes["disk"], codes["memory"])
        moved = (codes["memory"] != codes["base"]).float().mean().item()
        moved_share[how] = moved
    print(mode, "share of codes moved by the LoRA", moved_share)
    if mode == "fp8":  # plain: a delta ~2e-4 is under half the 2^-9 step of most weights, so adding it to fp8 moves ~nothing
        assert moved_share["merge_into_fp8"] < 0.01 < 0.05 < moved_share["merge_rtn"]


# ----------------------------------------------------------------------------------------------
# (d) expert-choice routing: a mixture-of-experts base whose rounding sends tokens to other experts


def tiny_nucleus():
    """Nucleus-Image's architecture: 1 dense and 2 mixture-of-experts blocks of 8 experts, each taking 2 x its share
    of the tokens. Weights N(0, 0.02), the routers' 10x so that their scores are not all near ties, biases N(0, 1)
    (the modulation's gates open), norm scales 1."""
    from library.models.nucleus_image.model import NucleusImage, NucleusImageConfig

    cfg = NucleusImageConfig(in_channels=16, out_channels=4, num_layers=3, attention_head_dim=32, num_attention_heads=2,
                             num_key_value_heads=1, joint_attention_dim=32, axes_dims_rope=(4, 14, 14), num_experts=8,
                             moe_intermediate_dim=64, dense_moe_strategy="leave_first_block_dense",
                             capacity_factors=(0, 2, 2))
    model = NucleusImage(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:  # Linears and the packed experts
                p.copy_(torch.randn(p.shape) * (0.2 if name.endswith("img_mlp.gate.weight") else 0.02))
            else:
                p.copy_(torch.randn(p.shape) if name.endswith("bias") else torch.ones(p.shape))
    return model


def test_routing_audit_counts_the_expert_choices_an_fp8_base_flips():
    torch.manual_seed(0)
    model = tiny_nucleus()
    inputs = doctor.make_inputs("nucleus_image", model.config, 16 * 16, 16 * 16, seed=0, text_len=8)
    bf16 = doctor.in_memory_variant(model, "nucleus_image", "bf16")
    models = {"bf16": bf16, "fp8_scaled": doctor.in_memory_variant(model, "nucleus_image", "fp8_scaled"),
              "fp8": bf16}  # the reference itself under another name: every choice kept
    result = precision.diagnose(models, inputs, timesteps=(0.9, 0.5))
    routers = ["transformer_blocks.1.img_mlp", "transformer_blocks.2.img_mlp"]
    assert sorted(result["modes"]["fp8"]["routing_kept"]) == routers  # the MoE blocks' routers, not the dense one
    assert all(v == 1.0 for v in result["modes"]["fp8"]["routing_kept"].values())
    kept = result["modes"]["fp8_scaled"]["routing_kept"]
    assert all(0.5 < v < 1.0 for v in kept.values()), kept
    text = doctor.report_text(result)
    assert "== Expert-choice routing" in text and f"{kept[routers[0]]:.3f}" in text
    assert "Expert-choice" not in doctor.report_text(run("flux", tiny_flux(), False, ("bf16", "fp8")))
