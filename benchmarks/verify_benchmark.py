"""Restore time with the checksums checked (the default) against `verify=False`, in one process,
alternating, warm page cache (issue 36: every restore checks what it reads).

Cases, each a step saved once and restored again and again into the same model:
- `same`: a (rows, cols) float32 embedding (256 MiB by default) saved split on its first axis over 8
  devices, restored onto the same layout: each region is one shard file, checked by the thread that
  reads it, over the bytes just read.
- `reshard`: the same step restored split on the last axis: each region cuts every saved shard file,
  so the files are read back and checked before the regions are read.
- `mlp`: a stack of `--layers` Dense(`--width`) layers with Adam's state (many small files, each read
  whole and checked).
- `save` (not by default): the `same` embedding saved (durable: each file fsync-ed) recording a
  CRC-32C beside the CRC-32 (with google-crc32c installed), against the CRC-32 alone: what recording
  both costs. Its columns are "both" and "CRC-32 only".

Prints per case the median seconds with checks and without, and their ratio, wall and process CPU
(on a shared machine the CPU time is the steadier figure).

Usage: python benchmarks/verify_benchmark.py [--rows 65536] [--cols 1024] [--layers 24]
    [--width 256] [--repeats 7] [--cases same,reshard,mlp,save] [--directory /tmp/vb] [--cold]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_model as bm  # noqa: E402
import cold_benchmark  # noqa: E402


def _embedding(rows: int, cols: int, axes: tuple):
    import keras

    mesh = keras.distribution.DeviceMesh((8,), ("model",))
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*embeddings"] = axes
    keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map))
    tokens = keras.Input((4,), dtype="int32")
    return keras.Model(tokens, keras.layers.Embedding(rows, cols, name="embed")(tokens))


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


def _time(model, directory: str, verify: bool, cold: bool = False) -> tuple[float, float]:
    """(wall, process CPU) seconds of one restore; `cold`: its files evicted from the page cache
    first, as on a fresh node."""
    import keras_orbax

    if cold:
        cold_benchmark.evict(directory)

    start, cpu = time.perf_counter(), time.process_time()
    keras_orbax.restore_sharded(model, directory, verify=None if verify else False)
    return time.perf_counter() - start, time.process_time() - cpu


def _saves(name: str, args: argparse.Namespace, root: str) -> list[float]:
    """Medians of (wall, CPU) of saves recording both CRCs, then of saves recording the CRC-32."""
    import numpy as np

    import keras_orbax
    from keras_orbax._src.format import crc

    model = _embedding(args.rows, args.cols, ("model", None))
    model.weights[0].assign(np.random.default_rng(0).random(model.weights[0].shape).astype("f4"))
    both, runs = crc.RECORDED, {}
    for n in range(-1, args.repeats):  # the first pair warms up
        for recorded in (both, (crc.CRC32,)):
            crc.RECORDED = recorded  # what shard_files records; a benchmark's switch only
            directory = os.path.join(root, f"save_{n}_{len(recorded)}")
            start, cpu = time.perf_counter(), time.process_time()
            keras_orbax.save(model, directory, step=1, incremental=False)
            if n >= 0:
                runs.setdefault(len(recorded), []).append(
                    (time.perf_counter() - start, time.process_time() - cpu)
                )
    crc.RECORDED = both
    return [statistics.median(t[i] for t in runs[k]) for k in (len(both), 1) for i in (0, 1)]


def _case(name: str, args: argparse.Namespace, root: str) -> list[float]:
    import numpy as np

    import keras_orbax

    directory = os.path.join(root, name)
    if name == "mlp":
        model = _mlp(args.layers, args.width)
    else:
        model = _embedding(args.rows, args.cols, ("model", None))
    for v in model.weights:
        v.assign(np.random.default_rng(0).random(v.shape).astype("float32"))
    keras_orbax.save(model, directory, step=1)
    if name == "reshard":
        model = _embedding(args.rows, args.cols, (None, "model"))
    on, off = [], []
    _time(model, directory, True)  # warm: page cache, compiled placements
    for _ in range(args.repeats):
        off.append(_time(model, directory, False, args.cold))
        on.append(_time(model, directory, True, args.cold))
    return [statistics.median(t[i] for t in runs) for runs in (on, off) for i in (0, 1)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=65536)
    parser.add_argument("--cols", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--cases", default="same,reshard,mlp")
    parser.add_argument("--directory", default=None)
    parser.add_argument("--cold", action="store_true", help="evict the files before each restore")
    args = parser.parse_args()
    bm.set_env()
    root = args.directory or tempfile.mkdtemp(prefix="verify_benchmark_")
    print(
        "| case | checked s | verify=False s | ratio | checked CPU s | verify=False CPU s | ratio |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in args.cases.split(","):
        on, on_cpu, off, off_cpu = (_saves if name == "save" else _case)(name, args, root)
        print(
            f"| {name} | {on:.3f} | {off:.3f} | {on / off:.2f} x | {on_cpu:.3f} | {off_cpu:.3f} "
            f"| {on_cpu / off_cpu:.2f} x |",
            flush=True,
        )


if __name__ == "__main__":
    main()
