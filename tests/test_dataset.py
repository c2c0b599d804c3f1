import os
import re
import warnings

import pytest
import torch
from PIL import Image

from library.data import caches, dataset as D, image_folders, text_corpus
from library.data.dataset_config import load_dataset_config, parse_dataset_config
from library.data.images import load_image

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_image(path, w, h, color=(200, 30, 30)):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    Image.new("RGB", (w, h), color).save(path)
    return str(path)


def write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    return str(path)


def blueprint(image_dir, **dataset):
    dataset = {"resolution": 64, **dataset}
    subset = {"image_dir": str(image_dir)}
    for key in ("class_tokens", "shuffle_caption", "keep_tokens", "caption_dropout_rate", "flip_aug", "num_repeats"):
        if key in dataset:
            subset[key] = dataset.pop(key)
    return parse_dataset_config({"datasets": [{**dataset, "subsets": [subset]}]}, source="test.toml")


def over_one_folder(image_dir, *subsets, **dataset):
    """One dataset whose subsets all read image_dir; each dict holds a subset's other keys."""
    subsets = [{"image_dir": str(image_dir), **s} for s in subsets]
    return parse_dataset_config({"datasets": [{"resolution": 32, **dataset, "subsets": subsets}]}, source="test.toml")


# ----------------------------------------------------------------------------------------------
# Config validation


def config_error(tmp_path, text):
    path = write(tmp_path / "ds.toml", text)
    with pytest.raises(ValueError) as e:
        load_dataset_config(path)
    return str(e.value)


def test_an_image_extension_as_caption_extension_is_refused_as_the_config_loads(tmp_path):
    """It was accepted and each image then failed as its own caption file: "caption file is not valid UTF-8"."""
    msg = config_error(tmp_path, '[[datasets]]\nresolution = 512\n[[datasets.subsets]]\nimage_dir = "a"\n'
                                 'caption_extension = ".PNG"\n')
    assert msg.endswith("key 'caption_extension' is '.PNG', an image extension: captions are text files (.txt, .caption)")


def test_unknown_subset_key_is_an_error_naming_file_section_and_allowed_keys(tmp_path):
    msg = config_error(tmp_path, '[[datasets]]\nresolution = 512\n[[datasets.subsets]]\nimage_dir = "a"\nfoo = 1\n')
    assert msg.startswith(f"{tmp_path / 'ds.toml'}: [datasets.subsets] unknown key 'foo' (allowed: image_dir, num_repeats")


@pytest.mark.parametrize("line", ["random_crop = true", "color_aug = true", "face_crop_aug_range = [2.0, 4.0]"])
def test_sd_scripts_pixel_augmentations_say_why_they_cannot_apply_to_cached_latents(tmp_path, line):
    """They were 'unknown key' with the allowed list: an sd-scripts user was not told why."""
    msg = config_error(tmp_path, f'[[datasets]]\nresolution = 512\n[[datasets.subsets]]\nimage_dir = "a"\n{line}\n')
    key = line.split(" =")[0]
    assert msg == (f"{tmp_path / 'ds.toml'}: [datasets.subsets] '{key}' is not supported: latents are always cached "
                   f"before training, so a per-epoch pixel augmentation cannot apply (sd-scripts refuses it with "
                   f"cache_latents too); remove it (flip_aug works: both sides are cached)")


def test_sd_scripts_pixel_augmentations_set_false_are_accepted_as_asking_for_nothing(tmp_path):
    """Until 2026-12-02 `random_crop = false` was refused as a pixel augmentation (sd-scripts refuses only true)."""
    path = write(tmp_path / "ds.toml", '[general]\ncolor_aug = false\n[[datasets]]\nresolution = 64\nrandom_crop = false\n'
                                       '[[datasets.subsets]]\nimage_dir = "a"\nrandom_crop = false\ncolor_aug = false\n')
    assert load_dataset_config(path).datasets[0].subsets[0].image_dir == "a"
    msg = config_error(tmp_path, '[[datasets]]\nresolution = 512\n[[datasets.subsets]]\nimage_dir = "a"\nrandom_crop = "false"\n')
    assert "'random_crop' is not supported: latents are always cached" in msg  # only a boolean false asks for nothing


def test_unknown_general_key_is_an_error(tmp_path):
    msg = config_error(tmp_path, '[general]\nshuffle_captions = true\n[[datasets]]\nresolution = 512\n'
                                 '[[datasets.subsets]]\nimage_dir = "a"\n')
    assert "[general] unknown key 'shuffle_captions'" in msg


def test_wrong_type_names_key_and_value(tmp_path):
    msg = config_error(tmp_path, '[[datasets]]\nresolution = 512\nbatch_size = "two"\n[[datasets.subsets]]\nimage_dir = "a"\n')
    assert msg == f"{tmp_path / 'ds.toml'}: [datasets] key 'batch_size' must be an integer, got 'two'"


def test_booleans_must_be_toml_booleans(tmp_path):
    msg = config_error(tmp_path, '[[datasets]]\nresolution = 512\n[[datasets.subsets]]\nimage_dir = "a"\nflip_aug = "True"\n')
    assert "key 'flip_aug' must be a boolean (true or false), got 'True'" in msg
    msg = config_error(tmp_path, '[[datasets]]\nresolution = 512\nbatch_size = true\n[[datasets.subsets]]\nimage_dir = "a"\n')
    assert "key 'batch_size' must be an integer, got True" in msg


