"""HiDream-I1's prompt encoding (library/models/hidream/text_encoder.py) on the tiny files (tiny_text.py): equal to
diffusers' HiDreamImagePipeline.encode_prompt run with transformers' CLIPTextModelWithProjection x 2, T5EncoderModel,
LlamaForCausalLM and the tokenizers (captions of different lengths, one over 128 tokens for every tokenizer, the empty
negative prompt); ComfyUI's single files give the same; the masks, hidden_states[1:] and the llama3 rope scaling are
what the parity rests on; the errors; the planner's counts."""

import logging
import os

import pytest
import torch

from library.io import CheckpointError
from library.models.hidream.text_encoder import (
    HiDreamTextEncoder, hidream_text_weights, load_hidream_text_encoders, load_llama_tokenizer,
)

CAPTIONS = [
    "a photo of a cat sitting on a red chair",
    "a dog",
    "a painting of a house by the sea at sunset, oil on canvas " * 30,  # > 128 tokens for each of the four
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from library.models.hidream.tiny_text import write_hidream_text_encoders

    return write_hidream_text_encoders(str(tmp_path_factory.mktemp("tiny")), seed=0)


@pytest.fixture(scope="module")
def reference(tiny):
    """diffusers' pipeline around transformers' models of the tiny folders (no transformer, VAE or scheduler)."""
    from diffusers import HiDreamImagePipeline
    from transformers import AutoTokenizer, CLIPTextModelWithProjection, LlamaForCausalLM, T5EncoderModel

    def tokenizer(key):
        return AutoTokenizer.from_pretrained(tiny[key])

    return HiDreamImagePipeline(
        scheduler=None, vae=None, transformer=None,
        text_encoder=CLIPTextModelWithProjection.from_pretrained(tiny["hidream_clip_l"]).eval(),
        tokenizer=tokenizer("hidream_tokenizer"),
        text_encoder_2=CLIPTextModelWithProjection.from_pretrained(tiny["hidream_clip_g"]).eval(),
        tokenizer_2=tokenizer("hidream_tokenizer_2"),
        text_encoder_3=T5EncoderModel.from_pretrained(tiny["hidream_t5xxl"]).eval(),
        tokenizer_3=tokenizer("hidream_tokenizer_3"),
        text_encoder_4=LlamaForCausalLM.from_pretrained(tiny["hidream_llama"]).eval(),
        tokenizer_4=tokenizer("hidream_llama"))


@pytest.fixture(scope="module")
def expected(reference):
    """encode_prompt's (t5 [B, 128, D], llama [layers, B, 128, D], pooled [B, P]) for CAPTIONS, then for the empty
    negative prompt (its default)."""
    quiet = logging.getLogger("diffusers.pipelines.hidream_image.pipeline_hidream_image")
    level, quiet.level = quiet.level, logging.ERROR  # its warnings print every cut token of the long caption
    try:
        with torch.no_grad():
            t5, negative_t5, llama, negative_llama, pooled, negative_pooled = reference.encode_prompt(
                CAPTIONS, device=torch.device("cpu"), do_classifier_free_guidance=True)
    finally:
        quiet.level = level
    return (torch.cat([t5, negative_t5[:1]]), torch.cat([llama, negative_llama[:, :1]], dim=1),
            torch.cat([pooled, negative_pooled[:1]]))


@pytest.fixture(scope="module")
def folder_encoder(tiny):
    root = os.path.dirname(tiny["hidream_clip_l"])  # the repo: each CLIP's / T5's component folder is found in it
    return load_hidream_text_encoders(root, root, root, tiny["hidream_llama"], dtype=torch.float32)


def stacked(encoder: HiDreamTextEncoder, captions: list[str]) -> tuple[torch.Tensor, ...]:
    ours = encoder.encode(captions)
    assert all(v.dtype == torch.float32 for o in ours for v in o.values())
    return (torch.stack([o["t5"] for o in ours]), torch.stack([o["llama"] for o in ours], dim=1),
            torch.stack([o["pooled"] for o in ours]))


def largest_differences(ours, expected) -> list[float]:
    return [(a - b).abs().max().item() for a, b in zip(ours, expected)]


def test_hidream_encode_matches_diffusers_encode_prompt_fp32(folder_encoder, reference, expected):
    for tokenizer in (reference.tokenizer, reference.tokenizer_2, reference.tokenizer_3, reference.tokenizer_4):
        assert len(tokenizer(CAPTIONS[2]).input_ids) > 128  # the long caption is cut by each
    ours = stacked(folder_encoder, CAPTIONS + [""])
    assert ours[0].shape == expected[0].shape == (4, 128, 64)
    assert ours[1].shape == expected[1].shape == (3, 4, 128, 64)  # hidden_states[1:] of the 3 layers
    assert ours[2].shape == expected[2].shape == (4, 64)
    assert folder_encoder.llama_layers == 3
    t5_diff, llama_diff, pooled_diff = largest_differences(ours, expected)
    assert t5_diff <= 1e-5 and llama_diff <= 1e-5 and pooled_diff <= 1e-5, (t5_diff, llama_diff, pooled_diff)


def test_hidream_single_files_give_the_folders_states(tiny, expected):
    """ComfyUI's files: CLIPs' configs and tokenizers from the repo folders beside text_encoders/, T5's likewise,
    Llama's config shaped from its tensors (Llama-3.1-8B's head_dim, RoPE and epsilon) and its tokenizer given."""
    single = load_hidream_text_encoders(tiny["hidream_clip_l_single"], tiny["hidream_clip_g_single"],
                                        tiny["hidream_t5xxl_single"], tiny["hidream_llama_single"], dtype=torch.float32,
                                        llama_tokenizer=tiny["hidream_llama"])
    assert single.llama.config.rope_scaling.rope_type == "llama3" and single.llama.config.head_dim == 128
    assert single.clip_l.model.config.max_position_embeddings == 248  # read from the file's position embedding
    diffs = largest_differences(stacked(single, CAPTIONS + [""]), expected)
    assert max(diffs) <= 1e-5, diffs


def test_hidream_parity_rests_on_masks_layers_and_rope_scaling(folder_encoder, expected):
    """Each step the pipeline takes changes the states by far more than the parity's 1e-5: Llama without its mask,
    with hidden_states[0] (the embeddings) and without the last layer, without the llama3 rope scaling; T5 without
    its mask."""
    import dataclasses

    captions = CAPTIONS[:2]
    llama = folder_encoder.llama
    tokens = folder_encoder.llama_tokenizer(captions, padding="max_length", max_length=128, return_tensors="pt")
    positions = torch.arange(128)
    with torch.no_grad():
        unmasked = torch.stack(llama.selected_hidden_states(tokens.input_ids, None, (1, 2, 3), positions))
        shifted = torch.stack(llama.selected_hidden_states(tokens.input_ids, tokens.attention_mask, (0, 1, 2),
                                                           positions))
        released = llama.config
        llama.config = dataclasses.replace(released, rope_scaling=None)  # the RoPE tables are cached per config
        try:
            plain_rope = torch.stack(llama.selected_hidden_states(tokens.input_ids, tokens.attention_mask, (1, 2, 3),
                                                                  positions))
        finally:
            llama.config = released
    t5_unmasked = folder_encoder.t5.encode(captions, 128, masked=False)
    want_llama, want_t5 = expected[1][:, :2], expected[0][:2]
    wrong = {"llama unmasked": (unmasked - want_llama).abs().max().item(),
             "llama hidden_states[:-1]": (shifted - want_llama).abs().max().item(),
             "llama without rope scaling": (plain_rope - want_llama).abs().max().item(),
             "t5 unmasked": (t5_unmasked - want_t5).abs().max().item()}
    assert min(wrong.values()) > 1e-4, wrong  # measured: 3.2, 3.5, 1.3e-3 (positions < 128 turn the scaled
    # low frequencies little), 4.2
    diffs = largest_differences(stacked(folder_encoder, captions), (want_t5, want_llama, expected[2][:2]))
    assert max(diffs) <= 1e-5, diffs  # the config restored


def test_hidream_text_errors_name_the_file(tiny):
    root = os.path.dirname(tiny["hidream_clip_l"])
    with pytest.raises(CheckpointError, match=r"no Llama tokenizer found .*put the Llama tokenizer's files"):
        load_hidream_text_encoders(root, root, root, tiny["hidream_llama_single"], dtype=torch.float32)
    with pytest.raises(CheckpointError, match=r"a CLIP tokenizer, given where HiDream-I1 needs Llama 3.1's"):
        load_llama_tokenizer(tiny["hidream_llama_single"], tiny["hidream_tokenizer"])
    with pytest.raises(CheckpointError, match=r"t5xxl.safetensors: no tensor for model.embed_tokens.weight .*not a "
                                              r"Llama text encoder"):
        load_hidream_text_encoders(root, root, root, tiny["hidream_t5xxl_single"], dtype=torch.float32,
                                   llama_tokenizer=tiny["hidream_llama"])
    with pytest.raises(CheckpointError, match=r"t5xxl.safetensors: not a CLIP-L checkpoint: no "
                                              r"'text_model.final_layer_norm.weight'"):
        load_hidream_text_encoders(tiny["hidream_t5xxl_single"], root, root, tiny["hidream_llama"])


def test_hidream_text_weights_counts_the_released_encoders_on_meta(tiny):
    clip_l, clip_g, t5, llama = hidream_text_weights()
    assert (clip_l.params, clip_g.params) == (123_781_632, 694_878_720)  # 248 positions, projections included
    assert clip_l.fp8_weights == clip_g.fp8_weights == 0
    assert (t5.params, t5.fp8_weights, t5.fp8_scales) == (4_762_310_656, 3_623_878_656, 56_623_104)
    assert (llama.params, llama.fp8_weights, llama.fp8_scales) == (7_504_924_672, 6_979_321_856, 109_051_904)
    tiny_weights = hidream_text_weights(tiny["hidream_clip_l_single"], tiny["hidream_clip_g_single"],
                                        tiny["hidream_t5xxl_single"], tiny["hidream_llama_single"])
    from library.io import CheckpointReader

    llama_file = CheckpointReader(tiny["hidream_llama_single"])
    assert tiny_weights[3].params == llama_file.numel([k for k in llama_file.keys() if k != "lm_head.weight"])


def test_hidream_comfyui_scaled_fp8_llama_encodes_as_its_dequantized_twin(tiny, tmp_path):
    """llama_3.1_8b_instruct_fp8_scaled's layout (`scaled_fp8` marker, e4m3 codes with a 0-dim float32 `scale_weight`
    per decoder Linear): loaded at fp32 it is dequantized as ComfyUI computes (codes * scale), so its Llama states equal
    those of a file holding those products (max |diff| 0), and differ from the unquantized file's."""
    from library.io import CheckpointReader, save_safetensors
    from library.models.hidream.text_encoder import load_hidream_llama

    source = dict(CheckpointReader(tiny["hidream_llama_single"]).items())
    stored, twin = {"scaled_fp8": torch.empty(0, dtype=torch.float8_e4m3fn)}, {}
    for key, weight in source.items():
        if key.startswith("model.layers.") and key.endswith("proj.weight"):
            scale = weight.abs().amax() / 448.0 * 1.5  # float32, 0-dim; the codes do not reach 448
            stored[key] = (weight / scale).to(torch.float8_e4m3fn)
            stored[key.removesuffix("weight") + "scale_weight"] = scale
            twin[key] = stored[key].float() * scale
        else:
            stored[key] = twin[key] = weight
    save_safetensors(stored, str(tmp_path / "llama_fp8_scaled.safetensors"))
    save_safetensors(twin, str(tmp_path / "llama_twin.safetensors"))
    tokenizer = load_llama_tokenizer(tiny["hidream_llama"])
    states = {name: HiDreamTextEncoder(None, None, None, load_hidream_llama(str(tmp_path / name)), tokenizer)
              .llama_states(CAPTIONS) for name in ("llama_fp8_scaled.safetensors", "llama_twin.safetensors")}
    full = HiDreamTextEncoder(None, None, None, load_hidream_llama(tiny["hidream_llama_single"]), tokenizer)
    assert (states["llama_fp8_scaled.safetensors"] - states["llama_twin.safetensors"]).abs().max().item() == 0
    assert (states["llama_twin.safetensors"] - full.llama_states(CAPTIONS)).abs().max().item() > 1e-4
