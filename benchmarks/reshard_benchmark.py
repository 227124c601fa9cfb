"""Restoring onto a layout that cuts the saved shards differently, against the same bytes onto the saved
layout, in one run (issue: any layout at the same-layout speed).

A (rows, cols) float32 embedding is saved under one layout, then restored deferred, each restore in a
fresh process, onto the saved layout (`same`) and onto another (`other`):
- `cols`: saved split on the last axis over 8 devices; `other` splits the first axis (each device needs
  whole rows of every saved shard, placed as short runs).
- `rows`: saved split on the first axis; `other` splits the last axis (each device needs a short run of
  every row of every saved shard).
- `2d`: saved split ("batch", "model") on a (2, 4) mesh; `other` splits ("model", "batch") (whole
  stored rows, as `cols`).
- `2d_rows`: the reverse, saved ("model", "batch"), `other` ("batch", "model"): cuts the stored rows.
- `h5`: a `.weights.h5` (one contiguous dataset); `same` splits the first axis (each region one
  contiguous run), `other` the last.
`same` opts in to mapping (`KERAS_ORBAX_MAP_SHARDS=1`: on the saved layout shards of 4 MiB and more
are mapped from their files instead of copied); a third restore, `copied`, is `same` as it runs by
default, each saved shard read into fresh memory, as any region of another layout is. So
`other / copied` compares the same work, and what a user sees by default, and `other / same` the
opt-in. (h5 files are never mapped: no `copied` there.)
Prints, per case, median seconds of each restore (wall and process CPU: on a shared machine the CPU
time is the steadier figure), the ratio, and the peak growth of resident memory
during the restore (VmHWM after minus VmRSS before, default allocator) against the array's bytes.

Usage: python benchmarks/reshard_benchmark.py [--rows 65536] [--cols 1024] [--repeats 3]
    [--cases cols,rows,2d,2d_rows,h5] [--json PATH]
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

# case -> (mesh shape, mesh axes, saved layout, other layout)
CASES = {
    "cols": ((8,), ("model",), (None, "model"), ("model", None)),
    "rows": ((8,), ("model",), ("model", None), (None, "model")),
    "2d": ((2, 4), ("batch", "model"), ("batch", "model"), ("model", "batch")),
    "2d_rows": ((2, 4), ("batch", "model"), ("model", "batch"), ("batch", "model")),
    "h5": ((8,), ("model",), ("model", None), (None, "model")),
}


def _model(rows: int, cols: int):
    import keras

    tokens = keras.Input((4,), dtype="int32")
    return keras.Model(tokens, keras.layers.Embedding(rows, cols, name="embed")(tokens))


def _distribution(case: str, axes: tuple):
    mesh_shape, mesh_axes = CASES[case][:2]
    return bm.make_distribution(
        mesh_shape=mesh_shape, axes=mesh_axes, rules={"embed/embeddings": axes}
    )


def child(mode: str, args: argparse.Namespace) -> dict:
    import keras
    import numpy as np

    import keras_orbax

    case, what = mode.split(":")
    saved, other = CASES[case][2:]
    work = os.path.join(args.work, case)
    if case == "h5":
        work = os.path.join(work, "embed.weights.h5")
    if what == "save":
        keras.distribution.set_distribution(_distribution(case, saved))
        model = _model(args.rows, args.cols)
        model.layers[1].embeddings.assign(
            np.random.default_rng(0).standard_normal((args.rows, args.cols), dtype="float32")
        )
        if case == "h5":
            os.makedirs(os.path.dirname(work), exist_ok=True)
            model.save_weights(work)
        else:
            keras_orbax.save(model, work, step=1, overwrite=True)
        return {}
    # Read at each restore (docs/format.md): `same` maps, `copied` and `other` copy, the default.
    os.environ["KERAS_ORBAX_MAP_SHARDS"] = "1" if what == "same" else "0"
    keras.distribution.set_distribution(_distribution(case, other if what == "other" else saved))
    with keras_orbax.deferred_init():
        model = _model(args.rows, args.cols)
    before = bm.rss_bytes()
    clock = bm.clock()
    result = keras_orbax.restore_sharded(model, work)
    seconds, cpu = bm.since(clock)
    growth = bm.peak_rss_bytes() - before
    return {"seconds": seconds, "cpu": cpu, "bytes_read": result.bytes_read, "peak_growth": growth}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=65536)
    parser.add_argument("--cols", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cases", default=",".join(CASES))
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

    nbytes = args.rows * args.cols * 4
    figures, medians = {}, {}
    for case in args.cases.split(","):
        run(f"{case}:save")
        # Alternate the two restores, so that a slow minute of a shared machine hits both.
        whats = ("same", "other") if case == "h5" else ("same", "other", "copied")
        runs: dict[str, list[dict]] = {what: [] for what in whats}
        for _ in range(args.repeats):
            for what in runs:
                runs[what].append(run(f"{case}:{what}"))
        seconds = {w: statistics.median(r["seconds"] for r in runs[w]) for w in runs}
        cpu = {w: statistics.median(r["cpu"] for r in runs[w]) for w in runs}
        peaks = {w: max(r["peak_growth"] for r in runs[w]) / nbytes for w in runs}
        same, other = seconds["same"], seconds["other"]
        copied = seconds.get("copied", same)
        print(
            f"{case}: same layout {same:.3f} s mapped (read, the default: {copied:.3f} s), other layout "
            f"{other:.3f} s: {other / same:.2f} x, {other / copied:.2f} x the read "
            f"(CPU {cpu['same']:.3f} s / {cpu['other']:.3f} s); "
            f"peak growth {peaks['same']:.2f} x / {peaks['other']:.2f} x the array"
        )
        figures[case] = {
            w: {k: [round(r[k], 3) for r in runs[w]] for k in ("seconds", "cpu")} for w in runs
        }
        medians[case] = dict(seconds)  # "copied" only where it ran
        medians[case].update({f"cpu_{w}": cpu[w] for w in runs})
        medians[case].update({f"peak_{w}": peaks[w] for w in runs})
    print(json.dumps(figures))
    if args.json:
        summary = {"rows": args.rows, "cols": args.cols, "repeats": args.repeats}
        summary.update(seconds=figures, median_s=medians)
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
