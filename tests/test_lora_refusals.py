"""Another family's LoRA: every tool that applies a LoRA (generate, the trainer's network_weights and base_loras,
merge_lora, the precision tools) refuses it in one line saying what tools/lora_info.py says, before any model
loads; a LoRA that names no family, or one whose model takes it (Chroma a FLUX.1 LoRA less its modulation), is
read. The FLUX.1 files: tests/conftest.py flux_loras (tests/lora_layouts.py)."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from library.io import CheckpointError
from library.models import spec as S
from networks import lora_files as lf
from networks.factory import network_from_file
from networks.lora import LoRANetwork
from tests.lora_layouts import CONSUMERS, TOL
from tools import convert_lora


def qwen_on_flux(path: str) -> str:
    from tools import lora_info

    info = lora_info.read_info(path)
    assert (info["arch"], info["naming"]) == ("qwen_image", "diffusers")
    return f"{path}: a LoRA for Qwen-Image (tools/lora_info.py: arch qwen_image, diffusers names), not for this FLUX.1 model"


def test_generate_names_the_architecture_of_another_familys_lora(qwen_lora, tmp_path, capsys):
    """The old generate loaded the text encoders and the transformer, then said "LoRA module
    'lora_unet_transformer_blocks_0_attn_add_k_proj' matches no module ... convert_lora ... --to kohya",
    which no conversion fixes; now the header decides, before any model file is opened (these are missing)."""
    from tests.test_reliability import one_error_line
    from tools import generate

    missing = str(tmp_path / "missing.safetensors")
    code = generate.main(["--model_type", "flux", "--model", missing, "--ae", missing, "--clip_l", missing, "--t5xxl", missing,
                          "--prompt", "a cat", "--lora", f"{qwen_lora}:0.5", "--out", str(tmp_path / "out")])  # fmt: skip
    assert one_error_line(capsys, code) == f"error: {qwen_on_flux(qwen_lora)}"
    assert not (tmp_path / "out").exists()


def test_network_weights_and_base_loras_of_another_family_are_refused_before_caching(qwen_lora, flux_loras):
    """library/training/lora_inputs.py, which both tasks call before the model loads (the diffusion task also
    before caching); the old runs cached the dataset and loaded the model first."""
    from types import SimpleNamespace

    from library.errors import ConfigError
    from library.training.lora_inputs import check_lora_inputs

    ours = flux_loras["cases"]["kohya (ours)"][0]
    for key, arch, args in (("network_weights", "flux", dict(network_weights=qwen_lora, base_loras=[ours])),
                            ("base_loras", "flux", dict(network_weights=ours, base_loras=[f"{qwen_lora}:0.5"])),
                            ("network_weights", "llm", dict(network_weights=ours))):
        with pytest.raises(ConfigError) as error:
            check_lora_inputs(SimpleNamespace(config_file="run.toml", **args), arch)
        line = qwen_on_flux(qwen_lora) if arch == "flux" else (
            f"{ours}: a LoRA for FLUX.1 (tools/lora_info.py: arch flux, bfl names), not for this LLM model")
        assert str(error.value) == f"run.toml: key '{key}': {line}"


def flux1_on(path: str, title: str, names: str = "bfl") -> str:
    return f"{path}: a LoRA for FLUX.1 (tools/lora_info.py: arch flux, {names} names), not for this {title} model"


@pytest.mark.parametrize("layout, names", [("kohya (ours)", "bfl"), ("diffusers", "diffusers")])
def test_a_flux1_lora_is_refused_by_flux2_from_its_header(flux_loras, layout, names):
    """FLUX.2 shares FLUX.1's block names, so the header check let a FLUX.1 LoRA through to a FLUX.2 run (which
    then failed after the model loaded). Its modulation Linears (img_mod.lin / norm1.linear: FLUX.2 has none)
    and its MLP widths (4 x hidden rows, FLUX.2's are 6 x) say FLUX.1's."""
    from networks.lora_reader import check_lora_arch

    path = flux_loras["cases"][layout][0]
    with pytest.raises(CheckpointError) as error:
        check_lora_arch(path, "flux2")
    assert str(error.value) == flux1_on(path, "FLUX.2", names)
    check_lora_arch(path, "flux")


@pytest.mark.parametrize("layout, others", [("kohya (ours)", 10), ("diffusers", 17)])  # the file's modules: q / k / v split
def test_chroma_loads_a_flux1_lora_without_the_modulation_it_lacks(flux_loras, layout, others, tmp_path):
    """Chroma is FLUX.1's blocks less the modulation Linears (its approximator makes them): ComfyUI loads a
    FLUX.1 LoRA on Chroma, skipping those keys. The old header check refused it ('a LoRA for FLUX.1 ... not for
    this Chroma model'); now the blocks load, with one warning saying how many modules were left out and why.
    A LoRA of those modules alone is still refused: nothing of it would load."""
    from library.models.chroma.model import Chroma, ChromaConfig
    from networks.lora_reader import check_lora_arch

    path, reference = flux_loras["cases"][layout]
    check_lora_arch(path, "chroma")
    chroma = Chroma(ChromaConfig(in_channels=64, context_in_dim=32, hidden_size=64, num_heads=2, depth=1, depth_single=1,
                                 axes_dim=(4, 14, 14), approximator_hidden=32, approximator_layers=1))
    with pytest.warns(UserWarning) as said:
        net = LoRANetwork.from_weights(chroma, "chroma", path)
    kept = {"double_blocks.0.img_attn.qkv", "double_blocks.0.img_attn.proj", "double_blocks.0.img_mlp.0", "double_blocks.0.img_mlp.2",
            "double_blocks.0.txt_attn.qkv", "double_blocks.0.txt_attn.proj", "double_blocks.0.txt_mlp.0", "double_blocks.0.txt_mlp.2",
            "single_blocks.0.linear1", "single_blocks.0.linear2"}
    got = {m.name: m.weights().delta() for m in net.lora_modules()}
    assert set(got) == kept and all((got[p] - reference[p]).abs().max() <= TOL * reference[p].abs().max() for p in kept)
    lines = [str(w.message) for w in said]
    assert len(lines) == 1 and lines[0].startswith(f"{path}: a FLUX.1 LoRA: left out its 3 modules this Chroma model "
                                                   f"lacks (e.g. '") and lines[0].endswith(f"kept the other {others}")
    modulation = {k: v for k, v in load_file(path).items() if "mod" in k or "norm1" in k or "norm.linear" in k}
    save_file(modulation, str(tmp_path / "mod.safetensors"))
    with pytest.raises(CheckpointError, match=r"mod.safetensors: a LoRA for FLUX.1 \(tools/lora_info.py: arch flux, "
                       r"\w+ names\), not for this Chroma model: its 3 modules are all ones this model lacks"):
        check_lora_arch(str(tmp_path / "mod.safetensors"), "chroma")


def test_a_flux1_lora_of_shared_modules_is_refused_by_its_metadata_or_its_released_size(tmp_path):
    """Attention and MLP of FLUX.1's shapes: refused by FLUX.2 where the header says FLUX.1 (ss_base_model_version
    flux1-dev, what our trainer and sd-scripts write) or where the width and blocks are FLUX.1 dev's (19 double
    at 3072; no FLUX.2 has 19). Chroma takes them, header or not (its blocks are FLUX.1's, as ComfyUI loads them);
    the old check refused the one whose header said FLUX.1."""
    from networks.lora_reader import check_lora_arch

    attn = {f"double_blocks.{i}.img_attn.qkv": lf.LoRAWeights(torch.zeros(1, 3072), torch.zeros(9216, 1), 1.0) for i in range(19)}
    lf.write_kohya(attn, str(tmp_path / "bare.safetensors"))
    lf.write_kohya(attn, str(tmp_path / "said.safetensors"), metadata={"ss_base_model_version": "flux1-dev"})
    for name in ("bare", "said"):
        check_lora_arch(str(tmp_path / f"{name}.safetensors"), "chroma")
    for name in ("said", "bare"):
        with pytest.raises(CheckpointError) as error:
            check_lora_arch(str(tmp_path / f"{name}.safetensors"), "flux2")
        assert str(error.value) == flux1_on(str(tmp_path / f"{name}.safetensors"), "FLUX.2")
    small = {p: w for p, w in attn.items() if int(p.split(".")[1]) < 5}  # FLUX.2 [klein] 4B's 5 double blocks fit too
    lf.write_kohya(small, str(tmp_path / "small.safetensors"))
    check_lora_arch(str(tmp_path / "small.safetensors"), "flux2")


def test_attention_only_loras_of_another_released_size_are_refused_from_the_header(tmp_path):
    """Attention projections (transformer_blocks.N.attn.to_q / add_q_proj) are in FLUX.1, FLUX.2 and Qwen-Image
    alike, so the header check let FLUX.2 [dev]'s (width 6144) or Qwen-Image's (60 blocks) through to a FLUX.1
    run, which failed after the model loaded (shapes, blocks it lacks). Where no release of the target fits the width and
    blocks and another's does, that one is named (what lora_info reports); a size the target's release fits
    stays the modules' to decide."""
    from networks.lora_reader import check_lora_arch

    names = ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj", "to_out.0", "to_add_out")
    for name, width, blocks in (("flux2_dev", 6144, 8), ("qwen", 3072, 60), ("flux1_dev", 3072, 19)):
        lf.write_peft({f"transformer_blocks.{i}.attn.{n}": lf.LoRAWeights(torch.zeros(1, width), torch.zeros(width, 1), 1.0)
                       for i in range(blocks) for n in names}, str(tmp_path / f"{name}.safetensors"))
    for name, arch, said in (("flux2_dev", "flux", "FLUX.2 (tools/lora_info.py: arch flux2), not for this FLUX.1"),
                             ("qwen", "flux", "Qwen-Image (tools/lora_info.py: arch qwen_image), not for this FLUX.1"),
                             ("flux1_dev", "flux2", "FLUX.1 (tools/lora_info.py: arch flux), not for this FLUX.2")):
        with pytest.raises(CheckpointError) as error:
            check_lora_arch(str(tmp_path / f"{name}.safetensors"), arch)
        assert str(error.value) == f"{tmp_path / name}.safetensors: a LoRA for {said} model"
    check_lora_arch(str(tmp_path / "flux1_dev.safetensors"), "qwen_image")  # Qwen-Image's first 19 blocks: its own size


def test_musubi_tuners_modelspec_names_flux1_and_flux2(tmp_path):
    """musubi-tuner writes modelspec.architecture 'Flux.1-dev/lora' (Kontext) and 'Flux.2-klein-4b/lora' /
    'Flux.2-dev/lora' and no ss_base_model_version. The old header checks knew 'flux1' / 'flux-1' and
    ss_base_model_version 'flux2' only, so an attention-only LoRA of 5 double blocks at 3072 (FLUX.1's and
    FLUX.2 [klein] 4B's alike) from musubi-tuner went to the other model's run unrefused."""
    from networks.lora_reader import check_lora_arch

    attn = {f"double_blocks.{i}.img_attn.qkv": lf.LoRAWeights(torch.zeros(1, 3072), torch.zeros(9216, 1), 1.0) for i in range(5)}
    for name, arch, said in (("Flux.1-dev/lora", "flux2", "FLUX.1 (tools/lora_info.py: arch flux, bfl names), not for this FLUX.2"),
                             ("Flux.2-klein-4b/lora", "flux", "FLUX.2 (tools/lora_info.py: arch flux2, bfl names), not for this FLUX.1")):
        path = str(tmp_path / "musubi.safetensors")
        lf.write_kohya(attn, path, metadata={"modelspec.architecture": name})
        with pytest.raises(CheckpointError) as error:
            check_lora_arch(path, arch)
        assert str(error.value) == f"{path}: a LoRA for {said} model"


def test_an_attention_only_lora_both_families_have_is_refused_by_its_header_or_read_with_a_warning(tmp_path):
    """transformer_blocks.N.attn.* at width 3072 in blocks 0-18 is FLUX.1's (19 double blocks) and Qwen-Image's
    (its first 19 of 60) alike: diffusers' FluxLoraLoaderMixin and QwenImageLoraLoaderMixin read the same keys,
    and the shapes are the same. The old reader took it silently in a Qwen-Image run whatever its header said.
    Now a header naming the other model (ss_base_model_version flux1-dev, what sd-scripts and our trainer write;
    musubi-tuner's modelspec.architecture Qwen-Image/lora) refuses it in one line, and a file with no header
    is read with one warning saying nothing tells which model it is for."""
    from networks.lora_arch import lora_files
    from networks.lora_reader import check_lora_arch, lora_for_model

    names = ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj", "to_out.0", "to_add_out")
    attn = {f"transformer_blocks.{i}.attn.{n}": lf.LoRAWeights(torch.zeros(1, 3072), torch.zeros(3072, 1), 1.0)
            for i in range(19) for n in names}
    for name, header in (("bare", {}), ("flux1", {"ss_base_model_version": "flux1-dev"}),
                         ("qwen", {"modelspec.architecture": "Qwen-Image/lora"})):
        lf.write_peft(attn, str(tmp_path / f"{name}.safetensors"), metadata=header)
    for name, arch, said in (("flux1", "qwen_image", "FLUX.1 (tools/lora_info.py: arch flux), not for this Qwen-Image"),
                             ("qwen", "flux", "Qwen-Image (tools/lora_info.py: arch qwen_image), not for this FLUX.1")):
        with pytest.raises(CheckpointError) as error:
            check_lora_arch(str(tmp_path / f"{name}.safetensors"), arch)
        assert str(error.value) == f"{tmp_path / name}.safetensors: a LoRA for {said} model"
    for name, arch in (("flux1", "flux"), ("qwen", "qwen_image"), ("bare", "flux"), ("bare", "qwen_image")):
        check_lora_arch(str(tmp_path / f"{name}.safetensors"), arch)
    tensors = load_file(str(tmp_path / "bare.safetensors"))
    paths = S.load_symbol(lora_files()["qwen_image"].module_paths)({"transformer_blocks": 60})
    with pytest.warns(UserWarning) as said:
        read = lora_for_model(tensors, {}, None, "qwen_image", paths, name="bare.safetensors")
    assert len(read.weights) == 19 * 8 and [str(w.message) for w in said] == [
        "bare.safetensors: its modules (e.g. 'transformer.transformer_blocks.0.attn.add_k_proj') are Qwen-Image's and FLUX.1's "
        "alike, at width 3072 in 19 blocks, and its header names no model (ss_base_model_version): read as this Qwen-Image "
        "model's LoRA"]


@pytest.mark.parametrize("consumer", CONSUMERS)
def test_every_consumer_names_the_architecture_of_another_familys_lora(flux_loras, qwen_lora, consumer):
    """The old readers said "LoRA module 'lora_unet_transformer_blocks_0_attn_add_k_proj' matches no module
    ... convert_lora.py IN OUT --to kohya" (generate, network_weights, base_loras) or "no LoRA module matches
    ... convert_lora first" (merge_lora): no conversion fixes another model's LoRA."""
    with pytest.raises(CheckpointError) as error:
        CONSUMERS[consumer](flux_loras["model"], "flux", qwen_lora, flux_loras["root"])
    assert str(error.value) == qwen_on_flux(qwen_lora)


def test_a_lora_of_text_encoders_alone_is_refused_in_one_line(flux_loras, tmp_path):
    """sd-scripts can train CLIP-L / T5 alone into a file: the old reader said "LoRA file holds no tensors"
    (it holds two) after generate had loaded the models. Now the header check (before any model) and the
    network's reader name what it holds."""
    from networks.lora_reader import check_lora_arch

    tensors = {k: v for k, v in load_file(flux_loras["cases"]["kohya + text encoder (sd-scripts)"][0]).items()
               if k.startswith("lora_te1_")}  # fmt: skip
    save_file(tensors, str(tmp_path / "te.safetensors"))
    line = f"{tmp_path / 'te.safetensors'}: holds only 1 text-encoder modules (CLIP-L lora_te1_ x1); this LoRA adapts no module of the transformer"
    with pytest.raises(CheckpointError) as error:
        check_lora_arch(str(tmp_path / "te.safetensors"), "flux")
    assert str(error.value) == line
    with pytest.raises(CheckpointError) as error:
        network_from_file(flux_loras["model"], "flux", str(tmp_path / "te.safetensors"))
    assert str(error.value) == line


def test_the_refusal_names_what_lora_info_reports_for_every_family(tiny_set, tmp_path):
    """For each family's tiny LoRA in each layout it writes, every other architecture that refuses it names
    the arch and naming tools/lora_info.py prints for the file (one word for one thing across the tools);
    the ones that take it are its own architecture or share its names."""
    from library.models.registry import arch_specs
    from library.models.spec import load_symbol
    from networks.lora_arch import lora_files
    from networks.lora_reader import check_lora_arch
    from tools import lora_info

    archs = [a for a, s in arch_specs().items() if s.tiny and s.tiny.transformer]
    refused = 0
    for arch in archs:
        spec = arch_specs()[arch]
        src = str(tmp_path / f"{arch}.safetensors")
        LoRANetwork(load_symbol(spec.transformer.load)(tiny_set[spec.tiny.transformer]), arch, rank=2).save(src)
        files = [src]
        for layout in set(lora_files()[arch].layouts) - {"kohya", "peft"}:
            files.append(str(tmp_path / f"{arch}_{layout}.safetensors"))
            convert_lora.convert_lora(src, files[-1], layout)
        for path in files:
            info = lora_info.read_info(path)
            for target in archs:
                try:
                    check_lora_arch(path, target)
                except CheckpointError as e:
                    refused += 1
                    assert f"(tools/lora_info.py: arch {info['arch']}, {info['naming']} names)" in str(e), (target, str(e))
                else:
                    assert target == arch or info["arch"] in (target, lora_files()[target].names_of), (path, target)
    assert refused > len(archs) ** 2  # most pairs are told apart by the names
