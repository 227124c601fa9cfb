"""Where `fit` is in its input: saved with every step `ModelCheckpoint` writes, and put back when
`fit` resumes, so that the first batch trained is the first one not trained before and no earlier
batch is read (docs/resuming.md).

What a position holds, per kind of input (`format/data_state.py`):
- arrays (NumPy, `jax.Array`): the batch; with `shuffle=True`, NumPy's global generator as the
  epoch began, from which Keras draws the epoch's permutation (`np.random.permutation`): set again
  on resume, it draws the same permutation, and leaves the generator where the uninterrupted run
  left it for the next epochs.
- `keras.utils.PyDataset`: the batch; with `shuffle=True`, Python's global generator as the epoch
  began (Keras shuffles the batch indices with `random.shuffle`).
- grain (`MapDataset`, `IterDataset`, `DataLoader`): the iterator's own `get_state()` after the
  last batch trained, given back with `set_state()`.
- `tf.data.Dataset`: the iterator's own checkpoint (`tf.train.Checkpoint(iterator=...)`).
- anything else (a Python generator, a torch `DataLoader`, a `PyDataset` with workers): no
  position; resuming mid-epoch reads and drops the trained batches, with a warning.
"""

from __future__ import annotations

import base64
import random
import warnings
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from keras_orbax._src.compat import data_compat
from keras_orbax._src.format import data_state
from keras_orbax._src.model.matching import counted
from keras_orbax._src.training import tf_iterator_state
from keras_orbax.errors import CorruptCheckpointError, KerasOrbaxWarning

_STATES_KEPT = 8  # grain states kept per epoch: Keras reads at most one batch ahead
_ITERATED = ("grain", "tf_data")  # kinds whose position is their iterator's own state


