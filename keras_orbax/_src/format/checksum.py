"""Checksums of the fast format's shard files (docs/format.md, "Checksums").

Each shard file's checksums are CRCs of the whole file (data, then the 20-byte zarr index): zlib's
CRC-32 always, and CRC-32C where google-crc32c is installed (`crc`), computed piece by piece while
the file is written and stored beside the step's arrays; a reader checks the strongest it computes
fast (`crc.strongest`). The zarr shard index carries its own CRC-32C (Castagnoli), which tensorstore
checks when it reads a shard.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from keras_orbax._src.format.crc import Crc, strongest
from keras_orbax._src.format.step_record import STATE
from keras_orbax._src.runtime import thread_pools
from keras_orbax._src.storage import locations
from keras_orbax.errors import CorruptCheckpointError

if TYPE_CHECKING:  # zarr_shards reads files through this module's checks
    from keras_orbax._src.format.zarr_shards import FastArray

# The file's `algorithm`: every entry has a CRC-32, which readers before CRC-32C require; a CRC-32C
# beside it (key "crc32c") is read where google-crc32c is installed.
ALGORITHM = "crc32"
PIECE_BYTES = 4 << 20  # checksummed while still in cache, just before it is written
INDEX_BYTES = 16 + 4  # one (offset, nbytes) little-endian uint64 pair, then its CRC-32C
CHECKSUMS_DIR = "keras_orbax_checksums"  # under <step>/state/: process_<i>.json per process
OCDBT_FILE = "ocdbt.json"  # beside them in a compact step: its OCDBT files (`ocdbt_checksums`)
# In a Hugging Face directory or keras-hub preset keras-orbax exported: each tensor's (h5
# dataset's) CRCs (`export_checksums`); beside a `.weights.h5` export, `export_sidecar_of`.
EXPORT_FILE = "keras_orbax_checksums.json"
_READ_BYTES = 8 << 20


def export_sidecar_of(file_name: str) -> str:
    """The sidecar of a file export (`m.weights.h5`): `m.weights.h5.keras_orbax_checksums.json`,
    beside it (Keras reads only the file, or the parts its `.weights.json` index names)."""
    return f"{file_name}.{EXPORT_FILE}"


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


def check_files(
    path: Path,
    what: str,
    arrays: Mapping[str, FastArray | None],
    files_of: Callable[[FastArray], Iterable[tuple[int, ...]]],
    on_file: Callable[[int], None] | None = None,
) -> tuple[int, int, int, tuple[str, ...]]:
    """Checks the shard files `files_of` each fast-format array names (size, index, checksum).

    Returns:
        Files read, bytes read, checksums compared, and the keys of the arrays with a file for
        which no checksum is recorded (a step saved before checksums: all of them).

    Raises:
        CorruptCheckpointError: naming each variable key and file that failed.
    """
    checksums = recorded_checksums(path / STATE)
    problems: list[str] = []
    io_error: OSError | None = None  # kept as the cause: an I/O error is retried, damage is not
    files, nbytes, compared = 0, 0, 0
    uncovered: dict[str, None] = {}
    for key, array in arrays.items():
        if array is None:
            continue
        for coords in files_of(array):
            file = array.file(coords)
            name = str(file.relative_to(path / STATE))
            algorithm, recorded = checksums.get(name, (None, 0))
            problem, size, crc = check_file(file, array.chunk_bytes, algorithm)
            if isinstance(problem, Unreadable):
                io_error = io_error or problem.error
            files, nbytes = files + 1, nbytes + size
            if on_file is not None:
                on_file(size)
            if algorithm is None:
                uncovered[key] = None
            elif problem is None:
                compared += 1
                if crc != recorded:
                    problem = f"checksum {crc:#010x}, recorded {recorded:#010x} ({algorithm.label})"
            if problem is not None:
                problems.append(f"  {key}: {file}: {problem}")
    if problems:
        failed = f"{len(problems)} array {'file' if len(problems) == 1 else 'files'} failed"
        raise CorruptCheckpointError(
            f"{what} is damaged; {failed}:\n"
            + "\n".join(problems[:50])
            + (f"\n  and {len(problems) - 50} more" if len(problems) > 50 else "")
            + "\nNo variable was modified."
        ) from io_error
    return files, nbytes, compared, tuple(uncovered)


_NOT_MODIFIED = (
    "No variable was modified. Restore another step, or pass verify=False to read it as it is."
)


def mismatch_line(key: str, file: Any, crc: int, recorded: int, algorithm: Crc) -> str:
    """What a restore says of a file whose bytes, as read, do not have their recorded checksum."""
    return (
        f"{key}: {file}: checksum {crc:#010x}, recorded {recorded:#010x} ({algorithm.label}): "
        "its bytes as read are not those written"
    )


def mismatch(
    key: str, file: Any, crc: int, recorded: int, algorithm: Crc
) -> CorruptCheckpointError:
    """The error for a file whose bytes, as read, do not have their recorded checksum."""
    return damaged([mismatch_line(key, file, crc, recorded, algorithm)])


def damaged(lines: list[str]) -> CorruptCheckpointError:
    """The error of a restore for the files `lines` name (one problem each)."""
    head = (
        f"{lines[0]}."
        if len(lines) == 1
        else f"{len(lines)} array files failed:\n  " + ("\n  ".join(lines[:50]))
    )
    return CorruptCheckpointError(
        f"{head}\n{_NOT_MODIFIED}" if len(lines) > 1 else f"{head} {_NOT_MODIFIED}"
    )


def file_crc(path: str, algorithm: Crc) -> tuple[int, int]:
    """(bytes, CRC) of the local file `path`, read once in large blocks (both CRCs release the GIL,
    so threads check files in parallel).

    Raises:
        OSError: the file cannot be read.
    """
    crc, size = 0, 0
    block = bytearray(_READ_BYTES)
    view = memoryview(block)
    with open(path, "rb", buffering=0) as handle:
        while n := handle.readinto(block):
            crc = algorithm.update(crc, view[:n])
            size += n
    return size, crc


def recorded_checksums(state: Path) -> dict[str, tuple[Crc, int]]:
    """`<array>/c/<i>/<j>` -> the strongest CRC recorded that this process computes fast, and its
    value, from every process's checksum file ({} for older steps).

    Raises:
        CorruptCheckpointError: a checksum file cannot be read, or uses another algorithm.
    """
    return _read_checksum_files(sorted((state / CHECKSUMS_DIR).glob("process_*.json")))


def recorded_ocdbt(state: Path) -> dict[str, tuple[Crc, int]]:
    """A compact step's OCDBT files (`manifest.ocdbt`, `d/<id>`, `ocdbt.process_<i>/...`) -> the
    strongest CRC recorded that this process computes, and its value ({} for a fast step, or a
    compact one saved before checksums: `write/ocdbt_checksums.py`).

    Raises:
        CorruptCheckpointError: the checksum file cannot be read, or uses another algorithm.
    """
    path = state / CHECKSUMS_DIR / OCDBT_FILE
    return _read_checksum_files([path] if path.exists() else [])


def check_whole_files(
    state: Path, recorded: Mapping[str, tuple[Crc, int]], what: str
) -> tuple[int, int]:
    """Reads each file of `recorded` (by name under `state`) whole, and checks it against its CRC;
    (files, bytes) read.

    Raises:
        CorruptCheckpointError: naming each file that is missing, unreadable (raised from its
            `OSError`) or fails its checksum.
    """
    ranges = [Recorded("", state / name, 0, None, *value) for name, value in recorded.items()]
    return check_ranges(ranges, what)


@dataclasses.dataclass(frozen=True)
class Recorded:
    """Bytes whose CRC was recorded: `nbytes` (None: to its end) from byte `offset` of `path`,
    named `name` in messages (a tensor; "" for a whole file)."""

    name: str
    path: Path
    offset: int
    nbytes: int | None
    algorithm: Crc
    value: int


def check_ranges(
    ranges: Sequence[Recorded], what: str, advice: str = _NOT_MODIFIED
) -> tuple[int, int]:
    """Reads each of `ranges` and checks it against its recorded CRC, several at a time (the CRCs
    release the GIL); (ranges, bytes) read.

    Raises:
        CorruptCheckpointError: naming each file (and tensor) that is missing, unreadable (raised
            from its `OSError`), short or fails its checksum.
    """
    pool = thread_pools.shared("checksums", 8)
    outcomes = list(pool.map(_range_problem, ranges))
    problems = [problem for problem, _, _ in outcomes if problem is not None]
    io_error = next((error for _, error, _ in outcomes if error is not None), None)
    if problems:
        failed = f"{len(problems)} {'check' if len(problems) == 1 else 'checks'} failed"
        raise CorruptCheckpointError(
            f"{what} is damaged; {failed}:\n" + "\n".join(problems[:50]) + f"\n{advice}"
        ) from io_error
    return len(ranges), sum(nbytes for _, _, nbytes in outcomes)


def _range_problem(recorded: Recorded) -> tuple[str | None, OSError | None, int]:
    """(what is wrong with the range or None, the `OSError` reading it raised, bytes read)."""
    where = f"  {recorded.path}" + (f": {recorded.name}" if recorded.name else "")
    try:
        size, crc = _range_crc(recorded)
    except FileNotFoundError:
        return f"{where}: missing", None, 0
    except OSError as error:
        return f"{where}: unreadable ({type(error).__name__}: {error.strerror})", error, 0
    if recorded.nbytes is not None and size != recorded.nbytes:
        return f"{where}: {size} bytes, expected {recorded.nbytes} (truncated)", None, size
    if crc != recorded.value:
        label = recorded.algorithm.label
        return (
            f"{where}: checksum {crc:#010x}, recorded {recorded.value:#010x} ({label}): its "
            "bytes as read are not those written",
            None,
            size,
        )
    return None, None, size


def _range_crc(recorded: Recorded) -> tuple[int, int]:
    """(bytes, CRC) of the range, read in large blocks."""
    crc, size = 0, 0
    left = recorded.nbytes
    block = bytearray(_READ_BYTES)
    view = memoryview(block)
    with open(recorded.path, "rb", buffering=0) as handle:
        handle.seek(recorded.offset)
        while left is None or left > 0:
            n = handle.readinto(view if left is None else view[: min(left, len(block))])
            if not n:
                break
            crc = recorded.algorithm.update(crc, view[:n])
            size += n
            left = None if left is None else left - n
    return size, crc


def _read_checksum_files(paths: list[Path]) -> dict[str, tuple[Crc, int]]:
    found: dict[str, tuple[Crc, int]] = {}
    for path in paths:
        try:
            content = json.loads(path.read_text())
        except (OSError, ValueError, RecursionError) as error:
            raise CorruptCheckpointError(f"Cannot read checksum file {path}: {error}") from error
        if content.get("algorithm") != ALGORITHM:
            raise CorruptCheckpointError(
                f"{path} uses checksum {content.get('algorithm')!r}; this version knows "
                f"{ALGORITHM!r}. Upgrade keras-orbax."
            )
        try:
            found.update({name: strongest(entry) for name, entry in content["files"].items()})
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise CorruptCheckpointError(
                f"Cannot read checksum file {path}: an entry without a CRC ({error!r})"
            ) from error
    return found


def _open_unbuffered(file: Any) -> Any:
    """A local file without Python's buffer (reads go straight to the caller), or an object."""
    return file.open("rb") if locations.is_remote(file) else open(file, "rb", buffering=0)


