"""FLUX.3 in fp8: pre-quantized files load as they are stored (precision/stored_layouts.py, as FLUX.2's) in BFL
names (ComfyUI's prefix, REPA heads skipped) and in diffusers' (each Linear's scales renamed with it, the final
adaLN's row scales swapped with its halves; GGUF blocks too); a broken layout is one line naming the key; and the
measurement behind the spec's keep rule for the shared stream modulations. tests/test_prequantized_families.py runs
FLUX.3's tiny file through every stored layout (ComfyUI's, musubi-tuner's, ours, plain, GGUF) against its
dequantized twin; tests/test_fp8_checkpoints.py merges into a ComfyUI scaled-fp8 FLUX.3 as into FLUX.1's."""

import dataclasses

import pytest
import torch
import torch.nn as nn
from safetensors.torch import save_file

from library.io import CheckpointError, save_diffusers_folder
from library.models.flux3.checkpoint import (
    FINAL_ADALN_LAYER, diffusers_config, flux3_diffusers_names, load_flux3, swap_halves,
)
from library.models.flux3.model import Flux3Config, Flux3Transformer, make_img_ids, make_txt_ids
from library.models.flux3.tiny import random_flux3
from library.models.flux3.spec import SHARED_MODULATION
from library.models.registry import arch_spec
from library.precision import fp8
from library.precision.fp8 import FP8Linear
from library.precision.gguf_weights import GGUFLinear
from tests.test_flux3_model import inputs, tiny_config
from tests.test_gguf import write_gguf
from tests.test_prequantized_families import fp8_dequantized, fp8_file, gguf_types

E4M3 = torch.float8_e4m3fn
PREFIX = "model.diffusion_model."


def tiny_flow_map() -> Flux3Transformer:
    """The distilled (flow-map) tiny model as the tiny set builds one (torch's Linear init, QK-norm scales
    N(1, 0.1)): ref_time_in is one more embedder the keep rules hold."""
    torch.manual_seed(0)
    return random_flux3(tiny_config(flow_map=True)).eval()


def kept_and_quantized(model: nn.Module) -> tuple[list[str], list[str]]:
    """The model's Linears the spec's fp8 rules keep in high precision, and the others."""
    linears = [n for n, m in model.named_modules() if type(m) is nn.Linear]
    kept = [n for n in linears if fp8.is_high_precision(n, arch_spec("flux3").fp8)]
    return kept, [n for n in linears if n not in kept]


@torch.no_grad()
def relative_error(model: nn.Module, reference: nn.Module, x: dict) -> float:
    out, expected = model(**x), reference(**x)
    return ((out - expected).norm() / expected.norm()).item()


def test_a_comfyui_scaled_fp8_file_loads_as_stored_close_to_the_high_precision_model(tmp_path):
    """ComfyUI's marker layout under `model.diffusion_model.` (every Linear e4m3 + a float32 scale_weight, a
    REPA head beside them): the 48 block Linears keep the file's codes and scales bit for bit, the kept ones
    (embedders, final layer, shared modulations) hold codes * scale exactly, and the output is the dequantized
    model's; against the bf16 model (the same weights as a bf16 file, float32 compute) it is 3.3e-2 off
    (one scale per tensor; the bf16 model is 2.0e-3 from the float32 one)."""
    model = tiny_flow_map()
    stored = fp8_file({k: v.detach() for k, v in model.state_dict().items()}, "comfy_marker")
    save_file({k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}, tmp_path / "bf16.safetensors")
    repa = {"repa_projectors.0.weight": torch.ones(4, 4).to(E4M3), "repa_projectors.0.scale_weight": torch.ones(())}
    save_file({PREFIX + k: v for k, v in (stored | repa).items()}, tmp_path / "flux3_fp8_e4m3fn_scaled.safetensors")
    with pytest.warns(UserWarning, match="widened"):
        loaded = load_flux3(str(tmp_path / "flux3_fp8_e4m3fn_scaled.safetensors")).eval()

    kept, quantized = kept_and_quantized(model)
    assert len(quantized) == 3 * 2 * 6 + 2 * 6 and len(kept) == 15  # 3 modes x 2 blocks, 2 single
    for name in quantized:
        layer = loaded.get_submodule(name)
        assert isinstance(layer, FP8Linear) and layer.mode == "fp8_tensor_scaled", name
        assert torch.equal(layer.weight.view(torch.uint8), stored[f"{name}.weight"].view(torch.uint8)), name
        assert torch.equal(layer.weight_scale, stored[f"{name}.scale_weight"]), name
    dequantized = fp8_dequantized(stored)
    for name in kept:
        assert type(loaded.get_submodule(name)) is nn.Linear, name
        assert torch.equal(loaded.get_submodule(name).weight, dequantized[f"{name}.weight"]), name
    twin = Flux3Transformer(model.config)
    twin.load_state_dict(dequantized, strict=True)
    x = inputs(flow_map=True, references=True)
    assert relative_error(loaded, twin.eval(), x) == 0.0
    error = relative_error(loaded, load_flux3(str(tmp_path / "bf16.safetensors")).eval(), x)
    print(f"FLUX.3 ComfyUI scaled fp8 vs the bf16 model: relative error {error:.2e}")
    assert 0.01 < error < 0.05


