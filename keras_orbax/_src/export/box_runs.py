"""Where a box of a C-order array lies in the array's file, and those runs written together.

A shard cut across an array's columns is one short run of the file per row, but the array's shards
together cover whole rows: `merged_runs` puts their runs in file order, and `write_gathered` writes
each stretch of back-to-back runs with one `pwritev`, straight from the shards' own memory (no copy;
a system call per ~1024 runs rather than per run). `FileWindows.write_boxes` writes through this.

```python
runs = box_runs.merged_runs(offset, array_shape, [(index, block), ...])
box_runs.write_gathered(fd, [block, ...], runs)
```
"""

from __future__ import annotations

import ctypes
import errno
import math
import os
from collections.abc import Sequence

import numpy as np

from keras_orbax._src.runtime import libc

Box = tuple[tuple[slice, ...], np.ndarray]  # (index into the array, the block it names)
Boxes = Sequence[Box]


def stretch_at(
    offset: int, shape: tuple[int, ...], index: tuple[slice, ...], itemsize: int
) -> int | None:
    """The file offset of the box `index` of a C-order array of `shape` at byte `offset`, where
    the box is one stretch of the file (one run: whole rows past its first axis of more than
    one); None where it is several."""
    runs = BoxRuns(shape, index, tuple(s.stop - s.start for s in index))
    return offset + runs.src_base * itemsize if runs.count == 1 else None


def pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


class BoxRuns:
    """The contiguous runs of the file that a box of an array covers: `count` runs of `length`
    elements; the k-th starts at element `src` of the array and `dst` of the box's block."""

    def __init__(
        self, shape: tuple[int, ...], index: tuple[slice, ...], block_shape: tuple[int, ...]
    ) -> None:
        extent = [s.stop - s.start for s in index]
        split = len(extent) - 1
        while split > 0 and extent[split] == shape[split] == block_shape[split]:
            split -= 1
        self.outer = tuple(extent[:split])
        self.count = math.prod(self.outer) if extent else 1
        self.length = extent[split] * math.prod(shape[split + 1 :]) if extent else 1
        src_strides = _strides(shape)
        self.src_base = sum(s.start * stride for s, stride in zip(index, src_strides, strict=True))
        self.src_strides = src_strides[:split]
        self.dst_strides = _strides(block_shape)[:split]

    def between(self, a: int, b: int) -> tuple[np.ndarray, np.ndarray]:
        """(src, dst) element offsets of runs a..b-1."""
        k = np.arange(a, b, dtype=np.int64)
        src = np.full(len(k), self.src_base, np.int64)
        dst = np.zeros(len(k), np.int64)
        if self.outer:
            for position, s, d in zip(
                np.unravel_index(k, self.outer), self.src_strides, self.dst_strides, strict=True
            ):
                src += position * s
                dst += position * d
        return src, dst


def _strides(shape: tuple[int, ...]) -> list[int]:
    return [math.prod(shape[d + 1 :]) for d in range(len(shape))]


Runs = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]  # file offset, box, start, bytes


def merged_runs(offset: int, shape: tuple[int, ...], boxes: Boxes) -> Runs | None:
    """Every contiguous run of the file the boxes cover, in file order: (file offset, box number,
    byte offset in the box's block, bytes) each."""
    parts = []
    for number, (index, block) in enumerate(boxes):
        itemsize = block.dtype.itemsize
        runs = BoxRuns(shape, index, tuple(block.shape))
        if runs.count == 0 or runs.length == 0:
            continue
        src, dst = runs.between(0, runs.count)
        parts.append(
            (
                offset + src * itemsize,
                np.full(len(src), number, np.int64),
                dst * itemsize,
                np.full(len(src), runs.length * itemsize, np.int64),
            )
        )
    if not parts:
        return None
    at, which, start, length = (np.concatenate(column) for column in zip(*parts, strict=True))
    order = np.argsort(at, kind="stable")
    return at[order], which[order], start[order], length[order]


def rows(boxes: Boxes, first: int, stop: int) -> list[Box]:
    """The parts of `boxes` in rows `first`..`stop`-1 of the array (each block's rows, still
    C-contiguous)."""
    parts = []
    for index, block in boxes:
        lo, hi = max(index[0].start, first), min(index[0].stop, stop)
        if lo < hi:
            rows = slice(lo - index[0].start, hi - index[0].start)
            parts.append(((slice(lo, hi), *index[1:]), block[rows]))
    return parts


# Pieces one `pwritev` takes at most (Linux's `UIO_MAXIOV`).
_IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX")) if hasattr(os, "sysconf") else 1024
# The C library's own: its pieces are an array of `struct iovec` that NumPy builds for thousands
# of runs at once, where `os.pwritev` needs a Python buffer per run, which cost whole CPU seconds
# of a large export (docs/benchmarks.md, "Where the exports' time went").
_pwritev = libc.function(
    "pwritev", ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
)


def write_gathered(fd: int, blocks: list[np.ndarray], runs: Runs) -> None:
    """Writes the runs (in file order, from the C-contiguous `blocks`): each stretch of
    back-to-back runs by one `pwritev`."""
    at, which, start, length = runs
    if _pwritev is None:  # no C library to call: a `pwrite` per run
        views = [memoryview(b.reshape(-1).view(np.uint8).data) for b in blocks]
        for offset, number, first, size in zip(*(column.tolist() for column in runs), strict=True):
            pwrite_all(fd, views[number][first : first + size], offset)
        return
    iovecs = np.empty((len(at), 2), np.uint64)  # struct iovec {void *base; size_t length}
    iovecs[:, 0] = np.array([b.ctypes.data for b in blocks], np.uint64)[which] + start
    iovecs[:, 1] = length
    for a, b in _stretches(at, length):
        _pwritev_all(fd, iovecs[a:b], int(at[a]))


def _stretches(at: np.ndarray, length: np.ndarray) -> list[tuple[int, int]]:
    """Run numbers [a, b) of each stretch one `pwritev` writes: back-to-back runs, at most
    `_IOV_MAX` of them."""
    n = len(at)
    gap = np.ones(n, bool)
    gap[1:] = at[1:] != at[:-1] + length[:-1]
    first = np.flatnonzero(gap)[np.cumsum(gap) - 1]  # each run's first run of its stretch
    cut = gap.copy()
    cut[1:] |= (np.arange(1, n) - first[1:]) % _IOV_MAX == 0
    starts = np.flatnonzero(cut).tolist()
    return list(zip(starts, [*starts[1:], n], strict=True))


def _pwritev_all(fd: int, iovecs: np.ndarray, offset: int) -> None:
    """`pwritev` of `iovecs` (rows of `struct iovec`, changed here) until every byte is written:
    a short write resumes where it stopped."""
    assert _pwritev is not None
    remaining, first = int(iovecs[:, 1].sum()), 0
    while remaining:
        done = _pwritev(fd, iovecs[first:].ctypes.data, len(iovecs) - first, offset)
        if done <= 0:
            if done < 0 and ctypes.get_errno() == errno.EINTR:
                continue
            raise libc.last_error() if done < 0 else OSError(errno.EIO, "pwritev wrote nothing")
        offset, remaining = offset + done, remaining - done
        ends = np.cumsum(iovecs[first:, 1])
        whole = int(np.searchsorted(ends, done, side="right"))  # runs written whole
        part = done - (int(ends[whole - 1]) if whole else 0)  # bytes of the next one
        if part:
            iovecs[first + whole, 0] += np.uint64(part)
            iovecs[first + whole, 1] -= np.uint64(part)
        first += whole
