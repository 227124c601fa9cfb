"""What an input position holds, per kind of input (`input_position` decides when each is used).

- arrays (NumPy, `jax.Array`): the batch; with `shuffle=True`, NumPy's global generator as the
  epoch began, from which Keras draws the epoch's permutation (`np.random.permutation`): set again
  on resume, it draws the same permutation, and leaves the generator where the uninterrupted run
  left it for the next epochs.
- `keras.utils.PyDataset`: the batch; with `shuffle=True`, Python's global generator as the epoch
  began (Keras shuffles the batch indices with `random.shuffle`); a dataset that defines
  `get_state()`/`set_state(state)` (as grain's iterators do), its own state as the epoch began: a
  dataset that reorders itself in `on_epoch_end`/`on_epoch_begin` is then put back in its order.
- grain (`MapDataset`, `IterDataset`, `DataLoader`): the iterator's own `get_state()` after the
  last batch trained, given back with `set_state()`.
- `tf.data.Dataset`: the iterator's own checkpoint (`tf.train.Checkpoint(iterator=...)`).
"""

from __future__ import annotations

import base64
import json
import random
import warnings
from collections.abc import Iterator
from typing import Any

import keras
import numpy as np

from keras_orbax._src.compat import data_compat
from keras_orbax._src.training import tf_iterator_state
from keras_orbax.errors import KerasOrbaxWarning

ITERATED = ("grain", "tf_data")  # kinds whose position is their iterator's own state


def iterated(kind: str, adapter: Any) -> tuple[Any, Iterator[Any]]:
    """A new iterator of the pipeline, and the batches Keras makes of what it yields."""
    if kind == "grain":
        iterator = iter(data_compat.keras_batches(adapter))
        return iterator, iterator
    iterator = iter(data_compat.tf_dataset(adapter))
    return iterator, data_compat.tf_batches(adapter, iterator)


def kind_of(epoch_iterator: Any) -> tuple[str, str | None]:
    """The kind of input, and why it cannot be positioned (None: it can)."""
    if epoch_iterator is None:
        return "generator", "the callback was not called from fit"
    adapter = epoch_iterator.data_adapter
    own_epochs = epoch_iterator.steps_per_epoch in (None, adapter.num_batches)
    if isinstance(adapter, data_compat.ArrayDataAdapter):
        kind = "arrays"
    elif isinstance(adapter, data_compat.PyDatasetAdapter):
        if adapter.py_dataset.num_batches is None:
            return "py_dataset", "an infinite PyDataset (num_batches is None) has no epochs"
        if data_compat.reads_ahead_across_epochs(adapter):
            return "py_dataset", (
                "a PyDataset with workers is read through Keras's OrderedEnqueuer, which carries "
                "the batches its workers read ahead into the next epoch"
            )
        kind = "py_dataset"
    elif isinstance(adapter, data_compat.GrainDatasetAdapter):
        kind = "grain"
    elif isinstance(adapter, data_compat.TFDatasetAdapter):
        kind = "tf_data"
    else:
        return "generator", "a Python generator has no position keras-orbax can save"
    if not own_epochs and adapter.num_batches is None:  # keras-hub's fit builds such an input
        return kind, (
            f"fit reads its epochs of {epoch_iterator.steps_per_epoch} batches (steps_per_epoch, "
            "passed to fit or declared by keras-hub's fit) from one iterator over an input of no "
            "length Keras knows, which keras-orbax cannot position"
        )
    if not own_epochs:
        return kind, (
            f"fit(steps_per_epoch={epoch_iterator.steps_per_epoch}) reads across the input's own "
            f"epochs of {adapter.num_batches} batches"
        )
    return kind, None


def layout(kind: str, adapter: Any) -> dict[str, Any]:
    """What must be the same for a saved position to mean the same batches: the number of batches
    per epoch and the batch size (None where the input does not say before it is read), and what
    orders them."""
    if kind == "arrays":
        layout = data_compat.array_layout(adapter)
        layout["shuffle"] = (
            str(layout["shuffle"]) if layout["shuffle"] == "batch" else bool(layout["shuffle"])
        )
        return layout
    if kind == "py_dataset":
        return data_compat.py_dataset_layout(adapter)
    if kind in ITERATED:
        return {"batches": data_compat.batches_per_epoch(adapter), "batch_size": adapter.batch_size}
    return {}


