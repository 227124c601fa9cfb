"""The datasets of Keras's weight files, indexed without reading their data.

`.weights.h5` (`save_weights`, keras-hub's `save_to_preset`), a sharded `*.weights.json` with its
`*_NNNNN.weights.h5` parts (`save_weights(..., max_shard_size=...)`), and a `.keras` archive, whose
`model.weights.h5` member is stored uncompressed and read in place: every dataset becomes an array
reader at its byte offset, so a restore reads only the regions each device holds.
"""

from __future__ import annotations

import json
import math
import struct
import zipfile
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from keras_orbax._src.format.dtypes import np_dtype
from keras_orbax._src.format.record_check import plain_name
from keras_orbax._src.read.contiguous import ByteSwappedArray, ContiguousArray, H5SliceArray
from keras_orbax.errors import CorruptCheckpointError

WEIGHTS_IN_ARCHIVE = "model.weights.h5"
# A dataset declaring more than this, and more than `_MAX_EXPANSION` times the bytes it stores, is
# a shape bomb (chunks never written read as the fill value): refused as Keras's loader refuses it
# (`safe_get_h5_dataset`, keras#22975), before anything is allocated by its shape.
_BOMB_FLOOR_BYTES = 1 << 32
_MAX_EXPANSION = 1000
# A `.keras` member read into memory (its config, metadata and assets; Keras stores each
# uncompressed) declaring more than this, and more than `_MAX_ZIP_EXPANSION` times what it stores,
# is a decompression bomb, refused as Keras refuses one (keras#23010) before it is inflated.
_ZIP_BOMB_FLOOR_BYTES = 64 << 20
_MAX_ZIP_EXPANSION = 100
_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")  # a zip local file header, 30 bytes

H5Array = ContiguousArray | ByteSwappedArray | H5SliceArray


def h5_datasets(path: Path) -> dict[str, H5Array]:
    """Every dataset of a `.weights.h5`, `.weights.json` (with its parts) or `.keras`, by h5 path.

    Raises:
        CorruptCheckpointError: a file is missing or not readable as HDF5.
    """
    name = path.name
    if name.endswith(".keras"):
        return _archive_datasets(path)
    if name.endswith(".json"):
        return _sharded_datasets(path)
    return _file_datasets(path, path, 0)


def _file_datasets(h5: Any, file: Path, base: int) -> dict[str, H5Array]:
    """The datasets of one HDF5 file (a path or an open file object) whose bytes start at `base`
    of `file`."""
    found: dict[str, H5Array] = {}

    def visit(name: str, obj: Any) -> None:
        if isinstance(obj, h5py.Dataset):
            found[name] = _array(name, obj, file, base)

    try:
        with h5py.File(h5, "r") as handle:
            handle.visititems(visit)
    except OSError as error:
        raise CorruptCheckpointError(
            f"Cannot read '{file}' as a Keras weights file: {error}"
        ) from error
    return found


def _array(name: str, dataset: h5py.Dataset, file: Path, base: int) -> H5Array:
    """A reader of `dataset`, listed in its native dtype (`float32` for data stored `>f4`)."""
    stored, dtype = dataset.dtype, _listed_dtype(dataset)
    shape = tuple(int(n) for n in dataset.shape)
    offset = dataset.id.get_offset()
    if int(np.prod(shape)) == 0:
        return ContiguousArray(name, file, base + (offset or 0), shape, dtype)
    if dataset.chunks is not None or dataset.compression is not None or offset is None:
        _refuse_hostile(name, dataset, file)  # a dataset with an address is read at it, checked
        return H5SliceArray(name, file, name, shape, dtype)
    if stored.isnative:  # bfloat16's opaque 2-byte data is read as bfloat16 directly
        return ContiguousArray(name, file, base + offset, shape, dtype)
    return ByteSwappedArray(ContiguousArray(name, file, base + offset, shape, stored), dtype)


def _refuse_hostile(name: str, dataset: h5py.Dataset, file: Path) -> None:
    """A dataset whose data lies in other files (external, virtual: HDF5 would read any file the
    weights file names) or that declares far more than it stores is refused, as by Keras.

    Raises:
        CorruptCheckpointError: naming the file and the dataset.
    """
    if dataset.external or dataset.is_virtual:
        raise CorruptCheckpointError(
            f"'{file}': dataset {name} keeps its data in other files "
            f"({'virtual' if dataset.is_virtual else 'external'}), which Keras refuses to read."
        )
    declared = math.prod(dataset.shape) * dataset.dtype.itemsize
    stored = dataset.id.get_storage_size()
    if declared > _BOMB_FLOOR_BYTES and declared > _MAX_EXPANSION * stored:
        raise CorruptCheckpointError(
            f"'{file}': dataset {name} declares shape {tuple(dataset.shape)} ({declared} bytes) "
            f"but stores {stored} bytes: a shape bomb, refused as Keras refuses it."
        )


