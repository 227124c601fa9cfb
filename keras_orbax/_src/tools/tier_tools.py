"""`verify` and `inspect` of one machine's local directory of a `ModelCheckpoint` run under
`jax.distributed` (`format.process_parts`): the parts it holds, its own process's and the replica
of its peer's, each read from disk; no process group is needed.

```python
keras_orbax.verify("/dev/shm/run1")     # every part of the newest step found there, checked
print(keras_orbax.inspect("/dev/shm/run1"))
```
"""

from __future__ import annotations

import os
from pathlib import Path

from keras_orbax._src.format import data_state, process_parts
from keras_orbax._src.storage import locations
from keras_orbax._src.tools.inspect_checkpoint import CheckpointInfo, StepSummary
from keras_orbax._src.tools.verify_step import VerifyResult
from keras_orbax.errors import CheckpointNotFoundError, CorruptCheckpointError, KerasOrbaxError

KIND = "keras-orbax-local"


def located(directory: str | os.PathLike) -> Path | None:
    """The local tier `directory` names, resolved; None where it names none."""
    location = os.fspath(directory)
    if locations.is_remote(location):
        return None
    root = locations.as_path(location)
    return root if process_parts.is_process_tier(root) else None


def _step(root: Path, step: int | None) -> tuple[int, dict[int, Path]]:
    """The step to describe (None: the newest found) and the part of each process holding it."""
    parts = process_parts.steps_by_process(root)
    found = sorted({s for steps in parts.values() for s in steps})
    chosen = found[-1] if step is None and found else step
    holding = {
        p: process_parts.folder(root, p) / str(chosen)
        for p, steps in parts.items()
        if chosen in steps
    }
    if chosen is None or not holding:
        raise CheckpointNotFoundError(
            f"The local tier '{root}' holds {'no step' if step is None else f'no step {step}'} "
            f"(steps found: {found}). Received: directory='{root}', step={step}"
        )
    return chosen, holding


def verify(root: Path, step: int | None) -> VerifyResult:
    """Checks each part of `step` this directory holds (its manifest's seal, its data's CRC-32,
    the input position's checksum).

    Raises:
        CorruptCheckpointError: a part fails; the message names it.
    """
    chosen, holding = _step(root, step)
    nbytes = files = 0
    for process, step_dir in holding.items():
        manifest, data = process_parts.read(step_dir)
        data_state.read(step_dir, process)  # raises if its checksum fails
        nbytes += len(data)
        files += 2 + (manifest["data_state"] is not None)
    return VerifyResult(
        step=chosen,
        files=files,
        bytes=nbytes,
        checksummed=files,
        unchecked=(),
        location=str(root),
        kind=KIND,
    )


def inspect(root: Path, step: int | None) -> CheckpointInfo:
    """Describes the local tier: each process folder's steps, and the step's record."""
    chosen, holding = _step(root, step)
    parts = process_parts.steps_by_process(root)
    summaries = []
    for each in sorted({s for steps in parts.values() for s in steps}):
        step_dir = next(
            process_parts.folder(root, p) / str(each) for p, s in parts.items() if each in s
        )
        disk = locations.total_bytes(step_dir)
        try:
            record = process_parts.record_of(process_parts.read(step_dir)[0])
        except KerasOrbaxError as error:
            summaries.append(StepSummary(each, None, {}, 0, disk, str(error)))
            continue
        size = sum(v.nbytes for v in record.variables.values())
        summaries.append(
            StepSummary(each, record.epoch, {}, size, disk, batch=record.batch or None)
        )
    first = min(holding)
    try:
        record = process_parts.record_of(process_parts.read(holding[first])[0])
    except CorruptCheckpointError as error:
        raise CorruptCheckpointError(
            f"Step {chosen} of the local tier '{root}': {error}"
        ) from error
    positions = {}
    for process, step_dir in holding.items():
        position = data_state.read(step_dir, process)
        if position is not None:
            positions[process] = position
    return CheckpointInfo(
        directory=root,
        steps=tuple(s.step for s in summaries),
        step=chosen,
        record=record,
        summaries=tuple(summaries),
        kind=KIND,
        disk_bytes=locations.total_bytes(root),
        data_position=positions,
        parts={f"process_{p}": tuple(steps) for p, steps in parts.items()},
    )
