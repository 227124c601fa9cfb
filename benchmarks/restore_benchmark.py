"""Restore benchmark: keras-orbax against Keras's own loaders and plain Orbax, on 8 CPU devices.

Run (from the repository root, with the venv's python):

    python benchmarks/restore_benchmark.py --quick          # smoke test: 0.1 GiB, 1 repeat
    python benchmarks/restore_benchmark.py                  # 1 GiB of float32 parameters, 3 repeats
    python benchmarks/restore_benchmark.py --sizes          # peak memory against model size / variable count
    python benchmarks/restore_benchmark.py --write-docs     # also write docs/benchmarks.md and the PNGs

Re-render results.md / PNGs (and docs/ with --write-docs) from results.json without running:
    python benchmarks/restore_benchmark.py --report-only [--write-docs]

Options: --params-gib, --layers (many small variables: e.g. --layers 255), --repeats, --cases,
--allocators, --compact (also save and restore the "compact" format), --resave, --work-dir.

The model (benchmarks/bench_model.py) is an Embedding, a LayerNormalization, a stack of wide Dense
layers and a Dense(1) head, compiled with Adam, under `ModelParallel` on a (2, 4) ("batch", "model")
mesh of 8 virtual CPU devices; Dense kernels are sharded ("batch", "model"), the embedding
(None, "model"), everything else is replicated. One process trains it for one step (so Adam's slots
hold non-trivial values) and saves it once to the work directory (default benchmarks/_work/<tag>/):
`model.weights.h5`, a `keras.callbacks.OrbaxCheckpoint` directory, `keras_orbax.save(...)` ("fast",
and with --compact "compact"). A meta.json records checksums of every variable and the predictions
on a fixed batch; every measured restore is checked against both (column "ok").

Each case then runs in a fresh process (so its peak RSS is its own), `--repeats` times per allocator
("default" glibc, and "mmap1M" = MALLOC_MMAP_THRESHOLD_=1048576 in the measured process), cases
interleaved; the medians are reported. Cases:

  ko_deferred      `with keras_orbax.deferred_init(): build+compile+optimizer.build`, then
                   `keras_orbax.restore_sharded` (model and optimizer state); the Adam instance is
                   made before the scope (its iteration/learning_rate variables come from numbers)
  ko_deferred_compact  (with --compact) ko_deferred from the "compact" (zstd + OCDBT) checkpoint
  ko_built         build normally (variables initialized), then `keras_orbax.restore_sharded`
  keras_h5         build, then `model.load_weights("model.weights.h5")`
  keras_orbax_cb   build, then `model.load_weights(<keras.callbacks.OrbaxCheckpoint dir>)`
  orbax_floor      no Keras model: `orbax.checkpoint.experimental.v1.load` of the OrbaxCheckpoint
                   callback's checkpoint (Orbax's default format: zarr3 + zstd + OCDBT) into
                   `jax.ShapeDtypeStruct` targets carrying the saved shardings (= the model's)
  orbax_floor_fast the same plain Orbax load, of the keras-orbax "fast" checkpoint's files
  disk_read        read the bytes of the keras-orbax "fast" checkpoint (or, without keras_orbax,
                   the callback's) into fresh numpy buffers, 4 x cores files in flight, page cache
                   warm: the physical floor (replicated shards are stored, and read, once)

Numbers:
  restore_s        wall time of the restore call alone (metadata reads included); "min s" is the
                   fastest of the repeats
  restore_cpu_s    CPU time (user + system, all threads) of the process during that call: less
                   sensitive than wall time to other work sharing the machine
  e2e_s            wall time from just before the parent spawns the process (empty process) to a
                   model ready to predict: interpreter start, imports, build, restore
  peak-import      peak RSS (VmHWM of the measured process) minus its RSS right after the imports,
                   jax backend initialization and set_distribution
  x resident       peak-import / resident bytes, where resident bytes = bytes the restored arrays
                   occupy on all devices together, replicas counted (sum of every addressable
                   shard's bytes): 1.0 is one copy of the state (on CPU, devices that hold the
                   same shard can share a host buffer, so a restore can go a little below 1).
                   disk_read's resident bytes are the bytes it read.
  x floor          a time divided by orbax_floor's median time with the same allocator
On CPU all 8 "devices" live in the process's memory, so peak RSS is the device memory high-water
mark of the whole restore. Results: <work>/results.json, <work>/results.md, <work>/restore_benchmark.png
(and docs/ with --write-docs).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

import bench_model as bm

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_WORK = os.path.join(HERE, "_work")
CASES = [
    "ko_deferred",
    "ko_built",
    "keras_h5",
    "keras_orbax_cb",
    "orbax_floor",
    "orbax_floor_fast",
    "disk_read",
]
KO_CASES = {"ko_deferred", "ko_built", "ko_deferred_compact", "orbax_floor_fast"}
ALLOCATORS = {"default": {}, "mmap1M": {"MALLOC_MMAP_THRESHOLD_": "1048576"}}
ARTIFACTS = {"h5": "model.weights.h5", "cb": "orbax_cb", "ko": "ko_fast", "compact": "ko_compact"}
CHECKPOINTABLE = {"cb": "pytree", "ko": "state"}  # the Orbax checkpointable holding the arrays
CHILD_TIMEOUT_S = 3600
# reads in flight for disk_read: as many as keras-orbax's reader uses
DISK_READ_THREADS = min(16, 4 * (os.cpu_count() or 1))
FLOOR_NOTES = {
    "cb": "plain Orbax v1 `load` of the keras.callbacks.OrbaxCheckpoint checkpoint (zarr3, zstd, OCDBT)",
    "ko": 'plain Orbax v1 `load` of the keras-orbax "fast" checkpoint (zarr3, uncompressed, chunk = shard)',
}


# ----------------------------------------------------------------------------- save (child)


def save_all(spec: bm.ModelSpec, work: str, artifacts: list[str]) -> None:
    """Trains the model one step and saves it in every requested format, plus meta.json."""
    import keras

    keras.utils.set_random_seed(0)
    keras.distribution.set_distribution(bm.make_distribution())
    model = bm.build_model(spec)
    x, y = bm.sample_batch(spec)
    callbacks = []
    if "cb" in artifacts:
        callbacks.append(keras.callbacks.OrbaxCheckpoint(os.path.join(work, ARTIFACTS["cb"])))
    model.fit(x, y, batch_size=bm.BATCH, epochs=1, callbacks=callbacks, verbose=0)
    if "h5" in artifacts:
        model.save_weights(os.path.join(work, ARTIFACTS["h5"]))
    if "ko" in artifacts or "compact" in artifacts:
        import keras_orbax

        if "ko" in artifacts:
            keras_orbax.save(model, os.path.join(work, ARTIFACTS["ko"]), step=1)
        if "compact" in artifacts:
            keras_orbax.save(
                model, os.path.join(work, ARTIFACTS["compact"]), step=1, format="compact"
            )
    write_meta(model, spec, work, artifacts, x)


def write_meta(model, spec: bm.ModelSpec, work: str, artifacts: list[str], x) -> None:
    state = bm.state_variables(model)
    meta = {
        "spec": {"params_gib": spec.params_gib, "layers": spec.layers, "width": spec.width},
        "n_params": spec.n_params(),
        "n_state_variables": len(state),
        "resident_bytes": bm.resident_bytes(v.value for v in state),
        "logical_bytes": sum(v.value.nbytes for v in state),
        "checksums": bm.checksums((v.path, v.value) for v in state),
        "predictions": model.predict(x, verbose=0).tolist(),
        "artifacts": {a: dir_bytes(os.path.join(work, ARTIFACTS[a])) for a in artifacts},
    }
    with open(os.path.join(work, "meta.json"), "w") as f:
        json.dump(meta, f)


def dir_bytes(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(p) for p in list_files(path))


def list_files(root: str) -> list[str]:
    return sorted(
        os.path.join(d, n)
        for d, _, names in os.walk(root)
        for n in names
        if not os.path.islink(os.path.join(d, n))
    )


# ----------------------------------------------------------------------------- cases (child)


def case_ko(spec, work, deferred: bool, artifact: str = "ko"):
    import keras

    import keras_orbax

    if deferred:
        optimizer = keras.optimizers.Adam(1e-3)  # made outside: see bm.build_model
        with keras_orbax.deferred_init():
            model = bm.build_model(spec, optimizer)
    else:
        model = bm.build_model(spec)
    t = bm.clock()
    result = keras_orbax.restore_sharded(model, os.path.join(work, ARTIFACTS[artifact]))
    return bm.since(t), model, result.bytes_read


def case_keras(spec, work, artifact: str):
    model = bm.build_model(spec)
    t = bm.clock()
    model.load_weights(os.path.join(work, ARTIFACTS[artifact]))
    return bm.since(t), model


def case_orbax_floor(work, artifact: str):
    """Plain Orbax v1 load into `jax.ShapeDtypeStruct`s carrying the saved shardings (on the same
    mesh they equal the model's); returns (seconds, {key: array})."""
    import jax
    import numpy as np
    import orbax.checkpoint.experimental.v1 as ocp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()).reshape(bm.MESH_SHAPE), bm.MESH_AXES)
    root = os.path.join(work, ARTIFACTS[artifact])
    step_dir = os.path.join(root, max((d for d in os.listdir(root) if d.isdigit()), key=int))
    name = CHECKPOINTABLE[artifact]

    def abstract(leaf):
        sharding = NamedSharding(mesh, PartitionSpec(*leaf.sharding_metadata.partition_spec))
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)

    t = bm.clock()
    tree = ocp.metadata(step_dir, checkpointable_name=name).metadata
    targets = jax.tree.map(abstract, tree, is_leaf=lambda x: hasattr(x, "sharding_metadata"))
    restored = ocp.load(step_dir, targets, checkpointable_name=name)
    elapsed = bm.since(t)
    flat = jax.tree_util.tree_flatten_with_path(restored)[0]
    return elapsed, {"/".join(str(k.key) for k in p[1:]): a for p, a in flat}