def diffusers_named(stored: dict[str, torch.Tensor], config: Flux3Config) -> dict[str, torch.Tensor]:
    """A BFL-named stored file under diffusers' names, as a diffusers-side quantizer would write it: each tensor of
    a Linear renamed with its weight, the final adaLN's rows (and its row-wise scales) in diffusers' order."""
    names = flux3_diffusers_names(config.depth, config.depth_single, config.flow_map)
    rows = stored[f"{FINAL_ADALN_LAYER}.weight"].shape[0]
    out = {}
    for key, tensor in stored.items():
        layer, _, leaf = key.rpartition(".")
        name = names.get(key) or names[f"{layer}.weight"][: -len("weight")] + leaf
        along_rows = layer == FINAL_ADALN_LAYER and tensor.dim() and tensor.shape[0] == rows  # not its JSON, scalars
        out[name] = swap_halves(tensor) if along_rows else tensor
    return out


@pytest.mark.parametrize("layout", ["ours", "comfy_quant"])
def test_a_prequantized_diffusers_folder_loads_as_the_same_bfl_file(tmp_path, layout):
    """Our block scales (the final adaLN's [out, in/64] scales swap with its rows) and comfy_quant's per-tensor
    ones: the diffusers folder loads to the very tensors and output of the BFL file."""
    model = tiny_flow_map()
    stored = fp8_file({k: v.detach() for k, v in model.state_dict().items()}, layout)
    save_file(stored, tmp_path / "bfl.safetensors")
    save_diffusers_folder(diffusers_named(stored, model.config), diffusers_config(model.config),
                          str(tmp_path / "transformer"))
    with pytest.warns(UserWarning, match="widened"):
        bfl, folder = load_flux3(str(tmp_path / "bfl.safetensors")), load_flux3(str(tmp_path))
    expected_mode = {"ours": "fp8_scaled", "comfy_quant": "fp8_tensor_scaled"}[layout]
    assert {m.mode for m in folder.modules() if isinstance(m, FP8Linear)} == {expected_mode}
    ours, theirs = bfl.state_dict(), folder.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k].view(torch.uint8) if ours[k].dtype == E4M3 else ours[k],
                           theirs[k].view(torch.uint8) if theirs[k].dtype == E4M3 else theirs[k]) for k in ours)
    x = inputs(flow_map=True, references=True)
    with torch.no_grad():
        assert torch.equal(bfl.eval()(**x), folder.eval()(**x))


def test_a_diffusers_named_gguf_loads_as_the_bfl_one(tmp_path):
    """ComfyUI-GGUF's blocks in either naming (the same types per Linear): the final adaLN's Q5_1 rows swap whole."""
    model = tiny_flow_map()
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    types = gguf_types(sd)
    names = flux3_diffusers_names(model.config.depth, model.config.depth_single, model.config.flow_map)
    bfl = load_flux3(write_gguf(sd, tmp_path / "bfl.gguf", types))
    theirs = {names[k]: swap_halves(v) if k.startswith(FINAL_ADALN_LAYER) else v for k, v in sd.items()}
    folder = load_flux3(write_gguf(theirs, tmp_path / "diffusers.gguf", {names[k]: t for k, t in types.items()}))
    assert types[f"{FINAL_ADALN_LAYER}.weight"] == "Q5_1"
    assert {m.qtype for m in folder.modules() if isinstance(m, GGUFLinear)} == {"Q8_0", "Q5_1"}
    x = inputs(flow_map=True, references=True)
    with torch.no_grad():
        assert torch.equal(bfl.eval()(**x), folder.eval()(**x))


