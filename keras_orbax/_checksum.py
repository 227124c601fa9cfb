"""Checksums of the fast format's shard files (docs/format.md, "Checksums").

Each shard file's checksum is zlib's CRC-32 of the whole file (data, then the 20-byte zarr index),
computed piece by piece while the file is written and stored beside the step's arrays. The zarr
shard index carries its own CRC-32C (Castagnoli), which tensorstore checks when it reads a shard.
"""

from __future__ import annotations

import functools
import struct
import zlib

ALGORITHM = "crc32"  # zlib.crc32: in the standard library, about 3 GB/s here, releases the GIL
PIECE_BYTES = 4 << 20  # checksummed while still in cache, just before it is written
INDEX_BYTES = 16 + 4  # one (offset, nbytes) little-endian uint64 pair, then its CRC-32C


def _crc32c_table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C of a few bytes (the shard index); pure Python, so only for small inputs."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


@functools.lru_cache(maxsize=1024)  # a model's arrays have a few shard sizes; the CRC is Python
def shard_index(nbytes: int) -> bytes:
    """The zarr `sharding_indexed` index of a shard file holding one chunk of `nbytes` at offset 0."""
    pair = struct.pack("<QQ", 0, nbytes)
    return pair + struct.pack("<I", crc32c(pair))


def update(crc: int, data: bytes | memoryview) -> int:
    return zlib.crc32(data, crc)
