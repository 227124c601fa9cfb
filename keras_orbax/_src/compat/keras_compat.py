"""Private Keras symbols, each wrapped with why no public API serves (the ones Keras's loading walk
needs are in `loading_compat`; Orbax's, etils's and JAX's in `orbax_compat`; keras-hub's in
`hub_compat`).

Tested with keras 3.15.1 (`versions.SUPPORTED`). The module-level symbols are resolved when this
module is imported and the attributes each object holds when first read, so that a Keras version
that moved one fails with one `UnsupportedVersionError` naming it; tests/test_versions.py resolves
every one in the installed versions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import keras

from keras_orbax._src.compat.versions import Private, attribute, set_attribute, unsupported

# Resolved on import: every keras-orbax verb needs them, and an unsupported Keras should fail once,
# up front, with one error naming the symbol, rather than part-way through a save.

# Why private: Keras keeps process-wide settings (the deferred-variable registry, the saving
# walk's caches) in `global_state`, which it does not export.
_STATE = "keras.src.backend.common.global_state"
_get_global: Callable[..., Any] = Private("keras", _STATE, "get_global_attribute").get()
_set_global: Callable[..., Any] = Private("keras", _STATE, "set_global_attribute").get()
# Why private: `MonitorCallback` is the base of Keras's own `ModelCheckpoint`, `EarlyStopping` and
# `OrbaxCheckpoint` but is not exported; subclassing it gives our callback exactly Keras's
# `monitor`/`mode="auto"` handling (a metric's `_direction`), `min_delta` and `best` bookkeeping.
_MONITOR = "keras.src.callbacks.monitor_callback"
MonitorCallback: Any = Private("keras", _MONITOR, "MonitorCallback").get()
Private("keras", _MONITOR, "MonitorCallback._set_monitor_op").get()
Private("keras", _MONITOR, "MonitorCallback._is_improvement").get()
# Why private: see `walk_saveable`, `unique_name`, `is_saveable`, `to_snake_case`.
_SAVING = "keras.src.saving.saving_lib"
_name_key: Callable[[str], Any] = Private("keras", _SAVING, "_name_key").get()
_get_attr_skipset: Callable[[str], Any] = Private("keras", _SAVING, "get_attr_skipset").get()
_get_unique_name: Callable[..., str] = Private("keras", _SAVING, "_get_unique_name").get()
_KerasSaveable: type = Private("keras", "keras.src.saving.keras_saveable", "KerasSaveable").get()
Private("keras", "keras.src.saving.keras_saveable", "KerasSaveable._obj_type").get()
_to_snake_case: Callable[[str], str] = Private(
    "keras", "keras.src.utils.naming", "to_snake_case"
).get()
# Methods called on each variable (a subclass may override them): the class still defines them.
# Why private: see `set_value` and `initialize_deferred`.
Private("keras", "keras", "Variable._direct_assign").get()
Private("keras", "keras", "Variable._deferred_initialize").get()

# Why private: see `deferred_scope`. Keras registers deferred variables in a list kept in
# `global_state` under this name (a string constant of the registering function, checked here:
# were it renamed, `deferred_scope` would hook nothing, silently).
_REGISTRY = "uninitialized_variables"
_REGISTER = Private(
    "keras", "keras.src.backend.common.variables", "register_uninitialized_variable"
)
if _REGISTRY not in _REGISTER.get().__code__.co_consts:
    raise unsupported("keras", f"{_REGISTER} (registering in global attribute {_REGISTRY!r})")


def walk_saveable(obj: Any) -> Iterator[tuple[str, Any]]:
    """Yields `(attribute, child)` of a Keras object in the order `.weights.h5` saving uses.

    Why private: Keras has no public walk over a model's tracked children by attribute name, and we want
    checkpoint keys that follow the same structure as `.weights.h5` (stable across rebuilds).

    What `saving_lib._walk_saveable` yields, with its costly steps cached: it sorts `dir(obj)` by
    `saving_lib._name_key` and drops names in the type's skip-set, the same work for every object
    of one class with the same instance attributes (5000 variables: 40 % of the time to key them);
    and `dir(obj)` itself, where the class keeps `object.__dir__`, is its instance attributes and
    `dir` of its class (a third of what was left). `tests/test_keys.py` checks that this yields
    exactly what Keras's own walk does.
    """
    obj_type = obj._obj_type()
    if obj_type in ("Sequential", "Functional"):
        yield "layers", obj.layers
    cls: type = type(obj)
    if cls.__dir__ is object.__dir__:
        names = _attributes_in_saving_order(cls, tuple(obj.__dict__), obj_type)
    else:  # dir(object) adds only dunder names, which are dropped
        names = _attributes_in_saving_order(object, tuple(dir(obj)), obj_type)
    lora = getattr(obj, "lora_enabled", False) is True
    for name in names:
        if name in _COMPUTED_TENSORS and lora and _computes_tensor(cls, name):
            continue
        try:
            child = getattr(obj, name)
        except Exception:  # as Keras's walk: an attribute that cannot be read is not state
            continue
        yield name, child


# Keras's LoRA-capable layers (Dense, EinsumDense, Conv, Embedding), once LoRA is enabled, compute
# `kernel` and `embeddings` at every read: the frozen variable plus the LoRA product, a matmul on
# the devices.
# Keras's walk reads them and then drops the tensor (it is not state): skipped here, where it cost
# a LoRA fine-tune's every save 0.3 s on the training loop (16 LoRA Dense(2048)).
_COMPUTED_TENSORS = frozenset({"kernel", "embeddings"})


@functools.lru_cache(maxsize=1024)
def _computes_tensor(cls: type, name: str) -> bool:
    """Whether `name` is one of Keras's own layer properties that compute a tensor."""
    found = inspect.getattr_static(cls, name, None)
    return isinstance(found, property) and getattr(found.fget, "__module__", "").startswith(
        "keras.src.layers."
    )


