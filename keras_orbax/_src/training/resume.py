"""Resuming `fit` at the position a checkpoint recorded, mid-epoch included."""

from __future__ import annotations

import dataclasses
import functools
import logging
import warnings
from collections.abc import Callable
from typing import Any

import keras
import orbax.checkpoint.experimental.v1 as ocp

from keras_orbax._src.compat import keras_compat
from keras_orbax._src.format import data_state, step_dirs
from keras_orbax._src.format.step_record import OPTIMIZER, StepRecord
from keras_orbax._src.model.matching import STRICT_HINT, counted
from keras_orbax._src.restore.restore import restore_sharded
from keras_orbax._src.restore.result import RestoreResult
from keras_orbax._src.runtime import io_faults, multihost
from keras_orbax._src.sources import resolve
from keras_orbax._src.sources.orbax_step import OrbaxStepSource
from keras_orbax._src.storage import commit, durable, locations
from keras_orbax.errors import (
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    KerasOrbaxWarning,
)

logger = logging.getLogger("keras_orbax")


@dataclasses.dataclass(frozen=True)
class Resumed:
    """What `resume` did: the restore, the epoch `fit` goes on at (None: the step records none,
    `fit` starts at its own `initial_epoch`), and the newer steps it passed over because they could
    not be restored, each moved aside to `set_aside[step]`."""

    restored: RestoreResult
    epoch: int | None
    unreadable: tuple[int, ...] = ()
    set_aside: dict[int, str] = dataclasses.field(default_factory=dict)


def resume(
    model: keras.Model,
    directory: str,
    checkpointer: ocp.training.Checkpointer,
    *,
    epochs: int | None,
    verbose: int,
    position_input: Callable[[int, StepRecord], bool] | None = None,
    newer_than: int | None = None,
) -> Resumed | None:
    """Restores the newest intact step of `directory` into `model` and sets `fit` to start at
    the epoch (and batch) it records; None if the directory holds no step.

    A newer step that cannot be restored (its `_CHECKPOINT_METADATA` is missing, damaged or
    unreadable, an input position fails its checksum, or one of its array files fails its size,
    zarr index or checksum) is passed over for the newest step that restores, as Keras's
    `BackupAndRestore(double_checkpoint=True)` falls back to its previous backup. A read that
    fails with an I/O error (EIO, EACCES, ...) is tried again first (`io_faults.retried`). Once
    that step is restored, each one passed over is moved aside to `<step>.unreadable` (never
    deleted; no listing of steps, retention included, sees it), with a `KerasOrbaxWarning` naming
    the step, where it went, and whether it was damaged or failed to read (the errno): this run
    writes those steps again.

    `position_input(step, record)` sets `fit`'s input to go on where the step left it, and says
    whether it is put past the batches trained before or reads and drops them
    (`input_position.InputPosition.resume_from`). `newer_than`: only steps after it are
    considered (None where there is no such step).

    Raises:
        CorruptCheckpointError: the directory holds steps, and none of them can be restored
            (nothing is moved).
        UnsupportedVersionError: the newest readable step is of a newer format than this version
            reads: the job must not train on from an older step, nor move one a newer install
            wrote.
    """
    steps = sorted(
        s
        for s in set(step_dirs.committed_steps(directory))
        | {c.step for c in checkpointer.checkpoints}
        if newer_than is None or s > newer_than
    )
    if not steps:
        if newer_than is None:  # else the tier passed over says where fit goes on
            _announce_fresh(directory, verbose)
        return None
    restored, passed_over = _restore_newest_intact(model, directory, steps)
    moved = multihost.primary_value(
        "resume/set aside", set_aside, directory, [s for s, _ in passed_over]
    )
    if passed_over:
        checkpointer.reload()  # its listing still holds the steps moved aside
    for (skipped, why), where in zip(passed_over, moved, strict=True):
        warnings.warn(
            f"Step {skipped} of '{directory}' cannot be restored, so fit resumes from step "
            f"{restored.step}, the newest intact one. Step {skipped} was moved aside to '{where}' "
            f"(nothing is deleted; inspect it, then remove it yourself); this run trains its "
            f"steps again. Step {skipped} {why}",
            KerasOrbaxWarning,
            stacklevel=2,
        )
    record = restored.record
    positioned = (
        position_input is not None
        and record.epoch is not None
        and restored.step is not None
        and position_input(restored.step, record)
    )
    _announce(restored, directory, epochs, verbose, positioned=positioned)
    _warn_if_no_optimizer_state(model, restored, directory)
    keras_compat.set_initial_epoch(model, record.epoch)
    skipped_steps = tuple(s for s, _ in passed_over)
    return Resumed(
        restored, record.epoch, skipped_steps, dict(zip(skipped_steps, moved, strict=True))
    )