def test_bucket_steps_must_be_a_multiple_of_16(tmp_path):
    msg = config_error(tmp_path, '[[datasets]]\nresolution = 512\nenable_bucket = true\nbucket_reso_steps = 40\n'
                                 '[[datasets.subsets]]\nimage_dir = "a"\n')
    assert "'bucket_reso_steps' must be a positive multiple of 16" in msg and "got 40" in msg
    ok = parse_dataset_config({"datasets": [{"resolution": 512, "bucket_reso_steps": 48, "subsets": [{"image_dir": "a"}]}]})
    assert ok.datasets[0].bucket_reso_steps == 48


def test_resolution_smaller_than_one_token_is_an_error(tmp_path):
    msg = config_error(tmp_path, '[[datasets]]\nresolution = [8, 512]\n[[datasets.subsets]]\nimage_dir = "a"\n')
    assert "'resolution' must be at least 16 pixels per side" in msg and "[8, 512]" in msg


def test_missing_image_dir_and_inverted_bucket_limits_are_errors(tmp_path):
    msg = config_error(tmp_path, '[[datasets]]\nresolution = 512\n[[datasets.subsets]]\nnum_repeats = 2\n')
    assert "[datasets.subsets] key 'image_dir' is required" in msg
    msg = config_error(tmp_path, '[[datasets]]\nresolution = 512\nmin_bucket_reso = 1024\nmax_bucket_reso = 512\n'
                                 '[[datasets.subsets]]\nimage_dir = "a"\n')
    assert "min_bucket_reso 1024 is larger than max_bucket_reso 512" in msg


def test_subset_keys_fall_back_to_dataset_then_general_then_defaults(tmp_path):
    path = write(tmp_path / "ds.toml", """
[general]
resolution = [768, 512]
num_repeats = 3
flip_aug = true
keep_tokens = 1
[[datasets]]
batch_size = 4
num_repeats = 5
  [[datasets.subsets]]
  image_dir = "a"
  num_repeats = 7
  [[datasets.subsets]]
  image_dir = "b"
[[datasets]]
resolution = 256
  [[datasets.subsets]]
  image_dir = "c"
""")
    bp = load_dataset_config(path)
    first, second = bp.datasets
    assert first.resolution == (768, 512) and first.batch_size == 4 and second.resolution == (256, 256)
    assert [s.num_repeats for s in first.subsets + second.subsets] == [7, 5, 3]  # subset, dataset, general
    assert all(s.flip_aug and s.keep_tokens == 1 for s in first.subsets + second.subsets)  # general
    s = second.subsets[0]
    assert (s.caption_extension, s.shuffle_caption, s.caption_dropout_rate, s.class_tokens) == (".txt", False, 0.0, None)
    assert (second.batch_size, second.enable_bucket, second.bucket_reso_steps) == (1, False, 64)


def test_example_config_parses():
    bp = load_dataset_config(os.path.join(ROOT, "configs", "dataset_example.toml"))
    ds = bp.datasets[0]
    assert ds.resolution == (1024, 1024) and ds.enable_bucket and ds.max_bucket_reso == 2048
    assert [s.num_repeats for s in ds.subsets] == [10, 1] and ds.subsets[1].flip_aug


# ----------------------------------------------------------------------------------------------
# Buckets and pixels


def test_buckets_are_step_multiples_within_limits_and_area():
    buckets = image_folders.make_buckets((512, 512), 256, 1024, 64)
    assert all(w % 64 == 0 and h % 64 == 0 and 256 <= min(w, h) and max(w, h) <= 1024 for w, h in buckets)
    assert all(w * h <= 512 * 512 for w, h in buckets)
    assert {(512, 512), (576, 448), (448, 576), (1024, 256), (256, 1024), (704, 320)} <= set(buckets)
    assert len(buckets) == 17  # 13 widths 256..1024, mirrored, the square counted once


def test_buckets_stay_on_the_step_grid_with_a_max_off_it():
    """The old line clamped sides to max_bucket_reso itself: 100 made 32x100 buckets (a 96 px latent,
    4 pixels silently cropped)."""
    buckets = image_folders.make_buckets((96, 96), 32, 100, 16)
    assert all(w % 16 == 0 and h % 16 == 0 and max(w, h) <= 96 for w, h in buckets) and (32, 96) in buckets


def test_bucket_limits_off_the_step_grid_widen_to_it_as_sd_scripts_with_one_warning(tmp_path):
    """max_bucket_reso 2000 at steps 64 made buckets up to 1984 without a word, where sd-scripts widens the range to
    2048 (and min 300 to 256) and says so: 734 of 3009 random sizes took another bucket (3195x488: 1984x320, not
    2048x320)."""
    with pytest.warns(UserWarning, match=r"test.toml: \[datasets\] min_bucket_reso / max_bucket_reso = 300 / 2000 are "
                                         r"not multiples of bucket_reso_steps 64: buckets span 256 / 2048"):
        (ds,) = blueprint(tmp_path, resolution=1024, enable_bucket=True, min_bucket_reso=300, max_bucket_reso=2000,
                          bucket_reso_steps=64).datasets
    assert (ds.min_bucket_reso, ds.max_bucket_reso) == (256, 2048)
    buckets = image_folders.dataset_buckets(ds)
    assert image_folders.image_bucket("p", (3195, 488), ds, buckets) == (2048, 320)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # on the grid, without buckets, or a min under one step: nothing to say
        blueprint(tmp_path, resolution=1024, enable_bucket=True, min_bucket_reso=256, max_bucket_reso=2048)
        blueprint(tmp_path, resolution=1024, min_bucket_reso=300, max_bucket_reso=2000)
        (under,) = blueprint(tmp_path, resolution=64, enable_bucket=True, min_bucket_reso=32).datasets
    assert under.min_bucket_reso == 32  # sd-scripts' floor would be 0: the buckets begin at one step, 64


