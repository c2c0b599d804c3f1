"""The Jobs tab's config form (library/ui/app.py's job_form, save_row; handlers.py's open / save / check of a
config) called in this process, without a server: what a field, the TOML editor, Load, Save TOML and Apply
leave in the form and write to the file (tests/test_webui_handlers.py: the other pages)."""

from __future__ import annotations

import gradio as gr
import pytest
import toml

from tests.test_webui_handlers import event, run, ui  # noqa: F401 (ui: the pages' fixture, a WebUI on tmp_path)


def test_the_forms_dropdowns_take_a_loaded_configs_value_and_retry_asks_what_it_removes(ui):
    """Old: a loaded model_type "flux1" (or base_precision "fp4") failed every action that sent the form inside
    gradio ("Value: flux1 is not in the list of choices"), before the check could name it under its field."""
    from library.ui.app import CONFIRM_QUESTIONS, LABELS, build_app

    app = build_app(ui)
    dropdowns = {block.label: block for block in app.blocks.values() if type(block).__name__ == "Dropdown"}
    for key, typo in (("model_type", "flux1"), ("base_precision", "fp4"), ("optimizer_type", "Adam")):
        assert dropdowns[LABELS[key]].preprocess(typo) == typo
    assert "LoRAs, samples, saved state and logs are removed" in CONFIRM_QUESTIONS["retry"]
    api = {fn.api_name: fn for fn in app.fns.values()}
    assert len(api["retry_job"].inputs) == len(api["delete_job"].inputs) == 2  # the job and its confirmation


def test_huge_integers_are_refused_under_their_field(ui):
    answer = ui.create("big", "", {"max_train_steps": "1e30"}, queue=True)
    assert answer == {"ok": False, "key": "max_train_steps",
                      "error": f"config: key 'max_train_steps' must be between -1000000000000000 and 1000000000000000, "
                               f"got {int(1e30)}"}
    answer = ui.check("seed = 99999999999999999999\n", {})
    assert answer["key"] == "seed" and answer["error"].endswith("got 99999999999999999999")
    assert ui.store.list() == []


def test_applying_a_plan_keeps_the_configs_comments_tables_and_keys(ui):
    """Old: Apply replaced the editor's text with every key flattened (comments and tables gone, the
    form's fields written in); now the suggested keys are set where the text writes them."""
    text = ('# my run\n[precision]\nfp8_base = true   # the older spelling\nfp8_scaled = true\n\n[memory]\n'
            'blocks_to_swap = 8   # my card\n[network]\nnetwork_dim = 16\n')
    keys = {"gradient_checkpointing": True, "blocks_to_swap": 2, "base_precision": "bf16"}
    new_text, fields = ui.apply_plan(text, {"network_dim": "32"}, keys)
    assert new_text == ('# my run\ngradient_checkpointing = true\nbase_precision = "bf16"\n\n[precision]\n\n'
                        '[memory]\nblocks_to_swap = 2  # my card\n[network]\nnetwork_dim = 16\n')
    assert fields["base_precision"] == "bf16" and fields["network_dim"] == "32"  # the user's field stays


def test_a_loaded_config_saved_back_is_the_same_file_and_a_changed_field_is_set_in_place(ui, tmp_path):
    """There was no way to save a config from the page (only a job's flattened config.toml, its comments
    and tables gone): Save TOML writes the editor's text with the changed fields set where it has them."""
    text = ('# my run\n[model]\nmodel_type = "flux"\nae = \'vae #2.safetensors\'  # a literal string\n\n[precision]\n'
            'fp8_base = true   # older spelling\n[network]\nnetwork_dim = 8   # rank\nnetwork_alpha = 8\n')
    source = tmp_path / "data" / "mine ü.toml"
    source.write_text(text)
    loaded_text, fields, _ = ui.load_config(str(source))
    copy = ui.save_config(str(tmp_path / "data" / "copy.toml"), loaded_text, fields)
    assert open(copy).read() == text
    fields.update(network_dim="16", base_precision="bf16", ae="vae.safetensors")
    ui.save_config(copy, loaded_text, fields)
    assert open(copy).read() == ('# my run\nbase_precision = "bf16"\n\n[model]\nmodel_type = "flux"\n'
                                 'ae = "vae.safetensors"  # a literal string\n\n[precision]\n'
                                 '[network]\nnetwork_dim = 16  # rank\nnetwork_alpha = 8\n')
    job = ui.store.create("mine", {"model_type": "flux"}, 2, queue=False)
    for path, expected in (("/etc/x.toml", "save to '/etc/x.toml' is outside the folders"),
                           (str(tmp_path / "data" / "x.txt"), "give a .toml file under the roots"),
                           # accepted, then written over by the job's own config at its launch
                           (job.config_path, "that is in the jobs folder, whose files the UI writes")):
        with pytest.raises(ValueError, match=expected):
            ui.save_config(path, loaded_text, fields)


