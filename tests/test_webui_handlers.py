"""The pages' handlers (library/ui/handlers.py) called in this process, without a server: what they
write, and the one clear line they answer to bad input."""

from __future__ import annotations

import os
import re
import shutil
import time

import gradio as gr
import pytest
import toml

from library.ui.config_check import ConfigChecker
from library.ui.handlers import KEEP_PRECISION, WebUI
from tests.ui_support import block, event, run


@pytest.fixture()
def ui(tmp_path):
    (tmp_path / "data").mkdir()
    ui = WebUI(str(tmp_path / "jobs"), str(tmp_path), [str(tmp_path / "data")])
    yield ui
    ui.close()  # its config checker process, if a test started it


@pytest.fixture(scope="module")
def checker(tmp_path_factory):
    """One config checker process for the module's tests that check a config (its start imports torch and
    the model code: seconds each), in a folder of its own, where relative paths resolve."""
    checker = ConfigChecker(os.path.realpath(tmp_path_factory.mktemp("checker_workdir")))
    yield checker
    checker.close()


def test_the_checker_imports_torch_and_the_model_code_before_its_first_request(checker):
    """The helper imported them at its first check: the UI starts it with itself, yet the first Validate or
    Queue waited for the imports (the browser test's first queue: 20-30 s on 2 cores). Now it imports them
    while no request is asked: libtorch is in the idle helper (the module's checker, started here: the later
    tests' checks are its requests)."""
    assert checker.process is None, "the module's first test: its checker has had no request yet"
    checker.start()
    maps = f"/proc/{checker.process.pid}/maps"
    deadline = time.time() + 240
    while time.time() < deadline and "libtorch_cpu" not in open(maps).read():
        time.sleep(0.2)
    assert "libtorch_cpu" in open(maps).read(), "the idle helper did not import torch"


def test_a_checker_that_dies_leaves_its_reason_on_the_uis_terminal(tmp_path, capfd):
    """The answer says "see the UI's terminal", but the helper's stderr went to /dev/null: why it died (a torch
    that does not import, a traceback) was nowhere."""
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\necho 'cannot import torch: a broken install' >&2\nexit 1\n")
    python.chmod(0o755)
    checker = ConfigChecker(str(tmp_path), str(python))
    try:
        answer = checker.check("model_type = 'flux'\n", str(tmp_path / "out"))
    finally:
        checker.close()
    assert answer["error"] == "the config checker process exited; see the UI's terminal", answer
    assert "cannot import torch: a broken install" in capfd.readouterr().err


@pytest.fixture()
def checked_ui(tiny_set, tmp_path, checker):
    """A WebUI on the tiny set and tmp_path whose config checks go to the module's one checker."""
    ui = WebUI(str(tmp_path / "jobs"), checker.workdir, [tiny_set["root"], str(tmp_path), checker.workdir])
    ui.checker = checker
    yield ui
    ui.runner.close()  # the checker stays up for the next test


def test_the_planner_names_the_forms_config_and_a_missing_lora_weight_is_one_line(ui, monkeypatch, tmp_path):
    """Old: the planner's errors named the temporary TOML it wrote the form's config to, deleted by then; a
    None weight (a cleared slider, an API call) to merge / generate was a TypeError traceback."""
    from library.ui import commands

    monkeypatch.setattr(commands, "run_tool", lambda script, args, *rest, **keywords: commands.Result(
        False, f"error: {args[1]}: unknown key 'bogus_key'"))
    monkeypatch.setattr(ui.checker, "check", lambda *args, **keywords: {"ok": True})  # the roots' check: inside
    assert ui.plan("the job form's config", "", 24, "", "", "bogus_key = 1\n", {})["report"] == (
        "error: the job form's config: unknown key 'bogus_key'")
    lora = str(tmp_path / "data" / "a.safetensors")
    job = ui.store.create("g", {"model_type": "flux", "pretrained_model_name_or_path": "m", "ae": "a",
                                "output_name": "lora"}, 5)
    merge = {"model": lora, "save_to": "m.safetensors", "save_precision": "bf16"}
    generate = {"job_id": job.id, "prompt": "a", "width": 64, "steps": 2}
    for tool, values, field in (("merge_lora", merge, "weight"), ("generate", generate, "LoRA weight")):
        for weight in (None, "abc", float("nan")):
            answer = ui.lora_tool(tool, {**values, "lora": lora, "weight": weight})
            assert answer == {"ok": False, "output": f"{field}: give a number, got {weight!r}", "image": None}


def test_plan_reads_nothing_outside_the_roots(ui, tmp_path, monkeypatch):
    """Old: Validate refused a config naming a model or dataset folder outside the roots, but Plan ran
    plan_memory.py on it: the report was built from that file's header and those images."""
    from library.ui import commands, config_check

    monkeypatch.setattr(ui.checker, "check", config_check.check)  # the helper's function, in this process
    monkeypatch.setattr(commands, "run_tool", lambda *args, **keywords: pytest.fail("the planner ran"))
    outside = tmp_path / "outside"
    outside.mkdir()
    config = {"model_type": "flux", "pretrained_model_name_or_path": str(tmp_path / "data" / "m.safetensors"),
              "ae": "data/ae.safetensors", "clip_l": "data/clip", "t5xxl": "data/t5",
              "dataset_config": "data/dataset.toml"}
    monkeypatch.chdir(tmp_path)  # the helper runs in the UI's working folder
    for changed, images, key, path in (
            ({"pretrained_model_name_or_path": str(outside / "m.safetensors")}, "data/images",
             "pretrained_model_name_or_path", outside / "m.safetensors"),
            ({}, str(outside), "dataset_config", outside)):
        (tmp_path / "data" / "dataset.toml").write_text(toml.dumps(
            {"datasets": [{"resolution": 64, "subsets": [{"image_dir": images}]}]}))
        answer = ui.plan("the job form's config", "", 24, "", "", toml.dumps({**config, **changed}), {})
        assert answer["ok"] is False and f"config: key '{key}': " in answer["report"], answer
        assert f"{str(path)!r} is outside the folders this UI may open" in answer["report"], answer


