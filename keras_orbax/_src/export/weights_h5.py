"""A sharded model written as Keras's `.weights.h5`, one window of one shard at a time.

Keras's `save_weights` fetches every variable whole to one host (`H5IOStore.__setitem__` converts
it to NumPy), which runs a host out of memory on a sharded model too big for it and fails outright
under `jax.distributed` on arrays that span other processes. Here Keras's own walk still decides
every group, dataset name and attribute (`keras_compat.save_state`); only each array is written
differently: its dataset is created with the full shape and dtype, then filled region by region
from the shards (`regions`).

An h5 file has one writer, process 0. Under `jax.distributed` every other process writes the
regions that only it holds, window by window, as `.npy` files in a staging directory beside the
destination (which must be on a filesystem all processes share), and process 0 copies them in.
The file is written under a hidden temporary name and renamed into place only when complete; on any
failure, on any process, nothing is left at the destination.
"""

from __future__ import annotations

import io
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import h5py
import jax
import keras
import numpy as np

from keras_orbax._src.compat import saving_compat
from keras_orbax._src.export import regions
from keras_orbax._src.runtime import multihost
from keras_orbax._src.storage import durable, locations
from keras_orbax.errors import SaveFailedError

SUFFIX = ".weights.h5"
SHARDED_SUFFIX = ".weights.json"


def save_weights(
    model: keras.Model,
    path: str | os.PathLike,
    *,
    window_bytes: int = regions.DEFAULT_WINDOW_BYTES,
    objects_to_skip: Sequence[Any] = (),
    max_shard_size: float | None = None,
) -> Path:
    """Writes `model`'s weights as Keras's `.weights.h5`, without fetching any variable whole.

    The file is the one `model.save_weights(path)` writes (the same groups, datasets, dtypes and
    attributes), and `model.load_weights(path)` reads it back. Call on every process: each
    process's own shards are read window by window; process 0 writes the file.

    Args:
        model: A built model, sharded or not.
        path: The file to write, ending in `.weights.h5` (local; replaced if it exists).
        window_bytes: The most bytes of one array copied to the host at a time (256 MiB).
        objects_to_skip: Layers (or other saveables) whose state is not written, as in
            `keras.saving.save_weights`.
        max_shard_size: If given (in GB), `path` ends in `.weights.json` and is written, with
            its `_NNNNN.weights.h5` parts, as `save_weights(path, max_shard_size=...)` writes it.

    Returns:
        The file written (absolute).

    Example:
    ```python
    keras_orbax.save_weights(model, "model.weights.h5")
    model.load_weights("model.weights.h5")
    ```

    Raises:
        ValueError: `path` does not end in `.weights.h5` (`.weights.json` with `max_shard_size`)
            or is an object-store URL, or `model` is not built.
        OSError: the file could not be written; nothing was left at `path`. Under
            `jax.distributed`, `SaveFailedError` on every process, naming each one's error.
    """
    destination = _local_destination(path, SUFFIX if max_shard_size is None else SHARDED_SUFFIX)
    if not model.built:
        raise ValueError(
            "save_weights needs a built model: call it on data or `build()` it first. "
            f"Received: model={model.name!r}"
        )
    return write(
        model,
        destination,
        window_bytes=window_bytes,
        skip=objects_to_skip,
        max_shard_size=max_shard_size,
    )


def _local_destination(path: str | os.PathLike, suffix: str) -> Path:
    text = os.fspath(path)
    if locations.is_remote(text):
        raise ValueError(
            f"save_weights writes a local file; write it locally, then copy it. Received: path={text!r}"
        )
    if not text.endswith(suffix):
        raise ValueError(f"The file name must end in `{suffix}`. Received: path={text!r}")
    destination: Path = locations.as_path(text)
    return destination


def write(
    model: keras.Model,
    destination: Path,
    *,
    window_bytes: int = regions.DEFAULT_WINDOW_BYTES,
    skip: Sequence[Any] = (),
    max_shard_size: float | None = None,
) -> Path:
    """Writes `destination` (absolute) as `save_weights` does; collective under `jax.distributed`.

    Sharded (`max_shard_size`), the index and its parts are written into a hidden directory, then
    moved into place: the old index removed first, the parts, the new index last, so that a failure
    part-way leaves no index that names a part of another export.
    """
    sharded = max_shard_size is not None
    partial = destination.with_name(f".{destination.name}.partial")  # a directory if sharded
    staging = destination.with_name(f".{destination.name}.staging")
    primary = multihost.is_primary()
    shared = multihost.process_count() > 1
    name = f"save_weights {destination}"
    error: BaseException | None = None
    if primary:
        try:
            destination.parent.mkdir(parents=True, exist_ok=True)
            _remove(partial, staging)
            if sharded:
                partial.mkdir()
            if shared:
                staging.mkdir()
        except OSError as failed:
            error = failed
    multihost.agree(
        f"{name}: prepare", error, unchanged=multihost.NOTHING_EXPORTED, fallback=SaveFailedError
    )
    writer = _Writer(window_bytes, staging, primary)
    target: Any = (partial / destination.name if sharded else partial) if primary else io.BytesIO()
    try:
        try:  # other processes only stage their regions: one plain store, in memory
            shards = max_shard_size if primary else None
            saving_compat.save_state(model, target, writer, skip, max_shard_size=shards)
        except Exception as failed:  # reported to every process by `agree`, which re-raises
            error = failed
        multihost.agree(
            f"{name}: regions",
            error,
            unchanged=multihost.NOTHING_EXPORTED,
            fallback=SaveFailedError,
        )
        if primary:
            try:
                writer.copy_staged()
                _move_into_place(partial, destination, sharded)
            except Exception as failed:
                error = failed
        multihost.agree(
            f"{name}: commit", error, unchanged=multihost.NOTHING_EXPORTED, fallback=SaveFailedError
        )
    finally:
        if primary:
            _remove(partial, staging)
    return destination


