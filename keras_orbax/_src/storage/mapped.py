"""Shard files mapped as the memory of the arrays read from them.

A region that is exactly one large saved shard of a file on a local filesystem is not read into
fresh memory: the file is mapped privately (copy-on-write) and every page is brought in before the
restore returns (`MADV_POPULATE_READ`), so the page cache's copy of the shard *is* the host buffer.
That saves faulting in, zeroing and filling as much fresh memory as the model holds: from a cold
page cache, the restore reads at the speed of the disk instead of adding the memory's cost on top
(docs/benchmarks.md). The CPU backend adopts the buffer as the device's memory; an accelerator
copies it and the mapping goes with the host array.

What a mapping means for the process, and why it is safe here: a checkpoint's files are never
written again once committed (a save writes a new step directory and renames it into place), so
the mapping sees fixed bytes; deleting the checkpoint (`max_to_keep`) unlinks the files, whose
blocks stay until the last mapping goes; writes (none by XLA: a donated input it did not allocate
is not reused) would go to private copies, never to the file. Network filesystems are not mapped
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
from typing import Any

import numpy as np

MIN_BYTES = 4 << 20
# Filesystems whose files live on this machine: what the kernel reads back from them is what
# was written.
_LOCAL_FILESYSTEMS = frozenset(
    {"ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "zfs", "bcachefs", "tmpfs", "overlay"}
)
_POPULATE_READ = 22  # MADV_POPULATE_READ, Linux 5.14; Python 3.11's mmap does not name it
_POPULATE_WRITE = 23  # MADV_POPULATE_WRITE, Linux 5.14


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
