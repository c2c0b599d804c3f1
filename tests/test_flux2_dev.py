"""FLUX.2 [dev]: the Mistral prompt encoding equals diffusers' Flux2Pipeline (system message, chat
template, padding either side, hidden layers 10 / 20 / 30 stacked, text ids) on the tiny Mistral3
text encoder; Flux2Family loads it for a [dev] transformer; train_lora.py trains [dev] with it."""

import csv
import os

import pytest
import torch

from tests.test_train_lora import sample_png

PROMPTS = ["a cat", "a painting of a [IMG] house by the sea at sunset, oil on canvas, with a dog"]


@pytest.fixture(scope="module")
def dev(tiny_set):
    """flux2_dev_text_encoder (Mistral3ForConditionalGeneration folder) and flux2_dev_tokenizer."""
    return tiny_set


def _reference(dev, tokenizer, max_length):
    """Flux2Pipeline.encode_prompt with transformers' Mistral3ForConditionalGeneration. The tokenizer
    stands in for the PixtralProcessor (which needs torchvision): for text-only messages the processor
    renders the same template and tokenizes without special tokens when the text starts with BOS,
    which the tokenizer's apply_chat_template does too for this template."""
    from diffusers.pipelines.flux2.pipeline_flux2 import Flux2Pipeline
    from transformers import Mistral3ForConditionalGeneration

    text_encoder = Mistral3ForConditionalGeneration.from_pretrained(dev["flux2_dev_text_encoder"]).eval()
    pipe = Flux2Pipeline(scheduler=None, vae=None, text_encoder=text_encoder, tokenizer=tokenizer, transformer=None)
    with torch.no_grad():
        return pipe.encode_prompt(PROMPTS, device=torch.device("cpu"), max_sequence_length=max_length)


@pytest.mark.parametrize("side,max_length", [("right", 512), ("left", 512), ("right", 24)],
                         ids=["right-512", "left-512", "truncated-24"])
def test_dev_prompt_embeds_and_text_ids_match_diffusers(dev, side, max_length):
    from transformers import AutoTokenizer

    from library.models.flux2.dev_text_encoder import load_dev_text_encoder

    ours = load_dev_text_encoder(dev["flux2_dev_text_encoder"], max_length=max_length)
    # 30 of the 31 layers are loaded (layer 30's output is the deepest one read), no lm_head, no vision tower.
    assert len(ours.llm.model.layers) == 30 and ours.llm.lm_head is None and ours.embed_dim == 96
    tokenizer = AutoTokenizer.from_pretrained(dev["flux2_dev_tokenizer"])
    ours.tokenizer.padding_side = tokenizer.padding_side = side
    embeds, text_ids = ours.encode(PROMPTS)
    ref, ref_ids = _reference(dev, tokenizer, max_length)
    assert embeds.shape == ref.shape == (2, max_length, 3 * 32) and embeds.dtype == torch.float32
    assert torch.equal(text_ids, ref_ids) and text_ids.dtype == torch.int64
    diff = (embeds - ref).abs().max().item()
    assert diff <= 1e-5, diff
    tokens = ours.tokenize(PROMPTS)
    assert tokens.input_ids[0].tolist().count(1) == 1  # one <s>: the template's, none added by the tokenizer
    if max_length == 512:  # pads are part of the output and carry the pad embedding through the layers
        pads = ~tokens.attention_mask.bool()
        assert pads[0].sum() > pads[1].sum() > 0
        assert embeds[0][pads[0]].abs().max().item() > 0
    else:
        assert tokens.attention_mask.all()  # the long prompt (system message included) is cut at max_length


def test_dev_prompt_text_is_the_system_and_user_message(dev):
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
    from transformers import AutoTokenizer

    from library.models.flux2.dev_text_encoder import DEV_SYSTEM_MESSAGE, MISTRAL_PROMPT, dev_prompt_text

    assert DEV_SYSTEM_MESSAGE == SYSTEM_MESSAGE
    tokenizer = AutoTokenizer.from_pretrained(dev["flux2_dev_tokenizer"])
    text = dev_prompt_text(tokenizer, "a [IMG]cat", tokenizer.chat_template)
    assert text == f"<s>[SYSTEM_PROMPT]{SYSTEM_MESSAGE}[/SYSTEM_PROMPT][INST]a cat[/INST]"
    assert dev_prompt_text(tokenizer, "a [IMG]cat", None) == text == MISTRAL_PROMPT.format(
        bos="<s>", system=SYSTEM_MESSAGE, prompt="a cat")  # no template anywhere: the built-in rendering


