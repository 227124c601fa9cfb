"""The background saver never dies silently and leaks nothing into user code.

An error in a background save or its cleanup is logged when it happens and raised from `fit` at
the next hook, never a hang; the collector pause ends as the user left the collector; a child
forked during `fit` gets SIGTERM's behaviour from before `fit`, not the callback's handler.
Real fits, real forks, real signals; the one fault injected is an `OSError` where keras-orbax's own
writer lock is released (a deferred write error on `close` over NFS).
"""

from __future__ import annotations

import errno
import gc
import logging
import multiprocessing
import os
import signal
import threading
from typing import Any

import keras
import numpy as np
import pytest

import keras_orbax
from keras_orbax._src.format import step_dirs
from keras_orbax._src.storage import writer_lock
from keras_orbax.errors import SaveFailedError
from tests import _models

_HANG_S = 300  # only to stop a hang: a fit of a few batches takes seconds
_CHILD_WAIT_S = 60  # a child that survives SIGTERM exits by itself after this


def _fit_in_thread(model: keras.Model, epochs: int, callbacks: list) -> BaseException | None:
    """Runs `fit`; returns what it raised. Fails (rather than hang) if it does not return."""
    rng = np.random.default_rng(0)
    x, y = rng.random((16, 16), dtype="float32"), rng.random((16, 8), dtype="float32")
    raised: list[BaseException] = []

    def fit() -> None:
        try:
            model.fit(x, y, batch_size=8, epochs=epochs, verbose=0, callbacks=callbacks)
        except BaseException as error:
            raised.append(error)

    thread = threading.Thread(target=fit, daemon=True)
    thread.start()
    thread.join(_HANG_S)
    assert not thread.is_alive(), "fit hangs"
    return raised[0] if raised else None


def _automatic_collections_run() -> bool:
    """Whether allocating cyclic garbage sets off a collection (the collector runs by itself)."""
    seen: list[str] = []

    def on_gc(phase: str, info: dict) -> None:
        seen.append(phase)

    gc.callbacks.append(on_gc)
    try:
        for _ in range(20 * 700):  # 700: CPython's default first threshold
            cycle: list[Any] = []
            cycle.append(cycle)
    finally:
        gc.callbacks.remove(on_gc)
    return bool(seen)


def test_a_failing_lock_release_stops_fit_with_its_error(tmp_path, monkeypatch, caplog):
    released = writer_lock._release

    def release_failing_on_close(path, fd) -> None:
        released(path, fd)
        if path.name == ".keras_orbax.2.lock":
            raise OSError(errno.EIO, "Input/output error (deferred write error on close)")

    monkeypatch.setattr(writer_lock, "_release", release_failing_on_close)
    checkpoint = keras_orbax.ModelCheckpoint(tmp_path, max_to_keep=None)
    with caplog.at_level(logging.ERROR, logger="keras_orbax"):
        raised = _fit_in_thread(_models.compile_adam(_models.mlp()), 4, [checkpoint])
    assert isinstance(raised, SaveFailedError), raised
    assert "Step 2 of" in str(raised) and "releasing its writer lock" in str(raised)
    assert "Input/output error" in str(raised)
    logged = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any("Saving step 2 to" in m and "Input/output error" in m for m in logged), logged
    # The step itself committed before the lock was released; fit stopped at the next hook.
    assert step_dirs.committed_steps(tmp_path) in ([2], [2, 4])
    assert keras_orbax.restore_sharded(_models.compile_adam(_models.mlp()), tmp_path).step == 2
    assert gc.isenabled() and _automatic_collections_run()


def test_a_collector_the_user_disabled_during_a_save_stays_disabled():
    from keras_orbax._src.runtime import gc_pause

    release = gc_pause.hold()
    gc.disable()  # the user's, while a background save holds the pause
    try:
        release()
        assert not gc.isenabled()
        assert not _automatic_collections_run()
        gc.enable()
        assert _automatic_collections_run()  # the thresholds are back
    finally:
        gc.enable()


def _report_collector(conn) -> None:
    conn.send((gc.isenabled(), _automatic_collections_run()))
    conn.close()


def test_a_child_forked_during_a_save_runs_its_collector():
    """A `PyDataset(use_multiprocessing=True)` pool forked while a background save holds the
    pause: its workers' collectors run, and the parent's pause still holds."""
    from keras_orbax._src.runtime import gc_pause

    release = gc_pause.hold()
    try:
        parent_end, child_end = multiprocessing.Pipe()
        child = multiprocessing.get_context("fork").Process(
            target=_report_collector, args=(child_end,)
        )
        child.start()
        assert parent_end.poll(_HANG_S)
        assert parent_end.recv() == (True, True)
        child.join(_HANG_S)
        assert child.exitcode == 0
        assert not _automatic_collections_run()  # here, the save's pause goes on
    finally:
        release()
    assert _automatic_collections_run()


def _wait_for_sigterm(conn) -> None:
    conn.send(os.getpid())
    threading.Event().wait(_CHILD_WAIT_S)  # SIGTERM's default action ends it first
    os._exit(3)


class _ForksAChild(keras.callbacks.Callback):
    """Forks a child in the middle of `fit` (as a `PyDataset` pool does) and sends it SIGTERM."""

    def __init__(self) -> None:
        super().__init__()
        self.exitcode: int | None = None

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if epoch != 0:
            return
        parent_end, child_end = multiprocessing.Pipe()
        child = multiprocessing.get_context("fork").Process(
            target=_wait_for_sigterm, args=(child_end,)
        )
        child.start()
        assert parent_end.poll(_HANG_S)
        os.kill(parent_end.recv(), signal.SIGTERM)
        child.join(_HANG_S)
        if child.is_alive():
            child.kill()
            child.join()
        self.exitcode = child.exitcode


@pytest.fixture
def default_sigterm():
    """SIGTERM's default action before the test, whatever an earlier test of this worker left;
    the earlier handler is put back after."""
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    signal.signal(signal.SIGTERM, previous)


def test_a_child_forked_during_fit_gets_the_default_sigterm(tmp_path, caplog, default_sigterm):
    forks = _ForksAChild()
    checkpoint = keras_orbax.ModelCheckpoint(tmp_path, save_on_preemption=True)
    with caplog.at_level(logging.WARNING, logger="keras_orbax"):
        assert _fit_in_thread_main(_models.compile_adam(_models.mlp()), [checkpoint, forks]) is None
    assert forks.exitcode == -signal.SIGTERM  # killed by it, not "saving a checkpoint"
    assert not checkpoint.preempted
    assert not any("Received SIGTERM" in r.getMessage() for r in caplog.records)
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def _fit_in_thread_main(model: keras.Model, callbacks: list) -> BaseException | None:
    """`fit` in this (the main) thread: the callback installs its SIGTERM handler only there."""
    rng = np.random.default_rng(0)
    x, y = rng.random((16, 16), dtype="float32"), rng.random((16, 8), dtype="float32")
    try:
        model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=callbacks)
    except BaseException as error:
        return error
    return None


@pytest.fixture(autouse=True)
def _collector_as_found():
    """Each test leaves the collector as it found it, whatever it asserted."""
    enabled, thresholds = gc.isenabled(), gc.get_threshold()
    yield
    gc.set_threshold(*thresholds)
    (gc.enable if enabled else gc.disable)()
