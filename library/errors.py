"""The error a bad setting raises: a training option, a dataset or optimizer choice. Every command
line prints it as one line and exits with status 2. It lives at the bottom of the library, apart
from the config reader (library/training/config.py), so that the modules the reader itself calls to
check a value (library/training/optim.py) can raise it without importing the reader back; nothing
here imports torch.

Also here: how a command line prints the warnings it raises (one_line_warnings, printed_warnings) and
how it exits (exit_without_collecting), and a family folder's registration error (SpecError)."""

import contextlib
import gc
import sys
import warnings

_python_warning = warnings.formatwarning


class ConfigError(ValueError):
    pass


class SpecError(ValueError):
    """A family folder that does not register: its spec.py or its adapter (library/models/registry.py,
    family.family_class), in one line naming the file and the field."""


def blame(origins: dict[str, str], where: str, *keys: str) -> str:
    """Where the values of `keys` were set, to begin an error about them: each key's file or
    "command line" (the distinct ones, in order), `where` for a key left at its default."""
    return " and ".join(dict.fromkeys(origins.get(key, where) for key in keys))


def where_set(args, *keys: str) -> str:
    """Where the values of `keys` were set, to begin an error about them after load_config (a check against the
    model or the data): each key's file or "command line" (blame), the config file for a key left at its default."""
    return blame(getattr(args, "key_origins", {}), args.config_file or "command line", *keys)


def exit_without_collecting(code):
    """sys.exit(code), past the interpreter's last cyclic collections: with torch, diffusers' quantizers
    (bitsandbytes, torch._inductor) and transformers loaded, tearing the modules down walked their ~0.5 M
    objects again and again (2.2 s measured after the last line on 2 idle cores, 3-7 s under load; 0.4 s
    with the objects frozen). Every file, log and tracker is closed by then; the OS takes back the memory.
    atexit handlers still run. `code` may be the command's main itself, run by run_main."""
    if callable(code):
        code = run_main(code)
    gc.freeze()
    sys.exit(code)


INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a Ctrl-C'd command (train_lora's too)


def run_main(main) -> int:
    """main()'s exit status (0 where it returns what it made, not a status), and a Ctrl-C (KeyboardInterrupt)
    anywhere in it one 'interrupted' line and status 130, as in train_lora: each tool printed a traceback.
    atomic_path / atomic_folder have removed their temporaries by then (their finally blocks run as it passes)."""
    try:
        code = main()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return INTERRUPTED
    return code if isinstance(code, int) else 0


def one_line_warnings() -> None:
    """From now on, our warnings (UserWarning: a dataset image, a setting) print as 'warning: ...'
    without Python's source location and code line, which tell a user nothing; a library's other
    kinds keep their form. Command lines call it; tests and importers keep Python's."""
    warnings.formatwarning = _one_line_warning


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    if category is UserWarning:
        return f"warning: {message}\n"
    return _python_warning(message, category, filename, lineno, line)


@contextlib.contextmanager
def printed_warnings():
    """Within: our warnings (UserWarning) from what a tool calls print at once as 'warning: ...' lines on
    stderr, as the tool's own print(f"warning: ...") lines do, in the order they come, every one (Python's
    filter shows a repeated line once), called in-process or not; a library's other kinds keep their form."""
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if category is UserWarning:
            print(f"warning: {message}", file=sys.stderr)
        else:
            shown(message, category, filename, lineno, file, line)

    with warnings.catch_warnings():
        warnings.simplefilter("always", UserWarning)
        warnings.showwarning = show
        yield
