"""Preemption notices, turned into "save now" at a training-step boundary.

One process: a SIGTERM handler sets a flag that the callback reads at the next batch or epoch end.
Under `jax.distributed`, JAX's preemption service owns SIGTERM (it installs its own notifier and
shares the notice with every process); `reached_preemption_sync_point` then answers True on every
process at the same step, so all of them enter the collective save together.
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import threading
import weakref
from types import FrameType
from typing import Any

import jax
from jax.experimental import multihost_utils

logger = logging.getLogger("keras_orbax")

# Consecutive and identical on every process (each calls `reached` once per batch of the same fits),
# as JAX's sync protocol requires: it picks "max step seen + 1" as the step to save at, so a counter
# that jumped (optimizer steps under `steps_per_execution`) could skip that step.
_sync_counter = itertools.count(1)
_watching: weakref.WeakSet[PreemptionWatcher] = weakref.WeakSet()  # with a handler installed


def _after_fork_in_child() -> None:
    for watcher in list(_watching):
        watcher._forked()
    _watching.clear()


class PreemptionWatcher:
    """Watches for a preemption notice between `start()` and `stop()`.

    A second SIGTERM while a save is pending is passed to the handler that was installed before
    (by default: the process terminates), so a stuck save can still be interrupted.
    """

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None
        self._installed = False
        self._distributed = False

    def start(self) -> None:
        self.requested = False
        self._distributed = jax.process_count() > 1
        if self._distributed:
            return  # JAX's preemption service handles SIGTERM; see `reached`.
        if threading.current_thread() is not threading.main_thread():
            logger.warning(
                "save_on_preemption: fit() runs outside the main thread, where no signal handler "
                "can be installed; SIGTERM will not trigger a checkpoint."
            )
            return
        previous = signal.getsignal(signal.SIGTERM)
        owner = getattr(previous, "__self__", None)
        if isinstance(owner, PreemptionWatcher):
            # Left behind by a fit() that raised before on_train_end: chain to what it replaced.
            previous = owner._previous
        # None: a handler installed outside Python, which cannot be put back; fall back to the default.
        self._previous = signal.SIG_DFL if previous is None else previous
        signal.signal(signal.SIGTERM, self._on_sigterm)
        self._installed = True
        _watching.add(self)

    def stop(self) -> None:
        _watching.discard(self)
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous)
            self._installed = False

    def _forked(self) -> None:
        """In a child forked during `fit` (a `PyDataset` pool, a user's subprocess): SIGTERM
        does there what it did before `fit`, by default terminating the child, which saves
        nothing (`Pool.terminate()` relies on it)."""
        if self._installed and signal.getsignal(signal.SIGTERM) == self._on_sigterm:
            signal.signal(signal.SIGTERM, self._previous)
        self._installed = False

    def reached(self) -> bool:
        """Whether to save and stop now. Call once per training batch, on every process."""
        if not self._distributed:
            return self.requested
        try:
            reached = multihost_utils.reached_preemption_sync_point(next(_sync_counter))
        except RuntimeError as error:  # jax_enable_preemption_service=False
            logger.warning(
                "save_on_preemption is off: JAX's preemption service is not running (%s)", error
            )
            self._distributed = False
            self._installed = False
            return False
        if reached:
            self.requested = True
        return self.requested

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        if not self.requested:
            self.requested = True
            logger.warning(
                "Received SIGTERM: saving a checkpoint at the next batch boundary, then stopping."
            )
            return
        # A second notice: hand it to whoever handled SIGTERM before us.
        self.stop()
        previous = self._previous
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:
            os.kill(os.getpid(), signal.SIGTERM)


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_after_fork_in_child)
