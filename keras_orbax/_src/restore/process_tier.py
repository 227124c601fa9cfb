"""Restoring from a local tier written under `jax.distributed` (`format.process_parts`): each
process reads its own part of a step from its own local directory, or, where that part is lost or
damaged, receives it from the next process, which keeps its replica (`runtime.ring`).

Collective: every process calls these functions in the same order, each with its own local
directory (they may be on separate machines). Which step is agreed over the coordination service:
the newest one every process can restore, from its own part or from its peer's replica.

```python
choice = newest_whole(own, replica)                 # the step, and whose parts are missing
payload = part_of(own, replica, choice)             # from disk, or over the ring from the peer
result = assign(model, *arrays_from(model, payload, where), step=choice.step)
```
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import jax
import keras

from keras_orbax._src.compat import keras_compat
from keras_orbax._src.format import process_parts
from keras_orbax._src.model import state_keys
from keras_orbax._src.restore.result import RestoreResult
from keras_orbax._src.runtime import multihost, ring
from keras_orbax._src.storage import locations
from keras_orbax.errors import CheckpointNotFoundError, CorruptCheckpointError


@dataclasses.dataclass(frozen=True)
class Choice:
    """The step every process can restore (None: none can), the processes whose own part of it
    is missing or damaged (their peers send their replicas back), and, on this process, why each
    step of its own folder and of the replica folder that fails its checks does."""

    step: int | None
    missing: tuple[int, ...]
    damaged_own: dict[int, str]
    damaged_replica: dict[int, str]
    # This process's own part of `step`, read (and checked) while choosing it.
    own_part: process_parts.Payload | None = dataclasses.field(
        default=None, repr=False, compare=False
    )


def named(directory: str | os.PathLike) -> bool:
    """Whether `directory` is a local tier written under `jax.distributed` on any process (each
    looks at its own: one whose local directory was lost sees nothing there)."""
    location = os.fspath(directory)
    mine = not locations.is_remote(location) and process_parts.is_process_tier(
        locations.as_path(location)
    )
    if multihost.process_count() == 1:
        return mine
    return any(multihost.gather("restore_sharded/local tier", mine))


def folders(directory: str | os.PathLike) -> tuple[Path, Path]:
    """This process's own folder of `directory` and the folder of the replica it keeps."""
    root = locations.as_path(directory)
    me, n = multihost.process_index(), multihost.process_count()
    return process_parts.folder(root, me), process_parts.folder(root, (me - 1) % n)


def newest_whole(
    own: Path, replica: Path, *, newer_than: int = -1, step: int | None = None
) -> Choice:
    """The newest step after `newer_than` (or `step` itself) that every process can restore: its
    own part intact, or the next process's replica of it. A collective call.

    Where every process's newest own part is the same step and intact, and no replica is newer,
    that step is the answer and no replica is read (the usual resume: each process then reads
    its own part once). Otherwise every part of both folders is checked."""
    newest, part, damaged = _newest_own(own, newer_than, step)
    replicas = [s for s in process_parts.steps(replica) if s > newer_than]
    views = multihost.gather(
        "local tier/newest own",
        {"own": newest, "damaged": bool(damaged), "replica": max(replicas, default=None)},
    )
    if (
        newest is not None
        and all(v["own"] == newest and not v["damaged"] for v in views)
        and all(v["replica"] is None or v["replica"] <= newest for v in views)
    ):
        return Choice(newest, (), {}, {}, own_part=part)
    return _checked_everywhere(own, replica, newer_than, step)


def _newest_own(
    own: Path, newer_than: int, step: int | None
) -> tuple[int | None, process_parts.Payload | None, dict[int, str]]:
    """This process's newest own step after `newer_than` (or `step`) whose part passes its
    checks, that part, and why each newer one does not."""
    damaged: dict[int, str] = {}
    for s in reversed(process_parts.steps(own)):
        if s <= newer_than or (step is not None and s != step):
            continue
        try:
            part = process_parts.payload(own / str(s))
            process_parts.unpack(part, f"'{own / str(s)}'")
        except CorruptCheckpointError as error:
            damaged[s] = str(error)
            continue
        return s, part, damaged
    return None, None, damaged


def _checked_everywhere(own: Path, replica: Path, newer_than: int, step: int | None) -> Choice:
    own_intact, damaged_own = _intact(own, newer_than)
    replica_intact, damaged_replica = _intact(replica, newer_than)
    views = multihost.gather("local tier/intact", {"own": own_intact, "replica": replica_intact})
    n = len(views)
    held = [set(v["own"]) for v in views]
    kept = [set(views[(p + 1) % n]["replica"]) for p in range(n)]  # p's part, at p + 1
    steps = sorted(set().union(*held, *kept), reverse=True)
    whole = [s for s in steps if all(s in held[p] or s in kept[p] for p in range(n))]
    wanted = whole[:1] if step is None else [s for s in whole if s == step]
    chosen = wanted[0] if wanted else None
    missing = () if chosen is None else tuple(p for p in range(n) if chosen not in held[p])
    return Choice(chosen, missing, damaged_own, damaged_replica)