def case_disk_read(work, threads: int = DISK_READ_THREADS):
    """Reads every file of the checkpoint into a fresh numpy buffer, `threads` files at a time;
    returns (seconds, bytes, directory)."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    root = os.path.join(work, ARTIFACTS["ko"])
    if not os.path.isdir(root):
        root = os.path.join(work, ARTIFACTS["cb"])

    def read(path):
        buf = np.empty(os.path.getsize(path), np.uint8)
        with open(path, "rb", buffering=0) as f:
            f.readinto(memoryview(buf))  # one read(2) per file; the kernel fills fresh pages
        return buf

    t = bm.clock()
    with ThreadPoolExecutor(threads) as pool:
        buffers = list(pool.map(read, list_files(root)))
    return bm.since(t), sum(b.nbytes for b in buffers), root


def restore_case(name: str, spec: bm.ModelSpec, work: str):
    """Runs the measured part of a case: ((wall s, CPU s), model or None, {key: array} or None,
    extra fields for the result)."""
    if name in ("ko_deferred", "ko_built", "ko_deferred_compact"):
        artifact = "compact" if name.endswith("compact") else "ko"
        times, model, nbytes = case_ko(spec, work, name != "ko_built", artifact)
        return times, model, None, {"bytes_read": nbytes}
    if name in ("keras_h5", "keras_orbax_cb"):
        times, model = case_keras(spec, work, "h5" if name == "keras_h5" else "cb")
        return times, model, None, {}
    if name in ("orbax_floor", "orbax_floor_fast"):
        artifact = "cb" if name == "orbax_floor" else "ko"
        times, arrays = case_orbax_floor(work, artifact)
        return times, None, arrays, {"note": FLOOR_NOTES[artifact]}
    if name == "disk_read":
        times, nbytes, root = case_disk_read(work)
        note = f"{DISK_READ_THREADS} threads read every file of {os.path.basename(root)}"
        return times, None, None, {"note": note, "bytes_read": nbytes, "resident_bytes": nbytes}
    raise ValueError(f"unknown case {name}")


def run_case(name: str, spec: bm.ModelSpec, work: str) -> dict:
    """Runs one case in this (fresh) process and returns its measurements."""
    t0 = float(os.environ.get("BENCH_T0", time.time()))
    import jax
    import keras
    import orbax.checkpoint  # noqa: F401  (imported by every case alike)

    with contextlib.suppress(ImportError):
        import keras_orbax  # noqa: F401
    jax.devices()
    keras.distribution.set_distribution(bm.make_distribution())
    rss_import = bm.rss_bytes()
    (restore_s, cpu_s), model, arrays, out = restore_case(name, spec, work)
    e2e_s = time.time() - t0
    out.update(
        case=name,
        restore_s=restore_s,
        restore_cpu_s=cpu_s,
        e2e_s=e2e_s,
        rss_import=rss_import,
        peak_rss=bm.peak_rss_bytes(),
        loadavg_1m=os.getloadavg()[0],
    )
    if model is not None:
        arrays = {v.path: v.value for v in bm.state_variables(model)}
    if arrays is None:  # disk_read: nothing to check but the byte count
        return dict(out, ok=True)
    out.setdefault("resident_bytes", bm.resident_bytes(arrays.values()))
    with open(os.path.join(work, "meta.json")) as f:
        out.update(verify(json.load(f), spec, arrays, model))
    return out


def verify(meta: dict, spec: bm.ModelSpec, arrays: dict, model) -> dict:
    """Checks the restored values against the saved checksums and predictions (after measuring)."""
    import numpy as np

    got = bm.checksums(arrays.items())
    if set(meta["checksums"]) <= set(got):
        bad = bm.compare_checksums(got, meta["checksums"])
    else:  # keys of another naming scheme (e.g. keras-orbax's): match the values as a multiset
        bad = bm.compare_checksum_values(got, meta["checksums"])
    result = {"ok": not bad, "mismatched": bad[:5], "n_mismatched": len(bad)}
    if model is not None:
        pred = model.predict(bm.sample_batch(spec)[0], verbose=0)
        pred_ok = bool(np.allclose(pred, np.array(meta["predictions"]), rtol=1e-4, atol=1e-5))
        result.update(ok=result["ok"] and pred_ok, predict_ok=pred_ok)
    return result


# ----------------------------------------------------------------------------- parent


def child_cmd(mode: str, spec: bm.ModelSpec, work: str, *extra: str) -> list[str]:
    return [
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        mode,
        "--params-gib",
        str(spec.params_gib),
        "--layers",
        str(spec.layers),
        "--work-dir",
        work,
        *extra,
    ]


def ko_available() -> bool:
    """Whether keras_orbax in the working tree has the API this benchmark calls."""
    code = "import keras_orbax as k; k.save; k.restore_sharded; k.deferred_init"
    env = dict(os.environ, PYTHONPATH=bm.REPO_ROOT, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu")
    return (
        subprocess.run([sys.executable, "-c", code], env=env, capture_output=True).returncode == 0
    )


def ensure_saved(spec: bm.ModelSpec, work: str, wanted: list[str], resave: bool) -> dict:
    """Saves the model in a child process unless meta.json already lists every wanted artifact."""
    meta_path = os.path.join(work, "meta.json")
    if not resave and os.path.exists(meta_path):
        with open(meta_path) as f:
            meta = json.load(f)
        if set(wanted) <= set(meta["artifacts"]) and meta["spec"]["width"] == spec.width:
            return meta
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    print(f"[save] {spec.tag}: width {spec.width}, saving {wanted} ...", flush=True)
    t = time.time()
    subprocess.run(child_cmd("save", spec, work, "--artifacts", ",".join(wanted)), check=True)
    print(f"[save] done in {time.time() - t:.0f} s", flush=True)
    with open(meta_path) as f:
        return json.load(f)


def warm_page_cache(work: str) -> None:
    for path in list_files(work):
        with open(path, "rb", buffering=0) as f:
            while f.read(64 << 20):
                pass


def run_child(case: str, allocator: str, spec: bm.ModelSpec, work: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.update(ALLOCATORS[allocator])
    env["BENCH_T0"] = repr(time.time())
    proc = subprocess.run(
        child_cmd("case", spec, work, "--case", case),
        env=env,
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"case": case, "allocator": allocator, "error": " | ".join(tail)}
    return dict(json.loads(lines[-1][len("RESULT ") :]), allocator=allocator)


def run_cases(cases, allocators, repeats, spec, work) -> list[dict]:
    """Every (case, allocator) `repeats` times, interleaved so drifts hit all cases alike."""
    runs = []
    for rep in range(repeats):
        for allocator in allocators:
            for case in cases:
                r = run_child(case, allocator, spec, work)
                runs.append(dict(r, repeat=rep))
                print(f"[run {rep}] {case:<20} {allocator:<8} " + brief(r), flush=True)
    return runs


def brief(r: dict) -> str:
    if "error" in r:
        return "ERROR " + r["error"][-300:]
    gib = (r["peak_rss"] - r["rss_import"]) / 2**30
    return f"restore {r['restore_s']:.2f}s cpu {r['restore_cpu_s']:.2f}s e2e {r['e2e_s']:.1f}s peak-import {gib:.2f}GiB ok={r['ok']}"


def summarize(runs: list[dict]) -> list[dict]:
    """Medians per (case, allocator), and ratios to orbax_floor with the same allocator."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["case"], r["allocator"]), []).append(r)
    rows = [median_row(case, alloc, rs) for (case, alloc), rs in groups.items()]
    floors = {r["allocator"]: r for r in rows if r["case"] == "orbax_floor" and "restore_s" in r}
    for r in rows:
        f = floors.get(r["allocator"])
        if f and "restore_s" in r:
            r["restore_x_floor"] = r["restore_s"] / f["restore_s"]
            r["e2e_x_floor"] = r["e2e_s"] / f["e2e_s"]
    return rows