class DataPosition:
    """The position of one `fit`'s input. Make it in `on_train_begin` (`of_fit`), call
    `begin_epoch` from `on_epoch_begin`, `state` for each save, and `close` when `fit` ends.

    Example (what `ModelCheckpoint` does):

        position = DataPosition.of_fit()               # on_train_begin
        positioned = position.resume_at(saved, epoch=2, batch=8)
        position.begin_epoch(2)                        # reads from batch 8 on
        state = position.state(epoch=2, batch=10)      # saved with the step
    """

    def __init__(self, epoch_iterator: Any) -> None:
        self._adapter = None if epoch_iterator is None else epoch_iterator.data_adapter
        self.kind, self._why_not = _kind(epoch_iterator)
        self._layout = _layout(self.kind, self._adapter)
        self._rng_at_epoch_begin: Any = None
        self._resume: tuple[int, int, dict[str, Any]] | None = None
        self._iterator_start: tuple[int, int, Any] | None = None  # epoch, batch, saved state
        self._iterator: Any = None
        self._reads = 0
        self._grain_states: dict[int, Any] = {}
        self._put_back = None
        if self.kind in _ITERATED:
            self._put_back = data_compat.replace_batches(self._adapter, self._iterated_batches)

    @classmethod
    def of_fit(cls) -> DataPosition:
        """The position of the input of the `fit` this is called from (in a callback hook)."""
        return cls(data_compat.fit_epoch_iterator())

    # -- resume ----------------------------------------------------------------------------------

    def resume_from(self, step_dir: Any, *, epoch: int, batch: int) -> bool:
        """Sets `fit`'s input to go on at batch `batch` of epoch `epoch`, from the position this
        process saved in the step at `step_dir`; whether it can (see `resume_at`)."""
        try:
            saved = data_state.read(step_dir, jax.process_index())
        except CorruptCheckpointError as error:
            return self.resume_at(None, epoch=epoch, batch=batch, why_not=str(error))
        return self.resume_at(saved, epoch=epoch, batch=batch)

    def resume_at(
        self,
        saved: dict[str, Any] | None,
        *,
        epoch: int,
        batch: int,
        why_not: str | None = None,
    ) -> bool:
        """Sets `fit`'s input to go on at batch `batch` of epoch `epoch` from `saved` (what `state`
        gave when the step was saved); whether it can. If not, warns once: resuming mid-epoch
        then reads and drops the trained batches, and a shuffled epoch may differ."""
        why_not = (
            why_not or self._why_not or _mismatch(self.kind, self._layout, saved, epoch, batch)
        )
        if why_not is None:
            assert saved is not None, "_mismatch refuses a missing position"
            self._resume = (epoch, batch, saved)
            return True
        if batch or (saved or {}).get("rng") is not None:
            drops = f"reads and drops the first {counted(batch, 'batch', 'batches')} of its epoch"
            warnings.warn(
                f"fit's input cannot be put back where the checkpoint left it: {why_not}. fit "
                f"resumes at epoch {epoch + 1}, batch {batch} as before positions were saved: it "
                + (f"{drops}, which must be the batches trained then." if batch else "")
                + ("" if batch else "starts the epoch with a new shuffle, if any."),
                KerasOrbaxWarning,
                stacklevel=3,
            )
        return False

    def begin_epoch(self, epoch: int) -> None:
        """Call from `on_epoch_begin`: in the resumed epoch, puts the input at its saved batch."""
        if self._resume is not None and self._resume[0] == epoch:
            _, batch, saved = self._resume
            self._resume = None
            _set_rng(self.kind, saved.get("rng"))
            if self.kind in _ITERATED:
                iterator = saved.get("iterator")
                self._iterator_start = (
                    None if iterator is None else (epoch, batch, _decoded(iterator))
                )
            elif batch:
                self._position_once(batch)
        self._rng_at_epoch_begin = _get_rng(self.kind, self._layout)

    def _position_once(self, batch: int) -> None:
        adapter = self._adapter
        batches = (
            data_compat.array_batches if self.kind == "arrays" else data_compat.py_dataset_batches
        )

        def positioned() -> Iterator[Any]:
            put_back()  # the next epochs read as Keras does
            return batches(adapter, batch)

        put_back = data_compat.replace_batches(adapter, positioned)

    # -- saving ----------------------------------------------------------------------------------

    def state(self, *, epoch: int, batch: int | None) -> dict[str, Any]:
        """The position to save with a step recording `epoch` and `batch` (None: the epoch's start)."""
        state: dict[str, Any] = {
            "kind": self.kind,
            "epoch": epoch,
            "batch": batch or 0,
            "layout": self._layout,
        }
        # Mid-epoch, the generator the epoch's shuffle was drawn from; at an epoch's start, the
        # one the next epoch's shuffle will be drawn from.
        rng = self._rng_at_epoch_begin if batch else _get_rng(self.kind, self._layout)
        if rng is not None:
            state["rng"] = rng
        if self.kind in _ITERATED and batch:
            iterator = self._iterator_state(batch)
            if iterator is not None:
                state["iterator"] = _encoded(iterator)
        return state

    def close(self) -> None:
        """Gives `fit`'s input back its own way of reading batches."""
        if self._put_back is not None:
            self._put_back()
            self._put_back = None

    # -- grain and tf.data: the iterator's own state -------------------------------------------

    def _iterated_batches(self) -> Iterator[Any]:
        """The epoch's batches through the pipeline's own iterator, whose state is noted (grain:
        after each read) or kept at hand (tf.data: its checkpoint is written at a save)."""
        iterator: Any
        if self.kind == "grain":
            iterator = batches = iter(data_compat.keras_batches(self._adapter))
        else:
            iterator = iter(data_compat.tf_dataset(self._adapter))
            batches = data_compat.tf_batches(self._adapter, iterator)
        self._iterator, self._reads, self._grain_states = iterator, 0, {}
        if self._iterator_start is not None:
            (epoch, reads, saved), self._iterator_start = self._iterator_start, None
            try:
                _restore_iterator(self.kind, iterator, saved)
                self._reads = reads
            except Exception as error:  # the pipeline's own check refused it: another pipeline
                self.resume_at(None, epoch=epoch, batch=reads, why_not=f"it was refused: {error}")
                for _ in range(reads):  # read and dropped, as for an input without a position
                    next(batches, None)
                self._reads = reads
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                return
            self._reads += 1
            if self.kind == "grain":
                self._grain_states[self._reads] = iterator.get_state()
                self._grain_states.pop(self._reads - _STATES_KEPT, None)
            yield batch

    def _iterator_state(self, batch: int) -> Any:
        """The iterator's state after `batch` batches of this epoch; None if not known (Keras
        read ahead of the batches trained)."""
        if self.kind == "grain":
            return self._grain_states.get(batch)
        if self.kind == "tf_data" and self._iterator is not None and self._reads == batch:
            return tf_iterator_state.save(self._iterator)
        return None


