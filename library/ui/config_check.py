"""A job's config, checked as train_lora.py checks it, in a helper process (it imports torch; the UI
process does not).

The helper (`python -m library.ui.config_check WORKDIR`) reads one JSON request per line on stdin,
{"toml": text, "output_dir": folder, "roots": [folders]}, and answers one JSON line: {"ok": true, "settings": {...},
"max_steps": N} or {"ok": false, "key": "network_dim" or null, "error": "one line"}. It runs
library.training.config.load_config on the text (the schema, types, choices and combinations that
train_lora.py enforces, the optimizer class) and then the checks train_lora.py runs first, its own function
(check_before_training: the model files' headers, blocks_to_swap, network_args, the LoRA files, the base's
stored precision; an LLM's train_data), with relative paths resolved against WORKDIR, where the jobs run;
every file the config names, and every folder its dataset TOML names, must lie under one of the roots (the
UI's --root folders), and the files and folders train_lora.py opens first (dataset, prompts, resume state,
initial weights) must be there.

The same warm process runs the UI's light tools in-process (TOOLS_IN_HELPER: the memory planner, the dataset
checker, the config converter; a request {"kind": "tool", "script": "plan_memory.py", "args": [...]} answers
{"returncode": 0, "stdout": ..., "stderr": ...}): as a fresh process each, a tiny plan of ~2 s waited ~15 s for
torch, diffusers and transformers to import on 2 cores. Checks and tools are served by a thread each, so a
Validate does not wait for a full-size plan; a request's "id" comes back with its answer.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import os
import queue
import re
import runpy
import subprocess
import sys
import tempfile
import threading

from library.errors import exit_without_collecting, printed_warnings
from library.ui.files import read_from, within

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KEY_IN_ERROR = re.compile(r"key '([A-Za-z0-9_]+)'|--([A-Za-z0-9_]+)")
# A line that starts with a key (after the file's "config: " or the model's path): optim.py's
# "optimizer_type 'x' is unknown" and "optimizer_args (d0=...) do not fit AdamW", "network_args: unknown key
# 'conv_dim' ...", "train_data x.txt: no such text file or folder", "blocks_to_swap must be between ..."
KEY_FIRST = re.compile(r"(?:[^:' ]+: )?([a-z][a-z0-9_]*)[ :]")


def error_key(message: str) -> str | None:
    """The config key an error line names (ConfigError says "key 'x'"; others start with the key), or None.
    A key the config may not have ("network_args: unknown key 'conv_dim'") gives way to the one the line starts
    with."""
    from library.training.config_schema import SCHEMA

    match = KEY_IN_ERROR.search(message)
    named = match and (match.group(1) or match.group(2))
    if named in SCHEMA:
        return named
    first = KEY_FIRST.match(message)
    return first.group(1) if first and first.group(1) in SCHEMA else named or None


def file_key(args, message: str) -> str | None:
    """The model-file key whose path a model-file error names (those errors name the file, not the key)."""
    from library.models.family import family_class

    keys = family_class(args.model_type).required_paths() if args.model_type != "llm" else ()
    return next((k for k in keys if getattr(args, k) and str(getattr(args, k)) in message), None)


# -- the helper process ------------------------------------------------------------------------

GENERIC_PATH_KEYS = ("pretrained_model_name_or_path", "ae", "dataset_config", "sample_prompts", "network_weights",
                     "resume", "logging_dir", "timestep_loss_weights")


def inside(path: str, roots: list[str]) -> bool:
    real = os.path.realpath(path)
    return any(within(real, root) for root in roots)


def refusal(key: str, message: str) -> dict:
    return {"ok": False, "key": key, "error": f"config: key '{key}': {message}"}


def outside_roots(args, roots: list[str]) -> dict | None:
    """The first file key whose path lies outside the roots, as an error answer (None: all inside):
    a job reads only what the pages may open."""
    keys = list(GENERIC_PATH_KEYS)
    if args.model_type != "llm":
        from library.models.family import family_class

        family = family_class(args.model_type)
        keys += [k for k in (*family.required_paths(), *family.optional_path_keys) if k not in keys]
    values = [(k, getattr(args, k)) for k in keys if getattr(args, k, None)]
    from library.lora_spec import parse_lora_spec

    # As the trainer splits an entry: "a/b 12:30/../x" names the whole path where that exists, not "a/b 12"
    values += [("base_loras", parse_lora_spec(entry, "base_loras").path) for entry in args.base_loras]
    values += [("train_data", entry) for entry in args.train_data]
    for key, path in values:
        if not inside(path, roots):
            return refusal(key, f"{path!r}{read_from(path, os.getcwd())} is outside the folders this UI may open; "
                                f"start tools/webui.py with --root FOLDER to add one")
    return None


# The files and folders train_lora.py opens before its first step: refused now, not seconds after queuing.
MUST_BE_FILES = ("dataset_config", "sample_prompts")


def missing_paths(args) -> dict | None:
    """The first path key that names nothing usable (None: all there)."""
    wanted = [(k, "a file", os.path.isfile) for k in MUST_BE_FILES]
    wanted.append(("resume", "a state folder", os.path.isdir))
    # an LLM's initial weights may be a PEFT adapter folder; a diffusion LoRA is a .safetensors file
    wanted.append(("network_weights", "a file or folder" if args.model_type == "llm" else "a file",
                   os.path.exists if args.model_type == "llm" else os.path.isfile))
    for key, what, test in wanted:
        path = getattr(args, key, None)
        if path and not test(path):
            found = "a folder" if os.path.isdir(path) else "a file" if os.path.exists(path) else "nothing"
            return refusal(key, f"{path!r} must be {what}; found {found} there")
    return None


def listed_outside_roots(args, key: str, read, named_paths, roots: list[str]) -> dict | None:
    """The first path that the file under `key` names outside the roots, as an error answer under `key`
    (None: no file, or all inside). read(file): its contents (a ValueError answers as the error);
    named_paths(contents): (what, path) pairs, a None path skipped."""
    file = getattr(args, key)
    if not file:
        return None
    try:
        contents = read(file)
    except ValueError as e:
        return {"ok": False, "key": key, "error": str(e).splitlines()[0]}
    for what, path in named_paths(contents):
        if path and not inside(path, roots):
            return refusal(key, f"{file}: {what} {path!r} is outside the folders this UI may open; start "
                                f"tools/webui.py with --root FOLDER to add one")
    return None


def dataset_folders(blueprint):
    """(key, folder) of each folder a dataset TOML names: images, masks, control images, caches (None where
    unset), its validation datasets' too."""
    for spec in [*blueprint.datasets, *blueprint.validation_datasets]:
        yield "cache_dir", spec.cache_dir
        for subset in spec.subsets:
            yield from (("image_dir", subset.image_dir), ("mask_dir", subset.mask_dir),
                        ("control_directory", subset.control_directory))


