"""User-facing errors.

Every mistake a user can make (YAML, data files, checkpoints, command line) raises a subclass of
:class:`LmforgeError` with a one-paragraph message that names the key or file and says what would be
valid. The CLI prints such messages without a traceback and exits with status 2; anything else is a
bug and keeps its traceback.
"""


class LmforgeError(Exception):
    """Base class of every error caused by user input."""


class ConfigError(LmforgeError, ValueError):
    """An invalid configuration value or structure (names the dotted key path)."""


class DataError(LmforgeError):
    """A missing, corrupt or mismatched data file."""


class CheckpointError(LmforgeError):
    """A missing, corrupt or incompatible checkpoint."""


class NotSupportedError(ConfigError):
    """A valid configuration (the original accepts it) that lmforge does not implement yet.

    ``lmforge check`` reports it as a warning — the file is valid — and ``lmforge train`` refuses it
    before any work starts.
    """
