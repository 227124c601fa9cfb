"""Save benchmark: a synchronous keras-orbax save against the durable write floor and other savers.

Each case runs in a fresh process that builds the state under `ModelParallel` on a (2, 4) mesh of 8
virtual CPU devices (Dense kernels sharded ("batch", "model"); with `many` (None, "model"), i.e. over
4 devices; biases replicated), fills it with random values, saves once untimed (warm-up: imports,
thread pools, first-call costs), then, with `os.sync()` untimed before each, times (the floor first
in even rounds, last in odd ones; every tree is deleted only after both):

  floor      every distinct shard (replica 0) written to its own file by 8 threads and fsync-ed:
             the bytes a save must make durable, with no format at all
  <case>     the saver, into an empty directory

"x floor" is the median over rounds of case / floor measured in the same process a moment before,
so both meet the same disk and the same load from other work.
"""

from __future__ import annotations

import os
import shutil
from functools import partial

from benchmarks import bench_model as bm
from benchmarks.harness import files_of

FLOOR_THREADS = 8


def build(layers: int, width: int, many: bool):
    import jax
    import keras

    rules = {r".*kernel": (None, "model") if many else ("batch", "model")}
    keras.distribution.set_distribution(bm.make_distribution(rules=rules))
    if many:
        model = bm.independent_dense(layers, width)
    else:
        model = keras.Sequential(
            [keras.Input((width,))] + [keras.layers.Dense(width) for _ in range(layers)]
        )
    if not many:
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
        model.optimizer.build(model.trainable_variables)
    variables = list(model.variables) + (list(model.optimizer.variables) if not many else [])
    for i, v in enumerate(variables):
        if len(v.shape) == 2:
            v.assign(jax.random.normal(jax.random.key(i), v.shape))
    jax.block_until_ready([v.value for v in variables])  # dispatch is asynchronous
    return model, variables


def save_floor(variables, directory: str) -> None:
    """Each distinct shard's bytes to its own file, written and fsync-ed by 8 threads."""
    shards = [s.data for v in variables for s in v.value.addressable_shards if s.replica_id == 0]
    bm.write_all(shards, directory, FLOOR_THREADS)


def save_case(case: str, model, variables, directory: str) -> None:
    import keras_orbax
    from keras_orbax._src.write import step_writer

    if case == "ko":
        keras_orbax.save(model, directory, step=1)
    elif case == "compact":
        keras_orbax.save(model, directory, step=1, format="compact")
    elif case == "ko_orbax":  # the fast format's options, Orbax's own array writer
        import orbax.checkpoint.experimental.v1 as ocp

        context = ocp.Context()
        for option, value in step_writer._FORMATS["fast"].items():
            setattr(context.array.saving, option, value)
        with ocp.training.Checkpointer(directory, context=context) as checkpointer:
            step_writer.write_step(checkpointer, model, step=1)
    elif case == "orbax_std":
        import orbax.checkpoint as ocp0

        checkpointer = ocp0.StandardCheckpointer()
        checkpointer.save(
            os.path.join(directory, "1"), {str(i): v.value for i, v in enumerate(variables)}
        )
        checkpointer.wait_until_finished()
        checkpointer.close()
    elif case == "keras_h5":
        os.makedirs(directory)
        model.save_weights(os.path.join(directory, "model.weights.h5"))
    else:
        raise ValueError(case)


def timed(fn) -> tuple[float, float]:
    os.sync()
    start = bm.clock()
    fn()
    return bm.since(start)


def prepare(params: dict, work: str) -> None:
    # 5000 variables' trees are 15,000 inodes each: deleted as each process ends, the next
    # process's writes would skip them (below), so the `many` runs keep them until the next run.
    shutil.rmtree(os.path.join(work, "trees"), ignore_errors=True)


def run_case(case: str, params: dict, work: str) -> dict:
    many = params.get("many", False)
    model, variables = build(params["layers"], params["width"], many)
    scratch = os.path.join(work, "trees", f"{params['_round']}-{case}") if many else work
    paths = {n: os.path.join(scratch, n) for n in ("warm", "floor", "case")}
    for path in paths.values():
        shutil.rmtree(path, ignore_errors=True)
    save_case(case, model, variables, paths["warm"])
    # Every tree stays until both are timed: ext4 without a journal (this machine's) skips inodes
    # deleted in the last minute when it allocates one, so a write right after another's delete
    # pays for it (the floor written twice, deleted between: 3.8 s then 10.6 s). The order
    # alternates between rounds, so neither is always the one after the other.
    writes = {
        "floor": partial(save_floor, variables, paths["floor"]),
        "case": partial(save_case, case, model, variables, paths["case"]),
    }
    order = ["case", "floor"] if params["_round"] % 2 else ["floor", "case"]
    times = {name: timed(writes[name]) for name in order}
    disk = sum(os.path.getsize(p) for p in files_of(paths["case"]))
    if not many:
        for path in paths.values():
            shutil.rmtree(path)
    os.sync()
    shard_bytes = sum(
        s.data.nbytes for v in variables for s in v.value.addressable_shards if s.replica_id == 0
    )
    return {
        "seconds": times["case"][0],
        "cpu_s": times["case"][1],
        "floor_s": times["floor"][0],
        "shard_gib": shard_bytes / 2**30,
        "disk_gib": disk / 2**30,
        "variables": len(variables),
    }
