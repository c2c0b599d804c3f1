"""Translate a training config written for sd-scripts, musubi-tuner or ai-toolkit into ours, and say
what every key became.

    python tools/convert_config.py my_lora.toml                      # sd-scripts (its dataset TOML too)
    python tools/convert_config.py my_lora.toml --model_type TYPE    # musubi-tuner (its script names the model)
    python tools/convert_config.py train_lora_24gb.yaml              # ai-toolkit (its datasets inside)
    python tools/convert_config.py --command "accelerate launch <script>.py --pretrained_model_name_or_path ..."

Writes OUT (default: the input's name + "_converted.toml", beside it) and, where the peer's config has a
dataset (a dataset_config file it names, musubi-tuner's dataset TOML, ai-toolkit's datasets, sd-scripts'
train_data_dir folders), OUT's name + "_dataset.toml", which OUT's dataset_config names. Each key is
kept, renamed, dropped (it asks for what we always do, or is the peer's own machinery) or not carried
(it would change the training and we do not do it; written as a comment, with why): the report lists
them all, and the written config is then checked as train_lora.py checks it (a model path not on this
machine is reported, not fatal). Peers' facts: library/training/peers/<peer>.py.

--from names the peer where it cannot be told: a .yaml / .yml file is ai-toolkit's, a config with musubi-
tuner's model keys (dit; vae without sd-scripts' pretrained_model_name_or_path / ae) or its dataset keys
(image_directory) musubi-tuner's, the rest sd-scripts'.
--strict: exit status 1 when a key is not carried. Bad input: one line, exit status 2, nothing written.
"""

from __future__ import annotations

import os
import re
import shlex
import sys

if __package__ in (None, ""):  # run as a script: make `library` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from library.training.peers import PEERS, peer_module  # noqa: E402
from library.training.peers.rules import DROPPED, KEPT, NOT_CARRIED, RENAMED, UNKNOWN, Translation  # noqa: E402
from tools.cli import Parser, check_command_line, exit_without_collecting  # noqa: E402



def build_parser() -> Parser:
    p = Parser(description="Translate an sd-scripts / musubi-tuner / ai-toolkit training config into ours.")
    p.add_argument("config", nargs="?", help="the peer's training config (.toml, or ai-toolkit's .yaml)")
    p.add_argument("--command", help="the peer's command line instead of a config file, quoted as one argument")
    p.add_argument("--dataset_config", help="the peer's dataset TOML (default: the one its config names)")
    p.add_argument("--from", dest="peer", choices=tuple(PEERS), help="the peer (default: told from the file)")
    p.add_argument("--model_type", help="our model_type where the peer's config does not say it (musubi-tuner)")
    p.add_argument("--out", help="our config to write (default: the input's name + '_converted.toml')")
    p.add_argument("--strict", action="store_true", help="exit status 1 when a key is not carried over")
    return p


def read_peer_config(args) -> tuple[dict, str, str | None]:
    """(the peer's config as read, where it came from, the script a --command ran)."""
    if bool(args.config) == bool(args.command):
        raise ValueError("give the peer's config file, or --command with its command line (one of them)")
    if args.command:
        from library.training.peers.rules import argv_to_dict

        words = command_words(args.command)
        script = next((w for w in words if w.endswith(".py")), None)
        if script is None:
            raise ValueError("--command: no training script (*.py) in the command line")
        rest = words[words.index(script) + 1:]
        flat = argv_to_dict(rest)
        launch = launch_mixed_precision(words[:words.index(script)])
        if launch and "mixed_precision" not in flat and is_musubi_script(script):
            flat["mixed_precision"] = launch  # its parser's default None: accelerate's launch flag decides
        if isinstance(flat.get("config_file"), str):  # the peers' --config_file: its keys, the command line's over them
            from library.training.peers.rules import flatten_tables

            path = flat.pop("config_file")
            path = path if path.endswith(".toml") or os.path.isfile(path) else path + ".toml"
            if not os.path.isfile(path):
                raise ValueError(f"{path}: no such file (the --config_file of --command)")
            flat = {**flatten_tables(read_toml_file(path, "training config")), **flat}
        return flat, "command line", script.replace("\\", "/")
    if not os.path.isfile(args.config):
        raise ValueError(f"{args.config}: no such file (the peer's training config)")
    if args.config.lower().endswith((".yaml", ".yml")):
        import yaml

        from library.text_files import read_utf8

        try:
            doc = yaml.safe_load(read_utf8(args.config, "YAML config"))
        except yaml.YAMLError as e:
            raise ValueError(f"{args.config}: not YAML: {' '.join(str(e).split())}") from None
        if not isinstance(doc, dict):
            raise ValueError(f"{args.config}: expected a YAML mapping (ai-toolkit's config:), got {type(doc).__name__}")
        return doc, args.config, None
    return read_toml_file(args.config, "training config"), args.config, None


