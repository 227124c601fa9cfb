"""Public exception types.

Each subclasses a builtin as well, so `except ValueError` or `except FileNotFoundError` still works.
"""

from __future__ import annotations

from collections.abc import Sequence


class KerasOrbaxError(Exception):
    """Base class of every keras-orbax error."""


class KerasOrbaxWarning(UserWarning):
    """Base class of every keras-orbax warning."""


class CheckpointNotFoundError(KerasOrbaxError, FileNotFoundError):
    """A directory holds no checkpoint, no committed step, or not the step asked for."""


class UnsupportedSourceError(KerasOrbaxError, ValueError):
    """A verb was given a kind of saved state it cannot use; the message names what can."""


class StepExistsError(KerasOrbaxError, FileExistsError):
    """`save` was asked to write a step that is already committed."""


class StepLockedError(KerasOrbaxError, BlockingIOError):
    """Another writer is saving the same step to the same directory right now, or another
    training run (`ModelCheckpoint`) is writing the directory; nothing was written.

    Raised at once, without waiting: the other writer's save goes on and commits normally.
    """


class DuplicateKeyError(KerasOrbaxError, ValueError):
    """Two different variables of one model map to the same checkpoint key."""


class CheckpointMismatchError(KerasOrbaxError, ValueError):
    """The checkpoint does not fit the model: missing or unexpected keys, shapes, dtypes, layouts.

    Attributes:
        problems: One line per offending variable, as printed in the message.
    """

    def __init__(self, message: str, problems: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.problems = tuple(problems)


class CorruptCheckpointError(KerasOrbaxError, OSError):
    """Array files of a committed step are missing, truncated or unreadable."""


class DeferredVariableError(KerasOrbaxError, RuntimeError):
    """A variable built under `deferred_init()` was used before `restore_sharded` filled it."""


class NotDeferrableError(KerasOrbaxError, ValueError):
    """Keras cannot create a variable without allocating it: it is made from a number, not an
    initializer (an optimizer's step counter, a model compiled while it is built)."""


class BackendError(KerasOrbaxError, RuntimeError):
    """Keras runs a backend other than JAX (keras-orbax works on JAX arrays and shardings)."""


class SaveFailedError(KerasOrbaxError, RuntimeError):
    """An asynchronous save failed; the previous committed step is intact."""


class ProcessSyncError(KerasOrbaxError, TimeoutError):
    """Processes under `jax.distributed` did not meet at a barrier in time, or were given other
    arguments (directory, step) for one collective `save`."""


class UnsupportedVersionError(KerasOrbaxError, ImportError):
    """An installed Keras, keras-hub, Orbax, JAX or etils lacks a private symbol keras-orbax uses,
    or a checkpoint step was written in a newer keras-orbax format than this version reads.

    The message names the symbol or the step, and the versions keras-orbax supports.
    """
