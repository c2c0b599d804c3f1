"""A peer's training config loaded in the Jobs tab (library/ui/peer_configs.py): an sd-scripts TOML or an
ai-toolkit YAML is converted by tools/convert_config.py beside it, the editor gets ours (which validates)
and the note says what was written and each key not carried; a config outside the roots, or one the
converter would read a file outside them for, is refused in one line; a musubi-tuner config that does not
say its model gets the converter's line asking for it, nothing written. Handler level, no server."""

from __future__ import annotations

import os
import shutil

import gradio as gr
import pytest
import toml

from library.ui.config_check import ConfigChecker
from library.ui.files import OutsideRoots
from library.ui.handlers import FORM_KEYS, WebUI
from tests.test_convert_config_ai_toolkit import FLUX_EXAMPLE, flux_pipeline_folder
from tests.test_webui_handlers import checked_ui, checker  # noqa: F401  (fixtures: one checker process a module)


@pytest.fixture()
def ui(tmp_path):
    (tmp_path / "data").mkdir()
    ui = WebUI(str(tmp_path / "jobs"), str(tmp_path), [str(tmp_path / "data")])
    yield ui
    ui.close()


def sd_scripts_config(tiny_set, folder, **extra) -> str:
    """An sd-scripts flux_train_network.py TOML on the tiny set, with its dataset TOML beside it."""
    dataset = folder / "my_dataset.toml"
    dataset.write_text(f'[general]\ncaption_extension = ".txt"\n\n[[datasets]]\nresolution = 64\nbatch_size = 2\n'
                       f'color_aug = true\n\n  [[datasets.subsets]]\n  image_dir = "{tiny_set["image_dir"]}"\n')
    keys = {"pretrained_model_name_or_path": tiny_set["flux_bfl"], "clip_l": tiny_set["clip_l"],
            "t5xxl": tiny_set["t5xxl"], "ae": tiny_set["flux_vae_single"], "dataset_config": "my_dataset.toml",
            "network_module": "networks.lora_flux", "network_dim": 4, "max_train_steps": 2, "sdpa": True,
            "optimizer_type": "AdamW", "learning_rate": 1e-4, "timestep_sampling": "flux_shift",
            "model_prediction_type": "raw", "network_train_unet_only": True, "guidance_scale": 1.0, **extra}
    path = folder / "my_flux_lora.toml"
    path.write_text(toml.dumps(keys))
    return str(path)


def test_a_peer_toml_whose_keys_are_all_ours_too_is_told_by_its_network_module():
    """An sd-scripts config of keys ours has too (fp8_base, ae, clip_l, ...) loaded unconverted: Validate asked
    for model_type, then refused networks.lora_flux, and nothing said convert it. Its LoRA module tells it now."""
    from library.ui.peer_configs import is_peer_config

    theirs = toml.dumps({"pretrained_model_name_or_path": "flux1-dev.safetensors", "ae": "ae.safetensors",
                         "clip_l": "clip_l.safetensors", "t5xxl": "t5xxl.safetensors", "fp8_base": True,
                         "network_module": "networks.lora_flux"})
    assert is_peer_config("sd run.toml", theirs)
    assert not is_peer_config("ours.toml", theirs.replace("networks.lora_flux", "networks.lora"))
    assert not is_peer_config("ours.toml", theirs.replace("networks.lora_flux", "lycoris.kohya"))


def test_an_sd_scripts_toml_is_converted_beside_it_and_the_editor_gets_ours_which_validates(checked_ui, tiny_set,
                                                                                              tmp_path):
    """Old: the TOML loaded as it is and Validate said "unknown keys ... `python tools/convert_config.py FILE`"."""
    checked_ui.checker.start()  # the UI starts it with itself: the conversion runs in its warm process
    path = sd_scripts_config(tiny_set, tmp_path)
    text, fields, note = checked_ui.load_config(path)
    ours = str(tmp_path / "my_flux_lora_converted.toml")
    assert text == open(ours).read() and text.startswith("# Translated from sd-scripts' ")
    assert toml.loads(text)["dataset_config"] == str(tmp_path / "my_flux_lora_converted_dataset.toml")
    assert (fields["model_type"], fields["network_dim"], fields["max_train_steps"]) == ("flux", "4", "2")
    lines = note.split("\n\n")
    assert lines[0] == (f"Converted from sd-scripts by tools/convert_config.py: wrote `{ours}`, "
                        f"`{ours[:-len('.toml')]}_dataset.toml`")
    assert lines[1].startswith("keys: ") and ", 1 not carried, 0 unknown (the keys not carried" in lines[1], lines[1]
    assert lines[2].startswith("- not carried: `datasets[0].color_aug = True`: ours caches the latents once"), lines[2]
    assert lines[3] == "check: train_lora.py reads it as written"
    answer = checked_ui.check(text, fields)
    assert answer["ok"] is True and answer["max_steps"] == 2, answer
    assert checked_ui.load_config(ours)[2] == ""  # ours, loaded again: no conversion
    # picked, then Load beside the picker: the same report (old: "converted before", the lost keys never shown)
    assert checked_ui.load_config(path) == (text, fields, note)
    # the peer's config edited since (ours not): converted again (old: the stale conversion, network_dim 4)
    with open(path) as f:
        peer = f.read()
    with open(path, "w") as f:
        f.write(peer.replace("network_dim = 4", "network_dim = 16"))
    text, fields, again = checked_ui.load_config(path)
    assert fields["network_dim"] == "16" and text == open(ours).read() and again == note
    # the peer's config picked again: the earlier conversion, edited since, is loaded, not written over (old: lost)
    with open(ours, "a") as f:
        f.write("# my edit\n")
    again, _, note = checked_ui.load_config(path)
    assert again.endswith("# my edit\n") and open(ours).read() == again
    assert note.startswith(f"`{ours}` was converted from `{path}` before (and may hold your edits since)"), note