def test_every_job_picker_lists_the_jobs_made_since_the_ui_started_when_opened(ui):
    """Old: the queue's, the comparison's (and the test image's) job pickers held the jobs of the UI's start: a page
    opened later listed none of those the queue table showed, until a timer's refresh (2 s; 10 s for the
    comparison's)."""
    from library.ui.app import build_app

    app = build_app(ui)  # as the UI starts: no job yet
    job = finished_job(ui)
    pickers = [b for b in app.blocks.values() if isinstance(b, gr.Dropdown) and str(b.label).startswith("job")]
    assert len(pickers) == 5 and all(b.choices == [] for b in pickers)
    for picker in pickers:
        opened = event(app, "focus", picker.elem_id) if picker.elem_id else next(
            fn for fn in app.fns.values() if (picker._id, "focus") in fn.targets)
        assert opened.fn()["choices"] == [(f"{job.id}: a (failed)", str(job.id))], picker.label


def test_a_confirmation_names_its_job_and_yes_acts_on_that_job_whatever_is_picked_since(ui):
    """Old: Delete… asked "Delete the job…?" naming none, and Yes deleted whichever job was picked when it was
    pressed: picking another job to look at it, then Yes, deleted that one."""
    from library.ui.app import build_app

    kept, asked = finished_job(ui), finished_job(ui)
    app = build_app(ui)
    pick = block(app, "job-pick")
    values = {pick._id: str(asked.id)}
    run(event(app, "click", "job-delete"), values)
    values[pick._id] = str(kept.id)  # looked at another job before answering
    run(event(app, "click", "job-delete-confirm"), values)
    assert [job.id for job in ui.store.list()] == [kept.id] and os.path.isdir(kept.output_dir)
    question = block(app, "job-delete-question")
    assert values[question._id].startswith(f"Delete **job {asked.id} (a, failed)** and its output folder")
    other = finished_job(ui)  # both questions up: each Yes acts on the job its own question names
    values[pick._id] = str(kept.id)
    run(event(app, "click", "job-retry"), values)
    values[pick._id] = str(other.id)
    run(event(app, "click", "job-delete"), values)
    run(event(app, "click", "job-retry-confirm"), values)
    assert (ui.store.get(kept.id).state, ui.store.get(other.id).state) == ("queued", "failed")
    values[pick._id] = ""
    run(event(app, "click", "job-retry"), values)  # nothing picked: no question, the refusal
    assert values[block(app, "action-result")._id] == {"ok": False, "error": "job '': not a job number; pick a job in the list"}


def test_a_file_is_written_through_a_fresh_temporary_and_a_root_of_slash_holds_every_path(tmp_path):
    """write_whole wrote through '<path>.tmp', following a link placed there (out of the roots); --root /
    refused every path (its prefix '//' matched none)."""
    from library.ui.config_check import inside
    from library.ui.files import Roots, write_whole

    (tmp_path / "outside").mkdir()
    (tmp_path / "data").mkdir()
    victim = tmp_path / "outside" / "victim.toml"
    victim.write_text("kept")
    os.symlink(victim, tmp_path / "data" / "x.toml.tmp")
    write_whole(str(tmp_path / "data" / "x.toml"), "a = 1\n")
    assert victim.read_text() == "kept" and (tmp_path / "data" / "x.toml").read_text() == "a = 1\n"
    assert not os.path.islink(tmp_path / "data" / "x.toml")
    assert Roots(["/"], str(tmp_path)).resolve("/etc/hostname") == os.path.realpath("/etc/hostname")
    assert inside("/etc/hostname", ["/"]) and not inside("/etc/hostname", [str(tmp_path)])


def test_a_root_below_another_lists_its_files_once(tmp_path):
    """Old: `--root data --root data/set` listed every file of data/set twice in each picker."""
    from library.ui.files import Roots

    (tmp_path / "data" / "set").mkdir(parents=True)
    (tmp_path / "data" / "set" / "dataset.toml").write_text("")
    (tmp_path / "data" / "other.toml").write_text("")
    roots = Roots(["data", "data/set"], str(tmp_path))
    assert roots.listing((".toml",)) == [os.path.join("data", "other.toml"), os.path.join("data", "set", "dataset.toml")]
    # a default root given again with --root: named twice in the "outside the folders" line
    assert Roots(["data", str(tmp_path / "data"), "data/"], str(tmp_path)).roots == [str(tmp_path / "data")]


