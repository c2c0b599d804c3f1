"""What the pages do, apart from their layout (library/ui/app.py): the job form merged into the TOML
and checked, the queue's actions, the live view's figures, the planner, the dataset view and the
LoRA tools. Values in, plain values out (strings, dicts, pandas frames), so each is testable alone."""

from __future__ import annotations

import contextlib
import math
import os
import sys
import tempfile
import time
from typing import NamedTuple

import pandas as pd
import toml

from library.data.image_names import is_image_name
from library.data.prompts import parse_prompt_line
from library.models.registry import BASE_PRECISIONS, FAMILIES  # noqa: F401 (BASE_PRECISIONS: the form's choices)
from library.text_files import read_utf8, set_toml_keys, toml_dumps, toml_loads
from library.training.config import _flatten
from library.training.config_schema import KEEPING_KEYS, SCHEMA
from library.ui import commands, peer_configs, run_files
from library.ui import runner as actions
from library.ui.config_check import ConfigChecker, dataset_folders
from library.ui.files import OutsideRoots, Roots, write_whole
from library.ui.jobs import ACTIVE, JobError, JobStore
from library.ui.runner import Runner

# The form's fields: config keys.
FORM_KEYS = ("model_type", "pretrained_model_name_or_path", "ae", "dataset_config", "network_dim", "max_train_steps",
             "learning_rate", "optimizer_type", "base_precision", "sample_prompts", "sample_every_n_steps")
OPTIMIZERS = ("AdamW", "AdamW8bit", "Prodigy", "AdamWScheduleFree")
MODEL_TYPES = SCHEMA["model_type"].choices  # every family and the LLM mode, as train_lora.py accepts them
PLOT_COLUMNS = ["step", "value", "series"]
KEEP_PRECISION = "keep the base's"  # the merge form's choice without --save_precision (its dtypes, its fp8 layout)
MAX_INT = 10**15  # beyond any real count or seed, and well inside SQLite's (and torch's) 64-bit integers
# The actions that remove a job's files: done only when confirmed (a Retry on a done job removed its LoRA at once).
CONFIRM_TO = {"delete": "delete it and its folder",
              "retry": "retry it from the start: its LoRAs, samples, saved state and logs are removed"}


# The keys base_precision replaces: the form writes base_precision alone, so they cannot contradict it.
FP8_KEYS = ("fp8_base", "fp8_scaled")


class Cleared:
    """What app.edited passes for a field Load filled and the user emptied: the key goes from the config (the
    trainer's default applies; Save TOML removes its line). An empty field Load left empty leaves the TOML's key."""

    def __repr__(self) -> str:
        return "CLEARED"


CLEARED = Cleared()


def cleared_keys(form: dict) -> tuple[str, ...]:
    return tuple(key for key, value in form.items() if value is CLEARED)


def replaced_keys(keys: dict) -> tuple[str, ...]:
    """The config's keys that setting `keys` removes: fp8_base / fp8_scaled where base_precision is set, and the
    keys train_lora.py refuses beside a plan's setting (they would do nothing): block_swap_prefetch at
    blocks_to_swap = 0, the checkpoint keeping keys without gradient_checkpointing."""
    drop = FP8_KEYS if "base_precision" in keys else ()
    if keys.get("blocks_to_swap") == 0:
        drop += ("block_swap_prefetch",)
    if keys.get("gradient_checkpointing") is False:
        drop += tuple(KEEPING_KEYS)
    return drop


def base_precision_of(settings: dict) -> str:
    """The base_precision key, else what the older fp8_base / fp8_scaled keys say."""
    if settings.get("base_precision"):
        return settings["base_precision"]
    if not settings.get("fp8_base"):
        return "bf16"
    return "fp8_scaled" if settings.get("fp8_scaled", SCHEMA["fp8_scaled"].default) else "fp8"


