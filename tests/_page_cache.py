"""Dropping files from the page cache, for cold reads in tests and benchmarks.

```python
evict(path for path in directory.rglob("*") if path.is_file())
```
"""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Iterable

import numpy as np


def evict(paths: Iterable[str | os.PathLike]) -> None:
    """Drops the files from the page cache, each written back first so that it can be dropped (a
    no-op where the filesystem keeps files in memory, such as tmpfs)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident_pages(path: str | os.PathLike) -> int:
    """How many pages of the file at `path` are in the page cache (`mincore` on a mapping of it;
    mapping reads nothing)."""
    size = os.path.getsize(path)
    if size == 0:
        return 0
    with open(path, "rb") as file:
        mapping = mmap.mmap(file.fileno(), size, prot=mmap.PROT_READ)
    address = ctypes.c_void_p(np.frombuffer(mapping, np.uint8).ctypes.data)
    pages = (ctypes.c_ubyte * -(-size // mmap.PAGESIZE))()
    if _libc.mincore(address, ctypes.c_size_t(size), pages) != 0:
        raise OSError(ctypes.get_errno(), f"mincore({path})")
    return sum(page & 1 for page in pages)


def written_back(paths: Iterable[str | os.PathLike]) -> list[str]:
    """Of `paths`, those with pages the page cache still holds after being asked to drop them
    without writing them first: pages not yet written to the disk (dirty or being written)."""
    held = []
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        if resident_pages(path):
            held.append(os.fspath(path))
    return held


_libc = ctypes.CDLL(None, use_errno=True)
