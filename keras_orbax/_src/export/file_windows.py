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

The shards of one array are written together (`write_boxes`): their runs of the file merged in
file order, each stretch by one `pwritev` straight from their memory (`box_runs`). A window can be written in the background
(`write_later`) while the next is filled on copy threads of their own (`copy`).

```python
with FileWindows() as files:
    fd = files.open(path)
    files.write([(fd, offset, block), ...])  # one window: several pieces, several files
    files.sync()
```
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from keras_orbax._src.export import box_runs

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
        boxes: box_runs.Boxes,
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
        count = sum(box_runs.BoxRuns(shape, index, tuple(b.shape)).count for index, b in boxes)
        if count > _MAX_RUNS and len(shape) > 1 and shape[0] > 1:
            step = max(1, shape[0] * _MAX_RUNS // count)
            return sum(
                self._write_merged(fd, offset, shape, box_runs.rows(boxes, first, first + step))
                for first in range(0, shape[0], step)
            )
        return self._write_merged(fd, offset, shape, boxes)

    def _write_merged(
        self,
        fd: int,
        offset: int,
        shape: tuple[int, ...],
        boxes: box_runs.Boxes,
    ) -> int:
        runs = box_runs.merged_runs(offset, shape, boxes)
        if runs is None:
            return 0
        blocks = [np.ascontiguousarray(b) for _, b in boxes]
        with self._lock(fd):  # one file: one thread (the module's docstring)
            box_runs.write_gathered(fd, blocks, runs)
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
            box_runs.pwrite_all(fd, view, offset)
            return
        box_runs.pwrite_all(fd, view[:head], offset)
        try:
            box_runs.pwrite_all(direct, view[head : head + body], offset + head)
            self._direct_written[fd] = self._direct_written.get(fd, 0) + body
        except OSError as e:
            if e.errno != errno.EINVAL:  # a filesystem that takes O_DIRECT at open but not here
                raise
            self._direct[fd] = None
            os.close(direct)
            box_runs.pwrite_all(fd, view[head : head + body], offset + head)
        box_runs.pwrite_all(fd, view[head + body :], offset + head + body)

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
