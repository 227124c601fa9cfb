"""The only module that touches private Keras, JAX and Orbax symbols. Each says why no public API serves.

Checked against keras 3.15.1, jax 0.10.2 and orbax-checkpoint 0.12.8; the tests exercise every one of
them, so a symbol that moves fails the suite rather than a user.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import keras
from keras.src.backend.common import global_state

# Why private: `MonitorCallback` is the base of Keras's own `ModelCheckpoint`, `EarlyStopping` and
# `OrbaxCheckpoint` but is not exported; subclassing it gives our callback exactly Keras's
# `monitor`/`mode="auto"` handling (a metric's `_direction`), `min_delta` and `best` bookkeeping.
from keras.src.callbacks.monitor_callback import MonitorCallback as MonitorCallback
from keras.src.saving import saving_lib
from keras.src.saving.keras_saveable import KerasSaveable

_REGISTRY = "uninitialized_variables"


def walk_saveable(obj: Any) -> Iterator[tuple[str, Any]]:
    """Yields `(attribute, child)` of a Keras object in the order `.weights.h5` saving uses.

    Why private: Keras has no public walk over a model's tracked children by attribute name, and we want
    checkpoint keys that follow the same structure as `.weights.h5` (stable across rebuilds).
    """
    yield from saving_lib._walk_saveable(obj)


def is_saveable(obj: Any) -> bool:
    """Why private: `KerasSaveable` is the base Keras walks when saving; it is not exported."""
    return isinstance(obj, KerasSaveable)


def own_variables(layer: keras.Layer) -> list[keras.Variable]:
    """The variables a layer created itself (not its children's), in creation order.

    Why private: `layer.weights` includes sub-layers' variables; the own lists are what
    `Layer.save_own_variables` walks too.
    """
    return list(layer._trainable_variables) + list(layer._non_trainable_variables)


def seed_generators(layer: keras.Layer) -> list[Any]:
    """Why private: a layer's seed generators (Dropout's RNG state) are only listed in `_seed_generators`."""
    return list(getattr(layer, "_seed_generators", []))


def stored_dtype(variable: keras.Variable) -> str:
    """The dtype the variable stores. Why private: `variable.dtype` is the autocast (compute) dtype
    inside an AutocastScope, e.g. bfloat16 for a float32 variable under mixed_bfloat16."""
    return str(variable._dtype)


def is_allocated(variable: keras.Variable) -> bool:
    """Why private: a deferred (not yet initialized) variable is only told apart by `_value is None`."""
    return variable._value is not None


def current_value(variable: keras.Variable) -> Any:
    """The stored array, bypassing autocast and stateless scopes. Why private: `variable.value`
    runs the initializer for a deferred variable and casts under autocast."""
    return variable._value


def layout(variable: keras.Variable) -> Any:
    """Why private: the TensorLayout Keras gave the variable (or None) lives in `_layout` only."""
    return variable._layout


def set_layout(variable: keras.Variable, value: Any) -> None:
    """Why private: a deferred variable gets its layout only when initialized; we set it at creation
    so optimizer slots (which copy their reference's `_layout`) come out sharded the same way."""
    variable._layout = value


def initializer(variable: keras.Variable) -> Any:
    """Why private: a deferred variable keeps its initializer in `_initializer` only."""
    return variable._initializer


def set_initializer(variable: keras.Variable, value: Any) -> None:
    """Why private: see `initializer`; we wrap it so a deferred variable used before restore raises."""
    variable._initializer = value


def set_value(variable: keras.Variable, value: Any) -> None:
    """Hands `value` (already of the target sharding and dtype) to the variable without a copy.

    Why private: `assign` would convert through `jnp.asarray` and refuses a deferred variable's
    placeholder shape checks inside stateless scopes; `_direct_assign` is what `assign` itself ends in
    and returns the same object when the sharding already matches.
    """
    variable._direct_assign(value)
    variable._initializer = None


def initialize_deferred(variable: keras.Variable) -> None:
    """Runs a deferred variable's own initializer, sharded by its layout.

    Why private: `_deferred_initialize` is the only way to initialize one variable (the public
    path initializes every registered variable at once)."""
    variable._deferred_initialize()


def set_initial_epoch(model: keras.Model, epoch: int | None) -> None:
    """Makes the `fit` call that is starting begin at `epoch` (None: at fit's own `initial_epoch`).

    Why private: Keras has no public way for a callback to resume `fit` mid-way; `fit` reads
    `model._initial_epoch` right after `on_train_begin`, and `BackupAndRestore` sets it the same way.
    """
    model._initial_epoch = epoch


class _Registry(list):
    """Keras's deferred-variable registry, calling `on_create` for each variable as it is made."""

    def __init__(self, items: list, on_create: Callable[[keras.Variable], None]) -> None:
        super().__init__(items)
        self.on_create = on_create

    def append(self, variable: keras.Variable) -> None:
        self.on_create(variable)
        super().append(variable)


@contextlib.contextmanager
def deferred_scope(on_create: Callable[[keras.Variable], None]) -> Iterator[None]:
    """A `keras.StatelessScope` that creates variables without values, calling `on_create` on each.

    Why private: Keras registers each deferred variable in a thread-local list
    (`register_uninitialized_variable`) and offers no creation hook; swapping that list for one
    whose `append` calls back is the least invasive way to give a variable its layout the moment it
    is created (optimizer slots copy their reference's layout at creation).

    The variables made inside are taken out of that registry on exit: Keras would otherwise
    initialize them at the end of the next outermost StatelessScope (every traced train or predict
    step opens one), silently, or re-run initialization after restore (see shared/FACTS.md), and a
    deferred model that is thrown away would break every later `fit` in the process.
    """
    previous = global_state.get_global_attribute(_REGISTRY, []) or []
    if isinstance(previous, _Registry):  # nested: the outer scope already hooks creation
        yield
        return
    global_state.set_global_attribute(_REGISTRY, _Registry(previous, on_create))
    try:
        with keras.StatelessScope(initialize_variables=False):
            yield
    finally:
        global_state.set_global_attribute(_REGISTRY, list(previous))


def distributed_client() -> Any:
    """JAX's client of the coordination service that `jax.distributed.initialize` started.

    Why private: its key-value store (`key_value_set`, `blocking_key_value_get` with a timeout) is
    only reachable as `jax._src.distributed.global_state.client`; the public `multihost_utils`
    collectives have no timeout and hang when a process is gone.
    """
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("jax.distributed is not initialized, yet jax.process_count() > 1.")
    return client


def step_custom_metadata(step_dir: Any) -> dict[str, Any] | None:
    """The `custom_metadata` Orbax stored with one step, read from that step's metadata file alone.

    Why private: the public `ocp.checkpointables_metadata` also loads the tree metadata of every
    array (about 1 s for 1,500 variables); Orbax's own step-metadata store reads just the JSON file.
    """
    from orbax.checkpoint._src.metadata import checkpoint

    store = checkpoint.metadata_store(enable_write=False)
    serialized = store.read(checkpoint.step_metadata_file_path(step_dir))
    return None if serialized is None else serialized.get("custom_metadata")


def pytree_handler_with_array_writer(leaf_handler: type) -> type:
    """Orbax's `PyTreeHandler`, saving every `jax.Array` leaf with `leaf_handler` instead of Orbax's.

    Why private: Orbax registers checkpointable handlers by class and records the class's dotted name
    in the step's metadata (`item_handlers`); plain `ocp.load` resolves the handler from that name.
    The subclass only swaps the leaf-handler registry (a constructor argument Orbax offers but the
    registry cannot pass) and keeps `PyTreeHandler`'s recorded name, because what it writes is
    exactly `PyTreeHandler`'s layout: plain Orbax then loads it with no warning. `leaf_handler` is
    registered for `jax.Array` under Orbax's own type name `"jax.Array"` (the `value_type` in
    `_METADATA`), so the tree metadata is unchanged too.
    """
    import jax
    from orbax.checkpoint.experimental.v1._src.handlers.pytree_handler import PyTreeHandler
    from orbax.checkpoint.experimental.v1._src.serialization import registry

    class Handler(PyTreeHandler):
        def __init__(self, **kwargs: Any) -> None:
            leaves = registry.BaseLeafHandlerRegistry()
            for (
                leaf,
                abstract,
                typestrs,
                handler,
            ) in registry.STANDARD_TYPE_AND_ABSTRACT_TYPE_AND_TYPESTR_TO_HANDLER:
                if leaf is jax.Array:
                    handler = leaf_handler
                leaves.add(leaf, abstract, handler, secondary_typestrs=typestrs)
            super().__init__(leaf_handler_registry=leaves, **kwargs)

    Handler.__module__ = PyTreeHandler.__module__
    Handler.__qualname__ = Handler.__name__ = PyTreeHandler.__qualname__
    return Handler


def array_leaf_handler() -> type:
    """Orbax's v1 `ArrayLeafHandler`, the base of our array writer (it keeps Orbax's reading).

    Why private: the v1 leaf-handler classes are not exported yet in orbax-checkpoint 0.12.
    """
    from orbax.checkpoint.experimental.v1._src.serialization.array_leaf_handler import (
        ArrayLeafHandler,
    )

    return ArrayLeafHandler


def serialized_sharding(sharding: Any) -> str | None:
    """The string Orbax stores for `sharding` in a step's `_sharding` file (None: not storable).

    Why private: Orbax's sharding-metadata serializer is internal; the `_sharding` file is what
    plain `ocp.load` reads to restore arrays onto their saved shardings.
    """
    from orbax.checkpoint._src.metadata import sharding as sharding_metadata

    metadata = sharding_metadata.from_jax_sharding(sharding)
    return None if metadata is None else metadata.to_serialized_string()
