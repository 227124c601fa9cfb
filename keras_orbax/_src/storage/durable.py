"""Making a committed step durable: what Orbax writes around the arrays, it does not fsync.

keras-orbax fsyncs every file and directory of the arrays it writes (`_write`). Orbax then writes
its own files (the tree's `_METADATA`, `_CHECKPOINT_METADATA`, the `commit_success.txt` markers)
and renames the temporary step directory into place, and fsyncs none of it: a power loss after
`save` returned could leave a committed step without its metadata. `step_committed` fsyncs those
files, their directories and the directory holding the step, so a save is durable when it
returns (`tests/test_durable.py`: no page of a saved step is left to write back, and every
directory entry is fsynced). Retention deletes older steps only after that
(`tests/test_durability_order.py`): a step to resume from is always on the disk.

```python
response.result()                       # Orbax has committed step 10
step_committed(Path("/ckpt/10"))
```
"""

from __future__ import annotations

import os
from pathlib import Path


def step_committed(step_dir: Path) -> None:
    """fsyncs the files of the committed step at `step_dir` outside its arrays' directories (those
    are durable already), the directories holding them and the one holding the step.

    Raises:
        OSError: the data could not be written back, or the step is gone (nothing deletes a
            step before it is durable: something outside keras-orbax did).
    """
    below = [Path(entry.path) for entry in os.scandir(step_dir) if entry.is_dir()]
    for directory in (step_dir, *below):
        for entry in os.scandir(directory):
            if entry.is_file(follow_symlinks=False):
                fsync_path(Path(entry.path))
    for directory in (*below, step_dir, step_dir.parent):
        fsync_path(directory)


def fsync_path(path: str | os.PathLike[str]) -> None:
    """fsyncs a file or a directory."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
