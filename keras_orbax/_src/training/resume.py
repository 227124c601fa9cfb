"""Resuming `fit` at the position a checkpoint recorded, mid-epoch included."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import keras
import numpy as np

from keras_orbax._src.compat import keras_compat
from keras_orbax._src.restore.restore import RestoreResult, restore_sharded

logger = logging.getLogger("keras_orbax")


def resume(model: keras.Model, directory: Any) -> tuple[RestoreResult, ResumePoint | None]:
    """Restores the latest step of `directory` into `model` and sets `fit` to start at the epoch
    (and batch) it records; the `ResumePoint` is None where the step records no epoch."""
    restored = restore_sharded(model, directory)
    record = restored.record
    where = f"epoch {record.epoch}" + (f", batch {record.batch}" if record.batch else "")
    logger.info("Resuming from step %d of '%s' (%s).", restored.step, directory, where)
    if record.batch:
        logger.info(
            "Step %d was saved mid-epoch: the first %d batches of epoch %d are read from the "
            "input and dropped, untrained.",
            restored.step,
            record.batch,
            record.epoch,
        )
    if record.epoch is None:
        logger.warning(
            "Step %d of '%s' records no epoch (it was not written by ModelCheckpoint): fit "
            "starts at its own initial_epoch.",
            restored.step,
            directory,
        )
        return restored, None
    keras_compat.set_initial_epoch(model, record.epoch)
    return restored, ResumePoint(model, record.epoch, record.batch or 0)


class ResumePoint:
    """Epoch `epoch` resumes after its first `batches` batches, which were trained already.

    `fit` starts at `epoch` (see `keras_compat.set_initial_epoch`). In that epoch, the first `batches`
    batches are read from the input and dropped, untrained, and the metrics' running values of the
    checkpoint (which `fit` resets when an epoch begins) are put back: the epoch ends exactly as
    it would have without the interruption, provided the input yields the same batches again.
    """

    def __init__(self, model: keras.Model, epoch: int, batches: int) -> None:
        self.epoch = epoch
        self.batches = batches
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
        self._put_back = keras_compat.drop_train_steps(model, executions, logs)

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
