"""Restore benchmark: keras-orbax against Keras's own loaders and plain Orbax, on 8 CPU devices.

Run (from the repository root, with the venv's python):

    python -m benchmarks restore --size small       # smoke test: 0.02 GiB, 1 round
    python -m benchmarks restore                    # 1 GiB of float32 parameters, 3 rounds
    python -m benchmarks restore --set layers=255   # many small variables
    python -m benchmarks render restore --write-docs   # the table and plot into docs/

The model (benchmarks/bench_model.py) is an Embedding, a LayerNormalization, a stack of wide Dense
layers and a Dense(1) head, compiled with Adam, under `ModelParallel` on a (2, 4) ("batch", "model")
mesh of 8 virtual CPU devices; Dense kernels are sharded ("batch", "model"), the embedding
(None, "model"), everything else is replicated. One process trains it for one step (so Adam's slots
hold non-trivial values) and saves it once to the work directory (benchmarks/_work/restore/<tag>/):
`model.weights.h5`, a `keras.callbacks.OrbaxCheckpoint` directory, `keras_orbax.save(...)`
("fast"). A meta.json records checksums of every variable and the predictions
on a fixed batch; every measured restore is checked against both (column "ok").

Each case then runs in a fresh process (so its peak RSS is its own) per allocator ("default"
glibc, and "mmap1M" = MALLOC_MMAP_THRESHOLD_=1048576 in the measured process: the cases named
`<case>+mmap1M`), through the harness; the medians are reported. Cases:

  ko_deferred      `with keras_orbax.deferred_init(): build+compile+optimizer.build`, then
                   `keras_orbax.restore_sharded` (model and optimizer state); the Adam instance is
                   made before the scope (its iteration/learning_rate variables come from numbers)
  ko_built         build normally (variables initialized), then `keras_orbax.restore_sharded`
  keras_h5         build, then `model.load_weights("model.weights.h5")`
  keras_orbax_cb   build, then `model.load_weights(<keras.callbacks.OrbaxCheckpoint dir>)`
  orbax_floor      no Keras model: `orbax.checkpoint.experimental.v1.load` of the OrbaxCheckpoint
                   callback's checkpoint (Orbax's default format: zarr3 + zstd + OCDBT) into
                   `jax.ShapeDtypeStruct` targets carrying the saved shardings (= the model's):
                   the floor
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
mark of the whole restore.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time

from benchmarks import bench_model as bm

ARTIFACTS = {"h5": "model.weights.h5", "cb": "orbax_cb", "ko": "ko_fast", "compact": "ko_compact"}
CHECKPOINTABLE = {"cb": "pytree", "ko": "state"}  # the Orbax checkpointable holding the arrays
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
    root = os.path.join(work, ARTIFACTS["ko"])
    if not os.path.isdir(root):
        root = os.path.join(work, ARTIFACTS["cb"])
    t = bm.clock()
    buffers = bm.read_all(root, threads)
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


def run_case(case: str, params: dict, work: str) -> dict:
    """Runs one case in this (fresh) process and returns its measurements."""
    t0 = float(os.environ.get("BENCH_T0", time.time()))
    name, spec = case.split("+")[0], _spec(params)
    work = os.path.join(work, spec.tag)
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
        seconds=restore_s,
        restore_cpu_s=cpu_s,
        e2e_s=e2e_s,
        rss_import=rss_import,
        peak_minus_import=bm.peak_rss_bytes() - rss_import,
    )
    if model is not None:
        arrays = {v.path: v.value for v in bm.state_variables(model)}
    if arrays is None:  # disk_read: nothing to check but the byte count
        return dict(out, ok=1)
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
    result = {"ok": int(not bad), "mismatched": bad[:5], "n_mismatched": len(bad)}
    if model is not None:
        pred = model.predict(bm.sample_batch(spec)[0], verbose=0)
        pred_ok = bool(np.allclose(pred, np.array(meta["predictions"]), rtol=1e-4, atol=1e-5))
        result.update(ok=int(result["ok"] and pred_ok), predict_ok=pred_ok)
    return result


# ----------------------------------------------------------------------------- the harness's side


def _spec(params: dict) -> bm.ModelSpec:
    return bm.ModelSpec(params["params_gib"], params["layers"])


def prepare(params: dict, work: str) -> dict:
    """Saves the model (unless meta.json lists every artifact already), reads every file once
    (page cache warm) and returns what the table states about the model."""
    spec = _spec(params)
    work = os.path.join(work, spec.tag)
    meta_path = os.path.join(work, "meta.json")
    meta = None
    if os.path.exists(meta_path):
        with open(meta_path) as f:
            meta = json.load(f)
    wanted = ["h5", "cb", "ko"] + (["compact"] if params.get("compact") else [])
    if meta is None or set(wanted) - set(meta["artifacts"]):
        shutil.rmtree(work, ignore_errors=True)
        os.makedirs(work)
        save_all(spec, work, wanted)
        with open(meta_path) as f:
            meta = json.load(f)
    for path in list_files(work):
        with open(path, "rb", buffering=0) as f:
            while f.read(64 << 20):
                pass
    return {"spec": meta["spec"], "meta": {k: meta[k] for k in META_KEYS}}


META_KEYS = ("n_params", "n_state_variables", "resident_bytes", "logical_bytes", "artifacts")


def render(result: dict, out_dir: str) -> str:
    """One row per case and allocator, each time / orbax_floor's with the same allocator (same
    round), and a plot of both ratios."""
    import statistics

    from benchmarks import render as r
    from benchmarks.registry import BY_NAME

    meta, spec, gib = result["prepared"]["meta"], result["prepared"]["spec"], 2**30
    for name, row in result["summary"].items():
        row.update(
            peak_gib=row["peak_minus_import"] / gib,
            x_resident=row["peak_minus_import"] / row["resident_bytes"],
        )
        floor = "orbax_floor" + name.partition("+")[1] + name.partition("+")[2]
        pairs = [
            x[name]["seconds"] / x[floor]["seconds"]
            for x in result["rounds"]
            if name in x and floor in x
        ]
        row["x_floor"] = statistics.median(pairs) if pairs and name != floor else None
    disk = ", ".join(f"{k} {v / gib:.2f} GiB" for k, v in meta["artifacts"].items())
    lines = [
        f"Model: {meta['n_params'] / 1e6:.0f} M float32 parameters, width {spec['width']}, {spec['layers']} "
        f"Dense blocks, Adam; {meta['n_state_variables']} variables with the optimizer's, "
        f"{meta['logical_bytes'] / gib:.2f} GiB of state, **{meta['resident_bytes'] / gib:.2f} GiB resident** "
        f"on 8 CPU devices (replicas counted). On disk: {disk}. `x floor`: / `orbax_floor` with the same "
        "allocator; `x resident`: peak RSS growth / the bytes the arrays occupy on all devices, replicas "
        "counted (on CPU, devices holding the same shard can share one host buffer: it can fall below 1).",
        "", *r.table(BY_NAME["restore"], result), "",
        f"- `orbax_floor`: {FLOOR_NOTES['cb']}", f"- `orbax_floor_fast`: {FLOOR_NOTES['ko']}", "",
    ]  # fmt: skip
    colors = {"": "#4f81bd", "mmap1M": "#c0504d"}
    for png, key, what in (("restore_time.png", "x_floor", "restore time / orbax_floor"),
                           ("restore_peak.png", "x_resident", "peak RSS growth / resident")):  # fmt: skip
        rows = [(k, v) for k, v in result["summary"].items() if v.get(key)]
        series = [[(v[key], colors[k.partition("+")[2]], f"{v[key]:.2f}")] for k, v in rows]
        if r.bars(os.path.join(out_dir, png), [k for k, _ in rows], series, what, f"{what} (blue: glibc default, red: mmap1M)", line=1.0):  # fmt: skip
            lines += [f"![{what}]({png})", ""]
    return "\n".join([*lines, r.provenance(result)]) + "\n"