def dataset_outside_roots(args, roots: list[str]) -> dict | None:
    """The dataset TOML's folders outside the roots, as an error answer under dataset_config (None: all
    inside): a job's dataset reads and writes only there."""
    from library.data.dataset_config import load_dataset_config

    return listed_outside_roots(args, "dataset_config", load_dataset_config, dataset_folders, roots)


def missing_image_dir(args) -> dict | None:
    """The dataset TOML's first image_dir that is not a folder or holds no image, as an error answer under
    dataset_config with the line train_lora.py fails with (None: no dataset, or every image_dir has images). An
    empty folder passed Validate and failed the queued job at its scan."""
    if not args.dataset_config:
        return None
    import warnings

    from library.data.dataset_config import load_dataset_config
    from library.data.image_folders import subset_images

    blueprint = load_dataset_config(args.dataset_config)
    for spec in [*blueprint.datasets, *blueprint.validation_datasets]:
        for subset in spec.subsets:
            try:
                with warnings.catch_warnings():  # the scan's warnings are the job's to print
                    warnings.simplefilter("ignore")
                    subset_images(subset)
            except ValueError as e:
                return {"ok": False, "key": "dataset_config", "error": f"{blueprint.source}: {e}"}
    return None


def prompt_images_outside_roots(args, roots: list[str]) -> dict | None:
    """The sample prompts' reference images (--ci) outside the roots, as an error answer under
    sample_prompts (None: all inside): an edit model's sample draws them where the pages show it."""
    from library.data.prompts import read_prompt_file

    refused = listed_outside_roots(args, "sample_prompts", lambda file: read_prompt_file(file, decode=False),
                                   lambda prompts: (("--ci", path) for prompt in prompts for path in prompt.control_images),
                                   roots)
    # Decoded only once every reference lies inside: an outside file is never opened by this check.
    return refused or listed_outside_roots(args, "sample_prompts", read_prompt_file, lambda prompts: (), roots)


