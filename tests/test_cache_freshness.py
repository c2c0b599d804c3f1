"""What re-encodes a cache and what does not: each change a user makes invalidates exactly the
latents or the text it changes, and an unchanged re-run encodes nothing (encoder calls counted)."""

import contextlib
import os
import re

import pytest
import torch
from PIL import Image

from library.data import caches, dataset as D
from library.data.dataset_config import parse_dataset_config
from library.models.family import DiffusionFamily
from tests.test_dataset import CountingEncoder, make_image, write


class Family(DiffusionFamily):
    name = "fresh"


def rewrite(path, data: bytes, mtime_ns: int):
    with open(path, "wb") as f:
        f.write(data)
    os.utime(path, ns=(mtime_ns, mtime_ns))


def test_a_model_file_rewritten_within_the_same_second_changes_its_cache_key(tmp_path):
    second = 1_700_000_000 * 10**9
    vae, t5 = tmp_path / "ae.safetensors", tmp_path / "t5.safetensors"
    rewrite(vae, b"a" * 64, second + 100_000_000)
    rewrite(t5, b"b" * 64, second)
    family = Family("model.safetensors", str(vae), t5xxl=str(t5))
    latent_key, text_key = family.latent_cache_key(), family.text_cache_key({"max_length": 512}, "bf16")
    assert (family.latent_cache_key(), family.text_cache_key({"max_length": 512}, "bf16")) == (latent_key, text_key)

    rewrite(vae, b"c" * 64, second + 900_000_000)  # same size, same whole second
    assert family.latent_cache_key() != latent_key
    assert family.text_cache_key({"max_length": 512}, "bf16") == text_key  # the text does not depend on the VAE
    latent_key = family.latent_cache_key()
    rewrite(t5, b"d" * 64, second + 1)
    assert family.text_cache_key({"max_length": 512}, "bf16") != text_key
    assert family.latent_cache_key() == latent_key
    assert family.text_cache_key({"max_length": 256}, "bf16") != family.text_cache_key({"max_length": 512}, "bf16")


def test_an_encoder_given_as_an_index_or_a_file_counts_its_shards_and_config_json(tmp_path):
    """t5xxl = <folder>/model.safetensors.index.json with shard 2 replaced (same shapes): the old key stat'ed the
    index alone and reused 8 stale caption caches (t5 embeddings off by up to 7.05). A config.json beside a
    single file is read by the text-encoder loader too (layer_norm_epsilon edited: the key stayed)."""
    import json

    folder = tmp_path / "t5"
    folder.mkdir()
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        rewrite(folder / name, b"a" * 64, 1_700_000_000 * 10**9)
    (folder / "config.json").write_text('{"layer_norm_epsilon": 1e-6}')
    family = Family("model.safetensors", "ae.safetensors", t5xxl=str(index))
    key = family.text_cache_key({"max_length": 512}, "bf16")
    rewrite(folder / "model-00002-of-00002.safetensors", b"b" * 64, 1_700_000_000 * 10**9 + 1)
    assert family.text_cache_key({"max_length": 512}, "bf16") != key
    single = Family("model.safetensors", "ae.safetensors", t5xxl=str(folder / "model-00001-of-00002.safetensors"))
    key = single.text_cache_key({"max_length": 512}, "bf16")
    (folder / "config.json").write_text('{"layer_norm_epsilon": 0.5}')
    assert single.text_cache_key({"max_length": 512}, "bf16") != key


# (where the encoder's path points, the tokenizer file changed) in a diffusers-style repo: text_encoder_2/ + tokenizer_2/
TOKENIZER_CHANGES = [
    ("repo/text_encoder_2/model.safetensors", "repo/tokenizer_2/spiece.model"),  # a single file, its tokenizer beside
    ("repo/text_encoder_2", "repo/tokenizer_2/tokenizer.json"),  # a component folder
    ("repo/text_encoder_2", "repo/tokenizer_2/tokenizer_config.json"),
    ("repo", "repo/tokenizer_2/spiece.model"),  # the pipeline folder
    ("t5", "t5/spiece.model"),  # an HF folder holding its tokenizer (a .model, which the folder walk skipped)
    ("repo/text_encoder_2", "repo/processor/preprocessor_config.json"),  # a VL encoder's processor
]


