"""A peer's config read key by key into ours. Each peer module (sd_scripts.py, musubi_tuner.py,
ai_toolkit.py) holds one Rule per key the peer documents, so every key of a config carried over either
means the same thing here, or is dropped because it asks for what we always do, or is named in one line
saying why it is not carried (it would change the training, and we do not do it).

Verdicts, in the order a person reads the report:
- kept / renamed: set in our config, with our name and value;
- dropped: the peer's machinery or what we always do (sdpa, cache_latents, network_train_unet_only =
  true, a logging level): nothing changes by leaving it out;
- not carried: it changes the training and we do not do it (noise_offset, xformers = false ...), or it
  asks for the opposite of what we always do (network_train_unet_only = false);
- unknown: no rule knows the key (a newer peer version, a typo).
No torch here: the converter and config.py's unknown-key hint import this before torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

KEPT, RENAMED, DROPPED, NOT_CARRIED, UNKNOWN = "kept", "renamed", "dropped", "not carried", "unknown"


@dataclass(frozen=True)
class Rule:
    kind: str  # "same", "renamed", "implied", "unsupported", "ignored", "custom"
    ours: str | None = None  # our key (same / renamed)
    convert: Callable[[Any], Any] | None = None  # peer value -> ours; raises ValueError(reason) when it cannot
    fits: Callable[[Any], bool] | None = None  # implied: the value asks for what we always do
    why: str = ""
    handle: Callable[["Translation", str, Any], None] | None = None  # custom: sets what it needs itself


def same(why: str = "", convert: Callable[[Any], Any] | None = None) -> Rule:
    """Our key of the same name and meaning (convert: a value spelled another way, "1024,1024" -> [1024, 1024])."""
    return Rule("same", convert=convert, why=why)


def renamed(ours: str, convert: Callable[[Any], Any] | None = None, why: str = "") -> Rule:
    return Rule("renamed", ours=ours, convert=convert, why=why)


def implied(fits: Callable[[Any], bool], why: str) -> Rule:
    """Dropped when fits(value) (it asks for what we always do: `why` says what that is); not carried else."""
    return Rule("implied", fits=fits, why=why)


def unsupported(why: str) -> Rule:
    """Changes the training; we do not do it. Not carried, whatever its value, unless it is falsy (off)."""
    return Rule("unsupported", why=why)


def ignored(why: str) -> Rule:
    """The peer's own machinery or output (logging level, a Hub upload): dropped, nothing changes."""
    return Rule("ignored", why=why)


def custom(handle: Callable[["Translation", str, Any], None]) -> Rule:
    return Rule("custom", handle=handle)


def unless_off(why: str) -> Rule:
    """Our key of the same name, or dropped (`why`) at the peer's off value ("", 0: sd-scripts tests `if args.key`),
    which a config written from a GUI's empty field holds and which ours refuses or reads otherwise."""
    def handle(t: "Translation", key: str, value: Any) -> None:
        (t.drop(key, value, why) if is_off(value) else t.set(key, value, key, value))

    return custom(handle)


def adafactor_refusal(optimizer_type: Any, optimizer_args: Any, peer: str) -> str:
    """Why ours does not train a peer's optimizer ("" where it does): Adafactor with relative_step (sd-scripts' and
    musubi-tuner's default, and warmup_init's: their get_optimizer), which sets its own lr; ours refuses it."""
    args = dict(str(a).partition("=")[::2] for a in (optimizer_args if isinstance(optimizer_args, list) else []))
    if str(optimizer_type or "").lower() == "adafactor" and (
            args.get("relative_step", "True").strip() not in ("False", "0") or
            args.get("warmup_init", "False").strip() in ("True", "1")):
        return (f"Adafactor with relative_step ({peer}'s default) sets its own lr (its adafactor schedule), which ours "
                f"does not: optimizer_args relative_step=False scale_parameter=False warmup_init=False train it at "
                f"learning_rate")
    return ""