def test_bucket_limits_that_leave_no_bucket_are_one_line_naming_the_file(tmp_path):
    """The old line got as far as 'min() arg is an empty sequence' when the first image was sized."""
    msg = config_error(tmp_path, '[[datasets]]\nresolution = 64\nenable_bucket = true\nmin_bucket_reso = 32\n'
                                 'max_bucket_reso = 256\nbucket_reso_steps = 128\n[[datasets.subsets]]\nimage_dir = "a"\n')
    assert "no bucket fits: no multiple of bucket_reso_steps 128 within [min_bucket_reso, max_bucket_reso] = [32, 256]" in msg


def test_image_goes_to_the_bucket_with_the_closest_aspect_ratio(tmp_path):
    make_image(tmp_path / "img" / "wide.png", 800, 400)  # 2:1 -> 704x320 (2.2) beats 640x384 (1.67)
    make_image(tmp_path / "img" / "tall.png", 300, 600)
    make_image(tmp_path / "img" / "square.png", 90, 100)
    for name in ("wide", "tall", "square"):
        write(tmp_path / "img" / f"{name}.txt", name)
    ds = D.ImageDataset(blueprint(tmp_path / "img", resolution=512, enable_bucket=True))
    buckets = {os.path.basename(i.image_path): i.bucket for i in ds.items}
    assert buckets == {"wide.png": (704, 320), "tall.png": (320, 704), "square.png": (512, 512)}
    sample = ds[[os.path.basename(i.image_path) for i in ds.items].index("tall.png")]
    assert sample["image"].shape == (3, 704, 320) and sample["image"].dtype == torch.float32


def test_bucket_no_upscale_keeps_small_images_small(tmp_path):
    make_image(tmp_path / "img" / "small.png", 100, 60)
    make_image(tmp_path / "img" / "big.png", 2000, 1000)
    ds = D.ImageDataset(blueprint(tmp_path / "img", resolution=512, enable_bucket=True, bucket_no_upscale=True,
                                  bucket_reso_steps=16, class_tokens="x"))
    buckets = {os.path.basename(i.image_path): i.bucket for i in ds.items}
    # big: area budget 512^2 -> 724x362; the height rounded to 16 (352) keeps 2:1 (704x352), the width (720) not
    assert buckets == {"small.png": (96, 48), "big.png": (704, 352)}


@pytest.mark.parametrize("size, resolution, step, sd_scripts", [
    ((3558, 1677), 1024, 64, (1344, 640)), ((1644, 1082), 1024, 32, (1216, 800)), ((984, 2598), 1024, 64, (576, 1472)),
    ((3021, 1018), 768, 16, (1280, 432)), ((3260, 2817), 1024, 64, (1024, 896)), ((2161, 3411), 512, 64, (384, 576)),
    ((1920, 1080), 1024, 64, (1344, 768)), ((5000, 500), 1024, 64, (3200, 320)),
])
def test_bucket_no_upscale_shrinks_a_large_image_to_sd_scripts_bucket(size, resolution, step, sd_scripts):
    """Each side rounded down on its own put 1187 of 3009 random sizes in another bucket than sd-scripts'
    BucketManager.select_bucket at 1024 (3558x1677: 1472x640, its height cropped to 92%, where sd-scripts keeps
    99% in 1344x640). The figures: sd-scripts' own select_bucket on these sizes (no_upscale, 2026-11-30)."""
    assert image_folders.bucket_without_upscale(size, resolution * resolution, step) == sd_scripts


def test_bucket_no_upscale_neither_warns_about_nor_skips_a_long_image(tmp_path):
    """Its bucket keeps the image's shape (cropped only by the rounding to bucket_reso_steps): a 5:1 image is
    no 'bad size', though beyond max_bucket_reso / min_bucket_reso = 4."""
    make_image(tmp_path / "img" / "long.png", 1000, 200)
    make_image(tmp_path / "img" / "square.png", 300, 300)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # was "1000x200 has aspect ratio 5.0, beyond ... (it is cropped)"
        ds = D.ImageDataset(blueprint(tmp_path / "img", resolution=512, enable_bucket=True, bucket_no_upscale=True,
                                      bucket_reso_steps=16, class_tokens="x", skip_bad_size_images=True))
    assert {os.path.basename(i.image_path): i.bucket for i in ds.items} == {"long.png": (992, 192), "square.png": (288, 288)}