def not_an_optimizer(args) -> dict | None:
    """load_config imports optimizer_type's module.Class; it must also be an optimizer class (not,
    say, os.system), or the run fails after loading the models."""
    import torch

    from library.training.optim import optimizer_class

    found = optimizer_class(args.optimizer_type)
    if isinstance(found, type) and issubclass(found, torch.optim.Optimizer):
        return None
    return refusal("optimizer_type", f"{args.optimizer_type!r} is not an optimizer class (a torch.optim.Optimizer "
                                     f"subclass)")


def check_before_training(args) -> None:
    """train_lora.py's own first checks (model files' headers, blocks_to_swap, keys the model never reads,
    network_args, LoRA files, the base's stored precision; an LLM's train_data), the function it runs itself:
    a config refused in the run's first seconds is refused here with its line."""
    if args.model_type == "llm":
        from library.training.llm_task import check_before_loading

        check_before_loading(args)
    else:
        from library.models.family import get_family
        from library.training.diffusion_checks import check_before_caching

        check_before_caching(args, get_family(args))


def reads_outside_roots(args, roots: list[str]) -> dict | None:
    """The first file or folder outside the roots that the config makes a tool read (the model files, the
    dataset's folders, the prompts' reference images), as an error answer (None: all inside)."""
    return outside_roots(args, roots) or dataset_outside_roots(args, roots) or prompt_images_outside_roots(args, roots)


def check(text: str, output_dir: str, roots: list[str] | None = None, reads_only: bool = False) -> dict:
    """train_lora.py's reading of the config with `output_dir` as its output folder (the error answer of the
    first thing refused). reads_only: what tools/plan_memory.py would read outside the roots, nothing else (a
    config load_config refuses is left for the planner to say why)."""
    import toml

    from library.text_files import toml_dumps, toml_loads
    from library.training.config import ConfigError, _flatten, load_config

    try:
        settings = _flatten(toml_loads(text), "config")
    except toml.TomlDecodeError as e:
        return {"ok": False, "key": None, "error": f"config: not valid TOML: {e}"}
    except ConfigError as e:
        return {"ok": False, "key": error_key(str(e)), "error": str(e)}
    settings["output_dir"] = output_dir  # the job's folder replaces it
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "config.toml")
        with open(path, "w", encoding="utf-8") as f:
            f.write(toml_dumps(settings))
        args = None
        try:
            args = load_config(["--config_file", path])
            if reads_only:
                return (roots is not None and reads_outside_roots(args, roots)) or {"ok": True}
            refused = (roots is not None and outside_roots(args, roots)) or missing_paths(args) or \
                not_an_optimizer(args) or (roots is not None and dataset_outside_roots(args, roots)) or \
                missing_image_dir(args) or \
                (roots is not None and prompt_images_outside_roots(args, roots))
            if refused:
                return refused
            check_before_training(args)
        except (ValueError, OSError) as e:  # ConfigError and CheckpointError are ValueErrors
            if reads_only and args is None:
                return {"ok": True}
            message = str(e).replace(path, "config")
            key = error_key(message) or (file_key(args, message) if args else None)
            return {"ok": False, "key": key, "error": message.splitlines()[0] if message else repr(e)}
    max_steps = None if args.max_train_epochs else args.max_train_steps
    return {"ok": True, "settings": settings, "max_steps": max_steps}


