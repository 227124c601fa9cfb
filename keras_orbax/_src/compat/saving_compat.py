"""Private Keras symbols of its saving walk, which `export/weights_h5` runs with stores of its own
(the other Keras ones are in `keras_compat`, those of the loading walk in `loading_compat`). Each
says why no public API serves.

Tested with keras 3.15.1 (`versions.SUPPORTED`): resolved on import, failing with one
`UnsupportedVersionError` if moved; tests/test_export_h5.py runs every one.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import keras

from keras_orbax._src.compat.versions import Private, attribute

_SAVING = "keras.src.saving.saving_lib"
# Why private: see `save_state`.
_H5IOStore: Any = Private("keras", _SAVING, "H5IOStore").get()
Private("keras", _SAVING, "H5IOStore._create_h5_group").get()
_save_state: Callable[..., Any] = Private("keras", _SAVING, "_save_state").get()
_ShardedH5IOStore: Any = Private("keras", _SAVING, "ShardedH5IOStore").get()
for _method in ("_restore_h5_file", "_create_new_shard_file", "close"):
    Private("keras", _SAVING, f"ShardedH5IOStore.{_method}").get()
_dtype_size: Callable[[str], int] = Private(
    "keras", "keras.src.utils.dtype_utils", "dtype_size"
).get()
_BASE_SAVE_OWN_VARIABLES = Private(
    "keras", "keras.src.optimizers.base_optimizer", "BaseOptimizer.save_own_variables"
).get()


class _ArrayStore(_H5IOStore):
    """A write-mode `H5IOStore` that hands each array it is given (a variable, a JAX array) to
    `write(group, key, value)` instead of fetching it whole; other values (numbers, NumPy arrays)
    are stored as Keras stores them."""

    def __init__(self, path_or_io: Any, write: Callable[[Any, str, Any], None]) -> None:
        super().__init__(path_or_io, mode="w")
        self._write = write

    def __setitem__(self, key: str, value: Any) -> None:
        import jax

        if not isinstance(value, keras.Variable | jax.Array):
            super().__setitem__(key, value)
            return
        if not attribute(self, "_h5_entry_initialized"):  # as `H5IOStore.__setitem__`
            self._create_h5_group(attribute(self, "_h5_entry_path"))
        self._write(attribute(self, "_h5_entry_group"), key, value)


class _ShardedArrayStore(_ShardedH5IOStore):
    """`_ArrayStore` for `save_weights(..., max_shard_size=...)`: a `.weights.json` index and
    `_NNNNN.weights.h5` parts, cut where Keras's `ShardedH5IOStore` cuts them."""

    def __init__(self, path: Any, max_shard_size: float, write: Callable[[Any, str, Any], None]):
        super().__init__(path, max_shard_size, mode="w")
        self._write = write

    def __setitem__(self, key: str, value: Any) -> None:
        """`ShardedH5IOStore.__setitem__`, its size taken from the shape and dtype rather than a
        fetched copy (which it makes first), the dataset written by `write`."""
        import jax

        if not isinstance(value, keras.Variable | jax.Array):
            super().__setitem__(key, value)
            return
        self._restore_h5_file()
        # From the shape and dtype alone: a deferred variable (no value yet) is sized too.
        dtype = keras.backend.standardize_dtype(value.dtype)
        size = math.prod(value.shape) * _dtype_size(dtype) / 8
        self.total_shard_size += size
        if size > self.max_shard_size:
            raise ValueError(
                f"The size of {key} is {size:.0f} bytes, which exceeds the maximum shard size "
                f"{self.max_shard_size:.0f} bytes: increase `max_shard_size`."
            )
        self.current_shard_size: float = self.current_shard_size + size
        if self.current_shard_size > self.max_shard_size:
            self.close()
            self.h5_file = self._create_new_shard_file()
            self.current_shard_size = size
        if not attribute(self, "_h5_entry_initialized"):
            self._create_h5_group(attribute(self, "_h5_entry_path"))
        group = attribute(self, "_h5_entry_group")
        self._write(group, key, value)
        weight_map = self.sharding_config["weight_map"]
        filename = self.current_shard_path.name
        if group.name not in weight_map:
            weight_map[group.name] = filename
        else:
            if not isinstance(weight_map[group.name], list):
                weight_map[group.name] = [weight_map[group.name]]
            if filename not in weight_map[group.name]:
                weight_map[group.name].append(filename)


def save_state(
    model: Any,
    path_or_io: Any,
    write: Callable[[Any, str, Any], None],
    skip: Sequence[Any] = (),
    max_shard_size: float | None = None,
) -> None:
    """Keras's own `save_weights` walk into the h5 file `path_or_io`, each array handed to
    `write(group, key, value)` (an h5py group, the dataset's name, the variable or array).

    Why private: `saving_lib._save_state` is the walk `save_weights` runs (each object's
    `save_own_variables`, groups named as Keras names them, the `name` attributes it sets), and it
    accepts only Keras's own store classes (`isinstance`); a subclass of `H5IOStore` that writes
    each array region by region, instead of `H5IOStore.__setitem__` converting it whole to NumPy,
    keeps every name, group and attribute Keras's. `skip`: objects not saved (their children
    neither), as `save_weights(objects_to_skip=...)`. With `max_shard_size` (GB), `path_or_io` is
    a `.weights.json` index, written with its parts as `save_weights(max_shard_size=...)` does
    (`ShardedH5IOStore`, whose `__setitem__` also fetches each array whole).
    """
    if max_shard_size is None:
        store = _ArrayStore(path_or_io, write)
    else:
        store = _ShardedArrayStore(path_or_io, max_shard_size, write)
    try:
        with optimizers_store_variables(model):
            _save_state(
                model,
                weights_store=store,
                assets_store=None,
                inner_path="",
                visited_saveables={id(obj) for obj in skip},
            )
    finally:
        store.close()


@contextlib.contextmanager
def optimizers_store_variables(model: Any) -> Iterator[None]:
    """Inside, each optimizer of `model` whose `save_own_variables` is Keras's base one stores
    its variables themselves, not `variable.numpy()` (see `_fetching_optimizers`)."""
    optimizers = _fetching_optimizers(model)
    try:
        for optimizer in optimizers:
            object.__setattr__(optimizer, "save_own_variables", _optimizer_saver(optimizer))
        yield
    finally:
        for optimizer in optimizers:
            object.__delattr__(optimizer, "save_own_variables")


def _fetching_optimizers(model: Any) -> list[Any]:
    """The model's optimizers whose `save_own_variables` is Keras's base one, which stores
    `variable.numpy()`: each slot fetched whole to the host, which under `jax.distributed` fails on
    a slot that spans other processes. For the walk, each gets the same method storing the
    variable itself (the same names and values), set on the instance and removed afterwards."""
    found = []
    optimizer = getattr(model, "optimizer", None)
    while isinstance(optimizer, keras.optimizers.Optimizer):
        if type(optimizer).save_own_variables is _BASE_SAVE_OWN_VARIABLES:
            found.append(optimizer)
        optimizer = getattr(optimizer, "inner_optimizer", None)  # a LossScaleOptimizer's
    return found


def _optimizer_saver(optimizer: Any) -> Callable[[Any], None]:
    def save_own_variables(store: Any) -> None:
        for i, variable in enumerate(optimizer.variables):
            store[str(i)] = variable

    return save_own_variables


def all_layers(layer: keras.Layer) -> list[keras.Layer]:
    """`layer` and every layer nested in it. Why private: `Layer._flatten_layers` is the list
    keras-hub's `Task.save_task_weights` skips (a task's own weights are the rest); not exported."""
    return list(layer._flatten_layers())
