"""Small arrays kept whole in one file, read once and cut into every region this process needs."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from keras_orbax._src.format.zarr_shards import FastArray
from keras_orbax._src.storage.byte_runs import Index, aligned_empty, bounds, cast
from keras_orbax._src.storage.small_files import SmallFiles
from keras_orbax.errors import CorruptCheckpointError


@dataclasses.dataclass
class WholeFileReader:
    """Reads the regions of a small array kept in one file (`_write.PACK_BYTES`) by reading the
    file once, whole, and cutting each region out of it: one `preadv` where each region would read
    its own runs of the file (a (64, 64) kernel split on columns over 4 devices: 256 runs of 64
    bytes). Only where this process needs every part of the array (`tiles`), so it reads no byte
    it does not use. The regions are read one after another, by one thread; a local file is read
    among many others by `SmallFiles` once `start`ed."""

    array: FastArray
    remaining: int  # regions still to read; the whole is dropped after the last
    _whole: np.ndarray | None = None
    _files: SmallFiles | None = None

    @staticmethod
    def tiles(array: Any, indices: list[Index]) -> bool:
        """Whether `indices` (distinct regions of one sharding) are all of `array`, in one file."""
        return (
            isinstance(array, FastArray)
            and array.chunk_shape == array.shape
            and sum(math.prod(hi - lo for lo, hi in bounds(i, array.shape)) for i in indices)
            == math.prod(array.shape)
        )

    @property
    def directory(self) -> Any:
        return self.array.directory

    @property
    def path(self) -> str:
        return self.array.local_file((0,) * len(self.array.shape))

    def start(self, files: SmallFiles) -> None:
        """Has `files` read the file (a local one), with others, before the first `read`."""
        self._files = files
        files.start(self.path)

    def read(self, index: Index, dtype: np.dtype) -> np.ndarray:
        """The region `index` in a 64-byte-aligned buffer (the whole's own, or a copy of its part),
        cast to `dtype`."""
        if self._whole is None:
            self._whole = self._read_whole(dtype)
        region = self._whole[index]
        self.remaining -= 1
        if not self.remaining:
            self._whole = None
        if region.shape == self.array.shape:
            return region
        out = aligned_empty(region.nbytes).view(region.dtype).reshape(region.shape)
        out[...] = region
        return out

    def _read_whole(self, dtype: np.dtype) -> np.ndarray:
        whole = tuple(slice(0, n) for n in self.array.shape)
        if self._files is None:
            return self.array.read(whole, dtype)
        try:
            data = self._files.get(self.path)
        except OSError as error:
            raise CorruptCheckpointError(f"{self.array.key}: {error}") from error
        if data is None:
            raise CorruptCheckpointError(f"{self.array.key}: missing file {self.path}")
        array = self.array.from_file(data)
        # Anything but the data followed by the plain index: the general path reads or says why.
        if array is None:
            return self.array.read(whole, dtype)
        # The whole file was just read: its CRC as read.
        self.array.verify_read((0,) * len(self.array.shape), data.data)
        return cast(array, dtype)
