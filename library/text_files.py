"""Reading text a person wrote (captions, prompt files, TOML configs, LLM corpora). No torch here:
the config reader uses it before a script imports torch, so --help and a bad flag answer at once."""

from __future__ import annotations


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
