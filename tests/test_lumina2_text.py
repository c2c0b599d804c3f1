"""Lumina Image 2.0's prompt encoding (library/models/lumina2/text_encoder.py) on the tiny files (tiny_text.py):
equal to diffusers' Lumina2Pipeline.encode_prompt run with transformers' Gemma2Model and the tokenizer (prompts of
different lengths, one cut at 256 tokens, and the empty negative prompt), the ComfyUI single file, the errors, and
Gemma-2-2B's planner count."""

import shutil

import pytest
import torch

from library.io import CheckpointError, save_safetensors
from library.models.lumina2.text_encoder import (
    LUMINA2_SYSTEM_PROMPT, Lumina2TextEncoder, load_lumina2_text_encoder, lumina2_text_weights,
)

CAPTIONS = ["a big red circle on the left, striped background", "a cat",
            "a small blue star in the centre, white background " * 30]  # the last one is cut at 256 tokens


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from library.models.lumina2.tiny_text import write_lumina2_text_encoder

    return write_lumina2_text_encoder(str(tmp_path_factory.mktemp("tiny")), seed=0)


@pytest.fixture(scope="module")
def diffusers_embeds(tiny):
    """Lumina2Pipeline.encode_prompt's (prompt_embeds, mask, negative_embeds, negative_mask) on the tiny files,
    Gemma2Model loaded as the pipeline loads it (no attn_implementation: transformers 5.23 picks eager)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Lumina2Pipeline
    from transformers import AutoTokenizer, Gemma2Model

    gemma = Gemma2Model.from_pretrained(tiny["lumina2_text_encoder"]).eval()
    assert gemma.config._attn_implementation == "eager"  # so the reference keeps the attention softcap
    pipe = Lumina2Pipeline(transformer=None, scheduler=FlowMatchEulerDiscreteScheduler(), vae=None,
                           text_encoder=gemma, tokenizer=AutoTokenizer.from_pretrained(tiny["lumina2_tokenizer"]))
    with torch.no_grad():
        return pipe.encode_prompt(CAPTIONS, do_classifier_free_guidance=True, device=torch.device("cpu"))


def assert_equal_to_pipeline(hidden, mask, embeds, pipe_mask):
    """Ours [B, S] against the pipeline's [B, 256]: masks exact (nothing real past S), states on real tokens."""
    S = mask.shape[1]
    assert torch.equal(mask, pipe_mask[:, :S].bool()) and not pipe_mask[:, S:].any()
    diff = (hidden - embeds[:, :S].float())[mask].abs().max().item()
    assert diff <= 1e-5, diff
    assert not hidden[~mask].any()  # zero at the pads
    return diff


def test_lumina2_encode_matches_diffusers_encode_prompt_fp32(tiny, diffusers_embeds):
    embeds, pipe_mask, negative, negative_mask = diffusers_embeds
    encoder = load_lumina2_text_encoder(tiny["lumina2_text_encoder"], dtype=torch.float32)
    assert len(encoder.llm.model.layers) == 2  # hidden_states[-2] of 3 layers: the last one is never loaded
    hidden, mask = encoder.encode(CAPTIONS, LUMINA2_SYSTEM_PROMPT)
    assert mask.shape[1] == 256 and mask.sum(1).tolist()[2] == 256  # the long caption is cut where the pipeline cuts
    assert mask.sum(1).tolist()[:2] == [35, 28]  # real tokens: <bos> + system prompt + marker + caption, no <unk>
    assert assert_equal_to_pipeline(hidden, mask, embeds, pipe_mask) <= 1e-5  # measured 3.2e-6 (the negative 2.6e-6)
    # the negative prompt: "" without the system prompt, <bos> alone
    neg_hidden, neg_mask = encoder.encode([""] * len(CAPTIONS), None)
    assert neg_mask.shape == (3, 1) and neg_mask.all()
    assert_equal_to_pipeline(neg_hidden, neg_mask, negative, negative_mask)
    # a prompt alone gives its batched states: only the batch's longest row sets S
    alone, alone_mask = encoder.encode(CAPTIONS[1:2], LUMINA2_SYSTEM_PROMPT)
    assert (alone[0] - hidden[1, : alone.shape[1]]).abs().max().item() <= 1e-5


def test_lumina2_tiny_tokenizer_knows_every_word(tiny):
    """The system prompts and the synthetic scenes' captions are real tokens, <bos> first, not <unk>."""
    from transformers import AutoTokenizer

    from library.models.lumina2.text_encoder import SD_SCRIPTS_SYSTEM_PROMPTS, lumina2_prompt_text

    tokenizer = AutoTokenizer.from_pretrained(tiny["lumina2_tokenizer"])
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id) == (0, 1, 2)
    for system in (LUMINA2_SYSTEM_PROMPT, *SD_SCRIPTS_SYSTEM_PROMPTS):
        ids = tokenizer(lumina2_prompt_text("a big purple star in the centre, black background", system)).input_ids
        assert ids[0] == 2 and tokenizer.unk_token_id not in ids and len(ids) < 60


