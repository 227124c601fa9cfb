"""`save`: one committed step, each process writing only the shards its devices own."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import keras
import numpy as np
import orbax.checkpoint.experimental.v1 as ocp

from keras_orbax._src.compat import keras_compat
from keras_orbax._src.format import own_state, step_dirs
from keras_orbax._src.format.data_state import DATA_STATE
from keras_orbax._src.format.step_record import (
    FORMAT_NAME,
    STATE,
    StepRecord,
    VariableRecord,
    versions,
)
from keras_orbax._src.model import keras_walk, shardings, state_keys
from keras_orbax._src.runtime import gc_pause, multihost, quiet
from keras_orbax._src.storage import commit, durable, locations, step_leftovers
from keras_orbax._src.storage.writer_lock import writer_lock
from keras_orbax._src.write import incremental as incremental_saves
from keras_orbax._src.write import save_errors, shard_writer, step_sink
from keras_orbax.errors import (
    DeferredVariableError,
    KerasOrbaxError,
    SaveFailedError,
    StepExistsError,
)

SaveFormat = step_sink.SaveFormat
_FORMATS = step_sink.FORMATS  # where benchmarks/save_benchmark.py reads the options


@gc_pause.paused()
def save(
    model: keras.Model,
    directory: str | os.PathLike,
    *,
    step: int,
    epoch: int | None = None,
    format: SaveFormat = "fast",
    overwrite: bool = False,
    incremental: bool = True,
    rewrite_every: int | None = None,
) -> Path:
    """Saves every piece of `model`'s state as one committed checkpoint step.

    Call on every process: each writes only the shards its devices own. Trainable and
    non-trainable variables, optimizer state (`iterations` included), metric variables and
    seed-generator state are saved, with a JSON record of each variable's path, shape, dtype and
    layout. The step appears only once it is fully written; earlier steps are never touched.

    Args:
        model: A built Keras model (JAX backend).
        directory: The checkpoint root; the step is written to `<directory>/<step>`.
        step: The step number, usually the global training step.
        epoch: Recorded in the metadata (e.g. for resuming `fit`).
        format: `"fast"` (uncompressed, one file per shard: the fastest restore) or `"compact"`
            (zstd + OCDBT: smaller, fewer files). Both restore the same way.
        overwrite: Replace `step` if it is already committed. The committed step is moved
            aside (`.keras_orbax.<step>.replaced`) and removed only once the new one is durable;
            if the save fails, it is put back (a killed save's is put back by the next listing
            of the directory's steps). In `gs://` and `s3://`, Orbax deletes it first.
        incremental: Write only the shard files whose content changed since the latest
            committed step before `step` in `directory`; the others are hard links to that
            step's files (in object storage: copies made by the store), so every step stays
            whole (fast format; docs/incremental.md). False writes every file and records no
            layouts.
        rewrite_every: With `incremental`, write again any file that `rewrite_every` steps
            hold already instead of linking it: two steps that many saves apart or more share no
            file, so damage to one file cannot reach both. `None`: link without limit.

    Returns:
        The step's directory.

    Raises:
        StepExistsError: `step` is committed already and `overwrite` is False.
        StepLockedError: another writer is saving `step` to `directory` right now (with or
            without `overwrite`); nothing was written. Local directories only: `gs://` and
            `s3://` directories are not locked.
        SaveFailedError: the write failed (e.g. a full disk); the committed steps are intact.

    Example:
    ```python
    keras_orbax.save(model, "/ckpt", step=int(model.optimizer.iterations))
    ```
    """
    step = step_dirs.checked_step(step)
    step_sink.check_format(format, directory)
    check_rewrite_every(rewrite_every)
    multihost.same_arguments("save", directory=os.fspath(directory), step=step, format=format)
    root = step_dirs.CheckpointRoot(directory)  # the one path of it, its steps listed once
    # A committed `step` is refused before the lock (from its own directory: a refused save leaves
    # the checkpoint directory as it was, the lock's file included) and, decisively, under it.
    if not overwrite and root.has_committed(step):
        raise _step_exists(root, step)
    checked = _checked_variables(model, root, step, overwrite=True, weights_only=False)
    try:
        with (
            writer_lock(root, step),  # released once the checkpointer has closed
            # The committed `step` is moved aside, not deleted (as Orbax's overwrite would): it is
            # removed once the new one is durable, and put back if the save fails.
            step_leftovers.replacing(root.path, step) if overwrite else contextlib.nullcontext(),
            step_leftovers.removing_staged(root.path, step),
            quiet.saving(root),
            step_sink.open_checkpointer(root, format) as checkpointer,
        ):
            # Decided under the lock (process 0 holds it and decides): a writer that held it may
            # have committed the step since `_checked_variables`.
            multihost.primary_value(
                f"save/step {step} free", _refuse_committed, root, step, overwrite, True
            )
            write_step(
                checkpointer,
                model,
                step=step,
                epoch=epoch,
                # Orbax deletes the step before writing it again: only in object storage, where
                # `replacing` cannot move it aside.
                overwrite=overwrite and locations.is_remote(root.path),
                checked=checked,
                incremental=incremental,
                rewrite_every=rewrite_every,
                root=root,
            )
    except Exception as error:  # the write failed: a full disk, a read-only directory...
        if isinstance(error, KerasOrbaxError) and not isinstance(error, SaveFailedError):
            raise  # the caller's input (StepExistsError...), or a process that never reported
        steps = root.listed_again()  # now that the failure is over: an old step put back
        if not overwrite and step in steps:
            # A process lost at Orbax's last barrier, after process 0 had renamed the step.
            raise SaveFailedError(
                f"Saving step {step} to '{root}' failed: {save_errors.described_error(error)}. "
                f"Process 0 had renamed step {step} into place (every process had agreed on its "
                "writes), but it was not made durable: a restore checks it, and `keras-orbax "
                "verify` tells whether it is whole."
            ) from error
        raise SaveFailedError(
            save_errors.failed_message(root, step, error, steps, overwrite)
        ) from error
    return root.step_dir(step)


def check_rewrite_every(rewrite_every: Any) -> None:
    """Raises ValueError unless `rewrite_every` is None or an int of at least 1."""
    if rewrite_every is not None and (
        not isinstance(rewrite_every, int) or isinstance(rewrite_every, bool) or rewrite_every < 1
    ):
        raise ValueError(
            f"rewrite_every must be None or a positive int. Received: rewrite_every={rewrite_every!r}"
        )


def warm_up() -> None:
    """Does now what the first save in a process would otherwise spend its time on: reading the
    installed packages' versions for the record (6 ms of parsing package metadata), and Keras's
    first serialization, which tries to import TensorFlow (it checks objects against
    `tf.TensorShape`): 2-3 s where TensorFlow is installed (docs/benchmarks.md).

    Never raises: a failure here is met again, and reported, by the save itself.
    """
    with contextlib.suppress(Exception):
        versions()
        # An initializer reaches Keras's TensorFlow check, as the model's config does.
        keras.saving.serialize_keras_object(keras.initializers.Zeros())


def write_step(
    checkpointer: ocp.training.Checkpointer,
    model: keras.Model,
    *,
    step: int,
    epoch: int | None = None,
    batch: int | None = None,
    metrics: dict[str, float] | None = None,
    extra: dict[str, Any] | None = None,
    overwrite: bool = False,
    blocking: bool = True,
    weights_only: bool = False,
    start_later: bool = False,
    checked: tuple[state_keys.KeyedState, dict[str, keras.Variable]] | None = None,
    incremental: bool = True,
    rewrite_every: int | None = None,
    data_state: dict[str, Any] | None = None,
    root: step_dirs.CheckpointRoot | None = None,
    recycled: str | None = None,
) -> Any:
    """Starts writing `model`'s state as `step`; with `blocking`, waits until it is committed.

    `weights_only` keeps the model's own variables (trainable, non-trainable, seed-generator state)
    and leaves out optimizer and metric state. `start_later` (fast format, not `blocking`) only
    copies the shards to the host now and returns a `LaterSave`: its `result()`, called from
    another thread, runs the rest of the save (Orbax's part included) and waits for the commit.
    `checked`: what `_checked_variables` returned for this very save, if the caller ran it.
    `incremental`: link (or copy on the server) the shard files unchanged since the previous
    committed step (`incremental.plan_for`, decided when the save starts writing), each file into
    at most `rewrite_every` steps.
    `data_state`: this process's input position (`format/data_state.py`), committed with the step.
    `root`: the checkpointer's root as the caller resolved and listed it (`save`).
    `recycled`: a local-tier save: a retired step's `state/`, whose files it writes into
    (`shard_writer.local_tier`).
    """
    root = root or step_dirs.CheckpointRoot(checkpointer.directory)
    state, variables = checked or _checked_variables(
        model, root, step, overwrite=overwrite, weights_only=weights_only
    )
    record = StepRecord(
        step=step,
        epoch=epoch,
        batch=batch,
        variables={key: variable_record(key, v, state.roles[key]) for key, v in variables.items()},
        model_config=_model_config(model),
        versions=versions(),
        extra=extra or {},
    )
    # Orbax refuses zero-size arrays; their record (shape, dtype) is all there is to restore.
    values = {key: keras_compat.current_value(v) for key, v in variables.items() if _size(v) > 0}
    # Orbax refuses an empty tree: a model without arrays is a step of its `keras_state/` alone.
    arrays = {STATE: state_keys.nest(values)} if values else {}
    checkpointables = arrays | _keras_state(model, state.objects, always=not values)
    if data_state is not None:
        checkpointables[DATA_STATE] = data_state

    def start() -> step_sink.DurableResponse | None:
        commit.fault_point("stage")
        plan = incremental_saves.plan_for(root, step, rewrite_every) if incremental else None
        synced = durable.Synced()  # the files the writer fsyncs: not fsynced again at commit
        with (
            incremental_saves.planned(plan),
            shard_writer.noting_fsyncs(synced),
            shard_writer.local_tier(recycled),
        ):
            return step_sink.save_async(
                checkpointer,
                root,
                step,
                checkpointables,
                synced,
                force=True,
                overwrite=overwrite,
                metrics=metrics,
                custom_metadata={FORMAT_NAME: record.to_json()},
            )

    if start_later and not blocking:
        staged = shard_writer.stage({key.replace("/", "."): value for key, value in values.items()})
        return LaterSave(start, staged, root, step)
    # A failed save removes what it staged: a full disk is not kept full for the next save.
    with step_leftovers.removing_staged(root.path, step):
        # Waited for at once, the save may write from the live device buffers; in the background
        # it must copy them first (the next train step donates them).
        with shard_writer.shards_stay_unchanged() if blocking else contextlib.nullcontext():
            response = start()
        if blocking and response is not None:
            response.result()
    return response


class LaterSave:
    """A save whose shards are on the host already; `result()` writes and commits it."""

    def __init__(
        self,
        start: Callable[[], step_sink.DurableResponse | None],
        staged: Any,
        root: step_dirs.CheckpointRoot,
        step: int,
    ) -> None:
        self._start, self._staged = start, staged
        self._root, self._step = root, step

    def result(self) -> None:
        with (
            step_leftovers.removing_staged(self._root.path, self._step),
            shard_writer.from_staged(self._staged),
        ):
            response = self._start()
        if response is not None:
            response.result()


def _checked_variables(
    model: keras.Model,
    root: step_dirs.CheckpointRoot,
    step: int,
    *,
    overwrite: bool,
    weights_only: bool,
) -> tuple[state_keys.KeyedState, dict[str, keras.Variable]]:
    """The model's keyed state and the variables to save, after the checks that need no writing.

    Raises:
        ValueError: the model has no variables and is not built.
        DeferredVariableError: some were built deferred and never restored.
        StepExistsError: `step` is committed already and `overwrite` is False.
    """
    state = state_keys.keyed_state(model)
    variables = state.of_role(state_keys.MODEL) if weights_only else state.variables
    if not variables and not model.built:  # a built model without variables saves, as in Keras
        raise ValueError(
            f"Model '{model.name}' has no variables to save: build it first (call it on data, "
            f"or model.build). Received: model={model.name}"
        )
    unset = [v.path for v in variables.values() if not keras_compat.is_allocated(v)]
    if unset:
        raise DeferredVariableError(
            f"Cannot save model '{model.name}': {len(unset)} variables were built under "
            f"deferred_init() and never restored, e.g. {unset[:5]}. Call restore_sharded first."
        )
    _refuse_committed(root, step, overwrite)
    return state, variables


def _refuse_committed(
    root: step_dirs.CheckpointRoot, step: int, overwrite: bool, again: bool = False
) -> None:
    """Raises StepExistsError if `step` is committed and not to be overwritten. Decisive only
    under the step's writer lock (`again`: listed afresh there); before it, only a check that
    fails early."""
    if overwrite:
        return
    if step in (root.listed_again() if again else root.steps()):
        raise _step_exists(root, step)


def _step_exists(root: step_dirs.CheckpointRoot, step: int) -> StepExistsError:
    return StepExistsError(
        f"Step {step} is already committed in '{root}'. Pass "
        f"overwrite=True to replace it. Received: step={step}"
    )


def variable_record(key: str, variable: keras.Variable, role: str) -> VariableRecord:
    """What a step records of `variable`, saved under `key` (a local tier's parts record the same)."""
    value = keras_compat.current_value(variable)
    return VariableRecord(
        key=key,
        path=variable.path,
        shape=tuple(int(n) for n in variable.shape),
        dtype=keras_compat.stored_dtype(variable),
        array=key.replace("/", "."),  # Orbax names a nested parameter by its keys joined with "."
        layout=shardings.describe(value.sharding),
        role=role,
    )


def _keras_state(
    model: keras.Model, objects: Any, *, always: bool
) -> dict[str, own_state.StepFiles]:
    """The step's `keras_state/` checkpointable, where the model's layers store values that are
    no variable or write assets (`keras_walk.captured` of `objects`, the walk `KeyedState` made);
    unless `always`, none where they do not."""
    kept = keras_walk.captured(model, objects)
    return {own_state.KERAS_STATE: own_state.StepFiles(kept)} if kept or always else {}


def _model_config(model: keras.Model) -> dict[str, Any] | None:
    """The model's serialized config where Keras can make one (JSON-safe), else None."""
    try:
        return json.loads(json.dumps(keras.saving.serialize_keras_object(model)))
    except (TypeError, ValueError, NotImplementedError, RecursionError):  # e.g. GPTQ configs
        return None


def _size(variable: keras.Variable) -> int:
    return int(np.prod(variable.shape, dtype=np.int64))
