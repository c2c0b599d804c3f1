"""tools/merge_lora.py with a LoRA of a mixture's packed experts (Nucleus-Image's experts_dim, networks/lora_packed.py)
and fp8: merged into a high-precision base and written in each fp8 layout (comfy / plain / block64), and merged into
an fp8 base (each layout) kept in its layout. Both were refused ("merging a LoRA of packed experts into an fp8 base or
output is not supported"). Oracles: PEFT's ParamWrapper delta written out (W[e] + ratio * (alpha / r) * up_e @ down_e),
fp8.quantize_packed_weight for the codes and scales, and the same LoRA applied at runtime on the fp8 base."""

import warnings

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from library.models.nucleus_image.family import NucleusImageFamily
from library.precision.fp8_packed import PackedWeights
from library.precision import fp8
from networks.lora import LoRANetwork
from tests.test_merge_convert import lora, merge, run
from tools import merge_lora
from tools.precision_doctor import make_inputs

RATIO = 0.5
EXPERTS = 8  # the tiny model's experts per mixture
LINEARS_OFF = {f"{t}_dim": 0 for t in ("attn", "context", "mod", "mlp", "router")}


def expert_delta(lora_file: dict, name: str) -> torch.Tensor:
    """(alpha / r) * up_e @ down_e [E, K, N] of the packed weight `name` in a kohya file, PEFT's ParamWrapper formula
    (up [K, r E] rank-major, down [r E, N] expert-major) written out, float32."""
    kohya = "lora_unet_" + name.replace(".", "_")
    up, down = lora_file[f"{kohya}.lora_up.weight"].float(), lora_file[f"{kohya}.lora_down.weight"].float()
    rank = down.shape[0] // EXPERTS
    scale = lora_file[f"{kohya}.alpha"].item() / rank
    return scale * torch.einsum("kre,ern->ekn", up.reshape(up.shape[0], rank, EXPERTS), down.reshape(EXPERTS, rank, -1))


def dequantized(tensors: dict, name: str) -> torch.Tensor:
    """A stored packed weight as the loaders compute with it: codes times their scale (none plain), float32."""
    return fp8.dequantize_packed_weight(tensors[name], tensors.get(name + "_scale"), torch.float32)