def test_lumina2_single_file_gives_the_same_states(tiny, tmp_path):
    """ComfyUI's layout (`model.*` keys, a `spiece_model` tensor, no config.json): shaped by its tensors with the
    tokenizer given or in the tokenizer/ folder beside the file, bit-equal to the repo layout; without one, one error
    naming where it looked."""
    import shutil

    repo = load_lumina2_text_encoder(tiny["lumina2_text_encoder"], dtype=torch.float32)
    single = load_lumina2_text_encoder(tiny["lumina2_gemma2_single_file"], dtype=torch.float32,
                                       tokenizer=tiny["lumina2_tokenizer"])
    assert single.llm.config == repo.llm.config  # the released head_dim, window, caps, RoPE; the tiny's sizes
    a, mask_a = repo.encode(CAPTIONS[:2], LUMINA2_SYSTEM_PROMPT)
    b, mask_b = single.encode(CAPTIONS[:2], LUMINA2_SYSTEM_PROMPT)
    assert torch.equal(a, b) and torch.equal(mask_a, mask_b)
    beside = load_lumina2_text_encoder(tiny["lumina2_gemma2_single_file"], dtype=torch.float32)  # lumina2/tokenizer/
    assert beside.token_rows(CAPTIONS[:2], None) == single.token_rows(CAPTIONS[:2], None)
    alone = tmp_path / "gemma.safetensors"
    shutil.copyfile(tiny["lumina2_gemma2_single_file"], alone)
    with pytest.raises(CheckpointError, match=r"no Gemma tokenizer found in"):
        load_lumina2_text_encoder(str(alone))


def test_lumina2_wrong_files_are_one_clear_error(tiny, tmp_path):
    from library.models.tiny_files import build_qwen3_tokenizer, save_tokenizer

    qwen = tmp_path / "qwen_tokenizer"
    save_tokenizer(build_qwen3_tokenizer(), str(qwen))
    with pytest.raises(CheckpointError, match=r"a Qwen2 tokenizer, given where Lumina Image 2.0 needs Gemma 2's"):
        load_lumina2_text_encoder(tiny["lumina2_text_encoder"], tokenizer=str(qwen))
    llama_like = tmp_path / "not_gemma.safetensors"  # a Llama-layout file: no post_feedforward_layernorm
    save_safetensors({"model.embed_tokens.weight": torch.zeros(8, 4),
                      "model.layers.0.self_attn.q_proj.weight": torch.zeros(4, 4)}, str(llama_like))
    with pytest.raises(CheckpointError, match=r"not_gemma.safetensors: no tensor for "
                                              r"model.layers.0.post_feedforward_layernorm.weight .*not a Gemma 2"):
        load_lumina2_text_encoder(str(llama_like), tokenizer=tiny["lumina2_tokenizer"])
    with pytest.raises(CheckpointError, match=r"missing.safetensors: no such file or folder"):
        load_lumina2_text_encoder(str(tmp_path / "missing.safetensors"))
    # a single file with another encoder's tokenizer/ beside it: that folder is skipped, named (Gemma's class says it)
    from library.models.text_encoders import tokenizer_kind

    assert tokenizer_kind(tiny["lumina2_tokenizer"]) == "Gemma"
    folder = tmp_path / "comfy" / "text_encoders"
    folder.mkdir(parents=True)
    shutil.copy(tiny["lumina2_gemma2_single_file"], folder / "gemma.safetensors")
    shutil.copytree(qwen, folder.parent / "tokenizer")
    with pytest.raises(CheckpointError, match=r"no Gemma tokenizer found in .*skipped .*tokenizer: a Qwen2 tokenizer"):
        load_lumina2_text_encoder(str(folder / "gemma.safetensors"))


def test_lumina2_text_weights_of_gemma2_2b():
    """Gemma-2-2B as loaded (embedding + 25 of 26 layers + the final norm's 2304, no head): 175 Linears in fp8."""
    weights = lumina2_text_weights()
    assert weights.params == 589_824_000 + 25 * 77_865_984 + 2304 == 2_536_475_904
    assert weights.fp8_weights == 25 * 77_856_768 == 1_946_419_200
    assert weights.fp8_scales == weights.fp8_weights // 64 == 30_412_800


def test_lumina2_encoder_needs_the_layer_it_reads(tiny):
    from library.models.llm import load_llm

    with pytest.raises(ValueError, match=r"hidden_states\[-2\] needs 2 decoder layers \(of 3\); 1 are loaded"):
        Lumina2TextEncoder(load_llm(tiny["lumina2_text_encoder"], keep_layers=1), tokenizer=None)


def test_a_gemma2_folder_trains_as_an_llm_lora(tiny, tmp_path):
    """train_lora.py --model_type llm on the tiny Gemma 2 (its text_encoder/ with the tokenizer copied in): 2 steps
    write a PEFT adapter over every attention and MLP Linear of its 3 layers, and the loss moves."""
    import shutil

    from safetensors import safe_open

    import train_lora

    base = tmp_path / "gemma2"
    shutil.copytree(tiny["lumina2_text_encoder"], base)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # model_type llm reads the tokenizer from the model folder
        shutil.copy(f"{tiny['lumina2_tokenizer']}/{name}", base / name)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" ".join(CAPTIONS[:2] * 200))
    out = tmp_path / "out"
    code = train_lora.main(["--model_type", "llm", "--pretrained_model_name_or_path", str(base), "--train_data",
                            str(corpus), "--output_dir", str(out), "--output_name", "g2", "--mixed_precision", "no",
                            "--max_length", "16", "--stride", "16", "--batch_size", "2", "--max_train_steps", "2",
                            "--eval_every_n_steps", "0", "--optimizer_type", "AdamW", "--learning_rate", "5e-2",
                            "--network_dim", "4"])
    assert code == 0
    with safe_open(str(out / "g2" / "adapter_model.safetensors"), "pt") as f:
        assert len([k for k in f.keys() if "lora_B" in k]) == 3 * 7
    losses = [float(line.split(",")[2]) for line in (out / "g2_log.csv").read_text().splitlines()[1:]]
    assert len(losses) == 2 and losses[1] != losses[0]
