"""Steps written by Keras's own `keras.callbacks.OrbaxCheckpoint`, read as keras-orbax steps.

Keras (3.15) saves `model.get_state_tree()` as the checkpointable `pytree` of `<directory>/<step>`:
leaves keyed by collection and variable path (`trainable_variables/dense/kernel`,
`optimizer_variables/adam/dense_kernel_momentum`, `metrics_variables/loss/total`), plus a
`model_config` checkpointable (the model's JSON). `model.set_state_tree` gives each leaf to the
variable of that collection whose `path` is the leaf's path. The same rule maps each leaf to a
keras-orbax key here, so the plan, the all-or-nothing checks and the sharded reads are the usual
ones; arrays are read through Orbax with each variable's target sharding.

Paths carry Keras's global name counters: the same model built again in one process has
`dense_1/kernel` where the checkpoint says `dense/kernel`, and Keras then silently restores
nothing of it. Here, variables left unmatched by exact paths are matched by their paths with the
counters removed (`dense_1` -> `dense`) where that pairs them one to one in order, shape and
dtype agreeing; then the same without the model's name, which a Sequential built with an `Input`
puts in front of its paths and one built from its config (by `load_model`) does not. Anything else
is reported missing or unexpected as usual.

```python
keras_orbax.restore_sharded(model, "/keras_orbax_checkpoint_dir")  # written by Keras's callback
```
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from keras_orbax._src.format.step_record import (
    METRIC,
    MODEL,
    OPTIMIZER,
    Role,
    StepRecord,
    VariableRecord,
)
from keras_orbax._src.model import name_counters
from keras_orbax._src.sources.base import Prepared, Source
from keras_orbax.errors import CorruptCheckpointError

# Keras, Orbax and the restore's modules load in the functions that use them: `is_keras_step`
# decides what a location is for every verb, `keras-orbax inspect` included (see `base`).
if TYPE_CHECKING:
    import keras

    from keras_orbax._src.model.matching import ReadRequest
    from keras_orbax._src.model.state_keys import KeyedState
    from keras_orbax._src.read.sharded_read import ReadPlan

PYTREE = "pytree"  # Keras's checkpointable of the state tree
MODEL_CONFIG = "model_config"
_ROLES: dict[str, Role] = {
    "trainable_variables": MODEL,
    "non_trainable_variables": MODEL,
    "optimizer_variables": OPTIMIZER,
    "metrics_variables": METRIC,
}


def is_keras_step(step_dir: Path) -> bool:
    """Whether `step_dir` is a step of Keras's `OrbaxCheckpoint` (not a keras-orbax step)."""
    return (step_dir / PYTREE).is_dir() and not (step_dir / "state").is_dir()


def tree_record(step: int, step_dir: Path) -> StepRecord:
    """The step's arrays as a record keyed by tree path (`trainable_variables/dense/kernel`):
    what `inspect` and `diff` show without a model.

    Raises:
        CorruptCheckpointError: the tree metadata is unreadable.
    """
    variables = {}
    for tree_path, (shape, dtype) in _tree_leaves(step_dir).items():
        collection, _, path = tree_path.partition("/")
        variables[tree_path] = VariableRecord(
            tree_path, path, shape, dtype, tree_path, role=_ROLES.get(collection, MODEL)
        )
    return StepRecord(step=step, variables=variables, model_config=model_config(step_dir))


def model_record(saved: StepRecord, state: KeyedState, model: keras.Model) -> StepRecord:
    """`saved` (a `tree_record`) keyed by the keras-orbax keys of `model`'s variables (see the
    module's doc for how leaves and variables are paired); unpaired leaves keep their tree path as
    key. Each record's `array` is its tree path."""
    leaves = saved.variables
    collections = _collections(model, state)
    wanted = {f"{collections[key]}/{v.path}": key for key, v in state.variables.items()}
    paired = {tree: wanted[tree] for tree in leaves if tree in wanted}
    paired.update(name_counters.pair_by_counterless_paths(leaves, wanted, paired, state))
    paired.update(_pair_without_model_name(leaves, wanted, paired, state, model.name))
    variables = {}
    for tree_path, leaf in leaves.items():
        key = paired.get(tree_path, tree_path)
        role = state.roles.get(key, leaf.role)
        variables[key] = VariableRecord(
            key, leaf.path, leaf.shape, leaf.dtype, tree_path, None, role
        )
    return dataclasses.replace(saved, variables=variables)


def model_config(step_dir: Path) -> dict[str, Any] | None:
    """The model config Keras stored with the step (a JSON string, parsed), or None."""
    if not (step_dir / MODEL_CONFIG).is_dir():
        return None
    import orbax.checkpoint.experimental.v1 as ocp

    try:
        loaded = ocp.load_checkpointables(step_dir, {MODEL_CONFIG: None})[MODEL_CONFIG]
        return json.loads(loaded["config"])
    except Exception as error:  # Orbax raises plain Exceptions; re-raised with the path
        raise CorruptCheckpointError(
            f"Cannot read the model config of Keras checkpoint step '{step_dir}': {error}"
        ) from error


