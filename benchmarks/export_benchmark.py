"""Export benchmark: the three exports of a sharded keras-hub Gemma against the durable write floor.

Each case runs in a fresh process that builds a Gemma backbone (bfloat16; Gemma-2B widths, few
layers, a smaller vocabulary) on keras-hub's layout map over a (2, 4) mesh of 8 virtual CPU devices
(key/value kernels split on the hidden axis: one key/value head), fills it with random values,
exports once untimed (imports, first-call costs), then, with `os.sync()` untimed before each,
times (the floor first in even rounds, last in odd ones):

  floor      every distinct shard (replica 0) of the backbone's weights written to its own new
             file by 8 threads and fsynced: the bytes an export must make durable, no format
  <case>     the export with a `window_mib` window, into a new directory

"peak over resident" is the rise of the process's peak RSS (VmHWM, reset first) over its RSS
before the export: what the export holds beside the model.
"""

from __future__ import annotations

import os
import shutil
from functools import partial

from benchmarks import bench_model as bm
from benchmarks.harness import files_of
from benchmarks.save_benchmark import save_floor, timed


def build(params: dict):
    import jax
    import keras
    import keras_hub

    from tests import _hf_export

    keras.distribution.set_distribution(_hf_export.model_parallel("gemma"))
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=params["vocabulary"],
        num_layers=params["layers"],
        num_query_heads=params["heads"],
        num_key_value_heads=1,
        hidden_dim=params["hidden"],
        intermediate_dim=params["intermediate"],
        head_dim=params["hidden"] // params["heads"],
        dtype="bfloat16",
    )
    for i, variable in enumerate(backbone.weights):
        variable.assign(jax.random.normal(jax.random.key(i), variable.shape, variable.dtype))
    jax.block_until_ready([v.value for v in backbone.weights])
    return backbone


def export(case: str, backbone, directory: str, window: int) -> None:
    import keras_orbax

    if case == "save_to_preset":
        keras_orbax.save_to_preset(backbone, directory, window_bytes=window)
    elif case == "save_weights":
        os.makedirs(directory)
        path = os.path.join(directory, "model.weights.h5")
        keras_orbax.save_weights(backbone, path, window_bytes=window)
    elif case == "export_to_transformers":
        keras_orbax.export_to_transformers(backbone, directory, window_bytes=window)
    else:
        raise ValueError(case)


def prepare(params: dict, work: str) -> None:
    shutil.rmtree(os.path.join(work, "trees"), ignore_errors=True)


def run_case(case: str, params: dict, work: str) -> dict:
    backbone = build(params)
    window = int(params["window_mib"] * 2**20)
    scratch = os.path.join(work, "trees")
    paths = {n: os.path.join(scratch, n) for n in ("warm", "floor", "case")}
    for path in paths.values():
        shutil.rmtree(path, ignore_errors=True)
    export(case, backbone, paths["warm"], window)
    peak = {}

    def measured() -> None:
        peak["growth"] = bm.peak_growth(partial(export, case, backbone, paths["case"], window))

    writes = {"floor": partial(save_floor, backbone.weights, paths["floor"]), "case": measured}
    order = ["case", "floor"] if params["_round"] % 2 else ["floor", "case"]
    times = {name: timed(writes[name]) for name in order}
    disk = sum(os.path.getsize(p) for p in files_of(paths["case"]))
    floor_bytes = sum(os.path.getsize(p) for p in files_of(paths["floor"]))
    shutil.rmtree(scratch)
    os.sync()
    return {
        "seconds": times["case"][0],
        "cpu_s": times["case"][1],
        "floor_s": times["floor"][0],
        "written_gib": disk / 2**30,
        "floor_gib": floor_bytes / 2**30,
        "peak_mib": None if peak["growth"] is None else peak["growth"] / 2**20,
        "rss_gib": bm.rss_bytes() / 2**30,
    }
