"""Restoring by copying (the default) against mapping the shard files (`KERAS_ORBAX_MAP_SHARDS=1`):
time and memory of a deferred restore onto the saved layout, each in a fresh process.

    copy   every saved shard read with `preadv` into fresh memory of its own
    map    every saved shard of 4 MiB or more mapped privately from its file, its pages brought in
           before the restore returns (the page cache's pages become the arrays' memory)

Each runs warm (the files in the page cache, as right after a save or a previous restore) and cold
(the files evicted first with `posix_fadvise(DONTNEED)`, as on a fresh node), alternating copy and
map. Reported per case, medians: restore seconds (wall and CPU), the growth of peak RSS (VmHWM) over
the process's RSS before the restore, and what the process holds after it: anonymous memory of its
own (RssAnon) and file pages it maps (RssFile, which the page cache shares).

The model is bench_model's, without an optimizer: an Embedding and `--layers` Dense layers of one
width, about `--params-mib` MiB of float32 under ModelParallel on 8 CPU devices; each kernel and
the embedding are split 8 ways into shards of 4 MiB and more, so every large shard can be mapped.

Usage: python benchmarks/mapped_benchmark.py [--params-mib 384] [--layers 3] [--repeats 5]
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
import cold_benchmark  # noqa: E402

MODES = {"copy": "0", "map": "1"}


def child(spec: bm.ModelSpec, work: str) -> dict:
    import keras

    import keras_orbax

    keras.distribution.set_distribution(bm.make_distribution())
    optimizer = keras.optimizers.Adam(1e-3)  # its counters come from numbers: made outside
    with keras_orbax.deferred_init():
        model = bm.build_model(spec, optimizer=optimizer, build_optimizer=False)
    before = bm.rss_bytes()
    clock = bm.clock()
    result = keras_orbax.restore_sharded(model, work)
    seconds, cpu = bm.since(clock)
    peak = bm.peak_rss_bytes()
    held = {field: bm.read_status_kib(field) * 1024 for field in ("RssAnon", "RssFile")}
    with open(os.path.join(work, "sums.json")) as f:
        wrong = bm.compare_checksums(
            bm.checksums((v.path, v.value) for v in model.weights), json.load(f)
        )
    if wrong:
        raise SystemExit(f"restored values differ from the saved ones: {wrong}")
    return {
        "seconds": seconds,
        "cpu": cpu,
        "peak_growth": peak - before,
        "bytes_read": result.bytes_read,
        **held,
    }


def save(spec: bm.ModelSpec, work: str) -> None:
    import keras
    import numpy as np

    import keras_orbax

    keras.distribution.set_distribution(bm.make_distribution())
    model = bm.build_model(spec, build_optimizer=False)
    rng = np.random.default_rng(0)
    for weight in model.weights:
        weight.assign(rng.standard_normal(weight.shape).astype("float32"))
    keras_orbax.save(model, work, step=1)
    with open(os.path.join(work, "sums.json"), "w") as f:
        json.dump(bm.checksums((v.path, v.value) for v in model.weights), f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params-mib", type=float, default=384)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--work", default=os.path.join(HERE, "_work", "mapped"))
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    parser.add_argument("--child", action="store_true")
    args = parser.parse_args()
    bm.set_env()
    spec = bm.ModelSpec(params_gib=args.params_mib / 1024, layers=args.layers)
    if args.child:
        print(json.dumps(child(spec, args.work)))
        return
    if not os.path.isfile(os.path.join(args.work, "sums.json")):
        save(spec, args.work)
    results: dict[str, list[dict]] = {}

    def run(mode: str, cold: bool) -> None:
        if cold:
            os.sync()
            cold_benchmark.evict(args.work)
        command = [sys.executable, __file__, "--child", "--work", args.work]
        command += ["--params-mib", str(args.params_mib), "--layers", str(args.layers)]
        env = dict(os.environ, KERAS_ORBAX_MAP_SHARDS=MODES[mode])
        done = subprocess.run(command, capture_output=True, text=True, env=env)
        if done.returncode:
            raise SystemExit(done.stderr[-3000:])
        figures = json.loads(done.stdout.strip().splitlines()[-1])
        results.setdefault(f"{mode} {'cold' if cold else 'warm'}", []).append(figures)

    run("copy", cold=False)  # fills the page cache for the first warm pair
    results.clear()
    for _ in range(args.repeats):
        for cold in (False, True):
            for mode in MODES:
                run(mode, cold)
    mib = 1 << 20
    print(f"model {spec.n_params() * 4 / mib:.0f} MiB, {args.repeats} runs each, medians:")
    print(
        "| case | restore s | CPU s | peak RSS growth MiB | RssAnon after MiB | RssFile after MiB |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for case, runs in results.items():
        m = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(
            f"| {case} | {m['seconds']:.2f} | {m['cpu']:.2f} | {m['peak_growth'] / mib:.0f} | "
            f"{m['RssAnon'] / mib:.0f} | {m['RssFile'] / mib:.0f} |"
        )
    print(
        "restore s per run: "
        + json.dumps({c: [round(r["seconds"], 3) for r in runs] for c, runs in results.items()})
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"params_mib": args.params_mib, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
