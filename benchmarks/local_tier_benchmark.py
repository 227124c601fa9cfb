"""The local tier of `ModelCheckpoint` (`local_directory` under /dev/shm): what a save after every
batch costs `fit`, and how soon a resumed `fit` trains again from it.

The model (`callback_benchmark.build_model`: 4 Dense layers, Adam; `mib` MiB of state in all,
variables and both Adam slots) trains `epochs` epochs of `steps` batches under ModelParallel on 8
virtual CPU devices, compiled by a `fit` beforehand. Every case's callback is wrapped so that each
batch's step has finished computing, off the clock, before the hooks run (the time inside them is
the time the loop is blocked); `plain` wraps a callback that does nothing, the same way.

`local_tier` (throughput and blocking; `seconds` runs from the first batch's end to the last's,
leaving out what `fit` does once, which on an accelerator is most of a short run):

    persistent  `ModelCheckpoint(directory)`, saving at each epoch's end: the run without the
                local tier (the floor)
    local       the same with `local_directory=<shm>, local_save_freq=every` (`--set every=N`)
    copy        the persistent tier's saves and, every `every` batches, the state's bytes written
                into files already in /dev/shm while the loop waits: what any local save costs
    plain       no checkpoint at all

`local_recovery` (`seconds` from the start of the resumed `fit` call to its first trained batch):

    floor       a `fit` of the same model with no checkpoint to its first batch, then the newest
                local step's files read into fresh memory (8 threads) and placed as the model's
                variables are
    recover     `ModelCheckpoint(..., local_directory=<shm>, resume=True)` from the step that
                `prepare` left there (mid-epoch, newer than the persistent tier's)
"""

from __future__ import annotations

import os
import shutil
import statistics
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from benchmarks import bench_model as bm
from benchmarks.callback_benchmark import BATCH, LAYERS, build_model


def _width(params: dict) -> int:
    # `mib` of state: float32 parameters and Adam's two slots, three copies.
    return int(round((params["mib"] * 2**20 / 3 / 4 / LAYERS) ** 0.5 / 64) * 64)


def _batch(params: dict) -> int:
    # `--set batch=N`: a larger batch for an accelerator, whose step the default makes tiny.
    return int(params.get("batch", BATCH))


def _data(params: dict):
    import numpy as np

    width = _width(params)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((params["steps"] * _batch(params), width), dtype="float32")
    y = rng.standard_normal((params["steps"] * _batch(params), width), dtype="float32")
    return x, y


def _shm(work: str) -> str:
    return os.path.join("/dev/shm", "keras_orbax_bench", os.path.basename(os.path.normpath(work)))


def _synced(inner):
    """`inner` wrapped: each batch's step is computed, off the clock, before its hooks run."""
    import time

    import jax
    import keras

    from benchmarks.hook_timer import TimedCallback

    class Synced(TimedCallback):
        def __init__(self, inner):
            super().__init__(inner)
            self.ends: list[float] = []  # when each batch's step had finished

        def on_train_batch_end(self, batch, logs=None):
            # Every array, not the variables: Keras's JAX loop updates those only when a
            # callback asks (as `ModelCheckpoint` does), which would wait for the step inside it.
            jax.block_until_ready(jax.live_arrays())
            self.ends.append(time.perf_counter())
            super().on_train_batch_end(batch, logs)

    return Synced(inner if inner is not None else keras.callbacks.Callback())


