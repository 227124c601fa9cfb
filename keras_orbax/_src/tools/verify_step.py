"""`verify`: read saved state back and check it against the checksums recorded when it was written,
or say that nothing was recorded to check against."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence

from keras_orbax._src.runtime.progress import Progress, human_bytes
from keras_orbax._src.sources import resolve
from keras_orbax._src.sources.base import Source, batched
from keras_orbax._src.storage import step_leftovers
from keras_orbax.errors import CorruptCheckpointError


@dataclasses.dataclass(frozen=True)
class VerifyResult:
    """What `verify` checked.

    Attributes:
        step: The step checked (None for a weights file or model directory).
        files: Files read back whole and checked (0 for a source that records no checksums,
            which is read back array by array).
        bytes: Bytes read.
        checksummed: Files (a Hugging Face export's: tensors) whose recorded checksum matched.
        unchecked: Keys of arrays that no recorded checksum covers: read back and found readable,
            but not compared with what was written (every array of a step saved before
            checksums, a compact one's included, and of sources that record none).
        location: The resolved location checked.
        kind: Which kind of source (`"keras-orbax"`, `"keras-weights"`, ...).
        why_unchecked: Why some arrays are unchecked, in words; empty if none is.
        leftovers: What saves left beside the steps of a checkpoint root, one line each: a
            killed save's staging directory (`<step>.orbax-checkpoint-tmp`, taking disk space),
            a step an overwrite moved aside; empty if nothing is.
    """

    step: int | None
    files: int
    bytes: int
    checksummed: int
    unchecked: tuple[str, ...]
    location: str = ""
    kind: str = "keras-orbax"
    why_unchecked: str = ""
    leftovers: tuple[str, ...] = ()

    @property
    def intact(self) -> bool:
        """Every array was compared with the checksums recorded when it was written."""
        return self.checksummed > 0 and not self.unchecked

    def __str__(self) -> str:
        beside = "".join(f"\n  left beside the steps: {line}" for line in self.leftovers)
        return self._outcome() + beside

    def _outcome(self) -> str:
        what = (
            f"step {self.step} of '{self.location}'"
            if self.step is not None
            else (f"'{self.location}'")
        )
        read = human_bytes(self.bytes)
        if self.files:
            read = f"{self.files} {'file' if self.files == 1 else 'files'}, {read}"
        if self.intact:
            return f"{what} intact: {read} read, each matched its recorded checksum."
        if not self.unchecked and not self.checksummed:
            return f"{what} not verified: it holds no arrays, so nothing was checked."
        count = len(self.unchecked)
        arrays = f"{count} {'array' if count == 1 else 'arrays'}"
        return (
            f"{what} not verified: {arrays} read back and readable, but not checked against "
            f"checksums ({self.why_unchecked}); {read} read, {self.checksummed} checksums matched."
        )


def verify(
    directory: str | os.PathLike, step: int | None = None, *, verbose: int = 0
) -> VerifyResult:
    """Reads every array file of saved state back and checks it against what was written.

    For a keras-orbax step, each shard file of a fast-format array must be there, have the
    expected size and a valid zarr shard index, and match the CRC recorded when it was written;
    each file of a compact step's OCDBT databases, its CRC; its record and input positions,
    their checksums. A Hugging Face directory `export_to_transformers` wrote: each tensor, its
    CRC. Sources that record no checksums (Keras weights files, presets, other Hugging Face
    directories, Keras's `OrbaxCheckpoint` steps, keras-orbax steps saved before checksums) are
    read back whole,
    array by array, and reported as not verified: `VerifyResult.intact` is then False and
    `unchecked` lists them. Changes nothing.

    Args:
        directory: Any location `restore_sharded` takes (a checkpoint root or step, a weights
            file, a preset or a Hugging Face directory). For a `ModelCheckpoint`'s
            `local_directory` written under `jax.distributed`, every part of the step that
            directory holds (its process's own, and the replica of its peer's): each part's
            manifest, data CRC-32 and input position.
        step: The step to check; `None` means the latest committed one.
        verbose: 1 shows the bytes checked and the rate on a terminal.

    Returns:
        What was checked; `intact` says whether every array was compared with its checksum.

    Raises:
        CheckpointNotFoundError: no such location or committed step.
        CorruptCheckpointError: a file is missing, truncated, has a bad index or checksum, or
            cannot be read; the message names each variable key and file.

    Example:
    ```python
    result = keras_orbax.verify("/ckpt")          # the latest step
    assert result.intact
    ```
    """
    from keras_orbax._src.tools import tier_tools  # it builds on this module's types

    tier = tier_tools.located(directory)
    if tier is not None:
        return tier_tools.verify(tier, step)
    source = resolve.open_source(directory, step)
    total = sum(v.nbytes for v in source.record.variables.values())
    try:
        with Progress("verify", total, enabled=bool(verbose)) as progress:
            found = source.check_files(on_file=progress.advance)
            read_back = found.unchecked if found is not None else tuple(source.record.variables)
            nbytes = _read_back(source, read_back, progress.advance)
    except CorruptCheckpointError as error:
        # The checks are the restore's, whose errors assure that no variable was modified:
        # verify has no variables, and says so nowhere.
        raise CorruptCheckpointError(_without_restore_note(str(error))) from error
    files = found.files if found else 0  # a source without checksums is read array by array
    why = "" if not read_back else (source.no_checksums if found is None else found.why_unchecked)
    return VerifyResult(
        step=source.step,
        files=files,
        bytes=(found.nbytes if found else 0) + nbytes,
        checksummed=found.checksummed if found else 0,
        unchecked=read_back,
        location=str(source.where),
        kind=source.kind,
        why_unchecked=why,
        leftovers=step_leftovers.notes(source.location) if source.kind == "keras-orbax" else (),
    )


def _without_restore_note(message: str) -> str:
    note = "No variable was modified."
    message = message.replace(f"\n{note} ", "\n").replace(f"\n{note}", "")
    message = message.replace(f" {note}", "").rstrip()
    return message if message.endswith(".") else f"{message}."


def _read_back(source: Source, keys: Sequence[str], on_read: Callable[[int], None]) -> int:
    """Reads each array whole, 64 MiB of arrays at a time; returns the bytes read.

    Raises:
        CorruptCheckpointError: an array cannot be read (named: a batch that fails is read again
            one array at a time to find it).
    """
    nbytes = 0

    def size(key: str) -> int:
        return source.record.variables[key].nbytes

    for batch in batched(keys, size):
        try:
            source.read_arrays(batch)
        except Exception:
            for key in batch:
                _read_one(source, key)
            raise
        for key in batch:
            nbytes += size(key)
            on_read(size(key))
    return nbytes


def _read_one(source: Source, key: str) -> None:
    """Reads the array `key` whole.

    Raises:
        CorruptCheckpointError: it cannot be read.
    """
    try:
        source.read_array(key)
    except CorruptCheckpointError:
        raise
    except Exception as error:  # a reader's own error (h5py, tensorstore): named here
        raise CorruptCheckpointError(
            f"{resolve.describe(source)} is damaged: {key} cannot be read: {error}"
        ) from error
