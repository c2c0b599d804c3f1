"""The gradio pages: Jobs (the form, the TOML, the queue and its actions), Live (one job's progress,
curves, samples, log and memory; two jobs compared), Planner, Dataset and LoRA tools. The logic is
in library/ui/handlers.py; each action has an api_name, so gradio_client scripts (and the tests)
drive the same functions the buttons do."""

from __future__ import annotations

import gradio as gr
import pandas as pd

from library.models.registry import arch_specs
from library.text_files import toml_dumps
from library.ui.files import OutsideRoots
from library.ui.handlers import (BASE_PRECISIONS, CLEARED, FORM_KEYS, KEEP_PRECISION, MODEL_TYPES, OPTIMIZERS,
                                PLOT_COLUMNS, WebUI, form_values_of, job_number)
from library.ui.jobs import JobError
from library.ui.peer_configs import CONFIG_SUFFIXES

LABELS = {
    "model_type": "model type", "pretrained_model_name_or_path": "model file (transformer)",
    "ae": "VAE (ae; none for a pixel-space model)",
    "dataset_config": "dataset TOML", "network_dim": "rank (network_dim)", "max_train_steps": "steps",
    "learning_rate": "learning rate", "optimizer_type": "optimizer", "base_precision": "base precision",
    "sample_prompts": "sample prompts file", "sample_every_n_steps": "sample every N steps",
}
# Keys without a field of their own whose errors belong beside one (optimizer_args that do not fit the optimizer).
FIELD_OF = {"fp8_base": "base_precision", "fp8_scaled": "base_precision", "optimizer_args": "optimizer_type"}
REFRESH_SECONDS = 2.0
# merge_lora.py's --save_precision choices, bf16 (the form's default) first (tests/test_webui_handlers.py checks them
# against its parser)
MERGE_PRECISIONS = (KEEP_PRECISION, "bf16", "fp16", "fp32", "fp8", "fp8_scaled", "gguf_q8_0", "gguf_q5_1", "gguf_q5_0",
                    "gguf_q4_1", "gguf_q4_0")
# Asked before the actions that remove a job's files, each naming the job ({job}) and what goes.
CONFIRM_QUESTIONS = {
    "retry": "Retry **{job}** from the start? Its LoRAs, samples, saved state and logs are removed (its config "
             "stays); Resume continues a stopped or failed job from its state instead.",
    "delete": "Delete **{job}** and its output folder (LoRAs, samples, state)?",
}
# Field errors in red; galleries keep thumbnails small (gradio widens the columns to fill the row
# when there are fewer images than columns: two samples would each take half the page).
CSS = (".field-error{color:#c62828} #samples .grid-container, #dataset-images .grid-container"
       "{grid-template-columns:repeat(auto-fill,minmax(180px,260px)) !important}")


def presets() -> list[str]:
    return sorted(n for s in arch_specs().values() if s.planner for n in s.planner.presets)


def edited(order: list[str], values: tuple) -> dict:
    """The form's fields from an event's inputs (the fields, then the values Load filled them with, then the
    fields the user typed in or left since): those Load filled and the user left as they were are dropped, so the
    TOML's text decides them; one Load filled and the user emptied is CLEARED, so its key goes (an empty field kept
    the TOML's value). Only a field the user was in is emptied: a click right after a TOML edit sends the fields
    as the browser still shows them, before the editor's blur event filled the ones that follow the TOML, while
    `loaded` (server-side) holds the new values already; those read as emptied once (8e16e39e, reverted)."""
    *values, loaded, typed = values
    empty = lambda v: v is None or (isinstance(v, (str, list)) and not "".join(map(str, v)).strip())  # noqa: E731
    return {k: CLEARED if k in typed and k in loaded and empty(v) and not empty(loaded[k]) else v
            for k, v in zip(order, values) if k not in loaded or v != loaded[k]}


def job_form_inputs(form: dict) -> list:
    """An event's inputs for the job form's config, another tab's: the TOML editor, then what edited() reads (the
    fields, the values Load filled them with, the fields typed in)."""
    return [form["text"], *[form["fields"][k] for k in form["order"]], form["loaded"], form["typed"]]


