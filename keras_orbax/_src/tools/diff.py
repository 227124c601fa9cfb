"""`diff`: what differs between two saved states, by key, and optionally by value.

```python
result = diff("/ckpt@100", "model.weights.h5", values=True)
print(result)            # keys only in one, shape and dtype changes, max |a - b| per variable
result.identical         # False if anything differs
```
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from keras_orbax._src.sources.base import Source, batched
from keras_orbax._src.sources.resolve import open_source
from keras_orbax._src.tools import diff_by_model


@dataclasses.dataclass(frozen=True)
class DiffResult:
    """What differs between sources `a` and `b`.

    Attributes:
        only_a, only_b: Keys in one source only.
        changed: Key -> `"(16, 32) float32 -> (16, 8) float32"` for shape or dtype changes.
        max_abs_diff: Key -> max |a - b| of each common variable of equal shape (with `values`).
        keras_state: What the layers keep besides their variables (`keras_state/`), by entry
            (`keras_state/layers/table/vars/table`, `keras_state/layers/table/words.txt`): how it differs.
        keras_state_unread: Why `keras_state/` was not compared (a side keeps none this can
            read), or "" if it was.
        matched_by: "" where the arrays are matched by their keys; else how: sources that key
            them differently (a task's step and the preset or Hugging Face directory exported
            from it) are matched by the Keras paths of the model one of them describes, and
            their keys are those paths.
    """

    a: str
    b: str
    only_a: list[str]
    only_b: list[str]
    changed: dict[str, str]
    max_abs_diff: dict[str, float]
    compared: int
    keras_state: dict[str, str] = dataclasses.field(default_factory=dict)
    keras_state_unread: str = ""
    matched_by: str = ""

    @property
    def identical(self) -> bool:
        return not (
            self.only_a
            or self.only_b
            or self.changed
            or self.keras_state
            or any(d != 0 for d in self.max_abs_diff.values())
        )

    def __str__(self) -> str:
        lines = [f"--- {self.a}", f"+++ {self.b}"]
        if self.matched_by:
            lines.append(f"matched by {self.matched_by}")
        lines += [f"- {key}  (only in {self.a})" for key in self.only_a]
        lines += [f"+ {key}  (only in {self.b})" for key in self.only_b]
        lines += [f"! {key}  {change}" for key, change in self.changed.items()]
        differing = {k: d for k, d in self.max_abs_diff.items() if d != 0}
        lines += [f"~ {key}  max |a - b| = {d:.9g}" for key, d in differing.items()]
        lines += [f"! {key}  {change}" for key, change in self.keras_state.items()]
        if self.keras_state_unread:
            lines.append(f"keras_state/ not compared: {self.keras_state_unread}")
        verdict = "identical" if self.identical else "differ"
        checked = " and values" if self.max_abs_diff else ""
        lines.append(
            f"{self.compared} common {'variable' if self.compared == 1 else 'variables'} "
            f"compared (keys, shapes, dtypes{checked}): {verdict}"
        )
        return "\n".join(lines)


def diff(
    a: str | os.PathLike,
    b: str | os.PathLike,
    *,
    values: bool = False,
    on_read: Callable[[int, int], None] | None = None,
) -> DiffResult:
    """Compares two sources (`DIR`, `DIR@STEP`, `.weights.h5`, `.keras`, ...) key by key.

    With `values`, each common variable of equal shape is read from both sides (64 MiB of
    variables at a time), and its max absolute difference computed in float64 (NaN against NaN
    and equal infinities count as equal; NaN against a number as `inf`). `on_read(nbytes,
    total)` follows each variable. What the layers keep besides their variables (`keras_state/`
    of a step: values their `save_own_variables` stores, files their `save_assets` writes) is
    compared too, by shape and dtype, and with `values` by content.

    Example:
    ```python
    result = keras_orbax.diff("/ckpt@100", "model.weights.h5", values=True)
    print(result)  # keys in one side only, shape or dtype changes, max |a - b|
    ```
    """
    first, second = open_source(a), open_source(b)
    left, right = first.record.variables, second.record.variables
    common = [key for key in left if key in right]
    if left and right and not common and any(map(diff_by_model.describes_a_model, (first, second))):
        return _by_model(first, second, values=values, on_read=on_read)
    changed = {}
    for key in common:
        x, y = left[key], right[key]
        if (x.shape, x.dtype) != (y.shape, y.dtype):
            changed[key] = f"{x.shape} {x.dtype} -> {y.shape} {y.dtype}"
    max_abs = {}
    if values:
        readable = [key for key in common if left[key].shape == right[key].shape]
        total = sum(left[key].nbytes + right[key].nbytes for key in readable)
        for batch in batched(readable, lambda key: left[key].nbytes + right[key].nbytes):
            xs, ys = first.read_arrays(batch), second.read_arrays(batch)
            for key in batch:
                max_abs[key] = _max_abs_diff(np.asarray(xs.pop(key)), np.asarray(ys.pop(key)))
                if on_read is not None:
                    on_read(left[key].nbytes + right[key].nbytes, total)
    own_changes, unread = _own_state_changes(first, second, values=values)
    return DiffResult(
        first.label,
        second.label,
        [key for key in left if key not in right],
        [key for key in right if key not in left],
        changed,
        max_abs,
        len(common),
        own_changes,
        unread,
    )


def _by_model(
    first: Source,
    second: Source,
    *,
    values: bool,
    on_read: Callable[[int, int], None] | None,
) -> DiffResult:
    """`diff` of sources keyed differently (a task's step, its exported preset or Hugging Face
    directory), by the Keras paths of the model one describes (`diff_by_model`)."""
    x, y = diff_by_model.pair(first, second)
    common = [path for path in x.keys if path in y.keys]
    changed = {
        path: f"{diff_by_model.described(x, path)} -> {diff_by_model.described(y, path)}"
        for path in common
        if diff_by_model.described(x, path) != diff_by_model.described(y, path)
    }
    max_abs = {}
    if values:
        readable = [p for p in common if diff_by_model.readable(x, y, p)]
        for path, xs, ys in diff_by_model.read_pairs(x, y, readable, on_read):
            max_abs[path] = _max_abs_diff(xs, ys)
    return DiffResult(
        first.label,
        second.label,
        diff_by_model.one_sided(x, y),
        diff_by_model.one_sided(y, x),
        changed,
        max_abs,
        len(common),
        matched_by="Keras paths (the sources key their arrays differently)",
    )


def _own_state_changes(first: Source, second: Source, *, values: bool) -> tuple[dict, str]:
    """How the two sources' `keras_state/` differ, by entry; or why they were not compared."""
    a, b = first.own_state(), second.own_state()
    if a is None and b is None:
        return {}, ""
    if a is None or b is None:
        return {}, f"{(first if a is None else second).label} keeps none that this reads"
    changes = {}
    for name, (x, y) in _paired(a.values, b.values).items():
        described = [None if v is None else f"{tuple(v.shape)} {v.dtype}" for v in (x, y)]
        if described[0] != described[1] or (values and not np.array_equal(x, y)):
            changes[name] = f"{described[0] or 'absent'} -> {described[1] or 'absent'}" + (
                "" if described[0] != described[1] else ": values differ"
            )
    for name, (x, y) in _paired(a.assets, b.assets).items():
        sizes = [None if v is None else f"{len(v)} bytes" for v in (x, y)]
        if sizes[0] != sizes[1] or (values and x != y):
            changes[name] = f"{sizes[0] or 'absent'} -> {sizes[1] or 'absent'}" + (
                "" if sizes[0] != sizes[1] else ": content differs"
            )
    return changes, ""


def _paired(a: dict[str, Any], b: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """`keras_state/<entry>` -> (a's, b's), None where a side lacks the entry."""
    return {f"keras_state/{k}": (a.get(k), b.get(k)) for k in sorted(a.keys() | b.keys())}


def _max_abs_diff(x: np.ndarray, y: np.ndarray) -> float:
    x, y = x.astype(np.float64), y.astype(np.float64)
    if x.size == 0:
        return 0.0
    with np.errstate(invalid="ignore"):
        difference = np.where(x == y, 0.0, np.abs(x - y))
    difference[np.isnan(x) & np.isnan(y)] = 0.0
    return float("inf") if np.isnan(difference).any() else float(np.max(difference))
