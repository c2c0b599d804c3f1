"""An LLM's .jsonl train data, one JSON object a line as PEFT / TRL / axolotl / unsloth datasets hold it:
{"text": "..."} (a document) or {"messages": [{"role": ..., "content": ...}, ...]} (a conversation), or a
conversation as ShareGPT's "conversations" or TRL's conversational "prompt" / "completion", read as the
"messages" it converts to (record_as_messages); TRL's plain-text "prompt" / "completion" is raw text, as its
SFTTrainer tokenizes it (no chat template).

A file is checked whole before the model loads (check_jsonl: the first bad line is one ConfigError naming
file:line), then read again a line at a time while tokenizing (jsonl_records). A conversation is rendered
by the tokenizer's own chat template; its assistant tokens are found by rendering it prefix by prefix
(assistant_spans: in windows of a few messages where that is exact, so a conversation's cost grows
linearly with its turns), so templates without {% generation %} markers (most of them) work."""

from __future__ import annotations

import bisect
import json
import os
import re
from typing import Callable, Iterator

from library.errors import ConfigError

ROLES = ("system", "user", "assistant", "tool")
FORMS = ('{"text": "..."}, {"messages": [{"role": ..., "content": "..."}, ...]}, '
         '{"conversations": [{"from": ..., "value": "..."}, ...]} or {"prompt": ..., "completion": ...}')
# A record's layouts by the keys that make them (a record holds one): what record_as_messages reads
LAYOUTS = {'"text"': ("text",), '"messages"': ("messages",), '"conversations"': ("conversations",),
           '"prompt" / "completion"': ("prompt", "completion")}
SHAREGPT_ROLES = {"system": "system", "human": "user", "gpt": "assistant", "user": "user", "assistant": "assistant",
                  "function_call": "assistant", "observation": "tool"}  # LLaMA-Factory's tool turns
SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # where a line may hold half a UTF-16 pair (lone_surrogate)
BLANK = object()  # jsonl_records' marker of a blank line
# A conversation's (ids, trained): one flag a token (True: the loss predicts it), or True for all of them. Called
# with its messages, where it is ('file:line') and its tools (None: none).
ChatEncoder = Callable[[list, str, "list | None"], "tuple[list[int], bool | list[bool]]"]


