"""What a restore checks as it reads (`verify`), and what it says of what it could not check."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from keras_orbax._src.model.matching import counted
from keras_orbax._src.read.sharded_read import ReadPlan
from keras_orbax._src.sources import resolve
from keras_orbax._src.sources.base import Source


def checked_reads(
    source: Source, reads: ReadPlan, verify: bool | None
) -> tuple[ReadPlan, tuple[str, ...] | None, str | None]:
    """`reads` made to check every byte against the checksums `source` recorded (unless `verify`
    is False); the keys they leave unchecked (None: all of them); and, for `verify=True` only,
    what to warn of those (None: nothing to say). By default a source that records no checksums
    is read quietly, and a file this process reads only part of is not read whole to check it
    (`ReadPlan.checks.unchecked` names its array once read); `verify=True` reads it back.

    Raises:
        CorruptCheckpointError: the source's checksum files cannot be read.
    """
    if verify is False:
        return reads, None, None
    reads, found = source.verified_reads(reads, read_back=bool(verify))
    if found is None:
        said = (
            f"restore_sharded(verify=True): {resolve.describe(source)} {source.no_checksums}, so "
            "nothing was verified. Its arrays are read as they are."
        )
        return reads, None, said if verify else None
    if not (verify and found.unchecked):
        return reads, found.unchecked, None
    unchecked = found.unchecked
    said = (
        f"restore_sharded(verify=True) could not verify {counted(len(unchecked), 'array')} of "
        f"{resolve.describe(source)} ({found.why_unchecked}), restored as read: "
        + ", ".join(unchecked[:5])
        + (f" and {len(unchecked) - 5} more." if len(unchecked) > 5 else ".")
    )
    return reads, unchecked, said


def unverified_keys(
    arrays: Mapping[str, Any], planned: tuple[str, ...] | None, reads: ReadPlan
) -> tuple[str, ...]:
    """The keys of `arrays` read without a check: those `planned` so (None: all), and those with
    a file this process read only part of (`read_checks`)."""
    partly = reads.checks.unchecked if reads.checks is not None else {}
    return tuple(k for k in arrays if planned is None or k in planned or k in partly)