def unsaved_edits(order: list[str], values: list, loaded: dict, text: str, loaded_text: str) -> list[str]:
    """What the form holds that the last Load did not put there: "the TOML" and the changed fields'
    labels. A field Load left empty and the user too is no edit."""
    changes = ["the TOML"] if (text or "").strip() != (loaded_text or "").strip() else []
    return changes + [LABELS.get(k, k) for k, v in zip(order, values)
                      if (v != loaded[k] if k in loaded else v not in (None, "", []))]


def error_note(message: str) -> dict:
    return gr.update(value=f"⚠ {message}" if message else "", visible=bool(message))


def file_picker(ui: WebUI, suffixes: tuple[str, ...], label: str, folders: bool = False, **kwargs) -> gr.Dropdown:
    """A Dropdown of the files (and/or folders) under the roots, listed again each time it is opened: a
    LoRA a job wrote, a TOML saved since the page loaded, shows without restarting the UI."""
    def listing():
        return ui.roots.listing(suffixes, folders=folders)
    picker = gr.Dropdown(listing(), value=None, label=label, allow_custom_value=True, **kwargs)
    picker.focus(lambda: gr.update(choices=listing()), None, picker, api_name=False, show_progress="hidden",
                 queue=False)
    return picker


def job_picker(ui: WebUI, label: str, **kwargs) -> gr.Dropdown:
    """A Dropdown of the queue's jobs, listed again each time it is opened: its choices as the page was built (at
    the UI's start) left a page opened since listing none of the jobs the queue table showed until a timer's
    refresh (2 s for the queue's picker, 10 s for the comparison's)."""
    picker = gr.Dropdown(ui.job_choices(), value=None, label=label, allow_custom_value=True, **kwargs)
    picker.focus(lambda: gr.update(choices=ui.job_choices()), None, picker, api_name=False, show_progress="hidden",
                 queue=False)
    return picker


# gradio copies every image it shows (samples, dataset images) into its cache folder and, unasked, keeps them for
# the server's life and past it: a UI up for weeks grew by each one viewed, a deleted job's samples still served.
# Now an hourly sweep drops the copies older than a day (a gallery shown again copies them anew), a restart all.
GRADIO_CACHE_SWEEP = (3600, 86400)  # gr.Blocks' delete_cache: (every s, older than s)


def build_app(ui: WebUI) -> gr.Blocks:
    with gr.Blocks(title="LoRA trainer", delete_cache=GRADIO_CACHE_SWEEP) as app:
        gr.Markdown("# LoRA trainer\nQueue training jobs, watch them learn, stop and resume them. "
                    "Each job is a `train_lora.py` process writing to its own folder.")
        with gr.Tabs():
            with gr.Tab("Jobs", id="jobs"):
                form, errors, job_id = jobs_tab(ui)
            with gr.Tab("Live", id="live"):
                live_tab(ui, job_id)
            with gr.Tab("Planner", id="planner"):
                planner_tab(ui, form)
            with gr.Tab("Dataset", id="dataset"):
                dataset_tab(ui)
            with gr.Tab("LoRA tools", id="tools"):
                tools_tab(ui)
    # gradio 6.31's queue loop wakes every 1 ms while idle (~5% of a core here, beside the trainer);
    # every 20 ms starts an event as soon to a person (bench/RESULTS.md: bench_webui.py).
    app._queue.sleep_when_free = 0.02
    app._queue.progress_update_sleep_when_free = 0.1
    return app


