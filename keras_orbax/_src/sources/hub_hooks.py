"""What a keras-hub conversion hook does to a tensor, read off its jaxpr on an abstract array.

keras-hub's hooks are numpy code (`np.transpose`, `np.reshape`, `astype`) that also runs on a JAX
tracer. A chain of reshapes and transposes is always `source.reshape(view_shape)
.transpose(permutation).reshape(target_shape)` for one `view_shape` that only splits source axes,
which is what a sharded reader needs to map each target region back onto the file.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

_RESHAPES = ("reshape", "squeeze")
_NESTED = ("pjit", "jit", "closed_call")


class HookKind(enum.Enum):
    IDENTITY = "identity"  # no hook, or one that returns its input
    TRANSPOSE = "transpose"  # `np.transpose(x, permutation)`
    RESHAPE = "reshape"  # `np.reshape(x, target_shape)`
    REARRANGE = "rearrange"  # reshape(view_shape) -> transpose(permutation) -> reshape(target)
    OTHER = "other"  # anything else: arithmetic, concatenation, slicing, constants...


@dataclasses.dataclass(frozen=True)
class HookPlan:
    """A hook as data: `target = source.reshape(view_shape).transpose(permutation)
    .reshape(shape)`, then cast through `casts` (none for OTHER).

    Attributes:
        kind: The simplest description of the hook.
        shape: The hook's output shape (None if tracing failed).
        view_shape: The source seen with some axes split (size-1 axes dropped); None for OTHER.
        permutation: Axes of `view_shape` in target order; for TRANSPOSE, axes of the source.
        casts: The dtypes the hook converts to, in order (keras-hub's `astype` hooks).
        reason: For OTHER, what could not be expressed.
    """

    kind: HookKind
    shape: tuple[int, ...] | None = None
    view_shape: tuple[int, ...] | None = None
    permutation: tuple[int, ...] | None = None
    casts: tuple[np.dtype, ...] = ()
    reason: str = ""


class _NotStructural(Exception):
    pass


class _Atoms:
    """Source axes cut into atoms (contiguous factors); the current array's axes as atom lists."""

    def __init__(self, shape: Sequence[int]) -> None:
        self._ids = itertools.count()
        self.size: dict[int, int] = {}
        self.source = [[self._new(d)] if d != 1 else [] for d in shape]
        self.current = [list(axis) for axis in self.source]

    def _new(self, size: int) -> int:
        atom = next(self._ids)
        self.size[atom] = size
        return atom

    def _split(self, atom: int, outer: int) -> list[int]:
        parts = [self._new(outer), self._new(self.size[atom] // outer)]
        for axis in (*self.source, *self.current):
            if atom in axis:
                i = axis.index(atom)
                axis[i : i + 1] = parts
        return parts

    def reshape(self, shape: Sequence[int]) -> None:
        flat = [atom for axis in self.current for atom in axis]
        new: list[list[int]] = []
        i = 0
        for d in shape:
            axis: list[int] = []
            rest = d
            while rest > 1:
                if i >= len(flat):
                    raise _NotStructural(f"reshape to {tuple(shape)} does not fit")
                size = self.size[flat[i]]
                if rest % size == 0:
                    rest //= size
                elif size % rest == 0:
                    flat[i : i + 1] = self._split(flat[i], rest)
                    rest = 1
                else:
                    raise _NotStructural(f"reshape to {tuple(shape)} mixes axes")
                axis.append(flat[i])
                i += 1
            new.append(axis)
        self.current = new

    def transpose(self, permutation: Sequence[int]) -> None:
        self.current = [self.current[p] for p in permutation]


def _chain(jaxpr: Any) -> list[Any]:
    """The equations of a jaxpr that is a chain from its one input to its one output, nested
    `jit`s inlined; raises `_NotStructural` for anything else (constants, several operands)."""
    if len(jaxpr.invars) != 1 or len(jaxpr.outvars) != 1:
        raise _NotStructural("the hook has more than one input or output")
    current = jaxpr.invars[0]
    flat: list[Any] = []
    for eqn in jaxpr.eqns:
        if len(eqn.invars) != 1 or eqn.invars[0] is not current:
            raise _NotStructural(f"`{eqn.primitive.name}` does not apply to the tensor alone")
        if eqn.primitive.name in _NESTED:
            inner = eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr")
            flat.extend(_chain(getattr(inner, "jaxpr", inner)))
        else:
            flat.append(eqn)
        current = eqn.outvars[0]
    if jaxpr.outvars[0] is not current:
        raise _NotStructural("the hook's result does not come from its input")
    return flat


def _plan_from_jaxpr(jaxpr: Any, source_shape: tuple[int, ...]) -> HookPlan:
    atoms = _Atoms(source_shape)
    casts: list[np.dtype] = []
    for eqn in _chain(jaxpr):
        name = eqn.primitive.name
        if name == "transpose":
            atoms.transpose(eqn.params["permutation"])
        elif name in _RESHAPES:
            atoms.reshape(eqn.outvars[0].aval.shape)
        elif name == "convert_element_type":
            casts.append(np.dtype(eqn.params["new_dtype"]))
        elif name != "copy":
            raise _NotStructural(f"the hook computes `{name}`")
    shape = tuple(jaxpr.outvars[0].aval.shape)
    source_atoms = [a for axis in atoms.source for a in axis]
    target_atoms = [a for axis in atoms.current for a in axis]
    view_shape = tuple(atoms.size[a] for a in source_atoms)
    permutation = tuple(source_atoms.index(a) for a in target_atoms)
    if permutation == tuple(range(len(permutation))):
        kind = HookKind.IDENTITY if shape == source_shape else HookKind.RESHAPE
    elif all(len(axis) == 1 for axis in (*atoms.source, *atoms.current)):
        kind = HookKind.TRANSPOSE
    else:
        kind = HookKind.REARRANGE
    return HookPlan(kind, shape, view_shape, permutation, tuple(casts))


def classify(
    hook: Callable[[Any, list[int]], Any] | None,
    source_shape: Sequence[int],
    source_dtype: np.dtype,
    target_shape: Sequence[int],
) -> HookPlan:
    """Traces `hook(x, list(target_shape))` on an abstract `x` and describes it as a `HookPlan`."""
    source_shape = tuple(source_shape)
    if hook is None:
        view = tuple(d for d in source_shape if d != 1)
        return HookPlan(HookKind.IDENTITY, source_shape, view, tuple(range(len(view))))
    try:
        closed = jax.make_jaxpr(lambda x: hook(x, list(target_shape)))(
            jax.ShapeDtypeStruct(source_shape, source_dtype)
        )
    except Exception as e:  # e.g. `np.asarray` on the tracer: not a structural hook
        return HookPlan(HookKind.OTHER, reason=f"not traceable: {type(e).__name__}: {e}")
    try:
        return _plan_from_jaxpr(closed.jaxpr, source_shape)
    except _NotStructural as e:
        shape = tuple(closed.jaxpr.outvars[0].aval.shape)
        return HookPlan(HookKind.OTHER, shape=shape, reason=str(e))
