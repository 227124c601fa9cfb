"""A chain of traced operations that only move bytes, replayed on a host array with NumPy.

Transposes, reshapes (those that split an axis too), squeezes, added size-1 axes, static slices,
reversals and same-dtype conversions change no value: NumPy's result is the same bits as XLA's,
however either lays them out. keras-hub's Gemma exporter builds its query projections with a
reshape that splits axes where `hidden_dim != heads * head_dim` (Gemma2 9B), and its key and value
projections with a slice (the first head): no rearrangement of the variable's blocks
(`hub_tensors.Rearranged`), but such a chain. Moved on the host (`on_host`), the tensor exists
once; computed by XLA on CPU devices, its result was replicated on every device.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import numpy as np

from keras_orbax._src.export import regions

# The primitives whose result is their operand's value, unchanged.
NO_OPS = ("copy", "copy_p")


@dataclasses.dataclass(frozen=True)
class Move:
    """One operation as NumPy replays it: `transpose` (a permutation), `reshape` (the shape, C
    order), `slice` (a tuple of slices) or `flip` (the axes reversed)."""

    kind: Literal["transpose", "reshape", "slice", "flip"]
    argument: tuple[Any, ...]


def moves_of(eqns: Sequence[Any]) -> tuple[Move, ...] | None:
    """`eqns` (one-operand equations, in order, nested calls inlined) as moves; None if one of
    them may change a value or its dtype."""
    moves: list[Move] = []
    for eqn in eqns:
        name, params = eqn.primitive.name, eqn.params
        operand, result = eqn.invars[0].aval, eqn.outvars[0].aval
        if name == "transpose":
            moves.append(Move("transpose", tuple(params["permutation"])))
        elif name == "reshape":
            if params.get("dimensions") is not None:
                moves.append(Move("transpose", tuple(params["dimensions"])))
            moves.append(Move("reshape", tuple(result.shape)))
        elif name in ("squeeze", "expand_dims") or (
            name == "broadcast_in_dim" and math.prod(result.shape) == math.prod(operand.shape)
        ):  # only size-1 axes dropped or added: a reshape
            moves.append(Move("reshape", tuple(result.shape)))
        elif name == "slice":
            strides = params.get("strides") or (1,) * len(operand.shape)
            bounds = zip(params["start_indices"], params["limit_indices"], strides, strict=True)
            moves.append(Move("slice", tuple(slice(a, b, s) for a, b, s in bounds)))
        elif name == "rev":
            moves.append(Move("flip", tuple(params["dimensions"])))
        elif name == "convert_element_type" and params["new_dtype"] == operand.dtype:
            continue
        elif name not in NO_OPS:
            return None
    return tuple(moves)


def fetch(
    value: jax.Array,
    moves: Sequence[Move],
    window_bytes: int,
    run: Callable[[Callable[[regions.Region], None], Sequence[regions.Region]], Any],
) -> tuple[np.ndarray, tuple[Move, ...]]:
    """`value` on the host as `moves` begin with it, and the moves left to replay on that.

    Leading slices (step 1) are applied while fetching: only the shards' parts they keep are
    copied. Leading transposes too: the host array is allocated in their order, so a reshape after
    them is a view, not a second copy. Shards in host memory are copied by `run(fn, regions)`
    (`FileWindows.copy`: on several threads); others are fetched a window at a time.
    """
    moves = list(moves)
    box = tuple(slice(0, n) for n in value.shape)
    while (
        moves and moves[0].kind == "slice" and all(s.step in (None, 1) for s in moves[0].argument)
    ):
        box = tuple(
            slice(b.start + s.start, b.start + s.stop)
            for b, s in zip(box, moves.pop(0).argument, strict=True)
        )
    order = tuple(range(value.ndim))
    while moves and moves[0].kind == "transpose":
        order = tuple(order[p] for p in moves.pop(0).argument)
    extent = [b.stop - b.start for b in box]
    host = np.empty([extent[axis] for axis in order], value.dtype)
    target = host.transpose(np.argsort(order))  # the variable's axes, as `box` cuts them

    def place(region: regions.Region) -> None:
        common = [
            (max(b.start, i.start), min(b.stop, i.stop))
            for b, i in zip(box, region.index, strict=True)
        ]
        if any(lo >= hi for lo, hi in common):
            return
        to = tuple(
            slice(lo - b.start, hi - b.start) for (lo, hi), b in zip(common, box, strict=True)
        )
        part = tuple(
            slice(lo - i.start, hi - i.start)
            for (lo, hi), i in zip(common, region.index, strict=True)
        )
        target[to] = region.block[part]

    shards = [
        shard
        for shard in regions.distinct_shards(value)
        if all(
            s.start < b.stop and b.start < s.stop
            for s, b in zip(regions.normalized(shard.index, value.shape), box, strict=True)
        )
    ]
    if regions.on_host(value):  # each shard's own buffer: copied on several threads
        run(place, list(regions.shard_regions(value, shards, window_bytes, whole=True)))
    else:
        for region in regions.shard_regions(value, shards, window_bytes):
            place(region)
    return host, tuple(moves)


def on_host(
    value: jax.Array,
    moves: Sequence[Move],
    window_bytes: int,
    run: Callable[[Callable[[regions.Region], None], Sequence[regions.Region]], Any],
) -> np.ndarray:
    """`value` moved as `moves` say, on the host: `fetch`, then the moves left replayed. The
    fetched array is dropped as soon as the result no longer views it: at most the fetched part
    and one copy of the tensor exist at a time."""
    array, rest = fetch(value, moves, window_bytes, run)
    for move in rest:
        array = _moved(array, move)
    return array


def replay(array: np.ndarray, moves: Sequence[Move]) -> np.ndarray:
    """`array` moved as `moves` say: views where NumPy can (a transpose, a slice), a copy where
    it cannot (a reshape of a transposed view)."""
    for move in moves:
        array = _moved(array, move)
    return array


def _moved(array: np.ndarray, move: Move) -> np.ndarray:
    if move.kind == "transpose":
        return array.transpose(move.argument)
    if move.kind == "reshape":
        return array.reshape(move.argument)
    if move.kind == "slice":
        return array[move.argument]
    return np.flip(array, move.argument)