def is_true(value: Any) -> bool:
    return value is True or (isinstance(value, str) and value.lower() == "true")


def is_off(value: Any) -> bool:
    """None, false, 0, "", [] and the peers' "none" spellings: a key given at its off value."""
    return value in (None, False, 0, 0.0, "", [], {}) or (isinstance(value, str) and value.lower() in ("none", "false"))


@dataclass
class Line:
    key: str  # the peer's key, as written (a dotted path for nested YAML)
    value: Any
    verdict: str
    text: str = ""  # renamed: our key; dropped / not carried: why
    note: str = ""  # kept / renamed: what a reader should know (a value converted, a default that differs)


@dataclass
class Translation:
    peer: str  # "sd-scripts", "musubi-tuner", "ai-toolkit"
    source: str  # the file (or "command line") it came from
    config: dict[str, Any] = field(default_factory=dict)  # our training keys, flat
    dataset: dict[str, Any] | None = None  # our dataset TOML ([general], [[datasets]] ...), None: none written
    lines: list[Line] = field(default_factory=list)
    # our key -> (file name suffix, text): a file the converter writes beside our config (OUT's name + suffix)
    # and sets the key to, e.g. "sample_prompts" -> ("_prompts.txt", ai-toolkit's prompts in our syntax)
    files: dict[str, tuple[str, str]] = field(default_factory=dict)
    # the peer's keys as read (flat), for a rule whose meaning depends on another key (sd-scripts'
    # weighting_scheme weighs the loss only with model_prediction_type sigma_scaled)
    given: dict[str, Any] = field(default_factory=dict)

    def set(self, ours: str, value: Any, key: str, peer_value: Any, verdict: str = KEPT, text: str = "",
            note: str = "") -> None:
        """Our key set from the peer's key; two peer keys that set one of ours to different values are
        one ValueError naming both (sd-scripts' fp8_base and fp8_base_unet, say). text: the line's (our key and
        what else the rule says); note: shown beside it."""
        setter = next((line.key for line in self.lines if line.verdict in (KEPT, RENAMED)
                       and (line.text == ours or line.text.startswith(ours + " "))), None)
        if ours in self.config and self.config[ours] != value:
            raise ValueError(f"{self.source}: {key!r} = {peer_value!r} and {setter or ours!r} both set our "
                             f"{ours!r}, to {value!r} and {self.config[ours]!r}")
        self.config[ours] = value
        self.lines.append(Line(key, peer_value, verdict, text or ours, note))  # text: ours and what else it says

    def drop(self, key: str, value: Any, why: str) -> None:
        self.lines.append(Line(key, value, DROPPED, why))

    def refuse(self, key: str, value: Any, why: str) -> None:
        self.lines.append(Line(key, value, NOT_CARRIED, why))

    @property
    def not_carried(self) -> list[Line]:
        return [line for line in self.lines if line.verdict in (NOT_CARRIED, UNKNOWN)]


def apply_rule(t: Translation, key: str, value: Any, rule: Rule | None) -> None:
    """One peer key into `t`, by its rule (None: no rule knows it). A value of another type than the rule
    reads (a list where it takes a number, text where it compares) is one ValueError naming the file, key
    and value, as the rules' own errors name the file."""
    try:
        _apply_rule(t, key, value, rule)
    except (TypeError, ValueError) as e:
        if str(e).startswith(f"{t.source}: "):
            raise
        raise ValueError(f"{t.source}: {key} = {value!r}: {' '.join(str(e).split())}") from None