def launch_mixed_precision(words: list[str]) -> str | None:
    """`accelerate launch --mixed_precision bf16` (or =bf16) before the script: what musubi-tuner's runs take where
    the script's own --mixed_precision is not given (sd-scripts' default "no" wins over it)."""
    for i, word in enumerate(words):
        if word.startswith("--mixed_precision="):
            return word.split("=", 1)[1]
        if word == "--mixed_precision" and i + 1 < len(words):
            return words[i + 1]
    return None


def is_musubi_script(script: str) -> bool:
    from library.training.peers.musubi_models import scripts

    return os.path.basename(script.replace("\\", "/")) in scripts()


def command_words(command: str) -> list[str]:
    """A pasted command line's words: a shell's (backslash-newline continuations), or Windows' (PowerShell's
    backtick and cmd's caret continuations, backslashes in paths: the peers' docs give both), whose
    backslashes POSIX splitting would drop (path\\to\\file -> pathtofile)."""
    text = re.sub(r"\\[ \t]*\r?\n", " ", command)
    windows = re.search(r"[`^][ \t]*\r?\n", text) or re.search(r"\\[^\s\"'$`\\]", text)
    if not windows:
        return shlex.split(text)
    text = re.sub(r"[`^][ \t]*\r?\n", " ", text)
    words = re.findall(r"""(?:[^\s"']+|"[^"]*"|'[^']*')+""", text)  # a word: bare and quoted parts, kept whole
    return [re.sub(r""""([^"]*)"|'([^']*)'""", lambda m: m.group(1) or m.group(2) or "", w) for w in words]


def read_toml_file(path: str, what: str) -> dict:
    from library.text_files import read_utf8, toml_loads

    try:
        return toml_loads(read_utf8(path, what))
    except Exception as e:  # TomlDecodeError, ValueError (UTF-8)
        raise ValueError(f"{path}: {what} cannot be read: {' '.join(str(e).split())}") from None


def tell_peer(args, config: dict, source: str, script: str | None) -> str:
    if args.peer:
        return args.peer
    if source.lower().endswith((".yaml", ".yml")):
        return "ai-toolkit"
    if script is not None:
        name = os.path.basename(script)  # a peer module's SCRIPTS: the training scripts it reads the command lines of
        return next((peer for peer in PEERS if name in getattr(peer_module(peer), "SCRIPTS", ())), "musubi-tuner")
    from library.training.peers.rules import flatten_tables

    flat = flatten_tables(config)
    if {"dit", "image_directory"} & set(flat):
        return "musubi-tuner"
    # vae is sd-scripts' key too (Stable Diffusion's VAE), and the kohya_ss GUI writes `vae = ""` for its empty field
    sd_model_keys = {"pretrained_model_name_or_path", "ae"} & set(flat)
    return "musubi-tuner" if flat.get("vae") and not sd_model_keys else "sd-scripts"