def test_a_broken_fp8_layout_is_one_line_naming_the_key(tmp_path):
    stored = fp8_file({k: v.detach() for k, v in tiny_flow_map().state_dict().items()}, "comfy_marker")
    cases = {  # what is broken -> the line it gives
        "e5m2": ("single_blocks.0.q_proj.weight", lambda t: t.to(torch.float8_e5m2),
                 f"'{PREFIX}single_blocks.0.q_proj.weight' is float8_e5m2 beside float8_e4m3fn codes"),
        "rows": ("txt_mode_blocks.1.mlp_out.scale_weight", lambda t: t.repeat(64),
                 f"'{PREFIX}txt_mode_blocks.1.mlp_out.scale_weight' has shape (64,); ComfyUI's scaled fp8 stores one "
                 f"float32 scale per tensor"),
    }
    for case, (key, broken, message) in cases.items():
        path = tmp_path / f"{case}.safetensors"
        save_file({PREFIX + k: broken(v) if k == key else v for k, v in stored.items()}, path)
        with pytest.raises(CheckpointError) as error:
            load_flux3(str(path))
        assert message in str(error.value) and "\n" not in str(error.value), str(error.value)

    ours = fp8_file({k: v.detach() for k, v in tiny_flow_map().state_dict().items()}, "ours")
    names = diffusers_named(ours, tiny_config(flow_map=True))
    names["mode_blocks.image.0.attn.to_q.weight_scale"] = torch.ones(64, 2, dtype=torch.bfloat16)
    save_diffusers_folder(names, diffusers_config(tiny_config(flow_map=True)), str(tmp_path / "transformer"))
    with pytest.raises(CheckpointError, match=r"'mode_blocks\.image\.0\.attn\.to_q\.weight_scale' has shape \(64, 2\), "
                                              r"not the fp8_scaled block scales \(64, 1\)"):
        load_flux3(str(tmp_path))


# ----------------------------------------------------------------------------------------------
# The keep rule for the shared stream modulations (spec.py FP8)


def test_fp8_keeping_shared_modulation_pays():
    """The measurement behind the flux3 spec's SHARED_MODULATION fp8 rule, one seed: keeping the six shared stream
    modulation Linears in high precision cuts fp8_scaled's error by more than the memory it adds."""
    errors = {keep: shared_modulation_error(keep) for keep in (False, True)}
    error_saved = 1 - errors[True] / errors[False]
    share = 18 * 3072**2 / 5_538_458_368  # 6 Linears [3h, h] of the released base (tests/test_flux3_model RELEASED)
    scaled_bytes = 1 + 2 / 64
    memory_added = share * (2 - scaled_bytes) / scaled_bytes
    print(f"fp8_scaled update error {errors[False]:.4f} quantized, {errors[True]:.4f} kept: -{error_saved:.1%} "
          f"for +{memory_added:.1%} memory")
    assert error_saved > memory_added


def shared_modulation_error(keep: bool, seed: int = 0) -> float:
    """Relative error of the blocks' residual update (last single block out - the per-mode blocks' inputs) of a
    width-256 FLUX.3 (1 per-mode block, 2 single blocks) with weights N(0, 0.02), fp8_scaled vs fp32."""
    torch.manual_seed(seed)
    config = Flux3Config(in_channels=128, cond_in_channels=128, context_in_dim=96, hidden_size=256, num_heads=2,
                         depth=1, depth_single=2, axes_dim=(32, 32, 32, 32))
    model = Flux3Transformer(config)
    with torch.no_grad():
        for name, p in model.named_parameters():  # the time embedder scaled so that the modulation is O(1)
            std = p.shape[-1] ** -0.5 if name.startswith("time_in") else 0.02
            p.copy_(1 + 0.1 * torch.randn(p.shape) if p.dim() == 1 else std * torch.randn(p.shape))
    x = dict(img=torch.randn(2, 24, 128), img_ids=make_img_ids(2, 4, 6), txt=torch.randn(2, 8, 96),
             txt_ids=make_txt_ids(2, 8), timesteps=torch.tensor([0.6, 0.6]))
    reference = residual_update(model, x)
    rules = arch_spec("flux3").fp8
    if not keep:
        rules = dataclasses.replace(rules, keep=tuple(p for p in rules.keep if p not in SHARED_MODULATION))
    fp8.quantize_module(model, "fp8_scaled", rules)
    return ((residual_update(model, x) - reference).norm() / reference.norm()).item()


def residual_update(model: Flux3Transformer, x: dict) -> torch.Tensor:
    """[txt, image] after the last single block minus the same streams as they enter their per-mode blocks."""
    seen = {}  # (the hooks return None: a returned value would replace the block's input / output)
    hooks = [
        model.txt_mode_blocks[0].register_forward_pre_hook(lambda m, a: seen.update(txt=a[0])),
        model.content_mode_blocks["image"][0].register_forward_pre_hook(lambda m, a: seen.update(image=a[0])),
        model.single_blocks[-1].register_forward_hook(lambda m, a, out: seen.update(output=torch.cat(out, 1))),
    ]
    with torch.no_grad():
        model(**x)
    for hook in hooks:
        hook.remove()
    return seen["output"] - torch.cat((seen["txt"], seen["image"]), 1)
