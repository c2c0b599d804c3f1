"""Gemma 2 on the LLM core (library/models/llm.py): parity with transformers' eager Gemma2Model / Gemma2ForCausalLM
on a tiny random config (every hidden state of a right-padded batch, the logits), a window shorter than the prompt
on every other layer, softcaps small enough to act, the config round trip and Gemma-2-2B's shape on meta."""

import dataclasses

import pytest
import torch

from library.models.llm import GEMMA2_2B, LLM, LLMConfig, count_parameters, load_llm

# head_dim 24 != 64 / 4 heads and query_pre_attn_scalar 20 != 24: both must be read as given. Window 5 < the 12-token
# prompts: layers 0 and 2 (sliding) differ from full attention. Softcaps 0.5 / 0.8 sit inside the random scores' and
# logits' range (|s| up to ~3), so a missing cap fails by far more than 1e-5 (measured below).
TINY = dict(vocab_size=96, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=24, intermediate_size=80, rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=128,
            query_pre_attn_scalar=20, sliding_window=5, attn_logit_softcapping=0.5, final_logit_softcapping=0.8,
            bos_token_id=2, eos_token_id=1, pad_token_id=0)
LENGTHS = (12, 7)  # a right-padded batch: row 1 has 5 pads


def randomize_(model):
    """Weights ~ N(0, 0.2), norm offsets ~ N(0, 0.3) (Gemma's x * (1 + w)): every parameter matters."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((0.3 if "norm" in name else 0.2) * torch.randn_like(p))
    return model.eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(Gemma2ForCausalLM eager, its save_pretrained folder)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    hf = randomize_(Gemma2ForCausalLM(Gemma2Config(**TINY, attn_implementation="eager")))
    folder = str(tmp_path_factory.mktemp("gemma2"))
    hf.save_pretrained(folder, safe_serialization=True)
    return hf, folder


def batch():
    ids = torch.randint(3, TINY["vocab_size"], (len(LENGTHS), max(LENGTHS)), generator=torch.Generator().manual_seed(1))
    mask = torch.arange(max(LENGTHS))[None] < torch.tensor(LENGTHS)[:, None]
    return ids.masked_fill(~mask, 0), mask


def test_gemma2_hidden_states_and_logits_match_transformers_eager_fp32(saved):
    hf, folder = saved
    ours = load_llm(folder)
    assert ours.config.window_layers == (0, 2) and ours.config.tie_word_embeddings
    ids, mask = batch()
    positions = torch.arange(ids.shape[1])  # transformers' default (pads keep their index)
    with torch.no_grad():
        theirs = hf(ids, attention_mask=mask.long(), output_hidden_states=True)
        logits, states = ours(ids, mask, output_hidden_states=True, position_ids=positions)
    assert len(states) == len(theirs.hidden_states) == TINY["num_hidden_layers"] + 1
    # Real tokens compare (each hidden state). A pad query whose window holds pads only (row 1's last one in the
    # sliding layers) sees no key: transformers' additive mask then spreads it evenly over every key, ours opens the
    # row (core.attention_mask); pads are never read (the text encoders zero them), so only real tokens count.
    diffs = [(a - b)[mask].abs().max().item() for a, b in zip(states, theirs.hidden_states)]
    assert max(diffs) <= 1e-5, diffs  # measured 3.5e-6
    assert (logits - theirs.logits)[mask].abs().max().item() <= 1e-5
    assert logits.abs().max().item() <= TINY["final_logit_softcapping"] + 1e-6  # capped
    # the default positions (pads at 0) change pads only: every real token is the same
    with torch.no_grad():
        default_positions = ours(ids, mask)
    assert (default_positions - theirs.logits)[mask].abs().max().item() <= 1e-5


def test_gemma2_base_model_keys_and_selected_states_match_gemma2model(saved, tmp_path):
    """Gemma2Model.save_pretrained (no `model.` prefix, what a diffusers text_encoder/ holds) loads; the states a
    text encoder reads (hidden_states[-2]: the last layer never runs) equal Gemma2Model's."""
    from transformers import Gemma2Config, Gemma2Model

    hf, _ = saved
    base = Gemma2Model(Gemma2Config(**TINY, attn_implementation="eager")).eval()
    base.load_state_dict(hf.model.state_dict())
    base.save_pretrained(str(tmp_path), safe_serialization=True)
    n = TINY["num_hidden_layers"]
    ours = load_llm(str(tmp_path), keep_layers=n - 1)
    assert len(ours.model.layers) == n - 1
    ids, mask = batch()
    with torch.no_grad():
        theirs = base(ids, attention_mask=mask.long(), output_hidden_states=True).hidden_states
        picked = ours.selected_hidden_states(ids, mask, (0, 1, n - 1), position_ids=torch.arange(ids.shape[1]))
    for k, state in zip((0, 1, n - 1), picked):
        assert (state - theirs[k])[mask].abs().max().item() <= 1e-5, k


