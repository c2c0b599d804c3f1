"""A job's config, checked as train_lora.py checks it, in a helper process (it imports torch; the UI
process does not).

The helper (`python -m library.ui.config_check WORKDIR`) reads one JSON request per line on stdin,
{"toml": text, "output_dir": folder, "roots": [folders]}, and answers one JSON line: {"ok": true, "settings": {...},
"max_steps": N} or {"ok": false, "key": "network_dim" or null, "error": "one line"}. It runs
library.training.config.load_config on the text (the schema, types, choices and combinations that
train_lora.py enforces, the optimizer class) and then the family's check of its model files (their
headers only), with relative paths resolved against WORKDIR, where the jobs run; every file the config
names must lie under one of the roots (the UI's --root folders).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KEY_IN_ERROR = re.compile(r"key '([A-Za-z0-9_]+)'|--([A-Za-z0-9_]+)")


def error_key(message: str) -> str | None:
    """The config key an error line names (ConfigError says "key 'x'"), or None."""
    match = KEY_IN_ERROR.search(message)
    return (match.group(1) or match.group(2)) if match else None


def file_key(args, message: str) -> str | None:
    """The model-file key whose path a model-file error names (those errors name the file, not the key)."""
    from library.models.family import family_class

    keys = family_class(args.model_type).required_paths() if args.model_type != "llm" else ()
    return next((k for k in keys if getattr(args, k) and str(getattr(args, k)) in message), None)


# -- the helper process ------------------------------------------------------------------------

GENERIC_PATH_KEYS = ("pretrained_model_name_or_path", "ae", "dataset_config", "sample_prompts", "network_weights",
                     "resume", "logging_dir")


def outside_roots(args, roots: list[str]) -> dict | None:
    """The first file key whose path lies outside the roots, as an error answer (None: all inside):
    a job reads only what the pages may open."""
    keys = list(GENERIC_PATH_KEYS)
    if args.model_type != "llm":
        from library.models.family import family_class

        keys += [k for k in family_class(args.model_type).required_paths() if k not in keys]
    values = [(k, getattr(args, k)) for k in keys if getattr(args, k, None)]
    values += [("base_loras", entry.rsplit(":", 1)[0]) for entry in args.base_loras]
    values += [("train_data", entry) for entry in args.train_data]
    for key, path in values:
        real = os.path.realpath(path)
        if not any(real == root or real.startswith(root + os.sep) for root in roots):
            return {"ok": False, "key": key, "error": f"config: key '{key}': {path!r} is outside the folders this UI "
                                                     f"may open; start tools/webui.py with --root FOLDER to add one"}
    return None


def check(text: str, output_dir: str, roots: list[str] | None = None) -> dict:
    import toml

    from library.training.config import ConfigError, _flatten, load_config

    try:
        settings = _flatten(toml.loads(text), "config")
    except toml.TomlDecodeError as e:
        return {"ok": False, "key": None, "error": f"config: not valid TOML: {e}"}
    except ConfigError as e:
        return {"ok": False, "key": error_key(str(e)), "error": str(e)}
    settings["output_dir"] = output_dir  # the job's folder replaces it
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "config.toml")
        with open(path, "w", encoding="utf-8") as f:
            toml.dump(settings, f)
        args = None
        try:
            args = load_config(["--config_file", path])
            if roots is not None and (refused := outside_roots(args, roots)):
                return refused
            if args.model_type != "llm":
                from library.models.family import get_family

                get_family(args).check_model_files()
        except (ValueError, OSError) as e:  # ConfigError and CheckpointError are ValueErrors
            message = str(e).replace(path, "config")
            key = error_key(message) or (file_key(args, message) if args else None)
            return {"ok": False, "key": key, "error": message.splitlines()[0] if message else repr(e)}
    max_steps = None if args.max_train_epochs else args.max_train_steps
    return {"ok": True, "settings": settings, "max_steps": max_steps}


def serve(workdir: str) -> None:
    os.chdir(workdir)
    answers = sys.stdout
    for line in sys.stdin:
        request = json.loads(line)
        try:
            with contextlib.redirect_stdout(sys.stderr):  # a library's print must not break the protocol
                answer = check(request["toml"], request["output_dir"], request.get("roots"))
        except Exception as e:  # an unforeseen failure is the config's answer, not the helper's death
            answer = {"ok": False, "key": None, "error": f"config check failed: {type(e).__name__}: {e}"}
        answers.write(json.dumps(answer) + "\n")
        answers.flush()


# -- the UI's side -----------------------------------------------------------------------------

class ConfigChecker:
    """The helper process, started on first use (or ahead with start()) and restarted if it died."""

    def __init__(self, workdir: str, python: str = sys.executable):
        self.workdir, self.python = workdir, python
        self.process: subprocess.Popen | None = None
        self.lock = threading.Lock()

    def start(self) -> None:
        with self.lock:
            self._ensure()

    def _ensure(self) -> None:
        if self.process is None or self.process.poll() is not None:
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
            self.process = subprocess.Popen([self.python, "-m", "library.ui.config_check", self.workdir],
                                            cwd=self.workdir, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                            stderr=subprocess.DEVNULL, text=True, bufsize=1)

    def check(self, text: str, output_dir: str, roots: list[str] | None = None) -> dict:
        with self.lock:
            for attempt in (1, 2):  # a helper that died (killed, out of memory) is started once more
                self._ensure()
                try:
                    request = {"toml": text, "output_dir": output_dir, "roots": roots}
                    self.process.stdin.write(json.dumps(request) + "\n")
                    self.process.stdin.flush()
                    line = self.process.stdout.readline()
                except (BrokenPipeError, OSError):
                    line = ""
                if line:
                    return json.loads(line)
                self.process.kill()
                self.process.wait()
                self.process = None
        return {"ok": False, "key": None, "error": "the config checker process exited; see the UI's terminal"}

    def close(self) -> None:
        with self.lock:
            if self.process is not None and self.process.poll() is None:
                self.process.stdin.close()
                try:
                    self.process.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    self.process.wait()
            self.process = None


if __name__ == "__main__":
    serve(sys.argv[1])