def test_a_picker_over_its_limit_lists_the_newest_files(tmp_path, monkeypatch):
    """Old: the first 400 files in walk order, the jobs folder (the last root) last: 150 jobs' LoRAs listed up to
    job 117, the newest jobs' none, without a word."""
    from library.ui.files import Roots

    for i in range(6):
        (tmp_path / "data").mkdir(exist_ok=True), (tmp_path / "jobs" / f"job-{i}").mkdir(parents=True)
        (tmp_path / "data" / f"old-{i}.safetensors").write_text("")
        os.utime(tmp_path / "data" / f"old-{i}.safetensors", (1e9 + i, 1e9 + i))
        (tmp_path / "jobs" / f"job-{i}" / "lora.safetensors").write_text("")
        os.utime(tmp_path / "jobs" / f"job-{i}" / "lora.safetensors", (2e9 + i, 2e9 + i))
    roots = Roots(["data", "jobs"], str(tmp_path))
    assert len(roots.listing((".safetensors",))) == 12
    assert roots.listing((".safetensors",), limit=4) == [os.path.join("jobs", f"job-{i}", "lora.safetensors")
                                                          for i in (2, 3, 4, 5)]
    # a huge first root ("/", a folder of 20k images) stops its own walk: old, the jobs root after it was cut
    # to its first folder, and no job's LoRA was listed
    monkeypatch.setattr("library.ui.files.WALK_LIMIT", 6)
    assert sum(shown.startswith("jobs") for shown in roots.listing((".safetensors",))) == 6


def finished_job(ui):
    job = ui.store.create("a", {"output_name": "lora"}, 5, queue=True)
    ui.store.claim_next("cpu")
    ui.store.update(job.id, state="failed", message="boom")
    return job


def test_retrying_a_job_whose_folder_was_removed_or_replaced(ui):
    job = finished_job(ui)
    shutil.rmtree(job.output_dir)
    assert ui.act("retry", job.id, confirm=True) == {"ok": True, "job_id": job.id, "state": "queued", "message": ""}
    assert os.path.isdir(job.output_dir)  # made again: the trainer's config goes there at launch

    other = finished_job(ui)
    shutil.rmtree(other.output_dir)
    open(other.output_dir, "w").close()  # a file where its folder was: it cannot be cleared
    answer = ui.act("retry", other.id, confirm=True)
    assert answer == {"ok": False, "error": f"job {other.id}: its output folder {other.output_dir!r} is not a folder; "
                                            f"remove what is there"}
    assert ui.store.get(other.id).state == "failed"  # left as it was


def test_retry_removes_a_jobs_files_only_when_confirmed(ui):
    """Old: Retry on a done job removed its LoRA, samples, state and log at once, unasked (Delete asked)."""
    job = finished_job(ui)
    ui.store.update(job.id, state="done")
    files = ["config.toml", "lora.safetensors", "lora_log.csv", "train.log"]
    for name in files:
        open(os.path.join(job.output_dir, name), "w").close()
    assert ui.act("retry", job.id) == {"ok": False, "error": f"job {job.id}: confirm to retry it from the start: its "
                                                             f"LoRAs, samples, saved state and logs are removed"}
    assert sorted(os.listdir(job.output_dir)) == sorted(files) and ui.store.get(job.id).state == "done"
    assert ui.act("retry", job.id, confirm=True)["state"] == "queued"
    assert os.listdir(job.output_dir) == ["config.toml"]


def test_a_file_where_a_new_jobs_folder_goes_is_passed_over(ui, monkeypatch):
    """Old: a NameError ('job' used before it was assigned) out of the Create button, the row kept; then one error
    line, and every Create failed until the file went. The id is passed over now, the file left alone."""
    open(ui.store.job_folder(1), "w").close()
    monkeypatch.setattr(ui, "check", lambda text, form: {"ok": True, "settings": {}, "max_steps": 1})
    answer = ui.create("a", "", {}, queue=True)
    assert answer["ok"] and [job.id for job in ui.store.list()] == [2]
    assert os.path.isfile(ui.store.job_folder(1)) and os.path.isdir(ui.store.job_folder(2))


def test_the_planner_and_the_lora_tools_answer_bad_fields_in_one_line(ui, tmp_path):
    def report(vram=24, resolution=1024, batch=1, source="preset", text=""):
        answer = ui.plan(source, "flux1-dev", vram, resolution, batch, text, {})
        assert answer["ok"] is False and answer["suggested"] is None
        return answer["report"]

    assert report(vram=None) == "card memory (GiB): give a number > 0, got None"
    assert report(resolution=0) == "resolution (px): give a whole number >= 64, got 0"  # not the preset's default
    assert report(batch=0) == "batch size: give a whole number >= 1, got 0"
    for preset in (None, ""):  # the dropdown cleared: plan_memory.py said "error: None: config file not found"
        assert ui.plan("preset", preset, 24, 1024, 1, "", {})["report"] == (
            "released model (preset): pick one, or plan the job form's config")
    assert report(source="the job form's config", text="x = ").startswith("config: not valid TOML")
    # toml's IndexError for an inline table left open escaped every handler (2026-11-27)
    assert report(source="the job form's config", text="optimizer_args = {d0 = 1").startswith("config: not valid TOML")
    assert ui.check("optimizer_args = {d0 = 1", {})["error"].startswith("config: not valid TOML: cannot be read")
    lora = str(tmp_path / "data" / "a.safetensors")
    for rank in (None, "", 2.5, 2**70):
        answer = ui.lora_tool("resize_lora", {"lora": lora, "save_to": "r.safetensors", "new_rank": rank})
        assert answer == {"ok": False, "output": f"new rank: give a whole number >= 1, got {rank!r}", "image": None}


