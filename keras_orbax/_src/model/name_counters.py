"""Keras's global name counters: the same model built again in one process names its layers
`dense_1`, `dense_2`... where the saved one said `dense`. Paths that differ only in those counters
are paired here by creation order, both sides by their own counters.

```python
pairs = pair_by_counterless_paths(saved, wanted, {}, state)   # {saved path: model key}
```
"""

from __future__ import annotations

import collections
import re
from typing import TYPE_CHECKING

from keras_orbax._src.format.step_record import VariableRecord

if TYPE_CHECKING:
    import keras

    from keras_orbax._src.model.state_keys import KeyedState

COUNTER = re.compile(r"_\d+(?=[/_]|$)")


def pair_by_counterless_paths(
    leaves: dict[str, VariableRecord],
    wanted: dict[str, str],
    paired: dict[str, str],
    state: KeyedState,
) -> dict[str, str]:
    """Pairs leftover leaves and variables whose paths differ only in Keras's name counters.

    Counters count creations, so within a group of such paths the leaf saved from the layer made
    first goes to the variable made first here: both sides by their own counters, never by the
    model's order (a layer made first may be tracked or applied last). A group is paired only if
    it has as many leaves as variables, `_creation_order` can tell the order, and every pair agrees
    in shape and dtype; otherwise its leaves and variables stay unpaired, reported unexpected and
    missing with both sides' paths."""
    taken = set(paired.values())
    leaf_groups = _by_counterless_path([t for t in leaves if t not in paired])
    variable_groups = _by_counterless_path([t for t, k in wanted.items() if k not in taken])
    found: dict[str, str] = {}
    for name, paths in variable_groups.items():
        pairs = _creation_order(leaf_groups.get(name, []), paths)
        if pairs and all(_fits(leaves[t], state.variables[wanted[p]]) for t, p in pairs):
            found.update((tree, wanted[path]) for tree, path in pairs)
    return found


def _by_counterless_path(tree_paths: list[str]) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = collections.defaultdict(list)
    for tree_path in tree_paths:
        groups[COUNTER.sub("", tree_path)].append(tree_path)
    return groups


def _creation_order(trees: list[str], paths: list[str]) -> list[tuple[str, str]] | None:
    """`trees` (saved) and `paths` (the model's) of one group paired by creation order, or None
    where the counters cannot tell it: the sides differ in size, two paths of one side have equal
    counters, or some counter position orders the pairs one way on one side and another way on
    the other."""
    if len(trees) != len(paths):
        return None
    columns = sorted({c for p in (*trees, *paths) for c in _counters(p)})
    saved = sorted((_aligned(t, columns), t) for t in trees)
    model = sorted((_aligned(p, columns), p) for p in paths)
    if any(len({counters for counters, _ in side}) < len(side) for side in (saved, model)):
        return None
    for i in range(len(columns)):
        if _ranks([c[i] for c, _ in saved]) != _ranks([c[i] for c, _ in model]):
            return None
    return [(tree, path) for (_, tree), (_, path) in zip(saved, model, strict=True)]


def _counters(tree_path: str) -> dict[tuple[int, int], int]:
    """Each counter of `tree_path` by where it stands in the path without counters (and its
    place among counters standing there): `m_1/dense_2/kernel` -> {(1, 0): 1, (7, 0): 2}."""
    found: dict[tuple[int, int], int] = {}
    removed, last, nth = 0, -1, 0
    for match in COUNTER.finditer(tree_path):
        at = match.start() - removed
        nth = nth + 1 if at == last else 0
        found[(at, nth)] = int(match.group()[1:])
        removed, last = removed + len(match.group()), at
    return found


def _aligned(tree_path: str, columns: list[tuple[int, int]]) -> tuple[int, ...]:
    """The counters of `tree_path` at `columns`; none is 0 (Keras names `dense`, then `dense_1`)."""
    counters = _counters(tree_path)
    return tuple(counters.get(column, 0) for column in columns)


def _ranks(values: list[int]) -> list[int]:
    order = {value: rank for rank, value in enumerate(sorted(set(values)))}
    return [order[value] for value in values]


def _fits(saved: VariableRecord, variable: keras.Variable) -> bool:
    from keras_orbax._src.compat import keras_compat

    shape = tuple(int(n) for n in variable.shape)
    return saved.shape == shape and saved.dtype == keras_compat.stored_dtype(variable)
