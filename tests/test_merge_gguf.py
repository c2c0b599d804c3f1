"""merge_lora --save_precision gguf_*: the merged transformer as one GGUF file in ComfyUI-GGUF's
layout (library/precision/gguf_writer.py), checked by reading it back with `gguf`'s own GGUFReader
(architecture, types, every tensor's bytes = gguf's quantization of the float32 merge) and with our
loader (GGUFLinear layers computing close to the float32 merge); bases it cannot write are one line."""

import json
import subprocess
import types

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from library.io import CheckpointReader
from library.models.flux1.checkpoint import load_flux
from library.models.registry import arch_spec
from library.precision.gguf_weights import GGUFLinear
from library.precision.gguf_writer import SMALL, WRITE_TYPES, convert_type, output_type
from tests.test_gguf import flux_inputs_for
from tests.test_merge_convert import lora, merge, run
from tests.test_reliability import one_error_line
from tools import merge_lora


def test_the_command_line_names_the_types_gguf_writes():
    assert merge_lora.GGUF_PRECISIONS == tuple(f"gguf_{t.lower()}" for t in WRITE_TYPES)


CITY96_MIRROR = "/work/.mirror/city96+ComfyUI-GGUF/repo"  # where `fetch github:city96/ComfyUI-GGUF` puts it
# city96's rules, spelled out here apart from gguf_writer (ComfyUI-GGUF's auto_convert branch at 4dfc025, the one
# with FLUX.2 and Z-Image support; `fetch github:city96/ComfyUI-GGUF`): tools/convert.py:308-320 from an F32 / BF16
# source keeps 1-D tensors, tensors of <= QUANTIZATION_THRESHOLD (1024, :10) elements and keys_hiprec (:152-156
# lumina2's pad tokens, none for flux) F32, the rest BF16 / F16; any other source F16. Then the llama.cpp patch
# quantizes a tensor whose name ends in "weight" (llama.cpp's own rule, as "_norm.weight" is kept), of 2 ggml dims
# (tools/lcpp.patch:497), not named by its arch's list (:377-388 flux with FLUX.2's shared modulation, :474-486
# lumina2), with img_tensor_get_type's ffn rule (:198-231: ".feed_forward.w2.weight" ... Q4_0 -> Q4_1, Q5_0 -> Q5_1).
CITY96_BRANCH = "auto_convert"
CITY96_UNQUANTIZED = {
    "flux": ("txt_in.", "img_in.", "time_in.", "vector_in.", "guidance_in.", "final_layer.",
             "single_stream_modulation.", "double_stream_modulation_"),
    "lumina2": ("t_embedder.", "x_embedder.", "final_layer.", "cap_embedder.", "context_refiner.", "noise_refiner."),
    "sd3": ("final_layer.", "time_text_embed.", "context_embedder.", "t_embedder.", "y_embedder.", "x_embedder.",
            "proj_out.weight", "pos_embed"),
    # :456-464 LLM_ARCH_HIDREAM
    "hidream": ("p_embedder.", "t_embedder.", "x_embedder.", "final_layer.", ".ff_i.gate.weight",
                "caption_projection."),
}
CITY96_HIPREC = {"flux": (), "lumina2": ("x_pad_token", "cap_pad_token"), "sd3": (),
                 "hidream": (".ff_i.gate.weight", "img_emb.emb_pos")}  # :56-60 ModelHiDream
# convert.py's detect_arch (keys_detect: :26-29 ModelFlux, :34-40 ModelSD3, :149-151 ModelLumina2) and loader.py:12
# IMG_ARCH_LIST
CITY96_DETECT = {"flux": ("double_blocks.0.img_attn.proj.weight",),
                 "lumina2": ("cap_embedder.1.weight", "context_refiner.0.attention.qkv.weight"),
                 "sd3": ("joint_blocks.0.x_block.attn.qkv.weight",),
                 "hidream": ("caption_projection.0.linear.weight",
                             "double_stream_blocks.0.block.ff_i.shared_experts.w3.weight")}  # :48-55 ModelHiDream
