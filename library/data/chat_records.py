"""An LLM's .jsonl train data, one JSON object a line as PEFT / TRL / axolotl / unsloth datasets hold it:
{"text": "..."} (a document) or {"messages": [{"role": ..., "content": ...}, ...]} (a conversation).

A file is checked whole before the model loads (check_jsonl: the first bad line is one ConfigError naming
file:line), then read again a line at a time while tokenizing (jsonl_records). A conversation is rendered
by the tokenizer's own chat template; its assistant tokens are found by rendering it prefix by prefix
(assistant_spans), so templates without {% generation %} markers (most of them) work."""

from __future__ import annotations

import json
from typing import Callable, Iterator

from library.errors import ConfigError

ROLES = ("system", "user", "assistant", "tool")
FORMS = '{"text": "..."} or {"messages": [{"role": ..., "content": "..."}, ...]}'
# A conversation's (ids, trained): one flag a token (True: the loss predicts it), or True for all of them.
ChatEncoder = Callable[[list, str], "tuple[list[int], bool | list[bool]]"]


def jsonl_records(path: str) -> Iterator[tuple[str, dict]]:
    """(where 'path:line', record) for each line that is not blank, parsed and checked (record_problem);
    the first bad one is a ConfigError naming its file and line."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            where = f"{path}:{n}"
            try:
                line = raw.decode("utf-8").removeprefix("\ufeff").rstrip("\r\n")
                record = json.loads(line) if line.strip() else None
            except UnicodeDecodeError as e:
                raise ConfigError(f"{where}: not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                                  f"save it as UTF-8") from None
            except ValueError as e:
                raise ConfigError(f"{where}: not JSON ({e}); expected one object a line, {FORMS}") from None
            if record is None:
                continue
            if problem := record_problem(record):
                raise ConfigError(f"{where}: {problem}")
            yield where, record


def record_problem(record) -> str | None:
    """What is wrong with one parsed record, or None."""
    if not isinstance(record, dict):
        return f"a JSON {type(record).__name__}; expected an object, {FORMS}"
    if ("text" in record) == ("messages" in record):
        keys = ", ".join(map(repr, record)) or "none"
        return f"expected a \"text\" or a \"messages\" key (one of them), {FORMS}; found keys {keys}"
    if "text" in record:
        return None if isinstance(record["text"], str) else f"\"text\" is a {type(record['text']).__name__}; expected a string"
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        return "\"messages\" must be a list of at least one {\"role\": ..., \"content\": \"...\"} object"
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            role = m.get("role") if isinstance(m, dict) else m
            return f"messages[{i}] role {role!r}: expected one of {', '.join(ROLES)}"
        calls = m.get("tool_calls") if m["role"] == "assistant" else None
        if calls is not None and not (isinstance(calls, list) and calls and all(isinstance(c, dict) for c in calls)):
            return f"messages[{i}] (assistant) tool_calls is {calls!r}; expected a list of at least one call object"
        if not isinstance(m.get("content"), str) and not (calls and m.get("content") is None):
            return f"messages[{i}] ({m['role']}) content is a {type(m.get('content')).__name__}; expected a string"
        if m["role"] == "assistant" and not calls and not m["content"].strip():
            return (f"messages[{i}] is an assistant message with empty content and no tool_calls; expected the "
                    f"reply to train on")
    return None


def check_jsonl(path: str, no_template: str | None, all_tokens: bool) -> tuple[int, int]:
    """Check every line of a .jsonl file; returns how many "text" records hold text (documents) and how
    many "messages" records it has (conversations). no_template: why a
    "messages" record cannot be rendered (the tokenizer has no chat template), None when it can.
    With the loss on assistant tokens only, a conversation without an assistant message, or starting
    with one, is refused."""
    documents = conversations = 0
    for where, record in jsonl_records(path):
        if "messages" in record:
            if no_template:
                raise ConfigError(f"{where}: a \"messages\" record, but {no_template}")
            if not all_tokens and not any(m["role"] == "assistant" for m in record["messages"]):
                raise ConfigError(f"{where}: no assistant message, so nothing to train on with the loss on assistant "
                                  f"tokens only (train_on_all_tokens = false)")
            if not all_tokens and record["messages"][0]["role"] == "assistant":  # chat templates render no empty prefix
                raise ConfigError(f"{where}: messages[0] is an assistant message; with the loss on assistant tokens only "
                                  f"a conversation starts with a system or user message (a reply is found after them)")
            conversations += 1
        else:
            documents += bool(record["text"].strip())
    return documents, conversations


def render_chat(tokenizer, messages: list, where: str, generation_prompt: bool = False) -> str:
    """The conversation's text as the tokenizer's chat template renders it (transformers'
    apply_chat_template); a template that fails on it is a ConfigError naming `where`."""
    from jinja2 import TemplateError

    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except (TemplateError, ValueError, TypeError, KeyError, IndexError) as e:
        raise ConfigError(f"{where}: the tokenizer's chat template fails on this conversation: {e}") from None


def chat_encoder(tokenizer, all_tokens: bool) -> ChatEncoder:
    """A conversation's ids as the tokenizer's chat template renders it (tokenized as transformers'
    apply_chat_template does: no special tokens added, the template writes its own), trained on every
    token (all_tokens) or on the assistant messages' tokens only (assistant_spans)."""

    def encode(messages: list, where: str):
        if all_tokens:
            return tokenizer(render_chat(tokenizer, messages, where), add_special_tokens=False)["input_ids"], True
        text, spans = assistant_spans(lambda m, g=False: render_chat(tokenizer, m, where, g), messages, where)
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return encoded["input_ids"], [any(a <= start < b for a, b in spans) for start, _ in encoded["offset_mapping"]]

    return encode


def user_turn_ids(tokenizer, prompt: str, where: str) -> list[int]:
    """`prompt` as one user message followed by the template's generation prompt (the opening of the
    assistant's turn), tokenized as chat_encoder tokenizes a conversation: what a chat model is asked
    at inference (apply_chat_template(add_generation_prompt=True), as TRL's and axolotl's evals do)."""
    text = render_chat(tokenizer, [{"role": "user", "content": prompt}], where, generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def assistant_spans(render: Callable[..., str], messages: list, where: str) -> tuple[str, list[tuple[int, int]]]:
    """The conversation's text and the character spans its assistant messages add: for messages[i], from
    the end of render(messages[:i], generation prompt) to the end of render(messages[:i + 1]) (the
    reply, its end-of-turn token and what the template writes after it, up to the next message). Both
    must begin the whole conversation's text; a template that rewrites earlier turns (Qwen3's drops
    their thinking) is a ConfigError naming the record."""
    text, spans = render(messages), []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before, through = render(messages[:i], True), render(messages[: i + 1])
        if not (through.startswith(before) and text.startswith(through)):
            raise ConfigError(f"{where}: the chat template renders the conversation up to messages[{i}] (assistant) "
                              f"as text that does not begin the whole conversation's (it rewrites earlier turns), so "
                              f"the assistant's tokens cannot be told apart; set train_on_all_tokens = true, or give "
                              f"each turn a record of its own")
        spans.append((len(before), len(through)))
    return text, spans
