"""Restore from a cold page cache, as a job starting on a fresh node meets it, against reading the same
files cold: each case evicts the checkpoint's files first (`posix_fadvise(DONTNEED)`, no root needed)
and runs in a fresh process.

    ko_cold     `deferred_init` + `restore_sharded` of the benchmark model with Adam
    read_cold   every file of the step read once with 8 threads (the floor)
    touch       as many bytes of fresh memory as the step's files, every page touched once: what a
                restore also pays, since it must end with every byte in memory, and the floor's
                reads into buffers it frees at once do not (on this virtual machine it moves with
                what ran before: 0.3-1 s per GiB)

Usage: python benchmarks/cold_benchmark.py [--params-gib 0.5] [--repeats 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_model as bm  # noqa: E402


def files_of(directory: str) -> list[str]:
    return [os.path.join(root, name) for root, _, names in os.walk(directory) for name in names]


def evict(directory: str) -> None:
    """Every file under `directory`, written back and dropped from the page cache."""
    if bm.REPO_ROOT not in sys.path:
        sys.path.insert(0, bm.REPO_ROOT)
    from tests._page_cache import evict as evict_files

    evict_files(files_of(directory))


def read_all(directory: str, threads: int = 8) -> int:
    def read(path: str) -> int:
        with open(path, "rb", buffering=0) as f:
            return len(f.read())

    with ThreadPoolExecutor(threads) as pool:
        return sum(pool.map(read, files_of(directory)))


def touch_fresh(nbytes: int) -> None:
    """Maps `nbytes` of fresh anonymous memory and writes one byte of each page."""
    import mmap

    import numpy as np

    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    np.frombuffer(memory, np.uint8)[:: mmap.PAGESIZE] = 1


def child(case: str, spec: bm.ModelSpec, work: str) -> dict:
    if case == "read_cold":
        clock = bm.clock()
        nbytes = read_all(work)
        return {"seconds": bm.since(clock)[0], "bytes": nbytes}
    if case == "touch":
        nbytes = sum(os.path.getsize(path) for path in files_of(work))
        clock = bm.clock()
        touch_fresh(nbytes)
        return {"seconds": bm.since(clock)[0], "bytes": nbytes}
    import keras

    import keras_orbax

    keras.distribution.set_distribution(bm.make_distribution())
    optimizer = keras.optimizers.Adam(1e-3)
    with keras_orbax.deferred_init():
        model = bm.build_model(spec, optimizer=optimizer, build_optimizer=False)
    clock = bm.clock()
    result = keras_orbax.restore_sharded(model, work)
    return {"seconds": bm.since(clock)[0], "bytes": result.bytes_read}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params-gib", type=float, default=0.5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--work", default=os.path.join(HERE, "_work", "cold"))
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    parser.add_argument("--child", default=None)
    args = parser.parse_args()
    bm.set_env()
    spec = bm.ModelSpec(params_gib=args.params_gib)
    if args.child:
        print(json.dumps(child(args.child, spec, args.work)))
        return
    if not os.path.isdir(args.work):
        import keras

        import keras_orbax

        keras.distribution.set_distribution(bm.make_distribution())
        keras_orbax.save(bm.build_model(spec), args.work, step=1)
    results: dict[str, list[float]] = {"read_cold": [], "ko_cold": [], "touch": []}

    def run(case: str) -> None:
        os.sync()
        evict(args.work)
        command = [sys.executable, __file__, "--child", case, "--work", args.work]
        command += ["--params-gib", str(args.params_gib)]
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        results[case].append(json.loads(done.stdout.strip().splitlines()[-1])["seconds"])

    # The restore and the floor alternate, each run right after the other. `touch` runs apart,
    # afterwards: whatever runs next after a process that freed as much fresh memory as the
    # model is slower on this virtual machine (seven rounds each way: the cold read 1.60 s after
    # `touch`, 1.43 s after the restore; the restore 1.97 s after `touch`, 1.57 s after the read).
    for _ in range(args.repeats):
        run("read_cold")
        run("ko_cold")
    for _ in range(args.repeats):
        run("touch")
    median = {case: statistics.median(seconds) for case, seconds in results.items()}
    floor, touch, ours = median["read_cold"], median["touch"], median["ko_cold"]
    print(
        f"cold restore {ours:.2f} s, cold read of the same files {floor:.2f} s: {ours / floor:.2f} x; "
        f"first touch of as much fresh memory {touch:.2f} s (restore / (read + touch): "
        f"{ours / (floor + touch):.2f} x)"
    )
    print(json.dumps(results))
    if args.json:
        summary = {"params_gib": args.params_gib, "repeats": args.repeats, "seconds": results}
        summary.update(median_s=median, ratio=ours / floor)
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