def _apply_rule(t: Translation, key: str, value: Any, rule: Rule | None) -> None:
    if rule is None:
        t.lines.append(Line(key, value, UNKNOWN, f"not a key {t.peer} documents (a newer version's, or a typo?)"))
    elif rule.kind == "custom":
        rule.handle(t, key, value)
    elif rule.kind in ("same", "renamed"):
        ours = key if rule.kind == "same" else rule.ours
        try:
            converted = rule.convert(value) if rule.convert else value
        except ValueError as e:
            t.refuse(key, value, str(e))
            return
        t.set(ours, converted, key, value, KEPT if rule.kind == "same" else RENAMED, ours)
    elif rule.kind == "implied":
        (t.drop if rule.fits(value) else t.refuse)(key, value, rule.why)
    elif rule.kind == "unsupported":
        (t.drop if is_off(value) else t.refuse)(key, value, "off" if is_off(value) else rule.why)
    else:
        t.drop(key, value, rule.why)


def apply_rules(t: Translation, flat: dict[str, Any], rules: dict[str, Rule]) -> None:
    for key, value in flat.items():
        apply_rule(t, key, value, rules.get(key))


def fixed_option(t: Translation, key: str, value: Any, option, release: str | None) -> None:
    """A peer's own option that ours reads at one value (a spec's PeerFixed; per release: `release`, our
    model_version): dropped at it (or where ours reads none of it), else not carried; its why on both. One that
    ours trains as config keys (a PeerAsKeys): keys_option."""
    from library.models.spec import PeerAsKeys

    if isinstance(option, PeerAsKeys):
        keys_option(t, key, value, option, release)
        return
    ours = option.ours.get(release) if isinstance(option.ours, dict) else option.ours
    if option.ours is None or (ours is not None and _same_value(value, ours)):
        t.drop(key, value, option.why)
    elif isinstance(option.ours, dict) and ours is not None:
        t.refuse(key, value, f"{option.why}; {release}'s: {ours!r}")
    else:
        t.refuse(key, value, option.why)


def keys_option(t: Translation, key: str, value: Any, option, release: str | None) -> None:
    """A peer's option ours trains as config keys (a spec's PeerAsKeys): dropped where they are the release's (what
    ours trains at without them), else set; a value that is no number is not carried."""
    try:
        keys = option.keys(value)
    except (TypeError, ValueError):
        t.refuse(key, value, f"{option.why}; expected a number")
        return
    released = option.released.get(release, {})
    if all(_same_value(v, released.get(k)) for k, v in keys.items()):
        t.drop(key, value, f"{option.why}; {release}'s own: " + ", ".join(f"{k} = {v}" for k, v in keys.items()))
        return
    first, *rest = keys  # one line for all: our first key and each value
    t.set(first, keys[first], key, value, RENAMED, ", ".join(f"{k} = {v}" for k, v in keys.items()) + f"; {option.why}")
    t.config.update({k: keys[k] for k in rest})


def _same_value(value: Any, ours: Any) -> bool:
    """A given value that is ours' (numbers by value: 8 is 8.0, and a YAML's text "8")."""
    if isinstance(ours, (int, float)) and not isinstance(ours, bool):
        try:
            return float(value) == float(ours)
        except (TypeError, ValueError):
            return False
    return value == ours


def peer_file(path: str, source: str) -> str:
    """A file a peer's config names, where the peer would have found it: the working folder's, else the one
    beside the config (`source`; a command line has no folder); `path` as given where neither exists."""
    import os

    if os.path.isfile(path) or source == "command line":
        return path
    beside = os.path.join(os.path.dirname(source), path)
    return beside if os.path.isfile(beside) else path