def job_form(ui: WebUI):
    """The config picker, the form's fields (each with its error line below it) and the TOML editor."""
    with gr.Row():
        with gr.Column(scale=3):
            with gr.Row():
                pick = file_picker(ui, CONFIG_SUFFIXES, "start from a config (configs/ or any TOML under the roots; an "
                                   "sd-scripts, musubi-tuner or ai-toolkit config is converted beside it)", scale=3)
                load = gr.Button("Load", scale=1)
            name = gr.Textbox(label="job name", placeholder="default: the config's output_name")
            fields, errors = {}, {}
            with gr.Row():
                for key in ("model_type", "base_precision", "optimizer_type"):
                    with gr.Column(min_width=160):
                        choices = {"model_type": list(MODEL_TYPES), "base_precision": list(BASE_PRECISIONS),
                                   "optimizer_type": list(OPTIMIZERS)}[key]
                        # Any value: gradio refuses one not among the choices before any handler runs, so a
                        # loaded config's typo in model_type must reach the check, which names it here.
                        fields[key] = gr.Dropdown(choices, value=None, label=LABELS[key], allow_custom_value=True)
                        errors[key] = gr.Markdown(visible=False, elem_classes="field-error")
            models = (".safetensors", ".gguf")
            for key, suffixes in (("pretrained_model_name_or_path", models), ("ae", models),
                                  ("dataset_config", (".toml",)), ("sample_prompts", (".txt",))):
                fields[key] = file_picker(ui, suffixes, LABELS[key], folders=suffixes == models)
                errors[key] = gr.Markdown(visible=False, elem_classes="field-error")
            with gr.Row():
                for key in ("network_dim", "max_train_steps", "learning_rate", "sample_every_n_steps"):
                    with gr.Column(min_width=140):
                        fields[key] = gr.Textbox(label=LABELS[key], placeholder="from the TOML")
                        errors[key] = gr.Markdown(visible=False, elem_classes="field-error")
        with gr.Column(scale=2):
            text = gr.Textbox(label="the full config (TOML; a field you change overrides it)", lines=24,
                              max_lines=40, elem_id="config-toml")
            errors["toml"] = gr.Markdown(visible=False, elem_classes="field-error")
            converted = gr.Markdown(visible=False, elem_id="converted-note")  # what Load's conversion did
    return pick, load, name, fields, errors, text, converted


def loading_events(ui: WebUI, pick, load, text, fields: dict, order: list, errors: dict, converted, states: tuple):
    """Load, a pick in the config list and leaving the editor: what fills the editor and the fields. states: the
    (loaded, loaded_text, conversion, loaded_file, typed) gr.States of jobs_tab."""
    loaded, loaded_text, conversion, loaded_file, typed = states
    form_inputs = [fields[k] for k in order]
    keep = [gr.update()] * (1 + len(order))  # the editor and the fields, as they are

    def on_load(path):
        try:
            real, new_text, values, note = ui.open_config(path)
        except (OutsideRoots, OSError, ValueError) as e:
            return keep + [error_note(str(e))] + [gr.update()] * 5
        return [new_text] + [values[k] for k in order] + [error_note(""), values, new_text, note, real, []]

    def show_conversion(note):
        return gr.update(value=note, visible=bool(note))

    load_outputs = [text, *form_inputs, errors["toml"], loaded, loaded_text, conversion, loaded_file, typed]
    load.click(on_load, [pick], load_outputs, api_name="load_config").then(
        show_conversion, [conversion], [converted], api_name=False, show_progress="hidden")

    def on_pick(path, text_value, *values):
        """Picking a config loads it, unless the form holds edits: then it asks (Load replaces them)."""
        *values, filled, filled_text = values
        if not path:
            return keep + [gr.update()] * 6
        if changes := unsaved_edits(order, values, filled, text_value, filled_text):
            return keep + [error_note(f"the form has unsaved edits ({', '.join(changes)}): press Load to replace "
                                      f"them with {path}, or Save TOML first")] + [gr.update()] * 5
        return on_load(path)

    pick.change(on_pick, [pick, text, *form_inputs, loaded, loaded_text], load_outputs, api_name="pick_config").then(
        show_conversion, [conversion], [converted], api_name=False, show_progress="hidden")

    def on_toml_edit(text_value, *values):
        """Leaving the editor: the fields that still show what Load (or this) put there, or nothing, follow the
        TOML's text (they showed the old value beside an edited one, which then gave way to the TOML unseen); a
        field the user changed keeps its value and wins, as before. Text that is no config TOML changes nothing:
        Validate names what is wrong with it."""
        *values, filled = values
        try:
            new = form_values_of(text_value)
        except ValueError:
            return [gr.update()] * (len(order) + 1)
        follow = [k for k, v in zip(order, values) if (v == filled[k] if k in filled else v in (None, "", []))]
        return [new[k] if k in follow else gr.update() for k in order] + [{**filled, **{k: new[k] for k in follow}}]

    text.blur(on_toml_edit, [text, *form_inputs, loaded], [*form_inputs, loaded], api_name="fields_from_toml",
              show_progress="hidden")


