"""Handing freed host memory back to the kernel (glibc's `malloc_trim`), where glibc allocates.

glibc raises its `mmap` threshold each time a block it had `mmap`ed is freed (up to 32 MiB), so
later blocks of that size come from its heaps, one per thread, where freed pages stay resident. A
Hugging Face export computes some tensors with keras-hub's operations (XLA's results, one tensor
at a time, on XLA's threads): their freed pages piled up beside the model, tensor after tensor
(docs/benchmarks.md, "Exports"). `malloc_trim(0)` returns every heap's free pages.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim  # the process's own C library
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to hand back this way
        return None


def release_freed() -> None:
    """Returns the free pages of glibc's heaps to the kernel; nothing where glibc is not the C
    library.

    ```python
    del computed  # the last reference to a large array
    release_freed()
    ```
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