def _copy_floor(work: str, every: int):
    """The least a local save costs: every `every` batches, the state's shards written into files
    already in /dev/shm (one per shard, their pages allocated by the first save), by 8 threads,
    while the loop waits (`run_case` adds the persistent tier's callback beside it, as `local`
    has)."""
    import keras

    class CopyFloor(keras.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self.fds: list[int] = []

        def on_train_end(self, logs=None):
            for fd in self.fds:
                os.close(fd)

        def on_train_batch_end(self, batch, logs=None):
            if (batch + 1) % every:
                return
            self.model.jax_state_sync()
            shards = [
                memoryview(np.asarray(s.data)).cast("B")
                for v in bm.state_variables(self.model)
                for s in v.value.addressable_shards
                if s.replica_id == 0
            ]
            if not self.fds:
                os.makedirs(_shm(work), exist_ok=True)
                self.fds = [
                    os.open(os.path.join(_shm(work), str(i)), os.O_RDWR | os.O_CREAT)
                    for i in range(len(shards))
                ]
            with ThreadPoolExecutor(8) as pool:
                list(pool.map(os.pwrite, self.fds, shards, [0] * len(shards)))

    return CopyFloor()


def _persistent(work: str):
    import keras_orbax

    return keras_orbax.ModelCheckpoint(os.path.join(work, "persistent"))


def _checkpoint(work: str, every: int = 1, **kwargs):
    import keras_orbax

    return keras_orbax.ModelCheckpoint(
        os.path.join(work, "persistent"),
        local_directory=_shm(work),
        local_save_freq=every,
        **kwargs,
    )


def run_case(case: str, params: dict, work: str) -> dict:
    if case in ("floor", "recover"):
        return _recovery(case, params, work)
    model = build_model(_width(params))
    x, y = _data(params)
    model.fit(x, y, batch_size=_batch(params), epochs=1, verbose=0)  # compile
    for directory in (os.path.join(work, "persistent"), _shm(work)):
        shutil.rmtree(directory, ignore_errors=True)
    # `--set every=N`: a local save every N batches (on an accelerator, N steps at least twice
    # the state's transfer to the host let each save's fetch finish behind training).
    every = int(params.get("every", 1))
    inner = {
        "plain": lambda: None,
        "persistent": lambda: _persistent(work),
        "local": lambda: _checkpoint(work, every),
        "copy": lambda: _copy_floor(work, every),
    }[case]
    timed = _synced(inner())
    beside = [_persistent(work)] if case == "copy" else []  # the epoch-end saves `local` makes
    model.fit(x, y, batch_size=_batch(params), epochs=params["epochs"], shuffle=False, verbose=0,
              callbacks=[timed, *beside])  # fmt: skip
    steps_s = timed.ends[-1] - timed.ends[0]
    blocked = timed.seconds["on_train_batch_end"]
    if case in ("local", "copy"):
        blocked = blocked[every - 1 :: every]  # the batches that save
    shutil.rmtree(_shm(work), ignore_errors=True)
    return {
        "seconds": steps_s,
        "step_ms": 1e3 * steps_s / (len(timed.ends) - 1),
        "blocked_ms": 1e3 * statistics.mean(blocked),
        "blocked_max_ms": 1e3 * max(blocked),
        "state_mib": bm.resident_bytes([v.value for v in bm.state_variables(model)]) / 2**20,
    }


def prepare(params: dict, work: str) -> dict:
    """A run that crashes mid-epoch, after batch 1 of epoch 1: persistent steps at epoch ends,
    local steps after every batch, so that the newest step is a local one."""
    model = build_model(_width(params))
    x, y = _data(params)
    for directory in (os.path.join(work, "persistent"), _shm(work)):
        shutil.rmtree(directory, ignore_errors=True)
    checkpoint = _checkpoint(work, local_max_to_keep=1)
    crash_after(model, x, y, _batch(params), params["steps"] + 1, checkpoint)
    keep_left(work, _shm(work))
    return {"local_step": params["steps"] + 1}


def keep_left(work: str, local: str) -> None:
    """Keeps what the crashed run left (the local tier, the persistent tier) under `work/left`,
    for `put_back` to restore before each case: a resumed run writes steps of its own."""
    shutil.rmtree(os.path.join(work, "left"), ignore_errors=True)
    shutil.copytree(local, os.path.join(work, "left", "local"))
    shutil.copytree(os.path.join(work, "persistent"), os.path.join(work, "left", "persistent"))
    shutil.rmtree(local)


def put_back(work: str, local: str) -> None:
    """The directories as the crashed run left them (`keep_left`)."""
    for directory in (local, os.path.join(work, "persistent")):
        shutil.rmtree(directory, ignore_errors=True)
    shutil.copytree(os.path.join(work, "left", "local"), local)
    shutil.copytree(os.path.join(work, "left", "persistent"), os.path.join(work, "persistent"))


def first_trained_batch(start: int):
    """A callback that stops `fit` at its first trained batch, the first at or past `start`
    (Keras calls the hooks of the batches a resume drops too, without training them): `seconds`
    from its `clock` (set before `fit`) to that batch's step computed."""
    import jax
    import keras

    class FirstBatch(keras.callbacks.Callback):
        clock = None
        seconds = None

        def on_train_batch_end(self, batch, logs=None):
            if self.seconds is None and batch >= start:
                # Every array, not the variables: Keras's JAX loop updates those at its end.
                jax.block_until_ready(jax.live_arrays())
                self.seconds = bm.since(self.clock)[0]
                self.model.stop_training = True

    return FirstBatch()


class Crash(Exception):
    """Raised from a batch's hook, as a crash would end `fit` there."""


def crash_after(model, x, y, batch_size: int, step: int, checkpoint) -> None:
    """Trains with `checkpoint` until `step`, then ends `fit` as a crash would: no epoch end, no
    train end (a stopped `fit` still ends its epoch, and the persistent tier would save that
    step too). The local save of `step`, started in the background, is waited for."""
    import keras

    class CrashAt(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if int(self.model.optimizer.iterations.numpy()) == step:
                raise Crash(step)

    try:
        model.fit(x, y, batch_size=batch_size, epochs=2, shuffle=False, verbose=0,
                  callbacks=[checkpoint, CrashAt()])  # fmt: skip
    except Crash:
        checkpoint.wait_until_finished()
    else:
        raise RuntimeError(f"fit ended before step {step}")


def _recovery(case: str, params: dict, work: str) -> dict:
    import jax

    from keras_orbax._src.format import step_dirs

    put_back(work, _shm(work))
    model = build_model(_width(params))
    x, y = _data(params)

    # The resumed run starts at batch 1 of epoch 1 (`prepare` crashed after step steps + 1).
    first = first_trained_batch(0 if case == "floor" else 1)
    callbacks: list = [first]
    if case == "recover":
        # After `first`: the batch is trained when its step is, before the local save that
        # follows it (which `local_tier` measures).
        resume = _checkpoint(work, resume=True)
        callbacks.append(resume)
    first.clock = bm.clock()
    model.fit(
        x, y, batch_size=_batch(params), epochs=2, shuffle=False, verbose=0, callbacks=callbacks
    )
    result = {"first_batch_s": first.seconds}
    if case == "recover":
        restored = resume.restored
        if restored is None or restored.step != params["steps"] + 1:  # the local step
            raise RuntimeError(f"resumed from {restored}, not the local step {params['steps'] + 1}")
        return {**result, "seconds": first.seconds}
    step = step_dirs.committed_steps(_shm(work))[-1]
    clock = bm.clock()
    buffer = _read_into_one(os.path.join(_shm(work), str(step)))
    placed = [
        jax.device_put(host, v.value.sharding)
        for v, host in zip(bm.state_variables(model), _as_arrays(buffer, model), strict=True)
    ]
    jax.block_until_ready(placed)
    read_place_s = bm.since(clock)[0]
    return {**result, "read_place_s": read_place_s, "seconds": first.seconds + read_place_s}


def _read_into_one(path: str, threads: int = 8):
    """Every file under `path` read by `threads` threads into one fresh buffer, file after file."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    from benchmarks.harness import files_of

    files = files_of(path)
    sizes = [os.path.getsize(f) for f in files]
    buffer = np.empty(sum(sizes), np.uint8)
    starts = np.cumsum([0, *sizes[:-1]])

    def read(i: int) -> None:
        with open(files[i], "rb", buffering=0) as f:
            f.readinto(memoryview(buffer[starts[i] : starts[i] + sizes[i]]))

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(read, range(len(files))))
    return buffer


def _as_arrays(buffer, model) -> list:
    """The state variables' shapes over the bytes read, one after the other (views, no copy;
    the fast format's files hold the state's bytes, in another order)."""
    import numpy as np

    arrays, offset = [], 0
    for variable in bm.state_variables(model):
        dtype = np.dtype(variable.dtype)
        size = int(np.prod(variable.shape)) * dtype.itemsize
        if offset + size > len(buffer):
            raise ValueError(f"the step holds fewer bytes than the model's state ({len(buffer)})")
        arrays.append(buffer[offset : offset + size].view(dtype).reshape(variable.shape))
        offset += size
    return arrays
