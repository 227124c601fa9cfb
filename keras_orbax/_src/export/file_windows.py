"""Bytes written at known offsets of files laid out in advance, one window at a time.

Every export whose layout is fixed before its data (a safetensors file, an h5 file whose datasets
are allocated up front) writes through this. Each file is written by one thread at a time, in file
order; distinct files are written side by side by up to `THREADS` threads. A local filesystem
serializes buffered writes to one file on its inode lock: more threads on one file copied no
faster and spun on the lock, taking the cores that the kernel's writeback and the exports' own
copies need. Nor does a writer start the writeback itself (`sync_file_range`): the kernel's own
was as fast on ext4, and under gVisor each call waited on the disk (docs/benchmarks.md, "Where the
exports' time went"). `write` returns once the window is written, so that its buffers can go
before the next window is fetched. `sync` fsyncs every file (in parallel) when the last window is
in: the data is on disk before the commit protocol (`storage.commit`) renames anything into place.

A piece held in memory placed like the file (its address and its offset equal modulo `ALIGN`:
`placed`) has its whole pages written with `O_DIRECT`, from its memory straight to the disk. The
page cache's copy, its allocation and its reclaim took 6-8 of the Hugging Face export's 16-18 CPU
s, and a transposing export is CPU-bound on a small machine (docs/benchmarks.md, "Straight to the
disk"). The partial pages at either end, which a neighbour may share, are written through the page
cache; where the filesystem refuses `O_DIRECT`, so is all of it.

The shards of one array are written together (`write_boxes`): a shard cut across columns is one
short run per row, but the array's shards together cover whole rows, so their runs are merged in
file order and each stretch is one `pwritev` straight from the shards' own memory (no copy, a
system call per ~1024 runs rather than per run). A window can be written in the background
(`write_later`) while the next is filled on copy threads of their own (`copy`).

```python
with FileWindows() as files:
    fd = files.open(path)
    files.write([(fd, offset, block), ...])  # one window: several pieces, several files
    files.sync()
```
"""

from __future__ import annotations

import ctypes
import errno
import math
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from keras_orbax._src.runtime import libc

THREADS = 8  # files written at once (each by one thread)
# O_DIRECT's alignment of file offsets, lengths and memory: a page, which covers the logical block
# of every local disk and filesystem block we know (a filesystem that wants more says EINVAL, and
# gets buffered writes).
ALIGN = 4096
# The least of a piece written with O_DIRECT: a direct write waits for the disk, worth it for
# bands of megabytes (a smaller one stays in the page cache, whose writeback overlaps it).
DIRECT_MIN = 1 << 20
_O_DIRECT: int | None = getattr(os, "O_DIRECT", None)  # Linux's; macOS has none
_DIRECT_FLAGS = os.O_WRONLY | os.O_CLOEXEC | (_O_DIRECT or 0)
_MAX_RUNS = 1 << 16  # runs whose offsets `write_boxes` holds at a time

Box = tuple[tuple[slice, ...], np.ndarray]  # (index into the array, the block it names)
Boxes = Sequence[Box]

Piece = tuple[int, int, Any]  # (fd, file offset, bytes: anything with the buffer protocol)
T = TypeVar("T")


