"""Restoring by copying (the default) against mapping the shard files (`KERAS_ORBAX_MAP_SHARDS=1`):
time and memory of a deferred restore onto the saved layout, each in a fresh process.

    copy_*  every saved shard read with `preadv` into fresh memory of its own
    map_*   every saved shard of 4 MiB or more mapped privately from its file, its pages brought
            in before the restore returns (the page cache's pages become the arrays' memory)

Warm: the files in the page cache (as right after a save); cold: evicted first (a fresh node).
Besides seconds: the growth of peak RSS (VmHWM) over the RSS before the restore, and what the
process holds after it: anonymous memory of its own (RssAnon) and file pages it maps (RssFile).
"""

from __future__ import annotations

import json
import os

from benchmarks import bench_model as bm


def _spec(params: dict) -> bm.ModelSpec:
    return bm.ModelSpec(params_gib=params["params_mib"] / 1024, layers=params["layers"])


def prepare(params: dict, work: str) -> None:
    import keras
    import numpy as np

    import keras_orbax

    keras.distribution.set_distribution(bm.make_distribution())
    model = bm.build_model(_spec(params), build_optimizer=False)
    rng = np.random.default_rng(0)
    for weight in model.weights:
        weight.assign(rng.standard_normal(weight.shape).astype("float32"))
    keras_orbax.save(model, work, step=1, overwrite=True)
    with open(os.path.join(work, "sums.json"), "w") as f:
        json.dump(bm.checksums((v.path, v.value) for v in model.weights), f)


def run_case(case: str, params: dict, work: str) -> dict:
    os.environ["KERAS_ORBAX_MAP_SHARDS"] = "1" if case.startswith("map") else "0"
    import keras

    import keras_orbax

    keras.distribution.set_distribution(bm.make_distribution())
    optimizer = keras.optimizers.Adam(1e-3)  # its counters come from numbers: made outside
    with keras_orbax.deferred_init():
        model = bm.build_model(_spec(params), optimizer=optimizer, build_optimizer=False)
    before, clock = bm.rss_bytes(), bm.clock()
    result = keras_orbax.restore_sharded(model, work)
    seconds, cpu = bm.since(clock)
    peak = bm.peak_rss_bytes()
    held = {f"{k}_mib": bm.read_status_kib(k) / 1024 for k in ("RssAnon", "RssFile")}
    with open(os.path.join(work, "sums.json")) as f:
        want = json.load(f)
    wrong = bm.compare_checksums(bm.checksums((v.path, v.value) for v in model.weights), want)
    if wrong:
        raise SystemExit(f"restored values differ from the saved ones: {wrong}")
    growth = (peak - before) / 2**20
    return {
        "seconds": seconds,
        "cpu_s": cpu,
        "peak_growth_mib": growth,
        **held,
        "bytes_read": result.bytes_read,
    }
