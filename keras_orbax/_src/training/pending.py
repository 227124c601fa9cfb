"""Background saves in flight: handed to one long-lived thread that collects Orbax's responses."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

from keras_orbax._src.write.staging import HostStaging


def _nothing() -> None:
    pass


class PendingSave:
    """A background save in flight; `join()` waits for it and returns its error, if any."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.error: BaseException | None = None
        self.done = threading.Event()

    def join(self) -> BaseException | None:
        self.done.wait()
        return self.error


_Item = tuple[PendingSave, Any, Callable[[], None], Callable[[], None], Callable[[], None]]


class Collector:
    """One thread that collects the results of background saves.

    Collecting an Orbax response joins Orbax's own threads, and starting a thread takes 10-20 ms
    on a host whose cores were just busy training: a long-lived collector keeps both off the
    training loop, which only hands over the response and later waits on an event. The saves'
    host buffers (`staging`) are lent to one save at a time and taken back once it has finished.
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
    ) -> PendingSave:
        """Collects `response`; calls `then` once it returned (the step is committed and durable,
        e.g. deleting older steps), `on_done` in any case (e.g. releasing a lock), and `last`
        once the collector holds nothing of the save (e.g. resuming the garbage collector)."""
        pending = PendingSave(step)
        self._queue.put((pending, response, then, on_done, last))
        return pending

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
        self.staging.close()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            last = item[-1]
            self._collect(*item[:-1])
            del item  # Orbax's response, and through it the save's shards and futures
            last()

    def _collect(
        self,
        pending: PendingSave,
        response: Any,
        then: Callable[[], None],
        on_done: Callable[[], None],
    ) -> None:
        try:
            response.result()
            then()
        except BaseException as error:  # handed to the training thread by join()
            pending.error = error
        finally:
            try:
                on_done()
            finally:
                self.staging.release()
                pending.done.set()
