"""Resuming `fit` at the position a checkpoint recorded, mid-epoch included."""

from __future__ import annotations

import dataclasses
import logging
import math
import warnings
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import orbax.checkpoint.experimental.v1 as ocp

from keras_orbax._src.compat import keras_compat
from keras_orbax._src.format import step_dirs
from keras_orbax._src.format.step_record import OPTIMIZER, StepRecord
from keras_orbax._src.model.matching import counted
from keras_orbax._src.restore.restore import RestoreResult, restore_sharded
from keras_orbax._src.runtime import multihost
from keras_orbax._src.sources import resolve
from keras_orbax.errors import CheckpointNotFoundError, CorruptCheckpointError, KerasOrbaxWarning

logger = logging.getLogger("keras_orbax")


@dataclasses.dataclass(frozen=True)
class Resumed:
    """What `resume` did: the restore, where `fit` goes on (None: the step records no epoch), and
    the newer steps it passed over and deleted because their record could not be read."""

    restored: RestoreResult
    point: ResumePoint | None
    unreadable: tuple[int, ...] = ()


def resume(
    model: keras.Model,
    directory: str,
    checkpointer: ocp.training.Checkpointer,
    *,
    epochs: int | None,
    steps_per_epoch: int | None = None,
    verbose: int,
    position_input: Callable[[int, StepRecord], bool] | None = None,
) -> Resumed | None:
    """Restores the newest readable step of `directory` into `model` and sets `fit` to start at
    the epoch (and batch) it records; None if the directory holds no step.

    A newer step whose record cannot be read (its `_CHECKPOINT_METADATA` is missing or damaged,
    or holds no valid keras-orbax record) cannot be resumed from, nor saved over: it is passed
    over with a `KerasOrbaxWarning` and deleted once the older step is restored, so that this run
    can write those steps again and retention does not rank it as the latest.

    `position_input(step, record)` puts `fit`'s input at the position the step saved, and says
    whether it could (`data_position.DataPosition`); if not, the trained batches of a resumed epoch
    are read and dropped.

    Raises:
        CorruptCheckpointError: the directory holds steps, and none of them can be read.
    """
    steps = sorted(
        set(step_dirs.committed_steps(directory)) | {c.step for c in checkpointer.checkpoints}
    )
    if not steps:
        return None
    step, unreadable = multihost.primary_value("resume", _newest_readable, directory, steps)
    if step is None:
        count = counted(len(unreadable), "step")
        reasons = "\n".join(f"  step {s}: {why}" for s, why in unreadable)
        raise CorruptCheckpointError(
            f"No step of '{directory}' can be read to resume from ({count}):\n{reasons}\n"
            "Delete the directory or pass another one to start afresh."
        )
    for skipped, why in unreadable:
        warnings.warn(
            f"Step {skipped} of '{directory}' cannot be read, so fit resumes from step {step} "
            f"instead and step {skipped} is deleted (this run trains it again). {why}",
            KerasOrbaxWarning,
            stacklevel=2,
        )
    restored = restore_sharded(model, directory, step)
    for skipped, _ in unreadable:
        checkpointer.delete(skipped, missing_ok=True)
    record = restored.record
    positioned = (
        position_input is not None and record.epoch is not None and position_input(step, record)
    )
    _announce(restored, directory, epochs, verbose, positioned=positioned)
    if model.optimizer is not None and not any(
        v.role == OPTIMIZER for v in record.variables.values()
    ):
        warnings.warn(  # restored as Keras's load_weights would, but not what resuming promises
            f"Step {step} of '{directory}' holds no optimizer state (saved with "
            "save_weights_only=True, or from a model without an optimizer): fit resumes from its "
            "weights with the optimizer as it is, not where that run's optimizer was.",
            KerasOrbaxWarning,
            stacklevel=2,
        )
    if record.epoch is None:
        return Resumed(restored, None, tuple(s for s, _ in unreadable))
    saved_steps = record.extra.get("steps_per_epoch")
    if (
        not positioned
        and record.batch
        and saved_steps is not None
        and steps_per_epoch not in (None, saved_steps)
    ):
        batches = counted(saved_steps, "batch", "batches")
        dropped = counted(record.batch, "batch", "batches")
        warnings.warn(  # the batches dropped are counted, not recognized
            f"Step {step} of '{directory}' was saved after batch {record.batch} of an epoch of "
            f"{batches}; this fit's epochs have {steps_per_epoch}. It drops the first {dropped} "
            f"of its epoch {record.epoch + 1} as trained already, which are other samples than "
            "the checkpoint trained (another batch size or dataset): resume mid-epoch with the "
            "same batches.",
            KerasOrbaxWarning,
            stacklevel=2,
        )
    keras_compat.set_initial_epoch(model, record.epoch)
    point = ResumePoint(model, record.epoch, record.batch or 0, read=not positioned)
    return Resumed(restored, point, tuple(s for s, _ in unreadable))


