"""Nucleus-Image's prompt encoding (library/models/nucleus_image/text_encoder.py) equals diffusers'
NucleusMoEImagePipeline.encode_prompt on a tiny Qwen3VLForConditionalGeneration of 33 layers (hidden_states[-8] is
state 26, a layer's output: not the final norm's) saved in the pipeline's layout (text_encoder/ + processor/: the
processor's files, with no padding_side in tokenizer_config.json, as the released one), built by FLUX.3's tiny
Qwen3-VL writer; single files and the planner's text weights at the released size from header-only (sparse)
files."""

import json
import os
import shutil

import pytest
import torch

from library.models.nucleus_image.text_encoder import NUCLEUS_NEGATIVE_PROMPT, load_nucleus_text_encoder

LAYERS = 33  # flux3.tiny.TEXT_LAYERS
MAX_LENGTH = 176  # a multiple of 8 (the processor refuses others); the system prompt alone is 161 tiny tokens
SHORT = "a red cat"
MEDIUM = "a photo of a cat sitting on a red chair"
LONG = " ".join([MEDIUM] * 3)
PROMPTS = [SHORT, NUCLEUS_NEGATIVE_PROMPT, LONG, MEDIUM]  # 164, 161, 176 (191 cut), 171 tokens


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    from library.models.flux3.tiny import write_qwen3_vl_text_encoder

    out = str(tmp_path_factory.mktemp("nucleus_text"))
    write_qwen3_vl_text_encoder(os.path.join(out, "text_encoder"), os.path.join(out, "processor"), 0)
    return out


@pytest.fixture(scope="module")
def pipe(root):
    """NucleusMoEImagePipeline with only its text side: transformers' model and the processor (fp32)."""
    from diffusers import NucleusMoEImagePipeline
    from transformers import Qwen3VLForConditionalGeneration, Qwen3VLProcessor

    from tests.test_vlm_inputs import processor_without_video

    model = Qwen3VLForConditionalGeneration.from_pretrained(os.path.join(root, "text_encoder")).eval()
    processor = processor_without_video(Qwen3VLProcessor, os.path.join(root, "processor"))
    processor.chat_template = processor.tokenizer.chat_template  # tokenizer_config.json's (no video check needed)
    return NucleusMoEImagePipeline(transformer=None, scheduler=None, vae=None, text_encoder=model, processor=processor)