def fp8_step(tensors: dict, name: str, reference: torch.Tensor) -> torch.Tensor:
    """The e4m3 step at each value of `reference` [E, K, N] in the layout of `tensors` (its scale: one number, blocks
    [E, K/64, N] over 64 rows of K, or none): 2^(binade - 3) of reference / scale (2^-9 below 2^-6), times the scale."""
    scale = tensors.get(name + "_scale")
    scale = torch.ones(()) if scale is None else scale.float()
    if scale.dim() == 3:
        scale = scale.repeat_interleave(reference.shape[1] // scale.shape[1], dim=1)
    _, exponent = torch.frexp(reference / scale)
    return torch.exp2(((exponent - 1).clamp_min(-6) - 3).float()) * scale


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def setup(tiny_set, tmp_path_factory):
    """The tiny Nucleus-Image (two MoE blocks of 8 experts: 4 packed weights), a LoRA of its Linears at rank 4 and its
    experts at rank 2 (l; up ~ N(0, 0.2)), one of the experts only (e), the base quantized to each fp8 layout (merged
    at ratio 0: our block64 experts with bf16 `<name>_scale` blocks, ComfyUI's per-tensor fp32 scale, plain codes)."""
    root = tmp_path_factory.mktemp("experts_fp8")
    base = tiny_set["nucleus_image"]
    model = load(base)
    experts = list(fp8.packed_weight_names(model))
    assert len(experts) == 4
    lora(model, "nucleus_image", rank=4, alpha=4.0, seed=3, experts_dim=2).save(str(root / "l.safetensors"))
    experts_only = lora(model, "nucleus_image", rank=4, alpha=4.0, seed=5, experts_dim=2, **LINEARS_OFF)
    experts_only.save(str(root / "e.safetensors"))
    bases = {}
    for layout in merge_lora.FP8_LAYOUTS:
        bases[layout] = root / f"base_{layout}.safetensors"
        assert merge("--model", base, "--lora", f"{root / 'l.safetensors'}:0", "--save_to", bases[layout],
                     "--save_precision", "fp8", "--fp8_layout", layout) == 0
    x = make_inputs("nucleus_image", model.config, 64, 48, seed=3, text_len=8).make_kwargs(0.6)
    return dict(root=root, base=base, experts=experts, bases=bases, x=x, fp32_experts=experts_outputs(model),
                lora={name: load_file(str(root / f"{name}.safetensors")) for name in ("l", "e")})


def load(path) -> torch.nn.Module:
    with warnings.catch_warnings():  # a comfy file's fp8 embedders and biases, widened (as ComfyUI writes them)
        warnings.simplefilter("ignore")
        return NucleusImageFamily(str(path)).load_transformer(torch.float32).eval()


def experts_outputs(model) -> torch.Tensor:
    """Every mixture's routed experts (SwiGLUExperts, through packed_bmm: a runtime LoRA's hook too) on the same
    tokens, x [E, 16, dim] N(0, 1): the experts' own forward, which no routing decision upstream changes."""
    g = torch.Generator().manual_seed(7)
    mixtures = [m for m in model.modules() if isinstance(m, PackedWeights)]
    assert len(mixtures) == 2
    experts, dim = mixtures[0].gate_up_proj.shape[:2]
    return torch.stack([m(torch.randn(experts, 16, dim, generator=g)) for m in mixtures])


def with_runtime_lora(setup, path, lora_name: str, ratio: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(experts' outputs, model output) of the checkpoint `path` with the LoRA applied at runtime at `ratio`."""
    model = load(path)
    net = LoRANetwork.from_weights(model, "nucleus_image", str(setup["root"] / f"{lora_name}.safetensors"))
    net.set_multiplier(ratio)
    net.apply()
    return experts_outputs(model), run(model, setup["x"])


@torch.no_grad()
@pytest.mark.parametrize("layout", list(merge_lora.FP8_LAYOUTS))
def test_experts_lora_merged_into_an_fp8_output_equals_it_at_runtime_on_the_fp8_base(setup, tmp_path, layout):
    """fp32 base + experts LoRA at 1.0 -> --save_precision fp8 --fp8_layout comfy / plain / block64: each merged
    packed weight is fp8.quantize_packed_weight(W + delta) bit for bit (fresh scale) and dequantizes to within half an
    fp8 step of W + delta (PEFT's formula); the file loads through the family's loader with its experts in the layout.
    The experts' forward is as close to the fp32 merge's as the fp8 base's with the LoRA at runtime (one fp8 rounding
    each; measured relative L2, merged / runtime: comfy 0.046 / 0.045, plain 0.047 / 0.045, block64 0.044 / 0.042, of a
    LoRA effect of 0.51), and so is the whole model's, within its routing (expert choice: a rounding upstream moves
    tokens between experts; merged vs runtime comfy 0.045, plain 0.043, block64 0.033 of LoRA effects 0.24-0.27)."""
    mode, lora_arg = merge_lora.FP8_LAYOUTS[layout], f"{setup['root'] / 'e.safetensors'}:1"
    exact, out = tmp_path / "fp32.safetensors", tmp_path / f"{layout}.safetensors"
    assert merge("--model", setup["base"], "--lora", lora_arg, "--save_to", exact, "--save_precision", "fp32") == 0
    assert merge("--model", setup["base"], "--lora", lora_arg, "--save_to", out, "--save_precision", "fp8",
                 "--fp8_layout", layout) == 0
    base, wide, written = load_file(setup["base"]), load_file(str(exact)), load_file(str(out))
    for name in setup["experts"]:
        reference = base[name].float() + expert_delta(setup["lora"]["e"], name)
        assert (wide[name] - reference).abs().max() <= 1e-6
        codes, scale = fp8.quantize_packed_weight(wide[name], mode)
        assert torch.equal(written[name].view(torch.uint8), codes.view(torch.uint8)), name
        assert torch.equal(written[name + "_scale"], scale) if scale is not None else name + "_scale" not in written
        error = (dequantized(written, name) - reference).abs() / fp8_step(written, name, reference)
        assert error.max() <= 0.5 + 1e-3, (name, error.max())  # round to nearest: at most half a step
        unmerged = fp8.quantize_packed_weight(base[name].float(), mode)[0]
        assert (written[name].view(torch.uint8) != unmerged.view(torch.uint8)).float().mean() > 0.5  # the delta shows

    merged_model = load(out)
    modes = {module.packed_modes.get(weight) for module, weight in fp8.packed_weight_names(merged_model).values()}
    assert modes == {mode}
    truth_model = load(exact)
    truth, truth_out = experts_outputs(truth_model), run(truth_model, setup["x"])
    merged, merged_out = experts_outputs(merged_model), run(merged_model, setup["x"])
    runtime, runtime_out = with_runtime_lora(setup, setup["bases"][layout], "e", 1.0)
    base_out = run(load(setup["bases"][layout]), setup["x"])
    merged_err, runtime_err = rel(merged, truth), rel(runtime, truth)
    between, effect = rel(merged_out, runtime_out), rel(runtime_out, base_out)
    print(f"{layout}: experts vs the fp32 merge's, merged {merged_err:.4f}, fp8 base + LoRA at runtime "
          f"{runtime_err:.4f} (the LoRA's effect {rel(truth, setup['fp32_experts']):.3f}); model output merged vs "
          f"runtime {between:.4f} (the LoRA's effect {effect:.3f})")
    assert merged_err <= 1.25 * runtime_err and runtime_err <= 0.06, (merged_err, runtime_err)
    assert between <= 0.25 * effect, (between, effect)


@torch.no_grad()
@pytest.mark.parametrize("layout", list(merge_lora.FP8_LAYOUTS))
def test_experts_lora_merged_into_an_fp8_base_keeps_its_layout_and_changes_only_the_merged_tensors(setup, tmp_path,
                                                                                                    layout):
    """fp8 base (comfy's per-tensor fp32 `<name>_scale`, plain codes, our bf16 blocks) + a LoRA of Linears and experts
    at 0.5, kept in its layout (no --save_precision): every key, dtype and shape as in the base; the tensors of
    modules the LoRA does not touch (biases, norms, other scales, the marker) byte for byte; each packed weight
    re-quantized from the dequantized base + 0.5 delta (the fp32 merge out of the fp8 base, which is that within 1e-6)
    with a fresh scale, bit for bit fp8.quantize_packed_weight's (round to nearest). The file loads through the
    family's loader in the base's layout; its experts' forward is the fp8 base's with the LoRA at runtime (exact: the
    fp32 merge's) within one fp8 rounding, no further than the base's own from the fp32 base's (measured relative L2,
    kept / base: comfy 0.045 / 0.046, plain 0.046 / 0.047, block64 0.044 / 0.043)."""
    mode, path = merge_lora.FP8_LAYOUTS[layout], setup["bases"][layout]
    lora_arg = f"{setup['root'] / 'l.safetensors'}:{RATIO}"
    exact, kept = tmp_path / "fp32.safetensors", tmp_path / "kept.safetensors"
    assert merge("--model", path, "--lora", lora_arg, "--save_to", exact, "--save_precision", "fp32") == 0
    assert merge("--model", path, "--lora", lora_arg, "--save_to", kept, "--no-stochastic_rounding") == 0
    base, wide, written = load_file(str(path)), load_file(str(exact)), load_file(str(kept))
    assert {k: (v.dtype, v.shape) for k, v in written.items()} == {k: (v.dtype, v.shape) for k, v in base.items()}
    modules = {k.split(".lora_")[0] for k in setup["lora"]["l"]}
    touched = {k for k in base if "lora_unet_" + k.rsplit(".", 1)[0].replace(".", "_") in modules
               and k.endswith((".weight", ".scale_weight", ".weight_scale"))}
    touched |= {k for name in setup["experts"] for k in (name, name + "_scale") if k in base}
    as_bytes = lambda t: t.reshape(-1).view(torch.uint8)  # noqa: E731
    changed = {k for k in base if not torch.equal(as_bytes(base[k]), as_bytes(written[k]))}
    assert changed <= touched and set(setup["experts"]) <= changed, sorted(changed - touched)
    for name in setup["experts"]:
        reference = dequantized(base, name) + RATIO * expert_delta(setup["lora"]["l"], name)
        assert (wide[name] - reference).abs().max() <= 1e-6  # the fp8 base dequantized, out into fp32
        codes, scale = fp8.quantize_packed_weight(wide[name], mode)
        assert torch.equal(written[name].view(torch.uint8), codes.view(torch.uint8)), name
        if scale is not None:  # fresh: the merged weight's absmax / 448, in the base's dtype and shape
            assert torch.equal(written[name + "_scale"], scale.to(base[name + "_scale"].dtype))
        error = (dequantized(written, name) - reference).abs() / fp8_step(written, name, reference)
        assert error.max() <= 0.5 + 1e-3, (name, error.max())

    kept_model = load(kept)
    modes = {module.packed_modes.get(weight) for module, weight in fp8.packed_weight_names(kept_model).values()}
    assert modes == {mode}
    runtime, _ = with_runtime_lora(setup, path, "l", RATIO)
    assert rel(experts_outputs(load(exact)), runtime) <= 1e-5  # out of fp8 into fp32: the runtime LoRA's exactly
    kept_err = rel(experts_outputs(kept_model), runtime)
    base_err = rel(experts_outputs(load(path)), setup["fp32_experts"])
    print(f"{layout} base: experts kept in the layout vs the fp8 base + LoRA at runtime {kept_err:.4f}; the fp8 base "
          f"vs the fp32 base {base_err:.4f}")
    assert kept_err <= 1.25 * base_err and base_err <= 0.06, (kept_err, base_err)


@torch.no_grad()
def test_a_bf16_per_tensor_expert_scale_stays_bf16_and_the_codes_divide_by_it_as_stored(setup, tmp_path):
    """A ComfyUI-style base whose packed weights' one-number scales are bf16 (as musubi-tuner stores per-tensor
    scales), kept in its layout: each merged expert's fresh scale is bf16 too, absmax / 448 rounded up (no code past
    448), and the codes are the merged weight divided by that bf16 number, so they dequantize within half a step of
    W + 0.5 delta; codes of the fp32 scale beside its bf16 rounding would be off by up to 0.4% more."""
    tensors, source = load_file(str(setup["bases"]["comfy"])), str(setup["bases"]["comfy"])
    with safe_open(source, "pt") as f:
        metadata = f.metadata()
    for name in setup["experts"]:
        tensors[name + "_scale"] = tensors[name + "_scale"].bfloat16()
    save_file(tensors, str(tmp_path / "bf16_scales.safetensors"), metadata)
    lora_arg = f"{setup['root'] / 'e.safetensors'}:{RATIO}"
    for name, extra in (("fp32", ["--save_precision", "fp32"]), ("kept", ["--no-stochastic_rounding"])):
        assert merge("--model", tmp_path / "bf16_scales.safetensors", "--lora", lora_arg, "--save_to",
                     tmp_path / f"{name}.safetensors", *extra) == 0
    wide, written = load_file(str(tmp_path / "fp32.safetensors")), load_file(str(tmp_path / "kept.safetensors"))
    for name in setup["experts"]:
        reference = dequantized(tensors, name) + RATIO * expert_delta(setup["lora"]["e"], name)
        scale = written[name + "_scale"]
        assert scale.dtype == torch.bfloat16 and scale.shape == tensors[name + "_scale"].shape
        assert torch.equal(scale, fp8.round_up_to_bf16(wide[name].abs().amax() / fp8.FP8_MAX))
        codes, _ = fp8.quantize_packed_weight(wide[name] / scale.float(), "fp8")
        assert torch.equal(written[name].view(torch.uint8), codes.view(torch.uint8)), name
        error = (dequantized(written, name) - reference).abs() / fp8_step(written, name, reference)
        assert error.max() <= 0.5 + 1e-3, (name, error.max())
    modes = {m.packed_modes.get(w) for m, w in fp8.packed_weight_names(load(tmp_path / "kept.safetensors")).values()}
    assert modes == {"fp8_tensor_scaled"}


@torch.no_grad()
@pytest.mark.parametrize("layout", ["comfy", "block64"])
def test_a_gentle_experts_lora_merged_into_an_fp8_base_is_kept_by_default_rounding_stochastically(setup, tmp_path,
                                                                                                   layout, capsys):
    """An experts-only LoRA at ratio 0.05 into the fp8 base kept in its layout: rounded to nearest the merged weight
    (on the fp8 grid plus a delta mostly under half a step) keeps a part of the delta only (measured share: comfy 0.53,
    block64 0.57); by default the merge rounds stochastically as for Linears and the share is 1 in expectation
    (measured 0.990 / 1.002), each code one of the two neighbours, the same bits as --stochastic_rounding --seed 0
    and other bits with --seed 1."""
    path, gentle = setup["bases"][layout], setup["lora"]["e"]
    base = load_file(str(path))
    shares = {}
    runs = {"default": [], "nearest": ["--no-stochastic_rounding"], "seed0": ["--stochastic_rounding"],
            "seed1": ["--seed", "1"]}
    for name, extra in runs.items():
        out = tmp_path / f"{name}.safetensors"
        capsys.readouterr()
        lora_arg = f"{setup['root'] / 'e.safetensors'}:0.05"
        assert merge("--model", path, "--lora", lora_arg, "--save_to", out, *extra) == 0
        assert ("stochastic rounding" in capsys.readouterr().out) == (name != "nearest")
        written = load_file(str(out))
        change = torch.cat([(dequantized(written, n) - dequantized(base, n)).reshape(-1) for n in setup["experts"]])
        delta = torch.cat([0.05 * expert_delta(gentle, n).reshape(-1) for n in setup["experts"]])
        shares[name] = ((change * delta).sum() / (delta * delta).sum()).item()  # the delta's share that is there
        for n in setup["experts"]:
            reference = dequantized(base, n) + 0.05 * expert_delta(gentle, n)
            assert ((dequantized(written, n) - reference).abs() / fp8_step(written, n, reference)).max() < 1 + 1e-3
        shares[name + "_bits"] = torch.cat([written[n].view(torch.uint8).reshape(-1) for n in setup["experts"]])
    print(f"{layout} base, experts LoRA at 0.05: the delta's share kept, stochastic {shares['default']:.3f}, "
          f"round to nearest {shares['nearest']:.3f}")
    assert abs(shares["default"] - 1) < 0.1 and shares["nearest"] < 0.7, shares
    assert torch.equal(shares["default_bits"], shares["seed0_bits"])
    assert not torch.equal(shares["default_bits"], shares["seed1_bits"])


@torch.no_grad()
def test_stochastic_rounding_into_fp8_rounds_each_merged_expert_to_a_neighbour_without_bias(setup, tmp_path):
    """fp32 base -> block64 and comfy with --stochastic_rounding: every merged expert's value is one of the two fp8
    neighbours of W + 0.5 delta with the round-to-nearest scales, and the rounding is unbiased (mean error under
    2% of a step over the 4 packed weights' values; measured block64 +0.04%, comfy -0.07%), not round to nearest's
    (whose errors are at most half a step, a quarter on average: these are a third on average, up to a whole step)."""
    base = load_file(setup["base"])
    for layout in ("block64", "comfy"):
        mode, out = merge_lora.FP8_LAYOUTS[layout], tmp_path / f"{layout}.safetensors"
        assert merge("--model", setup["base"], "--lora", f"{setup['root'] / 'l.safetensors'}:{RATIO}", "--save_to", out,
                     "--save_precision", "fp8", "--fp8_layout", layout, "--stochastic_rounding") == 0
        written, errors = load_file(str(out)), []
        for name in setup["experts"]:
            reference = base[name].float() + RATIO * expert_delta(setup["lora"]["l"], name)
            # round to nearest's scales (of the merge's float32 sum: this one may differ in its last bits)
            assert torch.allclose(written[name + "_scale"], fp8.quantize_packed_weight(reference, mode)[1], rtol=2**-7)
            errors.append(((dequantized(written, name) - reference) / fp8_step(written, name, reference)).reshape(-1))
        errors = torch.cat(errors)
        size, peak = errors.abs().mean().item(), errors.abs().max().item()
        print(f"{layout}: stochastic rounding's mean error {errors.mean().item():+.4f} step, mean size {size:.3f}, "
              f"max {peak:.3f}")
        assert peak < 1 + 1e-3 and abs(errors.mean().item()) < 0.02, (errors.mean(), peak)
        assert size > 0.3 and peak > 0.9, (size, peak)  # not round to nearest's (at most 0.5, 0.25 on average)
