"""A peer's training config picked in the Jobs tab (ai-toolkit's YAML; an sd-scripts or musubi-tuner TOML,
told by its unknown keys as train_lora.py's loader tells them), converted on Load by tools/convert_config.py,
which writes ours beside it under its default names (`<stem>_converted.toml`, `<stem>_converted_dataset.toml`,
`<stem>_converted_prompts.txt`), and the note its report gives the page. The tool runs from its path (in the
config checker's warm process, or as a subprocess), as the UI's other tools do (library/ui sits below tools/ and
never imports it); its report is ours to read."""

from __future__ import annotations

import os

from library.text_files import toml_loads
from library.training.config_schema import SCHEMA
from library.training.peers import peer_lora_modules, peers_of
from library.training.peers.rules import flatten_tables
from library.ui import commands
from library.ui.files import Roots

YAML_SUFFIXES = (".yaml", ".yml")  # ai-toolkit's configs: convert_config.py reads every YAML as one
CONFIG_SUFFIXES = (".toml", *YAML_SUFFIXES)  # the config picker's
# The peer TOML's keys naming what the converter reads and copies into ours (the dataset TOML, the prompts,
# the DreamBooth folders listed as subsets): like every file a page reads, refused outside the roots.
READ_KEYS = ("dataset_config", "sample_prompts", "train_data_dir", "reg_data_dir")
# The report's rows of the keys the run loses, as convert_config.report writes them ("  {verdict:<11} ...").
LOST_ROWS = ("  not carried ", "  unknown     ")


def toml_keys(text: str) -> dict | None:
    """A TOML's keys, tables flattened as the peers read them; None where it is no TOML."""
    try:
        return flatten_tables(toml_loads(text))
    except ValueError:  # TomlDecodeError: left for the loader's own line
        return None


def is_peer_config(path: str, text: str) -> bool:
    """ai-toolkit's YAML, or a training TOML with a key ours does not have and sd-scripts or musubi-tuner
    documents, or with their network_module (an sd-scripts config can have only keys ours has too: it loaded
    unconverted until 2026-11-30). A dataset TOML ([[datasets]]: ours, or a peer's, whose keys are
    sd-scripts' arguments too) is none: it loads as it is (the converter would take it for a training config)."""
    if path.lower().endswith(YAML_SUFFIXES):
        return True
    keys = toml_keys(text)
    if keys is None or "datasets" in keys:
        return False
    return keys.get("network_module") in peer_lora_modules() or any(peers_of(k) for k in keys if k not in SCHEMA)


# ai-toolkit's dataset keys naming folders: the converter reads folder_path's captions (is the trigger word in
# them?) and names the rest in the dataset TOML it writes.
YAML_FOLDER_KEYS = ("folder_path", "mask_path", "control_path", "control_path_1", "control_path_2", "control_path_3")


def yaml_reads(text: str) -> dict[str, str]:
    """{"datasets[i].key": folder} of an ai-toolkit YAML's processes ({} where it is no such YAML: the
    converter's own line explains it)."""
    import yaml

    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError:
        return {}
    job = doc.get("config") if isinstance(doc, dict) else None
    processes = job.get("process") if isinstance(job, dict) else None
    found = {}
    for process in processes if isinstance(processes, list) else []:
        datasets = process.get("datasets") if isinstance(process, dict) else None
        for i, entry in enumerate(datasets if isinstance(datasets, list) else []):
            if isinstance(entry, dict):
                found.update({f"datasets[{i}].{key}": entry[key] for key in YAML_FOLDER_KEYS if key in entry})
    return found


def check_reads(roots: Roots, real: str, text: str) -> None:
    """OutsideRoots where the converter would read a file outside the roots: the path as the peer config
    names it (relative to the working folder, where the tool runs) or beside the config, as it looks. An
    ai-toolkit YAML's dataset folders too (its captions were read: with trigger_word and caption_ext of the
    user's choosing, the note told whether any file outside held a word)."""
    if real.lower().endswith(YAML_SUFFIXES):
        keys = yaml_reads(text)
    else:
        keys = {key: value for key, value in (toml_keys(text) or {}).items() if key in READ_KEYS}
    for key, value in keys.items():
        if not isinstance(value, str) or not value:
            continue
        for candidate in (os.path.join(roots.workdir, value), os.path.join(os.path.dirname(real), value)):
            if os.path.exists(candidate):
                roots.resolve(candidate, f"{roots.shown(real)}'s {key}")


