"""The writing side of `ModelCheckpoint`: one directory's checkpointer, its saves (in the
background or not), retention's deletions once a step is durable, and what a failure leaves.

The callback decides when to save and what to record; `Saves` writes and commits. Every error it
raises is a `KerasOrbaxError` (`SaveFailedError` naming the last committed step, or the writer's
own, e.g. `StepLockedError`), raised after it has closed itself: Orbax re-raises a failure at
every later save, and `fit` calls no `on_train_end` once a callback has raised.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Callable
from typing import Any, NoReturn

import jax
import keras
import orbax.checkpoint.experimental.v1 as ocp

from keras_orbax._src.compat import keras_compat
from keras_orbax._src.format import step_dirs
from keras_orbax._src.format.step_record import STATE
from keras_orbax._src.model import state_keys
from keras_orbax._src.runtime import gc_pause, multihost, quiet
from keras_orbax._src.storage import locations, recycled_step, step_leftovers, writer_lock
from keras_orbax._src.training.pending import Collector, PendingSave
from keras_orbax._src.training.retention import Retention
from keras_orbax._src.write import save_errors, shard_writer, step_sink, step_writer
from keras_orbax.errors import KerasOrbaxError, SaveFailedError, StepExistsError

logger = logging.getLogger("keras_orbax")


class _InFlight:
    """The background saves of this process not known to have finished, by directory."""

    def __init__(self) -> None:
        self._saves: dict[str, list[PendingSave]] = {}
        self._lock = threading.Lock()

    def add(self, directory: str, pending: PendingSave) -> None:
        with self._lock:
            saves = [p for p in self._saves.get(directory, []) if not p.done.is_set()]
            self._saves[directory] = [*saves, pending]

    def wait(self, directory: str) -> None:
        """Waits for each save into `directory` still in flight; their errors were their own
        `fit`'s (logged here: that `fit` had raised already)."""
        with self._lock:
            saves = self._saves.pop(directory, [])
        for pending in saves:
            if not pending.done.is_set():
                logger.info(
                    "Waiting for step %d of '%s', saved by an earlier fit", pending.step, directory
                )
            error = pending.join()
            if error is not None:
                logger.warning(
                    "Step %d of '%s', saved in the background by an earlier fit, failed: %s",
                    pending.step,
                    directory,
                    error,
                )


_in_flight = _InFlight()
# The `Saves` of this process holding each directory's run lock (`writer_lock.run_lock`).
_runs: dict[str, Saves] = {}


