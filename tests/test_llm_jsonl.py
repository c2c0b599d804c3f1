""".jsonl LLM train data (library/data/chat_records.py, text_corpus.py): {"text"} and {"messages"} records,
the loss on assistant tokens only (found by rendering the chat template prefix by prefix), bad records
refused in one line naming file:line before the model loads, and a short LoRA run on a messages file."""

import contextlib
import csv
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

import train_lora
from library.data import chat_records, text_corpus
from library.data.tokenizer import load_tokenizer
from library.errors import ConfigError
from library.models.tiny_files import QWEN2_CHAT_TEMPLATE

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello! How can I help?"}, {"role": "user", "content": "What is 2 + 2?"},
        {"role": "tool", "content": "4"}, {"role": "assistant", "content": "It is 4."}]


@pytest.fixture(scope="module")
def chat_tokenizer():
    from library.models.tiny_files import build_qwen_tokenizer

    tok = build_qwen_tokenizer()
    tok.chat_template = QWEN2_CHAT_TEMPLATE
    return tok


@pytest.fixture
def chat_llm(tiny_set, tmp_path):
    """The tiny LM's folder with Qwen2's ChatML template in its tokenizer_config.json."""
    folder = tmp_path / "chat_llm"
    shutil.copytree(tiny_set["llm"], folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": QWEN2_CHAT_TEMPLATE}))
    return str(folder)


def write_jsonl(path, records) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


@contextlib.contextmanager
def chat_template(tok, template: str):
    """The shared tokenizer with another chat template for the block."""
    old, tok.chat_template = tok.chat_template, template
    try:
        yield tok
    finally:
        tok.chat_template = old


def test_the_loss_mask_holds_the_assistant_replies_and_their_end_of_turn_only(chat_tokenizer):
    """Of the 105 tokens the template renders (a system turn, two user turns, a tool result), the 28 trained
    ones decode to the two replies, each with its <|im_end|> and newline; the ids are transformers' own
    apply_chat_template(tokenize=True)."""
    ids, trained = chat_records.chat_encoder(chat_tokenizer, all_tokens=False)(CHAT, "x.jsonl:1")
    assert ids == chat_tokenizer.apply_chat_template(CHAT, tokenize=True, return_dict=False)
    replies = chat_tokenizer.decode([i for i, t in zip(ids, trained) if t])
    assert replies == "Hello! How can I help?<|im_end|>\nIt is 4.<|im_end|>\n"
    assert len(trained) == len(ids) and (sum(trained), len(ids)) == (28, 105)
    all_ids, all_trained = chat_records.chat_encoder(chat_tokenizer, all_tokens=True)(CHAT, "x.jsonl:1")
    assert all_ids == ids and all_trained is True


def test_an_assistant_turn_that_calls_a_tool_is_trained_on_its_call(chat_tokenizer, tmp_path):
    """OpenAI-style tool use: an assistant message with tool_calls and no content (null) renders through the
    template's tool-call branch and is trained like a reply (its call, then the final reply); the record
    passes the early check, where it was refused as an empty assistant message."""
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    chat = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "content": "18 C"}, {"role": "assistant", "content": "It is 18 C."}]
    text_corpus.check_corpus([write_jsonl(tmp_path / "tools.jsonl", [{"messages": chat}])], None, all_tokens=False)
    ids, trained = chat_records.chat_encoder(chat_tokenizer, all_tokens=False)(chat, "x.jsonl:1")
    assert ids == chat_tokenizer.apply_chat_template(chat, tokenize=True, return_dict=False)
    assert chat_tokenizer.decode([i for i, t in zip(ids, trained) if t]) == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
        "It is 18 C.<|im_end|>\n")


def test_tool_call_arguments_as_openai_writes_them_a_json_string_train_as_their_object(chat_tokenizer, tmp_path):
    """OpenAI's API writes "arguments" as the JSON text of the object: it is decoded before rendering, so a
    tojson template (Qwen2.5's) trains the same 85 tokens (the call, the reply) as the object; it trained the string
    double-encoded ("{\\"city\\": \\"Paris\\"}"). The caller's messages are left as they were."""
    def chat(arguments):
        call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
        return [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "tool", "content": "18 C"},
                {"role": "assistant", "content": "It is 18 C."}]

    as_string = chat('{"city": "Paris"}')
    text_corpus.check_corpus([write_jsonl(tmp_path / "openai.jsonl", [{"messages": as_string}])], None, False)
    ids, trained = chat_records.chat_encoder(chat_tokenizer, all_tokens=False)(as_string, "x.jsonl:1")
    assert (ids, trained) == chat_records.chat_encoder(chat_tokenizer, all_tokens=False)(chat({"city": "Paris"}), "")
    assert sum(trained) == 85
    assert chat_tokenizer.decode([i for i, t in zip(ids, trained) if t]) == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
        "It is 18 C.<|im_end|>\n")
    assert as_string == chat('{"city": "Paris"}')


def test_a_template_that_drops_the_system_prompt_once_a_reply_follows_is_refused_as_a_rewrite(chat_tokenizer):
    """Mistral v0.3's template writes the system prompt only into a user message that is the last message: the
    first reply's prefix renders it, the conversation does not. That is a rewrite of earlier turns; it was
    refused as a generation prompt that is not how the reply opens (the template has none), advising
    train_on_all_tokens without saying that drops the system prompt."""
    tok = chat_tokenizer
    template = ("{%- if messages[0].role == 'system' %}{%- set system = messages[0].content %}"
                "{%- set turns = messages[1:] %}{%- else %}{%- set turns = messages %}{%- endif %}"
                "{%- for m in turns %}{%- if m.role == 'user' %}{{- '[INST] ' }}"
                "{%- if loop.last and system is defined %}{{- system + '\\n\\n' }}{%- endif %}"
                "{{- m.content + '[/INST]' }}{%- else %}{{- ' ' + m.content + '</s>' }}{%- endif %}{%- endfor %}")
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"}]
    with chat_template(tok, template):
        with pytest.raises(ConfigError) as refused:
            chat_records.chat_encoder(tok, all_tokens=False)(chat, "m.jsonl:1")
        assert str(refused.value) == (
            "m.jsonl:1: the chat template renders the conversation up to messages[2] (assistant) as text that does "
            "not begin the whole conversation's (it rewrites earlier turns), so the assistant's tokens cannot be "
            "told apart; set train_on_all_tokens = true (the conversation as the template renders it whole, "
            "without what it drops from earlier turns), or give each turn a record of its own")
        assert sum(chat_records.chat_encoder(tok, all_tokens=False)(chat[1:], "m.jsonl:2")[1]) == 9  # " Hello</s>"


