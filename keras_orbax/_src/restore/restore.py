"""`restore_sharded`: validate the whole plan, read every shard onto its device, assign all or nothing."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import jax
import keras

from keras_orbax._src.compat import keras_compat
from keras_orbax._src.format import checksum, step_dirs
from keras_orbax._src.format.step_record import StepRecord
from keras_orbax._src.format.zarr_shards import FastArray
from keras_orbax._src.model import deferred, matching, state_keys, state_keys_v1
from keras_orbax._src.model.state_keys import OPTIMIZER
from keras_orbax._src.read import replicas, sharded_read
from keras_orbax._src.runtime import gc_pause, multihost
from keras_orbax._src.sources import hf_directory, keras_checkpoint, keras_weights
from keras_orbax._src.storage import locations
from keras_orbax.errors import CheckpointMismatchError, CorruptCheckpointError


@dataclasses.dataclass(frozen=True)
class RestoreResult:
    """What `restore_sharded` did.

    Attributes:
        step: The step restored (None for a Keras weights file).
        epoch: The epoch recorded with the step, if any.
        restored: Keys of the variables restored from the checkpoint.
        initialized: Keys of deferred variables the checkpoint lacked, initialized (strict=False).
        skipped: Keys that were not restored: model variables the checkpoint lacks or holds with
            another shape or dtype (kept as they were), and checkpoint entries the model lacks.
        bytes_read: Bytes of array data this process read from storage.
        record: The checkpoint's full keras-orbax record.
        bytes_received: Bytes of array data this process's devices received from other processes
            instead of reading them (`single_replica_reads`); with `bytes_read`, every distinct
            region its devices hold, once.
    """

    step: int | None
    epoch: int | None
    restored: tuple[str, ...]
    initialized: tuple[str, ...]
    skipped: tuple[str, ...]
    bytes_read: int
    record: StepRecord = dataclasses.field(repr=False)
    bytes_received: int = 0

    @property
    def num_variables(self) -> int:
        return len(self.restored)


@gc_pause.paused()
def restore_sharded(
    model: keras.Model,
    directory: str | os.PathLike,
    step: int | None = None,
    *,
    strict: bool = True,
    verify: bool = False,
    read_window_bytes: int | None = None,
    single_replica_reads: bool | None = None,
    verbose: int = 0,
) -> RestoreResult:
    """Restores `model` from a checkpoint, each shard read straight onto its device.

    Call on every process. Each process reads only the shards its devices own under the active
    `keras.distribution` (`ModelParallel`, `DataParallel`, or none: one device), whatever mesh the
    checkpoint was saved on. Floats are cast shard by shard where the model's dtype differs. The
    whole checkpoint is checked against the model first; either every variable is restored or
    none is changed.

    Args:
        model: A model built normally or under `keras_orbax.deferred_init()`. If it has an optimizer
            that is not built yet, it is built so that its state can be restored.
        directory: The root given to `save` or to the `ModelCheckpoint` callback.
        step: The step to restore; `None` means the latest committed one.
        strict: If False, restore what matches: variables the checkpoint lacks or holds with another
            shape or dtype keep their values (deferred ones are initialized), and checkpoint
            entries the model lacks are ignored. `RestoreResult.skipped` lists them.
        verify: Before reading, check every shard file this process reads against the checksum
            written with it (reads those files twice); a mismatch raises `CorruptCheckpointError`.
        read_window_bytes: Host memory for regions read ahead of being placed on their devices;
            default 512 MiB or the largest region, whichever is larger.
        single_replica_reads: Where several processes hold replicas of a region (`DataParallel`,
            or a layout replicated over a mesh axis that spans processes), one of them reads it
            from storage and sends it to the others over the interconnect (a JAX collective), so
            the checkpoint is read once in all, the reading spread evenly over the processes.
            `None` (default) does so in object storage (`gs://`, `s3://`) and on accelerators
            (GPU, TPU), not from local files on the CPU backend, where gloo over TCP is slower
            than reading; `False` has every process read its own replicas. One process: no
            effect.
        verbose: 1 shows the bytes read and the rate on a terminal (process 0 only).

    Returns:
        A `RestoreResult`: step, epoch, keys restored and skipped, bytes this process read and
        received.

    Raises:
        CheckpointNotFoundError: no such directory, no committed step, or no such step.
        CheckpointMismatchError: keys, shapes, dtypes or layouts do not fit; the message lists each.
        CorruptCheckpointError: array files are missing, truncated or unreadable.

    Example:
    ```python
    keras.distribution.set_distribution(ModelParallel(layout_map=layout_map))
    with keras_orbax.deferred_init():
        model = build_model()
    keras_orbax.restore_sharded(model, "/ckpt")
    ```
    """
    # Collective: process 0 picks the step; every process checks what it will read, then reads its
    # shards; all raise if any fails, and only then does any process change anything.
    local = not locations.is_remote(directory)  # Keras and Hugging Face files: local only
    share = replicas.enabled(single_replica_reads, object_storage=not local)
    file = keras_weights.weights_file(directory) if local else None
    if local and hf_directory.is_transformers_directory(Path(directory)):
        record, state, plan, reads = multihost.run_collectively(
            "restore_sharded/plan", hf_directory.prepare, model, Path(directory), strict
        )
        reads = replicas.share(reads) if share else reads
    elif file is not None:
        record, state, plan, reads = multihost.run_collectively(
            "restore_sharded/plan", keras_weights.prepare, model, file, strict
        )
        reads = replicas.share(reads) if share else reads
    else:
        step = multihost.primary_value(
            "restore_sharded/step", step_dirs.resolve_step, directory, step
        )
        record, state, plan, reads = multihost.run_collectively(
            "restore_sharded/plan", _prepare, model, directory, step, strict, verify, share
        )
    arrays, bytes_read = multihost.run_collectively(
        "restore_sharded/read",
        _read_checked,
        plan,
        reads,
        read_window_bytes,
        bool(verbose) and multihost.is_primary(),
    )
    # Every array is read: from here on nothing can fail halfway.
    variables = _attach_optimizer(model, record, state)
    for key, array in arrays.items():
        keras_compat.set_value(variables[key], array)
    not_read = [*plan.missing, *plan.mismatched]
    initialized = [k for k in not_read if deferred.is_deferred(variables[k])]
    for key in initialized:
        deferred.initialize(variables[key])
    return RestoreResult(
        step=step,
        epoch=record.epoch,
        restored=tuple(arrays),
        initialized=tuple(initialized),
        skipped=tuple(k for k in (*not_read, *plan.unexpected) if k not in initialized),
        bytes_read=bytes_read,
        record=record,
        bytes_received=reads.received_bytes,
    )


def _prepare(
    model: keras.Model,
    directory: str | os.PathLike,
    step: int,
    strict: bool,
    verify: bool = False,
    share: bool = False,
) -> tuple[StepRecord, state_keys.KeyedState, matching.Plan, sharded_read.ReadPlan]:
    """Everything a restore decides before reading: the plan, the files checked. Changes nothing:
    an optimizer that is not built yet is planned through a deferred copy of it. `share`: read
    each region replicated across processes on one of them only (`replicas`)."""
    path, record, state, plan = plan_restore(model, directory, step, strict)
    if plan.problems:
        raise CheckpointMismatchError(_mismatch_message(model, path, plan, strict), plan.problems)
    reads = sharded_read.plan_reads(path, list(plan.reads.values()))
    if share:
        reads = replicas.share(reads)
    if verify:
        fast = {request.record.key: (array, indices) for request, array, indices in reads.fast}

        def read_files(array: FastArray) -> list[tuple[int, ...]]:
            indices = fast[array.key][1]
            return list(dict.fromkeys(c for index in indices for c in array.chunks_of(index)))

        arrays = {key: array for key, (array, _) in fast.items() if isinstance(array, FastArray)}
        checksum.check_files(path, f"Checkpoint step '{path}'", arrays, read_files)
    if keras_checkpoint.is_keras_step(path):
        reads = dataclasses.replace(
            reads,
            checkpointable=keras_checkpoint.PYTREE,
            tree_paths=keras_checkpoint.tree_keys(record),
        )
    return record, state, plan, reads


def _read_checked(
    plan: matching.Plan,
    reads: sharded_read.ReadPlan,
    window_bytes: int | None = None,
    show_progress: bool = False,
) -> tuple[dict[str, jax.Array], int]:
    """Reads every planned array and checks that each is one: the right key, type, shape, dtype
    and sharding. A damaged file can make a reader hand back something else (Orbax returns the
    abstract target for a key its tree metadata lost); nothing may be assigned then."""
    arrays, bytes_read = sharded_read.read_arrays(
        reads, window_bytes=window_bytes, show_progress=show_progress
    )
    wrong = []
    for key, request in plan.reads.items():
        array, target = arrays.get(key), request.target
        if not (
            isinstance(array, jax.Array)
            and array.shape == target.shape
            and array.dtype == target.dtype
            and (
                array.sharding is target.sharding  # as placed: no need to compare device maps
                or array.sharding.is_equivalent_to(target.sharding, len(target.shape))
            )
        ):
            got = f"{array.shape} {array.dtype}" if isinstance(array, jax.Array) else repr(array)
            wrong.append(f"  {key}: read {got[:80]}, expected {target.shape} {target.dtype}")
    if wrong:
        raise CorruptCheckpointError(
            f"Checkpoint step '{reads.step_dir}' did not yield the arrays its record lists "
            f"({len(wrong)}):\n" + "\n".join(wrong[:20]) + "\nNo variable was modified."
        )
    return arrays, bytes_read


def plan_restore(
    model: keras.Model, directory: str | os.PathLike, step: int | None, strict: bool
) -> tuple[Path, StepRecord, state_keys.KeyedState, matching.Plan]:
    """The step's directory and record, the model's keyed state and the plan; reads no array
    and raises nothing for a plan with problems. A step of Keras's own `OrbaxCheckpoint` is
    keyed by the model's variables (`keras_checkpoint`)."""
    step, path = step_dirs.step_path(directory, step)
    if keras_checkpoint.is_keras_step(path):
        saved = keras_checkpoint.tree_record(step, path)
        state = _key_state(model, saved, _unbuilt_optimizer_stand_in(model, saved))
        record = keras_checkpoint.model_record(saved, state, model)
        optional = keras_checkpoint.optional_keys(saved, state)
    else:
        record = step_dirs.read_record(path)
        state = _key_state(model, record, _unbuilt_optimizer_stand_in(model, record))
        optional = frozenset()
    return path, record, state, matching.make_plan(record, state, strict=strict, optional=optional)


