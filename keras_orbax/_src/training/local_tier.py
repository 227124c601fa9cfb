"""`ModelCheckpoint`'s tier in local storage: frequent steps in a fast local directory (under
`/dev/shm`, or a local SSD), beside the rare ones of the persistent directory, so that a crash
loses the batches since the last local save rather than since the last persistent one.

A local step is an ordinary keras-orbax step (`restore_sharded`, `verify` and `inspect` read it),
written in the background with its own writer, retention and host buffers. Resuming takes the
newest intact step of either tier: a local step only where it is newer than the persistent tier's
newest, and a damaged one is passed over (moved aside, never deleted) as `resume` does.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable
from typing import Any

import keras

from keras_orbax._src.format import step_dirs
from keras_orbax._src.storage import locations
from keras_orbax._src.training.callback_args import positive_int
from keras_orbax._src.training.resume import Resumed, set_aside
from keras_orbax._src.training.retention import Retention
from keras_orbax._src.training.saving import Saves
from keras_orbax.errors import CorruptCheckpointError, KerasOrbaxWarning

logger = logging.getLogger("keras_orbax")

# How `ModelCheckpoint` resumes from a directory: (directory, checkpointer, newer_than) -> Resumed.
ResumeFrom = Callable[..., Resumed | None]


def check_arguments(
    local_directory: str | os.PathLike | None,
    local_save_freq: object,
    local_max_to_keep: object,
    *,
    directory: str,
    save_weights_only: bool,
) -> None:
    """Raises ValueError naming the argument and its value, with Keras's manners."""
    if local_directory is None:
        if local_save_freq is not None:
            raise ValueError(
                "local_save_freq needs a local_directory to save into. Received: "
                f"local_directory=None, local_save_freq={local_save_freq!r}"
            )
        return
    if not isinstance(local_directory, str | os.PathLike) or not os.fspath(local_directory):
        raise ValueError(
            f"local_directory must be a non-empty path. Received: local_directory={local_directory!r}"
        )
    if _same_place(os.fspath(local_directory), directory):
        raise ValueError(
            "local_directory must be another directory than directory: the two tiers keep "
            f"their own steps. Received: directory={directory!r}, "
            f"local_directory={os.fspath(local_directory)!r}"
        )
    for name, value in (
        ("local_save_freq", local_save_freq),
        ("local_max_to_keep", local_max_to_keep),
    ):
        if not (positive_int(value) or (name == "local_save_freq" and value is None)):
            raise ValueError(f"{name} must be a positive int. Received: {name}={value!r}")
    if save_weights_only:
        raise ValueError(
            "local_directory keeps steps to resume from, which need the optimizer state that "
            "save_weights_only=True leaves out. Received: save_weights_only=True, "
            f"local_directory={os.fspath(local_directory)!r}"
        )


def _same_place(one: str, other: str) -> bool:
    return bool(locations.as_path(one) == locations.as_path(other))


class LocalTier:
    """The local steps one `ModelCheckpoint` writes: every `every` batches, `max_to_keep` kept.

    Example (what `ModelCheckpoint` does):

        tier = LocalTier("/dev/shm/run1", every=1, max_to_keep=2, monitor="val_loss",
                         format="fast", incremental=True)
        tier.open()                            # on_train_begin
        if tier.due(previous_step, step):
            tier.save(model, step=step, epoch=0, batch=step, ...)
        tier.saves.close(failing=False)        # on_train_end, after `wait`
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        every: int,
        max_to_keep: int,
        monitor: str,
        format: str,
        incremental: bool,
    ) -> None:
        self.directory = os.fspath(directory)
        self.every = every
        self.saves = Saves(
            self.directory,
            Retention(monitor, max_to_keep=max_to_keep, keep_best=None, keep_every=None),
            format=format,  # type: ignore[arg-type]
            background=True,
            weights_only=False,
            incremental=incremental,
            recycle=format == "fast",  # keras-orbax's own writer takes the retired files
        )
        self.last_saved_step: int | None = None

    def open(self) -> None:
        """Opens the tier's writer (one process; under `jax.distributed`, `ModelCheckpoint`
        uses `peer_tier.PeerTier` instead)."""
        self.saves.open()

    def save(
        self,
        model: keras.Model,
        *,
        step: int,
        epoch: int,
        batch: int | None,
        steps_per_epoch: int | None,
        data_state: dict[str, Any] | None,
    ) -> None:
        """Writes `step` in the background, once the previous local save has committed."""
        self.saves.save(
            model,
            step=step,
            epoch=epoch,
            batch=batch,
            metrics=None,
            reason="local",
            blocking=False,
            steps_per_epoch=steps_per_epoch,
            data_state=data_state,
        )
        self.last_saved_step = step
        logger.debug("Saving step %d to the local tier '%s'", step, self.directory)

    def due(self, previous_step: int, step: int) -> bool:
        """Whether the batches from `previous_step` to `step` crossed a multiple of `every`."""
        return step // self.every > previous_step // self.every and step != self.last_saved_step

    def check_follows(self, step: int) -> None:
        """Refuses a local directory holding steps of a run ahead of this one (`step`)."""
        steps = step_dirs.committed_steps(self.directory)
        if steps and steps[-1] > step:
            raise ValueError(
                f"local_directory '{self.directory}' already holds steps up to {steps[-1]}, but "
                f"the model is at step {step}: new local steps would be mixed with a different "
                "run's. Pass resume=True to continue that run, or use a new local_directory. "
                f"Received: local_directory='{self.directory}'"
            )
        self.last_saved_step = steps[-1] if steps else None

    def resume(self, resume_from: ResumeFrom, *, persistent: str) -> Resumed | None:
        """Resumes from the newest intact local step newer than the persistent tier's newest;
        None where there is none, for the persistent tier to resume from. Local steps newer than
        that which cannot be restored are moved aside (never deleted), with a warning."""
        persistent_steps = step_dirs.committed_steps(persistent)
        newer_than = persistent_steps[-1] if persistent_steps else None
        try:
            resumed = resume_from(self.directory, self.saves.checkpointer, newer_than=newer_than)
        except CorruptCheckpointError as error:
            newer = [
                s
                for s in step_dirs.committed_steps(self.directory)
                if newer_than is None or s > newer_than
            ]
            moved = set_aside(self.directory, newer)
            if self.saves.checkpointer is not None:
                self.saves.checkpointer.reload()
            warnings.warn(
                f"No local step of '{self.directory}' newer than the persistent tier's "
                f"{_newest(newer_than, persistent)} can be restored, so fit resumes from "
                f"'{persistent}'. The local steps were moved aside to "
                f"{', '.join(repr(m) for m in moved)} (nothing is deleted). {error}",
                KerasOrbaxWarning,
                stacklevel=3,
            )
            return None
        if resumed is not None:
            logger.info(
                "Resumed from the local tier '%s' (step %s), newer than the persistent tier's %s",
                self.directory,
                resumed.restored.step,
                _newest(newer_than, persistent),
            )
        return resumed


def _newest(step: int | None, directory: str) -> str:
    return (
        f"newest step, {step}, of '{directory}'" if step is not None else f"'{directory}' (no step)"
    )