def check_file(file: Path, chunk_bytes: int, algorithm: Crc | None) -> tuple[str | None, int, int]:
    """(problem or None, bytes read, CRC of the whole file by `algorithm`: 0 if None)."""
    expected = chunk_bytes + INDEX_BYTES
    crc, size, tail = 0, 0, b""
    try:
        with _open_unbuffered(file) as handle:
            while block := handle.read(_READ_BYTES):
                crc = crc if algorithm is None else algorithm.update(crc, block)
                size += len(block)
                tail = (tail + block)[-INDEX_BYTES:]
    except FileNotFoundError:
        return "missing", 0, 0
    except OSError as error:  # EIO; a directory in its place; an object replaced since listed
        return Unreadable(error), size, crc
    if size != expected:
        return f"{size} bytes, expected {expected} (truncated or overwritten)", size, crc
    if tail != shard_index(chunk_bytes):
        offset, stored = struct.unpack("<QQ", tail[:16])
        return f"bad zarr shard index (offset {offset}, {stored} bytes)", size, crc
    return None, size, crc


class Unreadable(str):
    """A file's problem that is an `OSError` (`check_file`), which it keeps: the caller raises its
    error from it, so that an I/O error is told from damage (`runtime.io_faults`)."""

    error: OSError

    def __new__(cls, error: OSError) -> Unreadable:
        text = super().__new__(
            cls, f"unreadable ({type(error).__name__}: {error.strerror or error})"
        )
        text.error = error
        return text
