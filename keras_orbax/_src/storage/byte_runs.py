"""Reading a box of an array stored in C order at a byte offset of a file, into an aligned buffer.

The arithmetic both the fast format's shard files and contiguous datasets (`.weights.h5`,
safetensors) share: which contiguous runs of bytes a box is, how they are fetched (`preadv` locally,
ranged requests in object storage), and the 64-byte-aligned buffers the CPU backend adopts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import mmap
import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from keras_orbax._src.runtime import host_memory
from keras_orbax.errors import CorruptCheckpointError

Index = tuple[slice, ...]
Fetch = Callable[[list[tuple[memoryview, int]]], None]  # fills each view from its byte offset


class ArrayReader(Protocol):
    """Reads regions of one stored array: what every source gives the sharded read for each array
    (a fast-format shard set, a contiguous dataset, an h5 slice, a value computed on the host...)."""

    def check(self, indices: list[Index]) -> None:
        """Raises `CorruptCheckpointError` (naming the file) if any of `indices` cannot be read;
        called for every array before any is read, so a bad source changes nothing."""

    def read(self, index: Index, dtype: np.dtype) -> np.ndarray:
        """The region `index`, in `dtype` (converted, never reinterpreted), ideally in a 64-byte
        aligned buffer that the CPU backend adopts without a copy."""
        ...


_ALIGN = 64  # the CPU backend adopts a numpy buffer without a copy only at this alignment
_OWN_MAPPING_BYTES = 1 << 20
HUGE_BYTES = 2 << 20  # a huge page of x86-64 and arm64 (4 KiB base pages): `aligned_empty`
_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux only
_SMALL_RUN_BYTES = 1 << 16  # shorter runs are read as rows, then scattered (also `_coalesce`)
_SPAN_BYTES = 1 << 20  # the temporary buffer for such rows (1 MiB: faster and smaller than 4)
_REQUESTS_AT_ONCE = 256  # ranged requests in flight for one box (object storage)


@dataclasses.dataclass(frozen=True)
class Box:
    """The part of one stored array a region needs: its extent, where it starts in the stored array
    and in the region."""

    extent: list[int]
    src_start: list[int]
    dst_start: list[int]

    def runs(
        self, src_shape: tuple[int, ...], dst_shape: tuple[int, ...]
    ) -> list[tuple[int, int, int]]:
        """(source element offset, destination element offset, length) of each contiguous run.

        Trailing dimensions the box covers whole in both the stored array and the region merge into
        one run, so reading a whole saved shard is a single run.
        """
        ndim = len(self.extent)
        if ndim == 0:
            return [(0, 0, 1)]
        split, length = self._split(src_shape, dst_shape)
        src_strides, dst_strides = _strides(src_shape), _strides(dst_shape)
        runs = []
        for outer in itertools.product(*(range(n) for n in self.extent[:split])):
            position = (*outer, 0)
            src = sum((self.src_start[d] + position[d]) * src_strides[d] for d in range(split + 1))
            dst = sum((self.dst_start[d] + position[d]) * dst_strides[d] for d in range(split + 1))
            runs.append((src, dst, length))
        return runs

    def run_shape(self, src_shape: tuple[int, ...], dst_shape: tuple[int, ...]) -> tuple[int, int]:
        """(number of runs, elements per run) that `runs` would give, without listing them."""
        if not self.extent:
            return 1, 1
        split, length = self._split(src_shape, dst_shape)
        return math.prod(self.extent[:split]), length

    def whole_rows(self, src_shape: tuple[int, ...]) -> bool:
        """Whether the box takes whole rows (every element past the first axis) of the stored array."""
        return math.prod(self.extent[1:]) == math.prod(src_shape[1:])

    def _split(self, src_shape: tuple[int, ...], dst_shape: tuple[int, ...]) -> tuple[int, int]:
        split = len(self.extent) - 1
        while split > 0 and self.extent[split] == src_shape[split] == dst_shape[split]:
            split -= 1
        return split, self.extent[split] * math.prod(src_shape[split + 1 :])


@dataclasses.dataclass(frozen=True)
class Block:
    """A part of an array stored whole, in C order, at a byte offset of one file: a fast-format
    shard file, or a contiguous dataset (then the whole array)."""

    origin: tuple[int, ...]  # where it starts in the array
    shape: tuple[int, ...]
    opener: Callable[[], AbstractContextManager[tuple[Fetch, int]]]  # fetch, offset of its data

    def box(self, bounds: list[tuple[int, int]]) -> Box:
        """The part of this block that the region `bounds` (start, stop per axis) needs, which
        must overlap it."""
        ends = [o + n for o, n in zip(self.origin, self.shape, strict=True)]
        lo = [max(b[0], o) for b, o in zip(bounds, self.origin, strict=True)]
        hi = [min(b[1], e) for b, e in zip(bounds, ends, strict=True)]
        return Box(
            extent=[h - low for h, low in zip(hi, lo, strict=True)],
            src_start=[low - o for low, o in zip(lo, self.origin, strict=True)],
            dst_start=[low - b[0] for low, b in zip(lo, bounds, strict=True)],
        )


def bounds(index: Index, shape: tuple[int, ...]) -> list[tuple[int, int]]:
    """(start, stop) of the region `index` (slices with a step of 1) on each axis of `shape`."""
    return [
        (s.start or 0, n if s.stop is None else s.stop) for s, n in zip(index, shape, strict=True)
    ]


@contextlib.contextmanager
def local_file(path: Any, offset: int) -> Iterator[tuple[Fetch, int]]:
    """A `Block.opener` body for data at byte `offset` of a local file."""
    with open(path, "rb", buffering=0) as file:
        yield pread_fetch(file.fileno(), path), offset


def short_runs(
    box: Box, stored_shape: tuple[int, ...], out_shape: tuple[int, ...], itemsize: int
) -> bool:
    """Whether `box` is many runs too short to read one by one (under 64 KiB each)."""
    count, length = box.run_shape(stored_shape, out_shape)
    return count > 1 and length * itemsize < _SMALL_RUN_BYTES


def pread_fetch(fd: int, path: Any) -> Fetch:
    """A `Fetch` reading the local file `fd` with `preadv`."""

    def fetch(requests: list[tuple[memoryview, int]]) -> None:
        for view, offset in requests:
            _pread_exactly(fd, view, offset, path)

    return fetch


def read_box(
    fetch: Fetch,
    offset: int,
    stored_shape: tuple[int, ...],
    box: Box,
    out: np.ndarray,
    out_shape: tuple[int, ...],
    dtype: np.dtype,
) -> None:
    """Reads the part `box` of an array stored in C order at byte `offset` into `out` (the flat
    bytes of a region of `out_shape`), through `fetch`.

    Contiguous runs of a useful size are each one read straight into `out` (one `preadv`, or one
    ranged request in object storage, several in flight). A box that takes whole stored rows but
    places them as many short runs (a (65536, 1024) embedding saved split on columns and read split
    on rows: 512-byte runs) is read instead as spans of those rows, 1 MiB at a time, and
    scattered with numpy: a few large reads instead of one per run, and still exactly the bytes
    needed. (A box that cuts the stored rows is many short reads here; `_coalesce` reads such
    boxes of several regions together.)
    """
    item = dtype.itemsize
    row = math.prod(stored_shape[1:])
    # Only when the box takes whole stored rows: the spans then hold exactly the bytes needed
    # (each process reads only its own regions, byte for byte, whatever the layout).
    if not (short_runs(box, stored_shape, out_shape, item) and box.whole_rows(stored_shape)):
        view = out.data
        runs = iter(box.runs(stored_shape, out_shape))
        # A few requests at a time: a view per run of a large box would cost more than its bytes.
        while batch := list(itertools.islice(runs, _REQUESTS_AT_ONCE)):
            fetch(
                [
                    (view[dst * item : (dst + n) * item], offset + src * item)
                    for src, dst, n in batch
                ]
            )
        return
    target = out.view(dtype).reshape(out_shape)
    inner = tuple(slice(s, s + e) for s, e in zip(box.src_start[1:], box.extent[1:], strict=True))
    placed = tuple(slice(d, d + e) for d, e in zip(box.dst_start[1:], box.extent[1:], strict=True))
    rows_per_span = max(1, _SPAN_BYTES // (row * item))
    first, count = box.src_start[0], box.extent[0]
    span = np.empty(min(count, rows_per_span) * row * item, dtype=np.uint8)
    for start in range(0, count, rows_per_span):
        n = min(rows_per_span, count - start)
        fetch([(span.data[: n * row * item], offset + (first + start) * row * item)])
        rows = span[: n * row * item].view(dtype).reshape((n, *stored_shape[1:]))
        at = box.dst_start[0] + start
        target[(slice(at, at + n), *placed)] = rows[(slice(None), *inner)]


def _strides(shape: tuple[int, ...]) -> list[int]:
    return [math.prod(shape[d + 1 :]) for d in range(len(shape))]


def _pread_exactly(fd: int, view: memoryview, offset: int, path: Path) -> None:
    done = 0
    while done < len(view):
        try:
            n = os.preadv(fd, [view[done:]], offset + done)
        except OSError as error:  # EIO from a failing disk: the file is named, not the fd
            raise unreadable(path, error) from error
        if n == 0:
            raise CorruptCheckpointError(f"{path} is truncated.")
        done += n


def unreadable(path: Any, error: OSError) -> CorruptCheckpointError:
    """The error for a file the system cannot read (EIO, a vanished mount), naming it."""
    return CorruptCheckpointError(f"{path} cannot be read: {error.strerror or error}.")


def aligned_empty(nbytes: int) -> np.ndarray:
    """An uninitialized uint8 buffer whose data starts on a 64-byte boundary (the CPU backend
    adopts it as a device's memory without a copy).

    A large buffer is its own anonymous memory mapping: page-aligned, and given back to the OS the
    moment it is freed (glibc keeps large freed blocks resident once its mmap threshold has grown,
    which inflates peak memory and slows the next allocations). One of `HUGE_BYTES` or more starts
    on a huge-page boundary and is advised `MADV_HUGEPAGE`: where the kernel gives them (THP
    `madvise` or `always`), each 2 MiB is one page fault instead of 512, and filling fresh memory
    costs little more than the copy (docs/benchmarks.md, "Restore read path").
    """
    if nbytes >= HUGE_BYTES:
        return _huge_mapping(nbytes)
    if nbytes >= _OWN_MAPPING_BYTES:
        mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        return np.frombuffer(mapping, dtype=np.uint8)
    raw = np.empty(nbytes + _ALIGN, dtype=np.uint8)
    start = (-raw.ctypes.data) % _ALIGN
    return raw[start : start + nbytes]


def _huge_mapping(nbytes: int) -> np.ndarray:
    """`nbytes` of a private anonymous mapping, from a huge-page boundary, advised huge pages.

    The mapping is one huge page longer than asked, so that the buffer can start on a boundary
    where the kernel does not align the mapping itself. The part after the buffer is closed to
    faults: where memory is backed 2 MiB at a time (transparent huge pages `always`, gVisor), the
    buffer's last bytes would otherwise back a whole 2 MiB past it, a load's peak rising by up to
    that much per buffer (docs/benchmarks.md, "The 13-core host again")."""
    mapping = mmap.mmap(-1, nbytes + HUGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = np.frombuffer(mapping, dtype=np.uint8)
    start = (-whole.ctypes.data) % HUGE_BYTES
    end = start + -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
    host_memory.close_to_faults(whole.ctypes.data + end, len(mapping) - end)
    if _HUGEPAGE is not None:
        with contextlib.suppress(OSError):  # a kernel without THP: 4 KiB pages, as before
            mapping.madvise(_HUGEPAGE, start, nbytes // mmap.PAGESIZE * mmap.PAGESIZE)
    return whole[start : start + nbytes]


def cast(data: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """`data` as `dtype`: itself if it is already, else a cast copy in an aligned buffer."""
    if np.dtype(dtype) == data.dtype:
        return data
    out = aligned_empty(data.size * np.dtype(dtype).itemsize).view(dtype).reshape(data.shape)
    np.copyto(out, data, casting="unsafe")
    return out