def test_bucket_no_upscale_skips_an_image_below_the_bucket_step_with_skip_bad_size_images(tmp_path):
    make_image(tmp_path / "img" / "icon.png", 100, 40)
    make_image(tmp_path / "img" / "square.png", 300, 300)
    keys = dict(resolution=512, enable_bucket=True, bucket_no_upscale=True, bucket_reso_steps=64, class_tokens="x")
    with pytest.warns(UserWarning, match=r"icon.png: 100x40 has a side below bucket_reso_steps 64 .*; skipped"):
        ds = D.ImageDataset(blueprint(tmp_path / "img", skip_bad_size_images=True, **keys))
    assert [os.path.basename(i.image_path) for i in ds.items] == ["square.png"]  # was an error, skip or not
    os.remove(tmp_path / "img" / "square.png")
    with pytest.warns(UserWarning), pytest.raises(ValueError) as e:
        D.ImageDataset(blueprint(tmp_path / "img", skip_bad_size_images=True, **keys))
    assert str(e.value) == (f"{tmp_path / 'img'}: every image was skipped (skip_bad_size_images): none is large enough "
                            f"for a bucket_reso_steps 64 bucket without upscaling")
    make_image(tmp_path / "img" / "square.png", 300, 300)
    with pytest.warns(UserWarning), pytest.raises(ValueError, match="icon.png: image is 100x40, smaller than bucket"):
        D.ImageDataset(blueprint(tmp_path / "img", **keys))


def test_resize_center_crop_flip_and_value_range(tmp_path):
    img = Image.new("RGB", (64, 32), (0, 0, 0))
    img.paste((255, 255, 255), (32, 0, 64, 32))  # right half white
    path = str(tmp_path / "halves.png")
    img.save(path)
    x = load_image(path, (32, 32))  # no resize: crop columns 16..47
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32
    assert float(x[:, :, :16].max()) == -1.0 and float(x[:, :, 16:].min()) == 1.0
    torch.testing.assert_close(load_image(path, (32, 32), flip=True), x.flip(-1), rtol=0, atol=0)
    y = load_image(path, (16, 16))  # shrink 2x then crop 4..11: still half black / half white
    assert float(y[:, :, :3].max()) == -1.0 and float(y[:, :, -3:].min()) == 1.0


# ----------------------------------------------------------------------------------------------
# Captions and errors


def test_missing_caption_uses_class_tokens_and_is_an_error_without(tmp_path):
    make_image(tmp_path / "img" / "a.png", 32, 32)
    ds = D.ImageDataset(blueprint(tmp_path / "img", class_tokens="sks dog"))
    assert ds.items[0].caption == "sks dog"
    with pytest.raises(ValueError) as e:
        D.ImageDataset(blueprint(tmp_path / "img"))
    assert str(e.value) == f"{tmp_path / 'img' / 'a.png'}: no caption file 'a.txt' and no class_tokens for its subset"


def test_missing_caption_beside_a_caption_file_of_the_other_common_extension_names_it(tmp_path):
    """sd-scripts' default caption_extension is .caption, ours .txt: its dataset without class_tokens stopped on
    'no caption file a.txt' with no word of the a.caption beside it (with class_tokens that was a warning already)."""
    make_image(tmp_path / "img" / "a.png", 32, 32)
    write(tmp_path / "img" / "a.caption", "a red square")
    with pytest.raises(ValueError) as e:
        D.ImageDataset(blueprint(tmp_path / "img"))
    assert str(e.value) == (f"{tmp_path / 'img' / 'a.png'}: no caption file 'a.txt' and no class_tokens for its subset; "
                            f'a .caption one is beside it: set caption_extension = ".caption" in its subset')
    assert D.ImageDataset(blueprint(tmp_path / "img", caption_extension=".caption")).items[0].caption == "a red square"


def test_caption_file_wins_over_class_tokens_and_empty_file_is_an_error(tmp_path):
    make_image(tmp_path / "img" / "a.png", 32, 32)
    write(tmp_path / "img" / "a.txt", "  a red square\n")
    assert D.ImageDataset(blueprint(tmp_path / "img", class_tokens="sks")).items[0].caption == "a red square"
    write(tmp_path / "img" / "a.txt", " \n")
    with pytest.raises(ValueError, match=r"a\.txt: caption file is empty"):
        D.ImageDataset(blueprint(tmp_path / "img", class_tokens="sks"))


def test_corrupt_image_is_an_error_naming_the_file(tmp_path):
    make_image(tmp_path / "img" / "good.png", 32, 32)
    with open(tmp_path / "img" / "bad.jpg", "wb") as f:
        f.write(b"\xff\xd8\xff\xe0 definitely not a jpeg")
    with pytest.raises(ValueError, match=r"bad\.jpg: cannot be read as an image"):
        D.ImageDataset(blueprint(tmp_path / "img", class_tokens="x"))


def captions_drawn(tmp_path, caption: str, draws: int, **subset) -> list[str]:
    """The captions the training dataset gives the `draws` repeats of one image in epoch 0."""
    make_image(tmp_path / "img" / "a.png", 32, 32)
    write(tmp_path / "img" / "a.txt", caption)
    ds = D.ImageDataset(blueprint(tmp_path / "img", num_repeats=draws, **subset))
    return [ds[e]["caption"] for e in range(draws)]