def median_row(case: str, alloc: str, rs: list[dict]) -> dict:
    good = [r for r in rs if "error" not in r]
    if not good:
        return {"case": case, "allocator": alloc, "error": rs[-1]["error"]}
    med = lambda key: statistics.median(r[key] for r in good)  # noqa: E731
    peak = statistics.median(r["peak_rss"] - r["rss_import"] for r in good)
    resident = med("resident_bytes")
    return {
        "case": case,
        "allocator": alloc,
        "n": len(good),
        "restore_s": med("restore_s"),
        "restore_s_min": min(r["restore_s"] for r in good),
        "restore_cpu_s": med("restore_cpu_s"),
        "e2e_s": med("e2e_s"),
        "rss_import_gib": med("rss_import") / 2**30,
        "peak_minus_import_gib": peak / 2**30,
        "resident_gib": resident / 2**30,
        "peak_x_resident": peak / resident,
        "ok": all(r["ok"] for r in good),
        "note": good[0].get("note", ""),
        "errors": len(rs) - len(good),
        "loadavg_1m": max(r["loadavg_1m"] for r in good),
    }


def main_run(args) -> None:
    spec = bm.ModelSpec(args.params_gib, args.layers)
    work = os.path.join(args.work_dir, spec.tag)
    has_ko = ko_available()
    cases = [c for c in args.cases if has_ko or c not in KO_CASES]
    if args.compact and has_ko and "ko_deferred_compact" not in cases:
        cases.insert(1, "ko_deferred_compact")
    wanted = (
        ["h5", "cb"] + (["ko"] if has_ko else []) + (["compact"] if args.compact and has_ko else [])
    )
    meta = ensure_saved(spec, work, wanted, args.resave)
    if not has_ko:
        print("[warn] keras_orbax API not available: ko_* cases skipped", flush=True)
    warm_page_cache(work)
    runs = run_cases(cases, args.allocators, args.repeats, spec, work)
    report(
        args,
        {
            "spec": meta["spec"],
            "meta": {k: v for k, v in meta.items() if k in META_KEYS},
            "machine": machine_info(),
            "cases": cases,
            "runs": runs,
        },
    )


