"""Checksums of an export's files (a Hugging Face directory's safetensors files, a preset's or a
`.weights.h5` export's h5 files): each region's, read back by process 0 before the commit, and
each tensor's (h5 dataset's), kept in a sidecar file that readers check.

Under `jax.distributed` every process writes its own regions into the shared files. Each reports,
beside the keys of the regions it wrote, the CRC of each region's bytes as it wrote them (the
region of the variable, in its C order: `region_crc`). Process 0, once every process has
reported, reads every region back from the staged files (another host's bytes as this host's
filesystem gives them) and compares (`check_read_back`): a region missing, torn or overwritten
fails the export on every process, naming the file and the tensor. In the same pass it computes
each tensor's CRCs (`crc.RECORDED`) over its bytes in the file, and writes them to
`keras_orbax_checksums.json` in the export (`SIDECAR`; beside a `.weights.h5` or `.weights.json`
export, `<its name>.keras_orbax_checksums.json`: `sidecar_of`): names keras-hub's, Keras's and
transformers' loaders never open. `verify` and every restore of the export check each tensor
against it (`sources.export_sidecar`). An h5 export lists each dataset by its file and h5 path
(`model.weights.h5/layers/dense/vars/0`); the h5 writer (`weights_h5`) places every dataset
contiguously, so its bytes lie at one offset as those of a safetensors tensor do.

```json
{"algorithm": "crc32", "tensors": {"model.embed_tokens.weight":
  {"file": "model.safetensors", "offset": 1032, "bytes": 4096, "crc32": 1, "crc32c": 2}}}
```
"""

from __future__ import annotations

import abc
import dataclasses
import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from keras_orbax._src.export import regions
from keras_orbax._src.export.safetensors_writer import FileLayout, TensorSpec
from keras_orbax._src.format import crc
from keras_orbax._src.format.checksum import ALGORITHM, EXPORT_FILE, export_sidecar_of
from keras_orbax._src.storage import commit
from keras_orbax.errors import SaveFailedError

SIDECAR = EXPORT_FILE
sidecar_of = export_sidecar_of
REGION_CRC = crc.CRC32C or crc.CRC32  # the fastest this install computes: every process's is
_SLAB = 256 << 10  # a strided region is copied this much at a time to be checksummed


class ReadBackSink(commit.ExportSink):
    """An export whose processes each report the CRC of every region they wrote (`region_crcs`,
    by region key), which process 0 checks by reading the staged files back in `assemble`
    (`check_read_back`, with `reported`)."""

    reported: dict[str, int]

    @abc.abstractmethod
    def region_crcs(self) -> Mapping[str, int]:
        """This process's regions' CRCs (`region_crc`), by `<tensor>/<region key>`."""

    def report(self, written: Sequence[str]) -> list[Any]:
        """The regions' digest, and each region's CRC as this process wrote it."""
        return [*commit.digest(written), dict(self.region_crcs())]

    def check(self, reports: Sequence[Any]) -> None:
        commit.check_regions(
            [report[:2] for report in reports], self.regions_due, str(self.destination)
        )
        self.reported = {key: crc for report in reports for key, crc in report[2].items()}