def copy_prompts_without(t: Translation, key: str, value: Any, read: Callable[[str], bool], why: str,
                         rewrite: tuple[Callable[[list[str]], list[str]], str] | None = None,
                         objects: Callable[[str], list[str]] | None = None) -> None:
    """A peer's prompt file (value: its path) as our sample_prompts; where its lines have flags the peer does not
    read (read(part) false for the text after a --), which ours refuses, a copy without them beside our config
    (t.files), `why` in the note; "" none. rewrite: (a line's kept flags -> ours, what it does for the note), where
    ours reads a flag otherwise (a copy where it changes a line). objects: a .toml / .json file of prompt objects ->
    its prompts as lines, where the peer's objects are not ours (always a copy); None: read as they are. A relative
    path is the working folder's (the peer's), else the config's folder's."""
    import os

    from library.data.prompts import prompt_lines, split_prompt_line
    from library.text_files import read_utf8

    if is_off(value):
        t.drop(key, value, "empty: no samples")
        return
    if not isinstance(value, str):
        raise ValueError("expected the path of a prompt file")
    path = peer_file(value, t.source)
    as_objects = path.lower().endswith((".toml", ".json"))
    if not os.path.isfile(path) or (as_objects and objects is None):  # its objects: read as they are
        t.set(key, value, key, value, note="" if os.path.isfile(path) else "not on this machine: unchecked")
        return
    skipped, rewritten, lines = set(), False, []
    for line in objects(path) if as_objects else prompt_lines(read_utf8(path, "sample prompts")):
        parts = split_prompt_line(line) if line.strip() and not line.lstrip().startswith("#") else None
        flags = [part for part in parts[1:] if read(part)] if parts else []
        skipped |= {part.split(" ", 1)[0] for part in (parts or [""])[1:] if part not in flags}
        if parts and rewrite and (ours := rewrite[0](flags)) != flags:
            flags, rewritten = ours, True
        lines.append(" ".join([parts[0], *(f"--{f}" for f in flags)]) if parts else line)
    if not any(line.strip() and not line.lstrip().startswith("#") for line in lines):
        t.set(key, "", key, value, RENAMED, note='no prompts in it: "", no samples (ours refuses an empty file)')
        return
    if not skipped and not rewritten and not as_objects:
        t.set(key, path, key, value)
        return
    notes = (["its prompt objects as lines"] if as_objects else []) + (
        [f"without {', '.join('--' + f for f in sorted(skipped))}: {why}"] if skipped else []) + (
        [rewrite[1]] if rewritten else [])
    t.set(key, path, key, value, RENAMED, note=f"a copy {'; '.join(notes)}")
    text = "\n".join(lines)  # the file's last newline kept, none added
    t.files[key] = ("_prompts.txt", text if text.endswith("\n") else text + "\n")


def sample_when(t: Translation, key: str, value: Any, given: dict[str, Any], epochs_only: bool = True) -> None:
    """sample_every_n_steps / _epochs / sample_at_first as sd-scripts and musubi-tuner read them (`given`: the
    peer's keys): nothing renders without sample_prompts; with both intervals sd-scripts renders the epochs'
    samples only (`epochs_only`), musubi-tuner both, as ours does."""
    if not given.get("sample_prompts"):
        t.drop(key, value, f"no sample_prompts: {t.peer} renders none")
    elif key == "sample_every_n_steps" and given.get("sample_every_n_epochs") and epochs_only:
        t.drop(key, value, f"with sample_every_n_epochs {t.peer} renders the epochs' samples only")
    else:
        t.set(key, value, key, value)


def unless_schedule_free(rule: Rule) -> Rule:
    """A schedule key's rule, unless the peer's optimizer_type is schedule-free (t.given): sd-scripts and musubi-tuner
    then run a dummy scheduler at the constant lr (get_scheduler_fix) and read no schedule key: dropped, as ours
    refuses them with it (library/training/schedule_free.py)."""
    def handle(t: Translation, key: str, value: Any, **bound) -> None:
        if str(t.given.get("optimizer_type") or "").lower().endswith("schedulefree"):
            t.drop(key, value, f"{t.peer} ignores it with a schedule-free optimizer_type (a constant lr; its warmup "
                               f"is optimizer_args warmup_steps)")
        elif rule.kind == "custom":
            rule.handle(t, key, value, **bound)
        else:
            _apply_rule(t, key, value, rule)
    return Rule("custom", handle=handle)