def test_a_loaded_config_the_cli_refuses_is_refused_with_its_line_and_unchanged_keeps_its_keys(checked_ui, tiny_set,
                                                                                                 tmp_path):
    """The form's fields, filled by Load, used to be written back over the TOML: max_train_steps = "12"
    (a string: train_lora.py refuses it) became 12, and base_precision = "bf16" beside fp8_base = true
    (refused as contradicting) dropped the fp8 keys; both were queued. An unchanged config is kept key
    for key (fp8_base / fp8_scaled were rewritten as base_precision)."""
    from library.training.config import ConfigError, load_config
    from tests.ui_support import tiny_job_settings

    fine = tiny_job_settings(tiny_set, steps=2, fp8_base=True, fp8_scaled=True)
    for changes in ({"max_train_steps": "12"}, {"base_precision": "bf16"}):
        path = tmp_path / "refused.toml"
        path.write_text(toml.dumps({**fine, **changes}))
        with pytest.raises(ConfigError) as cli:
            load_config(["--config_file", str(path)])
        text, fields, _ = checked_ui.load_config(str(path))
        answer = checked_ui.check(text, fields)
        assert answer["ok"] is False and answer["error"] == str(cli.value).replace(str(path), "config")
    path.write_text(toml.dumps(fine))
    answer = checked_ui.create("kept", *checked_ui.load_config(str(path))[:2], queue=False)
    assert toml.loads(checked_ui.store.get(answer["job_id"]).config) == {**fine, "output_dir": answer["output_dir"]}


def test_a_logging_dir_inside_the_configs_output_dir_moves_into_the_jobs_folder(checked_ui, tiny_set, tmp_path):
    """The configs write TensorBoard to "<output_dir>/logs" (output/flux_lora/logs). A job's output_dir
    is its own folder, but its logging_dir stayed "output/flux_lora/logs": every job's events in one
    folder outside the job (and outside the default roots). Now it follows output_dir into the job's
    folder, as the CLI puts it beside the LoRA; a logging_dir elsewhere is kept."""
    from tests.ui_support import tiny_job_settings

    fine = tiny_job_settings(tiny_set, steps=2)
    for logging_dir, expected in (("output/flux_lora/logs", "{job}/logs"), ("tb", "tb")):
        text = toml.dumps({**fine, "output_dir": "output/flux_lora", "logging_dir": logging_dir})
        answer = checked_ui.create("logs", text, {}, queue=False)
        assert answer["ok"] is True, answer
        config = toml.loads(checked_ui.store.get(answer["job_id"]).config)
        assert config["logging_dir"] == expected.format(job=answer["output_dir"]), config


def test_a_string_with_a_backslash_x_reaches_the_job_as_written(checked_ui, tiny_set, tmp_path):
    r"""toml 0.10.2's writer, used for the checked and the queued config, wrote "print('\x41')" as
    "print('\x41')" unescaped: no reader takes that back, so a config train_lora.py runs was refused
    with 'config: not valid TOML: Reserved escape sequence used'."""
    prompt = "print('\\x41')  # C:\\xyz"
    settings = {"model_type": "llm", "pretrained_model_name_or_path": tiny_set["llm"], "max_train_steps": 1,
                "train_data": [tiny_set["corpus"]], "max_length": 32, "stride": 32}
    text = toml.dumps(settings) + f"sample_prompt = '''{prompt}'''\n"  # a literal string, as a person writes it
    answer = checked_ui.create("code", text, {}, queue=False)
    assert answer["ok"] is True, answer
    assert toml.loads(checked_ui.store.get(answer["job_id"]).config)["sample_prompt"] == prompt


def test_generate_refuses_a_reference_image_outside_the_roots(checked_ui, tiny_set, tmp_path, tmp_path_factory):
    """generate's prompt field passed --ci PATH on to tools/generate.py unchecked: an edit model drew a
    file from outside the folders this UI may open."""
    from PIL import Image

    from tests.ui_support import tiny_job_settings

    outside = tmp_path_factory.mktemp("outside") / "secret.png"
    Image.new("RGB", (16, 16)).save(outside)
    job = checked_ui.create("g", toml.dumps(tiny_job_settings(tiny_set, steps=1)), {}, queue=False)["job_id"]
    answer = checked_ui.lora_tool("generate", {"job_id": str(job), "lora": "", "weight": 1.0,
                                               "prompt": f"a cat --ci {outside}", "width": 64, "steps": 1, "seed": 0})
    assert answer["ok"] is False and answer["image"] is None
    assert answer["output"].startswith(f"--ci image {str(outside)!r} is outside the folders"), answer


def test_generate_with_a_blank_seed_lets_generate_draw_one(checked_ui, tiny_set, tmp_path):
    """The page's seed field started at 0 and a blank one was sent as 0: every image drew from seed 0,
    where generate.py (and sd-scripts) draw a random seed when none is given."""
    from tests.ui_support import tiny_job_settings

    job = checked_ui.create("g", toml.dumps(tiny_job_settings(tiny_set, steps=1)), {}, queue=False)["job_id"]
    fields = {"job_id": str(job), "lora": "", "weight": 1.0, "prompt": "a cat", "width": 64, "steps": 1}
    for seed, expected in ((None, None), ("", None), (0, 0), (7, 7)):
        args, _ = checked_ui._tool_args("generate", {**fields, "seed": seed})
        assert (args[args.index("--seed") + 1] if "--seed" in args else None) == expected, (seed, args)


