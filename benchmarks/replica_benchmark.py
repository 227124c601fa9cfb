"""Restoring with 4 processes x 2 CPU devices on 127.0.0.1, each replicated region read from storage
once (`single_replica_reads=True`, sent to the other processes over gloo) against every process
reading what it holds (`False`, the floor, measured by the same processes a moment apart).

A case is a layout and a page cache: `dp_*` restores under `DataParallel` (every variable on all 8
devices), `replicated_*` under `ModelParallel` on a (4, 2) mesh with kernels split over "model"
only (replicated over "batch", which spans the processes); `*_cold` evicts each array file
(`posix_fadvise(DONTNEED)`) before every restore. Each case process saves a model of Dense layers
(about `mib` MiB of float32) once, then starts the 4 processes (tests/_harness.py), which restore
once untimed with each setting, then `pairs` times both, alternating; the time is the median wall
time between two barriers around `restore_sharded` on process 0. Also reported: the bytes the
processes read from storage (`RestoreResult.bytes_read`) over the step's size, both settings.

With `--set store=s3` or `gcs` the step lives in a bucket of a local server started by the case
(moto, gcp-storage-emulator: tests/_object_stores.py); only the warm cases mean anything there
(`--set only=dp_warm,replicated_warm`).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

if __name__ == "__main__":  # a worker, started as a script by tests/_harness.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _model(mib: int):
    import keras

    width = 2048
    layers = max(1, mib * 2**20 // (width * width * 4))
    inputs = keras.Input((width,))
    x = inputs
    for i in range(layers):
        x = keras.layers.Dense(width, name=f"dense_{i}")(x)
    return keras.Model(inputs, x)


def _distribution(layout: str):
    import jax
    import keras

    if layout == "dp":
        return keras.distribution.DataParallel(devices=jax.devices())
    mesh = keras.distribution.DeviceMesh((4, 2), ("batch", "model"), jax.devices())
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*kernel"] = (None, "model")
    return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")


def worker() -> None:
    from tests._page_cache import evict
    from tests._worker_util import init_worker, write_result

    ctx = init_worker()
    import keras
    from jax.experimental import multihost_utils

    import keras_orbax

    keras.utils.set_random_seed(0)
    directory, args = ctx.args["directory"], ctx.args
    keras.distribution.set_distribution(_distribution(args["layout"]))
    runs: dict[str, list] = {"on": [], "off": []}
    for i in range(args["pairs"] + 1):  # the first pair compiles: not reported
        for share in (True, False) if i % 2 else (False, True):
            with keras_orbax.deferred_init():
                model = _model(args["mib"])
            if args["cold"] and ctx.process_id == 0:
                evict(path for path in Path(directory).rglob("*") if path.is_file())
            multihost_utils.sync_global_devices("before")
            start = time.perf_counter()
            result = keras_orbax.restore_sharded(model, directory, single_replica_reads=share)
            multihost_utils.sync_global_devices("after")
            if i:
                runs["on" if share else "off"].append(
                    [time.perf_counter() - start, result.bytes_read]
                )
            del model
    write_result(runs)


@contextlib.contextmanager
def _step(params: dict, work: str):
    """Where the step is (`store`), saved from this process; the server's env beside it."""
    import keras_orbax

    store = None
    directory = os.path.join(work, "ckpt")
    if params["store"] != "file":
        from tests import _object_stores

        store = _object_stores.start(params["store"], Path(work))
        os.environ.update(store.env)
        directory = store.new_bucket() + "/ckpt"
    model = _model(params["mib"])
    keras_orbax.save(model, directory, step=1, overwrite=True)
    try:
        yield (
            directory,
            sum(int(v.value.nbytes) for v in model.variables),
            store.env if store else {},
        )
    finally:
        if store is not None:
            _object_stores.stop(store)


def run_case(case: str, params: dict, work: str) -> dict:
    from tests._harness import run_workers

    layout, temperature = case.rsplit("_", 1)
    with _step(params, work) as (directory, step_bytes, env):
        args = dict(params, directory=directory, layout=layout, cold=temperature == "cold")
        workdir = os.path.join(work, f"w_{case}_{params['_round']}")
        os.makedirs(workdir, exist_ok=True)
        reports = run_workers(__file__, 4, 2, args, timeout=3600, workdir=workdir, env=env)
    out = {"step_mib": step_bytes / 2**20}
    for share, key in (("on", "seconds"), ("off", "floor_s")):
        out[key] = statistics.median(s for s, _ in reports[0][share])
        per_process = [r[share][-1][1] for r in reports]
        out[f"read_x_step_{share}"] = sum(per_process) / step_bytes
        out[f"read_max_mib_{share}"] = max(per_process) / 2**20
    return out


if __name__ == "__main__":
    worker()
