"""Ideogram 4 files: the released BFL fp8r / nvfp4 layouts read as diffusers reads them (its own
loader with BFLQuantizationConfig is the oracle), the diffusers folder and the original single file
(fused qkv, prefixes), meta loading, one-line errors, and gradients through the stored base."""

import json
import os

import pytest
import torch
from accelerate.utils import set_module_tensor_to_device
from diffusers import BFLQuantizationConfig, Ideogram4Transformer2DModel
from diffusers.quantizers.bfl.bfl_quantizer import BFLQuantizer
from diffusers.quantizers.bfl.utils import _replace_with_bfl_linear
from safetensors.torch import load_file, save_file

from library.io import CheckpointError
from library.models.family import fp8_prepare
from library.models.ideogram4.checkpoint import load_ideogram4, save_ideogram4_diffusers
from library.models.ideogram4.tiny import original_state_dict, random_ideogram4, stored_state_dict, tiny_config, \
    write_single_file
from library.precision.bfl_weights import BFLLinear

from tests.test_ideogram4 import diffusers_velocity, inputs

LAYOUTS = ("fp32", "fp8r", "nvfp4")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """layout -> a diffusers transformer folder of one random tiny model."""
    root, model = tmp_path_factory.mktemp("ideogram4"), random_ideogram4(tiny_config())
    out = {}
    for layout in LAYOUTS:
        out[layout] = str(root / layout / "transformer")
        save_ideogram4_diffusers(stored_state_dict(model, layout), tiny_config(), out[layout])
    out["model"] = model
    return out


def reference(folder: str, layout: str):
    """diffusers' model with the folder's tensors as diffusers' BFL quantizer loads them: its
    maybe_update_state_dict (the layout checks), its BFLFP8RLinear / BFLNVFP4Linear swapped in and
    filled by create_quantized_param. (Its from_pretrained cannot take the BFL config in 0.42.1: it
    json-dumps the torch dtype, then passes no state dict to the swap; and no single-file mapping
    exists for Ideogram 4, so this is the loader's own code path, called step by step.)"""
    if layout == "fp32":
        return Ideogram4Transformer2DModel.from_pretrained(folder).eval()
    with open(os.path.join(folder, "config.json")) as f:
        model = Ideogram4Transformer2DModel(**{k: v for k, v in json.load(f).items() if not k.startswith("_")})
    quantizer = BFLQuantizer(BFLQuantizationConfig(compute_dtype=torch.float32))
    sd = quantizer.maybe_update_state_dict(load_file(os.path.join(folder, "diffusion_pytorch_model.safetensors")))
    _replace_with_bfl_linear(model, torch.float32, sd)
    for key, value in sd.items():
        if quantizer.check_if_quantized_param(model, value, key, sd):
            quantizer.create_quantized_param(model, value, key, torch.device("cpu"), sd)
        else:
            set_module_tensor_to_device(model, key, "cpu", value=value)
    return model.eval()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_stored_layouts_match_diffusers_loader(folders, layout):
    model = load_ideogram4(folders[layout])
    assert model.stored_layout == (None if layout == "fp32" else f"bfl_{layout}")
    quantized = [m for m in model.modules() if isinstance(m, BFLLinear)]
    assert len(quantized) == (0 if layout == "fp32" else 2 * 8)  # q, k, v, out, w1, w2, w3, adaln per block
    grid, lengths = (3, 5), (7, 4)
    img, txt, mask, sigmas = inputs(*grid, lengths)
    expected = diffusers_velocity(reference(folders[layout], layout), img, txt, mask, sigmas, *grid)
    with torch.no_grad():
        out = model(img, txt, sigmas, *grid, txt_mask=mask)
    diff = (out - expected).abs().max().item()
    print(f"Ideogram 4 {layout} file vs diffusers' loader: max abs diff {diff:.2e}")
    assert diff == 0.0  # the same dequantization, then the same float32 model


@pytest.mark.parametrize("precision, quantized_class", [("fp8_scaled", "FP8Linear"), ("nf4", "NF4Linear"),
                                                      ("int8", "Int8Linear")])
def test_float_file_quantizes_while_loading_close_to_bf16(folders, precision, quantized_class):
    """A float file under a quantized base precision: its keys are the float model's, checked before
    prepare adds scale / absmax tensors and packs weights (the old loader checked them after)."""
    model = load_ideogram4(folders["fp32"], dtype=torch.bfloat16, prepare=fp8_prepare(precision, "ideogram4"))
    assert type(model.layers[0].attention.to_q).__name__ == quantized_class
    assert type(model.layers[1].adaln_modulation).__name__ == quantized_class
    reference = load_ideogram4(folders["fp32"], dtype=torch.bfloat16)
    grid, lengths = (3, 5), (7, 4)
    img, txt, mask, sigmas = inputs(*grid, lengths)
    with torch.no_grad():
        out = model(img, txt, sigmas, *grid, txt_mask=mask).float()
        expected = reference(img, txt, sigmas, *grid, txt_mask=mask).float()
    error = ((out - expected).norm() / expected.norm()).item()
    print(f"Ideogram 4 fp32 file loaded as {precision} vs bf16: relative error {error:.4f}")
    assert 1e-4 < error < 0.1


