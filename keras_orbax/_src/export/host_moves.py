"""A chain of traced operations that only move bytes, replayed on a host array with NumPy.

Transposes, reshapes (those that split an axis too), squeezes, added size-1 axes, static slices,
reversals and same-dtype conversions change no value: NumPy's result is the same bits as XLA's,
however either lays them out. keras-hub's Gemma exporter builds its query projections with a
reshape that splits axes where `hidden_dim != heads * head_dim` (Gemma2 9B), and its key and value
projections with a slice (the first head): no rearrangement of the variable's blocks
(`hub_tensors.Rearranged`), but such a chain. Replayed on the host (`replay`), the tensor exists
once; computed by XLA on CPU devices, its result was replicated on every device.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

# The primitives whose result is their operand's value, unchanged.
_NO_OPS = ("copy", "copy_p")


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
        elif name not in _NO_OPS:
            return None
    return tuple(moves)


def replay(array: np.ndarray, moves: Sequence[Move]) -> np.ndarray:
    """`array` moved as `moves` say: views where NumPy can (a transpose, a slice), a copy where
    it cannot (a reshape of a transposed view). Each earlier array is dropped as soon as the
    next no longer views it, so at most two exist at a time."""
    for move in moves:
        if move.kind == "transpose":
            array = array.transpose(move.argument)
        elif move.kind == "reshape":
            array = array.reshape(move.argument)
        elif move.kind == "slice":
            array = array[move.argument]
        else:
            array = np.flip(array, move.argument)
    return array
