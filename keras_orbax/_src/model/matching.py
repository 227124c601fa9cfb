"""Checkpoint record vs model: what to read onto which sharding, or why not."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import keras

from keras_orbax._src.compat import keras_compat
from keras_orbax._src.format.dtypes import can_cast
from keras_orbax._src.format.step_record import StepRecord, VariableRecord
from keras_orbax._src.model import shardings
from keras_orbax._src.model.state_keys import METRIC, OPTIMIZER, KeyedState
from keras_orbax._src.storage.byte_runs import Index
from keras_orbax.errors import CheckpointMismatchError


@dataclasses.dataclass(frozen=True)
class ReadRequest:
    """One array to read: what is on disk and what the variable needs."""

    record: VariableRecord
    target: jax.ShapeDtypeStruct  # the variable's shape, stored dtype and target sharding

    def local_indices(self) -> list[Index]:
        """The distinct regions this process's devices hold, in a stable order."""
        mapping = self.target.sharding.addressable_devices_indices_map(self.target.shape)
        return list({repr(index): index for index in mapping.values()}.values())


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a restore will do. `problems` empty means it can go ahead."""

    reads: dict[str, ReadRequest]  # by key
    missing: list[str]  # model keys the checkpoint lacks
    unexpected: list[str]  # checkpoint keys the model lacks
    mismatched: list[str]  # keys on both sides whose shape or dtype differ (or skipped with them)
    problems: list[str]  # one line per offending variable, naming both sides' Keras paths
    # Keys a strict restore refuses and `strict=False` skips (the model's keep their values).
    lenient: list[str] = dataclasses.field(default_factory=list)
    # Keys whose layout the mesh does not divide: a problem whatever the strictness.
    layouts: list[str] = dataclasses.field(default_factory=list)


def make_plan(
    record: StepRecord, state: KeyedState, *, strict: bool, optional: frozenset[str] = frozenset()
) -> Plan:
    """Compares the whole checkpoint with the model before anything is read or changed.

    With `strict`, a shape or dtype that differs is a problem, and so is a key on one side only if it
    is a model weight, or optimizer state of a model that has an optimizer (an uncompiled model
    simply does not take the optimizer's). Without `strict`, those keys are skipped, and the optimizer
    state is taken only if all of it matches (its keys are positions, as in Keras's own files). A
    layout that the mesh does not divide is always a problem. Metric variables are per-epoch
    accumulators that Keras creates lazily: restored where both sides have them, never a problem.
    `optional` keys are ones the source cannot hold (a `.weights.h5` has no seed-generator state):
    missing, they are not a problem either.
    """
    reads, problems, mismatched, differences, layouts = {}, [], [], {}, []
    variables = state.variables
    roles = {**{k: v.role for k, v in record.variables.items()}, **state.roles}
    missing = [key for key in variables if key not in record.variables]
    unexpected = [key for key in record.variables if key not in variables]
    for key, variable in variables.items():
        shape = tuple(int(n) for n in variable.shape)
        dtype = keras_compat.stored_dtype(variable)
        sharding = shardings.target_sharding(variable)
        saved = record.variables.get(key)
        if (error := shardings.layout_error(sharding, shape)) is not None:
            problems.append(f"{key} (model: {variable.path}): {error}")
            layouts.append(key)
        elif saved is None:
            continue
        elif saved.shape != shape or not can_cast(saved.dtype, dtype):
            mismatched.append(key)
            differences[key] = (
                f"{key}: checkpoint {_side(saved.path, saved.shape, saved.dtype)}, "
                f"model {_side(variable.path, shape, dtype)}"
            )
        else:
            reads[key] = ReadRequest(saved, jax.ShapeDtypeStruct(shape, dtype, sharding=sharding))
    has_optimizer = any(role == OPTIMIZER for role in state.roles.values())
    checked = [
        key
        for key in (*missing, *unexpected, *mismatched)
        if roles[key] != METRIC and key not in optional
    ]
    if not has_optimizer:
        checked = [key for key in checked if roles[key] != OPTIMIZER]
    lenient = list(checked)
    if strict:
        problems = [differences[k] for k in checked if k in differences] + problems
        problems += [_one_side(k, variables, record.variables) for k in checked if k in missing]
        problems += [_one_side(k, variables, record.variables) for k in checked if k in unexpected]
    elif any(roles[key] == OPTIMIZER for key in checked):
        # Optimizer keys are positions: once anything differs, none can be trusted to line up.
        dropped = [key for key in reads if roles[key] == OPTIMIZER]
        mismatched += dropped
        lenient += dropped
        reads = {k: r for k, r in reads.items() if k not in dropped}
    return Plan(reads, missing, unexpected, mismatched, problems, lenient, layouts)


def absent_optimizer(record: StepRecord, state: KeyedState) -> frozenset[str]:
    """The model's optimizer keys, where `record` holds no optimizer state at all (saved with
    `save_weights_only=True`, or from a model without an optimizer): as Keras's `load_weights` of
    such a file, a restore leaves the optimizer as it is rather than calling it missing."""
    if any(v.role == OPTIMIZER for v in record.variables.values()):
        return frozenset()
    return frozenset(k for k, role in state.roles.items() if role == OPTIMIZER)


def _side(path: str, shape: tuple[int, ...], dtype: str) -> str:
    return f"{path} {shape} {dtype}"


def _one_side(
    key: str, variables: dict[str, keras.Variable], saved: dict[str, VariableRecord]
) -> str:
    if key in variables:
        return f"{key} (model: {variables[key].path}): in the model, not in the checkpoint"
    return f"{key} (checkpoint: {saved[key].path}): in the checkpoint, not in the model"


def mismatch_error(
    model: keras.Model, location: object, problems: Sequence[str], *, hint: str = ""
) -> CheckpointMismatchError:
    """The one error a restore raises when the saved state does not fit the model: every
    problem on its line, what was left untouched, and `hint` where it applies."""
    lines = "\n".join(f"  {p}" for p in problems)
    return CheckpointMismatchError(
        f"Cannot restore model '{model.name}' from '{location}': "
        f"{counted(len(problems), 'problem')}.\n{lines}\n"
        f"No variable was modified.{' ' + hint if hint else ''}",
        problems,
    )


STRICT_HINT = "If the model changed on purpose, pass strict=False to restore only what matches."


def strict_hint(plan: Plan, strict: bool) -> str:
    """The advice for a strict restore that `strict=False` would let go ahead: keys on one side
    only, shapes or dtypes that differ. None where a layout is a problem, which no strictness
    gets around (the restore would fail again)."""
    return STRICT_HINT if strict and plan.lenient and not plan.layouts else ""


def counted(n: int, noun: str, plural: str = "") -> str:
    """`1 problem`, `2 problems` (`plural` where adding an s is wrong)."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def listed(names: Sequence[str], limit: int = 10) -> str:
    """`a, b, c`, the first `limit` of them, then `and N more`."""
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown}, and {len(names) - limit} more"