@pytest.mark.parametrize("encoder, tokenizer", TOKENIZER_CHANGES, ids=[t for _, t in TOKENIZER_CHANGES])
def test_a_changed_tokenizer_file_changes_the_text_cache_key(tmp_path, encoder, tokenizer):
    """The old key held the encoder files only (a folder's .safetensors and .json): a new spiece.model,
    or a tokenizer folder beside the encoder, left the old encodings in use."""
    second = 1_700_000_000 * 10**9
    for path in ("repo/text_encoder_2/model.safetensors", "repo/text_encoder_2/config.json", "t5/model.safetensors",
                 "repo/tokenizer_2/spiece.model", "repo/tokenizer_2/tokenizer.json", "repo/processor/preprocessor_config.json",
                 "repo/tokenizer_2/tokenizer_config.json", "t5/spiece.model", "t5/tokenizer_config.json"):
        os.makedirs(os.path.dirname(tmp_path / path), exist_ok=True)
        rewrite(tmp_path / path, b"x" * 64, second)
    family = Family("model.safetensors", "ae.safetensors", t5xxl=str(tmp_path / encoder))
    key = family.text_cache_key({"max_length": 512}, "bf16")
    rewrite(tmp_path / "unrelated.json", b"y", second)
    assert family.text_cache_key({"max_length": 512}, "bf16") == key
    rewrite(tmp_path / tokenizer, b"z" * 64, second + 1)  # same size, 1 ns later: a new tokenizer version
    assert family.text_cache_key({"max_length": 512}, "bf16") != key


def test_the_prompt_template_and_token_lengths_are_in_the_text_cache_key():
    class Templated(Family):
        template = "<user>{}</user>"

        def text_encoding_constants(self):
            return {"template": self.template, "max_length": 512}

    family = Templated("model.safetensors", "ae.safetensors", t5xxl="t5.safetensors")
    key = family.text_cache_key({"max_length": 512}, "bf16")
    family.template = "<system>be brief</system><user>{}</user>"
    assert family.text_cache_key({"max_length": 512}, "bf16") != key
    assert family.text_cache_key({"max_length": 256}, "bf16") != family.text_cache_key({"max_length": 512}, "bf16")


def dataset(root, **changes):
    subset = {"image_dir": str(root / "img"), **{k: changes.pop(k) for k in list(changes) if k in SUBSET_CHANGES}}
    return parse_dataset_config({"datasets": [{"resolution": 32, **changes, "subsets": [subset]}]}, source="t.toml")


SUBSET_CHANGES = ("caption_prefix", "caption_suffix", "flip_aug", "num_repeats", "caption_dropout_rate",
                  "caption_dropout_every_n_epochs", "shuffle_caption", "keep_tokens", "alpha_mask", "caption_variants")


def encode(root, enc, latent_key="vae-1", text_key="te-1", **changes) -> tuple[int, int]:
    items = D.ImageDataset(dataset(root, **changes)).items
    return (caches.cache_latents(items, enc.latents, latent_key, batch_size=2),
            caches.cache_text(items, enc.text, text_key))


def edit_image(root):
    make_image(root / "img" / "a.png", 64, 32, (1, 2, 3))  # same size, other pixels


def edit_caption(root):
    write(root / "img" / "a.txt", "caption B")  # same length


# (change, images re-encoded, captions re-encoded) with two images a (64x32) and b (32x32)
CHANGES = [
    ({}, 0, 0),
    ({"batch_size": 2}, 0, 0),
    ({"num_repeats": 3}, 0, 0),
    ({"caption_dropout_rate": 0.5}, 0, 0),  # the empty caption is cached apart (cache_empty_caption)
    ({"caption_dropout_every_n_epochs": 2}, 0, 0),
    ({"keep_tokens": 1}, 0, 0),  # without shuffle_caption: the same text
    ({"caption_variants": 3}, 0, 0),
    ({"resolution": 48}, 2, 0),
    ({"enable_bucket": True, "min_bucket_reso": 16, "max_bucket_reso": 64, "bucket_reso_steps": 16}, 1, 0),
    ({"flip_aug": True}, 2, 0),
    ({"alpha_mask": True}, 2, 0),
    ({"caption_prefix": "ohwx"}, 0, 2),
    ({"caption_suffix": "photo"}, 0, 2),
    ({"shuffle_caption": True}, 0, 2),
    ({"latent_key": "vae-2"}, 2, 0),  # another VAE file (the family's latent_cache_key)
    ({"text_key": "te-2"}, 0, 2),  # another encoder file, max length, precision (text_cache_key)
    (edit_image, 1, 0),
    (edit_caption, 0, 1),
]


