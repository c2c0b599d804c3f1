"""The error a bad setting raises: a training option, a dataset or optimizer choice. Every command
line prints it as one line and exits with status 2. It lives at the bottom of the library, apart
from the config schema (library/training/config.py), so that the modules the schema itself calls to
check a value (library/training/optim.py) can raise it without importing the schema back; nothing
here imports torch.

Also here: how a command line prints the warnings it raises (one_line_warnings)."""

import warnings

_python_warning = warnings.formatwarning


class ConfigError(ValueError):
    pass


def one_line_warnings() -> None:
    """From now on, our warnings (UserWarning: a dataset image, a setting) print as 'warning: ...'
    without Python's source location and code line, which tell a user nothing; a library's other
    kinds keep their form. Command lines call it; tests and importers keep Python's."""
    warnings.formatwarning = _one_line_warning


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    if category is UserWarning:
        return f"warning: {message}\n"
    return _python_warning(message, category, filename, lineno, line)
