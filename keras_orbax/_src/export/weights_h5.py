"""A sharded model written as Keras's `.weights.h5`, one window of one shard at a time.

Keras's `save_weights` fetches every variable whole to one host (`H5IOStore.__setitem__` converts
it to NumPy), which runs a host out of memory on a sharded model too big for it and fails outright
under `jax.distributed` on arrays that span other processes. Here Keras's own walk still decides
every group, dataset name and attribute (`keras_compat.save_state`); only each array is written
differently: its dataset is created with the full shape and dtype, its storage placed in the file
at once and never filled; once h5py has closed the file, the shards' bytes are written at the
dataset's offset (`regions`, `file_windows`: one writer per file). A dataset whose bytes do not lie
there as NumPy holds them is filled through h5py, region by region.

An h5 file has one writer, process 0. Under `jax.distributed` every other process writes the
regions that only it holds, window by window, as `.npy` files in a staging directory beside the
destination (which must be on a filesystem all processes share), and process 0 copies them in.
The file goes through the commit protocol every export shares (`storage.commit`): staged in a hidden
directory beside the destination, agreed on by every process (each region checked against those it
was due to write), fsynced, then renamed into place; on any failure, on any process, the previous
file is untouched. Every process reports each region's CRC as it wrote or staged it; process 0
reads every dataset back from the finished file, checks each region against it, and records each
dataset's CRCs in a sidecar (`export_checksums`): beside a `.weights.h5` export,
`<name>.keras_orbax_checksums.json`, renamed after the file, the old one removed before it (a
crash between leaves a file without a sidecar, never a sidecar of another file).
"""

from __future__ import annotations

import io
import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import h5py
import keras
import numpy as np