def convert(roots: Roots, real: str, text: str, python: str, helper=None) -> tuple[str, str]:
    """tools/convert_config.py on the peer's config `real` (under the roots; its text `text`): (the real
    path of our config written beside it, the note), or ValueError with the tool's one line (nothing written)."""
    check_reads(roots, real, text)
    source = roots.shown(real)  # as the picker lists it: the tool writes that name into ours
    source = source if not source.startswith("-") else os.path.join(os.curdir, source)
    out = os.path.splitext(source)[0] + "_converted.toml"  # the tool's default, given: the UI says where it writes
    earlier = roots.resolve(out, "converted config")
    written = _NOTES.get(earlier)
    if written and os.path.exists(earlier) and written[0] == _stamp(earlier):  # this process wrote it, no one since
        if written[1] == _stamp(real):  # and the peer's config is as it was: its report still holds
            return earlier, written[2]
        # the peer's config was edited since: converted again (ours is this process's own, unedited output)
    elif os.path.exists(earlier):  # converted before, and maybe edited since: loaded, never written over
        return earlier, (f"`{out}` was converted from `{source}` before (and may hold your edits since): loaded as it "
                         f"is; delete it, or rename it, to convert `{source}` again")
    result = commands.run_tool("convert_config.py", [source, "--out", out], roots.workdir, python, timeout=120,
                               helper=helper)
    if not result.ok:
        errors = [line for line in result.output.splitlines() if line.startswith("error: ")]
        raise ValueError(errors[-1][len("error: "):] if errors
                         else f"convert_config.py {source}: {' '.join(result.output.split())[-300:]}")
    written, note = roots.resolve(out, "converted config"), conversion_note(result.stdout)
    _NOTES[written] = (_stamp(written), _stamp(real), note)
    return written, note


# The note of each config this process converted, with the stamps then of ours and of the peer's config: picking a
# peer's config converts it and Load beside the picker converts again; the second found the file and said "converted
# before (and may hold your edits since)" in place of the report, whose lost keys the user had not read yet. The
# peer's stamp: a peer's config edited after its conversion was loaded as the stale conversion.
_NOTES: dict[str, tuple[tuple[int, int], tuple[int, int], str]] = {}


def _stamp(path: str) -> tuple[int, int]:
    """The file's (mtime in ns, size): a write since changes it."""
    st = os.stat(path)
    return st.st_mtime_ns, st.st_size


def conversion_note(report: str) -> str:
    """The note under the editor (Markdown): the files written, how many keys got each verdict, each key the
    run loses with why, and the tool's check of the written config."""
    lines = report.splitlines()
    peer, _, counts = lines[0].partition(" -> ours: ")
    wrote = next((line[len("wrote "):] for line in lines if line.startswith("wrote ")), "")
    check = next((line[len("check: "):] for line in lines if line.startswith("check: ")), "")
    rows = lost(lines)
    note = [f"Converted from {peer} by tools/convert_config.py: wrote {', '.join(f'`{p}`' for p in wrote.split(', '))}",
            f"keys: {counts}" + (" (the keys not carried are at the end of the TOML, commented)" if rows else "")]
    note += ["\n".join(f"- {verdict}: `{item}`: {why}" for verdict, item, why in rows)] if rows else []
    return "\n\n".join(note + ([f"check: {check}"] if check else []))


def lost(lines: list[str]) -> list[tuple[str, str, str]]:
    """(verdict, "key = value", why) of the report's rows not carried or unknown."""
    rows = []
    for line in (line for line in lines if line.startswith(LOST_ROWS)):
        item, _, why = line[14:].partition("  (")
        rows.append((line[2:13].strip(), item, why[:-1]))
    return rows
