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


def run_case(case: str, params: dict, work: str) -> dict:
    from tests._harness import run_workers

    shm = os.path.join("/dev/shm", "keras_orbax_bench", f"processes_{os.path.basename(work)}")
    shutil.rmtree(os.path.join(work, "persistent"), ignore_errors=True)
    workdir = os.path.join(work, f"w_{case}_{params['_round']}")
    os.makedirs(workdir, exist_ok=True)
    args = dict(params, case=case, work=work, shm=shm)
    try:
        reports = run_workers(__file__, 2, 4, args, timeout=3600, workdir=workdir)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    return reports[0]


if __name__ == "__main__":
    worker()