def warmup_steps(t: Translation, key: str, value: Any, given: dict[str, Any]) -> None:
    """lr_warmup_steps as sd-scripts and musubi-tuner read it (train_util.int_or_float; get_scheduler_fix): "10%"
    and a float are a fraction of the run's steps, an int a step count. Ours reads a number under 1 as the fraction
    and one of 1 or more as steps, so "10%" is written 0.1 (ours refused the text) and a fraction of 1 or more
    ("100%", a TOML 1.0: the whole run there, 1 step here) as int(fraction x max_train_steps) steps."""
    text = value.strip() if isinstance(value, str) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) and not (text and text.endswith("%")):
        raise ValueError("expected a step count, a fraction of the steps or a percentage")
    if t.source == "command line" and isinstance(value, float) and value >= 1:  # its word through the peer's type
        if t.peer == "sd-scripts":  # int_or_float: int(value) of the word, which "1.0" is not
            t.refuse(key, value, "sd-scripts' command line refuses a decimal of 1 or more (int_or_float); write steps")
            return
        if value.is_integer():  # musubi-tuner's _int_or_float: a whole decimal of 1 or more is steps
            value = int(value)
    fraction = float(text[:-1]) / 100 if text else value if isinstance(value, float) else None
    if fraction is None or fraction < 1:
        t.set(key, value if fraction is None else fraction, key, value, RENAMED if text else KEPT,
              note="a fraction of the steps" if text else "")
    elif isinstance(given.get("max_train_steps"), int):
        steps = int(fraction * given["max_train_steps"])
        t.set(key, steps, key, value, RENAMED, note=f"{t.peer} reads {value!r} as {fraction:g} x the run's "
                                                     f"{given['max_train_steps']} steps; ours takes steps from 1 up")
    else:
        t.refuse(key, value, f"{t.peer} reads it as {fraction:g} x the run's steps, which the config does not give "
                             f"(max_train_steps): write our {key} as steps")


# The scheduler keys whose "" (and, but for the ratio, 0) is not given there: a GUI's empty field, or the default.
SCHEDULE_KEYS_OFF = {
    "lr_decay_steps": "0: no decay (the default there)",
    "lr_scheduler_timescale": "not given (0: a GUI's empty field): ours' default too, the warmup's steps (or 10000)",
    "lr_scheduler_min_lr_ratio": "not given",
}


def schedule_key(t: Translation, key: str, value: Any, given: dict[str, Any], schedule: str,
                 readers: tuple[str, ...]) -> None:
    """A scheduler key of sd-scripts or musubi-tuner (`given`: the peer's keys; `schedule`: its lr_scheduler, whose
    values `readers` read the key there): dropped where its schedule does not read it, refused where ours does not
    offer that schedule; else lr_decay_steps read as lr_warmup_steps is (int_or_float), a key of SCHEDULE_KEYS_OFF
    not given dropped (a min lr ratio of 0 is a ratio), the rest as it is."""
    from library.training.config_keys import SCHEDULE_KEY_READERS  # (here: it loads the families' registry)

    if schedule not in readers:
        t.drop(key, value, f"read only by lr_scheduler {' / '.join(readers)}")
    elif schedule not in SCHEDULE_KEY_READERS[key]:
        t.refuse(key, value, f"goes with lr_scheduler {schedule!r}, not carried")
    elif key in SCHEDULE_KEYS_OFF and is_off(value) and not (key == "lr_scheduler_min_lr_ratio" and value == 0):
        t.drop(key, value, SCHEDULE_KEYS_OFF[key])
    elif key == "lr_decay_steps":
        warmup_steps(t, key, value, given)
    else:
        t.set(key, value, key, value)


def carry_schedule(t: Translation, key: str, value: Any, given: dict[str, Any], schedules: tuple[str, ...]) -> None:
    """A peer's lr_scheduler (its keys `given`): carried where ours offers it with what it needs, else refused why."""
    if value not in schedules:
        t.refuse(key, value, f"ours offers {', '.join(schedules)}")
    elif schedule_lacks(t, value, given):
        t.refuse(key, value, schedule_lacks(t, value, given))
    else:
        t.set(key, value, key, value)


