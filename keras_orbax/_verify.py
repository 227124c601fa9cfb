"""`verify`: read every array file of a step back and check its size, zarr index and checksum."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import struct
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from keras_orbax import _checksum, _steps, _storage, _write
from keras_orbax._fast_format import FastArray
from keras_orbax._metadata import STATE
from keras_orbax._progress import Progress
from keras_orbax.errors import CorruptCheckpointError

_READ_BYTES = 8 << 20


@dataclasses.dataclass(frozen=True)
class VerifyResult:
    """What `verify` checked.

    Attributes:
        step: The step checked.
        files: Shard files read back whole.
        bytes: Bytes read.
        checksummed: Files whose checksum was compared (steps saved before checksums: 0).
        unchecked: Keys of arrays not in the fast format (e.g. `"compact"`), which Orbax and
            tensorstore check (zstd, crc32c) only when they read them.
    """

    step: int
    files: int
    bytes: int
    checksummed: int
    unchecked: tuple[str, ...]


def verify(
    directory: str | os.PathLike, step: int | None = None, *, verbose: int = 0
) -> VerifyResult:
    """Reads every array file of a committed step and checks it against what was written.

    Each shard file of a fast-format array must be there, have the expected size and a valid zarr
    shard index, and, for steps saved with checksums, match the CRC-32 recorded when it was
    written. Reads every byte of the step once; changes nothing.

    Args:
        directory: The checkpoint root given to `save` or `ModelCheckpoint`.
        step: The step to check; `None` means the latest committed one.
        verbose: 1 shows the bytes checked and the rate on a terminal.

    Returns:
        What was checked.

    Raises:
        CheckpointNotFoundError: no such committed step.
        CorruptCheckpointError: a file is missing, truncated, has a bad index or checksum; the
            message names each variable key and file.

    Example:
    ```python
    keras_orbax.verify("/ckpt")          # the latest step
    ```
    """
    step, path = _steps.step_path(directory, step)
    record = _steps.read_record(path)

    def every_file(array: FastArray) -> Iterable[tuple[int, ...]]:
        grid = [n // c for n, c in zip(array.shape, array.chunk_shape, strict=True)]
        return itertools.product(*map(range, grid))

    arrays = {v.key: FastArray.open(path, v) for v in record.variables.values()}
    total = sum(
        (a.chunk_bytes + _checksum.INDEX_BYTES) * len(list(every_file(a)))
        for a in arrays.values()
        if a is not None
    )
    with Progress("verify", total, enabled=bool(verbose)) as progress:
        files, nbytes, compared = check_files(
            path, f"Step {step} of '{directory}'", arrays, every_file, progress.advance
        )
    unchecked = tuple(key for key, array in arrays.items() if array is None)
    return VerifyResult(step, files, nbytes, compared, unchecked)


def check_files(
    path: Path,
    what: str,
    arrays: Mapping[str, FastArray | None],
    files_of: Callable[[FastArray], Iterable[tuple[int, ...]]],
    on_file: Callable[[int], None] | None = None,
) -> tuple[int, int, int]:
    """Checks the shard files `files_of` each fast-format array names (size, index, checksum).

    Returns:
        Files read, bytes read, checksums compared.

    Raises:
        CorruptCheckpointError: naming each variable key and file that failed.
    """
    checksums = _recorded_checksums(path / STATE)
    problems: list[str] = []
    files, nbytes, compared = 0, 0, 0
    for key, array in arrays.items():
        if array is None:
            continue
        for coords in files_of(array):
            file = array.file(coords)
            name = str(file.relative_to(path / STATE))
            problem, size, crc = _check_file(file, array.chunk_bytes)
            files, nbytes = files + 1, nbytes + size
            if on_file is not None:
                on_file(size)
            if problem is None and name in checksums:
                compared += 1
                if crc != checksums[name]:
                    problem = f"checksum {crc:#010x}, recorded {checksums[name]:#010x}"
            if problem is not None:
                problems.append(f"  {key}: {file}: {problem}")
    if problems:
        raise CorruptCheckpointError(
            f"{what} is damaged; {len(problems)} array files failed:\n"
            + "\n".join(problems[:50])
            + ("\n  ..." if len(problems) > 50 else "")
            + "\nNo variable was modified."
        )
    return files, nbytes, compared


def _recorded_checksums(state: Path) -> dict[str, int]:
    """`<array>/c/<i>/<j>` -> CRC-32 from every process's checksum file ({} for older steps)."""
    found: dict[str, int] = {}
    for path in sorted((state / _write.CHECKSUMS_DIR).glob("process_*.json")):
        try:
            content = json.loads(path.read_text())
        except (OSError, ValueError) as error:
            raise CorruptCheckpointError(f"Cannot read checksum file {path}: {error}") from error
        if content.get("algorithm") != _checksum.ALGORITHM:
            raise CorruptCheckpointError(
                f"{path} uses checksum {content.get('algorithm')!r}; this version knows "
                f"{_checksum.ALGORITHM!r}. Upgrade keras-orbax."
            )
        found.update({name: entry[_checksum.ALGORITHM] for name, entry in content["files"].items()})
    return found


def _open_unbuffered(file: Any) -> Any:
    """A local file without Python's buffer (reads go straight to the caller), or an object."""
    return file.open("rb") if _storage.is_remote(file) else open(file, "rb", buffering=0)


def _check_file(file: Path, chunk_bytes: int) -> tuple[str | None, int, int]:
    """(problem or None, bytes read, CRC-32 of the whole file)."""
    expected = chunk_bytes + _checksum.INDEX_BYTES
    crc, size, tail = 0, 0, b""
    try:
        with _open_unbuffered(file) as handle:
            while block := handle.read(_READ_BYTES):
                crc = _checksum.update(crc, block)
                size += len(block)
                tail = (tail + block)[-_checksum.INDEX_BYTES :]
    except FileNotFoundError:
        return "missing", 0, 0
    if size != expected:
        return f"{size} bytes, expected {expected} (truncated or overwritten)", size, crc
    if tail != _checksum.shard_index(chunk_bytes):
        offset, stored = struct.unpack("<QQ", tail[:16])
        return f"bad zarr shard index (offset {offset}, {stored} bytes)", size, crc
    return None, size, crc