@pytest.mark.parametrize("change, images, captions", CHANGES,
                         ids=[c.__name__ if callable(c) else ",".join(c) or "unchanged" for c, _, _ in CHANGES])
def test_each_change_re_encodes_exactly_what_it_changes(tmp_path, change, images, captions):
    make_image(tmp_path / "img" / "a.png", 64, 32)
    make_image(tmp_path / "img" / "b.png", 32, 32)
    write(tmp_path / "img" / "a.txt", "caption A")
    write(tmp_path / "img" / "b.txt", "caption b")
    assert encode(tmp_path, CountingEncoder()) == (2, 2)
    enc = CountingEncoder()
    if callable(change):
        change(tmp_path)
        change = {}
    assert encode(tmp_path, enc, **change) == (images, captions)
    flips = 2 if change.get("flip_aug") else 1
    assert (enc.images, len(enc.captions) > 0) == (images * flips, captions > 0)
    assert encode(tmp_path, CountingEncoder(), **change) == (0, 0)  # and the run after that hits the cache


def test_an_empty_second_prompt_the_encoder_sees_alone_keeps_the_captions_entries(tmp_path):
    """blank_prompt_preservation where the encoder does not see references: the run's one empty caption serves
    every item, so the entries stay those of a run without it (until 2026-11-29 its name and hash took the
    empty prompt: turning it on or off re-encoded every caption, 8 of 8 on the tiny Qwen-Image set, and
    removed the files); a class caption (diff_output_preservation) is its item's own entry."""
    make_image(tmp_path / "img" / "a.png", 64, 32)
    make_image(tmp_path / "img" / "b.png", 32, 32)
    write(tmp_path / "img" / "a.txt", "caption A")
    write(tmp_path / "img" / "b.txt", "caption b")
    assert encode(tmp_path, CountingEncoder()) == (2, 2)
    items = D.ImageDataset(dataset(tmp_path)).items
    for item in items:
        item.preservation_caption = ""
    assert caches.cache_text(items, CountingEncoder().text, "te-1") == 0
    assert all(caches.read_text_cache(item.text_cache, "preserve") == {} for item in items)
    items[0].preservation_caption = "caption shape"
    assert caches.cache_text(items, CountingEncoder().text, "te-1") == 1
    assert caches.read_text_cache(items[0].text_cache, "preserve")


def test_a_cache_folder_that_cannot_be_written_is_one_error_before_encoding(tmp_path, monkeypatch):
    make_image(tmp_path / "img" / "a.png", 32, 32)
    write(tmp_path / "img" / "a.txt", "caption A")
    (tmp_path / "file").write_text("not a folder")
    enc = CountingEncoder()
    with pytest.raises(ValueError, match=r"file/img-[0-9a-f]{8}: cache files cannot be written there \(.*\); set "
                                         r"cache_dir in the dataset config's \[\[datasets\]\]"):
        encode(tmp_path, enc, cache_dir=str(tmp_path / "file"))
    folder = str(tmp_path / "img")
    access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: path != folder and access(path, mode))  # a read-only folder
    with pytest.raises(ValueError, match=re.escape(f"{folder}: cache files cannot be written there (not writable)")):
        encode(tmp_path, enc)
    assert (enc.images, enc.captions) == (0, [])  # said before the VAE or the text encoder ran
    monkeypatch.undo()
    assert encode(tmp_path, enc) == (1, 1)
    monkeypatch.setattr(os, "access", lambda path, mode: path != folder and access(path, mode))
    assert encode(tmp_path, CountingEncoder()) == (0, 0)  # current caches in a read-only folder are read


