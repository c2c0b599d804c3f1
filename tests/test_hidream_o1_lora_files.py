"""The peers' HiDream-O1-Image LoRA files, written tiny in each one's layout and header: musubi-tuner's (kohya
lora_unet_model_*, networks.lora_hidream_o1, ss_base_model_version hidream_o1_image, modelspec HiDream-O1-Image/lora)
and ai-toolkit's (diffusion_model.language_model.*.lora_A / lora_B without alphas, ss_base_model_version hidream_o1).
tools/lora_info.py and tools/convert_lora.py tell them without --model_type where the names or the header say it; a
LoRA of the decoder layers alone has an LLM's (Qwen3-VL's) names too: the header decides, and without one
convert_lora asks for --model_type in one line; the files load onto the model."""

import json

import pytest
import torch
from safetensors.torch import save_file

from library.models.hidream_o1.tiny import tiny_config
from networks.lora import LoRANetwork
from tools import convert_lora, lora_info

MUSUBI_HEADER = {"ss_network_module": "networks.lora_hidream_o1", "ss_base_model_version": "hidream_o1_image",
                 "modelspec.architecture": "HiDream-O1-Image/lora",
                 "modelspec.implementation": "https://github.com/HiDream-ai/HiDream-O1-Image"}
AI_TOOLKIT_HEADER = {"ss_base_model_version": "hidream_o1", "software": json.dumps({"name": "ai-toolkit"}),
                     "format": "pt"}
RANK = 4


@pytest.fixture(scope="module")
def model():
    from library.models.hidream_o1.model import HiDreamO1

    return HiDreamO1(tiny_config())


def linears(model, decoder_only: bool) -> dict[str, torch.nn.Linear]:
    """musubi-tuner's text-to-image targets (the decoder layers, the patch embedder, the final layer), or the decoder
    layers alone (ai-toolkit's transformer_only; a musubi-tuner run excluding the rest)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)
            and not name.startswith("model.t_embedder1")
            and (name.startswith("model.language_model.layers.") or not decoder_only)}


def musubi_file(path, model, decoder_only=False, header=MUSUBI_HEADER) -> str:
    tensors = {}
    for name, m in linears(model, decoder_only).items():
        kohya = "lora_unet_" + name.replace(".", "_")
        tensors[f"{kohya}.lora_down.weight"] = torch.randn(RANK, m.in_features) * 0.1
        tensors[f"{kohya}.lora_up.weight"] = torch.randn(m.out_features, RANK) * 0.1
        tensors[f"{kohya}.alpha"] = torch.tensor(float(RANK))
    save_file(tensors, str(path), header)
    return str(path)


def ai_toolkit_file(path, model, header=AI_TOOLKIT_HEADER) -> str:
    """Its save: transformer.model.<path> with '.model.' dropped (convert_lora_weights_before_save), PEFT keys, no
    alpha (scale 1)."""
    tensors = {}
    for name, m in linears(model, decoder_only=True).items():
        key = "diffusion_model." + name.removeprefix("model.")
        tensors[f"{key}.lora_A.weight"] = torch.randn(RANK, m.in_features) * 0.1
        tensors[f"{key}.lora_B.weight"] = torch.randn(m.out_features, RANK) * 0.1
    save_file(tensors, str(path), header)
    return str(path)


@pytest.mark.parametrize("write, decoder_only", [("musubi", False), ("musubi", True), ("ai-toolkit", True)])
def test_a_peers_lora_is_told_by_its_names_or_header_and_converts_without_model_type(model, tmp_path, write,
                                                                                     decoder_only):
    path = (musubi_file(tmp_path / "m.safetensors", model, decoder_only) if write == "musubi"
            else ai_toolkit_file(tmp_path / "a.safetensors", model))
    got = lora_info.read_info(path)
    assert (got["arch"], got["naming"], got["modules"]) == ("hidream_o1", "released", len(linears(model, decoder_only)))
    assert got["blocks"] == {"layer": 2} and got["width"] == 64
    out = tmp_path / "comfy.safetensors"
    assert convert_lora.main([path, str(out), "--to", "comfy" if write == "musubi" else "kohya"]) == 0
    network = LoRANetwork.from_weights(model, "hidream_o1", path)
    assert len(network.lora_modules()) == len(linears(model, decoder_only))


def test_the_decoder_layers_alone_without_a_header_ask_for_model_type(model, tmp_path, capsys):
    """Their names are also a Qwen3-VL language model's LoRA's (model.language_model.layers.N.self_attn.q_proj): with
    no header naming the model, lora_info says both and convert_lora asks for --model_type in one line."""
    path = musubi_file(tmp_path / "bare.safetensors", model, decoder_only=True, header={})
    got = lora_info.read_info(path)
    assert got["arch"] == "unknown" and got["fits"].startswith("names HiDream-O1-Image and LLM all have")
    assert convert_lora.main([path, str(tmp_path / "out.safetensors"), "--to", "comfy"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith("names neither): pass --model_type")
    assert "cannot tell HiDream-O1-Image from LLM" in err[0]
    assert convert_lora.main([path, str(tmp_path / "out.safetensors"), "--to", "comfy", "--model_type",
                              "hidream_o1"]) == 0
    assert len(LoRANetwork.from_weights(model, "hidream_o1", path).lora_modules()) == 14  # the model's own: loads


def test_an_llm_header_names_a_language_models_lora(model, tmp_path):
    """Our LLM trainer's header (ss_base_model_version llm-<layers>x<width>) tells the same names an LLM's: it was
    read as HiDream-O1's; onto the HiDream-O1 model it is refused naming what it is."""
    from library.io import CheckpointError
    from networks.lora_reader import check_lora_arch

    header = {"ss_base_model_version": "llm-2x64"}
    path = musubi_file(tmp_path / "llm.safetensors", model, decoder_only=True, header=header)
    assert lora_info.read_info(path)["arch"] == "llm"
    with pytest.raises(CheckpointError, match="a LoRA for LLM"):
        check_lora_arch(path, "hidream_o1")
