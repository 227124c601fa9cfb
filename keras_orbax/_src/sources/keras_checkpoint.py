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
dtype agreeing; anything else is reported missing or unexpected as usual.

```python
keras_orbax.restore_sharded(model, "/keras_orbax_checkpoint_dir")  # written by Keras's callback
```
"""

from __future__ import annotations

import collections
import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import keras
import numpy as np
import orbax.checkpoint.experimental.v1 as ocp

from keras_orbax._src.compat import keras_compat
from keras_orbax._src.format.step_record import StepRecord, VariableRecord
from keras_orbax._src.model.state_keys import METRIC, MODEL, OPTIMIZER, KeyedState, Role
from keras_orbax.errors import CorruptCheckpointError

PYTREE = "pytree"  # Keras's checkpointable of the state tree
MODEL_CONFIG = "model_config"
_ROLES: dict[str, Role] = {
    "trainable_variables": MODEL,
    "non_trainable_variables": MODEL,
    "optimizer_variables": OPTIMIZER,
    "metrics_variables": METRIC,
}
_COUNTER = re.compile(r"_\d+(?=[/_]|$)")


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
    paired.update(_pair_by_counterless_paths(leaves, wanted, paired, state))
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
    try:
        loaded = ocp.load_checkpointables(step_dir, {MODEL_CONFIG: None})[MODEL_CONFIG]
        return json.loads(loaded["config"])
    except Exception as error:  # Orbax raises plain Exceptions; re-raised with the path
        raise CorruptCheckpointError(
            f"Cannot read the model config of Keras checkpoint step '{step_dir}': {error}"
        ) from error


def _tree_leaves(step_dir: Path) -> dict[str, tuple[tuple[int, ...], str]]:
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


def _pair_by_counterless_paths(
    leaves: dict[str, VariableRecord],
    wanted: dict[str, str],
    paired: dict[str, str],
    state: KeyedState,
) -> dict[str, str]:
    """Pairs leftover leaves and variables whose paths differ only in Keras's name counters, in
    order (the variables' model order; the leaves' counters ascending), where each such group has
    as many leaves as variables and every pair agrees in shape and dtype."""
    taken = set(paired.values())
    leaf_groups: dict[str, list[str]] = collections.defaultdict(list)
    for tree_path in leaves:
        if tree_path not in paired:
            leaf_groups[_COUNTER.sub("", tree_path)].append(tree_path)
    variable_groups: dict[str, list[str]] = collections.defaultdict(list)
    for tree_path, key in wanted.items():
        if key not in taken:
            variable_groups[_COUNTER.sub("", tree_path)].append(key)
    found: dict[str, str] = {}
    for name, keys in variable_groups.items():
        trees = sorted(leaf_groups.get(name, []), key=_counters)
        if len(trees) != len(keys):
            continue
        pairs = list(zip(trees, keys, strict=True))
        if all(_fits(leaves[t], state.variables[k]) for t, k in pairs):
            found.update(pairs)
    return found


def _counters(tree_path: str) -> list[int]:
    return [int(n) for n in re.findall(r"_(\d+)(?=[/_]|$)", tree_path)] or [-1]


def _fits(saved: VariableRecord, variable: keras.Variable) -> bool:
    shape = tuple(int(n) for n in variable.shape)
    return saved.shape == shape and saved.dtype == keras_compat.stored_dtype(variable)


def tree_keys(record: StepRecord) -> dict[str, str]:
    """Key -> tree path of each leaf, for reading through Orbax."""
    return {key: v.array for key, v in record.variables.items()}


def optional_keys(saved: StepRecord, state: KeyedState) -> frozenset[str]:
    """Keys a Keras step cannot be blamed for lacking: optimizer state when it holds none (saved
    with `save_weights_only=True`), and seed-generator state when it holds none of that either."""
    optional = set()
    if not any(v.role == OPTIMIZER for v in saved.variables.values()):
        optional |= {k for k, role in state.roles.items() if role == OPTIMIZER}
    if not any("seed_generator" in path for path in saved.variables):
        optional |= {k for k in state.variables if "/seed_generators/" in k}
    return frozenset(optional)
