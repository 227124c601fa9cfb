"""The checksums keras-orbax's exports keep beside their files (`export.export_checksums`), checked
by every source that reads such an export: a Hugging Face directory, a keras-hub preset, a
`.weights.h5` (or `.weights.json`).

The sidecar lists, by name (a tensor; `<file>/<h5 dataset path>` for an h5 export), where each
array's bytes lie (`file`, `offset`, `bytes`) and their CRCs; a reader checks each array it lists
whole (`checksum.check_ranges`) where the sidecar puts it exactly where the file does.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from keras_orbax._src.format import checksum
from keras_orbax._src.format.crc import strongest
from keras_orbax._src.sources.base import FileCheck
from keras_orbax.errors import CorruptCheckpointError

if TYPE_CHECKING:
    from keras_orbax._src.read.sharded_read import ReadPlan

Place = tuple[Path, int, int]
"""Where an array's bytes lie, as its source reads them: (file, offset, bytes)."""


def recorded(sidecar: Path, places: Mapping[str, Place]) -> dict[str, checksum.Recorded] | None:
    """Each array's recorded CRC, by the name the sidecar gives it, where it lies where `places`
    (by the same names) puts it; None where there is no sidecar. An entry for a file not among
    `places`' files is not this source's (a preset's task weights) and is left out.

    Raises:
        CorruptCheckpointError: the sidecar cannot be read, or records another place for an array.
    """
    if not sidecar.is_file():
        return None
    files = {path.name for path, _, _ in places.values()}
    try:
        content = json.loads(sidecar.read_text())
        if content.get("algorithm") != checksum.ALGORITHM:
            raise ValueError(f"checksum {content.get('algorithm')!r}, not {checksum.ALGORITHM!r}")
        found = {}
        for name, entry in content["tensors"].items():
            if entry["file"] not in files:
                continue
            algorithm, value = strongest(entry)
            place = places.get(name)
            if place is None or (entry["file"], entry["offset"], entry["bytes"]) != (
                place[0].name,
                place[1],
                place[2],
            ):
                raise ValueError(f"{name} is not where its file puts it")
            found[name] = checksum.Recorded(name, place[0], place[1], place[2], algorithm, value)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as error:
        raise CorruptCheckpointError(
            f"Cannot use the checksum file {sidecar}: {error}. If another tool rewrote the "
            "export, delete that file."
        ) from error
    return found


def check(sidecar: Path, places: Mapping[str, Place], what: str) -> FileCheck | None:
    """Reads every array of `places` the sidecar records and checks it; None where there is no
    sidecar. `places`' arrays it does not record are returned as unchecked.

    Raises:
        CorruptCheckpointError: the sidecar cannot be read, or naming each array and file that
            fails its CRC.
    """
    found = recorded(sidecar, places)
    if found is None:
        return None
    advice = (
        "No variable was modified. If another tool rewrote the files since keras-orbax "
        f"exported them, delete {sidecar}; or pass verify=False to read them as they are."
    )
    compared, nbytes = checksum.check_ranges(list(found.values()), what, advice)
    files = len({r.path for r in found.values()})
    unchecked = tuple(name for name in places if name not in found)
    why = f"{len(unchecked)} arrays not in {sidecar.name}" if unchecked else ""
    return FileCheck(files, nbytes, compared, unchecked, why)


class CheckedBySidecar:
    """`check_files` and `verified_reads` of a source whose arrays keras-orbax's export may have
    checksummed: each array against the sidecar (`checked_by_sidecar`, None where there is none),
    and, for a restore, every one checked whole before any is read (such a source is read twice)."""

    def checked_by_sidecar(self) -> FileCheck | None:
        raise NotImplementedError

    def check_files(
        self, keys: Sequence[str] | None = None, on_file: Callable[[int], None] | None = None
    ) -> FileCheck | None:
        found = self.checked_by_sidecar()
        if found is not None and on_file is not None:
            on_file(found.nbytes)
        return found

    def verified_reads(
        self, reads: ReadPlan, *, read_back: bool = False
    ) -> tuple[ReadPlan, FileCheck | None]:
        return reads, self.checked_by_sidecar()
