"""The files of a local step that retention retired, kept for the next local save to write into.

The local tier (`ModelCheckpoint(local_directory=...)`, under `/dev/shm`) writes the whole state
every few batches. Writing a new file in tmpfs allocates and zeroes each of its pages, and deleting
the retired step frees them again: together several times what writing into pages a file has
already costs, on cores that training uses (docs/preemption.md). So where retention would delete
the oldest local step, it moves the step out of the steps instead (`retire`: one rename, after
which no reader lists it), and the next save moves each of its shard files into place and
overwrites it (`take`). Only a file that no kept step shares is taken: an incremental save
hard-links unchanged shards between steps, and writing into a shared inode would change a kept
step.

Nothing the user could still want is written into: retention had retired the step. The memory the
tier holds peaks at `local_max_to_keep` + 1 steps, as without this; between saves the retired
step's files wait in `.keras_orbax.recycled`, removed when `fit` ends (`remove`).

```python
retired = recycled_step.retire(root, 7)          # instead of deleting step 7
took = recycled_step.take(retired / "state", "kernel/c/0/0", new_path)
```
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

NAME = ".keras_orbax.recycled"


def path(root: str | os.PathLike) -> Path:
    """Where the local tier under `root` keeps the retired step's files."""
    return Path(root) / NAME


def retire(root: str | os.PathLike, step: int) -> Path:
    """Moves the committed `step` of `root` out of its steps, in place of an earlier retired one
    (whatever the last save did not take of that is deleted); returns where it is now."""
    into = path(root)
    remove(root)
    os.rename(Path(root) / str(step), into)
    return into


def take(state: str, relative: str, target: str) -> bool:
    """Moves the retired step's file `relative` (under its `state/`) to `target`, for the caller to
    overwrite; False where there is no such file or a kept step shares its inode."""
    source = f"{state}/{relative}"
    try:
        found = os.lstat(source)
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(found.st_mode) or found.st_nlink != 1:
        return False
    os.rename(source, target)
    return True


def remove(root: str | os.PathLike) -> None:
    """Deletes the retired step's files under `root`, if any."""
    shutil.rmtree(path(root), ignore_errors=True)
