"""A transposed view copied into a C-contiguous buffer: in cache tiles, by several threads.

A plain `np.copyto(buffer, view.transpose(...))` walks the source a whole row apart for every
element it writes; copied in tiles of 16 strided x 1024 contiguous elements, both the tile's source
lines and its destination lines stay in the cache (4-7 x faster here; docs/benchmarks.md,
"Exports"). Each thread copies a slab of the buffer's leading axis (NumPy's copies release the GIL).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

Index = tuple[slice, ...]


def copy(
    to: np.ndarray,
    source: np.ndarray,
    run: Callable[[Callable[[Index], None], Sequence[Index]], Any],
    threads: int,
) -> None:
    """`np.copyto(to, source)` (`to` C-contiguous, `source` of its shape, any strides), one slab
    per thread: `run(fn, slabs)` calls `fn` on every slab (`FileWindows.map`)."""
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


# A transposed copy reads 16 rows of 1024 contiguous elements of the source at a time: both the
# tile's source lines and its destination lines stay in the cache (a plain `copyto` walks the
# source a whole stride apart per element). Taller tiles lose to the cache's associativity where
# the rows are a power of two apart (docs/benchmarks.md, "Where the exports' time went").
_TILE_STRIDED, _TILE_CONTIGUOUS = 16, 1024


def _tiled_copy(to: np.ndarray, source: np.ndarray) -> None:
    """`np.copyto(to, source)` for a C-contiguous `to` and a transposed view `source`, in tiles
    along `to`'s last axis and the source's innermost one."""
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
    steps = [1] * to.ndim
    steps[last], steps[inner] = _TILE_STRIDED, _TILE_CONTIGUOUS
    starts = [range(0, n, step) for n, step in zip(to.shape, steps, strict=True)]
    for corner in itertools.product(*starts):
        tile = tuple(slice(c, c + step) for c, step in zip(corner, steps, strict=True))
        np.copyto(to[tile], source[tile])
