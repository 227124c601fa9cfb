"""Checkpoint record vs model: what to read onto which sharding, or why not."""

from __future__ import annotations

import dataclasses

import jax
import keras

from keras_orbax import _compat, _shardings
from keras_orbax._dtypes import can_cast
from keras_orbax._keys import MODEL
from keras_orbax._metadata import StepRecord
from keras_orbax._read import ReadRequest


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a restore will do. `problems` empty means it can go ahead."""

    reads: dict[str, ReadRequest]  # by key
    missing: list[str]  # model keys the checkpoint lacks
    unexpected: list[str]  # checkpoint keys the model lacks
    problems: list[str]  # one line per offending variable


def make_plan(record: StepRecord, variables: dict[str, keras.Variable], *, strict: bool) -> Plan:
    """Compares the whole checkpoint with the model before anything is read or changed.

    Model variables the checkpoint lacks are problems when `strict`. Checkpoint entries the model
    lacks are problems when `strict` and they are model weights, or optimizer/metric state of a
    model that has such state (an uncompiled model simply does not take the optimizer's).
    """
    reads, problems = {}, []
    missing = [key for key in variables if key not in record.variables]
    unexpected = [key for key in record.variables if key not in variables]
    for key, variable in variables.items():
        saved = record.variables.get(key)
        if saved is None:
            continue
        shape = tuple(int(n) for n in variable.shape)
        dtype = _compat.stored_dtype(variable)
        sharding = _shardings.target_sharding(variable)
        where = f"{key} ({variable.path})" if variable.path != key else key
        if saved.shape != shape:
            problems.append(f"{where}: checkpoint shape {saved.shape}, model shape {shape}")
        elif not can_cast(saved.dtype, dtype):
            problems.append(f"{where}: checkpoint dtype {saved.dtype}, model dtype {dtype}")
        elif (error := _shardings.layout_error(sharding, shape)) is not None:
            problems.append(f"{where}: {error}")
        else:
            reads[key] = ReadRequest(saved, jax.ShapeDtypeStruct(shape, dtype, sharding=sharding))
    if strict:
        problems += [f"{key}: in the model, not in the checkpoint" for key in missing]
        groups = {key.split("/", 1)[0] for key in variables}
        problems += [
            f"{key}: in the checkpoint, not in the model"
            for key in unexpected
            if key.split("/", 1)[0] in groups | {MODEL}
        ]
    return Plan(reads, missing, unexpected, problems)
