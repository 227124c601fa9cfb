"""Model state <-> stable checkpoint keys, in Keras's own saving structure.

A key names a variable by where Keras's `.weights.h5` saving puts it, not by `variable.path`, because
paths carry Keras's global name counters (`dense_1`, `adam_1`, `seed_generator_3`) and change when
the same model is built twice in one process. Groups are the ones `save_weights` writes (Keras's own
walk, snake-cased class names uniquified per container, nested containers as `container`), and a
variable is `vars/<i>` by its position in the layer's own variables, as `Layer.save_own_variables`
numbers them:

    layers/dense/vars/0                       a layer's variable (its kernel)
    layers/lstm/cell/vars/1                   a nested layer's, under its attribute name
    optimizer/vars/7                          an optimizer variable, in `optimizer.variables` order
    layers/dropout/seed_generators/0          a seed generator's state (not in `.weights.h5`)
    metrics/loss/total                        a metric variable, by its path (not in `.weights.h5`)

Each key also has a role (`model`, `optimizer` or `metric`), which decides how strictly it is matched.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable, Iterator, Mapping
from typing import Any

import keras

from keras_orbax._src.compat import keras_compat
from keras_orbax._src.format.step_record import METRIC, MODEL, OPTIMIZER, Role
from keras_orbax.errors import DuplicateKeyError


@dataclasses.dataclass(frozen=True)
class KeyedState:
    """A model's state by key, in a deterministic order, with each key's role."""

    variables: dict[str, keras.Variable]
    roles: dict[str, Role]
    # A group reached again under other attribute names (a property returning a layer): those
    # paths, where Keras's loader also looks for its state.
    aliases: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    # `(group, object)` of every object Keras's saving walks, in its order (`saveables`).
    objects: tuple[tuple[str, Any], ...] = ()

    def of_role(self, *roles: Role) -> dict[str, keras.Variable]:
        return {k: v for k, v in self.variables.items() if self.roles[k] in roles}

    def resolved(self, saved: Collection[str]) -> KeyedState:
        """This state with each key that `saved` lacks replaced by an alias `saved` holds, as
        Keras's loader resolves attributes: a layer saved as `self.dense` is restored into a
        model holding it as `self.a_dense` with a `dense` property returning it (Keras visits
        `a_dense` first, finds nothing there, and loads it at `dense`). Unchanged where that
        would give two variables one key."""
        renamed = {
            key: key if key in saved else self._alias_in(key, saved) for key in self.variables
        }
        if renamed == {k: k for k in renamed} or len(set(renamed.values())) < len(renamed):
            return self
        return KeyedState(
            {renamed[k]: v for k, v in self.variables.items()},
            {renamed[k]: r for k, r in self.roles.items()},
            self.aliases,
            self.objects,
        )

    def _alias_in(self, key: str, saved: Collection[str]) -> str:
        for group, others in self.aliases.items():
            if key.startswith(f"{group}/"):
                for other in others:
                    alias = other + key[len(group) :]
                    if alias in saved and alias not in self.variables:
                        return alias
        return key


def keyed_state(
    model: keras.Model, *, optimizer: keras.optimizers.Optimizer | None = None
) -> KeyedState:
    """Every piece of `model`'s state by key: its weights, its optimizer's variables (as far as they
    exist), seed-generator states and metric variables.

    Args:
        model: The model.
        optimizer: Keyed in place of `model.optimizer` (a stand-in for one not built yet).

    Raises:
        DuplicateKeyError: two different variables would share a key.
    """
    table = _KeyTable()
    replace = {}
    if optimizer is not None:
        replace[id(model.optimizer)] = optimizer
    else:
        optimizer = getattr(model, "optimizer", None)
    optimizer_ids = (
        {id(v) for v in optimizer.variables}
        if isinstance(optimizer, keras.optimizers.Optimizer)
        else set()
    )
    aliases: dict[str, list[str]] = {}
    objects = tuple(_walk(model, "", {}, replace, aliases))
    for group, saveable in objects:
        for i, variable in enumerate(_own_variables(saveable)):
            role: Role = OPTIMIZER if id(variable) in optimizer_ids else MODEL
            table.add(_join(group, f"vars/{i}"), variable, role)
        if isinstance(saveable, keras.Layer):
            for i, generator in enumerate(keras_compat.seed_generators(saveable)):
                table.add(_join(group, f"seed_generators/{i}"), generator.state, MODEL)
    for variable in model.variables:  # anything Keras's walk does not reach
        table.add_if_new(f"unreached/{variable.path}", variable, MODEL)
    for variable in model.metrics_variables:
        table.add_if_new(f"metrics/{variable.path}", variable, METRIC)
    return KeyedState(
        table.variables,
        table.roles,
        {group: tuple(a) for group, a in aliases.items() if group},
        objects,
    )


def keyed_variables(model: keras.Model) -> dict[str, keras.Variable]:
    """`keyed_state(model).variables`."""
    return keyed_state(model).variables


def saveables(obj: Any) -> Iterator[tuple[str, Any]]:
    """`(group, object)` for each Keras object holding state, in the order and under the names
    that Keras's `save_weights` gives them (`saving_lib._save_state`)."""
    yield from _walk(obj, "", {}, {})


