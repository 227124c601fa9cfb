"""Restoring from the weight files people already have: `.weights.h5`, a sharded `.weights.json`,
a `.keras` archive, a keras-hub preset directory (Keras format).

Which stored array goes to which variable is decided by Keras's own loader (`_keras_loader`); the
plan, the all-or-nothing checks and the region reads are the same as for keras-orbax's own steps.
"""

from __future__ import annotations

import os
from pathlib import Path

import keras

from keras_orbax._src.format.step_record import StepRecord, VariableRecord
from keras_orbax._src.model import matching, state_keys
from keras_orbax._src.model.deferred import deferred_copy
from keras_orbax._src.model.state_keys import METRIC, MODEL, OPTIMIZER
from keras_orbax._src.read import sharded_read
from keras_orbax._src.sources import h5_files
from keras_orbax._src.sources.keras_loader import trace_load
from keras_orbax.errors import CheckpointMismatchError, CheckpointNotFoundError

_PRESET_WEIGHTS = ("model.weights.json", "model.weights.h5")


def weights_file(path: str | os.PathLike) -> Path | None:
    """The Keras weights file `path` names or holds (a keras-hub preset directory's), or None if
    it is not one (a keras-orbax checkpoint directory)."""
    path = Path(path)
    if path.is_file() or path.name.endswith((".h5", ".keras", ".weights.json")):
        return path
    if (path / "config.json").is_file():
        for name in _PRESET_WEIGHTS:
            if (path / name).is_file():
                return path / name
    return None


def prepare(
    model: keras.Model, file: Path, strict: bool
) -> tuple[StepRecord, state_keys.KeyedState, matching.Plan, sharded_read.ReadPlan]:
    """Plans a restore of `model` from a Keras weights file; changes nothing.

    Raises:
        CheckpointNotFoundError: the file does not exist.
        CheckpointMismatchError: Keras's loader refuses a layer, or the plan finds problems.
        CorruptCheckpointError: a file is unreadable or truncated.
    """
    if not file.exists():
        raise CheckpointNotFoundError(f"Weights file does not exist: '{file}'")
    arrays = h5_files.h5_datasets(file)
    saved_optimizer = [name for name in arrays if name.startswith("optimizer/")]
    stand_in = _optimizer_stand_in(model, len(saved_optimizer))
    state = state_keys.keyed_state(model, optimizer=stand_in)
    traced = trace_load(model, arrays, state, stand_in)
    record = StepRecord(step=0, variables={}, format_version=0)
    for key, feed in traced.feeds.items():
        record.variables[key] = VariableRecord(
            key, feed.source, feed.shape, feed.dtype, feed.source, role=state.roles[key]
        )
    for name, array in arrays.items():
        if name not in traced.consumed and name not in record.variables:
            role = OPTIMIZER if name.startswith("optimizer/") else MODEL
            record.variables[name] = VariableRecord(
                name, name, tuple(array.shape), str(array.dtype), name, role=role
            )
    optional = {k for k in state.variables if "/seed_generators/" in k or state.roles[k] == METRIC}
    if not saved_optimizer:  # a file saved without optimizer state: Keras keeps the optimizer's
        optional |= {k for k, role in state.roles.items() if role == OPTIMIZER}
    plan = matching.make_plan(record, state, strict=strict, optional=frozenset(optional))
    problems = [*traced.problems, *plan.problems] if strict else plan.problems
    if problems:
        lines = "\n".join(f"  {p}" for p in problems)
        raise CheckpointMismatchError(
            f"Cannot restore model '{model.name}' from '{file}': {len(problems)} problems.\n"
            f"{lines}\nNo variable was modified."
            + (" Pass strict=False to restore only what matches." if strict else ""),
            problems,
        )
    feeds = traced.feeds
    reads = sharded_read.plan_reads(file, list(plan.reads.values()), lambda r: feeds[r.key].reader)
    return record, state, plan, reads


def _optimizer_stand_in(model: keras.Model, saved: int) -> keras.optimizers.Optimizer | None:
    """A deferred copy of an unbuilt optimizer if the file holds more optimizer state than it has:
    as Keras's `load_model` builds the optimizer before loading, so that it takes the file's."""
    optimizer = getattr(model, "optimizer", None)
    if not isinstance(optimizer, keras.optimizers.Optimizer) or optimizer.built:
        return None
    if saved <= len(optimizer.variables):
        return None
    return deferred_copy(optimizer, model.trainable_variables)
