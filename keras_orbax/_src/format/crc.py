"""The CRCs a step records for its shard files, and joining the CRCs of adjacent pieces.

`CRC32` (zlib's: the standard library's about 3 GB/s a core, no carry-less-multiply path; ISA-L's
where `isal` is installed, several times faster, `compat/crc32_compat.py`) is recorded by every
keras-orbax save; `CRC32C` (Castagnoli), where ISA-L or google-crc32c is
installed (the `crc32c` extra: `compat/crc32c_compat.py`), beside it: its hardware path runs several
times faster, so a reader that has it
checks with it (`strongest`), and one that has not checks the CRC-32 (docs/format.md, "Checksums").
"""

from __future__ import annotations

import dataclasses
import functools
import zlib
from collections.abc import Callable, Mapping
from typing import Any

from keras_orbax._src.compat import crc32_compat, crc32c_compat
from keras_orbax.errors import UnsupportedVersionError


@dataclasses.dataclass(frozen=True)
class Crc:
    """A CRC: its key in checksum files, its name in messages, `update(crc, data)` and its
    reflected polynomial (for `combine`)."""

    key: str
    label: str
    update: Callable[[int, Any], int] = dataclasses.field(repr=False, compare=False)
    polynomial: int = 0

    def of(self, *parts: Any) -> int:
        """The CRC of `parts` (buffers) one after another."""
        crc = 0
        for part in parts:
            crc = self.update(crc, part)
        return crc

    def combine(self, crc1: int, crc2: int, len2: int) -> int:
        """The CRC of A + B from A's (`crc1`), B's (`crc2`) and B's length (zlib's
        `crc32_combine`, for either polynomial; Python's zlib does not expose it)."""
        return _multmodp(_x8n(self.polynomial, len2), crc1, self.polynomial) ^ crc2


def _crc32(crc: int, data: Any) -> int:
    return zlib.crc32(data, crc)  # releases the GIL over large buffers


# ISA-L's where installed (the `crc32c` extra: several times zlib's speed), else zlib's.
CRC32 = Crc("crc32", "CRC-32", crc32_compat.extend or _crc32, 0xEDB88320)
CRC32C = (
    None
    if crc32c_compat.extend is None
    else Crc("crc32c", "CRC-32C", crc32c_compat.extend, 0x82F63B78)
)
"""Hardware CRC-32C, or None where neither ISA-L nor google-crc32c is installed."""

RECORDED = (CRC32,) if CRC32C is None else (CRC32, CRC32C)  # what a save records, in that order
# What a local-tier step records: the faster CRC alone. The machine that wrote it reads it back,
# and where zlib's CRC-32 runs without carry-less multiplication (a TPU host's Python) it costs
# several times the hardware CRC-32C, on every byte of every frequent save.
LOCAL = (CRC32,) if CRC32C is None else (CRC32C,)
KEYS = ("crc32", "crc32c")  # every CRC a checksum file's entry may hold (a link carries them on)


def strongest(entry: Mapping[str, Any]) -> tuple[Crc, int]:
    """The fastest CRC that a checksum file's `entry` records and this process computes, and its
    value (CRC-32C where both are there and google-crc32c is installed).

    Raises:
        KeyError: the entry records neither.
        UnsupportedVersionError: it records only a CRC-32C (a local-tier step), and neither
            ISA-L nor google-crc32c is installed here.
    """
    if CRC32C is not None and CRC32C.key in entry:
        return CRC32C, int(entry[CRC32C.key])
    if CRC32.key not in entry and "crc32c" in entry:
        raise UnsupportedVersionError(
            "A file's checksum entry records only a CRC-32C (a local-tier step records one CRC), "
            "which this process cannot compute: install keras-orbax[crc32c] "
            "(google-crc32c) to read it."
        )
    return CRC32, int(entry[CRC32.key])


def _multmodp(a: int, b: int, polynomial: int) -> int:
    """a * b modulo the polynomial (zlib's `multmodp`)."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ polynomial if b & 1 else b >> 1


@functools.lru_cache(maxsize=4)
def _x2n_table(polynomial: int) -> tuple[int, ...]:
    table, p = [], 1 << 30  # x^1
    for _ in range(32):
        table.append(p)
        p = _multmodp(p, p, polynomial)
    return tuple(table)


@functools.lru_cache(maxsize=4096)  # pieces come in a few lengths
def _x8n(polynomial: int, nbytes: int) -> int:
    """x^(8 * nbytes) modulo the polynomial (zlib's `x2nmodp(nbytes, 3)`)."""
    table = _x2n_table(polynomial)
    p, k = 1 << 31, 3
    while nbytes:
        if nbytes & 1:
            p = _multmodp(table[k & 31], p, polynomial)
        nbytes >>= 1
        k += 1
    return p
