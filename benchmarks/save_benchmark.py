"""Save benchmark: a synchronous keras-orbax save against the durable write floor and other savers.

Run (from the repository root, with the venv's python):

    python benchmarks/save_benchmark.py                      # 8 Dense(4096) + Adam: 1.5 GiB, 3 repeats
    python benchmarks/save_benchmark.py --layers 2 --repeats 1   # smoke test
    python benchmarks/save_benchmark.py --many               # 2500 Dense(64): 5000 small variables

Each case runs `--repeats` times, each time in a fresh process, cases interleaved. A process builds
the state under `ModelParallel` on a (2, 4) mesh of 8 virtual CPU devices (Dense kernels sharded
("batch", "model"); with --many (None, "model"), i.e. over 4 devices; biases replicated), fills it
with random values, saves once untimed (warm-up: imports, thread pools, first-call costs), then,
with `os.sync()` untimed before each, times (the floor first in odd-numbered processes, last in
even ones; every tree is deleted only after both):

  floor      every distinct shard (replica 0) written to its own file by 8 threads and fsync-ed:
             the bytes a save must make durable, with no format at all
  <case>     the saver (below), into an empty directory

and reports both. "x floor" is the median over processes of case / floor measured in the same
process a moment before, so both meet the same disk and the same load from other work.

Cases:
  ko           keras_orbax.save(..., format="fast"): keras-orbax's own shard writer
  ko_orbax     the same files written by Orbax/tensorstore (keras-orbax before it wrote them itself)
  compact      keras_orbax.save(..., format="compact"): zstd + OCDBT through Orbax
  orbax_std    plain orbax.checkpoint.StandardCheckpointer().save of the same arrays
  keras_h5     model.save_weights("*.weights.h5")
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from functools import partial

import bench_model as bm

HERE = os.path.dirname(os.path.abspath(__file__))
CASES = ["ko", "ko_orbax", "compact", "orbax_std", "keras_h5"]
MANY_CASES = ["ko", "ko_orbax", "keras_h5"]
FLOOR_THREADS = 8


def build(layers: int, width: int, many: bool):
    import jax
    import keras

    rules = {r".*kernel": (None, "model") if many else ("batch", "model")}
    keras.distribution.set_distribution(bm.make_distribution(rules=rules))
    if many:
        model = bm.independent_dense(layers, width)
    else:
        model = keras.Sequential(
            [keras.Input((width,))] + [keras.layers.Dense(width) for _ in range(layers)]
        )
    if not many:
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
        model.optimizer.build(model.trainable_variables)
    variables = list(model.variables) + (list(model.optimizer.variables) if not many else [])
    for i, v in enumerate(variables):
        if len(v.shape) == 2:
            v.assign(jax.random.normal(jax.random.key(i), v.shape))
    jax.block_until_ready([v.value for v in variables])  # dispatch is asynchronous
    return model, variables


def save_floor(variables, directory: str) -> None:
    """Each distinct shard's bytes to its own file, written and fsync-ed by 8 threads."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    os.makedirs(directory)
    shards = [s for v in variables for s in v.value.addressable_shards if s.replica_id == 0]

    def write(job):
        i, shard = job
        data = np.ascontiguousarray(np.asarray(shard.data))
        fd = os.open(os.path.join(directory, str(i)), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            view, done = memoryview(data.reshape(-1).view(np.uint8).data), 0
            while done < len(view):
                done += os.write(fd, view[done:])
            os.fsync(fd)
        finally:
            os.close(fd)

    with ThreadPoolExecutor(FLOOR_THREADS) as pool:
        list(pool.map(write, enumerate(shards)))


def save_case(case: str, model, variables, directory: str) -> None:
    import keras_orbax
    from keras_orbax._src.write import step_writer

    if case == "ko":
        keras_orbax.save(model, directory, step=1)
    elif case == "compact":
        keras_orbax.save(model, directory, step=1, format="compact")
    elif case == "ko_orbax":  # the fast format's options, Orbax's own array writer
        import orbax.checkpoint.experimental.v1 as ocp

        context = ocp.Context()
        for option, value in step_writer._FORMATS["fast"].items():
            setattr(context.array.saving, option, value)
        with ocp.training.Checkpointer(directory, context=context) as checkpointer:
            step_writer.write_step(checkpointer, model, step=1)
    elif case == "orbax_std":
        import orbax.checkpoint as ocp0

        checkpointer = ocp0.StandardCheckpointer()
        checkpointer.save(
            os.path.join(directory, "1"), {str(i): v.value for i, v in enumerate(variables)}
        )
        checkpointer.wait_until_finished()
        checkpointer.close()
    elif case == "keras_h5":
        os.makedirs(directory)
        model.save_weights(os.path.join(directory, "model.weights.h5"))
    else:
        raise ValueError(case)


def timed(fn, *args) -> tuple[float, float]:
    os.sync()
    start = bm.clock()
    fn(*args)
    wall, cpu = bm.since(start)
    return wall, cpu


def child(args) -> None:
    bm.set_env()
    model, variables = build(args.layers, args.width, args.many)
    scratch = args.work
    paths = {n: os.path.join(scratch, n) for n in ("warm", "floor", "case")}
    for path in paths.values():
        shutil.rmtree(path, ignore_errors=True)
    save_case(args.case, model, variables, paths["warm"])
    # Every tree stays until both are timed: ext4 without a journal (this machine's) skips inodes
    # deleted in the last minute when it allocates one, so a write right after another's delete
    # pays for it (the floor written twice, deleted between: 3.8 s then 10.6 s). The order
    # alternates between processes, so neither is always the one after the other.
    writes = {
        "floor": partial(save_floor, variables, paths["floor"]),
        "case": partial(save_case, args.case, model, variables, paths["case"]),
    }
    order = ["case", "floor"] if args.floor_last else ["floor", "case"]
    times = {name: timed(writes[name]) for name in order}
    (floor_s, _), (case_s, case_cpu) = times["floor"], times["case"]
    disk = sum(
        os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(paths["case"]) for f in fs
    )
    if not args.keep_trees:
        for path in paths.values():
            shutil.rmtree(path)
    os.sync()
    shard_bytes = sum(
        s.data.nbytes for v in variables for s in v.value.addressable_shards if s.replica_id == 0
    )
    print(
        "RESULT "
        + json.dumps(
            {
                "case": args.case,
                "save_s": case_s,
                "save_cpu_s": case_cpu,
                "floor_s": floor_s,
                "shard_bytes": shard_bytes,
                "disk_bytes": disk,
                "variables": len(variables),
                "floor_first": not args.floor_last,
                "load": os.getloadavg()[0],
            }
        ),
        flush=True,
    )


def parent(args) -> None:
    cases = args.cases or (MANY_CASES if args.many else CASES)
    os.makedirs(args.work, exist_ok=True)
    # 5000 variables' trees are 15,000 inodes each: deleted as each process ends, the next
    # process's writes would skip them (above); they are deleted after the last process instead.
    trees = os.path.join(args.work, "trees")
    results = []
    for repeat in range(args.repeats):
        for case in cases:
            work = os.path.join(trees, f"{repeat}-{case}") if args.many else args.work
            command = [sys.executable, __file__, "--child", "--case", case, "--work", work]
            command += ["--layers", str(args.layers), "--width", str(args.width)]
            command += ["--many"] if args.many else []
            command += ["--floor-last"] if repeat % 2 else []
            command += ["--keep-trees"] if args.many else []
            out = subprocess.run(command, capture_output=True, text=True, check=False)
            lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
            if out.returncode or not lines:
                raise RuntimeError(f"{case} failed:\n{out.stderr[-3000:]}")
            result = json.loads(lines[-1][len("RESULT ") :])
            results.append(result)
            print(
                f"[{repeat + 1}/{args.repeats}] {case:10s} {result['save_s']:7.2f} s, "
                f"floor {result['floor_s']:6.2f} s, load {result['load']:.1f}",
                flush=True,
            )
    shutil.rmtree(trees, ignore_errors=True)
    report(results, cases, args)


def report(results: list[dict], cases: list[str], args) -> None:
    first = results[0]
    print(
        f"\nState: {first['variables']} variables, {first['shard_bytes'] / 2**30:.2f} GiB of "
        f"distinct shards; {args.repeats} processes per case; medians.\n"
    )
    print("| case | save s | floor s (same process) | x floor | save CPU s | on disk GiB |")
    print("|---|---:|---:|---:|---:|---:|")
    for case in cases:
        rows = [r for r in results if r["case"] == case]
        ratio = statistics.median(r["save_s"] / r["floor_s"] for r in rows)
        print(
            f"| {case} | {statistics.median(r['save_s'] for r in rows):.2f} | "
            f"{statistics.median(r['floor_s'] for r in rows):.2f} | {ratio:.2f} | "
            f"{statistics.median(r['save_cpu_s'] for r in rows):.2f} | "
            f"{statistics.median(r['disk_bytes'] for r in rows) / 2**30:.2f} |"
        )
    loads = [r["load"] for r in results]
    print(f"\n1-minute load average during the runs: {min(loads):.1f} to {max(loads):.1f}.")
    with open(os.path.join(args.work, "save_results.json"), "w") as f:
        json.dump(results, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--many", action="store_true", help="2500 Dense(64): 5000 variables")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cases", nargs="*")
    parser.add_argument("--work", default=os.path.join(HERE, "_work", "save"))
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--case")
    parser.add_argument("--floor-last", action="store_true", help="time the case first")
    parser.add_argument("--keep-trees", action="store_true", help="leave the trees written")
    args = parser.parse_args()
    args.layers = args.layers or (2500 if args.many else 8)
    args.width = args.width or (64 if args.many else 4096)
    if args.child:
        child(args)
    else:
        parent(args)


if __name__ == "__main__":
    main()
