"""Hardware CRC-32C over any buffer, without a copy: ISA-L's (the `isal` package) where it is
installed, else google-crc32c's (both in the optional `crc32c` extra); the same CRC either way.

`google_crc32c.extend` parses its argument as read-only `bytes` (`y#`), which refuses every buffer
that must be released: memoryview (read-only or not), bytearray, numpy arrays. A restore's bytes
are in numpy buffers, so each would be copied into `bytes` first, and the module releases the GIL
only for `bytes`. The C library it wraps exports `crc32c_extend(crc, data, count)` (google/crc32c's
public `crc32c.h`), which its extension module links: called through ctypes it takes the buffer's
address and releases the GIL, so the reading threads check in parallel. Small buffers go through
`google_crc32c.extend` on a copy: a ctypes call costs more than copying a few KiB.

google/crc32c's x86 path is the SSE4.2 `crc32` instruction, one 8-byte step a cycle at best;
ISA-L's `crc32_iscsi` folds with carry-less multiplies (AVX-512 `VPCLMULQDQ` where the CPU has it,
else SSE `PCLMULQDQ` or the `crc32` instruction): several times faster, and the largest cost of a
checked restore is this CRC (docs/benchmarks.md, "Checking what a restore reads"). python-isal
exposes only the zlib CRC-32, but its `isal_zlib` extension module carries ISA-L's exported
`crc32_iscsi(buffer, len, crc)`, called here through ctypes the same way.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import numpy as np

from keras_orbax._src.compat import crc32_compat

_COPY_BELOW = 256 << 10  # bytes: copying this much costs less than one ctypes call (google-crc32c)
_ISAL_COPY_BELOW = 16 << 10  # the same where the CRC itself runs at ISA-L's speed
_ISAL_MAX_CALL = 1 << 30  # `crc32_iscsi` takes an `int` length
_MASK = 0xFFFFFFFF

Extend = Callable[[int, Any], int]


def _google() -> tuple[Extend | None, Extend | None]:
    """(extend through ctypes, extend on a copy) of google-crc32c's C library; None where it is
    not installed (or only its pure-Python fallback, ~1 MB/s, is)."""
    try:
        import google_crc32c
        from google_crc32c import _crc32c  # the extension module: it links the C library
    except ImportError:
        return None, None
    if getattr(google_crc32c, "implementation", None) != "c":
        return None, None
    by_copy: Extend = google_crc32c.extend

    def copied(crc: int, data: Any) -> int:
        return by_copy(crc, np.frombuffer(data, np.uint8).tobytes())

    try:
        native = ctypes.CDLL(_crc32c.__file__).crc32c_extend  # found in the libraries it links
    except (OSError, AttributeError):
        return copied, copied
    native.restype = ctypes.c_uint32
    native.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]

    def extend(crc: int, data: Any) -> int:
        address, size = crc32_compat.address(data)  # no copy; read-only or writable
        if size < _COPY_BELOW:
            return by_copy(crc, np.frombuffer(data, np.uint8).tobytes())
        return int(native(crc, address, size))

    return extend, copied


def _isal(small: Extend | None) -> Extend | None:
    """ISA-L's CRC-32C through ctypes (`small`: for buffers under `_ISAL_COPY_BELOW`, where a copy
    costs less than a ctypes call); None where python-isal is not installed."""
    native = crc32_compat.isal_function(
        "crc32_iscsi", ctypes.c_uint32, [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32]
    )
    if native is None:
        return None

    def extend(crc: int, data: Any) -> int:
        address, size = crc32_compat.address(data)  # no copy; read-only or writable
        if small is not None and size < _ISAL_COPY_BELOW:
            return small(crc, data)
        # ISA-L's iSCSI CRC is the CRC-32C without its initial and final inversion.
        crc = ~crc & _MASK
        for start in range(0, size, _ISAL_MAX_CALL):
            crc = native(address + start, min(_ISAL_MAX_CALL, size - start), crc)
        return ~crc & _MASK

    return extend


def _load() -> tuple[Extend | None, str | None]:
    google, copied = _google()
    fast = _isal(copied)
    if fast is not None:
        return fast, "isal"
    return google, None if google is None else "google-crc32c"


extend, library = _load()
"""`extend(crc, data)`: the CRC-32C of the bytes whose CRC-32C is `crc` followed by `data` (any
buffer); None where neither ISA-L (`isal`) nor google-crc32c (its C implementation) is installed.
`library`: which one computes it (None: neither)."""
