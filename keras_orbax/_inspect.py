"""`inspect`: what a checkpoint holds, read from its metadata alone (no arrays, no Keras model)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from keras_orbax import _steps
from keras_orbax._metadata import StepRecord


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """A checkpoint step as recorded on disk.

    Attributes:
        directory: The checkpoint root.
        steps: Every committed step, ascending.
        step: The step described.
        record: Its keras-orbax record: epoch, versions, model config and one entry per variable.
    """

    directory: Path
    steps: tuple[int, ...]
    step: int
    record: StepRecord

    @property
    def nbytes(self) -> int:
        """Bytes of all arrays of the step (one copy, whatever the layout)."""
        return sum(v.nbytes for v in self.record.variables.values())

    def __str__(self) -> str:
        record = self.record
        lines = [
            f"{self.directory}: steps {list(self.steps)}; step {self.step}"
            + (f", epoch {record.epoch}" if record.epoch is not None else "")
            + f", {len(record.variables)} variables, {_human(self.nbytes)}",
            f"written by {', '.join(f'{k} {v}' for k, v in record.versions.items())}",
        ]
        width = max((len(key) for key in record.variables), default=0)
        for key, v in record.variables.items():
            layout = v.layout
            where = (
                f"mesh {tuple(layout['mesh_shape'])} {tuple(layout['axis_names'])} "
                f"partition {tuple(layout['partition'])}"
                if layout
                else "one device"
            )
            lines.append(f"  {key:<{width}}  {v.dtype:<8} {v.shape!s:<14} {where}")
        return "\n".join(lines)


def inspect(directory: str | os.PathLike, step: int | None = None) -> CheckpointInfo:
    """Describes a checkpoint step: its variables' keys, Keras paths, shapes, dtypes and layouts.

    Reads only JSON metadata: no array is loaded and no model is needed.

    Args:
        directory: The checkpoint root.
        step: The step to describe; `None` means the latest committed one.

    Example:
    ```python
    print(keras_orbax.inspect("/ckpt"))
    ```
    """
    step, path = _steps.step_path(directory, step)
    return CheckpointInfo(
        directory=Path(directory),
        steps=tuple(_steps.committed_steps(directory)),
        step=step,
        record=_steps.read_record(path),
    )


def _human(nbytes: float) -> str:
    if nbytes < 1024:
        return f"{int(nbytes)} B"
    for unit in ("KiB", "MiB"):
        nbytes /= 1024
        if nbytes < 1024:
            return f"{nbytes:.1f} {unit}"
    return f"{nbytes / 1024:.1f} GiB"