def dataset_of(args, config: dict, source: str) -> tuple[dict | None, str | None]:
    """The peer's dataset TOML: --dataset_config, else the file its config names (relative to where the
    peer would have run: the working folder, then the config's folder)."""
    from library.training.peers.rules import flatten_tables, peer_file

    path = args.dataset_config or flatten_tables(config).get("dataset_config")
    if not path or not isinstance(path, str):
        return None, None
    if not args.dataset_config:
        path = peer_file(path, source)
    if not os.path.isfile(path):
        raise ValueError(f"{path}: no such file (the dataset config {'--dataset_config' if args.dataset_config else source} names)")
    return read_toml_file(path, "dataset config"), path


def out_paths(args, source: str) -> tuple[str, str]:
    out = args.out or (os.path.splitext(source)[0] + "_converted.toml" if source != "command line" else "converted.toml")
    if not out.endswith(".toml"):
        raise ValueError(f"--out {out}: expected a .toml file name")
    return out, out[:-len(".toml")] + "_dataset.toml"


def check_not_read(config: dict, source: str, dataset_source: str | None, written: list[str]) -> None:
    """None of the files written is one this conversion reads (the peer's config, its dataset TOML, its prompts):
    `--out sd.toml` replaced sd-scripts' config with ours, `--out my_dataset.toml` its dataset TOML (which the
    peer's config still names), without a word."""
    from library.training.peers.rules import flatten_tables, peer_file

    prompts = flatten_tables(config).get("sample_prompts")
    read = [(source if source != "command line" else None, "the config being converted"),
            (dataset_source, "the dataset config it names"),
            (peer_file(prompts, source) if isinstance(prompts, str) and prompts else None, "the prompt file it names")]
    reads = {os.path.realpath(path): what for path, what in read if path}
    for path in written:
        if os.path.realpath(path) in reads:
            raise ValueError(f"--out: {path} would be written over {reads[os.path.realpath(path)]}; give --out "
                             f"another name (nothing was written)")


def owner(peer: str) -> str:
    """The possessive: sd-scripts', musubi-tuner's."""
    return peer + ("'" if peer.endswith("s") else "'s")


def render_config(t: Translation, dataset_file: str | None) -> str:
    """Our config as TOML: its keys in the schema's order, then the keys not carried as comments."""
    from library.text_files import toml_dumps
    from library.training.config_schema import SCHEMA

    keys = dict(t.config)
    if dataset_file is not None:
        keys["dataset_config"] = dataset_file
    ordered = {k: keys[k] for k in SCHEMA if k in keys and keys[k] is not None}
    head = [f"# Translated from {owner(t.peer)} {t.source} by tools/convert_config.py.",
            "# Keys not carried over are at the end, commented, with why; the report printed says what each key became.", ""]
    tail = [""] + [f"# not carried: {line.key} = {line.value!r}: {line.text}" for line in t.not_carried] if t.not_carried else []
    return "\n".join(head) + toml_dumps(ordered) + "\n".join(tail) + ("\n" if tail else "")


def report(t: Translation) -> str:
    order = (KEPT, RENAMED, DROPPED, NOT_CARRIED, UNKNOWN)
    rows = []
    for verdict in order:
        for line in (x for x in t.lines if x.verdict == verdict):
            what = {KEPT: "", RENAMED: f"-> {line.text}"}.get(verdict, line.text)
            what = "; ".join(x for x in (what, line.note) if x)
            rows.append(f"  {verdict:<11} {line.key} = {line.value!r}" + (f"  ({what})" if what else ""))
    counts = ", ".join(f"{sum(x.verdict == v for x in t.lines)} {v}" for v in order)
    return f"{t.peer} -> ours: {counts}\n" + "\n".join(rows)


# The keys naming files or folders the run reads (the model's, the LoRA's to go on with, the prompts), and the
# dataset's folders.
INPUT_PATH_KEYS = ("pretrained_model_name_or_path", "ae", "clip_l", "t5xxl", "text_encoder", "siglip", "network_weights",
                   "sample_prompts")


