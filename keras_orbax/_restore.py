"""`restore_sharded`: validate the whole plan, read every shard onto its device, assign all or nothing."""

from __future__ import annotations

import dataclasses
import os

import jax
import keras

from keras_orbax import _compat, _deferred, _keys, _multihost, _plan, _read, _steps
from keras_orbax._keys import OPTIMIZER
from keras_orbax._metadata import StepRecord
from keras_orbax.errors import CheckpointMismatchError, CorruptCheckpointError


@dataclasses.dataclass(frozen=True)
class RestoreResult:
    """What `restore_sharded` did.

    Attributes:
        step: The step restored.
        epoch: The epoch recorded with the step, if any.
        restored: Keys of the variables restored from the checkpoint.
        initialized: Keys of deferred variables the checkpoint lacked, initialized (strict=False).
        skipped: Keys that were not restored: model variables the checkpoint lacks or holds with
            another shape or dtype (kept as they were), and checkpoint entries the model lacks.
        bytes_read: Bytes of array data this process read.
        record: The checkpoint's full keras-orbax record.
    """

    step: int
    epoch: int | None
    restored: tuple[str, ...]
    initialized: tuple[str, ...]
    skipped: tuple[str, ...]
    bytes_read: int
    record: StepRecord = dataclasses.field(repr=False)

    @property
    def num_variables(self) -> int:
        return len(self.restored)


def restore_sharded(
    model: keras.Model,
    directory: str | os.PathLike,
    step: int | None = None,
    *,
    strict: bool = True,
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

    Returns:
        A `RestoreResult`: step, epoch, keys restored and skipped, bytes this process read.

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
    # Collective: every process checks what it will read, then reads its shards; all raise if any
    # fails, and only then does any process assign.
    step, record, variables, plan, reads = _multihost.run_collectively(
        "restore_sharded/plan", _prepare, model, directory, step, strict
    )
    arrays, bytes_read = _multihost.run_collectively(
        "restore_sharded/read", _read_checked, plan, reads
    )
    # Every array is read: from here on nothing can fail halfway.
    for key, array in arrays.items():
        _compat.set_value(variables[key], array)
    not_read = [*plan.missing, *plan.mismatched]
    initialized = [k for k in not_read if _deferred.is_deferred(variables[k])]
    for key in initialized:
        _deferred.initialize(variables[key])
    return RestoreResult(
        step=step,
        epoch=record.epoch,
        restored=tuple(arrays),
        initialized=tuple(initialized),
        skipped=tuple(k for k in (*not_read, *plan.unexpected) if k not in initialized),
        bytes_read=bytes_read,
        record=record,
    )


def _prepare(
    model: keras.Model, directory: str | os.PathLike, step: int | None, strict: bool
) -> tuple[int, StepRecord, dict[str, keras.Variable], _plan.Plan, _read.ReadPlan]:
    """Everything a restore decides before reading: the step, the plan, the files checked."""
    step, path = _steps.step_path(directory, step)
    record = _steps.read_record(path)
    _build_optimizer_if_needed(model, record)
    variables = _keys.keyed_variables(model)
    plan = _plan.make_plan(record, variables, strict=strict)
    if plan.problems:
        raise CheckpointMismatchError(_mismatch_message(model, path, plan, strict), plan.problems)
    reads = _read.plan_reads(path, list(plan.reads.values()))
    return step, record, variables, plan, reads


def _read_checked(plan: _plan.Plan, reads: _read.ReadPlan) -> tuple[dict[str, jax.Array], int]:
    """Reads every planned array and checks that each is one: the right key, type, shape, dtype
    and sharding. A damaged file can make a reader hand back something else (Orbax returns the
    abstract target for a key its tree metadata lost); nothing may be assigned then."""
    arrays, bytes_read = _read.read_arrays(reads)
    wrong = []
    for key, request in plan.reads.items():
        array, target = arrays.get(key), request.target
        if not (
            isinstance(array, jax.Array)
            and array.shape == target.shape
            and array.dtype == target.dtype
            and array.sharding.is_equivalent_to(target.sharding, len(target.shape))
        ):
            got = f"{array.shape} {array.dtype}" if isinstance(array, jax.Array) else repr(array)
            wrong.append(f"  {key}: read {got[:80]}, expected {target.shape} {target.dtype}")
    if wrong:
        raise CorruptCheckpointError(
            f"Checkpoint step '{reads.step_dir}' did not yield the arrays its record lists "
            f"({len(wrong)}):\n" + "\n".join(wrong[:20]) + "\nNo variable was modified."
        )
    return arrays, bytes_read


def _build_optimizer_if_needed(model: keras.Model, record: StepRecord) -> None:
    optimizer = getattr(model, "optimizer", None)
    if not isinstance(optimizer, keras.optimizers.Optimizer) or optimizer.built:
        return
    slots = [k for k in record.variables if k.startswith(f"{OPTIMIZER}/{_keys.MODEL}/")]
    if slots:
        _deferred.build_optimizer(model)


def _mismatch_message(model: keras.Model, path: os.PathLike, plan: _plan.Plan, strict: bool) -> str:
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