def test_a_peer_config_outside_the_roots_or_reading_a_file_outside_them_is_refused(ui, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "job.yaml").write_text(FLUX_EXAMPLE)
    with pytest.raises(OutsideRoots, match="^config '.*job.yaml' is outside the folders this UI may open"):
        ui.load_config(str(elsewhere / "job.yaml"))
    # a peer TOML under the roots whose dataset TOML is not: the converter would copy it into ours
    (elsewhere / "my_dataset.toml").write_text('[[datasets]]\nresolution = 64\n')
    (tmp_path / "data" / "mine.toml").write_text(f'sdpa = true\ndataset_config = "{elsewhere / "my_dataset.toml"}"\n')
    with pytest.raises(OutsideRoots, match=r"^data/mine.toml's dataset_config '.*my_dataset.toml' is outside the "):
        ui.load_config("data/mine.toml")
    assert os.listdir(tmp_path / "data") == ["mine.toml"] and not os.path.exists(elsewhere / "job_converted.toml")
    # an ai-toolkit YAML under the roots whose captions are not (old: they were read, and the note said how many
    # held the trigger word: with trigger_word and caption_ext chosen, whether any file outside held a word)
    (elsewhere / "a.txt").write_text("password SECRETWORD")
    (tmp_path / "data" / "job.yaml").write_text(FLUX_EXAMPLE.replace("/path/to/images/folder", str(elsewhere)))
    with pytest.raises(OutsideRoots, match=r"^data/job.yaml's datasets\[0\].folder_path '.*elsewhere' is outside "):
        ui.load_config("data/job.yaml")
    assert sorted(os.listdir(tmp_path / "data")) == ["job.yaml", "mine.toml"]


def test_a_musubi_config_that_does_not_say_its_model_gets_the_converters_line_and_nothing_is_written(ui, tmp_path):
    """The line asked for --model_type alone, which the page has no way to give: it names network_module too,
    the key that, added to the TOML, loads it."""
    (tmp_path / "data" / "musubi.toml").write_text('dit = "dit.safetensors"\nvae = "vae.safetensors"\n')
    with pytest.raises(ValueError) as refused:
        ui.load_config("data/musubi.toml")
    assert str(refused.value).startswith("data/musubi.toml: musubi-tuner's config does not say the model (its training "
                                         "script does): add its network_module to it (networks.lora_"), refused.value
    assert os.listdir(tmp_path / "data") == ["musubi.toml"]
    (tmp_path / "data" / "musubi.toml").write_text('dit = "dit.safetensors"\nvae = "vae.safetensors"\n'
                                                   'network_module = "networks.lora_zimage"\n')
    assert ui.load_config("data/musubi.toml")


def test_a_dataset_toml_loads_as_it_is(ui, tmp_path):
    """Its keys (caption_extension, ...) are sd-scripts' arguments too: it was taken for an sd-scripts config and
    converted."""
    dataset = "[general]\ncaption_extension = \".txt\"\n\n[[datasets]]\nresolution = 64\n"
    (tmp_path / "data" / "dataset.toml").write_text(dataset)
    assert ui.load_config("data/dataset.toml")[::2] == (dataset, "")
    assert os.listdir(tmp_path / "data") == ["dataset.toml"]


def test_the_config_picker_lists_yaml_and_load_converts_it_with_the_note_under_the_editor(ui, tiny_set, tmp_path):
    """An ai-toolkit YAML through the page's events: picked, converted (our config, dataset TOML and prompts beside
    it), the editor and the fields ours, the note shown under the editor; a config of ours then hides it."""
    from library.ui.app import build_app
    from tests.test_webui_handlers import block, event, run

    images = shutil.copytree(tiny_set["image_dir"], tmp_path / "data" / "images")  # its captions: read, under the roots
    text = (FLUX_EXAMPLE.replace("/path/to/images/folder", str(images))
            .replace("black-forest-labs/FLUX.1-dev", flux_pipeline_folder(tiny_set, tmp_path)))
    (tmp_path / "data" / "job.yml").write_text(text)
    (tmp_path / "data" / "ours.toml").write_text("network_dim = 8\n")
    app = build_app(ui)
    picker = next(b for b in app.blocks.values() if isinstance(b, gr.Dropdown) and b.label.startswith("start from"))
    assert {"data/job.yml", "data/ours.toml"} <= {value for _, value in picker.choices}
    load, note = event(app, "click", api_name="load_config"), block(app, "converted-note")
    shown = next(fn for fn in app.fns.values() if fn.outputs == [note] and fn.inputs[0] in load.outputs)
    editor, fields = load.outputs[0], dict(zip(FORM_KEYS, load.outputs[1:]))
    values = {load.inputs[0]._id: "data/job.yml"}
    for fn in (load, shown):
        run(fn, values)
    written = ["data/job_converted.toml", "data/job_converted_dataset.toml", "data/job_converted_prompts.txt"]
    assert all((tmp_path / name).is_file() for name in written)
    assert values[editor._id] == (tmp_path / written[0]).read_text()
    assert (values[fields["model_type"]._id], values[fields["sample_prompts"]._id]) == ("flux", written[2])
    assert values[note._id]["visible"] and values[note._id]["value"].startswith(
        "Converted from ai-toolkit by tools/convert_config.py: wrote " + ", ".join(f"`{n}`" for n in written)
        + "\n\nkeys: "), values[note._id]
    values[load.inputs[0]._id] = "data/ours.toml"
    for fn in (load, shown):
        run(fn, values)
    assert not values[note._id]["visible"] and values[editor._id] == "network_dim = 8\n"