def test_generate_passes_the_jobs_boolean_family_keys(tmp_path):
    """Old: the job config's family keys reached tools/generate.py but its booleans were skipped: a
    krea2_edit job trained with reference_kv_cache = true (another attention mask) drew with false."""
    from library.ui.handlers import WebUI
    from tools.generate import build_parser

    (tmp_path / "data").mkdir()
    ui = WebUI(str(tmp_path / "jobs"), str(tmp_path), [str(tmp_path / "data")])
    for kv_cache in (True, False):
        job = ui.store.create("edit", {"model_type": "krea2_edit", "pretrained_model_name_or_path": "m.safetensors",
                                       "ae": "ae.safetensors", "text_encoder": "te", "reference_kv_cache": kv_cache,
                                       "output_name": "lora"}, 10)
        args, _ = ui._tool_args("generate", {"job_id": job.id, "prompt": "a cat", "width": 64, "steps": 2, "seed": 1,
                                             "lora": None, "weight": 1.0})
        assert build_parser().parse_args([str(a) for a in args]).reference_kv_cache is kv_cache


def test_generate_passes_ae_only_where_the_job_has_one(tmp_path):
    """A job of a model without a VAE file (pixel-space) has no `ae` key: the Generate button failed on it (a
    KeyError), and passes no --ae (tools/generate.py refuses one there)."""
    from library.ui.handlers import WebUI
    from tools.generate import build_parser

    (tmp_path / "data").mkdir()
    ui = WebUI(str(tmp_path / "jobs"), str(tmp_path), [str(tmp_path / "data")])
    base = {"model_type": "flux", "pretrained_model_name_or_path": "m.safetensors", "clip_l": "clip", "t5xxl": "t5",
            "output_name": "lora"}
    for given, expected in (({"ae": "ae.safetensors"}, "ae.safetensors"), ({}, None)):
        job = ui.store.create("g", {**base, **given}, 10)
        args, _ = ui._tool_args("generate", {"job_id": job.id, "prompt": "a cat", "width": 64, "steps": 2, "seed": 1,
                                             "lora": None, "weight": 1.0})
        assert build_parser().parse_args([str(a) for a in args]).ae == expected, args


def test_generate_draws_with_the_jobs_base_loras_before_its_lora(tmp_path):
    """A job trained over base_loras (merged into the frozen base, its samples rendered with them): the Generate
    button drew without them, another base than the LoRA learned on and the samples showed."""
    from library.ui.handlers import WebUI
    from tools.generate import build_parser

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "mine.safetensors").write_bytes(b"")
    ui = WebUI(str(tmp_path / "jobs"), str(tmp_path), [str(tmp_path / "data")])
    job = ui.store.create("g", {"model_type": "flux", "pretrained_model_name_or_path": "m.safetensors",
                                "ae": "ae.safetensors", "clip_l": "clip", "t5xxl": "t5", "output_name": "lora",
                                "base_loras": ["data/dedistill.safetensors:0.5"]}, 10)
    for lora, expected in ((None, ["data/dedistill.safetensors:0.5"]),
                           ("data/mine.safetensors", ["data/dedistill.safetensors:0.5",
                                                      f"{tmp_path / 'data' / 'mine.safetensors'}:0.8"])):
        args, _ = ui._tool_args("generate", {"job_id": job.id, "prompt": "a cat", "width": 64, "steps": 2, "seed": 1,
                                             "lora": lora, "weight": 0.8})
        assert build_parser().parse_args([str(a) for a in args]).lora == expected, args


def test_generate_renders_as_the_job_trained(tmp_path):
    """Old: the Generate button passed --dtype fp32 (the form sends no dtype) and none of the job's memory
    settings: a full-size base trained in bf16 with blocks swapped drew in float32, every block resident."""
    from library.ui.handlers import WebUI
    from tools.generate import build_parser

    (tmp_path / "data").mkdir()
    ui = WebUI(str(tmp_path / "jobs"), str(tmp_path), [str(tmp_path / "data")])
    base = {"model_type": "flux", "pretrained_model_name_or_path": "m.safetensors", "ae": "ae.safetensors",
            "clip_l": "clip", "t5xxl": "t5", "output_name": "lora"}
    for given, device, expected in (
            ({}, None, ("bf16", "bf16", 0, False, None)),
            ({}, "default", ("bf16", "bf16", 0, False, None)),  # tools/webui.py's device without --device
            ({"mixed_precision": "no"}, "cpu", ("fp32", "bf16", 0, False, "cpu")),
            ({"mixed_precision": "bf16", "blocks_to_swap": 2, "text_encoder_precision": "fp8", "vae_tiling": True},
             "cuda:1", ("bf16", "fp8", 2, True, "cuda:1"))):
        job = ui.store.create("g", {**base, **given}, 10, device=device)
        args, _ = ui._tool_args("generate", {"job_id": job.id, "prompt": "a cat", "width": 64, "steps": 2, "seed": 1,
                                             "lora": None, "weight": 1.0})
        parsed = build_parser().parse_args([str(a) for a in args])
        assert (parsed.dtype, parsed.text_encoder_precision, parsed.blocks_to_swap, parsed.vae_tiling,
                parsed.device) == expected, (given, args)