@functools.lru_cache(maxsize=4096)
def _attributes_in_saving_order(cls: type, own: tuple[str, ...], obj_type: str) -> tuple[str, ...]:
    """Of `dir()` of an object of class `cls` with the instance attributes `own`, the names
    `saving_lib._walk_saveable` reads, in its order."""
    _cache_attr_skipset(obj_type)
    skip = _get_attr_skipset(obj_type)
    ordered = sorted(set(own).union(dir(cls)), key=_name_key)
    return tuple(name for name in ordered if not name.startswith("__") and name not in skip)


def _cache_attr_skipset(obj_type: str) -> None:
    """Makes Keras's cache of attribute skip-sets hit.

    Why: `saving_lib.get_attr_skipset` looks its cache up under `saving_attr_skiplist_<type>` but
    stores under `saving_attr_skipset_<type>`, so every layer walked builds a throwaway `Layer()`
    (0.7 ms each: 1.8 s of a 5000-variable restore). Storing the set under the name it looks up
    gives it the same answer, once per type.
    """
    lookup = f"saving_attr_skiplist_{obj_type}"
    if _get_global(lookup) is None:
        _set_global(lookup, _get_attr_skipset(obj_type))


@functools.lru_cache(maxsize=4096)
def to_snake_case(name: str) -> str:
    """Keras's snake case of a class name (`Conv2D` -> `conv2d`, `LSTM` -> `lstm`).

    Why private: it names the groups of `.weights.h5` (`naming.to_snake_case`), and keys must match
    them exactly; Keras does not export it. Cached: three regular expressions per call, once per
    layer of a model (5000 variables: 15,000 substitutions).
    """
    return _to_snake_case(name)


def unique_name(name: str, used: dict[str, int]) -> str:
    """`name`, or `name_<n>` if used before in this container, as Keras uniquifies `.weights.h5` groups.

    Why private: `saving_lib._get_unique_name` is the rule Keras's saving applies; it is not exported.
    """
    return _get_unique_name(name, used)


