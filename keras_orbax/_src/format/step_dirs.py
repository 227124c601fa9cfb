"""A checkpoint directory and its committed steps."""

from __future__ import annotations

import json
import operator
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from keras_orbax._src.compat import orbax_compat
from keras_orbax._src.format import json_checksum
from keras_orbax._src.format.record_check import record_problems
from keras_orbax._src.format.step_record import FORMAT_NAME, FORMAT_VERSION, StepRecord
from keras_orbax._src.storage import locations, step_leftovers
from keras_orbax.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    UnsupportedVersionError,
)


class CheckpointRoot:
    """A checkpoint root, turned into a path once (`locations.as_path`), whose committed steps are
    listed once per operation: every part of one `save` or `convert` (the writer lock, the
    step-exists check, the incremental plan, the checkpointer, the error naming the intact step)
    asks it, instead of turning the location into a path and listing the steps again each.

    ```python
    root = CheckpointRoot("~/ckpt")
    root.path          # PosixPath('/home/me/ckpt')
    root.steps()       # listed now, then kept
    root.listed_again()  # under the writer lock: another writer may have committed since
    ```
    """

    def __init__(self, directory: str | os.PathLike | CheckpointRoot) -> None:
        if isinstance(directory, CheckpointRoot):
            self.path: Any = directory.path
        elif _resolved(directory):  # what `as_path` returns (Orbax's `checkpointer.directory`)
            self.path = directory
        else:
            self.path = locations.as_path(directory)
        self._steps: list[int] | None = None

    @classmethod
    def of(cls, directory: str | os.PathLike | CheckpointRoot) -> CheckpointRoot:
        """`directory` itself if it is a `CheckpointRoot` (its listing kept), else a new one."""
        return directory if isinstance(directory, CheckpointRoot) else cls(directory)

    def __fspath__(self) -> str:
        return os.fspath(self.path)

    def __str__(self) -> str:
        return str(self.path)

    def steps(self) -> list[int]:
        """The committed steps, ascending: listed on the first call, then kept."""
        if self._steps is None:
            self._steps = _committed(self.path)
        return list(self._steps)

    def listed_again(self) -> list[int]:
        """The committed steps listed afresh (and kept): where the answer decides, under the
        step's writer lock."""
        self._steps = None
        return self.steps()

    def step_dir(self, step: int) -> Any:
        return self.path / str(step)

    def has_committed(self, step: int) -> bool:
        """Whether `step` is committed, from its own directory (no listing): a check that fails
        early, before the writer lock is taken (whose file would touch the directory)."""
        path = self.step_dir(step)
        return path.is_dir() and _is_complete(path)


def _resolved(directory: Any) -> bool:
    """Whether `directory` is already what `locations.as_path` makes of it: an absolute, normal
    `pathlib.Path`, or an object-store path object."""
    if isinstance(directory, Path):
        return directory.is_absolute() and os.path.normpath(directory) == os.fspath(directory)
    return not isinstance(directory, str) and locations.is_remote(directory)


def committed_steps(directory: str | os.PathLike) -> list[int]:
    """The committed steps under `directory`, ascending; `[]` if there are none.

    Orbax writes a step under a temporary name and renames it when committed, so a step that
    crashed mid-save is never listed. A step directory without its metadata file is not listed
    either: the process died between the rename and the metadata write, or while retention was
    deleting the step (Orbax deletes in place); neither can be restored.
    """
    return _committed(locations.as_path(directory))


def _committed(root: Any) -> list[int]:
    if not root.is_dir():
        return []
    step_leftovers.put_back_replaced(root)  # a step a killed overwrite had moved aside
    return sorted(step for step, path in _step_dirs(root) if _is_complete(path))


