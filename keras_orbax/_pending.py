"""Background saves in flight: handed to one long-lived thread that collects Orbax's responses."""

from __future__ import annotations

import queue
import threading
from typing import Any


class PendingSave:
    """A background save in flight; `join()` waits for it and returns its error, if any."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.error: BaseException | None = None
        self.done = threading.Event()

    def join(self) -> BaseException | None:
        self.done.wait()
        return self.error


class Collector:
    """One thread that collects the results of background saves.

    Collecting an Orbax response joins Orbax's own threads, and starting a thread takes 10-20 ms
    on a host whose cores were just busy training: a long-lived collector keeps both off the
    training loop, which only hands over the response and later waits on an event.
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[PendingSave, Any] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="keras_orbax_saves", daemon=True)
        self._thread.start()

    def submit(self, step: int, response: Any) -> PendingSave:
        pending = PendingSave(step)
        self._queue.put((pending, response))
        return pending

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            pending, response = item
            try:
                response.result()
            except BaseException as error:  # handed to the training thread by join()
                pending.error = error
            finally:
                pending.done.set()
