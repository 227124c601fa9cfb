"""Per-device peak memory of a restore, and save and restore times against the hardware's floors:
keras-orbax `deferred_init` + `restore_sharded` against Keras `load_weights("*.weights.h5")`.

Run (repository root, venv python with a jax build for the accelerator, e.g. jax[cuda12]):

    python benchmarks/gpu_memory.py                     # 4 GiB of float32 params, all devices
    python benchmarks/gpu_memory.py --with-optimizer    # + Adam's two slots (3 x the bytes)
    python benchmarks/gpu_memory.py --params-gib 1 --out /tmp/gpu_memory.json
    python benchmarks/gpu_memory.py --cpu-devices 8     # on CPU (0.05 GiB unless --params-gib)

The model (benchmarks/bench_model.py: Embedding, LayerNormalization, Dense blocks, compiled with
Adam) is sharded over a 1-D "model" mesh of every visible device: Dense kernels and the embedding
split their last dimension, the rest is replicated. One process saves it (`model.weights.h5` and
`keras_orbax.save`, random initial weights) and then times, with `os.sync()` before each:

  device-to-host  `jax.device_get` of every distinct shard (replica 0)
  write floor     those host copies written to one file each and fsync-ed by 8 threads
  save            a second `keras_orbax.save` (the first pays first-call costs; reported apart)

and reports save / floor and save / (device-to-host + floor). Then each case runs in a fresh
process, because a device's `peak_bytes_in_use` cannot be reset:

  ko_deferred  `with keras_orbax.deferred_init(): build`, then `keras_orbax.restore_sharded`
  keras_h5     build (variables initialized), then `model.load_weights("model.weights.h5")`

For every device it prints `owned` (bytes of the restored state's shards on that device), `peak`
(`device.memory_stats()["peak_bytes_in_use"]` after the restore) and peak/owned; 1.0 means that no
device ever held more than its own shards. Backends without memory_stats (CPU) show "n/a"; the
process's peak RSS minus its RSS after imports (host memory; on CPU also the devices' memory) is
reported on every backend. After the peaks are taken, each case also times, in the same process:
`restore` (the `restore_sharded` or `load_weights` call alone, until the arrays are ready),
`device_put` of every addressable shard of the restored state (replicas counted) from fresh host
copies onto its device, the host-to-device floor, and reading the checkpoint's files with 8 threads
(page cache warm); it prints restore / device_put and restore / (read + device_put). On CPU,
`device_put` of host memory can alias it instead of copying: those ratios mean something on an
accelerator only. The default size (4 GiB, written and read as .weights.h5 and as keras-orbax) should finish
in a few minutes on one GPU; --timeout-s bounds each process. Results: --out (JSON).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time

import bench_model as bm

HERE = os.path.dirname(os.path.abspath(__file__))
CASES = ("ko_deferred", "keras_h5")


RULES = {r"block_\d+/kernel": (None, "model"), "embed/embeddings": (None, "model")}


def set_distribution():
    import jax
    import keras

    devices = jax.devices()
    dist = bm.make_distribution(devices, (len(devices),), ("model",), RULES)
    keras.distribution.set_distribution(dist)
    return devices


def save(spec: bm.ModelSpec, work: str, with_optimizer: bool) -> dict:
    """Saves the checkpoints the cases restore, then times a second `keras_orbax.save` against
    copying the same shards to the host and writing them durably (the floor)."""
    import jax
    import numpy as np

    import keras_orbax

    set_distribution()
    model = bm.build_model(spec, build_optimizer=with_optimizer)
    state = bm.state_variables(model)
    jax.block_until_ready([v.value for v in state])  # initializers dispatch asynchronously
    model.save_weights(os.path.join(work, "model.weights.h5"))
    start = time.perf_counter()
    keras_orbax.save(model, os.path.join(work, "ko"), step=1)  # the cases restore this one
    first_save_s = time.perf_counter() - start
    shards = [s.data for v in state for s in v.value.addressable_shards if s.replica_id == 0]
    start = time.perf_counter()
    host = [np.asarray(a) for a in jax.device_get(shards)]
    d2h_s = time.perf_counter() - start
    os.sync()
    floor_s = write_floor(host, os.path.join(work, "floor"))
    os.sync()
    start = time.perf_counter()
    keras_orbax.save(model, os.path.join(work, "ko_timed"), step=1)
    save_s = time.perf_counter() - start
    for name in ("floor", "ko_timed"):
        shutil.rmtree(os.path.join(work, name))
    return {
        "shard_bytes": sum(a.nbytes for a in host),
        "first_save_s": first_save_s,
        "save_s": save_s,
        "d2h_s": d2h_s,
        "write_floor_s": floor_s,
        "save_x_floor": save_s / floor_s,
        "save_x_d2h_plus_floor": save_s / (d2h_s + floor_s),
    }


def write_floor(buffers, directory: str) -> float:
    """Seconds to write each host buffer to its own file and fsync it, 8 threads (as
    save_benchmark.py's floor, less the device-to-host copy, timed apart here)."""
    from concurrent.futures import ThreadPoolExecutor

    os.makedirs(directory)

    def write(job) -> None:
        i, data = job
        fd = os.open(os.path.join(directory, str(i)), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            view, done = memoryview(data.reshape(-1).view("uint8")), 0
            while done < len(view):
                done += os.write(fd, view[done:])
            os.fsync(fd)
        finally:
            os.close(fd)

    start = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(write, enumerate(buffers)))
    return time.perf_counter() - start


def read_floor(path: str) -> float:
    """Seconds to read every file under `path` (or the file `path`), 8 threads."""
    from concurrent.futures import ThreadPoolExecutor

    files = (
        [path]
        if os.path.isfile(path)
        else [os.path.join(d, n) for d, _, names in os.walk(path) for n in names]
    )

    def read(name: str) -> int:
        with open(name, "rb", buffering=0) as f:
            return len(f.read())

    start = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        sum(pool.map(read, files))
    return time.perf_counter() - start


def host_to_device(state) -> dict:
    """Times `jax.device_put` of every addressable shard of the restored state (replicas
    counted), from host copies, onto the device that holds it: the bytes a restore must move."""
    import jax
    import numpy as np

    shards = [s for v in state for s in v.value.addressable_shards]
    host = [np.array(s.data) for s in shards]  # fresh host buffers (untimed)
    devices = [s.device for s in shards]
    jax.block_until_ready(jax.device_put(host[:1], devices[:1]))  # first-call costs
    start = time.perf_counter()
    jax.block_until_ready(jax.device_put(host, devices))
    seconds = time.perf_counter() - start
    nbytes = sum(h.nbytes for h in host)
    return {"h2d_s": seconds, "h2d_bytes": nbytes, "h2d_gb_per_s": nbytes / seconds / 1e9}


def run_case(case: str, spec: bm.ModelSpec, work: str, with_optimizer: bool) -> dict:
    import keras

    import keras_orbax

    devices = set_distribution()
    rss_import = bm.rss_bytes()
    t = time.perf_counter()
    if case == "ko_deferred":
        optimizer = keras.optimizers.Adam(
            1e-3
        )  # outside the scope: its variables come from numbers
        with keras_orbax.deferred_init():
            model = bm.build_model(spec, optimizer, build_optimizer=with_optimizer)
        artifact, start = os.path.join(work, "ko"), time.perf_counter()
        keras_orbax.restore_sharded(model, artifact)
    else:
        model = bm.build_model(spec, build_optimizer=with_optimizer)
        artifact, start = os.path.join(work, "model.weights.h5"), time.perf_counter()
        model.load_weights(artifact)
    import jax

    jax.block_until_ready([v.value for v in bm.state_variables(model)])
    end = time.perf_counter()
    elapsed, restore_s = end - t, end - start
    owned = {d.id: 0 for d in devices}
    for v in bm.state_variables(model):
        for shard in v.value.addressable_shards:
            owned[shard.device.id] += shard.data.nbytes
    per_device = [device_row(d, owned[d.id]) for d in devices]  # before h2d allocates again
    peak_rss = bm.peak_rss_bytes()
    h2d = host_to_device(bm.state_variables(model))
    read_s = read_floor(artifact)  # page cache warm: the restore just read these files
    return {
        "case": case,
        "build_and_restore_s": elapsed,
        "restore_s": restore_s,
        **h2d,
        "read_s": read_s,
        "restore_x_h2d": restore_s / h2d["h2d_s"],
        "restore_x_read_plus_h2d": restore_s / (read_s + h2d["h2d_s"]),
        "rss_import": rss_import,
        "peak_rss": peak_rss,
        "devices": per_device,
    }


def device_row(device, owned: int) -> dict:
    stats = None
    with contextlib.suppress(Exception):  # some backends raise instead of returning None
        stats = device.memory_stats()
    peak = (stats or {}).get("peak_bytes_in_use")
    return {
        "id": device.id,
        "kind": device.device_kind,
        "owned": owned,
        "peak": peak,
        "peak_x_owned": peak / owned if peak and owned else None,
    }


def child(args, mode: str, *extra: str) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        mode,
        "--params-gib",
        str(args.params_gib),
        "--layers",
        str(args.layers),
        "--work-dir",
        args.work_dir,
        "--cpu-devices",
        str(args.cpu_devices),
        *(["--with-optimizer"] if args.with_optimizer else []),
        *extra,
    ]
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout_s)


