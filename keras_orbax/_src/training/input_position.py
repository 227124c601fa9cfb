"""Where `fit` is in its input, and where a resumed `fit` goes on: the one place that decides
whether a resumed epoch's input is put past the batches trained before (from the position saved
with the step; what it holds per kind of input: `input_kinds`) or reads and drops them
(`dropped_steps`), and that warns where that is not exact (docs/resuming.md).

```python
position = InputPosition.of_fit()                          # on_train_begin
position.resume_from(model, step_dir, record, steps_per_epoch=4)   # after the restore
position.begin_epoch(model, 2)                             # on_epoch_begin: from batch 8 on
position.dropped(2, 3)                                     # a batch trained before the checkpoint
state = position.state(epoch=2, batch=10)                  # saved with the step
position.close()                                           # when fit ends
```
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import keras

from keras_orbax._src.compat import data_compat
from keras_orbax._src.format import data_state
from keras_orbax._src.model.matching import counted
from keras_orbax._src.training import input_kinds
from keras_orbax._src.training.dropped_steps import DroppedSteps
from keras_orbax._src.training.input_kinds import ITERATED
from keras_orbax.errors import CorruptCheckpointError, KerasOrbaxWarning

_STATES_KEPT = 8  # iterator states kept per epoch: Keras reads at most one batch ahead


@dataclasses.dataclass
class FitProgress:
    """The global step (batches trained, counted across restarts), the 0-based epoch `fit` is in,
    and the last batch of it trained (None before the first)."""

    step: int = 0
    epoch: int = 0
    last_batch: int | None = None

    def begin_epoch(self, epoch: int) -> None:
        self.epoch, self.last_batch = epoch, None

    def end_batch(self, batch: int) -> int:
        """Counts batch `batch` of the epoch as trained; returns the step before it."""
        previous = self.step
        self.step += batch + 1 if self.last_batch is None else batch - self.last_batch
        self.last_batch = batch
        return previous

    def step_after(self, batches: int) -> int:
        """The global step once `batches` batches of this epoch are trained."""
        done = 0 if self.last_batch is None else self.last_batch + 1
        return self.step + batches - done

    def position(self, at_epoch_end: bool, steps: int | None) -> tuple[int, int | None]:
        """(epoch, batch) to record: the next epoch to run, or the batches done in this one.

        After a batch, the epoch is done only if that was its known last batch (`steps` per
        epoch; a generator's length is unknown: its epoch counts as unfinished). At an epoch's end,
        it is done unless it stopped before its known number of batches (another callback stopped
        `fit`).
        """
        done = 0 if self.last_batch is None else self.last_batch + 1
        finished = (
            (steps is None or done >= steps)
            if at_epoch_end
            else (steps is not None and done >= steps)
        )
        return (self.epoch + 1, None) if finished else (self.epoch, done)


class InputPosition:
    """The position of one `fit`'s input. Make it in `on_train_begin` (`of_fit`); see the module.

    `save_may_follow(batches)` says whether a save may follow the batch that makes `batches`
    batches of the epoch trained: under Keras's one-batch-ahead reading, a `tf.data` iterator's
    checkpoint is taken before the read that such a save follows.
    """

    def __init__(
        self, epoch_iterator: Any, save_may_follow: Callable[[int], bool] = lambda _: False
    ) -> None:
        self._adapter: Any = None if epoch_iterator is None else epoch_iterator.data_adapter
        self.kind, self._why_not = input_kinds.kind_of(epoch_iterator)
        self._layout = input_kinds.layout(self.kind, self._adapter)
        self._save_may_follow = save_may_follow
        self._order_at_epoch_begin: dict[str, Any] = {}
        self._resume: tuple[int, int, dict[str, Any]] | None = None
        self._start: tuple[int, int, dict[str, Any] | None] | None = None  # epoch, batch, saved
        self._drops: DroppedSteps | None = None
        self._iterator: Any = None
        self._reads = 0
        self._states: dict[int, Any] = {}  # iterator states by batches read
        self._batch_size: int | None = None  # a PyDataset's, once a full batch is read
        self._epoch_length: int | None = None  # batches of a whole epoch read, where not declared
        self._put_back = None
        if self.kind in ITERATED or (self.kind == "py_dataset" and self._why_not is None):
            self._put_back = data_compat.replace_batches(self._adapter, self._epoch_batches)

    @classmethod
    def of_fit(cls, save_may_follow: Callable[[int], bool] = lambda _: False) -> InputPosition:
        """The position of the input of the `fit` this is called from (in a callback hook)."""
        return cls(data_compat.fit_epoch_iterator(), save_may_follow)

    # -- resume ----------------------------------------------------------------------------------

    def resume_from(
        self, model: keras.Model, step_dir: Path, record: Any, *, steps_per_epoch: int | None
    ) -> bool:
        """Sets `fit` to go on at the epoch and batch of the step at `step_dir` (restored into
        `model` already); whether its input is put there (True) or reads and drops the batches
        trained before (False, with a warning saying why, where that is not exact)."""
        epoch, batch = record.epoch, record.batch or 0
        try:
            saved = data_state.read(step_dir, jax.process_index())
            why_not = None
        except CorruptCheckpointError as error:
            saved, why_not = None, str(error)
        positioned = self._resume_at(saved, epoch=epoch, batch=batch, why_not=why_not)
        saved_steps = record.extra.get("steps_per_epoch")
        if not positioned and batch and steps_per_epoch not in (None, saved_steps) and saved_steps:
            _warn_other_epochs(step_dir, batch, epoch, saved_steps, steps_per_epoch)
        self._drops = DroppedSteps(model, epoch, batch, read=not positioned, logs=_logs_in(saved))
        return positioned

    def _resume_at(
        self, saved: dict[str, Any] | None, *, epoch: int, batch: int, why_not: str | None
    ) -> bool:
        why_not = (
            why_not or self._why_not or _mismatch(self.kind, self._layout, saved, epoch, batch)
        )
        if why_not is None:
            assert saved is not None, "_mismatch refuses a missing position"
            self._warn_if_reordered(saved, epoch, batch)
            self._resume = (epoch, batch, saved)
            return True
        if batch or (saved or {}).get("rng") is not None:
            _warn_not_positioned(why_not, epoch, batch)
        return False

    def _warn_if_reordered(self, saved: dict[str, Any], epoch: int, batch: int) -> None:
        """A PyDataset that orders itself in its epoch hooks is exact only from its own state."""
        # Even in epoch 0 (whose order Keras's reset before training drew in both runs), a hook
        # that draws from a global or unseeded generator draws otherwise in a new process.
        if self.kind != "py_dataset" or not (epoch or batch):
            return
        dataset = self._adapter.py_dataset
        if not input_kinds.reorders_itself(dataset) or saved.get("dataset") is not None:
            return
        name = type(dataset).__name__
        warnings.warn(
            f"{name} defines its own on_epoch_end or on_epoch_begin, which may reorder it, and the "
            f"step holds no state of it: fit resumes at epoch {epoch + 1}, batch {batch} in the "
            f"order this new {name} gives, which may be other samples than the checkpoint's run "
            f"trained there. Define {name}.get_state() (JSON-safe: what orders it, e.g. its "
            "generator's state) and set_state(state): keras-orbax then saves it with each step "
            "and puts it back.",
            KerasOrbaxWarning,
            stacklevel=4,
        )

    def begin_epoch(self, model: keras.Model, epoch: int) -> None:
        """Call from `on_epoch_begin`: in the resumed epoch, drops the batches trained before and
        puts the input at its saved batch."""
        if self._drops is not None:
            self._drops.begin_epoch(model, epoch)
        if self._resume is not None and self._resume[0] == epoch:
            _, batch, saved = self._resume
            self._resume = None
            input_kinds.set_epoch_order(self.kind, saved, self._adapter)
            self._start = (epoch, batch, saved)
            if self.kind == "arrays" and batch:
                self._position_arrays_once(batch)
        self._order_at_epoch_begin = input_kinds.epoch_order(self.kind, self._layout, self._adapter)

    def dropped(self, epoch: int, batch: int) -> bool:
        """Whether batch `batch` (0-based, as in `on_train_batch_end`) of `epoch` was trained
        before the checkpoint, and dropped now."""
        return self._drops is not None and self._drops.dropped(epoch, batch)

    def end_epoch(self) -> None:
        """Call from `on_epoch_end`: the input may have ended before the dropped batches did."""
        if self._drops is not None:
            self._drops.close()

    def _position_arrays_once(self, batch: int) -> None:
        adapter = self._adapter

        def positioned() -> Iterator[Any]:
            put_back()  # the next epochs read as Keras does
            return data_compat.array_batches(adapter, batch)

        put_back = data_compat.replace_batches(adapter, positioned)

    # -- saving ----------------------------------------------------------------------------------

    def state(
        self, *, epoch: int, batch: int | None, logs: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """The position to save with a step recording `epoch` and `batch` (None: the epoch's
        start); mid-epoch, with the `logs` `fit` reported after that batch."""
        state: dict[str, Any] = {
            "kind": self.kind,
            "epoch": epoch,
            "batch": batch or 0,
            "layout": self._layout,
        }
        if batch and logs and all(_finite(v) for v in logs.values()):
            # The resumed epoch's dropped batches report them again, rather than computing the
            # metrics' results before its first batch (a compile of their ops, in a fresh process).
            state["logs"] = dict(logs)
        if self._batch_size is not None:
            state["batch_size"] = self._batch_size
        if self._epoch_length is not None:
            state["epoch_length"] = self._epoch_length
        # Mid-epoch, what the epoch's order was drawn from; at an epoch's start, what the next
        # epoch's order will be drawn from.
        state.update(
            self._order_at_epoch_begin
            if batch
            else input_kinds.epoch_order(self.kind, self._layout, self._adapter)
        )
        if self.kind in ITERATED and batch:
            iterator = self._iterator_state(batch)
            if iterator is not None:
                state["iterator"] = iterator
        return state

    def known_at(self, batch: int) -> bool:
        """Whether `state` knows the position after `batch` batches of this epoch exactly."""
        if self.kind not in ITERATED or self._why_not is not None:
            return True  # positioned by index, or never (its resume reads and drops, and says so)
        return self._reads == batch or batch in self._states

    def close(self) -> None:
        """Gives `fit`'s input back its own way of reading batches, and `fit` its train step."""
        if self._put_back is not None:
            self._put_back()
            self._put_back = None
        if self._drops is not None:
            self._drops.close()
            self._drops = None

    # -- reading an epoch ------------------------------------------------------------------------

    def _epoch_batches(self) -> Iterator[Any]:
        """The epoch's batches, from the saved batch on in the resumed epoch: a PyDataset by
        index, grain and tf.data through the pipeline's own iterator, whose state is noted."""
        (epoch, start, saved), self._start = self._start or (0, 0, None), None
        if self.kind == "py_dataset":
            yield from self._py_dataset_batches(start, saved)
            return
        iterator, batches = input_kinds.iterated(self.kind, self._adapter)
        self._iterator, self._reads, self._states = iterator, 0, {}
        # Where Keras reads ahead (this generator's caller), a tf.data iterator is one batch past
        # the batches trained at a save: its checkpoint is taken before the read.
        caller = inspect.currentframe()
        snapshots = self.kind == "tf_data" and data_compat.read_one_batch_ahead(
            caller.f_back if caller is not None else None
        )
        del caller
        if start and saved is not None:
            try:
                input_kinds.restore_iterator(self.kind, iterator, saved["iterator"])
            except Exception as error:  # the pipeline's own check refused it: another pipeline
                _warn_not_positioned(f"it was refused: {error}", epoch, start)
                for _ in range(start):  # read and dropped, as for an input without a position
                    next(batches, None)
            self._reads = start
        while True:
            if snapshots and self._save_may_follow(self._reads):
                self._states[self._reads] = input_kinds.iterator_state(self.kind, iterator)
            try:
                batch = next(batches)
            except StopIteration:
                self._end_of_epoch(epoch, start, saved)
                return
            self._reads += 1
            if self.kind == "grain":
                self._states[self._reads] = iterator.get_state()
            self._states.pop(self._reads - _STATES_KEPT, None)
            yield batch

    def _end_of_epoch(self, epoch: int, start: int, saved: dict[str, Any] | None) -> None:
        """Notes how many batches a whole epoch has, where the pipeline does not say before it is
        read (a grain `IterDataset` or `DataLoader`): a resumed epoch of another length warns."""
        if self._layout.get("batches") is not None:
            return
        expected = (saved or {}).get("epoch_length") if start else None
        if expected not in (None, self._reads):
            warnings.warn(
                f"The resumed epoch {epoch + 1} of fit's {self.kind} input had {self._reads} "
                f"batches, the epochs of the checkpoint's run {expected}: the input changed, so "
                f"its position (batch {start}) stood for other samples, and this epoch trained "
                "others than an uninterrupted run. Resume mid-epoch with the same input.",
                KerasOrbaxWarning,
                stacklevel=2,
            )
        self._epoch_length = self._reads

    def _py_dataset_batches(self, start: int, saved: dict[str, Any] | None) -> Iterator[Any]:
        order = data_compat.py_dataset_order(self._adapter)[start:]
        last = self._layout["batches"] - 1
        batches = data_compat.py_dataset_batches(self._adapter, order)
        for index, batch in zip(order, batches, strict=True):
            if index != last and self._batch_size is None:
                self._batch_size = input_kinds.batch_size(batch)
                saved_size = (saved or {}).get("batch_size")
                if start and saved_size not in (None, self._batch_size):
                    _warn_other_batch_size(saved_size, self._batch_size)
            yield batch

    def _iterator_state(self, batch: int) -> Any:
        """The iterator's state after `batch` batches of this epoch, JSON-safe; None if not known
        (Keras read ahead of the batches trained, and no save was due there)."""
        if self.kind == "tf_data" and self._iterator is not None and self._reads == batch:
            return input_kinds.iterator_state(self.kind, self._iterator)
        state = self._states.get(batch)
        if state is None or self.kind == "tf_data":
            return state
        return input_kinds.encoded(state)


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
    if kind in ITERATED and batch and saved.get("iterator") is None:
        return f"the step holds no {kind} iterator state (Keras read ahead of the batch trained)"
    return None


def _warn_not_positioned(why_not: str, epoch: int, batch: int) -> None:
    drops = f"reads and drops the first {counted(batch, 'batch', 'batches')} of its epoch"
    warnings.warn(
        f"fit's input cannot be put back where the checkpoint left it: {why_not}. fit resumes at "
        f"epoch {epoch + 1}, batch {batch} as before positions were saved: it "
        + (f"{drops}, which must be the batches trained then." if batch else "")
        + ("" if batch else "starts the epoch with a new shuffle, if any."),
        KerasOrbaxWarning,
        stacklevel=5,
    )


def _warn_other_epochs(step_dir: Path, batch: int, epoch: int, saved: int, now: int) -> None:
    """The batches a mid-epoch resume drops are counted, not recognized."""
    warnings.warn(
        f"Step {step_dir.name} of '{step_dir.parent}' was saved after batch {batch} of an epoch of "
        f"{counted(saved, 'batch', 'batches')}; this fit's epochs have {now}. It drops the first "
        f"{counted(batch, 'batch', 'batches')} of its epoch {epoch + 1} as trained already, which "
        "are other samples than the checkpoint trained (another batch size or dataset): resume "
        "mid-epoch with the same batches.",
        KerasOrbaxWarning,
        stacklevel=5,
    )


def _warn_other_batch_size(saved: int, now: int | None) -> None:
    warnings.warn(
        f"The PyDataset's batches hold {now} samples, those of the checkpoint's run {saved}: its "
        "saved position (a batch index) now stands for other samples, so the resumed epoch "
        "trains other samples than an uninterrupted run. Resume mid-epoch with the same batch "
        "size.",
        KerasOrbaxWarning,
        stacklevel=2,
    )


def _finite(value: Any) -> bool:
    return isinstance(value, float) and math.isfinite(value)


def _logs_in(saved: dict[str, Any] | None) -> dict[str, float] | None:
    """The logs a position was saved with, where they are what `state` writes; else None."""
    logs = (saved or {}).get("logs")
    if not isinstance(logs, dict) or not logs:
        return None
    if not all(isinstance(k, str) and _finite(v) for k, v in logs.items()):
        return None
    return logs
