"""tools/merge_lora.py on tiny real models: merged weights and outputs, layouts kept, fp8 outputs and errors;
conversion: tests/test_convert_lora.py."""

import json
import os
import subprocess
import sys

import pytest
import torch
from diffusers import FluxTransformer2DModel
from safetensors import safe_open
from safetensors.torch import save_file

from library.precision import fp8
from library.models.flux1.model import Flux, FluxConfig, make_img_ids, make_txt_ids
from library.models.flux1.checkpoint import (
    diffusers_config,
    flux_diffusers_module_map,
    flux_to_diffusers_state_dict,
    load_flux,
    save_flux_bfl,
)
from library.models.llm import LLM, LLMConfig, load_llm
from library.models.qwen_image.model import QwenImage, QwenImageConfig, load_qwen_image, save_qwen_image_diffusers
from networks import lora_files as lf
from networks.lora_module_map import bfl_to_diffusers
from networks.lora import LoRANetwork
from tools import merge_lora
from library.models.registry import arch_spec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLUX_CFG = FluxConfig(in_channels=64, vec_in_dim=16, context_in_dim=32, hidden_size=64, num_heads=2, depth=1,
                      depth_single=1, axes_dim=(4, 14, 14))  # fmt: skip
QWEN_CFG = QwenImageConfig(num_layers=1, attention_head_dim=32, num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(8, 12, 12))
LLM_CFG = LLMConfig(vocab_size=48, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=48)


# ----------------------------------------------------------------------------------------------
# Tiny models, LoRAs and inputs


