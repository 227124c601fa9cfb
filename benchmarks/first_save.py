"""How long each background save of a `fit` blocks the loop in a fresh process, the first included.

    python -m benchmarks first_save [--repeats 3] [--set tf_site=DIR] [--set layers=8] ...

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
each save's blocked time is given as a ratio to their median. `incremental=0` turns incremental
saves off in the callback too (a full fine-tune changes every shard anyway; see docs/incremental.md).

Keras's first serialization in a process tries to import TensorFlow, so where TensorFlow is installed
the first save can cost seconds. `tf_site=DIR` adds the case `with_tf`: every run a second time with DIR on the
path, alternating, e.g. after
`pip install --target DIR --no-deps tensorflow-cpu gast astunparse flatbuffers google-pasta termcolor`
(the rest of TensorFlow's dependencies are in the virtualenv already).

Besides the wall time, each save's CPU time on the loop's thread (`blocked_cpu_s`: a wait shows as
wall time without CPU time) and the full garbage collections run in it (`blocked_gc2_s`) are
recorded, and every collection during the `fit`, on any thread, by generation (`fit_collections`;
the full ones' seconds in `fit_full_collections_s`). `settle=S` sleeps S seconds before each save, off the clock (what is left is the save's
own cost, not a wait for what the train step left behind). `devices`, `mesh=0` (no
distribution) and `compile_first=0` (the timed `fit` compiles) vary the setup. `profile=PATH`
writes a cProfile of each save of run 0 to PATH.<epoch> (PATH_tf.<epoch> with TensorFlow). The
case's figure is the first save's blocked time, its floor the median of the sync saves measured in
the same process; docs/dev/benchmarks-log.md ("The first save of a process") has the figures.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path


def run_case(case: str, params: dict, work: str) -> dict:
    """One fresh process: the timed fit, then the sync saves."""
    args = argparse.Namespace(**params)
    if case == "with_tf":
        sys.path.insert(0, os.path.abspath(args.tf_site))  # before Keras looks for TensorFlow
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.devices}"
    ).strip()
    import contextlib
    import cProfile
    import threading
    from collections.abc import Iterator

    import jax
    import keras
    import numpy as np

    import keras_orbax
    from benchmarks.hook_timer import TimedCallback

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

    profile = (
        cProfile.Profile() if args.profile and args._round == 0 else None
    )  # one file per save: PATH.<epoch>
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
            profile.dump_stats(f"{args.profile}{'_tf' if case == 'with_tf' else ''}.{epoch}")
            profile.clear()

    directory = Path(work) / case
    shutil.rmtree(directory, ignore_errors=True)
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
    shutil.rmtree(directory, ignore_errors=True)
    blocked = timed.seconds["on_epoch_end"]
    return {
        "seconds": blocked[0],
        "floor_s": statistics.median(sync),
        "first_cpu_s": timed.seconds["on_epoch_end_cpu"][0],
        "later_s": statistics.median(blocked[1:]) if len(blocked) > 1 else None,
        "later_x_sync": statistics.median(blocked[1:]) / statistics.median(sync)
        if len(blocked) > 1
        else None,
        "state_mib": sum(int(np.prod(v.shape)) * 4 for v in state) / 2**20,
        "construct_s": construct_s,
        "on_train_begin_s": timed.seconds["on_train_begin"][0],
        "on_train_batch_end_total_s": sum(timed.seconds["on_train_batch_end"]),
        "on_train_end_s": timed.seconds["on_train_end"][0],
        "fit_collections": {g: len(c) for g, c in timed.collections.items()},
        "fit_full_collections_s": timed.collections[2],
        "blocked_s": blocked,
        "blocked_cpu_s": timed.seconds["on_epoch_end_cpu"],
        "blocked_gc2_s": timed.seconds["on_epoch_end_gc2"],
        "save_windows_unix_s": windows,
        "main_thread_id": threading.get_native_id(),
        "previous_save_wait_s": previous_save_waits,
        "sync_s": sync,
    }