def jobs_tab(ui: WebUI):
    pick, load, name, fields, errors, text, converted = job_form(ui)
    order = list(FORM_KEYS)
    form_inputs = [fields[k] for k in order]
    error_outputs = [errors[k] for k in order] + [errors["toml"]]
    # The fields as the last Load filled them: one left so gives way to the TOML (an edit there wins).
    loaded = gr.State({})
    # The editor's text as the last Load put it there: another text is an edit a new pick must not drop.
    loaded_text = gr.State("")
    # The last Load's conversion note ("": the config was ours), shown by an event of its own after Load: a State
    # output, the note leaves /load_config's and /pick_config's outputs as API scripts unpack them.
    conversion = gr.State("")
    # The real path of the file the editor's text was loaded from (or saved to) last: Save refuses to write over
    # it once it holds another text than loaded_text (another tab saved it meanwhile: its edit would be lost).
    loaded_file = gr.State("")
    # The fields the user typed in or left (input and blur: no update from a handler fires them; gradio 6.31's
    # input misses a value set whole, as playwright's fill sets it) since Load or Save: only those can be emptied.
    typed = gr.State([])
    for key in order:
        gr.on([fields[key].input, fields[key].blur], lambda keys, key=key: sorted({*keys, key}), [typed], [typed],
              queue=False, api_name=False, show_progress="hidden")
    with gr.Row():
        check_button = gr.Button("Validate")
        create_button = gr.Button("Create (draft)")
        queue_new = gr.Button("Create and queue", variant="primary", elem_id="create-and-queue")
    save_row(ui, order, [text, *form_inputs, loaded, typed, loaded_text, loaded_file],
             [text, *form_inputs, loaded, typed, loaded_text, loaded_file, errors["toml"]])
    answer = gr.JSON(label="result", elem_id="job-result")

    table, job_id = queue_section(ui)

    def show_errors(result: dict) -> list:
        key = result.get("key") if not result.get("ok") else None
        where = key if key in errors else FIELD_OF.get(key, "toml")
        message = result.get("error", "") if not result.get("ok") else ""
        return [error_note(message if k == where else "") for k in order + ["toml"]]

    loading_events(ui, pick, load, text, fields, order, errors, converted,
                   (loaded, loaded_text, conversion, loaded_file, typed))

    def on_check(text_value, *values):
        result = ui.check(text_value, edited(order, values))
        summary = {k: result[k] for k in ("ok", "key", "error", "max_steps") if k in result}
        return [summary] + show_errors(result)

    check_button.click(on_check, [text, *form_inputs, loaded, typed], [answer, *error_outputs], api_name="validate")

    def creator(queue: bool):
        def on_create(job_name, text_value, *values):
            result = ui.create(job_name, text_value, edited(order, values), queue)
            summary = {k: v for k, v in result.items() if k != "settings"}
            return [summary] + show_errors(result) + [ui.jobs_table(), gr.update(choices=ui.job_choices(),
                                                                                value=str(result.get("job_id", "")) or None)]
        return on_create

    create_outputs = [answer, *error_outputs, table, job_id]
    create_button.click(creator(False), [name, text, *form_inputs, loaded, typed], create_outputs,
                        api_name="create_job")
    queue_new.click(creator(True), [name, text, *form_inputs, loaded, typed], create_outputs,
                    api_name="create_and_queue")

    return {"text": text, "fields": fields, "order": order, "loaded": loaded, "typed": typed}, errors, job_id


