"""Restore of many small variables: keras-orbax against reading the step's files and Keras's h5 load.

    python benchmarks/many_restore_benchmark.py                 # 2500 Dense(64): 5000 variables, 3 repeats
    python benchmarks/many_restore_benchmark.py --layers 250 --repeats 1   # smoke test
    python benchmarks/many_restore_benchmark.py --json /tmp/many.json

The state is save_benchmark.py's `--many` case: `--layers` independent Dense(`--width`) layers, no
optimizer (two variables per layer: 5000 by default), kernels split (None, "model") over a (2, 4) mesh
of 8 virtual CPU devices, biases replicated. One process saves it with `keras_orbax.save` and
`model.save_weights("model.weights.h5")`; the parent reads every file once (page cache warm), then
runs each case in a fresh process, `--repeats` times, cases interleaved:

  ko        `with keras_orbax.deferred_init(): build`, then `keras_orbax.restore_sharded` (timed)
  read      every file of the keras-orbax step read into fresh buffers by 8 threads (the floor)
  keras_h5  build (variables initialized), then `model.load_weights("model.weights.h5")` (timed)

Only the call is timed, not the build. Restored values are checked against the saved sums. The
medians and the ratios ko / read (target <= 1.2) and ko / keras_h5 (target < 1) go to stdout and
to --json (default benchmarks/_work/many_restore/results.json).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_model as bm  # noqa: E402

CASES = ("ko", "read", "keras_h5")
READ_THREADS = 8


def set_distribution() -> None:
    import keras

    keras.distribution.set_distribution(bm.make_distribution(rules={r".*kernel": (None, "model")}))


def files_of(directory: str) -> list[str]:
    return sorted(os.path.join(d, n) for d, _, names in os.walk(directory) for n in names)


def read_all(directory: str) -> int:
    import numpy as np

    def read(path: str) -> int:
        buf = np.empty(os.path.getsize(path), np.uint8)
        with open(path, "rb", buffering=0) as f:
            return f.readinto(memoryview(buf))

    with ThreadPoolExecutor(READ_THREADS) as pool:
        return sum(pool.map(read, files_of(directory)))


def sums(model) -> list[float]:
    import jax
    import numpy as np

    return [float(np.sum(jax.device_get(v.value), dtype=np.float64)) for v in model.variables]


def save(args) -> dict:
    import jax

    import keras_orbax

    set_distribution()
    model = bm.independent_dense(args.layers, args.width)
    for i, v in enumerate(model.variables):
        v.assign(jax.random.normal(jax.random.key(i), v.shape))
    keras_orbax.save(model, os.path.join(args.work, "ko"), step=1)
    model.save_weights(os.path.join(args.work, "model.weights.h5"))
    return {"sums": sums(model), "variables": len(model.variables)}


def run_case(case: str, args) -> dict:
    step = os.path.join(args.work, "ko", "1")
    if case == "read":
        start = bm.clock()
        nbytes = read_all(step)
        wall, cpu = bm.since(start)
        return {"seconds": wall, "cpu_s": cpu, "bytes": nbytes, "files": len(files_of(step))}
    import keras_orbax

    set_distribution()
    if case == "ko":
        with keras_orbax.deferred_init():
            model = bm.independent_dense(args.layers, args.width)
        start = bm.clock()
        keras_orbax.restore_sharded(model, os.path.join(args.work, "ko"))
    else:
        model = bm.independent_dense(args.layers, args.width)
        start = bm.clock()
        model.load_weights(os.path.join(args.work, "model.weights.h5"))
    wall, cpu = bm.since(start)
    with open(os.path.join(args.work, "meta.json")) as f:
        want = json.load(f)["sums"]
    ok = all(abs(a - b) <= 1e-9 * max(1.0, abs(b)) for a, b in zip(sums(model), want, strict=True))
    return {"seconds": wall, "cpu_s": cpu, "ok": ok}


def child(args, mode: str) -> dict:
    command = [sys.executable, __file__, "--child", mode, "--work", args.work]
    command += ["--layers", str(args.layers), "--width", str(args.width)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    if done.returncode or not lines:
        raise RuntimeError(f"{mode} failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def parent(args) -> dict:
    shutil.rmtree(args.work, ignore_errors=True)
    os.makedirs(args.work)
    meta = child(args, "save")
    with open(os.path.join(args.work, "meta.json"), "w") as f:
        json.dump(meta, f)
    read_all(args.work)  # page cache warm for every case
    runs: dict[str, list[dict]] = {case: [] for case in CASES}
    for repeat in range(args.repeats):
        for case in CASES:
            result = dict(child(args, case), load=os.getloadavg()[0])
            runs[case].append(result)
            print(f"[{repeat + 1}/{args.repeats}] {case:9s} {result['seconds']:7.3f} s", flush=True)
    median = {case: statistics.median(r["seconds"] for r in rs) for case, rs in runs.items()}
    return {
        "variables": meta["variables"],
        "layers": args.layers,
        "width": args.width,
        "repeats": args.repeats,
        "files": runs["read"][0]["files"],
        "bytes": runs["read"][0]["bytes"],
        "median_s": median,
        "ko_x_read": median["ko"] / median["read"],
        "ko_x_keras_h5": median["ko"] / median["keras_h5"],
        "ok": all(r.get("ok", True) for rs in runs.values() for r in rs),
        "runs": runs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=2500, help="Dense layers (2 variables each)")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--work", default=os.path.join(HERE, "_work", "many_restore"))
    parser.add_argument("--json", default=None, help="default: <work>/results.json")
    parser.add_argument("--child", choices=("save", *CASES), help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.work = os.path.abspath(args.work)
    bm.set_env()
    if args.child:
        result = save(args) if args.child == "save" else run_case(args.child, args)
        print("RESULT " + json.dumps(result), flush=True)
        return
    results = parent(args)
    m = results["median_s"]
    print(
        f"{results['variables']} variables, {results['files']} files, {results['bytes'] / 2**20:.1f} "
        f"MiB: restore {m['ko']:.2f} s, read {m['read']:.2f} s ({results['ko_x_read']:.2f} x), "
        f"keras h5 {m['keras_h5']:.2f} s ({results['ko_x_keras_h5']:.2f} x); ok={results['ok']}"
    )
    path = args.json or os.path.join(args.work, "results.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