def test_a_template_that_rewrites_earlier_turns_is_refused_naming_the_record(chat_tokenizer):
    """A template that marks only the last reply (as Qwen3's keeps only the last turn's thinking): the reply
    rendered as the last message is not how the whole conversation renders it."""
    tok = chat_tokenizer
    template = ("{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + (('[last] ' if loop.last else '') "
                "if m.role == 'assistant' else '') + m.content + '<|im_end|>\\n' }}{%- endfor %}"
                "{%- if add_generation_prompt %}{{- '<|im_start|>assistant ' + (messages|length + 1)|string + '\\n' }}{%- endif %}")
    with chat_template(tok, template):
        with pytest.raises(ConfigError, match=r"^d.jsonl:3: the chat template renders the conversation up to messages\[2\] "
                                              r"\(assistant\) as text that does not begin the whole conversation's"):
            chat_records.chat_encoder(tok, all_tokens=False)(CHAT, "d.jsonl:3")
        assert chat_records.chat_encoder(tok, all_tokens=True)(CHAT, "d.jsonl:3")[1] is True


def test_a_generation_prompt_that_opens_think_is_refused_naming_where_it_parts_from_the_reply(chat_tokenizer):
    """DeepSeek-R1-Distill's template: its generation prompt opens <think>, which the rendered conversation lacks,
    so even a one-turn record has no span. The refusal names the two texts where they part and offers
    train_on_all_tokens; it said the template rewrote earlier turns and to give each turn a record of its own."""
    tok = chat_tokenizer
    template = ("{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
                "{%- endfor %}"
                "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}")
    chat = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "It is 4, of course, as always."}]
    with chat_template(tok, template):
        with pytest.raises(ConfigError) as refused:
            chat_records.chat_encoder(tok, all_tokens=False)(chat, "r1.jsonl:1")
        assert str(refused.value) == (
            "r1.jsonl:1: the chat template's generation prompt is not how it opens messages[1] (assistant): where "
            "they part, messages[:1] rendered with add_generation_prompt goes on '<think>\\n' and the conversation "
            "'It is 4, of course, as a'..., so the assistant's tokens cannot be told apart; "
            "set train_on_all_tokens = true")
        assert chat_records.chat_encoder(tok, all_tokens=True)(chat, "r1.jsonl:1")[1] is True


@pytest.mark.parametrize("line, message", [
    ('{"text": "ok"', "not JSON (Expecting ',' delimiter: line 1 column 14 (char 13)); expected one object a line"),
    ('["a list"]', "the line is an array; expected an object"),
    ('{"prompt": "q"}', "expected one of {\"text\": \"...\"}, {\"messages\": "),
    ('{"prompt": "q", "chosen": "a", "rejected": "b"}', "expected one of "),
    ('{"text": "a", "messages": []}', "both \"text\" and \"messages\"; expected one of them"),
    ('{"text": 3}', "\"text\" is a number; expected a string"),
    ('{"messages": [{"role": "bot", "content": "hi"}]}', "messages[0] role 'bot': expected one of system, user, assistant, tool"),
    ('{"messages": [{"role": "user", "content": [{"type": "text"}]}]}',
     "messages[0] (user) content[0] is a text part whose \"text\" is null; expected a string"),
    ('{"messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, {"type": "image_url", '
     '"image_url": {"url": "a.png"}}]}, {"role": "assistant", "content": "A cat."}]}',
     "messages[0] (user) content[1] is a part of type 'image_url'; the LLM trainer reads text only"),
    ('{"messages": [{"role": "user", "content": ["q"]}, {"role": "assistant", "content": "a"}]}',
     "messages[0] (user) content[0] is a string; the LLM trainer reads text only"),
    ('{"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "a"}]}',
     "messages[0] (user) content is a number; expected a string or a list of text parts"),
    ('{"conversations": [{"from": "human", "value": "q"}, {"from": "bot", "value": "a"}]}',
     "conversations[1] from 'bot': expected one of system, human, gpt, user, assistant"),
    ('{"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": null}]}',
     "conversations[1] (gpt) value is null; expected a string"),
    ('{"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": " "}]}',
     "conversations[1] is an assistant message with empty content"),
    ('{"conversations": []}', "\"conversations\" must be a list of at least one"),
    ('{"conversations": ["human", "hi"]}',  # a traceback ('str' object has no attribute 'get')
     "conversations[0] is a string; expected a {\"from\": ..., \"value\": \"...\"} object"),
    ('{"text": "q a", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}',
     "both \"text\" and \"conversations\"; expected one of them"),  # the text trained, every token of it
    ('{"conversations": [{"from": "gpt", "value": "Hi!"}, {"from": "human", "value": "q"}]}',
     "conversations[0] is an assistant message; with the loss on assistant tokens only"),
    ('{"conversations": [{"from": "human", "value": "q"}], "prompt": "q", "completion": "a"}',
     "both \"conversations\" and \"prompt\" / \"completion\"; expected one of them"),
    ('{"prompt": "q", "completion": ""}', "\"completion\" is empty; expected the reply to train on"),
    ('{"prompt": "q", "completion": [{"role": "assistant", "content": "a"}]}',
     "\"prompt\" is a string and \"completion\" an array; expected two strings or two lists of messages"),
    ('{"prompt": [{"role": "user", "content": "q"}], "completion": [{"role": "user", "content": "a"}]}',
     "completion[0] role 'user': expected assistant (the completion is the reply trained on)"),
    ('{"prompt": [{"role": "human", "content": "q"}], "completion": [{"role": "assistant", "content": "a"}]}',
     "prompt[0] role 'human': expected one of system, user, assistant, tool"),
    ('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "  "}]}',
     "messages[1] is an assistant message with empty content"),
    ('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": null}]}',
     "messages[1] (assistant) content is null; expected a string"),
    ('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": null, "tool_calls": []}]}',
     "messages[1] (assistant) tool_calls is []; expected a list of at least one call object"),
    ('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": null, "tool_calls": '
     '[{"type": "function", "function": {"name": "f", "arguments": "city=Paris"}}]}]}',
     "messages[1] (assistant) tool_calls[0] arguments 'city=Paris' is a string that is no JSON object; expected an "
     "object or its JSON text"),  # it was trained as the string
    ('{"messages": [{"role": "user", "content": "q"}]}', "no assistant message, so nothing to train on"),
    ('{"messages": [{"role": "assistant", "content": "Hi!"}, {"role": "user", "content": "q"}]}',
     "messages[0] is an assistant message; with the loss on assistant tokens only a conversation starts with"),
    ("null", "the line is null; expected an object"),  # it was skipped as a blank line
    ('{"text": "x", "meta": ' + "[" * 3000 + "]" * 3000 + "}", "JSON nested too deep to read"),  # a RecursionError traceback
    ('{"text": "an emoji cut \\ud83d here"}', "holds a lone UTF-16 surrogate (\\ud83d: half of a character"),
    ('{"messages": [{"role": "user", "content": "q \\uDE00"}, {"role": "assistant", "content": "a"}]}',
     "holds a lone UTF-16 surrogate (\\ude00"),  # they passed the check, then failed tokenizing: a traceback
])
def test_a_bad_record_is_one_config_error_naming_file_and_line(tmp_path, line, message):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "fine"}, "", line, {"text": "never read"}])
    with pytest.raises(ConfigError) as e:
        text_corpus.check_corpus([path], None, all_tokens=False)
    assert str(e.value).startswith(f"{path}:3: {message}") and "\n" not in str(e.value)


