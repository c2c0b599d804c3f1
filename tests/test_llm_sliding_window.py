"""Qwen2 / Qwen3 sliding-window attention (use_sliding_window): the layers transformers' config rule picks
attend to the last sliding_window keys only; logits match transformers past the window."""

import json

import pytest
import torch

from library.models.llm import LLM, LLMConfig, load_llm, save_hf_folder
from tests.test_llm import TINY, assert_logits_match_with_left_padding, randomize_

QWEN = {**TINY, "num_hidden_layers": 4, "use_sliding_window": True, "sliding_window": 6}


def hf_model(model_type: str, **extra):
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    cls, cfg = {"qwen2": (Qwen2ForCausalLM, Qwen2Config), "qwen3": (Qwen3ForCausalLM, Qwen3Config)}[model_type]
    return randomize_(cls(cfg(**{**QWEN, **extra}, attn_implementation="eager")))


@pytest.mark.parametrize("model_type,extra,layers", [
    ("qwen2", {"max_window_layers": 2}, (2, 3)),
    ("qwen3", {"max_window_layers": 1, "head_dim": 24}, (1, 2, 3)),
    ("qwen3", {"layer_types": ["sliding_attention", "full_attention"] * 2}, (0, 2)),
])
def test_qwen_sliding_window_layers_match_transformers_past_the_window(tmp_path, model_type, extra, layers):
    """The old line refused use_sliding_window. 20 tokens (3x the window of 6), with and without left
    padding: logits within 1e-5 of transformers; the saved config reads back the same layers."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = hf_model(model_type, **extra)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    model = load_llm(str(tmp_path))
    assert (model.config.sliding_window, model.config.window_layers) == (6, layers)
    ids = assert_logits_match_with_left_padding(model, hf, tokens=20, padding=7)
    with torch.no_grad():
        full = LLM(LLMConfig(**{**model.config.__dict__, "sliding_window": 0}))
        full.load_state_dict(model.state_dict())
        assert (full(ids) - model(ids)).abs().max().item() > 1e-3  # the window hides something here
    saved = json.loads(json.dumps(model.config.to_hf()))
    assert LLMConfig.from_hf(saved) == model.config
    save_hf_folder(model, str(tmp_path / "ours"))  # what pretraining writes: transformers runs the same windows
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ours"), attn_implementation="eager").eval()
    with torch.no_grad():
        assert (reloaded(ids).logits - hf(ids).logits).abs().max().item() <= 1e-5


def test_qwen_sliding_window_configs_transformers_reads_as_full_attention():
    """use_sliding_window false (Qwen2.5's released configs) or max_window_layers >= num_hidden_layers:
    no layer slides, so nothing is stored."""
    config = {**QWEN, "model_type": "qwen2"}
    assert LLMConfig.from_hf({**config, "use_sliding_window": False}).window_layers == ()
    assert LLMConfig.from_hf({**config, "max_window_layers": 4}).sliding_window == 0
    assert LLMConfig.from_hf(config).window_layers == ()  # transformers' default max_window_layers 28 > 4 layers


@pytest.mark.parametrize("config,message", [
    ({"model_type": "qwen3", "layer_types": ["sliding_attention"] * 4}, "without use_sliding_window and a sliding_window"),
    ({"model_type": "qwen2", "use_sliding_window": True, "layer_types": ["full_attention"]}, "layer_types has 1 entries"),
    ({"model_type": "llama", "use_sliding_window": True}, "model_type 'llama' are not supported"),
])
def test_sliding_window_configs_transformers_cannot_run_are_refused(config, message):
    with pytest.raises(ValueError, match=message):
        LLMConfig.from_hf({**TINY, "num_hidden_layers": 4, "sliding_window": 6, **config})


def test_a_window_without_its_layers_is_refused():
    """LLMConfig(sliding_window=...) alone used to mean a bound on the sequence; now it must name its layers."""
    with pytest.raises(ValueError, match=r"sliding_window 8 with window_layers \(\): expected the indices"):
        LLMConfig(sliding_window=8)
    with pytest.raises(ValueError, match=r"window_layers \(2,\): expected the indices \(below num_layers 2\)"):
        LLMConfig(num_layers=2, sliding_window=8, window_layers=(2,))
