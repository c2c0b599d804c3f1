"""Scaled RoPE (library/models/llm_rope.py): logits equal transformers' on the same weights at positions
past the pretraining context, where the scaling acts; what is not read is refused in one line."""

import json

import pytest
import torch

from library.io import CheckpointError
from library.models.llm import LLM, LLMConfig, load_llm, save_hf_folder
from tests.test_llm import TINY, randomize_

# head_dim 16, theta 1e4: wavelengths 6.3, 20, 63, 199, ... With original_max_position_embeddings 64 and
# llama3's high_freq_factor 4 / low_freq_factor 1, the first is kept (< 16), the next two blended, the
# rest divided by factor: every band of the rule is hit. 80 positions run past 64.
LENGTH = 80
SCALINGS = {
    "llama3": ("llama", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64}),
    "linear": ("llama", {"rope_type": "linear", "factor": 4.0}),
    "dynamic": ("llama", {"rope_type": "dynamic", "factor": 2.0}),  # past max_position_embeddings 64 it re-bases theta
    "yarn": ("qwen2", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}),
    "yarn_qwen3": ("qwen3", {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}),
}


def hf_model(family: str, rope_scaling: dict, max_position_embeddings: int):
    import transformers

    name = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}[family]
    config = getattr(transformers, f"{name}Config")(**TINY, rope_scaling=dict(rope_scaling), attn_implementation="eager",
                                                     max_position_embeddings=max_position_embeddings)
    return randomize_(getattr(transformers, f"{name}ForCausalLM")(config))


@pytest.mark.parametrize("name", list(SCALINGS))
def test_scaled_rope_logits_match_transformers_past_the_original_context(name, tmp_path):
    """The old line refused every one of these configs ('rope type llama3 is not supported')."""
    family, scaling = SCALINGS[name]
    torch.manual_seed(0)
    hf = hf_model(family, scaling, 64 if name == "dynamic" else 256)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    model = load_llm(str(tmp_path))
    assert model.config.rope_scaling.rope_type == scaling.get("rope_type", scaling.get("type"))
    ids = torch.randint(2, 96, (2, LENGTH))
    with torch.no_grad():
        ours, theirs = model(ids), hf(ids).logits
        plain = hf_model(family, {"rope_type": "default"}, 256)
        plain.load_state_dict(hf.state_dict())
        unscaled = plain(ids).logits
    assert (ours - theirs).abs().max().item() <= 1e-5
    assert (unscaled - theirs)[:, 64:].abs().max().item() >= 1e-3  # the scaling changes what the test compares


def test_scaled_rope_tables_stay_float64_math_under_bf16_autocast():
    """The frequencies are no buffers: a bf16 model and autocast leave the tables those of fp32 weights."""
    family, scaling = SCALINGS["llama3"]
    config = LLMConfig.from_hf({**TINY, "model_type": family, "rope_scaling": scaling, "max_position_embeddings": 256})
    model = LLM(config)
    positions = torch.arange(200)
    reference = model._rope(positions)
    model.to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cos, sin = model._rope(positions)
    assert cos.dtype == torch.float32 and torch.equal(cos, reference[0]) and torch.equal(sin, reference[1])


@pytest.mark.parametrize("name", ["llama3", "yarn"])
def test_a_saved_folder_keeps_its_rope_scaling_for_transformers(name, tmp_path):
    """Pretraining's save_hf_folder writes rope_scaling, so transformers loads the function we trained."""
    from transformers import AutoModelForCausalLM

    family, scaling = SCALINGS[name]
    config = LLMConfig.from_hf({**TINY, "model_type": family, "rope_scaling": scaling, "max_position_embeddings": 256})
    torch.manual_seed(0)
    model = randomize_(LLM(config))
    save_hf_folder(model, str(tmp_path))
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager").eval()
    ids = torch.randint(2, 96, (1, LENGTH))
    with torch.no_grad():
        assert (model(ids) - hf(ids).logits).abs().max().item() <= 1e-5
    assert load_llm(str(tmp_path)).config.rope_scaling == config.rope_scaling