COMFYUI_GGUF_IMG_ARCHS = {"flux", "sd1", "sdxl", "sd3", "aura", "hidream", "cosmos", "ltxv", "hyvid", "wan", "lumina2",
                          "qwen_image"}
SAI_PREFIX = "model.diffusion_model."  # SAI's single files' (convert.py strips it before detecting the arch)
# family -> (its tiny single file, ComfyUI-GGUF's arch for it)
CITY96_FAMILIES = {"flux": ("flux_bfl", "flux"), "chroma": ("chroma_bfl", "flux"), "flux2": ("flux2_tiny", "flux"),
                   "zimage": ("zimage", "lumina2"), "lumina2": ("lumina2", "lumina2"), "sd3": ("sd3", "sd3"),
                   "hidream": ("hidream", "hidream")}


def city96_type(name: str, shape: tuple, source: str, qtype: str, arch: str) -> str:
    numel = int(np.prod(shape))
    hiprec = len(shape) == 1 or numel <= SMALL or any(k in name for k in CITY96_HIPREC[arch])
    converted = ("F32" if hiprec else "BF16" if source == "BF16" else "F16") if source in ("F32", "BF16") else "F16"
    dims = len(shape) - next((i for i, n in enumerate(shape) if n != 1), len(shape) - 1)
    if not name.endswith("weight") or "_norm.weight" in name or dims != 2 or any(k in name for k in CITY96_UNQUANTIZED[arch]):
        return converted
    if name.endswith((".feed_forward.w2.weight", ".ff.net.2.weight", ".ffn.2.weight", ".mlp.layer2.weight")):
        qtype = {"Q4_0": "Q4_1", "Q5_0": "Q5_1"}.get(qtype, qtype)
    return qtype if shape[-1] % 32 == 0 else converted


def expected_type(name: str, shape: tuple, qtype: str) -> str:
    return city96_type(name, shape, "F32", qtype, "flux")


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
    assert field("general.architecture") == arch_spec("flux").gguf.arch == "flux"
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


@pytest.mark.parametrize("family", list(CITY96_FAMILIES))
def test_each_familys_tensor_types_are_what_city96s_tools_write(tiny_set, family):
    """Every tensor of the family's tiny single file, from an F32 / BF16 / F16 source, at each type
    we write: our type is city96's (convert.py, then the quantize patch); the arch is what convert.py
    detects from the keys and what ComfyUI-GGUF's loader accepts."""
    key, arch = CITY96_FAMILIES[family]
    layout, reader = arch_spec(family).gguf, CheckpointReader(tiny_set[key])
    names = {k.removeprefix(SAI_PREFIX): k for k in reader.keys()}  # convert.py's strip_prefix (SAI's files)
    assert layout.arch == arch and arch in COMFYUI_GGUF_IMG_ARCHS and set(CITY96_DETECT[arch]) <= set(names)
    seen = set()
    for name, key in names.items():
        shape = tuple(reader.shape(key))
        for source in ("F32", "BF16", "F16"):
            for qtype in WRITE_TYPES:
                got = output_type(name, shape, source, qtype, layout)
                assert got == city96_type(name, shape, source, qtype, arch), (name, shape, source, qtype, got)
                seen.add(got)
    assert {"F32", "F16", "BF16", *WRITE_TYPES} <= seen


