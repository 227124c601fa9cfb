"""Thread pools kept for the life of the process, one per kind of work and number of threads.

Starting a pool's threads for every restore, save or commit was a measurable share of each
(docs/benchmarks.md: a quarter of a 256 MiB restore; part of a save's commit), so readers,
writers and fsyncs take theirs from here. A forked child starts with none: its parent's threads
are not in it, and a pool that believes it has idle threads would queue work no thread runs.

```python
pool = thread_pools.shared("fsync", 16)
```
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

_pools: dict[tuple[str, int], ThreadPoolExecutor] = {}
_lock = threading.Lock()


def shared(kind: str, workers: int) -> ThreadPoolExecutor:
    """The process's pool of `workers` threads for work of `kind`, started on first use."""
    with _lock:
        pool = _pools.get((kind, workers))
        if pool is None:
            pool = _pools[kind, workers] = ThreadPoolExecutor(workers, f"keras_orbax_{kind}")
        return pool


def _forget() -> None:
    """In a forked child: the parent's pools have no threads here, and their lock may be held."""
    global _lock
    _pools.clear()
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget)
