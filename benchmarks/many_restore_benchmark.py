"""Restore of many small variables: keras-orbax against reading the step's files and Keras's h5 load.

The state is the save benchmark's `many` one: `layers` independent Dense(`width`) layers, no
optimizer (two variables per layer: 5000 at full size), kernels split (None, "model") over a (2, 4)
mesh of 8 virtual CPU devices, biases replicated. `prepare` saves it with `keras_orbax.save` and
`model.save_weights("model.weights.h5")` and reads every file once (page cache warm). A restore
whose values differ from the saved ones fails the run.
"""

from __future__ import annotations

import json
import os

from benchmarks import bench_model as bm
from benchmarks.harness import files_of


def _set_distribution() -> None:
    import keras

    keras.distribution.set_distribution(bm.make_distribution(rules={r".*kernel": (None, "model")}))


def _sums(model) -> dict[str, float]:
    return bm.checksums((str(i), v.value) for i, v in enumerate(model.variables))


def prepare(params: dict, work: str) -> None:
    import jax

    import keras_orbax

    _set_distribution()
    model = bm.independent_dense(params["layers"], params["width"])
    for i, v in enumerate(model.variables):
        v.assign(jax.random.normal(jax.random.key(i), v.shape))
    keras_orbax.save(model, os.path.join(work, "ko"), step=1, overwrite=True)
    model.save_weights(os.path.join(work, "model.weights.h5"))
    with open(os.path.join(work, "sums.json"), "w") as f:
        json.dump(_sums(model), f)
    bm.read_all(work)  # page cache warm for every case


def run_case(case: str, params: dict, work: str) -> dict:
    step = os.path.join(work, "ko", "1")
    if case == "read":
        start = bm.clock()
        nbytes = sum(b.nbytes for b in bm.read_all(step))
        wall, cpu = bm.since(start)
        return {"seconds": wall, "cpu_s": cpu, "bytes": nbytes, "files": len(files_of(step))}
    import keras_orbax

    _set_distribution()
    if case == "ko":
        with keras_orbax.deferred_init():
            model = bm.independent_dense(params["layers"], params["width"])
        start = bm.clock()
        keras_orbax.restore_sharded(model, os.path.join(work, "ko"))
    else:
        model = bm.independent_dense(params["layers"], params["width"])
        start = bm.clock()
        model.load_weights(os.path.join(work, "model.weights.h5"))
    wall, cpu = bm.since(start)
    with open(os.path.join(work, "sums.json")) as f:
        wrong = bm.compare_checksums(_sums(model), json.load(f))
    if wrong:
        raise SystemExit(f"{case}: restored values differ from the saved ones: {wrong[:5]}")
    return {"seconds": wall, "cpu_s": cpu, "variables": len(model.variables)}
