"""The LLM (library/models/llm.py): parity with transformers on tiny random configs, checkpoint layouts,
error messages, preset sizes, generation, bf16, tokenizer and the quickstart script."""

import json
import os
import re

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from library.io import CheckpointError
from library.models.llm import (
    LLAMA3_8B,
    LLM,
    QWEN2_5_7B,
    LLMConfig,
    count_parameters,
    cross_entropy_loss,
    generate,
    load_llm,
    perplexity,
    position_ids_from_mask,
)

TINY = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=80, rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=None)


def randomize_(model):
    """Weights and biases ~ N(0, 0.1), norm weights ~ 1 + N(0, 0.1): every parameter matters."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    return model.eval()


def assert_logits_match_with_left_padding(model, hf, tokens: int, padding: int) -> torch.Tensor:
    """Our logits within 1e-5 of transformers' on 2 random rows, the second left-padded by `padding`
    tokens (compared where the mask is 1); returns the ids."""
    ids, mask = torch.randint(2, 96, (2, tokens)), torch.ones(2, tokens, dtype=torch.long)
    mask[1, :padding] = 0
    with torch.no_grad():
        assert (model(ids) - hf(ids).logits).abs().max().item() <= 1e-5
        diff = (model(ids, mask) - hf(ids, attention_mask=mask).logits)[mask.bool()]
        assert diff.abs().max().item() <= 1e-5
    return ids


def hf_causal_lm(family: str):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    cls, cfg = {"llama": (LlamaForCausalLM, LlamaConfig), "qwen2": (Qwen2ForCausalLM, Qwen2Config)}[family]
    return randomize_(cls(cfg(**TINY, attn_implementation="eager")))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{family: (hf model, folder written by save_pretrained)} for llama and qwen2."""
    torch.manual_seed(0)
    out = {}
    for family in ("llama", "qwen2"):
        hf = hf_causal_lm(family)
        folder = str(tmp_path_factory.mktemp(family))
        hf.save_pretrained(folder, safe_serialization=True)
        out[family] = (hf, folder)
    return out


def batch_with_left_padding():
    ids = torch.randint(2, 96, (3, 10))
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[1, :4] = 0
    mask[2, :1] = 0
    return ids, mask


def max_diff(a, b, keep):
    return (a.float() - b.float())[keep].abs().max().item()


# ----------------------------------------------------------------------------------------------
# Parity with transformers


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_logits_and_hidden_states_match_transformers_fp32(saved, family):
    hf, folder = saved[family]
    model = load_llm(folder)
    assert model.config.qkv_bias == (family == "qwen2")
    ids, mask = batch_with_left_padding()
    with torch.no_grad():
        for attention_mask in (None, mask):
            # transformers' generate() derives positions from the mask the same way
            positions = None if attention_mask is None else position_ids_from_mask(attention_mask, 10, "cpu")
            ref = hf(ids, attention_mask=attention_mask, position_ids=positions, output_hidden_states=True)
            logits, states = model(ids, attention_mask, output_hidden_states=True)
            keep = torch.ones(3, 10, dtype=torch.bool) if attention_mask is None else mask.bool()
            assert logits.dtype == torch.float32 and logits.shape == (3, 10, 96)
            assert max_diff(logits, ref.logits, keep) <= 1e-5
            assert len(states) == len(ref.hidden_states) == 3
            for ours, theirs in zip(states, ref.hidden_states):
                assert max_diff(ours, theirs, keep) <= 1e-5
            last = model.hidden_states(ids, attention_mask)
            assert max_diff(last, ref.hidden_states[-1], keep) <= 1e-5


def test_left_padding_does_not_change_real_token_logits(saved):
    model = load_llm(saved["llama"][1])
    ids = torch.randint(2, 96, (1, 6))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], dim=1)
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        alone, with_pad = model(ids), model(padded, mask)
    assert not torch.isnan(with_pad).any()
    assert (alone[0] - with_pad[0, 3:]).abs().max().item() <= 1e-5


