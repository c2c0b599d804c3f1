"""The LLM's training text: .txt documents and .jsonl records (folders searched recursively) -> one token
stream (documents joined by EOS, conversations by their chat template's tokens; a bool mask where some
tokens are not trained on), read a piece or a line at a time -> a train / validation split -> fixed windows
of max_length + 1 tokens."""

from __future__ import annotations

import array
import codecs
import os
import re
import warnings
from typing import Callable, Iterable, Iterator, NamedTuple

import torch

from library.data.chat_records import ChatEncoder, check_jsonl, jsonl_records
from library.errors import ConfigError
from library.io import read_utf8


# ----------------------------------------------------------------------------------------------
# LLM text: files -> documents and conversations -> one token stream -> fixed windows


RECORD_FILES = (".json", ".parquet", ".arrow")  # records we do not read: refused when named as train_data
CORPUS_FILES = (".txt", ".jsonl")  # what a train_data folder contributes (the extension in any case)


def text_files(folder: str) -> list[str]:
    """Every .txt and .jsonl file (the extension in any case: .TXT too) in `folder` and its subfolders, in
    path order (a folder's own files, then each subfolder's); hidden files and folders ('.name') are skipped."""
    found = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))  # os.walk descends into these, in order
        found += [os.path.join(root, f) for f in sorted(files) if f.lower().endswith(CORPUS_FILES) and not f.startswith(".")]
    return found


def corpus_files(paths: str | list[str]) -> list[str]:
    """The files of train_data: files as given (any name but a RECORD_FILES one) and the .txt / .jsonl
    files of folders, searched recursively (text_files). A missing path, a data file we do not read and
    a folder without a .txt or .jsonl file are ConfigErrors naming the train_data entry."""
    files = []
    for p in [paths] if isinstance(paths, str) else paths:
        if os.path.isdir(p):
            found = text_files(p)
            if not found:
                raise ConfigError(f"train_data {p}: no .txt or .jsonl file in this folder or its subfolders")
            files += found
        elif os.path.isfile(p):
            if p.lower().endswith(RECORD_FILES):
                raise ConfigError(f"train_data {p}: a {os.path.splitext(p)[1]} data file would be trained on as raw text "
                                  f"(its keys and quotes too); give plain text files, one document each, or .jsonl "
                                  f"records ({{\"text\": ...}} or {{\"messages\": [...]}} a line)")
            files.append(p)
        else:
            raise ConfigError(f"train_data {p}: no such text file or folder")
    return files


def is_jsonl(path: str) -> bool:
    return path.lower().endswith(".jsonl")


class TextCounts(NamedTuple):
    """What train_data holds, by how the stream borders it."""

    documents: int  # .txt files, "text" records holding more than whitespace, plain-text prompt / completion records:
    # raw text, each ended by EOS
    conversations: int  # "messages" (or converted) records: each bordered by its chat template's own tokens


def check_corpus(paths: list[str], no_template: str | None, all_tokens: bool) -> tuple[list[str], TextCounts]:
    """train_data's files (corpus_files), each read once before the model loads, keeping nothing: .txt
    files as UTF-8 (check_text_file), .jsonl records as check_jsonl checks them. Returns the files that
    hold text and how many documents and conversations do; none is a ConfigError."""
    files, documents, conversations = [], 0, 0
    for f in corpus_files(paths):
        docs, chats = check_jsonl(f, no_template, all_tokens) if is_jsonl(f) else (check_text_file(f), 0)
        documents, conversations = documents + docs, conversations + chats
        if docs or chats:  # a file of whitespace (or of empty records) is no document: left out
            files.append(f)
    if not documents + conversations:
        raise ConfigError(f"train_data {', '.join(paths)}: every text file and record is empty")
    return files, TextCounts(documents, conversations)


READ_BYTES = 1 << 22  # a text file is checked this many bytes at a time