def test_an_llm_jobs_val_loss_from_its_eval_csv_is_in_the_live_view_and_compare(ui):
    """Old: the LLM trainer writes val_loss to <output_name>_eval.csv, not the log CSV the pages read: it never
    showed."""
    job = finished_job(ui)
    with open(job.csv_path, "w") as f:
        f.write("step,epoch,loss,lr/unet\n1,0,2.5,0.001\n2,0,2.25,0.001\n")
    with open(job.eval_csv_path, "w") as f:  # a "start" eval, samples with a comma and a line break
        f.write('step,val_loss,val_perplexity,sample\nstart,3.0,20.1,"a, b"\n2,2.0,7.39,"x\ny"\nfinal,2.0,7.39,z\n')
    loss = ui.live(job.id)["loss"]
    assert loss.values.tolist() == [[1, 2.5, "loss"], [2, 2.25, "loss"], [2, 2.0, "val_loss"]]
    assert ui.compare(job.id, None, "val_loss").values.tolist() == [[2, 2.0, f"{job.id} a: val_loss"]]
    assert ui.live(job.id)["lr"]["series"].tolist() == ["lr/unet", "lr/unet"]


def test_a_planned_setting_applied_to_the_config_is_one_train_lora_loads(checked_ui, tiny_set, tmp_path):
    """Old: the planner's rows tried every base precision and Apply set a row's keys alone: with fp8_compute on an
    fp8_scaled base the bf16 row fit and was applied (refused: fp8_compute needs an fp8 base), and at blocks_to_swap = 0
    block_swap_prefetch stayed, as did checkpoint_saves_attention at gradient_checkpointing = false (each refused: it
    does nothing there). The rows now hold what the trainer accepts with the config, and Apply drops what the
    applied keys leave idle: the applied config loads."""
    from library.training.config import load_config
    from tests.ui_support import tiny_job_settings

    text = toml.dumps(tiny_job_settings(tiny_set, steps=1, base_precision="fp8_scaled", mixed_precision="bf16",
                                        fp8_compute=True, blocks_to_swap=2, block_swap_prefetch=2,
                                        gradient_checkpointing=True, checkpoint_saves_attention=True))
    ui = checked_ui
    ui.checker.start()  # the plan runs in its warm process, as in the UI
    answer = ui.plan("the job form's config", "", 24, "", "", text, {})
    assert answer["suggested"] == {"gradient_checkpointing": False, "blocks_to_swap": 0,
                                   "base_precision": "fp8_scaled"}, answer["report"]
    assert {fit["base"] for fit in answer["fits"]} == {"fp8_scaled"}
    assert "  bf16       left out: fp8_compute needs an fp8 base" in answer["report"], answer["report"]
    applied = tmp_path / "applied.toml"
    applied.write_text(ui.apply_plan(text, {}, answer["suggested"])[0])
    args = load_config(["--config_file", str(applied)])
    assert (args.base_precision, args.blocks_to_swap, args.gradient_checkpointing, args.block_swap_prefetch,
            args.checkpoint_saves_attention) == ("fp8_scaled", 0, False, 1, None)


def test_the_light_tools_run_in_the_checkers_warm_process_beside_its_checks(checker, tiny_set, tmp_path, monkeypatch,
                                                                             capsys):
    """Plan, the dataset view and a peer config's Load each started a process that imported torch, diffusers and
    transformers (~15 s on 2 cores before a tiny plan of ~2 s): they run in the config checker's warm process now,
    and a Validate asked during a plan is answered before the plan ends."""
    import threading

    from library.ui import commands
    from tests.ui_support import tiny_job_settings
    from tools import plan_memory

    checker.start()
    config = tmp_path / "plan.toml"
    config.write_text(toml.dumps(tiny_job_settings(tiny_set, steps=1, output_dir=str(tmp_path / "out"))))
    assert plan_memory.main(["--config_file", str(config), "--vram", "1"]) == 0
    expected = capsys.readouterr().out
    monkeypatch.setattr(commands.subprocess, "run", lambda *a, **k: pytest.fail("a tool process was started"))
    result, fits = commands.plan(checker.workdir, 1, config_file=str(config), helper=checker)
    here = lambda out: re.sub(r"[\d.]+ GiB available here", "", out)  # noqa: E731 (the machine's, at each plan)
    assert result.ok and here(result.stdout) == here(expected) and fits and fits[0].blocks_to_swap == 0
    missing = commands.run_tool("check_dataset.py", [str(tmp_path / "none.toml"), "--json"], checker.workdir,
                                helper=checker)
    assert (missing.ok, missing.output) == (False, f"error: {tmp_path / 'none.toml'}: no such dataset config file")

    done = {}
    planning = threading.Thread(target=lambda: done.update(plan=(commands.plan(
        checker.workdir, 1, config_file=str(config), helper=checker), time.monotonic())))
    planning.start()
    time.sleep(0.3)  # its request is out (the plan takes seconds)
    answer = checker.check('model_type = "flux"\n', str(tmp_path / "out"))
    answered = time.monotonic()
    planning.join()
    assert answer["key"] == "pretrained_model_name_or_path"
    (result, _), planned = done["plan"]
    assert here(result.stdout) == here(expected) and answered < planned


