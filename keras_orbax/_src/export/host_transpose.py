"""A transposed view copied into a C-contiguous buffer: in cache tiles, by several threads.

A plain `np.copyto(buffer, view.transpose(...))` walks the source a whole row apart for every
element it writes. Copied in tiles, both the tile's source lines and its destination lines stay in
the cache; and neighbours along the source's contiguous axis move together, 16 bytes at a time,
before they are spread apart within the tile (docs/benchmarks.md, "Exports"). Each thread copies a
slab of the buffer's leading axis (NumPy's copies release the GIL).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

Index = tuple[slice, ...]


def copy(
    to: np.ndarray,
    source: np.ndarray,
    run: Callable[[Callable[[Index], None], Sequence[Index]], Any],
    threads: int,
) -> None:
    """`np.copyto(to, source)` (`to` contiguous along its last axis, as a box of a C-contiguous
    buffer is; `source` of its shape, any strides), one slab per thread: `run(fn, slabs)` calls
    `fn` on every slab (`FileWindows.map`)."""
    if to.dtype.itemsize in (1, 2, 4, 8):
        # A copy moves bytes: NumPy's own loops for unsigned integers of the element's size,
        # not a custom dtype's (ml_dtypes' bfloat16 is copied element by element through its
        # own functions; docs/benchmarks.md, "Where the exports' time went").
        bytes_of = np.dtype(f"u{to.dtype.itemsize}")
        to, source = to.view(bytes_of), source.view(bytes_of)
    axis = next((a for a, n in enumerate(to.shape) if n > 1), 0)
    run(functools.partial(_copy_slab, to, source), _slabs(to.shape, axis, threads))


def _slabs(shape: tuple[int, ...], axis: int, count: int) -> list[Index]:
    """`shape` cut along `axis` into at most `count` slabs of about equal size."""
    n = shape[axis] if shape else 1
    bounds = sorted({round(i * n / count) for i in range(count + 1)})
    head = tuple(slice(None) for _ in range(axis))
    return [(*head, slice(a, b)) for a, b in itertools.pairwise(bounds) if b > a]


def _copy_slab(to: np.ndarray, source: np.ndarray, slab: Index) -> None:
    _tiled_copy(to[slab], source[slab])


# A transposed copy moves 16 bytes per element: a narrower element's neighbours along the source's
# contiguous axis travel together as one `V16` (NumPy's loops cost about the same per element
# whatever its size), and are spread back apart inside a tile that is still in the cache. Tiles
# of 64 x 512 wide elements; 16 x 1024 for the narrow copy of what is left over (taller ones lose
# to the cache's associativity where rows are a power of two apart). docs/benchmarks.md, "Where the
# exports' time went".
_WIDE_BYTES = 16
_TILE_WIDE, _TILE_ACROSS = 64, 512
_TILE_STRIDED, _TILE_CONTIGUOUS = 16, 1024


def _tiled_copy(to: np.ndarray, source: np.ndarray) -> None:
    """`np.copyto(to, source)` for `to` contiguous along its last axis and a transposed view
    `source`, in tiles along `to`'s last axis and the source's innermost one."""
    if to.ndim < 2 or to.size < _TILE_STRIDED * _TILE_CONTIGUOUS * 4:
        np.copyto(to, source)
        return
    last = to.ndim - 1
    strides = [
        abs(st) if n > 1 else np.inf for st, n in zip(source.strides, source.shape, strict=True)
    ]
    inner = int(np.argmin(strides))
    if inner == last:
        np.copyto(to, source)
        return
    together = max(1, _WIDE_BYTES // to.dtype.itemsize)
    head = to.shape[inner] // together * together
    if together > 1 and head and source.strides[inner] == to.dtype.itemsize:
        _wide_copy(_cut(to, inner, 0, head), _cut(source, inner, 0, head), inner, together)
        to, source = _cut(to, inner, head, to.shape[inner]), _cut(source, inner, head, None)
    _narrow_copy(to, source, inner)


def _cut(array: np.ndarray, axis: int, start: int, stop: int | None) -> np.ndarray:
    return array[(slice(None),) * axis + (slice(start, stop),)]


def _wide_copy(to: np.ndarray, source: np.ndarray, inner: int, together: int) -> None:
    """`_tiled_copy` where `source` is contiguous along `inner` and `together` elements of it
    make 16 bytes: those move as one `V16`, then are spread along `to`'s `inner` axis, a tile
    at a time."""
    last = to.ndim - 1
    memory_order = [*(a for a in range(to.ndim) if a != inner), inner]
    wide = source.transpose(memory_order).view(f"V{_WIDE_BYTES}")
    wide = wide.transpose(np.argsort(memory_order))  # `source`'s axes, `inner` / together
    # `to` with `inner` split into (its wide elements, `together`): a view of `to`
    split = np.lib.stride_tricks.as_strided(
        to,
        (*to.shape[:inner], to.shape[inner] // together, together, *to.shape[inner + 1 :]),
        (*to.strides[:inner], to.strides[inner] * together, *to.strides[inner:]),
    )
    # A tile, held in a scratch buffer of at most an eighth of what this call copies (the
    # exports' window bounds their memory: a small window's slabs get smaller tiles).
    across = min(_TILE_ACROSS, wide.shape[last])
    steps = [1] * to.ndim
    steps[inner] = max(1, min(_TILE_WIDE, wide.size // 8 // across))
    steps[last] = across
    scratch = np.empty(steps[inner] * across, wide.dtype)
    for tile in _tiles(wide.shape, steps):
        part = wide[tile]
        held = scratch[: part.size].reshape(part.shape)
        np.copyto(held, part)
        # each wide element back to its `together` elements, along `inner`
        spread = held.view(to.dtype).reshape(*part.shape, together)
        np.copyto(
            split[(*tile[: inner + 1], slice(None), *tile[inner + 1 :])],
            np.moveaxis(spread, -1, inner + 1),
        )


def _narrow_copy(to: np.ndarray, source: np.ndarray, inner: int) -> None:
    """`_tiled_copy` an element at a time, in tiles of 16 x 1024."""
    last = to.ndim - 1
    steps = [1] * to.ndim
    steps[last], steps[inner] = _TILE_STRIDED, _TILE_CONTIGUOUS
    for tile in _tiles(to.shape, steps):
        np.copyto(to[tile], source[tile])


def _tiles(shape: tuple[int, ...], steps: list[int]) -> Iterator[Index]:
    """Every tile of `shape`, `steps[axis]` long along each axis (shorter at the far edges)."""
    starts = [range(0, n, step) for n, step in zip(shape, steps, strict=True)]
    for corner in itertools.product(*starts):
        yield tuple(slice(c, c + step) for c, step in zip(corner, steps, strict=True))