def report(args, results: dict) -> None:
    """(Re)computes the summary from the runs, writes results.json, markdown and plots."""
    import bench_report

    results["summary"] = summarize(results["runs"])
    write_json(os.path.join(args.work_dir, "results.json"), results)
    print(bench_report.render_main(results))
    bench_report.write_outputs(args.work_dir, args.write_docs)


META_KEYS = ("n_params", "n_state_variables", "resident_bytes", "logical_bytes", "artifacts")


def sizes_run(args) -> None:
    """Peak memory of ko_deferred and keras_h5 against model bytes and number of variables."""
    has_ko = ko_available()
    cases = [c for c in ("ko_deferred", "keras_h5") if has_ko or c not in KO_CASES]
    specs = [bm.ModelSpec(g, args.layers) for g in args.sizes_gib]
    specs += [bm.ModelSpec(args.sizes_gib[0], n) for n in args.sizes_layers if n != args.layers]
    rows = []
    for spec in specs:
        work = os.path.join(args.work_dir, spec.tag)
        meta = ensure_saved(spec, work, ["h5"] + (["ko"] if has_ko else []), args.resave)
        warm_page_cache(work)
        for row in summarize(run_cases(cases, args.allocators, args.repeats, spec, work)):
            rows.append(
                dict(
                    row,
                    tag=spec.tag,
                    params_gib=spec.params_gib,
                    layers=spec.layers,
                    n_state_variables=meta["n_state_variables"],
                )
            )
    write_json(os.path.join(args.work_dir, "sizes.json"), {"machine": machine_info(), "rows": rows})
    import bench_report

    print(bench_report.render_sizes({"rows": rows}))
    bench_report.write_outputs(args.work_dir, args.write_docs)


