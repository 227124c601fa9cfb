"""Each Hugging Face tensor of a keras-hub backbone, as keras-hub's own exporter computes it.

keras-hub's per-model `get_*_weights_map(backbone)` computes every Hugging Face tensor from Keras
variables with `keras.ops` (transposes, reshapes, a LoRA kernel's merge), all at once, and its
writer then fetches each whole to the host. Here the same function is traced once, abstractly, with
the variables' values as inputs (a `keras.StatelessScope`); the trace says, per tensor, which
variables it reads and how:

- a chain of transposes and reshapes that only merge or drop axes of one variable (almost every
  tensor): the tensor's C-order bytes are `variable.squeeze().transpose(permutation)`'s, so each
  host block of the variable's shards is transposed on the host and written where it belongs;
- any other chain of one variable that only moves bytes (a reshape that splits an axis, a static
  slice: keras-hub's Gemma query, key and value projections): the variable is fetched to one host
  array and the chain replayed on it with NumPy (`host_moves`), where both fit the window;
- anything else (a LoRA merge), or a moved tensor too large for the window: the traced
  operations run on the devices, one at a time as keras-hub's eager `keras.ops` do (so the values
  are the same bits), and the result's shards are written. Only that one tensor exists beside the
  model, placed as the operations place it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import keras
import numpy as np
from jax.extend import core as jax_core

from keras_orbax._src.compat import keras_compat
from keras_orbax._src.export import host_moves

_SHAPE_ONLY = ("reshape", "squeeze", "expand_dims")
_NESTED = ("jit", "pjit", "closed_call")


@dataclasses.dataclass(frozen=True)
class Rearranged:
    """The tensor is `variable.value` with size-1 axes dropped, then transposed by `permutation`
    (whose C order is the tensor's)."""

    variable: keras.Variable
    permutation: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Computed:
    """The tensor is `compute()`, a `jax.Array` on the devices (keras-hub's operations, in order)."""

    compute: Callable[[], jax.Array]
    reason: str


@dataclasses.dataclass(frozen=True)
class Moved:
    """The tensor is `host_moves.replay(variable's value, moves)`: its bytes moved, no value
    changed. `computed` gives the same tensor on the devices, where the variable and the tensor
    do not fit the host window together."""

    variable: keras.Variable
    moves: tuple[host_moves.Move, ...]
    computed: Computed


Source = Rearranged | Moved | Computed


@dataclasses.dataclass(frozen=True)
class HubTensor:
    """One tensor of the export: its name, shape, dtype and how to obtain it."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    source: Source


def trace_tensors(
    weights_map: Callable[[], dict[str, Any]],
    variables: Sequence[keras.Variable],
    lora: Sequence[keras_compat.LoraMerge] = (),
) -> list[HubTensor]:
    """Traces `weights_map()` (keras-hub's exporter for one backbone) over `variables`.

    Args:
        weights_map: Returns `{hf_name: keras.Variable or tensor}`, as keras-hub's
            `get_*_weights_map(backbone, include_lm_head=...)` does.
        variables: Every variable it may read (the backbone's, LoRA factors included).
        lora: The LoRA layers among them, merged before `weights_map` reads them: it sees each
            frozen variable holding the merged tensor and zero factors, so an exporter that
            reads the variable (`weights[0]`) and one that reads the layer's merging property
            both get the merged tensor, once.
    """
    variables = list(variables)

    def traced(values: list[jax.Array]) -> dict[str, jax.Array]:
        state = list(zip(variables, values, strict=True))
        if lora:
            state = _merged_state(state, lora)
        with keras.StatelessScope(state_mapping=state):
            mapped = weights_map()
            return {
                name: (v.value if isinstance(v, keras.Variable) else keras.ops.convert_to_tensor(v))
                for name, v in mapped.items()
            }

    abstract = [jax.ShapeDtypeStruct(v.shape, v.value.dtype) for v in variables]
    closed, shapes = jax.make_jaxpr(traced, return_shape=True)(abstract)
    names = list(jax.tree_util.tree_flatten_with_path(shapes)[0])
    jaxpr = closed.jaxpr
    arg_of = {var: i for i, var in enumerate(jaxpr.invars)}
    producer = {out: eqn for eqn in jaxpr.eqns for out in eqn.outvars}
    tensors = []
    for (path, shape), out in zip(names, jaxpr.outvars, strict=True):
        name = path[0].key
        chain = _chain_to_input(out, producer, arg_of)
        plan = None if chain is None else _rearrangement(*chain)
        source: Source
        if plan is not None and chain is not None:
            source = Rearranged(variables[arg_of[chain[0]]], plan)
        else:
            needed = _needed(out, producer, jaxpr.eqns)
            source = Computed(
                _evaluator(closed, needed, out, variables), "not a rearrangement of one variable"
            )
            flat = None if chain is None else _flat(chain[1])
            moves = None if flat is None else host_moves.moves_of(flat)
            if moves is not None and chain is not None:
                source = Moved(variables[arg_of[chain[0]]], moves, source)
        tensors.append(HubTensor(name, tuple(shape.shape), np.dtype(shape.dtype), source))
    return tensors


def _merged_state(
    state: list[tuple[keras.Variable, Any]], lora: Sequence[keras_compat.LoraMerge]
) -> list[tuple[keras.Variable, Any]]:
    """`state` with each LoRA layer's frozen variable holding its merged tensor (the layer's own
    merge of `state`'s values) and its factors holding zeros."""
    with keras.StatelessScope(state_mapping=state):
        merged = {id(m.frozen): m.merged() for m in lora}
    zeros = {id(f) for m in lora for f in m.factors}
    replaced = []
    for variable, value in state:
        if id(variable) in merged:
            value = merged[id(variable)]
        elif id(variable) in zeros:
            value = keras.ops.zeros_like(value)
        replaced.append((variable, value))
    return replaced


def _chain_to_input(out: Any, producer: dict, arg_of: dict) -> tuple[Any, list[Any]] | None:
    """(input variable, equations in order) if `out` comes from one input through equations of one
    operand each; else None."""
    eqns = []
    var = out
    while var not in arg_of:
        eqn = producer.get(var)
        if eqn is None or len(eqn.invars) != 1 or len(eqn.outvars) != 1:
            return None
        eqns.append(eqn)
        var = eqn.invars[0]
        if isinstance(var, jax_core.Literal):
            return None
    return var, eqns[::-1]


def _flat(eqns: list[Any]) -> list[Any] | None:
    """`eqns` with nested `jit`s inlined (each must be a one-operand chain itself)."""
    flat = []
    for eqn in eqns:
        if eqn.primitive.name in _NESTED:
            inner = eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr")
            inner = getattr(inner, "jaxpr", inner)
            arg_of = {inner.invars[0]: 0} if len(inner.invars) == 1 else {}
            producer = {o: e for e in inner.eqns for o in e.outvars}
            chain = _chain_to_input(inner.outvars[0], producer, arg_of) if arg_of else None
            sub = None if chain is None else _flat(chain[1])
            if sub is None:
                return None
            flat.extend(sub)
        else:
            flat.append(eqn)
    return flat


def _rearrangement(source: Any, eqns: list[Any]) -> tuple[int, ...] | None:
    """The permutation of `source`'s non-1 axes that the chain amounts to, if it only transposes
    and merges or drops axes (never splits one, never changes a value or its dtype)."""
    flat = _flat(eqns)
    if flat is None:
        return None
    atoms = {i: n for i, n in enumerate(source.aval.shape) if n != 1}
    axes: list[list[int]] = [[i] if n != 1 else [] for i, n in enumerate(source.aval.shape)]
    for eqn in flat:
        name = eqn.primitive.name
        if name == "transpose":
            axes = [axes[p] for p in eqn.params["permutation"]]
        elif name in _SHAPE_ONLY:
            merged = _merge([a for axis in axes for a in axis], atoms, eqn.outvars[0].aval.shape)
            if merged is None:
                return None
            axes = merged
        elif name == "convert_element_type" and eqn.params["new_dtype"] == eqn.invars[0].aval.dtype:
            continue
        elif name not in host_moves.NO_OPS:
            return None
    order = [a for axis in axes for a in axis]
    source_atoms = sorted(atoms)
    return tuple(source_atoms.index(a) for a in order)


def _merge(flat: list[int], atoms: dict[int, int], shape: Sequence[int]) -> list[list[int]] | None:
    """Groups consecutive atoms into the axes of `shape`; None if an axis would split an atom."""
    axes, i = [], 0
    for n in shape:
        axis: list[int] = []
        while math.prod(atoms[a] for a in axis) < n and i < len(flat):
            axis.append(flat[i])
            i += 1
        if math.prod(atoms[a] for a in axis) != n:
            return None
        axes.append(axis)
    return axes if i == len(flat) else None


def _needed(out: Any, producer: dict, eqns: list[Any]) -> list[Any]:
    """The equations `out` depends on, in their order in the trace."""
    seen: set[int] = set()
    stack = [out]
    while stack:
        eqn = producer.get(stack.pop())
        if eqn is None or id(eqn) in seen:
            continue
        seen.add(id(eqn))
        stack.extend(v for v in eqn.invars if not isinstance(v, jax_core.Literal))
    return [eqn for eqn in eqns if id(eqn) in seen]


def _evaluator(
    closed: Any, eqns: list[Any], out: Any, variables: list[keras.Variable]
) -> Callable[[], jax.Array]:
    """Runs `eqns` on the variables' current values, one primitive at a time (as eager
    `keras.ops` do), and returns `out`'s value."""

    jaxpr = closed.jaxpr
    sub = jax_core.Jaxpr(jaxpr.constvars, jaxpr.invars, [out], eqns, debug_info=jaxpr.debug_info)

    def compute() -> jax.Array:
        values = [v.value for v in variables]
        (result,) = jax.core.eval_jaxpr(sub, closed.consts, *values)
        return jax.numpy.asarray(result)

    return compute
