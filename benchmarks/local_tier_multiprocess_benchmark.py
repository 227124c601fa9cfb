"""The local tier of `ModelCheckpoint` under `jax.distributed`: what a save after every batch costs
`fit` when each process keeps its part of the step in its own folder under /dev/shm and sends it
to its peer (`runtime/ring.py`), with 2 processes x 4 CPU devices on 127.0.0.1 (gloo over TCP).

The model (`callback_benchmark.build_model`: 4 Dense layers, Adam; `mib` MiB of state in all,
about half of it held by each process) trains `epochs` epochs of `steps` batches under
ModelParallel on the 8 devices of the 2 processes, compiled by a `fit` beforehand, each process
feeding its own half of every batch. As in `local_tier_benchmark`, every case's callback is
wrapped so that each batch's step has finished computing, off the clock, before the hooks run.
Reported from process 0 (`seconds` is the `fit`):

    plain       no checkpoint (the floor)
    local       `ModelCheckpoint(directory, local_directory=<shm>/<process>, local_save_freq=1)`,
                the persistent tier saving at each epoch's end

`local_recovery_processes` (`seconds` from the start of the resumed `fit` call, in a fresh pair
of processes, to its first trained batch; `prepare` crashes a run mid-epoch, its newest step a
local one, and each case starts from a copy of what it left):

    floor         a `fit` of the same model with no checkpoint to its first batch, then each
                  process's own part of the newest local step read into fresh memory and placed
                  on its devices
    recover       `ModelCheckpoint(..., local_directory=<shm>/<process>, resume=True)`
    recover_peer  the same after process 1's local directory is deleted (its machine replaced):
                  its part comes from process 0's replica, over the ring
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
from pathlib import Path

if __name__ == "__main__":  # a worker, started as a script by tests/_harness.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def worker() -> None:
    from tests._worker_util import init_worker, write_result

    ctx = init_worker()
    import keras

    import keras_orbax
    from benchmarks import bench_model as bm
    from benchmarks.callback_benchmark import BATCH, build_model
    from benchmarks.local_tier_benchmark import _data, _synced, _width

    params, work = ctx.args, ctx.args["work"]
    keras.utils.set_random_seed(0)  # the same initial state on every process
    model = build_model(_width(params))
    keras.distribution.distribution().auto_shard_dataset = False  # each feeds its own half
    x, y = _data(params)
    if params["case"] in RECOVERY_CASES:
        write_result(_recovery(params["case"], ctx.process_id, params, model, x, y))
        return
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)  # compile
    local = os.path.join(ctx.args["shm"], f"process_{ctx.process_id}")
    checkpoint = None
    if params["case"] == "local":
        checkpoint = keras_orbax.ModelCheckpoint(
            os.path.join(work, "persistent"), local_directory=local, local_save_freq=1
        )
    timed = _synced(checkpoint)
    clock = bm.clock()
    model.fit(x, y, batch_size=BATCH, epochs=params["epochs"], shuffle=False, verbose=0,
              callbacks=[timed])  # fmt: skip
    fit_s = bm.since(clock)[0]
    blocked = timed.seconds["on_train_batch_end"]
    steps = params["epochs"] * params["steps"]
    shutil.rmtree(local, ignore_errors=True)
    write_result(
        {
            "seconds": fit_s,
            "step_ms": 1e3 * fit_s / steps,
            "blocked_ms": 1e3 * statistics.mean(blocked),
            "blocked_max_ms": 1e3 * max(blocked),
            "state_mib": sum(v.value.nbytes for v in bm.state_variables(model)) / 2**20,
        }
    )


RECOVERY_CASES = ("prepare", "floor", "recover", "recover_peer")


def _recovery(case: str, process: int, params: dict, model, x, y) -> dict:
    """One process's part of a recovery case (see the module's doc)."""
    import jax

    import keras_orbax
    from benchmarks import bench_model as bm
    from benchmarks.callback_benchmark import BATCH
    from benchmarks.local_tier_benchmark import crash_after, first_trained_batch

    local = os.path.join(params["shm"], f"process_{process}")
    persistent = os.path.join(params["work"], "persistent")
    steps = params["steps"]
    if case == "prepare":
        checkpoint = keras_orbax.ModelCheckpoint(
            persistent, local_directory=local, local_save_freq=1, local_max_to_keep=1
        )
        crash_after(model, x, y, BATCH, steps + 1, checkpoint)
        return {"local_step": steps + 1}

    first = first_trained_batch(0 if case == "floor" else 1)  # a resume goes on at batch 1
    callbacks: list = [first]
    if case != "floor":
        # After `first`: the batch is trained when its step is, before the local save that
        # follows it (which `local_tier_processes` measures).
        resume = keras_orbax.ModelCheckpoint(persistent, local_directory=local, resume=True)
        callbacks.append(resume)
    first.clock = bm.clock()
    model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
    if case != "floor":
        restored = resume.restored
        if restored is None or restored.step != steps + 1:  # the local step, not the epoch's end
            raise RuntimeError(f"resumed from {restored}, not the local step {steps + 1}")
        return {"first_batch_s": first.seconds, "seconds": first.seconds}
    clock = bm.clock()
    jax.block_until_ready(_read_and_place(os.path.join(local, f"process_{process}"), model))
    read_place_s = bm.since(clock)[0]
    return {
        "first_batch_s": first.seconds,
        "read_place_s": read_place_s,
        "seconds": first.seconds + read_place_s,
    }


def _read_and_place(folder: str, model) -> list:
    """The newest part's bytes in `folder` read into fresh memory, and each variable's shards on
    this process's devices taken from them in turn (what a restore of the part must move)."""
    import jax
    import numpy as np

    from benchmarks import bench_model as bm

    step = max(int(name) for name in os.listdir(folder) if name.isdecimal())
    path = os.path.join(folder, str(step), "part.bin")
    buffer = np.empty(os.path.getsize(path), np.uint8)
    with open(path, "rb", buffering=0) as f:
        view = memoryview(buffer)
        while view:
            view = view[f.readinto(view) :]
    placed, offset = [], 0
    for variable in bm.state_variables(model):
        value = variable.value
        taken: dict = {}
        shards = []
        for shard in value.addressable_shards:
            key = str(shard.index)
            if key not in taken:
                size = shard.data.nbytes
                taken[key] = buffer[offset : offset + size].view(value.dtype)
                taken[key] = taken[key].reshape(shard.data.shape)
                offset += size
            shards.append(jax.device_put(taken[key], shard.device))
        placed.append(jax.make_array_from_single_device_arrays(value.shape, value.sharding, shards))
    return placed


