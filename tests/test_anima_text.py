"""Anima's prompt encoding (library/models/anima/text_encoder.py) equals diffusers' AnimaTextEncoderStep.encode_prompt
run with transformers' Qwen3Model and the tokenizers on the tiny files (library/models/anima/tiny_text.py: the
pipeline repo's text_encoder/ + tokenizer/ + t5_tokenizer/, and ComfyUI's single Qwen3 file)."""

import os
import shutil
from types import SimpleNamespace

import pytest
import torch

MAX_LENGTH = 24  # max_sequence_length for both sides (the released 512): the long prompt is cut here
PROMPTS = ["a red cat", "a watercolor painting of a lighthouse on a cliff at dusk, waves crashing on the rocks "
           "below, gulls over the foam", "", "two small dogs in the snow"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from library.models.anima.tiny_text import write_anima_text_encoder

    return write_anima_text_encoder(str(tmp_path_factory.mktemp("anima_text")), seed=0)


@pytest.fixture(scope="module")
def repo(files):
    return os.path.dirname(files["anima_text_encoder"])  # the pipeline folder: text_encoder/ + tokenizers beside


@pytest.fixture(scope="module")
def reference(files):
    """encode_prompt(prompts) of the pipeline on transformers' Qwen3Model and the saved tokenizers, fp32, CPU."""
    from diffusers.modular_pipelines.anima.encoders import AnimaTextEncoderStep
    from transformers import AutoTokenizer, Qwen3Model

    components = SimpleNamespace(
        tokenizer=AutoTokenizer.from_pretrained(files["anima_tokenizer"]),
        t5_tokenizer=AutoTokenizer.from_pretrained(files["anima_t5_tokenizer"]),
        text_encoder=Qwen3Model.from_pretrained(files["anima_text_encoder"]).eval())

    def encode(prompts):
        with torch.no_grad():
            out = AnimaTextEncoderStep.encode_prompt(components, prompts, prepare_unconditional_embeds=False,
                                                     max_sequence_length=MAX_LENGTH, device=torch.device("cpu"),
                                                     dtype=torch.float32)
        return (out["qwen_prompt_embeds"], out["qwen_attention_mask"], out["t5_input_ids"], out["t5_attention_mask"])

    return encode


def max_diff(ours, theirs) -> float:
    """max |ours - diffusers'| of the Qwen states after checking that masks, T5 ids and every shape agree exactly."""
    qwen, mask, t5_ids, t5_mask = ours
    ref_qwen, ref_mask, ref_ids, ref_t5_mask = theirs
    assert qwen.dtype == torch.float32 and mask.dtype == t5_mask.dtype == torch.bool and t5_ids.dtype == torch.int64
    assert qwen.shape == ref_qwen.shape and torch.equal(mask, ref_mask.bool())
    assert torch.equal(t5_ids, ref_ids) and torch.equal(t5_mask, ref_t5_mask.bool())
    return (qwen - ref_qwen).abs().max().item()


def test_anima_prompt_encoding_matches_diffusers_fp32(repo, reference):
    """The batch of 4 (Qwen3: 3, 24 (64 cut), 0, 14 tokens; T5: 4, 24, 1, 15) and each prompt alone: Qwen states within
    1e-5 (measured 1.2e-6 batched, 1.2e-6 alone), masks and T5 ids equal, zeros past each prompt."""
    from library.models.anima.text_encoder import load_anima_text_encoder
    from library.models.anima.tiny_text import TEXT_LAYERS, TEXT_WIDTH

    encoder = load_anima_text_encoder(repo, dtype=torch.float32, max_length=MAX_LENGTH)
    assert len(encoder.llm.model.layers) == TEXT_LAYERS and encoder.embed_dim == TEXT_WIDTH == 64
    ours, theirs = encoder.encode(PROMPTS), reference(PROMPTS)
    assert ours[0].shape == (4, MAX_LENGTH, 64) and ours[1].sum(1).tolist() == [3, 24, 0, 14]
    assert ours[3].sum(1).tolist() == [4, 24, 1, 15] and ours[2][2, 0].item() == 1  # "" -> [</s>]
    batch = max_diff(ours, theirs)
    alone = max(max_diff(encoder.encode([p]), reference([p])) for p in PROMPTS)
    print(f"max |ours - diffusers|: batch {batch:.2e}, one prompt {alone:.2e}")
    assert batch <= 1e-5 and alone <= 1e-5
    assert theirs[0][0].abs().max().item() > 0.1  # the states compared are not near zero
    assert ours[0][~ours[1]].abs().max().item() == 0


def test_a_batch_of_empty_prompts_is_one_masked_zero_token_each(repo, reference):
    """The pipeline turns a batch with no Qwen token into [B, 1] with mask 0; T5 still has its </s>."""
    from library.models.anima.text_encoder import load_anima_text_encoder

    ours = load_anima_text_encoder(repo, dtype=torch.float32, max_length=MAX_LENGTH).encode(["", ""])
    assert max_diff(ours, reference(["", ""])) == 0.0
    assert ours[0].shape == (2, 1, 64) and not ours[1].any() and ours[2].tolist() == [[1], [1]] and ours[3].all()


def test_the_single_file_with_tokenizers_beside_or_given_encodes_the_same(files, repo, tmp_path):
    """ComfyUI's layout: `model.*` keys, no config.json (shaped by the tensors); the Qwen3 tokenizer in the file's
    folder and t5_tokenizer/ beside it, or both given. Equal to the repo's encoding bit for bit."""
    from library.models.anima.text_encoder import load_anima_text_encoder

    folder = load_anima_text_encoder(repo, dtype=torch.float32, max_length=MAX_LENGTH).encode(PROMPTS)
    given = load_anima_text_encoder(files["anima_qwen3_single_file"], t5_tokenizer=files["anima_t5_tokenizer"],
                                    tokenizer=files["anima_tokenizer"], dtype=torch.float32,
                                    max_length=MAX_LENGTH)
    shutil.copytree(files["anima_tokenizer"], tmp_path / "text_encoders")
    shutil.copy(files["anima_qwen3_single_file"], tmp_path / "text_encoders" / "qwen.safetensors")
    shutil.copytree(files["anima_t5_tokenizer"], tmp_path / "t5_tokenizer")
    beside = load_anima_text_encoder(str(tmp_path / "text_encoders" / "qwen.safetensors"), dtype=torch.float32,
                                     max_length=MAX_LENGTH)
    for encoder in (given, beside):
        assert all(torch.equal(a, b) for a, b in zip(encoder.encode(PROMPTS), folder))


def test_a_missing_tokenizer_or_a_wrong_file_is_one_clear_error(files, tmp_path):
    from library.io import CheckpointError, save_safetensors
    from library.models.anima.text_encoder import load_anima_text_encoder

    single = files["anima_qwen3_single_file"]
    with pytest.raises(CheckpointError, match=r"no T5 tokenizer found in .*t5_tokenizer"):
        load_anima_text_encoder(single, tokenizer=files["anima_tokenizer"])
    with pytest.raises(CheckpointError, match=r"tokenizer: a Qwen2 tokenizer, given where Anima needs its T5 one"):
        load_anima_text_encoder(single, tokenizer=files["anima_tokenizer"], t5_tokenizer=files["anima_tokenizer"])
    with pytest.raises(CheckpointError, match=r"t5_tokenizer: a T5 tokenizer, given where Anima needs its Qwen2 one"):
        load_anima_text_encoder(single, tokenizer=files["anima_t5_tokenizer"], t5_tokenizer=files["anima_t5_tokenizer"])
    with pytest.raises(CheckpointError, match=r"nowhere: no tokenizer_config.json; expected the folder of Anima's T5"):
        load_anima_text_encoder(single, tokenizer=files["anima_tokenizer"], t5_tokenizer=str(tmp_path / "nowhere"))
    with pytest.raises(CheckpointError, match=r"no Qwen2 tokenizer found"):
        load_anima_text_encoder(single, t5_tokenizer=files["anima_t5_tokenizer"])
    wrong = str(tmp_path / "t5.safetensors")  # an encoder without Qwen3's q/k norms
    save_safetensors({"model.embed_tokens.weight": torch.zeros(8, 4), "model.layers.0.self_attn.q_proj.weight":
                      torch.zeros(4, 4)}, wrong)
    with pytest.raises(CheckpointError, match=r"t5.safetensors: no tensor for model.layers.0.self_attn.q_norm.weight .*"
                                              r"not a Qwen3 language model \(Anima's is Qwen3-0.6B\)"):
        load_anima_text_encoder(wrong, t5_tokenizer=files["anima_t5_tokenizer"], tokenizer=files["anima_tokenizer"])


def test_a_qwen2_config_beside_the_weights_is_refused(files, tmp_path):
    from library.io import CheckpointError
    from library.models.anima.text_encoder import anima_llm_config
    from library.models.llm import LLMConfig
    from library.models.tiny_files import write_json

    write_json(str(tmp_path / "config.json"), LLMConfig(vocab_size=64, hidden_size=32, num_layers=1, num_heads=2,
                                                        num_kv_heads=1, intermediate_size=64).to_hf())
    with pytest.raises(CheckpointError, match=r"config.json: Anima's text encoder is Qwen3 \(q/k norms\)"):
        anima_llm_config(str(tmp_path))
    assert anima_llm_config(files["anima_text_encoder"]).head_dim == 16  # explicit, != 64 / 2 heads


def test_a_saved_base_models_keys_map_to_the_llm_core():
    """Qwen3Model.save_pretrained writes `layers.*` (no `model.`): what the pipeline repo's text_encoder/ holds."""
    from library.models.llm import checkpoint_key_to_llm

    assert checkpoint_key_to_llm("layers.3.self_attn.q_norm.weight") == "model.layers.3.self_attn.q_norm.weight"
    assert checkpoint_key_to_llm("embed_tokens.weight") == "model.embed_tokens.weight"
    assert checkpoint_key_to_llm("norm.weight") == "model.norm.weight"
    assert checkpoint_key_to_llm("model.norm.weight") == "model.norm.weight"


def test_the_caption_limit_counts_the_longer_of_both_token_rows(repo):
    from library.models.anima.text_encoder import ANIMA_MAX_LENGTH, anima_caption_token_limit

    limit = anima_caption_token_limit(repo)
    assert limit.max_tokens == ANIMA_MAX_LENGTH == 512
    assert limit.count("") == 1 and limit.count("a red cat") == 4  # T5's 3 pieces + </s> (Qwen3: 3)


def test_qwen3_0_6b_text_weights_on_meta():
    """Qwen3-0.6B as the planner counts it: 596 M parameters (the tied 155.6 M embedding once), fp8 the 196 decoder
    Linears (440.4 M weights, one scale per 64)."""
    from library.models.anima.text_encoder import anima_text_weights
    from library.models.spec import TextWeights

    assert anima_text_weights() == TextWeights(596_049_920, fp8_weights=440_401_920, fp8_scales=6_881_280)


def test_a_full_size_single_file_is_shaped_as_qwen3_0_6b(tmp_path):
    """ComfyUI's qwen_3_06b_base.safetensors (Qwen3ForCausalLM's `model.*` keys, tied: no head), written as a sparse
    hole (1.1 GiB, no disk): shaped by its header into Qwen3-0.6B's config; the planner counts what it reads."""
    from bench.full_size_files import write_holes
    from library.io import CheckpointReader
    from library.models.anima.text_encoder import QWEN3_0_6B, anima_llm_config, anima_text_weights
    from library.models.llm import LLM, llm_text_weights

    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in LLM(QWEN3_0_6B).state_dict().items()}
    path = str(tmp_path / "qwen_3_06b_base.safetensors")
    write_holes(path, shapes)
    assert anima_llm_config(path) == QWEN3_0_6B
    reader = CheckpointReader(path)
    assert llm_text_weights(reader, list(reader.keys())) == anima_text_weights()
