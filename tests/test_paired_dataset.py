"""Paired data for edit models: references from a subset's control_directory, matched by stem,
fitted by the family's rule, cached with the target, batched by size; one-line errors."""

import os

import pytest
import torch
from PIL import Image

from library.data import caches, dataset as D, image_folders
from library.data.controls import check_family_takes
from library.data.dataset_config import parse_dataset_config
from tests.test_dataset import CountingEncoder, assert_each_subset_keeps_its_own_cache, cache_files, make_image, write


def paired_blueprint(tmp_path, **subset):
    sub = {"image_dir": str(tmp_path / "img"), "control_directory": str(tmp_path / "ctrl"), "class_tokens": "edit",
           **subset}
    return parse_dataset_config({"datasets": [{"resolution": 32, "subsets": [sub]}]}, source="paired.toml")


def test_single_and_numbered_references_are_cached_with_the_target_and_collated(tmp_path):
    make_image(tmp_path / "img" / "a.png", 32, 32, (255, 0, 0))
    make_image(tmp_path / "img" / "b.jpg", 32, 32, (255, 0, 0))
    make_image(tmp_path / "ctrl" / "a.png", 64, 64, (255, 255, 255))  # larger: fitted to the target's bucket
    make_image(tmp_path / "ctrl" / "b.png", 32, 32, (0, 0, 0))
    ds = D.ImageDataset(paired_blueprint(tmp_path))
    assert [os.path.basename(p) for it in ds.items for p in it.control_paths] == ["a.png", "b.png"]
    assert ds.items[0].control_buckets == [(32, 32)]
    enc = CountingEncoder()
    assert caches.cache_latents(ds.items, enc.latents, "flux_kontext", batch_size=2) == 2
    assert enc.images == 4  # targets + references, one file per target
    assert cache_files(tmp_path / "img") == ["a_flux_kontext_TAG_32x32.safetensors", "b_flux_kontext_TAG_32x32.safetensors"]
    batch = D.collate_batch([ds[0], ds[1]])
    (controls,) = batch["controls"]
    assert controls.shape == (2, 3, 4, 4) and controls.dtype == torch.float32
    assert controls[:, 0, 0, 0].tolist() == [0.5, -0.5]  # white and black references, in target order

    make_image(tmp_path / "ctrl" / "b.png", 32, 32, (9, 9, 9))  # a changed reference re-encodes its target
    enc = CountingEncoder()
    ds = D.ImageDataset(paired_blueprint(tmp_path))
    assert caches.cache_latents(ds.items, enc.latents, "flux_kontext") == 1 and enc.images == 2


def test_several_references_keep_their_order_and_flip_with_the_target(tmp_path):
    img = Image.new("RGB", (32, 32), (0, 0, 0))
    img.paste((255, 255, 255), (16, 0, 32, 32))
    os.makedirs(tmp_path / "img")
    img.save(tmp_path / "img" / "a.png")
    make_image(tmp_path / "ctrl" / "a_1.png", 32, 32, (0, 0, 0))
    os.makedirs(tmp_path / "ctrl", exist_ok=True)
    img.save(tmp_path / "ctrl" / "a_0.png")
    ds = D.ImageDataset(paired_blueprint(tmp_path, flip_aug=True))
    caches.cache_latents(ds.items, CountingEncoder().latents, "k")
    for epoch in range(8):
        s = ds[(0, epoch)]
        assert len(s["controls"]) == 2 and float(s["controls"][1].max()) == -0.5
        assert float(s["controls"][0][0, 0, 0]) == float(s["latents"][0, 0, 0])  # mirrored together
    uncached = D.ImageDataset(paired_blueprint(tmp_path))[0]
    assert [tuple(c.shape) for c in uncached["control_images"]] == [(3, 32, 32)] * 2