def machine_info() -> dict:
    import platform
    from importlib.metadata import version

    pkgs = ("keras", "jax", "jaxlib", "orbax-checkpoint", "tensorstore", "numpy")
    return {
        "cpus": os.cpu_count(),
        "mem_gib": round(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30, 1),
        "python": platform.python_version(),
        "versions": {p: version(p) for p in pkgs},
    }


def write_json(path: str, obj) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--params-gib", type=float, default=1.0)
    p.add_argument(
        "--layers", type=int, default=15, help="Dense blocks (more = many smaller variables)"
    )
    p.add_argument(
        "--repeats", type=int, default=None, help="fresh processes per case and allocator"
    )
    p.add_argument("--cases", type=lambda s: s.split(","), default=CASES)
    p.add_argument("--allocators", type=lambda s: s.split(","), default=list(ALLOCATORS))
    p.add_argument(
        "--work-dir", default=None, help="default benchmarks/_work (--quick: _work/quick)"
    )
    p.add_argument("--quick", action="store_true", help="0.1 GiB, 1 repeat (sizes: 0.025-0.1 GiB)")
    p.add_argument("--compact", action="store_true", help='also save/restore format="compact"')
    p.add_argument("--resave", action="store_true", help="save the checkpoints again")
    p.add_argument(
        "--sizes", action="store_true", help="peak memory against size and variable count"
    )
    p.add_argument(
        "--sizes-gib", type=lambda s: [float(x) for x in s.split(",")], default=[0.25, 0.5, 1.0]
    )
    p.add_argument(
        "--sizes-layers", type=lambda s: [int(x) for x in s.split(",")], default=[15, 255]
    )
    p.add_argument(
        "--write-docs", action="store_true", help="write docs/benchmarks.md and docs/*.png"
    )
    p.add_argument(
        "--report-only", action="store_true", help="re-render the work dir's results.json"
    )
    p.add_argument("--child", choices=["save", "case"], help=argparse.SUPPRESS)
    p.add_argument("--case", help=argparse.SUPPRESS)
    p.add_argument("--artifacts", type=lambda s: s.split(","), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.params_gib = 0.1
        args.sizes_gib = [0.025, 0.05, 0.1]
    if args.repeats is None:
        args.repeats = 1 if (args.quick or args.sizes) else 3
    if args.work_dir is None:
        args.work_dir = os.path.join(DEFAULT_WORK, "quick") if args.quick else DEFAULT_WORK
    args.work_dir = os.path.abspath(args.work_dir)
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.child:
        bm.set_env()
        spec = bm.ModelSpec(args.params_gib, args.layers)
        if args.child == "save":
            save_all(spec, args.work_dir, args.artifacts)
        else:
            print("RESULT " + json.dumps(run_case(args.case, spec, args.work_dir)), flush=True)
    elif args.report_only:
        with open(os.path.join(args.work_dir, "results.json")) as f:
            report(args, json.load(f))
    elif args.sizes:
        sizes_run(args)
    else:
        main_run(args)


if __name__ == "__main__":
    main()