def form_values(settings: dict) -> dict:
    """The form's fields from a config's keys."""
    values = {k: settings.get(k) for k in FORM_KEYS if k != "base_precision"}
    values.update({k: str(v) for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
    values["base_precision"] = base_precision_of(settings)
    return values


def form_values_of(text: str) -> dict:
    """The form's fields from a config's TOML text (a ValueError where it is no valid config TOML)."""
    return form_values(_flatten(toml_loads(text or ""), "config"))


class FormError(JobError):
    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key


def field_value(key: str, value):
    """A form field's text as the key's type (the numbers are text fields: empty means "the TOML's")."""
    kind = SCHEMA[key].type
    if kind in (int, float) and isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            raise FormError(key, f"form: key '{key}' must be {'an integer' if kind is int else 'a number'}, "
                                 f"got {value.strip()!r}") from None
        if kind is int and not number.is_integer():
            raise FormError(key, f"form: key '{key}' must be an integer, got {value.strip()!r}")
        return int(number) if kind is int else number
    return value.strip() if isinstance(value, str) else value


def out_of_range(settings: dict) -> FormError | None:
    """The first integer key past MAX_INT (from the form or the TOML), which would reach the queue's
    database and the trainer as a raw overflow, as the error to show under its field."""
    for key, value in settings.items():
        if key in SCHEMA and SCHEMA[key].type is int and isinstance(value, int) and abs(value) > MAX_INT:
            return FormError(key, f"config: key '{key}' must be between {-MAX_INT} and {MAX_INT}, got {value}")
    return None


def changed_fields(settings: dict, form: dict) -> dict:
    """The form's filled fields that say something else than the config's keys, as the keys' types.
    An empty field, or one showing what the TOML says (as Load fills it), leaves the TOML's key as
    written: the check then refuses what train_lora.py refuses (max_train_steps = "120", base_precision
    beside fp8_base that contradicts it), and a job's or a saved config keeps the file's keys. A field
    the user emptied (CLEARED) is no value: cleared_keys names the keys it removes."""
    shown = form_values(settings)
    changed = {key: field_value(key, value) for key, value in form.items() if value is not None and value is not CLEARED
               and not (isinstance(value, str) and value.strip() in ("", shown.get(key)))}
    check_steps_override(settings, changed)
    return changed


def check_steps_override(settings: dict, changed: dict) -> None:
    """A changed steps field under max_train_epochs, which overrides it: the job would train the
    epochs without a word. Refused under the field, as train_lora.py refuses --max_train_steps there."""
    epochs = {**settings, **changed}.get("max_train_epochs")
    if "max_train_steps" in changed and epochs is not None:
        steps = changed["max_train_steps"]
        raise FormError("max_train_steps", f"form: steps (max_train_steps) {steps} would be ignored: max_train_epochs "
                                           f"= {epochs} in the TOML overrides it; remove max_train_epochs from the "
                                           f"TOML to train {steps} step{'s' if steps != 1 else ''}")


FORM_CONFIG = "the job form's config"  # how a tool's output names form_config_file's temporary TOML
TIMESTEP_DRAWS = 20_000  # the timesteps plot's sigmas per size: a histogram of 100 bins, drawn in well under a second

# A job's compute dtype as generate.py names it (mixed_precision "no": float32, as the run computed).
RENDER_DTYPES = {"no": "fp32", "fp16": "fp16", "bf16": "bf16"}


def rendering_as_trained(config: dict, device: str | None) -> list:
    """generate.py's flags that render as the job trained: its compute dtype, caption encoders' precision,
    swapped blocks, tiled decode and device (a full-size base it trained in bf16 with blocks swapped was
    drawn in float32, all blocks resident: twice its weights' memory)."""
    args = ["--dtype", RENDER_DTYPES[config.get("mixed_precision", SCHEMA["mixed_precision"].default)]]
    for key in ("text_encoder_precision", "blocks_to_swap"):
        if config.get(key) not in (None, ""):
            args += [f"--{key}", config[key]]
    args += ["--vae_tiling"] if config.get("vae_tiling") else []
    named = device == "cpu" or (device or "").startswith("cuda")  # webui.py's "default": generate.py's own choice
    return args + (["--device", device] if named else [])


def form_changes(settings: dict, form: dict) -> tuple[dict, tuple[str, ...]]:
    """(the form's changed fields, the config's keys they remove): base_precision replaces the older fp8_base /
    fp8_scaled keys, which could contradict it; a field the user emptied removes its key."""
    changed = changed_fields(settings, form)
    return changed, replaced_keys(changed) + cleared_keys(form)


def apply_form(settings: dict, form: dict) -> dict:
    """The config's keys with the form's changed fields over them, less the keys they remove (form_changes)."""
    changed, drop = form_changes(settings, form)
    return {**{k: v for k, v in settings.items() if k not in drop}, **changed}


def toml_with(text: str, settings: dict, keys: dict, drop: tuple[str, ...] = ()) -> str:
    """The TOML text (whose keys less `drop` are `settings`) with `keys` set and `drop` removed where
    it writes them, comments and tables kept; the whole dump where the line edit cannot follow its
    layout (a dotted key, a key inside a multi-line string)."""
    new_text = set_toml_keys(text, keys, drop)
    try:
        if _flatten(toml_loads(new_text), "config") == {**settings, **keys}:
            return new_text
    except (toml.TomlDecodeError, ValueError):
        pass
    return toml_dumps({**settings, **keys})


def job_number(job_id) -> int:
    """A job id from a page's field (text, a number or a dropdown's value), or JobError."""
    try:
        return int(str(job_id).strip())
    except ValueError:
        raise JobError(f"job {job_id!r}: not a job number; pick a job in the list") from None


def whole_number(value, what: str, least: int = 1) -> int:
    """A form's whole number (a gradio Number sends None when empty), or ValueError naming the field."""
    if isinstance(value, str):
        value = value.strip()
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what}: give a whole number >= {least}, got {value!r}") from None
    if not number.is_integer() or number < least or number > MAX_INT:
        raise ValueError(f"{what}: give a whole number >= {least}, got {value!r}")
    return int(number)


def finite_number(value, what: str) -> float:
    """A form's number (a cleared gradio Slider or an API call sends None), or ValueError naming the field."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what}: give a number, got {value!r}") from None
    if not math.isfinite(number):
        raise ValueError(f"{what}: give a number, got {value!r}")
    return number


class CaptionFile(NamedTuple):
    """One gallery entry: an image of one subset and the caption file training reads for it there (an
    image folder shared by two subsets, .txt and .tags, is two entries, one per caption file)."""
    image: str  # its real path
    path: str  # the image's stem + its subset's caption_extension
    class_tokens: str | None  # the caption training uses where that file is missing


def frame(rows: list[dict], columns: list[str], series_of=lambda c: c) -> pd.DataFrame:
    """Long-format rows (step, value, series) of the CSV columns given, for one line per series."""
    data = [(row["step"], row[c], series_of(c)) for row in rows for c in columns if row.get(c) is not None]
    return pd.DataFrame(data, columns=PLOT_COLUMNS)


def curve_rows(job) -> tuple[list[dict], list[str]]:
    """The job's CSV log rows and their columns, with an LLM job's val_loss from its eval CSV (rows of
    their own, after the log's)."""
    rows = run_files.read_rows(job.csv_path)
    columns = list(rows[-1]) if rows else []
    evals = [row for row in run_files.read_rows(job.eval_csv_path, ("step", "val_loss"))
             if row.get("step") is not None and row.get("val_loss") is not None]
    if evals and "val_loss" not in columns:
        columns.append("val_loss")
    return rows + evals, columns


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n else "-"


class WebUI:
    def __init__(self, jobs_dir: str, workdir: str, roots: list[str], devices: tuple[str, ...] = ("cpu",),
                 python: str = sys.executable):
        self.workdir, self.python = os.path.realpath(workdir), python
        self.store = JobStore(jobs_dir)
        self.roots = Roots([*roots, self.store.root], self.workdir)
        self.runner = Runner(self.store, self.workdir, devices, python)
        self.checker = ConfigChecker(self.workdir, python)
        self.tool_runs = commands.ToolRuns()

    def start(self) -> None:
        self.runner.start()
        self.checker.start()

    def close(self) -> None:
        self.runner.close()
        self.checker.close()
        self.tool_runs.stop()  # a tool outliving the UI wrote its file where no page would say so

    # -- the job form ------------------------------------------------------------------------
    def load_config(self, path: str, convert: bool = True) -> tuple[str, dict, str]:
        """A config file (inside the roots) as the editor's text, the form's fields and a note. A peer's config
        (ai-toolkit's YAML, a TOML with sd-scripts' or musubi-tuner's keys) is converted first, unless `convert`
        is false (Save's reading back): tools/convert_config.py writes ours beside it, the editor gets ours and
        the note what each key became."""
        return self.open_config(path, convert)[1:]

    def open_config(self, path: str, convert: bool = True) -> tuple[str, str, dict, str]:
        """load_config's answer after the real path of the file the text is (ours, where a peer's was converted):
        a Save to that file later checks that no one else wrote it meanwhile."""
        real = self.roots.resolve(path, "config")
        if os.path.isdir(real):
            raise ValueError(f"config {path!r} is a folder: pick a .toml file (or a peer's .yaml)")
        text = read_utf8(real, "config file")  # not UTF-8 (a picture): one line naming the file
        note = ""
        if convert and peer_configs.is_peer_config(real, text):
            real, note = peer_configs.convert(self.roots, real, text, self.python, self.checker)
            path, text = self.roots.shown(real), read_utf8(real, "converted config")
        try:
            settings = _flatten(toml_loads(text), path)
        except toml.TomlDecodeError as e:
            raise ValueError(f"{path}: not valid TOML: {e}") from None
        return real, text, form_values(settings), note

    def settings(self, text: str, form: dict) -> dict:
        try:
            return apply_form(_flatten(toml_loads(text or ""), "config"), form)
        except toml.TomlDecodeError as e:
            raise JobError(f"config: not valid TOML: {e}") from None

    def check(self, text: str, form: dict) -> dict:
        """{"ok", "key", "error", "settings", "max_steps", "logging_subdir"}: the config as train_lora.py
        would check it, with the job's folder as its output_dir."""
        try:
            settings = self.settings(text, form)
            if too_big := out_of_range(settings):
                raise too_big
        except (JobError, ValueError) as e:
            return {"ok": False, "key": getattr(e, "key", None), "error": str(e)}
        subdir = self.logging_subdir(settings)
        if subdir is not None:  # checked where the job will write it
            settings = {**settings, "logging_dir": os.path.join(self.store.root, subdir)}
        answer = self.checker.check(toml_dumps(settings), self.store.root, self.roots.roots)
        answer.setdefault("settings", settings)
        return {**answer, "logging_subdir": subdir}

    def logging_subdir(self, settings: dict) -> str | None:
        """Where the config's logging_dir lies inside its output_dir (the configs' "<output_dir>/logs"),
        as train_lora.py run in the jobs' folder resolves both: a job's output_dir is its own folder, so
        such a logging_dir moves into it too (it stayed "output/<name>/logs", outside the job and
        the roots). None: no logging_dir, or one outside the output_dir (kept as it is)."""
        logging_dir, output_dir = settings.get("logging_dir"), settings.get("output_dir")
        if not logging_dir or not output_dir:
            return None
        inner = os.path.relpath(os.path.join(self.workdir, logging_dir), os.path.join(self.workdir, output_dir))
        return None if inner == os.pardir or inner.startswith(os.pardir + os.sep) else os.path.normpath(inner)

    def save_config(self, path: str, text: str, form: dict, loaded: tuple[str, str] | None = None) -> str:
        """The editor's TOML, with the fields changed from it set where it writes them (its comments,
        tables and other keys kept), written to `path` (a .toml file under the roots); the path written.
        loaded: (the real path, the text) of the file the page loaded (open_config) or saved last: that file
        holding another text now (another tab saved it) is refused, not written over."""
        if not str(path or "").strip().endswith(".toml"):
            raise ValueError(f"save to {path!r}: give a .toml file under the roots")
        real = self.roots.resolve(path.strip(), "save to")
        if os.path.commonpath([real, self.store.root]) == self.store.root:  # it was written, then lost at launch
            raise ValueError(f"save to {path!r}: that is in the jobs folder, whose files the UI writes (a job's "
                             f"config.toml again at each launch; a deleted job takes its folder): save under another "
                             f"folder")
        if loaded and loaded[0] == real and os.path.isfile(real) and read_utf8(real, "config file") != loaded[1]:
            raise ValueError(f"save to {path!r}: the file changed since this page loaded it (another tab or program "
                             f"saved it): Load it again to see its text, or save to another file")
        try:
            settings = _flatten(toml_loads(text or ""), "config")
        except toml.TomlDecodeError as e:
            raise ValueError(f"config: not valid TOML: {e}") from None
        changed, drop = form_changes(settings, form)
        new_text = toml_with(text or "", {k: v for k, v in settings.items() if k not in drop}, changed, drop)
        write_whole(real, new_text)
        return real

    def create(self, name: str, text: str, form: dict, queue: bool) -> dict:
        answer = self.check(text, form)
        if not answer["ok"]:
            return answer
        settings = {k: v for k, v in answer["settings"].items() if k != "output_dir"}
        name = (name or "").strip() or settings.get("output_name") or "job"
        try:
            job = self.store.create(name, settings, answer["max_steps"], queue=queue,
                                    logging_subdir=answer.get("logging_subdir"))
        except JobError as e:
            return {"ok": False, "key": None, "error": str(e)}
        return {"ok": True, "job_id": job.id, "state": job.state, "output_dir": job.output_dir}

    # -- queue actions -----------------------------------------------------------------------
    def act(self, action: str, job_id, confirm: bool = False) -> dict:
        try:
            job_id = job_number(job_id)
            if action in CONFIRM_TO and not confirm:
                raise JobError(f"job {job_id}: confirm to {CONFIRM_TO[action]}")
            if action == "delete":
                self.store.delete(job_id)
                return {"ok": True, "job_id": job_id, "state": "deleted"}
            job = {"queue": actions.queue, "stop": actions.stop, "resume": actions.resume,
                   "retry": actions.retry}[action](self.store, job_id)
            return {"ok": True, "job_id": job.id, "state": job.state, "message": job.message}
        except (JobError, ValueError, TypeError) as e:
            return {"ok": False, "error": str(e)}
        except OSError as e:  # the job's folder, changed by hand
            return {"ok": False, "error": f"job {job_id}: cannot {action}: {e.strerror}: {e.filename}"}

    def jobs_table(self) -> pd.DataFrame:
        rows = []
        for job in reversed(self.store.list()):
            total = f"/{job.max_steps}" if job.max_steps else ""
            started = time.strftime("%H:%M:%S", time.localtime(job.started)) if job.started else ""
            rows.append((job.id, job.name, job.state, f"{job.last_step}{total}", started, job.message))
        return pd.DataFrame(rows, columns=["id", "name", "state", "step", "started", "message"])

    def job_choices(self) -> list[tuple[str, str]]:
        return [(f"{job.id}: {job.name} ({job.state})", str(job.id)) for job in reversed(self.store.list())]

    # -- the live view -----------------------------------------------------------------------
    def live(self, job_id) -> dict:
        """Progress, the CSV's curves, the samples, the log's tail and peak memory of one job."""
        job = self.store.get(job_number(job_id))
        rows, columns = curve_rows(job)
        bar = run_files.progress(job.log_path, job.last_step, job.max_steps)
        if job.state not in ACTIVE:  # the bar of an earlier run would tell an old ETA
            bar = run_files.Progress(job.last_step, job.max_steps or bar.total)
        percent = f" ({100 * bar.step / bar.total:.0f}%)" if bar.total else ""
        timing = f", elapsed {bar.elapsed}, ETA {bar.remaining}" if bar.remaining else ""
        memory = f"peak RSS {gib(job.peak_rss)}" + (f", peak VRAM {gib(job.peak_vram)} (nvidia-smi, sampled)"
                                                     if job.peak_vram else "")
        prompts = run_files.prompts(self._sample_prompts(job))
        gallery = []
        for sample in run_files.samples(job.output_dir, job.output_name):
            prompt = prompts[sample.index] if sample.index < len(prompts) else f"prompt {sample.index}"
            gallery.append((sample.path, f"{sample.tag}: {prompt}"))
        return {
            "status": f"**job {job.id} {job.name}: {job.state}**, step {bar.step}/{bar.total or '?'}{percent}{timing}; "
                      f"{memory}" + (f"\n\n{job.message}" if job.message else ""),
            "loss": frame(rows, [c for c in ("loss", "val_loss") if c in columns]),
            "lr": frame(rows, [c for c in columns if c.startswith("lr/")]),
            "dlr": frame(rows, [c for c in columns if c.startswith("d*lr/")]),
            "samples": gallery,
            "log": "\n".join(run_files.log_lines(job.log_path, 40)),
            "step": bar.step, "total": bar.total, "peak_rss": job.peak_rss, "state": job.state,
        }

    def live_signature(self, job_id) -> tuple:
        """What the live view shows changes only when this does (the job's row, the CSV, the log, the
        samples): the page redraws nothing while it stays the same."""
        job = self.store.get(job_number(job_id))
        stats = []
        for path in (job.csv_path, job.eval_csv_path, job.log_path, job.output_dir):
            try:
                info = os.stat(path)
                stats.append((info.st_size, info.st_mtime_ns))
            except OSError:
                stats.append(None)
        return (job.id, job.state, job.message, job.last_step, job.peak_rss, job.peak_vram, *stats)

    def _sample_prompts(self, job) -> str | None:
        path = toml_loads(job.config).get("sample_prompts")
        if not path:
            return None
        try:
            return self.roots.resolve(path, "sample_prompts")
        except OutsideRoots:
            return None

    def compare(self, job_a, job_b, column: str = "loss") -> pd.DataFrame:
        frames = []
        for job_id in (job_a, job_b):
            if job_id in (None, ""):
                continue
            job = self.store.get(job_number(job_id))
            rows, columns = curve_rows(job)
            picked = [c for c in columns if c == column or c.startswith(column + "/")]
            frames.append(frame(rows, picked, lambda c, job=job: f"{job.id} {job.name}: {c}"))
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=PLOT_COLUMNS)

    # -- before a run ------------------------------------------------------------------------
    def plan(self, source: str, preset: str, vram: float, resolution, batch_size, text: str, form: dict) -> dict:
        """plan_memory.py's report and the setting it suggests; bad input is the report's one line."""
        try:
            vram = float(vram)
            if not 0 < vram < 1e6:
                raise ValueError
        except (TypeError, ValueError):
            return self._plan_refused(f"card memory (GiB): give a number > 0, got {vram!r}")
        if source == "preset" and not (preset or "").strip():  # plan_memory.py said "None: config file not found"
            return self._plan_refused("released model (preset): pick one, or plan the job form's config")
        try:
            given = lambda value: value is not None and str(value).strip() != ""  # noqa: E731
            resolution = whole_number(resolution, "resolution (px)", 64) if given(resolution) else None
            batch_size = whole_number(batch_size, "batch size") if given(batch_size) else None
            settings = self.settings(text, form) if source != "preset" else None
        except (JobError, ValueError) as e:
            return self._plan_refused(str(e))
        try:
            with self.form_config_file(settings) if settings is not None else contextlib.nullcontext() as config_file:
                result, fits = commands.plan(self.workdir, vram, preset if source == "preset" else None, config_file,
                                             resolution, batch_size, self.python, self.checker)
        except JobError as e:  # the config names a file outside the roots
            return self._plan_refused(str(e))
        if config_file:  # the report's errors named the temporary file, removed by now
            result.output = result.output.replace(config_file, FORM_CONFIG)
        best = commands.suggestion(fits)
        suggested = {**commands.suggested_keys(best), **commands.caching_keys(result.output)} if best else None
        return {"ok": result.ok, "report": result.output, "fits": [vars(f) for f in fits], "suggested": suggested}

    def timesteps(self, sizes: str, text: str, form: dict) -> dict:
        """plot_timesteps.py on the job form's config: the sigmas it trains on at each size, {"ok", "report", "image"
        (the PNG, or None)}; bad input is the report's one line. It reads the model's headers: the roots first."""
        out = self.tool_output("timesteps.png", "sigma plot")
        try:
            with self.form_config_file(self.settings(text, form)) as config_file:
                args = ["--config_file", config_file, "--resolution", (sizes or "").strip() or "1024",
                        "--draws", TIMESTEP_DRAWS, "--out", out]
                result = commands.run_tool("plot_timesteps.py", args, self.workdir, self.python, helper=self.checker)
        except (JobError, ValueError) as e:  # not TOML, a bad field, or a file outside the roots
            return {"ok": False, "report": str(e), "image": None}
        report = result.output.replace(config_file, FORM_CONFIG)
        return {"ok": result.ok, "report": report, "image": out if result.ok else None}

    @contextlib.contextmanager
    def form_config_file(self, settings: dict):
        """The job form's settings as a temporary TOML in the jobs folder for a tool to read (plan_memory.py,
        plot_timesteps.py), removed after; first the config checker's word that it names no file outside the roots
        (the tool reads them: headers, images), its line a JobError where it does. A tool's output names the path:
        FORM_CONFIG says it to the user."""
        text = toml_dumps(settings)
        answer = self.checker.check(text, self.store.root, self.roots.roots, reads_only=True)
        if not answer["ok"]:
            raise JobError(answer["error"])
        with tempfile.NamedTemporaryFile("w", suffix=".toml", dir=self.store.root, delete=False) as f:
            f.write(text)
        try:
            yield f.name
        finally:
            os.remove(f.name)

    @staticmethod
    def _plan_refused(message: str) -> dict:
        return {"ok": False, "report": message, "fits": [], "suggested": None}

    def apply_plan(self, text: str, form: dict, keys: dict) -> tuple[str, dict]:
        """The TOML text and form with a plan's suggested keys set: in the text where it writes them
        (its comments, tables and other keys kept), the form's fields as they were but base precision."""
        drop = replaced_keys(keys)
        try:
            written = {k: v for k, v in _flatten(toml_loads(text or ""), "config").items() if k not in drop}
        except (toml.TomlDecodeError, ValueError):  # edited since the plan: left for Validate to explain
            return text, {**form_values({}), **form}
        new_text = toml_with(text or "", written, keys, drop)
        planned = {k: v for k, v in keys.items() if k in FORM_KEYS}
        shown = {k: "" if v is CLEARED else v for k, v in form.items()}  # still empty, still cleared at the next event
        return new_text, {**form_values({**written, **keys}), **shown, **planned}

    def dataset(self, path: str, training_config: str | None = None) -> dict:
        """check_dataset.py's report (buckets, problems) and the images with their captions; with a training
        config, as that config trains the dataset (without one, no caption was counted against a text encoder's
        tokens: the page said nothing of captions a 64-token encoder cuts)."""
        real = self.roots.resolve(path, "dataset config")
        config = self.roots.resolve(training_config, "training config") if training_config else None
        self._check_dataset_reads(real)
        result, report = commands.check_dataset(self.workdir, real, self.python, self.checker, config)
        if report is None:
            return {"ok": False, "error": result.output}
        entries = self._caption_files(real)
        buckets, problems = {}, []
        for subset in report["subsets"]:
            for bucket, count in subset["buckets"].items():
                buckets[bucket] = buckets.get(bucket, 0) + count
            problems += [(p["severity"], p["kind"], p["message"]) for p in subset["problems"]]
        return {"ok": True, "images": [(e.image, self._gallery_caption(e)) for e in entries], "captions": entries,
                "buckets": pd.DataFrame(sorted(buckets.items()), columns=["bucket", "images"]),
                "problems": pd.DataFrame(problems, columns=["severity", "kind", "message"]),
                "summary": f"{sum(s['images'] for s in report['subsets'])} images, "
                           f"{sum(s['trained'] for s in report['subsets'])} trained; {report['errors']} errors, "
                           f"{report['warnings']} warnings; {report['token_check']}"}

    def _check_dataset_reads(self, dataset_config: str) -> None:
        """OutsideRoots where a folder the dataset TOML names lies outside the roots: check_dataset.py decodes
        its images and reads its captions (old: the report named the files of a folder anywhere)."""
        from library.data.dataset_config import load_dataset_config

        try:
            blueprint = load_dataset_config(dataset_config)
        except (ValueError, OSError):  # check_dataset.py's own line says why
            return
        for key, folder in dataset_folders(blueprint):
            if folder:
                self.roots.resolve(folder, f"{self.roots.shown(dataset_config)}'s {key}")

    def _caption_files(self, dataset_config: str) -> list[CaptionFile]:
        """The dataset's images (real paths, under the roots), each with its subset's caption file. A subset
        whose image_dir is missing is left out (check_dataset's report names it), one outside the roots too
        (the dataset page refuses such a dataset first: _check_dataset_reads)."""
        from library.data.dataset_config import load_dataset_config

        found = []
        for spec in load_dataset_config(dataset_config).datasets:
            for subset in spec.subsets:
                try:
                    folder = self.roots.resolve(subset.image_dir, "image_dir")
                    names = sorted(os.listdir(folder))
                except (OutsideRoots, OSError):
                    continue
                for name in filter(is_image_name, names):  # training's images: no '._000.png' of macOS
                    try:  # each file too: a link in the folder may lead out of the roots
                        image = self.roots.resolve(os.path.join(folder, name), "image")
                    except OutsideRoots:
                        continue
                    found.append(CaptionFile(image, os.path.splitext(image)[0] + subset.caption_extension,
                                             subset.class_tokens))
        return found

    def _read_caption(self, path: str) -> str:
        """A caption file's text; "" where there is none, where it links out of the roots, or where it is
        not UTF-8 (check_dataset's report names that file; raised, it hid the whole report)."""
        try:
            with open(self.roots.resolve(path, "caption"), encoding="utf-8") as f:
                return f.read().strip()
        except (OSError, OutsideRoots, UnicodeDecodeError):
            return ""

    def _gallery_caption(self, entry: CaptionFile) -> str:
        if not os.path.exists(entry.path) and entry.class_tokens:
            return f"(class_tokens: {entry.class_tokens})"
        return self._read_caption(entry.path)

    def picked_caption(self, entry: CaptionFile) -> tuple[str, str]:
        """The caption box's text for a gallery pick, read from its file now (the gallery's is Check's,
        older than any Save since), and a note where training captions the image with class_tokens."""
        if not os.path.exists(entry.path) and entry.class_tokens:
            return "", (f"no caption file {os.path.basename(entry.path)}: training captions this image with "
                        f"its subset's class_tokens {entry.class_tokens!r}; a caption saved here replaces them")
        return self._read_caption(entry.path), ""

    def save_caption(self, dataset: str, picked: str, caption: str, shown: str | None = None) -> str:
        """`caption` written to one of the dataset's caption files: `picked` is the caption file (as the
        gallery's pick names it), or an image with one caption file (an image folder shared by two
        subsets gives its images two, .txt and .tags: which is meant is unknown). Anything else is
        refused, and so is an empty caption, which training refuses. shown: the text the page showed for
        it (picked_caption's, or its last save): a file holding another text now (another tab or program
        saved it since) is refused, not written over."""
        if not (caption or "").strip():
            raise ValueError(f"caption for {picked!r} is empty: training refuses an empty caption file; type one "
                             f"(an image without a caption file takes its subset's class_tokens)")
        real = self.roots.resolve(picked, "caption file")
        entries = self._caption_files(self.roots.resolve(dataset, "dataset config"))
        paths = sorted({e.path for e in entries if real in (e.image, os.path.realpath(e.path))})
        if not paths:
            raise ValueError(f"{picked!r} is not an image or a caption file of the dataset {dataset!r}: pick "
                             f"an image in its gallery")
        if len(paths) > 1:
            raise ValueError(f"image {picked!r} has {len(paths)} caption files in the dataset {dataset!r} "
                             f"({', '.join(paths)}): give the caption file to write")
        path = self.roots.resolve(paths[0], "caption")
        if shown is not None and self._read_caption(path) != shown.strip():
            raise ValueError(f"caption file {path}: changed since this page showed it (another tab or program saved "
                             f"it): pick the image again to see its text")
        write_whole(path, caption.strip() + "\n")
        return path

    # -- after a run: the LoRA tools ---------------------------------------------------------
    def tool_output(self, path: str, what: str) -> str:
        """An output path for a tool: inside the roots (default: the jobs folder's tools/)."""
        if not path:
            raise OutsideRoots(f"{what}: no path given")
        if not os.path.isabs(path) and os.sep not in path:
            os.makedirs(os.path.join(self.store.root, "tools"), exist_ok=True)
            path = os.path.join(self.store.root, "tools", path)
        return self.roots.resolve(path, what)

    def lora_tool(self, tool: str, values: dict) -> dict:
        try:
            args, output = self._tool_args(tool, values)
        except (OutsideRoots, JobError, ValueError) as e:  # a field's bad value: one line
            return {"ok": False, "output": str(e), "image": None}
        # No time limit: a full-size merge or GGUF quantization runs for many minutes; Stop ends it (stop_tools).
        result = commands.run_tool(f"{tool}.py", args, self.workdir, self.python, timeout=None, runs=self.tool_runs)
        image = None
        if tool == "generate" and result.ok:
            pngs = [os.path.join(output, f) for f in os.listdir(output) if f.endswith(".png")]
            image = max(pngs, key=os.path.getmtime) if pngs else None
        return {"ok": result.ok, "output": result.output, "image": image}

    def stop_tools(self) -> str:
        """Stop the LoRA tools running for the forms (each exits through its clean-ups: no partial output)."""
        count = self.tool_runs.stop()
        return f"stopping {count} tool run{'s' if count > 1 else ''}" if count else "no tool is running"

    def _tool_args(self, tool: str, v: dict) -> tuple[list, str | None]:
        lora = lambda key="lora": self.roots.resolve(v[key], "LoRA")  # noqa: E731
        if tool == "lora_info":
            return [lora()], None
        if tool == "convert_lora":
            return [lora(), self.tool_output(v["save_to"], "output"), "--to", v["to"]], None
        if tool == "resize_lora":
            return ["--lora", lora(), "--save_to", self.tool_output(v["save_to"], "output"),
                    "--new_rank", whole_number(v["new_rank"], "new rank")], None
        if tool == "post_hoc_ema":  # a job's saves: its intermediate ones and its final
            job = self.store.get(job_number(v["job_id"]))
            saves = run_files.saves(job.output_dir, job.output_name)
            if len(saves) < 2:
                raise JobError(f"job {job.id}: {len(saves)} save{'s' if len(saves) != 1 else ''} of {job.output_name} "
                               f"in its folder; an average needs two or more (a config with save_every_n_steps)")
            return [*saves, "--save_to", self.tool_output(v["save_to"], "output"),
                    "--decay_per_step", str(finite_number(v["decay_per_step"], "decay per step"))], None
        if tool == "merge_lora":
            weight = finite_number(v["weight"], "weight")
            keep = v["save_precision"] in (None, "", KEEP_PRECISION)  # merge_lora.py's default: the base's dtypes
            return ["--model", self.roots.resolve(v["model"], "model"), "--lora", f"{lora()}:{weight}",
                    "--save_to", self.tool_output(v["save_to"], "output"),
                    *([] if keep else ["--save_precision", v["save_precision"]])], None
        if tool == "generate":  # with a job's models
            job = self.store.get(job_number(v["job_id"]))
            config = toml_loads(job.config)
            if config["model_type"] not in FAMILIES:
                raise JobError(f"job {job.id} trains an LLM (model_type {config['model_type']}): generate draws images "
                               f"with a diffusion job's models (an LLM job's samples are in its log)")
            out = self.tool_output(f"generated-job{job.id}", "output")
            args = ["--model_type", config["model_type"], "--model", config["pretrained_model_name_or_path"],
                    *(["--ae", config["ae"]] if config.get("ae") else []),  # none for a model without a VAE file
                    "--prompt", v["prompt"], "--width", whole_number(v["width"], "size (px)"),
                    "--height", whole_number(v["width"], "size (px)"), "--steps", whole_number(v["steps"], "steps"),
                    "--base_precision", base_precision_of(config), "--out", out,
                    *rendering_as_trained(config, job.device)]
            from library.training.config_schema import FAMILY_KEYS

            for key in (k for k in FAMILY_KEYS if k in config):  # generate.py reads these as the config's
                value = config[key]  # a bool as generate.py's true / false (a skipped one drew with its default)
                args += [f"--{key}", str(value).lower() if isinstance(value, bool) else value]
            if v.get("seed") not in (None, ""):  # blank: generate.py draws one and names the file with it
                args += ["--seed", whole_number(v["seed"], "seed", 0)]
            for path in parse_prompt_line(v["prompt"], "prompt").control_images:  # an edit model draws them
                self.roots.resolve(path, "--ci image")
            # the base the job trained on had its base_loras merged (its samples rendered with them): drawn with them
            args += [arg for entry in config.get("base_loras") or [] for arg in ("--lora", entry)]
            if v.get("lora"):
                args += ["--lora", f"{lora()}:{finite_number(v['weight'], 'LoRA weight')}"]
            return args, out
        raise ValueError(f"unknown tool {tool!r}")
