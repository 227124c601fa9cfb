"""Python's cyclic garbage collector, paused while a save or restore allocates its small objects."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Within it (or a function it decorates), the cyclic collector does not run.

    A model with thousands of variables keeps millions of Python objects alive, and a restore or
    save allocates tens of thousands more (regions, requests, futures), each allocation counting
    towards a collection that traverses them all: 161 collections, 0.24 s of a 1.6 s restore of
    5000 variables. Nothing here makes garbage that needs the cycle collector in between; reference
    counting frees the rest, and the collector runs again as usual afterwards.

    Example:
    ```python
    @paused()
    def restore(...): ...
    ```
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
