""".jsonl LLM records in other trainers' layouts (library/data/chat_records.py, text_corpus.py): TRL's plain-text
prompt-completion trained as its SFTTrainer trains it (raw text, EOS, the loss on the completion), and
LLaMA-Factory's ShareGPT "system", "tools", function_call and observation turns rendered by the chat template."""

import json

import pytest

import train_lora
from library.data import chat_records, text_corpus
from library.errors import ConfigError
from library.models.tiny_files import QWEN2_CHAT_TEMPLATE
from tests.test_llm_jsonl import chat_llm, chat_tokenizer, write_jsonl  # noqa: F401 (fixtures)


def trained_text(tok, ids, trained) -> str:
    return tok.decode([i for i, t in zip(ids, trained) if t])


def conversations(files, tok, all_tokens: bool) -> text_corpus.Corpus:
    """The stream of files that hold conversations only (no document to encode)."""
    encode = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    return text_corpus.tokenize_corpus(files, encode, encode, None, chat_records.chat_encoder(tok, all_tokens))


PROMPT, COMPLETION = "Translate to French: cheese =>", " fromage"


@pytest.mark.parametrize("all_tokens", [False, True])
def test_a_plain_text_prompt_completion_trains_as_trl_tokenizes_it(chat_tokenizer, tmp_path, all_tokens):
    """TRL's SFTTrainer tokenizes a plain-text prompt-completion record as raw text, no chat template:
    tokenizer(prompt + completion + eos_token), special tokens included, and trains by default on the tokens after
    tokenizer(prompt)'s only (completion_only_loss); train_on_all_tokens trains them all. It was rendered by the
    chat template as a user turn and an assistant turn (refused without a template). Its ids are the
    {"text": prompt + completion} record's, a document's."""
    tok = chat_tokenizer
    encode = lambda s: tok(s)["input_ids"]  # noqa: E731  (as LLMTask.encode: the tokenizer's special tokens)
    path = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": PROMPT, "completion": COMPLETION}])
    files, counts = text_corpus.check_corpus([path], "the tokenizer has no chat template", all_tokens)
    assert counts == (1, 0)  # a document (raw text ended by EOS), which needs no template
    corpus = text_corpus.tokenize_corpus(files, encode, encode, tok.eos_token_id,
                                         chat_records.chat_encoder(tok, all_tokens), all_tokens)
    prompt_ids, ids = tok(text=PROMPT)["input_ids"], tok(text=PROMPT + COMPLETION + tok.eos_token)["input_ids"]  # TRL's
    assert corpus.ids.tolist() == ids and ids[-1] == tok.eos_token_id
    if all_tokens:
        assert corpus.trained is None
    else:
        assert corpus.trained.tolist() == [False] * len(prompt_ids) + [True] * (len(ids) - len(prompt_ids))
        assert trained_text(tok, ids, corpus.trained.tolist()) == " fromage<|im_end|>"
    document = write_jsonl(tmp_path / "t.jsonl", [{"text": PROMPT + COMPLETION}])
    assert text_corpus.tokenize_corpus([document], encode, encode, tok.eos_token_id).ids.tolist() == ids


@pytest.mark.parametrize("all_tokens", ["false", "true"])
def test_the_trainer_masks_plain_prompts_by_train_on_all_tokens_and_samples_them_raw(chat_llm, tmp_path, all_tokens):
    """LLMTask over 40 plain-text prompt-completion records: no target is a chat template token, the prompts'
    tokens are -100 unless train_on_all_tokens (the key reaches the raw records), and sample_prompt is asked as
    raw text, as the records were trained (not as a user turn: they are no conversations)."""
    from library.training.config import load_config
    from library.training.llm_task import LLMTask

    records = [{"prompt": f"Question {n}: what is {n} plus {n}? Answer:", "completion": f" {2 * n}."} for n in range(40)]
    args = load_config(["--model_type", "llm", "--pretrained_model_name_or_path", chat_llm, "--train_data",
                        write_jsonl(tmp_path / "pc.jsonl", records), "--output_dir", str(tmp_path / "out"),
                        "--mixed_precision", "no", "--max_length", "32", "--val_fraction", "0",
                        "--train_on_all_tokens", all_tokens, "--sample_prompt", "Question 1:",
                        "--packing", "stream"])  # windows without padding: a -100 is a border or a prompt's
    task = LLMTask(args, train_lora.make_accelerator(args))
    im_start = task.tokenizer.convert_tokens_to_ids("<|im_start|>")
    targets = [task.train_set[i][1] for i in range(len(task.train_set))]
    assert not any((y == im_start).any() for y in targets)
    assert any((y == -100).sum() > 3 for y in targets) == (all_tokens == "false")  # more than the borders
    assert task.sample_chat is False and task.sample_ids == task.tokenizer("Question 1:")["input_ids"]