def default_size(args) -> float:
    """4 GiB on accelerators, 0.05 GiB on CPU (probed in a subprocess: the parent never imports jax)."""
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    probe = subprocess.run(
        [sys.executable, "-c", "import jax; print(jax.default_backend())"],
        env=env,
        capture_output=True,
        text=True,
    )
    backend = probe.stdout.strip() or "cpu"
    return 0.05 if backend == "cpu" or args.cpu_devices else 4.0


def print_case(r: dict) -> None:
    gib = 2**30
    host = (r["peak_rss"] - r["rss_import"]) / gib
    print(
        f"\n{r['case']}: build + restore {r['build_and_restore_s']:.1f} s, host peak RSS - import RSS {host:.2f} GiB"
    )
    print(
        f"  restore {r['restore_s']:.2f} s; device_put of the same {r['h2d_bytes'] / gib:.2f} GiB "
        f"{r['h2d_s']:.2f} s ({r['h2d_gb_per_s']:.1f} GB/s): {r['restore_x_h2d']:.2f} x; reading "
        f"the files {r['read_s']:.2f} s: restore / (read + device_put) "
        f"{r['restore_x_read_plus_h2d']:.2f} x"
    )
    print(f"  {'device':<28} {'owned GiB':>10} {'peak GiB':>10} {'peak/owned':>11}")
    peaks = [d["peak"] for d in r["devices"]]
    total = {"id": "all", "kind": "", "owned": sum(d["owned"] for d in r["devices"])}
    total["peak"] = None if None in peaks else sum(peaks)
    total["peak_x_owned"] = total["peak"] / total["owned"] if total["peak"] else None
    for d in [*r["devices"], total]:
        peak = "n/a" if d["peak"] is None else f"{d['peak'] / gib:.3f}"
        ratio = "n/a" if d["peak_x_owned"] is None else f"{d['peak_x_owned']:.2f}"
        print(
            f"  {str(d['id']) + ' ' + d['kind']:<28} {d['owned'] / gib:>10.3f} {peak:>10} {ratio:>11}"
        )


