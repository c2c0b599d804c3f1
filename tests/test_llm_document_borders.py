"""Packed LLM windows keep their documents apart (attend_across_documents = false, the default): each
document attends only to itself, counts its positions from 0, and the target after its end is not trained,
so a window holding A|B|C gives the logits of A, B and C run alone (TRL's padding_free packing, axolotl's
sample_packing, Llama 3's document mask)."""

import json
from types import SimpleNamespace

import pytest
import torch

import train_lora
from library.data import text_corpus
from library.data.text_corpus import IGNORE, TextWindowDataset
from library.models import core
from library.models.llm import LLM, LLMConfig

LENGTHS = (5, 7, 5)  # A | B | C: 17 tokens, one window of max_length 16 (C's last token is a target only)


def tiny_llm(**extra) -> LLM:
    config = dict(vocab_size=40, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64,
                  qkv_bias=True, max_position_embeddings=64)
    return LLM(LLMConfig(**{**config, **extra})).eval()


def packed_window():
    """(the dataset's window: inputs [16], targets [16], documents [1, 16]; the three documents' ids)."""
    docs = [torch.randint(1, 40, (n,)) for n in LENGTHS]
    starts = torch.tensor([0, LENGTHS[0], LENGTHS[0] + LENGTHS[1]])
    dataset = TextWindowDataset(torch.cat(docs), 16, document_starts=starts)
    inputs, targets = dataset[0]
    return inputs, targets, dataset.documents([0]), docs


@pytest.mark.parametrize("extra", [{}, {"sliding_window": 3, "window_layers": (1,)}], ids=["full", "sliding_window"])
def test_a_packed_window_gives_the_logits_of_each_document_run_alone(extra):
    """Measured (float32): 3e-7 apart (3.6e-7 with the sliding window); attending across (documents None, the
    behaviour before) moves B's and C's logits by up to 0.85 (0.66)."""
    torch.manual_seed(0)
    model = tiny_llm(**extra)
    inputs, _, documents, docs = packed_window()
    assert documents.tolist() == [[0] * 5 + [1] * 7 + [2] * 4]
    with torch.no_grad():
        packed = model(inputs[None], documents=documents)[0]
        alone = torch.cat([model(d[None])[0] for d in (docs[0], docs[1], docs[2][:-1])])
        across = model(inputs[None])[0]
    assert (packed - alone).abs().max() < 1e-5
    assert (across - alone)[5:].abs().max() > 1e-2  # the old behaviour: B and C see what came before them


def test_documents_combine_with_left_padding():
    """A left-padded packed row (the pads a document of their own, attention_mask 0 there): the real tokens'
    logits are still each document's alone (the padding mask and the document mask combine)."""
    torch.manual_seed(0)
    model = tiny_llm()
    inputs, _, documents, docs = packed_window()
    padded = torch.cat([torch.zeros(2, dtype=torch.long), inputs])[None]
    mask = torch.tensor([[0, 0] + [1] * 16])
    with torch.no_grad():
        logits = model(padded, attention_mask=mask, documents=torch.cat([torch.full((1, 2), -1), documents], 1))[0]
        alone = torch.cat([model(d[None])[0] for d in (docs[0], docs[1], docs[2][:-1])])
    assert (logits[2:] - alone).abs().max() < 1e-5


def test_the_target_across_a_border_is_ignored_and_the_rest_are_the_next_tokens():
    inputs, targets, _, docs = packed_window()
    stream = torch.cat(docs)
    assert targets[[4, 11]].tolist() == [IGNORE, IGNORE]  # A's and B's last tokens predicting B's and C's first
    kept = [i for i in range(16) if i not in (4, 11)]
    assert targets[kept].tolist() == stream[1:][kept].tolist()
    assert inputs.tolist() == stream[:16].tolist()


def test_positions_restart_at_each_document():
    from library.models.llm import position_ids_from_documents

    documents = torch.tensor([[0, 0, 1, 1, 1, 2], [0, 0, 0, 0, 0, 0]])
    assert position_ids_from_documents(documents).tolist() == [[0, 1, 0, 1, 2, 0], [0, 1, 2, 3, 4, 5]]
    assert position_ids_from_documents(documents).dtype == torch.int64  # RoPE's angles come from int64 positions


def test_a_window_of_one_document_builds_no_mask(monkeypatch):
    """A window inside one document (the first one part of it) gets documents None, and the model's attention
    then runs with no mask (SDPA's is_causal fast kernel); a batch holding any border gets one for every row."""
    ids = torch.randint(1, 40, (40,))
    dataset = TextWindowDataset(ids, 8, document_starts=torch.tensor([0, 20]))
    assert dataset.documents([0, 1]) is None  # tokens 0..15: document 0 only
    assert dataset.documents([1, 2]).tolist() == [[0] * 8, [0] * 4 + [1] * 4]  # window 2: tokens 16..23
    masks = []
    real = core.attention
    monkeypatch.setattr(core, "attention", lambda *a, **k: (masks.append(k["mask"]), real(*a, **k))[1])
    model = tiny_llm()
    with torch.no_grad():
        model(torch.stack([dataset[0][0], dataset[1][0]]), documents=dataset.documents([0, 1]))
    assert masks == [None, None]  # one a layer


