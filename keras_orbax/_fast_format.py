"""Reading keras-orbax's `"fast"` array format: exactly the bytes of one region, into an aligned buffer.

An array saved in the fast format is a zarr v3 array whose chunks are the saved shards, each in its own
file: the raw little-endian bytes in C order, followed by a 20-byte zarr shard index (docs/format.md).
A region of the array (one target shard) is read from each file it overlaps with `preadv`, straight
into a 64-byte-aligned host buffer: the CPU backend adopts such a buffer without a copy, and an
accelerator copies it to device memory once. When the region is a saved shard, that is one read. In
object storage each file is an object and each read a ranged request, many in flight at once.
Anything else (compressed, OCDBT) is not this format and goes through Orbax.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import mmap
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from keras_orbax import _storage
from keras_orbax._checksum import crc32c
from keras_orbax._dtypes import np_dtype
from keras_orbax._metadata import STATE, VariableRecord
from keras_orbax.errors import CorruptCheckpointError

Index = tuple[slice, ...]
_ALIGN = 64  # the CPU backend adopts a numpy buffer without a copy only at this alignment
_OWN_MAPPING_BYTES = 1 << 20
_INDEX_BYTES = 16 + 4  # the zarr shard index: one (offset, nbytes) uint64 pair, then a crc32c
_MISSING = 2**64 - 1
_RAW = {"name": "bytes", "configuration": {"endian": "little"}}


@dataclasses.dataclass(frozen=True)
class FastArray:
    """One array in the fast format: where its shard files are and how they are laid out."""

    key: str
    directory: Any  # a pathlib.Path, or an epath.Path in object storage
    shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]
    dtype: np.dtype

    @classmethod
    def open(cls, step_dir: Path, record: VariableRecord) -> FastArray | None:
        """The array if it was saved in the fast format, else None (Orbax will read it)."""
        directory = step_dir / STATE / record.array
        try:
            spec = json.loads((directory / "zarr.json").read_text())
            chunk = tuple(spec["chunk_grid"]["configuration"]["chunk_shape"])
        except (OSError, ValueError, TypeError, KeyError):  # Orbax reads it, or says what is wrong
            return None
        # Tensorstore leaves out the byte order of one-byte dtypes (int8, uint8, bool).
        raw = {"name": "bytes"} if np_dtype(record.dtype).itemsize == 1 else _RAW
        plain = {
            "name": "sharding_indexed",
            "configuration": {
                "chunk_shape": list(chunk),
                "codecs": [raw],
                "index_codecs": [_RAW, {"name": "crc32c"}],
            },
        }
        fits = (
            spec.get("zarr_format") == 3
            and spec.get("codecs") == [plain]
            and spec.get("chunk_key_encoding") == {"name": "default"}
            and spec.get("data_type") == record.dtype
            and tuple(spec.get("shape", ())) == record.shape
            and _chunks_divide(chunk, record.shape)
        )
        return (
            cls(record.key, directory, record.shape, chunk, np_dtype(record.dtype))
            if fits
            else None
        )

    @property
    def chunk_bytes(self) -> int:
        return math.prod(self.chunk_shape) * self.dtype.itemsize

    def file(self, coords: tuple[int, ...]) -> Any:
        return self.directory.joinpath("c", *map(str, coords))

    def chunks_of(self, index: Index) -> list[tuple[int, ...]]:
        """Coordinates of the saved chunks that hold any part of the region `index`."""
        ranges = [
            range(lo // c, (hi - 1) // c + 1)
            for (lo, hi), c in zip(self._bounds(index), self.chunk_shape, strict=True)
        ]
        return list(itertools.product(*ranges))

    def check(self, indices: list[Index]) -> None:
        """Every file holding part of `indices` is there and whole (Orbax writes every chunk, even an
        all-zero one, so a missing file is damage, not a fill value).

        Raises:
            CorruptCheckpointError: listing each missing or truncated file.
        """
        problems = []
        coords = dict.fromkeys(c for index in indices for c in self.chunks_of(index))
        sizes = self._object_sizes() if _storage.is_remote(self.directory) else None
        for path in map(self.file, coords):
            try:
                size = path.stat().st_size if sizes is None else sizes[self._key(path)]
            except (FileNotFoundError, KeyError):
                problems.append(f"  {self.key}: missing file {path}")
                continue
            if size != self.chunk_bytes + _INDEX_BYTES:
                problems.append(
                    f"  {self.key}: {path} has {size} bytes, expected {self.chunk_bytes + _INDEX_BYTES}"
                )
        if problems:
            raise CorruptCheckpointError(
                f"Checkpoint array '{self.directory}' is damaged; {len(problems)} shard files are "
                "missing or truncated:\n" + "\n".join(problems[:20]) + "\nNo variable was modified."
            )

    def read(self, index: Index, dtype: np.dtype) -> np.ndarray:
        """The region `index`, read once into a 64-byte-aligned buffer, cast to `dtype`."""
        bounds = self._bounds(index)
        shape = tuple(hi - lo for lo, hi in bounds)
        out = aligned_empty(math.prod(shape) * self.dtype.itemsize)
        for coords in self.chunks_of(index):
            origin = [c * n for c, n in zip(coords, self.chunk_shape, strict=True)]
            lo = [max(b[0], o) for b, o in zip(bounds, origin, strict=True)]
            hi = [
                min(b[1], o + n) for b, o, n in zip(bounds, origin, self.chunk_shape, strict=True)
            ]
            box = _Box(
                extent=[h - low for h, low in zip(hi, lo, strict=True)],
                src_start=[low - o for low, o in zip(lo, origin, strict=True)],
                dst_start=[low - b[0] for low, b in zip(lo, bounds, strict=True)],
            )
            self._read_box(self.file(coords), box, out, shape)
        data = out.view(self.dtype).reshape(shape)
        if np.dtype(dtype) == self.dtype:
            return data
        cast = aligned_empty(data.size * np.dtype(dtype).itemsize).view(dtype).reshape(shape)
        np.copyto(cast, data, casting="unsafe")
        return cast

    def _object_sizes(self) -> dict[str, int]:
        """Object name (relative to the array) -> size, for every shard object, in one listing."""
        return _storage.object_sizes(self.directory)

    def _key(self, path: Any) -> str:
        return str(path)[len(str(self.directory)) + 1 :]

    def _bounds(self, index: Index) -> list[tuple[int, int]]:
        return [
            (s.start or 0, n if s.stop is None else s.stop)
            for s, n in zip(index, self.shape, strict=True)
        ]

    def _read_box(self, path: Any, box: _Box, out: np.ndarray, out_shape: tuple[int, ...]) -> None:
        if _storage.is_remote(path):
            store, key = _storage.kvstore(self.directory), self._key(path)
            fetch = functools.partial(_fetch_ranges, store, key, path)
            self._read_indexed(path, fetch, None, box, out, out_shape)
            return
        with open(path, "rb", buffering=0) as file:
            fd = file.fileno()
            self._read_indexed(
                path, pread_fetch(fd, path), os.fstat(fd).st_size, box, out, out_shape
            )

    def _read_indexed(
        self,
        path: Any,
        fetch: Fetch,
        size: int | None,
        box: _Box,
        out: np.ndarray,
        out_shape: tuple[int, ...],
    ) -> None:
        """Checks the shard index of `path`, then reads `box` from where it says the data is."""
        index = bytearray(_INDEX_BYTES)
        fetch([(memoryview(index), self.chunk_bytes)])
        offset, stored = struct.unpack("<QQ", index[:16])
        (crc,) = struct.unpack("<I", index[16:])
        end = self.chunk_bytes + _INDEX_BYTES if size is None else size
        if offset == _MISSING or stored != self.chunk_bytes or offset + stored > end:
            raise CorruptCheckpointError(
                f"{self.key}: shard file {path} has no data or a bad index."
            )
        if crc != crc32c(bytes(index[:16])):  # a damaged index could shift the data silently
            raise CorruptCheckpointError(
                f"{self.key}: the shard index of {path} fails its CRC-32C check."
            )
        read_box(fetch, offset, self.chunk_shape, box, out, out_shape, self.dtype)


@dataclasses.dataclass(frozen=True)
class _Box:
    """The part of one chunk a region needs: its extent, where it starts in the chunk and in the region."""

    extent: list[int]
    src_start: list[int]
    dst_start: list[int]

    def runs(
        self, src_shape: tuple[int, ...], dst_shape: tuple[int, ...]
    ) -> list[tuple[int, int, int]]:
        """(source element offset, destination element offset, length) of each contiguous run.

        Trailing dimensions the box covers whole in both the chunk and the region merge into one run,
        so reading a whole saved shard is a single run.
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

    def _split(self, src_shape: tuple[int, ...], dst_shape: tuple[int, ...]) -> tuple[int, int]:
        split = len(self.extent) - 1
        while split > 0 and self.extent[split] == src_shape[split] == dst_shape[split]:
            split -= 1
        return split, self.extent[split] * math.prod(src_shape[split + 1 :])


