"""Krea 2 prompt encoding: Qwen3-VL's language model on our LLM core against Krea2Pipeline.encode_prompt
(a tiny transformers Qwen3VLModel), the interleaved M-RoPE tables against transformers', the layouts."""

import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from library.io import CheckpointError
from library.models.core import mrope_tables, rope_tables
from library.models.krea2.text_encoder import KREA2_DROP_TOKENS, load_krea2_text_encoder
from library.models.krea2.tiny import TEXT_TAPS, write_krea2_text_encoder

PROMPTS = ["a photo of a cat sitting on a red chair", "a dog"]


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    return write_krea2_text_encoder(str(tmp_path_factory.mktemp("krea2_text")), 0)


def pipeline(tiny_files):
    from diffusers import FlowMatchEulerDiscreteScheduler, Krea2Pipeline
    from transformers import AutoTokenizer, Qwen3VLModel

    text_encoder = Qwen3VLModel.from_pretrained(tiny_files["krea2_text_encoder"]).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_files["krea2_tokenizer"])
    return Krea2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=None, text_encoder=text_encoder,
                         tokenizer=tokenizer, transformer=None, text_encoder_select_layers=TEXT_TAPS)


def test_encode_prompt_matches_pipeline(tiny_files):
    pipe = pipeline(tiny_files)
    with torch.no_grad():  # [B, 512, 3 taps, 32] with the pads in the middle, and the mask
        expected, expected_mask = pipe.encode_prompt(PROMPTS, device="cpu", max_sequence_length=40)
    ours = load_krea2_text_encoder(os.path.dirname(tiny_files["krea2_text_encoder"]), max_length=40)
    assert ours.taps == TEXT_TAPS and len(ours.llm.model.layers) == 3  # taps 1..3 of 4 layers: the 4th never loaded
    embeds, mask = ours.encode(PROMPTS)
    assert embeds.dtype == torch.float32 and mask.sum(1).tolist() == expected_mask.sum(1).tolist()
    real = [e[m] for e, m in zip(expected, expected_mask)]  # each prompt's real tokens, pads dropped
    assert embeds.shape == (2, real[0].shape[0], 3, 32) and real[0].shape[0] > real[1].shape[0]
    diffs = [(e[m] - r).abs().max().item() for e, m, r in zip(embeds, mask, real)]
    scale = real[0].abs().max().item()  # ~0.1: transformers' initialisation
    print(f"Krea 2 encode_prompt: max abs diff {max(diffs):.2e} (values up to {scale:.2e})")
    assert max(diffs) <= 1e-5 * scale and real[0].abs().mean() > 1e-3
    assert (embeds[1][~mask[1]] == 0).all()


def test_truncation_keeps_what_the_pipeline_keeps(tiny_files):
    """A prompt longer than max_sequence_length: the pipeline cuts prefix + prompt at 541 - 512 + L tokens
    and appends the suffix; the real tokens after the prefix are then exactly max_sequence_length."""
    long = " ".join(["a red chair by the sea"] * 12)
    pipe = pipeline(tiny_files)
    with torch.no_grad():
        expected, expected_mask = pipe.encode_prompt([long], device="cpu", max_sequence_length=24)
    ours = load_krea2_text_encoder(os.path.dirname(tiny_files["krea2_text_encoder"]), max_length=24)
    embeds, mask = ours.encode([long])
    assert int(mask.sum()) == int(expected_mask.sum()) == 24
    assert (embeds[0] - expected[0][expected_mask[0]]).abs().max() <= 1e-5 * expected.abs().max()


def test_interleaved_mrope_is_transformers_and_text_is_1d_rope():
    """core.mrope_tables(interleaved=True) against Qwen3-VL's rotary embedding on unequal (image-like)
    positions; on equal ones (text) it is plain 1-D RoPE, which is what the encoder runs."""
    from transformers import Qwen3VLTextConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    sections, head_dim, theta = (24, 20, 20), 128, 5000000.0
    config = Qwen3VLTextConfig(hidden_size=256, num_attention_heads=2, head_dim=head_dim,
                               rope_parameters={"rope_type": "default", "mrope_section": list(sections),
                                                "mrope_interleaved": True, "rope_theta": theta})
    rotary = Qwen3VLTextRotaryEmbedding(config)
    g = torch.Generator().manual_seed(0)
    positions = torch.randint(0, 300, (3, 1, 17), generator=g)  # (t, h, w) ids
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions)  # [1, 17, 128]: halves repeated
    ours_cos, ours_sin = mrope_tables(positions.permute(1, 2, 0), head_dim, theta, sections, interleaved=True)
    assert (ours_cos - cos[..., :64]).abs().max() <= 2e-4 and (ours_sin - sin[..., :64]).abs().max() <= 2e-4
    contiguous, _ = mrope_tables(positions.permute(1, 2, 0), head_dim, theta, sections)
    assert (contiguous - cos[..., :64]).abs().max() > 0.1  # the layouts differ: the test can tell them apart
    text = torch.arange(40)[None, :, None].expand(1, 40, 3)
    assert torch.equal(mrope_tables(text, head_dim, theta, sections, interleaved=True)[0],
                       rope_tables(torch.arange(40)[None], (head_dim,), theta)[0])


