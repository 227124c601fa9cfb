"""Orbax's own log lines while keras-orbax drives it: at DEBUG, under the `keras_orbax.orbax` logger.

Orbax logs through absl (Python's "absl" logger) at INFO for every step it lists, opens, saves and
finalizes: a run with INFO logging on (for keras-orbax's own save lines) got some 300 of them for a
few saves. They describe keras-orbax's internals, not the user's checkpoint, and keras-orbax says
in its own words what matters (its save lines, warnings and errors). So while keras-orbax drives
Orbax (`quiet`'s notices mark where: the saves, the callback's whole fit, the reads through Orbax),
Orbax's records below ERROR are dropped from "absl", and passed on at DEBUG to `keras_orbax.orbax`
for whoever turns that on: `logging.getLogger("keras_orbax.orbax").setLevel(logging.DEBUG)`. Orbax
used by the user's own code outside keras-orbax's calls logs as it always did.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator

_ABSL = logging.getLogger("absl")
DEBUG_LOGGER = logging.getLogger("keras_orbax.orbax")
_ORBAX = f"{os.sep}orbax{os.sep}"  # in the path of Orbax's own modules


class _AtDebug(logging.Filter):
    def __init__(self) -> None:
        super().__init__()
        self.passes = logging.NOTSET  # the level "absl" let through before it was lowered

    def filter(self, record: logging.LogRecord) -> bool:
        if _ORBAX not in record.pathname:
            return record.levelno >= self.passes
        if record.levelno >= logging.ERROR:
            return True
        if DEBUG_LOGGER.isEnabledFor(logging.DEBUG):
            DEBUG_LOGGER.debug("%s", record.getMessage())
        return False


_FILTER = _AtDebug()
_lock = threading.Lock()
_depth = 0  # blocks open, across threads: the callback's spans a fit, a save's its writes
_level = logging.NOTSET  # "absl"'s own level, put back when the last block closes


@contextlib.contextmanager
def at_debug() -> Iterator[None]:
    """Within the block (in any thread: Orbax finishes saves in its own), Orbax's log records
    below ERROR go to `keras_orbax.orbax` at DEBUG instead of "absl"."""
    global _depth, _level
    with _lock:
        if _depth == 0:
            _ABSL.addFilter(_FILTER)
            _level, _FILTER.passes = _ABSL.level, _ABSL.getEffectiveLevel()
            if DEBUG_LOGGER.isEnabledFor(logging.DEBUG):  # else Orbax makes no INFO records
                _ABSL.setLevel(logging.DEBUG)  # the filter keeps other libraries' at their level
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                _ABSL.removeFilter(_FILTER)
                _ABSL.setLevel(_level)
