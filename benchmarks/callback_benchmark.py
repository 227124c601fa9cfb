"""How long `fit` is blocked per checkpoint: keras-orbax async against keras-orbax sync and Keras's
OrbaxCheckpoint.

One model (4 Dense layers, float32 parameters of about `mib` MiB, Adam: three times that in state)
under ModelParallel on 8 virtual CPU devices is compiled by one `fit` without a callback, then
trains `epochs` epochs of `steps` batches with the case's callback saving at every epoch end:

    sync    `keras_orbax.ModelCheckpoint(save_on_background=False)` (the floor)
    async   `keras_orbax.ModelCheckpoint(save_on_background=True)` (the default)
    keras   `keras.callbacks.OrbaxCheckpoint(save_on_background=True)` (Keras 3.15)

The callback is wrapped (`hook_timer.TimedCallback`): the wall time inside its hooks is the time the
loop is blocked; before `on_epoch_end` the wrapper waits, off the clock, for the epoch's last step.
`seconds` is the mean blocked time per save (the first included), `max_s` the longest;
`on_train_end` (waiting for the last background save and closing) is reported apart.
"""

from __future__ import annotations

import os
import shutil
import statistics

from benchmarks import bench_model as bm

LAYERS = 4
BATCH = 16


def build_model(width: int):
    import keras

    keras.distribution.set_distribution(
        bm.make_distribution(rules={".*kernel": ("batch", "model")})
    )
    inputs = keras.Input((width,))
    x = inputs
    for i in range(LAYERS):
        x = keras.layers.Dense(width, activation="relu" if i < LAYERS - 1 else None)(x)
    model = keras.Model(inputs, x)
    model.compile(optimizer=keras.optimizers.Adam(1e-4), loss="mse")
    return model


def _callback(case: str, directory: str):
    import keras

    import keras_orbax

    if case == "keras":
        return keras.callbacks.OrbaxCheckpoint(directory)
    return keras_orbax.ModelCheckpoint(directory, save_on_background=case == "async")


def run_case(case: str, params: dict, work: str) -> dict:
    import numpy as np

    from benchmarks.hook_timer import TimedCallback

    width = int(round((params["mib"] * 2**20 / 4 / LAYERS) ** 0.5 / 64) * 64)
    model = build_model(width)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((params["steps"] * BATCH, width), dtype="float32")
    y = rng.standard_normal((params["steps"] * BATCH, width), dtype="float32")
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)  # compile
    directory = os.path.join(work, case)
    shutil.rmtree(directory, ignore_errors=True)
    timed = TimedCallback(_callback(case, directory))
    clock = bm.clock()
    model.fit(x, y, batch_size=BATCH, epochs=params["epochs"], shuffle=False, verbose=0,
              callbacks=[timed])  # fmt: skip
    per_save = timed.seconds["on_epoch_end"]
    return {
        "seconds": statistics.mean(per_save),
        "max_s": max(per_save),
        "on_train_end_s": sum(timed.seconds["on_train_end"]),
        "fit_s": bm.since(clock)[0],
        "state_mib": sum(int(np.prod(v.shape)) * 4 for v in bm.state_variables(model)) / 2**20,
    }