def is_saveable(obj: Any) -> bool:
    """Why private: `KerasSaveable` is the base Keras walks when saving; it is not exported."""
    return isinstance(obj, _KerasSaveable)


def own_variables(layer: keras.Layer) -> list[keras.Variable]:
    """The variables a layer created itself (not its children's), in creation order.

    Why private: `layer.weights` includes sub-layers' variables; the own lists are what
    `Layer.save_own_variables` walks too.
    """
    return list(attribute(layer, "_trainable_variables")) + list(
        attribute(layer, "_non_trainable_variables")
    )


def seed_generators(obj: Any) -> list[Any]:
    """Why private: a layer's seed generators (Dropout's RNG state) are only listed in
    `_seed_generators`. Other saveables (optimizers, metrics) have none."""
    if not isinstance(obj, keras.Layer):
        return list(getattr(obj, "_seed_generators", []))
    return list(attribute(obj, "_seed_generators"))


def optimizer_variables_built_for(optimizer: keras.optimizers.Optimizer) -> list[keras.Variable]:
    """The model variables `optimizer` was built for (its slots are named after them).

    Why private: the optimizer lists them in `_trainable_variables` only.
    """
    return list(attribute(optimizer, "_trainable_variables"))


def stored_dtype(variable: keras.Variable) -> str:
    """The dtype the variable's array holds. Why private: `variable.dtype` is the autocast (compute)
    dtype inside an AutocastScope, e.g. bfloat16 for a float32 variable under mixed_bfloat16.

    Canonicalized as JAX holds it: an `int64` variable holds int32 (and `float64` float32) unless
    `jax_enable_x64` is on, so that is what is saved and what a restore reads into.
    """
    import jax

    return str(jax.dtypes.canonicalize_dtype(attribute(variable, "_dtype")))


def is_allocated(variable: keras.Variable) -> bool:
    """Why private: a deferred (not yet initialized) variable is only told apart by `_value is None`."""
    return attribute(variable, "_value") is not None


def current_value(variable: keras.Variable) -> Any:
    """The stored array, bypassing autocast and stateless scopes. Why private: `variable.value`
    runs the initializer for a deferred variable and casts under autocast."""
    return attribute(variable, "_value")


def layout(variable: keras.Variable) -> Any:
    """Why private: the TensorLayout Keras gave the variable (or None) lives in `_layout` only."""
    return attribute(variable, "_layout")


def set_layout(variable: keras.Variable, value: Any) -> None:
    """Why private: a deferred variable gets its layout only when initialized; we set it at creation
    so optimizer slots (which copy their reference's `_layout`) come out sharded the same way."""
    set_attribute(variable, "_layout", value)


def initializer(variable: keras.Variable) -> Any:
    """Why private: a deferred variable keeps its initializer in `_initializer` only."""
    return attribute(variable, "_initializer")


def set_initializer(variable: keras.Variable, value: Any) -> None:
    """Why private: see `initializer`; we wrap it so a deferred variable used before restore raises."""
    set_attribute(variable, "_initializer", value)


def set_value(variable: keras.Variable, value: Any) -> None:
    """Hands `value` (already of the target sharding and dtype) to the variable without a copy.

    Why private: `assign` would convert through `jnp.asarray` and refuses a deferred variable's
    placeholder shape checks inside stateless scopes; `_direct_assign` is what `assign` itself ends in
    and returns the same object when the sharding already matches.
    """
    variable._direct_assign(value)
    set_attribute(variable, "_initializer", None)


def initialize_deferred(variable: keras.Variable) -> None:
    """Runs a deferred variable's own initializer, sharded by its layout.

    Why private: `_deferred_initialize` is the only way to initialize one variable (the public
    path initializes every registered variable at once)."""
    variable._deferred_initialize()