def test_two_subsets_over_one_folder_keep_their_own_reference_latents(tmp_path):
    """One target folder, two reference folders (white, black): each subset trains on its own."""
    make_image(tmp_path / "img" / "a.png", 32, 32, (255, 0, 0))
    make_image(tmp_path / "white" / "a.png", 32, 32, (255, 255, 255))
    make_image(tmp_path / "black" / "a.png", 32, 32, (0, 0, 0))
    subsets = [{"image_dir": str(tmp_path / "img"), "control_directory": str(tmp_path / folder), "class_tokens": "edit"}
               for folder in ("white", "black")]
    bp = parse_dataset_config({"datasets": [{"resolution": 32, "subsets": subsets}]}, source="paired.toml")
    enc = CountingEncoder()
    white, black = assert_each_subset_keeps_its_own_cache(
        bp, lambda items, to_disk: caches.cache_latents(items, enc.latents, "flux_kontext", to_disk=to_disk))
    assert (float(white["control_0"].max()), float(black["control_0"].max())) == (0.5, -0.5)

    def text_seeing_references(captions, views):  # Qwen-Image-Edit: the text is encoded with its references
        return [{"hidden": torch.full((2,), float(refs[0].getpixel((0, 0))[0]))} for refs in views]

    white, black = assert_each_subset_keeps_its_own_cache(bp, lambda items, to_disk: caches.cache_text(
        items, text_seeing_references, "qwen_image_edit", to_disk=to_disk, with_references=True))
    assert (white["text_hidden"][0].item(), black["text_hidden"][0].item()) == (255.0, 0.0)


def test_batches_hold_one_reference_size(tmp_path):
    for name, size in (("a", 32), ("b", 32), ("c", 64)):
        make_image(tmp_path / "img" / f"{name}.png", 32, 32)
        make_image(tmp_path / "ctrl" / f"{name}.png", size, size)
    bp = paired_blueprint(tmp_path)
    bp.datasets[0].batch_size = 3
    with pytest.warns(UserWarning) as said:  # a family that keeps the reference size
        items = image_folders.scan_images(bp, control_bucket=lambda bucket, size, resolution: size)
    ds = D.ImageDataset(bp, items=items)
    batches = D.BucketBatchSampler(ds, seed=0).batches(0)
    assert sorted(len(b) for b in batches) == [1, 2]
    # Said, as FLUX.2's own-size references split a dataset into batches of one without a word (2026-12-01)
    assert [str(w.message) for w in said] == [
        "paired.toml: [[datasets]] #1: its reference images come in 2 sizes and a batch holds one size of each, so an "
        "epoch is 2 batches where 1 of batch_size 3 would hold its images (smaller batches, more steps): give the "
        "references of one target bucket one size to batch them fully"]
    from library.data.check import check_dataset  # the check says it too, given the family's rule

    report = check_dataset(bp, control_bucket=lambda bucket, size, resolution: size)
    assert [p.message for p in report.problems() if p.kind == "reference"] == [str(said[0].message)]
    assert not [p for p in check_dataset(bp).problems() if p.kind == "reference"]  # without a family: not known


@pytest.mark.parametrize("case, expected", [
    ("missing", r"img/b.png: no reference image in control_directory .*ctrl \(expected 'b.<ext>' or 'b_0.<ext>'"),
    ("gap", r"img/b.png: control_directory .*ctrl lacks reference 'b_1.<ext>'"),
    ("both", r"img/b.png: control_directory .*ctrl has both 'b.png' and numbered references 'b_0.png'"),
    ("unreadable", r"ctrl/b.png: cannot be read as an image"),
    # b_1 was silently replaced by b_01 (a dict by number), a reference fewer than the folder holds
    ("one_number_twice", r"img/b.png: control_directory .*ctrl has 'b_01.png' and 'b_1.png', both reference 1"),
    # the last one sorted was b's reference, silently (2026-11-27); image_dir refused the same pair
    ("two_of_one_name", r"ctrl: control_directory images 'b.jpg' and 'b.png' share the name 'b'"),
])  # fmt: skip
def test_bad_references_are_one_line_errors_naming_the_file(tmp_path, case, expected):
    for name in ("a", "b"):
        make_image(tmp_path / "img" / f"{name}.png", 32, 32)
    make_image(tmp_path / "ctrl" / "a.png", 32, 32)
    files = {"missing": [], "gap": ["b_0.png", "b_2.png"],
             "both": ["b.png", "b_0.png"], "unreadable": [], "two_of_one_name": ["b.png", "b.jpg"],
             "one_number_twice": ["b_0.png", "b_1.png", "b_01.png"]}[case]
    for f in files:
        make_image(tmp_path / "ctrl" / f, 32, 32)
    if case == "unreadable":
        write(tmp_path / "ctrl" / "b.png", "not a png")
    with pytest.raises(ValueError, match=expected) as e:
        D.ImageDataset(paired_blueprint(tmp_path))
    assert "\n" not in str(e.value)


