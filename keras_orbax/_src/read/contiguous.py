"""Arrays stored whole, contiguous and in C order at a byte offset of a file, read region by region.

This is how Keras writes every `.weights.h5` dataset (`dset.chunks is None`, no filter), how a
`.keras` archive stores its `model.weights.h5` (uncompressed zip member), and how safetensors stores
tensors. A region (one device's shard) is the same byte-run arithmetic as a fast-format shard over
one chunk that is the whole array: read with `preadv` straight into an aligned buffer that the
device adopts. Arrays that are not stored that way are read region by region through h5py, or
computed on the host (`ComputedArray`) when Keras's own loader derives a value.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from keras_orbax._src.storage.byte_runs import (
    Block,
    Index,
    aligned_empty,
    bounds,
    cast,
    local_file,
    read_box,
)
from keras_orbax.errors import CorruptCheckpointError


@dataclasses.dataclass(frozen=True)
class ContiguousArray:
    """`shape` elements of `dtype`, in C order, at byte `offset` of `file`.

    `dtype` is the stored one, byte order included: a region is viewed in it, then cast (a
    conversion, not a reinterpretation) to the dtype asked for. A source lists such an array in
    its native dtype through `ByteSwappedArray`.
    """

    name: str  # what the source calls it, for errors: an h5 dataset path, a tensor name
    file: Path
    offset: int
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def check(self, indices: list[Index]) -> None:
        """The file holds every byte of the array.

        Raises:
            CorruptCheckpointError: naming the file and the array.
        """
        try:
            size = self.file.stat().st_size
        except OSError as error:
            raise CorruptCheckpointError(
                f"{self.name}: cannot read {self.file}: {error}"
            ) from error
        if size < self.offset + self.nbytes:
            raise CorruptCheckpointError(
                f"{self.name}: {self.file} is truncated: the array needs bytes up to "
                f"{self.offset + self.nbytes}, the file has {size}. No variable was modified."
            )

    def blocks(self, index: Index) -> list[Block]:
        """The array as one block (every region is a box of it)."""
        opener = functools.partial(local_file, self.file, self.offset)
        return [Block((0,) * len(self.shape), self.shape, opener)]

    def read(self, index: Index, dtype: np.dtype) -> np.ndarray:
        """The region `index`, read once into a 64-byte-aligned buffer, cast to `dtype`."""
        region = bounds(index, self.shape)
        shape = tuple(hi - lo for lo, hi in region)
        out = aligned_empty(math.prod(shape) * self.dtype.itemsize)
        (block,) = self.blocks(index)
        with block.opener() as (fetch, offset):
            read_box(fetch, offset, self.shape, block.box(region), out, shape, self.dtype)
        return cast(out.view(self.dtype).reshape(shape), dtype)


@dataclasses.dataclass(frozen=True)
class H5SliceArray:
    """An h5 dataset stored chunked or filtered (not as Keras writes it): each region read through
    h5py, which decodes only the chunks the region touches."""

    name: str
    file: Path
    dataset: str
    shape: tuple[int, ...]
    dtype: np.dtype

    def check(self, indices: list[Index]) -> None:
        if not self.file.exists():
            raise CorruptCheckpointError(f"{self.name}: missing file {self.file}")

    def read(self, index: Index, dtype: np.dtype) -> np.ndarray:
        import h5py

        with h5py.File(self.file, "r") as file:
            region = np.asarray(file[self.dataset][tuple(index)])  # in the stored byte order
        return cast(as_listed(region, self.dtype), dtype)


@dataclasses.dataclass(frozen=True)
class ByteSwappedArray:
    """A contiguous array stored in the other byte order (h5py writes `>f4` when asked to), listed
    in its native dtype: each region is read in the stored order and converted, never
    reinterpreted (Keras's own loader gets the values through h5py, which converts too)."""

    stored: ContiguousArray  # its dtype is the stored one: `>f4`
    dtype: np.dtype  # native: `float32`, or bfloat16 for 2-byte data Keras marks so

    @property
    def name(self) -> str:
        return self.stored.name

    @property
    def shape(self) -> tuple[int, ...]:
        return self.stored.shape

    def check(self, indices: list[Index]) -> None:
        self.stored.check(indices)

    def read(self, index: Index, dtype: np.dtype) -> np.ndarray:
        native = self.stored.read(index, self.stored.dtype.newbyteorder("="))
        return cast(as_listed(native, self.dtype), dtype)


def as_listed(data: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Stored `data` as the `dtype` its source lists it in: non-native byte orders converted to
    native (`astype`), then, where the bytes are another type of one size (bfloat16, which Keras
    stores as 2-byte data with a `dtype` attribute), viewed as `dtype`."""
    if not data.dtype.isnative:
        data = data.astype(data.dtype.newbyteorder("="))
    if data.dtype == dtype:
        return data
    if data.dtype.itemsize == np.dtype(dtype).itemsize and data.dtype.kind in "uV":
        return data.view(dtype)
    return cast(data, dtype)


class ComputedArray:
    """A value the source's own loader derives (LoRA factors Keras sets to zeros, a keras-hub hook
    that is no box of the file): computed on the host by `compute` when its first region is read,
    and dropped once `release()` says every region was (`read_arrays` does); each device gets its
    region only."""

    def __init__(
        self, name: str, compute: Callable[[], Any], shape: tuple[int, ...], dtype: np.dtype
    ) -> None:
        self.name, self.compute, self.shape, self.dtype = name, compute, shape, dtype
        self._value: np.ndarray | None = None
        self._lock = threading.Lock()

    def check(self, indices: list[Index]) -> None:
        return None

    def release(self) -> None:
        self._value = None

    def read(self, index: Index, dtype: np.dtype) -> np.ndarray:
        with self._lock:  # regions are read by several threads; compute once
            if self._value is None:
                self._value = np.asarray(self.compute())
            value = self._value
        region = value[tuple(index)]
        out = (
            aligned_empty(region.size * np.dtype(dtype).itemsize).view(dtype).reshape(region.shape)
        )
        np.copyto(out, region, casting="unsafe")
        return out
