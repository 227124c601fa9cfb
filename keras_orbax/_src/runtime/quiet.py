"""Orbax log lines that keras-orbax's own saves cause but that tell the user nothing."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator

from keras_orbax._src.runtime import orbax_logs

# Orbax logs through absl, whose Python logger is "absl".
_ORBAX_LOGGER = logging.getLogger("absl")
_SKIPPED_MERGE = "Skipping merge of OCDBT checkpoints: No per-process OCDBT checkpoint subdirs"


class _SkippedMergeFilter(logging.Filter):
    """Drops Orbax's "Skipping merge of OCDBT checkpoints" WARNING about steps under `directory`.

    Orbax's pytree handler tries to merge per-process OCDBT files when it finishes any save, OCDBT
    on or off (`BasePyTreeCheckpointHandler._finalize_async` has no option to skip it), and warns
    when there are none: every step of the "fast" format (OCDBT off) did. Other messages, and this
    one about other directories, pass.
    """

    def __init__(self, directory: str | os.PathLike) -> None:
        super().__init__()
        self._prefix = os.path.join(os.path.abspath(directory), "")

    def filter(self, record: logging.LogRecord) -> bool:
        if not isinstance(record.msg, str) or _SKIPPED_MERGE not in record.msg:
            return True
        where = record.args[-1] if isinstance(record.args, tuple) and record.args else ""
        return not os.path.abspath(os.fspath(str(where))).startswith(self._prefix)


@contextlib.contextmanager
def skipped_merge_notices(directory: str | os.PathLike) -> Iterator[None]:
    """Within the block, Orbax's notice that it skipped an OCDBT merge under `directory` is dropped
    (and its other lines below ERROR go to DEBUG, `orbax_logs`)."""
    notice_filter = _SkippedMergeFilter(directory)
    _ORBAX_LOGGER.addFilter(notice_filter)
    try:
        with orbax_logs.at_debug():
            yield
    finally:
        _ORBAX_LOGGER.removeFilter(notice_filter)


# Where Orbax's code lies: absl names the file that logged a record as its `pathname`.
_ORBAX_CODE = f"{os.sep}orbax{os.sep}checkpoint{os.sep}"
DEBUG_LOGGER = logging.getLogger("keras_orbax.orbax")


class _OrbaxErrorsAtDebug(logging.Filter):
    """Passes Orbax's ERROR records on to `DEBUG_LOGGER` at DEBUG, tracebacks included.

    A failed save makes Orbax log the same failure once in each of its threads that meets it
    (the writer's, the metadata's, the commit's, the finalize's), each with its traceback: hundreds
    of lines before the one `SaveFailedError` keras-orbax raises, which names the cause."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR or _ORBAX_CODE not in record.pathname:
            return True
        if DEBUG_LOGGER.isEnabledFor(logging.DEBUG):
            DEBUG_LOGGER.debug(record.getMessage(), exc_info=record.exc_info)
        return False


class _RemovedStagingAtDebug(logging.Filter):
    """Passes Orbax's ERROR records about a staging directory keras-orbax removed after its save
    failed on to `DEBUG_LOGGER` at DEBUG, whenever they come.

    A save's other Orbax threads may still run when its failure is raised and what it staged is
    removed (`step_leftovers.remove_staged`); they then meet the directory gone and log it, after
    `saving`'s block may have ended: the failure keras-orbax raised already said what happened."""

    def __init__(self) -> None:
        super().__init__()
        self.paths: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR or _ORBAX_CODE not in record.pathname:
            return True
        message = record.getMessage()
        if not any(path in message for path in self.paths):
            return True
        if DEBUG_LOGGER.isEnabledFor(logging.DEBUG):
            DEBUG_LOGGER.debug(message, exc_info=record.exc_info)
        return False


_REMOVED_STAGING = _RemovedStagingAtDebug()
_removed_lock = threading.Lock()


def staging_removed(path: str | os.PathLike) -> None:
    """From now on, Orbax's errors naming `path` (a failed save's staging directory, about to be
    removed) go to DEBUG: see `_RemovedStagingAtDebug`."""
    with _removed_lock:
        if not _REMOVED_STAGING.paths:
            _ORBAX_LOGGER.addFilter(_REMOVED_STAGING)
        _REMOVED_STAGING.paths.add(os.fspath(path))


@contextlib.contextmanager
def saving(directory: str | os.PathLike) -> Iterator[None]:
    """Within the block (keras-orbax's saves into `directory`), Orbax's notice that it skipped an
    OCDBT merge there is dropped, and its ERROR records (a failed save's, which keras-orbax raises
    as one `SaveFailedError`) go to the `keras_orbax.orbax` logger at DEBUG."""
    errors_filter = _OrbaxErrorsAtDebug()
    _ORBAX_LOGGER.addFilter(errors_filter)
    try:
        with skipped_merge_notices(directory):
            yield
    finally:
        _ORBAX_LOGGER.removeFilter(errors_filter)


_NO_DATA_FILES = "TensorStore data files not found in checkpoint path"


class _NoDataFilesFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.msg, str) and _NO_DATA_FILES in record.msg)


@contextlib.contextmanager
def no_data_files_notices() -> Iterator[None]:
    """Within the block, Orbax's WARNING that a step has no TensorStore data files is dropped.

    Orbax's v1 loader looks for OCDBT or zarr v2 data files (`orbax_v0_layout`, through Python's
    root logger), which a step of the fast format never has (its arrays are zarr3 shard files):
    the notice comes with every Orbax read of such a step, and one that fails says why itself.
    """
    notice_filter = _NoDataFilesFilter()
    root = logging.getLogger()
    root.addFilter(notice_filter)
    try:
        with orbax_logs.at_debug():
            yield
    finally:
        root.removeFilter(notice_filter)
