"""Python's cyclic garbage collector, paused while a save or restore holds its small objects."""

from __future__ import annotations

import contextlib
import gc
import os
import threading
from collections.abc import Callable, Iterator

_lock = threading.Lock()
_holds = 0
_thresholds = (0, 0, 0)  # as the first hold found them
_generation = 0  # a forked child's holds are its parent's: releasing them there does nothing


def hold() -> Callable[[], None]:
    """Pauses the collector until the returned function is called, from any thread.

    A save or restore allocates tens of thousands of small objects (regions, requests, futures,
    JAX's per-device shards), each counting towards a collection that traverses every object the
    process holds: 161 collections, 0.24 s of a 1.6 s restore of 5000 variables. A background save
    keeps its objects until it commits, so the collections they set off move them to the old
    generation, about 6,000 per save, and every ten or so saves a full collection (0.15 s)
    stalls the training loop on whichever allocation finds it due. Nothing here makes garbage that
    needs the cycle collector; reference counting frees it all, so once the save has let go of
    its objects the collector finds nothing new to do. Holds nest and may overlap across threads.

    The pause sets the first threshold to 0, which stops automatic collections as
    `gc.disable()` does, and leaves `gc.enable()`/`gc.disable()` to the user: a collector the
    user disables or enables meanwhile stays so, and thresholds the user sets meanwhile are
    kept. The last release puts the thresholds back. A child forked during a hold (a
    `PyDataset(use_multiprocessing=True)` pool) gets them back at once.

    Example:
    ```python
    release = gc_pause.hold()
    try:
        ...  # allocate, use and drop the save's objects
    finally:
        release()
    ```
    """
    global _holds, _thresholds
    with _lock:
        if _holds == 0:
            _thresholds = gc.get_threshold()
            gc.set_threshold(0, *_thresholds[1:])  # a first threshold of 0: no automatic runs
        _holds += 1
        generation = _generation
    released = False

    def release() -> None:
        global _holds
        nonlocal released
        with _lock:
            if released or generation != _generation:
                return
            released = True
            _holds -= 1
            if _holds == 0:
                _resume()

    return release


def _resume() -> None:
    """Puts the thresholds back, unless the user set others during the pause."""
    if gc.get_threshold() == (0, *_thresholds[1:]):
        gc.set_threshold(*_thresholds)


def _after_fork_in_child() -> None:
    """The child holds none of its parent's saves: its collector runs as the user left it."""
    global _holds, _generation
    if _holds:
        _resume()
    _holds, _generation = 0, _generation + 1
    _lock.release()  # taken before the fork (so that no other thread held it then)


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(
        before=_lock.acquire, after_in_parent=_lock.release, after_in_child=_after_fork_in_child
    )


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Within it (or a function it decorates), the cyclic collector does not run (`hold`).

    Example:
    ```python
    @paused()
    def restore(...): ...
    ```
    """
    release = hold()
    try:
        yield
    finally:
        release()
