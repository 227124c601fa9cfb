"""`ModelCheckpoint`: sharded, asynchronous checkpoints during `fit`, with retention, resume and preemption."""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

import jax
import orbax.checkpoint.experimental.v1 as ocp

from keras_orbax._src.compat import keras_compat
from keras_orbax._src.format import step_dirs
from keras_orbax._src.format.step_record import LOCAL_TIER
from keras_orbax._src.restore.result import RestoreResult
from keras_orbax._src.runtime import gc_pause, multihost
from keras_orbax._src.storage import locations
from keras_orbax._src.training import local_tier, peer_tier
from keras_orbax._src.training.best_so_far import BestSoFar
from keras_orbax._src.training.callback_args import validate
from keras_orbax._src.training.input_position import FitProgress, InputPosition
from keras_orbax._src.training.preemption import PreemptionWatcher
from keras_orbax._src.training.resume import Resumed, resume
from keras_orbax._src.training.retention import Retention, loggable
from keras_orbax._src.training.saving import Saves
from keras_orbax._src.write import step_writer

logger = logging.getLogger("keras_orbax")


class ModelCheckpoint(keras_compat.MonitorCallback):
    """Saves sharded checkpoints of the whole training state during `fit`, in the background.

    Each checkpoint is `<directory>/<step>` with the global training step: the batches trained
    so far, counted across restarts (`model.optimizer.iterations` unless gradients are accumulated
    or loss scaling skipped an update), so steps never collide. Every process writes only its own
    shards while `fit` goes on; a step appears only once fully written, and older steps are
    deleted only after that. A save at the end of epoch `e` (0-based) or after its known last
    batch records `epoch=e + 1`, the next epoch to run; a save after batch `b` records `epoch=e,
    batch=b + 1`, and the input's position (docs/resuming.md): resuming from it goes on with batch
    `b + 1` of epoch `e`, reading none before (an input without a position reads and drops them).
    Retention keeps a step if any rule keeps it: the latest `max_to_keep`, the best `keep_best`
    by `monitor` (the logs are stored with each step, so this survives restarts), every multiple
    of `keep_every`. See docs/callback.md.

    Args:
        directory: Where checkpoints go: a directory, one subdirectory per step, not a Keras
            `filepath` (a `{epoch}` template or a `.weights.h5`/`.keras` name is refused). Use one
            directory per training run. The other arguments are keyword-only (Keras's
            `ModelCheckpoint` and `OrbaxCheckpoint` order them differently).
        monitor: The metric that `save_best_only` and `keep_best` rank by, e.g. `"val_loss"`.
        verbose: 1 prints one line per save, and where a resumed `fit` goes on (on process 0
            only).
        save_best_only: Save only when `monitor` improves on the best value so far (read back
            from the directory when `fit` starts); the best step is always kept.
        save_weights_only: Save only the model's variables: no optimizer or metric state (such
            a checkpoint cannot be resumed from).
        mode: `"auto"`, `"min"` or `"max"`: whether a lower or higher `monitor` is better.
        save_freq: `"epoch"`, or an int N: save whenever the global step reaches a multiple of N.
        initial_value_threshold: With `save_best_only`, a value of `monitor` to beat first.
        max_to_keep: Keep the latest N steps; `None` keeps every step.
        keep_best: Also keep the N best steps by `monitor`.
        keep_every: Also keep every step that is a multiple of K.
        resume: When `fit` starts, restore the newest intact committed step (`restore_sharded`,
            its array files checked against their checksums) and continue from its epoch:
            rerunning the same `fit(epochs=N)` finishes the run. A newer step whose record cannot
            be read or whose files fail their checks is passed over and moved aside to
            `<step>.unreadable`, never deleted (`KerasOrbaxWarning`); one of a newer format
            raises `UnsupportedVersionError`.
        save_on_background: Write checkpoints while training continues. A failed background
            save (or its cleanup) is logged at once and raises `SaveFailedError` at the next
            batch or epoch end, save, or when `fit` ends.
        format: `"fast"` or `"compact"`, as in `keras_orbax.save`.
        incremental: Write only the shard files that changed since the previous committed step;
            the others are hard links to its files, as in `keras_orbax.save`. Kept steps then
            share those files: damage to one (bit rot, a write into it) reaches every step
            holding it. Restores check every file read against its checksum.
        rewrite_every: With `incremental`, write again any file that this many steps hold
            already: steps `rewrite_every` or more saves apart share no file. With
            `max_to_keep > rewrite_every` the kept steps always include two independent copies
            of every file. `None` (default): link without limit; `incremental=False`: every
            step a full copy. See docs/incremental.md.
        save_on_preemption: On SIGTERM, save at the next batch boundary (waiting until it is
            committed) and stop `fit`, which returns normally with `preempted` set; exiting is
            left to the caller. Under `jax.distributed`, JAX's preemption service makes every
            process save at the same step.
        local_directory: A second tier of steps in fast local storage (under `/dev/shm`, or a
            local SSD), written in the background every `local_save_freq` batches, so that a
            crash loses the batches since the last local save. `resume` takes the newest
            intact step of either tier. On one process, each step there is an ordinary
            keras-orbax step. Under `jax.distributed`, each process's own local storage: it
            keeps its part of each step there and a replica of the previous process's, sent
            over JAX's collectives, so the loss of one process's local directory loses
            nothing. See docs/preemption.md.
        local_save_freq: Save to `local_directory` every N batches (None: every batch).
        local_max_to_keep: Keep the latest N local steps (one more while a new one commits;
            the files of the step retired last wait, until `fit` ends, for the next local
            save to write into).

    Raises:
        ValueError: an argument is out of range, or `directory` is a Keras file name or template.
        SaveFailedError: (from `fit`) a save failed; the previous committed step is intact.
        UnsupportedVersionError: (from `fit`, with `resume`) the newest step is of a newer
            keras-orbax format than this one reads.

    Example:
    ```python
    keras.distribution.set_distribution(ModelParallel(layout_map=layout_map))
    model = build_model()
    model.compile(optimizer="adam", loss="mse")
    checkpoint = keras_orbax.ModelCheckpoint("/ckpt", max_to_keep=3, resume=True)
    model.fit(x, y, epochs=10, callbacks=[checkpoint])
    if checkpoint.preempted:
        sys.exit(0)  # rerun the same script to continue
    ```
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        monitor: str = "val_loss",
        verbose: int = 0,
        save_best_only: bool = False,
        save_weights_only: bool = False,
        mode: str = "auto",
        save_freq: str | int = "epoch",
        initial_value_threshold: float | None = None,
        max_to_keep: int | None = 1,
        keep_best: int | None = None,
        keep_every: int | None = None,
        resume: bool = False,
        save_on_background: bool = True,
        format: step_writer.SaveFormat = "fast",
        save_on_preemption: bool = True,
        incremental: bool = True,
        rewrite_every: int | None = None,
        local_directory: str | os.PathLike | None = None,
        local_save_freq: int | None = None,
        local_max_to_keep: int = 2,
    ) -> None:
        super().__init__(monitor, mode, initial_value_threshold)
        validate(directory, save_freq, max_to_keep, keep_best, keep_every, format)
        local_tier.check_arguments(
            local_directory,
            local_save_freq,
            local_max_to_keep,
            directory=os.fspath(directory),
            save_weights_only=save_weights_only,
        )
        step_writer.check_rewrite_every(rewrite_every)
        if resume and save_weights_only:
            raise ValueError(
                "resume=True needs the optimizer state, which save_weights_only=True leaves out. "
                f"Received: resume={resume}, save_weights_only={save_weights_only}"
            )
        self.directory = os.fspath(directory)
        self.verbose = verbose
        self.save_best_only = save_best_only
        self.save_weights_only = save_weights_only
        self.save_freq = save_freq
        self.initial_value_threshold = initial_value_threshold
        self.max_to_keep = max_to_keep
        self.keep_best = keep_best
        self.keep_every = keep_every
        self._retention = Retention(
            monitor,
            max_to_keep=max_to_keep,
            keep_best=keep_best or (1 if save_best_only else None),
            keep_every=keep_every,
        )
        self.resume = resume
        self.save_on_background = save_on_background
        self.format = format
        self.save_on_preemption = save_on_preemption
        self.incremental = incremental
        self.rewrite_every = rewrite_every
        self.preempted = False
        """True once a preemption notice made this callback save and stop `fit`."""
        self.restored: RestoreResult | None = None
        """What `resume=True` restored when `fit` started; None if nothing was."""
        self._saves = Saves(
            self.directory,
            self._retention,
            format=format,
            background=save_on_background,
            weights_only=save_weights_only,
            incremental=incremental,
            rewrite_every=rewrite_every,
            # So that `inspect` of this directory names the local tier beside it.
            extra=(
                {}
                if local_directory is None
                else {LOCAL_TIER: str(locations.as_path(local_directory))}
            ),
        )
        self.local_directory = None if local_directory is None else os.fspath(local_directory)
        self.local_save_freq = local_save_freq
        self.local_max_to_keep = local_max_to_keep
        self._local: local_tier.LocalTier | peer_tier.PeerTier | None = (
            None
            if local_directory is None
            else local_tier.LocalTier(
                local_directory,
                every=local_save_freq or 1,
                max_to_keep=local_max_to_keep,
                monitor=monitor,
                format=format,
                incremental=incremental,
            )
        )
        self._last_saved_step: int | None = None
        self._best = BestSoFar(self._retention)
        self._watcher = PreemptionWatcher()
        self._set_epoch = False
        self._progress = FitProgress()
        self._data: InputPosition | None = None
        self._batch_logs: dict | None = None
        self._steps_per_execution = 1

    # -- fit hooks -------------------------------------------------------------------------------

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.preempted, self.restored = False, None
        # Read here: `self.model` syncs the JAX state, which `_save_may_follow` must not do (it
        # runs inside a train step, reading the next batch).
        self._steps_per_execution = self.model.steps_per_execution
        self._data = InputPosition.of_fit(self._save_may_follow)  # the input of this fit
        try:
            checkpointer = self._saves.open()  # StepLockedError if another run writes there
            if isinstance(self._local, local_tier.LocalTier) and multihost.process_count() > 1:
                # Each process's local directory may be on its own machine: parts and replicas.
                self._local = peer_tier.PeerTier(
                    self._local.directory,
                    every=self._local.every,
                    max_to_keep=self.local_max_to_keep,
                )
            if self._local is not None:
                self._local.open()
            self._begin_in_directory(checkpointer)
        except BaseException:
            self._close(failing=True)
            raise
        self._saves.start(self.model)
        if self._local is not None:
            self._local.saves.start(self.model)
        if self.save_on_preemption:
            self._watcher.start()

    def _begin_in_directory(self, checkpointer: ocp.training.Checkpointer) -> None:
        """Resumes if asked, and checks that this run's steps follow the directory's."""
        if self.resume:
            self._restore(checkpointer)
        steps = step_dirs.committed_steps(self.directory)
        # The step counts training batches, updates applied or not (see keras_compat.optimizer_steps);
        # a LossScaleOptimizer's counter also stops on skipped updates, the checkpoint's does not.
        step = keras_compat.optimizer_steps(self.model.optimizer)
        if self.restored is not None and self.restored.step is not None:
            step = max(step, self.restored.step)
        self._progress.step = step
        if self._local is not None:
            self._local.check_follows(step)
        if steps and steps[-1] > step:
            raise ValueError(
                f"'{self.directory}' already holds steps up to {steps[-1]}, but the model is at "
                f"step {step}: new checkpoints would be mixed with a different run's. Pass "
                f"resume=True to continue that run, or use a new directory. Received: "
                f"directory='{self.directory}', resume={self.resume}"
            )
        self._last_saved_step = steps[-1] if steps else None
        self._best.begin(self, checkpointer.checkpoints)

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._progress.begin_epoch(epoch)
        if self._set_epoch:  # fit has read it by now; a later fit must not start there again
            keras_compat.set_initial_epoch(self.model, None)
            self._set_epoch = False
        if self._data is not None:
            self._data.begin_epoch(self.model, epoch)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self._raise_if_failed()
        self._batch_logs = logs  # saved with a step taken after this batch (`_data_state`)
        if self._data is not None and self._data.dropped(self._progress.epoch, batch):
            self._progress.last_batch = batch  # trained before the checkpoint; read and dropped now
            return
        previous = self._progress.end_batch(batch)
        preempted = self.save_on_preemption and self._watcher.reached() and self._input_known()
        if (
            isinstance(self.save_freq, int)
            and self._progress.step // self.save_freq > previous // self.save_freq
        ):
            self._consider_save(logs or {}, at_epoch_end=False)
        if self._local is not None and self._local.due(previous, self._progress.step):
            self._save_local()
        if preempted:
            self._save_for_preemption(at_epoch_end=False)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self._raise_if_failed()
        if self._data is not None:
            self._data.end_epoch()
        if self.preempted:
            return  # saved and stopping already; this epoch did not finish
        if self.save_freq == "epoch":
            self._consider_save(logs or {}, at_epoch_end=True)
        if self.save_on_preemption and self._watcher.requested:
            self._save_for_preemption(at_epoch_end=True)

    def on_train_end(self, logs: dict | None = None) -> None:
        self.wait_until_finished()
        self._close(failing=False)

    def _raise_if_failed(self) -> None:
        """A background save that failed stops `fit` at the next hook, not the next save."""
        try:
            self._saves.raise_if_failed()
            if self._local is not None:
                self._local.saves.raise_if_failed()
        except BaseException:
            self._close(failing=True)
            raise

    def wait_until_finished(self) -> None:
        """Blocks until the save in progress, if any, is committed.

        Raises:
            SaveFailedError: it failed; the previous committed step is intact.
        """
        try:
            self._saves.wait()
            if self._local is not None:
                self._local.saves.wait()
        except BaseException:
            self._close(failing=True)
            raise

    # -- saving ----------------------------------------------------------------------------------

    # The collector is paused from the start of the hook's work (the save's own hold goes on until
    # the background save lets go of its objects): gc_pause.hold.
    @gc_pause.paused()
    def _consider_save(self, logs: dict, *, at_epoch_end: bool) -> None:
        save, note = self._best.should_save(self, logs)
        if not save:
            return
        reason = "epoch" if at_epoch_end else "batch"
        blocking = not self.save_on_background
        self._save(loggable(logs), reason, at_epoch_end, blocking=blocking, note=note)

    @gc_pause.paused()
    def _save_for_preemption(self, *, at_epoch_end: bool) -> None:
        if self.save_best_only or self.keep_best:
            self._best.settle(self)  # retention ranks the kept steps after this save too
        self._save(None, "preemption", at_epoch_end, blocking=True)
        self.wait_until_finished()  # the step may have been started just before, in the background
        self.preempted = True
        self.model.stop_training = True

    def _save(
        self,
        metrics: dict[str, float] | None,
        reason: str,
        at_epoch_end: bool,
        *,
        blocking: bool,
        note: str = "",
    ) -> None:
        step = self._progress.step
        if step == self._last_saved_step:
            return  # nothing was trained since: that step holds this very state
        self.model.jax_state_sync()  # mid-epoch, the variables are empty until synced
        epoch, batch = self._progress.position(at_epoch_end, self._param("steps"))
        try:
            self._saves.save(
                self.model,
                step=step,
                epoch=epoch,
                batch=batch,
                metrics=metrics,
                reason=reason,
                blocking=blocking,
                steps_per_epoch=self._param("steps"),
                data_state=self._data_state(epoch, batch),
            )
        except BaseException:
            self._close(failing=True)
            raise
        self._last_saved_step = step
        self._report(step, epoch, batch, reason, note)

    @gc_pause.paused()
    def _save_local(self) -> None:
        """Writes the current step to the local tier, in the background (after the previous
        local save has committed: each local step is one batch's loss at most)."""
        assert self._local is not None
        self.model.jax_state_sync()
        epoch, batch = self._progress.position(False, self._param("steps"))
        try:
            self._local.save(
                self.model,
                step=self._progress.step,
                epoch=epoch,
                batch=batch,
                steps_per_epoch=self._param("steps"),
                data_state=self._data_state(epoch, batch),
            )
        except BaseException:
            self._close(failing=True)
            raise

    def _data_state(self, epoch: int, batch: int | None) -> dict[str, Any] | None:
        if self._data is None:
            return None
        return self._data.state(epoch=epoch, batch=batch, logs=self._batch_logs)

    # -- resume, fit's parameters ----------------------------------------------------------------

    def _restore(self, checkpointer: ocp.training.Checkpointer) -> None:
        resumed = None
        if isinstance(self._local, peer_tier.PeerTier):
            resumed = self._local.resume(
                self.model,
                persistent=self.directory,
                position_input=self._position_input,
                verbose=self.verbose,
            )
        elif self._local is not None:
            resumed = self._local.resume(self._resume_from, persistent=self.directory)
        if resumed is None:
            resumed = self._resume_from(self.directory, checkpointer)
        if resumed is not None:
            self.restored = resumed.restored
            self._set_epoch = resumed.epoch is not None

    def _resume_from(
        self,
        directory: str,
        checkpointer: ocp.training.Checkpointer,
        newer_than: int | None = None,
    ) -> Resumed | None:
        return resume(
            self.model,
            directory,
            checkpointer,
            epochs=self._param("epochs"),
            verbose=self.verbose,
            position_input=functools.partial(self._position_input, directory),
            newer_than=newer_than,
        )

    def _position_input(self, directory: str, step: int, record: Any) -> bool:
        """Sets `fit` to go on where step `step` of `directory` left it (`InputPosition`); whether
        its input is put past the batches trained before (else it reads and drops them)."""
        assert self._data is not None, "made in on_train_begin, before the restore"
        step_dir = locations.as_path(directory) / str(step)
        return self._data.resume_from(
            self.model, step_dir, record, steps_per_epoch=self._param("steps")
        )

    def _input_known(self) -> bool:
        """Whether the input's position after this batch can be saved. Not where Keras read a
        tf.data iterator one batch ahead before a preemption notice came: the save then waits one
        batch, whose read came after it. Under jax.distributed, every process saves at the step
        JAX's preemption service agreed on, whatever its input (it may then read and drop)."""
        if self._data is None or jax.process_count() > 1:
            return True
        _, batch = self._progress.position(False, self._param("steps"))
        return batch is None or self._data.known_at(batch)

    def _save_may_follow(self, batches: int) -> bool:
        """Whether a save may follow the batch that makes `batches` batches of this epoch trained
        (a preemption notice, or a multiple of an int `save_freq` reached in that execution)."""
        if self.save_on_preemption and self._watcher.requested:
            return True
        if not batches:
            return False
        step = self._progress.step_after(batches)
        every = [self.save_freq] if isinstance(self.save_freq, int) else []
        if self._local is not None:
            every.append(self._local.every)
        return any(step // n > (step - self._steps_per_execution) // n for n in every)

    def _param(self, name: str) -> Any:
        """What `fit` told its callbacks (`epochs`, `steps` per epoch, `verbose`), None before."""
        return (self.params or {}).get(name)

    # -- reporting and cleanup -------------------------------------------------------------------

    def _report(self, step: int, epoch: int, batch: int | None, reason: str, note: str) -> None:
        if not multihost.is_primary():
            return
        # Numbered from 1, as Keras prints epochs: `epoch` epochs are done, or `batch` batches of
        # the 0-based epoch `epoch`.
        where = f"Epoch {epoch}" if batch is None else f"Epoch {epoch + 1}, batch {batch}"
        action = "preempted, saved" if reason == "preemption" else "saving"
        line = f"{where}: {action} step {step} to '{self.directory}'{note}"
        logger.info(line)
        if self.verbose > 0:
            # Keras's progress bar (`fit(verbose=1)`, the default) leaves its line open: start on
            # a line of our own, as Keras's ModelCheckpoint does.
            bar = self._param("verbose") in (1, "auto")
            print(f"\n{line}" if bar else line, flush=True)

    def _close(self, *, failing: bool) -> None:
        """Puts back what on_train_begin changed, and closes the saves (`Saves.close`)."""
        self._watcher.stop()
        if self._set_epoch:
            keras_compat.set_initial_epoch(self.model, None)
            self._set_epoch = False
        if self._data is not None:
            self._data.close()
            self._data = None
        if self._local is not None:
            self._local.saves.close(failing=failing)
        self._saves.close(failing=failing)