_SMALL_RUN_BYTES = 1 << 16  # runs shorter than this are read as whole rows, then scattered
_SPAN_BYTES = 4 << 20  # the temporary buffer for such rows
_REQUESTS_AT_ONCE = 256  # ranged requests in flight for one box (object storage)


Fetch = Callable[[list[tuple[memoryview, int]]], None]  # fills each view from its byte offset


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
    box: _Box,
    out: np.ndarray,
    out_shape: tuple[int, ...],
    dtype: np.dtype,
) -> None:
    """Reads the part `box` of an array stored in C order at byte `offset` into `out` (the flat
    bytes of a region of `out_shape`), through `fetch`.

    Contiguous runs of a useful size are each one read straight into `out` (one `preadv`, or one
    ranged request in object storage, several in flight). A box that takes whole stored rows but
    places them as many short runs (a (65536, 1024) embedding saved split on columns and read split
    on rows: 512-byte runs) is read instead as spans of those rows, a few MiB at a time, and
    scattered with numpy: a few large reads instead of one per run, and still exactly the bytes
    needed.
    """
    item = dtype.itemsize
    count, length = box.run_shape(stored_shape, out_shape)
    row = math.prod(stored_shape[1:])
    wanted = math.prod(box.extent[1:])
    # Only when the box takes whole stored rows: the spans then hold exactly the bytes needed
    # (each process reads only its own regions, byte for byte, whatever the layout).
    coalesce = count > 1 and length * item < _SMALL_RUN_BYTES and wanted == row
    if not coalesce:
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


