"""tools/lora_info.py on LoRA files of every layout: format, network, ranks, alphas and the architecture and
release their names and shapes fit."""

import json

import pytest
import torch

from networks import lora_files as lf
from networks.lora import LoRANetwork
from tools.lora_common import load_model
from tests.test_lora_tools import _lokr, random_lora


def info(*argv) -> dict:
    from tools import lora_info

    return lora_info.read_info(str(argv[0]))


def test_lora_info_describes_our_kohya_file_with_training_metadata(tiny_set, tmp_path, capsys):
    from tools import lora_info

    net = random_lora(tiny_set["flux_bfl"], tmp_path / "ours.safetensors", rank=8, alpha=4.0)
    net.save(str(tmp_path / "ours.safetensors"), torch.bfloat16,
             lf.build_metadata(base_model="/models/flux1-dev.safetensors", base_precision="fp8_scaled", lr=1e-4,
                               steps=100))
    got = info(tmp_path / "ours.safetensors")
    assert (got["format"], got["network"], got["arch"], got["naming"]) == ("kohya", "LoRA", "flux", "bfl")
    assert got["modules"] == 26 and got["ranks"] == {"8": 26} and got["alphas"] == {"4": 26}
    assert got["dtypes"] == {"BF16": 52, "F32": 26}  # alphas stay float32
    assert got["width"] == 64 and got["blocks"] == {"double": 2, "single": 2}
    assert "not a released size" in got["fits"]
    assert got["training"]["base_model"] == "flux1-dev.safetensors"
    assert got["training"]["base_precision"] == "fp8_scaled"
    assert got["training"]["network_dim"] == "8" and "sshs_model_hash" in got["metadata"]
    assert lora_info.main([str(tmp_path / "ours.safetensors"), "--model", tiny_set["flux_bfl"]]) == 0
    text = capsys.readouterr().out
    assert "LoRA in kohya layout" in text and "checked: fits" in text and "base_precision: fp8_scaled" in text
    assert lora_info.main([str(tmp_path / "ours.safetensors"), "--model", tiny_set["llm"], "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["checked"].startswith("does not fit")


def test_lora_info_names_the_modules_a_training_left_at_zero(tiny_set, tmp_path, capsys):
    """A module whose up stayed at its zero init (frozen, left out of the optimizer) adds nothing at any ratio; the
    report said only "all finite" (sd-scripts' check_lora_weights.py prints each tensor's mean |x| to find them)."""
    from tools import lora_info

    net = random_lora(tiny_set["flux_bfl"], tmp_path / "a.safetensors")
    untrained = net.lora_modules()[3]
    with torch.no_grad():
        untrained.lora_up.weight.zero_()
    net.save(str(tmp_path / "a.safetensors"))
    got = info(tmp_path / "a.safetensors")
    assert got["zero_modules"] == ["lora_unet_" + untrained.name.replace(".", "_")], got["zero_modules"]  # file names
    assert lora_info.main([str(tmp_path / "a.safetensors")]) == 0
    assert "zero modules: 1 of 26 have an up or down of zeros" in capsys.readouterr().out
    random_lora(tiny_set["flux_bfl"], tmp_path / "b.safetensors")
    assert info(tmp_path / "b.safetensors")["zero_modules"] == []


def test_lora_info_reads_a_peft_llm_adapter_with_its_header_alpha(tiny_set, tmp_path):
    model, family, _ = load_model(tiny_set["llm"])
    weights = LoRANetwork(model, family, rank=4, alpha=8.0).lora_weights()
    tensors = {}
    for path, w in weights.items():
        tensors[f"base_model.model.{path}.lora_A.weight"] = w.down
        tensors[f"base_model.model.{path}.lora_B.weight"] = w.up
    lf.write_lora_tensors(tensors, str(tmp_path / "adapter_model.safetensors"),
                          {lf.ADAPTER_METADATA_KEY: json.dumps({"lora_alpha": 16, "r": 4})})
    got = info(tmp_path / "adapter_model.safetensors")
    assert (got["format"], got["arch"], got["width"]) == ("peft", "llm", 32)
    assert got["alphas"] == {"16": 14} and "adapter config" in got["alpha_source"]
    assert got["fits"] == "an LLM (Llama / Qwen2 layout) of width 32, at least 2 layers"


def test_lora_info_on_a_folder_says_what_it_expects_and_reads_a_peft_adapter_folder(tiny_set, tmp_path, capsys):
    import shutil

    from tests.test_reliability import one_error_line
    from tools import lora_info

    (tmp_path / "vae").mkdir()
    shutil.copy(tiny_set["flux_vae_single"], tmp_path / "vae" / "ae.safetensors")
    capsys.readouterr()
    line = one_error_line(capsys, lora_info.main([str(tmp_path / "vae")]))
    assert line == (f"error: {tmp_path / 'vae'}: a folder without adapter_config.json (expected a PEFT adapter folder "
                    f"or a .safetensors LoRA)")
    model, family, _ = load_model(tiny_set["llm"])
    LoRANetwork(model, family, rank=4, alpha=8.0).save_peft(str(tmp_path / "adapter"))
    got = info(tmp_path / "adapter")  # alpha 8 is in adapter_config.json only, not in the file's header
    assert (got["format"], got["arch"], got["alphas"]) == ("peft", "llm", {"8": 14})
    assert got["alpha_source"] == "the folder's adapter_config.json"


def test_lora_info_names_released_sizes_dora_and_lycoris(tmp_path):
    w = lf.LoRAWeights(torch.zeros(1, 3072), torch.zeros(9216, 1), 1.0)
    lf.write_kohya({"double_blocks.18.img_attn.qkv": w}, str(tmp_path / "dev.safetensors"))
    lf.write_kohya({"double_blocks.19.img_attn.qkv": w}, str(tmp_path / "bigger.safetensors"))
    assert info(tmp_path / "dev.safetensors")["fits"] == "FLUX.1 dev / schnell"
    assert "not a released size" in info(tmp_path / "bigger.safetensors")["fits"]
    dora = lf.LoRAWeights(torch.zeros(1, 3072), torch.zeros(3072, 1), 1.0, magnitude=torch.ones(3072))
    lf.write_kohya({"transformer_blocks.59.img_mod.1": lf.LoRAWeights(torch.zeros(1, 3072), torch.zeros(18432, 1), 1.0),
                    "transformer_blocks.0.attn.to_q": dora}, str(tmp_path / "qwen_dora.safetensors"))  # fmt: skip
    got = info(tmp_path / "qwen_dora.safetensors")
    assert (got["network"], got["arch"], got["fits"]) == ("DoRA", "qwen_image", "Qwen-Image")
    _lokr(tmp_path / "k.safetensors")
    got = info(tmp_path / "k.safetensors")
    assert (got["format"], got["network"], got["ranks"], got["alphas"]) == ("lycoris", "LoKr", {}, {"1": 1})


ATTENTION = ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj", "to_out.0", "to_add_out")


@pytest.mark.parametrize("arch, width, blocks, single, fits", [
    ("flux", 3072, 19, 0, "FLUX.1 dev / schnell"), ("flux", 3072, 19, 38, "FLUX.1 dev / schnell"),
    ("flux2", 3072, 5, 0, "FLUX.2 [klein] 4B"), ("flux2", 6144, 8, 0, "FLUX.2 [dev]"),
    ("qwen_image", 3072, 60, 0, "Qwen-Image")])  # fmt: skip
def test_lora_info_tells_attention_only_diffusers_loras_apart_by_shapes_and_blocks(
        tmp_path, arch, width, blocks, single, fits):
    """`transformer.transformer_blocks.N.attn.add_q_proj` is in FLUX.1, FLUX.2 (and Chroma, FLUX.1's names)
    and Qwen-Image alike: lora_info said qwen_image for every attention-only file (the first marker that
    matched). Now the width and block counts pick the release: FLUX.1 19 double (+ 38 single) blocks at 3072,
    FLUX.2 [klein] 4B 5 at 3072 and [dev] 8 at 6144, Qwen-Image 60 at 3072."""
    w = lambda: lf.LoRAWeights(torch.zeros(1, width), torch.zeros(width, 1), 1.0)  # noqa: E731
    modules = {f"transformer_blocks.{i}.attn.{n}": w() for i in range(blocks) for n in ATTENTION}
    modules |= {f"single_transformer_blocks.{i}.attn.{n}": w() for i in range(single) for n in ("to_q", "to_k", "to_v")}
    lf.write_peft(modules, str(tmp_path / "attn.safetensors"), dtype=torch.float16)
    got = info(tmp_path / "attn.safetensors")
    assert (got["arch"], got["fits"]) == (arch, fits)


def test_lora_info_says_when_shapes_tell_no_architecture_apart(tmp_path):
    """Tiny attention-only LoRAs (width 64) fit no release: no architecture is named, the candidates are."""
    weights = {f"transformer_blocks.0.attn.{n}": lf.LoRAWeights(torch.zeros(1, 64), torch.zeros(64, 1), 1.0)
               for n in ATTENTION}
    lf.write_peft(weights, str(tmp_path / "attn.safetensors"))
    got = info(tmp_path / "attn.safetensors")
    assert got["arch"] == "unknown" and got["fits"].startswith(
        "names FLUX.1, Qwen-Image, FLUX.2, Chroma or HunyuanImage-2.1 all have")