def parts(*texts) -> list:
    return [{"type": "text", "text": t} for t in texts]


SHAREGPT_CHAT = [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi there"},
                 {"from": "gpt", "value": "Hello! How can I help?"}, {"from": "user", "value": "What is 2 + 2?"},
                 {"from": "assistant", "value": "It is 4."}]
ANOTHER_LAYOUT = {  # a record in another trainer's layout, and the "messages" it trains as
    "sharegpt": ({"conversations": SHAREGPT_CHAT, "id": "x1"}, CHAT[:4] + CHAT[5:]),
    "trl_conversational": ({"prompt": CHAT[:4], "completion": CHAT[5:]}, CHAT[:4] + CHAT[5:]),
    "content_parts": ({"messages": [{"role": "system", "content": parts("Be brief.")},
                                    {"role": "user", "content": parts("Hi ", "there")},
                                    {"role": "assistant", "content": parts("Hello!", " How can I help?")}]},
                      [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
                       {"role": "assistant", "content": "Hello! How can I help?"}]),
}


@pytest.mark.parametrize("all_tokens", [False, True])
@pytest.mark.parametrize("layout", list(ANOTHER_LAYOUT))
def test_sharegpt_prompt_completion_and_content_part_records_train_as_their_messages_record(
        chat_tokenizer, tmp_path, layout, all_tokens):
    """Each layout other trainers write (they were refused) gives the token ids and the trained mask of the
    "messages" record it converts to, token for token; the replies alone are trained by default."""
    record, messages = ANOTHER_LAYOUT[layout]
    chat = chat_records.chat_encoder(chat_tokenizer, all_tokens)
    encode = lambda s: chat_tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731  (unused: no documents)
    streams = []
    for name, line in (("other", record), ("messages", {"messages": messages})):
        files, count = text_corpus.check_corpus([write_jsonl(tmp_path / f"{name}.jsonl", [line])], None, all_tokens)
        assert count == (0, 1)
        corpus = text_corpus.tokenize_corpus(files, encode, encode, eos_id=None, chat=chat)
        streams.append((corpus.ids.tolist(), None if corpus.trained is None else corpus.trained.tolist()))
    assert streams[0] == streams[1]
    ids, trained = streams[0]
    assert ids == chat_tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
    replies = "".join(m["content"] + "<|im_end|>\n" for m in messages if m["role"] == "assistant")
    assert trained is None if all_tokens else chat_tokenizer.decode([i for i, t in zip(ids, trained) if t]) == replies


@pytest.mark.parametrize("record, layout", [({"conversations": SHAREGPT_CHAT}, '"conversations"'),
                                           ({"prompt": CHAT[:4], "completion": CHAT[5:]}, '"prompt" / "completion"')])
def test_a_converted_record_without_a_chat_template_is_refused_naming_its_layout(tmp_path, record, layout):
    path = write_jsonl(tmp_path / "c.jsonl", [{"text": "a document"}, record])
    with pytest.raises(ConfigError) as e:
        chat_records.check_jsonl(path, "the tokenizer has no chat template", all_tokens=False)
    assert str(e.value) == f"{path}:2: a {layout} record, but the tokenizer has no chat template"


def test_messages_without_a_chat_template_are_refused_before_the_model_loads(tiny_set, tmp_path, capsys, monkeypatch):
    """The tiny LM's tokenizer has no chat template: the first messages record (line 2) is named, and the
    model is never loaded."""
    from library.training import llm_task

    path = write_jsonl(tmp_path / "chat.jsonl", [{"text": "a document"}, {"messages": CHAT}, {"messages": CHAT}])
    monkeypatch.setattr(llm_task.LLMTask, "_load_model", lambda *a: pytest.fail("the model loaded"))
    code = train_lora.main(["--model_type", "llm", "--pretrained_model_name_or_path", tiny_set["llm"], "--train_data", path,
                            "--output_dir", str(tmp_path / "out"), "--mixed_precision", "no"])
    assert code == 2
    assert capsys.readouterr().err == (f"error: {path}:2: a \"messages\" record, but the tokenizer in {tiny_set['llm']} has "
                                       f"no chat template (chat_template in tokenizer_config.json, or chat_template.jinja) "
                                       f"to render it with\n")