def warm() -> None:
    """Import what a check of a diffusion or LLM config imports (torch, diffusers' VAE classes, transformers'
    tokenizers, the optimizers, the planner; ~10-30 s on 2 cores), before the first request arrives: the UI
    starts the helper with itself, so the first Validate, Queue or Plan no longer waits for them. A failed
    import is the checks' to report, not the helper's end."""
    with contextlib.suppress(Exception):
        import library.models.text_encoders  # noqa: F401
        import library.models.vae  # noqa: F401
        import library.training.diffusion_task  # noqa: F401
        import library.training.llm_task  # noqa: F401
        import library.training.memory_plan  # noqa: F401
        import library.training.optim  # noqa: F401
        import torch._dynamo  # noqa: F401  (torch.optim's optimizers import it when the first one is made)


# The tools the helper runs in-process: each reads headers and small files, never a model's weights (the LoRA
# tools, which merge or resize whole models, keep a process of their own).
TOOLS_IN_HELPER = ("plan_memory.py", "check_dataset.py", "convert_config.py", "plot_timesteps.py")


class ThreadOutput(io.TextIOBase):
    """The helper's sys.stdout and sys.stderr: what a tool's thread prints goes to that run's buffer, anything
    else to `fallback` (the helper's stderr): a check running beside a tool stays out of its report, and a
    library's print never reaches the answers' pipe."""

    encoding = "utf-8"  # (TextIOBase's is None: a library asking for it gets what the buffers take)

    def __init__(self, fallback):
        self.fallback, self.buffers = fallback, {}

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        return self.buffers.get(threading.get_ident(), self.fallback).write(text)

    def flush(self) -> None:
        self.fallback.flush()

    @contextlib.contextmanager
    def captured(self):
        self.buffers[threading.get_ident()] = buffer = io.StringIO()
        try:
            yield buffer
        finally:
            del self.buffers[threading.get_ident()]


def run_tool(script: str, args: list) -> dict:
    """tools/<script>'s main(args) in this process, its exit status and what it printed, as its own process
    would (an argparse exit is its status, an unforeseen exception one error line and status 1, each warning a
    'warning: ...' line). The script runs from its path, as a subprocess runs it (library/ui never imports
    tools/): its top level each time, the library it imports already loaded."""
    if script not in TOOLS_IN_HELPER:
        return {"returncode": 2, "stdout": "", "stderr": f"error: {script} does not run in the config checker"}
    with sys.stdout.captured() as out, sys.stderr.captured() as err, printed_warnings():  # one line each, every time
        argv0, sys.argv[0] = sys.argv[0], script  # argparse's usage line names it
        try:
            tool = runpy.run_path(os.path.join(ROOT, "tools", script), run_name="tool_in_helper")
            code = tool["main"]([str(a) for a in args])
        except SystemExit as e:  # argparse's --help or a bad flag
            code = e.code if isinstance(e.code, int) or e.code is None else 2
        except Exception as e:  # noqa: BLE001  (as a crashed process would end; the helper lives on)
            print(f"error: {script}: {type(e).__name__}: {e}", file=sys.stderr)
            code = 1
        finally:
            sys.argv[0] = argv0
    return {"returncode": code or 0, "stdout": out.getvalue(), "stderr": err.getvalue()}


def answer(request: dict) -> dict:
    try:
        if request.get("kind") == "tool":
            return run_tool(request["script"], request["args"])
        return check(request["toml"], request["output_dir"], request.get("roots"), request.get("reads_only", False))
    except Exception as e:  # an unforeseen failure is the config's answer, not the helper's death
        return {"ok": False, "key": None, "error": f"config check failed: {type(e).__name__}: {e}"}


def serve(workdir: str) -> None:
    """Answers stdin's requests on stdout until stdin closes: checks in order on one thread, tools in order on
    another, each answer one line with its request's id."""
    os.chdir(workdir)
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w", encoding="utf-8")  # the answers' pipe, the helper's alone
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # a library's C-level print goes to stderr too
    sys.stdout, sys.stderr = ThreadOutput(sys.stderr), ThreadOutput(sys.stderr)
    warm()
    written = threading.Lock()

    def work(requests: queue.Queue) -> None:
        while (request := requests.get()) is not None:
            reply = json.dumps({**answer(request), "id": request.get("id")})
            with written:
                answers.write(reply + "\n")
                answers.flush()

    queues = {"check": queue.Queue(), "tool": queue.Queue()}
    workers = [threading.Thread(target=work, args=(q,), daemon=True) for q in queues.values()]
    for worker in workers:
        worker.start()
    for line in sys.stdin:
        request = json.loads(line)
        queues["tool" if request.get("kind") == "tool" else "check"].put(request)
    for q in queues.values():
        q.put(None)
    for worker in workers:
        worker.join()


