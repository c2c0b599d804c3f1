"""Mistral on the LLM core (library/models/llm.py): parity with transformers' MistralForCausalLM and
with the language model inside Mistral3ForConditionalGeneration (FLUX.2 [dev]'s text encoder) on tiny
random weights, both Mistral3 key layouts, left padding, the full-size config on meta, refusals."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from library.models.llm import MISTRAL_SMALL_3_1, LLM, LLMConfig, checkpoint_key_to_llm, count_parameters, load_llm

# head_dim 24 != hidden 64 / 4 heads (Mistral Small 3.1: 128 != 5120 / 32), GQA 4 / 2, rope_theta 1e9, no window.
TEXT = dict(vocab_size=96, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            head_dim=24, intermediate_size=80, rope_theta=1000000000.0, rms_norm_eps=1e-5, max_position_embeddings=128,
            sliding_window=None, bos_token_id=1, eos_token_id=2, pad_token_id=11, tie_word_embeddings=False)
VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, head_dim=8, patch_size=14,
              image_size=56)


def randomize_(model):
    """Weights ~ N(0, 0.1), norm weights ~ 1 + N(0, 0.1): every parameter matters (the pad row too)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    return model.eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{name: (transformers model, folder)}: a MistralForCausalLM, a Mistral3ForConditionalGeneration
    as save_pretrained writes it (`language_model.model.*`, the released layout) and the same weights
    renamed to transformers' in-memory layout (`model.language_model.*`, `lm_head.*`)."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    out = {}
    mistral = randomize_(MistralForCausalLM(MistralConfig(**TEXT, attn_implementation="sdpa")))
    out["mistral"] = (mistral, str(tmp_path_factory.mktemp("mistral")))
    mistral.save_pretrained(out["mistral"][1], safe_serialization=True)
    config = Mistral3Config(text_config={**TEXT, "model_type": "mistral"}, vision_config=VISION, tie_word_embeddings=False)
    mistral3 = randomize_(Mistral3ForConditionalGeneration(config))
    folder = str(tmp_path_factory.mktemp("mistral3"))
    mistral3.save_pretrained(folder, safe_serialization=True)
    out["mistral3"] = (mistral3, folder)
    renamed = str(tmp_path_factory.mktemp("mistral3_new_layout"))
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    assert any(k.startswith("language_model.model.layers.") for k in tensors)  # what transformers writes
    new = {}
    for k, v in tensors.items():
        for old, repl in (("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."),
                          ("vision_tower.", "model.vision_tower."), ("multi_modal_projector.", "model.multi_modal_projector.")):
            if k.startswith(old):
                k = repl + k[len(old):]
                break
        new[k] = v
    save_file(new, os.path.join(renamed, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(folder, "config.json")) as f, open(os.path.join(renamed, "config.json"), "w") as g:
        g.write(f.read())
    out["mistral3_new_layout"] = (mistral3, renamed)
    return out


def max_diff(a, b, keep):
    return (a.float() - b.float())[keep].abs().max().item()


@pytest.mark.parametrize("name", ["mistral", "mistral3", "mistral3_new_layout"])
def test_mistral_logits_and_hidden_states_match_transformers_fp32(saved, name):
    hf, folder = saved[name]
    model = load_llm(folder)
    cfg = model.config
    assert (cfg.qk_norm, cfg.qkv_bias, cfg.head_dim, cfg.tie_word_embeddings, cfg.rope_theta) == (False, False, 24, False, 1e9)
    assert model.model.layers[0].self_attn.q_proj.weight.shape == (4 * 24, 64)
    ids = torch.randint(12, 96, (3, 10))
    left, right = torch.ones(3, 10, dtype=torch.long), torch.ones(3, 10, dtype=torch.long)
    left[1, :4], left[2, :1] = 0, 0
    right[1, 6:], right[2, 9:] = 0, 0
    everything = torch.ones(3, 10, dtype=torch.bool)
    with torch.no_grad():
        for mask in (None, left, right):
            ids_in = ids if mask is None else ids.masked_fill(~mask.bool(), 11)  # <pad> where masked
            # No position_ids, as the FLUX.2 [dev] pipeline calls it: 0..L-1 for every row, pads included.
            ref = hf(input_ids=ids_in, attention_mask=mask, output_hidden_states=True)
            logits, states = model(ids_in, mask, output_hidden_states=True, position_ids=torch.arange(10))
            # Pad rows are compared too: left-pad queries see no key, and both give them a 0 attention output.
            assert max_diff(logits, ref.logits, everything) <= 1e-5
            assert len(states) == len(ref.hidden_states) == 4
            for ours, theirs in zip(states, ref.hidden_states):
                assert max_diff(ours, theirs, everything) <= 1e-5
            picked = model.selected_hidden_states(ids_in, mask, (2, 1), position_ids=torch.arange(10))
            assert max_diff(picked[0], ref.hidden_states[2], everything) <= 1e-5
            assert max_diff(picked[1], ref.hidden_states[1], everything) <= 1e-5


def test_mistral3_vision_keys_are_skipped_unread(saved, monkeypatch):
    from library.io import CheckpointReader

    read = []
    original = CheckpointReader.get
    monkeypatch.setattr(CheckpointReader, "get", lambda self, key: read.append(key) or original(self, key))
    load_llm(saved["mistral3"][1])
    assert read and not any(k.startswith(("vision_tower.", "multi_modal_projector.")) for k in read)
    for key in ("vision_tower.ln_pre.weight", "model.vision_tower.ln_pre.weight", "multi_modal_projector.linear_1.weight",
                "model.multi_modal_projector.norm.weight"):
        assert checkpoint_key_to_llm(key) is None, key
    assert checkpoint_key_to_llm("language_model.model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert checkpoint_key_to_llm("model.language_model.norm.weight") == "model.norm.weight"
    assert checkpoint_key_to_llm("language_model.lm_head.weight") == "lm_head.weight"


def test_mistral_small_3_1_config_matches_transformers_defaults_and_parameter_count():
    """MISTRAL_SMALL_3_1 is Mistral3Config's default text_config (the 24B release), read from a
    Mistral3 config.json; on meta its parameter count is transformers' MistralForCausalLM's."""
    from transformers import Mistral3Config, MistralConfig, MistralForCausalLM

    hf = Mistral3Config(tie_word_embeddings=False).to_dict()
    assert LLMConfig.from_hf(json.loads(json.dumps(hf))) == MISTRAL_SMALL_3_1
    text = MistralConfig(**{k: v for k, v in hf["text_config"].items() if k not in ("model_type",)})
    with torch.device("meta"):
        ours, theirs = count_parameters(LLM(MISTRAL_SMALL_3_1)), count_parameters(MistralForCausalLM(text))
    assert ours == theirs == 23_572_403_200  # the 24B language model (vision tower and projector not included)
    assert 3 * MISTRAL_SMALL_3_1.hidden_size == 15360  # the FLUX.2 [dev] transformer's joint_attention_dim
    # A Mistral written back by to_hf is a Llama with an explicit head_dim, which from_hf reads back.
    assert LLMConfig.from_hf(json.loads(json.dumps(MISTRAL_SMALL_3_1.to_hf()))) == MISTRAL_SMALL_3_1


def test_mistral_sliding_window_is_read_as_a_bound_on_the_sequence():
    """Within the window attention hides nothing (test_llm checks the logits against transformers'), so a
    sliding_window is read as the longest sequence, in a plain and a Mistral3-nested config alike."""
    config = {**TEXT, "model_type": "mistral", "sliding_window": 4096}
    assert LLMConfig.from_hf(config).sliding_window == 4096
    assert LLMConfig.from_hf({"model_type": "mistral3", "text_config": config}).sliding_window == 4096
