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

import contextlib
import dataclasses
import functools
import itertools
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from keras_orbax._src.format.checksum import shard_index
from keras_orbax._src.format.dtypes import np_dtype
from keras_orbax._src.format.read_checks import PIECE_BYTES, ReadChecks, read_in_pieces
from keras_orbax._src.format.step_record import STATE, VariableRecord
from keras_orbax._src.format.zarr_layout import (
    INDEX_BYTES,
    ONE_FILE_KEYS,
    ONE_FILE_SEPARATOR,
    chunk_key,
    data_offset,
    fast_codec,
    plain_layout,
    refuse_another_array,
    refuse_missing_spec,
    refuse_unparsable_spec,
)
from keras_orbax._src.storage import locations, mapped
from keras_orbax._src.storage.byte_runs import (
    Block,
    Fetch,
    Index,
    aligned_empty,
    bounds,
    cast,
    pread_fetch,
    read_box,
    unreadable,
)
from keras_orbax.errors import CorruptCheckpointError

# What write/ takes from here (the layout is zarr_layout's).
__all__ = ["ONE_FILE_KEYS", "ONE_FILE_SEPARATOR", "FastArray", "chunk_key", "fast_codec"]

# Shard files of one array that are checked by name, one by one, without counting them first:
# one per device of a 65,536-device mesh.
_MANY_FILES = 1 << 16


