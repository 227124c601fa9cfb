"""Time from a resumed `fit` call to its first trained batch, against how far into the epoch the
job was stopped: a `PyDataset` of `batches` batches that cost `cost_s` each to make (decoding,
augmenting), a small Dense model, one device.

A case is a stop point: a first `fit` trains that share of the epoch (`early` 5 %, `middle` 50 %,
`late` 95 %), saves (`ModelCheckpoint`, save_freq = the stop) and stops; a second `fit` with
`resume=True` is timed from its call to the end of its first trained batch (the restore included)
and the dataset counts its reads. The floor, `fresh`, is a `fit` from scratch timed the same way.
Each process first runs one short stop untimed (compilation, Orbax's first save). To compare with
an older keras-orbax, run the same command in its checkout.
"""

from __future__ import annotations

import tempfile
import time

STOPS = {"early": 0.05, "middle": 0.5, "late": 0.95}
BATCH = 8


def _classes(batches: int, cost_s: float):
    import keras
    import numpy as np

    class Slow(keras.utils.PyDataset):
        def __init__(self) -> None:
            super().__init__()
            rng = np.random.default_rng(0)
            self.x = rng.random((batches * BATCH, 16), dtype="float32")
            self.y = rng.random((batches * BATCH, 8), dtype="float32")
            self.reads = 0

        def __len__(self) -> int:
            return batches

        def __getitem__(self, i: int):
            self.reads += 1
            time.sleep(cost_s)
            return self.x[i * BATCH : (i + 1) * BATCH], self.y[i * BATCH : (i + 1) * BATCH]

    class StopAt(keras.callbacks.Callback):
        """Stops after batch `at`; notes when the first batch at or past `trained` ends."""

        def __init__(self, at: int, trained: int = 0) -> None:
            super().__init__()
            self.at_, self.trained, self.first = at, trained, None

        def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
            if self.first is None and batch >= self.trained:
                self.first = time.perf_counter()
            if batch + 1 == self.at_:
                self.model.stop_training = True

    return Slow, StopAt


def _model():
    import keras

    inputs = keras.Input((16,))
    model = keras.Model(inputs, keras.layers.Dense(8)(keras.layers.Dense(32)(inputs)))
    model.compile(optimizer="adam", loss="mse")
    return model


def measure(stop_at: int, params: dict) -> dict:
    """Seconds from a `fit` call to its first trained batch: resumed after `stop_at` batches, or
    from scratch (`stop_at` 0)."""
    import keras_orbax

    Slow, StopAt = _classes(params["batches"], params["cost_s"])
    with tempfile.TemporaryDirectory() as directory:
        callbacks = []
        if stop_at:
            first = keras_orbax.ModelCheckpoint(
                directory, save_freq=stop_at, save_on_background=False
            )
            _model().fit(Slow(), epochs=1, verbose=0, callbacks=[first, StopAt(stop_at)])
            callbacks = [keras_orbax.ModelCheckpoint(directory, resume=True)]
        data, probe, model = Slow(), StopAt(stop_at + 1, stop_at), _model()
        start = time.perf_counter()
        model.fit(data, epochs=1, verbose=0, callbacks=[*callbacks, probe])
        assert probe.first is not None
        return {"seconds": probe.first - start, "stopped_at": stop_at, "reads": data.reads}


def run_case(case: str, params: dict, work: str) -> dict:
    import keras

    keras.utils.set_random_seed(0)
    measure(2, params)  # warm-up: compilation, Orbax's first save
    stop = 0 if case == "fresh" else max(1, round(STOPS[case] * params["batches"]))
    return measure(stop, params)
