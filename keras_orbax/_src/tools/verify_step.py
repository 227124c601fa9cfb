"""`verify`: read every array file of a step back and check its size, zarr index and checksum."""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Iterable

from keras_orbax._src.format import checksum, step_dirs
from keras_orbax._src.format.zarr_shards import FastArray
from keras_orbax._src.runtime.progress import Progress


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
    step, path = step_dirs.step_path(directory, step)
    record = step_dirs.read_record(path)

    def every_file(array: FastArray) -> Iterable[tuple[int, ...]]:
        grid = [n // c for n, c in zip(array.shape, array.chunk_shape, strict=True)]
        return itertools.product(*map(range, grid))

    arrays = {v.key: FastArray.open(path, v) for v in record.variables.values()}
    total = sum(
        (a.chunk_bytes + checksum.INDEX_BYTES) * len(list(every_file(a)))
        for a in arrays.values()
        if a is not None
    )
    with Progress("verify", total, enabled=bool(verbose)) as progress:
        files, nbytes, compared = checksum.check_files(
            path, f"Step {step} of '{directory}'", arrays, every_file, progress.advance
        )
    unchecked = tuple(key for key, array in arrays.items() if array is None)
    return VerifyResult(step, files, nbytes, compared, unchecked)
