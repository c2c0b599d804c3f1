"""Reading text a person wrote (captions, prompt files, TOML configs, LLM corpora), and writing a
config back as TOML. No torch here: the config reader uses it before a script imports torch, so
--help and a bad flag answer at once."""

from __future__ import annotations

import json

import toml


def read_utf8(path: str, what: str = "text file") -> str:
    """The text of a UTF-8 file a person wrote, newlines as open() reads them (\\r\\n and \\r become
    \\n), without the byte order mark Windows Notepad puts first. Bytes that are not UTF-8 are one
    ValueError naming the file and the offset of the first (a text-mode read's error names no file,
    and its position counts from the chunk it was decoding)."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: {what} is not valid UTF-8: byte 0x{data[e.start]:02x} at offset {e.start} "
                         f"({e.reason}); save it as UTF-8") from None
    # Decoded as utf-8, not utf-8-sig: the offsets above count from the file's first byte, BOM or not.
    return text.removeprefix("\ufeff").replace("\r\n", "\n").replace("\r", "\n")


def toml_loads(text: str) -> dict:
    """toml.loads, every failure of which is a TomlDecodeError: 0.10.2 raises IndexError for an inline
    table left open at the end (`optimizer_args = {d0 = 1`), which the callers' one-line errors missed."""
    try:
        return toml.loads(text)
    except toml.TomlDecodeError:
        raise
    except (IndexError, KeyError, TypeError, ValueError) as e:
        raise toml.TomlDecodeError(f"cannot be read ({type(e).__name__}: {e}; a table, array or string left "
                                   f"open?)", text, len(text)) from None


class _TomlEncoder(toml.TomlEncoder):
    r"""toml 0.10.2's writer with strings written right: its own turns a backslash before an 'x' into
    an escape ("C:\\xyz" is written "C:\xyz", which no reader takes back) and drops the backslash of
    a control character's escape ("\x01" comes back as "x01")."""

    def __init__(self):
        super().__init__()
        self.dump_funcs[str] = toml_string


def toml_string(text: str) -> str:
    r"""A TOML basic string: JSON's escapes (\" \\ \n \t \uXXXX) are TOML's; DEL is escaped too."""
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")


def toml_dumps(settings: dict) -> str:
    """A config's keys as TOML text that toml.loads reads back equal."""
    return toml.dumps(settings, encoder=_TomlEncoder())


def set_toml_keys(text: str, keys: dict, drop: tuple[str, ...] = ()) -> str:
    """The TOML text a person wrote with `keys` set (scalars) and the `drop` keys removed, the rest as
    written (comments, tables, order): a key's line is rewritten where it stands, its comment kept;
    a new key goes above the first table. For a config whose keys may sit in any table."""
    import re

    lines, todo = text.split("\n"), dict(keys)
    for i, line in enumerate(lines):
        match = re.match(r"\s*([A-Za-z0-9_]+)\s*=\s*(\"(?:[^\"\\]|\\.)*\"|'[^']*'|[^#]*?)\s*(#.*)?$", line)
        if not match or (match.group(1) not in todo and match.group(1) not in drop):
            continue
        key = match.group(1)
        if key in drop:
            lines[i] = None
            continue
        comment = f"  {match.group(3)}" if match.group(3) else ""
        lines[i] = f"{key} = {toml_dumps({key: todo.pop(key)}).split(' = ', 1)[1].strip()}{comment}"
    first_table = next((i for i, line in enumerate(lines) if line is not None and line.lstrip().startswith("[")),
                       len(lines))
    added = [toml_dumps({k: v}).strip() for k, v in todo.items()] + ([""] if todo and first_table < len(lines) else [])
    kept = [line for line in lines[:first_table] if line is not None]
    return "\n".join(kept + added + [line for line in lines[first_table:] if line is not None])


def read_number_list(path: str, what: str = "weight table") -> list[float]:
    """The numbers of a list a person or a tool wrote: a JSON list, numbers separated by commas or whitespace (a
    CSV column), or a Python file whose one top-level list literal holds them (ai-toolkit's
    toolkit/timestep_weighing/default_weighing_scheme.py: read as data, never run). One ValueError naming the file
    and what it holds otherwise; every number finite."""
    import ast
    import math

    text = read_utf8(path, what)
    numbers = None
    if path.endswith(".py"):
        try:
            tree = ast.parse(text, path)
        except SyntaxError as e:
            raise ValueError(f"{path}: {what} is not a Python file ast reads (line {e.lineno}: {e.msg})") from None
        lists = [node.value for node in tree.body if isinstance(node, ast.Assign) and isinstance(node.value, ast.List)]
        if len(lists) != 1:
            raise ValueError(f"{path}: {what}: expected one top-level `name = [numbers]`, found {len(lists)}")
        try:
            numbers = ast.literal_eval(lists[0])
        except ValueError:
            raise ValueError(f"{path}: {what}: its list holds more than number literals") from None
    else:
        try:
            numbers = json.loads(text)
        except json.JSONDecodeError:
            try:  # (the error quotes none of the file: the web UI may check a file it may not show)
                numbers = [float(v) for v in text.replace(",", " ").split()]
            except ValueError:
                raise ValueError(f"{path}: {what} is neither a JSON list nor numbers separated by commas or "
                                 f"whitespace") from None
    if not isinstance(numbers, list) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                for v in numbers):
        raise ValueError(f"{path}: {what}: expected a list of numbers")
    if not numbers or not all(math.isfinite(v) for v in numbers):
        raise ValueError(f"{path}: {what}: expected at least one number, each finite")
    return [float(v) for v in numbers]
