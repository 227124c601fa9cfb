"""Making a committed step durable: what Orbax writes around the arrays, it does not fsync.

keras-orbax fsyncs every file and directory of the arrays it writes (`_write`). Orbax then writes
its own files (the tree's `_METADATA`, `_CHECKPOINT_METADATA`, the `commit_success.txt` markers,
the compact format's `state/array_metadatas/process_0`) and renames the temporary step directory
into place, and fsyncs none of it: a power loss after `save` returned could leave a committed step
without its metadata. `step_committed` fsyncs every file and directory of the step, at any depth,
and the directory holding the step, so a save is durable when it
returns (`tests/test_durable.py`: no page of a saved step is left to write back, and every
directory entry is fsynced). Retention deletes older steps only after that
(`tests/test_durability_order.py`): a step to resume from is always on the disk.

A file keras-orbax's writer fsynced already (every shard file, its metadata and checksum files),
and a directory it created and filled, is not fsynced again: the writer notes each in a `Synced`
record, and `step_committed` passes over one that is still the very one noted (same inode, size,
times and link count). On ext4
without a journal every fsync flushes the disk's cache, so a second fsync of each of a step's
hundreds of files cost more than writing them (docs/benchmarks.md). The rest (Orbax's files, the
directories it writes into) is fsynced by a pool of threads, files before directories.

```python
synced = Synced()                       # handed to the writer: `fsync_path(path, synced)`
response.result()                       # Orbax has committed step 10
step_committed(Path("/ckpt/10"), synced)
```
"""

from __future__ import annotations

import os
import stat as stat_mode
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from keras_orbax._src.runtime import thread_pools

# fsyncs in flight at the end of a save: concurrent ones share the disk's cache flushes.
_WORKERS = 16


class Synced:
    """The files and directories one save's writer fsynced, by identity (device, inode, size,
    modification and change times in ns, link count, taken after the fsync): one still matching it
    needs no second fsync. The writer notes only directories it created and filled itself, none
    that Orbax writes into after the writer's fsync (`state/` gets `_METADATA`, the step's
    directory is renamed). Thread-safe: the writer's threads add to it concurrently."""

    def __init__(self) -> None:
        self._files: set[tuple[int, ...]] = set()
        self._lock = threading.Lock()

    def add(self, fd: int) -> None:
        """Notes the file or directory open as `fd`, fsynced just now."""
        key = _identity(os.fstat(fd))
        with self._lock:
            self._files.add(key)

    def holds(self, stat: os.stat_result) -> bool:
        """Whether the file or directory `stat` describes is one noted, unchanged since."""
        return _identity(stat) in self._files

    def __len__(self) -> int:
        return len(self._files)


def _identity(stat: os.stat_result) -> tuple[int, ...]:
    return stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_nlink


def step_committed(step_dir: Path, synced: Synced | None = None) -> None:
    """fsyncs every file and directory of the committed step at `step_dir`, at any depth (Orbax's
    own files lie two levels down too: the compact format's `state/array_metadatas/process_0`),
    and the directory holding the step; one in `synced`, unchanged since, is passed over.

    Raises:
        OSError: the data could not be written back, or the step is gone (nothing deletes a
            step before it is durable: something outside keras-orbax did).
    """
    fsync_tree(step_dir, synced)
    fsync_path(step_dir.parent)


def fsync_tree(root: str | os.PathLike[str], synced: Synced | None = None) -> None:
    """fsyncs every file and directory under `root` (itself included) concurrently, the
    directories after all the files; one in `synced`, unchanged since, is passed over.

    Raises:
        OSError: some data could not be written back, or a file vanished.
    """
    files: list[str] = []
    directories: list[str] = []
    for directory, _, names in os.walk(root, topdown=False, onerror=_raise):
        for name in names:
            path = os.path.join(directory, name)
            stat = os.lstat(path)
            if not stat_mode.S_ISLNK(stat.st_mode) and not (synced and synced.holds(stat)):
                files.append(path)
        if not (synced and synced.holds(os.lstat(directory))):
            directories.append(directory)
    fsync_all(files)
    fsync_all(directories)


def fsync_all(paths: Iterable[str | os.PathLike[str]], synced: Synced | None = None) -> None:
    """fsyncs each of `paths` (files or directories) on the shared pool, noting each in `synced`.

    Raises:
        OSError: the first failure, once every fsync has ended.
    """
    paths = list(paths)
    if len(paths) <= 1:
        for path in paths:
            fsync_path(path, synced)
        return
    pool = shared_pool()
    futures = [pool.submit(fsync_path, path, synced) for path in paths]
    errors = [f.exception() for f in futures]
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first


def shared_pool() -> ThreadPoolExecutor:
    """The process's pool of fsync threads (`runtime.thread_pools`)."""
    return thread_pools.shared("fsync", _WORKERS)


def _raise(error: OSError) -> None:
    raise error


def fsync_path(path: str | os.PathLike[str], synced: Synced | None = None) -> None:
    """fsyncs a file or a directory, noting it in `synced`."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
        if synced is not None:
            synced.add(fd)
    finally:
        os.close(fd)
