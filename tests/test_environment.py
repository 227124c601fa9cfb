"""The machine misbehaves: a full disk, a read-only directory, two writers at once, a dead writer.

The disk and the read-only directory are real filesystems of the test's own (a size-limited tmpfs,
a read-only bind mount), which needs root and mount(2); as root, permission bits do not stop a
write, so chmod cannot stand in for them. Without root, these two tests are skipped with the reason.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import keras
import numpy as np
import pytest

import keras_orbax
from keras_orbax._src.format import step_dirs
from keras_orbax._src.storage import writer_lock
from keras_orbax._src.storage.writer_lock import lock_path
from keras_orbax.errors import SaveFailedError, StepLockedError
from tests import _models
from tests._beacons import Go
from tests._harness import REPO_ROOT, WORKERS_DIR
from tests._lock_holder import lock_holder

HANG_S = 300  # only to stop a hung process; no test asserts on time
needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="mounting a tmpfs or a read-only bind mount needs root"
)


@contextlib.contextmanager
def _mounted(target: Path, *args: str) -> Iterator[Path]:
    target.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", *args, str(target)], check=True, capture_output=True)
    try:
        yield target
    finally:
        subprocess.run(["umount", "-l", str(target)], check=True, capture_output=True)


def _fill(directory: Path) -> Path:
    """Writes a file until the filesystem is full; returns it."""
    filler = directory / "filler"
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError as error:
            assert error.errno == errno.ENOSPC
    return filler


def _fit(
    model: keras.Model,
    epochs: int,
    checkpoint: keras_orbax.ModelCheckpoint,
    *others: keras.callbacks.Callback,
) -> None:
    x, y = np.ones((32, 16), "float32"), np.ones((32, 8), "float32")
    model.fit(x, y, batch_size=8, epochs=epochs, verbose=0, callbacks=[checkpoint, *others])


def _state(model: keras.Model) -> list[np.ndarray]:
    return _models.values(model.variables + model.optimizer.variables)


def _restored(directory: Path) -> list[np.ndarray]:
    model = _models.compile_adam(_models.mlp())
    keras_orbax.restore_sharded(model, directory)
    return _state(model)


def _assert_equal(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)


@needs_root
def test_full_disk_fails_the_save_and_keeps_the_previous_step(
    tmp_path, distribution, caplog, capfd
):
    """A background save meets a full disk: one error, logged once (Orbax's tracebacks of it at
    DEBUG only), then raised; what it staged is removed, so the disk is not kept full."""
    distribution(_models.model_parallel((2, 4)))
    with _mounted(tmp_path / "disk", "-t", "tmpfs", "-o", "size=2m", "tmpfs") as disk:
        directory = disk / "ckpt"
        model = _models.compile_adam(_models.mlp())
        _fit(model, 1, keras_orbax.ModelCheckpoint(directory, max_to_keep=None))
        saved = _state(model)
        filler = _fill(disk)
        capfd.readouterr()
        caplog.clear()

        with pytest.raises(SaveFailedError, match=r"Saving step 8 to .*ckpt.*intact"):
            _fit(model, 2, keras_orbax.ModelCheckpoint(directory, max_to_keep=None, resume=True))
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert [(r.name, r.exc_info) for r in errors] == [("keras_orbax", None)], errors
        assert "No space left on device" in errors[0].getMessage()
        assert "Traceback" not in capfd.readouterr().err
        assert _staged(directory) == []
        assert step_dirs.committed_steps(directory) == [4]
        _assert_equal(_restored(directory), saved)
        with pytest.raises(SaveFailedError, match=r"(?s)step 99 .*No space left on device.*4, is"):
            keras_orbax.save(model, directory, step=99)
        assert _staged(directory) == []
        assert step_dirs.committed_steps(directory) == [4]

        filler.unlink()  # space again: the next run goes on from the step that was kept
        resumed = _models.compile_adam(_models.mlp())
        checkpoint = keras_orbax.ModelCheckpoint(directory, max_to_keep=None, resume=True)
        _fit(resumed, 2, checkpoint)
        assert checkpoint.restored is not None and checkpoint.restored.step == 4
        assert step_dirs.committed_steps(directory) == [4, 8]
        _assert_equal(_restored(directory), _state(resumed))


@needs_root
def test_read_only_directory_restores_and_refuses_saves(tmp_path, distribution):
    distribution(_models.model_parallel((2, 4)))
    model = _models.compile_adam(_models.mlp())
    _fit(model, 1, keras_orbax.ModelCheckpoint(tmp_path / "ckpt", max_to_keep=None))
    listing = sorted(str(p.relative_to(tmp_path)) for p in (tmp_path / "ckpt").rglob("*"))
    with _mounted(tmp_path / "ro", "--bind", str(tmp_path / "ckpt")) as ro:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(ro)], check=True)
        with pytest.raises(OSError, match="Read-only file system"):
            (ro / "probe").write_text("")  # the mount really is read-only, even to root

        _assert_equal(_restored(ro), _state(model))  # a restore writes nothing
        assert keras_orbax.load_model(ro).get_layer("hidden").kernel.shape == (16, 32)
        with pytest.raises(SaveFailedError, match=r"(?s)step 5 .*Read-only file system.*4, is"):
            keras_orbax.save(model, ro, step=5)
        with pytest.raises(SaveFailedError):
            _fit(model, 2, keras_orbax.ModelCheckpoint(ro, max_to_keep=None, resume=True))
    assert sorted(str(p.relative_to(tmp_path)) for p in (tmp_path / "ckpt").rglob("*")) == listing


def test_two_writers_at_once(tmp_path, distribution):
    """Two processes save to one directory at the same moment: the same step, then each its own.

    The same step: exactly one commits it, whole; the other gets `StepLockedError` (the first
    holds the step's lock) or, if the first committed before it looked, `StepExistsError`. Their
    own steps: both commit. The step saved before either started is never touched."""
    distribution(_models.model_parallel((2, 4)))
    directory = tmp_path / "ckpt"
    first = _models.mlp()
    _models.fill_arange(first)
    keras_orbax.save(first, directory, step=1)
    before = _models.values(first.variables)

    procs = []
    for writer in (0, 1):
        args = {
            "directory": str(directory),
            "writer": writer,
            "steps": [5, 6 + writer],
            "workdir": str(tmp_path),
            "result": str(tmp_path / f"writer_{writer}.json"),
        }
        with open(tmp_path / f"writer_{writer}.log", "wb") as log:
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(WORKERS_DIR / "concurrent_save.py"), json.dumps(args)],
                    cwd=REPO_ROOT,
                    env=_worker_env(),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
    for writer, proc in enumerate(procs):
        log = tmp_path / f"writer_{writer}.log"
        assert proc.wait(timeout=HANG_S) == 0, log.read_text()[-3000:]
    outcomes = [json.loads((tmp_path / f"writer_{w}.json").read_text()) for w in (0, 1)]

    same_step = [o[0] for o in outcomes]
    assert same_step.count("ok") == 1, outcomes
    assert re.match(
        r"keras_orbax\.errors\.(StepLockedError: Cannot save step 5 to '.*ckpt': another writer "
        r"\((PID \d+ on .*|its PID not yet recorded)\)"
        r"|StepExistsError: Step 5 is already committed)",
        same_step[1 - same_step.index("ok")],
    ), outcomes
    assert [o[1] for o in outcomes] == ["ok", "ok"], outcomes
    assert step_dirs.committed_steps(directory) == [1, 5, 6, 7]
    assert _lock_files(directory) == []

    model = _models.mlp()
    keras_orbax.restore_sharded(model, directory, 1)
    _assert_equal(_models.values(model.variables), before)
    keras_orbax.restore_sharded(model, directory, 5)
    step5 = np.concatenate([v.ravel() for v in _models.values(model.variables)])
    winner = 1.0 + same_step.index("ok")  # writer w saves the value w + 1
    assert (step5 == winner).all(), "step 5 is not the winning writer's, whole"
    for step, value in ((6, 1.0), (7, 2.0)):
        keras_orbax.restore_sharded(model, directory, step)
        assert all((v == value).all() for v in _models.values(model.variables)), step


def test_a_step_another_writer_holds_is_refused_and_then_committed_by_it(tmp_path, distribution):
    """A second writer of step 5, with or without overwrite, gets `StepLockedError` naming the
    holder's PID and writes nothing; other steps save meanwhile; the holder then commits step 5."""
    distribution(_models.model_parallel((2, 4)))
    directory = tmp_path / "ckpt"
    model = _models.mlp()
    keras_orbax.save(model, directory, step=1)
    before = _models.values(model.variables)
    with Go(tmp_path / "go") as go, lock_holder(tmp_path, directory, 5, go=go) as holder:
        match = (
            rf"Cannot save step 5 to '{re.escape(str(directory))}': another writer "
            rf"\(PID {holder.pid} on .+\) is saving that step right now and holds its lock, "
            r".*\.keras_orbax\.5\.lock\. Nothing was written; the committed steps are intact"
        )
        for overwrite in (False, True):
            with pytest.raises(StepLockedError, match=match) as raised:
                keras_orbax.save(model, directory, step=5, overwrite=overwrite)
            assert isinstance(raised.value, BlockingIOError)
        assert step_dirs.committed_steps(directory) == [1]
        keras_orbax.save(model, directory, step=6)  # another step: no wait, no error
        go.send()
        assert holder.wait(timeout=HANG_S) == 0, (tmp_path / "holder_5.log").read_text()[-3000:]

    assert step_dirs.committed_steps(directory) == [1, 5, 6]
    assert _lock_files(directory) == []
    restored = _models.mlp()
    keras_orbax.restore_sharded(restored, directory, 5)
    want = [v + 1000 for v in _models.arange_values([tuple(v.shape) for v in model.variables])]
    _assert_equal(_models.values(restored.variables), want)
    for step in (1, 6):
        keras_orbax.restore_sharded(restored, directory, step)
        _assert_equal(_models.values(restored.variables), before)


def test_a_writer_refused_just_as_the_holder_locks_names_it(tmp_path, distribution, monkeypatch):
    """The holder records its PID just after it takes the lock; a second writer refused in that
    instant waits for the record instead of naming no one."""
    # The refused writer waits up to `_HOLDER_WAIT_S` (2 s) for the record; on a loaded machine the
    # recording thread below may take longer than that to be scheduled, so the bound is lifted.
    monkeypatch.setattr(writer_lock, "_HOLDER_WAIT_S", HANG_S)
    distribution(_models.model_parallel((2, 4)))
    directory = tmp_path / "ckpt"
    directory.mkdir()
    lock = lock_path(directory, 5)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # locked, nothing recorded yet
        record = threading.Thread(target=_record_once_opened, args=(fd, lock))
        record.start()
        with pytest.raises(StepLockedError, match=r"another writer \(PID 4242 on other-host\)"):
            keras_orbax.save(_models.mlp(), directory, step=5)
        record.join()
    finally:
        os.close(fd)
    assert step_dirs.committed_steps(directory) == []


def _record_once_opened(fd: int, path: Path) -> None:
    """Writes a holder's record into `fd` 0.1 s after another descriptor opens `path`."""
    deadline = time.monotonic() + HANG_S
    while time.monotonic() < deadline and not _opened_elsewhere(fd, path):
        time.sleep(0.001)
    time.sleep(0.1)
    os.write(fd, b"4242 other-host\n")


def _opened_elsewhere(fd: int, path: Path) -> bool:
    """Whether a descriptor of this process other than `fd` has `path` open."""
    for other in os.listdir("/proc/self/fd"):
        # One of those listed is the listing's own descriptor, closed by now; others may close
        # meanwhile: skip each, not the whole listing (whether `path` came before them in it
        # depended on descriptor numbers, and the test flaked).
        with contextlib.suppress(OSError):
            if int(other) != fd and os.readlink(f"/proc/self/fd/{other}") == str(path):
                return True
    return False


def test_a_killed_writers_lock_does_not_block_the_next_save(tmp_path, distribution):
    distribution(_models.model_parallel((2, 4)))
    directory = tmp_path / "ckpt"
    model = _models.mlp()
    _models.fill_arange(model)
    with lock_holder(tmp_path, directory, 3) as holder:
        with pytest.raises(StepLockedError, match=rf"PID {holder.pid} "):
            keras_orbax.save(model, directory, step=3)
        holder.send_signal(signal.SIGKILL)
        assert holder.wait(timeout=HANG_S) == -signal.SIGKILL
    assert _lock_files(directory) == [".keras_orbax.3.lock"]  # left behind, unlocked by the kernel

    keras_orbax.save(model, directory, step=3)
    assert step_dirs.committed_steps(directory) == [3]
    assert _lock_files(directory) == []
    restored = _models.mlp()
    keras_orbax.restore_sharded(restored, directory)
    _assert_equal(_models.values(restored.variables), _models.values(model.variables))


@pytest.mark.parametrize("background", [True, False], ids=["async", "sync"])
def test_callback_stops_at_a_step_another_writer_holds(tmp_path, distribution, background):
    """`fit` raises `StepLockedError` at the held step, the steps before it intact; once the holder
    is gone, resuming finishes the run. Meanwhile, each step the callback has started is locked
    until it is committed (a background save too)."""
    distribution(_models.model_parallel((2, 4)))
    directory = tmp_path / "ckpt"
    model = _models.compile_adam(_models.mlp())
    after_epoch_1 = _Snapshot()
    checkpoint = keras_orbax.ModelCheckpoint(
        directory, max_to_keep=None, save_on_background=background
    )
    with lock_holder(tmp_path, directory, 8) as holder:
        with pytest.raises(StepLockedError, match=rf"step 8 .*PID {holder.pid} "):
            _fit(model, 2, checkpoint, after_epoch_1)
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=HANG_S)
    assert step_dirs.committed_steps(directory) == [4]
    _assert_equal(_restored(directory), after_epoch_1.state)

    resumed = _models.compile_adam(_models.mlp())
    checkpoint = keras_orbax.ModelCheckpoint(
        directory, max_to_keep=None, save_on_background=background, resume=True
    )
    _fit(resumed, 2, checkpoint, _LockedUntilCommitted(checkpoint))
    assert step_dirs.committed_steps(directory) == [4, 8]
    assert _lock_files(directory) == []
    _assert_equal(_restored(directory), _state(resumed))


class _Snapshot(keras.callbacks.Callback):
    """The model's state at the end of the first epoch."""

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if epoch == 0:
            self.state = _state(self.model)


class _LockedUntilCommitted(keras.callbacks.Callback):
    """After each batch, the step the checkpoint last started is committed or still locked.

    The lock is read first: a lock released before that read was released after the commit."""

    def __init__(self, checkpoint: keras_orbax.ModelCheckpoint) -> None:
        super().__init__()
        self.checkpoint = checkpoint

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        step = self.checkpoint._last_saved_step
        if step is not None:
            locked = lock_path(self.checkpoint.directory, step).exists()
            assert locked or step in step_dirs.committed_steps(self.checkpoint.directory), step


def _worker_env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(REPO_ROOT), JAX_PLATFORMS="cpu")


def _staged(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob("*.orbax-checkpoint-tmp*"))


def _lock_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob(".keras_orbax.*.lock"))