def test_shuffle_keeps_the_first_keep_tokens_tags_and_is_deterministic(tmp_path):
    caption = "sks, dog, red, grass, sunny, park"
    outs = captions_drawn(tmp_path, caption, 30, shuffle_caption=True, keep_tokens=2)
    assert all(o.startswith("sks, dog, ") for o in outs)
    assert all(sorted(o.split(", ")) == sorted(caption.split(", ")) for o in outs)
    assert len(set(outs)) > 5  # it really shuffles
    assert outs == captions_drawn(tmp_path, caption, 30, shuffle_caption=True, keep_tokens=2)
    assert captions_drawn(tmp_path, caption, 1) == [caption]


def test_caption_dropout_rate_drops_that_fraction_deterministically(tmp_path):
    outs = captions_drawn(tmp_path, "a cat", 1000, caption_dropout_rate=0.3)
    assert 0.25 < outs.count("") / 1000 < 0.35 and set(outs) == {"", "a cat"}
    assert outs == captions_drawn(tmp_path, "a cat", 1000, caption_dropout_rate=0.3)
    assert captions_drawn(tmp_path, "a cat", 1, caption_dropout_rate=1.0) == [""]


def test_dataset_augmentation_depends_on_seed_epoch_and_entry_only(tmp_path):
    make_image(tmp_path / "img" / "a.png", 32, 32)
    write(tmp_path / "img" / "a.txt", "t0, t1, t2, t3, t4, t5")
    bp = blueprint(tmp_path / "img", shuffle_caption=True, keep_tokens=1, num_repeats=20)
    ds = D.ImageDataset(bp, seed=1)
    epoch0 = [ds[(e, 0)]["caption"] for e in range(20)]
    assert epoch0 == [D.ImageDataset(bp, seed=1)[(e, 0)]["caption"] for e in range(20)]
    assert epoch0 != [ds[(e, 1)]["caption"] for e in range(20)]
    assert len(set(epoch0)) > 5 and all(c.startswith("t0, ") for c in epoch0)


def test_one_image_in_two_subsets_gets_its_own_key_and_draws_in_each_stable_across_runs(tmp_path):
    """The key seeds a sample's noise and sigma: an image read by two subsets must not share them."""
    from library.models.flow_matching import sample_sigmas
    from library.training.state import sample_seed

    make_image(tmp_path / "img" / "a.png", 32, 32)
    write(tmp_path / "img" / "a.txt", "a square")
    bp = over_one_folder(tmp_path / "img", {"num_repeats": 2}, {"num_repeats": 2})
    keys = [D.ImageDataset(bp)[e]["key"] for e in range(4)]
    assert len(set(keys)) == 4, keys
    assert keys == ["0:0:a.png#0", "0:0:a.png#1", "0:1:a.png#0", "0:1:a.png#1"]  # dataset:subset:path#repeat
    assert keys == [D.ImageDataset(bp, seed=7)[(e, 3)]["key"] for e in range(4)]  # another run / epoch: the same keys
    draws = []
    for key in keys:
        g = torch.Generator().manual_seed(sample_seed(0, 5, key))
        draws.append((torch.randn(4, generator=g).tolist(), sample_sigmas(1, "sigmoid", generator=g).item()))
    assert len({tuple(noise) for noise, _ in draws}) == 4 and len({sigma for _, sigma in draws}) == 4


# ----------------------------------------------------------------------------------------------
# Batching


def test_batches_hold_one_bucket_and_cover_every_entry_once(tmp_path):
    for i, (w, h) in enumerate([(64, 64), (64, 64), (128, 64), (128, 64), (128, 60), (64, 128)]):
        make_image(tmp_path / "img" / f"{i}.png", w, h)
    bp = blueprint(tmp_path / "img", resolution=64, enable_bucket=True, min_bucket_reso=32, max_bucket_reso=128,
                   bucket_reso_steps=16, batch_size=2, num_repeats=3, class_tokens="x")
    ds = D.ImageDataset(bp)
    sampler = D.BucketBatchSampler(ds, seed=0)
    batches = sampler.batches(0)
    assert sorted(e for b in batches for e, _ in b) == list(range(18))
    assert all(len({ds.items[ds.entries[e]].bucket for e, _ in b}) == 1 and len(b) <= 2 for b in batches)
    assert len({ds.items[ds.entries[e]].bucket for b in batches for e, _ in b}) == 3
    assert batches == D.BucketBatchSampler(ds, seed=0).batches(0)
    assert batches != sampler.batches(1)
    assert [b for b in sampler] == batches and next(iter(sampler)) == sampler.batches(1)[0]  # epochs advance
    loader = torch.utils.data.DataLoader(ds, batch_sampler=D.BucketBatchSampler(ds), collate_fn=D.collate_batch)
    for batch in loader:
        w, h = batch["bucket"]
        assert batch["images"].shape[1:] == (3, h, w) and len(batch["captions"]) == batch["images"].shape[0]


# ----------------------------------------------------------------------------------------------
# Caches


class CountingEncoder:
    """Stands in for a VAE / text encoder and counts what it was asked to encode."""

    def __init__(self):
        self.images, self.captions = 0, []

    def latents(self, images):
        self.images += images.shape[0]
        return images[:, :, ::8, ::8] * 0.5  # [B, 3, H/8, W/8]

    def text(self, captions):
        self.captions += captions
        return [{"hidden": torch.full((len(c), 4), float(len(c))), "mask": torch.ones(len(c), dtype=torch.bool)}
                for c in captions]