def test_text_records_and_txt_files_are_the_same_documents(tmp_path, monkeypatch):
    """A .jsonl "text" record is a document as a .txt file is (EOS after each); a .txt file larger than a
    read is cut into pieces as the whole text would be (BOM dropped, a CRLF split across two reads one
    newline), and nothing is masked."""
    monkeypatch.setattr(text_corpus, "PIECE_CHARS", 64)
    doc = "".join(f"Line {i} with some words.\r\n" for i in range(40))
    (tmp_path / "a.txt").write_bytes(b"\xef\xbb\xbf" + doc.encode())
    jsonl = write_jsonl(tmp_path / "b.jsonl", [{"text": doc.replace("\r\n", "\n")}, {"text": "short"}])
    encode = lambda s: [ord(c) for c in s]  # noqa: E731
    files, count = text_corpus.check_corpus([str(tmp_path)], None, all_tokens=False)
    ids, trained, _ = text_corpus.tokenize_corpus(files, encode, encode, eos_id=0)
    whole = encode(doc.replace("\r\n", "\n")) + [0]
    assert count == (3, 0) and trained is None and ids.tolist() == whole + whole + encode("short") + [0]
    assert files[1] == jsonl


def test_empty_text_records_and_files_are_no_documents(tmp_path):
    """They were counted as none but tokenized as BOS (where the tokenizer adds one) + EOS: 'stop at once', trained
    (2026-11-27); a file of a BOM and whitespace too (2026-11-28)."""
    (tmp_path / "blank.txt").write_text(" \n\n ")
    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbf \n")
    write_jsonl(tmp_path / "b.jsonl", [{"text": ""}, {"text": "one"}, {"text": " \n"}, {"text": "two"}])
    encode = lambda s: [1] + [ord(c) for c in s]  # noqa: E731  (a BOS first, as Llama's tokenizer adds)
    files, count = text_corpus.check_corpus([str(tmp_path)], None, all_tokens=False)
    ids, _, starts = text_corpus.tokenize_corpus(files, encode, encode, eos_id=0)
    assert count == (2, 0) and files == [str(tmp_path / "b.jsonl")]
    assert ids.tolist() == encode("one") + [0] + encode("two") + [0] and starts.tolist() == [0, 5]


@pytest.mark.parametrize("spans", [[(6, 20), (30, 40)], [(6, 20), (30, 40), (35, 36)]])  # apart (bisection); overlapping
def test_a_token_holding_a_replys_first_character_is_trained_as_transformers_marks_it(spans):
    """A ChatML reply opening with newlines: the template's "\\n" and the reply's "\\n\\n" are one token
    (characters 5-8 here; the reply starts at 6). transformers' return_assistant_tokens_mask trains it
    (char_to_token of the span's start); it was left out. A token ending at the span's start is not."""
    offsets = [(0, 5), (5, 8), (8, 20), (20, 22), (22, 30), (28, 31), (31, 40), (40, 41)]
    assert chat_records.starts_inside(offsets, spans) == [False, True, True, False, False, True, True, False]


def test_a_bad_utf8_byte_past_the_first_read_is_named_at_its_file_offset(tmp_path, monkeypatch):
    """The same message and offset as read_utf8 gives for the whole file, with a character split across reads."""
    from library.io import read_utf8

    monkeypatch.setattr(text_corpus, "READ_BYTES", 7)
    path = tmp_path / "a.txt"
    path.write_bytes("caf\u00e9 \u00fcber ".encode() * 3 + b"\xff tail")
    with pytest.raises(ValueError) as whole:
        read_utf8(str(path))
    with pytest.raises(ValueError) as streamed:
        text_corpus.check_text_file(str(path))
    assert str(streamed.value) == str(whole.value) and "at offset 36" in str(streamed.value)


def test_the_token_stream_joins_blocks_and_starts_its_mask_where_a_token_is_untrained(monkeypatch):
    monkeypatch.setattr(text_corpus.TokenStream, "BLOCK", 5)
    stream = text_corpus.TokenStream()
    for n in range(4):
        stream.add(list(range(10 * n, 10 * n + 3)))
    stream.add([90, 91, 92], [False, True, False])
    stream.add([93])
    ids, trained = stream.finish()
    assert ids.tolist() == [0, 1, 2, 10, 11, 12, 20, 21, 22, 30, 31, 32, 90, 91, 92, 93] and ids.dtype == torch.int32
    assert trained.tolist() == [True] * 12 + [False, True, False, True]


def test_windows_without_a_trained_target_are_left_out_and_the_rest_are_ignored():
    """targets are IGNORE (-100) where untrained; a window whose targets are all untrained would give a
    0 / 0 loss (nan) and is dropped: of the 4 windows of 4 tokens, the second and the last have none."""
    trained = torch.tensor([False] * 17)
    trained[[1, 2, 12]] = True
    ds = text_corpus.TextWindowDataset(torch.arange(17), 4, None, trained)
    assert [int(s) for s in ds.starts] == [0, 8]
    x, y = ds[1]
    assert x.tolist() == [8, 9, 10, 11] and y.tolist() == [-100, -100, -100, 12]
    assert text_corpus.TextWindowDataset(torch.arange(17), 4).starts == range(0, 13, 4)