def set_monitor_op(callback: Any) -> None:
    """Settles a `MonitorCallback`'s `monitor_op` (and the sign of its `min_delta`) from `mode`
    and the model's metrics. Why private: `MonitorCallback._set_monitor_op` is Keras's own rule
    (`mode="auto"` reads a metric's `_direction`); subclasses call it, Keras does not export it."""
    callback._set_monitor_op()


def is_improvement(callback: Any, value: float, reference: float | None) -> bool:
    """Why private: `MonitorCallback._is_improvement` is Keras's comparison with `min_delta`."""
    return bool(callback._is_improvement(value, reference))


def set_initial_epoch(model: keras.Model, epoch: int | None) -> None:
    """Makes the `fit` call that is starting begin at `epoch` (None: at fit's own `initial_epoch`).

    Why private: Keras has no public way for a callback to resume `fit` mid-way; `fit` reads
    `model._initial_epoch` right after `on_train_begin`, and `BackupAndRestore` sets it the same way.
    """
    set_attribute(model, "_initial_epoch", epoch)


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
    previous = _get_global(_REGISTRY, []) or []
    if isinstance(previous, _Registry):  # nested: the outer scope already hooks creation
        yield
        return
    _set_global(_REGISTRY, _Registry(previous, on_create))
    try:
        with keras.StatelessScope(initialize_variables=False):
            yield
    finally:
        _set_global(_REGISTRY, list(previous))


def optimizer_steps(optimizer: keras.optimizers.Optimizer) -> int:
    """The training steps `optimizer` has run, whether or not each applied an update.

    Why private: `optimizer.iterations` counts applied updates, i.e. the raw step counter
    `_iterations` divided by `gradient_accumulation_steps`; only `_iterations` advances every
    step. A `LossScaleOptimizer` never advances its own counter: its inner optimizer's counts.
    """
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        optimizer = optimizer.inner_optimizer
    return int(attribute(optimizer, "_iterations"))


@dataclasses.dataclass(frozen=True)
class LoraMerge:
    """A LoRA-enabled layer's frozen variable, its two factors, and `merged()`: the layer's own
    merged tensor (its `kernel` or `embeddings` property), in the frozen variable's dtype, as
    Keras's `save_own_variables` stores it."""

    frozen: keras.Variable
    factors: tuple[keras.Variable, keras.Variable]
    merged: Callable[[], Any]


# Keras's LoRA-capable layers: the property that merges, the frozen variable, the two factors.
_LORA_PARTS = (
    ("kernel", "_kernel", "lora_kernel_a", "lora_kernel_b"),  # Dense, EinsumDense, Conv
    ("embeddings", "_embeddings", "lora_embeddings_a", "lora_embeddings_b"),  # Embedding
)


def lora_merges(model: keras.Layer) -> list[LoraMerge]:
    """Every LoRA-enabled layer of `model`, as a `LoraMerge`.

    Why private: Keras merges LoRA only in the `kernel`/`embeddings` property; the frozen variable
    (`_kernel`, `_embeddings`, which `layer.weights[0]` also returns) has no public name, and an
    exporter that reads it (keras-hub's Gemma exporter reads `weights[0]`) drops the update.
    """
    from keras_orbax._src.compat import saving_compat

    merges = []
    for layer in saving_compat.all_layers(model):
        if getattr(layer, "lora_enabled", False) is not True:
            continue
        for prop, frozen, a, b in _LORA_PARTS:
            if isinstance(getattr(layer, frozen, None), keras.Variable):
                variable = attribute(layer, frozen, "keras")
                merges.append(
                    LoraMerge(
                        variable,
                        (attribute(layer, a, "keras"), attribute(layer, b, "keras")),
                        functools.partial(_merged, layer, prop, variable.dtype),
                    )
                )
                break
        else:
            raise unsupported("keras", f"{type(layer).__name__}'s LoRA variables")
    return merges


def _merged(layer: keras.Layer, prop: str, dtype: str) -> Any:
    return keras.ops.cast(getattr(layer, prop), dtype)