TOOLS = [{"name": "get_weather", "description": "The weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
LLAMA_FACTORY = {  # glaive_toolcall_en_demo's layout: tools and the call as JSON text
    "system": "Be brief.", "tools": json.dumps(TOOLS),
    "conversations": [{"from": "human", "value": "Weather in Paris?"}, {"from": "function_call", "value": json.dumps(CALL)},
                      {"from": "observation", "value": "18 C"}, {"from": "gpt", "value": "It is 18 C."}]}
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": CALL}]},
            {"role": "tool", "content": "18 C"}, {"role": "assistant", "content": "It is 18 C."}]


@pytest.mark.parametrize("all_tokens", [False, True])
def test_llama_factory_system_tools_and_tool_turns_train_as_the_messages_record_with_tools(chat_tokenizer, tmp_path,
                                                                                           all_tokens):
    """LLaMA-Factory's ShareGPT record: the top-level "system" is the first message, "tools" (JSON text) goes to
    apply_chat_template(tools=...), function_call is an assistant message calling the tool, observation its tool
    result. The ids are transformers' own rendering with the tools (Qwen2.5's system turn lists them), the
    trained tokens the call and the reply; the same as the "messages" record with its "tools". "system" and
    "tools" were ignored, function_call / observation refused."""
    tok = chat_tokenizer
    streams = []
    for name, record in (("lf", LLAMA_FACTORY), ("messages", {"messages": MESSAGES, "tools": TOOLS})):
        files, counts = text_corpus.check_corpus([write_jsonl(tmp_path / f"{name}.jsonl", [record])], None, all_tokens)
        assert counts == (0, 1)
        corpus = conversations(files, tok, all_tokens)
        streams.append((corpus.ids.tolist(), None if corpus.trained is None else corpus.trained.tolist()))
    assert streams[0] == streams[1]
    ids, trained = streams[0]
    assert ids == tok.apply_chat_template(MESSAGES, tools=TOOLS, tokenize=True, return_dict=False)
    assert "# Tools" in tok.decode(ids) and '"description": "The weather in a city"' in tok.decode(ids)
    assert trained is None if all_tokens else trained_text(tok, ids, trained) == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
        "It is 18 C.<|im_end|>\n")


def test_a_parallel_function_call_and_an_empty_system_and_tools_read_as_llama_factory_reads_them(tmp_path):
    """A function_call value holding a list is one assistant message with both calls; "system": "" and
    "tools": "" (LLaMA-Factory's columns left empty) add no system message and no tools."""
    record = {"system": "", "tools": "", "conversations": [
        {"from": "human", "value": "Weather in Paris and Rome?"},
        {"from": "function_call", "value": json.dumps([CALL, {**CALL, "arguments": {"city": "Rome"}}])},
        {"from": "observation", "value": "18 C"}, {"from": "observation", "value": "21 C"},
        {"from": "gpt", "value": "18 C and 21 C."}]}
    [(_, read)] = chat_records.jsonl_records(write_jsonl(tmp_path / "p.jsonl", [record]))
    assert "tools" not in read and [m["role"] for m in read["messages"]] == ["user", "assistant", "tool", "tool",
                                                                             "assistant"]
    assert [c["function"]["arguments"]["city"] for c in read["messages"][1]["tool_calls"]] == ["Paris", "Rome"]


def test_a_top_level_system_beside_messages_is_their_first_message(chat_tokenizer, tmp_path):
    """LLaMA-Factory's OpenAI-style layout ("messages" with a top-level "system" column) trains as the "messages"
    record whose first message is that system prompt; "system" was ignored there, the prompt lost unsaid."""
    tok = chat_tokenizer
    streams = []
    for name, record in (("lf", {"system": "Be brief.", "messages": MESSAGES[1:], "tools": TOOLS}),
                         ("messages", {"messages": MESSAGES, "tools": TOOLS})):
        files, counts = text_corpus.check_corpus([write_jsonl(tmp_path / f"{name}.jsonl", [record])], None, False)
        corpus = conversations(files, tok, False)
        streams.append((corpus.ids.tolist(), corpus.trained.tolist()))
    assert streams[0] == streams[1] and "Be brief." in tok.decode(streams[0][0])


TURNS = [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]