def reference(pipe, prompts, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """encode_prompt's (embeds [B, T8, D] float32, mask [B, T8] bool; all True where it returns None)."""
    with torch.no_grad():
        embeds, mask = pipe.encode_prompt(prompts, torch.device("cpu"), max_sequence_length=MAX_LENGTH, **kwargs)
    return embeds, torch.ones(embeds.shape[:2], dtype=torch.bool) if mask is None else mask.bool()


def real_token_diff(ours, theirs, ours_mask, their_mask) -> float:
    """Max |ours - theirs| over the real tokens, both layouts right-padded with the same real tokens first."""
    counts = ours_mask.sum(-1).tolist()
    assert their_mask.sum(-1).tolist() == counts
    assert all(their_mask[i, :n].all() and ours_mask[i, :n].all() for i, n in enumerate(counts))
    return max((ours[i, :n] - theirs[i, :n]).abs().max().item() for i, n in enumerate(counts))


def test_prompt_embeds_match_diffusers_fp32(root, pipe):
    """The batch of 4 (164, 161, 176 = 191 cut at max_sequence_length, 171 real tokens; the pipeline pads all to 176)
    and each prompt alone (padded to 168, 168, 176, 176): max |diff| <= 1e-5 on the real tokens (measured 1.0e-7 in the
    batch and alone, on values up to 0.33; hidden state -7 or -9 instead: 6.4e-2, 3.3e-2), the same token ids, zeros
    and mask False past each prompt."""
    from diffusers.pipelines.nucleusmoe_image.pipeline_nucleusmoe_image import DEFAULT_SYSTEM_PROMPT

    from library.models.nucleus_image.text_encoder import NUCLEUS_SYSTEM_PROMPT

    encoder = load_nucleus_text_encoder(root, max_length=MAX_LENGTH)
    assert NUCLEUS_SYSTEM_PROMPT == DEFAULT_SYSTEM_PROMPT
    assert encoder.layer == LAYERS - 7 and len(encoder.llm.model.layers) == LAYERS - 7 and encoder.llm.lm_head is None
    embeds, mask = encoder.encode(PROMPTS)
    assert embeds.dtype == torch.float32 and embeds.shape == (4, MAX_LENGTH, 32) and mask.dtype == torch.bool
    assert mask.sum(-1).tolist() == [164, 161, MAX_LENGTH, 171] and embeds[~mask].abs().max().item() == 0

    formatted = [pipe._format_prompt(p) for p in PROMPTS]
    ids = pipe.processor(text=formatted, padding="longest", pad_to_multiple_of=8, max_length=MAX_LENGTH,
                         truncation=True, return_tensors="pt")
    assert ids.input_ids.shape[1] == 176 and [r[m.bool()].tolist() for r, m in zip(ids.input_ids, ids.attention_mask)] \
        == encoder.token_ids(PROMPTS)
    theirs, their_mask = reference(pipe, PROMPTS)
    assert theirs.shape[1] == 176 and theirs.dtype == torch.float32
    batch = real_token_diff(embeds, theirs, mask, their_mask)
    alone, lengths = 0.0, []
    for prompt in PROMPTS:
        one, one_mask = reference(pipe, [prompt])
        lengths.append(one.shape[1])
        ours, ours_mask = encoder.encode([prompt])
        alone = max(alone, real_token_diff(ours, one, ours_mask, one_mask))
    scale = theirs[their_mask].abs().max().item()
    print(f"Nucleus-Image prompt_embeds, hidden state -8: max |ours - diffusers| batch {batch:.2e}, one prompt "
          f"{alone:.2e} (values up to {scale:.2f})")
    assert lengths == [168, 168, 176, 176] and batch <= 1e-5 and alone <= 1e-5 and scale > 0.1


def collated_cache(encoder, prompts) -> dict[str, torch.Tensor]:
    """Each caption encoded alone and cached as its real tokens ({"embeds": [n, D], "mask": [n]}), collated as the
    trainer's collate_batch pads text: zeros and mask False at the end, to the batch's longest."""
    from library.data.dataset import collate_batch

    cached = [dict(zip(("embeds", "mask"), (t[0] for t in encoder.encode([p])))) for p in prompts]
    return collate_batch([{"image_path": p, "key": p, "caption": p, "bucket": (64, 64), "text": c}
                          for p, c in zip(prompts, cached)])["text"]


def test_cached_captions_collate_to_the_pipelines_batch(root, pipe):
    """Captions of 164, 161 and 171 tokens cached apart and collated (171 long): the pipeline's batch on every real
    token, and its mask (176 long) is the collated one extended by False to its multiple of 8."""
    prompts = [SHORT, NUCLEUS_NEGATIVE_PROMPT, MEDIUM]
    text = collated_cache(load_nucleus_text_encoder(root, max_length=MAX_LENGTH), prompts)
    theirs, their_mask = reference(pipe, prompts)
    assert text["mask"].shape == (3, 171) and their_mask.shape == (3, 176)
    assert torch.equal(torch.cat([text["mask"], text["mask"].new_zeros(3, 5)], dim=1), their_mask)
    diff = real_token_diff(text["embeds"], theirs, text["mask"], their_mask)
    print(f"Nucleus-Image cached captions collated vs the pipeline's batch: max |diff| {diff:.2e}")
    assert diff <= 1e-5


def left_padded(pipe, prompts) -> tuple[torch.Tensor, torch.Tensor]:
    """encode_prompt with the processor's tokenizer padding on the left (as a tokenizer_config.json saying so)."""
    pipe.processor.tokenizer.padding_side = "left"
    try:
        return reference(pipe, prompts)
    finally:
        pipe.processor.tokenizer.padding_side = "right"


def test_the_processor_pads_right_as_released(root, pipe):
    """A tokenizer_config.json without padding_side (Qwen3-VL-8B-Instruct's) pads right: the real tokens first. Padded
    left they would come after the pads with the same states (Qwen3-VL's RoPE sees only their relative offsets): the
    side matters to the transformer's text positions only (next test)."""
    with open(os.path.join(root, "processor", "tokenizer_config.json")) as f:
        assert "padding_side" not in json.load(f)
    assert pipe.processor.tokenizer.padding_side == "right"
    ours, mask = load_nucleus_text_encoder(root, max_length=MAX_LENGTH).encode([SHORT])  # 164 real tokens: 4 pads
    left, left_mask = left_padded(pipe, [SHORT])
    assert left.shape[1] == 168 and not left_mask[0, :4].any() and left_mask[0, 4:].all()
    same = (left[0, 4:] - ours[0]).abs().max().item()
    print(f"Nucleus-Image left padding: the real tokens' Qwen3-VL states off by {same:.1e}, 4 places later")
    assert same <= 1e-5


def test_the_transformer_sees_our_cache_as_the_pipelines_layout(root, pipe):
    """diffusers' NucleusMoEImageTransformer2DModel (tiny, random, text width 32) on the pipeline's right-padded
    batch (164 and 171 tokens padded to 176, its mask) and on our cached captions collated (171 long, no pad past
    the longest): the same prediction, as the text RoPE positions of the real tokens are 0..n-1 in both. The
    left-padded batch (real tokens 12 and 5 places later) predicts otherwise: the cache would then need the pads."""
    from diffusers import NucleusMoEImageTransformer2DModel

    torch.manual_seed(0)
    model = NucleusMoEImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=2,
        num_key_value_heads=1, joint_attention_dim=32, axes_dims_rope=(4, 6, 6), moe_enabled=False).eval()
    latents = torch.randn(2, 16, 16)  # a 4 x 4 grid of packed tokens per sample

    def predict(embeds, mask):
        with torch.no_grad():
            return model(hidden_states=latents, timestep=torch.tensor([0.5, 0.5]), encoder_hidden_states=embeds,
                         encoder_hidden_states_mask=mask, img_shapes=[(1, 4, 4)] * 2, return_dict=False)[0]

    text = collated_cache(load_nucleus_text_encoder(root, max_length=MAX_LENGTH), [SHORT, MEDIUM])
    assert text["embeds"].shape[1] == 171
    pipeline = predict(*reference(pipe, [SHORT, MEDIUM]))
    ours = (predict(text["embeds"], text["mask"]) - pipeline).abs().max().item()
    left = (predict(*left_padded(pipe, [SHORT, MEDIUM])) - pipeline).abs().max().item()
    scale = pipeline.abs().max().item()
    print(f"Nucleus-Image transformer on our collated cache vs the pipeline's layout: {ours:.1e}; "
          f"left-padded: {left:.1e} (predictions up to {scale:.2f})")
    assert ours <= 1e-5 and left > 1e-3 * scale