def print_save(r: dict) -> None:
    print(
        f"save of {r['shard_bytes'] / 2**30:.2f} GiB of distinct shards: first {r['first_save_s']:.2f} s, "
        f"then {r['save_s']:.2f} s; device-to-host {r['d2h_s']:.2f} s, write floor "
        f"{r['write_floor_s']:.2f} s: {r['save_x_floor']:.2f} x the floor, "
        f"{r['save_x_d2h_plus_floor']:.2f} x (device-to-host + floor)"
    )


def main_parent(args) -> None:
    t0 = time.time()
    if args.params_gib is None:
        args.params_gib = default_size(args)
    shutil.rmtree(args.work_dir, ignore_errors=True)
    os.makedirs(args.work_dir)
    spec = bm.ModelSpec(args.params_gib, args.layers)
    slots = "with Adam's slots" if args.with_optimizer else "no optimizer slots"
    gib = spec.n_params() * 4 / 2**30
    print(
        f"model: {spec.n_params() / 1e6:.0f} M params ({gib:.2f} GiB), {slots}, width {spec.width}"
    )
    saved = child(args, "save")
    lines = [ln for ln in saved.stdout.splitlines() if ln.startswith("RESULT ")]
    if saved.returncode != 0 or not lines:
        sys.exit("save failed:\n" + saved.stderr[-3000:])
    timings = json.loads(lines[-1][len("RESULT ") :])
    print_save(timings)
    print(f"saved in {time.time() - t0:.0f} s")
    results = {"params_gib": args.params_gib, "layers": args.layers, "save": timings, "cases": []}
    for case in CASES:
        proc = child(args, "case", "--case", case)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            print(f"\n{case}: FAILED\n{proc.stderr[-2000:]}")
            results["cases"].append({"case": case, "error": proc.stderr[-2000:]})
            continue
        r = json.loads(lines[-1][len("RESULT ") :])
        results["cases"].append(r)
        print_case(r)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"\nwrote {args.out}; total {time.time() - t0:.0f} s")
    if not args.keep:
        shutil.rmtree(args.work_dir, ignore_errors=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--params-gib", type=float, default=None, help="default: 4 (accelerators), 0.05 (CPU)"
    )
    p.add_argument("--layers", type=int, default=15)
    p.add_argument(
        "--with-optimizer", action="store_true", help="also build and restore Adam's slots"
    )
    p.add_argument(
        "--cpu-devices", type=int, default=0, help="force N virtual CPU devices (CPU runs)"
    )
    p.add_argument("--work-dir", default=os.path.join(HERE, "_work", "gpu_memory"))
    p.add_argument("--out", default=os.path.join(HERE, "_work", "gpu_memory.json"))
    p.add_argument("--timeout-s", type=int, default=600, help="per process")
    p.add_argument("--keep", action="store_true", help="keep the saved checkpoints")
    p.add_argument("--child", choices=["save", "case"], help=argparse.SUPPRESS)
    p.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if not args.child:
        return main_parent(args)
    bm.set_env(cpu_devices=args.cpu_devices or None)
    spec = bm.ModelSpec(args.params_gib, args.layers)
    if args.child == "save":
        print("RESULT " + json.dumps(save(spec, args.work_dir, args.with_optimizer)), flush=True)
    else:
        result = run_case(args.case, spec, args.work_dir, args.with_optimizer)
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
