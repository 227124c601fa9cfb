"""Per-device peak memory of a restore: keras-orbax `deferred_init` + `restore_sharded` against
Keras `load_weights("*.weights.h5")`.

Run (repository root, venv python with a jax build for the accelerator, e.g. jax[cuda12]):

    python benchmarks/gpu_memory.py                     # 4 GiB of float32 params, all devices
    python benchmarks/gpu_memory.py --with-optimizer    # + Adam's two slots (3 x the bytes)
    python benchmarks/gpu_memory.py --params-gib 1 --out /tmp/gpu_memory.json
    python benchmarks/gpu_memory.py --cpu-devices 8     # on CPU (0.05 GiB unless --params-gib)

The model (benchmarks/bench_model.py: Embedding, LayerNormalization, Dense blocks, compiled with
Adam) is sharded over a 1-D "model" mesh of every visible device: Dense kernels and the embedding
split their last dimension, the rest is replicated. One process saves it (`model.weights.h5` and
`keras_orbax.save`, random initial weights); then each case runs in a fresh process, because a
device's `peak_bytes_in_use` cannot be reset:

  ko_deferred  `with keras_orbax.deferred_init(): build`, then `keras_orbax.restore_sharded`
  keras_h5     build (variables initialized), then `model.load_weights("model.weights.h5")`

For every device it prints `owned` (bytes of the restored state's shards on that device), `peak`
(`device.memory_stats()["peak_bytes_in_use"]` after the restore) and peak/owned; 1.0 means that no
device ever held more than its own shards. Backends without memory_stats (CPU) show "n/a"; the
process's peak RSS minus its RSS after imports (host memory; on CPU also the devices' memory) is
reported on every backend. The default size (4 GiB, written and read as .weights.h5 and as keras-orbax) should finish
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


def save(spec: bm.ModelSpec, work: str, with_optimizer: bool) -> None:
    import keras_orbax

    set_distribution()
    model = bm.build_model(spec, build_optimizer=with_optimizer)
    model.save_weights(os.path.join(work, "model.weights.h5"))
    keras_orbax.save(model, os.path.join(work, "ko"), step=1)


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
        keras_orbax.restore_sharded(model, os.path.join(work, "ko"))
    else:
        model = bm.build_model(spec, build_optimizer=with_optimizer)
        model.load_weights(os.path.join(work, "model.weights.h5"))
    elapsed = time.perf_counter() - t
    owned = {d.id: 0 for d in devices}
    for v in bm.state_variables(model):
        for shard in v.value.addressable_shards:
            owned[shard.device.id] += shard.data.nbytes
    per_device = [device_row(d, owned[d.id]) for d in devices]
    return {
        "case": case,
        "build_and_restore_s": elapsed,
        "rss_import": rss_import,
        "peak_rss": bm.peak_rss_bytes(),
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
    if saved.returncode != 0:
        sys.exit("save failed:\n" + saved.stderr[-3000:])
    print(f"saved in {time.time() - t0:.0f} s")
    results = {"params_gib": args.params_gib, "layers": args.layers, "cases": []}
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
        save(spec, args.work_dir, args.with_optimizer)
    else:
        result = run_case(args.case, spec, args.work_dir, args.with_optimizer)
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
