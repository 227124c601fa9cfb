"""Checksums of a Hugging Face export's safetensors files: each region's, read back by process 0
before the commit, and each tensor's, kept in a sidecar file that readers check.

Under `jax.distributed` every process writes its own regions into the shared files. Each reports,
beside the keys of the regions it wrote, the CRC of each region's bytes as it wrote them (the
region of the variable, in its C order: `region_crc`). Process 0, once every process has
reported, reads every region back from the staged files (another host's bytes as this host's
filesystem gives them) and compares (`check_read_back`): a region missing, torn or overwritten
fails the export on every process, naming the file and the tensor. In the same pass it computes
each tensor's CRCs (`crc.RECORDED`) over its bytes in the file, and writes them to
`keras_orbax_checksums.json` in the export (`SIDECAR`): a name keras-hub's, Keras's and
transformers' loaders never open. `verify` and every restore of the directory check each tensor
against it (`sources.hf_directory`).

```json
{"algorithm": "crc32", "tensors": {"model.embed_tokens.weight":
  {"file": "model.safetensors", "offset": 1032, "bytes": 4096, "crc32": 1, "crc32c": 2}}}
```
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from keras_orbax._src.export import regions
from keras_orbax._src.export.safetensors_writer import FileLayout
from keras_orbax._src.format import crc
from keras_orbax._src.format.checksum import ALGORITHM
from keras_orbax.errors import SaveFailedError

SIDECAR = "keras_orbax_checksums.json"
REGION_CRC = crc.CRC32C or crc.CRC32  # the fastest this install computes: every process's is
_PIECE = 16 << 20  # a tensor's bytes are checksummed in pieces of this many (from the mapping)


@dataclasses.dataclass(frozen=True)
class Placement:
    """How a variable's regions sit in its tensor: the tensor's shape in the file (`view`), the
    variable's axes kept (size-1 ones dropped) and their permutation (`tensor_writer`)."""

    view: tuple[int, ...]
    kept: tuple[int, ...]
    permutation: tuple[int, ...]


def region_crc(block: np.ndarray) -> int:
    """The CRC of a region's bytes in its C order, as a process reports what it wrote."""
    return REGION_CRC.of(np.ascontiguousarray(block).reshape(-1).view(np.uint8))


def check_read_back(
    staging: Path,
    layouts: list[FileLayout],
    placements: Mapping[str, Placement],
    reported: Mapping[str, int],
) -> dict[str, dict[str, Any]]:
    """Process 0: reads every reported region (`<tensor>/<region key>` -> CRC) back from the
    staged files and checks it; returns each tensor's sidecar entry (its CRCs over its bytes in
    the file).

    Raises:
        SaveFailedError: a region's bytes in the file are not those its process wrote; naming the
            file, the tensor and the region.
    """
    wrong = []
    entries = {}
    by_tensor: dict[str, list[tuple[str, int]]] = {}
    for key, value in reported.items():
        name, _, region = key.rpartition("/")
        by_tensor.setdefault(name, []).append((region, value))
    for layout in layouts:
        path = staging / layout.file_name
        for name, offset in layout.offsets.items():
            spec = layout.specs[name]
            if spec.nbytes == 0:
                entries[name] = _entry(layout.file_name, offset, b"")
                continue
            data = np.memmap(path, np.uint8, "r", offset, spec.nbytes)
            entries[name] = _entry(layout.file_name, offset, data)
            placement = placements[name]
            tensor = data.view(spec.dtype).reshape(placement.view)
            for region, value in by_tensor.get(name, ()):
                if region_crc(_region(tensor, placement, region)) != value:
                    wrong.append(f"  {path}: {name}, region {region}")
            del tensor, data
    if wrong:
        raise SaveFailedError(
            f"{len(wrong)} {'region' if len(wrong) == 1 else 'regions'} of the export read back "
            f"from the shared files are not the bytes their process wrote ({REGION_CRC.label}):\n"
            + "\n".join(wrong[:20])
            + "\nThe export is abandoned; the previous one is untouched."
        )
    return entries


def _region(tensor: np.ndarray, placement: Placement, key: str) -> np.ndarray:
    """The region `key` (in the variable's coordinates) of `tensor` as the file holds it, in the
    variable's axes again (the region's block as its process wrote it)."""
    index = regions.parse_region_key(key)
    kept = tuple(index[axis] for axis in placement.kept)
    box = tuple(kept[p] for p in placement.permutation)
    block = tensor[box]
    inverse = tuple(np.argsort(placement.permutation))
    return block.transpose(inverse).reshape([s.stop - s.start for s in index])


def _entry(file: str, offset: int, data: Any) -> dict[str, Any]:
    crcs = [0] * len(crc.RECORDED)
    for start in range(0, len(data), _PIECE):
        piece = data[start : start + _PIECE]
        crcs = [c.update(value, piece) for c, value in zip(crc.RECORDED, crcs, strict=True)]
    return {
        "file": file,
        "offset": offset,
        "bytes": len(data),
        **{c.key: value for c, value in zip(crc.RECORDED, crcs, strict=True)},
    }


def write_sidecar(staging: Path, entries: Mapping[str, dict[str, Any]]) -> None:
    """Process 0: the sidecar file, in the staged export (fsynced with the rest of it)."""
    content = {"algorithm": ALGORITHM, "tensors": dict(entries)}
    (staging / SIDECAR).write_text(json.dumps(content, indent=1) + "\n")
