"""Two writers of one checkpoint directory: a second training run is refused before it trains,
naming the first; retention counts every step of the directory; two `ModelCheckpoint`s of one
`fit`, each with its own directory, save the same steps at once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import keras
import numpy as np
import pytest

import keras_orbax
from keras_orbax._src.format import step_dirs
from keras_orbax.errors import StepLockedError
from tests import _models
from tests._beacons import Beacon
from tests._harness import REPO_ROOT, WORKERS_DIR

HANG_S = 300  # only to stop a hang


def _fit(model, epochs, *callbacks, n=32):
    x, y = np.ones((n, 16), "float32"), np.ones((n, 8), "float32")
    model.fit(x, y, batch_size=8, epochs=epochs, verbose=0, callbacks=list(callbacks))


def _values(model):
    return _models.values(model.variables + model.optimizer.variables)


def test_a_second_run_in_the_directory_is_refused_naming_the_first(tmp_path, distribution, caplog):
    """The same job launched twice: the second `fit` raises `StepLockedError` naming the first
    run's PID before it trains or writes anything, and is not told to overwrite. `inspect` and
    `verify` show the first run's save in progress, then, once it is killed, what it left; the
    same job then resumes from the last committed step and removes it."""
    distribution(_models.model_parallel((2, 4)))
    directory = tmp_path / "ckpt"
    ready = Beacon(tmp_path / "ready")
    args = {"directory": str(directory), "ready": str(ready)}
    log = tmp_path / "first_run.log"
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), JAX_PLATFORMS="cpu")
    with open(log, "wb") as out:
        first = subprocess.Popen(
            [sys.executable, str(WORKERS_DIR / "train_and_hold.py"), json.dumps(args)],
            cwd=REPO_ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        ready.wait(first, HANG_S, log)  # inside its save of step 6
        assert step_dirs.committed_steps(directory) == [2, 4]
        before = sorted(p.name for p in directory.iterdir())
        assert "6.orbax-checkpoint-tmp" in before

        model = _models.compile_adam(_models.mlp())
        initial = _models.values(model.variables)
        second = keras_orbax.ModelCheckpoint(directory, max_to_keep=2, save_freq=2, resume=True)
        refusal = rf"another training run \(PID {first.pid} on .*Nothing was written"
        with pytest.raises(StepLockedError, match=refusal) as refused:
            _fit(model, 2, second)
        assert "overwrite" not in str(refused.value)
        assert sorted(p.name for p in directory.iterdir()) == before  # nothing written
        for got, want in zip(_models.values(model.variables), initial, strict=True):  # untouched
            np.testing.assert_array_equal(got, want)
        busy = ("6.orbax-checkpoint-tmp: step 6 being written now",)
        assert keras_orbax.inspect(directory).leftovers == busy
    finally:
        ready.close()
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=HANG_S)

    (left,) = keras_orbax.verify(directory).leftovers
    assert left.startswith("6.orbax-checkpoint-tmp: what a save of step 6 staged before it was")
    assert left in str(keras_orbax.inspect(directory))
    resumed = _models.compile_adam(_models.mlp())
    again = keras_orbax.ModelCheckpoint(directory, max_to_keep=2, save_freq=2, resume=True)
    _fit(resumed, 2, again)
    assert (
        "Removed 1 staging directories" in caplog.text and "6.orbax-checkpoint-tmp" in caplog.text
    )
    assert again.restored is not None and again.restored.step == 4
    assert step_dirs.committed_steps(directory) == [6, 8]
    assert keras_orbax.inspect(directory).leftovers == ()
    assert not list(directory.glob(".keras_orbax*"))  # its locks released


class _SaveStepOne(keras.callbacks.Callback):
    """Another writer of the directory: `keras_orbax.save` of step 1 after the first batch."""

    def __init__(self, directory):
        super().__init__()
        self.directory = directory

    def on_train_batch_end(self, batch, logs=None):
        if batch == 0 and not step_dirs.committed_steps(self.directory):
            keras_orbax.save(self.model, self.directory, step=1)


def test_retention_counts_every_step_of_the_directory(tmp_path, distribution):
    distribution(_models.model_parallel((2, 4)))
    directory = tmp_path / "ckpt"
    model = _models.compile_adam(_models.mlp())
    checkpoint = keras_orbax.ModelCheckpoint(directory, max_to_keep=2)
    _fit(model, 3, _SaveStepOne(directory), checkpoint)
    assert step_dirs.committed_steps(directory) == [8, 12]


def test_two_callbacks_of_one_fit_save_the_same_steps_at_once(tmp_path, distribution):
    """Each with its own directory, in the background, both saving (and deleting) at every other
    step: Orbax numbers saves and deletions with one counter per process, and two in flight at
    once used to wait on each other's signals and write into each other's temporary
    directories."""
    distribution(_models.model_parallel((2, 4)))
    model = _models.compile_adam(_models.mlp())
    first, second = (
        keras_orbax.ModelCheckpoint(tmp_path / name, max_to_keep=2, save_freq=2)
        for name in ("a", "b")
    )
    _fit(model, 2, first, second, n=64)
    state = _values(model)
    for name in ("a", "b"):
        assert step_dirs.committed_steps(tmp_path / name) == [14, 16]
        restored = _models.compile_adam(_models.mlp())
        keras_orbax.restore_sharded(restored, tmp_path / name)
        for got, want in zip(_values(restored), state, strict=True):
            np.testing.assert_array_equal(got, want)
