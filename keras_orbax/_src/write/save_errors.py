"""What a failed save says: the error and what it followed, and which step it left intact."""

from __future__ import annotations

from keras_orbax._src.format import step_dirs
from keras_orbax._src.storage import step_leftovers
from keras_orbax.errors import KerasOrbaxError


def failed_message(
    root: step_dirs.CheckpointRoot,
    step: int,
    error: BaseException,
    steps: list[int],
    overwrite: bool,
) -> str:
    """What a failed save says it left, from the steps listed after the failure."""
    aside = step_leftovers.replaced_path(root.path, step)
    if overwrite and step in steps:
        kept = f" Step {step} as it was before this save is back in place, intact."
    elif overwrite and aside.is_dir():
        kept = (
            f" Step {step} as it was before this save is kept at {aside}; the next listing of "
            "the directory's steps (a restore, `keras-orbax inspect`) puts it back."
        )
    elif steps:
        kept = f" The last committed step, {steps[-1]}, is intact."
    else:
        kept = " No step is committed in the directory."
    failed = f"Saving step {step} to '{root}' failed: {described_error(error)}."
    return f"{failed} Nothing was committed.{kept}"


def described_error(error: BaseException) -> str:
    """`error`, and the error it was raised while handling: Orbax's manager meets the other
    processes once more after a failed save (a barrier in a `finally`), and a process lost there
    too replaces the first error with that barrier's."""
    text = f"{type(error).__name__}: {error}"
    if isinstance(error, KerasOrbaxError):  # keras-orbax's own errors name what they followed
        return text
    first = error.__context__
    if first is not None and error.__cause__ is None and not error.__suppress_context__:
        text += f" (raised while handling {type(first).__name__}: {first})"
    return text