def schedule_lacks(t: Translation, schedule: str, given: dict[str, Any]) -> str:
    """Why ours does not run the peer's lr_scheduler with its keys (`given`), "" where it does: the key it needs
    (config_keys.SCHEDULE_NEEDS) is not given. The peers' transformers stops on cosine_with_min_lr without its
    ratio; their warmup_stable_decay at lr_decay_steps 0 (the default) never decays."""
    from library.training.config_keys import SCHEDULE_NEEDS  # (here: it loads the families' registry)

    needed = SCHEDULE_NEEDS.get(schedule, ("",))[0]
    value = given.get(needed)
    if not needed or not is_off(value) or (needed == "lr_scheduler_min_lr_ratio" and value == 0):
        return ""
    if schedule == "cosine_with_min_lr":
        return f"{t.peer} stops on it without lr_scheduler_min_lr_ratio (transformers' min_lr_rate); ours needs it too"
    return (f"without lr_decay_steps (0, the default there) the lr never decays in {t.peer}, which ours refuses: "
            f"give lr_decay_steps, or use lr_scheduler constant_with_warmup")


def flatten_tables(config: dict[str, Any]) -> dict[str, Any]:
    """sd-scripts' and musubi-tuner's config reading: tables are for people ([model], [training] ...),
    every leaf key is an argument."""
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(flatten_tables(value))
        else:
            flat[key] = value
    return flat


# The peers' training arguments that take several words (argparse nargs "*" / "+": sd-scripts' train_util /
# train_network, musubi-tuner's parser_common): any other takes one, and a second word is none of the script's
PEER_LIST_FLAGS = ("network_args", "optimizer_args", "lr_scheduler_args", "base_weights", "base_weights_multiplier",
                   "text_encoder_lr", "trainable_modules")


def argv_to_dict(argv: list[str], list_keys: tuple[str, ...] = PEER_LIST_FLAGS) -> dict[str, Any]:
    """A peer's command line (`--key value`, `--flag`, `--network_args a=1 b=2`) as the dict its TOML
    would hold: a flag alone is true, one of `list_keys` a list; numbers stay text where the rule's convert reads
    them (a command line does not say 1 from "1"). A word no flag takes (a doc's `...` or `(other args)`) is a
    ValueError, as the peer's argparse refuses it: it was taken as a second value of the flag before it, and
    `--model_version edit-2511 ...` trained another model."""
    flat: dict[str, Any] = {}
    key = None
    for word in argv:
        if word.startswith("--"):
            key = word[2:].split("=", 1)[0]
            flat[key] = [] if key in list_keys else True
            if "=" in word:
                _append(flat, key, word.split("=", 1)[1])
        elif key is not None and (key in list_keys or flat[key] is True):
            _append(flat, key, word)
        else:
            after = f" after --{key} {flat[key]!r}" if key is not None else " before the first flag"
            raise ValueError(f"command line: {word!r}{after}: no argument of the script takes it (its argparse "
                             f"refuses it: unrecognized arguments); leave it out")
    return {k: _number(v) for k, v in flat.items()}


def _append(flat: dict[str, Any], key: str, word: str) -> None:
    current = flat[key]
    flat[key] = word if current is True else ([*current, word] if isinstance(current, list) else [current, word])


def _number(value: Any) -> Any:
    """A command line's word as its TOML would hold it: a number where it reads back as written ("001", an
    output_name, stays text: 1 would name another file; "1e-4", "0.5" are numbers), true / false, else text."""
    if not isinstance(value, str):
        return value
    try:
        if str(int(value)) == value:
            return int(value)
    except ValueError:
        pass
    try:
        number = float(value)
        if not value.lstrip("+-").isdigit():  # "001": text, as above; "inf" / "nan" are words too
            return number if value.lower().lstrip("+-") not in ("inf", "infinity", "nan") else value
    except ValueError:
        pass
    return {"true": True, "false": False}.get(value.lower(), value)