def _restore_newest_intact(
    model: keras.Model, directory: str, steps: list[int]
) -> tuple[RestoreResult, list[tuple[int, str]]]:
    """The restore of the newest of `steps` whose record reads and whose array files pass their
    checks (a failed restore leaves `model` untouched), and the newer ones passed over, why."""
    passed_over: list[tuple[int, str]] = []
    while True:
        step, unreadable = multihost.primary_value("resume", _newest_readable, directory, steps)
        passed_over += [(s, why) for s, why in unreadable]
        if step is None:
            count = counted(len(passed_over), "step")
            reasons = "\n".join(f"  step {s}: {why}" for s, why in passed_over)
            raise CorruptCheckpointError(
                f"No step of '{directory}' can be read to resume from ({count}):\n{reasons}\n"
                "Nothing was moved or deleted. Delete the directory or pass another one to start "
                "afresh."
            )
        try:
            # Checked before it is trusted: a damaged newest step falls back to the one before;
            # one that fails to read is read again first (an I/O error may pass).
            restored = io_faults.retried(
                functools.partial(restore_sharded, model, directory, step, verify=True),
                f"Restoring step {step} of '{directory}'",
                functools.partial(commit.fault_point, "retry"),
            )
            return restored, passed_over
        except CheckpointMismatchError as error:
            raise _advised_for_resume(error, directory) from None
        except CorruptCheckpointError as error:
            passed_over.append((step, _why(error)))
            steps = [s for s in steps if s < step]


def _why(error: BaseException) -> str:
    """Why a step cannot be restored, starting with what kind of failure it was: damage, or an
    I/O error that lasted over every attempt (`io_faults.retried`)."""
    kind = io_faults.cause(error)
    if kind == "damage":
        return f"is damaged: {type(error).__name__}: {error}"
    return (
        f"failed to read with {kind} in each of {io_faults.ATTEMPTS} attempts: it may be intact, "
        "and restores from where it was moved once the storage reads again: "
        f"{type(error).__name__}: {error}"
    )


def _advised_for_resume(error: CheckpointMismatchError, directory: str) -> Exception:
    """The restore's error, with advice that works for `ModelCheckpoint(resume=True)`, which
    takes no `strict`: a model changed on purpose cannot go on in this directory."""
    advice = (
        "If the model changed on purpose, it cannot resume from this directory: start afresh in "
        "a new directory, or first restore what matches with keras_orbax.restore_sharded(model, "
        f"'{directory}', strict=False), then fit with a ModelCheckpoint into a new directory."
    )
    message = str(error).replace(STRICT_HINT, advice)
    return CheckpointMismatchError(message, error.problems)


def _warn_if_no_optimizer_state(
    model: keras.Model, restored: RestoreResult, directory: str
) -> None:
    if model.optimizer is not None and not any(
        v.role == OPTIMIZER for v in restored.record.variables.values()
    ):
        warnings.warn(  # restored as Keras's load_weights would, but not what resuming promises
            f"Step {restored.step} of '{directory}' holds no optimizer state (saved with "
            "save_weights_only=True, or from a model without an optimizer): fit resumes from its "
            "weights with the optimizer as it is, not where that run's optimizer was.",
            KerasOrbaxWarning,
            stacklevel=3,
        )


