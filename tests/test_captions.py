"""Caption dropout and tag augmentation with cached text (library/data/captions.py): dropout
substitutes the cached empty-caption text at the configured rate, augmented captions come from K
cached variants, every draw is deterministic per (seed, epoch, entry), and every key is checked
when the dataset TOML loads. Ends with tiny FLUX and Qwen-Image runs of train_lora.py."""

import os
import random
import shutil

import pytest
import torch
from safetensors import safe_open

import train_lora
from library.data import caches, dataset as D
from library.data.captions import augment_tags
from library.data.dataset_config import SubsetSpec, load_dataset_config, parse_dataset_config
from tests.test_dataset import make_image, write


class TextIdEncoder:
    """Encodes a text to its number in the order first seen, so a cached tensor says which text it is."""

    def __init__(self):
        self.texts, self.calls = [], []

    def __call__(self, captions):
        self.calls += captions
        out = []
        for c in captions:
            if c not in self.texts:
                self.texts.append(c)
            out.append({"hidden": torch.full((3, 2), float(self.texts.index(c))), "mask": torch.ones(3, dtype=torch.bool)})
        return out

    def decode(self, text: dict) -> str:
        return self.texts[int(text["hidden"][0, 0])]


def dataset(tmp_path, caption="sks, dog, red, grass, sunny, park", images=1, seed=0, **subset):
    for i in range(images):
        make_image(tmp_path / "img" / f"{i}.png", 32, 32)
        write(tmp_path / "img" / f"{i}.txt", caption)
    bp = parse_dataset_config({"datasets": [{"resolution": 32, "subsets": [{"image_dir": str(tmp_path / "img"), **subset}]}]},
                              source="test.toml")
    return D.ImageDataset(bp, seed=seed)


def spec(**kw):
    base = dict(image_dir="x", num_repeats=1, caption_extension=".txt", class_tokens=None, shuffle_caption=False,
                keep_tokens=0, caption_dropout_rate=0.0, flip_aug=False)
    return SubsetSpec(**{**base, **kw})


def test_shuffled_captions_come_from_k_cached_variants_and_the_text_matches_the_caption(tmp_path):
    ds = dataset(tmp_path, shuffle_caption=True, keep_tokens=2, caption_variants=4, num_repeats=60)
    enc = TextIdEncoder()
    assert caches.cache_text(ds.items, enc, "flux", to_disk=True) == 1
    (item,) = ds.items
    assert enc.calls == [item.caption, *item.caption_variants] and len(item.caption_variants) == 4
    assert all(v.startswith("sks, dog, ") and sorted(v.split(", ")) == sorted(item.caption.split(", "))
               for v in item.caption_variants)
    samples = [ds[(e, epoch)] for epoch in range(2) for e in range(60)]
    assert all(enc.decode(s["text"]) == s["caption"] for s in samples)  # each caption with its own text
    assert {s["caption"] for s in samples} == set(item.caption_variants)  # every variant is drawn
    again = dataset(tmp_path, shuffle_caption=True, keep_tokens=2, caption_variants=4, num_repeats=60)
    assert caches.cache_text(again.items, enc, "flux", to_disk=True) == 0  # the variants' cache is reused ...
    assert [again[(e, 1)]["caption"] for e in range(60)] == [s["caption"] for s in samples[60:]]  # ... same draws
    more = dataset(tmp_path, shuffle_caption=True, keep_tokens=2, caption_variants=5)
    assert caches.cache_text(more.items, enc, "flux", to_disk=True) == 1  # another K is another cache


def test_variants_do_not_depend_on_the_training_seed_and_validation_uses_the_caption(tmp_path):
    a = dataset(tmp_path, shuffle_caption=True, seed=1).items[0].caption_variants
    b = dataset(tmp_path, shuffle_caption=True, seed=2).items[0].caption_variants
    assert a == b and len(set(a)) == 8
    ds = dataset(tmp_path, shuffle_caption=True, caption_dropout_rate=1.0)
    val = D.ImageDataset(ds.blueprint, items=ds.items, validation=True)
    enc = TextIdEncoder()
    caches.cache_text(ds.items, enc, "flux", to_disk=False)
    assert val[0]["caption"] == ds.items[0].caption and enc.decode(val[0]["text"]) == ds.items[0].caption


