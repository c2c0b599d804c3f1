"""The Dataset page (library/ui/handlers.py WebUI.dataset, save_caption; app.py dataset_tab) called in this
process: check_dataset.py's report, the gallery's captions and what a Save writes."""

from __future__ import annotations

import os
import shutil

import gradio as gr
import pytest
import toml

from library.ui.files import OutsideRoots
from tests.test_webui_handlers import ui  # noqa: F401 (the fixture: a WebUI on tmp_path/data)
from tests.ui_support import event, labelled, run


@pytest.fixture()
def caption_dataset(tiny_set, tmp_path) -> str:
    """A copy of the tiny dataset whose captions are .caption files."""
    images = tmp_path / "data" / "images"
    shutil.copytree(tiny_set["image_dir"], images)
    for name in os.listdir(images):
        if name.endswith(".txt"):
            os.rename(images / name, images / (name[:-4] + ".caption"))
    dataset = toml.load(tiny_set["dataset_config"])
    dataset["datasets"][0]["subsets"][0].update(image_dir=str(images), caption_extension=".caption")
    path = tmp_path / "data" / "dataset.toml"
    path.write_text(toml.dumps(dataset))
    return str(path)


def test_a_caption_is_saved_with_the_datasets_caption_extension(ui, caption_dataset):
    images = os.path.join(os.path.dirname(caption_dataset), "images")
    first = sorted(f for f in os.listdir(images) if f.endswith(".png"))[0]
    saved = ui.save_caption(caption_dataset, os.path.join(images, first), "an edited caption")
    stem = os.path.join(images, os.path.splitext(first)[0])
    assert saved == stem + ".caption" and not os.path.exists(stem + ".txt")
    with open(saved) as f:
        assert f.read() == "an edited caption\n"


def test_save_caption_refuses_what_is_not_an_image_of_the_dataset(ui, caption_dataset, tmp_path):
    prompts = tmp_path / "data" / "sample_prompts.toml"  # its "caption" would overwrite sample_prompts.caption
    prompts.write_text("x = 1\n")
    for image in (str(prompts), os.path.join(os.path.dirname(caption_dataset), "images", "missing.png")):
        with pytest.raises(ValueError, match=f"'{image}' is not an image or a caption file of the dataset"):
            ui.save_caption(caption_dataset, image, "overwritten")
    assert not (tmp_path / "data" / "sample_prompts.caption").exists()


def test_the_dataset_view_reads_no_caption_or_image_through_a_link_out_of_the_roots(ui, caption_dataset, tmp_path):
    """The gallery showed a caption file that linked out of the roots (2026-11-27), and listed such images."""
    images = os.path.join(os.path.dirname(caption_dataset), "images")
    first = sorted(f for f in os.listdir(images) if f.endswith(".png"))[0]
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret.caption").write_text("SECRET")
    shutil.copy(os.path.join(images, first), tmp_path / "outside" / "x.png")
    caption = os.path.join(images, os.path.splitext(first)[0] + ".caption")
    os.remove(caption)
    os.symlink(tmp_path / "outside" / "secret.caption", caption)
    os.symlink(tmp_path / "outside" / "x.png", os.path.join(images, "zz_link.png"))
    found = ui._caption_files(caption_dataset)
    assert found and all(entry.image.startswith(str(tmp_path / "data")) for entry in found)
    captions = {os.path.basename(entry.image): ui._read_caption(entry.path) for entry in found}
    assert captions[first] == "" and "zz_link.png" not in captions and len(set(captions.values())) > 1


def test_a_caption_that_is_not_utf8_is_one_problem_of_the_dataset_report_not_its_end(ui, caption_dataset):
    """One Latin-1 caption made the whole Dataset tab one "'utf-8' codec can't decode" line naming no file: no
    buckets, no problems table, no gallery. The report names it as check_dataset.py does; its caption is empty."""
    images = os.path.join(os.path.dirname(caption_dataset), "images")
    first = sorted(f for f in os.listdir(images) if f.endswith(".png"))[0]
    with open(os.path.join(images, os.path.splitext(first)[0] + ".caption"), "wb") as f:
        f.write("caf\u00e9 au lait".encode("latin-1"))
    view = ui.dataset(caption_dataset)
    assert view["ok"] and dict(view["images"])[os.path.join(images, first)] == ""
    assert any("caption file is not valid UTF-8" in message and first[:-4] in message
               for message in view["problems"]["message"]), view["problems"]


