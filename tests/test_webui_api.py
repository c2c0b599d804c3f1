"""The web UI through gradio_client, against tools/webui.py serving the tiny set: each action the pages
offer (validate, create, queue, stop, delete, the live view, planner, dataset view, captions; a stopped job's
LoRA in the tools, compare, delete and resume: test_webui_faults.py) and the roots that confine what the pages
may read."""

from __future__ import annotations

import os
import shutil
import signal
import threading

import pytest
import toml
from PIL import Image

from library.ui.handlers import FORM_KEYS
from tests.test_webui_jobs import pending_signals
from tests.ui_support import WebUIProcess, job_pid, mark_to_pause, pause_hook_env, paused, tiny_job_settings, wait_for

EMPTY_FORM = [None] * len(FORM_KEYS)


def form(**values) -> list:
    return [values.get(k) for k in FORM_KEYS]


@pytest.fixture(scope="module")
def server(tiny_set, tmp_path_factory):
    root = tmp_path_factory.mktemp("webui")
    (root / "data").mkdir()  # a --root must exist; the dataset test fills it
    # 127.0.0.2: another address than 127.0.0.1 (still this machine's loopback), so it needs a password:
    # every test here goes through it (test_another_address_needs_a_password_and_gets_it: one UI start less)
    ui = WebUIProcess(str(root / "jobs"), [tiny_set["root"], str(root / "data")], str(root / "webui.log"),
                      host="127.0.0.2", password="s3cret", env=pause_hook_env(root))
    yield ui
    ui.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


@pytest.fixture(scope="module")
def tiny_toml(tiny_set):
    return toml.dumps(tiny_job_settings(tiny_set, steps=6))


def live(client, job_id) -> dict:
    return client.predict(str(job_id), api_name="/live")


def test_a_bad_config_is_refused_with_the_error_at_its_field(client, tiny_toml):
    answer, *notes = client.predict(tiny_toml, *form(network_dim="0"), api_name="/validate")
    assert answer == {"ok": False, "key": "network_dim", "error": "config: key 'network_dim' must be >= 1, got 0"}
    shown = {k: n for k, n in zip([*FORM_KEYS, "toml"], notes) if n["visible"]}
    assert list(shown) == ["network_dim"] and "must be >= 1" in shown["network_dim"]["value"]

    answer, *notes = client.predict(tiny_toml + "\nlearning_rat = 1.0\n", *EMPTY_FORM, api_name="/validate")
    assert answer["ok"] is False and answer["error"] == "config: unknown key 'learning_rat'"
    assert notes[-1]["visible"] and "learning_rat" in notes[-1]["value"]  # no such field: shown under the TOML

    answer, *_ = client.predict(tiny_toml, *form(ae="/etc/ae.safetensors"), api_name="/validate")
    assert answer["ok"] is False and answer["key"] == "ae" and "'/etc/ae.safetensors' is outside" in answer["error"]
    missing = os.path.join(os.path.dirname(toml.loads(tiny_toml)["ae"]), "no_such_ae.safetensors")
    answer, *_ = client.predict(tiny_toml, *form(ae=missing), api_name="/validate")
    assert answer["ok"] is False and answer["key"] == "ae" and missing in answer["error"]
    answer, *_ = client.predict("fresh", tiny_toml, *form(max_train_steps="ten"), api_name="/create_and_queue")
    assert answer["ok"] is False and answer["key"] == "max_train_steps"
    assert client.predict(api_name="/list_jobs")["data"] == []  # nothing was queued

    answer, *_ = client.predict(tiny_toml, *EMPTY_FORM, api_name="/validate")
    assert answer["ok"] is True and answer["max_steps"] == 6, answer


def test_a_dropdown_value_not_among_its_choices_gets_the_checks_line_under_its_field(client, tiny_toml):
    """Old: a loaded config's model_type "flux1" (a typo) failed Validate, Create, Save TOML and Plan inside gradio
    ("Value: flux1 is not in the list of choices"), never reaching the check that names it under the field."""
    for key, typo in (("model_type", "flux1"), ("base_precision", "fp4")):
        text = toml.dumps({**toml.loads(tiny_toml), key: typo})
        answer, *notes = client.predict(text, *form(**{key: typo}), api_name="/validate")
        assert answer["ok"] is False and answer["key"] == key and f"got '{typo}'" in answer["error"], answer
        shown = {k: n for k, n in zip([*FORM_KEYS, "toml"], notes) if n["visible"]}
        assert list(shown) == [key], shown


