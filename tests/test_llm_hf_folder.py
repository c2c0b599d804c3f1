"""Pretrained LLM folders load as the Hugging Face ecosystem loads them: AutoTokenizer tokenizes
exactly like our training tokenizer, config.json keeps the special token ids, generation_config.json
makes transformers' generate() stop at <|endoftext|>, tokenizer_config.json has only fields
transformers 4.x and 5.x both read."""

import json

import pytest
import torch

from library.data.tokenizer import build_bpe_tokenizer, load_tokenizer
from library.models.llm import LLM, LLMConfig, save_hf_folder
from tools.llm_quickstart import stdlib_docstrings

# Written for this test, in no training corpus: contractions in both cases, digits, runs of spaces
# and newlines, tabs, punctuation glued to words, accents in composed and decomposed (NFD) form.
TEXT = ("WE'LL see: I'M sure it's 2024-07-15 (at 10:45pm), isn't it?\n\n\n   Indented\tline;\"quoted\"...\r\n"
        "Prices: $1,299.99 vs. EUR 1.299,99!! x+=y**2 // z; e-mail: someone@example.org #hash\n"
        "Cafe\u0301 vs Caf\u00e9, nai\u0308ve na\u00efve, \u00dcber \u2014 \u201cok\u201d \u2026 \u00bd  \u4e2d\u6587  \U0001F600 end")


def tiny_llm(vocab: int, qkv_bias: bool) -> LLM:
    torch.manual_seed(0)
    cfg = LLMConfig(vocab_size=vocab, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=64,
                    rope_theta=10000.0, rms_norm_eps=1e-6, qkv_bias=qkv_bias, max_position_embeddings=128)
    return LLM(cfg).eval()


@pytest.fixture(scope="module")
def trained_tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    return build_bpe_tokenizer([stdlib_docstrings(30_000)], 400, str(folder))


@pytest.mark.parametrize("qkv_bias, model_type", [(True, "qwen2"), (False, "llama")])
def test_autotokenizer_on_a_saved_folder_encodes_like_the_training_tokenizer(trained_tokenizer, tmp_path, qkv_bias, model_type):
    from transformers import AutoTokenizer

    folder = tmp_path / "model"
    save_hf_folder(tiny_llm(len(trained_tokenizer), qkv_bias), str(folder), trained_tokenizer)
    assert json.loads((folder / "config.json").read_text())["model_type"] == model_type
    ours = load_tokenizer(str(folder)).encode(TEXT, add_special_tokens=False)
    auto = AutoTokenizer.from_pretrained(str(folder))  # transformers 5: Qwen2Tokenizer for qwen2
    assert auto.encode(TEXT, add_special_tokens=False) == ours
    assert auto.decode(ours) == trained_tokenizer.decode(ours)
    assert auto.eos_token_id == trained_tokenizer.eos_token_id and auto.pad_token_id == trained_tokenizer.pad_token_id


def test_a_gpt2_style_pre_tokenizer_would_disagree_on_the_test_text(trained_tokenizer, tmp_path):
    """The oracle check that TEXT exercises the difference: the pre-tokenizer this project used
    before (GPT-2 byte-level regex) gives other ids than transformers' Qwen2Tokenizer on it."""
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    folder = tmp_path / "model"
    save_hf_folder(tiny_llm(len(trained_tokenizer), True), str(folder), trained_tokenizer)
    gpt2_style = load_tokenizer(str(folder))
    gpt2_style.backend_tokenizer.normalizer = None
    gpt2_style.backend_tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    auto = AutoTokenizer.from_pretrained(str(folder))
    assert gpt2_style.encode(TEXT, add_special_tokens=False) != auto.encode(TEXT, add_special_tokens=False)


def test_saved_configs_keep_token_ids_and_tokenizer_config_has_no_5x_only_fields(trained_tokenizer, tmp_path):
    save_hf_folder(tiny_llm(len(trained_tokenizer), True), str(tmp_path), trained_tokenizer)
    eos, pad = trained_tokenizer.eos_token_id, trained_tokenizer.pad_token_id
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["eos_token_id"], config["pad_token_id"], config["bos_token_id"]) == (eos, pad, None)
    assert json.loads((tmp_path / "generation_config.json").read_text()) == {"eos_token_id": eos, "pad_token_id": pad}
    tok_config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert tok_config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert not {"backend", "is_local", "local_files_only"} & set(tok_config)
    assert tok_config["eos_token"] == "<|endoftext|>" and tok_config["pad_token"] == "<|pad|>"


def test_transformers_generate_stops_at_endoftext_from_generation_config(trained_tokenizer, tmp_path):
    """With the final norm's weight at 0 every logit is 0 and greedy decoding picks id 0, which is
    <|endoftext|> in our BPE: generate() must stop after one token, which it only does if it reads
    eos_token_id from the saved folder (else it runs all 6 tokens)."""
    from transformers import AutoModelForCausalLM

    model = tiny_llm(len(trained_tokenizer), True)
    with torch.no_grad():
        model.model.norm.weight.zero_()
    save_hf_folder(model, str(tmp_path), trained_tokenizer)
    eos = trained_tokenizer.eos_token_id
    assert eos == 0
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    assert hf.generation_config.eos_token_id == eos
    prompt = torch.tensor([trained_tokenizer.encode("Return the", add_special_tokens=False)])
    out = hf.generate(prompt, max_new_tokens=6, do_sample=False)
    assert out.shape[1] == prompt.shape[1] + 1 and out[0, -1].item() == eos


@pytest.mark.parametrize("source, eos", [
    (None, [448, 450]),  # no generation_config.json in the base: config.json's ids, then the sample's stops
    ({"eos_token_id": [450, 448], "top_k": 20}, [450, 448]),  # the base's already stops at both: kept as it is
    ({"eos_token_id": 448, "top_k": 20}, [448, 450]),  # the base's first, no id twice
])
def test_generation_config_lists_the_bases_eos_ids_then_the_sample_stops(source, eos):
    from library.models.llm import generation_config

    ids = {"bos_token_id": None, "eos_token_id": 448, "pad_token_id": 449}
    written = generation_config(ids, source, (448, 450))
    assert written == {"pad_token_id": 449, **(source or {}), "eos_token_id": eos}
