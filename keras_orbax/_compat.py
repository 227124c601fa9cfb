"""Private Keras, JAX and Orbax symbols, each wrapped with why no public API serves (the ones Keras's
loading walk needs are in `_compat_loading`).

Checked against keras 3.15.1, jax 0.10.2 and orbax-checkpoint 0.12.8; the tests exercise every one of
them, so a symbol that moves fails the suite rather than a user.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import keras
from keras.src.backend.common import global_state

# Why private: `MonitorCallback` is the base of Keras's own `ModelCheckpoint`, `EarlyStopping` and
# `OrbaxCheckpoint` but is not exported; subclassing it gives our callback exactly Keras's
# `monitor`/`mode="auto"` handling (a metric's `_direction`), `min_delta` and `best` bookkeeping.
from keras.src.callbacks.monitor_callback import MonitorCallback as MonitorCallback
from keras.src.saving import saving_lib
from keras.src.saving.keras_saveable import KerasSaveable
from keras.src.utils import naming

_REGISTRY = "uninitialized_variables"


def walk_saveable(obj: Any) -> Iterator[tuple[str, Any]]:
    """Yields `(attribute, child)` of a Keras object in the order `.weights.h5` saving uses.

    Why private: Keras has no public walk over a model's tracked children by attribute name, and we want
    checkpoint keys that follow the same structure as `.weights.h5` (stable across rebuilds).

    What `saving_lib._walk_saveable` yields, with its one costly step cached: it sorts `dir(obj)` by
    `saving_lib._name_key` and drops names in the type's skip-set, the same work for every object
    with the same attributes (5000 variables: 40 % of the time to key them).
    `tests/test_keys.py` checks that this yields exactly what Keras's own walk does.
    """
    obj_type = obj._obj_type()
    if obj_type in ("Sequential", "Functional"):
        yield "layers", obj.layers
    for name in _attributes_in_saving_order(tuple(dir(obj)), obj_type):
        try:
            child = getattr(obj, name)
        except Exception:  # as Keras's walk: an attribute that cannot be read is not state
            continue
        yield name, child


@functools.lru_cache(maxsize=4096)
def _attributes_in_saving_order(names: tuple[str, ...], obj_type: str) -> tuple[str, ...]:
    """Of `names` (an object's `dir()`), those `saving_lib._walk_saveable` reads, in its order."""
    _cache_attr_skipset(obj_type)
    skip = saving_lib.get_attr_skipset(obj_type)
    ordered = sorted(names, key=saving_lib._name_key)
    return tuple(name for name in ordered if not name.startswith("__") and name not in skip)


def _cache_attr_skipset(obj_type: str) -> None:
    """Makes Keras's cache of attribute skip-sets hit.

    Why: `saving_lib.get_attr_skipset` looks its cache up under `saving_attr_skiplist_<type>` but
    stores under `saving_attr_skipset_<type>`, so every layer walked builds a throwaway `Layer()`
    (0.7 ms each: 1.8 s of a 5000-variable restore). Storing the set under the name it looks up
    gives it the same answer, once per type.
    """
    lookup = f"saving_attr_skiplist_{obj_type}"
    if global_state.get_global_attribute(lookup) is None:
        global_state.set_global_attribute(lookup, saving_lib.get_attr_skipset(obj_type))


def to_snake_case(name: str) -> str:
    """Keras's snake case of a class name (`Conv2D` -> `conv2d`, `LSTM` -> `lstm`).

    Why private: it names the groups of `.weights.h5` (`naming.to_snake_case`), and keys must match
    them exactly; Keras does not export it.
    """
    return naming.to_snake_case(name)


def unique_name(name: str, used: dict[str, int]) -> str:
    """`name`, or `name_<n>` if used before in this container, as Keras uniquifies `.weights.h5` groups.

    Why private: `saving_lib._get_unique_name` is the rule Keras's saving applies; it is not exported.
    """
    return saving_lib._get_unique_name(name, used)


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
    """The dtype the variable's array holds. Why private: `variable.dtype` is the autocast (compute)
    dtype inside an AutocastScope, e.g. bfloat16 for a float32 variable under mixed_bfloat16.

    Canonicalized as JAX holds it: an `int64` variable holds int32 (and `float64` float32) unless
    `jax_enable_x64` is on, so that is what is saved and what a restore reads into.
    """
    import jax

    return str(jax.dtypes.canonicalize_dtype(variable._dtype))


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


def optimizer_steps(optimizer: keras.optimizers.Optimizer) -> int:
    """The training steps `optimizer` has run, whether or not each applied an update.

    Why private: `optimizer.iterations` counts applied updates, i.e. the raw step counter
    `_iterations` divided by `gradient_accumulation_steps`; only `_iterations` advances every
    step. A `LossScaleOptimizer` never advances its own counter: its inner optimizer's counts.
    """
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        optimizer = optimizer.inner_optimizer
    return int(optimizer._iterations)


def drop_train_steps(
    model: keras.Model, executions: int, logs: dict[str, Any]
) -> Callable[[], None]:
    """Makes `fit`'s next `executions` train steps drop the batches they were given.

    Each dropped step leaves the training state as it is and reports `logs`. Returns a function
    that puts the real train step back early (it is put back by itself after the last drop).

    Why private: Keras has no way to start `fit` after the first batches of an epoch, as resuming a
    checkpoint taken mid-epoch needs. The JAX trainer's `fit` calls `model.train_function(state,
    iterator)` once per execution, which reads `steps_per_execution` batches from the input's
    iterator (an attribute that `fit` does not replace once made): swapping it for the first
    executions of the resumed epoch drops exactly those batches, whatever the input (arrays,
    PyDataset, generator).
    """
    original = model.train_function
    remaining = executions

    def put_back() -> None:
        if model.train_function is drop:
            model.train_function = original

    def drop(state: Any, iterator: Iterator[Any]) -> tuple[dict[str, Any], Any]:
        nonlocal remaining
        remaining -= 1
        if remaining <= 0:
            put_back()
        next(iterator)  # StopIteration ends the epoch, as in Keras's own step
        for _ in range(model.steps_per_execution - 1):
            if next(iterator, None) is None:
                break
        return logs, state

    if executions > 0:
        model.train_function = drop
    return put_back


def downloaded_preset(handle: str) -> Any:
    """The local directory holding a keras-hub preset's config and weights, downloaded by keras-hub.

    Why private: keras-hub resolves `kaggle://`/`hf://` handles in `preset_utils.get_file` only;
    there is no public "download this preset" call. Untested offline.
    """
    import json
    from pathlib import Path

    from keras_hub.src.utils import preset_utils

    directory = Path(preset_utils.get_file(handle, "config.json")).parent
    if preset_utils.check_file_exists(handle, "model.weights.json"):
        index = Path(preset_utils.get_file(handle, "model.weights.json"))
        parts = json.loads(index.read_text())["weight_map"].values()
        for part in {p for files in parts for p in ([files] if isinstance(files, str) else files)}:
            preset_utils.get_file(handle, part)
    else:
        preset_utils.get_file(handle, "model.weights.h5")
    return directory


def epath_forget_tensorflow() -> None:
    """Makes `etils.epath` read `EPATH_USE_TF` again for object-store paths.

    Why private: epath decides once per process (`gpath._is_tf_installed`, a `functools.cache`)
    whether to send `gs://` and `s3://` to TensorFlow; a path used before keras-orbax set
    `EPATH_USE_TF=false` would keep TensorFlow's file system, which has no `s3` and ignores
    `STORAGE_EMULATOR_HOST`.
    """
    from etils.epath import gpath

    if gpath._is_tf_installed.cache_info().currsize and not gpath._epath_use_tf():
        gpath._is_tf_installed.cache_clear()


def step_metadata_file(step_dir: Any) -> Any:
    """The file `step_custom_metadata` reads (a `pathlib.Path`, or an `epath.Path` in object
    storage). Why private: see `step_custom_metadata`; named in errors about a missing or damaged
    step record."""
    from orbax.checkpoint._src.metadata import checkpoint

    path = checkpoint.step_metadata_file_path(step_dir)
    return path if "://" in str(path) else Path(path)


# keras-hub (an optional extra: imported only when these are called).


def hub_preset_loader(directory: str) -> Any:
    """The loader keras-hub's `Backbone.from_preset(directory)` uses.

    Why private: `preset_utils.get_preset_loader` is how `from_preset` tells a Keras preset from a
    Hugging Face or timm directory; for Hugging Face, its `TransformersPresetLoader` picks the
    converter module for the config's `model_type` and builds the backbone config
    (`load_backbone`). keras-hub exports neither; reusing them keeps the mapping keras-hub's own.
    """
    from keras_hub.src.utils.preset_utils import get_preset_loader

    return get_preset_loader(directory)


def hub_is_transformers_loader(loader: Any) -> bool:
    """Why private: see `hub_preset_loader`; `TransformersPresetLoader` is not exported."""
    from keras_hub.src.utils.transformers.preset_loader import TransformersPresetLoader

    return isinstance(loader, TransformersPresetLoader)


def hub_safetensor_loader_class() -> type:
    """keras-hub's `SafetensorLoader`, the object its converters call `port_weight` on.

    Why private: converters take the loader as an argument and call `port_weight(variable, key,
    hook_fn)`, `get_tensor(key)` and its key-prefix resolution; a subclass that records instead of
    assigning sees exactly the mapping keras-hub would apply. keras-hub does not export the class.
    """
    from keras_hub.src.utils.transformers.safetensor_utils import SafetensorLoader

    return SafetensorLoader


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


def step_metrics(step_dir: Any) -> dict[str, Any]:
    """The metrics Orbax stored with one step (`save(..., metrics=logs)`), from its metadata file.

    Why private: as `step_custom_metadata`; the public `ocp.checkpointables_metadata` also loads
    the tree metadata of every array, and `inspect` lists every step.
    """
    from orbax.checkpoint._src.metadata import checkpoint

    store = checkpoint.metadata_store(enable_write=False)
    serialized = store.read(checkpoint.step_metadata_file_path(step_dir))
    return dict((serialized or {}).get("metrics") or {})