def city96_convert_py():
    """ComfyUI-GGUF's tools/convert.py as a module (it imports gguf, torch, tqdm, safetensors: no ComfyUI),
    from the mirror `fetch github:city96/ComfyUI-GGUF` leaves; None where there is none."""
    try:
        text = subprocess.run(["git", "--git-dir", CITY96_MIRROR, "show", f"{CITY96_BRANCH}:tools/convert.py"],
                              capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    module = types.ModuleType("city96_convert")
    exec(compile(text, "city96/ComfyUI-GGUF/tools/convert.py", "exec"), module.__dict__)
    return module


@pytest.mark.parametrize("family", list(CITY96_FAMILIES))
def test_convert_py_itself_gives_our_float_types_and_arch(tiny_set, family):
    """Step 1 run by city96's own code: detect_arch on the tiny file's keys and handle_tensors' type of
    every tensor (fp32 and bf16 sources) equal our spec's arch and gguf_writer.convert_type."""
    convert = city96_convert_py()
    if convert is None:
        pytest.skip(f"no ComfyUI-GGUF mirror at {CITY96_MIRROR}")
    sd = convert.strip_prefix(load_file(tiny_set[CITY96_FAMILIES[family][0]]))  # as its load_state_dict
    layout = arch_spec(family).gguf
    template = convert.detect_arch(sd)
    assert template.arch == layout.arch

    class Recorder:
        def __init__(self):
            self.types = {}

        def add_tensor(self, name, data, raw_dtype):
            self.types[name] = raw_dtype.name

    for dtype, source in ((torch.float32, "F32"), (torch.bfloat16, "BF16")):
        writer = Recorder()
        convert.handle_tensors(writer, {k: v.to(dtype) for k, v in sd.items()}, template)
        ours = {k: convert_type(k, tuple(v.shape), source, layout) for k, v in sd.items()}
        assert writer.types == ours


def test_modulation_and_guidance_layers_are_quantized_as_city96_quantizes_them():
    """Chroma's distilled_guidance_layer: "flux" to convert.py, whose patch keeps only the embedders, the final
    layer and (auto_convert's "Flux2 specific filter") FLUX.2's shared modulation Linears, which stay BF16."""
    shape = (3072 * 6, 3072)  # FLUX.2 [klein] 4B's double_stream_modulation_img.lin
    assert output_type("double_stream_modulation_img.lin.weight", shape, "BF16", "Q4_0", arch_spec("flux2").gguf) == "BF16"
    assert output_type("double_stream_modulation_txt.lin.weight", shape, "F32", "Q8_0", arch_spec("flux2").gguf) == "F16"
    assert output_type("single_stream_modulation.lin.weight", (9216, 3072), "BF16", "Q8_0", arch_spec("flux2").gguf) == "BF16"
    assert output_type("double_blocks.0.img_mlp.0.weight", (18432, 3072), "BF16", "Q8_0", arch_spec("flux2").gguf) == "Q8_0"
    assert output_type("distilled_guidance_layer.layers.0.in_layer.weight", (5120, 5120), "BF16", "Q5_1",
                       arch_spec("chroma").gguf) == "Q5_1"
    assert output_type("final_layer.linear.weight", (64, 3072), "BF16", "Q8_0", arch_spec("chroma").gguf) == "BF16"
    assert output_type("img_in.weight", (3072, 128), "F16", "Q8_0", arch_spec("flux2").gguf) == "F16"
    # Z-Image as "lumina2": its refiner blocks stay high precision, its SwiGLU output takes Q4_1 at Q4_0
    assert output_type("noise_refiner.0.attention.qkv.weight", (11520, 3840), "BF16", "Q4_0", arch_spec("zimage").gguf) == "BF16"
    assert output_type("layers.3.feed_forward.w2.weight", (3840, 10240), "BF16", "Q4_0", arch_spec("zimage").gguf) == "Q4_1"
    assert output_type("layers.3.feed_forward.w1.weight", (10240, 3840), "BF16", "Q4_0", arch_spec("zimage").gguf) == "Q4_0"
    # Qwen-Image's MLP output: the ffn rule's step up (auto_convert tools/lcpp.patch:206-207)
    qwen = arch_spec("qwen_image").gguf
    assert output_type("transformer_blocks.0.img_mlp.net.2.weight", (3072, 12288), "BF16", "Q4_0", qwen) == "Q4_1"
    assert output_type("transformer_blocks.59.txt_mlp.net.2.weight", (3072, 12288), "BF16", "Q5_0", qwen) == "Q5_1"
    assert output_type("transformer_blocks.0.img_mlp.net.0.proj.weight", (12288, 3072), "BF16", "Q4_0", qwen) == "Q4_0"
    # Z-Image's [1, 3840] pad tokens: F32 (keys_hiprec), as ComfyUI-GGUF reads BF16 as floats only when 1-D
    for name in ("x_pad_token", "cap_pad_token"):
        assert output_type(name, (1, 3840), "BF16", "Q8_0", arch_spec("zimage").gguf) == "F32"
    with pytest.raises(ValueError, match="GGUF type Q4_K: only Q8_0, Q5_1, Q5_0, Q4_1, Q4_0 can be written"):
        output_type("double_blocks.0.img_mlp.0.weight", (12288, 3072), "BF16", "Q4_K", arch_spec("flux").gguf)


def test_bases_it_cannot_write_are_one_line(tiny_set, merged, tmp_path, capsys):
    capsys.readouterr()
    line = one_error_line(capsys, merge("--model", tiny_set["flux_diffusers"], "--lora", merged / "l.safetensors",
                                        "--save_to", tmp_path / "x", "--save_precision", "gguf_q8_0"))
    assert "GGUF is written from a single file in the names ComfyUI-GGUF reads" in line, line
    line = one_error_line(capsys, merge("--model", tiny_set["flux_bfl"], "--lora", merged / "l.safetensors",
                                        "--save_to", tmp_path / "x.gguf", "--save_precision", "gguf_q8_0", "--fp8_layout", "comfy"))
    assert "--fp8_layout and --stochastic_rounding are for fp8 outputs" in line, line
    assert not list(tmp_path.iterdir())


def test_a_full_disk_while_writing_a_gguf_is_one_line_naming_the_file(tiny_set, merged, tmp_path, capsys, monkeypatch):
    """numpy's tofile says a short write without its errno: 'error: 69632 requested and 8160 written' named no file
    and no full disk (a 400 KiB tmpfs)."""
    import gguf

    def short_write(self, tensor):
        raise OSError("69632 requested and 8160 written")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", short_write)
    capsys.readouterr()
    out = tmp_path / "m.gguf"
    line = one_error_line(capsys, merge("--model", tiny_set["flux_bfl"], "--lora", merged / "l.safetensors", "--save_to", out,
                                        "--save_precision", "gguf_q8_0"))
    assert line == f"error: {out}: cannot be written, no space left on device (nothing was written)", line
    assert not list(tmp_path.iterdir())


def test_a_zimage_merge_writes_a_lumina2_gguf_that_reads_back_to_its_dequantized_weights(tiny_set, tmp_path, capsys):
    """Z-Image: ComfyUI-GGUF's "lumina2" with the single file's names (fused attention.qkv, x_embedder ...),
    which convert.py detects and the loader accepts; our loader gives back, weight for weight, what gguf
    dequantizes from the file (the fused qkv split into q / k / v after dequantizing), and the model
    computes close to the float32 merge."""
    from library.models.zimage.checkpoint import from_single_file_state_dict, load_zimage
    from tests.test_prequantized_families import output

    base = tiny_set["zimage"]
    lora(load_zimage(base), "zimage", rank=4, alpha=4.0, seed=2).save(str(tmp_path / "z.safetensors"))
    out = tmp_path / "z-Q4_0.gguf"
    assert merge("--model", base, "--lora", tmp_path / "z.safetensors", "--save_to", out, "--save_precision", "gguf_q4_0") == 0
    assert merge("--model", base, "--lora", tmp_path / "z.safetensors", "--save_to", tmp_path / "z.safetensors.m.safetensors",
                 "--save_precision", "fp32") == 0
    reader, source = gguf.GGUFReader(str(out)), CheckpointReader(base)
    assert reader.get_field("general.architecture").contents() == "lumina2" in COMFYUI_GGUF_IMG_ARCHS
    stored = {t.name: t for t in reader.tensors}
    assert sorted(stored) == sorted(source.keys()) and set(CITY96_DETECT["lumina2"]) <= set(stored)
    kinds = {name: t.tensor_type.name for name, t in stored.items()}
    assert kinds == {name: city96_type(name, tuple(source.shape(name)), "F32", "Q4_0", "lumina2") for name in stored}
    assert kinds["layers.0.attention.qkv.weight"] == "Q4_0" and kinds["layers.0.feed_forward.w2.weight"] == "F16"  # 170 inputs
    assert kinds["noise_refiner.0.attention.qkv.weight"] == "F16" and kinds["x_embedder.weight"] == "F16"
    dequantized = {name: torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(np.asarray(t.data), t.tensor_type),
                                                               dtype=np.float32)).reshape(source.shape(name))
                   for name, t in stored.items()}
    model = load_zimage(str(out)).eval()
    packed = {n: m for n, m in model.named_modules() if isinstance(m, GGUFLinear)}
    assert {m.qtype for m in packed.values()} == {"Q4_0"} and len(packed) == 2 * 7  # 2 layers: q, k, v, out, w1, w3, adaLN
    want = from_single_file_state_dict(dequantized)
    got = {**model.state_dict(), **{f"{n}.weight": m.dequantized_weight(torch.float32) for n, m in packed.items()}}
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k].float(), want[k]) for k in want), [k for k in want if not torch.equal(got[k].float(), want[k])]
    reference = load_zimage(str(tmp_path / "z.safetensors.m.safetensors")).eval()
    ours, full = output(model, "zimage"), output(reference, "zimage")
    relative = ((ours - full).norm() / full.norm()).item()
    assert 0 < relative < 0.2, relative