def randomized(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every parameter random (norms around 1), so every weight and its LoRA shows in the output."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if p.dim() == 1 and "norm" in name:
                p.copy_(1 + 0.2 * noise)
            else:
                p.copy_(noise / p.shape[-1] ** 0.5 if p.dim() == 2 else 0.1 * noise)
    return model.eval()


def lora(model, family, rank, alpha, seed, **args) -> LoRANetwork:
    torch.manual_seed(seed)
    net = LoRANetwork(model, family, rank=rank, alpha=alpha, network_args=args)
    with torch.no_grad():
        for m in net.lora_modules():
            m.lora_up.weight.normal_(0, 0.2)
    return net


def flux_inputs():
    g = torch.Generator().manual_seed(5)
    return dict(img=torch.randn(1, 16, 64, generator=g), img_ids=make_img_ids(1, 4, 4), txt=torch.randn(1, 8, 32, generator=g),
                txt_ids=make_txt_ids(1, 8), timesteps=torch.tensor([0.4]), y=torch.randn(1, 16, generator=g))  # fmt: skip


def qwen_inputs():
    g = torch.Generator().manual_seed(6)
    return dict(img=torch.randn(1, 16, 64, generator=g), txt=torch.randn(1, 8, 32, generator=g),
                txt_mask=torch.ones(1, 8, dtype=torch.bool), timesteps=torch.tensor([0.4]), img_shapes=[(1, 4, 4)])  # fmt: skip


def llm_inputs():
    return dict(input_ids=torch.randint(0, 48, (1, 7), generator=torch.Generator().manual_seed(7)))


def run(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs)


def runtime_output(model, nets_and_ratios, inputs) -> torch.Tensor:
    """The base with the LoRAs applied unmerged (patched forwards), then removed again."""
    for net, ratio in nets_and_ratios:
        net.set_multiplier(ratio)
        net.apply()
    out = run(model, inputs)
    for net, _ in reversed(nets_and_ratios):
        net.remove()
    return out


def merge(*argv) -> int:
    return merge_lora.main([str(a) for a in argv])


def save_llm_folder(model: LLM, folder):
    """HF layout in two shards + index, and a file the merge must copy along (tokenizer config)."""
    os.makedirs(folder, exist_ok=True)
    sd = model.state_dict()
    names = sorted(sd)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2], "model-00002-of-00002.safetensors": names[len(names) // 2 :]}
    for shard, keys in shards.items():
        save_file({k: sd[k].contiguous() for k in keys}, os.path.join(folder, shard), metadata={"format": "pt"})
    index = {"metadata": {"total_size": 0}, "weight_map": {k: s for s, keys in shards.items() for k in keys}}
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({**LLM_CFG.to_hf(), "dtype": "float32"}, f)
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        f.write('{"model_max_length": 64}')


def read_all(path) -> dict[str, torch.Tensor]:
    with safe_open(path, framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def only_line(captured: str) -> str:
    lines = [line for line in captured.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    return lines[0]


@pytest.fixture(scope="module")
def flux_bfl(tmp_path_factory):
    """A tiny FLUX BFL file and two kohya LoRAs (the second also on the modulation Linears)."""
    root = tmp_path_factory.mktemp("flux")
    model = randomized(Flux(FLUX_CFG), 1)
    save_flux_bfl(model, str(root / "base.safetensors"))
    a = lora(model, "flux", rank=4, alpha=2.0, seed=2)
    b = lora(model, "flux", rank=2, alpha=8.0, seed=3, train_modulation=True)
    a.save(str(root / "a.safetensors"))
    b.save(str(root / "b.safetensors"))
    return root, model, a, b


# ----------------------------------------------------------------------------------------------
# Merging: weights and outputs


def test_merged_weights_equal_independent_formula_for_two_loras(flux_bfl, tmp_path):
    root, model, a, b = flux_bfl
    out = tmp_path / "merged.safetensors"
    assert merge("--model", root / "base.safetensors", "--lora", f"{root / 'a.safetensors'}:0.8", f"{root / 'b.safetensors'}:-0.5",
                 "--save_to", out, "--save_precision", "fp32") == 0  # fmt: skip
    merged, base = read_all(out), read_all(root / "base.safetensors")
    assert set(merged) == set(base)
    changed = 0
    for key, w in base.items():
        expected = w.double()
        for net, ratio in ((a, 0.8), (b, -0.5)):
            module = dict((m.name, m) for m in net.lora_modules()).get(key.removesuffix(".weight"))
            if module is not None and key.endswith(".weight"):
                up, down = module.lora_up.weight.double(), module.lora_down.weight.double()
                expected = expected + ratio * (float(module.alpha) / module.rank) * up @ down
        changed += not torch.equal(merged[key], w)
        assert (merged[key].double() - expected).abs().max() <= 1e-6 * expected.abs().max(), key
    assert changed == len({m.name for m in a.lora_modules()} | {m.name for m in b.lora_modules()}) == 13
    with safe_open(str(out), framework="pt") as f:
        meta = f.metadata()
    assert json.loads(meta["merged_loras"]) == [{"file": "a.safetensors", "ratio": 0.8}, {"file": "b.safetensors", "ratio": -0.5}]
    assert meta["save_precision"] == "fp32" and "flux_config" in meta


def test_flux_bfl_merge_output_equals_unmerged_lora(flux_bfl, tmp_path):
    root, model, a, b = flux_bfl
    expected = runtime_output(model, [(a, 0.8), (b, 1.0)], flux_inputs())
    assert (expected - run(model, flux_inputs())).abs().max() > 0.05  # the LoRAs matter
    merge("--model", root / "base.safetensors", "--lora", f"{root / 'a.safetensors'}:0.8", root / "b.safetensors",
          "--save_to", tmp_path / "m.safetensors")  # fmt: skip
    merged = load_flux(str(tmp_path / "m.safetensors"))
    assert (run(merged, flux_inputs()) - expected).abs().max() <= 1e-5


def test_flux_diffusers_sharded_folder_merge_keeps_layout_and_output(flux_bfl, tmp_path):
    root, model, a, b = flux_bfl
    reference = FluxTransformer2DModel(**{k: v for k, v in diffusers_config(FLUX_CFG).items() if not k.startswith("_")})
    reference.load_state_dict(flux_to_diffusers_state_dict(model.state_dict()))
    reference.save_pretrained(tmp_path / "pipe" / "transformer", max_shard_size="300KB")
    shards = sorted(os.listdir(tmp_path / "pipe" / "transformer"))
    assert sum(s.endswith(".safetensors") for s in shards) > 1
    # a BFL-named kohya LoRA and a diffusers-named PEFT LoRA, both onto diffusers names
    peft = bfl_to_diffusers(b.lora_weights(), flux_diffusers_module_map(1, 1, 64, 256))
    lf.write_peft(peft, str(tmp_path / "b_peft.safetensors"))
    out = tmp_path / "merged"
    assert merge("--model", tmp_path / "pipe", "--lora", f"{root / 'a.safetensors'}:0.7", f"{tmp_path / 'b_peft.safetensors'}:1.5",
                 "--save_to", out) == 0  # fmt: skip
    assert sorted(os.listdir(out)) == shards
    with open(out / "diffusion_pytorch_model.safetensors.index.json") as f:
        index = json.load(f)
    assert index["weight_map"] == json.load(open(tmp_path / "pipe" / "transformer" / "diffusion_pytorch_model.safetensors.index.json"))["weight_map"]
    expected = runtime_output(model, [(a, 0.7), (b, 1.5)], flux_inputs())
    assert (run(load_flux(str(out)), flux_inputs()) - expected).abs().max() <= 1e-5


def test_diffusers_named_lora_merges_into_bfl_file(flux_bfl, tmp_path):
    root, model, a, _ = flux_bfl
    peft = bfl_to_diffusers(a.lora_weights(), flux_diffusers_module_map(1, 1, 64, 256))
    lf.write_peft(peft, str(tmp_path / "a_peft.safetensors"))
    merge("--model", root / "base.safetensors", "--lora", tmp_path / "a_peft.safetensors", "--save_to", tmp_path / "m.safetensors")
    expected = runtime_output(model, [(a, 1.0)], flux_inputs())
    assert (run(load_flux(str(tmp_path / "m.safetensors")), flux_inputs()) - expected).abs().max() <= 1e-5


def test_qwen_image_folder_merge_equals_unmerged_lora(tmp_path):
    model = randomized(QwenImage(QWEN_CFG), 4)
    save_qwen_image_diffusers(model.state_dict(), QWEN_CFG, str(tmp_path / "qwen" / "transformer"))
    net = lora(model, "qwen_image", rank=4, alpha=1.0, seed=5, mod_dim=2)
    net.save(str(tmp_path / "q.safetensors"))
    expected = runtime_output(model, [(net, 1.2)], qwen_inputs())
    assert (expected - run(model, qwen_inputs())).abs().max() > 0.05
    assert merge("--model", tmp_path / "qwen", "--lora", f"{tmp_path / 'q.safetensors'}:1.2", "--save_to", tmp_path / "out") == 0
    assert sorted(os.listdir(tmp_path / "out")) == ["config.json", "diffusion_pytorch_model.safetensors"]
    assert (run(load_qwen_image(str(tmp_path / "out")), qwen_inputs()) - expected).abs().max() <= 1e-5


def test_llm_sharded_folder_merge_equals_unmerged_lora_and_copies_files(tmp_path):
    model = randomized(LLM(LLM_CFG), 6)
    save_llm_folder(model, tmp_path / "llm")
    net = lora(model, "llm", rank=4, alpha=4.0, seed=7)
    net.save(str(tmp_path / "l.safetensors"))
    expected = runtime_output(model, [(net, 0.9)], llm_inputs())
    assert merge("--model", tmp_path / "llm", "--lora", f"{tmp_path / 'l.safetensors'}:0.9", "--save_to", tmp_path / "out",
                 "--save_precision", "bf16") == 0  # fmt: skip
    assert sorted(os.listdir(tmp_path / "out")) == sorted(os.listdir(tmp_path / "llm"))
    assert open(tmp_path / "out" / "tokenizer_config.json").read() == '{"model_max_length": 64}'
    merged = read_all(tmp_path / "out" / "model-00001-of-00002.safetensors")
    assert {t.dtype for t in merged.values()} == {torch.bfloat16}
    # config.json said float32 still: transformers loaded the bf16 weights as float32 (twice the memory)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
    out = run(load_llm(str(tmp_path / "out")), llm_inputs())
    assert (out - expected).abs().max() <= 0.02 * expected.abs().max()  # bf16 storage of the merged fp32 sum
    # The old line wrote e4m3 + weight_scale, which transformers loads without the scales (logits off ~0.7).
    for layout in (["--save_precision", "fp8_scaled"], ["--save_precision", "fp8", "--fp8_layout", "block64"]):
        assert merge("--model", tmp_path / "llm", "--lora", tmp_path / "l.safetensors", "--save_to", tmp_path / "q",
                     *layout) == 2
        assert not (tmp_path / "q").exists()


# ----------------------------------------------------------------------------------------------
# fp8 outputs


# Single FLUX / Qwen-Image files default to ComfyUI's layout; these name the others.
LAYOUT_ARGS = {"fp8": ["--save_precision", "fp8", "--fp8_layout", "plain"], "fp8_scaled": ["--save_precision", "fp8_scaled"],
               "comfy": ["--save_precision", "fp8"]}


@pytest.mark.parametrize("mode, tolerance", [("fp8", 0.05), ("fp8_scaled", 0.03)])
def test_fp8_outputs_dequantize_to_the_fp32_merge(flux_bfl, tmp_path, mode, tolerance):
    root, model, a, _ = flux_bfl
    lora_arg = f"{root / 'a.safetensors'}:0.8"
    merge("--model", root / "base.safetensors", "--lora", lora_arg, "--save_to", tmp_path / "f32.safetensors", "--save_precision", "fp32")
    merge("--model", root / "base.safetensors", "--lora", lora_arg, "--save_to", tmp_path / "q.safetensors", *LAYOUT_ARGS[mode])
    exact, quantized = read_all(tmp_path / "f32.safetensors"), read_all(tmp_path / "q.safetensors")
    linears = [k for k in exact if k.endswith(".weight") and exact[k].dim() == 2]
    for key in linears:
        module = key.removesuffix(".weight")
        if fp8.is_high_precision(module, arch_spec("flux").fp8):
            assert quantized[key].dtype == torch.bfloat16 and module + ".weight_scale" not in quantized
            continue
        q = quantized[key]
        scale = quantized.get(module + ".weight_scale")
        assert q.dtype == torch.float8_e4m3fn and (scale is not None) == (mode == "fp8_scaled")
        w = fp8.dequantize_weight(q, scale, torch.float32)
        rms = ((w - exact[key]).norm() / exact[key].norm()).item()
        assert rms <= tolerance, (key, rms)
    assert all(t.dtype == torch.bfloat16 for k, t in quantized.items() if k not in linears and not k.endswith("_scale"))
    if mode == "fp8_scaled":  # loads into the project's FP8Linear layout and runs close to the fp32 merge
        with torch.device("meta"):
            fp8_model = fp8.prepare_fp8(Flux(FLUX_CFG), mode, arch_spec("flux").fp8)
        fp8_model.load_state_dict({k: t if t.dtype == torch.float8_e4m3fn or k.endswith("_scale") else t.float()
                                   for k, t in quantized.items()}, assign=True)  # fmt: skip
        expected = run(load_flux(str(tmp_path / "f32.safetensors")), flux_inputs())
        err = ((run(fp8_model, flux_inputs()) - expected).norm() / expected.norm()).item()
        assert err <= 0.04, err  # measured 0.019


def reference_fp8_model(skeleton, merged: dict, mode: str, family: str):
    """The merged fp8 file loaded by hand into FP8Linear (codes and scales as stored), fp32 elsewhere."""
    with torch.device("meta"):
        model = fp8.prepare_fp8(skeleton, mode, arch_spec(family).fp8)
    model.load_state_dict({k: t if t.dtype == torch.float8_e4m3fn or k.endswith("_scale") else t.float()
                           for k, t in merged.items()}, assign=True)  # fmt: skip
    return model


@pytest.mark.parametrize("mode", ["fp8", "fp8_scaled"])
def test_fp8_merges_load_back_as_they_are_and_equal_their_dequantized_weights(flux_bfl, tmp_path, mode):
    """merge -> load (no re-quantization) for both fp8 layouts, FLUX BFL file and Qwen-Image folder."""
    root, _, _, _ = flux_bfl
    out = tmp_path / f"flux_{mode}.safetensors"
    assert merge("--model", root / "base.safetensors", "--lora", f"{root / 'a.safetensors'}:0.8", "--save_to", out,
                 *LAYOUT_ARGS[mode]) == 0
    loaded = load_flux(str(out))
    layers = [m for m in loaded.modules() if isinstance(m, fp8.FP8Linear)]
    assert layers and {m.mode for m in layers} == {mode}
    expected = reference_fp8_model(Flux(FLUX_CFG), read_all(out), mode, "flux")
    assert torch.equal(run(loaded, flux_inputs()), run(expected, flux_inputs()))

    qwen = randomized(QwenImage(QWEN_CFG), 4)
    save_qwen_image_diffusers(qwen.state_dict(), QWEN_CFG, str(tmp_path / "qwen"))
    lora(qwen, "qwen_image", rank=4, alpha=1.0, seed=5).save(str(tmp_path / "q.safetensors"))
    assert merge("--model", tmp_path / "qwen", "--lora", str(tmp_path / "q.safetensors"), "--save_to", tmp_path / "qout",
                 "--save_precision", mode) == 0
    loaded = load_qwen_image(str(tmp_path / "qout"))
    merged = read_all(tmp_path / "qout" / "diffusion_pytorch_model.safetensors")
    expected = reference_fp8_model(QwenImage(QWEN_CFG), merged, mode, "qwen_image")
    assert torch.equal(run(loaded, qwen_inputs()), run(expected, qwen_inputs()))
    if mode == "fp8":  # folders default to plain; ComfyUI's layout is for single files only
        assert merge("--model", tmp_path / "qwen", "--lora", str(tmp_path / "q.safetensors"), "--save_to",
                     tmp_path / "qcomfy", "--save_precision", "fp8", "--fp8_layout", "comfy") == 2
        assert not (tmp_path / "qcomfy").exists()


def test_fp8_tensors_where_we_keep_high_precision_are_widened_exactly_with_a_warning(flux_bfl, tmp_path):
    root, model, _, _ = flux_bfl
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    sd["img_in.weight"] = sd["img_in.weight"].to(torch.float8_e4m3fn)  # a layer we keep in high precision
    save_flux_bfl(sd, str(tmp_path / "widened.safetensors"), config=FLUX_CFG)
    with pytest.warns(UserWarning, match=r"1 fp8 tensors where the model keeps high precision \(first 'img_in.weight'\)"):
        loaded = load_flux(str(tmp_path / "widened.safetensors"))
    assert torch.equal(loaded.img_in.weight, sd["img_in.weight"].float())
    assert type(loaded.img_in) is torch.nn.Linear  # still high precision, fp8 values widened


def test_merged_fp8_file_generates_an_image(tiny_set, tmp_path):
    from tools import generate

    net = LoRANetwork(load_flux(tiny_set["flux_bfl"]), "flux", 4, 4.0)
    for m in net.lora_modules():
        torch.nn.init.normal_(m.lora_up.weight, std=0.05)
    net.save(str(tmp_path / "l.safetensors"))
    for mode in ("fp8", "fp8_scaled", "comfy"):
        merged = tmp_path / f"merged_{mode}.safetensors"
        assert merge("--model", tiny_set["flux_bfl"], "--lora", tmp_path / "l.safetensors", "--save_to", merged,
                     *LAYOUT_ARGS[mode]) == 0
        assert generate.main(["--model_type", "flux", "--model", str(merged), "--ae", tiny_set["flux_vae_single"],
                              "--clip_l", tiny_set["clip_l"], "--t5xxl", tiny_set["t5xxl"], "--prompt", "a red square",
                              "--width", "64", "--height", "64", "--steps", "2", "--dtype", "fp32",
                              "--out", str(tmp_path / mode)]) == 0
        assert len(os.listdir(tmp_path / mode)) == 1


# Every tiny transformer merge_lora reads; those whose loader reads no stored fp8 in their naming (a diffusers
# folder whose fused rows a stored scale would not survive; Krea 2, which quantizes while loading) are refused.
FP8_MERGE_BASES = {"flux_bfl": True, "flux_diffusers": False, "chroma_bfl": True, "chroma_diffusers": False,
                   "flux2_tiny": True, "flux2_diffusers": False, "flux3_tiny": True, "flux3_diffusers": True,
                   "krea2": False, "krea2_diffusers": False, "ernie_image": True, "ernie_image_diffusers": True,
                   "nucleus_image": True, "nucleus_image_diffusers": True,  # the packed experts in the layout too
                   "zimage": True, "zimage_diffusers": True, "qwen_image": True, "qwen_image21": True,
                   "qwen_image21_comfy": True}  # fmt: skip


@pytest.mark.parametrize("base_key, reads_fp8", FP8_MERGE_BASES.items())
def test_every_fp8_merge_loads_through_the_family_loader_or_is_refused_in_one_line(tiny_set, tmp_path, capsys,
                                                                                   base_key, reads_fp8):
    """Such a merge used to end with exit 0 and write a file or folder that train_lora and generate refused."""
    from library.models.spec import load_symbol
    from tools.merge_base import open_base

    base = open_base(tiny_set[base_key])
    load = load_symbol(arch_spec(base.family).transformer.load)
    LoRANetwork(load(tiny_set[base_key]), base.family, 4, 4.0).save(str(tmp_path / "l.safetensors"))
    for layout in ("plain", "block64") if base.is_folder else ("comfy", "plain", "block64"):  # comfy: single files
        out = tmp_path / (layout if base.is_folder else f"{layout}.safetensors")
        capsys.readouterr()
        rc = merge("--model", tiny_set[base_key], "--lora", tmp_path / "l.safetensors", "--save_to", out,
                   "--save_precision", "fp8", "--fp8_layout", layout)  # fmt: skip
        assert rc == (0 if reads_fp8 else 2), (layout, capsys.readouterr().err)
        if reads_fp8:  # a mixture's packed experts (Nucleus-Image's) in the layout too, not left in bf16
            packed = fp8.packed_weight_names(load(str(out), torch.bfloat16)).values()
            assert {module.packed_modes.get(weight) for module, weight in packed} <= {merge_lora.FP8_LAYOUTS[layout]}
            assert bool(packed) == base_key.startswith("nucleus_image")
        else:
            line = only_line(capsys.readouterr().err)
            assert "loader does not read a stored" in line and f"--fp8_layout {layout}" in line, line
            assert not out.exists() and os.listdir(tmp_path) == ["l.safetensors"]


def test_packed_experts_merge_into_fp8_as_codes_and_scales_and_out_of_it_dequantized(tiny_set, tmp_path):
    """A mixture's packed experts ([E, K, N], no Linear: Nucleus-Image's) in an fp8 output are e4m3 codes +
    `<name>_scale` as the loaders store them (fp8.quantize_packed_weight: bf16 blocks, one fp32 for comfy, none
    plain), bit for bit; they were written bf16. Out of our fp8_scaled file (and the comfy one) into fp32 / bf16 each
    is its codes times its scales, and no scale is left over: the expert scales were ignored (the codes read as the
    weights) and copied as stray keys. The merge out of fp8_scaled equals the LoRA at runtime on the fp8 model."""
    from library.models.nucleus_image.checkpoint import load_nucleus_image, save_nucleus_image_single_file
    from library.models.nucleus_image.family import NucleusImageFamily
    from tools.precision_doctor import make_inputs

    base = read_all(tiny_set["nucleus_image"])
    model = load_nucleus_image(tiny_set["nucleus_image"])
    experts = list(fp8.packed_weight_names(model))
    assert len(experts) == 4  # the tiny model's two MoE blocks: gate_up_proj, down_proj
    lora(model, "nucleus_image", rank=4, alpha=4.0, seed=3).save(str(tmp_path / "l.safetensors"))
    for layout, mode in merge_lora.FP8_LAYOUTS.items():
        out = tmp_path / f"{layout}.safetensors"
        assert merge("--model", tiny_set["nucleus_image"], "--lora", tmp_path / "l.safetensors", "--save_to", out,
                     "--save_precision", "fp8", "--fp8_layout", layout) == 0
        written = read_all(out)
        for name in experts:
            codes, scale = fp8.quantize_packed_weight(base[name], mode)
            assert torch.equal(written[name].view(torch.uint8), codes.view(torch.uint8)), (layout, name)
            assert torch.equal(written[name + "_scale"], scale) if scale is not None else name + "_scale" not in written
        if layout == "comfy":  # every Linear's scale_weight, the experts' scales, the marker: nothing else
            linears = [k[: -len("weight")] for k, v in base.items() if k.endswith(".weight") and v.dim() == 2]
            assert written.keys() == {*base, *(k + "scale_weight" for k in linears), *(e + "_scale" for e in experts),
                                      "scaled_fp8"}

    fp8_model = NucleusImageFamily(tiny_set["nucleus_image"]).load_transformer(torch.float32, "fp8_scaled").eval()
    save_nucleus_image_single_file(fp8_model, str(tmp_path / "fp8_scaled.safetensors"))
    net = lora(fp8_model, "nucleus_image", rank=4, alpha=4.0, seed=4)
    net.save(str(tmp_path / "l8.safetensors"))
    with pytest.warns(UserWarning, match="widened"):  # the comfy file's fp8 embedders, as ComfyUI writes them
        comfy_model = load_nucleus_image(str(tmp_path / "comfy.safetensors"))
    for source, held, mode in (("fp8_scaled", fp8_model, "fp8_scaled"), ("comfy", comfy_model, "fp8_tensor_scaled")):
        merged = {}
        for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            out = tmp_path / f"{source}_{precision}.safetensors"
            assert merge("--model", tmp_path / f"{source}.safetensors", "--lora", tmp_path / "l8.safetensors",
                         "--save_to", out, "--save_precision", precision) == 0
            merged[precision] = read_all(out)
            assert merged[precision].keys() == base.keys(), sorted(merged[precision].keys() - base.keys())
            assert {t.dtype for t in merged[precision].values()} == {dtype}
        for name, (module, weight) in fp8.packed_weight_names(held).items():  # codes times scales, then cast
            expected = module.packed_weight(weight, torch.float32)
            assert module.packed_modes[weight] == mode
            assert torch.equal(merged["fp32"][name], expected)
            assert torch.equal(merged["bf16"][name], expected.bfloat16())
    x = make_inputs("nucleus_image", model.config, 64, 48, seed=3, text_len=8).make_kwargs(0.6)
    expected = runtime_output(fp8_model, [(net, 1.0)], x)
    diff = (run(load_nucleus_image(str(tmp_path / "fp8_scaled_fp32.safetensors")).eval(), x) - expected).abs().max()
    print(f"merged out of fp8_scaled into fp32 vs the LoRA at runtime on the fp8 model: {diff:.1e} "
          f"(outputs up to {expected.abs().max():.2f})")
    assert diff < 1e-5


def test_stochastic_rounding_keeps_a_delta_that_round_to_nearest_drops(tmp_path):
    model = randomized(LLM(LLM_CFG), 8)
    # q_proj of layer 0: weights that are exact e4m3 values of one binade (step 2^-7) and a uniform
    # delta of 0.25 step. Round to nearest gives the base back; stochastic rounding keeps the mean.
    step, delta = 2.0**-7, 0.25 * 2.0**-7
    g = torch.Generator().manual_seed(0)
    w = (1 + torch.randint(0, 8, (32, 32), generator=g) / 8) * 2.0**-4 * torch.randint(0, 2, (32, 32), generator=g).mul(2).sub(1)
    model.model.layers[0].self_attn.q_proj.weight.data.copy_(w)
    save_llm_folder(model, tmp_path / "llm")
    ones = lf.LoRAWeights(torch.full((1, 32), delta**0.5), torch.full((32, 1), delta**0.5), alpha=1.0)
    lf.write_kohya({"model.layers.0.self_attn.q_proj": ones}, str(tmp_path / "d.safetensors"), prefix="lora_te")
    shard = "model-00001-of-00002.safetensors"
    key = "model.layers.0.self_attn.q_proj.weight"
    results = {}
    for name, extra in (("nearest", []), ("stochastic", ["--stochastic_rounding"]), ("stochastic_again", ["--stochastic_rounding"])):
        assert merge("--model", tmp_path / "llm", "--lora", tmp_path / "d.safetensors", "--save_to", tmp_path / name,
                     "--save_precision", "fp8", *extra) == 0  # fmt: skip
        results[name] = read_all(tmp_path / name / shard)[key].float()
    assert torch.equal(results["nearest"], w)  # the whole delta vanished
    mean_shift = (results["stochastic"] - w).mean().item()
    assert abs(mean_shift - delta) <= 0.1 * delta, (mean_shift, delta)
    assert (results["stochastic"] - (w + delta)).abs().max() < step  # always one of the two neighbours
    assert torch.equal(results["stochastic"], results["stochastic_again"])  # same --seed, same bits


# ----------------------------------------------------------------------------------------------
# Errors: one line, exit status 2, nothing written


def _foreign_lora(tmp_path):
    net = lora(LLM(LLM_CFG), "llm", rank=2, alpha=1.0, seed=9)
    net.save(str(tmp_path / "llm_lora.safetensors"))
    return tmp_path / "llm_lora.safetensors"


def _misshapen_lora(tmp_path):
    w = lf.LoRAWeights(torch.randn(2, 48), torch.randn(64, 2), 1.0)  # proj is [64, 64]
    lf.write_kohya({"double_blocks.0.img_attn.proj": w}, str(tmp_path / "bad_shape.safetensors"))
    return tmp_path / "bad_shape.safetensors"


def _partly_matching_lora(tmp_path, root):
    weights, _, _ = lf.read_lora(str(root / "a.safetensors"), module_paths=flux_diffusers_module_map(1, 1, 64, 256))
    weights["double_blocks.7.img_attn.proj"] = lf.LoRAWeights(torch.randn(2, 64), torch.randn(64, 2), 1.0)
    lf.write_kohya(weights, str(tmp_path / "partly.safetensors"))
    return tmp_path / "partly.safetensors"


def _fp8_base(tmp_path, root):
    sd = read_all(root / "base.safetensors")
    sd["double_blocks.0.img_attn.qkv.weight"] = sd["double_blocks.0.img_attn.qkv.weight"].to(torch.float8_e4m3fn)
    save_file(sd, str(tmp_path / "fp8_base.safetensors"))
    return tmp_path / "fp8_base.safetensors"


@pytest.mark.parametrize(
    "case, message",
    [
        ("other_model", "llm_lora.safetensors: a LoRA for LLM (tools/lora_info.py: arch llm, hf names), not for this FLUX.1 model"),
        ("shape", "'double_blocks.0.img_attn.proj.weight' gives a delta of shape (64, 48), the checkpoint weight is (64, 64)"),
        ("ratio", "ratio 'abc' is not a number"),
        ("fp8_base", "is a pre-quantized fp8 base; another fp8 layout would re-round all its weights"),
        ("missing", "missing.safetensors: no such file"),
        ("unmatched", "match no weight of"),
        ("stochastic_without_fp8", "--stochastic_rounding needs --save_precision fp8"),
        ("layout_without_fp8", "--fp8_layout plain needs --save_precision fp8, got bf16"),
        ("block64_is_not_comfy", "--save_precision fp8_scaled is --fp8_layout block64, not comfy"),
        ("nan", "nan.safetensors: tensor 'lora_unet_double_blocks_0_img_attn_proj.lora_up.weight' holds 1 non-finite value"),
    ],
)
def test_errors_are_one_line_exit_2_and_leave_no_output(flux_bfl, tmp_path, capsys, case, message):
    root, *_ = flux_bfl
    base, lora_arg, extra = root / "base.safetensors", str(root / "a.safetensors"), []
    if case == "other_model":
        lora_arg = _foreign_lora(tmp_path)
    elif case == "shape":
        lora_arg = _misshapen_lora(tmp_path)
    elif case == "ratio":
        lora_arg += ":abc"
    elif case == "fp8_base":  # merged into as it is (tests/test_fp8_checkpoints.py), not converted
        base, extra = _fp8_base(tmp_path, root), ["--save_precision", "fp8_scaled"]
    elif case == "missing":
        lora_arg = tmp_path / "missing.safetensors"
    elif case == "unmatched":
        lora_arg = _partly_matching_lora(tmp_path, root)
    elif case == "stochastic_without_fp8":
        extra = ["--stochastic_rounding"]
    elif case == "layout_without_fp8":
        extra = ["--save_precision", "bf16", "--fp8_layout", "plain"]
    elif case == "block64_is_not_comfy":
        extra = ["--save_precision", "fp8_scaled", "--fp8_layout", "comfy"]
    elif case == "nan":  # a diverged training's LoRA: it was merged, every weight it touches written as NaN (exit 0)
        tensors = read_all(root / "a.safetensors")
        tensors["lora_unet_double_blocks_0_img_attn_proj.lora_up.weight"][0, 0] = float("nan")
        save_file(tensors, str(tmp_path / "nan.safetensors"))
        lora_arg = str(tmp_path / "nan.safetensors")
    before = set(os.listdir(tmp_path))
    capsys.readouterr()
    assert merge("--model", base, "--lora", lora_arg, "--save_to", tmp_path / "out.safetensors", *extra) == 2
    line = only_line(capsys.readouterr().err)
    assert line.startswith("error: ") and message in line, line
    assert set(os.listdir(tmp_path)) == before  # no output, no temporary file


def test_merge_save_to_is_never_a_lora_and_its_extension_names_the_format(flux_bfl, tmp_path, capsys):
    """--save_to the LoRA itself is refused (it used to be overwritten by the merged model); a GGUF
    output needs a .gguf name and a safetensors output a .safetensors name."""
    import shutil

    root, *_ = flux_bfl
    lora_path = tmp_path / "a.safetensors"
    shutil.copy(root / "a.safetensors", lora_path)
    before = lora_path.read_bytes()
    cases = [
        ([lora_path], f"--save_to {lora_path}: is one of the --lora inputs; write the merge elsewhere"),
        ([tmp_path / "m.safetensors", "--save_precision", "gguf_q8_0"], "expected a .gguf name (a GGUF file is written)"),
        ([tmp_path / "m.gguf"], "expected a .safetensors name (a safetensors file is written)"),
        ([tmp_path / "m.gguf", "--save_precision", "bf16"], "expected a .safetensors name (a safetensors file is written)"),
    ]
    for argv, message in cases:
        capsys.readouterr()
        assert merge("--model", root / "base.safetensors", "--lora", f"{lora_path}:0.5", "--save_to", *argv) == 2
        line = only_line(capsys.readouterr().err)
        assert line.startswith("error: ") and message in line, line
    assert lora_path.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["a.safetensors"]


def test_merge_into_a_folder_never_replaces_one_holding_the_inputs_or_other_files(flux_bfl, tmp_path, capsys):
    """A folder base writes a folder that replaces --save_to whole: --save_to the folder holding the base
    (models/ with models/flux/transformer in it) deleted the base and every other file there, exit 0; a
    folder of other files lost them. Both are one line now, nothing touched; an earlier merge is replaced."""
    from library.models.flux1.checkpoint import save_flux_diffusers

    root, model, a, _ = flux_bfl
    save_flux_diffusers(model, FLUX_CFG, str(tmp_path / "models" / "flux" / "transformer"))
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep")
    for save_to, message in ((tmp_path / "models", f"holds the input {tmp_path / 'models' / 'flux'}"),
                             (tmp_path / "notes", "a folder of other files (no checkpoint")):
        capsys.readouterr()
        assert merge("--model", tmp_path / "models" / "flux", "--lora", root / "a.safetensors", "--save_to", save_to) == 2
        assert message in only_line(capsys.readouterr().err)
    assert (tmp_path / "notes" / "todo.txt").read_text() == "keep"
    assert os.path.isfile(tmp_path / "models" / "flux" / "transformer" / "config.json")
    for _ in range(2):  # into a new folder, then over that earlier merge
        assert merge("--model", tmp_path / "models" / "flux", "--lora", root / "a.safetensors", "--save_to", tmp_path / "m") == 0
    # Old: a folder named m.safetensors, exit 0; and the copied config.json kept the source's mode, not the umask's
    assert merge("--model", tmp_path / "models" / "flux", "--lora", root / "a.safetensors", "--save_to",
                 tmp_path / "m.safetensors") == 2
    assert "is a folder and so is the merge; name a folder" in only_line(capsys.readouterr().err)
    assert not (tmp_path / "m.safetensors").exists()
    config = tmp_path / "models" / "flux" / "transformer" / "config.json"
    os.chmod(config, 0o600)
    old = os.umask(0o022)
    try:
        assert merge("--model", tmp_path / "models" / "flux", "--lora", root / "a.safetensors", "--save_to", tmp_path / "n") == 0
    finally:
        os.umask(old)
    assert os.stat(tmp_path / "n" / "config.json").st_mode & 0o777 == 0o644


def test_unmatched_modules_are_listed_and_skipped_with_allow_unmatched(flux_bfl, tmp_path, capsys):
    root, model, a, _ = flux_bfl
    partly = _partly_matching_lora(tmp_path, root)
    assert merge("--model", root / "base.safetensors", "--lora", partly, "--save_to", tmp_path / "m.safetensors", "--allow_unmatched") == 0
    assert "skipped 1 unmatched LoRA modules: double_blocks.7.img_attn.proj" in capsys.readouterr().err  # a FLUX.1 name, read as one
    expected = runtime_output(model, [(a, 1.0)], flux_inputs())
    assert (run(load_flux(str(tmp_path / "m.safetensors")), flux_inputs()) - expected).abs().max() <= 1e-5


def test_command_line_bad_ratio_exits_2_with_one_stderr_line(flux_bfl, tmp_path):
    root, *_ = flux_bfl
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "merge_lora.py"), "--model", str(root / "base.safetensors"),
         "--lora", f"{root / 'a.safetensors'}:x1", "--save_to", str(tmp_path / "o.safetensors")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2 and done.stdout == ""
    assert "ratio 'x1' is not a number" in only_line(done.stderr)
    assert not os.path.exists(tmp_path / "o.safetensors")


def test_streaming_writer_output_reads_back_with_safe_open(tmp_path):
    tensors = {"a": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.int64), "c": torch.randn(2, 2).to(torch.float8_e4m3fn),
               "d": torch.tensor(1.5, dtype=torch.bfloat16)}  # fmt: skip
    entries = [merge_lora.Entry(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()]
    merge_lora.write_safetensors_streaming(str(tmp_path / "s.safetensors"), entries, iter(tensors.items()), {"x": "y"})
    with safe_open(str(tmp_path / "s.safetensors"), framework="pt") as f:
        assert f.metadata() == {"x": "y"}
        back = {k: f.get_tensor(k) for k in f.keys()}
    assert set(back) == set(tensors)
    assert all(back[k].dtype == t.dtype and torch.equal(back[k].float(), t.float()) for k, t in tensors.items())
    with open(tmp_path / "s.safetensors", "rb") as f:
        assert int.from_bytes(f.read(8), "little") % 8 == 0  # header padded like safetensors' own
