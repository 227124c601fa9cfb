"""The `"compact"` format's region check: each process's OCDBT database, looked up by name.

Orbax's tensorstore writes every process's chunks of a compact step into that process's own OCDBT
database under the step's `state/`, `ocdbt.process_<i>/` (a `manifest.ocdbt` and data files
`d/<id>` that tensorstore names), which process 0 merges at Orbax's finalize. Which chunks and
data files tensorstore writes is its own choice, so the check is one level up: every process due
to write data (replica 0 of some shard of some array: Orbax writes at least that replica's part)
must have its database, and every data file that database references (its manifest's B+tree, its
nodes and their values) must be there and hold the bytes referenced, each looked up by name: never
a listing of what happens to be there.

```python
state_dir_arrays = take_arrays(state_dir)     # recorded by `CompactArrayLeafHandler`
due = processes_due(state_dir_arrays)         # e.g. {0, 1}
names = databases_found(state_dir, process)   # ["ocdbt.process_1"], or [] if its manifest is gone
```
"""

from __future__ import annotations

import os
import re
from collections.abc import Awaitable, Sequence
from typing import Any

import jax

from keras_orbax._src.compat import orbax_compat
from keras_orbax._src.model import shardings
from keras_orbax._src.storage import locations

_MANIFEST = "manifest.ocdbt"
# A node or value of an OCDBT database, as `tensorstore.ocdbt.dump` writes its location:
# `<kind>:<base path>:<relative path>:<offset>:<length>`.
_LOCATION = re.compile(r"^(btreenode|versionnode|value):([^:]*):([^:]+):(\d+):(\d+)$")
# Each compact save's arrays (shape and sharding), by its `state/` directory, until the step's
# commit takes them (`take_arrays`).
_arrays: dict[str, list[tuple[tuple[int, ...], Any]]] = {}


def database(process: int) -> str:
    """The directory of `process`'s OCDBT database, relative to the step's `state/` (Orbax's
    `ocdbt.process_<i>`)."""
    return f"ocdbt.process_{process}"


class CompactArrayLeafHandler(orbax_compat.array_leaf_handler()):  # type: ignore[misc]
    """Orbax's array leaf handler, unchanged, noting each array's shape and sharding for the
    commit's region check (`take_arrays`)."""

    async def serialize(self, params: Sequence[Any], serialization_context: Any) -> Awaitable[None]:
        key = _key(serialization_context.parent_dir.path)
        noted = _arrays.setdefault(key, [])
        noted += [
            (tuple(p.value.shape), p.value.sharding)
            for p in params
            if isinstance(p.value, jax.Array) and p.value.size > 0
        ]
        return await super().serialize(params, serialization_context)


def take_arrays(directory: Any) -> list[tuple[tuple[int, ...], Any]] | None:
    """The arrays `CompactArrayLeafHandler` saved into `directory` (a step's `state/`); None where
    it did not write them (the fast format)."""
    return _arrays.pop(_key(directory), None)


def processes_due(arrays: list[tuple[tuple[int, ...], Any]]) -> set[int]:
    """The processes holding replica 0 of some shard of some array: each writes data (Orbax writes
    replica 0's part, with replica-parallel writes others' too), so each must have a database."""
    return {
        process
        for shape, sharding in arrays
        for process, _ in shardings.replica_zero(sharding, shape)
    }


def databases_found(directory: Any, process: int) -> list[str]:
    """`[database(process)]` if that database is in `directory` (a step's `state/`) whole: its
    manifest, and every data file it references holding the bytes referenced, each looked up by
    name; `[]` if its manifest is missing. An object in object storage is there once written.

    Raises:
        OSError: a data file the database references is missing or shorter than referenced (or the
            filesystem fails: EIO); reported to every process by the caller.
    """
    if locations.is_remote(directory):
        return [database(process)]
    root = f"{os.fspath(locations.as_path(directory))}/{database(process)}"
    try:
        os.stat(f"{root}/{_MANIFEST}")
    except FileNotFoundError:
        return []
    _check_references(root)
    return [database(process)]


def _check_references(root: str) -> None:
    """Walks the OCDBT database in `root` from its manifest (`tensorstore.ocdbt.dump`), checking
    every data file a node or value is referenced in before reading any node from it."""
    import tensorstore as ts  # Orbax's dependency

    base = ts.KvStore.open(f"file://{root}/").result()
    checked: dict[str, int] = {}  # file -> bytes it holds
    pending = [ts.ocdbt.dump(base).result()]
    while pending:
        nodes = []
        for found in _locations(pending.pop()):
            kind, base_path, relative, offset, length = found.groups()
            _check_holds(root, base_path + relative, int(offset) + int(length), checked)
            if kind != "value":
                nodes.append(ts.ocdbt.dump(base, found.group(0)))
        pending += [node.result() for node in nodes]


def _locations(dumped: Any) -> list[re.Match[str]]:
    """Every location in a dumped manifest or node (strings in nested dicts and lists)."""
    if isinstance(dumped, str):
        found = _LOCATION.match(dumped)
        return [found] if found else []
    if isinstance(dumped, dict):
        return [found for value in dumped.values() for found in _locations(value)]
    if isinstance(dumped, list):
        return [found for value in dumped for found in _locations(value)]
    return []


def _check_holds(root: str, relative: str, end: int, checked: dict[str, int]) -> None:
    if relative not in checked:
        path = f"{root}/{relative}"
        try:
            checked[relative] = os.stat(path).st_size
        except FileNotFoundError as error:
            raise FileNotFoundError(
                error.errno, f"A data file of the OCDBT database '{root}' is missing", path
            ) from None
    if checked[relative] < end:
        raise OSError(
            f"A data file of the OCDBT database '{root}' is shorter ({checked[relative]} bytes) "
            f"than referenced ({end} bytes): {root}/{relative}"
        )


def _key(directory: Any) -> str:
    return os.fspath(locations.as_path(os.fspath(directory)))