def test_gradient_checkpointing_gives_same_gradients(saved):
    model = load_llm(saved["qwen2"][1]).train()
    ids = torch.randint(2, 96, (2, 8))
    grads = []
    for use in (False, True):
        model.gradient_checkpointing = use
        model.zero_grad()
        cross_entropy_loss(model(ids[:, :-1]), ids[:, 1:]).backward()
        grads.append(model.model.layers[0].self_attn.q_proj.weight.grad.clone())
    assert (grads[0] - grads[1]).abs().max().item() <= 1e-6


def test_bf16_logits_within_tolerance_of_fp32(saved):
    fp32, bf16 = load_llm(saved["qwen2"][1]), load_llm(saved["qwen2"][1], dtype=torch.bfloat16)
    assert bf16.compute_dtype == torch.bfloat16 and bf16.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    ids, mask = batch_with_left_padding()
    with torch.no_grad():
        ref, out = fp32(ids, mask), bf16(ids, mask)
    assert out.dtype == torch.float32
    diff = max_diff(out, ref, mask.bool())
    # bf16 keeps 8 significant bits: a tiny 2-layer model drifts by a few percent of the logit scale
    assert diff <= 0.05 * ref.abs().max().item(), diff
    assert (out.argmax(-1) == ref.argmax(-1))[mask.bool()].float().mean().item() >= 0.9


# ----------------------------------------------------------------------------------------------
# Checkpoint layouts and errors