def test_targets_with_different_reference_counts_batch_apart(tmp_path):
    """As musubi-tuner takes them: b.png with two references beside a.png with one was refused ("every image of a
    subset needs the same number"); a batch holds one count, and the plans size the most any target has."""
    for i, name in enumerate(("a", "b", "c")):
        make_image(tmp_path / "img" / f"{name}.png", 32, 32, (9 * i, 0, 0))  # three files (check_dataset: no twins)
    for name in ("a.png", "b_0.png", "b_1.png", "c_0.png", "c_1.png"):
        make_image(tmp_path / "ctrl" / name, 32, 32)
    bp = paired_blueprint(tmp_path)
    bp.datasets[0].batch_size = 3
    ds = D.ImageDataset(bp)
    counts = {os.path.basename(it.image_path): len(it.control_paths) for it in ds.items}
    assert counts == {"a.png": 1, "b.png": 2, "c.png": 2}
    caches.cache_latents(ds.items, CountingEncoder().latents, "k", batch_size=3)
    batches = D.BucketBatchSampler(ds, seed=0).batches(0)
    assert sorted(len(D.collate_batch([ds[e] for e in b])["controls"]) for b in batches) == [1, 2]
    assert image_folders.reference_count(bp) == 2 and image_folders.largest_step(bp).references == 2
    from library.data.check import check_dataset

    assert check_dataset(bp).problems() == []


def test_finding_references_reads_the_folder_once_not_once_per_target(tmp_path, monkeypatch):
    """find_controls matched every file of the control_directory against each target: 4000 pairs took 4.3 s,
    20000 minutes, at every run's start. Now the numbered names are indexed once per folder."""
    import re

    from library.data import controls

    (tmp_path / "ctrl").mkdir()
    for i in range(100):
        for name in (f"t{i}_0.png", f"t{i}_1.png", f"u{i}.png"):
            (tmp_path / "ctrl" / name).touch()
    matched, fullmatch = [], re.fullmatch
    monkeypatch.setattr(controls.re, "fullmatch", lambda *a, **k: matched.append(1) or fullmatch(*a, **k))
    files = controls.control_files(str(tmp_path / "ctrl"))
    targets = frozenset([*(f"t{i}" for i in range(100)), *(f"u{i}" for i in range(100))])
    found = [controls.find_controls(f"/img/{t}.png", "ctrl", files, targets) for t in sorted(targets)]
    assert [os.path.basename(p) for p in found[0] + found[-1]] == ["t0_0.png", "t0_1.png", "u99.png"]
    assert len(matched) == 300  # each file once (was 40000: 200 targets x the 200 files not a target)


def test_a_numbered_name_that_is_another_target_is_that_targets_reference(tmp_path):
    """photo.png and photo_1.png are two targets: ctrl/photo_1.png is photo_1's reference, not photo's second."""
    for name, colour in (("photo", (255, 0, 0)), ("photo_1", (0, 0, 255))):
        make_image(tmp_path / "img" / f"{name}.png", 32, 32)
        make_image(tmp_path / "ctrl" / f"{name}.png", 32, 32, colour)
    ds = D.ImageDataset(paired_blueprint(tmp_path))  # was "has both 'photo.png' and numbered references 'photo_1.png'"
    assert {os.path.basename(it.image_path): [os.path.basename(p) for p in it.control_paths] for it in ds.items} == {
        "photo.png": ["photo.png"], "photo_1.png": ["photo_1.png"]}
    os.remove(tmp_path / "ctrl" / "photo.png")
    os.rename(tmp_path / "img" / "photo_1.png", tmp_path / "img" / "photo_0.png")
    os.rename(tmp_path / "ctrl" / "photo_1.png", tmp_path / "ctrl" / "photo_0.png")
    # photo lacks its reference: was paired silently with photo_0's
    with pytest.raises(ValueError, match=r"img/photo.png: no reference image in control_directory"):
        D.ImageDataset(paired_blueprint(tmp_path))


