"""Orbax's "Skipping merge of OCDBT checkpoints" WARNING does not reach the user of our saves."""

from __future__ import annotations

import contextlib
import logging
import os

import keras

import keras_orbax
from keras_orbax._src.format import step_dirs
from tests import _models

NOTICE = "Skipping merge of OCDBT checkpoints"
ORBAX_LOGGER = logging.getLogger("absl")


def _notices(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if NOTICE in r.getMessage()]


def test_a_fast_save_logs_no_skipped_merge_notice(tmp_path, caplog, capfd):
    filters = list(ORBAX_LOGGER.filters)
    with caplog.at_level(logging.INFO):
        keras_orbax.save(_models.mlp(), tmp_path, step=1, format="fast")
    assert step_dirs.committed_steps(tmp_path) == [1]
    assert _notices(caplog) == []
    assert NOTICE not in capfd.readouterr().err
    assert ORBAX_LOGGER.filters == filters  # only installed around the save


def test_the_callback_logs_no_skipped_merge_notice(tmp_path, caplog, capfd):
    model = _models.compile_adam(_models.mlp())
    x, y = keras.random.uniform((32, 16)), keras.random.uniform((32, 8))
    filters = list(ORBAX_LOGGER.filters)
    with caplog.at_level(logging.INFO):
        checkpoint = keras_orbax.ModelCheckpoint(tmp_path, save_freq=2, max_to_keep=None)
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[checkpoint])
    assert step_dirs.committed_steps(tmp_path) == [2, 4]  # background saves, finalized by fit's end
    assert _notices(caplog) == []
    assert NOTICE not in capfd.readouterr().err
    assert ORBAX_LOGGER.filters == filters


def test_the_same_notice_about_another_directory_still_passes(tmp_path, caplog):
    from keras_orbax._src.runtime import quiet

    message = (
        "[process=%s][thread=%s] "
        + NOTICE
        + ": No per-process OCDBT checkpoint subdirs found in %s, "
    )
    with caplog.at_level(logging.WARNING), quiet.skipped_merge_notices(tmp_path / "ours"):
        ORBAX_LOGGER.warning(message, 0, "t", tmp_path / "ours" / "1.orbax-checkpoint-tmp")
        ORBAX_LOGGER.warning(message, 0, "t", tmp_path / "other" / "1.orbax-checkpoint-tmp")
    assert [r.args[-1] for r in _notices(caplog)] == [tmp_path / "other" / "1.orbax-checkpoint-tmp"]


def _orbax_records(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if f"{os.sep}orbax{os.sep}" in r.pathname]


def test_orbax_lines_go_to_debug_while_keras_orbax_drives_it(tmp_path, caplog):
    """With INFO logging on (for keras-orbax's save lines), Orbax's own lines (hundreds, at INFO)
    are not among them; they are at DEBUG under `keras_orbax.orbax`, for whoever turns it on."""
    model = _models.compile_adam(_models.mlp())
    x, y = keras.random.uniform((32, 16)), keras.random.uniform((32, 8))
    filters = list(ORBAX_LOGGER.filters)
    with caplog.at_level(logging.INFO):
        checkpoint = keras_orbax.ModelCheckpoint(tmp_path / "fit", save_freq=2, resume=True)
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[checkpoint])
        keras_orbax.save(model, tmp_path / "compact", step=1, format="compact")
        keras_orbax.restore_sharded(model, tmp_path / "compact")  # read through Orbax
    saves = [r.getMessage() for r in caplog.records if r.name == "keras_orbax"]
    assert any("saving step 4" in line for line in saves)
    assert _orbax_records(caplog) == []
    assert ORBAX_LOGGER.filters == filters
    caplog.clear()
    # Orbax's INFO lines made whatever level an earlier test left its (absl's) logger at.
    with (
        caplog.at_level(logging.INFO, logger="absl"),
        caplog.at_level(logging.DEBUG, logger="keras_orbax.orbax"),
    ):
        keras_orbax.save(model, tmp_path / "compact", step=2, format="compact")
    debug = [r for r in caplog.records if r.name == "keras_orbax.orbax"]
    assert debug and all(r.levelno == logging.DEBUG for r in debug)
    assert _orbax_records(caplog) == []


def _orbax_thread_failing_on(path) -> None:
    """Runs Orbax's own `_SignalingThread` (the kind a save's late threads are) on a target that
    meets `path` gone: Orbax logs that at ERROR, from its own code."""
    from orbax.checkpoint._src.futures import future

    def target() -> None:
        os.listdir(path)

    thread = future._SignalingThread(target=target, send_signals=[], receive_signals=[])
    thread.start()
    with contextlib.suppress(FileNotFoundError):  # Orbax's thread raises what it met here too
        thread.join()


def test_orbax_errors_about_a_removed_failed_save_staging_go_to_debug(
    tmp_path, caplog, monkeypatch
):
    """A failed save's staging directory, once keras-orbax removed it, may still be met by that
    save's other Orbax threads: their errors about it go to `keras_orbax.orbax` at DEBUG, at any
    time after; Orbax's errors about anything else still reach the user."""
    from keras_orbax._src.runtime import quiet

    # This filter alone on Orbax's logger, as in a process where no save has failed yet (an
    # earlier test's failed fit may have left its own filters there).
    monkeypatch.setattr(ORBAX_LOGGER, "filters", [])
    monkeypatch.setattr(quiet._REMOVED_STAGING, "paths", set())
    removed, other = tmp_path / "8.orbax-checkpoint-tmp", tmp_path / "elsewhere"
    quiet.staging_removed(removed)
    with caplog.at_level(logging.DEBUG, logger="keras_orbax.orbax"):
        _orbax_thread_failing_on(removed / "state.orbax-checkpoint-tmp")
        _orbax_thread_failing_on(other)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert [str(other) in r.getMessage() for r in errors] == [True]
    at_debug = [r for r in caplog.records if r.name == "keras_orbax.orbax"]
    assert [str(removed) in r.getMessage() for r in at_debug] == [True]
