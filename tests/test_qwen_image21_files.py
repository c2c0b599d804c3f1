"""Pre-quantized Qwen-Image-2.1 transformer files in the ComfyUI layout (prefix, fused img_mlp.gate_up),
loaded as stored (precision/stored_layouts.py): ComfyUI's scaled fp8, our fp8_scaled block scales and
city96's ComfyUI-GGUF blocks. The oracle is a plain float32 model holding the file's tensors dequantized as
ComfyUI computes them, the fused gate_up dequantized whole and only then split (so a scale given to the
wrong rows shows); forward outputs compared exactly (max abs diff 0.0)."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from library.models.qwen_image21.checkpoint import CONFIG_KEY, load_qwen_image21
from library.models.qwen_image21.model import QwenImage21
from library.precision.fp8 import FP8Linear
from library.precision.gguf_weights import GGUFLinear
from library.io import CheckpointReader
from tests.test_gguf import write_gguf
from tests.test_prequantized_families import fp8_dequantized, fp8_file, gguf_dequantized, gguf_types

PREFIX = "model.diffusion_model."
GATE_UP = "transformer_blocks.1.img_mlp.gate_up"


def comfy_source(tiny_set):
    """The tiny ComfyUI file's float32 tensors (no prefix, gate_up fused) and its config metadata."""
    path = tiny_set["qwen_image21_comfy"]
    sd = {k[len(PREFIX):]: v.float() for k, v in load_file(path).items()}
    return sd, {CONFIG_KEY: CheckpointReader(path).metadata[CONFIG_KEY]}


def twin(config, dequantized: dict[str, torch.Tensor]) -> QwenImage21:
    """A plain float32 model holding the dequantized file, each fused gate_up split only now."""
    sd = {}
    for key, value in dequantized.items():
        if key.endswith("img_mlp.gate_up.weight"):
            stem = key[: -len("gate_up.weight")]
            sd[stem + "gate_layer.weight"], sd[stem + "proj.weight"] = value.chunk(2, dim=0)
        else:
            sd[key] = value
    model = QwenImage21(config)
    model.load_state_dict(sd, strict=True)
    return model.eval()


@torch.no_grad()
def output(model):
    g = torch.Generator().manual_seed(3)
    txt, img = torch.randn(1, 6, 32, generator=g), torch.randn(1, 12, 64, generator=g)
    return model(img, txt, torch.tensor([0.6]), 3, 4)


@pytest.mark.parametrize("layout,mode", [("comfy_marker", "fp8_tensor_scaled"), ("ours", "fp8_scaled")])
def test_fp8_files_load_as_stored_and_compute_as_their_dequantized_twin(tiny_set, tmp_path, layout, mode):
    sd, metadata = comfy_source(tiny_set)
    stored = fp8_file(sd, layout)
    path = tmp_path / f"{layout}.safetensors"
    save_file({PREFIX + k: v for k, v in stored.items()}, str(path), metadata=metadata)
    with pytest.warns(UserWarning, match="widened"):  # ComfyUI's fp8 embedders / outputs: kept high precision here
        model = load_qwen_image21(str(path)).eval()
    layers = {n: m for n, m in model.named_modules() if isinstance(m, FP8Linear)}
    assert layers and {m.mode for m in layers.values()} == {mode}
    fused = stored[GATE_UP + ".weight"]
    half = fused.shape[0] // 2
    assert torch.equal(layers["transformer_blocks.1.img_mlp.proj"].weight.view(torch.uint8), fused[half:].view(torch.uint8))
    diff = (output(model) - output(twin(model.config, fp8_dequantized(stored)))).abs().max().item()
    print(f"Qwen-Image-2.1 {layout}: max abs diff vs the dequantized float32 twin {diff}")
    assert diff == 0.0


def test_gguf_file_loads_as_stored_and_computes_as_its_dequantized_twin(tiny_set, tmp_path):
    sd, metadata = comfy_source(tiny_set)
    types = gguf_types(sd)
    path = write_gguf(sd, tmp_path / "qi21-tiny.gguf", types, metadata, prefix=PREFIX)
    model = load_qwen_image21(path).eval()
    packed = {n: m for n, m in model.named_modules() if isinstance(m, GGUFLinear)}
    assert {m.qtype for m in packed.values()} == {"Q8_0", "Q5_1"}
    fused = CheckpointReader(path).get(PREFIX + GATE_UP + ".weight")
    half = fused.shape[0] // 2
    assert torch.equal(packed["transformer_blocks.1.img_mlp.gate_layer"].weight, fused[:half])
    diff = (output(model) - output(twin(model.config, gguf_dequantized(path, types, PREFIX)))).abs().max().item()
    print(f"Qwen-Image-2.1 gguf: max abs diff vs gguf's float32 dequantization {diff}")
    assert diff == 0.0
