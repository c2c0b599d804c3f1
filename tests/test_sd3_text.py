"""Stable Diffusion 3's prompt encoding (library/models/sd3/text_encoder.py) on the tiny files (tiny_text.py): equal
to diffusers' StableDiffusion3Pipeline.encode_prompt run with transformers' CLIPTextModelWithProjection x 2,
T5EncoderModel and the tokenizers (captions of different lengths, one over 77 CLIP and 256 T5 tokens, the empty
negative prompt), without T5 too; SAI's single files and the full checkpoint give the same; the second-to-last
layer and CLIP-G's own pad token are what the parity rests on; the errors; the planner's counts."""

import os
import shutil

import pytest
import torch

from library.io import CheckpointError
from library.models.sd3.text_encoder import (
    CLIP_G_FILES, SD3TextEncoder, join_sd3_context, load_sd3_clip, load_sd3_text_encoders, sd3_caption_token_limit,
    sd3_text_weights,
)
from library.models.text_encoders import CLIPPenultimateEncoder

CAPTIONS = [
    "a photo of a cat sitting on a red chair",
    "a dog",
    "a painting of a house by the sea at sunset, oil on canvas " * 30,  # > 77 CLIP tokens, > 256 T5 tokens
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from library.models.sd3.tiny_text import write_sd3_text_encoders

    return write_sd3_text_encoders(str(tmp_path_factory.mktemp("tiny")), seed=0)


@pytest.fixture(scope="module")
def reference(tiny):
    """diffusers' pipeline around transformers' models of the tiny folders (no transformer, VAE or scheduler)."""
    from diffusers import StableDiffusion3Pipeline
    from transformers import AutoTokenizer, CLIPTextModelWithProjection, T5EncoderModel

    def tokenizer(key):
        return AutoTokenizer.from_pretrained(tiny[key])

    return StableDiffusion3Pipeline(
        transformer=None, scheduler=None, vae=None,
        text_encoder=CLIPTextModelWithProjection.from_pretrained(tiny["sd3_clip_l"]).eval(),
        tokenizer=tokenizer("sd3_tokenizer"),
        text_encoder_2=CLIPTextModelWithProjection.from_pretrained(tiny["sd3_clip_g"]).eval(),
        tokenizer_2=tokenizer("sd3_tokenizer_2"),
        text_encoder_3=T5EncoderModel.from_pretrained(tiny["sd3_t5xxl"]).eval(),
        tokenizer_3=tokenizer("sd3_tokenizer_3"))


@pytest.fixture(scope="module")
def expected(reference):
    """encode_prompt's (context, pooled) for CAPTIONS, then for the empty negative prompt (its default)."""
    with torch.no_grad():
        context, negative, pooled, negative_pooled = reference.encode_prompt(
            CAPTIONS, None, None, device=torch.device("cpu"), do_classifier_free_guidance=True)
    return torch.cat([context, negative[:1]]), torch.cat([pooled, negative_pooled[:1]])


@pytest.fixture(scope="module")
def folder_encoder(tiny):
    root = os.path.dirname(tiny["sd3_clip_l"])  # the repo: each encoder's component folder is found in it
    return load_sd3_text_encoders(root, root, root, dtype=torch.float32)


def largest_difference(encoder: SD3TextEncoder, expected) -> tuple[float, float]:
    ours = encoder.encode(CAPTIONS + [""])
    context = torch.stack([o["context"] for o in ours])
    pooled = torch.stack([o["pooled"] for o in ours])
    assert context.dtype == pooled.dtype == torch.float32
    assert context.shape == expected[0].shape == (4, 77 + 256, 64) and pooled.shape == expected[1].shape == (4, 64)
    return (context - expected[0]).abs().max().item(), (pooled - expected[1]).abs().max().item()


def test_sd3_encode_matches_diffusers_encode_prompt_fp32(folder_encoder, reference, expected):
    for tokenizer, limit in ((reference.tokenizer, 77), (reference.tokenizer_2, 77), (reference.tokenizer_3, 256)):
        assert len(tokenizer(CAPTIONS[2]).input_ids) > limit  # the long caption is cut by each
    context_diff, pooled_diff = largest_difference(folder_encoder, expected)
    assert context_diff <= 1e-5 and pooled_diff <= 1e-5, (context_diff, pooled_diff)


def test_sd3_single_files_and_full_checkpoint_match_the_folders(tiny, expected):
    from library.io import CheckpointReader

    projection = CheckpointReader(tiny["sd3_clip_l_single"]).get("text_projection.weight")
    assert (projection - torch.eye(projection.shape[0])).abs().max() > 0.1  # identity only if the loader makes it
    singles = load_sd3_text_encoders(tiny["sd3_clip_l_single"], tiny["sd3_clip_g_single"], tiny["sd3_t5xxl_single"],
                                     dtype=torch.float32)
    bundled = tiny["sd3_text_bundled"]
    for encoder in (singles, load_sd3_text_encoders(bundled, bundled, bundled, dtype=torch.float32)):
        context_diff, pooled_diff = largest_difference(encoder, expected)
        assert context_diff <= 1e-5 and pooled_diff <= 1e-5, (context_diff, pooled_diff)


def test_sd3_without_t5_matches_diffusers_zeros(tiny, reference, expected):
    from types import SimpleNamespace

    reference.text_encoder_3 = None  # restored below: the module's other tests share the pipeline
    reference.transformer = SimpleNamespace(config=SimpleNamespace(joint_attention_dim=64))
    try:
        with torch.no_grad():
            context, _, pooled, _ = reference.encode_prompt(CAPTIONS, None, None, device=torch.device("cpu"),
                                                            do_classifier_free_guidance=True)
    finally:
        reference.text_encoder_3, reference.transformer = expected_t5(tiny), None
    encoder = load_sd3_text_encoders(tiny["sd3_clip_l"], tiny["sd3_clip_g"], None, dtype=torch.float32,
                                     context_width=64)
    assert encoder.t5 is None and len(encoder.models) == 2
    context_ours, pooled_ours = encoder.encode_batch(CAPTIONS)
    assert context_ours.shape == context.shape == (3, 77 + 256, 64) and not context_ours[:, 77:].any()
    assert (context_ours - context).abs().max() <= 1e-5 and (pooled_ours - pooled).abs().max() <= 1e-5


def expected_t5(tiny):
    from transformers import T5EncoderModel

    return T5EncoderModel.from_pretrained(tiny["sd3_t5xxl"]).eval()


def test_sd3_reads_the_second_to_last_layer(folder_encoder, expected, monkeypatch):
    """The parity above fails by far when the last layer's states are taken instead."""

    @torch.no_grad()
    def last_layer(self, prompts):
        ids = self.tokenizer(prompts, padding="max_length", max_length=77, truncation=True, return_tensors="pt")
        out = self.model(ids.input_ids, output_hidden_states=True)
        return out.hidden_states[-1].float(), out.text_embeds.float()

    monkeypatch.setattr(CLIPPenultimateEncoder, "encode", last_layer)
    context_diff, pooled_diff = largest_difference(folder_encoder, expected)
    assert context_diff > 0.1 and pooled_diff <= 1e-5, (context_diff, pooled_diff)  # pooled: the final layer


def test_sd3_clip_g_pads_with_its_own_token(tiny, folder_encoder, expected, tmp_path):
    """CLIP-G padded with CLIP-L's pad (its EOT) changes the 77 states after each caption's EOT: the loader refuses
    such a tokenizer, and the parity would fail by far."""
    assert folder_encoder.clip_g.tokenizer.pad_token_id == 0 and folder_encoder.clip_l.tokenizer.pad_token_id != 0
    tokenizer = folder_encoder.clip_g.tokenizer
    tokenizer.pad_token = folder_encoder.clip_l.tokenizer.pad_token
    try:
        context_diff, _ = largest_difference(folder_encoder, expected)
    finally:
        tokenizer.pad_token = "!"
    assert context_diff > 0.1, context_diff

    repo = tmp_path / "repo"
    shutil.copytree(os.path.dirname(tiny["sd3_clip_g"]), repo)
    shutil.rmtree(repo / "tokenizer_2")
    shutil.copytree(tiny["sd3_tokenizer"], repo / "tokenizer_2")  # CLIP-L's tokenizer as tokenizer_2/
    with pytest.raises(CheckpointError, match=r"tokenizer_2: CLIP-G's tokenizer pads with '<\|endoftext\|>'"):
        load_sd3_clip(str(repo), CLIP_G_FILES)


def test_sd3_text_errors_name_the_file(tiny, tmp_path):
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(tiny["sd3_clip_g_single"], alone / "clip_g.safetensors")
    with pytest.raises(CheckpointError, match=r"no CLIP tokenizer found in .*put the CLIP tokenizer's files"):
        load_sd3_clip(str(alone / "clip_g.safetensors"), CLIP_G_FILES)
    t5 = tiny["sd3_t5xxl_single"]
    with pytest.raises(CheckpointError, match=r"t5xxl.safetensors: not a CLIP-G checkpoint: no "
                                              r"'text_model.final_layer_norm.weight'"):
        load_sd3_text_encoders(tiny["sd3_clip_l"], t5, t5)
    with pytest.raises(CheckpointError, match=r"text_encoder_2: not a T5-XXL checkpoint"):
        load_sd3_text_encoders(tiny["sd3_clip_l"], tiny["sd3_clip_g"], tiny["sd3_clip_g"])
    with pytest.raises(CheckpointError, match=r"nowhere: no such file or folder \(the CLIP-L text encoder\)"):
        load_sd3_text_encoders(str(tmp_path / "nowhere"), tiny["sd3_clip_g"], None)


def test_join_sd3_context_pads_the_clips_with_zeros_to_t5_width():
    clip_l, clip_g, t5 = torch.randn(2, 77, 3), torch.randn(2, 77, 5), torch.randn(2, 10, 16)
    joined = join_sd3_context(clip_l, clip_g, t5)
    assert joined.shape == (2, 87, 16) and torch.equal(joined[:, 77:], t5)
    assert torch.equal(joined[:, :77, :3], clip_l) and torch.equal(joined[:, :77, 3:8], clip_g)
    assert not joined[:, :77, 8:].any()
    with pytest.raises(ValueError, match="CLIP-L \\+ CLIP-G width 8 exceeds T5's 6"):
        join_sd3_context(clip_l, clip_g, torch.randn(2, 10, 6))


def test_sd3_text_weights_count_what_the_loader_keeps(tiny, folder_encoder):
    released = sd3_text_weights()
    assert [w.params for w in released] == [123_650_304, 694_659_840, 4_762_310_656]
    assert released[0].fp8_weights == released[1].fp8_weights == 0  # the CLIPs stay bf16 under fp8
    assert released[2].fp8_weights == 3_623_878_656 and released[2].fp32_in_fp16 == 1_006_632_960
    assert len(sd3_text_weights(with_t5=False)) == 2
    for paths in ((tiny["sd3_clip_l"], tiny["sd3_clip_g"], tiny["sd3_t5xxl"]),
                  (tiny["sd3_clip_l_single"], tiny["sd3_clip_g_single"], tiny["sd3_t5xxl_single"])):
        counted = [w.params for w in sd3_text_weights(*paths)]
        # once per storage: T5's `shared` and encoder.embed_tokens are one tensor in two Parameters
        loaded = [sum({p.data_ptr(): p.numel() for p in m.parameters()}.values()) for m in folder_encoder.models]
        assert counted == loaded, (counted, loaded)


def test_sd3_caption_token_limit_counts_t5_tokens_of_each_layout(tiny, reference):
    for path in (os.path.dirname(tiny["sd3_t5xxl"]), tiny["sd3_t5xxl_single"], tiny["sd3_text_bundled"]):
        limit = sd3_caption_token_limit(path)
        assert limit.encoder == "T5-XXL" and limit.max_tokens == 256
        assert limit.count(CAPTIONS[2]) == len(reference.tokenizer_3(CAPTIONS[2]).input_ids) > 256


def test_sd3_encoders_taking_turns_give_the_resident_outputs(tiny, folder_encoder):
    """one_at_a_time (a card that cannot hold the three): CLIP-L stays, CLIP-G then T5-XXL come in for their own
    stage and leave after it; the outputs are the resident encoders' bit for bit."""
    root = os.path.dirname(tiny["sd3_clip_l"])
    encoder = load_sd3_text_encoders(root, root, root, dtype=torch.float32)
    encoder.place("cpu", one_at_a_time=True)
    turns, resident = (e.encode(CAPTIONS) for e in (encoder, folder_encoder))
    assert all(torch.equal(a[k], b[k]) for a, b in zip(turns, resident) for k in ("context", "pooled"))
    assert list(encoder.placement.swap.log) == [("load", 1), ("release", 1), ("load", 2), ("release", 2)]
    assert encoder.t5.model.shared.weight.numel() == 0 < encoder.clip_l.model.text_model.embeddings.position_ids.numel()