def check_text_file(path: str) -> bool:
    """Whether the file holds more than whitespace; bytes that are not UTF-8 are one ValueError naming
    the file and the offset of the first, as read_utf8's. Reads READ_BYTES at a time, keeping none."""
    decoder, offset, has_text = codecs.getincrementaldecoder("utf-8")(), 0, False
    with open(path, "rb") as f:
        while True:
            data, pending = f.read(READ_BYTES), len(decoder.getstate()[0])  # pending: bytes of a split character
            try:
                text = decoder.decode(data, final=not data)
                text = text.removeprefix("\ufeff") if offset == 0 else text  # the BOM the reader drops is no text
                has_text = bool(text.strip()) or has_text
            except UnicodeDecodeError as e:
                at = offset - pending + e.start
                raise ValueError(f"{path}: text file is not valid UTF-8: byte 0x{e.object[e.start]:02x} at offset "
                                 f"{at} ({e.reason}); save it as UTF-8") from None
            if not data:
                return has_text
            offset += len(data)


TOKEN_DTYPE = torch.int32  # 4 bytes a stored token (every vocab fits); windows widen to int64 as they are read
PIECE_CHARS = 1 << 18  # a document is tokenized in pieces of about this many characters (a piece's encoding: ~100 B a token)
# Where a piece may end: after a newline that a non-space follows, else before a space that a letter follows. A
# byte-level BPE's pre-tokenizer (GPT-2 / Llama-3 / Qwen2 split patterns) never joins the two sides of either;
# a tokenizer that does (SentencePiece's dummy prefix) fails the probe below and gets whole documents.
CUT = re.compile(r"\n(?=\S)|(?<=\S)(?= [A-Za-z])")
PROBE = "Title: a test.\nFirst line, with words 123 and 4567.\n\n  Indented  line\n\tTabbed it's\r\nCRLF line. \u00fcber caf\u00e9\nend"


def text_pieces(text: str, budget: int | None = None) -> list[str]:
    """text cut into pieces of at least `budget` (None: PIECE_CHARS) characters, the last maybe shorter, at CUT points."""
    pieces, start, budget = [], 0, budget or PIECE_CHARS
    while len(text) - start > budget:
        cut = CUT.search(text, start + budget)
        if cut is None:
            break
        pieces.append(text[start : cut.end()])
        start = cut.end()
    return pieces + [text[start:]]


def pieces_keep_tokens(encode: Callable[[str], list[int]], encode_more: Callable[[str], list[int]]) -> bool:
    """True when PROBE, cut at every CUT point, encodes to the tokens of PROBE whole."""
    first, *rest = text_pieces(PROBE, 1)
    return list(encode(first)) + [t for piece in rest for t in encode_more(piece)] == list(encode(PROBE))


def file_pieces(path: str, budget: int | None = None) -> Iterator[str]:
    """A text file's document in pieces of about budget (None: PIECE_CHARS) characters or more, cut at CUT
    points, read a budget at a time: newlines as open() reads them, the byte order mark dropped (as
    read_utf8's). What is held is the piece being read; each read is searched once for a cut (with the two
    characters before it, which CUT's lookarounds need), so a file without a cut is read in linear time."""
    budget = budget or PIECE_CHARS
    with open(path, encoding="utf-8") as f:
        held = [f.read(budget).removeprefix("\ufeff")]
        size = len(held[0])  # characters held
        while more := f.read(budget):
            tail = held[-1][-2:]
            cut = CUT.search(tail + more, max(0, budget - size + len(tail)))  # a piece of >= budget characters
            if cut is None:
                held.append(more)
                size += len(more)
                continue
            text = "".join(held) + more
            at = len(text) - len(more) - len(tail) + cut.end()
            yield text[:at]
            held = [text[at:]]
            size = len(held[0])
    yield "".join(held)