class Saves:
    """The checkpoints one `fit` writes into `directory`.

    Example (what `ModelCheckpoint` does):

        saves = Saves(directory, retention, format="fast", background=True,
                      weights_only=False, incremental=True)
        checkpointer = saves.open()                    # on_train_begin
        saves.save(model, step=8, epoch=1, batch=None, metrics={}, reason="epoch")
        saves.close(failing=False)                     # on_train_end, after `wait`
    """

    def __init__(
        self,
        directory: str,
        retention: Retention,
        *,
        format: step_writer.SaveFormat,
        background: bool,
        weights_only: bool,
        incremental: bool,
        rewrite_every: int | None = None,
        extra: dict[str, Any] | None = None,
        recycle: bool = False,
    ) -> None:
        self.directory = directory
        # The local tier: retention's oldest retired step is written into by the next save.
        self.recycle = recycle and not locations.is_remote(directory)
        self.extra = extra or {}  # recorded with every step (the local tier's directory)
        self.retention = retention
        self.format = format
        self.background = background
        self.weights_only = weights_only
        self.incremental = incremental
        self.rewrite_every = rewrite_every
        self.checkpointer: ocp.training.Checkpointer | None = None
        self.pending: PendingSave | None = None
        self._collector: Collector | None = None
        self._notices = contextlib.ExitStack()
        self._run = contextlib.ExitStack()

    def open(self) -> ocp.training.Checkpointer:
        """Opens the directory's checkpointer, and readies what background saves need. First
        waits for any background save into the directory still in flight in this process: one of
        a `fit` that raised (no `on_train_end` ran), which would otherwise commit its step under
        this run (resume would not see it, and a save of that step would find it taken)."""
        self.pending = None
        multihost.same_arguments("ModelCheckpoint", directory=self.directory)
        _in_flight.wait(self.directory)
        self._notices.close()  # left open by a fit that raised before on_train_end
        self._hold_directory()
        self._notices.enter_context(quiet.saving(self.directory))
        # No preservation policy: Orbax would delete old steps before the new one is durable;
        # `prune` deletes them once it is (retention.py).
        self.checkpointer = step_sink.open_checkpointer(self.directory, self.format)
        return self.checkpointer

    def _hold_directory(self) -> None:
        """Takes the directory's run lock: a second run writing it (the same job launched twice)
        gets `StepLockedError` naming this one, before it trains. Then removes what saves killed
        before they committed left there (no writer of the directory is left to finish them)."""
        self._run.close()  # held by this object's earlier fit, which raised before on_train_end
        previous = _runs.pop(self.directory, None)
        if previous is not None and previous is not self:
            # Another callback of this process holds it: its fit raised before on_train_end (or
            # two callbacks of one fit write one directory, which this takes from the first).
            logger.warning(
                "'%s' was still held by another ModelCheckpoint of this process, whose fit ended "
                "without on_train_end; it is closed now.",
                self.directory,
            )
            previous.close(failing=True)
        self._run.enter_context(writer_lock.run_lock(locations.as_path(self.directory)))
        _runs[self.directory] = self
        if multihost.is_primary():
            step_leftovers.remove_stale_staged(locations.as_path(self.directory))

    def _release_directory(self) -> None:
        if _runs.get(self.directory) is self:
            del _runs[self.directory]
        self._run.close()

    def start(self, model: keras.Model) -> None:
        """What the first save would otherwise do on the loop: the background collector and its
        host buffers, and Keras's first serialization."""
        if self.background and self._collector is None:
            self._collector = Collector()
            unpacked = (v for v in self._state_values(model) if not shard_writer.is_packed(v))
            self._collector.staging.prepare(unpacked)  # a packed array is assembled, not staged
        # Here rather than in the first save, which would block the loop for it (seconds where
        # TensorFlow is installed). Not in a thread: a short first epoch would end before it does.
        step_writer.warm_up()

    def save(
        self,
        model: keras.Model,
        *,
        step: int,
        epoch: int,
        batch: int | None,
        metrics: dict[str, float] | None,
        reason: str,
        blocking: bool,
        steps_per_epoch: int | None = None,
        data_state: dict[str, Any] | None = None,
    ) -> None:
        """Writes `step`, in the background unless `blocking`; retention deletes older steps
        once it is durable. Waits for the save in progress first. `steps_per_epoch` is recorded
        for a resume mid-epoch to check that its epochs are the same; `data_state` is this
        process's input position, committed with the step."""
        self.wait()
        if self.checkpointer is None:
            raise SaveFailedError(
                f"ModelCheckpoint('{self.directory}') is closed: an earlier save failed, or "
                "on_train_begin has not run."
            )
        staging: contextlib.AbstractContextManager = contextlib.nullcontext()
        if not blocking and self._collector is not None:  # the shards are copied into warm buffers
            staging = self._collector.staging.active()
        with contextlib.ExitStack() as lock, contextlib.ExitStack() as collector_paused:
            # Until the save has let go of its objects: see gc_pause.hold.
            collector_paused.callback(gc_pause.hold())
            try:
                lock.enter_context(writer_lock.writer_lock(self.directory, step))
                with staging:
                    response = step_writer.write_step(
                        self.checkpointer,
                        model,
                        step=step,
                        epoch=epoch,
                        batch=batch,
                        metrics=metrics,
                        extra={
                            "reason": reason,
                            "steps_per_epoch": steps_per_epoch,
                            **self.extra,
                        },
                        blocking=blocking,
                        weights_only=self.weights_only,
                        incremental=self.incremental,
                        rewrite_every=self.rewrite_every,
                        data_state=data_state,
                        # Orbax's part of the save runs in the background too. Not for compact
                        # arrays (Orbax's own serializer reads the live arrays), nor across
                        # processes (its collectives would interleave with the train step's).
                        start_later=self.format == "fast" and jax.process_count() == 1,
                        recycled=self._recycled_state(),
                    )
            except StepExistsError as error:  # written by another writer: not ours to replace
                self.close(failing=True)
                raise StepExistsError(
                    f"Cannot save step {step} to '{self.directory}': another writer committed "
                    f"that step there while this run was training (a `keras_orbax.save`, or a "
                    "run in a directory no lock covers, such as object storage). Nothing was "
                    f"written; step {step} is untouched. Give each training run a directory of "
                    f"its own. Received: step={step}"
                ) from error
            except KerasOrbaxError:  # e.g. another writer holds the step: fit stops here
                self.close(failing=True)
                raise
            except Exception as error:
                self.fail(f"Saving step {step} to '{self.directory}' failed", error)
            # Older steps are deleted only once this one is durable, its Orbax metadata files and
            # rename included (DurableResponse.result has returned).
            if blocking:
                try:
                    self.prune(step)
                except SaveFailedError:
                    self.close(failing=True)
                    raise
            else:  # the lock is held until the background save commits or fails
                assert self._collector is not None, "`start` starts the collector"
                self.pending = self._collector.submit(
                    step,
                    response,
                    self._release_lock(step, lock.pop_all()),
                    then=lambda: self.prune(step),
                    last=collector_paused.pop_all().close,
                    where=self.directory,
                )
                _in_flight.add(self.directory, self.pending)

    def _release_lock(self, step: int, lock: contextlib.ExitStack) -> Callable[[], None]:
        """Releases the writer lock of `step` once its background save has ended; an error
        doing so (a deferred write error on `close` over NFS) is a `SaveFailedError`."""

        def release() -> None:
            try:
                lock.close()
            except Exception as error:
                raise SaveFailedError(
                    f"Step {step} of '{self.directory}': releasing its writer lock once its "
                    f"save had ended failed: {type(error).__name__}: {error}. "
                    f"{self.intact_note()}"
                ) from error

        return release

    def raise_if_failed(self) -> None:
        """Raises the error of the background save in progress if it has failed already (a
        check that never waits; call it from every hook)."""
        if self.pending is not None and self.pending.failed():
            self.wait()

    def wait(self) -> None:
        """Blocks until the save in progress, if any, is committed.

        Raises:
            SaveFailedError: it failed; the previous committed step is intact.
        """
        pending, self.pending = self.pending, None
        if pending is None:
            return
        error = pending.join()
        if isinstance(error, SaveFailedError):  # the step committed; retention's deletion failed
            self.close(failing=True)
            raise error
        if error is not None:
            self.fail(
                f"Saving step {pending.step} to '{self.directory}' failed in the background", error
            )

    def prune(self, step: int) -> None:
        """Deletes the steps retention no longer keeps: call once `step`, the newest, is durable.

        Raises:
            SaveFailedError: a deletion failed; `step` is committed and durable.
        """
        if self.checkpointer is None:
            return
        retire = None
        if self.recycle:
            retire = functools.partial(recycled_step.retire, locations.as_path(self.directory))
        try:
            # The local tier's directory is this run's alone (its run lock, on a local disk): the
            # steps its checkpointer saved are all there are, without listing them again.
            self.retention.prune(self.checkpointer, retire=retire, rescan=not self.recycle)
        except Exception as error:
            raise SaveFailedError(
                f"Step {step} of '{self.directory}' is committed and durable, but deleting the "
                f"steps retention no longer keeps failed: {type(error).__name__}: {error}"
            ) from error

    def _recycled_state(self) -> str | None:
        if not self.recycle:
            return None
        return str(recycled_step.path(locations.as_path(self.directory)) / STATE)

    def fail(self, what: str, error: BaseException) -> NoReturn:
        """Raises SaveFailedError, naming the last committed step, after closing."""
        failure = SaveFailedError(
            f"{what}: {save_errors.described_error(error)}. {self.intact_note()}"
        )
        self.close(failing=True)
        raise failure from error

    def intact_note(self) -> str:
        steps = step_dirs.committed_steps(self.directory)
        if not steps:
            return "No step is committed in the directory."
        return f"The last committed step, {steps[-1]}, is intact."

    def close(self, *, failing: bool) -> None:
        """Closes the collector and the checkpointer (waiting for Orbax's last writes).

        Raises:
            SaveFailedError: closing failed, unless `failing` (a failure already being raised is
                the one to report; this one is logged).
        """
        checkpointer, self.checkpointer = self.checkpointer, None
        if self._collector is not None:
            self._collector.close()
            self._collector = None
        if self.recycle:  # what the next save would have written into: fit is over
            recycled_step.remove(locations.as_path(self.directory))
        if checkpointer is None:
            self._release_directory()
            return
        try:
            checkpointer.close()
        except Exception as error:
            self._notices.close()
            self._release_directory()
            if failing:
                logger.warning(
                    "Closing the checkpointer of '%s' failed too: %s", self.directory, error
                )
                return
            raise SaveFailedError(
                f"Finishing the saves to '{self.directory}' failed: {type(error).__name__}: "
                f"{error}. {self.intact_note()}"
            ) from error
        self._notices.close()  # every save has finished logging
        self._release_directory()

    def _state_values(self, model: keras.Model) -> list[Any]:
        """The arrays a save of this model writes (for the background saves' host buffers)."""
        state = state_keys.keyed_state(model)
        variables = state.of_role(state_keys.MODEL) if self.weights_only else state.variables
        return [
            keras_compat.current_value(v)
            for v in variables.values()
            if keras_compat.is_allocated(v)
        ]