from keras_orbax._src.compat import saving_compat
from keras_orbax._src.export import export_checksums, h5_regions, regions
from keras_orbax._src.export.safetensors_writer import FileLayout, TensorSpec
from keras_orbax._src.runtime import multihost
from keras_orbax._src.storage import commit, durable, locations

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
        SaveFailedError: the file could not be written (on any process: every process raises,
            naming each one's error); the previous file at `path` is untouched.
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
    """Writes `destination` (absolute) as `save_weights` does, through the commit protocol
    (`storage.commit`); collective under `jax.distributed`."""
    sink = H5Sink(H5File(model, destination.name, window_bytes, skip, max_shard_size), destination)
    return commit.write(sink, f"save_weights {destination}")


class H5File:
    """One `.weights.h5` (or `.weights.json` and its parts) of a model, staged in a directory:
    process 0 writes the file, the other processes stage their regions as `.npy` files beside it
    (`regions/<name>/`), which process 0 copies in once every process has written its part."""

    def __init__(
        self,
        model: keras.Model,
        name: str,
        window_bytes: int,
        skip: Sequence[Any] = (),
        max_shard_size: float | None = None,
    ) -> None:
        self.model, self.name, self.skip = model, name, skip
        self.window_bytes, self.max_shard_size = window_bytes, max_shard_size
        self.writer: h5_regions.RegionWriter | None = None

    @property
    def sharded(self) -> bool:
        return self.max_shard_size is not None

    def bytes_needed(self) -> int:
        """About the file's size: every weight and optimizer variable (skipped ones included: an
        upper bound), and 1 MiB of HDF5 metadata."""
        optimizer = getattr(self.model, "optimizer", None)
        variables = [*self.model.weights, *(optimizer.variables if optimizer is not None else [])]
        return sum(int(v.value.nbytes) for v in variables) + (1 << 20)

    def stage(self, staging: Path) -> list[str]:
        """Every process: Keras's walk, each array's regions written (process 0) or staged."""
        primary = multihost.is_primary()
        regions_dir = staging / "regions" / self.name
        if not primary:
            regions_dir.mkdir(parents=True, exist_ok=True)
        self.writer = h5_regions.RegionWriter(self.window_bytes, regions_dir, primary)
        target: Any = staging / self.name if primary else io.BytesIO()
        shards = self.max_shard_size if primary else None  # others: one plain store, in memory
        saving_compat.save_state(self.model, target, self.writer, self.skip, max_shard_size=shards)
        if primary:
            self.writer.write_direct()
        else:
            durable.fsync_tree(regions_dir)
        return [f"{self.name}/{key}" for key in self.writer.written]

    def regions_due(self, process: int) -> list[str]:
        assert self.writer is not None
        return [f"{self.name}/{key}" for key in self.writer.due(process)]

    def assemble(self, staging: Path) -> None:
        """Process 0: copies in the regions the other processes staged (every one due: a region
        missing from a lagging shared filesystem is an error, never zeros)."""
        assert self.writer is not None
        for process in range(1, multihost.process_count()):
            self.writer.copy_staged(process)

    def region_crcs(self) -> dict[str, int]:
        """This process's regions' CRCs, by `<name>:<dataset number>/<region key>`."""
        crcs = {} if self.writer is None else self.writer.region_crcs
        return {f"{self.name}:{key}": crc for key, crc in crcs.items()}

    def read_back(self, staging: Path, reported: dict[str, int]) -> dict[str, dict[str, Any]]:
        """Process 0, once assembled: every dataset read back from the files, each region
        `reported` (by every process) checked against it (`export_checksums.check_read_back`);
        each dataset's sidecar entry, by `<file>/<h5 path>`.

        Raises:
            SaveFailedError: a region's bytes in the file are not those its process wrote.
        """
        assert self.writer is not None
        datasets = self.writer.datasets
        offsets_in: dict[str, dict[str, int | None]] = {}
        for file in dict.fromkeys(d[0] for d in datasets):
            with h5py.File(file, "r") as h5:
                offsets_in[file] = {
                    d[1]: h5_regions.direct_offset(h5[d[1]]) for d in datasets if d[0] == file
                }
        layouts: dict[str, tuple[dict[str, int], dict[str, TensorSpec]]] = {}
        placements, names = {}, {}
        for number, (file, dataset, shape, dtype, *_) in enumerate(datasets):
            offset = offsets_in[file][dataset]
            if offset is None or 0 in shape:
                continue  # no bytes, or not where NumPy holds them: left unchecked by readers
            name = f"{Path(file).name}/{dataset.lstrip('/')}"  # the sidecar's, and messages'
            offsets, specs = layouts.setdefault(Path(file).name, ({}, {}))
            offsets[name] = offset
            specs[name] = TensorSpec(name, shape, np.dtype(dtype))
            axes = tuple(range(len(shape)))
            placements[name] = export_checksums.Placement(shape, axes, axes)
            names[f"{self.name}:{number:06d}"] = name
        regions_reported = {}  # each by `<sidecar name>/<region key>`, as `check_read_back` reads
        for key, crc in reported.items():
            which, _, region = key.rpartition("/")
            if which in names:
                regions_reported[f"{names[which]}/{region}"] = crc
        return export_checksums.check_read_back(
            staging,
            [FileLayout(f, b"", offsets, specs, 0) for f, (offsets, specs) in layouts.items()],
            placements,
            regions_reported,
            export_checksums.read_back_bytes(self.window_bytes),
        )

    def files(self, staging: Path) -> list[str]:
        """The file names written, in rename order: the parts the index names, then the index."""
        if not self.sharded:
            return [self.name]
        return [*[p.name for p in parts_of(staging / self.name)], self.name]

    def old_files(self, directory: Path) -> list[str]:
        """The files an earlier export of this name left in `directory` (its index and parts)."""
        index = directory / self.name
        if not self.sharded:
            return [self.name] if index.exists() else []
        return [*[p.name for p in parts_of(index)], *([self.name] if index.exists() else [])]


class H5Sink(export_checksums.ReadBackSink):
    """`save_weights`'s sink: one `.weights.h5`, renamed into place in one step; or a
    `.weights.json` and its parts, the old index removed first so that no index ever names a part
    of another export (a kill part-way leaves no index: nothing loads, nothing mixes). Its
    sidecar is renamed last, the old one removed first: no sidecar describes another file."""

    whole_directory = False

    def __init__(self, file: H5File, destination: Path) -> None:
        self.file, self.destination = file, destination
        self._old: list[str] = []
        self._new: list[str] = []
        self.reported = {}
        self.sidecar = export_checksums.sidecar_of(file.name)

    def prepare(self, staging: Path) -> None:
        commit.check_space(staging, self.file.bytes_needed())
        self._old = self.file.old_files(self.destination.parent)

    def stage(self, staging: Path) -> list[str]:
        return self.file.stage(staging)

    def regions_due(self, process: int) -> list[str]:
        return self.file.regions_due(process)

    def region_crcs(self) -> dict[str, int]:
        return self.file.region_crcs()

    def assemble(self, staging: Path) -> None:
        self.file.assemble(staging)
        remove_regions(staging)
        entries = self.file.read_back(staging, self.reported)
        export_checksums.write_sidecar(staging / self.sidecar, entries)
        self._new = [*self.file.files(staging), self.sidecar]

    def commit_order(self) -> list[str]:
        return self._new

    def removed_first(self) -> list[str]:
        """The old sidecar (it describes the old file), and the old index of parts."""
        return [self.sidecar, *([self.file.name] if self.file.sharded else [])]

    def replaced(self) -> list[str]:
        return [name for name in self._old if name not in self._new]

    def is_export_file(self, relative: str) -> bool:
        return True


def remove_regions(staging: Path) -> None:
    """Removes the staged regions' directory, copied in by now (never part of the export)."""
    if (staging / "regions").exists():
        shutil.rmtree(staging / "regions")


def parts_of(index: Path) -> list[Path]:
    """The part files a `.weights.json` lists (none if there is none or it cannot be read)."""
    try:
        weight_map = json.loads(index.read_text()).get("weight_map", {})
    except (OSError, ValueError, AttributeError):
        return []
    names = {n for v in weight_map.values() for n in ([v] if isinstance(v, str) else v)}
    return [index.parent / n for n in sorted(names) if isinstance(n, str) and "/" not in n]
