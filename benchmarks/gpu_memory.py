"""Per-device peak memory of a restore on accelerators, and save and restore times against the
hardware's floors: keras-orbax `deferred_init` + `restore_sharded` against Keras
`load_weights("*.weights.h5")`. Needs a jax build for the accelerator (e.g. jax[cuda12]); on CPU:
`--set cpu_devices=8`.

The model (bench_model.py: Embedding, LayerNormalization, Dense blocks, Adam; `params_gib` GiB of
float32 parameters, Adam's slots with `with_optimizer`) is sharded over a 1-D "model" mesh of every
device: Dense kernels and the embedding split their last dimension, the rest is replicated.
`prepare` saves it (`model.weights.h5` and `keras_orbax.save`) and then times, `os.sync()` before
each: `jax.device_get` of every distinct shard (device-to-host), those host copies written to one
file each and fsync-ed by 8 threads (the write floor), and a second `keras_orbax.save`.

Each case runs in a fresh process, because a device's `peak_bytes_in_use` cannot be reset:

  ko_deferred  `with keras_orbax.deferred_init(): build`, then `keras_orbax.restore_sharded`
  keras_h5     build (variables initialized), then `model.load_weights("model.weights.h5")`

and reports per device `owned` (bytes of the restored state's shards), `peak`
(`memory_stats()["peak_bytes_in_use"]` after the restore) and peak / owned (1.0: no device ever
held more than its own shards; backends without memory_stats, CPU among them, give none), the
host's peak RSS growth, and the restore's time against its floor in the same process: reading the
checkpoint's files (8 threads, page cache warm) + `device_put` of every addressable shard from
fresh host copies. On CPU `device_put` can alias host memory instead of copying: the ratio means
something on an accelerator only.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time

from benchmarks import bench_model as bm

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # before jax starts
RULES = {r"block_\d+/kernel": (None, "model"), "embed/embeddings": (None, "model")}


def _setup(params: dict):
    import jax
    import keras

    devices = jax.devices()
    keras.distribution.set_distribution(
        bm.make_distribution(devices, (len(devices),), ("model",), RULES)
    )
    return devices, bm.ModelSpec(params["params_gib"], params["layers"])


def prepare(params: dict, work: str) -> dict:
    """Saves what the cases restore; times a second save against its floors."""
    import jax
    import numpy as np

    import keras_orbax

    _, spec = _setup(params)
    model = bm.build_model(spec, build_optimizer=params["with_optimizer"])
    state = bm.state_variables(model)
    jax.block_until_ready([v.value for v in state])  # initializers dispatch asynchronously
    model.save_weights(os.path.join(work, "model.weights.h5"))
    keras_orbax.save(model, os.path.join(work, "ko"), step=1, overwrite=True)
    shards = [s.data for v in state for s in v.value.addressable_shards if s.replica_id == 0]
    os.sync()
    start = time.perf_counter()
    host = [np.asarray(a) for a in jax.device_get(shards)]
    times = {"d2h_s": time.perf_counter() - start}
    os.sync()
    start = time.perf_counter()
    bm.write_all(host, os.path.join(work, "floor"))
    times["write_floor_s"] = time.perf_counter() - start
    os.sync()
    start = time.perf_counter()
    keras_orbax.save(model, os.path.join(work, "timed"), step=1)
    times["save_s"] = time.perf_counter() - start
    for name in ("floor", "timed"):
        shutil.rmtree(os.path.join(work, name))
    return dict(times, shard_gib=sum(a.nbytes for a in host) / 2**30,
                save_x_floor=times["save_s"] / times["write_floor_s"])  # fmt: skip


def run_case(case: str, params: dict, work: str) -> dict:
    import jax
    import keras
    import numpy as np

    import keras_orbax

    devices, spec = _setup(params)
    rss_import = bm.rss_bytes()
    if case == "ko_deferred":
        optimizer = keras.optimizers.Adam(
            1e-3
        )  # outside the scope: its variables come from numbers
        with keras_orbax.deferred_init():
            model = bm.build_model(spec, optimizer, build_optimizer=params["with_optimizer"])
        artifact, start = os.path.join(work, "ko"), time.perf_counter()
        keras_orbax.restore_sharded(model, artifact)
    else:
        model = bm.build_model(spec, build_optimizer=params["with_optimizer"])
        artifact, start = os.path.join(work, "model.weights.h5"), time.perf_counter()
        model.load_weights(artifact)
    state = bm.state_variables(model)
    jax.block_until_ready([v.value for v in state])
    seconds = time.perf_counter() - start
    owned = {d.id: 0 for d in devices}
    for shard in (s for v in state for s in v.value.addressable_shards):
        owned[shard.device.id] += shard.data.nbytes
    rows = [_device_row(d, owned[d.id]) for d in devices]  # before the floor allocates again
    host_peak = bm.peak_rss_bytes() - rss_import
    shards = [s for v in state for s in v.value.addressable_shards]
    host = [np.array(s.data) for s in shards]  # fresh host copies, untimed
    jax.block_until_ready(jax.device_put(host[:1], [shards[0].device]))  # first-call costs
    start = time.perf_counter()
    jax.block_until_ready(jax.device_put(host, [s.device for s in shards]))
    h2d_s, start = time.perf_counter() - start, time.perf_counter()
    bm.read_all(artifact)  # page cache warm: the restore just read these files
    read_s = time.perf_counter() - start
    ratios = [r["peak_x_owned"] for r in rows if r["peak_x_owned"]]
    return {
        "seconds": seconds, "floor_s": read_s + h2d_s, "h2d_s": h2d_s, "read_s": read_s,
        "peak_x_owned": max(ratios) if ratios else None, "host_peak_gib": host_peak / 2**30,
        "devices": rows,
    }  # fmt: skip


def _device_row(device, owned: int) -> dict:
    stats = None
    with contextlib.suppress(Exception):  # some backends raise instead of returning None
        stats = device.memory_stats()
    peak = (stats or {}).get("peak_bytes_in_use")
    return {"id": device.id, "kind": device.device_kind, "owned": owned, "peak": peak,
            "peak_x_owned": peak / owned if peak and owned else None}  # fmt: skip


def render(result: dict, out_dir: str) -> str:
    """The cases' table, the save's figures and each device's peak of the last round."""
    from benchmarks import render as r
    from benchmarks.registry import BY_NAME

    p, gib = result["prepared"], 2**30
    lines = [*r.table(BY_NAME["gpu_memory"], result), ""]
    lines.append(
        f"Save of {p['shard_gib']:.2f} GiB of distinct shards: {p['save_s']:.2f} s; device-to-host "
        f"{p['d2h_s']:.2f} s, write floor {p['write_floor_s']:.2f} s: {p['save_x_floor']:.2f} x "
        f"the floor. `x floor` of a restore: / (read + `device_put`), same process."
    )
    runs = result["rounds"][-1]
    table = [
        "",
        "| case | device | owned GiB | peak GiB | peak / owned |",
        "|---|---|---:|---:|---:|",
    ]
    for case, run in runs.items():
        for d in run["devices"]:
            peak = f"{(d['peak'] or 0) / gib:.3f}"
            table.append(f"| `{case}` | {d['id']} {d['kind']} | {d['owned'] / gib:.3f} | {peak} "
                         f"| {d['peak_x_owned'] or 0:.2f} |")  # fmt: skip
    peaks = any(d["peak"] for run in runs.values() for d in run["devices"])
    lines += table if peaks else ["No device peaks: this backend has no `memory_stats` (CPU)."]
    return "\n".join([*lines, "", r.provenance(result)]) + "\n"
