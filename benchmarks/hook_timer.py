"""A callback wrapper that measures how long each of another callback's hooks blocks `fit`.

```python
timed = TimedCallback(keras_orbax.ModelCheckpoint(directory))
model.fit(x, y, callbacks=[timed])
timed.seconds["on_epoch_end"]        # wall seconds of each call
timed.seconds["on_epoch_end_cpu"]    # CPU seconds of each, on the loop's thread
timed.seconds["on_epoch_end_gc2"]    # full garbage collections run in each, on that thread
timed.collections[2]                 # seconds of each full collection during fit, any thread
```

Before each `on_epoch_end`, off the clock, it waits for the epoch's last train step to finish
computing (JAX dispatches it asynchronously; every callback must wait for it before reading the
state, and the device is busy with it, not idle), then runs `before_epoch_end(epoch)` if given.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import jax
import keras


class TimedCallback(keras.callbacks.Callback):
    """Runs `inner`'s hooks and records, per hook, each call's wall time, CPU time on the loop's
    thread, and the time of the full garbage collections run on that thread during it.

    Args:
        inner: The callback measured.
        before_epoch_end: Runs off the clock before each timed `on_epoch_end`.
        around_epoch_end: A context manager factory entered around each timed `on_epoch_end`
            (a profiler, say).
    """

    def __init__(
        self,
        inner: keras.callbacks.Callback,
        *,
        before_epoch_end: Callable[[int], None] | None = None,
        around_epoch_end: Callable[[int], AbstractContextManager[Any]] | None = None,
    ) -> None:
        super().__init__()
        self.inner = inner
        self.seconds: dict[str, list[float]] = defaultdict(list)
        self._before = before_epoch_end
        self._around = around_epoch_end or (lambda epoch: contextlib.nullcontext())
        # Seconds of every collection from `fit`'s start to its end, by generation, any thread.
        self.collections: dict[int, list[float]] = {0: [], 1: [], 2: []}
        self._collections: list[float] = []
        self._collection_start: float | None = None
        self._fitting = False
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":  # collections never overlap: the collector runs under the GIL
            self._collection_start = time.perf_counter()
            return
        if self._collection_start is None:
            return
        seconds = time.perf_counter() - self._collection_start
        self._collection_start = None
        if self._fitting:
            self.collections[info["generation"]].append(seconds)
        if info["generation"] == 2 and threading.current_thread() is threading.main_thread():
            self._collections.append(seconds)

    def set_model(self, model: keras.Model) -> None:
        super().set_model(model)
        self.inner.set_model(model)

    def set_params(self, params: dict) -> None:
        super().set_params(params)
        self.inner.set_params(params)

    def _time(self, hook: str, *args: Any) -> None:
        self._collections.clear()
        start, cpu = time.perf_counter(), time.thread_time()
        getattr(self.inner, hook)(*args)
        self.seconds[hook].append(time.perf_counter() - start)
        self.seconds[f"{hook}_cpu"].append(time.thread_time() - cpu)
        self.seconds[f"{hook}_gc2"].append(sum(self._collections))

    def on_train_begin(self, logs=None):
        self._fitting = True
        self._time("on_train_begin", logs)

    def on_epoch_begin(self, epoch, logs=None):
        self._time("on_epoch_begin", epoch, logs)

    def on_train_batch_end(self, batch, logs=None):
        self._time("on_train_batch_end", batch, logs)

    def on_epoch_end(self, epoch, logs=None):
        jax.block_until_ready(
            [v.value for v in self.model.variables + self.model.optimizer.variables]
        )
        if self._before is not None:
            self._before(epoch)
        with self._around(epoch):
            self._time("on_epoch_end", epoch, logs)

    def on_train_end(self, logs=None):
        self._time("on_train_end", logs)
        self._fitting = False
        gc.callbacks.remove(self._on_gc)
