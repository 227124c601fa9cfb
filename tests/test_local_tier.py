"""`ModelCheckpoint(local_directory=...)`: a tier of frequent steps in local storage beside the
persistent one; resuming takes the newest intact step of either, bitwise as an uninterrupted run.

A crash is a SIGKILL of a real training process (one, at a batch drawn from a seeded generator),
or, in this process, an exception out of `fit` after a batch (Keras runs no `on_train_end` then,
as after a crash; the save in flight finishes or not, as it would).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import keras
import numpy as np
import pytest

import keras_orbax
from keras_orbax._src.format import step_dirs
from keras_orbax._src.training import saving
from keras_orbax.errors import KerasOrbaxWarning
from tests import _local_tier, _models
from tests._harness import REPO_ROOT, WORKERS_DIR

HANG_S = 600  # only to stop a hung run


class _Crash(Exception):
    pass


class _CrashAfter(keras.callbacks.Callback):
    """Raises out of `fit` after global batch `n` (after the checkpoint's hook: its local save
    of that batch has started)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def on_train_batch_end(self, batch, logs=None):
        if int(self.model.optimizer.iterations.numpy()) == self.n:
            raise _Crash(f"crash after batch {self.n}")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The state at the end of the run that nothing interrupts, and its directories."""
    root = tmp_path_factory.mktemp("uninterrupted")
    previous = keras.distribution.distribution()
    model, _ = _local_tier.train(root / "ckpt", root / "local", resume=False)
    yield _local_tier.state(model), root
    keras.distribution.set_distribution(previous)


def _crashed_run(root: Path, crash_after: int) -> None:
    with pytest.raises(_Crash):
        _local_tier.train(root / "ckpt", root / "local", extra_callbacks=[_CrashAfter(crash_after)])
    # What a new process finds: the saves the crashed fit left in flight have ended.
    for directory in (root / "ckpt", root / "local"):
        saving._in_flight.wait(str(directory))


def _assert_same(model_state, expected) -> None:
    for got, want in zip(model_state, expected, strict=True):
        np.testing.assert_array_equal(got, want)


def test_each_local_step_restores_and_verifies_and_retention_keeps_two(uninterrupted):
    expected, root = uninterrupted
    last = _local_tier.EPOCHS * _local_tier.BATCHES
    assert step_dirs.committed_steps(root / "ckpt") == [4, 8, 12]
    assert step_dirs.committed_steps(root / "local") == [last - 1, last]
    for step in (last - 1, last):
        assert keras_orbax.verify(root / "local", step).intact
    model = _local_tier.build()
    model.optimizer.build(model.trainable_variables)
    result = keras_orbax.restore_sharded(model, root / "local")  # the newest: step 12
    assert result.step == last and result.record.batch is None
    restored = _models.values(model.variables + model.optimizer.variables)  # metrics unbuilt
    _assert_same(restored, expected[: len(restored)])


def test_inspect_of_the_persistent_directory_shows_the_local_tier_beside_it(uninterrupted):
    """`inspect` of a `ModelCheckpoint` directory names its local tier and the steps held there,
    and says so when this machine has none of it (a local tier is each machine's own)."""
    _, root = uninterrupted
    last = _local_tier.EPOCHS * _local_tier.BATCHES
    info = keras_orbax.inspect(root / "ckpt")
    assert info.local_tier == {"directory": str(root / "local"), "steps": [last - 1, last]}
    assert f"local tier: {root / 'local'}: steps [{last - 1}, {last}]" in str(info)
    assert keras_orbax.inspect(root / "local").local_tier == {}  # its own steps name no tier

    moved = root / "local_elsewhere"
    (root / "local").rename(moved)
    try:
        info = keras_orbax.inspect(root / "ckpt")
    finally:
        moved.rename(root / "local")
    assert info.local_tier == {"directory": str(root / "local"), "missing": True}
    assert "not on this machine" in str(info)


def test_a_sigkill_after_any_batch_loses_at_most_that_batch(tmp_path, uninterrupted):
    expected, _ = uninterrupted
    kill_after = int(np.random.default_rng(53).integers(5, 12))  # mid-run, not at an epoch end
    args = {
        "directory": str(tmp_path / "ckpt"),
        "local_directory": str(tmp_path / "local"),
        "kill_after": kill_after,
    }
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(
        XLA_FLAGS="--xla_force_host_platform_device_count=8",
        JAX_PLATFORMS="cpu",
        KERAS_BACKEND="jax",
        PYTHONPATH=str(REPO_ROOT),
    )
    run = subprocess.run(
        [sys.executable, str(WORKERS_DIR / "local_tier_train.py"), json.dumps(args)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        timeout=HANG_S,
    )
    assert run.returncode == -signal.SIGKILL, run.stderr.decode()[-3000:]
    persistent = step_dirs.committed_steps(tmp_path / "ckpt")
    assert persistent[-1] < kill_after - 1  # the persistent tier alone would lose more

    model, checkpoint = _local_tier.train(tmp_path / "ckpt", tmp_path / "local")
    assert checkpoint.restored is not None
    assert checkpoint.restored.step in (kill_after - 1, kill_after)
    _assert_same(_local_tier.state(model), expected)


def test_a_damaged_newest_local_step_is_passed_over_and_kept(tmp_path, uninterrupted):
    expected, _ = uninterrupted
    _crashed_run(tmp_path, crash_after=10)
    newest = step_dirs.committed_steps(tmp_path / "local")[-1]
    _flip_a_byte_of_an_array_file(tmp_path / "local" / str(newest))
    with pytest.warns(KerasOrbaxWarning, match=rf"Step {newest} of .*local.* moved aside"):
        model, checkpoint = _local_tier.train(tmp_path / "ckpt", tmp_path / "local")
    assert checkpoint.restored is not None and checkpoint.restored.step == newest - 1
    assert (tmp_path / "local" / f"{newest}.unreadable").is_dir()  # kept for the user
    _assert_same(_local_tier.state(model), expected)


def test_every_newer_local_step_damaged_falls_back_to_the_persistent_tier(tmp_path, uninterrupted):
    expected, _ = uninterrupted
    _crashed_run(tmp_path, crash_after=7)
    local = step_dirs.committed_steps(tmp_path / "local")
    assert local and all(s > 4 for s in local)
    for step in local:
        _flip_a_byte_of_an_array_file(tmp_path / "local" / str(step))
    with pytest.warns(KerasOrbaxWarning, match=r"No local step .* newer than .* step, 4,"):
        model, checkpoint = _local_tier.train(tmp_path / "ckpt", tmp_path / "local")
    assert checkpoint.restored is not None and checkpoint.restored.step == 4
    assert all((tmp_path / "local" / f"{s}.unreadable").is_dir() for s in local)
    _assert_same(_local_tier.state(model), expected)


def test_the_local_tier_gone_resumes_from_the_persistent_one(tmp_path, uninterrupted):
    expected, _ = uninterrupted
    _crashed_run(tmp_path, crash_after=6)
    shutil.rmtree(tmp_path / "local")  # the machine's local disk did not survive
    with warnings.catch_warnings():
        warnings.simplefilter("error", KerasOrbaxWarning)
        model, checkpoint = _local_tier.train(tmp_path / "ckpt", tmp_path / "local")
    assert checkpoint.restored is not None and checkpoint.restored.step == 4
    _assert_same(_local_tier.state(model), expected)


def _flip_a_byte_of_an_array_file(step_dir: Path) -> None:
    files = sorted(
        (p for p in step_dir.rglob("*") if p.is_file() and p.stat().st_size > 64),
        key=lambda p: p.stat().st_size,
    )
    data = bytearray(files[-1].read_bytes())  # the largest: an array's bytes
    data[len(data) // 2] ^= 0xFF
    files[-1].write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"local_directory": "ckpt"}, "local_directory must be another directory"),
        ({"local_save_freq": 2}, "local_save_freq needs a local_directory"),
        ({"local_directory": "l", "local_save_freq": 0}, "local_save_freq must be a positive"),
        ({"local_directory": "l", "local_max_to_keep": 0}, "local_max_to_keep must be a positive"),
        ({"local_directory": "l", "save_weights_only": True}, "save_weights_only=True"),
    ],
)
def test_arguments_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        keras_orbax.ModelCheckpoint("ckpt", **kwargs)