def check_written(out: str, t: Translation) -> str:
    """train_lora.py's reading of the written config (its one line where it refuses it), then the paths it
    names that this machine lacks (expected where a config is translated away from its files: the run's
    model loading would stop there)."""
    from library.errors import ConfigError
    from library.training.config import load_config

    try:
        args = load_config(["--config_file", out])
        blueprint = None
        if getattr(args, "dataset_config", None):  # the dataset TOML written beside it, as train_lora.py reads it
            from library.data.dataset_config import load_dataset_config

            blueprint = load_dataset_config(args.dataset_config)
    except (ConfigError, ValueError, OSError) as e:
        return " ".join(str(e).split())
    from library.models.family import FAMILIES, family_class

    keys = list(INPUT_PATH_KEYS)
    if t.config.get("model_type") in FAMILIES:  # and the family's own files (a byT5 glyph encoder, a T5 tokenizer)
        family = family_class(t.config["model_type"])
        keys += [k for k in (*family.required_paths(), *family.optional_path_keys) if k not in keys]
    paths = [(k, t.config[k]) for k in keys if isinstance(t.config.get(k), str) and t.config[k]]
    paths += dataset_folders(blueprint)
    missing = list(dict.fromkeys(f"{k} = {p}" for k, p in paths if not os.path.exists(p)))
    return ("train_lora.py reads it as written" + (f"; not on this machine: {', '.join(missing)}" if missing else ""))


def dataset_folders(blueprint) -> list[tuple[str, str]]:
    """(key, folder) of the image, mask and reference folders of the dataset as train_lora.py read it (a key
    given in [general] or [[datasets]] too: it falls back as the loader's)."""
    folders = []
    for spec in [*blueprint.datasets, *blueprint.validation_datasets] if blueprint is not None else []:
        for subset in spec.subsets:
            folders += [(k, getattr(subset, k)) for k in ("image_dir", "mask_dir", "control_directory") if getattr(subset, k)]
    return folders


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config, source, script = read_peer_config(args)
        peer = tell_peer(args, config, source, script)
        dataset, dataset_source = dataset_of(args, config, source) if peer != "ai-toolkit" else (None, None)
        t = peer_module(peer).translate(config, source, model_type=args.model_type, dataset=dataset,
                                        dataset_source=dataset_source, script=script)
        out, dataset_out = out_paths(args, source)
        check_not_read(config, source, dataset_source,
                       [out] + ([dataset_out] if t.dataset is not None else []) + [out[:-len(".toml")] + suffix
                                                                                   for suffix, _ in t.files.values()])
        from library.atomic_files import write_text
        from library.text_files import toml_dumps

        if t.dataset is not None:
            write_text(dataset_out, f"# Translated from {owner(t.peer)} {dataset_source or source} by tools/convert_config.py.\n\n"
                       + "\n".join(toml_dumps({k: v}) for k, v in sorted(t.dataset.items(), key=lambda kv: kv[0] != "general")))
        for key, (suffix, text) in t.files.items():
            t.config[key] = out[:-len(".toml")] + suffix
            write_text(t.config[key], text)
        write_text(out, render_config(t, dataset_out if t.dataset is not None else None))
    except (ValueError, OSError) as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    print(report(t))
    written = [out] + ([dataset_out] if t.dataset is not None else []) + [t.config[k] for k in t.files]
    print(f"wrote {', '.join(written)}")
    print(f"check: {check_written(out, t)}")
    if t.not_carried:
        print(f"{len(t.not_carried)} key(s) not carried over: the run will differ from {owner(t.peer)} in these", file=sys.stderr)
    return 1 if args.strict and t.not_carried else 0


if __name__ == "__main__":
    check_command_line(build_parser)
    exit_without_collecting(main)
