"""A huge training document is tokenized in pieces (library/data/text_corpus.py): the same tokens as the
whole document, with no Python list longer than a piece."""

import random

import pytest
import torch

from library.data import text_corpus


@pytest.fixture(scope="module")
def qwen_tokenizer():
    from library.models.tiny_files import build_qwen_tokenizer

    return build_qwen_tokenizer()


def varied_text(lines: int) -> str:
    """Lines of words, numbers, punctuation, runs of spaces and blank lines: every pre-tokenizer branch."""
    rng = random.Random(0)
    words = ["the", "Quick", "brown", "fox's", "12", "3456", "über", "café", "--", "...", "it'll", "(x)", "\t"]
    out = []
    for _ in range(lines):
        out.append(" ".join(rng.choice(words) for _ in range(rng.randint(0, 12))) + rng.choice(["", " ", "  ", "."]))
    return "\n".join(out) + rng.choice(["\n\n", "\r\n", "\n  "]).join(["", "tail"])


def test_a_huge_document_is_encoded_in_pieces_with_the_whole_documents_tokens(qwen_tokenizer, monkeypatch):
    """The old line encoded each document in one call: the 60 KB text below became one Python list of all its
    tokens. Now pieces of >= 2000 characters, cut after a newline (or before a word): the stream equals the
    whole-document encoding plus EOS, and no encode call returns over 1/10 of the tokens."""
    tok = qwen_tokenizer
    monkeypatch.setattr(text_corpus, "PIECE_CHARS", 2000)
    doc = varied_text(3000)
    one_line = doc.replace("\n", " ")  # no newline at all: cut before words only
    sizes = []

    def counted(add_special_tokens):
        return lambda text: sizes.append(len(ids := tok.encode(text, add_special_tokens=add_special_tokens))) or ids

    ids = text_corpus.tokenize_documents([doc, one_line], counted(True), 7, counted(False))
    whole = tok.encode(doc) + [7] + tok.encode(one_line) + [7]
    assert ids.dtype == torch.int32 and ids.tolist() == whole
    assert len(sizes) > 40 and max(sizes) < len(whole) / 10


def test_a_tokenizer_whose_tokens_change_at_a_cut_gets_whole_documents():
    """A SentencePiece-style dummy prefix ('▁' before each encoded text) would change the first token of each
    piece: the probe sees that, and the document is encoded whole."""
    encode = lambda text: [ord("▁")] + [ord(c) for c in text]  # noqa: E731
    doc = "line one\nline two\n" * 2000
    calls = []
    ids = text_corpus.tokenize_documents([doc], lambda t: calls.append(t) or encode(t), None, encode)
    assert not text_corpus.pieces_keep_tokens(encode, encode)
    assert ids.tolist() == encode(doc) and calls[-1] == doc


def test_text_pieces_cut_where_no_pre_token_spans():
    assert text_corpus.text_pieces("ab\n\ncd\n ef gh", 1) == ["ab\n\n", "cd\n ef", " gh"]
    assert "".join(text_corpus.text_pieces(varied_text(500), 100)) == varied_text(500)


def test_a_file_is_read_in_pieces_cut_where_its_whole_text_may_be_cut(tmp_path):
    """file_pieces joins back to the text read whole; each piece but the last ends at a CUT point of the
    whole text and holds at least a read (100 characters); a file with no cut point is one piece."""
    text = varied_text(400).replace("\r\n", "\n")
    (tmp_path / "a.txt").write_text(text)
    pieces = list(text_corpus.file_pieces(str(tmp_path / "a.txt"), 100))
    assert "".join(pieces) == text and len(pieces) > 20 and all(len(p) >= 100 for p in pieces[:-1])
    ends = {m.end() for m in text_corpus.CUT.finditer(text)}
    assert all(sum(map(len, pieces[: i + 1])) in ends for i in range(len(pieces) - 1))
    (tmp_path / "b.txt").write_text("x" * 5000)
    assert list(text_corpus.file_pieces(str(tmp_path / "b.txt"), 100)) == ["x" * 5000]