def two_caption_extensions(caption_dataset) -> str:
    """The caption dataset's folder in two subsets: .caption files (prose) and .tags files (tags)."""
    images = os.path.join(os.path.dirname(caption_dataset), "images")
    for name in os.listdir(images):
        if name.endswith(".caption"):
            with open(os.path.join(images, name[:-8] + ".tags"), "w") as f:
                f.write("tag1, tag2\n")
    dataset = toml.load(caption_dataset)
    subset = dataset["datasets"][0]["subsets"][0]
    dataset["datasets"][0]["subsets"].append({**subset, "caption_extension": ".tags"})
    with open(caption_dataset, "w") as f:
        toml.dump(dataset, f)
    return images


def test_gradios_copies_of_the_images_shown_are_swept(ui):
    """gradio keeps its copy of each image a page showed (samples, dataset images) for the server's life and past
    it unless delete_cache is set: a UI serving for weeks grew by every image viewed."""
    from library.ui.app import build_app

    every, age = build_app(ui).delete_cache
    assert 0 < every <= age <= 86400


def test_a_picked_caption_is_saved_to_its_own_file_and_shows_what_was_saved_when_picked_again(ui, caption_dataset):
    """Old: with one image folder in two subsets (.caption and .tags) the gallery showed each image twice; saving
    the .caption entry wrote the .tags file (the pick named the image only, and the last subset's extension won).
    And picking an image again showed the caption Check had read, not the one saved since: a second save put the
    old text back."""
    from library.ui.app import build_app

    images = two_caption_extensions(caption_dataset)
    app = build_app(ui)
    check = event(app, "click", api_name="dataset")
    values = {check.inputs[0]._id: caption_dataset}  # the dataset TOML picked
    run(check, values)
    select, caption = event(app, "select", "dataset-images"), labelled(app, "caption")
    gallery = [image for image, _ in values[select.targets[0][0]]]
    first = os.path.join(images, "000.png")
    prose, tags = [i for i, image in enumerate(gallery) if image == first]
    run(select, values, gr.SelectData(None, {"index": prose, "value": None}))
    with open(os.path.join(images, "000.caption")) as f:
        assert values[caption._id] == f.read().strip()
    values[caption._id] = "an edited caption"
    run(event(app, "click", api_name="save_caption"), values)
    with open(os.path.join(images, "000.caption")) as f, open(os.path.join(images, "000.tags")) as g:
        assert (f.read(), g.read()) == ("an edited caption\n", "tag1, tag2\n")
    run(select, values, gr.SelectData(None, {"index": tags, "value": None}))
    assert values[caption._id] == "tag1, tag2"
    run(select, values, gr.SelectData(None, {"index": prose, "value": None}))
    assert values[caption._id] == "an edited caption"
    with pytest.raises(ValueError, match="has 2 caption files in the dataset"):  # the image alone: which file?
        ui.save_caption(caption_dataset, first, "overwritten")


def test_a_caption_another_tab_saved_since_this_one_showed_it_is_refused(ui, caption_dataset):
    """Old: two tabs on one image, each Save wrote its text over the other's, the earlier edit lost without a word
    (the config editor refuses that; captions did not). Now a Save whose file changed since the page showed it
    is refused, the other's text kept; picked again, the page shows it, and saves."""
    from library.ui.app import build_app

    app = build_app(ui)
    check, select = event(app, "click", api_name="dataset"), event(app, "select", "dataset-images")
    save, caption, note = event(app, "click", api_name="save_caption"), labelled(app, "caption"), save_note(app)
    tabs = [{check.inputs[0]._id: caption_dataset} for _ in range(2)]
    for values in tabs:
        run(check, values)
        run(select, values, gr.SelectData(None, {"index": 0, "value": None}))
    path = tabs[0][labelled(app, "caption file")._id]
    for values, text in zip(tabs, ("the first tab's", "the second tab's")):
        values[caption._id] = text
    run(save, tabs[1])
    run(save, tabs[0])
    assert tabs[0][note._id] == (f"⚠ caption file {path}: changed since this page showed it (another tab or program "
                                 f"saved it): pick the image again to see its text"), tabs[0][note._id]
    assert open(path).read() == "the second tab's\n"
    run(save, tabs[1])  # the tab that saved it saves again
    run(select, tabs[0], gr.SelectData(None, {"index": 0, "value": None}))
    assert tabs[0][caption._id] == "the second tab's"
    tabs[0][caption._id] = "the first tab's, after reading the second's"
    run(save, tabs[0])
    assert tabs[0][note._id] == f"saved {path}" and open(path).read() == "the first tab's, after reading the second's\n"


def save_note(app):
    """The Markdown under the caption box (Save caption's first output)."""
    return event(app, "click", api_name="save_caption").outputs[0]


