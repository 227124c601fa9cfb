"""Worker for tests/test_multihost.py: one process of a `jax.distributed` cluster.

args: {"tasks": [task, ...]}, each task {"action": ..., "directory": ..., plus what it needs}, run
in turn in the one cluster; the result is {"tasks": [what each returned, in order]}.
- "write": save `mlp` (arange values) at step 1 on a (2, 4) mesh, then train it with `ModelCheckpoint`
  (resume, async) and write every trained variable (gathered) to <workdir>/trained.npz from process 0.
- "read": restore step 1 under each of args["layouts"]; report per layout the values that differ and
  the bytes read and received (ours) and read (/proc/self/io) against this process's shard bytes. A
  layout ending ":on" or ":off" restores with `single_replica_reads` True or False; else the default.
  With args["trained"]
  and args["reference"] (the writer's npz), also `load_model` the latest trained step and compare.
- "save_killed": save step 1, then step 2; process 1 SIGKILLs itself just before it opens its first
  file of step 2 (an audit hook): the step's temporary directory exists, nothing is committed.
- "read_expect_error": restore step 1 of each of args["directories"] (`single_replica_reads=True`);
  report the error each got.
- "read_own_view": each process restores the latest step of its own args["directories"][i].
- "bucket": args["directory"] is an object-store URL: save `mlp` (arange values) at step 1 under the
  "replicated" layout, then "read" it under args["layouts"] (replicas read once: the default there).
"""

from __future__ import annotations

import os
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import jax
import keras
import numpy as np
from jax.experimental import multihost_utils

import keras_orbax
from tests import _models
from tests._worker_util import init_worker, write_result

# keras_orbax imports its verbs on first use: import them now, so that the memory and bytes
# measured below are the restore's, not the loading of its modules.
for _name in keras_orbax.__all__:
    getattr(keras_orbax, _name)

# Kernels (16, 4096) and (4096, 8): 384 KiB, far more than the metadata a restore reads.
WIDTH = 4096
SWITCHES = {"": None, "on": True, "off": False}  # layout suffix -> single_replica_reads
_WRITING = os.O_WRONLY | os.O_RDWR


def _rchar() -> int:
    with open("/proc/self/io") as io:
        return next(int(line.split()[1]) for line in io if line.startswith("rchar:"))


def _own_shard_bytes(model: keras.Model) -> int:
    """Bytes of the distinct shards this process's devices hold."""
    total = 0
    for variable in model.variables:
        shards = {repr(s.index): s.data.nbytes for s in variable.value.addressable_shards}
        total += sum(shards.values())
    return total


def _distribution(layout: str) -> keras.distribution.Distribution:
    if layout == "dp":
        return _models.data_parallel()
    if layout == "replicated":  # kernels split over "model" only: replicated over "batch"
        mesh = keras.distribution.DeviceMesh((4, 2), ("batch", "model"), jax.devices())
        layout_map = keras.distribution.LayoutMap(mesh)
        layout_map[".*kernel"] = (None, "model")
        return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
    if layout == "transposed":  # another LayoutMap: kernels split the other way round
        mesh = keras.distribution.DeviceMesh((2, 4), ("batch", "model"), jax.devices())
        layout_map = keras.distribution.LayoutMap(mesh)
        layout_map[".*kernel"] = ("model", "batch")
        return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
    rows, cols = (int(n) for n in layout.split("x"))
    return _models.model_parallel((rows, cols))


def write(directory: Path, workdir: Path) -> dict:
    distribution = _models.model_parallel((2, 4))
    distribution.auto_shard_dataset = False  # each process feeds its own rows (_local_batches)
    keras.distribution.set_distribution(distribution)
    model = _models.mlp(width=WIDTH)
    _models.fill_arange(model)
    keras_orbax.save(model, directory / "arange", step=1)

    trained = _models.compile_adam(_models.mlp())
    checkpoint = keras_orbax.ModelCheckpoint(directory / "trained", monitor="loss", max_to_keep=2)
    x = np.linspace(0, 1, 32 * 16, dtype="float32").reshape(32, 16)
    y = np.linspace(1, 0, 32 * 8, dtype="float32").reshape(32, 8)
    data = _local_batches(x, y)
    trained.fit(data, epochs=2, steps_per_epoch=4, callbacks=[checkpoint], verbose=0)
    gathered = {
        v.path: np.asarray(multihost_utils.process_allgather(v.value, tiled=True))
        for v in trained.variables + trained.optimizer.variables
    }
    if jax.process_index() == 0:
        np.savez(workdir / "trained.npz", **{k.replace("/", "|"): v for k, v in gathered.items()})
    return {"steps": keras_orbax.inspect(directory / "trained").steps}


def _local_batches(x: np.ndarray, y: np.ndarray):
    """Global batches of 8 rows; each process yields its own rows, Keras assembles the global arrays."""
    per_process = 8 // jax.process_count()
    start = jax.process_index() * per_process
    while True:
        for i in range(0, len(x), 8):
            rows = slice(i + start, i + start + per_process)
            yield x[rows], y[rows]


