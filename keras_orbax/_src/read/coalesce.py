"""Reading the regions of one array together where they cut the same stored rows.

A region that cuts the rows of a stored block (a (65536, 1024) float32 embedding saved split on its
first axis and restored split on its last: 512 bytes of every row of every saved shard) is one short
read per row when read alone, half a million `preadv` calls for that embedding. The regions this
process's devices hold often tile whole rows between them. `plan` finds, in each block, the bands of
rows where they do (or tile a narrower box: then each row of it is one read, not one per region),
and `Together` reads each such band once, in pieces of about 1 MiB, scattering every piece into each
region with numpy. It still reads only bytes some region needs (the multi-host byte counts stay
exact); any other part is read box by box, as alone.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable

import numpy as np

from keras_orbax._src.storage import mapped
from keras_orbax._src.storage.byte_runs import (
    Block,
    Box,
    Index,
    aligned_empty,
    bounds,
    cast,
    read_box,
    short_runs,
)

_PIECE_BYTES = 1 << 20  # rows of a band read at once, then scattered (measured: 1 MiB beat 4 MiB)
_JOB_BYTES = 32 << 20  # bytes one job reads; jobs run in parallel on the reading threads
Blocks = Callable[[Index], list[Block]]


@dataclasses.dataclass(frozen=True)
class _Direct:
    """A box of one region read straight into it (`read_box`)."""

    region: int
    box: Box


@dataclasses.dataclass(frozen=True)
class _Piece:
    """Rows of a band read once into a buffer (`union`: its box of the block), then scattered into
    the regions of `parts` (each a region and its box of the block, within `union`)."""

    union: Box
    parts: list[tuple[int, Box]]


_Step = _Direct | _Piece


@dataclasses.dataclass(frozen=True)
class _Job:
    block: Block
    steps: list[_Step]


def plan(
    blocks: Blocks, shape: tuple[int, ...], dtype: np.dtype, indices: list[Index]
) -> Together | None:
    """How to read `indices` (regions of an array of `shape` stored as `blocks` in `dtype`)
    together, or None where no band of rows is worth reading together (each region is then read
    alone, as fast)."""
    regions = [bounds(index, shape) for index in indices]
    region_shapes = [tuple(hi - lo for lo, hi in region) for region in regions]
    parts: dict[tuple[int, ...], tuple[Block, list[tuple[int, Box]]]] = {}
    for number, index in enumerate(indices):
        for block in blocks(index):
            entry = parts.setdefault(block.origin, (block, []))
            entry[1].append((number, block.box(regions[number])))
    jobs: list[_Job] = []
    for block, boxes in parts.values():
        steps = _steps(block.shape, boxes, region_shapes, dtype.itemsize)
        jobs.extend(_Job(block, group) for group in _jobs(steps, dtype.itemsize))
    if not any(isinstance(step, _Piece) for job in jobs for step in job.steps):
        return None
    return Together(region_shapes, dtype, jobs)


class Together:
    """The regions of one array, read by `jobs()` (to run in parallel, each on its own block),
    then handed out by `regions(dtype)`."""

    def __init__(self, shapes: list[tuple[int, ...]], dtype: np.dtype, jobs: list[_Job]) -> None:
        self.shapes, self.dtype, self._jobs = shapes, dtype, jobs
        self._outs: list[np.ndarray] = []

    def jobs(self) -> list[Callable[[], None]]:
        """Allocates the regions (untouched pages until read); the jobs that fill them."""
        self._outs = [
            aligned_empty(math.prod(shape) * self.dtype.itemsize).view(self.dtype).reshape(shape)
            for shape in self.shapes
        ]
        return [functools.partial(self._run, job) for job in self._jobs]

    def regions(self, dtype: np.dtype) -> list[np.ndarray]:
        """Each region, once every job has run, cast to `dtype`."""
        outs, self._outs = self._outs, []
        return [cast(out, dtype) for out in outs]

    def _run(self, job: _Job) -> None:
        block, item = job.block, self.dtype.itemsize
        largest = max(
            (math.prod(s.union.extent) for s in job.steps if isinstance(s, _Piece)), default=0
        )
        buffer = np.empty(largest * item, np.uint8)  # one piece of rows at a time
        for region, (start, stop) in self._spans(job).items():
            mapped.populate_for_writing(self._outs[region], start, stop)
        with block.opener() as (fetch, offset):
            for step in job.steps:
                if isinstance(step, _Direct):
                    out = self._outs[step.region]
                    flat = out.reshape(-1).view(np.uint8)
                    read_box(fetch, offset, block.shape, step.box, flat, out.shape, self.dtype)
                    continue
                shape = tuple(step.union.extent)
                rows = buffer[: math.prod(shape) * item]
                read_box(fetch, offset, block.shape, step.union, rows, shape, self.dtype)
                self._scatter(rows.view(self.dtype).reshape(shape), step)

    def _spans(self, job: _Job) -> dict[int, tuple[int, int]]:
        """Per region, the bytes from the first to the last that the pieces of `job` write."""
        spans: dict[int, tuple[int, int]] = {}
        for step in job.steps:
            for region, box in step.parts if isinstance(step, _Piece) else []:
                strides = self._outs[region].strides
                first = sum(d * s for d, s in zip(box.dst_start, strides, strict=True))
                last = sum(
                    (d + e - 1) * s
                    for d, e, s in zip(box.dst_start, box.extent, strides, strict=True)
                )
                lo, hi = spans.get(region, (first, last + self.dtype.itemsize))
                spans[region] = (min(lo, first), max(hi, last + self.dtype.itemsize))
        return spans

    def _scatter(self, piece: np.ndarray, step: _Piece) -> None:
        """Copies each part of `piece` (the rows `step.union` of the block) into its region."""
        origin = step.union.src_start
        for region, box in step.parts:
            source = tuple(
                slice(s - o, s - o + e)
                for s, o, e in zip(box.src_start, origin, box.extent, strict=True)
            )
            placed = tuple(slice(d, d + e) for d, e in zip(box.dst_start, box.extent, strict=True))
            self._outs[region][placed] = piece[source]


def _steps(
    stored: tuple[int, ...], boxes: list[tuple[int, Box]], shapes: list[tuple[int, ...]], item: int
) -> list[_Step]:
    """The steps reading `boxes` (region, box) of one block of shape `stored`: band by band of
    rows, the boxes of a band read together where they tile a box and would be short runs alone."""
    if len(stored) < 2 or len(boxes) < 2:
        return [_Direct(region, box) for region, box in boxes]
    cuts = sorted(
        {b.src_start[0] for _, b in boxes} | {b.src_start[0] + b.extent[0] for _, b in boxes}
    )
    steps: list[_Step] = []
    for top, bottom in itertools.pairwise(cuts):
        band = [
            (r, _rows(b, top, bottom))
            for r, b in boxes
            if b.src_start[0] <= top < b.src_start[0] + b.extent[0]
        ]
        if not band:  # rows no region here needs
            continue
        union = _tiled(band)
        worth = any(
            short_runs(b, stored, shapes[r], item) and not b.whole_rows(stored) for r, b in band
        )
        if union is None or len(band) < 2 or not worth:
            steps.extend(_Direct(r, b) for r, b in band)
            continue
        row_bytes = math.prod(union.extent[1:]) * item
        step = max(1, _PIECE_BYTES // row_bytes)
        for start in range(top, bottom, step):
            stop = min(start + step, bottom)
            rows = dataclasses.replace(_rows(union, start, stop), dst_start=union.dst_start)
            steps.append(_Piece(rows, [(r, _rows(b, start, stop)) for r, b in band]))
    return steps


def _rows(box: Box, start: int, stop: int) -> Box:
    """The part of `box` in rows [start, stop) of the block (which it must span)."""
    shift = start - box.src_start[0]
    return Box(
        extent=[stop - start, *box.extent[1:]],
        src_start=[start, *box.src_start[1:]],
        dst_start=[box.dst_start[0] + shift, *box.dst_start[1:]],
    )


def _tiled(band: list[tuple[int, Box]]) -> Box | None:
    """The box that the boxes of one band (the same rows) tile exactly, if they do."""
    first = band[0][1]
    lo = [min(b.src_start[d] for _, b in band) for d in range(len(first.extent))]
    hi = [max(b.src_start[d] + b.extent[d] for _, b in band) for d in range(len(first.extent))]
    if sum(math.prod(b.extent[1:]) for _, b in band) != math.prod(
        h - low for h, low in zip(hi[1:], lo[1:], strict=True)
    ):
        return None
    for (_, a), (_, b) in itertools.combinations(band, 2):
        if all(
            a.src_start[d] < b.src_start[d] + b.extent[d]
            and b.src_start[d] < a.src_start[d] + a.extent[d]
            for d in range(1, len(first.extent))
        ):
            return None  # overlapping boxes: not a tiling
    return Box(
        extent=[h - low for h, low in zip(hi, lo, strict=True)],
        src_start=lo,
        dst_start=[0] * len(lo),
    )


def _jobs(steps: list[_Step], item: int) -> list[list[_Step]]:
    """`steps` in consecutive groups of about `_JOB_BYTES` each."""
    groups: list[list[_Step]] = [[]]
    size = 0
    for step in steps:
        if size >= _JOB_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(step)
        box = step.union if isinstance(step, _Piece) else step.box
        size += math.prod(box.extent) * item
    return [group for group in groups if group]
