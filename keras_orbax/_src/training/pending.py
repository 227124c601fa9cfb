"""Background saves in flight: handed to one long-lived thread that collects Orbax's responses."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from keras_orbax._src.write.staging import HostStaging

logger = logging.getLogger("keras_orbax")


def _nothing() -> None:
    pass


class PendingSave:
    """A background save in flight; `join()` waits for it and returns its error, if any."""

    def __init__(self, step: int, where: str = "") -> None:
        self.step = step
        self.where = where  # the directory, for the log
        self.error: BaseException | None = None
        self.done = threading.Event()

    def join(self) -> BaseException | None:
        self.done.wait()
        return self.error

    def failed(self) -> bool:
        """Whether it has finished, with an error: a check that never waits."""
        return self.done.is_set() and self.error is not None


_Item = tuple[PendingSave, Any, Callable[[], None], Callable[[], None], Callable[[], None]]


class Collector:
    """One thread that collects the results of background saves.

    Collecting an Orbax response joins Orbax's own threads, and starting a thread takes 10-20 ms
    on a host whose cores were just busy training: a long-lived collector keeps both off the
    training loop, which only hands over the response and later waits on an event. The saves'
    host buffers (`staging`) are lent to one save at a time and taken back once it has finished.

    Nothing a save or its cleanup raises ends the thread: the first error is logged when it
    happens and kept for `PendingSave.join`, every cleanup still runs, and the save is marked done
    only after, so no later save waits for a thread that is gone.
    """

    def __init__(self) -> None:
        self.staging = HostStaging()
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="keras_orbax_saves", daemon=True)
        self._thread.start()

    def submit(
        self,
        step: int,
        response: Any,
        on_done: Callable[[], None] = _nothing,
        *,
        then: Callable[[], None] = _nothing,
        last: Callable[[], None] = _nothing,
        where: str = "",
    ) -> PendingSave:
        """Collects `response`; calls `then` once it returned (the step is committed and durable,
        e.g. deleting older steps), `on_done` in any case (e.g. releasing a lock), and `last`
        once the collector holds nothing of the save (e.g. resuming the garbage collector).
        `where` names the directory in the log."""
        pending = PendingSave(step, where)
        self._queue.put((pending, response, then, on_done, last))
        return pending

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
        self.staging.close()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            pending, response, then, on_done, last = item
            # Orbax's response holds the save's shards and futures: dropped before `last`.
            del item
            try:
                response.result()
                then()  # only once the step is committed and durable
                errors: list[BaseException] = []
            except BaseException as error:
                errors = [error]
            del response
            errors += _each(on_done, self.staging.release)
            if errors:
                pending.error = errors[0]
            for failure in errors:
                _log(pending, failure)
            pending.done.set()
            # After `done`: a collection the pause held back is due at once, and is not counted
            # against the save. Resuming the collector sets thresholds; it cannot fail but is
            # logged if it does.
            for failure in _each(last):
                _log(pending, failure)


def _log(pending: PendingSave, error: BaseException) -> None:
    where = f" to '{pending.where}'" if pending.where else ""
    logger.error(
        "Saving step %d%s in the background failed: %s: %s",
        pending.step,
        where,
        type(error).__name__,
        error,
    )


def _each(*cleanups: Callable[[], Any]) -> list[BaseException]:
    """Calls every one of `cleanups`, whichever raise; returns what they raised."""
    errors: list[BaseException] = []
    for cleanup in cleanups:
        try:
            cleanup()
        except BaseException as error:  # handed to the training thread by PendingSave.join
            errors.append(error)
    return errors
