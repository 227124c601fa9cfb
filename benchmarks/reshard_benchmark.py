"""Restoring onto a layout that cuts the saved shards differently, against the same bytes onto the
saved layout (issue: any layout at the same-layout speed).

A (rows, cols) float32 embedding is saved under one layout (`layout`), then restored deferred in
fresh processes onto the saved layout and onto another:
- `cols`: saved split on the last axis over 8 devices; `other` splits the first axis (each device
  needs whole rows of every saved shard, placed as short runs).
- `rows`: saved split on the first axis; `other` splits the last axis (each device needs a short
  run of every row of every saved shard).
- `2d`: saved split ("batch", "model") on a (2, 4) mesh; `other` splits ("model", "batch").
- `2d_rows`: the reverse, saved ("model", "batch"), `other` ("batch", "model").
- `h5`: a `.weights.h5` (one contiguous dataset); `same` splits the first axis, `other` the last.
`same` opts in to mapping (`KERAS_ORBAX_MAP_SHARDS=1`: shards of 4 MiB and more mapped from their
files); `copied` (the floor) is `same` as it runs by default, each shard read into fresh memory, as
any region of another layout is. h5 files are never mapped: `copied` there is `same`.
"""

from __future__ import annotations

import os

from benchmarks import bench_model as bm

# layout -> (mesh shape, mesh axes, saved layout, other layout)
LAYOUTS = {
    "cols": ((8,), ("model",), (None, "model"), ("model", None)),
    "rows": ((8,), ("model",), ("model", None), (None, "model")),
    "2d": ((2, 4), ("batch", "model"), ("batch", "model"), ("model", "batch")),
    "2d_rows": ((2, 4), ("batch", "model"), ("model", "batch"), ("batch", "model")),
    "h5": ((8,), ("model",), ("model", None), (None, "model")),
}


def _model(params: dict, axes: tuple):
    return bm.embedding(params["rows"], params["cols"], axes, *LAYOUTS[params["layout"]][:2])


def _path(params: dict, work: str) -> str:
    return os.path.join(work, "embed.weights.h5") if params["layout"] == "h5" else work


def prepare(params: dict, work: str) -> None:
    import numpy as np

    import keras_orbax

    model = _model(params, LAYOUTS[params["layout"]][2])
    values = np.random.default_rng(0).standard_normal(model.layers[1].embeddings.shape, "float32")
    model.layers[1].embeddings.assign(values)
    if params["layout"] == "h5":
        model.save_weights(_path(params, work))
    else:
        keras_orbax.save(model, work, step=1, overwrite=True)


def run_case(case: str, params: dict, work: str) -> dict:
    import keras_orbax

    os.environ["KERAS_ORBAX_MAP_SHARDS"] = "1" if case == "same" else "0"
    saved, other = LAYOUTS[params["layout"]][2:]
    with keras_orbax.deferred_init():
        model = _model(params, other if case == "other" else saved)
    before, clock = bm.rss_bytes(), bm.clock()
    result = keras_orbax.restore_sharded(model, _path(params, work))
    seconds, cpu = bm.since(clock)
    growth = (bm.peak_rss_bytes() - before) / (params["rows"] * params["cols"] * 4)
    return {"seconds": seconds, "cpu_s": cpu, "bytes_read": result.bytes_read, "peak_x": growth}