def queue_section(ui: WebUI):
    """The queue's table, its job picker and its actions (queue, stop, resume; retry and delete asked
    first), refreshed on a timer. Returns (table, job_id) for the form's Create to update."""
    gr.Markdown("## Queue")
    table = gr.Dataframe(ui.jobs_table(), interactive=False, elem_id="queue-table")
    with gr.Row():
        job_id = job_picker(ui, "job", elem_id="job-pick")
        buttons = {a: gr.Button(a.capitalize(), elem_id=f"job-{a}") for a in ("queue", "stop", "resume")}
        asking = {"retry": gr.Button("Retry…", elem_id="job-retry"),
                  "delete": gr.Button("Delete…", variant="stop", elem_id="job-delete")}
    # Per action that removes files: its row (the question, Yes, No), hidden until asked, and the job
    # asked about: Yes acts on that one, not on whichever job is picked when it is pressed.
    questions = {}
    for action in CONFIRM_QUESTIONS:
        with gr.Row(visible=False) as row:
            questions[action] = (row, gr.Markdown(elem_id=f"job-{action}-question"),
                                 gr.Button(f"Yes, {action}", variant="stop", elem_id=f"job-{action}-confirm"),
                                 gr.Button("No"), gr.State(None))
    action_answer = gr.JSON(label="action", elem_id="action-result")

    for action, button in buttons.items():
        button.click(lambda j, a=action: (ui.act(a, j), ui.jobs_table()), [job_id], [action_answer, table],
                     api_name=f"{action}_job")
    api_confirm = gr.Checkbox(visible=False)

    def confirmed(action: str):
        def on_confirmed(j, yes=True):
            picked = gr.update(choices=ui.job_choices(), value=None) if action == "delete" else \
                gr.update(choices=ui.job_choices())
            return ui.act(action, j, confirm=yes), ui.jobs_table(), gr.update(visible=False), picked
        return on_confirmed

    for action, (row, question, yes, no, asked) in questions.items():
        asking[action].click(lambda j, a=action: ask(ui, a, j), [job_id], [row, question, asked, action_answer],
                             api_name=False)
        no.click(lambda: gr.update(visible=False), None, [row], api_name=False)
        outputs = [action_answer, table, row, job_id]
        yes.click(confirmed(action), [asked], outputs, api_name=False)
        gr.Button(visible=False).click(confirmed(action), [job_id, api_confirm], outputs, api_name=f"{action}_job")
    gr.Button(visible=False).click(ui.jobs_table, None, [table], api_name="list_jobs")
    timer = gr.Timer(REFRESH_SECONDS)
    timer.tick(lambda: (ui.jobs_table(), gr.update(choices=ui.job_choices())), None, [table, job_id], api_name=False)
    return table, job_id


def ask(ui: WebUI, action: str, job_id) -> tuple:
    """The confirmation row of `action` shown with its question naming the picked job, and that job's id
    (what Yes acts on); no pick, or a job that is gone: the row hidden and the refusal in the answer."""
    try:
        job = ui.store.get(job_number(job_id))
    except JobError as e:
        return gr.update(visible=False), "", None, {"ok": False, "error": str(e)}
    question = CONFIRM_QUESTIONS[action].format(job=f"job {job.id} ({job.name}, {job.state})")
    return gr.update(visible=True), question, str(job.id), gr.update()


def save_row(ui: WebUI, order: list[str], inputs: list, reloaded: list) -> None:
    """Save TOML: the editor's config written back under the roots. inputs: the TOML, the fields, the values
    Load filled them with, the fields typed in, the text and real path of the file Load read. reloaded: the TOML,
    the fields and Load's baselines (fields, none typed in, text, file), set from the file saved: what it holds is
    no unsaved edit (a pick then asked to "Save TOML first"), and this page's to save again; then the note under
    the editor, cleared (a pick's "press Load ..., or Save TOML first" stayed after the save it asked for)."""
    with gr.Row():
        save_to = gr.Textbox(label="save the config to (a .toml under the roots; comments and tables kept)", scale=3)
        save = gr.Button("Save TOML", scale=1)
    saved = gr.Markdown()

    def on_save(path, text_value, *values):
        *values, base_text, base_file = values
        try:
            real = ui.save_config(path, text_value, edited(order, values), (base_file, base_text))
            _, new_text, filled, _ = ui.open_config(real, convert=False)  # the file as saved, whatever its keys
        except (OutsideRoots, OSError, ValueError) as e:
            return [f"⚠ {e}"] + [gr.update()] * len(reloaded)
        return [f"saved {real}", new_text] + [filled[k] for k in order] + [filled, [], new_text, real, error_note("")]

    save.click(on_save, [save_to, *inputs], [saved, *reloaded], api_name="save_config")


