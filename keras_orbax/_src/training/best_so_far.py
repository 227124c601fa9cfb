"""`save_best_only` and `keep_best`: the best value of `monitor` so far (the values stored with the
directory's steps count, so it survives restarts), and whether a save improves on it."""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import keras

from keras_orbax._src.compat import keras_compat
from keras_orbax._src.runtime import multihost
from keras_orbax._src.training.retention import Retention, metric, number
from keras_orbax.errors import KerasOrbaxWarning

if TYPE_CHECKING:
    from keras_orbax._src.training.callback import ModelCheckpoint


class BestSoFar:
    """The callback's `best` (Keras's `MonitorCallback` attribute) kept with the best value stored
    in the directory, once the monitor's direction is known; warns once about a missing monitor."""

    def __init__(self, retention: Retention) -> None:
        self._retention = retention
        self._candidates: list[float] = []
        self._warned_missing = False

    def begin(self, callback: ModelCheckpoint, checkpoints: Iterable[Any]) -> None:
        """At `fit`'s start: `initial_value_threshold`, then the values stored with `checkpoints`
        (folded in by `settle`, when the monitor's direction is known)."""
        callback.best = callback.initial_value_threshold
        self._candidates = [
            value
            for checkpoint in checkpoints
            if (value := metric(checkpoint.metrics, callback.monitor)) is not None
        ]

    def settle(self, callback: ModelCheckpoint) -> None:
        """Settles the monitor's direction, and folds in the best value stored in the directory."""
        if callback.monitor_op is None:
            keras_compat.set_monitor_op(callback)
        self._retention.higher_is_better = callback.monitor_op is keras.ops.greater
        callback.best = self._retention.best([callback.best, *self._candidates])
        self._candidates = []

    def should_save(self, callback: ModelCheckpoint, logs: dict) -> tuple[bool, str]:
        """Whether a save with these logs goes ahead, and what to add to its line (the monitor
        improved from ... to ...)."""
        if callback.save_best_only or callback.keep_best:
            self.settle(callback)
        note = ""
        if callback.save_best_only:
            # Keras's ModelCheckpoint saves when the monitor is missing or not a scalar (it
            # falls back to save_best_only=False for that save, with a warning): so does this.
            current = number(logs.get(callback.monitor))
            if current is None:
                self._warn_missing(callback, logs.get(callback.monitor))
            improved = current is None or keras_compat.is_improvement(
                callback, current, callback.best
            )
            if not multihost.primary_decision(improved):
                return False, ""
            if current is not None:  # None: process 0 decided, seeing a value this one lacks
                previous = "None" if callback.best is None else f"{callback.best:.5f}"
                note = f" ({callback.monitor} improved from {previous} to {current:.5f})"
                callback.best = current
        elif callback.keep_best and number(logs.get(callback.monitor)) is None:
            self._warn_missing(callback, logs.get(callback.monitor))
        return True, note

    def _warn_missing(self, callback: ModelCheckpoint, current: Any) -> None:
        if self._warned_missing:
            return
        self._warned_missing = True
        if callback.save_best_only:
            what = "ModelCheckpoint(save_best_only=True) saves every time, as Keras's does,"
        else:
            what = (
                f"ModelCheckpoint(keep_best={callback.keep_best}) cannot rank the steps it saves "
                "(only max_to_keep and keep_every keep them)"
            )
        where = ""
        if callback.save_freq != "epoch":  # a batch's logs hold no epoch-end metric (val_loss)
            where = f" after a batch (save_freq={callback.save_freq})"
        warnings.warn(
            f"{what} while '{callback.monitor}' is not a number in the logs{where}. "
            f"Received: {callback.monitor}={current!r}",
            KerasOrbaxWarning,
            stacklevel=4,  # past _warn_missing, should_save, ModelCheckpoint._consider_save
        )
