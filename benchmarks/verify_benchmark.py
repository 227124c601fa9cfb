"""Restore time with the checksums checked (the default) against `verify=False`, warm page cache
(issue 36: every restore checks what it reads). Each case is a fresh process that restores once
untimed (thread pools, compiled placements), then once timed.

Layouts (`layout`), each a step saved once:
- `same`: a (rows, cols) float32 embedding (256 MiB at full size) saved split on its first axis
  over 8 devices, restored onto the same layout: each region is one shard file, checked by the
  thread that reads it.
- `reshard`: the same step restored split on the last axis: each region cuts every saved file, so
  the files are read back and checked before the regions are read.
- `mlp`: `layers` Dense(`width`) layers with Adam's state (many small files, each read and checked).
"""

from __future__ import annotations

from benchmarks import bench_model as bm


def _mlp(layers: int, width: int):
    import keras

    keras.distribution.set_distribution(keras.distribution.DataParallel())
    inputs = keras.Input((width,))
    x = inputs
    for n in range(layers):
        x = keras.layers.Dense(width, name=f"dense_{n}")(x)
    model = keras.Model(inputs, x)
    model.compile(optimizer="adam", loss="mse")
    model.optimizer.build(model.trainable_variables)
    return model


def _model(params: dict, restore: bool):
    if params["layout"] == "mlp":
        return _mlp(params["layers"], params["width"])
    axes = (None, "model") if restore and params["layout"] == "reshard" else ("model", None)
    return bm.embedding(params["rows"], params["cols"], axes)


def prepare(params: dict, work: str) -> None:
    import numpy as np

    import keras_orbax

    model = _model(params, restore=False)
    for v in model.weights:
        v.assign(np.random.default_rng(0).random(v.shape).astype("float32"))
    keras_orbax.save(model, work, step=1, overwrite=True)


def run_case(case: str, params: dict, work: str) -> dict:
    import keras_orbax

    model = _model(params, restore=True)
    keras_orbax.restore_sharded(model, work)  # warm: thread pools, compiled placements
    clock = bm.clock()
    keras_orbax.restore_sharded(model, work, verify=None if case == "checked" else False)
    seconds, cpu = bm.since(clock)
    return {"seconds": seconds, "cpu_s": cpu}