class FileWindows:
    """Files open for writing at known offsets, and the threads that write them."""

    def __init__(self, threads: int = THREADS) -> None:
        self.threads = max(1, threads)
        self._pool = ThreadPoolExecutor(self.threads, "keras_orbax_file_windows")
        # Copies are CPU work: one core is left to the writing thread and the kernel's writeback
        # (on 2 cores, a second copy thread made exports slower: docs/benchmarks.md, "Where the
        # exports' time went").
        self.copy_threads = max(1, min(THREADS, (os.cpu_count() or 1) - 1))
        self._copy_pool: ThreadPoolExecutor | None = None
        self._fds: dict[Path, int] = {}
        self._locks: dict[int, threading.Lock] = {}  # one writer per file, windows in flight too
        self._direct: dict[int, int | None] = {}  # each file's O_DIRECT descriptor, if it has one
        self._direct_written: dict[int, int] = {}  # bytes written with it (under the file's lock)

    def __enter__(self) -> FileWindows:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open(self, path: Path) -> int:
        """A descriptor of `path` (which exists: its layout is written), opened once."""
        if path not in self._fds:
            self._fds[path] = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        return self._fds[path]

    def write(self, pieces: Iterable[Piece]) -> int:
        """Writes every piece whole at its offset, each file's by one thread; returns the bytes
        written once all are (the first error, if any, is raised after every thread is done)."""
        return self.write_later(pieces)()

    def write_later(self, pieces: Iterable[Piece]) -> Callable[[], int]:
        """Starts writing the pieces as `write` does and returns at once: the function returned
        waits until every piece is written and returns the bytes (or raises the first error, once
        every thread is done). The pieces' buffers must stay as they are until then."""
        shares = _by_file([_as_bytes(data) for data in pieces])
        futures = [self._pool.submit(self._write_share, share) for share in shares]
        total = sum(len(view) for share in shares for _, _, view in share)

        def wait() -> int:
            errors = [f.exception() for f in futures]
            for error in errors:
                if error is not None:
                    raise error
            return total

        return wait

    def write_boxes(
        self,
        fd: int,
        offset: int,
        shape: tuple[int, ...],
        boxes: Boxes,
    ) -> int:
        """Writes several boxes of one C-order array of `shape` at byte `offset` of `fd` at once
        (each `(index, block)`: `block`, C-contiguous, holds the elements `index` names): the
        runs of every box merged in file order, and each stretch of the file they cover back to
        back written by one `pwritev` of up to `IOV_MAX` of them, straight from the blocks (no
        copy). The shards of an array split across its columns are short runs each, but
        together they cover whole rows: one system call per run (and per inode lock) became the
        cost of a column-split export. Returns the bytes written.

        The runs' offsets are arrays (48 bytes a run, with their iovecs): an array of more than
        `_MAX_RUNS` runs is written a band of rows at a time, so that they stay a few MiB beside
        the window (a (256000, 3584) embedding split across its columns: a million runs, tens of
        MiB of offsets).
        """
        count = sum(_BoxRuns(shape, index, tuple(b.shape)).count for index, b in boxes)
        if count > _MAX_RUNS and len(shape) > 1 and shape[0] > 1:
            step = max(1, shape[0] * _MAX_RUNS // count)
            return sum(
                self._write_merged(fd, offset, shape, _rows(boxes, first, first + step))
                for first in range(0, shape[0], step)
            )
        return self._write_merged(fd, offset, shape, boxes)

    def _write_merged(
        self,
        fd: int,
        offset: int,
        shape: tuple[int, ...],
        boxes: Boxes,
    ) -> int:
        runs = _merged_runs(offset, shape, boxes)
        if runs is None:
            return 0
        blocks = [np.ascontiguousarray(b) for _, b in boxes]
        with self._lock(fd):  # one file: one thread (the module's docstring)
            _write_gathered(fd, blocks, runs)
        return int(runs[3].sum())

    def _lock(self, fd: int) -> threading.Lock:
        return self._locks.setdefault(fd, threading.Lock())

    def _write_share(self, share: list[tuple[int, int, memoryview]]) -> None:
        with self._lock(share[0][0]):
            for fd, offset, view in share:
                self._write_piece(fd, offset, view)

    def _write_piece(self, fd: int, offset: int, view: memoryview) -> None:
        """`view` at `offset`: its whole pages with O_DIRECT where it is `placed` and long enough,
        the rest (or all of it) through the page cache."""
        head = min(len(view), -offset % ALIGN)
        body = (len(view) - head) // ALIGN * ALIGN
        direct = None
        if body >= DIRECT_MIN and (_address(view) - offset) % ALIGN == 0:
            direct = self._direct_fd(fd)
        if direct is None:
            _pwrite_all(fd, view, offset)
            return
        _pwrite_all(fd, view[:head], offset)
        try:
            _pwrite_all(direct, view[head : head + body], offset + head)
            self._direct_written[fd] = self._direct_written.get(fd, 0) + body
        except OSError as e:
            if e.errno != errno.EINVAL:  # a filesystem that takes O_DIRECT at open but not here
                raise
            self._direct[fd] = None
            os.close(direct)
            _pwrite_all(fd, view[head : head + body], offset + head)
        _pwrite_all(fd, view[head + body :], offset + head + body)

    def _direct_fd(self, fd: int) -> int | None:
        """`fd`'s file opened with O_DIRECT once (under the file's lock); None where the
        filesystem refuses it (tmpfs before Linux 6.6, FUSE)."""
        if fd not in self._direct:
            path = next(p for p, f in self._fds.items() if f == fd)
            try:
                self._direct[fd] = None if _O_DIRECT is None else os.open(path, _DIRECT_FLAGS)
            except OSError:
                self._direct[fd] = None
        return self._direct[fd]

    @property
    def direct_bytes(self) -> int:
        """The bytes written with O_DIRECT so far."""
        return sum(self._direct_written.values())

    def map(self, fn: Callable[[T], Any], items: Sequence[T]) -> list[Any]:
        """`fn(item)` for every item on the threads (work that fills a window's buffer: numpy
        copies release the GIL); the results in order."""
        if len(items) <= 1:
            return [fn(item) for item in items]
        return list(self._pool.map(fn, items))

    def copy(self, fn: Callable[[T], Any], items: Sequence[T]) -> list[Any]:
        """`map` on threads of their own, for copies into a buffer while the writing threads
        write the previous one (`write_later`)."""
        if len(items) <= 1:
            return [fn(item) for item in items]
        if self._copy_pool is None:
            self._copy_pool = ThreadPoolExecutor(self.copy_threads, "keras_orbax_file_copies")
        return list(self._copy_pool.map(fn, items))

    def sync(self) -> None:
        """fsyncs every file opened here, in parallel."""
        self.map(os.fsync, list(self._fds.values()))

    def close(self) -> None:
        self._pool.shutdown()
        if self._copy_pool is not None:
            self._copy_pool.shutdown()
        fds, self._fds = list(self._fds.values()), {}
        direct, self._direct = [fd for fd in self._direct.values() if fd is not None], {}
        for fd in fds + direct:
            os.close(fd)


def placed(buffer: np.ndarray, offset: int, nbytes: int) -> np.ndarray:
    """`nbytes` of `buffer` (at least `nbytes + ALIGN` long) whose address is `offset` modulo
    `ALIGN`: written at `offset`, their whole pages go with O_DIRECT."""
    shift = (offset - buffer.ctypes.data) % ALIGN
    return buffer.reshape(-1).view(np.uint8)[shift : shift + nbytes]


def stretch_at(
    offset: int, shape: tuple[int, ...], index: tuple[slice, ...], itemsize: int
) -> int | None:
    """The file offset of the box `index` of a C-order array of `shape` at byte `offset`, where
    the box is one stretch of the file (one run: whole rows past its first axis of more than
    one); None where it is several."""
    runs = _BoxRuns(shape, index, tuple(s.stop - s.start for s in index))
    return offset + runs.src_base * itemsize if runs.count == 1 else None


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, np.uint8).ctypes.data)