def test_retry_is_refused_unless_confirmed(client, tiny_toml):
    """Old: /retry_job (the Retry button) removed a done job's LoRA, samples, state and log unasked."""
    job_id = client.predict("unasked", tiny_toml, *EMPTY_FORM, api_name="/create_job")[0]["job_id"]
    answer = client.predict(str(job_id), False, api_name="/retry_job")[0]
    assert answer == {"ok": False, "error": f"job {job_id}: confirm to retry it from the start: its LoRAs, samples, "
                                            f"saved state and logs are removed"}
    assert client.predict(str(job_id), True, api_name="/delete_job")[0]["state"] == "deleted"


def test_two_tabs_queuing_at_once_keep_the_queue_consistent(server, tiny_set):
    text = toml.dumps(tiny_job_settings(tiny_set, steps=1))
    answers: list[dict] = []
    tabs = [server.client(), server.client()]  # two sessions, as two browser tabs
    before = {row[0] for row in tabs[0].predict(api_name="/list_jobs")["data"]}

    def queue_three(tab, name):
        for i in range(3):
            answers.append(tab.predict(f"{name}-{i}", text, *[None] * 11, api_name="/create_and_queue")[0])

    threads = [threading.Thread(target=queue_three, args=(tab, f"tab{n}")) for n, tab in enumerate(tabs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(a["ok"] for a in answers), answers
    ids = sorted(a["job_id"] for a in answers)
    assert len(set(ids)) == 6 and not set(ids) & before and len({a["output_dir"] for a in answers}) == 6
    rows = [row for row in tabs[0].predict(api_name="/list_jobs")["data"] if row[0] in ids]
    states = [row[2] for row in rows]
    assert sorted(row[0] for row in rows) == ids and set(states) <= {"queued", "running", "done"}
    assert states.count("running") <= 1  # one job at a time on the one device
    for job_id in ids:  # end them: the queued ones go back to draft, a running one stops
        tabs[1].predict(str(job_id), api_name="/stop_job")
    wait_for(lambda: not {r[2] for r in tabs[0].predict(api_name="/list_jobs")["data"]} & {"running", "stopping"},
             180, "every job to end")


def test_every_job_picker_learns_of_jobs_made_after_the_page_was_built(client):
    """Old: the LoRA tools' generate picker kept the jobs of the UI's start (a page reload too: its
    choices are the built page's); the others are refreshed by their timers or their tab's actions."""
    config = client.config
    pickers = {c["id"]: c["props"]["label"] for c in config["components"] if c.get("type") == "dropdown"
               and c["props"].get("label") in ("job", "job A", "job B", "job (its model files)")}
    refreshed = {pickers[o] for d in config["dependencies"] for o in d["outputs"] if o in pickers}
    assert len(pickers) == 4 and refreshed == set(pickers.values()), (pickers, refreshed)


def test_pages_read_only_under_their_roots(client):
    *_, note = client.predict("/etc/passwd", api_name="/load_config")
    assert note["visible"] and "outside the folders this UI may open" in note["value"]
    assert "outside the folders" in client.predict("/etc/hostname", api_name="/lora_info")


def test_bad_job_ids_and_config_files_get_one_line(client, tiny_set):
    _, note = client.predict("abc", None, "loss", api_name="/compare")
    assert note["visible"] and note["value"] == "⚠ job 'abc': not a job number; pick a job in the list"
    _, note = client.predict("9999", None, "loss", api_name="/compare")
    assert note["value"] == "⚠ job 9999: no such job"
    assert client.predict("abc", api_name="/stop_job")[0] == {
        "ok": False, "error": "job 'abc': not a job number; pick a job in the list"}
    images = tiny_set["image_dir"]
    png = os.path.join(images, sorted(f for f in os.listdir(images) if f.endswith(".png"))[0])
    txt = os.path.splitext(png)[0] + ".txt"
    for path, expected in ((png, f"{png}: config file is not valid UTF-8"), (txt, f"{txt}: not valid TOML"),
                           (images, f"config {images!r} is a folder: pick a .toml file")):
        *_, note = client.predict(path, api_name="/load_config")
        assert note["visible"] and note["value"].startswith(f"⚠ {expected}") and "\n" not in note["value"], note


def test_planner_suggests_settings_and_applies_them_to_the_form(client, tiny_toml):
    note, report, keys = client.predict("the job form's config", "flux1-dev", 1, 64, 1, tiny_toml, *EMPTY_FORM,
                                        api_name="/plan")
    assert "predicted peak device memory" in report and "gradient_checkpointing" in report, report
    assert keys["blocks_to_swap"] == 0 and "Suggested" in note  # the tiny model fits a 1 GiB card (0.6 of it: the CUDA context)
    text, *fields = client.predict(keys, tiny_toml, *EMPTY_FORM, api_name="/apply_plan")
    applied = toml.loads(text)
    assert {k: applied[k] for k in keys} == keys
    assert fields[FORM_KEYS.index("base_precision")] == keys["base_precision"]


def test_the_sigmas_the_forms_config_trains_on_are_drawn_per_size(client, tiny_toml):
    """tools/plot_timesteps.py on the job form's config (in the config checker's process), the form's fields over the
    TOML: its quantiles per size and the PNG; a bad size is its one line and no image."""
    image, report = client.predict("64,128", tiny_toml, *form(max_train_steps="6"), api_name="/timesteps")
    lines = report.splitlines()
    assert lines[0].startswith("64x64: timestep_sampling") and lines[1].startswith("128x128: "), report
    assert image.endswith(".png") and os.path.getsize(image) > 10_000
    image, report = client.predict("big", tiny_toml, *EMPTY_FORM, api_name="/timesteps")
    assert image is None and report.strip() == "error: --resolution 'big': expected a size in pixels, 1024 or 1024x768"


def test_the_planner_plans_the_configs_own_size_and_batch_unless_asked_another(client):
    """The planner tab sent 1024 px and batch 1 with the job form's config (the config trained 64 px, batch 2): its
    fields are empty until the user fills them, as plan_memory.py's --resolution / --batch_size."""
    parameters = {p["label"]: p for p in client.view_api(print_info=False, return_format="dict")["named_endpoints"]
                  ["/plan"]["parameters"]}
    assert parameters["resolution (px; empty: the config's)"]["parameter_default"] == ""
    assert parameters["batch size (empty: the config's)"]["parameter_default"] == ""


def test_dataset_view_lists_captions_buckets_and_problems(client, tiny_set, server):
    data = os.path.join(os.path.dirname(server.jobs_dir), "data")
    shutil.copytree(os.path.dirname(tiny_set["dataset_config"]), data, dirs_exist_ok=True)
    config = os.path.join(data, "dataset.toml")
    dataset = toml.load(config)
    images = os.path.join(data, "images")
    dataset["datasets"][0]["subsets"][0]["image_dir"] = images
    with open(config, "w") as f:
        toml.dump(dataset, f)
    Image.new("RGB", (8, 8)).save(os.path.join(images, "tiny.png"))  # upscaled, and it has no caption
    summary, buckets, problems, gallery = client.predict(config, api_name="/dataset")
    assert summary.startswith("9 images, 9 trained; 1 errors, 1 warnings"), summary
    assert {row[0]: row[1] for row in buckets["data"]} == {"64x64": 5, "80x48": 4}, buckets
    assert sorted((row[0], row[1]) for row in problems["data"] if "tiny.png" in row[2]) == [
        ("error", "caption"), ("warning", "size")], problems
    captions = [item["caption"] for item in gallery]
    assert len(captions) == 9 and sum(bool(c) for c in captions) == 8

    first = sorted(f for f in os.listdir(images) if f.endswith(".png"))[0]
    saved = client.predict(config, os.path.join(images, first), "an edited caption", api_name="/save_caption")
    with open(os.path.join(images, os.path.splitext(first)[0] + ".txt")) as f:
        assert f.read() == "an edited caption\n" and "saved" in saved


def test_an_edit_of_the_loaded_toml_is_not_undone_by_the_fields_load_filled(server, tiny_toml):
    """Old: Load filled steps = 6; the user changed max_train_steps to 3 in the TOML; Validate (and the
    job) took the field's 6. A field the user changes still overrides the TOML."""
    path = os.path.join(os.path.dirname(server.jobs_dir), "data", "edited.toml")
    with open(path, "w") as f:
        f.write(tiny_toml)
    tab = server.client()
    text, *fields, _ = tab.predict(path, api_name="/load_config")
    assert fields[FORM_KEYS.index("max_train_steps")] == "6"
    edited = text.replace("max_train_steps = 6", "max_train_steps = 3")
    assert tab.predict(edited, *fields, api_name="/validate")[0] == {"ok": True, "max_steps": 3}
    fields[FORM_KEYS.index("max_train_steps")] = "4"
    assert tab.predict(edited, *fields, api_name="/validate")[0] == {"ok": True, "max_steps": 4}
    saved, *_ = tab.predict(path, edited, *fields, api_name="/save_config")  # Save TOML: the edit and the field
    with open(path) as f:
        assert saved == f"saved {path}" and f.read() == edited.replace("max_train_steps = 3", "max_train_steps = 4")


def test_picking_a_config_loads_it_unless_the_form_holds_edits(server, tiny_toml):
    """Choosing a config in the picker did nothing until Load was pressed. Now the pick loads it into
    a form without edits; with an edit (of the TOML or a field) it loads nothing and asks, naming the
    edits, and Load replaces them."""
    folder = os.path.join(os.path.dirname(server.jobs_dir), "data")
    first, second = os.path.join(folder, "first.toml"), os.path.join(folder, "second.toml")
    for path, steps in ((first, 6), (second, 7)):
        with open(path, "w") as f:
            f.write(tiny_toml.replace("max_train_steps = 6", f"max_train_steps = {steps}"))
    tab = server.client()
    text, *fields, note = tab.predict(first, "", *EMPTY_FORM, api_name="/pick_config")
    assert fields[FORM_KEYS.index("max_train_steps")] == "6" and "max_train_steps = 6" in text and not note["visible"]
    edited = text.replace("max_train_steps = 6", "max_train_steps = 3")
    fields[FORM_KEYS.index("network_dim")] = "12"
    kept, *kept_fields, note = tab.predict(second, edited, *fields, api_name="/pick_config")
    untouched = {"__type__": "update"}  # gr.update(): the editor and the fields stay as the user left them
    assert kept == untouched and kept_fields == [untouched] * len(fields), "the edits were replaced"
    assert note["value"] == (f"⚠ the form has unsaved edits (the TOML, rank (network_dim)): press Load to replace "
                             f"them with {second}, or Save TOML first"), note
    text, *fields, note = tab.predict(second, api_name="/load_config")
    assert "max_train_steps = 7" in text and not note["visible"]
    text, *fields, note = tab.predict(first, text, *fields, api_name="/pick_config")  # unedited: loads
    assert "max_train_steps = 6" in text


def test_an_llm_config_validates_and_its_job_refuses_generate_in_one_line(client, tiny_set):
    """The form's model type offers every model_type train_lora.py takes: the LLM mode's "llm" was
    missing, so Validate and Create of a loaded configs/llm_lora.toml answered gradio's 'Value: llm is
    not in the list of choices'; and generate with an LLM job was a raw KeyError 'ae'."""
    text = toml.dumps({"train_data": [tiny_set["corpus"]], "max_length": 32, "stride": 32, "mixed_precision": "no"})
    fields = form(model_type="llm", pretrained_model_name_or_path=tiny_set["llm"], max_train_steps="1")
    answer, *_ = client.predict(text, *fields, api_name="/validate")
    assert answer == {"ok": True, "max_steps": 1}
    answer, *_ = client.predict("llm job", text, *fields, api_name="/create_job")
    output, image = client.predict(str(answer["job_id"]), "", 1.0, "The", 64, 2, 0, api_name="/generate")
    assert image is None and output == (f"job {answer['job_id']} trains an LLM (model_type llm): generate draws "
                                        f"images with a diffusion job's models (an LLM job's samples are in its log)")
    client.predict(str(answer["job_id"]), True, api_name="/delete_job")


def test_the_ui_process_never_loads_torch(server, client):
    """After validating, training, planning and the dataset view (the tests above), the UI's own
    process has mapped no torch library: those ran in their own processes."""
    client.predict(api_name="/list_jobs")
    with open(f"/proc/{server.process.pid}/maps") as f:
        maps = f.read()
    assert "libtorch" not in maps and "/torch/" not in maps
    assert "gradio" in maps or "python" in maps  # the right process


def test_another_address_needs_a_password_and_gets_it(server, tmp_path, capsys):
    import urllib.error
    import urllib.request

    from tools.webui import main

    assert main(["--host", "0.0.0.0", "--jobs_dir", str(tmp_path / "refused")]) == 2
    assert "give --password" in capsys.readouterr().err and not (tmp_path / "refused").exists()
    assert server.url.startswith("http://127.0.0.2:") and server.password  # the module's UI
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(server.url + "/config", timeout=10)
    assert refused.value.code == 401
    assert isinstance(server.client().predict(api_name="/list_jobs")["data"], list)  # with the password


def test_sigterm_stops_the_ui_as_ctrl_c_does_deleting_its_copies_of_the_images_it_served(server, client, tiny_set):
    """Old: SIGTERM (systemd, docker stop, this fixture's stop) ended the process where it stood: gradio's copy
    of every image it had shown stayed behind (in /tmp), one per image viewed, as long as the UI had run.
    The module's last test: it stops the module's UI."""
    client.predict(tiny_set["dataset_config"], api_name="/dataset")  # the gallery: gradio copies its images
    cache = os.path.join(server.jobs_dir, ".gradio_cache")
    copies = lambda: [os.path.join(d, n) for d, _, names in os.walk(cache) for n in names]  # noqa: E731
    assert copies(), "the dataset gallery's images were not copied to the jobs folder's gradio cache"
    server.stop()
    assert server.process.returncode == 0, open(server.log_path).read()[-2000:]
    assert copies() == []
