"""What the tests of O_DIRECT writes ask of the kernel (whether a filesystem takes them, which
pages of a file are in the page cache) and of the writer (the bytes it wrote so)."""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from keras_orbax._src.export import file_windows
from keras_orbax._src.runtime import libc


def refuses_o_direct(directory: Path) -> str | None:
    """Why `directory`'s filesystem takes no O_DIRECT writes, or None where it takes them."""
    path = directory / "probe"
    path.write_bytes(b"")
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_DIRECT))
        return None
    except (OSError, AttributeError) as e:
        return f"{directory}'s filesystem refuses O_DIRECT: {e}"
    finally:
        path.unlink()


def cached_pages(path: Path) -> np.ndarray:
    """Which of `path`'s pages are in the page cache (the kernel's `mincore`)."""
    mincore = libc.function(
        "mincore", ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p
    )
    assert mincore is not None
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mapped:
        pages = np.zeros(-(-len(mapped) // mmap.PAGESIZE), np.uint8)
        address = np.frombuffer(mapped, np.uint8).ctypes.data
        assert mincore(address, len(mapped), pages.ctypes.data) == 0, libc.last_error()
        return (pages & 1).astype(bool)


def filesystem_type(path: Path) -> str:
    """The type of the filesystem `path` is on (`/proc/self/mounts`: the longest mount point)."""
    best, kind = "", ""
    resolved = str(path.resolve())
    with open("/proc/self/mounts") as mounts:
        for line in mounts:
            _, point, fs_type, *_ = line.split()
            point = point.replace("\\040", " ")
            inside = resolved == point or resolved.startswith(point.rstrip("/") + "/")
            if inside and len(point) > len(best):
                best, kind = point, fs_type
    return kind


@contextlib.contextmanager
def direct_bytes_written(minimum: int | None = None) -> Iterator[list[int]]:
    """Within the block, the bytes each `FileWindows` wrote with O_DIRECT, kept as it closes (the
    real close runs); with `minimum`, `file_windows.DIRECT_MIN` lowered to it (the tests' bands
    are KiBs)."""
    written: list[int] = []
    close, direct_min = file_windows.FileWindows.close, file_windows.DIRECT_MIN

    def recorded(files: file_windows.FileWindows) -> None:
        written.append(files.direct_bytes)
        close(files)

    file_windows.FileWindows.close = recorded  # type: ignore[method-assign]
    file_windows.DIRECT_MIN = direct_min if minimum is None else minimum
    try:
        yield written
    finally:
        file_windows.FileWindows.close = close  # type: ignore[method-assign]
        file_windows.DIRECT_MIN = direct_min