def test_a_lora_trains_on_a_messages_file_with_the_loss_on_replies_only(tiny_set, chat_llm, tmp_path):
    """4 steps on 40 conversations: every train target outside a reply is -100, and the held-out loss is
    over the replies' tokens alone (finite)."""
    from library.training.config import load_config
    from library.training.llm_task import LLMTask

    records = [{"messages": [{"role": "user", "content": f"Count to {n}."},
                             {"role": "assistant", "content": " ".join(str(i) for i in range(1, n + 1))}]}
               for n in range(2, 42)]
    path = write_jsonl(tmp_path / "chat.jsonl", records)
    argv = ["--model_type", "llm", "--pretrained_model_name_or_path", chat_llm, "--train_data", path, "--output_dir",
            str(tmp_path / "out"), "--output_name", "chat", "--mixed_precision", "no", "--max_length", "32", "--batch_size",
            "4", "--max_train_steps", "4", "--eval_every_n_steps", "4", "--sample_max_new_tokens", "4",
            "--optimizer_type", "AdamW", "--learning_rate", "1e-2"]
    args = load_config(argv)
    task = LLMTask(args, train_lora.make_accelerator(args))
    im_start = task.tokenizer.convert_tokens_to_ids("<|im_start|>")
    x, y = task.train_set[0]
    assert (y == im_start).sum() == 0 and (y == -100).any() and (y != -100).any()
    assert 0 < int(task.val_trained.sum()) < len(task.val_ids)
    assert train_lora.main(argv) == 0
    with open(tmp_path / "out" / "chat_log.csv") as f:
        losses = [float(r["loss"]) for r in csv.DictReader(f)]
    with open(tmp_path / "out" / "chat_eval.csv") as f:
        val = [float(r["val_loss"]) for r in csv.DictReader(f)]
    assert len(losses) == 4 and all(0 < v < 20 for v in losses + val)


