"""The error a bad setting raises: a training option, a dataset or optimizer choice. Every command
line prints it as one line and exits with status 2. It lives at the bottom of the library, apart
from the config schema (library/training/config.py), so that the modules the schema itself calls to
check a value (library/training/optim.py) can raise it without importing the schema back; nothing
here imports torch."""


class ConfigError(ValueError):
    pass
