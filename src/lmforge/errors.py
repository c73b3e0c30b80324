"""User-facing errors.

Every mistake a user can make (YAML, data files, checkpoints, command line) raises a subclass of
:class:`LmforgeError` with a one-paragraph message that names the key or file and says what would be
valid. The CLI prints such messages without a traceback and exits with the error's ``exit_status``: 2
for a mistake in the input, :data:`EXIT_TRAINING_FAILED` for a run that could not train
(:class:`TrainingFailed`); anything else is a bug and keeps its traceback.
"""

EXIT_USER_ERROR = 2  # the input is wrong: the file, data, a checkpoint, the command line, the environment
EXIT_TRAINING_FAILED = 5  # the run started but could not train (docs/training.md, "Exit statuses")


class LmforgeError(Exception):
    """Base class of every error caused by user input."""

    exit_status = EXIT_USER_ERROR


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


class TrainingFailed(LmforgeError):
    """A run that could not train: every step skipped, stopped by too many consecutive skipped steps,
    recovery gave up, or a start refused because recovery gave up in that ``save_path`` before.

    Its own exit status, so that a script (or a scheduler's requeue rule) can tell "the file is wrong"
    (2) from "the training failed" without reading the message.
    """

    exit_status = EXIT_TRAINING_FAILED
