"""Hardware CRC-32C from google-crc32c (the optional `crc32c` extra), over any buffer, without a
copy.

`google_crc32c.extend` parses its argument as read-only `bytes` (`y#`), which refuses every buffer
that must be released: memoryview (read-only or not), bytearray, numpy arrays. A restore's bytes
are in numpy buffers, so each would be copied into `bytes` first, and the module releases the GIL
only for `bytes`. The C library it wraps exports `crc32c_extend(crc, data, count)` (google/crc32c's
public `crc32c.h`), which its extension module links: called through ctypes it takes the buffer's
address and releases the GIL, so the reading threads check in parallel. Small buffers go through
`google_crc32c.extend` on a copy: a ctypes call costs more than copying a few KiB.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import numpy as np

_COPY_BELOW = 256 << 10  # bytes: copying this much costs less than one ctypes call

Extend = Callable[[int, Any], int]


def _load() -> Extend | None:
    try:
        import google_crc32c
        from google_crc32c import _crc32c  # the extension module: it links the C library
    except ImportError:
        return None
    if getattr(google_crc32c, "implementation", None) != "c":  # pure Python: ~1 MB/s
        return None
    by_copy: Extend = google_crc32c.extend
    try:
        native = ctypes.CDLL(_crc32c.__file__).crc32c_extend  # found in the libraries it links
    except (OSError, AttributeError):
        return lambda crc, data: by_copy(crc, bytes(data))
    native.restype = ctypes.c_uint32
    native.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]

    def extend(crc: int, data: Any) -> int:
        view = np.frombuffer(data, np.uint8)  # no copy; read-only or writable
        if view.size < _COPY_BELOW:
            return by_copy(crc, view.tobytes())
        return int(native(crc, view.ctypes.data, view.size))

    return extend


extend: Extend | None = _load()
"""`extend(crc, data)`: the CRC-32C of the bytes whose CRC-32C is `crc` followed by `data` (any
buffer); None where google-crc32c (its C implementation) is not installed."""