def test_document_starts_are_kept_for_documents_and_conversations(tmp_path):
    """tokenize_corpus records where each .txt file, "text" record and "messages" record starts."""
    (tmp_path / "a.txt").write_text("abc")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "de"}) + "\n" + json.dumps({"messages": [{"role": "user", "content": "x"}]}) + "\n"
                                      + json.dumps({"text": "f"}) + "\n")
    encode = lambda s: [ord(c) for c in s]  # noqa: E731
    chat = lambda messages, where, tools: ([7, 8, 9, 10], [False, False, True, True])  # noqa: E731
    ids, trained, starts = text_corpus.tokenize_corpus([str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl")], encode,
                                                       encode, eos_id=0, chat=chat)
    assert starts.tolist() == [0, 4, 7, 11] and len(ids) == 13
    train, val = text_corpus.split_starts(starts, 9)
    assert train.tolist() == [0, 4, 7] and val.tolist() == [2]
    assert text_corpus.document_borders(starts, 13).tolist() == [4, 7, 11]  # the stream's first token is no border
    dataset = TextWindowDataset(ids, 12, trained=trained, document_starts=starts)  # one window: targets 1 .. 12
    assert [i + 1 for i, t in enumerate(dataset[0][1].tolist()) if t != IGNORE] == [
        1, 2, 3, 5, 6, 9, 10, 12]  # the conversation's first two tokens untrained as before; 4, 7, 11 borders


def test_held_out_loss_scores_each_document_alone():
    """The held-out split follows the training rule: the mean over each document's own targets, run alone."""
    from types import SimpleNamespace

    import torch.nn.functional as F

    from library.training.llm_task import LLMTask

    torch.manual_seed(0)
    model = tiny_llm()
    docs = [torch.randint(1, 40, (n,)) for n in (9, 12, 6)]  # 27 tokens: windows of 16 targets, then 10
    starts = torch.tensor([0, 9, 21])
    ids = torch.cat(docs)
    task = SimpleNamespace(val_ids=ids, val_trained=None, val_packed=None,  # the border targets: from val_starts
                           val_starts=starts, args=SimpleNamespace(max_length=16, batch_size=2), model=model, device="cpu")
    with torch.no_grad():  # window 0 holds A and B's first 7 tokens; window 1 the rest of B (positions from 0) and C
        pieces = [docs[0], docs[1][:8], docs[1][7:], docs[2]]
        losses = [F.cross_entropy(model(p[None, :-1])[0], p[1:], reduction="sum") for p in pieces]
    expected = float(sum(losses)) / sum(len(p) - 1 for p in pieces)
    assert abs(LLMTask.held_out_loss(task) - expected) < 1e-5



def test_a_plain_corpus_with_documents_keeps_no_mask_over_its_stream():
    """The border targets are found a window at a time from the starts: a corpus with every token trained keeps
    trained None and its windows a range (before: a bool mask over the stream, 1 byte a token, and its int32
    cumsum while the windows were chosen); a caller's mask is kept as given, not copied."""
    ids, starts = torch.randint(1, 40, (1000,)), torch.arange(0, 1000, 50)
    dataset = TextWindowDataset(ids, 16, document_starts=starts)
    assert dataset.trained is None and dataset.starts == range(0, 984, 16) and len(dataset.borders) == 19
    assert (dataset[3][1] == IGNORE).nonzero().flatten().tolist() == [1]  # targets 49 .. 64: 50 a border
    trained = torch.arange(1000) % 3 > 0
    assert TextWindowDataset(ids, 16, trained=trained, document_starts=starts).trained is trained


def old_border_rule(ids, max_length, stride, trained, starts):
    """The rule before (untrain_border_targets): a bool mask over the whole stream with each document's first
    token (but the stream's first) untrained; (the kept window starts, their items, that mask)."""
    n = len(ids)
    borders = starts[(starts > 0) & (starts < n)]
    if len(borders):
        trained = torch.ones(n, dtype=torch.bool) if trained is None else trained.clone()
        trained.index_fill_(0, borders, False)
    kept = [s for s in range(0, n - max_length, stride) if trained is None or trained[s + 1 : s + max_length + 1].any()]
    items = []
    for s in kept:
        targets = ids[s + 1 : s + max_length + 1].long()
        items.append((ids[s : s + max_length].long(),
                      targets if trained is None else targets.masked_fill(~trained[s + 1 : s + max_length + 1], IGNORE)))
    return kept, items, trained


def random_corpus(gen):
    """(ids [n], starts: increasing, some repeated (empty documents), some one token apart, maybe 0 and n;
    a caller's mask or None)."""
    n = int(torch.randint(12, 60, (1,), generator=gen))
    dense = float(torch.rand(1, generator=gen)) * 0.9  # up to nearly every token a document of its own
    starts = torch.arange(n + 1)[torch.rand(n + 1, generator=gen) < dense]
    starts = torch.sort(torch.cat([starts, starts[torch.rand(len(starts), generator=gen) < 0.2]])).values
    share = float(torch.rand(1, generator=gen))  # of the tokens the caller trains
    trained = None if torch.rand(1, generator=gen) < 0.5 else torch.rand(n, generator=gen) < share
    return torch.randint(0, 40, (n,), generator=gen), starts, trained


def test_the_windows_from_the_starts_equal_the_mask_over_the_stream():
    """Random corpora (plain or with a caller's mask; documents of one token in a row, empty ones, a start at 0
    or at the end), several max_length and stride: every window, the windows kept and whether a held-out split
    has a target to score equal the old materialized rule's."""
    from library.training.llm_task import LLMTask

    gen, seen = torch.Generator().manual_seed(0), {"plain": [0, 0], "masked": [0, 0]}  # windows kept, dropped
    for _ in range(60):
        ids, starts, trained = random_corpus(gen)
        for max_length in (1, 2, 3, 8):
            for stride in (1, 2, 3, max_length):
                if len(ids) < max_length + 1:
                    continue
                kept, items, _ = old_border_rule(ids, max_length, stride, trained, starts)
                dataset = TextWindowDataset(ids, max_length, stride, trained, starts)
                assert [int(s) for s in dataset.starts] == kept
                for i, (inputs, targets) in enumerate(items):
                    assert torch.equal(dataset[i][0], inputs) and torch.equal(dataset[i][1], targets)
                counts = seen["plain" if trained is None else "masked"]
                counts[0] += len(kept)
                counts[1] += len(range(0, len(ids) - max_length, stride)) - len(kept)
        task = SimpleNamespace(val_ids=ids, val_trained=trained, val_starts=starts, val_packed=None)
        old_mask = old_border_rule(ids, 1, 1, trained, starts)[2]
        assert LLMTask.scores_held_out(task) == (old_mask is None or bool(old_mask[1:].any()))
    assert min(seen["plain"] + seen["masked"]) > 2000, seen  # kept and dropped windows of both kinds checked


def write_documents(path, count: int = 60) -> str:
    """`count` short "text" records: several to a 32-token window."""
    words = ["red apple", "blue sky over the sea", "green grass", "a cat sat on the mat", "the dog runs home"]
    path.write_text("".join(json.dumps({"text": f"{words[i % 5]} number {i}"}) + "\n" for i in range(count)))
    return str(path)


def test_training_with_the_default_keeps_documents_apart_and_its_loss_falls(tiny_set, tmp_path, monkeypatch):
    """The real entry (train_lora.main) on 60 short documents: every training batch reaches the model with its
    documents, and the loss falls (a from-scratch model's first steps: 6.9 -> ~5.5 in 6 steps)."""
    from tests.test_train_llm import column, llm_args

    seen = []
    real = LLM._embed
    monkeypatch.setattr(LLM, "_embed", lambda self, *a, **k: (seen.append(a[4] if len(a) > 4 else k.get("documents")),
                                                              real(self, *a, **k))[1])
    out = tmp_path / "out"
    argv = llm_args(tiny_set, out, "--pretrained_model_name_or_path", tiny_set["llm_scratch"], "--pretrain",
                    "--train_data", write_documents(tmp_path / "docs.jsonl"), "--max_train_steps", "6",
                    "--eval_every_n_steps", "0", "--learning_rate", "3e-3", "--output_name", "lm")
    assert train_lora.main(argv) == 0
    losses = column(out / "lm_log.csv", "loss")
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.5, losses
    assert len(seen) >= 6 and all(d is not None and int(d[:, -1].max()) >= 2 for d in seen[:6])


def test_attend_across_documents_keeps_one_stream(tiny_set, tmp_path):
    """The key on: the windows carry no documents and the border targets are trained, as before the key."""
    from library.training.config import load_config
    from tests.test_train_llm import llm_args

    def task(*extra):
        argv = llm_args(tiny_set, tmp_path / "out", "--pretrained_model_name_or_path", tiny_set["llm_scratch"],
                        "--pretrain", "--train_data", write_documents(tmp_path / "docs.jsonl"), *extra)
        return train_lora.Trainer(load_config(argv)).task

    across, apart = task("--attend_across_documents"), task()
    batch_across, batch_apart = next(across.epoch_batches(0)), next(apart.epoch_batches(0))
    assert batch_across[2] is None and batch_apart[2] is not None
    assert int((batch_across[1] == IGNORE).sum()) == 0 and int((batch_apart[1] == IGNORE).sum()) >= 8
