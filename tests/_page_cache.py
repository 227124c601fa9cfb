"""Dropping files from the page cache, for cold reads in tests and benchmarks.

```python
evict(path for path in directory.rglob("*") if path.is_file())
```
"""

from __future__ import annotations

import os
from collections.abc import Iterable


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