# -- the UI's side -----------------------------------------------------------------------------

class ConfigChecker:
    """The helper process, started on first use (or ahead with start()) and restarted if it died. Requests
    from the UI's threads go out as they come; a reader thread hands each answer to the request of its id."""

    def __init__(self, workdir: str, python: str = sys.executable):
        self.workdir, self.python = workdir, python
        self.process: subprocess.Popen | None = None
        self.lock = threading.Lock()  # the process's start and end, the requests' writes
        self.waiting: dict[int, tuple[threading.Event, list, subprocess.Popen]] = {}
        self.ids = itertools.count()

    def start(self) -> None:
        with self.lock:
            self._ensure()

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def _ensure(self) -> None:
        if self.process is None or self.process.poll() is not None:
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
            self.process = subprocess.Popen([self.python, "-m", "library.ui.config_check", self.workdir],
                                            cwd=self.workdir, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                            text=True, bufsize=1)  # its stderr: the UI's terminal (a crash, a warning)
            threading.Thread(target=self._read, args=(self.process,), daemon=True).start()

    def _read(self, process: subprocess.Popen) -> None:
        for line in process.stdout:
            reply = json.loads(line)
            with self.lock:
                event, answer, _ = self.waiting.pop(reply.pop("id"), (None, None, None))
            if event:
                answer.append(reply)
                event.set()
        with self.lock:  # it exited: what still waits on it gets no answer
            for request_id in [i for i, (_, _, p) in self.waiting.items() if p is process]:
                self.waiting.pop(request_id)[0].set()

    def _ask(self, request: dict, timeout: float | None = None) -> dict | None:
        """The helper's answer to `request`; None when it exited twice without one or ran past `timeout`
        (then it is stopped: the next request starts another)."""
        for attempt in (1, 2):  # a helper that died (killed, out of memory) is started once more
            event, answer = threading.Event(), []
            with self.lock:
                self._ensure()
                process, request_id = self.process, next(self.ids)
                self.waiting[request_id] = (event, answer, process)
                try:
                    process.stdin.write(json.dumps({**request, "id": request_id}) + "\n")
                    process.stdin.flush()
                except (BrokenPipeError, OSError):
                    self.waiting.pop(request_id, None)
                    event.set()
            finished = event.wait(timeout)
            if answer:
                return answer[0]
            with self.lock:
                self.waiting.pop(request_id, None)
                if self.process is process:
                    process.kill()
                    process.wait()
                    self.process = None
            if not finished:
                return None
        return None

    def check(self, text: str, output_dir: str, roots: list[str] | None = None, reads_only: bool = False) -> dict:
        answer = self._ask({"kind": "check", "toml": text, "output_dir": output_dir, "roots": roots,
                            "reads_only": reads_only})
        return answer or {"ok": False, "key": None, "error": "the config checker process exited; see the UI's terminal"}

    def run_tool(self, script: str, args: list, timeout: float) -> dict:
        """tools/<script> (one of TOOLS_IN_HELPER) run in the helper: {"returncode", "stdout", "stderr"}."""
        answer = self._ask({"kind": "tool", "script": script, "args": [str(a) for a in args]}, timeout)
        return answer or {"returncode": 1, "stdout": "",
                          "stderr": f"{script} ran past {timeout:.0f} s or its process exited, and was stopped"}

    def close(self) -> None:
        """Ends the helper: at once when nothing waits on it (it holds no state; one still importing at its
        start took the whole 5 s to notice its closed stdin), else once its answers are out (5 s at most)."""
        with self.lock:
            if self.process is not None and self.process.poll() is None:
                if self.waiting:
                    self.process.stdin.close()
                try:
                    self.process.wait(timeout=5 if self.waiting else 0)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    self.process.wait()
            self.process = None


if __name__ == "__main__":
    serve(sys.argv[1])
    exit_without_collecting(0)