def test_the_planners_caching_advice_is_applied_with_its_setting(ui, monkeypatch):
    """Old: Apply set the fitting row's keys alone; the report's caching advice (a run that fits the card in
    training stops in caching) was left for the user to read and type."""
    from library.ui import commands

    report = ("  caching   4.10 GiB ...\n"
              "  caching does not fit a 16 GiB card (usable 14.6): set vae_batch_size = 2 and "
              'text_encoder_precision = "fp8"\n'
              "\nOn a 16 GiB card (usable 14.6 GiB), training:\n"
              "  bf16       gradient_checkpointing=true : fits with blocks_to_swap = 4 (peak 14.1 GiB)\n")
    monkeypatch.setattr(commands, "run_tool", lambda *args, **keywords: commands.Result(True, report, report))
    answer = ui.plan("preset", "flux1-dev", 16, "", "", "", {})
    assert answer["suggested"] == {"gradient_checkpointing": True, "blocks_to_swap": 4, "base_precision": "bf16",
                                   "vae_batch_size": 2, "text_encoder_precision": "fp8"}
    text, _ = ui.apply_plan("[caching]\nvae_batch_size = 4\n", {}, answer["suggested"])
    assert toml.loads(text)["caching"]["vae_batch_size"] == 2 and toml.loads(text)["text_encoder_precision"] == "fp8"
    # what no key fixes sets none
    unfixable = report.replace('set vae_batch_size = 2 and text_encoder_precision = "fp8"',
                               "set a smaller resolution (the VAE encode of one image is over)")
    assert commands.caching_keys(unfixable) == {} and commands.caching_keys("") == {}


def test_the_planners_suggestion_line_is_toml_to_copy():
    """Old: `base_precision = nf4` (a string unquoted: no TOML), as the report's own lines never write it."""
    from library.ui.app import plan_note

    suggested = {"gradient_checkpointing": True, "blocks_to_swap": 4, "base_precision": "nf4",
                 "text_encoder_precision": "fp8"}
    note = plan_note({"ok": True, "suggested": suggested})
    assert note == ('**Suggested:** `gradient_checkpointing = true`, `blocks_to_swap = 4`, `base_precision = "nf4"`, '
                    '`text_encoder_precision = "fp8"`')
    assert toml.loads("\n".join(note.split("`")[1::2])) == suggested
    assert plan_note({"ok": False, "suggested": None}) == "**Plan failed.**"


def test_a_changed_steps_field_under_the_tomls_max_train_epochs_is_refused_under_it(ui, tmp_path):
    """Old: the form's steps went into the config beside the file's max_train_epochs, which overrides them:
    Validate said ok and the job trained the epochs (the CLI refuses --max_train_steps there)."""
    text = "max_train_epochs = 2\nmax_train_steps = 120\n"
    refused = {"ok": False, "key": "max_train_steps",
               "error": "form: steps (max_train_steps) 2 would be ignored: max_train_epochs = 2 in the TOML overrides "
                        "it; remove max_train_epochs from the TOML to train 2 steps"}
    assert ui.check(text, {"max_train_steps": "2"}) == refused
    assert ui.create("epochs", text, {"max_train_steps": "2"}, queue=True) == refused and ui.store.list() == []
    with pytest.raises(ValueError, match="would be ignored: max_train_epochs = 2"):
        ui.save_config(str(tmp_path / "data" / "x.toml"), text, {"max_train_steps": "2"})
    # the steps field as Load filled it keeps the file's epochs; without max_train_epochs the steps are the form's
    assert ui.settings(text, {"max_train_steps": "120"}) == {"max_train_epochs": 2, "max_train_steps": 120}
    assert ui.settings("max_train_steps = 120\n", {"max_train_steps": "2"}) == {"max_train_steps": 2}