def cache_files(folder) -> list[str]:
    """The cache files in `folder`, sorted, with their entry tag (8 hex digits) written TAG."""
    return sorted(re.sub(r"_[0-9a-f]{8}_", "_TAG_", f) for f in os.listdir(folder) if f.endswith(".safetensors"))


def cached_dataset(tmp_path, enc, model_key="flux", **kw):
    ds = D.ImageDataset(blueprint(tmp_path / "img", **kw))
    n_lat = caches.cache_latents(ds.items, enc.latents, model_key, batch_size=2)
    n_txt = caches.cache_text(ds.items, enc.text, model_key)
    return ds, n_lat, n_txt


def test_an_image_named_in_65_cjk_characters_gets_cache_files_its_file_system_takes(tmp_path):
    """A 195-byte stem (65 CJK characters) fits ext4's 255 bytes as an image name, not as its text cache's
    temporary (`.<stem>_flux_<tag>_te.safetensors.<8>.tmp`): 'File name too long' after the whole VAE pass. Such a
    stem keeps its first bytes and a hash of the whole; two stems alike in their first bytes keep two files; a
    re-run reuses both; a short stem keeps its plain name."""
    long_a, long_b = "猫" * 65, "猫" * 64 + "犬"
    for stem, color in ((long_a, (255, 0, 0)), (long_b, (0, 255, 0)), ("short", (0, 0, 255))):
        make_image(tmp_path / "img" / f"{stem}.png", 32, 32, color)
        write(tmp_path / "img" / f"{stem}.txt", f"caption {color}")
    key = "flux1_0123456789_abcdef0123"  # as long as a real text cache key: <family>_<10 hex>_<10 hex>
    _, n_lat, n_txt = cached_dataset(tmp_path, CountingEncoder(), key)
    names = cache_files(tmp_path / "img")
    limit = os.pathconf(tmp_path, "PC_NAME_MAX")
    assert (n_lat, n_txt, len(names)) == (3, 3, 6)
    assert all(len(f".{n}.xxxxxxxx.tmp".encode()) <= limit for n in names)
    assert {f"short_{key}_TAG_64x64.safetensors", f"short_{key}_TAG_te.safetensors"} <= set(names)
    assert sum(n.startswith("猫") and "~" in n for n in names) == 4
    assert cached_dataset(tmp_path, CountingEncoder(), key)[1:] == (0, 0)


def test_caches_are_reused_and_exactly_the_changed_entries_are_recomputed(tmp_path):
    colors = [(255, 0, 0), (0, 255, 0), (0, 0, 255)]
    for i, c in enumerate(colors):
        make_image(tmp_path / "img" / f"{i}.png", 32, 32, c)
        write(tmp_path / "img" / f"{i}.txt", f"caption {i}")
    enc = CountingEncoder()
    ds, n_lat, n_txt = cached_dataset(tmp_path, enc)
    assert (n_lat, n_txt, enc.images, len(enc.captions)) == (3, 3, 3, 3)
    assert {"0_flux_TAG_64x64.safetensors", "0_flux_TAG_te.safetensors"} <= set(cache_files(tmp_path / "img"))

    enc = CountingEncoder()
    assert cached_dataset(tmp_path, enc)[1:] == (0, 0) and enc.images == 0

    write(tmp_path / "img" / "1.txt", "an edited caption")
    make_image(tmp_path / "img" / "2.png", 32, 32, (9, 9, 9))
    enc = CountingEncoder()
    ds, n_lat, n_txt = cached_dataset(tmp_path, enc)
    assert (n_lat, n_txt, enc.images, enc.captions) == (1, 1, 1, ["an edited caption"])
    assert float(ds[2]["latents"][0, 0, 0]) == pytest.approx(0.5 * (9 / 127.5 - 1), abs=1e-2)  # the new pixels

    enc = CountingEncoder()
    assert cached_dataset(tmp_path, enc, model_key="qwen_image")[1:] == (3, 3)  # other model: all new


def sample_tensors(sample) -> dict[str, torch.Tensor]:
    """Every tensor a sample carries (latents, mask, references, text), by name."""
    out = {k: sample[k] for k in ("latents", "mask") if k in sample}
    out.update({f"control_{k}": c for k, c in enumerate(sample.get("controls", []))})
    out.update({f"text_{k}": v for k, v in sample.get("text", {}).items()})
    return out


def assert_each_subset_keeps_its_own_cache(bp, cache) -> list[dict[str, torch.Tensor]]:
    """cache(items, to_disk) -> files encoded. Every sample read from the disk caches equals the
    one encoded in memory, and a second run encodes nothing. Returns the samples' tensors."""
    in_memory = D.ImageDataset(bp)
    cache(in_memory.items, False)
    on_disk = D.ImageDataset(bp)
    encoded = cache(on_disk.items, True)
    files = {c for item in on_disk.items for c in (item.latent_cache, item.text_cache) if c is not None}
    assert encoded == len(files)  # a file two entries share is encoded once
    samples = [sample_tensors(on_disk[e]) for e in range(len(on_disk))]
    for e, sample in enumerate(samples):
        expected = sample_tensors(in_memory[e])
        assert sample.keys() == expected.keys(), e
        assert [name for name in sample if not torch.equal(sample[name], expected[name])] == [], e
    assert cache(D.ImageDataset(bp).items, True) == 0  # nothing re-encoded, nothing overwritten
    return samples