def live_tab(ui: WebUI, job_id) -> None:
    status = gr.Markdown("Pick a job in the Jobs tab.", elem_id="live-status")
    with gr.Row():
        loss = gr.LinePlot(x="step", y="value", color="series", title="loss / val_loss", elem_id="plot-loss")
        lr = gr.LinePlot(x="step", y="value", color="series", title="lr per group", elem_id="plot-lr")
        dlr = gr.LinePlot(x="step", y="value", color="series", title="d*lr per group (Prodigy)", elem_id="plot-dlr")
    samples = gr.Gallery(label="samples by step, with their prompt (on a low-precision base: bf16 base | that base, "
                               "side by side)",
                         columns=6, object_fit="contain", height=300, allow_preview=False, elem_id="samples")
    log = gr.Textbox(label="log (tail)", lines=12, max_lines=12, elem_id="log-tail")

    shown = gr.State(None)  # the signature of what this page shows (handlers.live_signature)

    def emptied(status_line: str, last) -> list:
        """No job to show (Delete cleared the pick, or another tab deleted the job): the job shown before is
        emptied from the view (its curves, samples and log stayed, under "no such job"), once."""
        if last == status_line:
            return [gr.update()] * 6 + [last]
        empty = pd.DataFrame(columns=PLOT_COLUMNS)
        return [status_line, empty, empty, empty, [], "", status_line]

    def on_live(j, last):
        if j in (None, ""):
            return emptied("Pick a job in the Jobs tab.", last) if last is not None else [gr.update()] * 6 + [None]
        try:
            signature = ui.live_signature(j)
            if signature == last:  # nothing new: no data sent, no chart redrawn
                return [gr.update()] * 6 + [last]
            view = ui.live(j)
        except (JobError, ValueError):
            return emptied("no such job", last)
        return view["status"], view["loss"], view["lr"], view["dlr"], view["samples"], view["log"], signature

    outputs = [status, loss, lr, dlr, samples, log, shown]
    job_id.change(on_live, [job_id, shown], outputs, api_name=False)
    gr.Timer(REFRESH_SECONDS).tick(on_live, [job_id, shown], outputs, api_name=False)
    gr.Button(visible=False).click(lambda j: {k: (v.to_dict("records") if hasattr(v, "to_dict") else v)
                                              for k, v in ui.live(j).items()},
                                   [job_id], [gr.JSON(visible=False)], api_name="live")

    gr.Markdown("## Compare two jobs")
    with gr.Row():
        a, b = job_picker(ui, "job A"), job_picker(ui, "job B")
        column = gr.Dropdown(["loss", "val_loss", "lr", "d*lr"], value="loss", label="curve")
        go = gr.Button("Compare")
    both = gr.LinePlot(x="step", y="value", color="series", title="two jobs", elem_id="plot-compare")
    refused = gr.Markdown(visible=False, elem_classes="field-error")

    def on_compare(job_a, job_b, curve):
        try:
            return ui.compare(job_a, job_b, curve), error_note("")
        except JobError as e:
            return gr.update(), error_note(str(e))

    go.click(on_compare, [a, b, column], [both, refused], api_name="compare")
    gr.Timer(REFRESH_SECONDS * 5).tick(lambda: [gr.update(choices=ui.job_choices())] * 2, None, [a, b], api_name=False)


def plan_note(result: dict) -> str:
    """The line above a plan's report: its suggested keys as TOML writes them (`base_precision = "nf4"`, a line
    to copy into a config), or why there are none."""
    if best := result["suggested"]:
        return "**Suggested:** " + ", ".join(f"`{toml_dumps({k: v}).strip()}`" for k, v in best.items())
    return "**Nothing fits this card**, even with every block swapped." if result["ok"] else "**Plan failed.**"


def planner_tab(ui: WebUI, form: dict) -> None:
    gr.Markdown("What fits your card (`tools/plan_memory.py`: every component built on `meta`, one training step "
                "counted), and the settings to apply to the job form.")
    with gr.Row():
        source = gr.Radio(["preset", "the job form's config"], value="preset", label="plan")
        preset = gr.Dropdown(presets(), value=presets()[0], label="released model (preset)")
        vram = gr.Number(24, label="card memory (GiB)", elem_id="plan-vram")
        # empty: the config's own (its largest bucket and batch; a preset's 1024 and 1), as plan_memory.py does:
        # 1024 and 1 here planned the job form's config at another size than it trains. Text boxes: an empty
        # gr.Number reaches the handler as 0 from the browser.
        resolution = gr.Textbox("", label="resolution (px; empty: the config's)", placeholder="the config's")
        batch = gr.Textbox("", label="batch size (empty: the config's)", placeholder="the config's")
    run = gr.Button("Plan", variant="primary", elem_id="plan-run")
    suggestion = gr.Markdown(elem_id="plan-suggestion")
    report = gr.Textbox(label="plan", lines=14, elem_id="plan-report")
    keys = gr.JSON(label="suggested settings", elem_id="plan-keys")
    apply = gr.Button("Apply the suggested settings to the job form", elem_id="plan-apply")
    order, fields = form["order"], form["fields"]

    def on_plan(src, name, gib, side, size, text_value, *values):
        result = ui.plan(src, name, gib, side, size, text_value, edited(order, values))
        return plan_note(result), result["report"], result["suggested"]

    run.click(on_plan, [source, preset, vram, resolution, batch, *job_form_inputs(form)], [suggestion, report, keys],
              api_name="plan")

    def on_apply(best, text_value, *values):
        if not best:
            return [gr.update()] * (2 + len(order))
        new_text, new_values = ui.apply_plan(text_value, edited(order, values), best)
        # A field showing Apply's value shows what the TOML now says: compared with that from here, a field set
        # back to its Load-time value is an edit (compared with Load's, it was dropped and the TOML's value trained).
        loaded = {**values[-2], **{k: best[k] for k in order if k in best and new_values[k] == best[k]}}
        return [new_text] + [new_values[k] for k in order] + [loaded]

    apply.click(on_apply, [keys, *job_form_inputs(form)], [form["text"], *[fields[k] for k in order], form["loaded"]],
                api_name="apply_plan")
    timesteps_section(ui, form)


