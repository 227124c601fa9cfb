"""Making a committed step durable: what Orbax writes around the arrays, it does not fsync.

keras-orbax fsyncs every file and directory of the arrays it writes (`_write`). Orbax then writes
its own files (the tree's `_METADATA`, `_CHECKPOINT_METADATA`, the `commit_success.txt` markers,
the compact format's `state/array_metadatas/process_0`) and renames the temporary step directory
into place, and fsyncs none of it: a power loss after `save` returned could leave a committed step
without its metadata. `step_committed` fsyncs every file and directory of the step, at any depth,
and the directory holding the step, so a save is durable when it
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
    """fsyncs every file and directory of the committed step at `step_dir`, at any depth (Orbax's
    own files lie two levels down too: the compact format's `state/array_metadatas/process_0`),
    and the directory holding the step. A file keras-orbax fsynced already costs a system call.

    Raises:
        OSError: the data could not be written back, or the step is gone (nothing deletes a
            step before it is durable: something outside keras-orbax did).
    """
    fsync_tree(step_dir)
    fsync_path(step_dir.parent)


def fsync_tree(root: Path) -> None:
    """fsyncs every file and directory under `root` (itself included), directories after the
    files they hold.

    Raises:
        OSError: some data could not be written back, or a file vanished.
    """
    for directory, _, files in os.walk(root, topdown=False, onerror=_raise):
        for name in files:
            path = os.path.join(directory, name)
            if not os.path.islink(path):
                fsync_path(path)
        fsync_path(directory)


def _raise(error: OSError) -> None:
    raise error


def fsync_path(path: str | os.PathLike[str]) -> None:
    """fsyncs a file or a directory."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
