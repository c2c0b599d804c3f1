"""The repository's tools run for the UI's forms: each with an argument list (never a shell string), in the
working folder, returning what it printed; the light ones (the planner, the dataset checker, the config
converter) in the config checker's warm process where one is given, the others as a subprocess each. The
planner's and the dataset checker's outputs are read back into the forms' values."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from dataclasses import dataclass, field

from library.models.registry import BASE_PRECISIONS
from library.ui.config_check import TOOLS_IN_HELPER

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PLAN_ROW = re.compile(r"^\s+(bf16|fp8_scaled|fp8|\S+)\s+gradient_checkpointing=(true|false)\s*: "
                      r"(?:fits with blocks_to_swap = (\d+) \(peak ([\d.]+) GiB\)|does not fit)")


@dataclass
class Result:
    ok: bool
    output: str  # stdout, then stderr
    stdout: str = ""


@dataclass
class ToolRuns:
    """The tool processes running for the UI's forms, so that Stop ends them (a merge or a GGUF quantization of a
    full-size base runs for many minutes; it was cut at 900 s, SIGKILLed, its temporary left behind)."""

    processes: set = field(default_factory=set)
    stopped: set = field(default_factory=set)  # the pids Stop ended
    lock: threading.Lock = field(default_factory=threading.Lock)

    def stop(self, grace: float = 30) -> int:
        """SIGTERM to each (the tools exit 143 through their clean-ups: tools/cli.exit_on_sigterm), SIGKILL to
        any still running `grace` s later; run_tool's thread reads their output meanwhile. Returns how many ran."""
        with self.lock:
            running = [p for p in self.processes if p.poll() is None]
            self.stopped.update(p.pid for p in running)
        for proc in running:
            proc.terminate()
            killer = threading.Timer(grace, lambda p=proc: p.poll() is None and p.kill())
            killer.daemon = True  # the UI's own exit does not wait for it
            killer.start()
        return len(running)


def run_tool(script: str, args: list[str], workdir: str, python: str = sys.executable, timeout: float | None = 900,
             helper=None, runs: ToolRuns | None = None) -> Result:
    """`helper`: a ConfigChecker (library/ui/config_check.py); where its process is up (the UI starts it with
    itself), it runs TOOLS_IN_HELPER with torch and the library imported already (a fresh process spent ~15 s
    importing them on 2 cores). Otherwise a fresh process, listed in `runs` while it runs (ToolRuns.stop);
    timeout None: as long as it takes."""
    if helper is not None and helper.running() and script in TOOLS_IN_HELPER:
        done = helper.run_tool(script, args, timeout)
        return printed(done["returncode"], done["stdout"], done["stderr"])
    command = [python, os.path.join(ROOT, "tools", script), *map(str, args)]
    runs = runs or ToolRuns()
    with subprocess.Popen(command, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          stdin=subprocess.DEVNULL) as proc:
        with runs.lock:
            runs.processes.add(proc)
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.terminate()  # as Stop does: the tool's clean-ups run
            try:
                proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
            return Result(False, f"{script} ran past {timeout:.0f} s and was stopped")
        finally:
            with runs.lock:
                runs.processes.discard(proc)
    with runs.lock:
        stopped = proc.pid in runs.stopped
        runs.stopped.discard(proc.pid)
    if stopped and proc.returncode != 0:  # 0: it had finished (Stop met its exit), its own lines say what it wrote
        said = printed(proc.returncode, stdout, stderr).output
        return Result(False, f"{script} was stopped (Stop) before it finished: a file it was still writing is not "
                             f"left behind; one it had finished stays" + (f"\n{said}" if said else ""))
    return printed(proc.returncode, stdout, stderr)


def printed(returncode: int, stdout: str, stderr: str) -> Result:
    """A tool run's Result: ok at status 0, its output stdout then stderr."""
    return Result(returncode == 0, (stdout + ("\n" + stderr if stderr.strip() else "")).strip(), stdout)


# -- the memory planner ------------------------------------------------------------------------

@dataclass
class Fit:
    base: str  # bf16, fp8_scaled, or a pre-quantized file's layout
    checkpointing: bool
    blocks_to_swap: int | None  # None: does not fit
    peak_gib: float | None


def plan(workdir: str, vram: float, preset: str | None = None, config_file: str | None = None,
         resolution: int | None = None, batch_size: int | None = None, python: str = sys.executable,
         helper=None) -> tuple[Result, list[Fit]]:
    args = ["--preset", preset] if preset else ["--config_file", config_file]
    args += ["--vram", vram]
    if resolution:
        args += ["--resolution", int(resolution)]
    if batch_size:
        args += ["--batch_size", int(batch_size)]
    result = run_tool("plan_memory.py", args, workdir, python, helper=helper)
    fits = []
    for line in result.output.splitlines():
        if match := PLAN_ROW.match(line):
            swap = int(match.group(3)) if match.group(3) is not None else None
            fits.append(Fit(match.group(1), match.group(2) == "true", swap,
                            float(match.group(4)) if match.group(4) else None))
    return result, fits


def suggestion(fits: list[Fit]) -> Fit | None:
    """The setting that fits with the least cost: fewest swapped blocks (each copies weights per
    step), then no checkpointing (recomputes the forward), then the bf16 base (fp8 loses precision)."""
    fitting = [f for f in fits if f.blocks_to_swap is not None]
    return min(fitting, key=lambda f: (f.blocks_to_swap, f.checkpointing, f.base != "bf16"), default=None)


# plan_memory.py's caching advice: "caching does not fit a 16 GiB card (...): set vae_batch_size = 2 and
# text_encoder_precision = "fp8"" (what it cannot fix, "a smaller resolution", sets no key).
CACHING_LINE = re.compile(r"^\s*caching does not fit .*: set (.*)$", re.MULTILINE)
CACHING_KEY = re.compile(r"\b(vae_batch_size) = (\d+)\b|\b(text_encoder_precision) = \"(\w+)\"")


def caching_keys(output: str) -> dict:
    """The config keys the plan's caching advice sets ({} where caching fits the card): training fitting
    the card is not enough, caching runs first."""
    keys = {}
    for line in CACHING_LINE.findall(output):
        for batch_key, batch, precision_key, precision in CACHING_KEY.findall(line):
            keys.update({batch_key: int(batch)} if batch_key else {precision_key: precision})
    return keys


def suggested_keys(fit: Fit) -> dict:
    """The config keys that select a plan's setting."""
    keys = {"gradient_checkpointing": fit.checkpointing, "blocks_to_swap": fit.blocks_to_swap}
    if fit.base in BASE_PRECISIONS:
        keys["base_precision"] = fit.base
    return keys


# -- the dataset checker -----------------------------------------------------------------------

def check_dataset(workdir: str, dataset_config: str, python: str = sys.executable, helper=None,
                  training_config: str | None = None) -> tuple[Result, dict | None]:
    """tools/check_dataset.py --json: per subset its sizes, buckets and problems (None: it failed). A
    dataset with errors exits 1 with its report: that is a report, not a failure. training_config: checked
    as that config trains it (its text encoder's caption tokens, its family's reference sizes)."""
    config = ["--config_file", training_config] if training_config else []
    result = run_tool("check_dataset.py", [dataset_config, "--json", *config], workdir, python, helper=helper)
    if not result.stdout.strip():  # the config could not be read (exit 2, one line on stderr)
        return result, None
    try:
        return result, json.loads(result.stdout)
    except ValueError:
        return Result(False, result.output), None
