"""HiDream-O1-Image's prompt ids against the peers' construction (musubi-tuner's build_t2i_input_ids, ai-toolkit's
encode_prompt): the processor's chat template text of one user message with the generation prompt, then
<|boi_token|><|tms_token|>, tokenized whole; on the tiny HiDream-O1 tokenizer (tiny_text.py)."""

import json
import os
import shutil

import pytest
import torch

from library.io import CheckpointError
from library.models.hidream_o1 import text_encoder as te
from library.models.hidream_o1.tiny_text import build_hidream_o1_tokenizer, write_hidream_o1_tokenizer

CAPTIONS = ["a cat", "a painting of a house by the sea at sunset, oil on canvas, with a red chair in the grass", "",
            te.NEGATIVE_PROMPT]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_hidream_o1_tokenizer(str(tmp_path_factory.mktemp("hidream_o1_text")), 0)["hidream_o1_tokenizer"]


@pytest.fixture(scope="module")
def ids(folder):
    return te.load_hidream_o1_prompt_ids(folder)


def peers_ids(tokenizer, prompt: str) -> list[int]:
    """musubi-tuner's build_t2i_input_ids: processor.apply_chat_template(tokenize=False) + boi + tms, encoded whole.
    The processor is transformers' Qwen3VLProcessor with the tokenizer alone (its image and video processors
    need torchvision): its apply_chat_template renders with its chat template and the tokenizer's specials."""
    from transformers import Qwen3VLProcessor

    processor = Qwen3VLProcessor.__new__(Qwen3VLProcessor)  # no __init__: it builds the video processor
    processor.tokenizer, processor.chat_template = tokenizer, tokenizer.chat_template
    messages = [{"role": "user", "content": prompt}]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text + te.BOI_TOKEN + te.TMS_TOKEN, add_special_tokens=False)


def test_ids_are_the_chat_template_then_boi_and_tms(ids):
    tokenizer = ids.tokenizer
    out = ids.encode(CAPTIONS)
    for caption, row in zip(CAPTIONS, out):
        template = tokenizer.apply_chat_template([{"role": "user", "content": caption}], add_generation_prompt=True,
                                                 tokenize=True, return_dict=False)
        assert row["input_ids"].tolist() == list(template) + [ids.boi_id, ids.tms_id]
        assert row["input_ids"].tolist() == peers_ids(tokenizer, caption)
        assert tokenizer.decode(row["input_ids"]) == (f"<|im_start|>user\n{caption}<|im_end|>\n<|im_start|>assistant\n"
                                                      "<|boi_token|><|tms_token|>")
    # the template adds 10 tokens to the prompt's (3 before it, 7 after), as the released tokenizer's does
    assert [len(r["input_ids"]) for r in out[2:]] == [10, 11]
    assert ids.tms_id == ids.boi_id + 4  # the released order: boi, bor, eor, bot, tms


def test_a_samples_empty_negative_is_the_pipelines_space_and_an_empty_caption_stays_empty(ids):
    """The pipelines' unconditional prompt is " " (musubi-tuner's and ai-toolkit's); a sample without --n was encoded
    as the empty prompt. Caption dropout's "" stays "" there."""
    from library.data.prompts import NegativePrompt
    from library.models.family import family_class

    space, empty = ids.encode([te.NEGATIVE_PROMPT, ""])
    negative, = ids.encode([family_class("hidream_o1").sample_negative("")])
    assert negative["input_ids"].tolist() == space["input_ids"].tolist() == peers_ids(ids.tokenizer, " ")
    assert len(empty["input_ids"]) == len(space["input_ids"]) - 1
    assert ids.encode([NegativePrompt("blurry")])[0]["input_ids"].tolist() == peers_ids(ids.tokenizer, "blurry")


def test_rows_and_lengths(ids):
    out = ids.encode(CAPTIONS)
    lengths = [len(ids.token_ids([c])[0]) for c in CAPTIONS]
    assert len(set(lengths)) == 4  # four different lengths
    for row, length in zip(out, lengths):
        assert set(row) == {"input_ids", "length"}
        assert row["input_ids"].dtype == torch.int64 and row["input_ids"].shape == (length,)
        assert row["length"].dtype == torch.int64 and row["length"].shape == () and int(row["length"]) == length
        assert int(row["input_ids"][-1]) == ids.tms_id and int(row["input_ids"][-2]) == ids.boi_id