def read(
    directory: Path | str, layouts: list[str], trained: str | None, reference: str | None
) -> dict:
    report: dict = {}
    # XLA reads ~0.8 MB of files the first time it compiles in a process (a restore that shares
    # replicas compiles its collective): not restore I/O, so done before measuring.
    jax.jit(lambda x: x + 1)(np.zeros(2, "float32")).block_until_ready()
    for layout in layouts:
        name, _, switch = layout.partition(":")
        keras.distribution.set_distribution(_distribution(name))
        with keras_orbax.deferred_init():
            model = _models.mlp(width=WIDTH)
        before = _rchar()
        result = keras_orbax.restore_sharded(
            model, directory, single_replica_reads=SWITCHES[switch]
        )
        read_by_os = _rchar() - before
        mismatches = _compare_with_arange(model)
        report[layout] = {
            "bytes_read": result.bytes_read,
            "bytes_received": result.bytes_received,
            "rchar": read_by_os,
            "own_shard_bytes": _own_shard_bytes(model),
            "mismatches": mismatches,
            "sharding_ok": all(
                v.value.sharding.is_equivalent_to(
                    keras.distribution.distribution().get_variable_layout(v).backend_layout,
                    v.value.ndim,
                )
                for v in model.variables
            ),
        }
    if trained and reference:
        keras.distribution.set_distribution(_models.model_parallel((4, 2)))
        model = keras_orbax.load_model(trained)
        saved = np.load(reference)
        wrong = []
        for variable in model.variables + model.optimizer.variables:
            want = saved[variable.path.replace("/", "|")]
            for shard in variable.value.addressable_shards:
                if not np.array_equal(np.asarray(shard.data), want[shard.index]):
                    wrong.append(variable.path)
        report["load_model"] = {"wrong": wrong, "iterations": int(model.optimizer.iterations)}
    return report


def _compare_with_arange(model: keras.Model) -> list[str]:
    expected = _models.arange_values([v.shape for v in model.variables])
    wrong = []
    for variable, want in zip(model.variables, expected, strict=True):
        for shard in variable.value.addressable_shards:
            if not np.array_equal(np.asarray(shard.data), want[shard.index]):
                wrong.append(f"{variable.path} on device {shard.device.id}")
    return wrong


def save_killed(directory: Path) -> dict:
    keras.distribution.set_distribution(_models.model_parallel((2, 4)))
    model = _models.mlp()
    keras_orbax.save(model, directory, step=1)
    if jax.process_index() == 1:
        sys.addaudithook(_kill_at_first_write(f"{directory}/2.orbax-checkpoint-tmp"))
    keras_orbax.save(model, directory, step=2)
    return {"finished": True}


def _kill_at_first_write(prefix: str):
    """An audit hook that SIGKILLs this process just before it opens a file under `prefix` for
    writing (`open()` or `os.open`): in the middle of that save, whatever its speed."""

    def hook(event: str, args: tuple) -> None:
        # args: path, mode, the flags given to open(2) (both calls)
        if event == "open" and str(args[0]).startswith(prefix) and args[2] & _WRITING:
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


def read_expect_error(directories: list[str]) -> list[dict]:
    """Restores step 1 of each directory, each replicated region read by one process only;
    reports the error each restore raised."""
    keras.distribution.set_distribution(_models.model_parallel((2, 4)))
    reports = []
    for directory in directories:
        with keras_orbax.deferred_init():
            model = _models.mlp(width=WIDTH)
        start = time.monotonic()
        try:
            keras_orbax.restore_sharded(model, directory, single_replica_reads=True)
        except keras_orbax.errors.KerasOrbaxError as error:
            reports.append(
                {
                    "type": type(error).__name__,
                    "message": str(error),
                    "seconds": time.monotonic() - start,
                    "untouched": all(v._value is None for v in model.variables),
                }
            )
        else:
            reports.append({"type": None})
    return reports


def read_own_view(directories: list[str]) -> dict:
    """Each process restores the latest step of its own copy of a directory: they must agree on
    process 0's choice, whatever their own listing says."""
    keras.distribution.set_distribution(_models.model_parallel((2, 4)))
    with keras_orbax.deferred_init():
        model = _models.mlp(width=WIDTH)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = keras_orbax.restore_sharded(model, directories[jax.process_index()])
    said = [str(w.message) for w in caught if "every process reads" in str(w.message)]
    return {"step": result.step, "mismatches": _compare_with_arange(model), "warned": said}


def save_mismatch(directory: str) -> dict:
    """Each process saves another step of one directory: refused on both, before any write."""
    keras.distribution.set_distribution(_models.model_parallel((2, 4)))
    model = _models.mlp()
    try:
        keras_orbax.save(model, directory, step=10 + jax.process_index())
    except keras_orbax.errors.KerasOrbaxError as error:
        return {"type": type(error).__name__, "message": str(error)}
    return {"type": None}


def bucket(url: str, layouts: list[str]) -> dict:
    keras.distribution.set_distribution(_distribution("replicated"))
    model = _models.mlp(width=WIDTH)
    _models.fill_arange(model)
    keras_orbax.save(model, f"{url}/arange", step=1)
    return read(f"{url}/arange", layouts, None, None)


def run(task: dict[str, Any], workdir: Path) -> Any:
    action = task["action"]
    if action == "bucket":
        return bucket(task["directory"], task["layouts"])
    if action == "write":
        return write(Path(task["directory"]), workdir)
    if action == "read":
        return read(task["directory"], task["layouts"], task.get("trained"), task.get("reference"))
    if action == "save_killed":
        return save_killed(Path(task["directory"]))
    if action == "read_own_view":
        return read_own_view(task["directories"])
    if action == "save_mismatch":
        return save_mismatch(task["directory"])
    if action == "read_expect_error":
        return {"restores": read_expect_error(task["directories"])}
    raise ValueError(f"unknown action {action!r}")


def main() -> None:
    ctx = init_worker()
    keras.utils.set_random_seed(0)  # every process must initialize the same values
    write_result({"tasks": [run(task, ctx.workdir) for task in ctx.args["tasks"]]})


if __name__ == "__main__":
    main()
