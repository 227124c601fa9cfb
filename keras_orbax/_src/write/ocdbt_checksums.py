"""The `"compact"` format's checksums: a CRC of every file of the step's OCDBT databases.

Orbax's tensorstore writes a compact step's arrays into one OCDBT database per process
(`ocdbt.process_<i>/`: a `manifest.ocdbt` and data files `d/<id>`), and process 0 merges them at
Orbax's finalize into the step's own (`state/manifest.ocdbt`, `state/d/<id>`: its B+tree nodes,
which hold small arrays' chunks inline). None of it changes once the merge is written, so process
0 then walks every database, each file read once, and records its CRCs (`crc.RECORDED`) in
`state/keras_orbax_checksums/ocdbt.json`, in the same form as the fast format's checksum files, before
Orbax renames the step: the checksums commit with it. A restore and `verify` check every file
against them before anything is read (`checksum.check_whole_files`).

Process 0 reads the whole step once more to do so (Orbax's OCDBT files are its own: each
process's chunks are compressed into them by tensorstore, with no hook for a CRC as they are
written). The data files are the step's compressed bytes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

from keras_orbax._src.format import checksum, crc
from keras_orbax._src.runtime import multihost, thread_pools
from keras_orbax._src.storage import durable, locations

_READ_BYTES = 8 << 20


def record(state: Any) -> None:
    """Process 0, once Orbax has merged the databases of the compact step whose `state/` is
    `state`: writes (and fsyncs) the CRCs of every file of them. Another process, or a step in
    object storage (no local files to walk), records none.

    Raises:
        OSError: a file cannot be read, or the checksum file cannot be written.
    """
    if not multihost.is_primary() or locations.is_remote(state):
        return
    root = os.fspath(locations.as_path(os.fspath(state)))
    names = sorted(database_files(root))
    pool = thread_pools.shared("checksums", 8)
    sizes_and_crcs = list(pool.map(lambda name: _crcs(f"{root}/{name}"), names))
    files = {name: entry for name, entry in zip(names, sizes_and_crcs, strict=True)}
    directory = f"{root}/{checksum.CHECKSUMS_DIR}"
    os.makedirs(directory, exist_ok=True)
    path = f"{directory}/{checksum.OCDBT_FILE}"
    with open(path, "w") as handle:
        json.dump({"algorithm": checksum.ALGORITHM, "files": files}, handle)
        handle.flush()
        os.fsync(handle.fileno())
    durable.fsync_path(directory)


def database_files(root: str) -> Iterator[str]:
    """Every file of the OCDBT databases under `root` (a compact step's `state/`), relative to it:
    each database's manifest and data files."""
    for entry in os.scandir(root):
        if entry.is_dir() and entry.name.startswith("ocdbt.process_"):
            yield from _database(root, f"{entry.name}/")
    yield from _database(root, "")


def _database(root: str, prefix: str) -> Iterator[str]:
    if os.path.isfile(f"{root}/{prefix}manifest.ocdbt"):
        yield f"{prefix}manifest.ocdbt"
    data = f"{root}/{prefix}d"
    if os.path.isdir(data):
        yield from (f"{prefix}d/{name}" for name in os.listdir(data))


def _crcs(path: str) -> dict[str, int]:
    """The file's checksum entry: each CRC a save records, over one read of it, and its size."""
    crcs, nbytes = [0] * len(crc.RECORDED), 0
    block = bytearray(_READ_BYTES)
    view = memoryview(block)
    with open(path, "rb", buffering=0) as handle:
        while n := handle.readinto(block):
            crcs = [c.update(value, view[:n]) for c, value in zip(crc.RECORDED, crcs, strict=True)]
            nbytes += n
    return {**{c.key: value for c, value in zip(crc.RECORDED, crcs, strict=True)}, "bytes": nbytes}