def run_case(case: str, params: dict, work: str) -> dict:
    if case in RECOVERY_CASES:
        return _run_recovery(case, params, work)
    shm = os.path.join("/dev/shm", "keras_orbax_bench", f"processes_{os.path.basename(work)}")
    shutil.rmtree(os.path.join(work, "persistent"), ignore_errors=True)
    try:
        return _workers(case, params, work, shm)
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def prepare(params: dict, work: str) -> dict:
    """A run of 2 processes that crashes mid-epoch (persistent steps at epoch ends, local steps
    after every batch), what it left kept under `work` for every case to start from."""
    from benchmarks.local_tier_benchmark import keep_left

    shm = _recovery_shm(work)
    for directory in (shm, os.path.join(work, "persistent")):
        shutil.rmtree(directory, ignore_errors=True)
    report = _workers("prepare", params, work, shm)
    keep_left(work, shm)
    return report


def _run_recovery(case: str, params: dict, work: str) -> dict:
    from benchmarks.local_tier_benchmark import put_back

    shm = _recovery_shm(work)
    put_back(work, shm)
    if case == "recover_peer":
        shutil.rmtree(os.path.join(shm, "process_1"))  # its part and its replica of process 0's
    try:
        return _workers(case, params, work, shm)
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def _recovery_shm(work: str) -> str:
    return os.path.join("/dev/shm", "keras_orbax_bench", f"recovery_{os.path.basename(work)}")


def _workers(case: str, params: dict, work: str, shm: str) -> dict:
    from tests._harness import run_workers

    workdir = os.path.join(work, f"w_{case}_{params.get('_round', 0)}")
    os.makedirs(workdir, exist_ok=True)
    args = dict(params, case=case, work=work, shm=shm)
    return run_workers(__file__, 2, 4, args, timeout=3600, workdir=workdir)[0]


if __name__ == "__main__":
    worker()