def batch_size(batch: Any) -> int | None:
    """The leading dimension of a batch's first array."""
    leaves = keras.tree.flatten(batch)
    shape = getattr(leaves[0], "shape", None) if leaves else None
    return int(shape[0]) if shape else None


# -- what an epoch's order is drawn from ---------------------------------------------------------


def reorders_itself(dataset: keras.utils.PyDataset) -> bool:
    """Whether a PyDataset has its own `on_epoch_end` or `on_epoch_begin` (which may reorder it)."""
    base = keras.utils.PyDataset
    return any(
        getattr(type(dataset), hook) is not getattr(base, hook)
        for hook in ("on_epoch_end", "on_epoch_begin")
    )


def has_own_state(dataset: Any) -> bool:
    """Whether a PyDataset opts in to being positioned by its own state (`get_state`/`set_state`)."""
    return callable(getattr(dataset, "get_state", None)) and callable(
        getattr(dataset, "set_state", None)
    )


def epoch_order(kind: str, layout: dict[str, Any], adapter: Any) -> dict[str, Any]:
    """What the order of the epoch about to start is drawn from, JSON-safe: the global generator
    Keras's shuffle draws from, and a PyDataset's own state where it has one."""
    order: dict[str, Any] = {}
    if layout.get("shuffle"):
        order["rng"] = _get_rng(kind)
    if kind == "py_dataset" and has_own_state(adapter.py_dataset):
        state = _own_state(adapter.py_dataset)
        if state is not None:
            order["dataset"] = state
    return order


def set_epoch_order(kind: str, saved: dict[str, Any], adapter: Any) -> None:
    """Draws the next epoch's order as from `saved` (what `epoch_order` gave)."""
    if saved.get("rng") is not None:
        _set_rng(kind, saved["rng"])
    if saved.get("dataset") is not None:
        adapter.py_dataset.set_state(saved["dataset"])


def _own_state(dataset: Any) -> Any:
    """`dataset.get_state()`; None (with a warning) if it is not JSON-safe."""
    state = dataset.get_state()
    try:
        json.dumps(state)
    except (TypeError, ValueError) as error:
        name = type(dataset).__name__
        warnings.warn(
            f"{name}.get_state() returned a {type(state).__name__} that is not JSON-safe "
            f"({error}): the steps hold no state of {name}, and a resume mid-run "
            "reads it in the order a new one gives. Return dicts, lists, strings and numbers "
            "(e.g. `array.tolist()`, `generator.bit_generator.state`).",
            KerasOrbaxWarning,
            stacklevel=2,
        )
        return None
    return state


def _get_rng(kind: str) -> Any:
    if kind == "arrays":
        name, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
        return [name, np.asarray(keys).tolist(), int(pos), int(has_gauss), float(gauss)]
    if kind == "py_dataset":
        version, internal, gauss = random.getstate()
        return [version, list(internal), gauss]
    return None


def _set_rng(kind: str, rng: Any) -> None:
    if kind == "arrays":
        name, keys, pos, has_gauss, gauss = rng
        np.random.set_state((name, np.asarray(keys, np.uint32), pos, has_gauss, gauss))
    elif kind == "py_dataset":
        version, internal, gauss = rng
        random.setstate((version, tuple(internal), gauss))


# -- grain and tf.data: the iterator's own state -------------------------------------------------


def iterator_state(kind: str, iterator: Any) -> Any:
    """The iterator's own state, JSON-safe (tf.data's: its checkpoint's files)."""
    if kind == "tf_data":
        return tf_iterator_state.save(iterator)
    return encoded(iterator.get_state())


def encoded(state: Any) -> dict[str, Any]:
    """A grain iterator's state, JSON-safe (a `DataLoader`'s is bytes, a dataset iterator's a dict)."""
    if isinstance(state, bytes):
        return {"bytes": base64.b64encode(state).decode("ascii")}
    return {"value": state}


def restore_iterator(kind: str, iterator: Any, saved: Any) -> None:
    """Puts a new iterator of the pipeline where `iterator_state` found the saved one.

    Raises:
        Exception: the pipeline's own check refused the state (another pipeline).
    """
    if kind == "tf_data":
        tf_iterator_state.restore(iterator, saved)
    elif "bytes" in saved:  # a DataLoader's
        state = base64.b64decode(saved["bytes"])
        iterator.set_state(data_compat.grain_loader_state(state, iterator.get_state()))
    else:
        iterator.set_state(saved["value"])
