"""Windows of whole documents: best-fit packing of a token stream's documents (conversations, prompt /
completion records), as TRL's SFTTrainer packs by default ("bfd") and axolotl's multipack does.

The stream's windows (text_corpus.TextWindowDataset) cut the stream every max_length tokens, wherever a
conversation is: its tail then trained in the next window without its prompt (attention restarts at each
document): of 20,000 conversations of 30-500 tokens, 20.1% of the reply tokens at max_length 1024
(bench/bench_llm_packing.py; best fit: none, in 0.2% more windows). Here each document is a piece
of at most max_length + 1 tokens (a window's inputs and its last target), and the pieces are put into
windows by best fit, longest first: a document that fits a window is never cut. A longer one is cut into
pieces of max_length + 1 tokens that overlap by one, the stream's rule (they train apart, as there).

A window is its pieces end to end, padded to max_length + 1 with PAD_ID as a document of its own; the
targets are the next tokens, IGNORE at each piece's first token (no piece sees another's), on the padding
and where `trained` is False. documents() gives the piece of each input token, so attention and positions
restart at each piece as they restart at each document in the stream's windows."""

from __future__ import annotations

import torch

from library.data.text_corpus import IGNORE, TOKEN_DTYPE, batch_documents


def packing_of(args) -> str:
    """The config's packing, unset resolved: best_fit, but stream where stride is set (overlapping windows are
    the stream's) or attend_across_documents (no documents to keep whole)."""
    if args.packing:
        return args.packing
    return "stream" if args.attend_across_documents or args.stride not in (None, args.max_length) else "best_fit"


PAD_ID = 0  # an input no real token attends to (a document of its own) and no target reads


def document_pieces(starts: torch.Tensor, n: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(int64 [P] first tokens, int64 [P] token counts): the pieces of at most length + 1 tokens of each
    document of a stream of n tokens (starts: int64 [D], increasing; tokens before the first start are a
    document too), a longer document's every `length` tokens; a piece of one token (no target) is left out."""
    bounds = torch.cat([starts.new_zeros(1), starts, starts.new_full((1,), n)]).unique_consecutive()
    begin, end = bounds[:-1], bounds[1:]  # int64 [D']
    counts = (end - begin - 2).clamp(min=0) // length + 1  # int64 [D']: pieces a document is cut into
    doc = torch.repeat_interleave(torch.arange(len(begin)), counts)  # int64 [P]: each piece's document
    first_piece = torch.cumsum(counts, 0) - counts  # int64 [D']
    k = torch.arange(len(doc)) - first_piece[doc]  # int64 [P]: the piece's number in its document
    first = begin[doc] + k * length
    sizes = torch.minimum(end[doc] - first, torch.full_like(first, length + 1))
    kept = sizes >= 2
    return first[kept], sizes[kept]


def best_fit(sizes: list[int], capacity: int) -> list[list[int]]:
    """Bins of at most `capacity`, each a list of indices into `sizes` (each <= capacity): the sizes longest
    first (ties in order), each into the bin it leaves the least room in, or a new bin. A segment tree over
    the room left (0..capacity) finds that bin in O(log capacity)."""
    size = 1 << capacity.bit_length()
    tree = [0] * (2 * size)  # tree[size + r]: open bins with r left; each inner node: the sum of its two
    with_room: list[list[int]] = [[] for _ in range(capacity + 1)]
    bins: list[list[int]] = []

    def count(room: int, change: int):
        i = room + size
        while i:
            tree[i] += change
            i //= 2

    for p in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        room = _least_room(tree, size, sizes[p])
        if room is None:
            b, left = len(bins), capacity - sizes[p]
            bins.append([p])
        else:
            b, left = with_room[room].pop(), room - sizes[p]
            count(room, -1)
            bins[b].append(p)
        if left >= 2:  # a piece has two tokens at least
            with_room[left].append(b)
            count(left, +1)
    return bins


def _least_room(tree: list[int], size: int, need: int) -> int | None:
    """The least room r >= need that an open bin has (tree: best_fit's counts), or None."""
    i = need + size
    if tree[i]:
        return need
    while i > 1:  # up to the first left child whose right sibling holds a bin
        if i % 2 == 0 and tree[i + 1]:
            i += 1
            break
        i //= 2
    else:
        return None
    while i < size:  # down to that subtree's leftmost bin
        i = 2 * i if tree[2 * i] else 2 * i + 1
    return i - size


class PackedWindowDataset(torch.utils.data.Dataset):
    """TextWindowDataset's interface (item i: int64 [max_length] inputs and targets; documents(items)) over
    windows of whole documents (the module's docstring). A piece with no trained target is left out before
    packing. token_ids: the stream; trained: bool [N] or None (every token); document_starts: int64 [D]."""

    def __init__(self, token_ids, max_length: int, trained: torch.Tensor | None, document_starts: torch.Tensor):
        self.ids = torch.as_tensor(token_ids).to(TOKEN_DTYPE).flatten()
        self.max_length, self.trained = max_length, trained
        first, sizes = document_pieces(torch.as_tensor(document_starts, dtype=torch.int64), len(self.ids), max_length)
        if trained is not None:  # trained targets: tokens 1 .. size - 1 of the piece; int32 counts below 2^31
            counts = trained.cumsum(0, dtype=torch.int32 if len(trained) < 2**31 else torch.int64)  # (no int64 copy)
            useful = counts[first + sizes - 1] - counts[first] > 0
            first, sizes = first[useful], sizes[useful]
        bins = best_fit(sizes.tolist(), max_length + 1)
        order = torch.tensor([p for b in bins for p in b], dtype=torch.int64)
        self.first, self.sizes = first[order], sizes[order]  # int64 [P], window by window
        self.offsets = torch.tensor([0, *map(len, bins)], dtype=torch.int64).cumsum(0)  # int64 [W + 1]

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def filled(self) -> float:
        """The share of the windows' max_length + 1 tokens that documents fill (the rest: padding)."""
        return int(self.sizes.sum()) / max(len(self) * (self.max_length + 1), 1)

    def _pieces(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        lo, hi = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.first[lo:hi], self.sizes[lo:hi]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        first, sizes = self._pieces(i)
        spans = [slice(int(f), int(f + s)) for f, s in zip(first, sizes)]
        row = torch.full((self.max_length + 1,), PAD_ID, dtype=torch.int64)  # int64 [L + 1]
        used = int(sizes.sum())
        row[:used] = torch.cat([self.ids[s] for s in spans]).long()
        targets = row[1:].clone()  # int64 [L]: target j is row token j + 1
        ignored = torch.ones(self.max_length + 1, dtype=torch.bool)  # per row token: not a target
        ignored[:used] = False
        ignored[(sizes.cumsum(0) - sizes)] = True  # each piece's first token
        if self.trained is not None:
            ignored[:used] |= ~torch.cat([self.trained[s] for s in spans])
        targets[ignored[1:]] = IGNORE
        return row[:-1], targets

    def documents(self, items: list[int]) -> torch.Tensor | None:
        """int64 [len(items), max_length]: the piece of each input token (the padding: one past the last),
        or None where each window is one piece filling it (batch_documents)."""
        rows = []
        for i in items:
            sizes = self._pieces(i)[1]
            pad = self.max_length + 1 - int(sizes.sum())
            counts = torch.cat([sizes, torch.tensor([pad])]) if pad else sizes
            rows.append(torch.repeat_interleave(torch.arange(len(counts)), counts)[: self.max_length])
        return batch_documents(rows)
