"""Functions of the process's C library that Python's `os` lacks, or offers at a cost a benchmark
showed, called through ctypes (which releases the GIL during the call).

```python
pwritev = libc.function("pwritev", ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p, ...)
if pwritev is not None and pwritev(fd, iovecs, count, offset) < 0:
    raise libc.last_error()
```
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable
from typing import Any


@functools.cache
def function(name: str, restype: Any, *argtypes: Any) -> Callable[..., Any] | None:
    """The C library's `name`, typed; None where it has none (not glibc, not Linux, not POSIX).
    Each keeps `errno` for `last_error`."""
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.restype, fn.argtypes = restype, list(argtypes)
    return fn


def last_error() -> OSError:
    """The `OSError` of the `errno` the last call through `function` left on this thread."""
    code = ctypes.get_errno()
    return OSError(code, os.strerror(code))
