r"""The keys of `get_layout_map`'s `LayoutMap`: variable paths as patterns that match the same
variables in another build of the model, whatever Keras numbers its layers.

```python
keyed({"block_1/dense_3/kernel": ("model", None)})
# {r"block(?:_\d+)?/dense(?:_\d+)?/kernel(?:_\d+)?": ("model", None)}
```
"""

from __future__ import annotations

import itertools
import re

Axes = tuple[str | None, ...]


def keyed(layouts: dict[str, Axes]) -> dict[str, Axes]:
    r"""The map's keys: each path's names with their numbers generalized (`block_\d+/dense(?:_\d+)?/
    kernel`), where every path a key stands for has the same layout. Where they differ, only the
    first names are generalized, as many as keep each key's layout one, and the others' counters
    (`stage_1/dense(?:_\d+)?`, `stage_2/...`); then the others literal; the exact path where none
    does. Replicated paths need no key: Keras replicates what the map does not match."""
    groups: dict[str, dict[str, Axes]] = {}
    for path, axes in layouts.items():
        groups.setdefault(_general(path, None), {})[path] = axes
    keyed: dict[str, Axes] = {}
    for members in groups.values():
        levels = range(next(iter(members)).count("/") + 1, -1, -1)
        # Counters generalized before any name is kept literal: a build numbers them anew.
        for counters, level in itertools.product((True, False), levels):
            keys: dict[str, set[Axes]] = {}
            for path, axes in members.items():
                keys.setdefault(_general(path, level, counters), set()).add(axes)
            if all(len(found) == 1 for found in keys.values()):
                keyed.update({key: found.pop() for key, found in keys.items()})
                break
    return {key: axes for key, axes in keyed.items() if any(axes)}


def _general(path: str, level: int | None, counters: bool = False) -> str:
    """`path` as a pattern, its first `level` names (all for None) generalized by `_name`, the
    rest literal but for their counters if `counters` (`_counter`).

    Paths whose names generalize alike match each other's patterns and no other path's, so no
    path matches two keys (which `LayoutMap` refuses); within one such group, the patterns of one
    level are disjoint too.
    """
    names = path.split("/")
    cut = len(names) if level is None else level
    rest = [_counter(name) if counters else re.escape(name) for name in names[cut:]]
    return "/".join([*map(_name, names[:cut]), *rest])


def _counter(name: str) -> str:
    r"""A pattern for `name` with any counter suffix, or none: `_name`'s, its other numbers kept
    (`stage_1_2` -> `stage_1_\d+`, `dense_3` -> `dense(?:_\d+)?`)."""
    base = re.sub(r"_\d+$", "", name)
    return re.escape(base) + (r"_\d+" if re.search(r"_\d+$", base) else r"(?:_\d+)?")


def _name(name: str) -> str:
    r"""A pattern for every name that Keras could give the same layer in another build: its
    numbers any number, and its counter suffix (`dense`, `dense_1`, `dense_12`) any or none.

    It matches exactly the names of the same form: digits runs as `\d+`, and one trailing
    `_<number>` dropped (`dense_3` and `dense` are one form, `block_1_2` and `block_3_4` another).
    """
    base = re.sub(r"_\d+$", "", name)
    pattern = r"\d+".join(re.escape(part) for part in re.split(r"\d+", base))
    # `block_1_2` drops one suffix to `block_1`: its form keeps a counter (`block_\d+_\d+`).
    return pattern + (r"_\d+" if re.search(r"_\d+$", base) else r"(?:_\d+)?")