def test_an_empty_caption_is_refused_and_an_image_captioned_by_class_tokens_says_so(ui, caption_dataset):
    """Old: picking an image without a caption file (class_tokens caption it) showed an empty box; Save wrote an
    empty caption file, which training then refuses ("caption file is empty")."""
    images = os.path.join(os.path.dirname(caption_dataset), "images")
    dataset = toml.load(caption_dataset)
    dataset["datasets"][0]["subsets"][0]["class_tokens"] = "ohwx person"
    with open(caption_dataset, "w") as f:
        toml.dump(dataset, f)
    os.remove(os.path.join(images, "000.caption"))
    for empty in ("", "  \n"):
        with pytest.raises(ValueError, match="is empty: training refuses an empty caption file"):
            ui.save_caption(caption_dataset, os.path.join(images, "000.png"), empty)
    assert not os.path.exists(os.path.join(images, "000.caption"))
    entry = next(e for e in ui._caption_files(caption_dataset) if e.image.endswith("000.png"))
    text, note = ui.picked_caption(entry)
    assert text == "" and "class_tokens 'ohwx person'" in note
    assert ui._gallery_caption(entry) == "(class_tokens: ohwx person)"


def test_a_missing_image_dir_is_a_row_of_the_dataset_view_and_one_outside_the_roots_is_refused(ui, caption_dataset,
                                                                                               tmp_path):
    """Old: a subset whose image_dir is missing made the Dataset tab one bare FileNotFoundError (check_dataset.py
    reports it as one error beside the rest). The gallery also listed macOS's '._000.png' files, which training
    skips. A subset outside the roots was left out of the gallery, but check_dataset.py read it whole: the report
    named its files, decoded its images and read its captions; refused now (as Validate refuses the dataset),
    before anything there is opened."""
    images = os.path.join(os.path.dirname(caption_dataset), "images")
    with open(os.path.join(images, "._000.png"), "wb") as f:
        f.write(b"\x00\x05\x16\x07" + b"\x00" * 60)  # an AppleDouble header
    outside, missing = tmp_path / "outside", tmp_path / "data" / "missing"
    shutil.copytree(images, outside)
    dataset = toml.load(caption_dataset)
    subset = dataset["datasets"][0]["subsets"][0]
    dataset["datasets"][0]["subsets"] += [{**subset, "image_dir": str(missing)}]
    with open(caption_dataset, "w") as f:
        toml.dump(dataset, f)
    view = ui.dataset(caption_dataset)
    assert view["ok"] and sorted(os.path.basename(image) for image, _ in view["images"]) == sorted(
        f for f in os.listdir(images) if f.endswith(".png") and not f.startswith("."))
    rows = view["problems"].values.tolist()
    assert [row for row in rows if str(missing) in row[2]] == [
        ["error", "folder", f"{missing}: image_dir does not exist or is not a folder"]]
    for key in ("image_dir", "mask_dir", "control_directory"):
        with open(caption_dataset, "w") as f:
            subsets = [subset, {**subset, key: str(outside)}]
            toml.dump({**dataset, "datasets": [{**dataset["datasets"][0], "subsets": subsets}]}, f)
        with pytest.raises(OutsideRoots, match=rf"^data/dataset.toml's {key} '{outside}' is outside the folders"):
            ui.dataset(caption_dataset)


def test_a_training_config_checks_the_dataset_as_it_trains_it(ui, caption_dataset, tiny_set, tmp_path):
    """Old: the page ran check_dataset.py without a training config, so a caption the config's text encoder cuts
    (FLUX.2 [klein] at max_sequence_length 64, a T5 at 32) was no row of its problems; the CLI's --config_file
    counted it. Now the page's optional training config is passed as --config_file."""
    from tests.ui_support import tiny_job_settings

    config = tmp_path / "data" / "train.toml"
    config.write_text(toml.dumps(tiny_job_settings(tiny_set, t5xxl_max_token_length=4)))
    cut = lambda view: [m for m in view["problems"]["message"] if "the encoder keeps 4" in m]  # noqa: E731
    alone = ui.dataset(caption_dataset)
    assert alone["ok"] and not cut(alone) and "not counted" in alone["summary"], alone["summary"]
    trained = ui.dataset(caption_dataset, str(config))
    assert trained["ok"] and len(cut(trained)) == len(trained["images"]), trained["problems"]
    assert "not counted" not in trained["summary"], trained["summary"]
    with pytest.raises(OutsideRoots, match="^training config "):
        ui.dataset(caption_dataset, tiny_set["dataset_config"])

    from library.ui.app import build_app  # the page passes its second picker

    check = event(build_app(ui), "click", api_name="dataset")
    assert check.inputs[1].label.startswith("training config (optional")
    values = {check.inputs[0]._id: caption_dataset, check.inputs[1]._id: str(config)}
    run(check, values)
    assert "not counted" not in values[check.outputs[0]._id], values[check.outputs[0]._id]
