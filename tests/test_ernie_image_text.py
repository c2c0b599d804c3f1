"""ERNIE-Image's prompt encoding (library/models/ernie_image/text_encoder.py) equals diffusers'
ErnieImagePipeline.encode_prompt on a tiny Mistral3Model saved in the pipeline's layout (text_encoder/ +
tokenizer/), with the released language model's YaRN RoPE (mscale / mscale_all_dim, llama_4_scaling_beta) in
its text_config, as model_type mistral (the released one) and ministral3."""

import json
import os
from types import SimpleNamespace

import pytest
import torch

MAX_LENGTH = 24  # the tiny tokenizer's model_max_length (the released one's is 2048): the long prompt is cut there
PROMPTS = ["a red cat", "a watercolor painting of a lighthouse on a cliff at dusk, waves crashing on the rocks "
           "below, gulls over the foam", "", "two small dogs in the snow"]


def write_pipeline(root, model_type: str) -> str:
    """A tiny ERNIE-Image text_encoder/ + tokenizer/ (tiny.write_mistral3_text_encoder: Pixtral tower, projector,
    3-layer language model with the released rope; head_dim 16 != hidden / heads; <s> added), as `model_type`."""
    from library.models.ernie_image.tiny import write_mistral3_text_encoder

    torch.manual_seed(0)
    folder = os.path.join(root, model_type)
    write_mistral3_text_encoder(os.path.join(folder, "text_encoder"), os.path.join(folder, "tokenizer"), model_type,
                                MAX_LENGTH)
    return folder


@pytest.fixture(scope="module", params=["mistral", "ministral3"])
def pipeline(request, tmp_path_factory):
    return write_pipeline(tmp_path_factory.mktemp("ernie_text"), request.param)


def reference(folder: str, prompts: list[str]) -> list[torch.Tensor]:
    """ErnieImagePipeline.encode_prompt on transformers' Mistral3Model and the folder's tokenizer, fp32."""
    from diffusers import ErnieImagePipeline
    from transformers import AutoTokenizer, Mistral3Model

    pipe = SimpleNamespace(tokenizer=AutoTokenizer.from_pretrained(os.path.join(folder, "tokenizer")),
                           text_encoder=Mistral3Model.from_pretrained(os.path.join(folder, "text_encoder")).eval())
    return ErnieImagePipeline.encode_prompt(pipe, prompts, torch.device("cpu"))


def test_ernie_prompt_embeds_match_diffusers_fp32(pipeline):
    """The batch of 4 (4, 24, 1, 15 tokens: the long one cut at model_max_length, "" = <s>) and each prompt
    alone: max |diff| <= 1e-5 (measured 1.2e-7 batched, 8.9e-8 alone), zeros and mask False past each prompt.
    (Plain RoPE instead of the YaRN one is 9.3e-5 off here, yarn's default attention factor 2.4e-2.)"""
    from library.models.ernie_image.text_encoder import load_ernie_text_encoder

    encoder = load_ernie_text_encoder(pipeline)
    assert len(encoder.llm.model.layers) == 2 and encoder.layer == 2  # hidden_states[-2] of 3 layers: 2 run
    ref = reference(pipeline, PROMPTS)
    counts = [r.shape[0] for r in ref]
    assert counts[1] == MAX_LENGTH and counts[2] == 1 and len(set(counts)) == 4
    embeds, mask = encoder.encode(PROMPTS)
    assert embeds.dtype == torch.float32 and embeds.shape == (4, MAX_LENGTH, 32) and mask.dtype == torch.bool
    assert mask.sum(-1).tolist() == counts
    worst = max((embeds[i, :n] - r).abs().max().item() for i, (n, r) in enumerate(zip(counts, ref)))
    alone = max((encoder.encode([p])[0][0] - r).abs().max().item() for p, r in zip(PROMPTS, ref))
    print(f"max |ours - diffusers|: batch {worst:.2e}, one prompt {alone:.2e}")
    assert worst <= 1e-5 and alone <= 1e-5
    assert min(r.abs().max().item() for r in ref) > 0.1  # the states compared are not near zero
    assert embeds[~mask].abs().max().item() == 0


def test_the_yarn_rope_of_ministral_3_is_read_as_transformers_computes_it(pipeline):
    """mscale = mscale_all_dim = 1 cancel (attention factor 1, not yarn's default 0.1 ln 16 + 1 = 1.277, which a
    plain from_hf read would apply); llama_4_scaling_beta (ministral3) limits prompts to 16384 tokens."""
    from library.models.ernie_image.text_encoder import MINISTRAL_3_3B, ernie_llm_config

    config, longest = ernie_llm_config(os.path.join(pipeline, "text_encoder"))
    assert config.rope_scaling.attention_factor == 1.0 and config.sliding_window == 0
    assert longest == (16384 if pipeline.endswith("ministral3") else 0)
    assert MINISTRAL_3_3B.rope_scaling == config.rope_scaling and MINISTRAL_3_3B.num_layers == 26


def test_an_empty_token_list_becomes_bos_as_in_the_pipeline(pipeline):
    """A tokenizer that adds no <s> gives "" no tokens; the pipeline then encodes [bos_token_id]."""
    from tokenizers import processors

    from library.models.ernie_image.text_encoder import load_ernie_text_encoder

    encoder = load_ernie_text_encoder(pipeline)
    encoder.tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(single="$A", special_tokens=[])
    assert encoder.tokenizer("").input_ids == []
    assert encoder.token_ids(["", "a red cat"]) == [[1], encoder.tokenizer("a red cat").input_ids]


def test_a_single_language_model_file_loads_with_the_tokenizer_beside_it(pipeline, tmp_path):
    """The LM's tensors alone (`model.language_model.*` keys) with its config.json and tokenizer in one folder."""
    from safetensors.torch import load_file

    from library.io import save_safetensors
    from library.models.ernie_image.text_encoder import load_ernie_text_encoder

    source = os.path.join(pipeline, "text_encoder")
    stored = load_file(os.path.join(source, "model.safetensors"))  # `language_model.model.*` (and vision) keys
    tensors = {"model.language_model." + k.removeprefix("language_model.model."): v
               for k, v in stored.items() if k.startswith("language_model.")}
    save_safetensors(tensors, str(tmp_path / "lm.safetensors"))
    with open(os.path.join(source, "config.json")) as f:
        (tmp_path / "config.json").write_text(json.dumps(json.load(f)))
    for name in os.listdir(os.path.join(pipeline, "tokenizer")):
        (tmp_path / name).write_bytes(open(os.path.join(pipeline, "tokenizer", name), "rb").read())
    single = load_ernie_text_encoder(str(tmp_path / "lm.safetensors")).encode(PROMPTS)
    folder = load_ernie_text_encoder(pipeline).encode(PROMPTS)
    assert torch.equal(single[0], folder[0]) and torch.equal(single[1], folder[1])


def test_ernie_memory_preset_counts_the_ministral_layers_read():
    """The planner's text encoder: Ministral 3 3B's embeddings, 25 of 26 layers and the final norm, on meta."""
    from library.models.ernie_image.text_encoder import ernie_text_weights
    from library.models.spec import TextWeights

    assert ernie_text_weights() == TextWeights(3_312_608_256, fp8_weights=2_909_798_400, fp8_scales=45_465_600)