def test_caption_dropout_substitutes_the_cached_empty_text_at_the_rate(tmp_path):
    ds = dataset(tmp_path, caption="a cat", caption_dropout_rate=0.3, num_repeats=500)
    enc = TextIdEncoder()
    caches.cache_text(ds.items, enc, "flux", to_disk=False)
    with pytest.raises(ValueError, match="cache_empty_caption"):
        [ds[e] for e in range(500)]
    caches.cache_empty_caption(ds, enc, "te")
    assert enc.calls == ["a cat", ""] and ds.empty_text["hidden"].dtype == caches.CACHE_DTYPE
    samples = [ds[(e, 0)] for e in range(500)]
    dropped = [s["caption"] == "" for s in samples]
    assert 0.25 < sum(dropped) / 500 < 0.35
    assert all(enc.decode(s["text"]) == s["caption"] for s in samples)
    assert dropped == [ds[(e, 0)]["caption"] == "" for e in range(500)]  # per (seed, epoch, entry)
    assert dropped != [ds[(e, 1)]["caption"] == "" for e in range(500)]


@pytest.mark.parametrize("to_disk", [False, True])
def test_a_dropped_caption_becomes_the_subsets_caption_dropout_text(tmp_path, to_disk):
    """caption_dropout_text (ai-toolkit's dropped caption is its trigger word): encoded into each entry as its
    "@dropped" text, the entry's file its own (another text: another file), the run's empty caption unread."""
    ds = dataset(tmp_path, caption="sks, a cat", caption_dropout_rate=0.5, caption_dropout_text="sks", num_repeats=40)
    enc = TextIdEncoder()
    assert caches.cache_text(ds.items, enc, "flux", to_disk=to_disk) == 1 and enc.calls == ["sks, a cat", "sks"]
    samples = [ds[(e, 0)] for e in range(40)]  # no cache_empty_caption: the dropped text is the entry's own
    assert {s["caption"] for s in samples} == {"sks, a cat", "sks"}
    assert all(enc.decode(s["text"]) == s["caption"] for s in samples)
    if to_disk:
        other = dataset(tmp_path, caption="sks, a cat", caption_dropout_rate=0.5, caption_dropout_text="zxq")
        assert caches.cache_text(other.items, enc, "flux", to_disk=True) == 1  # another text: its own entry
        assert other.items[0].text_cache != ds.items[0].text_cache
        plain = dataset(tmp_path, caption="sks, a cat", caption_dropout_rate=0.5)
        assert caches.cache_text(plain.items, enc, "flux", to_disk=True) == 1 and enc.calls[-1] == "sks, a cat"
    with pytest.raises(ValueError, match="'caption_dropout_text' is what a dropped caption becomes"):
        dataset(tmp_path, caption_dropout_text="sks")


def test_caption_dropout_every_n_epochs_drops_whole_epochs_counted_from_one(tmp_path):
    ds = dataset(tmp_path, caption="a cat", caption_dropout_every_n_epochs=3, num_repeats=5)
    caches.cache_text(ds.items, TextIdEncoder(), "flux", to_disk=False)
    caches.cache_empty_caption(ds, TextIdEncoder(), "te")
    per_epoch = [{ds[(e, epoch)]["caption"] for e in range(5)} for epoch in range(7)]
    assert per_epoch == [{"a cat"}, {"a cat"}, {""}, {"a cat"}, {"a cat"}, {""}, {"a cat"}]  # sd-scripts' epochs 3, 6


def test_tag_dropout_and_keep_tokens_separator_as_sd_scripts(tmp_path):
    s = spec(caption_tag_dropout_rate=0.5, keep_tokens_separator="|||")
    caption = "sks man ||| red, hat, beach, smiling, sand ||| photo, 35mm"
    outs = [augment_tags(caption, s, random.Random(i)) for i in range(400)]
    assert all(o.startswith("sks man, ") and o.endswith(", photo, 35mm") for o in outs)
    kept = [len(o.split(", ")) - 3 for o in outs]
    assert 2.2 < sum(kept) / len(kept) < 2.8  # 5 flexible tags, each kept with probability 0.5
    assert all(o.split(", ")[1:-2] == [t for t in ["red", "hat", "beach", "smiling", "sand"] if t in o.split(", ")]
               for o in outs)  # dropping without shuffle keeps the order
    fixed = dataset(tmp_path, caption=caption, keep_tokens_separator="|||")[0]["caption"]  # what training sees
    assert fixed == "sks man, red, hat, beach, smiling, sand, photo, 35mm"  # the separator is not trained on


