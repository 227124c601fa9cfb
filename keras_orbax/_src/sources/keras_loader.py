"""Which stored array goes to which variable, exactly as Keras's own loader decides, without data.

Keras's `load_weights` walks the model (`saving_lib._load_state`) and each layer's
`load_own_variables` assigns what it takes from the file (quantized layers, EinsumDense, LoRA and
keras-hub layers each in their own way). That walk is run here on a store whose entries are traced
JAX placeholders, inside a `keras.StatelessScope` that collects every `assign` instead of doing it,
under `jax.make_jaxpr`. Each variable's update is then, in the traced program:
- a stored array itself (possibly cast): read its regions straight onto the devices;
- anything else (LoRA factors set to zeros, values Keras computes): evaluated on the host from the
  arrays it needs, one variable at a time, and each device gets its region.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import jax
import keras
import numpy as np

from keras_orbax._src.compat import keras_compat, loading_compat
from keras_orbax._src.model import keras_walk, state_keys
from keras_orbax._src.read.contiguous import ComputedArray

Reader = Any  # ContiguousArray | H5SliceArray | ComputedArray


@dataclasses.dataclass(frozen=True)
class Feed:
    """What one variable gets: `reader` gives its regions; `source` names it in the file."""

    reader: Reader
    source: str
    shape: tuple[int, ...]
    dtype: str


@dataclasses.dataclass(frozen=True)
class Traced:
    feeds: dict[str, Feed]  # by the variable's keras-orbax key
    consumed: set[str]  # stored arrays some variable takes
    problems: dict[str, str]  # what Keras's loader refused: one line per layer, by its group


def trace_load(
    model: keras.Model,
    arrays: Mapping[str, Reader],
    state: state_keys.KeyedState,
    optimizer: keras.optimizers.Optimizer | None = None,
    values: Mapping[str, Any] | None = None,
) -> Traced:
    """Runs Keras's own loading walk of `model` over `arrays` (by h5 path) without reading them.

    Args:
        model: The model to load into; nothing of it changes.
        arrays: The stored arrays by their path in the file.
        state: The model's keyed state (with `optimizer` as its optimizer, if given).
        optimizer: Walked in place of `model.optimizer` (a stand-in for one not built yet).
        values: Stored values that are no variable (`keras_walk.host_entries`), by h5 path,
            handed to the walk as they are: a layer may take them as NumPy arrays.
    """
    names = list(arrays)
    abstract = [jax.ShapeDtypeStruct(arrays[n].shape, arrays[n].dtype) for n in names]
    by_id = {id(v): key for key, v in state.variables.items()}
    errors: dict[int, tuple[Any, BaseException]] = {}
    assigned: list[str] = []

    def load(*placeholders: Any) -> list[Any]:
        entries = {**dict(zip(names, placeholders, strict=True)), **(values or {})}
        store = loading_compat.tracing_store(entries)
        with keras.StatelessScope(initialize_variables=False) as scope:
            loading_compat.load_state(model, store, errors, skip=optimizer and model.optimizer)
            if optimizer is not None:
                loading_compat.load_state(optimizer, store, errors, path="optimizer")
        updates = loading_compat.stateless_updates(scope)
        assigned.extend(by_id[i] for i in updates if i in by_id)
        return [updates[i] for i in updates if i in by_id]

    loading_compat.cache_walk_skipsets()
    walked = [obj for _, obj in state_keys.saveables(model)] + [optimizer]
    with warnings.catch_warnings(), _no_traced_attributes(walked):
        # The walk goes on past a layer that fails (its error is reported as a problem), and
        # Keras then blames the containers above it on an old file format: not so here.
        warnings.filterwarnings("ignore", message="Skipping nested container", category=UserWarning)
        closed = jax.make_jaxpr(load)(*abstract)
    feeds, consumed = _feeds(closed, names, arrays, assigned, state)
    groups = {id(obj): group for group, obj in state_keys.saveables(model)}
    if optimizer is not None:
        groups[id(optimizer)] = "optimizer"  # the stand-in is walked where model.optimizer is
    problems = {}
    for saveable, error in errors.values():
        group = groups.get(id(saveable), "?") or "<model>"
        name = getattr(saveable, "name", type(saveable).__name__)
        problems[group] = f"{group} (model: {name}): Keras cannot load it: {reason(error)}"
    return Traced(feeds, consumed, problems)


@contextlib.contextmanager
def _no_traced_attributes(objects: Iterable[Any]) -> Iterator[None]:
    """Puts back, after the traced walk, every attribute of `objects` that the walk set: a layer
    that derives state from its variables as it loads them (an adapted `Normalization`'s
    broadcast mean and variance, `finalize_state`) would otherwise keep a tracer, and fail at its
    next call, and one that takes a stored value (a NumPy table) would hold it before the restore
    has decided anything. The restore sets that state once it has assigned the variables
    (`keras_walk.replay` runs each layer's own loader)."""
    attributes = keras_walk.Attributes(objects)
    try:
        yield
    finally:
        attributes.put_back()


def _feeds(
    closed: Any,
    names: list[str],
    arrays: Mapping[str, Reader],
    keys: list[str],
    state: state_keys.KeyedState,
) -> tuple[dict[str, Feed], set[str]]:
    jaxpr = closed.jaxpr
    inputs = {var: i for i, var in enumerate(jaxpr.invars)}
    producers = {out: eqn for eqn in jaxpr.eqns for out in eqn.outvars}
    feeds, consumed = {}, set()
    for position, (key, out) in enumerate(zip(keys, jaxpr.outvars, strict=True)):
        variable = state.variables[key]
        source = _stored_source(out, inputs, producers)
        if source is not None:
            name = names[source]
            array = arrays[name]
            feeds[key] = Feed(array, name, tuple(array.shape), str(array.dtype))
            consumed.add(name)
            continue
        needed = loading_compat.inputs_of(jaxpr, position)
        consumed.update(names[i] for i in needed)
        shape = tuple(int(n) for n in variable.shape)
        dtype = keras_compat.stored_dtype(variable)
        compute = _host_computation(closed, position, needed, names, arrays)
        reader = ComputedArray(key, compute, shape, np.dtype(jax.numpy.dtype(dtype)))
        described = ", ".join(names[i] for i in needed) or "no stored array"
        feeds[key] = Feed(reader, f"computed by Keras's loader from {described}", shape, dtype)
    return feeds, consumed


def _stored_source(out: Any, inputs: dict[Any, int], producers: dict[Any, Any]) -> int | None:
    """The input that `out` is, through casts only; None if it is computed."""
    var = out
    while not loading_compat.is_literal(var) and var not in inputs:
        eqn = producers.get(var)
        if eqn is None or eqn.primitive.name != "convert_element_type":
            return None
        var = eqn.invars[0]
    return None if loading_compat.is_literal(var) else inputs[var]


def _host_computation(
    closed: Any, position: int, needed: list[int], names: list[str], arrays: Mapping[str, Reader]
) -> Callable[[], np.ndarray]:
    def compute() -> np.ndarray:
        stored = [arrays[names[i]] for i in needed]
        full = [a.read(tuple(slice(None) for _ in a.shape), a.dtype) for a in stored]
        with jax.default_device(jax.local_devices(backend="cpu")[0]):
            return np.asarray(loading_compat.evaluate_output(closed, position, full))

    return compute


# Keras's errors print the variable they concern, and with it every value it holds: dozens of
# lines per layer. A message names the variable by its path, shape and dtype instead, and any
# other long run of numbers in brackets (an array printed some other way) is cut.
_VARIABLE = re.compile(
    r"<Variable path=([^,>]*), shape=(\([^)]*\)), dtype=(\w+)(?:, value=[^>]*)?>"
)
_NUMBERS = re.compile(r"\[[-+\d.eEnaif,\s\[\]]*\d[-+\d.eEnaif,\s\[\]]*\]")
_REASON_CHARS = 300


def reason(error: BaseException) -> str:
    """Keras's error in one line, without the values of the variables it prints."""
    text = _VARIABLE.sub(r"\1 \2 \3", str(error))
    text = _NUMBERS.sub(lambda m: m[0] if len(m[0]) <= 40 else "[...]", text)
    text = " ".join(text.split())
    return text if len(text) <= _REASON_CHARS else text[: _REASON_CHARS - 3] + "..."