def test_single_file_and_taps(tiny_files, tmp_path):
    """A single file in Qwen3-VL's HF layout (model.language_model.*, model.visual.*) with its config and
    tokenizer beside it loads the same weights; the taps come from model_index.json or the caller."""
    folder = os.path.dirname(tiny_files["krea2_text_encoder"])
    reference = load_krea2_text_encoder(folder)
    single_dir = tmp_path / "qwen3vl"
    single_dir.mkdir()
    sd = load_file(os.path.join(tiny_files["krea2_text_encoder"], "model.safetensors"))
    save_file({"model." + k: v for k, v in sd.items()}, str(single_dir / "qwen3vl_tiny.safetensors"))
    for name in ("config.json",):
        (single_dir / name).write_text(open(os.path.join(tiny_files["krea2_text_encoder"], name)).read())
    single = load_krea2_text_encoder(str(single_dir / "qwen3vl_tiny.safetensors"), tokenizer=tiny_files["krea2_tokenizer"],
                                     taps=TEXT_TAPS)
    a, b = reference.llm.state_dict(), single.llm.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert load_krea2_text_encoder(folder, taps=(0, 4)).encode(["a cat"])[0].shape[2] == 2  # the final state too
    alone = str(tmp_path / "alone.safetensors")
    save_file({"model.language_model.embed_tokens.weight": torch.zeros(8, 32)}, alone)
    with pytest.raises(CheckpointError, match=r"alone\.safetensors: embedding width 32 is not Qwen3-VL-4B's \(2560\)"):
        load_krea2_text_encoder(alone, tokenizer=tiny_files["krea2_tokenizer"])
    assert KREA2_DROP_TOKENS == 34


def test_the_family_checks_its_taps_against_the_transformer_where_there_is_one(tiny_files, tmp_path):
    """Krea2Family's text encoder taps as many layers as the transformer's text fusion takes, else one line naming
    the transformer file; with no transformer file yet (tools/pretrain_tiny_base.py encodes the captions of the
    base it is about to train) the encoder taps model_index.json's layers."""
    import json
    from pathlib import Path

    from library.models.krea2.family import Krea2Family
    from library.models.krea2.tiny import write_krea2

    folder = os.path.dirname(tiny_files["krea2_text_encoder"])
    transformer = str(tmp_path / "krea2-tiny.safetensors")
    os.replace(write_krea2(str(tmp_path / "written"), 0)["krea2"], transformer)
    family = Krea2Family(transformer, None, text_encoder=tiny_files["krea2_text_encoder"])
    embeds = family.load_text_encoder("fp32", torch.device("cpu"))(["a cat"])[0]["embeds"]
    assert embeds.shape[1] == len(TEXT_TAPS)
    index = Path(folder) / "model_index.json"
    released = index.read_text()
    try:
        index.write_text(json.dumps({**json.loads(released), "text_encoder_select_layers": [1, 2]}))
        with pytest.raises(ValueError, match=rf"{transformer}: the transformer takes 3 text layers per token, the "
                                             r"text encoder taps 2 \(\[1, 2\]: model_index.json or Krea 2's\)"):
            Krea2Family(transformer, None, text_encoder=tiny_files["krea2_text_encoder"]).load_text_encoder("fp32")
        before = Krea2Family(str(tmp_path / "not_yet.safetensors"), None, text_encoder=tiny_files["krea2_text_encoder"])
        assert before.load_text_encoder("fp32", torch.device("cpu"))(["a cat"])[0]["embeds"].shape[1] == 2
    finally:
        index.write_text(released)