def read_back_bytes(window_bytes: int) -> int:
    """The bands process 0 reads the export back in: at most half the window, and small enough
    to stay in the CPU's cache while they are checksummed (one buffer, reused)."""
    return max(1, min(window_bytes // 2, 8 << 20))


@dataclasses.dataclass(frozen=True)
class Placement:
    """How a variable's regions sit in its tensor: the tensor's shape in the file (`view`), the
    variable's axes kept (size-1 ones dropped) and their permutation (`tensor_writer`)."""

    view: tuple[int, ...]
    kept: tuple[int, ...]
    permutation: tuple[int, ...]

    def box(self, key: str) -> regions.Index:
        """The region `key` (in the variable's coordinates) as a box of the tensor."""
        index = regions.parse_region_key(key)
        kept = tuple(index[axis] for axis in self.kept)
        return tuple(kept[p] for p in self.permutation)


def region_crc(block: np.ndarray, crc: int = 0) -> int:
    """The CRC of a region's bytes in its C order (`block`: the region as the tensor holds it,
    any strides), extended from `crc`; a strided block is copied a slab at a time, so no host
    buffer near its size is made."""
    if block.flags.c_contiguous:
        return REGION_CRC.update(crc, block.reshape(-1).view(np.uint8))
    if block.ndim > 1 and block[0].nbytes > _SLAB:
        for row in block:
            crc = region_crc(row, crc)
        return crc
    rows = max(1, _SLAB // max(1, block[0].nbytes if block.ndim > 1 else block.itemsize))
    for start in range(0, len(block), rows):
        slab = np.ascontiguousarray(block[start : start + rows])
        crc = REGION_CRC.update(crc, slab.reshape(-1).view(np.uint8))
    return crc


def check_read_back(
    staging: Path,
    layouts: list[FileLayout],
    placements: Mapping[str, Placement],
    reported: Mapping[str, int],
    band_bytes: int,
) -> dict[str, dict[str, Any]]:
    """Process 0: reads every tensor back from the staged files in bands of at most `band_bytes`
    (or a row), checks each reported region (`<tensor>/<region key>` -> CRC) against it, and
    returns each tensor's sidecar entry (its CRCs over its bytes in the file).

    Raises:
        SaveFailedError: a region's bytes in the file are not those its process wrote; naming the
            file, the tensor and the region.
    """
    by_tensor: dict[str, list[tuple[str, int]]] = {}
    for key, value in reported.items():
        name, _, region = key.rpartition("/")
        by_tensor.setdefault(name, []).append((region, value))
    reader = _ReadBack(band_bytes)
    wrong, entries = [], {}
    for layout in layouts:
        path = staging / layout.file_name
        with open(path, "rb", buffering=0) as handle:
            for name, offset in layout.offsets.items():
                placement = placements[name]
                boxes = {r: placement.box(r) for r, _ in by_tensor.get(name, ())}
                spec = layout.specs[name]
                crcs, found = reader.tensor(handle.fileno(), path, offset, spec, placement, boxes)
                wrong += [
                    f"  {path}: {name}, region {region}"
                    for region, value in by_tensor.get(name, ())
                    if found[region] != value
                ]
                entries[name] = {
                    "file": layout.file_name,
                    "offset": offset,
                    "bytes": spec.nbytes,
                    **{c.key: v for c, v in zip(crc.RECORDED, crcs, strict=True)},
                }
    if wrong:
        raise SaveFailedError(
            f"{len(wrong)} {'region' if len(wrong) == 1 else 'regions'} of the export read back "
            f"from the shared files {'is' if len(wrong) == 1 else 'are'} not the bytes their "
            f"process wrote ({REGION_CRC.label}):\n"
            + "\n".join(wrong[:20])
            + "\nThe export is abandoned; the previous one is untouched."
        )
    return entries


class _ReadBack:
    """Reads tensors back band by band into one buffer, reused (at most `band_bytes`, or a row)."""

    def __init__(self, band_bytes: int) -> None:
        self.band_bytes = band_bytes
        self.buffer = np.empty(0, np.uint8)

    def tensor(
        self,
        fd: int,
        path: Path,
        offset: int,
        spec: TensorSpec,
        placement: Placement,
        boxes: Mapping[str, regions.Index],
    ) -> tuple[list[int], dict[str, int]]:
        """The tensor's CRCs (`crc.RECORDED`) over its bytes in the file, and each region
        box's CRC (`REGION_CRC`) over its bytes in C order (the tensor's, whose C order the
        bands follow: each box's bytes come band after band, in order)."""
        view_shape = placement.view
        itemsize = spec.dtype.itemsize
        strides = [math.prod(view_shape[d + 1 :]) for d in range(len(view_shape))]
        crcs, found = [0] * len(crc.RECORDED), dict.fromkeys(boxes, 0)
        for band in regions.windows(view_shape, itemsize, self.band_bytes):
            extent = [s.stop - s.start for s in band]
            nbytes = math.prod(extent) * itemsize
            if self.buffer.nbytes < nbytes:
                self.buffer = np.empty(nbytes, np.uint8)
            start = sum(b.start * n for b, n in zip(band, strides, strict=True))
            view = memoryview(self.buffer.data)[:nbytes]
            _read_exactly(fd, view, offset + start * itemsize, path)
            crcs = [c.update(v, view) for c, v in zip(crc.RECORDED, crcs, strict=True)]
            data = self.buffer[:nbytes].view(spec.dtype).reshape(extent)
            for region, box in boxes.items():
                common = [
                    (max(b.start, i.start), min(b.stop, i.stop))
                    for b, i in zip(band, box, strict=True)
                ]
                if all(lo < hi for lo, hi in common):
                    part = tuple(
                        slice(lo - b.start, hi - b.start)
                        for (lo, hi), b in zip(common, band, strict=True)
                    )
                    found[region] = region_crc(data[part], found[region])
        return crcs, found


def _read_exactly(fd: int, view: memoryview, offset: int, path: Path) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise SaveFailedError(f"{path} is shorter than its layout: written in part only.")
        done += n


def write_sidecar(path: Path, entries: Mapping[str, dict[str, Any]]) -> None:
    """Process 0: the sidecar file at `path`, in the staged export (fsynced with the rest of it)."""
    content = {"algorithm": ALGORITHM, "tensors": dict(entries)}
    path.write_text(json.dumps(content, indent=1) + "\n")