def _listed_dtype(dataset: h5py.Dataset) -> np.dtype:
    """The dtype Keras's loader gives `dataset`: native byte order (h5py reads `>f4` into
    float32 values), bfloat16 where Keras marked 2-byte data so (`H5IOStore.__setitem__`)."""
    if dataset.attrs.get("dtype") == "bfloat16":
        return np_dtype("bfloat16")
    return dataset.dtype.newbyteorder("=")


def _sharded_datasets(index: Path) -> dict[str, H5Array]:
    """`x.weights.json`: `{"metadata": ..., "weight_map": {"/layers/dense/vars": [parts]}}`."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        parts = sorted({part for files in weight_map.values() for part in _as_list(files)}, key=str)
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as error:
        raise CorruptCheckpointError(
            f"'{index}' is not a Keras sharded-weights index: {error}"
        ) from error
    found: dict[str, H5Array] = {}
    for part in parts:
        if not isinstance(part, str) or not plain_name(part):  # Keras: `path.with_name(part)`
            raise CorruptCheckpointError(
                f"'{index}' names the part '{part}', which is not a file beside it."
            )
        file = index.parent / part
        if not file.exists():
            raise CorruptCheckpointError(f"'{index}' names the part '{part}', which is missing.")
        found.update(_file_datasets(file, file, 0))
    return found


def _archive_datasets(archive: Path) -> dict[str, H5Array]:
    """A `.keras` zip: its weights member is stored uncompressed, so its datasets sit at fixed
    offsets of the archive and are read in place."""
    try:
        with _open_archive(archive) as zf:
            info = zf.getinfo(WEIGHTS_IN_ARCHIVE)
            if info.compress_type != zipfile.ZIP_STORED:
                raise CorruptCheckpointError(
                    f"'{archive}': {WEIGHTS_IN_ARCHIVE} is compressed; Keras stores it uncompressed."
                )
            with open(archive, "rb") as raw:
                raw.seek(info.header_offset)
                header = _LOCAL_HEADER.unpack(raw.read(_LOCAL_HEADER.size))
            name_length, extra_length = header[-2], header[-1]
            base = info.header_offset + _LOCAL_HEADER.size + name_length + extra_length
            with zf.open(info) as member:
                return _file_datasets(member, archive, base)
    except (zipfile.BadZipFile, KeyError) as error:
        raise CorruptCheckpointError(
            f"'{archive}' is not a readable .keras archive: {error}"
        ) from error


def _open_archive(archive: Path) -> zipfile.ZipFile:
    """`archive` opened, once every member's name and size is checked: a member named outside
    the archive (`../x`, `/x`: keras#23101) or a decompression bomb is refused, whichever verb
    reads it, before any member is read.

    Raises:
        CorruptCheckpointError: naming the archive and the member.
        zipfile.BadZipFile: not a zip file.
    """
    zf = zipfile.ZipFile(archive)
    for info in zf.infolist():
        parts = info.filename.replace("\\", "/").split("/")
        if info.filename.startswith(("/", "\\")) or ".." in parts or ":" in parts[0]:
            zf.close()
            raise CorruptCheckpointError(
                f"'{archive}' is not a .keras archive Keras wrote: its member "
                f"'{info.filename}' names a file outside the archive."
            )
        if info.file_size > max(_ZIP_BOMB_FLOOR_BYTES, _MAX_ZIP_EXPANSION * info.compress_size):
            zf.close()
            raise CorruptCheckpointError(
                f"'{archive}': its member '{info.filename}' declares {info.file_size} bytes but "
                f"stores {info.compress_size}: a decompression bomb, refused as Keras refuses it."
            )
    return zf


def archive_assets(file: Path) -> dict[str, bytes]:
    """A `.keras` archive's asset files (what layers' `save_assets` wrote), by their path under
    `assets/`; none for any other file."""
    if not file.name.endswith(".keras"):
        return {}
    try:
        with _open_archive(file) as zf:
            return {
                info.filename[len("assets/") :]: zf.read(info)
                for info in zf.infolist()
                if info.filename.startswith("assets/") and not info.is_dir()
            }
    except zipfile.BadZipFile as error:
        raise CorruptCheckpointError(
            f"'{file}' is not a readable .keras archive: {error}"
        ) from error


def archive_json(archive: Path, member: str) -> dict[str, Any]:
    """A JSON member of a `.keras` archive (`config.json`, `metadata.json`)."""
    try:
        with _open_archive(archive) as zf:
            return json.loads(zf.read(member))
    except (zipfile.BadZipFile, KeyError, ValueError, RecursionError) as error:
        raise CorruptCheckpointError(f"Cannot read {member} of '{archive}': {error}") from error


def _as_list(files: Any) -> list[str]:
    return [files] if isinstance(files, str) else list(files)