def _as_bytes(piece: Piece) -> tuple[int, int, memoryview]:
    fd, offset, data = piece
    if isinstance(data, np.ndarray):
        data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    return fd, offset, memoryview(data).cast("B")


def _by_file(pieces: list[tuple[int, int, memoryview]]) -> list[list[tuple[int, int, memoryview]]]:
    """The pieces of each file, in file order: one thread's share each."""
    files: dict[int, list[tuple[int, int, memoryview]]] = {}
    for piece in pieces:
        files.setdefault(piece[0], []).append(piece)
    return [sorted(share, key=lambda piece: piece[1]) for share in files.values()]


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


class _BoxRuns:
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


def _merged_runs(offset: int, shape: tuple[int, ...], boxes: Boxes) -> Runs | None:
    """Every contiguous run of the file the boxes cover, in file order: (file offset, box number,
    byte offset in the box's block, bytes) each."""
    parts = []
    for number, (index, block) in enumerate(boxes):
        itemsize = block.dtype.itemsize
        runs = _BoxRuns(shape, index, tuple(block.shape))
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


def _rows(boxes: Boxes, first: int, stop: int) -> list[Box]:
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


def _write_gathered(fd: int, blocks: list[np.ndarray], runs: Runs) -> None:
    """Writes the runs (in file order, from the C-contiguous `blocks`): each stretch of
    back-to-back runs by one `pwritev`."""
    at, which, start, length = runs
    if _pwritev is None:  # no C library to call: a `pwrite` per run
        views = [memoryview(b.reshape(-1).view(np.uint8).data) for b in blocks]
        for offset, number, first, size in zip(*(column.tolist() for column in runs), strict=True):
            _pwrite_all(fd, views[number][first : first + size], offset)
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
