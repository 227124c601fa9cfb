"""How long `fit` is blocked per checkpoint: keras-orbax async vs keras-orbax sync vs Keras's OrbaxCheckpoint.

    .venv/bin/python benchmarks/callback_benchmark.py [--mib 256] [--epochs 4] [--steps 8] [--json PATH]

One model (Dense stack, float32 parameters of about `--mib` MiB, Adam: three times that in state)
under ModelParallel on 8 virtual CPU devices trains `--epochs` epochs of `--steps` batches per
variant, saving at every epoch end:

- `keras_orbax async`: `keras_orbax.ModelCheckpoint(save_on_background=True)` (the default),
- `keras_orbax sync`: `keras_orbax.ModelCheckpoint(save_on_background=False)`,
- `keras OrbaxCheckpoint`: `keras.callbacks.OrbaxCheckpoint(save_on_background=True)` (Keras 3.15).

Each callback is wrapped (`hook_timer.TimedCallback`) so that the wall time spent inside its hooks
is measured: the time the training loop is blocked. Before `on_epoch_end`, the wrapper first waits,
off the clock, for the epoch's last train step to finish computing. "per save" is the
mean of the `on_epoch_end` hooks (where the saves start); `on_train_end` (waiting for the last
background save and closing) is reported apart, as is the wall time of the whole `fit` against a
`fit` without a callback. The same model keeps training across variants (compiled once); each
variant writes to its own fresh directory.
Results go to stdout and `--json` (default `benchmarks/_work/callback/results.json`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
WORK = REPO_ROOT / "benchmarks" / "_work" / "callback"

os.environ["KERAS_BACKEND"] = "jax"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
sys.path.insert(0, str(REPO_ROOT))

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
from hook_timer import TimedCallback  # noqa: E402

import keras_orbax  # noqa: E402

LAYERS = 4
BATCH = 16


def build_model(width: int) -> keras.Model:
    mesh = keras.distribution.DeviceMesh((2, 4), ("batch", "model"), jax.devices())
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*kernel"] = ("batch", "model")
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
    )
    inputs = keras.Input((width,))
    x = inputs
    for i in range(LAYERS):
        x = keras.layers.Dense(width, activation="relu" if i < LAYERS - 1 else None)(x)
    model = keras.Model(inputs, x)
    model.compile(optimizer=keras.optimizers.Adam(1e-4), loss="mse")
    return model


def variants(directory: Path) -> dict[str, keras.callbacks.Callback]:
    return {
        "keras_orbax async": keras_orbax.ModelCheckpoint(directory / "ko_async"),
        "keras_orbax sync": keras_orbax.ModelCheckpoint(
            directory / "ko_sync", save_on_background=False
        ),
        "keras OrbaxCheckpoint": keras.callbacks.OrbaxCheckpoint(directory / "keras_orbax_cb"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=float, default=256, help="float32 parameters, MiB")
    parser.add_argument("--epochs", type=int, default=4, help="epochs (= saves) per variant")
    parser.add_argument("--steps", type=int, default=8, help="batches per epoch")
    parser.add_argument("--json", default=str(WORK / "results.json"), help="where results go")
    args = parser.parse_args()

    width = int(round((args.mib * 2**20 / 4 / LAYERS) ** 0.5 / 64) * 64)
    model = build_model(width)
    n_params = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.steps * BATCH, width), dtype="float32")
    y = rng.standard_normal((args.steps * BATCH, width), dtype="float32")

    def fit(callbacks: list) -> float:
        start = time.perf_counter()
        model.fit(x, y, batch_size=BATCH, epochs=args.epochs, shuffle=False, verbose=0,
                  callbacks=callbacks)  # fmt: skip
        return time.perf_counter() - start

    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)  # compile
    results: dict = {
        "params_mib": n_params * 4 / 2**20,
        "state_mib": sum(
            int(np.prod(v.shape)) * 4 for v in model.variables + model.optimizer.variables
        )
        / 2**20,
        "width": width,
        "epochs": args.epochs,
        "steps_per_epoch": args.steps,
        "devices": jax.device_count(),
        "cpus": os.cpu_count(),
        "fit_without_callback_s": [fit([])],
        "variants": {},
    }
    for name, callback in variants(WORK).items():
        timed = TimedCallback(callback)
        wall = fit([timed])
        per_save = timed.seconds["on_epoch_end"]
        results["variants"][name] = {
            "blocked_per_save_s": statistics.mean(per_save),
            "blocked_per_save_median_s": statistics.median(per_save),
            "blocked_per_save_max_s": max(per_save),
            "blocked_saves_s": per_save,
            "on_train_begin_s": sum(timed.seconds["on_train_begin"]),
            "on_train_batch_end_total_s": sum(timed.seconds["on_train_batch_end"]),
            "on_train_end_s": sum(timed.seconds["on_train_end"]),
            "fit_s": wall,
        }

    results["fit_without_callback_s"].append(fit([]))  # before and after: this host is noisy
    sync = results["variants"]["keras_orbax sync"]["blocked_per_save_s"]
    for entry in results["variants"].values():
        entry["blocked_vs_keras_orbax_sync"] = entry["blocked_per_save_s"] / sync
    Path(args.json).write_text(json.dumps(results, indent=2))
    report(results)


def report(results: dict) -> None:
    print(
        f"\n{results['params_mib']:.0f} MiB of float32 parameters ({results['state_mib']:.0f} MiB "
        f"with Adam), {results['devices']} devices, {results['cpus']} CPUs; "
        f"{results['epochs']} saves x {results['steps_per_epoch']} batches; fit without a "
        "callback: " + " s, ".join(f"{t:.2f}" for t in results["fit_without_callback_s"]) + " s"
    )
    header = f"{'variant':<24}{'blocked/save':>14}{'median':>10}{'vs sync':>9}{'train_end':>11}{'fit':>9}"
    print(header)
    for name, entry in results["variants"].items():
        print(
            f"{name:<24}{entry['blocked_per_save_s']:>12.3f} s"
            f"{entry['blocked_per_save_median_s']:>8.3f} s{entry['blocked_vs_keras_orbax_sync']:>9.3f}"
            f"{entry['on_train_end_s']:>9.2f} s{entry['fit_s']:>7.2f} s"
        )


if __name__ == "__main__":
    main()
