"""merge_lora --save_precision gguf_*: the merged transformer as one GGUF file in ComfyUI-GGUF's
layout (library/precision/gguf_writer.py), checked by reading it back with `gguf`'s own GGUFReader
(architecture, types, every tensor's bytes = gguf's quantization of the float32 merge) and with our
loader (GGUFLinear layers computing close to the float32 merge); bases it cannot write are one line."""

import json

import gguf
import numpy as np
import pytest
import torch

from library.io import CheckpointReader
from library.models.flux1.checkpoint import load_flux
from library.models.registry import arch_spec
from library.precision.fp8 import is_high_precision
from library.precision.gguf_weights import GGUFLinear
from library.precision.gguf_writer import SMALL, WRITE_TYPES
from tests.test_gguf import flux_inputs_for
from tests.test_merge_convert import lora, merge, run
from tests.test_reliability import one_error_line
from tools import merge_lora


def test_the_command_line_names_the_types_gguf_writes():
    assert merge_lora.GGUF_PRECISIONS == tuple(f"gguf_{t.lower()}" for t in WRITE_TYPES)


def expected_type(name: str, shape: tuple, qtype: str) -> str:
    """ComfyUI-GGUF's rules, spelled out: F32 for 1-D / small, the block type for the FLUX.1 Linears its
    llama.cpp patch quantizes (every 2-D weight but txt_in, img_in, time_in, vector_in, guidance_in,
    final_layer), F16 for the rest of an fp32 source."""
    if len(shape) == 1 or int(np.prod(shape)) <= SMALL:
        return "F32"
    kept = ("txt_in.", "img_in.", "time_in.", "vector_in.", "guidance_in.", "final_layer.")
    return "F16" if name.startswith(kept) or not name.endswith(".weight") else qtype


@pytest.fixture(scope="module")
def merged(tiny_set, tmp_path_factory):
    """The tiny FLUX.1 (fp32 file) + a random LoRA: the fp32 merge (the oracle) and its LoRA file."""
    root = tmp_path_factory.mktemp("merge_gguf")
    net = lora(load_flux(tiny_set["flux_bfl"]), "flux", rank=4, alpha=4.0, seed=1)
    net.save(str(root / "l.safetensors"))
    assert merge("--model", tiny_set["flux_bfl"], "--lora", root / "l.safetensors", "--save_to", root / "m.safetensors",
                 "--save_precision", "fp32") == 0
    return root


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_merge_writes_comfyui_ggufs_layout_and_reads_back(tiny_set, merged, qtype, capsys):
    out = merged / f"m-{qtype}.gguf"
    capsys.readouterr()
    assert merge("--model", tiny_set["flux_bfl"], "--lora", merged / "l.safetensors", "--save_to", out,
                 "--save_precision", f"gguf_{qtype.lower()}") == 0
    assert f"({'gguf_' + qtype.lower()})" in capsys.readouterr().out
    oracle, source = CheckpointReader(str(merged / "m.safetensors")), CheckpointReader(tiny_set["flux_bfl"])
    reader = gguf.GGUFReader(str(out))
    field = lambda key: reader.get_field(key).contents()  # noqa: E731
    assert field("general.architecture") == arch_spec("flux").gguf_arch == "flux"
    assert field("general.file_type") == gguf.LlamaFileType[f"MOSTLY_{qtype}"]
    assert field("flux_config") == source.metadata["flux_config"] and json.loads(field("merged_loras"))[0]["file"] == "l.safetensors"
    tensors = {t.name: t for t in reader.tensors}
    assert sorted(tensors) == sorted(source.keys())  # no prefix, nothing left out or added
    counts = {}
    for name, t in tensors.items():
        shape = tuple(reversed(t.shape.tolist()))  # ggml: innermost first
        assert shape == oracle.shape(name)
        kind = expected_type(name, shape, qtype)
        assert t.tensor_type.name == kind, name
        counts[kind] = counts.get(kind, 0) + 1
        # the bytes are gguf's own encoding of the float32 merge
        want = gguf.quants.quantize(oracle.get(name).numpy(), gguf.GGMLQuantizationType[kind])
        assert np.array_equal(np.asarray(t.data).view(np.uint8).reshape(-1), want.view(np.uint8).reshape(-1)), name
    assert counts[qtype] > 10 and counts["F32"] > 10 and counts.get("F16", 0) >= 1
    # our loader: the file's blocks as GGUFLinear, computing close to the float32 merge
    model, reference = load_flux(str(out)).eval(), load_flux(str(merged / "m.safetensors")).eval()
    layers = [m for m in model.modules() if isinstance(m, GGUFLinear)]
    assert len(layers) == counts[qtype] and {m.qtype for m in layers} == {qtype}
    inputs = flux_inputs_for(model)
    ours, want = run(model, inputs), run(reference, inputs)
    relative = ((ours - want).norm() / want.norm()).item()
    assert 0 < relative < {"Q8_0": 0.01, "Q4_0": 0.2}[qtype], relative


def test_the_type_rules_follow_the_architectures_keep_rules():
    from library.precision.gguf_writer import output_type

    rules = arch_spec("flux").fp8
    assert is_high_precision("final_layer.linear", rules)
    assert output_type("final_layer.linear", (64, 3072), "BF16", "Q8_0", rules) == "BF16"  # kept, bf16 source
    assert output_type("double_blocks.0.img_mod.lin", (18432, 3072), "BF16", "Q8_0", rules) == "Q8_0"  # modulation too
    assert output_type("double_blocks.0.img_mlp.0", (12288, 3072), "F16", "Q4_1", rules) == "Q4_1"
    assert output_type("double_blocks.0.img_mlp.0", (1000, 48), "F32", "Q8_0", rules) == "F16"  # 48 inputs: no blocks of 32
    assert output_type(None, (3072,), "BF16", "Q8_0", rules) == "F32"
    with pytest.raises(ValueError, match="GGUF type Q4_K: only Q8_0, Q5_1, Q5_0, Q4_1, Q4_0 can be written"):
        output_type("double_blocks.0.img_mlp.0", (12288, 3072), "BF16", "Q4_K", rules)


def test_bases_it_cannot_write_are_one_line(tiny_set, merged, tmp_path, capsys):
    capsys.readouterr()
    line = one_error_line(capsys, merge("--model", tiny_set["flux_diffusers"], "--lora", merged / "l.safetensors",
                                        "--save_to", tmp_path / "x", "--save_precision", "gguf_q8_0"))
    assert "GGUF is written from a single file in the names ComfyUI-GGUF reads" in line, line
    line = one_error_line(capsys, merge("--model", tiny_set["flux_bfl"], "--lora", merged / "l.safetensors",
                                        "--save_to", tmp_path / "x.gguf", "--save_precision", "gguf_q8_0", "--fp8_layout", "comfy"))
    assert "--fp8_layout and --stochastic_rounding are for fp8 outputs" in line, line
    assert not list(tmp_path.iterdir())
