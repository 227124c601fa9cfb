"""Private Keras symbols of `fit`'s input pipeline, wrapped for positioning it on resume
(`training/input_position.py`).

Why private: Keras 3.15 gives a callback no handle on the input `fit` reads, and no way to start an
epoch after its first batches. `fit` builds a data adapter (one class per input kind) inside an
`EpochIterator` held in a local variable, and reads every epoch's batches from the adapter's
`get_jax_iterator()`, called once per epoch (also under a distribution). Replacing that method on the
adapter instance, for this `fit` only, is the smallest change that positions every kind of input.
"""

from __future__ import annotations

import functools
import inspect
import json
import random
import re
from collections.abc import Callable, Iterator
from typing import Any

import jax
import keras
import numpy as np

from keras_orbax._src.compat.versions import Private, attribute, set_attribute, unsupported

_ADAPTERS = "keras.src.trainers.data_adapters"
ArrayDataAdapter: Any = Private(
    "keras", f"{_ADAPTERS}.array_data_adapter", "ArrayDataAdapter"
).get()
PyDatasetAdapter: Any = Private(
    "keras", f"{_ADAPTERS}.py_dataset_adapter", "PyDatasetAdapter"
).get()
GrainDatasetAdapter: Any = Private(
    "keras", f"{_ADAPTERS}.grain_dataset_adapter", "GrainDatasetAdapter"
).get()
TFDatasetAdapter: Any = Private(
    "keras", f"{_ADAPTERS}.tf_dataset_adapter", "TFDatasetAdapter"
).get()
# The conversion Keras applies to arrays, so that a positioned epoch yields the very same batches.
_sliceable: Callable[..., Any] = Private(
    "keras", f"{_ADAPTERS}.array_slicing", "convert_to_sliceable"
).get()
_jax_compatible: Callable[[Iterator[Any]], Iterator[Any]] = Private(
    "keras", f"{_ADAPTERS}.data_adapter_utils", "get_jax_iterator"
).get()
_ONE_BATCH_AHEAD: Any = inspect.unwrap(
    Private(
        "keras", "keras.src.backend.jax.trainer", "JAXEpochIterator._one_batch_ahead_iterator"
    ).get()
)
# `fit` keeps its EpochIterator in this local; found from a callback hook it runs. `keras.Model.fit`
# is the JAX backend's trainer's own `fit` (named `JAXTrainer` in Keras 3.15, `Trainer` in 3.16).
_FIT = inspect.unwrap(keras.Model.fit)
if "epoch_iterator" not in _FIT.__code__.co_varnames:
    raise unsupported("keras", f"{_FIT.__module__}.{_FIT.__qualname__} (its epoch_iterator)")


def fit_epoch_iterator() -> Any | None:
    """The `EpochIterator` of the `fit` whose callback hook this is called from (its `data_adapter`
    and `steps_per_epoch`); None outside `fit`."""
    frame = inspect.currentframe()
    try:
        while frame is not None:
            if frame.f_code is _FIT.__code__:
                return frame.f_locals.get("epoch_iterator")
            frame = frame.f_back
        return None
    finally:
        del frame


def read_one_batch_ahead(frame: Any) -> bool:
    """Whether `frame`, the frame that asked the adapter's batches for their first one, is Keras's
    `_one_batch_ahead_iterator`: `fit` then reads each batch before the one before it is trained.

    Why private: Keras's `JAXEpochIterator._get_iterator` wraps the adapter's batches in it (to
    start each batch's transfer to the device while the one before trains) on a GPU or TPU
    without a distribution, and says so nowhere else.
    """
    return frame is not None and frame.f_code is _ONE_BATCH_AHEAD.__code__


def replace_batches(adapter: Any, batches: Callable[[], Iterator[Any]]) -> Callable[[], None]:
    """Makes `adapter` yield `batches()` for each epoch `fit` reads; returns what puts it back."""

    def get_jax_iterator(super_batch: int | None = None) -> Iterator[Any]:
        # Keras 3.16 asks for `steps_per_execution` batches stacked into one, as its own adapters
        # stack them (a function 3.15 does not have, so it is resolved only when asked for).
        if not super_batch:
            return batches()
        return _super_batches()(iter(batches()), super_batch, stack_fn=jax.numpy.stack)

    adapter.get_jax_iterator = get_jax_iterator

    def put_back() -> None:
        adapter.__dict__.pop("get_jax_iterator", None)

    return put_back


@functools.cache
def _super_batches() -> Callable[..., Iterator[Any]]:
    return Private("keras", f"{_ADAPTERS}.data_adapter_utils", "super_batch_iterator").get()


def keras_batches(adapter: Any) -> Iterator[Any]:
    """What Keras's own `adapter.get_jax_iterator()` yields (an iterable for grain)."""
    return type(adapter).get_jax_iterator(adapter)


def array_layout(adapter: Any) -> dict[str, Any]:
    """An array adapter's samples, batch size, batches per epoch and `shuffle` argument."""
    return {
        "samples": int(attribute(adapter, "_num_samples")),
        "batch_size": int(attribute(adapter, "_batch_size")),
        "batches": int(attribute(adapter, "_size")),
        "shuffle": attribute(adapter, "_shuffle"),
    }