def _newest_readable(directory: str, steps: list[int]) -> list[Any]:
    """`[step, [[newer step, why], ...]]`: the newest of `steps` whose record reads, None if none
    does, and the newer ones that do not (JSON-safe: process 0 decides for all). A record of a
    newer format raises `UnsupportedVersionError`: that step is intact."""
    unreadable: list[list[Any]] = []
    for step in sorted(steps, reverse=True):
        try:
            io_faults.retried(
                functools.partial(_open, directory, step),
                f"Reading step {step} of '{directory}'",
                functools.partial(commit.fault_point, "retry"),
            )
        except (CorruptCheckpointError, CheckpointNotFoundError) as error:
            unreadable.append([step, _why(error)])
            continue
        return [step, unreadable]
    return [None, unreadable]


def _open(directory: str, step: int) -> None:
    """Opens the step (its record, checked) and reads every process's input position (each
    checked against its checksum: a changed digit would move the input)."""
    source = resolve.open_source(directory, step)
    if isinstance(source, OrbaxStepSource):
        data_state.read_all(source.step_dir)


ASIDE_SUFFIX = step_dirs.ASIDE_SUFFIX


def set_aside(directory: str, steps: list[int]) -> list[str]:
    """Moves each of `steps` out of the listing of `directory`'s steps, under a name that says
    why and is not taken; returns where each went (JSON-safe: process 0 moves for all)."""
    root = locations.as_path(directory)
    moved = []
    for step in steps:
        source = root / str(step)
        target = root / f"{step}{ASIDE_SUFFIX}"
        taken = 1
        while target.exists():
            taken += 1
            target = root / f"{step}{ASIDE_SUFFIX}-{taken}"
        if source.exists():  # Orbax lists a step without metadata that committed_steps does not
            source.rename(target)
            if not locations.is_remote(root):
                durable.fsync_path(root)
        moved.append(str(target))
    return moved


def _announce(
    restored: RestoreResult,
    directory: str,
    epochs: int | None,
    verbose: int,
    *,
    positioned: bool = False,
) -> None:
    """Logs (and with `verbose`, prints) where `fit` resumes, on process 0. Epochs are numbered
    from 1 and batches counted as done, as the save lines are (`Epoch 2, batch 3: saving ...`)."""
    if not multihost.is_primary():
        return
    record, step = restored.record, restored.step
    start = f"Resuming from step {step} of '{directory}'"
    of = f"/{epochs}" if epochs is not None else ""
    if record.epoch is None:
        line = (
            f"{start}: it records no epoch (it was not written by ModelCheckpoint), so fit "
            "starts at its own initial_epoch."
        )
        logger.warning(line)
    elif epochs is not None and record.epoch >= epochs:
        done = _position(record.epoch, record.batch)
        line = f"{start} ({done}): all {counted(epochs, 'epoch')} are done, nothing left to train."
        logger.info(line)
    elif record.batch and positioned:
        line = (
            f"{start} at epoch {record.epoch + 1}{of}, batch {record.batch}: the input goes on "
            "from the position saved with the step, reading none of the batches trained before; "
            "other callbacks (the progress bar, loggers) still see their batch hooks run for them."
        )
        logger.info(line)
    elif record.batch:
        line = (
            f"{start} at epoch {record.epoch + 1}{of}, batch {record.batch}: "
            + (
                "the first batch of that epoch, trained before the checkpoint, is"
                if record.batch == 1
                else f"the first {record.batch} batches of that epoch, trained before the "
                "checkpoint, are"
            )
            + " read from the input and dropped; other callbacks (the progress bar, loggers) "
            "still see their batch hooks run for them."
        )
        logger.info(line)
    else:
        line = (
            f"{start}: {counted(record.epoch, 'epoch')} done, fit goes on at epoch "
            f"{record.epoch + 1}{of}."
        )
        logger.info(line)
    if verbose > 0:
        print(line, flush=True)


def _announce_fresh(directory: str, verbose: int) -> None:
    """Says, on process 0, that `resume=True` found nothing to resume from: a mistyped directory
    would otherwise start a fresh run silently. Named absolute, as the run's working directory
    resolves it."""
    if not multihost.is_primary():
        return
    line = (
        f"Nothing to resume from: no committed step in '{locations.as_path(directory)}', so fit "
        "starts fresh."
    )
    logger.info(line)
    if verbose > 0:
        print(line, flush=True)


def _position(epoch: int, batch: int | None) -> str:
    return f"epoch {epoch + 1}, batch {batch}" if batch else f"{counted(epoch, 'epoch')} done"