def test_two_subsets_over_one_folder_keep_their_own_caption_caches(tmp_path):
    """.txt and .cap captions of one image: each subset trains on its own text, from its own file."""
    make_image(tmp_path / "img" / "a.png", 32, 32)
    write(tmp_path / "img" / "a.txt", "a red square")
    write(tmp_path / "img" / "a.cap", "crimson")
    bp = over_one_folder(tmp_path / "img", {"caption_extension": ".txt"}, {"caption_extension": ".cap"})
    enc = CountingEncoder()
    txt, cap = assert_each_subset_keeps_its_own_cache(
        bp, lambda items, to_disk: caches.cache_text(items, enc.text, "flux", to_disk=to_disk))
    assert txt["text_hidden"].shape == (12, 4) and cap["text_hidden"].shape == (7, 4)
    assert_each_subset_keeps_its_own_cache(  # one latent file for both: its content is the same
        bp, lambda items, to_disk: caches.cache_latents(items, enc.latents, "flux", to_disk=to_disk))


@pytest.mark.parametrize("first, second", [
    ({"class_tokens": "cat"}, {"class_tokens": "a dog"}),  # no caption file: the class tokens are the caption
    ({"shuffle_caption": True}, {"shuffle_caption": True, "keep_tokens": 1}),
    ({"shuffle_caption": True, "caption_variants": 2}, {"shuffle_caption": True, "caption_variants": 3}),
    ({}, {"flip_aug": True}),
    ({}, {"alpha_mask": True}),
    ({}, {"caption_prefix": "ohwx,"}),
    ({"caption_suffix": ", a"}, {"caption_suffix": ", b"}),
])
def test_subsets_that_differ_in_any_cached_input_get_their_own_cache_files(tmp_path, first, second):
    image = Image.new("RGBA", (32, 32), (0, 0, 0, 255))
    image.paste((255, 255, 255, 0), (16, 0, 32, 32))  # left half dark and kept, right half light and masked
    os.makedirs(tmp_path / "img")
    image.save(tmp_path / "img" / "a.png")
    if "class_tokens" not in first:
        write(tmp_path / "img" / "a.txt", "t0, t1, t2, t3, t4, t5")
    enc = CountingEncoder()
    bp = over_one_folder(tmp_path / "img", first, second)
    for cache in (caches.cache_latents, caches.cache_text):
        encode = enc.latents if cache is caches.cache_latents else enc.text
        assert_each_subset_keeps_its_own_cache(bp, lambda items, to_disk: cache(items, encode, "flux", to_disk=to_disk))


def test_a_cache_file_name_that_misses_an_input_is_an_error_not_a_silent_overwrite(tmp_path, monkeypatch):
    make_image(tmp_path / "img" / "a.png", 32, 32)
    write(tmp_path / "img" / "a.txt", "a red square")
    write(tmp_path / "img" / "a.cap", "crimson")
    bp = over_one_folder(tmp_path / "img", {"caption_extension": ".txt"}, {"caption_extension": ".cap"})
    monkeypatch.setattr(caches, "text_entry", lambda item, with_references: "00000000")  # a name blind to the extension
    with pytest.raises(RuntimeError, match=r"a_flux_00000000_te.safetensors: two cache entries of .*a.png with "):
        caches.cache_text(D.ImageDataset(bp).items, CountingEncoder().text, "flux")
    assert cache_files(tmp_path / "img") == []  # raised before anything was written


def test_cached_samples_yield_float32_latents_and_text_and_collate(tmp_path):
    make_image(tmp_path / "img" / "a.png", 32, 32, (255, 255, 255))
    make_image(tmp_path / "img" / "b.png", 32, 32, (0, 0, 0))
    write(tmp_path / "img" / "a.txt", "short")
    write(tmp_path / "img" / "b.txt", "a longer one")
    enc = CountingEncoder()
    ds, _, _ = cached_dataset(tmp_path, enc, resolution=32)
    sample = ds[0]
    assert "image" not in sample and sample["latents"].dtype == torch.float32
    assert sample["latents"].shape == (3, 4, 4) and float(sample["latents"].max()) == 0.5
    batch = D.collate_batch([ds[0], ds[1]])
    assert batch["latents"].shape == (2, 3, 4, 4)
    assert batch["text"]["hidden"].shape == (2, 12, 4) and batch["text"]["hidden"].dtype == torch.float32
    assert batch["text"]["mask"].sum(1).tolist() == [5, 12]  # zero-padded at the end