def _restore_iterator(kind: str, iterator: Any, saved: Any) -> None:
    if kind == "grain":
        iterator.set_state(saved)
    else:
        tf_iterator_state.restore(iterator, saved)


def _kind(epoch_iterator: Any) -> tuple[str, str | None]:
    """The kind of input, and why it cannot be positioned (None: it can)."""
    adapter: Any
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


def _layout(kind: str, adapter: Any) -> dict[str, Any]:
    """What must be the same for a saved position to mean the same batches."""
    if kind == "arrays":
        layout = data_compat.array_layout(adapter)
        layout["shuffle"] = (
            str(layout["shuffle"]) if layout["shuffle"] == "batch" else bool(layout["shuffle"])
        )
        return layout
    if kind == "py_dataset":
        return data_compat.py_dataset_layout(adapter)
    if kind in _ITERATED:
        return {"batches": adapter.num_batches}
    return {}


def _mismatch(
    kind: str, layout: dict[str, Any], saved: dict[str, Any] | None, epoch: int, batch: int
) -> str | None:
    """Why `saved` cannot position this input at (`epoch`, `batch`); None if it can."""
    if saved is None:
        return "the step holds no input position for this process (saved by an older keras-orbax)"
    if saved.get("kind") != kind:
        return f"the step was saved reading {saved.get('kind')}, this fit reads {kind}"
    if (saved.get("epoch"), saved.get("batch")) != (epoch, batch):
        return f"its position (epoch {saved.get('epoch')}, batch {saved.get('batch')}) is not the step's"
    if saved.get("layout") != layout:
        return f"the input changed: saved {saved.get('layout')}, now {layout}"
    if kind in _ITERATED and batch and saved.get("iterator") is None:
        return f"the step holds no {kind} iterator state (Keras read ahead of the batch trained)"
    return None


def _get_rng(kind: str, layout: dict[str, Any]) -> Any:
    """The global generator this kind's shuffle draws from, JSON-safe; None if it does not shuffle."""
    if not layout.get("shuffle"):
        return None
    if kind == "arrays":
        name, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
        return [name, np.asarray(keys).tolist(), int(pos), int(has_gauss), float(gauss)]
    if kind == "py_dataset":
        version, internal, gauss = random.getstate()
        return [version, list(internal), gauss]
    return None


def _set_rng(kind: str, rng: Any) -> None:
    if rng is None:
        return
    if kind == "arrays":
        name, keys, pos, has_gauss, gauss = rng
        np.random.set_state((name, np.asarray(keys, np.uint32), pos, has_gauss, gauss))
    elif kind == "py_dataset":
        version, internal, gauss = rng
        random.setstate((version, tuple(internal), gauss))


def _encoded(state: Any) -> Any:
    """A grain iterator state, JSON-safe (a `DataLoader`'s is bytes, a dataset iterator's a dict)."""
    if isinstance(state, bytes):
        return {"bytes": base64.b64encode(state).decode("ascii")}
    return {"value": state}


def _decoded(encoded: dict[str, Any]) -> Any:
    if "bytes" in encoded:
        return base64.b64decode(encoded["bytes"])
    return encoded["value"]