def test_gemma2_softcaps_window_and_norm_offset_each_change_the_output(saved):
    """Each Gemma 2 piece acts at these sizes: leaving one out moves the logits far past the parity tolerance."""
    hf, folder = saved
    ours = load_llm(folder)
    ids, mask = batch()
    with torch.no_grad():
        reference = ours(ids, mask)
    changed = {}
    for name, change in {"attn_softcap": dict(attn_logit_softcapping=0.0), "window": dict(sliding_window=0),
                         "final_softcap": dict(final_logit_softcapping=0.0),
                         "scale": dict(query_pre_attn_scalar=TINY["head_dim"])}.items():
        ours.config = dataclasses.replace(reference_config := load_llm(folder).config, **change)
        for layer in ours.model.layers:
            layer.self_attn.softcap = ours.config.attn_logit_softcapping
            layer.self_attn.scale = ours.config.attention_scale
        with torch.no_grad():
            changed[name] = (ours(ids, mask) - reference).abs().max().item()
        ours.config = reference_config
    assert min(changed.values()) > 1e-3, changed


def test_gemma2_config_round_trip_and_transformers_defaults():
    from transformers import Gemma2Config

    tiny = LLMConfig.from_hf({**TINY, "model_type": "gemma2"})
    assert LLMConfig.from_hf(tiny.to_hf()) == tiny
    assert tiny.hidden_act == "gelu_pytorch_tanh" and tiny.gemma_norms and tiny.scale_embeddings
    assert tiny.attention_scale == 20 ** -0.5 and tiny.window_layers == (0, 2)
    # a config.json leaving out what Gemma2Config defaults: google/gemma-2-2b's shape
    assert LLMConfig.from_hf(Gemma2Config().to_dict()) == GEMMA2_2B
    assert LLMConfig.from_hf({**GEMMA2_2B.to_hf(), "attn_logit_softcapping": None}).attn_logit_softcapping == 0.0
    hf = Gemma2Config(**{k: v for k, v in tiny.to_hf().items() if k != "architectures"})  # transformers reads ours
    assert hf.layer_types == ["sliding_attention", "full_attention"] * 2 and hf.query_pre_attn_scalar == 20
    with pytest.raises(ValueError, match=r"^config.json: hidden_activation 'gelu' is not supported"):
        LLMConfig.from_hf({**TINY, "model_type": "gemma2", "hidden_activation": "gelu"})
    # every other model is unchanged by the new fields
    llama = LLMConfig.from_hf({**TINY, "model_type": "llama"})
    assert llama.hidden_act == "silu"
    assert not (llama.gemma_norms or llama.scale_embeddings or llama.attn_logit_softcapping)


def test_gemma2_2b_on_meta_matches_transformers_parameter_count():
    """2,614,341,888 parameters (Gemma2ForCausalLM, tied head), 256000 x 2304 of them the embedding."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    with torch.device("meta"):
        ours = count_parameters(LLM(GEMMA2_2B))
        theirs = count_parameters(Gemma2ForCausalLM(Gemma2Config()))
    assert ours == theirs == 2_614_341_888
