"""Errors a user can act on.

Every error in this module is printed by the command-line entry points as one line and
exits with status 2 (the Unix convention for a usage error), instead of a traceback.
"""


class MindSpeedError(Exception):
    """Base class of errors caused by the user's input or environment, not by a bug."""

    exit_code = 2


class BackendError(MindSpeedError):
    """The requested framework or device cannot be used (unknown, missing, already bound)."""


class FeatureNotAvailable(MindSpeedError):
    """An argument asks for a feature the selected framework/device does not provide."""


class Stopped(MindSpeedError):
    """The run stopped on a signal after saving (--exit-signal-handler); it leaves with the
    shell's code for that signal, 128 + its number."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


class CheckpointError(MindSpeedError):
    """A checkpoint file is missing, corrupt, or does not fit what loads it."""