def test_control_directory_must_be_a_folder_and_a_family_must_take_references(tmp_path):
    make_image(tmp_path / "img" / "a.png", 32, 32)
    with pytest.raises(ValueError, match=r"paired.toml: .* key 'control_directory' '.*ctrl' is not a folder"):
        paired_blueprint(tmp_path)
    # the image_dir itself (a.png its own reference, a_0.png a target without a caption): refused, whatever the spelling
    for same in (tmp_path / "img", tmp_path / "img" / ".", tmp_path / "ctrl2"):
        if same.name == "ctrl2":
            os.symlink(tmp_path / "img", same)
        with pytest.raises(ValueError, match=r"key 'control_directory' .* is the image_dir: each image there is a "):
            paired_blueprint(tmp_path, control_directory=str(same))
    make_image(tmp_path / "ctrl" / "a.png", 32, 32)
    items = D.ImageDataset(paired_blueprint(tmp_path)).items
    check_family_takes(items, "flux_kontext", 4)
    with pytest.raises(ValueError, match=r"img/a.png: 1 reference image\(s\) in .*ctrl, but model_type flux takes no "):
        check_family_takes(items, "flux", 0)


@pytest.mark.parametrize("name", ["dataset_kontext", "dataset_qwen_image_edit", "dataset_krea2_edit"])
def test_edit_dataset_examples_parse_with_their_folders(tmp_path, monkeypatch, name):
    from library.data.dataset_config import load_dataset_config

    example = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", f"{name}.toml")
    monkeypatch.chdir(tmp_path)
    os.makedirs("data/edit/inputs")
    (subset,) = load_dataset_config(example).datasets[0].subsets
    assert (subset.image_dir, subset.control_directory) == ("data/edit/targets", "data/edit/inputs")


def test_ci_flags_keep_their_order_and_a_missing_file_is_an_error(tmp_path):
    from library.data.prompts import parse_prompt_line

    a, b = make_image(tmp_path / "a.png", 16, 16), make_image(tmp_path / "b.png", 16, 16)
    p = parse_prompt_line(f"make it red --ci {b} --w 32 --ci {a}", "p.txt:1")
    assert p.control_images == (b, a) and p.width == 32 and p.prompt == "make it red"
    with pytest.raises(ValueError, match=r"p.txt:2: --ci '.*missing.png' is not an image file"):
        parse_prompt_line(f"x --ci {tmp_path / 'missing.png'}", "p.txt:2")
    # decoded as the prompt file is read: an undecodable one failed after caching or at every render until 2026-11-27
    from library.data.prompts import read_prompt_file

    (tmp_path / "pointer.png").write_text("version https://git-lfs.github.com/spec/v1\n")
    (tmp_path / "p.txt").write_text(f"# samples\nmake it red --ci {b}\nx --ci {tmp_path / 'pointer.png'}\n")
    with pytest.raises(ValueError, match=r"p.txt:3: --ci .*pointer.png: cannot be decoded as an image"):
        read_prompt_file(str(tmp_path / "p.txt"))


def paired_images(tmp_path, count: int) -> None:
    """`count` targets with a reference each, every image its own colour and left / right halves
    (so a flipped latent differs from the unflipped one)."""
    for i in range(count):
        for folder, shade in (("img", 0), ("ctrl", 100)):
            img = Image.new("RGB", (32, 32), (10 * i, shade, 50))
            img.paste((255 - 10 * i, 200, shade), (16, 0, 32, 32))
            os.makedirs(tmp_path / folder, exist_ok=True)
            img.save(tmp_path / folder / f"{i:02d}.png")


def test_latent_caching_loads_ahead_in_threads_and_caches_the_same(tmp_path):
    """cache_latents' load_workers read the next batches while the VAE encodes this one; the cached
    targets, flipped targets and references equal the one-batch-at-a-time loop's, in order."""
    paired_images(tmp_path, 7)
    cached = {}
    for workers in (0, 3):
        ds = D.ImageDataset(paired_blueprint(tmp_path, flip_aug=True))
        enc = CountingEncoder()
        assert caches.cache_latents(ds.items, enc.latents, "k", batch_size=2, to_disk=False, load_workers=workers) == 7
        assert enc.images == 7 * 4  # target, reference, both flipped
        cached[workers] = [item.latent_cache for item in ds.items]
    assert [sorted(c) for c in cached[3]] == [["control_0", "control_0_flipped", "latents", "latents_flipped"]] * 7
    for one, ahead in zip(cached[0], cached[3]):
        for name in one:
            assert torch.equal(one[name], ahead[name]), name
    assert not torch.equal(cached[3][0]["latents"], cached[3][0]["latents_flipped"])


