"""Shard files mapped as the memory of the arrays read from them, where the user opts in.

The contract (docs/format.md): by default every restored buffer is memory of its own, read from
the files with `preadv`, so nothing done to the checkpoint afterwards reaches a model that was
restored from it. A private mapping (`MAP_PRIVATE`) is copy-on-write for the process's writes
only: a page not yet written is the page cache's page, so an in-place write to the file (`cp -r`
over the checkpoint, `rsync --inplace`) shows in the model's weights, and a truncation turns the
next read of the buffer into SIGBUS, which kills the process. A serving process holds its buffers
for its whole life; keras-orbax cannot know that no one writes the files meanwhile.

`KERAS_ORBAX_MAP_SHARDS=1` (read at each restore) opts in, for files the user keeps as written
(a read-only volume, a checkpoint nothing copies over): a region that is exactly one large saved
shard of a file on a local filesystem is then mapped privately and every page brought in before
the restore returns (`MADV_POPULATE_READ`), so the page cache's copy of the shard *is* the host
buffer. That saves faulting in, zeroing and filling as much fresh memory as the model holds
(docs/benchmarks.md). The CPU backend adopts the buffer as the device's memory; an accelerator
copies it and the mapping goes with the host array. Even then, network filesystems are not mapped
(a page dropped under memory pressure would be fetched again from a file that another host may
have deleted), nor object storage, nor shards under `MIN_BYTES` (one mapping each: the kernel
limits a process to `vm.max_map_count`, 65530 by default).

`populate_for_writing` is the same kernel call for fresh memory about to be filled piece by piece
(the regions of a layout that cuts the saved rows): its pages faulted in at once.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import warnings
from typing import Any

import numpy as np

from keras_orbax.errors import KerasOrbaxWarning

ENVIRONMENT_VARIABLE = "KERAS_ORBAX_MAP_SHARDS"
_ON, _OFF = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")
MIN_BYTES = 4 << 20
# Filesystems whose files live on this machine: what the kernel reads back from them is what
# was written.
_LOCAL_FILESYSTEMS = frozenset(
    {"ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "zfs", "bcachefs", "tmpfs", "overlay"}
)
_POPULATE_READ = 22  # MADV_POPULATE_READ, Linux 5.14; Python 3.11's mmap does not name it
_POPULATE_WRITE = 23  # MADV_POPULATE_WRITE, Linux 5.14


def enabled() -> bool:
    """Whether the user opted in to mapping shard files (`KERAS_ORBAX_MAP_SHARDS`), read now, so
    that setting `os.environ` in the process before a restore is enough."""
    return _setting(os.environ.get(ENVIRONMENT_VARIABLE, ""))


@functools.lru_cache(maxsize=8)
def _setting(raw: str) -> bool:
    """`raw`, the environment variable's value, as a switch; an unknown one warns once and copies
    (the safe side: a typo must not map files the user meant to keep apart from the model)."""
    value = raw.strip().lower()
    if value in _ON:
        return True
    if value not in _OFF:
        warnings.warn(
            f"{ENVIRONMENT_VARIABLE}={raw!r} is neither on (1, true, yes, on: map large saved "
            "shards) nor off (0, false, no, off, or unset: copy them, the default); restored "
            "weights are copied.",
            KerasOrbaxWarning,
            stacklevel=2,
        )
    return False


def map_file(path: str, nbytes: int) -> np.ndarray | None:
    """The whole file at `path`, `nbytes` long, mapped privately with every page in memory; None
    where it is not mapped (a small or remote file, another size, an older kernel, the map limit
    reached, a read error): the caller reads it instead, and reports what is wrong."""
    if nbytes < MIN_BYTES:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        status = os.fstat(fd)
        if status.st_size != nbytes or not _is_local(status.st_dev):
            return None
        mapping = mmap.mmap(
            fd, nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE
        )
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    data = np.frombuffer(mapping, np.uint8)
    if not _populate(data):
        del data
        mapping.close()
        return None
    return data


def _populate(data: np.ndarray) -> bool:
    """Faults in every page of the mapping under `data` (reading the file where the page cache
    lacks it) without holding the GIL: `mmap.madvise` holds it for the whole read, so threads
    reading other shards would wait (96 shards of 16 MiB read cold by 8 threads: 1.3-1.5 s that
    way, 0.8-1.4 s this way)."""
    if _libc_madvise is None:
        return False
    return _libc_madvise(data.ctypes.data, data.nbytes, _POPULATE_READ) == 0


def populate_for_writing(buffer: np.ndarray, start: int, stop: int) -> None:
    """Faults in, at once, the pages under bytes [start, stop) of `buffer` (C-contiguous fresh
    memory) that are about to be written piece by piece: one call where a scatter into them would
    fault each page in on its first write (256 MiB of regions filled 512 bytes at a time: 0.28-0.32 s
    of CPU with it, 0.32-0.55 s without). Does nothing where the kernel cannot (before 5.14)."""
    if _libc_madvise is None or stop <= start:
        return
    page = mmap.PAGESIZE
    first = (buffer.ctypes.data + start) // page * page
    _libc_madvise(first, buffer.ctypes.data + stop - first, _POPULATE_WRITE)


def _madvise() -> Any:
    try:
        function = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):  # not Linux, or no libc
        return None
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    function.restype = ctypes.c_int
    return function


_libc_madvise = _madvise()


def _is_local(device: int) -> bool:
    """Whether the filesystem with device number `device` is one of `_LOCAL_FILESYSTEMS` (False
    where it cannot tell)."""
    return filesystem_type(device) in _LOCAL_FILESYSTEMS


@functools.lru_cache(maxsize=64)
def filesystem_type(device: int) -> str | None:
    """The type of the filesystem with device number `device` (`os.stat(path).st_dev`), as
    `/proc/self/mountinfo` says: "ext4", "tmpfs", "nfs4"...; None where it cannot tell."""
    wanted = f"{os.major(device)}:{os.minor(device)}"
    try:
        with open("/proc/self/mountinfo") as mounts:
            for line in mounts:
                fields = line.split()
                if fields[2] == wanted and "-" in fields:
                    return fields[fields.index("-") + 1]
    except OSError:
        pass
    return None
