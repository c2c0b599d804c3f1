"""tools/make_tiny_dataset.py: the sets it writes are what their names say, at every --size."""

import hashlib

import pytest

from library.data.check import check_dataset
from library.data.dataset_config import load_dataset_config
from tools.make_tiny_dataset import make_tiny_dataset, make_tiny_edit_dataset, make_tiny_layered_dataset


def _digests(folder) -> list[str]:
    return [hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.glob("*.png"))]


def test_edit_set_writes_as_many_different_pairs_as_asked(tmp_path):
    paths = make_tiny_edit_dataset(str(tmp_path), count=8, size=32)
    targets, references = _digests(tmp_path / "edit_images"), _digests(tmp_path / "edit_control")
    assert len(set(targets)) == 8 and len(set(references)) == 8  # was 4 and 4: 5 of 8 pairs the same pair
    assert not set(targets) & set(references)
    report = check_dataset(load_dataset_config(paths["edit_dataset_config"]))
    assert report.problems() == []  # was 4 "the same file as" warnings per folder


@pytest.mark.parametrize("size", [16, 32, 48, 64])
def test_plain_set_trains_every_image_at_its_own_size(tmp_path, size):
    report = check_dataset(load_dataset_config(make_tiny_dataset(str(tmp_path), count=4, size=size)["dataset_config"]))
    # 32 was 40x24 images in 32x32 buckets, "upscaled" x4; 16 was refused (min_bucket_reso 32 > resolution 16)
    assert [p.line() for p in report.problems()] == []
    (subset,) = report.subsets
    assert subset.buckets == subset.sizes and sum(subset.sizes.values()) == 4


def test_layered_set_writes_different_composites(tmp_path):
    make_tiny_layered_dataset(str(tmp_path), count=8, size=32)
    composites = _digests(tmp_path / "layered_images")[::3]  # NNN.png, NNN_1.png, NNN_2.png
    assert len(set(composites)) == 8  # was 6: 005 = 000 and 007 = 004


def test_an_out_under_a_file_is_one_line_naming_the_file(tmp_path, capsys):
    """The old line: 'error: [Errno 20] Not a directory: .../notes.txt/set' (os.makedirs' words)."""
    from tools import make_tiny_dataset

    (tmp_path / "notes.txt").write_text("notes")
    assert make_tiny_dataset.main(["--out", str(tmp_path / "notes.txt" / "set")]) == 2
    assert capsys.readouterr().err == (f"error: --out {tmp_path / 'notes.txt' / 'set'}: cannot be created, "
                                       f"'{tmp_path / 'notes.txt'}' is a file, not a folder\n")


def test_a_second_set_into_the_same_out_is_refused_unless_overwrite(tmp_path, capsys):
    """--edit --count 4 after --count 8 into one --out printed 'wrote 4 pairs' and left 8 pairs (the 4
    older ones trained too). Now it is one line naming the folder; --overwrite clears that set's .png
    and .txt files first (4 pairs left); another set's folders in the same --out are not in the way."""
    from tools import make_tiny_dataset

    out = tmp_path / "set"
    assert make_tiny_dataset.main(["--out", str(out), "--edit", "--count", "8", "--size", "16"]) == 0
    assert make_tiny_dataset.main(["--out", str(out), "--edit", "--count", "4", "--size", "16"]) == 2
    assert capsys.readouterr().err == (f"error: --out {out}: {out / 'edit_images'} already holds files (an earlier "
                                       f"set's images would stay beside the new ones): add --overwrite to delete its "
                                       f".png and .txt files first, or choose another --out\n")
    (out / "edit_images" / "notes.md").write_text("mine")
    assert make_tiny_dataset.main(["--out", str(out), "--edit", "--count", "4", "--size", "16", "--overwrite"]) == 0
    assert [len(list((out / d).glob(f"*.{e}"))) for d, e in [("edit_images", "png"), ("edit_images", "txt"),
                                                              ("edit_control", "png")]] == [4, 4, 4]
    assert (out / "edit_images" / "notes.md").read_text() == "mine"
    assert make_tiny_dataset.main(["--out", str(out), "--layered", "--count", "2", "--size", "16"]) == 0


def test_an_out_with_quotes_and_backslashes_is_in_every_toml_as_written(tmp_path):
    """The TOMLs held the folders between bare quotes: --out 'it"s' wrote a TOML that does not parse, and
    a backslash was TOML's escape (a\\b read as 'a', backspace). Now each is a TOML string (toml_string)."""
    from tools.make_tiny_dataset import scene_dataset_toml

    out = tmp_path / 'it"s a\\b'
    paths = {**make_tiny_dataset(str(out), count=2, size=16), **make_tiny_edit_dataset(str(out), count=2, size=16),
             **make_tiny_layered_dataset(str(out), count=2, size=16)}
    paths["reg_dataset_config"] = str(out / "reg.toml")  # the concept set's, without its 200 images
    scene_dataset_toml(paths["reg_dataset_config"], str(out / "images"), 16, "2 images", reg_dir=str(out / "reg"))
    expected = {"dataset_config": [("images", None)], "edit_dataset_config": [("edit_images", "edit_control")],
                "layered_dataset_config": [("layered_images", None)],
                "reg_dataset_config": [("images", None), ("reg", None)]}
    for key, folders in expected.items():
        (ds,) = load_dataset_config(paths[key]).datasets
        assert [(s.image_dir, s.control_directory) for s in ds.subsets] == [
            (str(out / image_dir), control and str(out / control)) for image_dir, control in folders], key


def test_every_command_shown_into_tiny_models_runs_twice():
    """The configs' comments (quickstart, llm_lora, ...), README's tool table, concept_demo's docstring and
    gpu_bench.sh showed `python tools/make_tiny_dataset.py --out tiny_models/...` without --overwrite: the
    same line run a second time was refused ('... already holds files'). Each now has it. A placeholder
    --out DIR does not: that folder may be the user's own."""
    import glob
    import os
    import re

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    files = [os.path.join(root, name) for name in ("README.md", "Makefile")]
    for pattern in ("configs/*.toml", "docs/*.md", "tools/*.py", "bench/*.sh"):
        files += glob.glob(os.path.join(root, pattern))
    command = re.compile(r"tools/make_tiny_dataset\.py --out tiny_models/[^\n`&#>|]*")
    shown = []
    for path in files:
        with open(path, encoding="utf-8") as f:
            shown += [(os.path.relpath(path, root), m.group(0)) for m in command.finditer(f.read())]
    assert len(shown) >= 8 and [s for s in shown if "--overwrite" not in s[1].split()] == [], shown


def test_make_tiny_models_out_under_a_file_is_one_line(tmp_path, capsys):
    """Old: NotADirectoryError's traceback after no file was written."""
    from tools import make_tiny_models

    (tmp_path / "notes.txt").write_text("notes")
    assert make_tiny_models.main(["--out", str(tmp_path / "notes.txt" / "set")]) == 2
    assert capsys.readouterr().err == (f"error: --out {tmp_path / 'notes.txt' / 'set'}: cannot be created, "
                                       f"'{tmp_path / 'notes.txt'}' is a file, not a folder\n")