def _recorded_crcs(step_dir: Path) -> set[frozenset[str]]:
    """The CRC keys of each shard file's entry in a step's checksum files, as distinct sets."""
    from keras_orbax._src.format import crc

    return {
        frozenset(k for k in entry if k in crc.KEYS)
        for path in (step_dir / "state" / "keras_orbax_checksums").glob("process_*.json")
        for entry in json.loads(path.read_text())["files"].values()
    }


def test_a_local_step_records_the_faster_crc_alone_and_verify_checks_it(uninterrupted):
    """The machine that wrote a local step reads it back: one CRC of each file, the faster
    (`crc.LOCAL`); a persistent step records every CRC this process computes, for any reader."""
    from keras_orbax._src.format import crc

    _, root = uninterrupted
    local, persistent = root / "local" / "12", root / "ckpt" / "12"
    assert _recorded_crcs(local) == {frozenset(c.key for c in crc.LOCAL)}
    assert _recorded_crcs(persistent) == {frozenset(c.key for c in crc.RECORDED)}
    result = keras_orbax.verify(root / "local", 12)
    assert result.intact and result.checksummed > 0 and result.unchecked == (), result


def test_a_process_without_crc32c_names_what_to_install_for_a_local_step(
    uninterrupted, monkeypatch
):
    """A local step's files record only a CRC-32C: a process that cannot compute it says what
    to install, rather than calling the step damaged (which resume would move aside)."""
    from keras_orbax._src.format import crc
    from keras_orbax.errors import UnsupportedVersionError

    if crc.LOCAL != (crc.CRC32C,):
        pytest.skip("google-crc32c is not installed: local steps record CRC-32")
    _, root = uninterrupted
    monkeypatch.setattr(crc, "CRC32C", None)
    model = _local_tier.build()
    model.optimizer.build(model.trainable_variables)
    with pytest.raises(UnsupportedVersionError, match=r"keras-orbax\[crc32c\]"):
        keras_orbax.restore_sharded(model, root / "local")
    with pytest.raises(UnsupportedVersionError, match=r"keras-orbax\[crc32c\]"):
        keras_orbax.verify(root / "local", 12)