class RecordingChecker:
    """A config checker that answers `answer` and keeps the configs it was asked about (no helper process)."""

    def __init__(self, answer: dict):
        self.answer, self.asked = answer, []

    def check(self, text: str, output_dir: str, roots=None) -> dict:
        self.asked.append(toml.loads(text))
        return dict(self.answer)

    def start(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_a_field_set_back_to_its_load_time_value_after_apply_is_what_the_job_gets(ui, tmp_path):
    """Old: Load (base precision fp8_scaled), Apply a plan's base_precision = "bf16", then pick fp8_scaled again:
    the page showed fp8_scaled but the field equalled its Load-time value, so it was dropped as untouched and the
    job trained the TOML's bf16."""
    from library.ui.app import build_app
    from library.ui.handlers import FORM_KEYS

    config = tmp_path / "data" / "run.toml"
    config.write_text('base_precision = "fp8_scaled"\nnetwork_dim = 8\n')
    ui.checker = RecordingChecker({"ok": True, "max_steps": 1})
    app = build_app(ui)
    load, apply, validate = (event(app, "click", api_name=n) for n in ("load_config", "apply_plan", "validate"))
    values = {load.inputs[0]._id: str(config)}
    run(load, values)
    field = {k: block._id for k, block in zip(FORM_KEYS, validate.inputs[1:])}
    assert values[field["base_precision"]] == "fp8_scaled"
    values[apply.inputs[0]._id] = {"blocks_to_swap": 0, "base_precision": "bf16"}  # the plan's suggestion
    run(apply, values)
    assert values[field["base_precision"]] == "bf16"
    run(validate, values)
    assert ui.checker.asked[-1]["base_precision"] == "bf16"  # Apply's value, as the page shows it
    values[field["base_precision"]] = "fp8_scaled"  # picked again
    run(validate, values)
    assert ui.checker.asked[-1]["base_precision"] == "fp8_scaled" and ui.checker.asked[-1]["blocks_to_swap"] == 0


def test_a_saved_config_is_no_unsaved_edit_when_another_is_picked(ui, tmp_path):
    """Old: after Save TOML to the loaded file, picking another config still said "the form has unsaved edits
    (the TOML) ... or Save TOML first": the edit was compared with the text as first loaded."""
    from library.ui.app import build_app
    from library.ui.handlers import FORM_KEYS

    first, second = tmp_path / "data" / "first.toml", tmp_path / "data" / "second.toml"
    first.write_text("network_dim = 8\nmax_train_steps = 6\n")
    second.write_text("network_dim = 8\nmax_train_steps = 7\n")
    app = build_app(ui)
    pick, save = event(app, "change", api_name="pick_config"), event(app, "click", api_name="save_config")
    values = {block._id: block.value for block in pick.inputs if isinstance(block, gr.State)}  # as a page starts
    values[pick.inputs[0]._id] = str(first)
    run(pick, values)
    text = pick.inputs[1]._id
    values[text] = values[text].replace("max_train_steps = 6", "max_train_steps = 3")
    values[pick.inputs[0]._id] = str(second)  # refused: "the form has unsaved edits ... or Save TOML first"
    refused, note = dict(values), pick.outputs[1 + len(FORM_KEYS)]._id
    run(pick, refused)  # its other outputs gr.update(): the page keeps them
    values[note] = refused[note]
    assert values[note]["visible"] and "or Save TOML first" in values[note]["value"], values[note]
    values[save.inputs[0]._id] = str(first)  # save to the file loaded
    run(save, values)
    assert first.read_text() == "network_dim = 8\nmax_train_steps = 3\n"
    assert not values[note]["visible"], "the note asking to save stayed after the save"
    run(pick, values)
    assert not values[note]["visible"] and "max_train_steps = 7" in values[text], values[note]


def test_optimizer_args_that_do_not_fit_are_shown_beside_the_optimizer_field(ui):
    """Old: the error's key, optimizer_args, has no field: the line went under the TOML editor."""
    from library.ui.app import build_app
    from library.ui.handlers import FORM_KEYS

    error = "config: optimizer_args (d0=0.003) do not fit AdamW: AdamW.__init__() got an unexpected keyword argument 'd0'"
    ui.checker = RecordingChecker({"ok": False, "key": "optimizer_args", "error": error})
    validate = event(build_app(ui), "click", api_name="validate")
    values = {validate.inputs[-2]._id: {}, validate.inputs[-1]._id: []}  # nothing loaded, nothing typed
    run(validate, values)
    notes = {k: values[block._id] for k, block in zip([*FORM_KEYS, "toml"], validate.outputs[1:])}
    assert {k: note["value"] for k, note in notes.items() if note["visible"]} == {"optimizer_type": f"⚠ {error}"}


def test_a_tab_saving_a_config_another_tab_saved_since_it_loaded_it_is_refused(ui, tmp_path):
    """Old: two tabs loaded one config; the first saved its steps edit, then the second saved its rank edit over
    it without a word (its editor still held the old steps): the first tab's edit was gone."""
    from library.ui.app import build_app

    config = tmp_path / "data" / "run.toml"
    config.write_text("network_dim = 8\nmax_train_steps = 6\n")
    app = build_app(ui)
    pick, save = event(app, "change", api_name="pick_config"), event(app, "click", api_name="save_config")
    text = pick.inputs[1]._id
    tabs = []
    for _ in range(2):  # two tabs, each picks the config as a page starts
        values = {block._id: block.value for block in {*pick.inputs, *save.inputs} if isinstance(block, gr.State)}
        values.update({pick.inputs[0]._id: str(config), save.inputs[0]._id: str(config)})
        run(pick, values)
        tabs.append(values)
    first, second = tabs
    first[text] = first[text].replace("max_train_steps = 6", "max_train_steps = 3")
    run(save, first)
    assert config.read_text() == "network_dim = 8\nmax_train_steps = 3\n"
    second[text] = second[text].replace("network_dim = 8", "network_dim = 4")
    run(save, second)
    assert config.read_text() == "network_dim = 8\nmax_train_steps = 3\n"  # the first tab's edit kept
    said = second[save.outputs[0]._id]
    assert said.startswith(f"⚠ save to {str(config)!r}: the file changed since this page loaded it"), said
    first[text] = first[text].replace("network_dim = 8", "network_dim = 16")  # the tab that saved it saves again
    run(save, first)
    assert config.read_text() == "network_dim = 16\nmax_train_steps = 3\n"


def test_the_fields_follow_an_edited_toml_where_the_user_left_them(ui):
    """An edit in the TOML editor left the field beside it showing the old value (the TOML's won at Create, unseen).
    Leaving the editor now sets each field Load filled and the user left (or an empty one) from the TOML; a field
    the user changed keeps its value; text that is no config TOML changes nothing."""
    from library.ui.app import build_app
    from library.ui.handlers import FORM_KEYS, form_values_of

    on_toml_edit = {fn.api_name: fn for fn in build_app(ui).fns.values()}["fields_from_toml"].fn
    order = list(FORM_KEYS)
    loaded = form_values_of('model_type = "flux"\nmax_train_steps = 100\nlearning_rate = 1e-3\n')
    shown = {**loaded, "learning_rate": "5e-4"}  # the user's edit of one field
    edited = 'model_type = "flux"\nmax_train_steps = 500\nlearning_rate = 2e-3\nnetwork_dim = 16\nfp8_base = true\n'
    *fields, now_loaded = on_toml_edit(edited, *[shown[k] for k in order], loaded)
    got = dict(zip(order, fields))
    assert (got["max_train_steps"], got["network_dim"], got["base_precision"]) == ("500", "16", "fp8_scaled")
    assert got["learning_rate"] == gr.update() and now_loaded["learning_rate"] == "0.001"  # still the user's
    assert now_loaded["max_train_steps"] == "500"  # followed: Create leaves it to the TOML, as shown
    assert on_toml_edit("max_train_steps = ", *[shown[k] for k in order], loaded) == [gr.update()] * (len(order) + 1)


def test_a_field_load_filled_and_the_user_emptied_removes_its_key(ui, tmp_path):
    """Old: emptying a field Load had filled kept the TOML's value (an empty field leaves the TOML's key), so a user
    who emptied "sample every N steps" still sampled, unseen. Now its key goes: Validate and the job run without it,
    Save TOML removes its line, Apply keeps the field empty; a field Load left empty and the user too, or one the
    user left as Load filled it, still leaves the TOML's key."""
    from library.ui.app import edited
    from library.ui.handlers import CLEARED, FORM_KEYS

    text = 'model_type = "flux"\nmax_train_steps = 100\nsample_every_n_steps = 50  # often\nnetwork_dim = 8\n'
    source = tmp_path / "data" / "run.toml"
    source.write_text(text)
    loaded_text, loaded, _ = ui.load_config(str(source))
    order = list(FORM_KEYS)
    shown = {**loaded, "sample_every_n_steps": "", "ae": "", "max_train_steps": ""}  # ae: Load filled None
    # emptied, typed in (left empty); max_train_steps: not typed in, as a click right after a TOML edit sends a
    # field that follows the TOML before the editor's blur filled it (8e16e39e cleared it: reverted)
    form = edited(order, (*[shown[k] for k in order], loaded, ["sample_every_n_steps", "ae"]))
    assert form == {"sample_every_n_steps": CLEARED, "ae": "", "max_train_steps": ""}
    settings = ui.settings(loaded_text, form)
    assert "sample_every_n_steps" not in settings and (settings["max_train_steps"], settings["network_dim"]) == (100, 8)
    _, fields = ui.apply_plan(loaded_text, form, {"network_dim": 4})
    assert fields["sample_every_n_steps"] == "" and fields["network_dim"] == 4  # (the plan's key as it sets it)
    ui.save_config(str(source), loaded_text, form)
    assert source.read_text() == 'model_type = "flux"\nmax_train_steps = 100\nnetwork_dim = 8\n'