def jsonl_records(path: str) -> Iterator[tuple[str, dict]]:
    """(where 'path:line', record) for each line that is not blank, parsed, checked and read as a document or
    a conversation (record_as_messages); the first bad one is a ConfigError naming its file and line."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            where = f"{path}:{n}"
            try:
                line = raw.decode("utf-8").removeprefix("\ufeff").rstrip("\r\n")
                record = json.loads(line) if line.strip() else BLANK
            except UnicodeDecodeError as e:
                raise ConfigError(f"{where}: not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                                  f"save it as UTF-8") from None
            except ValueError as e:
                raise ConfigError(f"{where}: not JSON ({e}); expected one object a line, {FORMS}") from None
            except RecursionError:  # json's decoder recurses once per level of nesting
                raise ConfigError(f"{where}: JSON nested too deep to read; expected one object a line, {FORMS}") from None
            if record is BLANK:  # (a line reading null is a record, and refused as one)
                continue
            try:
                read = record_as_messages(record)
            except RecordProblem as e:
                raise ConfigError(f"{where}: {e}") from None
            if SURROGATE_ESCAPE.search(line) and (problem := lone_surrogate(record)):
                raise ConfigError(f"{where}: {problem}")
            yield where, read


JSON_KINDS = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "a number",
              float: "a number", type(None): "null"}


def json_kind(value) -> str:
    """What a parsed JSON value is, in JSON's words ("null", "an array"; Python's said "NoneType", "a int")."""
    return JSON_KINDS.get(type(value), f"a {type(value).__name__}")


class RecordProblem(ValueError):
    """What is wrong with one record; jsonl_records names its file:line."""


def record_as_messages(record) -> dict:
    """The one place a record's layout is read: a parsed line as it is trained, one of
    - {"text": ...}: a document;
    - {"prompt": ..., "completion": ...}: TRL's plain-text prompt-completion, raw text (raw_prompt_completion);
    - {"messages": [...], "key": ..., "tools": [...]}: a conversation (key: the record's key it was read from;
      "tools" only where the record gives some, record_tools).
    The first layout the record holds is read (one of LAYOUTS: a record of two is refused as ambiguous); its other
    keys are ignored (UltraChat's "prompt" beside its "messages"), but for a conversation's "tools":
    - "messages": as they are, a content given as OpenAI's parts joined into its text (chat_messages), a
      top-level "system" beside them (LLaMA-Factory's OpenAI-style layout) first (with_system);
    - ShareGPT's "conversations": {"from": human / gpt / ..., "value"} turns as role / content, LLaMA-Factory's
      top-level "system" and tool turns too (sharegpt_messages);
    - TRL's "prompt" and "completion": two strings are raw text, as TRL's SFTTrainer trains them; two lists of
      messages (its conversational form) are the conversation (prompt_completion_messages).
    So a converted conversation trains exactly as the "messages" record it converts to. Raises RecordProblem."""
    if not isinstance(record, dict):
        raise RecordProblem(f"the line is {json_kind(record)}; expected an object, {FORMS}")
    held = [name for name, keys in LAYOUTS.items() if all(k in record for k in keys)]
    if len(held) > 1:  # a pre-rendered "text" beside the turns trained every token of it, the replies' mask lost
        raise RecordProblem(f"both {' and '.join(held)}; expected one of them, {FORMS}")
    if "text" in record:
        text = record["text"]
        if not isinstance(text, str):
            raise RecordProblem(f"\"text\" is {json_kind(text)}; expected a string")
        return {"text": text}
    if "messages" in record:
        messages = chat_messages(record["messages"], "messages")
        return conversation(with_system(messages, record.get("system"), "messages"), "messages", record)
    if "conversations" in record:
        return conversation(sharegpt_messages(record["conversations"], record.get("system")), "conversations", record)
    if "prompt" in record and "completion" in record:
        prompt, completion = record["prompt"], record["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            return raw_prompt_completion(record)
        return conversation(prompt_completion_messages(prompt, completion), "prompt", record)
    keys = ", ".join(map(repr, record)) or "none"
    lone = ("; a \"prompt\" without a \"completion\" is nothing to train on (preference data, \"chosen\" / "
            "\"rejected\", is not read)") if "prompt" in record else ""
    raise RecordProblem(f"expected one of {FORMS}; found keys {keys}{lone}")


def conversation(messages: list, key: str, record: dict) -> dict:
    """A conversation as record_as_messages reads it: its messages, the key they came from and the record's tools."""
    tools = record_tools(record.get("tools"))
    return {"messages": messages, "key": key, **({"tools": tools} if tools else {})}


def record_tools(tools) -> list | None:
    """A conversation's "tools" (TRL's column, LLaMA-Factory's ShareGPT key): the tool definitions the chat template
    renders (transformers' apply_chat_template(tools=...)), a list of objects or its JSON text (LLaMA-Factory writes
    a string; TRL json.loads one). None, "" and []: none. Raises RecordProblem."""
    given = tools
    if isinstance(tools, str):
        if not tools.strip():
            return None
        try:
            tools = json.loads(tools)
        except (ValueError, RecursionError) as e:
            raise RecordProblem(f"\"tools\" is a string that is not JSON ({e}); expected a list of tool objects or "
                                f"its JSON text") from None
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        what = json_kind(tools) if tools is given else f"JSON text of {json_kind(tools)}"
        if isinstance(tools, list):
            what = f"{what} holding {json_kind(next(t for t in tools if not isinstance(t, dict)))}"
        raise RecordProblem(f"\"tools\" is {what}; expected a list of tool objects ({{\"name\": ..., \"parameters\": "
                            f"...}} or OpenAI's {{\"type\": \"function\", \"function\": {{...}}}}) or its JSON text")
    return tools


def raw_prompt_completion(record: dict) -> dict:
    """TRL's standard (plain-text) prompt-completion record as its SFTTrainer reads it: raw text, no chat template
    (text_corpus.prompt_completion_ids tokenizes it). Its "tools" would be dropped: refused. Raises RecordProblem."""
    if not record["completion"].strip():
        raise RecordProblem("\"completion\" is empty; expected the reply to train on")
    if record_tools(record.get("tools")):
        raise RecordProblem("\"tools\" beside a plain-text \"prompt\" and \"completion\", which train as raw text (no "
                            "chat template renders the tools); give the prompt and completion as lists of messages")
    return {"prompt": record["prompt"], "completion": record["completion"]}


def chat_messages(messages, name: str) -> list:
    """`messages` (a record's "messages", or TRL's conversational "prompt" / "completion": `name`) checked, each
    content given as a list of OpenAI parts joined into its text (text_of_parts): a copy of such a message,
    the others as they are. Raises RecordProblem naming name[i]."""
    if not isinstance(messages, list) or not messages:
        raise RecordProblem(f"\"{name}\" must be a list of at least one {{\"role\": ..., \"content\": \"...\"}} object")
    checked = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            role = m.get("role") if isinstance(m, dict) else m
            raise RecordProblem(f"{name}[{i}] role {role!r}: expected one of {', '.join(ROLES)}")
        label = f"{name}[{i}] ({m['role']})"
        calls = m.get("tool_calls") if m["role"] == "assistant" else None
        if calls is not None and not (isinstance(calls, list) and calls and all(isinstance(c, dict) for c in calls)):
            raise RecordProblem(f"{label} tool_calls is {calls!r}; expected a list of at least one call object")
        if calls and (problem := arguments_problem(calls)):
            raise RecordProblem(f"{label} {problem}")
        if isinstance(m.get("content"), list):
            m = {**m, "content": text_of_parts(m["content"], label)}
        if not isinstance(m.get("content"), str) and not (calls and m.get("content") is None):
            raise RecordProblem(f"{label} content is {json_kind(m.get('content'))}; expected a string or a list of "
                                f"text parts")
        if m["role"] == "assistant" and not calls and not m["content"].strip():
            raise RecordProblem(f"{name}[{i}] is an assistant message with empty content and no tool_calls; "
                                f"expected the reply to train on")
        checked.append(m)
    return checked


def text_of_parts(parts: list, label: str) -> str:
    """A content given as OpenAI's parts ([{"type": "text", "text": "..."}, ...]) as one string: the texts
    joined as they are (as the chat templates that read parts render them, Qwen2-VL's, Llama 3.2 Vision's).
    Any other part (an image, audio) is refused: the LLM trainer reads text only."""
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            shown = f"a part of type {kind!r}" if isinstance(part, dict) else json_kind(part)
            raise RecordProblem(f"{label} content[{j}] is {shown}; the LLM trainer reads text only, expected "
                                f"{{\"type\": \"text\", \"text\": \"...\"}} parts")
        if not isinstance(part.get("text"), str):
            raise RecordProblem(f"{label} content[{j}] is a text part whose \"text\" is {json_kind(part.get('text'))}; "
                                f"expected a string")
    return "".join(part["text"] for part in parts)


def sharegpt_messages(turns, system=None) -> list:
    """ShareGPT's "conversations" ([{"from": "system" | "human" | "gpt", "value": "..."}], "user" / "assistant"
    too) as messages: human -> user, gpt -> assistant, and LLaMA-Factory's tool turns: function_call -> an
    assistant message calling the tools its value names (sharegpt_calls), observation -> a tool message (its
    result). LLaMA-Factory's top-level "system" (`system`; None or "": none) is a first system message; beside a
    system turn it is refused (LLaMA-Factory lets the turn win, unsaid). Raises RecordProblem naming
    conversations[i]."""
    if not isinstance(turns, list) or not turns:
        raise RecordProblem("\"conversations\" must be a list of at least one {\"from\": ..., \"value\": \"...\"} "
                            "object")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise RecordProblem(f"conversations[{i}] is {json_kind(turn)}; expected a {{\"from\": ..., \"value\": "
                                f"\"...\"}} object")
        speaker = turn.get("from")
        if not isinstance(speaker, str) or speaker not in SHAREGPT_ROLES:
            raise RecordProblem(f"conversations[{i}] from {speaker!r}: expected one of {', '.join(SHAREGPT_ROLES)}")
        if not isinstance(turn.get("value"), str):
            raise RecordProblem(f"conversations[{i}] ({speaker}) value is {json_kind(turn.get('value'))}; "
                                f"expected a string")
        if speaker == "function_call":
            messages.append({"role": "assistant", "content": None, "tool_calls": sharegpt_calls(turn["value"], i)})
        else:
            messages.append({"role": SHAREGPT_ROLES[speaker], "content": turn["value"]})
    return with_system(chat_messages(messages, "conversations"), system, "conversations")


def with_system(messages: list, system, name: str) -> list:
    """A record's top-level "system" (LLaMA-Factory's; None or "": none) as a first system message of its checked
    `messages` (read from the record's `name`, whose indices errors keep). Beside a system message it is refused:
    LLaMA-Factory lets the message win, unsaid. Raises RecordProblem."""
    if system is not None and not isinstance(system, str):
        raise RecordProblem(f"\"system\" is {json_kind(system)}; expected a string (the system prompt)")
    if not system:
        return messages
    turn = next((i for i, m in enumerate(messages) if m["role"] == "system"), None)
    if turn is not None:
        raise RecordProblem(f"a top-level \"system\" and a system turn, {name}[{turn}]; expected one of them")
    return [{"role": "system", "content": system}, *messages]


def sharegpt_calls(value: str, i: int) -> list:
    """A function_call turn's value, LLaMA-Factory's JSON text of a call {"name": ..., "arguments": {...}} or of a
    list of them, as OpenAI's tool_calls (arguments as given: an object, or JSON text that decoded_arguments
    decodes). Raises RecordProblem naming conversations[i]."""
    try:
        calls = json.loads(value)
    except (ValueError, RecursionError):
        calls = None
    calls = calls if isinstance(calls, list) else [calls]
    if not calls or not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls):
        shown = value if len(value) <= 40 else value[:40] + "..."
        raise RecordProblem(f"conversations[{i}] (function_call) value {shown!r} is no call; expected the JSON text of "
                            f"{{\"name\": ..., \"arguments\": {{...}}}} or of a list of them (LLaMA-Factory's)")
    return [{"type": "function", "function": {"name": c["name"], "arguments": c.get("arguments", {})}} for c in calls]


def prompt_completion_messages(prompt, completion) -> list:
    """TRL's conversational prompt-completion record as messages: two lists of messages are the conversation, the
    completion opening with the assistant's reply (two strings are raw text: raw_prompt_completion). Raises
    RecordProblem."""
    if isinstance(prompt, list) and isinstance(completion, list):
        opening, reply = chat_messages(prompt, "prompt"), chat_messages(completion, "completion")
        if reply[0]["role"] != "assistant":
            raise RecordProblem(f"completion[0] role {reply[0]['role']!r}: expected assistant (the completion is the "
                                f"reply trained on)")
        return opening + reply
    raise RecordProblem(f"\"prompt\" is {json_kind(prompt)} and \"completion\" {json_kind(completion)}; expected two "
                        f"strings or two lists of messages")


def call_function(call: dict) -> dict:
    """A tool call's {"name", "arguments"}: OpenAI's "function" object, or the call itself (as Qwen's templates
    read a call without one)."""
    return call["function"] if isinstance(call.get("function"), dict) else call


def json_object(text: str) -> dict | None:
    """The JSON object `text` encodes, or None where it encodes none."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def arguments_problem(calls: list) -> str | None:
    """What is wrong with the first call whose "arguments" string is no JSON object (decoded_arguments cannot
    decode it), or None."""
    for j, call in enumerate(calls):
        arguments = call_function(call).get("arguments")
        if isinstance(arguments, str) and json_object(arguments) is None:
            shown = arguments if len(arguments) <= 40 else arguments[:40] + "..."
            return (f"tool_calls[{j}] arguments {shown!r} is a string that is no JSON object; expected an object "
                    f"or its JSON text (as OpenAI writes it)")
    return None


def decoded_arguments(messages: list, where: str) -> list:
    """The messages (as record_as_messages reads them) with each tool call's "arguments" string (OpenAI's API
    writes the JSON text) decoded to its object: templates render arguments with tojson (Qwen2.5's, Llama
    3.1's), which would train the string double-encoded ("{\\"city\\": ...}"); Qwen3's writes a string as it is
    and an object with tojson. Copies what it decodes; the caller's messages are unchanged."""
    decoded = []
    for i, m in enumerate(messages):
        calls = m.get("tool_calls") if m["role"] == "assistant" else None
        if calls and any(isinstance(call_function(c).get("arguments"), str) for c in calls):
            if problem := arguments_problem(calls):
                raise ConfigError(f"{where}: messages[{i}] (assistant) {problem}")
            m = {**m, "tool_calls": [decoded_call(c) for c in calls]}
        decoded.append(m)
    return decoded


def decoded_call(call: dict) -> dict:
    """The call with its "arguments" string decoded, a copy (the call itself where they are no string)."""
    function = call_function(call)
    if not isinstance(function.get("arguments"), str):
        return call
    decoded = {**function, "arguments": json_object(function["arguments"])}
    return decoded if function is call else {**call, "function": decoded}


def lone_surrogate(record: dict) -> str | None:
    """JSON may escape half of a UTF-16 pair ("\\ud83d": an emoji cut in two by a scraper); such a string
    is no Unicode text and the tokenizer fails on it with a traceback naming no record."""
    try:
        json.dumps(record, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        return (f"holds a lone UTF-16 surrogate (\\u{ord(e.object[e.start]):04x}: half of a character, e.g. an emoji "
                f"cut in two); expected whole characters")
    return None


def check_jsonl(path: str, no_template: str | None, all_tokens: bool) -> tuple[int, int]:
    """Check every line of a .jsonl file; returns how many documents ("text" records that hold text, plain-text
    "prompt" / "completion" records: raw text ended by EOS) and how many conversations ("messages",
    "conversations", conversational "prompt" / "completion" records) it has. no_template: why a conversation
    cannot be rendered (the tokenizer has no chat template), None when it can.
    With the loss on assistant tokens only, a conversation without an assistant message, or starting
    with one, is refused."""
    documents = conversations = 0
    for where, record in jsonl_records(path):
        if "prompt" in record:  # raw text, no template: its completion is never empty (raw_prompt_completion)
            documents += 1
        elif "messages" in record:
            key = record["key"]
            if no_template:
                layout = '"prompt" / "completion"' if key == "prompt" else f'"{key}"'
                raise ConfigError(f"{where}: a {layout} record, but {no_template}")
            if not all_tokens and not any(m["role"] == "assistant" for m in record["messages"]):
                raise ConfigError(f"{where}: no assistant message, so nothing to train on with the loss on assistant "
                                  f"tokens only (train_on_all_tokens = false)")
            if not all_tokens and record["messages"][0]["role"] == "assistant":  # chat templates render no empty prefix
                raise ConfigError(f"{where}: {key}[0] is an assistant message; with the loss on assistant tokens only "
                                  f"a conversation starts with a system or user message (a reply is found after them)")
            conversations += 1
        else:
            documents += bool(record["text"].strip())
    return documents, conversations


def render_chat(tokenizer, messages: list, where: str, generation_prompt: bool = False,
                tools: list | None = None) -> str:
    """The conversation's text as the tokenizer's chat template renders it (transformers'
    apply_chat_template, with the record's tools); a template that fails on it is a ConfigError naming `where`."""
    from jinja2 import TemplateError

    try:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                             add_generation_prompt=generation_prompt)
    except (TemplateError, ValueError, TypeError, KeyError, IndexError) as e:
        raise ConfigError(f"{where}: the tokenizer's chat template fails on this conversation: {e}") from None


def chat_encoder(tokenizer, all_tokens: bool) -> ChatEncoder:
    """A conversation's ids as the tokenizer's chat template renders it with its tools (tokenized as transformers'
    apply_chat_template does: no special tokens added, the template writes its own), trained on every
    token (all_tokens) or on the assistant messages' tokens only (assistant_spans)."""

    def encode(messages: list, where: str, tools: list | None = None):
        messages = decoded_arguments(messages, where)
        render = lambda m, g=False: render_chat(tokenizer, m, where, g, tools)  # noqa: E731
        if tools:
            refuse_unrendered_tools(render(messages), render_chat(tokenizer, messages, where), where)
        refuse_unrendered_calls(render, messages, where)
        if all_tokens:
            return tokenizer(render(messages), add_special_tokens=False)["input_ids"], True
        text, spans = assistant_spans(render, messages, where)
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return encoded["input_ids"], starts_inside(encoded["offset_mapping"], spans)

    return encode


def refuse_unrendered_tools(with_tools: str, without: str, where: str):
    """A template that reads no `tools` (the tiny ChatML ones, many base models') renders a record's tools as
    nothing: the LoRA would learn calls to tools it was never shown. Refused, naming the record."""
    if with_tools == without:
        raise ConfigError(f"{where}: the record gives \"tools\", but the tokenizer's chat template renders none of "
                          f"them (it reads no `tools`), so they would be dropped; use a template that renders tools "
                          f"(Qwen2.5's, Llama 3.1's) or leave \"tools\" out")


def refuse_unrendered_calls(render: Callable[..., str], messages: list, where: str):
    """A template that reads no `tool_calls` (Llama 3 Instruct's, Mistral v0.1 / v0.2's, Gemma's) renders an
    assistant turn that only calls a tool as an empty reply: the LoRA would learn to answer with nothing where
    the data calls a tool. The conversation up to its first call is rendered with and without that call (a
    template renders all calls or none); the same text is refused, naming the record."""
    first = next((i for i, m in enumerate(messages) if m.get("role") == "assistant" and m.get("tool_calls")), None)
    if first is None:
        return
    call = messages[first]
    without = {**{k: v for k, v in call.items() if k != "tool_calls"}, "content": call.get("content") or ""}
    try:
        if render(messages[:first + 1]) != render([*messages[:first], without]):
            return
    except ConfigError:  # a template that needs the calls (or content) to render them is one that reads them
        return
    raise ConfigError(f"{where}: an assistant turn calls a tool (\"tool_calls\", or a ShareGPT function_call turn), "
                      f"but the tokenizer's chat template renders no tool_calls, so the call would train as an empty "
                      f"reply; use a template that renders them (Qwen2.5's, Llama 3.1's) or leave the call out")


def starts_inside(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[bool]:
    """For each token's (start, end) characters, whether it starts in one of the [a, b) spans or holds a
    span's first character (a reply opening "\\n\\n" after the template's "\\n": one token "\\n\\n\\n";
    transformers' return_assistant_tokens_mask trains it too: char_to_token of the span's start): by
    bisection where the spans are in order and apart (as assistant_spans gives them), else by trying each
    (tokens x spans: quadratic in a conversation's turns)."""
    starts = [a for a, _ in spans]
    if any(b > next_a for (_, b), next_a in zip(spans, starts[1:])):
        return [any(a <= start < b or start < a < end for a, b in spans) for start, end in offsets]
    trained = []
    for start, end in offsets:
        k = bisect.bisect_right(starts, start)  # the first span starting after the token's start
        trained.append((k > 0 and start < spans[k - 1][1]) or (k < len(starts) and starts[k] < end))
    return trained


def user_turn_ids(tokenizer, prompt: str, where: str) -> list[int]:
    """`prompt` as one user message followed by the template's generation prompt (the opening of the
    assistant's turn), tokenized as chat_encoder tokenizes a conversation: what a chat model is asked
    at inference (apply_chat_template(add_generation_prompt=True), as TRL's and axolotl's evals do)."""
    text = render_chat(tokenizer, [{"role": "user", "content": prompt}], where, generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def end_of_turn_id(tokenizer) -> int | None:
    """The token the chat template closes an assistant's reply with, where that is one special token
    (ChatML's <|im_end|>, Llama 3's <|eot_id|>, Gemma's <end_of_turn>), else None: a chat sample stops at
    it as at EOS (chat models' generation_config.json lists both for transformers' generate)."""
    reply = "Sure."
    try:
        text = render_chat(tokenizer, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": reply}], "")
    except ConfigError:
        return None
    at = text.rfind(reply)
    ids = tokenizer(text[at + len(reply) :], add_special_tokens=False)["input_ids"] if at >= 0 else []
    added = tokenizer.added_tokens_decoder.get(ids[0]) if ids else None
    return ids[0] if added is not None and added.special else None


def assistant_spans(render: Callable[..., str], messages: list, where: str) -> tuple[str, list[tuple[int, int]]]:
    """The conversation's text and the character spans its assistant messages add: for messages[i], from
    the end of render(messages[:i], generation prompt) to the end of render(messages[:i + 1]) (the
    reply, its end-of-turn token and what the template writes after it, up to the next message). Both
    must begin the whole conversation's text; a template that rewrites earlier turns (Qwen3's drops
    their thinking) is a ConfigError naming the record. Found in linear time where windowed_spans can
    tell its spans are these; else by exact_span for each assistant message (quadratic)."""
    text = render(messages)
    try:
        spans = windowed_spans(render, messages, text)
    except ConfigError:  # a window the template fails on: the exact way meets (and names) the error, if any
        spans = None
    if spans is None:
        spans = []
        for i, m in enumerate(messages):
            if m["role"] == "assistant":
                spans.append(exact_span(render, messages, i, text)
                             or refuse_unspannable(render, messages, i, text, where))
    return text, spans


def exact_span(render: Callable[..., str], messages: list, i: int, text: str) -> tuple[int, int] | None:
    """messages[i]'s span from the two renders of the conversation up to it, or None where they do not
    begin `text` (the whole conversation's). Each costs O(i): O(n^2) for a conversation's replies."""
    before = render(messages[:i], True)
    through = text if i + 1 == len(messages) else render(messages[: i + 1])
    if not (through.startswith(before) and text.startswith(through)):
        return None
    return len(before), len(through)


def refuse_unspannable(render: Callable[..., str], messages: list, i: int, text: str, where: str):
    """exact_span found no span for messages[i]: say why. Where the first reply's prefix, rendered without
    the generation prompt, begins the conversation but the generation prompt does not begin it
    (DeepSeek-R1-Distill's opens <think>, which the conversation lacks), no earlier turn is rewritten, and a
    record per turn would meet the same prompt. Where the prefix itself renders otherwise once a reply
    follows (Mistral v0.3's writes the system prompt only into a user message that is the last), the
    template rewrites earlier turns."""
    before = render(messages[:i], True)
    through = text if i + 1 == len(messages) else render(messages[: i + 1])
    first = all(m["role"] != "assistant" for m in messages[:i])
    if (first and text.startswith(through) and not through.startswith(before)
            and through.startswith(render(messages[:i]))):
        same = len(os.path.commonprefix([before, through]))
        raise ConfigError(f"{where}: the chat template's generation prompt is not how it opens messages[{i}] "
                          f"(assistant): where they part, messages[:{i}] rendered with add_generation_prompt goes on "
                          f"{_tail(before, same)} and the conversation {_tail(through, same)}, so the assistant's "
                          f"tokens cannot be told apart; set train_on_all_tokens = true")
    refuse_rewritten(where, i)


def _tail(text: str, start: int, most: int = 24) -> str:
    """text from `start` as repr shows it, cut to `most` characters."""
    return repr(text[start : start + most]) + ("..." if len(text) > start + most else "")


def refuse_rewritten(where: str, i: int):
    raise ConfigError(f"{where}: the chat template renders the conversation up to messages[{i}] (assistant) "
                      f"as text that does not begin the whole conversation's (it rewrites earlier turns), so "
                      f"the assistant's tokens cannot be told apart; set train_on_all_tokens = true (the conversation "
                      f"as the template renders it whole, without what it drops from earlier turns), or give "
                      f"each turn a record of its own")


SHORT_PREFIX = 16  # messages: before this many, exact_span's two renders cost less than a window's three


def windowed_spans(render: Callable[..., str], messages: list, text: str) -> list[tuple[int, int]] | None:
    """exact_span's spans in linear time, or None where this cannot tell they are the same (or uses no window).

    An assistant message after SHORT_PREFIX messages or more, but the last, is found in a window
    (window_span) placed at the end of the assistant message before it; the others by exact_span. A
    window equals exact_span for a template that renders a message from itself, its neighbours and
    messages[0] (ChatML, with Qwen2.5's tool grouping). No window can be exact for every template (one
    may number the turns, count the messages, or mark the last user message), so each window's text
    must equal the conversation's where it is placed, and the windows' last end must equal the exact
    render's up to there; else None, and assistant_spans renders every prefix."""
    assistants = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    windowed = {i for i in assistants[1:-1] if i >= SHORT_PREFIX}
    if not windowed or assistants[0] == 0:
        return None
    spans, end, previous = [], 0, None
    for i in assistants[:-1]:
        span = (window_span(render, messages, previous, i, end, text) if i in windowed
                else exact_span(render, messages, i, text))
        if span is None:
            return None
        spans.append(span)
        end, previous = span[1], i
    through = render(messages[: previous + 1])  # the windows' last end against the exact prefix's
    if len(through) != end or not text.startswith(through):
        return None
    spans.append(exact_span(render, messages, assistants[-1], text))
    return None if spans[-1] is None else spans


def window_span(render: Callable[..., str], messages: list, previous: int, i: int, end: int,
                text: str) -> tuple[int, int] | None:
    """messages[i]'s span from a window: messages[0] (a template's system header depends on it), the
    assistant message messages[previous], which ends at `end` in text, and the messages after it up to
    i, rendered with and without the generation prompt. O(i - previous). None where the window's text
    after messages[previous] is not text's from `end`."""
    window = [messages[0], *messages[previous : i + 1]]
    head, before, through = render(window[:2]), render(window[:-1], True), render(window)
    at = end - len(head)  # the window's character p is the conversation's at + p
    if not (before.startswith(head) and through.startswith(before) and text.startswith(through[len(head) :], end)):
        return None
    return at + len(before), at + len(through)