def test_conversations_longer_than_a_window_are_counted_in_one_warning(tiny_set, chat_llm, tmp_path):
    """3 of 33 conversations do not fit a window of max_length 96 + 1 tokens: the windows cut each into pieces
    trained apart, which nothing said. One warning now gives how many, the longest (its file:line) and the
    windows at least; prompt / completion records too."""
    import warnings

    from library.training.config import load_config
    from library.training.llm_task import LLMTask

    short = [{"role": "user", "content": "Count to 3."}, {"role": "assistant", "content": "1 2 3"}]
    long = [{"role": "user", "content": "Count to 40."},
            {"role": "assistant", "content": " ".join(map(str, range(1, 41)))}]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": short}] * 30 + [{"messages": long}] * 3)
    args = load_config(["--model_type", "llm", "--pretrained_model_name_or_path", chat_llm, "--train_data", path,
                        "--output_dir", str(tmp_path / "out"), "--mixed_precision", "no", "--max_length", "96"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        task = LLMTask(args, train_lora.make_accelerator(args))
    said = [str(w.message) for w in caught if "are longer than a window" in str(w.message)]
    longest = len(task.tokenizer.apply_chat_template(long, tokenize=True, return_dict=False))
    assert said == [f"train_data: 3 of 33 records (conversations, prompt / completion) are longer than a window of "
                    f"max_length 96 + 1 tokens (the "
                    f"longest {longest}, {path}:31): they are split into at least {3 * -(-(longest - 1) // 96)} "
                    f"windows, trained apart (raise max_length, or shorten them)"], said
    assert longest > 97
    # a plain-text prompt / completion record longer than a window: counted and named too (it went unsaid)
    record = {"prompt": "Count to 60:", "completion": " " + " ".join(map(str, range(1, 61)))}
    path = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "Count to 3:", "completion": " 1 2 3"}] * 30 + [record])
    args = load_config(["--model_type", "llm", "--pretrained_model_name_or_path", chat_llm, "--train_data", path,
                        "--output_dir", str(tmp_path / "out"), "--mixed_precision", "no", "--max_length", "96"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        LLMTask(args, train_lora.make_accelerator(args))
    said = [str(w.message) for w in caught if "are longer than a window" in str(w.message)]
    assert len(said) == 1 and said[0].startswith("train_data: 1 of 31 records") and f"{path}:31)" in said[0], said


def test_the_held_out_loss_averages_over_the_trained_tokens_only():
    """70 held-out tokens, 23 of them trained (every third from 1): the token-weighted mean over those 23
    targets, not over all 69 (the all-token loss differs)."""
    from types import SimpleNamespace

    import torch.nn.functional as F

    from library.models.llm import LLM, LLMConfig
    from library.training.llm_task import LLMTask

    model = LLM(LLMConfig(vocab_size=40, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=32,
                          qkv_bias=False, max_position_embeddings=32)).eval()
    ids, trained = torch.randint(0, 40, (70,)), torch.arange(70) % 3 == 1
    task = SimpleNamespace(val_ids=ids, val_trained=trained, val_starts=None, val_packed=None,  # stream windows
                           args=SimpleNamespace(max_length=16, batch_size=3), model=model, device="cpu")
    total, count = 0.0, 0
    for s in range(0, 69, 16):
        window, keep = ids[s : s + 17][None], trained[s + 1 : s + 17]
        with torch.no_grad():
            losses = F.cross_entropy(model(window[:, :-1])[0], window[0, 1:], reduction="none")
        total, count = total + float(losses[keep].sum()), count + int(keep.sum())
    assert count == 23 and abs(LLMTask.held_out_loss(task) - total / count) <= 1e-5
    task.val_trained = None
    assert abs(LLMTask.held_out_loss(task) - total / count) > 1e-3


def test_a_held_out_tail_without_a_reply_reports_no_loss_and_says_so(tiny_set, chat_llm, tmp_path):
    """The held-out split is the stream's last tokens: where they hold no assistant token (the last
    conversation ends with a long user turn), no held-out loss is reported, with one warning at start
    (it was a nan val_loss in every eval line and the eval log)."""
    reply = [{"role": "user", "content": "Count to 3."}, {"role": "assistant", "content": "1 2 3"}]
    tail = reply + [{"role": "user", "content": " ".join(["more words that nobody answers"] * 40)}]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": reply}] * 30 + [{"messages": tail}])
    argv = ["--model_type", "llm", "--pretrained_model_name_or_path", chat_llm, "--train_data", path, "--output_dir",
            str(tmp_path / "out"), "--output_name", "chat", "--mixed_precision", "no", "--max_length", "32", "--batch_size",
            "4", "--max_train_steps", "2", "--eval_every_n_steps", "2", "--sample_max_new_tokens", "2",
            "--optimizer_type", "AdamW", "--val_fraction", "0.1"]
    with pytest.warns(UserWarning, match=r"holds out the last \d+ tokens, none of them an assistant token"):
        assert train_lora.main(argv) == 0
    with open(tmp_path / "out" / "chat_eval.csv") as f:
        rows = list(csv.DictReader(f))
    assert rows and all("val_loss" not in r or r["val_loss"] in ("", None) for r in rows), rows


@pytest.mark.parametrize("data, flag, templated", [("messages", None, True), ("messages", "false", False),
                                                    ("text", None, False), ("text", "true", True)])
def test_the_sample_prompt_is_a_user_turn_where_the_data_is_chat_and_the_sample_is_its_reply(
        tiny_set, chat_llm, tmp_path, monkeypatch, data, flag, templated):
    """A LoRA trained on messages records is asked sample_prompt as one user turn with the generation prompt
    (transformers' apply_chat_template(add_generation_prompt=True) ids), and the eval shows and logs the reply
    alone; sample_chat_template forces it on or off. The old line encoded the prompt raw ('Count to 3.' as a
    document's start, never seen in training) and showed the prompt with the reply."""
    from library.training import llm_task
    from library.training.config import load_config

    records = [{"messages": [{"role": "user", "content": f"Count to {n}."}, {"role": "assistant", "content": "1 2 3 4 5"}]}
               if data == "messages" else {"text": f"Count to {n}. 1 2 3 4 5"} for n in range(2, 12)]
    argv = ["--model_type", "llm", "--pretrained_model_name_or_path", chat_llm, "--train_data",
            write_jsonl(tmp_path / "d.jsonl", records), "--output_dir", str(tmp_path / "out"), "--output_name", "chat",
            "--mixed_precision", "no", "--max_length", "16", "--val_fraction", "0", "--max_train_steps", "1",
            "--sample_prompt", "Count to 3."] + (["--sample_chat_template", flag] if flag else [])
    args = load_config(argv)
    task = llm_task.LLMTask(args, train_lora.make_accelerator(args))
    reply = task.tokenizer.encode(" 1 2 3", add_special_tokens=False) + [task.tokenizer.eos_token_id]
    asked = []
    monkeypatch.setattr(llm_task, "generate", lambda model, idx, *a, **k: asked.append(idx[0].tolist()) or
                        torch.cat([idx, torch.tensor([reply])], 1))
    (tmp_path / "out").mkdir()
    task.report_eval("start")
    user_turn = task.tokenizer.apply_chat_template([{"role": "user", "content": "Count to 3."}], tokenize=True,
                                                   add_generation_prompt=True, return_dict=False)
    assert asked == [user_turn if templated else task.encode("Count to 3.")]
    assert user_turn[-3:] == task.tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    with open(tmp_path / "out" / "chat_eval.csv") as f:
        assert [r["sample"] for r in csv.DictReader(f)] == [" 1 2 3" if templated else "Count to 3. 1 2 3"]


def test_sample_chat_template_true_without_a_template_is_one_line_before_the_data_is_read(tiny_set, tmp_path, capsys,
                                                                                           monkeypatch):
    from library.training import llm_task

    monkeypatch.setattr(llm_task, "check_corpus", lambda *a: pytest.fail("the data was read"))
    code = train_lora.main(["--model_type", "llm", "--pretrained_model_name_or_path", tiny_set["llm"], "--train_data",
                            tiny_set["corpus"], "--output_dir", str(tmp_path / "out"), "--mixed_precision", "no",
                            "--sample_chat_template", "true"])
    assert code == 2
    assert capsys.readouterr().err == (f"error: sample_chat_template = true, but the tokenizer in {tiny_set['llm']} has "
                                       f"no chat template (chat_template in tokenizer_config.json, or chat_template.jinja) "
                                       f"to render sample_prompt with\n")


@pytest.mark.parametrize("texts, warned", [(1, None), (2, 2)])
def test_the_no_eos_warning_counts_documents_not_conversations(chat_llm, tmp_path, texts, warned):
    """Without an eos_token, documents ("text" records, .txt files) run together; conversations are bordered
    by their template's <|im_start|>. One text record and 3 conversations: no warning (the old line: 'the 4
    documents'); two: 'the 2 documents'."""
    import warnings

    from library.training.config import load_config
    from library.training.llm_task import LLMTask

    config = json.loads((tmp_path / "chat_llm" / "tokenizer_config.json").read_text())
    (tmp_path / "chat_llm" / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items()
                                                                             if k != "eos_token"}))
    records = [{"text": f"Document {n} says hello to the world."} for n in range(texts)] + [{"messages": CHAT}] * 3
    args = load_config(["--model_type", "llm", "--pretrained_model_name_or_path", chat_llm, "--train_data",
                        write_jsonl(tmp_path / "d.jsonl", records), "--output_dir", str(tmp_path / "out"),
                        "--mixed_precision", "no", "--max_length", "16", "--val_fraction", "0", "--max_train_steps", "1"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        LLMTask(args, train_lora.make_accelerator(args))
    said = [str(w.message) for w in caught if "eos_token" in str(w.message)]
    assert said == ([] if warned is None else [f"{chat_llm}: the tokenizer names no eos_token, so the {warned} documents of "
                                               f"train_data (.txt files, \"text\" and plain-text \"prompt\" / "
                                               f"\"completion\" records) run together with no border between them "
                                               f"(set eos_token in its tokenizer_config.json)"])


def many_turn_chat(turns: int, system: bool) -> list:
    """turns user questions, every third answered through a tool call (two tool results in a row, which
    Qwen2.5's template joins in one user turn), the rest directly; the last turn left unanswered."""
    chat = [{"role": "system", "content": "Be brief."}] if system else []
    for t in range(turns):
        chat.append({"role": "user", "content": f"Question {t}: what is {t} + {t}?"})
        if t % 3 == 1:
            call = {"type": "function", "function": {"name": "add", "arguments": {"a": t, "b": t}}}
            chat += [{"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "tool", "content": str(2 * t)},
                     {"role": "tool", "content": "ok"}]
        chat.append({"role": "assistant", "content": f"It is {2 * t}."})
    return chat + [{"role": "user", "content": "Thanks!"}]


def quadratic_mask(tok, messages):
    """The old line's (ids, trained): each assistant message's span from the renders of its prefix (O(n) renders
    of O(n) messages), each token tried against every span."""
    render = lambda m, g=False: tok.apply_chat_template(m, tokenize=False, add_generation_prompt=g)  # noqa: E731
    text = render(messages)
    spans = [(len(render(messages[:i], True)), len(render(messages[: i + 1])))
             for i, m in enumerate(messages) if m["role"] == "assistant"]
    encoded = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    return encoded["input_ids"], [any(a <= s < b for a, b in spans) for s, _ in encoded["offset_mapping"]]


@pytest.mark.parametrize("system", [True, False])
def test_a_many_turn_conversation_is_rendered_in_linear_time_with_the_old_mask_bit_for_bit(chat_tokenizer, monkeypatch,
                                                                                            system):
    """40 turns (121 or 120 messages, 53 assistant messages, 13 of them tool calls): the ids and the trained mask
    equal the old quadratic line's, while the messages rendered in all sum to 8 per message (the old
    line: 6,600 renders of a message, 55 per message)."""
    chat = many_turn_chat(40, system)
    expected = quadratic_mask(chat_tokenizer, chat)
    rendered, apply = [], chat_tokenizer.apply_chat_template
    monkeypatch.setattr(chat_tokenizer, "apply_chat_template", lambda m, **k: rendered.append(len(m)) or apply(m, **k))
    ids, trained = chat_records.chat_encoder(chat_tokenizer, all_tokens=False)(chat, "x.jsonl:1")
    assert (ids, trained) == expected and sum(trained) > 500
    assert sum(rendered) < 9 * len(chat), (sum(rendered), len(chat))


def test_a_template_that_numbers_its_turns_falls_back_to_rendering_every_prefix(chat_tokenizer):
    """A window of a template that writes loop.index renders other numbers than the whole conversation: the
    windows are not used (they are with ChatML, on the same 31 messages), and the mask is the old line's."""
    tok = chat_tokenizer
    template = ("{%- for m in messages %}{{- '<|im_start|>' + m.role + ' ' + loop.index|string + '\\n' + "
                "(m.content or m.tool_calls[0].function.name) + '<|im_end|>\\n' }}{%- endfor %}"
                "{%- if add_generation_prompt %}{{- '<|im_start|>assistant ' + (messages|length + 1)|string + '\\n' }}{%- endif %}")
    chat = many_turn_chat(10, system=True)
    render = lambda m, g=False: tok.apply_chat_template(m, tokenize=False, add_generation_prompt=g)  # noqa: E731
    assert chat_records.windowed_spans(render, chat, render(chat)) is not None
    with chat_template(tok, template):
        assert chat_records.windowed_spans(render, chat, render(chat)) is None
        assert chat_records.chat_encoder(tok, all_tokens=False)(chat, "x.jsonl:1") == quadratic_mask(tok, chat)


class ScriptedLM(torch.nn.Module):
    """A stand-in model whose next token (greedy) is script[k] at the k-th generated step after a prompt of
    `prompt` tokens: what a LoRA that learned the replies says, then what it says after the turn ends."""

    def __init__(self, config, prompt: int, script: list[int]):
        super().__init__()
        self.config, self.prompt, self.script = config, prompt, script

    def forward(self, idx):
        logits = torch.full((*idx.shape, self.config.vocab_size), -1e4)
        logits[:, -1, self.script[min(idx.shape[1] - self.prompt, len(self.script) - 1)]] = 1e4
        return logits


def test_a_chat_sample_stops_at_the_templates_end_of_turn_where_eos_is_another_token(chat_llm, tmp_path):
    """A base whose eos_token is <|endoftext|> (Qwen2.5's base models, Gemma's <eos> beside <end_of_turn>) with
    ChatML data: the LoRA learns to end a reply with <|im_end|>, so the sample is the reply and stops there (as
    Qwen2.5-Instruct's generation_config.json lists [<|im_end|>, <|endoftext|>] for generate). It ran on past the
    turn into a made-up next user turn: '1 2 3\\nuser\\nCount to 4.\\n' (the special tokens skipped)."""
    from library.training import llm_task
    from library.training.config import load_config

    config = json.loads((tmp_path / "chat_llm" / "tokenizer_config.json").read_text())
    (tmp_path / "chat_llm" / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<|endoftext|>"}))
    records = [{"messages": [{"role": "user", "content": f"Count to {n}."}, {"role": "assistant", "content": "1 2 3"}]}
               for n in range(2, 12)]
    args = load_config(["--model_type", "llm", "--pretrained_model_name_or_path", chat_llm, "--train_data",
                        write_jsonl(tmp_path / "d.jsonl", records), "--output_dir", str(tmp_path / "out"),
                        "--output_name", "chat", "--mixed_precision", "no", "--max_length", "16", "--val_fraction", "0",
                        "--max_train_steps", "1", "--sample_prompt", "Count to 3.", "--temperature", "0"])
    task = llm_task.LLMTask(args, train_lora.make_accelerator(args))
    tok = task.tokenizer
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.eos_token == "<|endoftext|>" and task.sample_stops == (tok.eos_token_id, im_end)
    script = tok.encode("1 2 3<|im_end|>\n<|im_start|>user\nCount to 4.<|im_end|>\n", add_special_tokens=False)
    task.model = ScriptedLM(task.model.config, len(task.sample_ids), script + [tok.eos_token_id])
    assert task.evaluate()["sample"] == "1 2 3"


def test_a_pretrained_folder_keeps_the_bases_generation_config_and_stops_where_the_chat_sample_did(chat_llm, tmp_path):
    """pretrain = true on chat data from a base whose EOS is <|endoftext|> and whose generation_config.json has
    sampling defaults: the saved generation_config.json keeps the base's keys, and its eos_token_id lists the
    base's ids and then <|im_end|>, where the eval sample stopped. It was {eos_token_id, pad_token_id} from
    config.json alone, so transformers' generate() on the folder ran on past the reply into made-up turns."""
    folder = tmp_path / "chat_llm"
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<|endoftext|>"}))
    tok = load_tokenizer(chat_llm)
    eos, im_end = tok.convert_tokens_to_ids("<|endoftext|>"), tok.convert_tokens_to_ids("<|im_end|>")
    model_config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**model_config, "eos_token_id": eos}))  # as Qwen2.5's base says
    base = {"bos_token_id": eos, "do_sample": True, "eos_token_id": [eos], "temperature": 0.7, "top_p": 0.8,
            "top_k": 20}
    (folder / "generation_config.json").write_text(json.dumps(base))
    records = [{"messages": [{"role": "user", "content": f"Count to {n}."}, {"role": "assistant", "content": "1 2 3"}]}
               for n in range(2, 12)]
    assert train_lora.main(["--model_type", "llm", "--pretrain", "true", "--pretrained_model_name_or_path", chat_llm,
                            "--train_data", write_jsonl(tmp_path / "d.jsonl", records), "--output_dir",
                            str(tmp_path / "out"), "--output_name", "full", "--mixed_precision", "no", "--max_length",
                            "16", "--max_train_steps", "1", "--eval_every_n_steps", "0",
                            "--optimizer_type", "AdamW"]) == 0
    saved = json.loads((tmp_path / "out" / "full" / "generation_config.json").read_text())
    assert saved == {**base, "eos_token_id": [eos, im_end], "pad_token_id": tok.pad_token_id}


# Qwen3's rule for thinking (its chat template's, tools left out): an assistant message after the last user
# query keeps its reasoning_content, and the last message always gets a <think> block (empty without one).
QWEN3_THINKING_TEMPLATE = (
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}"
    "{%- for message in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}"
    "{%- if ns.multi_step_tool and message.role == 'user' %}"
    "{%- set ns.multi_step_tool = false %}{%- set ns.last_query_index = index %}{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}{%- set reasoning = message.reasoning_content or '' %}"
    "{%- if loop.index0 > ns.last_query_index and (loop.last or reasoning) %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def test_qwen3_thinking_whose_windows_each_match_is_still_refused_as_a_rewrite(chat_tokenizer):
    """Qwen3's thinking rule on a tool chain: a reply with reasoning after the query, then replies without.
    Each window (no user message in it, so Qwen3 marks none as after the query) renders those replies as
    the whole conversation does, but the prefix through one of them gives it an empty <think> block the
    whole conversation drops: the windows' last end differs from the prefix's, the windows are not used,
    and the record is refused naming the first such reply (without that end check it was trained on)."""
    chat = [{"role": "system", "content": "Use the tools."}]
    for t in range(8):  # messages 1-16: no user query yet, every reply plain
        chat += [{"role": "assistant", "content": f"Step {t}."}, {"role": "tool", "content": f"done {t}"}]
    chat += [{"role": "user", "content": "Now sum them."},
             {"role": "assistant", "content": "Summing.", "reasoning_content": "Add the steps."}]
    for t in range(3):
        chat += [{"role": "tool", "content": str(t)}, {"role": "assistant", "content": f"Partial {t}."}]
    tok = chat_tokenizer
    render = lambda m, g=False: tok.apply_chat_template(m, tokenize=False, add_generation_prompt=g)  # noqa: E731
    old, tok.chat_template = tok.chat_template, QWEN3_THINKING_TEMPLATE
    try:
        text = render(chat)
        assert "<think>\nAdd the steps.\n</think>\n\nSumming." in text and text.count("<think>") == 2
        assert chat_records.window_span(render, chat, 18, 20, len(render(chat[:19])), text) is not None
        assert chat_records.windowed_spans(render, chat, text) is None
        with pytest.raises(ConfigError, match=r"^x.jsonl:1: the chat template renders the conversation up to "
                                              r"messages\[20\] \(assistant\)"):
            chat_records.chat_encoder(tok, all_tokens=False)(chat, "x.jsonl:1")
    finally:
        tok.chat_template = old


def test_accumulated_micro_batches_train_the_loss_of_one_batch_of_all_their_tokens(tiny_set, chat_llm, tmp_path):
    """Replies of 2..41 numbers: windows hold from a few to 31 trained tokens. Each micro-batch's token mean was
    averaged, weighting a window of few trained tokens more: batch 4 x accumulation 2 (and 2 processes x batch 4,
    the same code) trained another objective than batch 8 (logged loss 6.14358 vs 6.14374, the LoRA 0.054 apart
    after 4 steps). The step's loss is the mean over all its trained tokens now (Task.loss_weight)."""
    records = [{"messages": [{"role": "user", "content": f"Count to {n}."},
                             {"role": "assistant", "content": " ".join(str(i) for i in range(1, n + 1))}]}
               for n in range(2, 42)]
    path = write_jsonl(tmp_path / "chat.jsonl", records)

    def run(out, *extra):
        argv = ["--model_type", "llm", "--pretrained_model_name_or_path", chat_llm, "--train_data", path, "--output_dir",
                str(tmp_path / out), "--output_name", "chat", "--mixed_precision", "no", "--max_length", "32",
                "--max_train_steps", "2", "--eval_every_n_steps", "0", "--optimizer_type", "AdamW", "--learning_rate",
                "1e-2", "--save_format", "kohya", *extra]
        assert train_lora.main(argv) == 0
        with open(tmp_path / out / "chat_log.csv") as f:
            return [float(r["loss"]) for r in csv.DictReader(f)], load_file(tmp_path / out / "chat.safetensors")

    (whole, a), (accumulated, b) = run("whole", "--batch_size", "8"), run("acc", "--batch_size", "4", "--gradient_accumulation_steps", "2")
    assert whole == pytest.approx(accumulated, abs=2e-6), (whole, accumulated)
    # (the LoRA after 2 AdamW steps at lr 1e-2: Adam divides each gradient by its own size, so a float32 summation
    # order difference in a near-zero gradient moves its weight by up to ~lr; 2.5e-4 on an AMX Xeon, < 1e-5 on
    # others; the old objective's loss was 1.6e-4 off, above)
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-3
