"""Restoring with 4 processes x 2 CPU devices on 127.0.0.1, each replicated region read from storage
once (`single_replica_reads=True`, sent to the other processes over gloo) or by every process that
holds it (`False`), in one run (issue 10, item 5).

The parent saves a model of Dense layers (about `--mib` MiB of float32) from one process, then starts
4 processes (tests/_harness.py) that restore it under `DataParallel` (every variable on all 8
devices) and under `ModelParallel` on a (4, 2) mesh with kernels split over "model" only (replicated
over "batch", which spans the processes), each on and off, warm (page cache) and cold (each array
file evicted with `posix_fadvise(DONTNEED)` before the restore). Prints, per case, the bytes each
process read from storage (`RestoreResult.bytes_read`) and their total against the step's size, and
the median wall time between two barriers around `restore_sharded`.

With `--store s3` or `--store gcs` the step lives in a bucket of a local server started for the run
(moto, gcp-storage-emulator: tests/_object_stores.py) and is only measured warm (no page cache there).

Usage: python benchmarks/replica_benchmark.py [--mib 128] [--repeats 3] [--store file|s3|gcs]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

LAYOUTS = ("dp", "replicated")


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
    import jax
    import keras
    from jax.experimental import multihost_utils

    import keras_orbax

    keras.utils.set_random_seed(0)
    directory, mib, repeats = ctx.args["directory"], ctx.args["mib"], ctx.args["repeats"]
    remote = "://" in directory
    results = []
    for layout in LAYOUTS:
        keras.distribution.set_distribution(_distribution(layout))
        # "first" compiles; not reported. Nothing to evict in a bucket.
        for temperature in ("first", "warm") if remote else ("first", "warm", "cold"):
            for share in (True, False) * (1 if temperature == "first" else repeats):
                with keras_orbax.deferred_init():
                    model = _model(mib)
                if temperature == "cold" and ctx.process_id == 0:
                    evict(path for path in Path(directory).rglob("*") if path.is_file())
                multihost_utils.sync_global_devices("before")
                start = time.perf_counter()
                result = keras_orbax.restore_sharded(model, directory, single_replica_reads=share)
                multihost_utils.sync_global_devices("after")
                seconds = time.perf_counter() - start
                results.append(
                    {
                        "layout": layout,
                        "temperature": temperature,
                        "single_replica_reads": share,
                        "seconds": seconds,
                        "bytes_read": result.bytes_read,
                        "bytes_received": result.bytes_received,
                    }
                )
                del model
    write_result({"process": jax.process_index(), "runs": results})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--store", choices=("file", "s3", "gcs"), default="file")
    args = parser.parse_args()
    os.environ["KERAS_BACKEND"] = "jax"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import keras

    import keras_orbax
    from tests._harness import run_workers

    with tempfile.TemporaryDirectory() as tmp:
        store, env = None, {}
        directory: str = str(Path(tmp) / "ckpt")
        if args.store != "file":
            from tests import _object_stores

            store = _object_stores.start(args.store, Path(tmp))
            env = store.env
            os.environ.update(env)
            directory = store.new_bucket() + "/ckpt"
        model = _model(args.mib)
        keras_orbax.save(model, directory, step=1)
        step_bytes = sum(int(v.value.nbytes) for v in model.variables)
        del model
        keras.backend.clear_session()
        workdir = Path(tmp) / "w"
        workdir.mkdir()
        reports = run_workers(
            __file__,
            4,
            2,
            {"directory": directory, "mib": args.mib, "repeats": args.repeats},
            timeout=3600,
            workdir=workdir,
            env=env,
        )
        if store is not None:
            _object_stores.stop(store)
    print(f"storage: {args.store}")
    _print(reports, step_bytes)


def _print(reports: list[dict], step_bytes: int) -> None:
    print(f"step: {step_bytes / 2**20:.1f} MiB; 4 processes x 2 CPU devices on 127.0.0.1")
    print(
        f"{'layout':<11}{'cache':<6}{'single':<8}{'MiB read per process':<30}"
        f"{'total/step':>11}{'median s':>10}"
    )
    cases: dict[tuple, list] = {}
    for report in reports:
        for run in report["runs"]:
            key = (run["layout"], run["temperature"], run["single_replica_reads"])
            cases.setdefault(key, []).append((report["process"], run))
    summary = {}
    for (layout, temperature, share), runs in cases.items():
        if temperature == "first":
            continue
        per_process = {p: run["bytes_read"] for p, run in runs}  # the same on every repeat
        seconds = [run["seconds"] for p, run in runs if p == 0]
        total = sum(per_process.values())
        read = " ".join(f"{per_process[p] / 2**20:6.1f}" for p in sorted(per_process))
        median = statistics.median(seconds)
        print(
            f"{layout:<11}{temperature:<6}{share!s:<8}{read:<30}"
            f"{total / step_bytes:>10.2f}x{median:>10.3f}"
        )
        summary[f"{layout}/{temperature}/{'on' if share else 'off'}"] = {
            "bytes_read_per_process": [per_process[p] for p in sorted(per_process)],
            "total_over_step": total / step_bytes,
            "median_seconds": median,
        }
    print(json.dumps(summary))


if __name__ == "__main__":
    if "KERAS_ORBAX_TEST_COORDINATOR" in os.environ:
        worker()
    else:
        main()
