"""Best-fit packing (library/data/packing.py, `packing` unset or "best_fit"): each conversation / record that fits
a window is trained whole in one window, never cut at a window border as the stream's windows cut it (20.1% of
the reply tokens of 20,000 conversations trained without their prompt at max_length 1024:
bench/bench_llm_packing.py); every trained target of the stream is trained exactly once; a packed window gives
each document's logits as if run alone."""

import random

import pytest
import torch

from library.data import packing
from library.data.packing import PackedWindowDataset, best_fit, document_pieces
from library.data.text_corpus import IGNORE, TextWindowDataset
from tests.test_llm_document_borders import tiny_llm
from tests.test_llm_jsonl import chat_llm, chat_tokenizer  # noqa: F401 (fixtures)


def corpus(lengths: list[int], seed: int = 0):
    """(ids int64 [N], trained bool [N]: each document's second half, as a reply after its prompt, starts)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 40, (sum(lengths),), generator=g)
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0)[:-1].tolist()])
    trained = torch.zeros(len(ids), dtype=torch.bool)
    for s, n in zip(starts.tolist(), lengths):
        trained[s + n // 2 : s + n] = True
    return ids, trained, starts


def test_best_fit_fills_bins_longest_first_into_the_least_room():
    """Sizes into bins of 10: each bin within capacity, each size in one bin; 7 goes where it leaves 0 (after
    3 took a bin with 7 left, beside a bin with 8 left), not into the first bin that fits."""
    assert best_fit([8, 3, 2, 7], 10) == [[0, 2], [3, 1]]  # 8 | 7, then 3 into 7's room (0 left), 2 into 8's
    rng = random.Random(0)
    sizes = [rng.randint(2, 33) for _ in range(500)]
    bins = best_fit(sizes, 33)
    assert sorted(p for b in bins for p in b) == list(range(500))
    assert all(sum(sizes[p] for p in b) <= 33 for b in bins)
    assert len(bins) <= 1.05 * sum(sizes) / 33 + 1  # within 5% of a perfect fill


def test_a_document_longer_than_a_window_is_cut_into_pieces_that_overlap_by_one_token():
    """Documents of 3, 1 (no target: left out), 10 and 6 tokens, windows of 4 (+ 1): the stream's rule, a piece's last
    token the next one's first input."""
    first, sizes = document_pieces(torch.tensor([0, 3, 4, 14]), 20, 4)
    assert first.tolist() == [0, 4, 8, 12, 14, 18] and sizes.tolist() == [3, 5, 5, 2, 5, 2]


def test_no_conversation_that_fits_a_window_is_cut_and_every_trained_target_is_trained_once():
    """200 conversations of 8-60 tokens, max_length 64: packed, each window's pieces are whole conversations
    (each starts at a conversation's start), and the trained targets are exactly the corpus's trained tokens
    (borders aside); the stream's windows cut conversations, and of their trained tokens some train in a window
    that does not hold their conversation's first token."""
    rng = random.Random(1)
    lengths = [rng.randint(8, 60) for _ in range(200)]
    ids, trained, starts = corpus(lengths)
    packed = PackedWindowDataset(ids, 64, trained, starts)
    assert set(packed.first.tolist()) <= set(starts.tolist()) and len(packed.first) == 200
    targets = torch.cat([packed[i][1] for i in range(len(packed))])
    expected = ids[trained & ~torch.isin(torch.arange(len(ids)), starts)]
    assert sorted(targets[targets != IGNORE].tolist()) == sorted(expected.tolist())
    fill = sum(lengths) / (len(packed) * 65)
    assert fill > 0.88, fill  # 0.903: pieces over half a window pair with short ones alone
    stream = TextWindowDataset(ids, 64, trained=trained, document_starts=starts)
    opened_inside = sum(int(s) not in set(starts.tolist()) for s in stream.starts)
    assert opened_inside > len(stream) // 2  # most stream windows open inside a conversation