def test_a_file_picker_lists_files_written_after_the_page_loaded(ui, tmp_path):
    """Old: every file picker (configs, models, dataset TOMLs, prompt files, LoRAs) held the files found when
    the UI started: a LoRA a job wrote since, or a TOML saved since, could only be typed in by hand."""
    from library.ui.app import build_app

    app = build_app(ui)
    data = tmp_path / "data"
    for label, name in (("dataset TOML", "new_dataset.toml"), ("LoRA", "new_lora.safetensors"),
                        ("base model", "new_model.safetensors")):
        pickers = [b for b in app.blocks.values() if isinstance(b, gr.Dropdown) and b.label == label]
        (data / name).write_bytes(b"")
        for picker in pickers:
            opened = next(fn for fn in app.fns.values() if (picker._id, "focus") in fn.targets)
            listed = [value for _, value in opened.fn()["choices"]] if isinstance(opened.fn()["choices"][0], tuple) \
                else opened.fn()["choices"]
            assert any(str(choice).endswith(name) for choice in listed), (label, listed)


def test_the_bucket_histograms_bars_rise_from_zero(ui):
    """Old: gradio's plots scale y to the data (vega-lite `zero: false`): the tiny set's two buckets of 4 images
    each drew no bar at all (the axis ran from 4 to 4), and of buckets of 3 and 5 images the smaller drew none."""
    from library.ui.app import build_app

    histogram = next(b for b in build_app(ui).blocks.values() if isinstance(b, gr.BarPlot))
    assert histogram.title == "bucket histogram" and histogram.y_lim == [0, None]


def test_the_convert_forms_formats_are_the_tools(ui):
    """Old: the LoRA tools' "convert to" offered kohya, diffusers and peft: ComfyUI's layout (convert_lora.py
    --to comfy) could not be picked from the page."""
    from library.ui.app import build_app
    from tools.convert_lora import build_parser

    to = next(b for b in build_app(ui).blocks.values() if isinstance(b, gr.Dropdown) and b.label == "convert to")
    formats = next(a.choices for a in build_parser()._actions if a.dest == "to")
    assert [value for _, value in to.choices] == list(formats)


def test_the_merge_forms_precisions_are_the_tools(ui):
    """Old: the merge form offered bf16, fp16, fp32, fp8 and fp8_scaled: merge_lora.py's GGUF outputs (a ComfyUI-GGUF
    file of Q8_0 ... Q4_0 blocks) could not be picked from the page."""
    from library.ui.app import build_app
    from tools.merge_lora import build_parser

    precision = next(b for b in build_app(ui).blocks.values() if isinstance(b, gr.Dropdown) and b.label == "save precision")
    choices = next(a.choices for a in build_parser()._actions if a.dest == "save_precision")
    assert sorted(value for _, value in precision.choices) == sorted([*choices, KEEP_PRECISION])
    assert precision.value == KEEP_PRECISION  # merge_lora.py's default


def test_the_merge_form_keeps_the_bases_dtypes_unless_told(ui, tmp_path, monkeypatch):
    """Old: the form had no choice without --save_precision, and its bf16 default dequantized an fp8 base (3.7 MB
    where merge_lora.py's default kept 2.1 MB of fp8 weights)."""
    from library.ui import commands

    ran = []
    monkeypatch.setattr(commands, "run_tool", lambda script, args, *rest, **keywords: ran.append(args) or
                        commands.Result(True, "merged"))
    lora = str(tmp_path / "data" / "a.safetensors")
    for precision in (KEEP_PRECISION, "fp8_scaled"):
        assert ui.lora_tool("merge_lora", {"model": lora, "lora": lora, "weight": 1.0, "save_to": "m.safetensors",
                                           "save_precision": precision})["ok"]
    assert "--save_precision" not in ran[0] and ran[1][-2:] == ["--save_precision", "fp8_scaled"]


def test_stop_ends_a_running_tool_through_its_clean_ups(ui, tmp_path):
    """A tool run had no Stop and was SIGKILLed after 900 s (a full-size merge or GGUF quantization may need
    longer), its hidden temporary left behind. Now no time limit, and Stop sends SIGTERM (tools exit 143 through
    their clean-ups: tests/test_crash_safety.py)."""
    import threading

    python = tmp_path / "slow_python"  # stands in for the interpreter: a tool that runs until stopped
    # the sleep starts before the ready mark: a TERM between the mark and the sleep found no $! to kill (kill's usage
    # on stderr, in the tool's output)
    python.write_text("#!/bin/sh\ntrap 'kill $!; exit 143' TERM\nsleep 600 >/dev/null 2>&1 &\n"
                      "touch \"$0.ready\"\nwait\n")
    python.chmod(0o755)
    ui.python = str(python)
    lora = str(tmp_path / "data" / "a.safetensors")
    answers = []
    worker = threading.Thread(target=lambda: answers.append(ui.lora_tool("convert_lora", {
        "lora": lora, "save_to": "c.safetensors", "to": "comfy"})))
    worker.start()
    deadline = time.monotonic() + 30  # a safeguard against a hang, not a timing assertion
    # its trap set, and run_tool has listed it (a loaded machine can run the child's first lines before the thread
    # that started it lists the process: Stop then found "no tool is running")
    while not (os.path.exists(f"{python}.ready") and ui.tool_runs.processes):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    os.remove(f"{python}.ready")
    assert ui.stop_tools() == "stopping 1 tool run"
    worker.join(30)
    assert answers == [{"ok": False, "output": "convert_lora.py was stopped (Stop) before it finished: a file it was "
                                               "still writing is not left behind; one it had finished stays",
                        "image": None}]
    assert ui.stop_tools() == "no tool is running" and not ui.tool_runs.processes and not ui.tool_runs.stopped

    # Stop landing while a tool that finished exits: its own output, not "stopped" (it said "its output was not
    # written" of a merge it had written)
    python.write_text("#!/bin/sh\ntrap 'kill $!; echo wrote c.safetensors; exit 0' TERM\n"
                      "sleep 600 >/dev/null 2>&1 &\ntouch \"$0.ready\"\nwait\n")
    answers.clear()
    worker = threading.Thread(target=lambda: answers.append(ui.lora_tool("convert_lora", {
        "lora": lora, "save_to": "c.safetensors", "to": "comfy"})))
    worker.start()
    # its trap set (before it, SIGTERM would end the shell with 143) and the process listed
    while not (os.path.exists(f"{python}.ready") and ui.tool_runs.processes):
        assert time.monotonic() < deadline + 30
        time.sleep(0.01)
    assert ui.stop_tools() == "stopping 1 tool run"
    worker.join(30)
    assert answers == [{"ok": True, "output": "wrote c.safetensors", "image": None}]