def _newest_readable(directory: str, steps: list[int]) -> list[Any]:
    """`[step, [[newer step, why], ...]]`: the newest of `steps` whose record reads, None if none
    does, and the newer ones that do not (JSON-safe: process 0 decides for all)."""
    unreadable: list[list[Any]] = []
    for step in sorted(steps, reverse=True):
        try:
            resolve.open_source(directory, step)
        except (CorruptCheckpointError, CheckpointNotFoundError) as error:
            unreadable.append([step, f"{type(error).__name__}: {error}"])
            continue
        return [step, unreadable]
    return [None, unreadable]


def _announce(
    restored: RestoreResult,
    directory: str,
    epochs: int | None,
    verbose: int,
    *,
    positioned: bool = False,
) -> None:
    """Logs (and with `verbose`, prints) where `fit` resumes, on process 0. Epochs are numbered
    from 1 and batches counted as done, as the save lines are (`Epoch 2, batch 3: saving ...`)."""
    if not multihost.is_primary():
        return
    record, step = restored.record, restored.step
    start = f"Resuming from step {step} of '{directory}'"
    of = f"/{epochs}" if epochs is not None else ""
    if record.epoch is None:
        line = (
            f"{start}: it records no epoch (it was not written by ModelCheckpoint), so fit "
            "starts at its own initial_epoch."
        )
        logger.warning(line)
    elif epochs is not None and record.epoch >= epochs:
        done = _position(record.epoch, record.batch)
        line = f"{start} ({done}): all {counted(epochs, 'epoch')} are done, nothing left to train."
        logger.info(line)
    elif record.batch and positioned:
        line = (
            f"{start} at epoch {record.epoch + 1}{of}, batch {record.batch}: the input goes on "
            "from the position saved with the step, reading none of the batches trained before; "
            "other callbacks (the progress bar, loggers) still see their batch hooks run for them."
        )
        logger.info(line)
    elif record.batch:
        line = (
            f"{start} at epoch {record.epoch + 1}{of}, batch {record.batch}: "
            + (
                "the first batch of that epoch, trained before the checkpoint, is"
                if record.batch == 1
                else f"the first {record.batch} batches of that epoch, trained before the "
                "checkpoint, are"
            )
            + " read from the input and dropped; other callbacks (the progress bar, loggers) "
            "still see their batch hooks run for them."
        )
        logger.info(line)
    else:
        line = (
            f"{start}: {counted(record.epoch, 'epoch')} done, fit goes on at epoch "
            f"{record.epoch + 1}{of}."
        )
        logger.info(line)
    if verbose > 0:
        print(line, flush=True)


def _position(epoch: int, batch: int | None) -> str:
    return f"epoch {epoch + 1}, batch {batch}" if batch else f"{counted(epoch, 'epoch')} done"


class ResumePoint:
    """Epoch `epoch` resumes after its first `batches` batches, which were trained already.

    `fit` starts at `epoch` (see `keras_compat.set_initial_epoch`). In that epoch, the first `batches`
    train steps are dropped, untrained, and the metrics' running values of the checkpoint (which
    `fit` resets when an epoch begins) are put back: the epoch ends exactly as it would have
    without the interruption. With `read`, the dropped steps read their batches from the input
    (which must yield the same batches again); without, the input was put past them already
    (`data_position.DataPosition`) and they read nothing.

    Other callbacks still see `on_train_batch_begin`/`_end` for the dropped batches, with the
    checkpoint's metric values: Keras builds the `CallbackList` inside `fit` and calls every
    callback in it for every execution, and gives a callback no way to hide batches from the
    others (docs/resuming.md).
    """

    def __init__(self, model: keras.Model, epoch: int, batches: int, *, read: bool = True) -> None:
        self.epoch = epoch
        self.batches = batches
        self.read = read  # False: the input starts past them (`data_position`), nothing to read
        self._metrics = [keras_compat.current_value(v) for v in model.metrics_variables]
        self._put_back: Callable[[], None] | None = None

    def begin_epoch(self, model: keras.Model, epoch: int) -> None:
        """Call from `on_epoch_begin`: in the resumed epoch, starts dropping its trained batches."""
        if epoch != self.epoch or not self.batches:
            return
        for variable, value in zip(model.metrics_variables, self._metrics, strict=True):
            variable.assign(value)
        logs = {k: _python(v) for k, v in model.get_metrics_result().items()}
        executions = math.ceil(self.batches / model.steps_per_execution)
        self._put_back = keras_compat.drop_train_steps(model, executions, logs, read=self.read)

    def dropped(self, epoch: int, batch: int) -> bool:
        """Whether batch `batch` (0-based, as in `on_train_batch_end`) of `epoch` was dropped."""
        return epoch == self.epoch and batch < self.batches

    def close(self) -> None:
        """Puts `fit`'s train step back if the epoch ended before every drop happened."""
        if self._put_back is not None:
            self._put_back()
            self._put_back = None


def _python(value: Any) -> Any:
    array = np.asarray(value)
    return array.item() if array.ndim == 0 else array
