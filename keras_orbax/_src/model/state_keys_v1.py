"""The checkpoint keys of keras-orbax 0.1 (format_version 1), kept to read its checkpoints.

Version 2 keys follow Keras's own saving structure (`_keys`); a step written by 0.1 is read by keying
the model with this scheme, which is exactly what 0.1 wrote. Do not use it for new checkpoints.

A key names a variable by where it sits in the model, not by `variable.path`, because paths carry Keras's
global name counters (`dense_1`, `adam_1`, `seed_generator_3`) and change when the same model is built
twice in one process. Keys follow the structure `.weights.h5` uses: children by attribute name, list
members by class name, uniquified per list:

    model/layers/dense/kernel                 a layer's own variable, by its name
    model/layers/dropout/seed_generator/state  a seed generator's state
    optimizer/iteration                        an optimizer variable, by its name
    optimizer/model/layers/dense/kernel/momentum   a slot, by its reference variable's key
    metrics/loss/total                         a metric variable, by its path
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any, cast

import keras

from keras_orbax._src.compat import keras_compat
from keras_orbax._src.format.step_record import v1_role
from keras_orbax._src.model.state_keys import KeyedState, Role
from keras_orbax.errors import DuplicateKeyError

MODEL, OPTIMIZER, METRICS = "model", "optimizer", "metrics"


def keyed_state(
    model: keras.Model, *, optimizer: keras.optimizers.Optimizer | None = None
) -> KeyedState:
    """Every piece of `model`'s state by its 0.1 key, in a deterministic order.

    Includes the optimizer's variables if the model has one and they exist, and the metric variables.

    Raises:
        DuplicateKeyError: two different variables would share a key (e.g. a layer with two
            variables of the same name).
    """
    keys = _KeyTable()
    for key, variable in _walk_layers(model, MODEL, set()):
        keys.add(key, variable)
    for variable in model.variables:  # anything the structural walk did not reach
        keys.add_if_new(f"{MODEL}/unreached/{variable.path}", variable)
    optimizer = optimizer or getattr(model, "optimizer", None)
    if isinstance(optimizer, keras.optimizers.Optimizer):
        for key, variable in _optimizer_keys(optimizer, keys.key_of):
            keys.add(key, variable)
    for variable in model.metrics_variables:
        keys.add_if_new(f"{METRICS}/{variable.path}", variable)
    return KeyedState(keys.table, {key: cast(Role, v1_role(key)) for key in keys.table})


class _KeyTable:
    def __init__(self) -> None:
        self.table: dict[str, keras.Variable] = {}
        self.key_of: dict[int, str] = {}
        self._clashes: dict[str, list[str]] = {}

    def add(self, key: str, variable: keras.Variable) -> None:
        if id(variable) in self.key_of:
            return  # shared variable, already keyed
        if key in self.table:
            raise DuplicateKeyError(
                f"Two variables map to the checkpoint key '{key}': "
                f"'{self.table[key].path}' and '{variable.path}'. keras-orbax cannot tell them apart "
                "on restore. Give the variables distinct names within their layer. "
                f"Received: paths=['{self.table[key].path}', '{variable.path}']"
            )
        self.table[key] = variable
        self.key_of[id(variable)] = key

    def add_if_new(self, key: str, variable: keras.Variable) -> None:
        if id(variable) not in self.key_of:
            self.add(key, variable)


def _walk_layers(obj: Any, prefix: str, visited: set[int]) -> Iterator[tuple[str, keras.Variable]]:
    if id(obj) in visited:
        return
    visited.add(id(obj))
    if isinstance(obj, keras.Layer):
        for variable in keras_compat.own_variables(obj):
            yield f"{prefix}/{variable.name}", variable
        generators = keras_compat.seed_generators(obj)
        for i, generator in enumerate(generators):
            name = "seed_generator" if len(generators) == 1 else f"seed_generator_{i}"
            yield f"{prefix}/{name}/state", generator.state
    if isinstance(obj, keras.optimizers.Optimizer | keras.metrics.Metric):
        return  # keyed separately
    for attribute, child in keras_compat.walk_saveable(obj):
        if keras_compat.is_saveable(child):
            yield from _walk_layers(child, f"{prefix}/{attribute}", visited)
        elif isinstance(child, list | tuple | dict):
            yield from _walk_container(child, f"{prefix}/{attribute}", visited)


def _walk_container(
    container: list | tuple | dict, prefix: str, visited: set[int]
) -> Iterator[tuple[str, keras.Variable]]:
    if id(container) in visited:
        return
    visited.add(id(container))
    members = container.values() if isinstance(container, dict) else container
    used: dict[str, int] = {}
    for member in members:
        if keras_compat.is_saveable(member):
            name = _unique(_snake(type(member).__name__), used)
            yield from _walk_layers(member, f"{prefix}/{name}", visited)
        elif isinstance(member, list | tuple | dict):
            yield from _walk_container(member, prefix, visited)


def _optimizer_keys(
    optimizer: keras.optimizers.Optimizer, key_of: dict[int, str]
) -> Iterator[tuple[str, keras.Variable]]:
    # Slots are named f"{reference.path.replace('/', '_')}_{slot}" (Optimizer.add_variable_from_reference).
    references = {
        variable.path.replace("/", "_"): key_of[id(variable)]
        for variable in keras_compat.optimizer_variables_built_for(optimizer)
        if id(variable) in key_of
    }
    for variable in optimizer.variables:
        yield f"{OPTIMIZER}/{_slot_key(variable.name, references)}", variable


def _slot_key(name: str, references: dict[str, str]) -> str:
    best = max((ref for ref in references if name.startswith(ref + "_")), key=len, default=None)
    if best is None:
        return name
    return f"{references[best]}/{name[len(best) + 1 :]}"


def _snake(name: str) -> str:
    # 0.1's own snake case (`Conv2D` -> `conv2_d`), not Keras's: it is what 0.1 wrote.
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name.lstrip("_")).lower()


def _unique(name: str, used: dict[str, int]) -> str:
    if name not in used:
        used[name] = 0
        return name
    used[name] += 1
    return f"{name}_{used[name]}"