def fill_caches(root, family, prompts=(), keep_cache=False, accelerator=None, **changes):
    """DiffusionTask._fill_caches on the images under root/img with a stand-in family; returns the
    task and the lines it printed. `accelerator`: a real one's processes (else one process)."""
    from types import SimpleNamespace

    import torch

    from library.training.diffusion_task import DiffusionTask

    args = SimpleNamespace(vae_batch_size=2, cache_latents_to_disk=True, text_encoder_precision="bf16",
                           text_encoder_batch_size=8, cache_text_encoder_outputs_to_disk=True, keep_cache=keep_cache)
    printed = []
    task = SimpleNamespace(dataset=D.ImageDataset(dataset(root, **changes)), validation_set=SimpleNamespace(items=[]),
                           family=family, device=torch.device("cpu"), args=args, prompts=list(prompts), _cache_locks={},
                           accelerator=SimpleNamespace(print=lambda *a, **k: printed.append(" ".join(map(str, a))),
                                                       is_main_process=True, process_index=0, num_processes=1,
                                                       main_process_first=contextlib.nullcontext))
    if accelerator is not None:
        task.accelerator.__dict__.update({k: getattr(accelerator, k) for k in ("is_main_process", "process_index",
                                                                                "num_processes", "main_process_first")})
    for method in ("_cache_latents", "_cache_prompt_texts", "_prompt_folder", "_remove_unused_caches"):
        setattr(task, method, getattr(DiffusionTask, method).__get__(task))
    DiffusionTask._fill_caches(task)
    return task, printed


def stand_in_family(loads: list, name="fresh", latent_key="fresh_0123456789", text_key="fresh_0123456789_abcdef01"):
    from types import SimpleNamespace

    import torch

    from library.data.prompts import NegativePrompt

    enc = CountingEncoder()
    return SimpleNamespace(
        name=name, latent_cache_key=lambda: latent_key, text_options=lambda args: {},
        text_cache_key=lambda options, precision: text_key, text_sees_controls=False, true_cfg=True,
        sample_negative=lambda negative: NegativePrompt(negative or " "),  # a model card's " " (DiffusionFamily's)
        load_vae=lambda dtype: loads.append("vae") or SimpleNamespace(vae=torch.nn.Identity(), encode=enc.latents),
        load_text_encoder=lambda precision, device: loads.append("text") or enc.text)


@pytest.mark.parametrize("dropout, prompts", [(0.0, 0), (0.5, 0), (0.0, 2), (0.5, 2)],
                         ids=["captions", "caption_dropout", "sample_prompts", "both"])
def test_a_re_run_with_current_caches_loads_no_encoder(tmp_path, dropout, prompts):
    """The old line loaded the VAE and every text encoder on every run, to encode nothing; and where
    caption dropout or sample prompts were set, it still loaded the text encoders for the empty
    caption and the prompts, which were never cached."""
    import torch

    from library.data.prompts import SamplePrompt

    make_image(tmp_path / "img" / "a.png", 32, 32)
    write(tmp_path / "img" / "a.txt", "caption A")
    loads = []
    family = stand_in_family(loads)
    sample_prompts = [SamplePrompt(f"prompt {i}", negative="blurry" if i else "") for i in range(prompts)]
    runs = []
    for expected in (["vae", "text"], []):
        loads.clear()
        task, _ = fill_caches(tmp_path, family, sample_prompts, caption_dropout_rate=dropout)
        assert loads == expected
        if expected:  # the first prompt's negative is the family's empty one (sample_negative), the second's its --n
            encoded = family.load_text_encoder("bf16", None).__self__.captions
            assert [c for c in encoded if c in (" ", "blurry")] == [" ", "blurry"][:prompts]
        runs.append((task.dataset.empty_text, task.prompt_texts))
    (empty, texts), (cached_empty, cached_texts) = runs
    assert (empty is None) == (dropout == 0) and (cached_empty is None) == (dropout == 0)
    if empty is not None:
        assert all(torch.equal(empty[k], cached_empty[k]) for k in empty) and empty["hidden"].dtype == torch.bfloat16
    assert len(texts) == len(cached_texts) == prompts
    for (text, negative), (cached, cached_negative) in zip(texts, cached_texts):
        assert all(torch.equal(text[k], cached[k]) and text[k].dtype == cached[k].dtype for k in text)
        assert all(torch.equal(negative[k], cached_negative[k]) for k in negative)  # true CFG: " " or "blurry"