def test_precision_doctor_runs_on_a_float_file(folders, tmp_path, capsys):
    from tools import precision_doctor as doctor

    rc = doctor.main(["--model_type", "ideogram4", "--model", folders["fp32"], "--resolution", "64",
                      "--timesteps", "0.5", "--text_len", "4", "--out", str(tmp_path / "r"), "--skip_fp32",
                      "--device", "cpu"])
    assert rc == 0, capsys.readouterr().err
    assert "fp8_scaled" in json.loads((tmp_path / "r" / "report.json").read_text())["modes"]


def test_bf16_compute_keeps_stored_dtypes(folders):
    model = load_ideogram4(folders["nvfp4"], dtype=torch.bfloat16)
    layer = model.layers[0].attention.to_q
    assert layer.weight.dtype == torch.uint8 and layer.weight_scale.dtype == torch.float8_e4m3fn
    model.to(torch.bfloat16)
    assert layer.weight.dtype == torch.uint8 and layer.weight_scale_2.dtype == torch.float32
    assert model.input_proj.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("prefix", ["conditional_transformer.", "model.diffusion_model."])
def test_original_fused_single_file_equals_split(folders, tmp_path, prefix):
    """q, k, v stored fused (one nvfp4 Linear with one global scale) load as diffusers' split
    converter would give them: each third of the rows with its own block scales."""
    model = folders["model"]
    path = write_single_file(original_state_dict(model, "nvfp4"), str(tmp_path / "ideogram4.safetensors"), prefix)
    ours = load_ideogram4(path, config=tiny_config())
    assert ours.stored_layout == "bfl_nvfp4"
    fused = original_state_dict(model, "nvfp4")
    for i, proj in enumerate(("to_q", "to_k", "to_v")):
        layer = getattr(ours.layers[1].attention, proj)
        assert torch.equal(layer.weight, fused["layers.1.attention.qkv.weight"].chunk(3)[i])
        assert torch.equal(layer.weight_scale.view(torch.uint8),
                           fused["layers.1.attention.qkv.weight_scale"].chunk(3)[i].view(torch.uint8))
        assert torch.equal(layer.weight_scale_2, fused["layers.1.attention.qkv.weight_scale_2"])
    assert torch.equal(ours.layers[0].attention.to_out[0].weight, fused["layers.0.attention.o.weight"])


def test_meta_load_reads_headers_only(folders):
    model = load_ideogram4(folders["nvfp4"], read_weights=False, dtype=torch.bfloat16)
    assert all(t.device.type == "meta" for t in model.state_dict().values())
    assert model.stored_layout == "bfl_nvfp4" and isinstance(model.layers[0].feed_forward.w1, BFLLinear)


def _rewrite(folder, tmp_path, edit):
    sd = load_file(os.path.join(folder, "diffusion_pytorch_model.safetensors"))
    edit(sd)
    out = tmp_path / "bad"
    out.mkdir()
    save_file(sd, str(out / "diffusion_pytorch_model.safetensors"))
    with open(os.path.join(folder, "config.json")) as f:
        (out / "config.json").write_text(f.read())
    return str(out)


def test_wrong_files_are_one_line_naming_the_key(folders, tmp_path):
    bad = _rewrite(folders["nvfp4"], tmp_path, lambda sd: sd.pop("layers.1.feed_forward.w2.input_scale"))
    with pytest.raises(CheckpointError, match=r"'layers\.1\.feed_forward\.w2' has weight_scale_2 but no input_scale"):
        load_ideogram4(bad)
    (tmp_path / "bad2").mkdir()
    sd = load_file(os.path.join(folders["fp8r"], "diffusion_pytorch_model.safetensors"))
    sd["layers.0.attention.to_k.weight"] = sd["layers.0.attention.to_k.weight"].to(torch.bfloat16)
    save_file(sd, str(tmp_path / "bad2" / "x.safetensors"))
    with pytest.raises(CheckpointError, match=r"'layers\.0\.attention\.to_k\.weight' is BF16, but the fp8r layout"):
        load_ideogram4(str(tmp_path / "bad2" / "x.safetensors"), config=tiny_config())
    save_file({"foo.weight": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(CheckpointError, match="not an Ideogram 4 transformer"):
        load_ideogram4(str(tmp_path / "other.safetensors"))


def test_gradients_reach_the_input_not_the_stored_base(folders):
    model = load_ideogram4(folders["nvfp4"])
    layer = model.layers[0].adaln_modulation  # a quantized Linear with a bias
    x = torch.randn(3, layer.in_features, requires_grad=True)
    layer(x).square().sum().backward()
    w = layer.dequantized_weight(torch.float32)
    expected = (2 * (x.detach() @ w.T + layer.bias.detach())) @ w
    assert torch.allclose(x.grad, expected, rtol=1e-5, atol=1e-5)
    assert not any(t.requires_grad for t in layer.state_dict(keep_vars=True).values())