def test_hidden_state_is_a_parameter_and_the_last_is_normed(root, pipe):
    """hidden_state -1: every layer and the final norm, as transformers' last hidden state (return_index=-1). Refused
    in one line: a state the model does not have, a max_length the processor would refuse (not a multiple of 8)."""
    encoder = load_nucleus_text_encoder(root, max_length=MAX_LENGTH, hidden_state=-1)
    assert encoder.layer == LAYERS and len(encoder.llm.model.layers) == LAYERS
    ours, mask = encoder.encode([SHORT, MEDIUM])
    theirs, their_mask = reference(pipe, [SHORT, MEDIUM], return_index=-1)
    assert real_token_diff(ours, theirs, mask, their_mask) <= 1e-5
    with pytest.raises(ValueError, match="hidden state -35: a model of 33 layers has hidden states -34..33"):
        load_nucleus_text_encoder(root, hidden_state=-35)
    with pytest.raises(ValueError, match="max_length 180 is not a multiple of 8"):
        load_nucleus_text_encoder(root, max_length=180)


def test_the_tokenizer_is_the_pipelines_processor(root, tmp_path):
    """processor/ (what the pipeline tokenizes with) before the text encoder's own copy (the released repo has both),
    from the pipeline folder or its text_encoder/; then text_encoder/ itself, then tokenizer/. Without a chat template
    the prompt is rendered as Qwen3-VL's template renders it."""
    from library.models.nucleus_image.text_encoder import nucleus_prompt_text, nucleus_tokenizer_folder
    from library.models.text_encoders import load_chat_tokenizer

    processor = os.path.join(root, "processor")
    assert nucleus_tokenizer_folder(root) == processor
    assert nucleus_tokenizer_folder(os.path.join(root, "text_encoder")) == processor
    released = tmp_path / "released"
    for name in ("processor", "text_encoder"):
        shutil.copytree(processor, released / name)
    assert nucleus_tokenizer_folder(str(released)) == str(released / "processor")
    shutil.rmtree(released / "processor")
    assert nucleus_tokenizer_folder(str(released)) == str(released / "text_encoder")
    shutil.copytree(processor, tmp_path / "tokenizer")
    os.symlink(os.path.join(root, "text_encoder"), tmp_path / "text_encoder")
    assert nucleus_tokenizer_folder(str(tmp_path)) == str(tmp_path / "tokenizer")
    tokenizer = load_chat_tokenizer(processor)
    templated = nucleus_prompt_text(tokenizer, MEDIUM)
    tokenizer.chat_template = None
    assert nucleus_prompt_text(tokenizer, MEDIUM) == templated