class TokenStream:
    """Token ids (TOKEN_DTYPE) and, once some token is not trained on, a bool mask of those that are,
    appended a document or a piece at a time into blocks of BLOCK tokens allocated whole (their pages
    count once written), the blocks joined into one tensor at the end, each freed as it is copied: the
    peak is the stream plus about one block, not twice the stream. Where each document (or conversation)
    starts is kept too (start_document): 8 bytes a document, for windows that do not attend across them."""

    BLOCK = 1 << 24  # tokens (64 MB of int32): above glibc's largest mmap threshold, so a freed block leaves RSS

    def __init__(self):
        self.blocks, self.masks, self.fill = [torch.empty(self.BLOCK, dtype=TOKEN_DTYPE)], None, 0
        self.starts = array.array("q")  # int64 offsets of each document's first token, increasing

    def start_document(self):
        """The next token added starts a document (or a conversation)."""
        self.starts.append((len(self.blocks) - 1) * self.BLOCK + self.fill)

    def add(self, ids: list[int], trained: bool | list[bool] = True):
        """ids, each trained on (a target of the loss) or not: one flag for all, or one a token."""
        ids = torch.tensor(ids, dtype=TOKEN_DTYPE)
        if trained is not True and self.masks is None:  # the first untrained token: the mask starts here
            self.masks = [torch.ones(self.BLOCK, dtype=torch.bool) for _ in self.blocks]
        flags = None if self.masks is None else torch.tensor(trained, dtype=torch.bool).expand(len(ids))
        at = 0
        while at < len(ids):
            n = min(len(ids) - at, self.BLOCK - self.fill)
            self.blocks[-1][self.fill : self.fill + n] = ids[at : at + n]
            if flags is not None:
                self.masks[-1][self.fill : self.fill + n] = flags[at : at + n]
            self.fill, at = self.fill + n, at + n
            if self.fill == self.BLOCK:
                self.blocks.append(torch.empty(self.BLOCK, dtype=TOKEN_DTYPE))
                if self.masks is not None:
                    self.masks.append(torch.ones(self.BLOCK, dtype=torch.bool))
                self.fill = 0

    def document_starts(self) -> torch.Tensor:
        """int64 [D]: where each document begins (an empty one, adding no token, shares the next's start)."""
        if not self.starts:
            return torch.zeros(0, dtype=torch.int64)
        return torch.frombuffer(self.starts, dtype=torch.int64).clone()  # a copy: the array may grow or go

    def finish(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(ids TOKEN_DTYPE [N], trained bool [N] or None where every token is trained)."""
        self.blocks[-1] = self.blocks[-1][: self.fill].clone()  # the last block's written part, compact
        if self.masks is not None:
            self.masks[-1] = self.masks[-1][: self.fill].clone()
        return join_freeing(self.blocks, TOKEN_DTYPE), None if self.masks is None else join_freeing(self.masks, torch.bool)


def join_freeing(blocks: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """torch.cat(blocks), each block dropped from the list as soon as it is copied (one block: itself)."""
    if len(blocks) == 1:
        return blocks.pop()
    out, at = torch.empty(sum(len(b) for b in blocks), dtype=dtype), 0
    for i in range(len(blocks)):
        out[at : at + len(blocks[i])] = blocks[i]
        at += len(blocks[i])
        blocks[i] = None
    blocks.clear()
    return out


def add_text(stream: TokenStream, pieces: Iterable[str], encode: Callable[[str], list[int]],
             encode_more: Callable[[str], list[int]] | None, end: list[int]):
    """One document, given as pieces: the first encoded by `encode`, the rest by `encode_more`; then `end`."""
    stream.start_document()
    for i, piece in enumerate(pieces):
        stream.add(list((encode if i == 0 else encode_more)(piece)))
    stream.add(end)


def tokenize_documents(documents: Iterable[str], encode: Callable[[str], list[int]], eos_id: int | None,
                       encode_more: Callable[[str], list[int]] | None = None) -> torch.Tensor:
    """One TOKEN_DTYPE token stream; eos_id (if given) ends each document so windows see the border.
    encode: a document's start (with the tokenizer's special tokens); encode_more: text continuing it (none).
    With encode_more and a tokenizer whose tokens do not change at CUT points (pieces_keep_tokens), a document
    is encoded a piece of ~PIECE_CHARS at a time, each piece's ids a compact tensor at once: a Python list
    (~36 bytes a token) never holds more than one piece, however large the document. Otherwise each whole
    document is one list while it is encoded."""
    pieces = text_pieces if encode_more is not None and pieces_keep_tokens(encode, encode_more) else lambda d: [d]
    stream = TokenStream()
    for doc in documents:
        add_text(stream, pieces(doc), encode, encode_more, [eos_id] if eos_id is not None else [])
    return stream.finish()[0]


class Corpus(NamedTuple):
    """train_data as one token stream."""

    ids: torch.Tensor  # TOKEN_DTYPE [N]
    trained: torch.Tensor | None  # bool [N]: the tokens that are targets of the loss; None: every token
    starts: torch.Tensor  # int64 [D]: the offset where each document / conversation begins, increasing


def tokenize_corpus(files: list[str], encode: Callable[[str], list[int]], encode_more: Callable[[str], list[int]],
                    eos_id: int | None, chat: ChatEncoder | None = None, all_tokens: bool = False,
                    record_lengths: list[tuple[int, str]] | None = None) -> Corpus:
    """The token stream of train_data's files (corpus_files), read a file piece or a .jsonl line at a time:
    only the ids (and the trained mask) are kept. A .txt file and a .jsonl "text" record are documents
    (tokenize_documents' pieces and eos_id); a plain-text "prompt" / "completion" record is raw text too, ended by
    eos_id, trained on its completion unless all_tokens (prompt_completion_ids); a conversation record (its
    "messages", record_as_messages) is what `chat` renders, its own template's tokens its borders (no eos_id added),
    trained where `chat` says. Returns a Corpus: the ids, the trained mask (None when every token is trained) and
    the document starts. record_lengths: each prompt / completion record's (tokens, file:line) is appended
    (a conversation's: `chat` measured)."""
    split = pieces_keep_tokens(encode, encode_more)
    end, stream = [eos_id] if eos_id is not None else [], TokenStream()
    for path in files:
        if not is_jsonl(path):
            add_text(stream, file_pieces(path) if split else [read_utf8(path)], encode, encode_more, end)
            continue
        for where, record in jsonl_records(path):
            if "text" in record:  # an empty one is no document (it trained BOS -> EOS: "stop at once")
                if record["text"].strip():
                    add_text(stream, text_pieces(record["text"]) if split else [record["text"]], encode, encode_more, end)
            elif "prompt" in record:
                stream.start_document()
                ids, trained = prompt_completion_ids(record["prompt"], record["completion"], encode, end, all_tokens)
                stream.add(ids, trained)
                if record_lengths is not None:
                    record_lengths.append((len(ids), where))
            else:
                stream.start_document()
                stream.add(*chat(record["messages"], where, record.get("tools")))
    return Corpus(*stream.finish(), stream.document_starts())


def prompt_completion_ids(prompt: str, completion: str, encode: Callable[[str], list[int]], end: list[int],
                          all_tokens: bool) -> tuple[list[int], bool | list[bool]]:
    """TRL's plain-text prompt-completion record as its SFTTrainer tokenizes it: prompt + completion as one raw
    text (encode: with the tokenizer's special tokens, no chat template), then `end` (EOS, as TRL appends
    eos_token); trained on every token after the prompt's own len(encode(prompt)) (its completion_only_loss,
    the default), or on all of them (all_tokens)."""
    ids = list(encode(prompt + completion)) + end
    if all_tokens:
        return ids, True
    n = len(encode(prompt))  # TRL's rule: a token the two texts share at the cut counts as the prompt's
    return ids, [i >= n for i in range(len(ids))]


def measured(chat: ChatEncoder, lengths: list[tuple[int, str]]) -> ChatEncoder:
    """chat, appending each conversation's (token count, file:line) to `lengths` (what warn_long_conversations
    reads)."""

    def encode(messages: list, where: str, tools: list | None = None):
        ids, trained = chat(messages, where, tools)
        lengths.append((len(ids), where))
        return ids, trained

    return encode


def warn_long_conversations(lengths: list[tuple[int, str]], max_length: int) -> None:
    """One warning for the conversations longer than a window (max_length inputs + the last target), naming the
    longest's file:line: the windows cut each into pieces trained apart, none seeing its start with its end, which
    went unsaid. Counted as windows of stride max_length: overlapping windows (a smaller stride) make more."""
    long = [(n, where) for n, where in lengths if n > max_length + 1]
    if long:
        pieces = sum(-(-(n - 1) // max_length) for n, _ in long)
        longest, where = max(long, key=lambda nw: nw[0])
        warnings.warn(f"train_data: {len(long)} of {len(lengths)} records (conversations, prompt / completion) are "
                      f"longer than a window of max_length "
                      f"{max_length} + 1 tokens (the longest {longest}, {where}): they are split into at least "
                      f"{pieces} windows, trained apart (raise max_length, or shorten them)", stacklevel=3)


def train_val_split(ids: torch.Tensor, val_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The last val_fraction of the stream is validation: a contiguous tail, so no window of
    validation text also appears in training."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    n_val = int(round(len(ids) * val_fraction))
    return ids[: len(ids) - n_val], ids[len(ids) - n_val :]


def split_starts(starts: torch.Tensor, n_train: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Document starts (int64 [D]) split as train_val_split splits their stream at n_train tokens: the
    validation part's offsets counted from its own first token."""
    at = int(torch.searchsorted(starts, n_train))
    return starts[:at], starts[at:] - n_train


IGNORE = -100  # a target the loss skips (cross_entropy's ignore_index): a token that is not trained on


def masked_targets(targets: torch.Tensor, trained: torch.Tensor | None) -> torch.Tensor:
    """targets (int64) with IGNORE where `trained` (bool, the same shape) is False; as given for None."""
    return targets if trained is None else targets.masked_fill(~trained, IGNORE)


def document_borders(starts: torch.Tensor | None, n: int) -> torch.Tensor | None:
    """int64 [B]: the tokens of a stream of n that are borders, once each, increasing: each document's first
    token but the stream's first (an empty document shares the next's start). As a target a border is
    predicted from the end of the document before it (EOS, a conversation's last token), an unrelated text,
    so it is not trained on. starts: int64 [D], increasing; None (one stream attended across): None.
    8 bytes a document: the border rule is applied a window at a time from these, never as a mask over n."""
    if starts is None:
        return None
    return torch.unique_consecutive(starts[(starts > 0) & (starts < n)])


def borders_in(borders: torch.Tensor, begin: int, end: int) -> torch.Tensor:
    """int64 [K]: the borders among tokens begin .. end - 1 (two binary searches)."""
    lo, hi = torch.searchsorted(borders, torch.tensor([begin, end])).tolist()
    return borders[lo:hi]


def window_targets(ids: torch.Tensor, trained: torch.Tensor | None, borders: torch.Tensor | None, begin: int,
                   length: int) -> torch.Tensor:
    """int64 [length]: the stream's tokens begin .. begin + length - 1 as targets (ids: TOKEN_DTYPE [N]), IGNORE
    where `trained` (bool [N], None: all) is False and at each of `borders` (document_borders, None: none)."""
    span = slice(begin, begin + length)
    targets = masked_targets(ids[span].long(), None if trained is None else trained[span])
    if borders is None:
        return targets
    # out of place: with trained None and int64 ids, .long() returned the stream itself
    return targets.index_fill(0, borders_in(borders, begin, begin + length) - begin, IGNORE)


def border_only_windows(borders: torch.Tensor, length: int, stride: int, end: int) -> torch.Tensor:
    """int64 [K]: the window starts s (multiples of stride below end) whose targets s + 1 .. s + length are
    all borders: `length` tokens in a row, each a document of its own. Of a corpus with every token trained,
    only these windows have no target to train; found from the borders (int64 [B]) alone."""
    first = borders[: max(len(borders) - length + 1, 0)]  # int64: a window's first target, a border
    in_a_row = borders[length - 1 :] - first == length - 1  # bool: the `length` borders from `first` are consecutive
    s = first[in_a_row] - 1
    return s[(s % stride == 0) & (s < end)]


def trained_windows(trained: torch.Tensor, borders: torch.Tensor | None, length: int, stride: int) -> torch.Tensor:
    """int64 [W]: the window starts s (every stride tokens) whose targets s + 1 .. s + length hold a token
    that `trained` (bool [N]) trains and that is not one of `borders` (document_borders, None: none)."""
    starts = torch.arange(0, len(trained) - length, stride)  # int64 [W]
    counts = trained.cumsum(0, dtype=torch.int32)  # int32 [N]: trained tokens up to each
    targets = counts[starts + length] - counts[starts]  # int32 [W]: trained targets of each window
    if borders is not None:  # less its borders that `trained` trains: one it leaves out is not counted twice
        trained_borders = borders[trained[borders]]  # int64, increasing
        targets = targets - (torch.searchsorted(trained_borders, starts + length, right=True)
                             - torch.searchsorted(trained_borders, starts + 1))
    return starts[targets > 0]


def kept_windows(n: int, length: int, stride: int, trained: torch.Tensor | None,
                 borders: torch.Tensor | None) -> range | torch.Tensor:
    """The starts of the windows (every stride tokens of a stream of n, `length` targets each) with a target
    that is trained on (trained_windows): a range where that is every window, else int64 [W]."""
    if trained is not None:
        return trained_windows(trained, borders, length, stride)
    every = range(0, n - length, stride)
    dropped = border_only_windows(borders, length, stride, n - length) if borders is not None else []
    if not len(dropped):  # the usual case: no tensor a window
        return every
    starts = torch.arange(0, n - length, stride)  # int64 [W]
    return starts[~torch.isin(starts, dropped)]


def window_documents(starts: torch.Tensor, begin: int, length: int) -> torch.Tensor:
    """int64 [length]: which document each token begin .. begin + length - 1 belongs to, counted from 0 at
    `begin` (a document that starts before the window is document 0). starts: int64 [D], increasing."""
    documents = torch.searchsorted(starts, torch.arange(begin, begin + length), right=True)
    return documents - documents[0]


def batch_documents(rows: list[torch.Tensor]) -> torch.Tensor | None:
    """int64 [B, L] of window_documents rows, or None where each window holds one document: the model
    then builds no mask (SDPA's causal fast kernel) and counts positions 0..L-1, as one document needs."""
    if all(int(row[-1]) == 0 for row in rows):
        return None
    return torch.stack(rows)


class TextWindowDataset(torch.utils.data.Dataset):
    """Windows of max_length tokens every `stride` tokens (default: max_length, no overlap).
    Item i is (input_ids, targets), both int64 [max_length], targets = inputs shifted by one, IGNORE
    where `trained` (bool, one a token, None: all) is False; a window with no trained target is left
    out (its loss would be 0 / 0). The stream itself is held as TOKEN_DTYPE. Tokens after the last
    full window are not used.
    document_starts (int64 [D], where each document begins, increasing; None: one stream attended across): a
    target that is a document's first token (document_borders) is IGNORE too, found a window at a time from
    the starts (`trained` stays the caller's: no mask over the stream is made for them), and documents(i)
    says which document each input token of window i belongs to, for attention and positions that restart at each."""

    def __init__(self, token_ids, max_length: int, stride: int | None = None, trained: torch.Tensor | None = None,
                 document_starts: torch.Tensor | None = None):
        self.ids = torch.as_tensor(token_ids).to(TOKEN_DTYPE).flatten()
        self.document_starts = None if document_starts is None else torch.as_tensor(document_starts, dtype=torch.int64)
        self.borders = document_borders(self.document_starts, len(self.ids))  # int64 [B] or None
        self.max_length, self.stride, self.trained = max_length, stride or max_length, trained
        if max_length < 1 or self.stride < 1:
            raise ValueError(f"max_length and stride must be >= 1, got {max_length}, {self.stride}")
        if len(self.ids) < max_length + 1:
            raise ValueError(f"text has {len(self.ids)} tokens, fewer than max_length + 1 = {max_length + 1}")
        self.starts = kept_windows(len(self.ids), max_length, self.stride, trained, self.borders)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = int(self.starts[i])
        inputs = self.ids[s : s + self.max_length].long()  # int64 [max_length]
        return inputs, window_targets(self.ids, self.trained, self.borders, s + 1, self.max_length)

    def documents(self, items: list[int]) -> torch.Tensor | None:
        """int64 [len(items), max_length]: the document of each input token of these windows (batch_documents),
        or None: each window holds one document, or the stream is attended across (no document_starts)."""
        if self.document_starts is None:
            return None
        starts = self.document_starts
        return batch_documents([window_documents(starts, int(self.starts[i]), self.max_length) for i in items])
