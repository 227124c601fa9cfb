"""The files of the `"fast"` format, one at a time: a shard file (local, or an object), a small
metadata file, and this process's checksum file.

`files_writer.ArrayFiles` decides which files a step has and writes them concurrently; these are
the single writes it hands to its threads. A local shard file is written once, straight from the
shard's buffer, checksummed piece by piece while still in cache, and fsync-ed; an object is sent
in one request (an object is durable once written). Nothing here fsyncs a directory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import jax
import numpy as np

from keras_orbax._src.format import checksum, crc
from keras_orbax._src.format.zarr_shards import ONE_FILE_SEPARATOR, chunk_key
from keras_orbax._src.storage import durable, recycled_step
from keras_orbax._src.write import incremental


@dataclasses.dataclass(frozen=True)
class Shard:
    """One shard file's content: the host bytes of one chunk of an array."""

    array: str  # Orbax parameter name: the array's directory
    coords: tuple[int, ...]  # chunk coordinates: the file is c/<coords...> (c.<coords...> packed)
    data: np.ndarray  # C-contiguous host bytes
    packed: bool = False
    layout: str = ""  # compared by an incremental save besides the bytes (`incremental.layout_of`)
    # Done once `data` holds the bytes: a background save's fetch from the device (`staging`).
    filled: Future | None = None

    @property
    def relative(self) -> str:
        return f"{self.array}/{chunk_key(self.coords, ONE_FILE_SEPARATOR if self.packed else '/')}"


class Once:
    """Writes small files, each distinct content once: a file whose content was written before is a
    hard link to that file (a model's thousands of arrays have a few distinct `zarr.json`, and each
    file costs an inode and its own write-back; 5000 Dense(64): save 5.08 -> 4.29 s, medians of 6
    alternating). Where the filesystem refuses the link (some FUSE and network filesystems have no
    hard links; ext4 allows 65,000 per file) the content is written again. Nothing is fsync-ed:
    the caller fsyncs `written` and the directories."""

    def __init__(self) -> None:
        self._sources: dict[bytes, str] = {}
        self.written: list[str] = []

    def write(self, path: str, content: bytes) -> None:
        source = self._sources.get(content)
        if source is not None:
            with contextlib.suppress(OSError):
                os.link(source, path)
                return
        write_file(path, content, sync=False)
        self._sources[content] = path
        self.written.append(path)


def checksums_name() -> str:
    """This process's checksum file, relative to a step's `state/`."""
    return f"{checksum.CHECKSUMS_DIR}/process_{jax.process_index()}.json"


def checksums_json(checksums: dict[str, dict[str, Any]], *, incremental_save: bool) -> bytes:
    """The content of this process's checksum file listing `checksums` (name -> entry); with
    `incremental_save`, the layouts the next save compares (older readers ignore them)."""
    content: dict[str, Any] = {"algorithm": checksum.ALGORITHM}
    if incremental_save:
        return json.dumps({**content, **incremental.recorded_json(checksums)}).encode()
    return json.dumps({**content, "files": checksums}).encode()


def _entry(
    crcs: list[int], nbytes: int, recorded: Sequence[crc.Crc] = crc.RECORDED
) -> dict[str, int]:
    """A shard file's checksum entry: each CRC a save records (`recorded`), and its size."""
    return {**{c.key: value for c, value in zip(recorded, crcs, strict=True)}, "bytes": nbytes}


def put_shard(
    store: Any, shard: Shard, known: Mapping[str, int] | None = None
) -> tuple[str, dict[str, Any]]:
    """Writes one shard as an object (copied once into the request body); its name and checksum
    entry (`known`: CRCs of it computed already, by key)."""
    view, index = incremental.shard_bytes(shard)
    known = known or {}
    crcs = [known[c.key] if c.key in known else c.of(view, index) for c in crc.RECORDED]
    store.write(shard.relative, b"".join((view, index))).result()
    return shard.relative, _entry(crcs, len(view) + len(index))


def put_file(store: Any, name: str, content: bytes) -> None:
    store.write(name, content).result()


def write_shard(
    root: str,
    shard: Shard,
    synced: durable.Synced | None = None,
    known: Mapping[str, int] | None = None,
    recycled: str | None = None,
    recorded: Sequence[crc.Crc] = crc.RECORDED,
) -> tuple[str, dict[str, Any]]:
    """Writes one shard file under `root` (bytes, then the zarr index) and fsyncs it, noting it in
    `synced`; returns its name and checksum entry, each CRC of `recorded` computed piece by piece
    while in cache but those `known` already (by key: an incremental save's candidate,
    `incremental`). With `recycled` (a retired step's `state/`), writes into that step's file of
    the same name where it may (`recycled_step.take`)."""
    path = f"{root}/{shard.relative}"
    view, index = incremental.shard_bytes(shard)
    known = known or {}
    todo = [c for c in recorded if c.key not in known]
    crcs = [0] * len(todo)
    reused = recycled is not None and recycled_step.take(recycled, shard.relative, path)
    # A file taken keeps its pages until overwritten: truncated after the write, not before.
    flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | (0 if reused else os.O_TRUNC)
    fd = os.open(path, flags, 0o666)
    try:
        for start in range(0, len(view), checksum.PIECE_BYTES):
            piece = view[start : start + checksum.PIECE_BYTES]
            crcs = [c.update(value, piece) for c, value in zip(todo, crcs, strict=True)]
            _write_all(fd, piece)
        crcs = [c.update(value, index) for c, value in zip(todo, crcs, strict=True)]
        _write_all(fd, index)
        if reused:
            os.ftruncate(fd, len(view) + len(index))
        os.fsync(fd)
        if synced is not None:
            synced.add(fd)
    finally:
        os.close(fd)
    computed = {**known, **{c.key: value for c, value in zip(todo, crcs, strict=True)}}
    size = len(view) + len(index)
    return shard.relative, _entry([computed[c.key] for c in recorded], size, recorded)


def write_file(
    path: str, content: bytes, sync: bool = True, synced: durable.Synced | None = None
) -> None:
    """Writes `content` to a new file at `path`; with `sync`, fsyncs it, noting it in `synced`."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
    try:
        _write_all(fd, memoryview(content))
        if sync:
            os.fsync(fd)
            if synced is not None:
                synced.add(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, view: memoryview) -> None:
    done = 0
    while done < len(view):
        done += os.write(fd, view[done:])
