"""Restoring onto a layout that cuts the saved shards differently, against the same bytes onto the saved
layout, in one run (issue: any layout at the same-layout speed).

A (rows, cols) float32 embedding is saved split on its last axis over 8 devices, then restored, each
case in a fresh process, deferred: `same` split on the last axis again, `rows` split on the first
axis (every device needs a slice of every saved shard: short runs in each file). Prints median
seconds and the ratio.

Usage: python benchmarks/reshard_benchmark.py [--rows 65536] [--cols 1024] [--repeats 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_model as bm  # noqa: E402


def _model(rows: int, cols: int):
    import keras

    tokens = keras.Input((4,), dtype="int32")
    return keras.Model(tokens, keras.layers.Embedding(rows, cols, name="embed")(tokens))


def _distribution(axes: tuple):
    return bm.make_distribution(mesh_shape=(8,), axes=("model",), rules={"embed/embeddings": axes})


def child(mode: str, args: argparse.Namespace) -> dict:
    import keras
    import numpy as np

    import keras_orbax

    if mode == "save":
        keras.distribution.set_distribution(_distribution((None, "model")))
        model = _model(args.rows, args.cols)
        model.layers[1].embeddings.assign(
            np.random.default_rng(0).standard_normal((args.rows, args.cols), dtype="float32")
        )
        keras_orbax.save(model, args.work, step=1, overwrite=True)
        return {}
    axes = (None, "model") if mode == "same" else ("model", None)
    keras.distribution.set_distribution(_distribution(axes))
    with keras_orbax.deferred_init():
        model = _model(args.rows, args.cols)
    clock = bm.clock()
    result = keras_orbax.restore_sharded(model, args.work)
    seconds = bm.since(clock)[0]
    return {"seconds": seconds, "bytes_read": result.bytes_read}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=65536)
    parser.add_argument("--cols", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--work", default=os.path.join(HERE, "_work", "reshard"))
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    parser.add_argument("--child", default=None)
    args = parser.parse_args()
    bm.set_env()
    if args.child:
        print(json.dumps(child(args.child, args)))
        return

    def run(mode: str) -> dict:
        command = [sys.executable, __file__, "--child", mode, "--work", args.work]
        command += ["--rows", str(args.rows), "--cols", str(args.cols)]
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        return json.loads(done.stdout.strip().splitlines()[-1])

    run("save")
    figures = {
        mode: [run(mode)["seconds"] for _ in range(args.repeats)] for mode in ("same", "rows")
    }
    same, rows = (statistics.median(figures[m]) for m in ("same", "rows"))
    print(f"same layout {same:.3f} s, another layout {rows:.3f} s: {rows / same:.2f} x")
    print(json.dumps(figures))
    if args.json:
        summary = {"rows": args.rows, "cols": args.cols, "repeats": args.repeats}
        summary.update(seconds=figures, median_s={"same": same, "rows": rows}, ratio=rows / same)
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