def test_latent_caching_overlaps_loading_the_next_batch_with_encoding_this_one(tmp_path, monkeypatch):
    """The first batch's encode waits (up to 10 s) for the second batch's images to start loading:
    with loading ahead they do at once; loading in turn (load_workers 0) never would."""
    import threading

    paired_images(tmp_path, 4)
    second_batch_loading = threading.Event()
    load = caches.load_image

    def loading(path, *args, **kwargs):
        if os.path.basename(path) in ("02.png", "03.png"):
            second_batch_loading.set()
        return load(path, *args, **kwargs)

    monkeypatch.setattr(caches, "load_image", loading)
    overlapped = []

    def encode(images):
        if not overlapped:
            overlapped.append(second_batch_loading.wait(timeout=10))
        return images[:, :, ::8, ::8]

    ds = D.ImageDataset(paired_blueprint(tmp_path))
    caches.cache_latents(ds.items, encode, "k", batch_size=2, to_disk=False, load_workers=2)
    assert overlapped == [True]


def test_layered_targets_are_refused_for_a_family_that_trains_no_layers(tmp_path):
    """Old: multiple_target's composite counted as a reference: an edit family took it (its VAE met RGBA
    after the text was cached), a text-to-image one was told of a control_directory never set."""
    from library.data.dataset_config import load_dataset_config
    from library.data.image_folders import scan_images
    from tools.make_tiny_dataset import make_tiny_layered_dataset

    layered = make_tiny_layered_dataset(str(tmp_path / "l"), count=2, size=32)["layered_dataset_config"]
    items = scan_images(load_dataset_config(layered))
    check_family_takes(items, "layered", 1, 1, takes_layers=True)
    for model_type, most in (("flux_kontext", 4), ("flux", 0)):
        with pytest.raises(ValueError, match=f"multiple_target = true .*, but model_type {model_type} trains no layers"):
            check_family_takes(items, model_type, most)


def test_a_layered_family_refuses_a_paired_subset(tmp_path):
    """Old: a control_directory's reference met the layered family's one condition image: the run cached one frame
    and trained it onto another image (no layer), without a word, its samples still decomposing."""
    from library.data.image_folders import scan_images

    make_image(tmp_path / "img" / "a.png", 32, 32, (255, 0, 0))
    make_image(tmp_path / "ctrl" / "a.png", 32, 32, (0, 0, 0))
    items = scan_images(paired_blueprint(tmp_path))
    with pytest.raises(ValueError, match="model_type qwen_image_layered trains layer decompositions: its subsets set "
                                         "multiple_target = true"):
        check_family_takes(items, "qwen_image_layered", 1, 1, takes_layers=True)


def test_a_family_that_stretches_references_trains_on_them_stretched_in_their_own_cache_entries(tmp_path):
    """Training sees a reference as its sample does (stretched: Qwen-Image-Edit, Qwen-Image-2.1), and a
    cache written with cropped references is not reused for stretched ones."""
    from PIL import Image

    from library.data.images import load_rgb

    make_image(tmp_path / "img" / "a.png", 32, 32, (255, 0, 0))
    ref = Image.new("RGB", (48, 32))
    ref.paste((255, 255, 255), (0, 0, 8, 32))  # a white band on the left: a centre crop cuts it
    os.makedirs(tmp_path / "ctrl")
    ref.save(tmp_path / "ctrl" / "a.png")
    cropped = image_folders.scan_images(paired_blueprint(tmp_path))
    stretched = image_folders.scan_images(paired_blueprint(tmp_path), stretch_controls=True)
    assert stretched[0].controls_stretched and not cropped[0].controls_stretched
    assert caches.latent_entry(stretched[0]) != caches.latent_entry(cropped[0])
    sample = D.ImageDataset(paired_blueprint(tmp_path), items=stretched)[0]
    expected = load_rgb(str(tmp_path / "ctrl" / "a.png")).resize((32, 32), Image.Resampling.LANCZOS)
    pixels = torch.tensor(list(expected.getdata()), dtype=torch.float32).T.reshape(3, 32, 32) / 127.5 - 1
    assert torch.allclose(sample["control_images"][0], pixels, atol=1e-6)
    assert float(sample["control_images"][0][:, :, 0].mean()) > 0.9  # the band is kept