def part_of(own: Path, replica: Path, choice: Choice) -> process_parts.Payload:
    """This process's part of the chosen step: read from its own folder, or, where it is missing,
    received from the next process's replica (a collective call where any process misses it)."""
    assert choice.step is not None, "a step was chosen"
    me = multihost.process_index()
    received: process_parts.Payload = b""
    if choice.missing:
        previous = (me - 1) % multihost.process_count()
        sending = previous in choice.missing
        payload = process_parts.payload(replica / str(choice.step)) if sending else b""
        received = ring.shift(payload, by=-1, name=f"local tier/recover {choice.step}")
    if me in choice.missing:
        return received
    if choice.own_part is not None:
        return choice.own_part
    return process_parts.payload(own / str(choice.step))


def arrays_from(
    model: keras.Model, payload: process_parts.Payload, where: str, *, checked: bool = False
) -> tuple[dict[str, jax.Array], dict[str, Any], int]:
    """The arrays of `model`'s variables from a part (checked, its data's CRC unless `checked`
    already: `newest_whole` read this process's own part), its manifest and its bytes; assigns
    nothing.

    Raises:
        CorruptCheckpointError: the part fails its checks.
        CheckpointMismatchError: the part does not fit the model or its mesh.
        ValueError: some variables of `model` are not built.
    """
    manifest, data = process_parts.unpack(payload, where, check_data=not checked)
    state = state_keys.keyed_state(model)
    unset = [v.path for v in state.variables.values() if not keras_compat.is_allocated(v)]
    if unset:
        raise ValueError(
            "A local step restores into a built model (fit builds it; else build the model and "
            f"its optimizer first): {len(unset)} variables are not built, e.g. {unset[:3]}."
        )
    targets = {}
    for key, variable in state.variables.items():
        value = keras_compat.current_value(variable)
        if value.size:
            targets[key] = jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=value.sharding)
    return process_parts.arrays(manifest, data, targets, where), manifest, len(data)


def assign(
    model: keras.Model,
    arrays: dict[str, jax.Array],
    manifest: dict[str, Any],
    nbytes: int,
    *,
    step: int,
) -> RestoreResult:
    """Assigns the arrays every process has read (`arrays_from`, agreed) to `model`."""
    state = state_keys.keyed_state(model)
    for key, value in arrays.items():
        state.variables[key].assign(value)
    record = process_parts.record_of(manifest)
    paths = {k: v.path for k, v in state.variables.items()}
    return RestoreResult(step, record.epoch, tuple(arrays), (), (), nbytes, record, paths=paths)


def restore_tier(
    model: keras.Model, directory: str | os.PathLike, step: int | None, *, strict: bool = True
) -> RestoreResult:
    """`restore_sharded` from a local tier written under `jax.distributed` (see the module's doc).

    Raises:
        CheckpointNotFoundError: no step (or not `step`) that every process can restore.
        CheckpointMismatchError, CorruptCheckpointError: as `arrays_from`, on every process.
    """
    if not strict:
        raise ValueError(
            f"'{directory}' is a local tier: its steps restore whole into the model they were "
            "saved from. Restore the persistent directory with strict=False instead. Received: "
            "strict=False"
        )
    if multihost.process_count() == 1:
        root = locations.as_path(directory)
        raise CheckpointNotFoundError(
            f"'{directory}' is a local tier written under jax.distributed by "
            f"{len(process_parts.processes_in(root))} processes: each process's part restores only "
            "on that process, with the same mesh. Restore it under jax.distributed with as many "
            "processes, or restore the ModelCheckpoint's persistent directory."
        )
    own, replica = folders(directory)
    choice = newest_whole(own, replica, step=step)
    if choice.step is None:
        which = "no step" if step is None else f"no step {step}"
        raise CheckpointNotFoundError(
            f"The local tier '{directory}' holds {which} that every process can restore (from "
            "its own part, or from the replica of it the next process keeps). Restore the "
            "persistent directory instead."
        )
    chosen = choice.step

    def read() -> tuple[dict[str, jax.Array], dict[str, Any], int]:
        payload = part_of(own, replica, choice)
        where = f"step {chosen} of '{own}'"
        return arrays_from(model, payload, where, checked=payload is choice.own_part)

    arrays, manifest, nbytes = multihost.run_collectively(f"local tier/restore {chosen}", read)
    return assign(model, arrays, manifest, nbytes, step=chosen)


def _intact(into: Path, newer_than: int) -> tuple[list[int], dict[int, str]]:
    """The steps of a process's folder newer than `newer_than` whose part passes its checks, and
    why each other one does not."""
    intact, damaged = [], {}
    for step in process_parts.steps(into):
        if step <= newer_than:
            continue
        try:
            process_parts.read(into / str(step))
        except CorruptCheckpointError as error:
            damaged[step] = str(error)
            continue
        intact.append(step)
    return intact, damaged