def _fetch_ranges(store: Any, key: str, path: Any, requests: list[tuple[memoryview, int]]) -> None:
    """Fills each view from its byte range of the object `key`, all requests in flight at once."""
    futures = [
        store.read(key, byte_range=slice(offset, offset + len(view))) for view, offset in requests
    ]
    for (view, _), future in zip(requests, futures, strict=True):
        try:
            result = future.result()
        except ValueError as error:  # tensorstore: a range past the end of the object
            raise CorruptCheckpointError(f"{path} is truncated: {error}") from error
        if result.state == "missing":
            raise CorruptCheckpointError(f"{path} is missing.")
        if len(result.value) != len(view):
            raise CorruptCheckpointError(f"{path} is truncated.")
        view[:] = result.value


def _chunks_divide(chunk: tuple, shape: tuple[int, ...]) -> bool:
    """`chunk` (from an untrusted zarr.json) is one positive int per dimension, each dividing it."""
    return len(chunk) == len(shape) and all(
        isinstance(c, int) and not isinstance(c, bool) and c > 0 and n % c == 0
        for n, c in zip(shape, chunk, strict=True)
    )


def _strides(shape: tuple[int, ...]) -> list[int]:
    return [math.prod(shape[d + 1 :]) for d in range(len(shape))]


def _pread_exactly(fd: int, view: memoryview, offset: int, path: Path) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise CorruptCheckpointError(f"{path} is truncated.")
        done += n


def aligned_empty(nbytes: int) -> np.ndarray:
    """An uninitialized uint8 buffer whose data starts on a 64-byte boundary.

    A large buffer is its own anonymous memory mapping: page-aligned, and given back to the OS the
    moment it is freed (glibc keeps large freed blocks resident once its mmap threshold has grown,
    which inflates peak memory and slows the next allocations).
    """
    if nbytes >= _OWN_MAPPING_BYTES:
        mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        return np.frombuffer(mapping, dtype=np.uint8)
    raw = np.empty(nbytes + _ALIGN, dtype=np.uint8)
    start = (-raw.ctypes.data) % _ALIGN
    return raw[start : start + nbytes]