def test_flip_aug_caches_both_orientations_and_cache_dir_is_used(tmp_path):
    img = Image.new("RGB", (32, 32), (0, 0, 0))
    img.paste((255, 255, 255), (16, 0, 32, 32))
    os.makedirs(tmp_path / "img")
    img.save(tmp_path / "img" / "a.png")
    enc = CountingEncoder()
    ds, n_lat, _ = cached_dataset(tmp_path, enc, resolution=32, flip_aug=True, class_tokens="x",
                                  cache_dir=str(tmp_path / "cache"))
    assert n_lat == 1 and enc.images == 2  # plain + mirrored
    assert not any(f.endswith(".safetensors") for f in os.listdir(tmp_path / "img"))
    (sub,) = os.listdir(tmp_path / "cache")
    assert cache_files(tmp_path / "cache" / sub) == ["a_flux_TAG_32x32.safetensors", "a_flux_TAG_te.safetensors"]
    first_columns = {float(ds[(0, epoch)]["latents"][0, 0, 0]) for epoch in range(12)}
    assert first_columns == {-0.5, 0.5}  # both orientations are served across epochs


# ----------------------------------------------------------------------------------------------
# LLM text


def test_text_windows_shift_targets_by_one_and_respect_stride():
    ids = torch.arange(21)
    ds = text_corpus.TextWindowDataset(ids, max_length=5)
    assert len(ds) == 4
    x, y = ds[3]
    assert x.tolist() == [15, 16, 17, 18, 19] and y.tolist() == [16, 17, 18, 19, 20] and x.dtype == torch.long
    assert len(text_corpus.TextWindowDataset(ids, max_length=5, stride=2)) == 8  # starts 0, 2, ..., 14
    with pytest.raises(ValueError, match="fewer than max_length"):
        text_corpus.TextWindowDataset(torch.arange(5), max_length=5)


def test_token_stream_is_stored_in_4_bytes_a_token_with_the_same_windows():
    """The old line held the stream as a Python list (~36 bytes a token while tokenizing) and then int64
    (8 bytes); now int32 (4), and every window is the int64 one sliced from the old stream."""
    big = [151935, 0, 70000, 2**31 - 1]  # a Qwen vocab's top id, and int32's largest
    docs = [f"d{i}" for i in range(5)]
    encode = lambda d: [big[(int(d[1:]) * 7 + j) % 4] - j for j in range(13)]  # noqa: E731
    ids = text_corpus.tokenize_documents(docs, encode, eos_id=151643)
    old = torch.tensor([t for d in docs for t in encode(d) + [151643]], dtype=torch.long)
    assert ids.dtype == torch.int32 and ids.element_size() * len(ids) == 4 * len(old) == 4 * 70
    train, val = text_corpus.train_val_split(ids, 0.2)
    windows = text_corpus.TextWindowDataset(train, max_length=9, stride=4)
    assert windows.ids.dtype == torch.int32 and len(windows) == 12
    for i, s in enumerate(range(0, 56 - 9, 4)):
        x, y = windows[i]
        assert x.dtype == y.dtype == torch.long
        assert torch.equal(x, old[s : s + 9]) and torch.equal(y, old[s + 1 : s + 10])
    assert torch.equal(val.long(), old[56:])


def test_corpus_loading_tokenizing_and_tail_validation_split(tmp_path):
    write(tmp_path / "docs" / "b.txt", "world")
    write(tmp_path / "docs" / "a.txt", "hello")
    write(tmp_path / "docs" / "skip.md", "not text")
    files, count = text_corpus.check_corpus([str(tmp_path / "docs")], None, False)
    assert [os.path.basename(f) for f in files] == ["a.txt", "b.txt"] and count == (2, 0)
    encode = lambda s: [ord(c) for c in s]  # noqa: E731
    ids, trained, _ = text_corpus.tokenize_corpus(files, encode, encode, eos_id=0)
    assert ids.tolist() == [104, 101, 108, 108, 111, 0, 119, 111, 114, 108, 100, 0] and trained is None
    train, val = text_corpus.train_val_split(torch.arange(100), 0.1)
    assert train.tolist() == list(range(90)) and val.tolist() == list(range(90, 100))
    with pytest.raises(ValueError, match="no such text file"):
        text_corpus.corpus_files(str(tmp_path / "missing"))


def test_corpus_folders_are_read_recursively_with_any_case_extension(tmp_path):
    """The old line read only the folder's own lower-case *.txt ('c' and 'D' were skipped) and named
    no folder when it found nothing ("['...']: no .txt files found")."""
    from library.errors import ConfigError

    write(tmp_path / "docs" / "a.txt", "a")
    write(tmp_path / "docs" / "part" / "c.txt", "c")
    write(tmp_path / "docs" / "part" / "D.TXT", "D")
    write(tmp_path / "docs" / ".git" / "x.txt", "hidden")
    found = text_corpus.corpus_files(str(tmp_path / "docs"))
    assert [os.path.basename(f) for f in found] == ["a.txt", "D.TXT", "c.txt"]  # path order (sorted names)
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    with pytest.raises(ConfigError, match=f"^train_data {tmp_path / 'empty'}: no .txt or .jsonl file in this folder or its subfolders$"):
        text_corpus.corpus_files([str(tmp_path / "docs"), str(tmp_path / "empty")])


def test_a_json_file_in_train_data_is_refused_not_read_as_text(tmp_path):
    """The old line trained on '{"text": "hello"}' as it stands, keys and quotes included."""
    from library.errors import ConfigError

    path = write(tmp_path / "data.json", '[{"text": "hello"}]\n')
    with pytest.raises(ConfigError, match=f"^train_data {path}: a .json data file would be trained on as raw text"):
        text_corpus.corpus_files([path])