# -- full-size Qwen3-VL files as headers over sparse data (no weight is written or read)

def write_header_only(path: str, shapes: dict[str, tuple[int, ...]]) -> None:
    """A bf16 safetensors file with these tensors' header and a sparse (unwritten) data section."""
    header, offset = {}, 0
    for key, shape in shapes.items():
        size = 2 * int(torch.Size(shape).numel())
        header[key] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        f.truncate(8 + len(raw) + offset)


def qwen3_vl_shapes(config, vision: bool) -> dict[str, tuple[int, ...]]:
    """transformers' Qwen3VLForConditionalGeneration keys of `config`'s language model (an lm_head unless tied), and
    two of a vision tower's."""
    from library.models.llm import LLM

    with torch.device("meta"):
        llm = LLM(config)
    shapes = {"model.language_model." + k.removeprefix("model."): tuple(v.shape) for k, v in llm.state_dict().items()
              if k.startswith("model.")}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, config.hidden_size)
    if vision:
        shapes.update({"model.visual.patch_embed.proj.weight": (1152, 3, 2, 16, 16),
                       "model.visual.merger.linear_fc2.weight": (4096, 4608)})
    return shapes


def test_a_single_file_is_shaped_by_its_tensors(tmp_path):
    """Without config.json: Qwen3-VL-8B's language model (36 layers, lm_head, vision keys) and Qwen3-VL-4B's (tied)
    come out as the released configs; a file of another width is refused naming the model expected."""
    from library.io import CheckpointError
    from library.models.llm import QWEN3_VL_4B, QWEN3_VL_8B
    from library.models.text_encoders import qwen3_vl_language_config

    for config, name in ((QWEN3_VL_8B, "Qwen3-VL-8B"), (QWEN3_VL_4B, "Qwen3-VL-4B")):
        path = str(tmp_path / f"{name}.safetensors")
        write_header_only(path, qwen3_vl_shapes(config, vision=config is QWEN3_VL_8B))
        assert qwen3_vl_language_config(path, name) == config
    with pytest.raises(CheckpointError, match=r"Qwen3-VL-4B\.safetensors: embedding width 2560 is not Qwen3-VL-8B's"):
        qwen3_vl_language_config(str(tmp_path / "Qwen3-VL-4B.safetensors"), "Qwen3-VL-8B")


def test_planner_text_weights_are_the_29_layers_read(root, tmp_path):
    """Released size (a header-only Qwen3-VL-8B file): the embeddings, 29 of 36 layers, the final norm = 6.22 B
    parameters, as counted on the model we build; on the tiny folder, the parameters of the encoder loaded."""
    from library.models.llm import LLM, QWEN3_VL_8B
    from library.models.llm_spec import FP8
    from library.models.nucleus_image.text_encoder import nucleus_text_weights
    from library.models.spec import TextWeights
    from library.models.text_encoders import module_text_weights

    path = str(tmp_path / "qwen3_vl_8b.safetensors")
    write_header_only(path, qwen3_vl_shapes(QWEN3_VL_8B, vision=True))
    released = TextWeights(6_217_780_480, fp8_weights=5_595_201_536, fp8_scales=87_425_024)
    with torch.device("meta"):
        built = LLM(QWEN3_VL_8B)
        built.truncate_for_hidden_states(29)
    assert nucleus_text_weights(path) == module_text_weights(built, FP8) == released
    tiny = load_nucleus_text_encoder(root).llm
    assert nucleus_text_weights(root).params == sum(p.numel() for p in tiny.parameters())