def test_cache_files_no_entry_uses_are_removed_and_a_users_files_survive(tmp_path):
    """The old line never deleted a cache: each changed setting (here the resolution, a caption
    prefix, a sample prompt) or a removed image left its files beside the new ones for good."""
    from library.data.prompts import SamplePrompt
    from library.io import save_safetensors

    import torch

    for name in "abc":
        make_image(tmp_path / "img" / f"{name}.png", 32, 32)
        write(tmp_path / "img" / f"{name}.txt", f"caption {name}")
    img = tmp_path / "img"
    save_safetensors({"w": torch.ones(4)}, str(img / "my_lora.safetensors"))  # a user's file, no cache header
    save_safetensors({"w": torch.ones(4)}, str(img / "a_fresh_0123456789_00000000_te.safetensors"))  # named like ours
    (img / "b_fresh_0123456789_00000000_te.safetensors").write_text("not a safetensors file")
    (img / ".notes.txt.x1y2.tmp").write_text("a user's temporary")
    other, _ = fill_caches(tmp_path, stand_in_family([], "other", "other_0123456789", "other_0123456789_abcdef01"))
    users = sorted(os.listdir(img))
    family = stand_in_family([])
    _, printed = fill_caches(tmp_path, family, [SamplePrompt("a cat")], resolution=32)
    first = sorted(set(os.listdir(img)) - set(users))
    assert len(first) == 3 * 2 + 2 and not any("caches:" in line for line in printed)  # + the prompt and its negative
    left = [img / f".a_fresh_0123456789_abcdef01_0000000{k}_te.safetensors.ab_{k}cdef.tmp" for k in range(2)]
    for path, age in zip(left, (7200, 60)):  # a killed run's, and one being written now
        path.write_bytes(b"\0" * 100)
        os.utime(path, (path.stat().st_mtime - age,) * 2)
    os.remove(img / "c.png")
    _, printed = fill_caches(tmp_path, family, [SamplePrompt("a dog")], keep_cache=True, resolution=48,
                             caption_prefix="ohwx")
    assert set(first) < set(os.listdir(img)) and not any("caches:" in line for line in printed)  # keep_cache
    sizes = {f: (img / f).stat().st_size for f in os.listdir(img)}
    _, printed = fill_caches(tmp_path, family, [SamplePrompt("a dog")], resolution=48, caption_prefix="ohwx")
    now = sorted(set(os.listdir(img)) - set(users) - {left[1].name})
    assert len(set(first) & set(now)) == 1 and len(now) == 2 * 2 + 2  # a, b at 48 with the prefix, "a dog"; "" kept
    line = next(line for line in printed if line.startswith("caches:"))
    assert re.fullmatch(r"caches: 8 files no entry uses were removed \(\d+ KiB freed; keep_cache = true keeps them\)",
                        line), line
    assert line.split("(")[1].split(" KiB")[0] == f"{(sum(sizes[f] for f in set(first) - set(now)) + 100) / 1024:.0f}"
    assert not left[0].exists() and left[1].exists()  # the hour-old temporary went with them
    assert set(users) - {"c.png"} <= set(os.listdir(img))  # the user's files, the other family's caches are all there


def test_a_read_only_cache_folder_with_current_captions_encodes_new_prompts_in_memory(tmp_path, monkeypatch):
    """Valid caches on a read-only mount train; the empty caption and a new sample prompt, which
    cannot be kept there, are encoded and held in memory, and no cache is removed."""
    import errno
    import tempfile

    from library.data.prompts import SamplePrompt

    make_image(tmp_path / "img" / "a.png", 32, 32)
    write(tmp_path / "img" / "a.txt", "caption A")
    loads = []
    family = stand_in_family(loads)
    fill_caches(tmp_path, family, resolution=48)  # an old setting's files, unused below
    fill_caches(tmp_path, family, keep_cache=True)
    files = sorted(os.listdir(tmp_path / "img"))

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    monkeypatch.setattr(os, "remove", read_only)
    loads.clear()
    task, printed = fill_caches(tmp_path, family, [SamplePrompt("a cat")], caption_dropout_rate=0.5)
    assert loads == ["text"] and task.dataset.empty_text is not None and len(task.prompt_texts) == 1
    assert sorted(os.listdir(tmp_path / "img")) == files and not any("caches:" in line for line in printed)


