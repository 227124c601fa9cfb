"""`save`: one committed step, each process writing only the shards its devices own."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import keras
import numpy as np
import orbax.checkpoint.experimental.v1 as ocp

from keras_orbax._src.compat import keras_compat, orbax_compat
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
from keras_orbax._src.storage import commit, durable, locations
from keras_orbax._src.storage.writer_lock import writer_lock
from keras_orbax._src.write import data_state_writer, shard_writer
from keras_orbax._src.write import incremental as incremental_saves
from keras_orbax.errors import (
    DeferredVariableError,
    KerasOrbaxError,
    SaveFailedError,
    StepExistsError,
)

SaveFormat = Literal["fast", "compact"]
# "fast": one uncompressed file per shard, chunk = shard (one file for an array of <= 1 MiB), so
# restore reads each file once, straight into the buffer its device uses (docs/format.md); keras-orbax
# writes these files itself (`shard_writer`). "compact": Orbax's defaults, zstd-compressed chunks in one
# OCDBT database per process: smaller, fewer files.
_FORMATS: dict[str, dict[str, bool]] = {
    "fast": {
        "use_zarr3": True,
        "use_compression": False,
        "use_ocdbt": False,
        "use_replica_parallel": False,
    },
    "compact": {"use_zarr3": True, "use_compression": True, "use_ocdbt": True},
}


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
        overwrite: Replace `step` if it is already committed.
        incremental: Write only the shard files whose content changed since the latest
            committed step before `step` in `directory`; the others are hard links to that
            step's files (in object storage: copies made by the store), so every step stays
            whole (fast format; docs/incremental.md). False writes every file and records no
            fingerprints.
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
    _check_format(format, directory)
    check_rewrite_every(rewrite_every)
    multihost.same_arguments("save", directory=os.fspath(directory), step=step, format=format)
    checked = _checked_variables(model, directory, step, overwrite=overwrite, weights_only=False)
    try:
        with (
            writer_lock(directory, step),  # released once the checkpointer has closed
            quiet.skipped_merge_notices(directory),
            open_checkpointer(directory, format) as checkpointer,
        ):
            # Again under the lock (process 0 holds it and decides): a writer that held it may
            # have committed the step since the check above.
            multihost.primary_value(
                f"save/step {step} free", _refuse_committed, directory, step, overwrite
            )
            write_step(
                checkpointer,
                model,
                step=step,
                epoch=epoch,
                overwrite=overwrite,
                checked=checked,
                incremental=incremental,
                rewrite_every=rewrite_every,
            )
    except Exception as error:  # the write failed: a full disk, a read-only directory...
        if isinstance(error, KerasOrbaxError) and not isinstance(error, SaveFailedError):
            raise  # the caller's input (StepExistsError...), or a process that never reported
        steps = step_dirs.committed_steps(directory)
        intact = f" The last committed step, {steps[-1]}, is intact." if steps else ""
        raise SaveFailedError(
            f"Saving step {step} to '{locations.as_path(directory)}' failed: "
            f"{type(error).__name__}: {error}. Nothing was committed.{intact}"
        ) from error
    return locations.as_path(directory) / str(step)


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


def open_checkpointer(
    directory: str | os.PathLike,
    format: SaveFormat = "fast",
    preservation_policy: Any = None,
    *,
    leaf_handler: type = shard_writer.FastArrayLeafHandler,
    commit_timeout_s: int | None = None,
) -> ocp.training.Checkpointer:
    """An Orbax `training.Checkpointer` that writes keras-orbax's array format.

    `leaf_handler` writes the fast format's arrays (`array_writer` holds the step open instead);
    `commit_timeout_s` replaces Orbax's limit on the time from a save's start to its commit.
    """
    _check_format(format, directory)
    context = ocp.Context()
    for option, value in _FORMATS[format].items():
        setattr(context.array.saving, option, value)
    # The shard files written by keras-orbax ("fast") or by Orbax ("compact"); either way every
    # process's outcome agreed on (`_agree_on_write`) before Orbax commits the step. Both formats
    # hold each process's input position (`data_state_writer`).
    array_handler = leaf_handler if format == "fast" else orbax_compat.array_leaf_handler()
    context.checkpointables_options.registry = data_state_writer.register(_registry(array_handler))
    if commit_timeout_s is not None:
        context.async_options.timeout_secs = commit_timeout_s
    if locations.is_remote(directory):  # no atomic rename: a marker file commits the step
        context.atomicity.mode = ocp.options.AtomicityMode.COMMIT_FILE
    return ocp.training.Checkpointer(
        locations.as_path(directory), context=context, preservation_policy=preservation_policy
    )


def _registry(leaf_handler: type) -> Any:
    """Orbax's handlers, with `state` saved by a PyTreeHandler whose `jax.Array` leaves go to
    `leaf_handler` and whose commit waits for `_agree_on_write`."""
    handler = orbax_compat.pytree_handler_with_array_writer(leaf_handler, _agree_on_write)
    registry = ocp.handlers.local_registry(include_global_registry=False)
    registry.add(handler, checkpointable_name=STATE)
    default = ocp.handlers.local_registry()
    for handler_type, name in default.get_all_entries():
        if name != STATE:
            registry.add(
                handler_type,
                checkpointable_name=name,
                secondary_typestrs=default.get_secondary_typestrs(handler_type),
            )
    return registry


def _agree_on_write(operation_id: str, error: BaseException | None, wait_s: float | None) -> None:
    """The step's "agree" stage, between this process's writes and Orbax's commit: every process
    reports whether its shard files were written and fsynced; if any failed, every process raises
    `SaveFailedError` naming it, and none enters Orbax's commit barrier. Processes that are only
    slower are waited for as long as Orbax's own limit on the write (`wait_s`).

    Raises:
        SaveFailedError: a process failed (its error named); the step is not committed.
        ProcessSyncError: a process did not report within `wait_s`.
    """
    commit.fault_point("agree")
    multihost.agree_on_outcome(
        "writing the step's files", operation_id, error, wait_s=wait_s, fallback=SaveFailedError
    )
    commit.fault_point("rename")  # Orbax's finalize: its metadata, then the rename


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
    """
    state, variables = checked or _checked_variables(
        model, checkpointer.directory, step, overwrite=overwrite, weights_only=weights_only
    )
    record = StepRecord(
        step=step,
        epoch=epoch,
        batch=batch,
        variables={key: _record(key, v, state.roles[key]) for key, v in variables.items()},
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

    def start() -> DurableResponse | None:
        commit.fault_point("stage")
        plan = (
            incremental_saves.plan_for(checkpointer.directory, step, rewrite_every)
            if incremental
            else None
        )
        synced = durable.Synced()  # the files the writer fsyncs: not fsynced again at commit
        with incremental_saves.planned(plan), shard_writer.noting_fsyncs(synced):
            response = checkpointer.save_checkpointables_async(
                step,
                checkpointables,
                force=True,
                overwrite=overwrite,
                metrics=metrics,
                custom_metadata={FORMAT_NAME: record.to_json()},
            )
        if response is None:
            return None
        return DurableResponse(response, checkpointer.directory, step, synced)

    if start_later and not blocking:
        staged = shard_writer.stage({key.replace("/", "."): value for key, value in values.items()})
        return LaterSave(start, staged)
    # Waited for at once, the save may write from the live device buffers; in the background it
    # must copy them first (the next train step donates them).
    with shard_writer.shards_stay_unchanged() if blocking else contextlib.nullcontext():
        response = start()
    if blocking and response is not None:
        response.result()
    return response


class DurableResponse:
    """Orbax's response to a save, whose `result()` waits for the commit and then makes the step
    durable (`durable.step_committed`: Orbax fsyncs neither its own files nor the rename).

    Hand the checkpointer no preservation policy: Orbax would delete older steps before the commit
    is reported, so before this fsync. `ModelCheckpoint` deletes them once `result()` has returned
    (`training/retention.py`). `synced`: the files the writer fsynced already
    (`shard_writer.noting_fsyncs`), not fsynced again.
    """

    def __init__(
        self,
        response: ocp.AsyncResponse,
        directory: Any,
        step: int,
        synced: durable.Synced | None = None,
    ) -> None:
        self._response, self._step_dir = response, locations.as_path(directory) / str(step)
        self._synced = synced

    def result(self) -> None:
        self._response.result()
        commit.fault_point("fsync")
        if not locations.is_remote(self._step_dir):  # an object is durable once written
            durable.step_committed(self._step_dir, self._synced)


class LaterSave:
    """A save whose shards are on the host already; `result()` writes and commits it."""

    def __init__(self, start: Callable[[], DurableResponse | None], staged: Any) -> None:
        self._start, self._staged = start, staged

    def result(self) -> None:
        with shard_writer.from_staged(self._staged):
            response = self._start()
        if response is not None:
            response.result()


def _check_format(format: str, directory: str | os.PathLike) -> None:
    if format not in _FORMATS:
        raise ValueError(f"format must be one of {sorted(_FORMATS)}. Received: format={format!r}")
    if format == "compact" and os.fspath(directory).startswith("s3://"):
        # Orbax builds a local file path for the arrays of an s3:// checkpoint in this format.
        raise ValueError(
            "format='compact' cannot be written to s3:// (Orbax's tensorstore path for it is "
            "local-only); use the default format='fast'. "
            f"Received: format={format!r}, directory={os.fspath(directory)!r}"
        )


def _checked_variables(
    model: keras.Model,
    directory: Any,
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
    _refuse_committed(directory, step, overwrite)
    return state, variables


def _refuse_committed(directory: Any, step: int, overwrite: bool) -> None:
    """Raises StepExistsError if `step` is committed and not to be overwritten. Decisive only
    under the step's writer lock; before it, only a check that fails early."""
    if not overwrite and step in step_dirs.committed_steps(directory):
        raise StepExistsError(
            f"Step {step} is already committed in '{locations.as_path(directory)}'. Pass "
            f"overwrite=True to replace it. Received: step={step}"
        )


def _record(key: str, variable: keras.Variable, role: str) -> VariableRecord:
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
