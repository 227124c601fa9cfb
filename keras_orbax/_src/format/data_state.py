"""The input's position saved in a step: `<step>/data_state/process_<i>.json`, one per process.

Each process reads its own input (under `jax.distributed`, its own shard of the data), so each
saves its own position: the epoch and batch the step records, the kind of input and what that kind
needs to start the next batch without reading the earlier ones (docs/resuming.md). The files are an
Orbax checkpointable of the step, so they are committed with it, or not at all. Each holds its
checksum (`json_checksum`), checked when it is read.

```python
state = data_state.read(step_dir, process=0)  # None: the step holds no position for process 0
```
"""

from __future__ import annotations

import json
from typing import Any

from keras_orbax._src.format import json_checksum
from keras_orbax.errors import CorruptCheckpointError

DATA_STATE = "data_state"  # the checkpointable's name: the subdirectory of the step
KINDS = ("arrays", "py_dataset", "grain", "tf_data", "generator")


def file_name(process: int) -> str:
    return f"process_{process}.json"


def read(step_dir: Any, process: int) -> dict[str, Any] | None:
    """Process `process`'s saved position in the step at `step_dir`; None if it holds none (a step
    saved by `save`, by an older keras-orbax, or with no position for that process).

    Raises:
        CorruptCheckpointError: the file exists but is not a position keras-orbax wrote, or fails
            its checksum.
    """
    path = step_dir / DATA_STATE / file_name(process)
    if not path.exists():
        return None
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise CorruptCheckpointError(f"Cannot read the input position '{path}': {error}") from error
    if not isinstance(state, dict) or state.get("kind") not in KINDS:
        raise CorruptCheckpointError(
            f"'{path}' holds no input position keras-orbax wrote (its kind is not one of {KINDS})."
        )
    problem = json_checksum.problem(state)
    if problem is not None:  # a changed digit would move the input silently
        raise CorruptCheckpointError(f"The input position '{path}' is damaged: {problem}.")
    return json_checksum.without(state)


def read_all(step_dir: Any) -> dict[int, dict[str, Any]]:
    """Every process's saved position in the step at `step_dir`, by process index."""
    folder = step_dir / DATA_STATE
    if not folder.exists():
        return {}
    positions = {}
    for path in folder.iterdir():
        stem = path.name.removesuffix(".json")
        if stem.startswith("process_") and stem[len("process_") :].isdigit():
            process = int(stem[len("process_") :])
            state = read(step_dir, process)
            if state is not None:
                positions[process] = state
    return dict(sorted(positions.items()))
