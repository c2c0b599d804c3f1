"""A raw PEFT state dict (peft's own keys: `<module>.base_layer.weight` / `.bias` beside
`lora_A.default.weight` / `lora_B.default.weight`) read as the LoRA it holds, by the file reader every
tool shares. Files built with peft itself on the tiny models (diffusers' add_adapter on the FLUX.1
transformer, get_peft_model on the LLM); oracle: peft's get_delta_weight / merge_and_unload."""

import re

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file

from tests.test_reliability import one_error_line
from tools import merge_lora

RANK = 2


def _randomize_b(model) -> None:
    """lora_B random (peft initializes it to zero: no delta to see)."""
    torch.manual_seed(4)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)


def _lora_and_base_layers(state: dict) -> dict:
    """The LoRA's and the wrapped Linears' tensors of a whole model.state_dict() (its other modules left out)."""
    return {k: v.contiguous() for k, v in state.items() if ".lora_" in k or ".base_layer." in k}


def _merge(capsys, base: str, lora: str, out: str) -> tuple[int, list[str]]:
    """merge_lora's exit status and stderr lines."""
    capsys.readouterr()
    code = merge_lora.main(["--model", base, "--lora", lora, "--save_to", out, "--save_precision", "fp32"])
    return code, capsys.readouterr().err.splitlines()


def test_a_diffusers_models_peft_state_dict_merges_as_its_lora(tiny_set, tmp_path, capsys):
    """The FLUX.1 diffusers transformer with peft's adapter on to_q / to_k / to_v (add_adapter): its state
    dict's 12 LoRA modules and their base_layer weight and bias (24 tensors). Refused before ("LoRA key
    '...base_layer.bias' mixes with PEFT keys"); now merged equal to peft's own delta, saying how many
    base_layer tensors were left out. A whole model.state_dict() (norms, embedders beside) stays refused, in a
    line saying so (was "LoRA key '...' mixes with PEFT keys like ...")."""
    from diffusers import FluxTransformer2DModel

    model = FluxTransformer2DModel.from_pretrained(tiny_set["flux_diffusers"])
    model.add_adapter(LoraConfig(r=RANK, lora_alpha=RANK, target_modules=["to_q", "to_k", "to_v"]))
    _randomize_b(model)
    state = model.state_dict()
    lora = str(tmp_path / "peft_state.safetensors")
    save_file(_lora_and_base_layers(state), lora)
    code, said = _merge(capsys, tiny_set["flux_diffusers"], lora, str(tmp_path / "merged"))
    assert code == 0, said
    assert (f"warning: {lora}: left out 24 base_layer tensors (the base model's weights a PEFT model.state_dict() "
            f"saves beside its LoRA): read the LoRA alone") in said
    base, merged = load_file(f"{tiny_set['flux_diffusers']}/diffusion_pytorch_model.safetensors"), load_file(
        str(tmp_path / "merged" / "diffusion_pytorch_model.safetensors"))
    wrapped = {name: m for name, m in model.named_modules() if hasattr(m, "get_delta_weight")}
    assert len(wrapped) == 12
    for name, m in wrapped.items():
        want = base[f"{name}.weight"] + m.get_delta_weight("default")
        assert (merged[f"{name}.weight"] - want).abs().max() <= 1e-6 * want.abs().max()
    assert sum(not torch.equal(merged[k], base[k]) for k in base) == 12
    whole = str(tmp_path / "whole.safetensors")
    save_file({k: v.contiguous() for k, v in state.items()}, whole)
    line = one_error_line(capsys, merge_lora.main(["--model", tiny_set["flux_diffusers"], "--lora", whole,
                                                   "--save_to", str(tmp_path / "m2")]))
    assert line == (f"error: {whole}: a whole PEFT model's state_dict(): 88 tensors of the model (like "
                    f"'context_embedder.bias') beside the LoRA and its base_layer weights; save the LoRA alone "
                    f"(peft's get_peft_model_state_dict(model))")


def test_an_llms_peft_state_dict_merges_as_merge_and_unload(tiny_set, tmp_path, capsys):
    """get_peft_model on the tiny LLM (q_proj / v_proj, `base_model.model.` prefix): its LoRA and base_layer
    tensors merge into the Hugging Face folder as peft's merge_and_unload gives, to float32 rounding."""
    from transformers import AutoModelForCausalLM

    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_set["llm"]),
                                LoraConfig(r=RANK, lora_alpha=RANK, target_modules=["q_proj", "v_proj"]))
    _randomize_b(peft_model)
    lora = str(tmp_path / "peft_state.safetensors")
    tensors = _lora_and_base_layers(peft_model.state_dict())
    assert any(k.startswith("base_model.model.model.layers.0.self_attn.q_proj.base_layer.") for k in tensors)
    save_file(tensors, lora)
    code, said = _merge(capsys, tiny_set["llm"], lora, str(tmp_path / "merged"))
    assert code == 0, said
    layers = peft_model.config.num_hidden_layers
    base_layers = sum(".base_layer." in k for k in tensors)
    assert base_layers >= 2 * layers and any(f"left out {base_layers} base_layer tensors" in s for s in said)
    want = {k: v for k, v in peft_model.merge_and_unload().state_dict().items()}
    merged = load_file(str(tmp_path / "merged" / "model.safetensors"))
    for key in (f"model.layers.{i}.self_attn.{p}.weight" for i in range(layers) for p in ("q_proj", "v_proj")):
        assert (merged[key] - want[key]).abs().max() <= 1e-6 * want[key].abs().max(), key


@pytest.mark.parametrize("extra", ["transformer_blocks.0.norm1.linear.weight", "transformer_blocks.0.attn.to_q.lora_C.weight"])
def test_a_tensor_beside_base_layers_that_is_neither_keeps_the_file_refused(tmp_path, extra):
    """base_layer tensors are left out only where every other tensor is the LoRA's."""
    from library.io import CheckpointError
    from networks.lora_files import read_lora_tensors

    path = str(tmp_path / "x.safetensors")
    save_file({"transformer_blocks.0.attn.to_q.lora_A.default.weight": torch.zeros(2, 4), extra: torch.zeros(4, 4),
               "transformer_blocks.0.attn.to_q.lora_B.default.weight": torch.zeros(4, 2),
               "transformer_blocks.0.attn.to_q.base_layer.weight": torch.zeros(4, 4)}, path)
    said = f"{path}: a whole PEFT model's state_dict(): 1 tensors of the model (like '{extra}')"
    with pytest.raises(CheckpointError, match=re.escape(said)):
        read_lora_tensors(path)