def _tree_leaves(step_dir: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    import orbax.checkpoint.experimental.v1 as ocp

    try:
        tree = ocp.metadata(step_dir, checkpointable_name=PYTREE).metadata
    except Exception as error:  # Orbax raises plain Exceptions; re-raised with the path
        raise CorruptCheckpointError(
            f"Cannot read the state tree of Keras checkpoint step '{step_dir}': {error}"
        ) from error
    leaves: dict[str, tuple[tuple[int, ...], str]] = {}

    def visit(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for name, child in node.items():
                visit(child, f"{prefix}/{name}" if prefix else str(name))
        elif hasattr(node, "shape") and hasattr(node, "dtype"):
            leaves[prefix] = (tuple(int(n) for n in node.shape), str(np.dtype(node.dtype)))

    visit(tree, "")
    return leaves


def _collections(model: keras.Model, state: KeyedState) -> dict[str, str]:
    """Each key's collection in `get_state_tree()`, as `set_state_tree` looks variables up."""
    by_id: dict[int, str] = {}
    for key, variable in state.variables.items():
        if state.roles[key] == OPTIMIZER:
            by_id[id(variable)] = "optimizer_variables"
    groups = (
        ("metrics_variables", model.metrics_variables),
        ("non_trainable_variables", model.non_trainable_variables),
        ("trainable_variables", model.trainable_variables),
    )
    for name, variables in groups:
        for variable in variables:
            by_id.setdefault(id(variable), name)
    return {key: by_id.get(id(v), "non_trainable_variables") for key, v in state.variables.items()}


def _pair_without_model_name(
    leaves: dict[str, VariableRecord],
    wanted: dict[str, str],
    paired: dict[str, str],
    state: KeyedState,
    model_name: str,
) -> dict[str, str]:
    """Pairs leftover leaves and variables whose paths differ in the model's name, as
    `name_counters.pair_by_counterless_paths` does otherwise. A Sequential built with an `Input`
    names its variables `sequential/dense/kernel` (and Adam's slots
    `adam/sequential_dense_kernel_momentum`); the same Sequential built from its config, as
    `load_model` builds it, `dense/kernel`. Only where leaving the name out keeps every path on
    each side distinct."""
    taken = set(paired.values())
    name = name_counters.COUNTER.sub("", model_name)
    leftover = {_without_model_name(t, name): t for t in leaves if t not in paired}
    variables = {_without_model_name(p, name): p for p, k in wanted.items() if k not in taken}
    if len(leftover) < len(leaves) - len(paired) or len(variables) < len(wanted) - len(taken):
        return {}  # two paths became one: which is which cannot be told
    found = name_counters.pair_by_counterless_paths(
        {bare: leaves[tree] for bare, tree in leftover.items()},
        {bare: wanted[path] for bare, path in variables.items()},
        {},
        state,
    )
    return {leftover[bare]: key for bare, key in found.items()}


def _without_model_name(tree_path: str, name: str) -> str:
    """`tree_path` without the model's name `name` (its counter removed) where Keras puts it: the
    first part of a variable's path, or the start of an optimizer slot's name."""
    parts = tree_path.split("/")
    if len(parts) > 2 and name_counters.COUNTER.sub("", parts[1]) == name:
        return "/".join([parts[0], *parts[2:]])
    if len(parts) == 3 and parts[0] == "optimizer_variables":
        slot = re.sub(rf"^{re.escape(name)}(_\d+)?_", "", parts[2])
        return "/".join([*parts[:2], slot])
    return tree_path


def tree_keys(record: StepRecord) -> dict[str, str]:
    """Key -> tree path of each leaf, for reading through Orbax."""
    return {key: v.array for key, v in record.variables.items()}


def optional_keys(saved: StepRecord, state: KeyedState) -> frozenset[str]:
    """Keys a Keras step cannot be blamed for lacking: optimizer state when it holds none (saved
    with `save_weights_only=True`), and seed-generator state when it holds none of that either."""
    from keras_orbax._src.model.matching import absent_optimizer

    optional = set(absent_optimizer(saved, state))
    if not any("seed_generator" in path for path in saved.variables):
        optional |= {k for k in state.variables if "/seed_generators/" in k}
    return frozenset(optional)


class KerasCheckpointSource(Source):
    """One step of a directory written by `keras.callbacks.OrbaxCheckpoint`, listed by tree path
    (`trainable_variables/dense/kernel`) and restored by pairing leaves with the model's variables."""

    kind = "keras-checkpoint"
    description = "step written by keras.callbacks.OrbaxCheckpoint"
    no_checksums = "was written by keras.callbacks.OrbaxCheckpoint, which records no checksums"

    def __init__(self, root: Any, step: int, steps: Sequence[int] = ()) -> None:
        self.step_dir = root / str(step)
        super().__init__(root, tree_record(step, self.step_dir), step, steps)

    def plan_reads(self, requests: Sequence[ReadRequest]) -> ReadPlan:
        from keras_orbax._src.read.sharded_read import ReadPlan

        paths = {request.record.key: request.record.array for request in requests}
        return ReadPlan(self.step_dir, [], list(requests), PYTREE, paths)

    def prepare(self, model: keras.Model, *, strict: bool) -> Prepared:
        from keras_orbax._src.model.deferred import optimizer_stand_in
        from keras_orbax._src.model.matching import make_plan
        from keras_orbax._src.model.state_keys import keyed_state

        saved = sum(v.role == OPTIMIZER for v in self.record.variables.values())
        state = keyed_state(model, optimizer=optimizer_stand_in(model, saved))
        record = model_record(self.record, state, model)
        optional = optional_keys(self.record, state)
        plan = make_plan(record, state, strict=strict, optional=optional)
        reads = None if plan.problems else self.plan_reads(list(plan.reads.values()))
        return Prepared(record, state, plan, reads, tuple(plan.problems))
