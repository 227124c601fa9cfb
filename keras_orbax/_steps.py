"""A checkpoint directory and its committed steps."""

from __future__ import annotations

import os
from pathlib import Path

import orbax.checkpoint.experimental.v1 as ocp

from keras_orbax import _compat
from keras_orbax._metadata import FORMAT_NAME, FORMAT_VERSION, StepRecord
from keras_orbax.errors import CheckpointNotFoundError, CorruptCheckpointError

_NAME_FORMAT = ocp.path.step.standard_name_format()


def committed_steps(directory: str | os.PathLike) -> list[int]:
    """The committed steps under `directory`, ascending; `[]` if there are none.

    Orbax writes a step under a temporary name and renames it when committed, so a step that
    crashed mid-save is never listed.
    """
    if not Path(directory).is_dir():
        return []
    return sorted(m.step for m in _NAME_FORMAT.find_all(directory))


def step_path(directory: str | os.PathLike, step: int | None) -> tuple[int, Path]:
    """The step to read (the latest committed one if `step` is None) and its directory.

    Raises:
        CheckpointNotFoundError: `directory` is missing, holds no committed step, or not `step`.
    """
    root = Path(directory)
    if not root.exists():
        raise CheckpointNotFoundError(f"Checkpoint directory does not exist: '{root}'")
    if not root.is_dir():
        raise CheckpointNotFoundError(f"Checkpoint directory is not a directory: '{root}'")
    steps = committed_steps(root)
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
    return step, Path(_NAME_FORMAT.find_step(root, step).path)


def resolve_step(directory: str | os.PathLike, step: int | None) -> int:
    """`step`, or the latest committed one if None, checked to be committed.

    Raises:
        CheckpointNotFoundError: as `step_path`.
    """
    return step_path(directory, step)[0]


def read_record(path: Path) -> StepRecord:
    """The keras-orbax record of the step at `path`.

    Raises:
        CorruptCheckpointError: the step has no readable keras-orbax record.
    """
    try:
        custom = _compat.step_custom_metadata(path) or {}
    except (OSError, ValueError) as error:
        raise CorruptCheckpointError(
            f"Cannot read the metadata of checkpoint step '{path}': {error}"
        ) from error
    record = custom.get(FORMAT_NAME)
    if record is None:
        raise CorruptCheckpointError(
            f"'{path}' is an Orbax checkpoint but was not written by keras-orbax "
            f"(its metadata has no '{FORMAT_NAME}' record)."
        )
    if not isinstance(record, dict):
        raise CorruptCheckpointError(f"The keras-orbax record of '{path}' is not a JSON object.")
    if not isinstance(record.get("format_version", 1), int):
        raise CorruptCheckpointError(
            f"'{path}' has a keras-orbax record with an unreadable format_version: "
            f"{record.get('format_version')!r}."
        )
    if record.get("format_version", 1) > FORMAT_VERSION:
        raise CorruptCheckpointError(
            f"'{path}' uses keras-orbax format {record['format_version']}; this version reads "
            f"up to {FORMAT_VERSION}. Upgrade keras-orbax."
        )
    try:
        return StepRecord.from_json(record)
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise CorruptCheckpointError(
            f"The keras-orbax record of checkpoint step '{path}' cannot be parsed "
            f"({type(error).__name__}: {error})."
        ) from error
