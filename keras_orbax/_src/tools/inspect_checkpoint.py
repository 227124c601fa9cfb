"""`inspect`: what a checkpoint holds, read from its metadata alone (no arrays, no Keras model)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from keras_orbax._src.compat import orbax_compat
from keras_orbax._src.format import step_dirs
from keras_orbax._src.format.step_record import StepRecord
from keras_orbax._src.runtime.progress import human_bytes
from keras_orbax._src.sources import keras_checkpoint
from keras_orbax._src.storage import locations


@dataclasses.dataclass(frozen=True)
class StepSummary:
    """One committed step: its epoch, the metrics saved with it, its array bytes and disk size."""

    step: int
    epoch: int | None
    metrics: dict[str, Any]
    nbytes: int
    disk_bytes: int


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """A checkpoint step as recorded on disk.

    Attributes:
        directory: The checkpoint root.
        steps: Every committed step, ascending.
        step: The step described.
        record: Its record: epoch, versions, model config and one entry per variable. For a
            directory written by Keras's `OrbaxCheckpoint`, keyed by tree path.
        summaries: Epoch, metrics and sizes of every committed step.
        writer: `"keras-orbax"` or `"keras"` (Keras's own `OrbaxCheckpoint`).
    """

    directory: Path
    steps: tuple[int, ...]
    step: int
    record: StepRecord
    summaries: tuple[StepSummary, ...] = ()
    writer: str = "keras-orbax"

    @property
    def nbytes(self) -> int:
        """Bytes of all arrays of the step (one copy, whatever the layout)."""
        return sum(v.nbytes for v in self.record.variables.values())

    def __str__(self) -> str:
        record = self.record
        lines = [
            f"{self.directory}: steps {list(self.steps)}; step {self.step}"
            + (f", epoch {record.epoch}" if record.epoch is not None else "")
            + f", {len(record.variables)} variables, {human_bytes(self.nbytes)}",
        ]
        if record.versions:
            lines.append(f"written by {', '.join(f'{k} {v}' for k, v in record.versions.items())}")
        elif self.writer == "keras":
            lines.append("written by keras.callbacks.OrbaxCheckpoint")
        if self.summaries:
            lines.append(f"  {'step':>8}  {'epoch':>5}  {'arrays':>10}  {'on disk':>10}  metrics")
            for s in self.summaries:
                metrics = " ".join(f"{k}={_number(v)}" for k, v in s.metrics.items())
                epoch = "-" if s.epoch is None else str(s.epoch)
                lines.append(
                    f"  {s.step:>8}  {epoch:>5}  {human_bytes(s.nbytes):>10}  "
                    f"{human_bytes(s.disk_bytes):>10}  {metrics}".rstrip()
                )
        lines.append(f"step {self.step}:")
        rows = [
            (key, v.path, str(v.shape), v.dtype, human_bytes(v.nbytes), _where(v.layout))
            for key, v in record.variables.items()
        ]
        widths = [max((len(r[i]) for r in rows), default=0) for i in range(5)]
        for row in rows:
            lines.append(
                "  "
                + "  ".join(f"{c:<{w}}" for c, w in zip(row, widths, strict=False))
                + "  "
                + row[5]
            )
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready description: the steps and every variable of the step described."""
        return {
            "directory": str(self.directory),
            "writer": self.writer,
            "steps": [dataclasses.asdict(s) for s in self.summaries],
            "step": self.step,
            "epoch": self.record.epoch,
            "nbytes": self.nbytes,
            "versions": self.record.versions,
            "variables": [
                {**dataclasses.asdict(v), "shape": list(v.shape), "nbytes": v.nbytes}
                for v in self.record.variables.values()
            ],
        }


def inspect(directory: str | os.PathLike, step: int | None = None) -> CheckpointInfo:
    """Describes a checkpoint: its committed steps (epoch, metrics, sizes), and for one step its
    variables' keys, Keras paths, shapes, dtypes, bytes and layouts.

    Reads only metadata: no array is loaded and no model is needed. Reads directories written by
    keras-orbax and by Keras's own `keras.callbacks.OrbaxCheckpoint`.

    Args:
        directory: The checkpoint root.
        step: The step to describe; `None` means the latest committed one.

    Example:
    ```python
    print(keras_orbax.inspect("/ckpt"))
    ```
    """
    step, path = step_dirs.step_path(directory, step)
    steps = tuple(step_dirs.committed_steps(directory))
    summaries = []
    for each in steps:
        each_path = path if each == step else step_dirs.step_path(directory, each)[1]
        each_record = _record(each, each_path)
        summaries.append(
            StepSummary(
                each,
                each_record.epoch,
                orbax_compat.step_metrics(each_path),
                sum(v.nbytes for v in each_record.variables.values()),
                _disk_bytes(each_path),
            )
        )
    return CheckpointInfo(
        directory=locations.as_path(directory),
        steps=steps,
        step=step,
        record=_record(step, path),
        summaries=tuple(summaries),
        writer="keras" if keras_checkpoint.is_keras_step(path) else "keras-orbax",
    )


def _record(step: int, path: Path) -> StepRecord:
    if keras_checkpoint.is_keras_step(path):
        return keras_checkpoint.tree_record(step, path)
    return step_dirs.read_record(path)


def _disk_bytes(path: Any) -> int:
    if locations.is_remote(path):
        return locations.total_bytes(path)
    # Each inode once: arrays of one shape share a hard-linked `zarr.json` (`_write._Once`).
    stats = [f.stat() for f in path.rglob("*") if f.is_file()]
    return sum({(s.st_dev, s.st_ino): s.st_size for s in stats}.values())


def _where(layout: dict[str, Any] | None) -> str:
    if not layout:
        return "one device"
    return (
        f"mesh {tuple(layout['mesh_shape'])} {tuple(layout['axis_names'])} "
        f"partition {tuple(layout['partition'])}"
    )


def _number(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)
