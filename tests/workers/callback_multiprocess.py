"""Worker for tests/test_callback.py: `ModelCheckpoint` under jax.distributed (run by tests/_harness.py).

args: {"directory": str, "ready": str}

1. save_best_only with a monitored value that differs per process (process 1 sees the opposite
   trend, and no value at all in the last epoch): every process must follow process 0's
   decisions, or they would enter the collective save at different steps and hang.
2. save_on_preemption: after writing `ready`, trains on until the test sends SIGTERM to one
   process; JAX's preemption service must make both save at the same step and stop.
3. resume=True into the save_best_only directory once process 0 has flipped a byte of its newest
   step's array file: every process falls back to the same older step, and process 0 moves the
   damaged one aside.
4. The coordination service's keys that keras-orbax set for all this are deleted once every
   process has read them: `keys_left` counts the ones left.
"""

from __future__ import annotations

import time
from pathlib import Path

import jax
import keras
import numpy as np

import keras_orbax
from keras_orbax._src.compat import orbax_compat
from keras_orbax._src.format import step_dirs
from keras_orbax._src.runtime import multihost
from tests import _models
from tests._worker_util import init_worker, write_result


class _Scores(keras.callbacks.Callback):
    def __init__(self, scores: list[float | None]) -> None:
        super().__init__()
        self.scores = scores

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        assert logs is not None
        logs["score"] = self.scores[epoch]


def _resume_past_a_damaged_step(
    best: Path, x: np.ndarray, y: np.ndarray
) -> tuple[int | None, list[str], list[int]]:
    """Flips a byte of the newest step's largest array file of its own (process 0), then resumes
    a fresh model from `best` on every process: (step restored, names moved aside, steps)."""
    newest = best / str(step_dirs.committed_steps(best)[-1])
    if jax.process_index() == 0:
        files = [f for f in (newest / "state").rglob("*") if f.is_file() and f.parent.name == "c"]
        own = [f for f in files if f.stat().st_nlink == 1]  # not hard-linked to an older step
        with open(max(own, key=lambda f: f.stat().st_size), "r+b") as damaged:
            first = damaged.read(1)
            damaged.seek(0)
            damaged.write(bytes([first[0] ^ 0x40]))
    multihost.gather("test/damaged", 0)
    model = _models.compile_adam(_models.mlp())
    resumer = keras_orbax.ModelCheckpoint(best, resume=True, max_to_keep=None)
    # The older step records epoch 2: with epochs=2 there is nothing left to train.
    model.fit(x, y, epochs=2, batch_size=4, shuffle=False, verbose=0, callbacks=[resumer])
    multihost.gather("test/resumed", 0)  # process 0 has moved the step aside
    restored = resumer.restored.step if resumer.restored is not None else None
    aside = sorted(p.name for p in best.iterdir() if not p.name.isdecimal())
    return restored, aside, step_dirs.committed_steps(best)


def main() -> None:
    ctx = init_worker()
    directory = Path(ctx.args["directory"])
    distribution = _models.model_parallel((2, 4))
    distribution.auto_shard_dataset = False  # each process feeds its own half of every batch
    keras.distribution.set_distribution(distribution)
    keras.utils.set_random_seed(0)
    model = _models.compile_adam(_models.mlp())
    rng = np.random.default_rng(ctx.process_id)
    x, y = rng.random((16, 16), dtype="float32"), rng.random((16, 8), dtype="float32")

    # Epochs 0..3: process 0 improves at epochs 0, 1 and 3; process 1 only at epoch 0 and 2, and
    # has no score at epoch 3, where process 0 decides to save.
    scores = [0.5, 0.4, 0.45, 0.3] if ctx.process_id == 0 else [0.5, 0.6, 0.4, None]
    best_only = keras_orbax.ModelCheckpoint(
        directory / "best", monitor="score", mode="min", save_best_only=True, max_to_keep=None
    )
    fit_kwargs = {"batch_size": 4, "shuffle": False, "verbose": 0}
    model.fit(x, y, epochs=4, callbacks=[_Scores(scores), best_only], **fit_kwargs)
    best_steps = step_dirs.committed_steps(directory / "best")

    preemptible = keras_orbax.ModelCheckpoint(directory / "preempt", max_to_keep=None)
    batches = 0

    def pace(batch: int, logs: dict | None = None) -> None:
        nonlocal batches
        batches += 1
        if batches == 6:
            Path(ctx.args["ready"]).write_text(str(ctx.process_id))  # a `tests._beacons.Beacon`
        time.sleep(0.02)

    start_step = int(model.optimizer.iterations)
    history = model.fit(
        x,
        y,
        epochs=200,
        callbacks=[preemptible, keras.callbacks.LambdaCallback(on_train_batch_end=pace)],
        **fit_kwargs,
    )
    resumed_step, aside, best_after = _resume_past_a_damaged_step(directory / "best", x, y)
    multihost.gather("test/first", 0)
    multihost.gather("test/second", 0)  # every process is past the first, its deletions done
    keys = orbax_compat.distributed_client().key_value_dir_get("keras_orbax/")
    write_result(
        {
            "keys_left": sorted(key for key, _ in keys),
            "resumed_step": resumed_step,
            "aside": aside,
            "best_after": best_after,
            "best_steps": best_steps,
            "best": best_only.best,
            "start_step": start_step,
            "preempted": preemptible.preempted,
            "step": int(model.optimizer.iterations),
            "epochs_run": len(history.epoch),
            "preempt_steps": step_dirs.committed_steps(directory / "preempt"),
            "process_count": jax.process_count(),
        }
    )


if __name__ == "__main__":
    main()