def _walk(
    obj: Any,
    path: str,
    visited: dict[int, str],
    replace: dict[int, Any],
    aliases: dict[str, list[str]] | None = None,
) -> Iterator[tuple[str, Any]]:
    """Keras's saving walk from `obj` at `path`; an object met again is not walked again, and
    its path is added to `aliases` under the path it was first met at."""
    obj = replace.get(id(obj), obj)
    if id(obj) in visited:
        if aliases is not None:
            aliases.setdefault(visited[id(obj)], []).append(path)
        return
    visited[id(obj)] = path
    yield path, obj
    for attribute, child in keras_compat.walk_saveable(obj):
        if keras_compat.is_saveable(child):
            yield from _walk(child, _join(path, attribute), visited, replace, aliases)
        elif isinstance(child, list | tuple | dict):
            yield from _walk_container(
                child, _join(path, attribute), visited, replace, set(), aliases
            )


def _walk_container(
    container: list | tuple | dict,
    path: str,
    visited: dict[int, str],
    replace: dict[int, Any],
    containers: set[int],
    aliases: dict[str, list[str]] | None = None,
) -> Iterator[tuple[str, Any]]:
    if id(container) in containers:
        return
    containers.add(id(container))
    used: dict[str, int] = {}
    for member in container.values() if isinstance(container, dict) else container:
        if keras_compat.is_saveable(member):
            name = keras_compat.unique_name(keras_compat.to_snake_case(type(member).__name__), used)
            yield from _walk(member, _join(path, name), visited, replace, aliases)
        elif isinstance(member, list | tuple | dict):
            name = keras_compat.unique_name("container", used)
            yield from _walk_container(
                member, _join(path, name), visited, replace, containers, aliases
            )


def _own_variables(saveable: Any) -> list[keras.Variable]:
    """What Keras's default `save_own_variables` numbers `vars/<i>`: a layer's own variables, an
    optimizer's `variables` (a LossScaleOptimizer's include its inner optimizer's)."""
    if isinstance(saveable, keras.Layer):
        return _in_float8_order(saveable, keras_compat.own_variables(saveable))
    if isinstance(saveable, keras.optimizers.Optimizer):
        return list(saveable.variables)
    return []


def _in_float8_order(layer: keras.Layer, variables: list[keras.Variable]) -> list[keras.Variable]:
    """A float8-quantized layer's variables in the order of Keras's `save_own_variables` (its
    `variable_serialization_spec`), others as created. Keras creates a float8 layer's variables
    in that order when `quantize("float8")` converts it, but its scales first when it is built
    under a float8 dtype policy (from its config, as `load_model` builds it): numbered as created,
    the two would not restore into each other. In every other mode both are created alike, and
    numbered as created (so keys of existing checkpoints stay as they were)."""
    if getattr(layer, "quantization_mode", None) != "float8":
        return variables
    spec = getattr(layer, "variable_serialization_spec", {}).get("float8", [])
    ordered: list[keras.Variable] = []
    for name in spec:  # `kernel` is a property over the `_kernel` variable
        for attribute in (f"_{name}", name):
            found = getattr(layer, attribute, None)
            if any(found is v for v in variables) and not any(found is o for o in ordered):
                ordered.append(found)
                break
    return ordered + [v for v in variables if not any(v is o for o in ordered)]


def _advice(role: Role) -> str:
    if role == METRIC:  # metric variables are keyed by path: two metrics of one class collide
        return ": give each metric a unique name (for example MeanAbsoluteError(name='mae_out'))"
    return ""


def _join(group: str, name: str) -> str:
    return f"{group}/{name}" if group else name


class _KeyTable:
    def __init__(self) -> None:
        self.variables: dict[str, keras.Variable] = {}
        self.roles: dict[str, Role] = {}
        self._keys: dict[int, str] = {}

    def add(self, key: str, variable: keras.Variable, role: Role) -> None:
        if id(variable) in self._keys:
            return  # shared variable (or a LossScaleOptimizer's inner one), already keyed
        if key in self.variables:
            raise DuplicateKeyError(
                f"Two variables map to the checkpoint key '{key}': "
                f"'{self.variables[key].path}' and '{variable.path}'. keras-orbax cannot tell them "
                f"apart on restore{_advice(role)}. "
                f"Received: paths=['{self.variables[key].path}', '{variable.path}']"
            )
        self.variables[key] = variable
        self.roles[key] = role
        self._keys[id(variable)] = key

    def add_if_new(self, key: str, variable: keras.Variable, role: Role) -> None:
        if id(variable) not in self._keys:
            self.add(key, variable, role)


def nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    """`{"a/b": x}` -> `{"a": {"b": x}}`: the PyTree Orbax saves, one array per key."""
    tree: dict[str, Any] = {}
    for key, value in flat.items():
        *parents, leaf = key.split("/")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


def flatten(tree: Mapping[str, Any], keys: Iterable[str]) -> dict[str, Any]:
    """The leaves of a tree made by `nest`, by key."""
    flat = {}
    for key in keys:
        node: Any = tree
        for part in key.split("/"):
            node = node[part]
        flat[key] = node
    return flat