def test_the_live_view_empties_when_its_job_is_deleted(ui):
    """Old: Delete cleared the job picker and the Live tab kept drawing the deleted job: its status, curves,
    samples and log, as if it were still there."""
    from library.ui.app import build_app

    job = ui.store.create("gone", {"output_name": "lora"}, 5)
    with open(job.csv_path, "w") as f:
        f.write("step,loss,lr/lora\n1,0.5,0.001\n2,0.4,0.001\n")
    with open(job.log_path, "w") as f:
        f.write("training: 2/5\n")
    app = build_app(ui)
    live = event(app, "change", "job-pick")
    values = {live.inputs[0]._id: str(job.id), live.inputs[1]._id: None}
    run(live, values)
    status = block(app, "live-status")._id
    assert values[status].startswith(f"**job {job.id} gone: draft**") and len(values[block(app, "plot-loss")._id]) == 2
    ui.act("delete", job.id, confirm=True)
    shown = dict(values)
    run(live, values)  # the timer's tick in another tab, whose picker still names the job
    assert values[status] == "no such job" and values[block(app, "log-tail")._id] == ""
    assert values[block(app, "samples")._id] == [] and len(values[block(app, "plot-loss")._id]) == 0
    shown[live.inputs[0]._id] = None  # what Delete leaves in this tab's picker
    run(live, shown)
    assert shown[status] == "Pick a job in the Jobs tab." and shown[block(app, "log-tail")._id] == ""
    assert shown[block(app, "samples")._id] == [] and len(shown[block(app, "plot-loss")._id]) == 0


def test_a_relative_path_outside_the_roots_says_where_it_was_read_from(tmp_path):
    """`cat/train.toml` meant under the root data/ is read from the folder the UI runs in: the refusal said only
    "start tools/webui.py with --root FOLDER", the root being given already. It says where the path led."""
    from library.ui.files import OutsideRoots, Roots

    (tmp_path / "data").mkdir()
    (tmp_path / "repo").mkdir()
    roots = Roots([str(tmp_path / "data")], str(tmp_path / "repo"))
    repo = os.path.realpath(tmp_path / "repo")
    with pytest.raises(OutsideRoots) as e:
        roots.resolve("cat/train.toml", "config")
    assert str(e.value).startswith(f"config 'cat/train.toml' (relative: read from {repo}, so {repo}/cat/train.toml) "
                                   f"is outside the folders this UI may open"), str(e.value)
    with pytest.raises(OutsideRoots, match=f"^config '{tmp_path}/x.toml' is outside"):  # absolute: as it was
        roots.resolve(str(tmp_path / "x.toml"), "config")


def test_post_hoc_ema_averages_a_jobs_saves_in_step_order(ui):
    """The tools tab's post-hoc EMA: the job's step saves and final (its _ema left out) by step, decay per step."""
    import torch
    from safetensors.torch import load_file, save_file

    job = ui.store.create("a", {"output_name": "lora"}, 5, queue=False)
    os.makedirs(job.output_dir, exist_ok=True)
    fields = {"job_id": str(job.id), "decay_per_step": 0.5, "save_to": "avg.safetensors"}
    answer = ui.lora_tool("post_hoc_ema", fields)
    assert answer["ok"] is False and answer["output"] == (f"job {job.id}: 0 saves of lora in its folder; an average "
                                                          f"needs two or more (a config with save_every_n_steps)")
    alpha = torch.tensor(4.0)
    for name, step, value in (("lora-step000002", 2, 3.0), ("lora", 4, 5.0), ("lora-step000001", 1, 1.0),
                              ("lora_ema", 4, 9.0), ("other-step000001", 1, 7.0)):
        save_file({"m.lora_down.weight": torch.full((2, 3), value), "m.alpha": alpha},
                  os.path.join(job.output_dir, f"{name}.safetensors"), {"ss_steps": str(step)})
    answer = ui.lora_tool("post_hoc_ema", fields)
    assert answer["ok"] is True, answer["output"]
    out = load_file(os.path.join(ui.store.root, "tools", "avg.safetensors"))
    # steps 1, 2, 4: e = 1; 0.5 * 1 + 0.5 * 3 = 2; 0.5 ** 2 * 2 + 0.75 * 5 = 4.25
    assert torch.equal(out["m.lora_down.weight"], torch.full((2, 3), 4.25)) and torch.equal(out["m.alpha"], alpha)