def _step_dirs(root: Any) -> list[tuple[int, Any]]:
    """`(step, directory)` of each step Orbax has renamed as committed: directories named by the
    bare step number, as Orbax's `standard_name_format()` names them (a save in progress is under
    `<step>.orbax-checkpoint-tmp-*`). Listed here rather than with Orbax's `find_all`, which reads
    every step's metadata file (holding the keras-orbax record) for timestamps, in a thread pool:
    10-15 ms of a background save's blocking time, 0.5 s with 5000 variables."""
    return [
        (int(path.name), path)
        for path in root.iterdir()
        if path.name.isdecimal() and str(int(path.name)) == path.name and path.is_dir()
    ]


def checked_step(step: Any) -> int:
    """`step` as the non-negative `int` that names its directory: a Python or NumPy integer, a 0-d
    integer array, or a Keras variable holding one (`optimizer.iterations`). Every verb that takes
    a step checks it here, so each gives the same answer.

    Raises:
        TypeError: not an integer (a float, a string, a bool); a string of digits is named as such.
        ValueError: negative.
    """
    try:
        number = _as_index(step)
    except TypeError:
        hint = "for example int(model.optimizer.iterations)"
        if isinstance(step, str) and step.isdecimal():  # read from argv, say
            hint = f"not a string: pass step=int({step!r})"
        raise TypeError(
            f"step must be an integer (it names the step's directory), {hint}. "
            f"Received: step={step!r}"
        ) from None
    if number < 0:
        raise ValueError(f"step must be 0 or more. Received: step={number}")
    return number


def _as_index(step: Any) -> int:
    if isinstance(step, bool | np.bool_ | str | bytes):
        raise TypeError
    if hasattr(step, "__index__"):
        return operator.index(step)
    array = np.asarray(step)  # a Keras variable, a 0-d array (without importing Keras here)
    if array.ndim != 0 or not np.issubdtype(array.dtype, np.integer):
        raise TypeError
    return int(array)


def _is_complete(step_dir: Any) -> bool:
    """The step has its metadata file and, in object storage, Orbax's commit marker: objects are
    written in place, so the marker, written last, is what commits the step."""
    if locations.is_remote(step_dir) and not (step_dir / locations.COMMIT_FILE).exists():
        return False
    return orbax_compat.step_metadata_file(step_dir).is_file()


def step_path(directory: str | os.PathLike, step: int | None) -> tuple[int, Path]:
    """The step to read (the latest committed one if `step` is None) and its directory.

    Raises:
        CheckpointNotFoundError: `directory` is missing, holds no committed step, or not `step`.
        CorruptCheckpointError: `step` (or, with no committed step, the latest) lacks its metadata.
    """
    step = None if step is None else checked_step(step)
    root = locations.as_path(directory)
    if not root.exists():
        raise CheckpointNotFoundError(f"Checkpoint directory does not exist: '{root}'")
    if not root.is_dir():
        raise CheckpointNotFoundError(f"Checkpoint directory is not a directory: '{root}'")
    steps = committed_steps(root)
    unfinished = _unfinished_steps(root)
    wanted_unfinished = step in unfinished if step is not None else not steps and unfinished
    if wanted_unfinished:
        names = step if step is not None else ", ".join(map(str, unfinished))
        noun = "step" if step is not None or len(unfinished) == 1 else "steps"
        raise CorruptCheckpointError(
            f"Checkpoint {noun} {names} of '{root}' has no metadata file "
            f"({orbax_compat.step_metadata_file(root / str(unfinished[-1])).name})"
            + (
                f" or no commit marker ({locations.COMMIT_FILE})"
                if locations.is_remote(root)
                else ""
            )
            + ": its save was cut off before it committed, or retention was deleting it. "
            "It cannot be restored." + (f" Committed steps: {steps}." if steps else "")
        )
    if not steps:
        raise CheckpointNotFoundError(
            f"No committed checkpoint step in '{root}'. It is not a keras-orbax checkpoint "
            "directory, or every save into it was interrupted before it committed."
        )
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise CheckpointNotFoundError(
            f"Step {step} is not a committed step of '{root}'. Committed steps: {steps}. "
            f"Received: step={step}"
        )
    return step, root / str(step)


