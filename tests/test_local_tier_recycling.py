"""The local tier writes each step into the files of the step retention retired (tmpfs pages it
has already), never into a file a kept step shares, and every kept step stays exactly what it
saved; counted from the filesystem (inodes), with restores as the oracle."""

from __future__ import annotations

import os
from pathlib import Path

import keras
import numpy as np
import pytest

import keras_orbax
from keras_orbax._src.format import step_dirs
from keras_orbax._src.storage import commit, recycled_step
from keras_orbax.errors import SaveFailedError
from tests import _faults, _models

BATCHES, BATCH = 8, 8


class _Observe(keras.callbacks.Callback):
    """After the checkpoint's hook of each batch: the model's state by step, the inodes of the
    shard files of every local step committed by then (the save before this batch's has),
    and those steps that `verify` finds damaged (the save in flight may be writing)."""

    def __init__(self, local: Path) -> None:
        super().__init__()
        self.local = local
        self.states: dict[int, list[np.ndarray]] = {}
        self.inodes: dict[int, dict[str, int]] = {}
        self.shared_seen = False
        self.damaged: list[int] = []

    def on_train_batch_end(self, batch, logs=None):
        self.model.jax_state_sync()
        step = batch + 1  # one epoch: the checkpoint numbers steps by batches trained
        self.states[step] = _models.values(self.model.variables + self.model.optimizer.variables)
        for committed in step_dirs.committed_steps(self.local):
            files = _shard_files(self.local / str(committed))
            self.inodes.setdefault(committed, {k: s.st_ino for k, s in files.items()})
            self.shared_seen |= any(s.st_nlink > 1 for s in files.values())
            if not keras_orbax.verify(self.local, committed).intact:
                self.damaged.append(committed)


def _shard_files(step_dir: Path) -> dict[str, os.stat_result]:
    """The shard files of the model's and the optimizer's variables (`<path>.vars.<i>/`), by path
    within the step: not their `zarr.json`, nor the step's metadata files."""
    state = step_dir / "state"
    return {
        str(p.relative_to(state)): p.stat()
        for p in state.rglob("*")
        if p.is_file() and p.name != "zarr.json" and ".vars." in p.relative_to(state).parts[0]
    }


def _train(root: Path, observer: list | None = None, **adam: int) -> tuple[keras.Model, _Observe]:
    keras.distribution.set_distribution(_models.model_parallel((2, 4)))
    keras.utils.set_random_seed(1)
    model = _models.mlp(width=64)
    model.compile(optimizer=keras.optimizers.Adam(1e-2, **adam), loss="mse")
    rng = np.random.default_rng(0)
    x = rng.random((BATCHES * BATCH, 16), dtype="float32")
    y = rng.random((BATCHES * BATCH, 8), dtype="float32")
    observe = _Observe(root / "local")
    if observer is not None:  # for a test whose fit raises
        observer.append(observe)
    checkpoint = keras_orbax.ModelCheckpoint(
        root / "ckpt", local_directory=root / "local", local_save_freq=1, local_max_to_keep=2
    )
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=[checkpoint, observe])  # fmt: skip
    return model, observe


def _assert_kept_steps_hold_what_they_saved(root: Path, observe: _Observe, **adam: int) -> None:
    assert observe.damaged == []
    kept = step_dirs.committed_steps(root / "local")
    assert kept == [BATCHES - 1, BATCHES]
    for step in kept:
        _assert_holds(root, observe, step, **adam)


def _assert_holds(root: Path, observe: _Observe, step: int, **adam: int) -> None:
    """Local step `step` verifies and restores exactly the state the model had at it."""
    assert keras_orbax.verify(root / "local", step).intact
    model = _models.mlp(width=64)
    model.compile(optimizer=keras.optimizers.Adam(**adam), loss="mse")
    model.optimizer.build(model.trainable_variables)
    keras_orbax.restore_sharded(model, root / "local", step=step)
    got = _models.values(model.variables + model.optimizer.variables)
    for g, want in zip(got, observe.states[step], strict=True):
        np.testing.assert_array_equal(g, want)


@pytest.fixture(autouse=True)
def _distribution():
    previous = keras.distribution.distribution()
    yield
    keras.distribution.set_distribution(previous)


def test_each_save_writes_into_the_files_of_the_step_retention_retired(tmp_path):
    _, observe = _train(tmp_path)
    # Kept 2: step s is written once s - 1 is committed and s - 3 retired, into s - 3's files.
    for step in range(4, BATCHES):
        assert observe.inodes[step] == observe.inodes[step - 3], step
    assert not recycled_step.path(tmp_path / "local").exists()  # freed when fit ends
    _assert_kept_steps_hold_what_they_saved(tmp_path, observe)


def test_a_file_a_kept_step_shares_is_never_written_into(tmp_path):
    """Updates every third batch: an incremental save links the weights' files of the two steps
    after an update to its, so the step retired just before the next update shares them with
    both kept steps; the update's save writes new files instead (`verify` of the kept steps at
    every batch)."""
    _, observe = _train(tmp_path, gradient_accumulation_steps=3)
    assert observe.shared_seen  # the case arose
    _assert_kept_steps_hold_what_they_saved(tmp_path, observe, gradient_accumulation_steps=3)


def test_a_full_disk_during_a_save_into_retired_files_keeps_every_committed_step(tmp_path):
    """A real tmpfs filled (ENOSPC from the kernel) as the fifth local save starts, which writes
    into step 2's files: `fit` stops with the error, and the steps committed before it (3 and 4)
    still hold exactly what they saved; nothing of the failed save is left."""
    saves = []

    def fifth_save_fills_the_disk(stage: str) -> None:
        saves.append(stage == "stage")
        if stage == "stage" and sum(saves) == 5:
            _faults.fill_disk(tmp_path / "local")

    with _faults.tmpfs(tmp_path / "local", size="2m"), commit.on_stage(fifth_save_fills_the_disk):
        with pytest.raises(SaveFailedError, match="No space left on device"):
            _train(tmp_path, observer=(observed := []))
        (tmp_path / "local" / ".filler").unlink()
        observe = observed[0]
        assert step_dirs.committed_steps(tmp_path / "local") == [3, 4]
        assert [p.name for p in (tmp_path / "local").iterdir() if not p.name.isdecimal()] == []
        for step in (3, 4):
            _assert_holds(tmp_path, observe, step)