def test_a_packed_window_gives_each_documents_logits_as_if_run_alone():
    """Three documents and the padding in one window of 24: the logits at each document's tokens equal the
    document run alone (float32, 1e-5); the targets are its next tokens, IGNORE at each first token and on the pad."""
    torch.manual_seed(0)
    ids, _, starts = corpus([9, 7, 5])
    dataset = PackedWindowDataset(ids, 24, None, starts)
    assert len(dataset) == 1
    inputs, targets = dataset[0]
    documents = dataset.documents([0])
    order = [slice(int(f), int(f + s)) for f, s in zip(dataset.first, dataset.sizes)]
    assert documents.tolist() == [[0] * 9 + [1] * 7 + [2] * 5 + [3] * 3]
    row = torch.cat([ids[s] for s in order])
    assert inputs[:21].tolist() == row.tolist() and inputs[21:].tolist() == [packing.PAD_ID] * 3
    assert targets.tolist() == [*row[1:9].tolist(), IGNORE, *row[10:16].tolist(), IGNORE, *row[17:21].tolist(),
                                *[IGNORE] * 4]
    model = tiny_llm()
    with torch.no_grad():
        packed = model(inputs[None], documents=documents)[0]
        alone = torch.cat([model(ids[s][None])[0] for s in order])
    assert (packed[:21] - alone).abs().max() < 1e-5


@pytest.mark.parametrize("settings, expected", [
    ({}, "best_fit"), ({"stride": 64}, "best_fit"), ({"stride": 32}, "stream"),
    ({"attend_across_documents": True}, "stream"), ({"packing": "stream"}, "stream"),
])
def test_unset_packing_is_best_fit_unless_stride_or_attend_across_documents_ask_for_the_stream(settings, expected):
    from types import SimpleNamespace

    args = SimpleNamespace(**{"packing": None, "stride": None, "max_length": 64, "attend_across_documents": False,
                              **settings})
    assert packing.packing_of(args) == expected


def test_best_fit_with_a_stride_is_refused_naming_both_keys(tmp_path):
    from library.errors import ConfigError
    from library.training.config import load_config

    with pytest.raises(ConfigError, match="packing = \"best_fit\" puts whole documents into windows, which 'stride' "
                                          "= 16 would cut as a stream"):
        load_config(["--model_type", "llm", "--pretrained_model_name_or_path", str(tmp_path), "--train_data",
                     str(tmp_path), "--max_length", "32", "--stride", "16", "--packing", "best_fit"])


def test_the_held_out_loss_with_best_fit_is_each_documents_own_over_its_packed_windows():
    """With best-fit packing the held-out split is scored in training's layout: the token-weighted mean of each
    document's cross-entropy run alone (its trained targets after its first token). The stream's windows cut 25% of
    a chat split's replies from their prompt (20,000 conversations at max_length 1024), which training never asks."""
    from types import SimpleNamespace

    import torch.nn.functional as F

    from library.training.llm_task import LLMTask

    torch.manual_seed(0)
    ids, trained, starts = corpus([9, 7, 5, 12, 3])
    model = tiny_llm()
    task = SimpleNamespace(val_packed=PackedWindowDataset(ids, 16, trained, starts), model=model, device="cpu",
                           args=SimpleNamespace(batch_size=2))
    total, count = 0.0, 0
    with torch.no_grad():
        for s, n in zip(starts.tolist(), [9, 7, 5, 12, 3]):
            logits = model(ids[s : s + n - 1][None])[0]
            targets = torch.where(trained[s + 1 : s + n], ids[s + 1 : s + n], IGNORE)
            total += float(F.cross_entropy(logits.float(), targets, reduction="sum"))
            count += int((targets != IGNORE).sum())
        loss = LLMTask._packed_held_out_loss(task)
    assert abs(loss - total / count) < 1e-5, (loss, total / count)


def test_the_trainer_scores_its_held_out_split_in_the_layout_it_trains(chat_llm, tmp_path):
    """Default (best_fit): the held-out split's own packed windows; packing = "stream": the stream's windows."""
    import train_lora
    from library.training.config import load_config
    from library.training.llm_task import LLMTask
    from tests.test_llm_jsonl import write_jsonl

    records = [{"messages": [{"role": "user", "content": f"Count to {n}."},
                             {"role": "assistant", "content": " ".join(map(str, range(1, n + 1)))}]}
               for n in range(2, 30)]
    path = write_jsonl(tmp_path / "chat.jsonl", records)
    for extra, packed in (([], True), (["--packing", "stream"], False)):
        args = load_config(["--model_type", "llm", "--pretrained_model_name_or_path", chat_llm, "--train_data", path,
                            "--output_dir", str(tmp_path / "out"), "--mixed_precision", "no", "--max_length", "64",
                            "--val_fraction", "0.3", *extra])
        task = LLMTask(args, train_lora.make_accelerator(args))
        assert (task.val_packed is not None) is packed and isinstance(task.train_set, PackedWindowDataset) is packed
        assert task.held_out_windows() > 0 and task.held_out_loss() > 0
        if packed:
            assert task.held_out_windows() == len(task.val_packed)