def test_sharded_checkpoint_with_index_loads_identically(saved, tmp_path):
    _, folder = saved["llama"]
    with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    keys = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2], "model-00002-of-00002.safetensors": keys[len(keys) // 2 :]}
    for name, part in shards.items():
        save_file({k: tensors[k] for k in part}, str(tmp_path / name))
    index = {"metadata": {}, "weight_map": {k: name for name, part in shards.items() for k in part}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "config.json").write_text(open(os.path.join(folder, "config.json")).read())
    ids = torch.randint(2, 96, (2, 7))
    with torch.no_grad():
        reference = load_llm(folder)(ids)
        assert torch.equal(load_llm(str(tmp_path))(ids), reference)
        assert torch.equal(load_llm(str(tmp_path / "model.safetensors.index.json"))(ids), reference)


def test_qwen2_5_vl_checkpoint_layouts_load_language_model(tmp_path):
    """A real (tiny) Qwen2.5-VL saved by transformers, and the same tensors under the
    `model.language_model.*` and `language_model.model.*` layouts: the vision tower is skipped
    and text-only logits equal Qwen2_5_VLForConditionalGeneration's."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    text = {**TINY, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}}
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=64, fullatt_block_indexes=[0])
    hf = randomize_(Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, attn_implementation="eager")))
    hf.save_pretrained(str(tmp_path / "vl"), safe_serialization=True)
    with safe_open(str(tmp_path / "vl" / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    assert any(k.startswith("visual.") for k in tensors)
    config = LLMConfig.from_hf(json.loads((tmp_path / "vl" / "config.json").read_text()))
    assert config.qkv_bias and config.num_layers == 2 and config.rope_theta == 10000.0
    layouts = {
        "new": lambda k: "model." + k if k.startswith("visual.") else k.replace("model.", "model.language_model.", 1),
        "llava": lambda k: k if k.startswith("visual.") else "language_model." + k,
    }
    for name, rename in layouts.items():
        save_file({rename(k): v for k, v in tensors.items()}, str(tmp_path / f"{name}.safetensors"))
    ids, mask = batch_with_left_padding()
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask).logits
        for path in (str(tmp_path / "vl"), str(tmp_path / "new.safetensors"), str(tmp_path / "llava.safetensors")):
            cfg = None if path.endswith("vl") else config
            assert max_diff(load_llm(path, config=cfg)(ids, mask), ref, mask.bool()) <= 1e-5, path


def test_missing_and_unexpected_keys_raise_checkpoint_error_naming_them(saved, tmp_path):
    _, folder = saved["llama"]
    with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    config = LLMConfig.from_hf(json.loads(open(os.path.join(folder, "config.json")).read()))
    missing = {k: v for k, v in tensors.items() if k != "model.layers.1.mlp.up_proj.weight"}
    save_file(missing, str(tmp_path / "missing.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing keys: model\.layers\.1\.mlp\.up_proj\.weight"):
        load_llm(str(tmp_path / "missing.safetensors"), config=config)
    save_file({**tensors, "model.layers.1.self_attn.q_norm.weight": torch.ones(16)}, str(tmp_path / "extra.safetensors"))
    with pytest.raises(CheckpointError, match=r"unexpected keys.*model\.layers\.1\.self_attn\.q_norm\.weight"):
        load_llm(str(tmp_path / "extra.safetensors"), config=config)
    with pytest.raises(CheckpointError, match="config.json"):
        load_llm(str(tmp_path / "extra.safetensors"))


def test_mistral_sliding_window_matches_transformers_past_the_window(tmp_path):
    """Mistral-7B-v0.1 and its fine-tunes set sliding_window 4096 on every layer. The old line refused a
    sequence longer than the window (13 tokens for a window of 12) and capped context_length at it; now
    the window is applied and 30 tokens (padded or not) match transformers within 1e-5."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    hf = randomize_(MistralForCausalLM(MistralConfig(**TINY, sliding_window=12, attn_implementation="eager")))
    hf.save_pretrained(tmp_path, safe_serialization=True)
    model = load_llm(str(tmp_path))
    assert (model.config.sliding_window, model.config.window_layers, model.config.context_length) == (12, (0, 1), 131072)
    assert_logits_match_with_left_padding(model, hf, tokens=30, padding=5)
    saved = json.loads(json.dumps(model.config.to_hf()))
    assert (saved["model_type"], saved["sliding_window"]) == ("mistral", 12)
    assert LLMConfig.from_hf(saved) == model.config
    assert LLMConfig.from_hf({**TINY, "model_type": "mistral"}).sliding_window == 4096  # transformers' default


@pytest.mark.parametrize("model_type", ["gemma", "granite", "qwen3_moe", "qwen3_vl_moe"])
def test_from_hf_refuses_model_types_whose_layers_are_not_llamas(model_type):
    """The old line read any model_type as Llama (qwen3_moe without its QK norm): a Gemma or Granite
    folder then loaded name for name and trained a different function without a word."""
    with pytest.raises(ValueError, match=f"^config.json: model_type '{model_type}' is not supported"):
        LLMConfig.from_hf({**TINY, "model_type": model_type})


def test_from_hf_refuses_an_mlp_activation_other_than_silu():
    """The old line read hidden_act 'gelu_pytorch_tanh' as SiLU: the model loaded and computed another function."""
    with pytest.raises(ValueError, match=r"^config.json: hidden_act 'gelu_pytorch_tanh' is not supported \(expected silu\)$"):
        LLMConfig.from_hf({**TINY, "model_type": "llama", "hidden_act": "gelu_pytorch_tanh"})
    assert LLMConfig.from_hf({**TINY, "model_type": "llama", "hidden_act": "silu"}) == LLMConfig.from_hf({**TINY, "model_type": "llama"})


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3"])
def test_a_config_without_max_position_embeddings_gets_transformers_default(model_type):
    """The old line took 4096 for every type (transformers: Llama 2048, Mistral 131072, Qwen2 / Qwen3 32768):
    dynamic RoPE re-based theta from another length, and max_length was checked against another window."""
    from transformers import AutoConfig

    config = {k: v for k, v in TINY.items() if k != "max_position_embeddings"}
    expected = AutoConfig.for_model(model_type).max_position_embeddings
    assert LLMConfig.from_hf({**config, "model_type": model_type}).max_position_embeddings == expected


def test_from_hf_refuses_a_quantized_checkpoints_config():
    """The old line read the config of an HF fp8 release (Qwen3-8B-FP8: block scales `weight_scale_inv`);
    train_lora.py then said 'stores a pre-quantized fp8 base ... set fp8_base = true and fp8_scaled = false',
    and with that 'unexpected keys for this model: ...weight_scale_inv'."""
    quant = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    with pytest.raises(ValueError, match=r"^config.json: quantization_config \(quant_method 'fp8'\): a Hugging Face "
                                         r"quantized checkpoint is not read"):
        LLMConfig.from_hf({**TINY, "model_type": "qwen3", "quantization_config": quant})


# ----------------------------------------------------------------------------------------------
# Presets


def test_meta_parameter_counts_of_presets_match_transformers():
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    with torch.device("meta"):
        ours = {"qwen": count_parameters(LLM(QWEN2_5_7B)), "llama": count_parameters(LLM(LLAMA3_8B))}
        hf_llama = LlamaForCausalLM(LlamaConfig(vocab_size=128256, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336, tie_word_embeddings=False))
        hf_qwen = Qwen2ForCausalLM(Qwen2Config(vocab_size=152064, hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, intermediate_size=18944, tie_word_embeddings=False))
    assert ours == {"qwen": 7_615_616_512, "llama": 8_030_261_248}
    assert ours == {"qwen": count_parameters(hf_qwen), "llama": count_parameters(hf_llama)}


# ----------------------------------------------------------------------------------------------
# Generation and loss helpers


class NextTokenModel(torch.nn.Module):
    """Predicts (last token + 1) % V at every position; records the input lengths it saw."""

    def __init__(self, vocab=16):
        super().__init__()
        self.vocab, self.seen = vocab, []

    def forward(self, idx):
        self.seen.append(idx.shape[1])
        return torch.nn.functional.one_hot((idx + 1) % self.vocab, self.vocab).float() * 10.0


def test_generate_stops_at_eos_and_crops_context():
    model = NextTokenModel()
    out = generate(model, torch.tensor([[2, 3, 4, 5, 6, 7]]), max_new_tokens=10, context_size=4, eos_id=11)
    assert out.tolist() == [[2, 3, 4, 5, 6, 7, 8, 9, 10]]  # 11 = eos is sampled, not appended
    assert max(model.seen) == 4 and len(model.seen) == 4
    batch = generate(NextTokenModel(), torch.tensor([[9], [5]]), max_new_tokens=10, context_size=4, eos_id=11)
    assert batch.tolist() == [[9, 10, 11, 11, 11, 11], [5, 6, 7, 8, 9, 10]]
    no_eos = generate(NextTokenModel(), torch.tensor([[0]]), max_new_tokens=5, context_size=4, top_k=3, temperature=0.5)
    assert no_eos.shape == (1, 6)


def test_generate_stops_at_any_of_several_eos_ids():
    """(EOS, a chat template's end of turn), as generation_config lists them: a row stops at whichever it samples
    first and is padded with the first id."""
    batch = generate(NextTokenModel(), torch.tensor([[9], [5]]), max_new_tokens=10, context_size=4, eos_id=[13, 7])
    assert batch.tolist() == [[9, 10, 11, 12], [5, 6, 13, 13]]  # 7 ends row 1, 13 row 0 (not appended)


def test_generate_top_k_over_the_vocab_keeps_every_token():
    """The old line ran torch.topk(logits, 40) on a 16-token vocab: 'RuntimeError: selected index k out of
    range' at the first eval of a training run (the default top_k 40 over a vocab under 40), before any save."""
    draw = lambda k: generate(NextTokenModel(), torch.tensor([[0]]), 6, 4, temperature=50.0, top_k=k,  # noqa: E731
                              generator=torch.Generator().manual_seed(0))
    assert torch.equal(draw(40), draw(None)) and torch.equal(draw(16), draw(None))


def test_cross_entropy_and_perplexity_of_uniform_logits():
    logits = torch.zeros(2, 5, 50, dtype=torch.bfloat16)
    targets = torch.randint(0, 50, (2, 5))
    targets[0, :2] = -100  # ignored
    loss = cross_entropy_loss(logits, targets)
    assert loss.dtype == torch.float32
    assert abs(loss.item() - torch.log(torch.tensor(50.0)).item()) <= 1e-6
    assert abs(perplexity(loss) - 50.0) <= 1e-4


# ----------------------------------------------------------------------------------------------
# Tokenizer and quickstart


def test_bpe_tokenizer_round_trips_and_loads_with_autotokenizer(tmp_path):
    from transformers import AutoTokenizer

    from library.data.tokenizer import build_bpe_tokenizer, load_tokenizer

    texts = ["Return the number of items in the container.", "Raise ValueError if the value is not found."] * 20
    tok = build_bpe_tokenizer(texts, 300, str(tmp_path))
    sample = "Return the value, ünïcode too."
    assert tok.decode(tok.encode(sample, add_special_tokens=False)) == sample
    assert len(tok) == 300 and tok.eos_token == "<|endoftext|>" and tok.pad_token_id is not None
    again = AutoTokenizer.from_pretrained(str(tmp_path))
    assert again.encode(sample) == tok.encode(sample) == load_tokenizer(str(tmp_path)).encode(sample)
    assert again.eos_token_id == tok.eos_token_id


def test_quickstart_short_run_writes_outputs_and_lowers_val_loss(tmp_path):
    from tools.llm_quickstart import main

    out = tmp_path / "qs"
    result = main(["--output_dir", str(out), "--corpus_chars", "30000", "--vocab_size", "300", "--context", "32", "--hidden", "32", "--layers", "1", "--heads", "2", "--kv_heads", "1", "--batch_size", "8", "--max_steps", "30", "--eval_every", "15", "--eval_batches", "2", "--sample_tokens", "5", "--threads", "1"])
    for name in ("log.csv", "loss.png", "model.safetensors", "config.json", "generation_config.json", "tokenizer.json"):
        assert (out / name).is_file(), name
    assert result["val_loss_end"] < result["val_loss_start"] - 0.3, result
    assert len((out / "log.csv").read_text().splitlines()) == 1 + 3  # header + evals at steps 1, 15, 30
    reloaded = load_llm(str(out))
    assert reloaded.config.vocab_size == 300


@pytest.mark.parametrize("extra, message", [
    (["--heads", "3"], "^error: --hidden 128, --heads 3, --kv_heads 2: expected --hidden a multiple of --heads"),
    # a traceback after the tokenizer trained, and a model of width-0 MLPs (2026-11-27)
    (["--hidden", "12", "--heads", "4", "--kv_heads", "2"], "^error: --hidden 12 / --heads 4 = 3: a head's width must be even"),
    (["--hidden", "8", "--heads", "2", "--kv_heads", "1"], "^error: --hidden 8: expected at least 12"),
    (["--corpus_chars", "800", "--vocab_size", "300"],
     r"^error: --corpus_chars 800: \d+ tokens leave the validation tenth \d+, fewer than --context \+ 1 = 129"),
    # ZeroDivisionErrors after the tokenizer trained, and NotADirectoryError (2026-11-27)
    (["--max_steps", "0"], "^error: --max_steps 0: expected at least 1$"),
    (["--eval_every", "0"], "^error: --eval_every 0: expected at least 1$"),
    # tracebacks (the tokenizer's, AdamW's once tokenizer.json was written) or a model of no layers (2026-11-28)
    (["--lr", "-1"], r"^error: --lr -1.0: expected a number above 0$"),
    (["--vocab_size", "2"], r"^error: --vocab_size 2: expected at least 258"),
    (["--layers", "0"], "^error: --layers 0: expected at least 1$"),
    (["--output_dir", "/etc/passwd/run"], "^error: --output_dir /etc/passwd/run: cannot be created, '/etc/passwd' is a file"),
])
def test_quickstart_bad_settings_are_one_line_before_training(tmp_path, capsys, extra, message):
    """The old line trained the tokenizer and then died in a traceback: LLMConfig's ValueError for --heads 3, and
    for a corpus whose validation tenth is under one window, torch.randint's 'from=0 >= to=-75' at the first eval."""
    from tools.llm_quickstart import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--output_dir", str(tmp_path), "--max_steps", "1", *extra])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.match(message, err), err
    assert not (tmp_path / "model.safetensors").exists()


def test_quickstart_batches_reach_the_last_window():
    """A stream of exactly context + 1 tokens holds one window: the old line drew starts from randint(0, 0) and
    raised; every start 0..len - context - 1 is drawn now."""
    from tools.llm_quickstart import random_batch

    x, y = random_batch(torch.arange(9), 4, 8, torch.Generator().manual_seed(0))
    assert x.tolist() == [list(range(8))] * 4 and y.tolist() == [list(range(1, 9))] * 4
    starts = random_batch(torch.arange(12), 200, 8, torch.Generator().manual_seed(0))[0][:, 0]
    assert set(starts.tolist()) == {0, 1, 2, 3}