@pytest.mark.parametrize("rope, message", [
    ({"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]},
     r"^config.json: rope_scaling rope_type 'longrope' is not supported \(expected default, mrope, linear, dynamic, yarn, llama3\)$"),
    ({"rope_type": "llama3", "factor": 8.0}, r"^config.json: rope_scaling rope_type 'llama3' needs low_freq_factor, high_freq_factor$"),
    ({"rope_type": "yarn", "factor": 4.0, "mscale": 0.7, "mscale_all_dim": 0.7},
     r"^config.json: rope_scaling rope_type 'yarn' with mscale, mscale_all_dim is not supported$"),
])
def test_unread_rope_settings_are_one_line_naming_the_key(rope, message):
    with pytest.raises(ValueError, match=message):
        LLMConfig.from_hf({**TINY, "model_type": "llama", "rope_scaling": rope})


def test_a_refused_rope_names_the_config_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**TINY, "model_type": "llama",
                                                      "rope_scaling": {"rope_type": "longrope"}}))
    with pytest.raises(CheckpointError, match=rf"^{tmp_path / 'config.json'}: rope_scaling rope_type 'longrope'"):
        load_llm(str(tmp_path))


def test_the_context_window_of_a_yarn_config_is_factor_times_the_original():
    """Qwen3's card: yarn factor 4 over 32768 in a config.json with max_position_embeddings 40960 -> 131072."""
    qwen3 = {**TINY, "model_type": "qwen3", "max_position_embeddings": 40960}
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert LLMConfig.from_hf({**qwen3, "rope_scaling": yarn}).context_length == 131072
    assert LLMConfig.from_hf(qwen3).context_length == 40960
    llama3 = {**SCALINGS["llama3"][1], "original_max_position_embeddings": 8192}  # Llama-3.1: 8 x 8192 < 131072
    assert LLMConfig.from_hf({**TINY, "model_type": "llama", "rope_scaling": llama3, "max_position_embeddings": 131072}
                             ).context_length == 131072


@pytest.mark.parametrize("name", ["llama3", "dynamic", None])
def test_rope_tables_are_built_once_and_stay_float_when_the_model_is_cast(name, monkeypatch):
    """The old line rebuilt RoPE every forward: 3 forwards of one length called the table builder 3 times
    (and a scaled RoPE's float64 inv_freq 3 times); now once each. The cache is no buffer: model.to(bfloat16)
    leaves cos / sin float32 and inv_freq float64, and the bf16 model's logits equal an uncached forward's."""
    from library.models import core

    scaling = {} if name is None else {"rope_scaling": SCALINGS[name][1]}
    config = LLMConfig.from_hf({**TINY, "model_type": "llama", "max_position_embeddings": 64, **scaling})
    torch.manual_seed(0)
    model, calls = randomize_(LLM(config)), []
    builder = "rope_tables" if name is None else "rope_tables_from_inv_freq"
    original = getattr(core, builder)
    monkeypatch.setattr(core, builder, lambda *a, **k: calls.append(1) or original(*a, **k))
    ids = torch.randint(2, 96, (2, LENGTH))
    with torch.no_grad():
        first = [model(ids) for _ in range(3)][0]
    assert len(calls) == 1
    model.to(torch.bfloat16).compute_dtype = torch.bfloat16
    dtypes = {t.dtype for value in model._rope_cache.values() for t in value if isinstance(t, torch.Tensor)}
    assert dtypes == ({torch.float32} if name is None else {torch.float32, torch.float64})
    with torch.no_grad():
        cached = model(ids)
        model._rope_cache.clear()
        assert torch.equal(cached, model(ids))
    assert (cached - first).abs().max().item() > 0  # bf16 weights ran


def test_rope_tables_cached_under_inference_mode_train_afterwards():
    """A table first built in an eval under torch.inference_mode is an ordinary tensor: a training forward
    of the same length saves it for backward without 'Inference tensors cannot be saved for backward'."""
    torch.manual_seed(0)
    model = randomize_(LLM(LLMConfig.from_hf({**TINY, "model_type": "llama"})))
    ids = torch.randint(2, 96, (1, 12))
    with torch.inference_mode():
        model(ids)
    model.train()
    model(ids).float().square().mean().backward()
    assert model.model.layers[0].self_attn.q_proj.weight.grad.abs().sum().item() > 0
