"""Time from a resumed `fit` call to its first trained batch, against how far into the epoch the
job was stopped: a `PyDataset` whose batches cost 20 ms each (docs/benchmarks.md).

For each stop point `b`, a first `fit` trains `b` batches of the epoch, saves (ModelCheckpoint,
save_freq=b) and stops; a second `fit` with `resume=True` is timed from its call to the end of its
first trained batch (the restore included). Run it once with this checkout and once with an older
keras-orbax on `PYTHONPATH` to compare:

    PYTHONPATH=. python benchmarks/resume_position_benchmark.py --label after
    PYTHONPATH=/tmp/main python benchmarks/resume_position_benchmark.py --label before
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

os.environ.setdefault("KERAS_BACKEND", "jax")

import keras
import numpy as np

import keras_orbax

BATCH, BATCHES, COST_S = 8, 200, 0.02


class _Slow(keras.utils.PyDataset):
    """200 batches, each taking 20 ms to make (decoding, augmenting)."""

    def __init__(self) -> None:
        super().__init__()
        rng = np.random.default_rng(0)
        self.x = rng.random((BATCHES * BATCH, 16), dtype="float32")
        self.y = rng.random((BATCHES * BATCH, 8), dtype="float32")
        self.reads = 0

    def __len__(self) -> int:
        return BATCHES

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        self.reads += 1
        time.sleep(COST_S)
        return self.x[i * BATCH : (i + 1) * BATCH], self.y[i * BATCH : (i + 1) * BATCH]


class _StopAt(keras.callbacks.Callback):
    def __init__(self, batches: int) -> None:
        super().__init__()
        self.batches = batches

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if batch + 1 == self.batches:
            self.model.stop_training = True


class _FirstTrained(keras.callbacks.Callback):
    """Notes when the first batch past `skip` ends: the first one trained after the resume."""

    def __init__(self, skip: int) -> None:
        super().__init__()
        self.skip, self.at = skip, None

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if self.at is None and batch >= self.skip:
            self.at = time.perf_counter()


def _model() -> keras.Model:
    inputs = keras.Input((16,))
    outputs = keras.layers.Dense(8)(keras.layers.Dense(32)(inputs))
    model = keras.Model(inputs, outputs)
    model.compile(optimizer="adam", loss="mse")
    return model


def measure(stop_at: int) -> dict[str, float | int]:
    with tempfile.TemporaryDirectory() as directory:
        first = keras_orbax.ModelCheckpoint(directory, save_freq=stop_at, save_on_background=False)
        _model().fit(_Slow(), epochs=1, verbose=0, callbacks=[first, _StopAt(stop_at)])
        data, probe = _Slow(), _FirstTrained(stop_at)
        resumed = keras_orbax.ModelCheckpoint(directory, resume=True)
        model = _model()
        start = time.perf_counter()
        model.fit(data, epochs=1, verbose=0, callbacks=[resumed, probe, _StopAt(stop_at + 1)])
        assert probe.at is not None
        return {"stopped_at": stop_at, "to_first_batch_s": probe.at - start, "reads": data.reads}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", default="after")
    parser.add_argument("--stops", default="10,50,150")
    args = parser.parse_args()
    keras.utils.set_random_seed(0)
    measure(2)  # warm-up: compilation, Orbax's first save
    for stop in (int(s) for s in args.stops.split(",")):
        print(json.dumps({"label": args.label, **measure(stop)}), flush=True)


if __name__ == "__main__":
    main()
