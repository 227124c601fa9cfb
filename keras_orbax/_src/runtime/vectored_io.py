"""Many runs of a file read or written by few system calls: the C library's `preadv` and
`pwritev`, from an array of `struct iovec` that NumPy builds.

A variable split across its columns is one short run per row: millions at the seed's size.
`os.preadv` and `os.pwritev` take a Python buffer per run (about 0.7 us each: whole CPU seconds);
here a run costs a row of an array, and each stretch of back-to-back runs is one call of up to
`IOV_MAX` of them (docs/benchmarks.md, "Where the exports' time went").

```python
iovecs = iovec_array(addresses, lengths)
for a, b in stretches(offsets, lengths):
    transfer_all(PREADV, fd, iovecs[a:b], int(offsets[a]))
```
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Callable

import numpy as np

from keras_orbax._src.runtime import libc

# Pieces one call takes at most (Linux's `UIO_MAXIOV`).
IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX")) if hasattr(os, "sysconf") else 1024
_ARGS = (ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64)
PREADV = libc.function("preadv", ctypes.c_ssize_t, *_ARGS)
PWRITEV = libc.function("pwritev", ctypes.c_ssize_t, *_ARGS)


def iovec_array(addresses: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Rows of `struct iovec {void *base; size_t length}`."""
    iovecs = np.empty((len(addresses), 2), np.uint64)
    iovecs[:, 0], iovecs[:, 1] = addresses, lengths
    return iovecs


def stretches(at: np.ndarray, length: np.ndarray, limit: int = IOV_MAX) -> list[tuple[int, int]]:
    """Run numbers [a, b) of each stretch one call transfers: runs back to back in the file (run
    k at offset `at[k]`, `length[k]` bytes, in file order), at most `limit` of them."""
    n = len(at)
    gap = np.ones(n, bool)
    gap[1:] = at[1:] != at[:-1] + length[:-1]
    first = np.flatnonzero(gap)[np.cumsum(gap) - 1]  # each run's first run of its stretch
    cut = gap.copy()
    cut[1:] |= (np.arange(1, n) - first[1:]) % limit == 0
    starts = np.flatnonzero(cut).tolist()
    return list(zip(starts, [*starts[1:], n], strict=True))


def transfer_all(call: Callable[..., int], fd: int, iovecs: np.ndarray, offset: int) -> None:
    """`call` (`PREADV` or `PWRITEV`) of `iovecs` (rows of `struct iovec`, changed here) at
    `offset` until every byte is moved: a short transfer resumes where it stopped. Raises the
    call's `OSError`; EOFError where a read finds the end of the file first."""
    remaining, first = int(iovecs[:, 1].sum()), 0
    while remaining:
        done = call(fd, iovecs[first:].ctypes.data, len(iovecs) - first, offset)
        if done <= 0:
            if done < 0 and ctypes.get_errno() == errno.EINTR:
                continue
            if done < 0:
                raise libc.last_error()
            if call is PREADV:
                raise EOFError(f"the file ends before byte {offset + remaining}")
            raise OSError(errno.EIO, "pwritev wrote nothing")
        offset, remaining = offset + done, remaining - done
        ends = np.cumsum(iovecs[first:, 1])
        whole = int(np.searchsorted(ends, done, side="right"))  # runs moved whole
        part = done - (int(ends[whole - 1]) if whole else 0)  # bytes of the next one
        if part:
            iovecs[first + whole, 0] += np.uint64(part)
            iovecs[first + whole, 1] -= np.uint64(part)
        first += whole