def _move_into_place(partial: Path, destination: Path, sharded: bool) -> None:
    """fsyncs what `partial` holds, then renames it (a sharded export's parts, then its index)."""
    if not sharded:
        durable.fsync_path(partial)
        partial.replace(destination)
    else:
        files = sorted(partial.iterdir(), key=lambda f: f.name == destination.name)  # index last
        for file in files:
            durable.fsync_path(file)
        destination.unlink(missing_ok=True)
        for file in files:
            file.replace(destination.parent / file.name)
    durable.fsync_path(destination.parent)


def create_dataset(group: h5py.Group, key: str, shape: Sequence[int], dtype: Any) -> h5py.Dataset:
    """The empty dataset Keras's `H5IOStore.__setitem__` would store an array of `shape` and
    `dtype` (a JAX, NumPy or Keras dtype) in: bfloat16 marked by its `dtype` attribute."""
    name = keras.backend.standardize_dtype(dtype)
    numpy_dtype = np.dtype(jax.numpy.dtype(name))  # bfloat16: ml_dtypes', as JAX gives it
    dataset = group.create_dataset(key, shape=tuple(shape), dtype=numpy_dtype)
    if name == "bfloat16":
        dataset.attrs["dtype"] = "bfloat16"
    return dataset


class _Writer:
    """Called by Keras's walk with each array: creates its dataset as Keras would (process 0) and
    writes, or stages, the regions this process is the one to write."""

    def __init__(self, window_bytes: int, staging: Path, primary: bool) -> None:
        self.window_bytes = window_bytes
        self.staging = staging
        self.primary = primary
        # (file, h5 path) of each dataset, in the walk's order (the same on every process)
        self.datasets: list[tuple[str, str]] = []

    def __call__(self, group: h5py.Group, key: str, value: Any) -> None:
        array = value.value if isinstance(value, keras.Variable) else value
        number = len(self.datasets)
        self.datasets.append((str(group.file.filename), f"{group.name}/{key}"))
        dataset = None
        if self.primary:
            dataset = create_dataset(group, key, array.shape, array.dtype)
        for region in regions.shard_regions(array, _shards_to_write(array), self.window_bytes):
            if dataset is not None:
                dataset[region.index] = region.block
            else:
                np.save(self.staging / _staged_name(number, region.index), region.block)

    def copy_staged(self) -> None:
        """Writes the regions other processes staged into the files (process 0), one window at a
        time."""
        if not self.staging.is_dir():
            return
        by_file: dict[str, list[tuple[str, Path]]] = {}
        for path in sorted(self.staging.iterdir()):
            number, _ = _parse_staged(path.name)
            file, dataset = self.datasets[number]
            by_file.setdefault(file, []).append((dataset, path))
        for file, staged in by_file.items():
            with h5py.File(file, "r+") as h5:
                for dataset, path in staged:
                    h5[dataset][_parse_staged(path.name)[1]] = np.load(path)


def _shards_to_write(array: jax.Array) -> list[jax.Shard]:
    """The distinct shards this process writes: every region process 0 holds is process 0's; a
    region it does not hold, the lowest process's that does. A process-local array (each process
    holds all of it) is process 0's alone."""
    me = jax.process_index()
    if array.is_fully_addressable:
        return regions.distinct_shards(array) if me == 0 else []
    holders: dict[tuple[tuple[int, int], ...], int] = {}
    for device, index in array.sharding.devices_indices_map(array.shape).items():
        key = _key(regions.normalized(index, array.shape))
        process = int(device.process_index)  # type: ignore[attr-defined]
        holders[key] = min(holders.get(key, process), process)
    return [
        shard
        for shard in regions.distinct_shards(array)
        if holders[_key(regions.normalized(shard.index, array.shape))] == me
    ]


def _key(index: regions.Index) -> tuple[tuple[int, int], ...]:
    return tuple((s.start, s.stop) for s in index)


def _staged_name(number: int, index: regions.Index) -> str:
    return ".".join([f"{number:06d}", *(f"{s.start}-{s.stop}" for s in index)]) + ".npy"


def _parse_staged(name: str) -> tuple[int, regions.Index]:
    number, *bounds = name.removesuffix(".npy").split(".")
    return int(number), tuple(slice(*map(int, b.split("-"))) for b in bounds)


def _remove(*paths: Path) -> None:
    for path in paths:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