def test_a_lumina2_merge_writes_a_gguf_our_loader_and_comfyui_gguf_read(tiny_set, tmp_path):
    """Lumina 2: ComfyUI-GGUF's "lumina2" (the arch its convert.py was written for: the single file's names as they
    are, nothing fused or split), the types city96's tools write, and our loader computes it close to the float32
    merge (Q8_0)."""
    from library.models.lumina2.checkpoint import load_lumina2
    from tests.test_prequantized_families import output

    base = tiny_set["lumina2"]
    lora(load_lumina2(base), "lumina2", rank=4, alpha=4.0, seed=2).save(str(tmp_path / "l.safetensors"))
    out = tmp_path / "l-Q8_0.gguf"
    assert merge("--model", base, "--lora", tmp_path / "l.safetensors", "--save_to", out,
                 "--save_precision", "gguf_q8_0") == 0
    assert merge("--model", base, "--lora", tmp_path / "l.safetensors", "--save_to", tmp_path / "m.safetensors",
                 "--save_precision", "fp32") == 0
    reader, source = gguf.GGUFReader(str(out)), CheckpointReader(base)
    assert reader.get_field("general.architecture").contents() == "lumina2"
    kinds = {t.name: t.tensor_type.name for t in reader.tensors}
    # the tiny file is bf16, as released
    assert kinds == {n: city96_type(n, tuple(source.shape(n)), "BF16", "Q8_0", "lumina2") for n in source.keys()}
    model, reference = load_lumina2(str(out)).eval(), load_lumina2(str(tmp_path / "m.safetensors")).eval()
    assert {m.qtype for m in model.modules() if isinstance(m, GGUFLinear)} == {"Q8_0"}
    ours, full = output(model, "lumina2"), output(reference, "lumina2")
    relative = ((ours - full).norm() / full.norm()).item()
    assert 0 < relative < 0.02, relative