@pytest.mark.parametrize("record, message", [
    ({"system": "Be brief.", "conversations": [{"from": "system", "value": "Be kind."}, *TURNS]},
     "a top-level \"system\" and a system turn, conversations[0]; expected one of them"),
    ({"system": ["Be brief."], "conversations": TURNS}, "\"system\" is an array; expected a string (the system prompt)"),
    ({"system": "Be brief.", "messages": [{"role": "user", "content": "q"}, {"role": "system", "content": "Be kind."},
                                          {"role": "assistant", "content": "a"}]},
     "a top-level \"system\" and a system turn, messages[1]; expected one of them"),
    ({"tools": "get_weather(city)", "conversations": TURNS},
     "\"tools\" is a string that is not JSON (Expecting value: line 1 column 1 (char 0)); expected a list of tool "
     "objects or its JSON text"),
    ({"tools": json.dumps(TOOLS[0]), "conversations": TURNS},
     "\"tools\" is JSON text of an object; expected a list of tool objects"),
    ({"tools": 3, "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
     "\"tools\" is a number; expected a list of tool objects"),
    ({"tools": ["get_weather"], "conversations": TURNS}, "\"tools\" is an array holding a string; expected a list"),
    ({"conversations": [TURNS[0], {"from": "function_call", "value": "get_weather(Paris)"}]},
     "conversations[1] (function_call) value 'get_weather(Paris)' is no call; expected the JSON text of {\"name\": "
     "..., \"arguments\": {...}} or of a list of them (LLaMA-Factory's)"),
    ({"conversations": [TURNS[0], {"from": "function_call", "value": '{"arguments": {}}'}]},
     "conversations[1] (function_call) value '{\"arguments\": {}}' is no call"),
    ({"prompt": "q", "completion": "a", "tools": TOOLS},
     "\"tools\" beside a plain-text \"prompt\" and \"completion\", which train as raw text"),
])
def test_a_bad_system_tools_or_tool_turn_is_one_error_naming_file_and_line(tmp_path, record, message):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "fine"}, record])
    with pytest.raises(ConfigError) as e:
        text_corpus.check_corpus([path], None, all_tokens=False)
    assert str(e.value).startswith(f"{path}:2: {message}") and "\n" not in str(e.value)


def test_tools_a_chat_template_does_not_render_are_refused_naming_the_record(chat_tokenizer, tmp_path):
    """A template that reads no `tools` (this ChatML one: Qwen2.5's without its tools branch) would drop them and
    train calls to tools the model was never shown: refused in one line naming file:line."""
    plain = QWEN2_CHAT_TEMPLATE[QWEN2_CHAT_TEMPLATE.index("{%- elif messages[0]"):].replace("{%- elif", "{%- if", 1)
    old, chat_tokenizer.chat_template = chat_tokenizer.chat_template, plain
    try:
        path = write_jsonl(tmp_path / "t.jsonl", [LLAMA_FACTORY])
        with pytest.raises(ConfigError) as e:
            conversations([path], chat_tokenizer, all_tokens=False)
    finally:
        chat_tokenizer.chat_template = old
    assert str(e.value) == (f"{path}:1: the record gives \"tools\", but the tokenizer's chat template renders none of "
                            f"them (it reads no `tools`), so they would be dropped; use a template that renders tools "
                            f"(Qwen2.5's, Llama 3.1's) or leave \"tools\" out")


# ChatML as Llama 3 Instruct's and Gemma's templates render a turn: its content alone, no tool_calls branch
NO_CALLS_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] or '' }}<|im_end|>\n"
                     "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("all_tokens", [False, True])
def test_tool_calls_a_chat_template_does_not_render_are_refused_naming_the_record(chat_tokenizer, tmp_path,
                                                                                 all_tokens):
    """A template that reads no `tool_calls` rendered a call-only assistant turn as an empty reply, trained as
    such (the LoRA learns to answer nothing where the data calls a tool): refused in one line naming file:line,
    for OpenAI's tool_calls and a ShareGPT function_call turn alike. A call the template renders passes."""
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    openai = {"messages": [{"role": "user", "content": "Weather in Paris?"},
                           {"role": "assistant", "content": None, "tool_calls": [call]},
                           {"role": "tool", "content": "18 C"}, {"role": "assistant", "content": "It is 18 C."}]}
    sharegpt = {"conversations": [{"from": "human", "value": "Weather in Paris?"},
                                  {"from": "function_call", "value": json.dumps(CALL)},
                                  {"from": "observation", "value": "18 C"}, {"from": "gpt", "value": "It is 18 C."}]}
    assert len(conversations([write_jsonl(tmp_path / "ok.jsonl", [openai])], chat_tokenizer, all_tokens).ids) > 0
    old, chat_tokenizer.chat_template = chat_tokenizer.chat_template, NO_CALLS_TEMPLATE
    try:
        for name, record in (("o.jsonl", openai), ("s.jsonl", sharegpt)):
            path = write_jsonl(tmp_path / name, [{"text": "fine"}, record])
            with pytest.raises(ConfigError) as e:
                conversations([path], chat_tokenizer, all_tokens)
            assert str(e.value) == (
                f"{path}:2: an assistant turn calls a tool (\"tool_calls\", or a ShareGPT function_call turn), but "
                f"the tokenizer's chat template renders no tool_calls, so the call would train as an empty reply; "
                f"use a template that renders them (Qwen2.5's, Llama 3.1's) or leave the call out")
        plain = write_jsonl(tmp_path / "p.jsonl", [{"messages": openai["messages"][:1] + openai["messages"][3:]}])
        assert len(conversations([plain], chat_tokenizer, all_tokens).ids) > 0
    finally:
        chat_tokenizer.chat_template = old