def test_an_interrupted_caching_leaves_whole_files_and_a_truncated_one_is_re_encoded(tmp_path):
    for name in "abc":
        make_image(tmp_path / "img" / f"{name}.png", 32, 32)
        write(tmp_path / "img" / f"{name}.txt", f"caption {name}")
    enc, calls = CountingEncoder(), []

    def interrupted(images):
        calls.append(images.shape[0])
        if len(calls) == 2:
            raise KeyboardInterrupt  # Ctrl-C in the second batch (c), after a and b were written
        return enc.latents(images)

    with pytest.raises(KeyboardInterrupt):
        caches.cache_latents(D.ImageDataset(dataset(tmp_path)).items, interrupted, "vae-1", batch_size=2, load_workers=0)
    files = sorted(f for f in os.listdir(tmp_path / "img") if not f.endswith((".png", ".txt")))
    assert len(files) == 2 and all(f.endswith(".safetensors") for f in files)  # a and b whole, no temporary left
    path = tmp_path / "img" / files[0]
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])  # a copy cut short
    assert encode(tmp_path, CountingEncoder())[0] == 2  # the truncated one and c
    assert encode(tmp_path, CountingEncoder()) == (0, 0)


def test_one_caption_in_two_datasets_is_encoded_once(tmp_path):
    """Two datasets over one folder at two resolutions share each image's text file: the old line
    encoded it for each (4 captions through the encoder for 2 images, the file written twice)."""
    for name in "ab":
        make_image(tmp_path / "img" / f"{name}.png", 32, 32)
        write(tmp_path / "img" / f"{name}.txt", f"caption {name}")
    config = {"datasets": [{"resolution": resolution, "subsets": [{"image_dir": str(tmp_path / "img")}]}
                           for resolution in (32, 48)]}
    items = D.ImageDataset(parse_dataset_config(config, source="t.toml")).items
    enc = CountingEncoder()
    assert caches.cache_text(items, enc.text, "te-1") == 2 and enc.captions == ["caption a", "caption b"]
    assert caches.cache_latents(items, enc.latents, "vae-1") == 4  # each resolution its own latents
    assert len({item.text_cache for item in items}) == 2 and all(os.path.exists(item.text_cache) for item in items)
    assert [caches.read_text_cache(item.text_cache, None)["hidden"].shape for item in items] == [(9, 4)] * 4


def test_an_encoder_output_with_nan_is_refused_naming_the_text_and_nothing_is_cached(tmp_path):
    """A text encoder run in fp16 (an LLM encoder's activations past fp16's 65504: NaN where bf16 holds them) gave
    NaN embeddings that were cached without a word, met as a NaN loss or black samples later. Now one line naming
    the output, the text and the precision to use, before any file is written; sample prompts likewise."""
    make_image(tmp_path / "img" / "a.png", 32, 32)
    write(tmp_path / "img" / "a.txt", "a dog on a red chair")

    class Overflowing(CountingEncoder):
        def text(self, captions):
            outputs = super().text(captions)
            outputs[0]["hidden"][1, 2] = float("nan")
            return outputs

    items = D.ImageDataset(dataset(tmp_path)).items
    refusal = ("the text encoder's output 'hidden' for the text 'a dog on a red chair' holds 1 inf / NaN values of "
               "80: the encoder overflowed its precision (fp16 does where bf16 does not): set text_encoder_precision "
               "= 'bf16' (or 'fp32')")
    with pytest.raises(ValueError, match=re.escape(refusal)):
        caches.cache_text(items, Overflowing().text, "te-1")
    assert not [f for f in os.listdir(tmp_path / "img") if f.endswith(".safetensors")]
    with pytest.raises(ValueError, match=re.escape(refusal)):
        caches.cache_prompts([("a dog on a red chair", (), None)], Overflowing().text, "te-1", str(tmp_path / "p"))


def test_a_negative_prompt_is_cached_apart_from_the_same_caption(tmp_path):
    """A family may encode a sample's negative otherwise than a caption (a system prompt before the positive prompt
    only): the negative reaches the encoder marked (NegativePrompt) and is kept in its own file, so the empty
    negative never reads the empty caption's cache, nor the other way round; each is encoded once."""
    from library.data.prompts import NegativePrompt

    seen = []

    def encode(captions):  # one token: 1.0 for a negative, 0.0 for a caption
        seen.extend(isinstance(c, NegativePrompt) for c in captions)
        return [{"hidden": torch.full((1, 4), float(isinstance(c, NegativePrompt)))} for c in captions]

    folder = str(tmp_path / "p")
    jobs = [("", (), None), (NegativePrompt(""), (), None)]
    for _ in range(2):
        (caption, negative), files = caches.cache_prompts(jobs, encode, "te-1", folder)
        assert files[0] != files[1] and (negative["hidden"] - caption["hidden"]).abs().max() == 1.0
    assert seen == [False, True]  # the second round read both back
