"""Each array of Keras's `.weights.h5` walk, as `weights_h5` writes it: its dataset created as
Keras's `H5IOStore` would, its storage placed in the file and never filled; then its regions written
at the dataset's offset once h5py has closed the file (process 0), or through h5py, or staged as
`.npy` files for process 0 to copy in (every other process), each region's CRC kept.

```python
writer = RegionWriter(window_bytes, staging, primary=True)
saving_compat.save_state(model, path, writer, skip)  # Keras's walk: each array
writer.write_direct()  # once the files are closed
```
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import h5py
import jax
import keras
import numpy as np

from keras_orbax._src.export import export_checksums, file_windows, regions


def create_dataset(
    group: h5py.Group, key: str, shape: Sequence[int], dtype: Any, *, allocated: bool = False
) -> h5py.Dataset:
    """The empty dataset Keras's `H5IOStore.__setitem__` would store an array of `shape` and
    `dtype` (a JAX, NumPy or Keras dtype) in: bfloat16 marked by its `dtype` attribute.

    `allocated`: its storage is placed in the file now and never filled (the bytes are written
    there, by `direct_offset`, once the file is closed)."""
    name = keras.backend.standardize_dtype(dtype)
    numpy_dtype = np.dtype(jax.numpy.dtype(name))  # bfloat16: ml_dtypes', as JAX gives it
    dcpl = None
    if allocated:
        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
        dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
    dataset = group.create_dataset(key, shape=tuple(shape), dtype=numpy_dtype, dcpl=dcpl)
    if name == "bfloat16":
        dataset.attrs["dtype"] = "bfloat16"
    return dataset


def direct_offset(dataset: h5py.Dataset) -> int | None:
    """Where `dataset`'s C-order bytes start in its file, if they lie there as NumPy holds them:
    contiguous, allocated, its stored type the array's size; else None (written through h5py)."""
    if dataset.id.get_create_plist().get_layout() != h5py.h5d.CONTIGUOUS:
        return None
    if dataset.id.get_type().get_size() != dataset.dtype.itemsize:
        return None
    offset = dataset.id.get_offset()
    return None if offset is None else int(offset)


class RegionWriter:
    """Called by Keras's walk with each array: creates its dataset as Keras would (process 0) and
    writes, or stages, the regions this process is the one to write."""

    def __init__(self, window_bytes: int, staging: Path, primary: bool) -> None:
        self.window_bytes = window_bytes
        self.staging = staging
        self.primary = primary
        # (file, h5 path, shape, dtype, sharding, fully addressable, whole shards) of each
        # dataset, in the walk's order (the same on every process)
        self.datasets: list[tuple[str, str, tuple[int, ...], Any, Any, bool, bool]] = []
        self.written: list[str] = []
        # `<dataset number>/<region key>` -> the CRC of each region as this process wrote it
        self.region_crcs: dict[str, int] = {}
        # (dataset number, file offset, array) of each dataset written after the walk
        self.direct: list[tuple[int, int, Any]] = []

    def __call__(self, group: h5py.Group, key: str, value: Any) -> None:
        array = value.value if isinstance(value, keras.Variable) else value
        number = len(self.datasets)
        # Process 0 writes each shard whole where it is in host memory, a window at a time
        # otherwise; the others stage windows. Recorded from the sharding alone, the same on
        # every process: each checks every process's regions (`due`).
        whole = regions.on_host(array)
        self.datasets.append(
            (
                str(group.file.filename),
                f"{group.name}/{key}",
                tuple(array.shape),
                array.dtype,
                array.sharding,
                bool(array.is_fully_addressable),
                whole,
            )
        )
        dataset = None
        if self.primary:
            dataset = create_dataset(group, key, array.shape, array.dtype, allocated=True)
            offset = direct_offset(dataset)
            if offset is not None:  # written once the file is closed (`write_direct`)
                self.direct.append((number, offset, array))
                return
        own = regions.own_shards(array)
        staged_whole = whole and self.primary
        for region in regions.shard_regions(array, own, self.window_bytes, staged_whole):
            name = _staged_name(number, region.index)
            if dataset is not None:
                dataset[region.index] = region.block
            else:
                np.save(self.staging / name, region.block)
            self.written.append(name)
            self._crc(number, region)

    def write_direct(self) -> None:
        """Process 0, once Keras's walk has closed the files: each array's regions written at
        its dataset's offset (`file_windows`), every file fsynced."""
        with file_windows.FileWindows() as files:
            for number, offset, array in self.direct:
                file, _, shape, _, _, _, whole = self.datasets[number]
                fd = files.open(Path(file))
                own = regions.own_shards(array)
                found = regions.shard_regions(array, own, self.window_bytes, whole)
                # A shard in host memory is its own buffer: the array's shards are written
                # together, their runs merged into whole stretches of the file (`write_boxes`);
                # a fetched window goes before the next is fetched.
                for group in [list(found)] if whole else ([r] for r in found):
                    files.write_boxes(fd, offset, shape, [(r.index, r.block) for r in group])
                    self.written += [_staged_name(number, r.index) for r in group]
                    for region in group:
                        self._crc(number, region)
                    del group
            files.sync()
        self.direct = []

    def _crc(self, number: int, region: regions.Region) -> None:
        key = f"{number:06d}/{regions.region_key(region.index)}"
        self.region_crcs[key] = export_checksums.region_crc(np.asarray(region.block))

    def due(self, process: int) -> list[str]:
        """The staged names of every window `process` writes."""
        return [
            _staged_name(number, index)
            for number, (_, _, shape, dtype, sharding, local, whole) in enumerate(self.datasets)
            for index in regions.due_windows(
                shape, dtype, sharding, process, self.window_bytes, local, whole and process == 0
            )
        ]

    def copy_staged(self, process: int) -> None:
        """Writes the regions `process` staged into the files (process 0), one window at a time,
        each opened by the name it was due under."""
        by_file: dict[str, list[tuple[str, regions.Index, str]]] = {}
        for name in self.due(process):
            number, index = _parse_staged(name)
            file, dataset = self.datasets[number][:2]
            by_file.setdefault(file, []).append((dataset, index, name))
        for file, staged in by_file.items():
            with h5py.File(file, "r+") as h5:
                for dataset, index, name in staged:
                    h5[dataset][index] = np.load(self.staging / name)


def _staged_name(number: int, index: regions.Index) -> str:
    return f"{number:06d}.{regions.region_key(index)}.npy"


def _parse_staged(name: str) -> tuple[int, regions.Index]:
    number, _, bounds = name.removesuffix(".npy").partition(".")
    return int(number), regions.parse_region_key(bounds)