@pytest.mark.parametrize("line, message", [
    ("shuffle_caption = true\ncaption_variants = 1", "key 'caption_variants' must be >= 2 with shuffle_caption"),
    ("caption_tag_dropout_rate = 1.5", "key 'caption_tag_dropout_rate' must be in [0, 1], got 1.5"),
    ("caption_dropout_every_n_epochs = -1", "key 'caption_dropout_every_n_epochs' must be >= 0, got -1"),
    ("caption_variants = 0", "key 'caption_variants' must be >= 1, got 0"),
    ('caption_separator = ""', "key 'caption_separator' must not be empty"),
    ("keep_tokens_separator = 3", "key 'keep_tokens_separator' must be a string, got 3"),
])
def test_caption_keys_are_checked_when_the_dataset_loads(tmp_path, line, message):
    path = write(tmp_path / "ds.toml", f'[[datasets]]\nresolution = 64\n[[datasets.subsets]]\nimage_dir = "a"\n{line}\n')
    with pytest.raises(ValueError) as e:
        load_dataset_config(path)
    assert str(e.value).startswith(f"{path}: [datasets.subsets]") and message in str(e.value)


def qwen_args(tiny_set, out, *extra):
    return ["--model_type", "qwen_image", "--pretrained_model_name_or_path", tiny_set["qwen_image"],
            "--ae", tiny_set["qwen_image_vae"], "--text_encoder", tiny_set["qwen_image_text_encoder"],
            "--output_dir", str(out), "--mixed_precision", "no", "--network_dim", "4",
            "--optimizer_type", "AdamW", "--learning_rate", "1e-3", *extra]


@pytest.mark.parametrize("family", ["flux", "qwen"])
def test_training_with_caption_dropout_and_shuffle_runs_on_both_families(tiny_set, tmp_path, family):
    from tests.test_train_lora import flux_args

    source = load_dataset_config(tiny_set["dataset_config"]).datasets[0].subsets[0].image_dir
    image_dir = shutil.copytree(source, tmp_path / "img", ignore=shutil.ignore_patterns("*.safetensors"))  # caches go beside
    ds = tmp_path / "ds.toml"
    ds.write_text(f'[[datasets]]\nresolution = 64\n[[datasets.subsets]]\nimage_dir = "{image_dir}"\n'
                  f'shuffle_caption = true\ncaption_variants = 3\ncaption_dropout_rate = 0.5\n'
                  f'caption_dropout_text = "sks"\n')
    out = tmp_path / "run"
    make_args = flux_args if family == "flux" else qwen_args
    code = train_lora.main(make_args(tiny_set, out, "--dataset_config", str(ds), "--max_train_steps", "3",
                                     "--cache_text_encoder_outputs_to_disk", "true"))
    assert code == 0
    cached = [f for f in os.listdir(image_dir) if f.endswith("_te.safetensors") and not f.startswith("prompt-")]
    prompts = [f for f in os.listdir(image_dir) if f.startswith("prompt-")]  # the empty caption and sample prompts
    assert len(prompts) >= 1
    assert len(cached) == len([f for f in os.listdir(source) if f.endswith(".png")])
    with safe_open(os.path.join(image_dir, cached[0]), "pt") as f:
        names = set(f.keys())
    # 3 variants beside the caption, and the dropped caption's text (caption_dropout_text)
    assert {n.split("@")[-1] for n in names if "@" in n} == {"0", "1", "2", "dropped"}
    assert any("@" not in n for n in names)


def test_caption_prefix_and_suffix_join_every_caption_before_shuffling_as_sd_scripts(tmp_path):
    """sd-scripts' caption_prefix / caption_suffix (were refused: unknown key): joined with a space, to the
    caption file's text and to class_tokens; keep_tokens counts the prefix's tags."""
    ds = dataset(tmp_path, caption="dog, red, grass", caption_prefix="ohwx, photo,", caption_suffix=", sunny",
                 shuffle_caption=True, keep_tokens=2, caption_variants=4)
    (item,) = ds.items
    assert item.caption == "ohwx, photo, dog, red, grass , sunny"
    assert all(v.startswith("ohwx, photo, ") and sorted(v.split(", ")) == ["dog", "grass", "ohwx", "photo", "red", "sunny"]
               for v in item.caption_variants)
    make_image(tmp_path / "bare" / "0.png", 32, 32)
    bp = parse_dataset_config({"datasets": [{"resolution": 32, "subsets": [
        {"image_dir": str(tmp_path / "bare"), "class_tokens": "sks dog", "caption_suffix": "in a park"}]}]})
    assert [item.caption for item in D.ImageDataset(bp).items] == ["sks dog in a park"]