def timesteps_section(ui: WebUI, form: dict) -> None:
    gr.Markdown("The sigmas the job form's config trains on (`tools/plot_timesteps.py`: its timestep_sampling or the "
                "model's own, its timestep range), at each image size: the shifts follow the token count.")
    with gr.Row():
        sizes = gr.Textbox("1024", label="image sizes (px, comma-separated: 1024 or 1024x768)",
                           elem_id="timesteps-sizes")
        draw = gr.Button("Draw the sigmas", elem_id="timesteps-run")
    with gr.Row():
        plot = gr.Image(label="trained sigmas", type="filepath", elem_id="timesteps-plot")
        report = gr.Textbox(label="quantiles per size", lines=6, elem_id="timesteps-report")

    def on_draw(sizes_value, text_value, *values):
        result = ui.timesteps(sizes_value, text_value, edited(form["order"], values))
        return result["image"], result["report"]

    draw.click(on_draw, [sizes, *job_form_inputs(form)], [plot, report], api_name="timesteps")


def dataset_tab(ui: WebUI) -> None:
    with gr.Row():
        path = file_picker(ui, (".toml",), "dataset TOML", scale=3)
        training = file_picker(ui, (".toml",), "training config (optional: captions counted in its text encoder's "
                                               "tokens, its family's checks)", scale=3)
        check = gr.Button("Check", scale=1)
    summary = gr.Markdown()
    with gr.Row():
        # From zero: gradio scales y to the data, and buckets of equal counts drew no bar (the smallest none).
        buckets = gr.BarPlot(x="bucket", y="images", title="bucket histogram", y_lim=[0, None])
        problems = gr.Dataframe(label="problems, one per image and why (an error stops training; a warning trains anyway)",
                                interactive=False)
    images = gr.Gallery(label="images with captions (click one to edit its caption)", columns=6, height=300,
                        allow_preview=False, elem_id="dataset-images")
    # The caption file itself: an image folder shared by two subsets (.txt and .tags) shows each image twice.
    picked = gr.Textbox(label="caption file", interactive=False)
    caption = gr.Textbox(label="caption", lines=2)
    save = gr.Button("Save caption")
    saved = gr.Markdown()
    shown = gr.State([])  # the gallery's entries (handlers.CaptionFile), in its order
    shown_caption = gr.State(None)  # the picked file's text as shown (or last saved): a Save checks it is still that

    def on_check(p, config=None):  # optional in the API too (a client passing the dataset alone)
        try:
            view = ui.dataset(p, config or None)
        except (OutsideRoots, OSError, ValueError) as e:
            return f"⚠ {e}", None, None, [], []
        if not view["ok"]:
            return f"⚠ {view['error']}", None, None, [], []
        return view["summary"], view["buckets"], view["problems"], view["images"], view["captions"]

    check.click(on_check, [path, training], [summary, buckets, problems, images, shown], api_name="dataset")

    def on_select(entries, event: gr.SelectData):
        entry = entries[event.index]
        text, note = ui.picked_caption(entry)  # the file as it is now: a Save since Check changed it
        return entry.path, text, note, text

    images.select(on_select, [shown], [picked, caption, saved, shown_caption], api_name=False)
    save.click(lambda d, i, c, s: _saved(ui, d, i, c, s), [path, picked, caption, shown_caption], [saved, shown_caption],
               api_name="save_caption")