def test_flux2_family_loads_the_dev_text_encoder(dev, tiny_set):
    from library.models.flux2.family import Flux2Family

    family = Flux2Family(tiny_set["flux2_dev_tiny"], text_encoder=dev["flux2_dev_text_encoder"])
    constants, klein = family.text_encoding_constants(), Flux2Family(tiny_set["flux2_tiny"]).text_encoding_constants()
    assert constants["hidden_layers"] == (10, 20, 30) and klein["hidden_layers"] == (9, 18, 27)
    encode = family.load_text_encoder("fp32")
    (first, second) = encode(PROMPTS)
    assert first["embeds"].shape == (512, 96) and not torch.equal(first["embeds"], second["embeds"])
    # The memory planner counts what is loaded: 30 of 31 layers, no head, no vision tower or projector.
    from library.models.flux2.dev_text_encoder import load_dev_text_encoder

    loaded = load_dev_text_encoder(dev["flux2_dev_text_encoder"]).llm
    assert family.text_encoder_params() == sum(p.numel() for p in loaded.parameters())


def test_flux2_dev_lora_trains_two_steps_samples_and_generates(dev, tiny_set, tmp_path):
    import train_lora

    code = train_lora.main([
        "--model_type", "flux2", "--pretrained_model_name_or_path", tiny_set["flux2_dev_tiny"],
        "--ae", tiny_set["flux2_vae"], "--text_encoder", dev["flux2_dev_text_encoder"],
        "--dataset_config", tiny_set["dataset_config"], "--sample_prompts", tiny_set["sample_prompts"],
        "--output_dir", str(tmp_path), "--output_name", "dev",
        "--max_train_steps", "2", "--mixed_precision", "no", "--network_dim", "4", "--network_alpha", "4",
        "--optimizer_type", "AdamW", "--learning_rate", "1e-3", "--sample_at_first", "false", "--save_every_n_steps", "0",
    ])
    assert code == 0
    with open(os.path.join(tmp_path, "dev_log.csv")) as f:
        losses = [float(r["loss"]) for r in csv.DictReader(f)]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    assert os.path.getsize(os.path.join(tmp_path, "dev.safetensors")) > 0
    assert sample_png(tmp_path, "dev", "final").stat().st_size > 0  # sampled with the embedded guidance

    from tools import generate

    out = tmp_path / "generated"
    assert generate.main([
        "--model_type", "flux2", "--model", tiny_set["flux2_dev_tiny"], "--ae", tiny_set["flux2_vae"],
        "--text_encoder", dev["flux2_dev_text_encoder"], "--prompt", "a red cat --w 64 --h 48 --s 2 --g 3.5",
        "--dtype", "fp32", "--text_encoder_precision", "fp32", "--lora", f"{tmp_path / 'dev.safetensors'}:0.8",
        "--out", str(out), "--device", "cpu",
    ]) == 0
    assert len(list(out.glob("*.png"))) == 1


def test_flux2_dev_memory_preset_counts_the_mistral_layers_read():
    """The planner's flux2-dev text encoder is what load_dev_text_encoder keeps of Mistral Small 3.1
    (embeddings, 30 of 40 layers, final norm, no head), counted on meta. (plan_memory --preset
    flux2-dev --vram 48 --resolution 1024: fp8_scaled + gradient checkpointing fits without swap.)"""
    from library.models.llm import LLM, MISTRAL_SMALL_3_1, count_parameters
    from tools import plan_memory

    with torch.device("meta"):
        llm = LLM(MISTRAL_SMALL_3_1)
        llm.truncate_for_hidden_states(30)
    assert plan_memory.presets()["flux2-dev"].text_params["text_encoder"].params == count_parameters(llm) == 17_343_759_360
