"""zlib's CRC-32 from ISA-L (the `isal` package, in the optional `crc32c` extra), over any
buffer, without a copy; None where `isal` is not installed (then `zlib.crc32`).

Python's `zlib.crc32` (zlib 1.2.13 here, no carry-less-multiply path) runs at 2-3 GB/s a core;
ISA-L's `crc32_gzip_refl` folds with `PCLMULQDQ` (AVX-512 `VPCLMULQDQ` where the CPU has it), the
same CRC several times faster. python-isal's own `isal_zlib.crc32` holds the GIL; its extension
module exports the C function, called here through ctypes on the buffer's address (GIL released,
as `crc32c_compat` calls `crc32_iscsi`).
"""

from __future__ import annotations

import ctypes
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

_ZLIB_BELOW = 16 << 10  # bytes: `zlib.crc32` costs less than a ctypes call this short

Extend = Callable[[int, Any], int]


def isal_function(name: str, restype: Any, argtypes: list[Any]) -> Any:
    """ISA-L's exported C function `name`, called through ctypes (GIL released); None where
    python-isal is not installed or its extension module does not carry it."""
    try:
        from isal import isal_zlib  # the extension module: it carries ISA-L's CRC functions
    except ImportError:
        return None
    try:
        native = getattr(ctypes.CDLL(isal_zlib.__file__), name)
    except (OSError, AttributeError):
        return None
    native.restype, native.argtypes = restype, argtypes
    return native


def address(data: Any) -> tuple[int, int]:
    """(address, bytes) of a C-contiguous buffer, without a copy, for a C function to read.

    A writable buffer's through ctypes (0.2 us); numpy's `.ctypes.data` (1.2 us) for the rest
    (read-only or empty). A restore calls this once per piece it checks, in the reading threads,
    with the GIL held: the cheaper the call, the sooner the next read starts while the piece just
    read is still in the cache (docs/benchmarks.md, "Restore read path")."""
    view = memoryview(data)
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(view)), view.nbytes
    except (TypeError, ValueError):  # read-only, or empty
        array = np.frombuffer(view, np.uint8)
        return array.ctypes.data, array.size


def _load() -> Extend | None:
    native = isal_function(
        "crc32_gzip_refl", ctypes.c_uint32, [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_uint64]
    )
    if native is None:
        return None

    def extend(crc: int, data: Any) -> int:
        at, size = address(data)  # no copy; read-only or writable
        if size < _ZLIB_BELOW:
            return zlib.crc32(np.frombuffer(data, np.uint8).data, crc)
        return int(native(crc, at, size))

    return extend


extend: Extend | None = _load()
"""`extend(crc, data)`: zlib's `crc32(data, crc)` by ISA-L (any buffer); None where `isal` is not
installed."""
