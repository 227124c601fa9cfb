"""Trains with `keras_orbax.ModelCheckpoint` until SIGTERM; for tests/test_callback.py.

    python tests/workers/preempt_train.py DIRECTORY READY_FILE RESULT_FILE

Run with KERAS_BACKEND=jax and 8 virtual CPU devices in XLA_FLAGS. Trains 8 batches per epoch;
after batch index 2 of epoch 1 (global step 11) it opens READY_FILE (a FIFO the test
waits on) and waits there until the SIGTERM has arrived, so the callback sees it at the very next batch end: step 12, mid-epoch. It
then writes what `fit` returned to RESULT_FILE as JSON and exits normally.
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import threading
from pathlib import Path
from types import FrameType

import keras

import keras_orbax
from tests import _models

EPOCHS = 50
BATCHES_PER_EPOCH = 8
BATCH_SIZE = 8


def build() -> keras.Model:
    """The model both the worker and the resuming test train (same structure, any init)."""
    keras.distribution.set_distribution(_models.model_parallel((2, 4)))
    return _models.compile_adam(_models.full_model())


def data() -> tuple:
    return _models.training_data(BATCHES_PER_EPOCH * BATCH_SIZE)


def main() -> None:
    directory, ready, result = sys.argv[1:4]
    keras.utils.set_random_seed(0)
    model = build()
    checkpoint = keras_orbax.ModelCheckpoint(directory, max_to_keep=None)

    batches_done = 0

    def wait_for_sigterm(batch: int, logs: dict | None = None) -> None:
        nonlocal batches_done
        batches_done += 1
        if batches_done != BATCHES_PER_EPOCH + 3:
            return
        # The callback's own SIGTERM handler runs as the signal arrives, then wakes this wait.
        arrived = threading.Event()
        callback_handler = signal.getsignal(signal.SIGTERM)
        assert callable(callback_handler), callback_handler

        def on_sigterm(signum: int, frame: FrameType | None) -> None:
            signal.signal(signal.SIGTERM, callback_handler)
            callback_handler(signum, frame)
            arrived.set()

        signal.signal(signal.SIGTERM, on_sigterm)
        # Any thread may receive the signal (XLA's too), and then nothing interrupts a wait of the
        # main thread: the signal's byte on the wakeup fd does.
        wakeup, wakeup_writer = os.pipe()
        os.set_blocking(wakeup_writer, False)
        previous_fd = signal.set_wakeup_fd(wakeup_writer)
        try:
            Path(ready).write_text("epoch 1, batch 3")  # a `tests._beacons.Beacon`
            select.select([wakeup], [], [], 120)
        finally:
            signal.set_wakeup_fd(previous_fd)
            os.close(wakeup)
            os.close(wakeup_writer)
        if not arrived.wait(60):  # the handler runs in this thread, at its next Python call
            raise TimeoutError("no SIGTERM within 120 s")
        assert checkpoint._watcher.requested  # the callback's handler took the notice

    x, y = data()
    history = model.fit(
        x,
        y,
        batch_size=BATCH_SIZE,
        epochs=EPOCHS,
        shuffle=False,
        verbose=0,
        callbacks=[checkpoint, keras.callbacks.LambdaCallback(on_train_batch_end=wait_for_sigterm)],
    )
    Path(result).write_text(
        json.dumps(
            {
                "preempted": checkpoint.preempted,
                "step": int(model.optimizer.iterations),
                "epochs": history.epoch,
            }
        )
    )


if __name__ == "__main__":
    main()
