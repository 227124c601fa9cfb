"""Loading Keras's own weight files sharded: keras-orbax against Keras's `load_weights`, in one run.

For each model (the benchmark model of `bench_model.py` with Adam, and one dominated by a single large
embedding) and each case, a fresh process loads the weights and reports time and peak RSS growth over
the resident bytes of the loaded state:

    keras_h5        normal build + compile + optimizer build + `model.load_weights(x.weights.h5)`
    ko_h5           `deferred_init` build + `restore_sharded(x.weights.h5)`
    ko_json         the same from `save_weights(..., max_shard_size=...)` (`x.weights.json` + parts)
    ko_converted    `restore_sharded` of the same state converted once to a keras-orbax checkpoint
    read_floor      reading every byte of the h5 file into fresh memory (page cache warm)
    e2e_keras_h5 / e2e_ko_h5   from an empty process to a model that has predicted once

`model` (a parameter): `dense` or `embedding`.
"""

from __future__ import annotations

import os
import time

from benchmarks import bench_model as bm


def _build(model_name: str, spec: bm.ModelSpec, deferred: bool = False):
    import keras

    import keras_orbax

    optimizer = keras.optimizers.Adam(1e-3)
    with keras_orbax.deferred_init() if deferred else _null():
        if model_name == "dense":
            model = bm.build_model(spec, optimizer=optimizer, build_optimizer=False)
        else:
            tokens = keras.Input((bm.SEQ_LEN,), dtype="int32")
            x = keras.layers.Embedding(spec.width * 16, spec.width, name="embed")(tokens)
            out = keras.layers.Dense(1, name="head")(x)
            model = keras.Model(tokens, out, name="embedding_bench")
    if model_name == "embedding":
        model.compile(optimizer=optimizer, loss="mse")
    return model


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *args):
        return False


def _paths(work: str, model_name: str) -> dict[str, str]:
    return {
        "h5": os.path.join(work, f"{model_name}.weights.h5"),
        "json": os.path.join(work, f"{model_name}.weights.json"),
        "ko": os.path.join(work, f"{model_name}_ko"),
    }


def prepare(params: dict, work: str) -> None:
    """Writes the h5, sharded json and converted keras-orbax files of one trained-looking model."""
    model_name, spec = params["model"], bm.ModelSpec(params_gib=params["params_gib"])
    import keras
    import numpy as np

    import keras_orbax

    keras.distribution.set_distribution(bm.make_distribution(rules=_rules()))
    model = _build(model_name, spec)
    model.optimizer.build(model.trainable_variables)
    rng = np.random.default_rng(0)
    for v in model.variables + model.optimizer.variables:  # random-looking values
        if v.dtype == "float32":
            v.assign(rng.standard_normal(v.shape, dtype="float32"))
    paths = _paths(work, model_name)
    model.save_weights(paths["h5"])
    model.save_weights(paths["json"], max_shard_size=0.25)
    keras_orbax.save(model, paths["ko"], step=1, overwrite=True)


def _rules() -> dict[str, tuple]:
    return {**bm.layout_rules(), "embed/embeddings": ("batch", "model")}


def run_case(case: str, params: dict, work: str) -> dict:
    """Runs in a fresh process: one case, one model; returns seconds and memory figures."""
    start_wall = time.perf_counter()
    model_name, spec = params["model"], bm.ModelSpec(params_gib=params["params_gib"])
    import jax
    import keras

    import keras_orbax

    paths = _paths(work, model_name)
    if case == "read_floor":
        baseline = bm.rss_bytes()
        clock = bm.clock()
        with open(paths["h5"], "rb", buffering=0) as f:
            data = f.read()
        seconds = bm.since(clock)[0]
        growth = bm.peak_rss_bytes() - baseline
        return {"seconds": seconds, "peak_x_resident": growth / len(data)}
    keras.distribution.set_distribution(bm.make_distribution(rules=_rules()))
    jax.devices()
    baseline = bm.rss_bytes()
    clock = bm.clock()
    if case in ("keras_h5", "e2e_keras_h5"):
        model = _build(model_name, spec)
        model.optimizer.build(model.trainable_variables)
        model.load_weights(paths["h5"])
    else:
        model = _build(model_name, spec, deferred=True)
        source = {"ko_json": paths["json"], "ko_converted": paths["ko"]}.get(case, paths["h5"])
        keras_orbax.restore_sharded(model, source)
    seconds = bm.since(clock)[0]
    if case.startswith("e2e"):
        x, _ = bm.sample_batch(spec)
        x = x % spec.width
        model.predict(x, verbose=0)
        seconds = time.perf_counter() - start_wall
    state = [v.value for v in bm.state_variables(model)]
    resident = bm.resident_bytes(state)
    growth = bm.peak_rss_bytes() - baseline
    return {
        "seconds": seconds,
        "peak_x_resident": growth / resident,
        "resident_gib": resident / 2**30,
    }
