"""Worker for tests/test_local_tier_multiprocess.py: `ModelCheckpoint(local_directory=...)` under
jax.distributed, each process with its own local directory (`<run>/local_<i>`; nothing shared but
the persistent `<run>/ckpt`).

args: {"root": str, "phase": "first" | "resume", "kill_after": int, "crash_after": int}

phase "first": trains `reference` uninterrupted, then `damaged` and `neighbours` until an
exception out of `fit` after batch `crash_after`, writes its result, then trains `killed` and
SIGKILLs itself after batch `kill_after` (both processes, at the same batch).
phase "resume": the test has deleted process 1's local directory of `killed` and damaged process
0's newest own part of `damaged`, and every copy of process 0's parts of `neighbours` (its local
directory, and its replica in process 1's); resumes the three runs to their end. Then process 1
deletes its own part of `killed`'s newest step, and both `restore_sharded` a fresh model from
their local directory of `killed`, then from their (intact) one of `reference`. Last, `failing`
trains with process 1's replica folder taken by a file.
Each result holds a digest of this process's shards of the whole state (weights, optimizer,
metrics) after each run, the step each resume restored, and what each local directory holds.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import signal
import warnings
from pathlib import Path

import jax
import keras
import numpy as np

import keras_orbax
from keras_orbax._src.runtime import multihost, ring
from tests import _models
from tests._worker_util import init_worker, write_result

EPOCHS, ROWS, BATCH = 2, 16, 4


class _Crash(Exception):
    pass


class _StopAfter(keras.callbacks.Callback):
    """After global batch `n` (after the checkpoint's hook): SIGKILL, or an exception."""

    def __init__(self, n: int, kill: bool) -> None:
        super().__init__()
        self.n, self.kill = n, kill

    def on_train_batch_end(self, batch, logs=None):
        if int(self.model.optimizer.iterations.numpy()) == self.n:
            if self.kill:
                os.kill(os.getpid(), signal.SIGKILL)
            raise _Crash(f"crash after batch {self.n}")


def _train(run: Path, *, stop_after: int | None = None, kill: bool = False):
    keras.utils.set_random_seed(1)
    model = _models.compile_adam(_models.mlp())
    checkpoint = keras_orbax.ModelCheckpoint(
        run / "ckpt",
        local_directory=run / f"local_{jax.process_index()}",
        local_save_freq=1,
        local_max_to_keep=2,
        max_to_keep=None,
        resume=True,
        verbose=1,  # says which tier and step it resumed from
    )
    rng = np.random.default_rng(jax.process_index())  # each process feeds its half of a batch
    x, y = rng.random((ROWS, 16), dtype="float32"), rng.random((ROWS, 8), dtype="float32")
    callbacks = [checkpoint] + ([_StopAfter(stop_after, kill)] if stop_after else [])
    fit = {"batch_size": BATCH, "epochs": EPOCHS, "shuffle": False, "verbose": 0}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with contextlib.suppress(_Crash):  # the crash: as after a kill, no on_train_end
            model.fit(x, y, callbacks=callbacks, **fit)
    restored = checkpoint.restored.step if checkpoint.restored is not None else None
    return model, restored, [str(w.message) for w in caught]


def _digest(model: keras.Model, *, metrics: bool = True) -> str:
    """This process's shards of every variable (weights, optimizer, metrics), in order, hashed."""
    digest = hashlib.sha256()
    variables = model.variables + model.optimizer.variables
    for variable in variables + (model.metrics_variables if metrics else []):
        value = variable.value
        for shard in sorted(value.addressable_shards, key=lambda s: s.device.id):
            digest.update(np.asarray(shard.data).tobytes())
    return digest.hexdigest()


def _listing(local: Path) -> dict[str, list[str]]:
    return {p.name: sorted(c.name for c in p.iterdir()) for p in sorted(local.iterdir())}


def main() -> None:
    ctx = init_worker()
    # Each part (about 10 KiB) travels in several chunks, as large ones do.
    ring._GRAIN, ring._CHUNK_BYTES = 512, 4096
    root, me = Path(ctx.args["root"]), ctx.process_id
    distribution = _models.model_parallel((2, 4))
    distribution.auto_shard_dataset = False
    keras.distribution.set_distribution(distribution)
    if ctx.args["phase"] == "first":
        reference, _, _ = _train(root / "reference")
        for run in ("damaged", "neighbours"):
            _train(root / run, stop_after=ctx.args["crash_after"])
        result = {
            "reference": _digest(reference),
            "reference_weights": _digest(reference, metrics=False),
            "reference_local": _listing(root / "reference" / f"local_{me}"),
            "damaged_local": _listing(root / "damaged" / f"local_{me}"),
        }
        multihost.gather("test/first written", 0)
        write_result(result)
        _train(root / "killed", stop_after=ctx.args["kill_after"], kill=True)
        raise SystemExit("not killed")
    result = {}
    for run in ("killed", "damaged", "neighbours"):
        model, restored, warned = _train(root / run)
        if run == "killed":
            model_killed = model
        result[run] = {
            "digest": _digest(model),
            "restored": restored,
            "warnings": warned,
            "local": _listing(root / run / f"local_{me}"),
        }
    # restore_sharded of a local directory as the user passed it: process 1's own part of the
    # newest step deleted, it comes from the replica process 0 keeps.
    killed = root / "killed" / f"local_{me}"
    if me == 1:
        shutil.rmtree(killed / "process_1")
    multihost.gather("test/own part deleted", 0)
    fresh = _models.compile_adam(_models.mlp())
    fresh.optimizer.build(fresh.trainable_variables)
    restored = keras_orbax.restore_sharded(fresh, killed)
    result["restore_sharded"] = {"step": restored.step, "digest": _digest(fresh, metrics=False)}
    # And of an intact local directory: each process reads its own part once, no replica.
    fresh = _models.compile_adam(_models.mlp())
    fresh.optimizer.build(fresh.trainable_variables)
    restored = keras_orbax.restore_sharded(fresh, root / "reference" / f"local_{me}")
    result["restore_intact"] = {"step": restored.step, "digest": _digest(fresh, metrics=False)}
    result["killed"]["weights"] = _digest(model_killed, metrics=False)
    # A write that fails on one process (its replica's folder is taken by a file) stops fit on
    # every process at the next local save, none left waiting in the exchange.
    failing = root / "failing"
    if me == 1:
        (failing / "local_1").mkdir(parents=True)
        (failing / "local_1" / "process_0").write_text("not a folder")
    multihost.gather("test/replica folder taken", 0)
    try:
        _train(failing)
    except keras_orbax.errors.SaveFailedError as error:
        result["failing"] = str(error)
    # Another run on process 1's machine holds its folder of the local directory (a job launched
    # twice): fit stops on every process before it writes anything.
    held = root / "held"
    holder = None
    if me == 1:
        (held / "local_1" / "process_1").mkdir(parents=True)
        holder = os.open(
            held / "local_1" / "process_1" / ".keras_orbax.lock", os.O_RDWR | os.O_CREAT
        )
        fcntl.flock(holder, fcntl.LOCK_EX)
        os.write(holder, b"4242 other-run\n")
    multihost.gather("test/folder held", 0)
    try:
        _train(held)
    except keras_orbax.errors.StepLockedError as error:
        result["held"] = str(error)
    result["held_local"] = _listing(held / f"local_{me}") if (held / f"local_{me}").is_dir() else {}
    if holder is not None:
        os.close(holder)
    write_result(result)


if __name__ == "__main__":
    main()
