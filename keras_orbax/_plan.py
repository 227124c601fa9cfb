"""Checkpoint record vs model: what to read onto which sharding, or why not."""

from __future__ import annotations

import dataclasses

import jax
import keras

from keras_orbax import _compat, _shardings
from keras_orbax._dtypes import can_cast
from keras_orbax._keys import MODEL, OPTIMIZER
from keras_orbax._metadata import StepRecord
from keras_orbax._read import ReadRequest

_STRICT_GROUPS = {MODEL, OPTIMIZER}


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a restore will do. `problems` empty means it can go ahead."""

    reads: dict[str, ReadRequest]  # by key
    missing: list[str]  # model keys the checkpoint lacks
    unexpected: list[str]  # checkpoint keys the model lacks
    mismatched: list[str]  # keys on both sides whose shape or dtype differ
    problems: list[str]  # one line per offending variable


def make_plan(record: StepRecord, variables: dict[str, keras.Variable], *, strict: bool) -> Plan:
    """Compares the whole checkpoint with the model before anything is read or changed.

    With `strict`, a shape or dtype that differs is a problem, and so is a key on one side only if it
    is a model weight, or optimizer state of a model that has an optimizer (an uncompiled model
    simply does not take the optimizer's). Without `strict`, those keys are skipped. A layout that
    the mesh does not divide is always a problem.
    Metric variables are per-epoch accumulators that Keras creates lazily: they are restored where
    both sides have them and never make a restore fail.
    """
    reads, problems, mismatched, differences = {}, [], [], []
    missing = [key for key in variables if key not in record.variables]
    unexpected = [key for key in record.variables if key not in variables]
    for key, variable in variables.items():
        shape = tuple(int(n) for n in variable.shape)
        dtype = _compat.stored_dtype(variable)
        sharding = _shardings.target_sharding(variable)
        where = f"{key} ({variable.path})" if variable.path != key else key
        saved = record.variables.get(key)
        if (error := _shardings.layout_error(sharding, shape)) is not None:
            problems.append(f"{where}: {error}")
        elif saved is None:
            continue
        elif saved.shape != shape:
            mismatched.append(key)
            differences.append(f"{where}: checkpoint shape {saved.shape}, model shape {shape}")
        elif not can_cast(saved.dtype, dtype):
            mismatched.append(key)
            differences.append(f"{where}: checkpoint dtype {saved.dtype}, model dtype {dtype}")
        else:
            reads[key] = ReadRequest(saved, jax.ShapeDtypeStruct(shape, dtype, sharding=sharding))
    if strict:
        problems = differences + problems
        groups = {_group(key) for key in variables} & _STRICT_GROUPS | {MODEL}
        problems += [
            f"{k}: in the model, not in the checkpoint" for k in missing if _group(k) in groups
        ]
        problems += [
            f"{k}: in the checkpoint, not in the model" for k in unexpected if _group(k) in groups
        ]
    return Plan(reads, missing, unexpected, mismatched, problems)


def _group(key: str) -> str:
    return key.split("/", 1)[0]