@dataclasses.dataclass(frozen=True)
class FastArray:
    """One array in the fast format: where its shard files are and how they are laid out."""

    key: str
    directory: Any  # a pathlib.Path, or an epath.Path in object storage
    shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]
    dtype: np.dtype
    separator: str = "/"  # of the chunk keys: c/0/1, or c.0.1 (a small array's one file)
    # With them, every byte read is checked against its file's recorded CRC-32 (`read_checks`).
    checks: ReadChecks | None = dataclasses.field(
        default=None, compare=False, hash=False, repr=False
    )

    @classmethod
    def open(cls, step_dir: Path, record: VariableRecord) -> FastArray | None:
        """The array if it was saved in the fast format, else None (Orbax will read it)."""
        directory = step_dir / STATE / record.array
        try:
            spec = _read_small(directory, "zarr.json")
        except OSError:  # Orbax reads it, or says what is wrong
            return None
        return cls.from_spec(directory, record, spec)

    @classmethod
    def from_spec(
        cls, directory: Path, record: VariableRecord, spec: bytes | np.ndarray | None
    ) -> FastArray | None:
        """`open` of the array in `directory`, given the contents of its `zarr.json` (None: there
        is none)."""
        if spec is None:
            refuse_missing_spec(directory, record)
            return None
        raw = spec.tobytes() if isinstance(spec, np.ndarray) else spec
        layout = plain_layout(raw, np_dtype(record.dtype).itemsize == 1)
        if layout is None:
            refuse_unparsable_spec(directory, record, raw)
            return None  # another layout: Orbax reads it, or says what is wrong
        if layout[:2] != (record.dtype, record.shape):
            refuse_another_array(directory, record, *layout[:2])
        _, shape, chunk, separator = layout
        array = cls(record.key, directory, shape, chunk, np_dtype(record.dtype), separator)
        array.refuse_a_grid_beyond_its_files()
        return array

    def refuse_a_grid_beyond_its_files(self) -> None:
        """A grid of more than `_MANY_FILES` shard files is counted against the files the
        directory holds before anything walks it: a hostile `zarr.json` and record declaring a
        huge shape in small chunks would have every check walk billions of names.

        Raises:
            CorruptCheckpointError: naming the array's directory.
        """
        grid = math.prod(n // c for n, c in zip(self.shape, self.chunk_shape, strict=True))
        if grid <= _MANY_FILES:
            return
        if locations.is_remote(self.directory):
            there = len(self._object_sizes())
        else:
            there = sum(len(files) for _, _, files in os.walk(self.directory)) - 1  # zarr.json
        if there < grid:
            raise CorruptCheckpointError(
                f"Checkpoint array '{self.directory}' ({self.key}) is damaged: its shape "
                f"{self.shape} in chunks of {self.chunk_shape} makes {grid} shard files, and the "
                f"directory holds {there}. No variable was modified."
            )

    @property
    def chunk_bytes(self) -> int:
        return math.prod(self.chunk_shape) * self.dtype.itemsize

    def file(self, coords: tuple[int, ...]) -> Any:
        return self.directory / chunk_key(coords, self.separator)

    def local_file(self, coords: tuple[int, ...]) -> str:
        """`file` of a local array as a string: building a `pathlib` path costs more than reading
        a small file (5000 arrays)."""
        return f"{os.fspath(self.directory)}/{chunk_key(coords, self.separator)}"

    def chunks_of(self, index: Index) -> list[tuple[int, ...]]:
        """Coordinates of the saved chunks that hold any part of the region `index`."""
        if self.chunk_shape == self.shape:  # one file
            return [(0,) * len(self.shape)]
        ranges = [
            range(lo // c, (hi - 1) // c + 1)
            for (lo, hi), c in zip(bounds(index, self.shape), self.chunk_shape, strict=True)
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
        sizes = self._object_sizes() if locations.is_remote(self.directory) else None
        base = os.fspath(self.directory)
        for key in (chunk_key(c, self.separator) for c in coords):
            path = f"{base}/{key}"  # a string: pathlib costs more than the stat (5000 arrays)
            try:
                size = os.stat(path).st_size if sizes is None else sizes[key]
            except (FileNotFoundError, KeyError):
                problems.append(f"  {self.key}: missing file {path}")
                continue
            if size != self.chunk_bytes + INDEX_BYTES:
                problems.append(
                    f"  {self.key}: {path} has {size} bytes, expected {self.chunk_bytes + INDEX_BYTES}"
                )
        if problems:
            raise CorruptCheckpointError(
                f"Checkpoint array '{self.directory}' is damaged; "
                + ("1 shard file is" if len(problems) == 1 else f"{len(problems)} shard files are")
                + " missing or truncated:\n"
                + "\n".join(problems[:20])
                + "\nNo variable was modified."
            )

    def blocks(self, index: Index) -> list[Block]:
        """The saved shards that hold any part of the region `index`, as blocks to read boxes of."""
        return [
            Block(
                tuple(c * n for c, n in zip(coords, self.chunk_shape, strict=True)),
                self.chunk_shape,
                functools.partial(self._open, coords),
            )
            for coords in self.chunks_of(index)
        ]

    def read(self, index: Index, dtype: np.dtype) -> np.ndarray:
        """The region `index`, read once into a 64-byte-aligned buffer, cast to `dtype`."""
        region = bounds(index, self.shape)
        shape = tuple(hi - lo for lo, hi in region)
        whole = self.is_one_shard(index)
        mapped = self._map_whole(region) if whole else None
        if mapped is not None:
            self._verify_shard(region, mapped)
            return cast(mapped.view(self.dtype).reshape(shape), dtype)
        out = aligned_empty(math.prod(shape) * self.dtype.itemsize)
        if whole and self._read_whole(region, out):  # checked as it was read
            return cast(out.view(self.dtype).reshape(shape), dtype)
        for block in self.blocks(index):
            with block.opener() as (fetch, offset):
                read_box(fetch, offset, block.shape, block.box(region), out, shape, self.dtype)
        if whole:
            self._verify_shard(region, out)
        return cast(out.view(self.dtype).reshape(shape), dtype)

    def _verify_shard(self, region: list[tuple[int, int]], data: np.ndarray) -> None:
        """With `checks`, checks the data just read of a region that is one whole shard: its
        file is that data followed by the plain shard index (`_read_whole` and `_open` checked
        the index), so the file's CRC extends the data's with the index's."""
        coords = tuple(lo // n for (lo, _), n in zip(region, self.chunk_shape, strict=True))
        self.verify_read(coords, data.reshape(-1).view(np.uint8).data, self._plain_index)

    def verify_read(self, coords: tuple[int, ...], *parts: Any) -> None:
        """Checks `parts`, the whole file of chunk `coords` as it was read, against the checksum
        recorded for it (no `checks`, or none recorded for that file: nothing to check).

        Raises:
            CorruptCheckpointError: naming the array and the file.
        """
        if self.checks is not None:  # the path only for a message: a Path costs more than a CRC
            file = functools.partial(self.file, coords)
            self.checks.whole(self.file_name(coords), self.key, file, *parts)

    def file_name(self, coords: tuple[int, ...]) -> str:
        """The file of chunk `coords` as a step's checksum files name it: `<array>/<chunk key>`."""
        return f"{self.directory.name}/{chunk_key(coords, self.separator)}"

    def from_file(self, data: np.ndarray) -> np.ndarray | None:
        """The array from the bytes of its one file (`chunk_shape == shape`) if they are its data
        followed by the shard index every keras-orbax file has, else None."""
        n = self.chunk_bytes
        if data.size != n + INDEX_BYTES or data[n:].tobytes() != self._plain_index:
            return None
        return data[:n].view(self.dtype).reshape(self.shape)

    @property
    def _plain_index(self) -> bytes:
        """The shard index of a file holding the chunk at offset 0, with its CRC-32C."""
        return shard_index(self.chunk_bytes)

    def is_one_shard(self, index: Index) -> bool:
        """The region `index` is exactly one saved shard (the saved layout, or a coarser one)."""
        return all(
            hi - lo == n and lo % n == 0
            for (lo, hi), n in zip(bounds(index, self.shape), self.chunk_shape, strict=True)
        )

    def _map_whole(self, region: list[tuple[int, int]]) -> np.ndarray | None:
        """The data of a region that is exactly one large saved shard of a local file, mapped
        (`mapped`) where the user opted in; None where it is not (then it is read)."""
        if (
            self.chunk_bytes < mapped.MIN_BYTES
            or locations.is_remote(self.directory)
            or not mapped.enabled()
        ):
            return None
        coords = tuple(lo // n for (lo, _), n in zip(region, self.chunk_shape, strict=True))
        data = mapped.map_file(self.local_file(coords), self.chunk_bytes + INDEX_BYTES)
        if data is None or data[self.chunk_bytes :].tobytes() != self._plain_index:
            return None  # reading it says what is wrong, if anything
        return data[: self.chunk_bytes]

    def _read_whole(self, region: list[tuple[int, int]], out: np.ndarray) -> bool:
        """Reads a region that is exactly one saved shard, data then index, the data in pieces
        each checksummed while in the cache (`read_checks.read_in_pieces`), and checks the file
        with `checks`. False where that does not apply (object storage, a short read, an index
        placing the data elsewhere than at the start): then the general path reads."""
        if locations.is_remote(self.directory):
            return False
        coords = tuple(lo // n for (lo, _), n in zip(region, self.chunk_shape, strict=True))
        path = self.local_file(coords)
        name = self.file_name(coords) if self.checks is not None else ""
        algorithm = None if self.checks is None else self.checks.algorithm(name)
        index = bytearray(INDEX_BYTES)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                # One system call where nothing is checked or the file is small (most of the
                # time of a restore of many small variables is system calls).
                if algorithm is None or self.chunk_bytes <= PIECE_BYTES:
                    got, crc = os.preadv(fd, [out.data, index], 0), 0
                    if algorithm is not None:
                        crc = algorithm.update(0, out.data)
                else:
                    got, crc = read_in_pieces(fd, out.data, 0, algorithm)
                    if got == self.chunk_bytes:
                        got += os.preadv(fd, [index], got)
            finally:
                os.close(fd)
        except OSError as error:
            raise unreadable(path, error) from error
        if got != self.chunk_bytes + INDEX_BYTES:  # short: the general path reads or says why
            return False
        # The index every keras-orbax shard file has (CRC included), or one that says the same.
        if index != self._plain_index and self._check_index(path, index, got) != 0:
            return False
        if self.checks is not None and algorithm is not None:
            file = functools.partial(self.file, coords)
            self.checks.compare(name, self.key, file, algorithm.update(crc, index))
        return True

    def _object_sizes(self) -> dict[str, int]:
        """Object name (relative to the array) -> size, for every shard object, in one listing."""
        return locations.object_sizes(self.directory)

    @contextlib.contextmanager
    def _open(self, coords: tuple[int, ...]) -> Iterator[tuple[Fetch, int]]:
        """(fetch, byte offset of the data) of the shard file of chunk `coords`, its index checked."""
        path = self.file(coords)
        if locations.is_remote(path):
            store, key = locations.kvstore(self.directory), chunk_key(coords, self.separator)
            remote: Fetch = functools.partial(_fetch_ranges, store, key, path)
            yield self._checked(coords, remote, self._data_offset(path, remote, None))
            return
        with open(path, "rb", buffering=0) as file:
            fd = file.fileno()
            fetch = pread_fetch(fd, path)
            # `check` has found the file's size to be exactly data + index.
            yield self._checked(coords, fetch, self._data_offset(path, fetch, None))

    def _checked(self, coords: tuple[int, ...], fetch: Fetch, offset: int) -> tuple[Fetch, int]:
        """(fetch, offset), the fetch noting what it reads where `checks` asks for it."""
        if self.checks is None:
            return fetch, offset
        name, path = self.file_name(coords), self.file(coords)
        local = not locations.is_remote(path)
        fetch = self.checks.fetching(name, self.key, path, self.chunk_bytes, fetch, offset, local)
        return fetch, offset

    def checked_by(self, checks: ReadChecks) -> FastArray:
        """This array, its reads checked by `checks` (`dataclasses.replace` costs more than the
        read of a small array)."""
        return FastArray(
            self.key,
            self.directory,
            self.shape,
            self.chunk_shape,
            self.dtype,
            self.separator,
            checks,
        )

    def _check_index(self, path: Any, index: bytearray, end: int) -> int:
        """Checks a shard index read from `path` (`end`: the file's size); returns the data's offset."""
        return data_offset(self.key, path, index, self.chunk_bytes, end)

    def _data_offset(self, path: Any, fetch: Fetch, size: int | None) -> int:
        """Checks the shard index of `path`; returns where it says the data is."""
        index = bytearray(INDEX_BYTES)
        fetch([(memoryview(index), self.chunk_bytes)])
        return self._check_index(
            path, index, self.chunk_bytes + INDEX_BYTES if size is None else size
        )


def _read_small(directory: Any, name: str) -> bytes:
    """The file `name` under `directory`; a local one read without pathlib (5000 zarr.json files:
    a third of the time of opening them went to building paths)."""
    if locations.is_remote(directory):
        return (directory / name).read_bytes()
    with open(f"{os.fspath(directory)}/{name}", "rb") as f:
        return f.read()


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
