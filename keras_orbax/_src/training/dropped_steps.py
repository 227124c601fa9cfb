"""The batches of a resumed epoch that were trained before the checkpoint: their train steps run
as no-ops (`data_compat.drop_train_steps`), reading their batches or not as `input_position`
decided, with the checkpoint's metric values."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import keras
import numpy as np

from keras_orbax._src.compat import data_compat, keras_compat


class DroppedSteps:
    """In epoch `epoch`, the first `batches` batches were trained before the checkpoint: their
    train steps are dropped, and the metrics' running values of the checkpoint (which `fit`
    resets when an epoch begins) are put back, so the epoch ends exactly as it would have without
    the interruption. With `read`, the dropped steps read their batches from the input (which
    must yield the same batches again); without, the input was put past them already. `logs`:
    what `fit` reported after the checkpoint's batch, which the dropped batches report again
    (else the metrics' results are computed from the checkpoint's values).

    Other callbacks still see `on_train_batch_begin`/`_end` for the dropped batches, with the
    checkpoint's metric values: Keras builds the `CallbackList` inside `fit`, calls every
    callback in it for every execution, and gives a callback no way to hide batches from the
    others (docs/resuming.md).
    """

    def __init__(
        self,
        model: keras.Model,
        epoch: int,
        batches: int,
        *,
        read: bool,
        logs: dict[str, float] | None = None,
    ) -> None:
        self.epoch, self.batches, self.read = epoch, batches, read
        self._metrics = [keras_compat.current_value(v) for v in model.metrics_variables]
        self._logs = logs  # what `fit` reported after the checkpoint's batch, where saved
        self._put_back: Callable[[], None] | None = None

    def begin_epoch(self, model: keras.Model, epoch: int) -> None:
        if epoch != self.epoch or not self.batches:
            return
        for variable, value in zip(model.metrics_variables, self._metrics, strict=True):
            variable.assign(value)
        logs = self._logs
        if logs is None:
            logs = {k: _python(v) for k, v in model.get_metrics_result().items()}
        executions = math.ceil(self.batches / model.steps_per_execution)
        self._put_back = data_compat.drop_train_steps(model, executions, logs, read=self.read)

    def dropped(self, epoch: int, batch: int) -> bool:
        return epoch == self.epoch and batch < self.batches

    def close(self) -> None:
        if self._put_back is not None:
            self._put_back()
            self._put_back = None


def _python(value: Any) -> Any:
    array = np.asarray(value)
    return array.item() if array.ndim == 0 else array