def _unfinished_steps(root: Path) -> list[int]:
    """Steps renamed as committed whose metadata file is missing (see `committed_steps`)."""
    return sorted(step for step, path in _step_dirs(root) if not _is_complete(path))


def resolve_step(directory: str | os.PathLike, step: int | None) -> int:
    """`step`, or the latest committed one if None, checked to be committed.

    Raises:
        CheckpointNotFoundError: as `step_path`.
    """
    return step_path(directory, step)[0]


def read_record(path: Path) -> StepRecord:
    """The keras-orbax record of the step at `path`, validated (`_record_check`).

    Raises:
        CorruptCheckpointError: the step has no readable, valid keras-orbax record; the message
            names the metadata file and each problem.
        UnsupportedVersionError: the record is of a newer format than this version reads (a
            step a newer install wrote: intact, not damaged).
    """
    file = orbax_compat.step_metadata_file(path)
    custom = orbax_compat.step_custom_metadata(path) or {}  # unreadable: None, explained below
    record = custom.get(FORMAT_NAME) if isinstance(custom, dict) else None
    if record is None:
        raise _no_record(path, file)
    version = record.get("format_version") if isinstance(record, dict) else None
    if type(version) is int and version > FORMAT_VERSION:
        raise UnsupportedVersionError(
            f"Checkpoint step '{path}' is in keras-orbax format {version}, newer than this "
            f"version of keras-orbax reads (formats 1 to {FORMAT_VERSION}): it was written by a "
            "newer install. Upgrade keras-orbax to read it; nothing was modified. "
            f"Received: format_version={version}"
        )
    problems = record_problems(record, FORMAT_VERSION)
    if not problems:  # a changed digit the checks above pass: only the checksum tells
        problems = [f"the record {p}" for p in [json_checksum.problem(record)] if p is not None]
    if problems:
        lines = "\n".join(f"  {p}" for p in problems[:20])
        count = f"{len(problems)} {'problem' if len(problems) == 1 else 'problems'}"
        raise CorruptCheckpointError(
            f"The keras-orbax record of checkpoint step '{path}' (in {file}) is damaged or not "
            f"one this version reads; {count}:\n{lines}\nNo variable was modified."
        )
    return StepRecord.from_json(record)


def _no_record(path: Path, file: Path) -> CorruptCheckpointError:
    """Why a step has no record: its metadata file is missing, cannot be read (the `OSError` kept
    as the cause: an I/O error is retried, `runtime.io_faults`), is not JSON, or is plain Orbax's."""
    try:
        content = file.read_bytes()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return CorruptCheckpointError(
            f"Checkpoint step '{path}' has no metadata file {file}: the step is damaged or was "
            "partly deleted. Restore another step."
        )
    except OSError as error:
        failed = CorruptCheckpointError(
            f"The metadata file {file} of checkpoint step '{path}' cannot be read: {error}"
        )
        failed.__cause__ = error
        return failed
    try:
        json.loads(content)
    except (ValueError, RecursionError) as error:
        return CorruptCheckpointError(
            f"The metadata file {file} of checkpoint step '{path}' is unreadable: {error}"
        )
    return CorruptCheckpointError(
        f"'{path}' is an Orbax checkpoint but was not written by keras-orbax "
        f"(its metadata {file} has no '{FORMAT_NAME}' record)."
    )


ASIDE_SUFFIX = ".unreadable"
"""Steps that resume passed over are moved to `<step>.unreadable` (`-2`, `-3`... if taken): not a
step name to Orbax, `committed_steps`, retention or a restore of the root, nor an Orbax temporary
one. Named on its own (`ckpt/12.unreadable`), it is read as that step, for `inspect`, `verify` and
`diff` to say what is wrong with it."""

_ASIDE = re.compile(rf"^(\d+){re.escape(ASIDE_SUFFIX)}(-\d+)?$")


def aside_step(path: Any) -> int | None:
    """The step a directory that resume moved aside held (`12.unreadable-2`: 12); None for any
    other path."""
    matched = _ASIDE.match(path.name)
    return int(matched.group(1)) if matched and path.is_dir() else None