def _key_state(
    model: keras.Model, record: StepRecord, optimizer: keras.optimizers.Optimizer | None = None
) -> state_keys.KeyedState:
    """The model's state keyed by the scheme the step was written with."""
    if record.format_version == 1:
        return state_keys_v1.keyed_state(model, optimizer=optimizer)
    return state_keys.keyed_state(model, optimizer=optimizer)


def _unbuilt_optimizer_stand_in(
    model: keras.Model, record: StepRecord
) -> keras.optimizers.Optimizer | None:
    """A deferred copy of `model.optimizer`, built, if the optimizer is not built yet and the step
    holds optimizer slots: its variables have the shapes, layouts and keys the real ones will get,
    and allocate nothing."""
    optimizer = getattr(model, "optimizer", None)
    if not isinstance(optimizer, keras.optimizers.Optimizer) or optimizer.built:
        return None
    saved = sum(v.role == OPTIMIZER for v in record.variables.values())
    if saved <= len(optimizer.variables):  # only what exists before build (the step counter...)
        return None
    return deferred.deferred_copy(optimizer, model.trainable_variables)


def _attach_optimizer(
    model: keras.Model, record: StepRecord, planned: state_keys.KeyedState
) -> dict[str, keras.Variable]:
    """Builds the model's optimizer if the plan went through a stand-in of it; the variables by key."""
    optimizer = getattr(model, "optimizer", None)
    if not isinstance(optimizer, keras.optimizers.Optimizer) or optimizer.built:
        return planned.variables
    if sum(role == OPTIMIZER for role in planned.roles.values()) <= len(optimizer.variables):
        return planned.variables  # planned without a stand-in: nothing of the optimizer is read
    deferred.build_optimizer(model)
    variables = _key_state(model, record).variables
    if list(variables) != list(planned.variables):  # a stand-in that differs is a bug of ours
        raise RuntimeError(
            f"keras-orbax: optimizer '{optimizer.name}' built with other variables than planned "
            "for; no variable was modified."
        )
    return variables


def _mismatch_message(
    model: keras.Model, path: os.PathLike, plan: matching.Plan, strict: bool
) -> str:
    lines = "\n".join(f"  {p}" for p in plan.problems)
    hint = (
        " If the model changed on purpose, pass strict=False to restore only what matches."
        if strict and (plan.missing or plan.unexpected or plan.mismatched)
        else ""
    )
    return (
        f"Cannot restore model '{model.name}' from '{path}': {len(plan.problems)} problems.\n"
        f"{lines}\nNo variable was modified.{hint}"
    )