def test_a_tokenizer_without_the_hidream_o1_tokens_is_one_error_naming_the_folder(tmp_path):
    from library.models.qwen_image21.tiny import QWEN3_VL_CHAT_TEMPLATE
    from library.models.tiny_files import build_qwen_tokenizer, save_tokenizer

    tokenizer = build_qwen_tokenizer(vision_templates=())  # a Qwen3-VL-like tokenizer: no boi / tms
    tokenizer.chat_template = QWEN3_VL_CHAT_TEMPLATE
    save_tokenizer(tokenizer, str(tmp_path / "qwen3_vl"))
    with pytest.raises(CheckpointError) as error:
        te.load_hidream_o1_prompt_ids(str(tmp_path / "qwen3_vl"))
    assert str(tmp_path / "qwen3_vl") in str(error.value)
    assert "<|boi_token|> or <|tms_token|>" in str(error.value)


def test_a_tokenizer_without_a_chat_template_is_an_error_naming_the_folder(tmp_path):
    from library.models.tiny_files import save_tokenizer

    tokenizer = build_hidream_o1_tokenizer()
    tokenizer.chat_template = None
    save_tokenizer(tokenizer, str(tmp_path / "plain"))
    with pytest.raises(CheckpointError, match=f"{tmp_path / 'plain'}: the tokenizer has no chat template"):
        te.load_hidream_o1_prompt_ids(str(tmp_path / "plain"))


@pytest.mark.parametrize("template_file", ["chat_template.json", "chat_template.jinja"])
def test_the_processor_files_chat_template_and_the_folder_beside_a_single_file(folder, ids, tmp_path, template_file):
    # ComfyUI's single file holds no tokenizer: a tokenizer/ folder beside it; the template in a processor's
    # file (legacy chat_template.json, or chat_template.jinja) instead of tokenizer_config.json: the same ids
    comfy = tmp_path / "diffusion_models"
    shutil.copytree(folder, comfy / "tokenizer")
    (comfy / "hidream_o1_image_bf16.safetensors").write_bytes(b"")
    config_file = comfy / "tokenizer" / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    template = config.pop("chat_template")
    config_file.write_text(json.dumps(config))
    legacy = template_file.endswith(".json")
    (comfy / "tokenizer" / template_file).write_text(json.dumps({"chat_template": template}) if legacy else template)
    path = str(comfy / "hidream_o1_image_bf16.safetensors")
    assert te.hidream_o1_tokenizer_folder(path) == str(comfy / "tokenizer")
    beside = te.load_hidream_o1_prompt_ids(path)
    assert beside.token_ids(CAPTIONS) == ids.token_ids(CAPTIONS)
    assert te.hidream_o1_tokenizer_folder(folder) == folder  # the HF repo's root holds the processor files
    assert te.hidream_o1_tokenizer_folder(path, folder) == folder  # given


def test_caption_token_limit_counts_the_row_and_refuses_what_reaches_the_image(folder, ids):
    limit = te.hidream_o1_caption_token_limit(ids)
    assert limit.max_tokens == 4096 and limit.refuses and limit.encoder == "Qwen3-VL"
    assert [limit.count(c) for c in CAPTIONS] == [len(r) for r in ids.token_ids(CAPTIONS)]
    fits = "a" + " a" * (4096 - 11)  # one token a word: 4086 + the template's 10
    assert limit.count(fits) == 4096 and int(ids.encode([fits])[0]["length"]) == 4096
    with pytest.raises(ValueError, match="caption is 4097 tokens with HiDream-O1's template; at most 4096"):
        ids.encode([fits + " a"])


def test_the_tiny_processor_folder(folder):
    assert sorted(os.listdir(folder)) == ["preprocessor_config.json", "tokenizer.json", "tokenizer_config.json"]
    with open(os.path.join(folder, "preprocessor_config.json")) as f:
        config = json.load(f)
    assert config["processor_class"] == "Qwen3VLProcessor" and (config["patch_size"], config["merge_size"]) == (16, 2)


def test_the_full_size_benchs_tokenizer_has_the_released_special_ids(ids, tmp_path):
    """bench/full_size_files.py's tokenizer beside the released-shape file (read with the released tms id, 151673):
    the tiny tokenizer with each special token at its released id. Each caption's row is the tiny one's with the
    special ids renumbered, the learned tokens unchanged."""
    from bench.full_size_files import HIDREAM_O1_TOKEN_IDS, write_hidream_o1_tokenizer as write_released

    write_released(str(tmp_path))
    released = te.load_hidream_o1_prompt_ids(str(tmp_path))
    assert (released.boi_id, released.tms_id) == (151669, 151673)
    renumbered = {ids.tokenizer.convert_tokens_to_ids(t): i for t, i in HIDREAM_O1_TOKEN_IDS.items()}
    for tiny, row in zip(ids.encode(CAPTIONS), released.encode(CAPTIONS)):
        assert row["input_ids"].tolist() == [renumbered.get(i, i) for i in tiny["input_ids"].tolist()]
