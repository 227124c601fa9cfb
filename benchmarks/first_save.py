"""How long each background save of a `fit` blocks the loop in a fresh process, the first included.

    .venv/bin/python benchmarks/first_save.py [--runs 3] [--tf-site DIR] [--layers 8] [--width 2048]
        [--epochs 4] [--steps 4] [--settle 0] [--incremental 1] [--json PATH]
        [--profile PATH]

Each run is a fresh process: a Dense stack (`--layers` Dense(`--width`), Adam: three times the
parameters in state) under ModelParallel on 8 virtual CPU devices is compiled by one `fit` without a
callback, then trains `--epochs` epochs of `--steps` batches with `keras_orbax.ModelCheckpoint`
(`save_on_background=True`, the default) saving at every epoch end. Nothing of keras-orbax runs in
the process before that `fit`, so its first save is the first save of the process. A wrapper times
each hook, as `callback_benchmark.py` does; before `on_epoch_end` it waits, off the clock, for the
epoch's last train step to finish computing and for the previous background save to commit (a save
waits for the one before: that is saving more often than a save takes, not a cost of starting one).
After that `fit`, the same process times three sync `keras_orbax.save(..., incremental=False)` calls
of the same state (full saves: saved again incrementally, an unchanged state is all hard links) and
each save's blocked time is given as a ratio to their median. `--incremental 0` turns incremental
saves off in the callback too (a full fine-tune changes every shard anyway; see docs/incremental.md).

Keras's first serialization in a process tries to import TensorFlow, so where TensorFlow is installed
the first save can cost seconds. `--tf-site DIR` runs every run a second time with DIR on the
PYTHONPATH, alternating, e.g. after
`pip install --target DIR --no-deps tensorflow-cpu gast astunparse flatbuffers google-pasta termcolor`
(the rest of TensorFlow's dependencies are in the virtualenv already).

Besides the wall time, each save's CPU time on the loop's thread (`blocked_cpu_s`: a wait shows as
wall time without CPU time) and the full garbage collections run in it (`blocked_gc2_s`) are
recorded, and every collection during the `fit`, on any thread, by generation (`fit_collections`;
the full ones' seconds in `fit_full_collections_s`). `--settle S` sleeps S seconds before each save, off the clock (what is left is the save's
own cost, not a wait for what the train step left behind). `--devices`, `--mesh 0` (no
distribution) and `--compile-first 0` (the timed `fit` compiles) vary the setup. `--profile PATH`
writes a cProfile of each save of run 0 to PATH.<epoch> (PATH_tf.<epoch> with TensorFlow). Results
go to stdout and `--json` (default `benchmarks/_work/first_save/results.json`); docs/benchmarks.md
("The first save of a process") has the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
WORK = REPO_ROOT / "benchmarks" / "_work" / "first_save"


def child(args: argparse.Namespace) -> None:
    """One fresh process: the timed fit, then the sync saves; prints one JSON line."""
    os.environ["KERAS_BACKEND"] = "jax"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.devices}"
    ).strip()
    sys.path.insert(0, str(REPO_ROOT))
    import contextlib
    import cProfile
    import threading
    from collections.abc import Iterator

    import jax
    import keras
    import numpy as np
    from hook_timer import TimedCallback

    import keras_orbax

    if args.mesh:
        mesh = keras.distribution.DeviceMesh((2, 4), ("batch", "model"), jax.devices())
        layout_map = keras.distribution.LayoutMap(mesh)
        layout_map[".*kernel"] = ("batch", "model")
        keras.distribution.set_distribution(
            keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
        )
    inputs = keras.Input((args.width,))
    x = inputs
    for i in range(args.layers):
        x = keras.layers.Dense(args.width, activation="relu" if i < args.layers - 1 else None)(x)
    model = keras.Model(inputs, x)
    model.compile(optimizer=keras.optimizers.Adam(1e-4), loss="mse")
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((args.steps * 16, args.width), dtype="float32")
    ys = rng.standard_normal((args.steps * 16, args.width), dtype="float32")
    if args.compile_first:
        model.fit(xs, ys, batch_size=16, epochs=1, verbose=0)

    profile = cProfile.Profile() if args.profile else None  # one file per save: PATH.<epoch>
    windows: list[list[float]] = []  # wall-clock span of each timed save, to find it in a trace
    previous_save_waits: list[float] = []

    def before_epoch_end(epoch: int) -> None:
        # Off the clock: the previous background save, if still running (a save waits for it).
        start = time.perf_counter()
        if (pending := callback._saves.pending) is not None:
            pending.done.wait()
        previous_save_waits.append(time.perf_counter() - start)
        time.sleep(args.settle)

    @contextlib.contextmanager
    def around_epoch_end(epoch: int) -> Iterator[None]:
        if profile is not None:
            profile.enable()
        begun = time.time()
        yield
        windows.append([begun, time.time()])
        if profile is not None:
            profile.disable()
            profile.dump_stats(f"{args.profile}.{epoch}")
            profile.clear()

    directory = Path(args.directory)
    start = time.perf_counter()
    callback = keras_orbax.ModelCheckpoint(directory / "async", incremental=bool(args.incremental))
    construct_s = time.perf_counter() - start
    timed = TimedCallback(
        callback, before_epoch_end=before_epoch_end, around_epoch_end=around_epoch_end
    )
    model.fit(
        xs, ys, batch_size=16, epochs=args.epochs, verbose=0, shuffle=False, callbacks=[timed]
    )
    sync = []
    for i in range(3):
        jax.block_until_ready([v.value for v in model.variables + model.optimizer.variables])
        start = time.perf_counter()
        # Full saves: the same state saved again would be all hard links (incremental).
        keras_orbax.save(model, directory / "sync", step=i, incremental=False)
        sync.append(time.perf_counter() - start)
    state = model.variables + model.optimizer.variables
    print(
        json.dumps(
            {
                "state_mib": sum(int(np.prod(v.shape)) * 4 for v in state) / 2**20,
                "construct_s": construct_s,
                "on_train_begin_s": timed.seconds["on_train_begin"][0],
                "on_train_batch_end_total_s": sum(timed.seconds["on_train_batch_end"]),
                "blocked_s": timed.seconds["on_epoch_end"],
                "blocked_cpu_s": timed.seconds["on_epoch_end_cpu"],
                "blocked_gc2_s": timed.seconds["on_epoch_end_gc2"],
                "fit_collections": {g: len(c) for g, c in timed.collections.items()},
                "fit_full_collections_s": timed.collections[2],
                "save_windows_unix_s": windows,
                "main_thread_id": threading.get_native_id(),
                "on_train_end_s": timed.seconds["on_train_end"][0],
                "previous_save_wait_s": previous_save_waits,
                "sync_s": sync,
            }
        )
    )


def run_child(args: argparse.Namespace, run: int, tf_site: str | None) -> dict:
    """One fresh process; `tf_site`: a directory put on its PYTHONPATH (one holding TensorFlow)."""
    directory = WORK / f"run{run}"
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    command = [sys.executable, __file__, "--child", "--directory", str(directory)]
    for name in (
        "layers",
        "width",
        "epochs",
        "steps",
        "devices",
        "mesh",
        "compile_first",
        "settle",
        "incremental",
    ):
        command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    if args.profile and run == 0:
        command += ["--profile", f"{args.profile}{'_tf' if tf_site else ''}"]
    env = dict(os.environ)
    if tf_site:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [tf_site, env.get("PYTHONPATH")]))
    load = os.getloadavg()[0]
    output = subprocess.run(command, check=True, capture_output=True, text=True, env=env).stdout
    shutil.rmtree(directory, ignore_errors=True)
    result = json.loads(output.strip().splitlines()[-1])
    result["load_before"] = load
    result["sync_median_s"] = statistics.median(result["sync_s"])
    result["ratios"] = [t / result["sync_median_s"] for t in result["blocked_s"]]
    return result


def summarize(runs: list[dict]) -> dict:
    first = [r["ratios"][0] for r in runs]
    later = [ratio for r in runs for ratio in r["ratios"][1:]]
    return {
        "runs": len(runs),
        "state_mib": runs[0]["state_mib"],
        "first_blocked_median_s": statistics.median(r["blocked_s"][0] for r in runs),
        "first_blocked_cpu_median_s": statistics.median(r["blocked_cpu_s"][0] for r in runs),
        "later_blocked_median_s": statistics.median(t for r in runs for t in r["blocked_s"][1:]),
        "sync_median_s": statistics.median(r["sync_median_s"] for r in runs),
        "first_ratio_median": statistics.median(first),
        "first_ratio_max": max(first),
        "later_ratio_median": statistics.median(later),
        "later_ratio_max": max(later),
        "on_train_begin_median_s": statistics.median(r["on_train_begin_s"] for r in runs),
        "load_median": statistics.median(r["load_before"] for r in runs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="fresh processes per configuration")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--epochs", type=int, default=4, help="epochs (= saves) per fit")
    parser.add_argument("--steps", type=int, default=4, help="batches per epoch")
    parser.add_argument("--tf-site", default=None, help="a directory holding TensorFlow")
    parser.add_argument("--json", default=str(WORK / "results.json"))
    parser.add_argument("--profile", default=None, help="cProfiles of run 0's saves: PATH.<epoch>")
    parser.add_argument("--devices", type=int, default=8, help="virtual CPU devices")
    parser.add_argument("--mesh", type=int, default=1, help="0: no distribution")
    parser.add_argument(
        "--compile-first", type=int, default=1, help="0: no fit before the timed one"
    )
    parser.add_argument(
        "--settle", type=float, default=0.0, help="seconds slept before each save, off the clock"
    )
    parser.add_argument(
        "--incremental", type=int, default=1, help="ModelCheckpoint(incremental=...): 1 or 0"
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--directory", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return

    configurations = {"without TensorFlow": None}
    if args.tf_site:
        configurations["with TensorFlow"] = os.path.abspath(args.tf_site)
    runs: dict[str, list[dict]] = {name: [] for name in configurations}
    for run in range(args.runs):  # the configurations alternate: the load drifts
        for name, tf_site in configurations.items():
            result = run_child(args, run, tf_site)
            runs[name].append(result)
            blocked = ", ".join(f"{t:.3f}" for t in result["blocked_s"])
            ratios = ", ".join(f"{r:.3f}" for r in result["ratios"])
            collections = "/".join(str(n) for n in result["fit_collections"].values())
            print(
                f"{name}, run {run}: blocked {blocked} s; sync {result['sync_median_s']:.3f} s; "
                f"ratios {ratios}; on_train_begin {result['on_train_begin_s']:.3f} s; "
                f"collections in fit (generations 0/1/2) {collections}; "
                f"load {result['load_before']:.1f}",
                flush=True,
            )
    summaries = {name: summarize(results) for name, results in runs.items()}
    WORK.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"summary": summaries, "runs": runs}, indent=2))
    print(f"\n{os.cpu_count()} CPUs, 1-minute load average now {os.getloadavg()[0]:.1f}; medians:")
    for name, s in summaries.items():
        print(
            f"{name}: {s['state_mib']:.0f} MiB of state, {s['runs']} fresh processes; first save "
            f"blocked {s['first_blocked_median_s']:.3f} s (CPU {s['first_blocked_cpu_median_s']:.3f} "
            f"s; {s['first_ratio_median']:.3f} x sync, max {s['first_ratio_max']:.3f} x), later "
            f"{s['later_blocked_median_s']:.3f} s ({s['later_ratio_median']:.3f} x, max "
            f"{s['later_ratio_max']:.3f} x); sync save {s['sync_median_s']:.3f} s; on_train_begin "
            f"{s['on_train_begin_median_s']:.3f} s"
        )


if __name__ == "__main__":
    main()