def array_batches(adapter: Any, start: int) -> Iterator[Any]:
    """The epoch's batches from `start` on, drawing the epoch's permutation from NumPy's global
    generator exactly as `ArrayDataAdapter._get_iterator` does (one `permutation(samples)`, or one
    per batch for `shuffle="batch"`), so the generator is left where Keras would leave it."""
    layout = array_layout(adapter)
    samples, size, shuffle = layout["samples"], layout["batch_size"], layout["shuffle"]
    inputs = _sliceable(attribute(adapter, "_inputs"), target_backend="jax")
    permutation = np.random.permutation(samples) if shuffle and shuffle != "batch" else None
    for i in range(layout["batches"]):
        low, high = i * size, min((i + 1) * size, samples)
        indices: Any = slice(low, high)
        if shuffle == "batch":
            indices = np.random.permutation(high - low) + low
        elif permutation is not None:
            indices = permutation[low:high]
        if i < start:
            continue
        yield keras.tree.map_structure(
            lambda s, at=indices: s.convert_to_jax_compatible(s[at]), inputs, none_is_leaf=False
        )


def py_dataset_layout(adapter: Any) -> dict[str, Any]:
    """A PyDataset adapter's batches per epoch (None: infinite) and `shuffle` argument."""
    return {"batches": adapter.py_dataset.num_batches, "shuffle": bool(adapter.shuffle)}


def py_dataset_order(adapter: Any) -> list[int]:
    """The epoch's batch indices in the order Keras draws them (`random.shuffle` of the indices
    from Python's global generator, as `PyDatasetAdapter._finite_generator` does)."""
    order = list(range(adapter.py_dataset.num_batches))
    if adapter.shuffle:
        random.shuffle(order)
    return order


def py_dataset_batches(adapter: Any, indices: list[int]) -> Iterator[Any]:
    """What Keras's `PyDatasetAdapter.get_jax_iterator()` yields for the batches at `indices`. Not
    for a dataset with workers (`reads_ahead_across_epochs`)."""
    return _jax_compatible(_py_dataset_batches(adapter, indices))


def _py_dataset_batches(adapter: Any, indices: list[int]) -> Iterator[Any]:
    standardize = attribute(adapter, "_standardize_batch")
    for index in indices:
        yield standardize(adapter.py_dataset[index])


def reads_ahead_across_epochs(adapter: Any) -> bool:
    """Whether a PyDataset adapter reads through Keras's `OrderedEnqueuer` (workers): its `stop()`
    keeps the batches its workers read ahead and yields them first in the next epoch, so an epoch's
    batches depend on how far the workers got, not on the epoch alone."""
    return adapter.enqueuer is not None


def batches_per_epoch(adapter: Any) -> int | None:
    """The batches of a grain or tf.data pipeline's epoch, where it says before it is read: a grain
    `MapDataset`'s length, a `tf.data` dataset's cardinality (Keras's grain adapter says None for
    every grain pipeline)."""
    if isinstance(adapter, GrainDatasetAdapter):
        dataset: Any = attribute(adapter, "_dataset")
        return len(dataset) if isinstance(dataset, _grain_map_dataset()) else None
    return adapter.num_batches


def _grain_map_dataset() -> Any:
    import grain

    return grain.MapDataset


# Python's default repr: the class and the object's address, which a new process changes.
_DEFAULT_REPR = re.compile(r"<([\w.]+) object at 0x[0-9a-fA-F]+>")


def grain_loader_state(saved: bytes, fresh: bytes) -> bytes:
    """A grain `DataLoader` iterator's `saved` state, to be given to a new iterator whose own
    state is `fresh`.

    Why: the loader refuses a state whose `repr` of the data source differs from its own; a source
    without its own `__repr__` has Python's, which names its address, so every new process would
    be refused and read the epoch again. Where both are that default repr of the same class, the
    new one is put in the state; the loader still checks its sampler (the records, shuffle and
    seed) and worker count. The state's JSON layout is grain's (`data_loader._DATA_SOURCE`).
    """
    state, current = json.loads(saved), json.loads(fresh)
    before = _DEFAULT_REPR.fullmatch(str(state.get("data_source")))
    now = _DEFAULT_REPR.fullmatch(str(current.get("data_source")))
    if before is not None and now is not None and before.group(1) == now.group(1):
        state["data_source"] = current["data_source"]
    return json.dumps(state).encode()


def tf_batches(adapter: Any, iterator: Iterator[Any]) -> Iterator[Any]:
    """What Keras's `TFDatasetAdapter.get_jax_iterator()` yields (its conversion of each batch),
    read from `iterator`, a `tf.data` iterator of the adapter's dataset made (and restored) by the
    caller: the adapter iterates its `_dataset` when its generator starts, so that is `iterator`
    until the first batch is read."""
    original = attribute(adapter, "_dataset")
    set_attribute(adapter, "_dataset", _Iterated(iterator))
    try:
        batches = keras_batches(adapter)
        first = next(batches)
    except StopIteration:
        return
    finally:
        set_attribute(adapter, "_dataset", original)
    yield first
    yield from batches


def tf_dataset(adapter: Any) -> Any:
    """The `tf.data.Dataset` a `TFDatasetAdapter` reads (distributed by Keras where it does)."""
    return attribute(adapter, "_dataset")


class _Iterated:
    """An iterable whose iterator is one already made."""

    def __init__(self, iterator: Iterator[Any]) -> None:
        self.iterator = iterator

    def __iter__(self) -> Iterator[Any]:
        return self.iterator


def drop_train_steps(
    model: keras.Model, executions: int, logs: dict[str, Any], *, read: bool = True
) -> Callable[[], None]:
    """Makes `fit`'s next `executions` train steps drop the batches they were given (with `read`
    False: they read none; the input was positioned past them, `training/input_position.py`).

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
        if not read:
            return logs, state
        next(iterator)  # StopIteration ends the epoch, as in Keras's own step
        for _ in range(model.steps_per_execution - 1):
            if next(iterator, None) is None:
                break
        return logs, state

    if executions > 0:
        model.train_function = drop
    return put_back