def _saved(ui: WebUI, dataset: str, image: str, caption: str, shown: str | None) -> tuple[str, str | None]:
    """The note under the box, and the text the page now holds as the file's (the saved one)."""
    try:
        return f"saved {ui.save_caption(dataset, image, caption, shown)}", (caption or "").strip()
    except (OutsideRoots, OSError, ValueError) as e:
        return f"⚠ {e}", shown


def tools_tab(ui: WebUI) -> None:
    loras = (".safetensors",)
    out = gr.Textbox(label="output", lines=12, elem_id="tool-output")
    gr.Button("Stop the running tool", size="sm").click(ui.stop_tools, [], [out], api_name="stop_tools")
    with gr.Accordion("lora_info: what a LoRA file holds", open=True):
        info_path = file_picker(ui, loras, "LoRA")
        gr.Button("Inspect").click(lambda p: ui.lora_tool("lora_info", {"lora": p})["output"], [info_path], [out],
                                   api_name="lora_info")
    with gr.Accordion("convert / resize", open=False):
        src = file_picker(ui, loras, "LoRA")
        dst = gr.Textbox(label="save to (a name goes to the jobs folder's tools/)")
        to = gr.Dropdown(["kohya", "diffusers", "comfy", "peft"], value="diffusers", label="convert to")
        rank = gr.Number(4, label="new rank")  # precision=0 rounded 2.5 to 2 in the page: whole_number refuses it
        with gr.Row():
            gr.Button("Convert").click(lambda s, d, t: ui.lora_tool("convert_lora", {"lora": s, "save_to": d, "to": t})
                                       ["output"], [src, dst, to], [out], api_name="convert_lora")
            gr.Button("Resize").click(lambda s, d, r: ui.lora_tool("resize_lora", {"lora": s, "save_to": d, "new_rank": r})
                                      ["output"], [src, dst, rank], [out], api_name="resize_lora")
    with gr.Accordion("post-hoc EMA: a job's saves averaged", open=False):
        ema_job = job_picker(ui, "job (its saves: save_every_n_steps)")
        decay = gr.Number(0.99, label="EMA decay per step (the training's ema_decay)")
        ema_to = gr.Textbox(label="save to (a name goes to the jobs folder's tools/)")
        gr.Button("Average").click(lambda j, d, s: ui.lora_tool("post_hoc_ema", {"job_id": j, "decay_per_step": d,
                                                                                 "save_to": s})["output"],
                                   [ema_job, decay, ema_to], [out], api_name="post_hoc_ema")
    with gr.Accordion("merge into a checkpoint", open=False):
        model = file_picker(ui, loras, "base model", folders=True)
        merge_lora = file_picker(ui, loras, "LoRA")
        ratio = gr.Slider(-2, 2, 1.0, step=0.05, label="weight")
        merged = gr.Textbox(label="save to")
        # merge_lora.py's --save_precision choices: GGUF writes one ComfyUI-GGUF .gguf file (save to a .gguf name)
        precision = gr.Dropdown(MERGE_PRECISIONS, value=KEEP_PRECISION, label="save precision")
        gr.Button("Merge").click(lambda m, l, w, s, p: ui.lora_tool("merge_lora", {"model": m, "lora": l, "weight": w,
                                                                                   "save_to": s, "save_precision": p})
                                 ["output"], [model, merge_lora, ratio, merged, precision], [out], api_name="merge_lora")
    with gr.Accordion("generate a test image with a job's models", open=False):
        job = job_picker(ui, "job (its model files)")
        gen_lora = file_picker(ui, loras, "LoRA (empty: none)")
        weight = gr.Slider(-2, 2, 1.0, step=0.05, label="LoRA weight")
        prompt = gr.Textbox(label="prompt")
        with gr.Row():
            side = gr.Number(1024, label="size (px)", precision=0)
            steps = gr.Number(20, label="steps", precision=0)
            seed = gr.Number(None, label="seed (blank: a random one)", precision=0)
        picture = gr.Image(label="image", type="filepath")

        def on_generate(j, lora, w, text, s, n, sd):
            result = ui.lora_tool("generate", {"job_id": j, "lora": lora, "weight": w, "prompt": text, "width": s,
                                               "steps": n, "seed": sd})
            return result["output"], result["image"]

        gr.Button("Generate").click(on_generate, [job, gen_lora, weight, prompt, side, steps, seed], [out, picture],
                                    api_name="generate")
