"""A journal of the real fsyncs, renames and deletions a process makes, in the order made.

`record(monkeypatch)` wraps `os.fsync`, `os.rename`, `os.replace`, `os.unlink`, `os.remove`,
`os.rmdir` and `shutil.rmtree`: each call is noted (what it named, resolved to an absolute path, and
for an fsync the inode it reached) and then made as it would have been. Nothing is mocked: the
files are written, synced and deleted. A deletion under a step directory also notes, at that
moment, the inode of every file and directory of the newest other step, so that a test can ask
whether all of them had been fsynced before.

```python
journal = record(monkeypatch, root)
model.fit(..., callbacks=[keras_orbax.ModelCheckpoint(root, max_to_keep=1)])
deletion = journal.deletions()[0]
```
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest

Inode = tuple[int, int]


@dataclasses.dataclass(frozen=True)
class Event:
    kind: str  # "fsync", "rename", "delete"
    path: str  # absolute; for a rename, the destination
    inode: Inode | None = None  # fsync: what the descriptor reached
    source: str | None = None  # rename: the old name


@dataclasses.dataclass(frozen=True)
class Deletion:
    """The first deletion reaching step `step`, at position `index` of the journal; `newest` is
    the newest step at that moment (a later one), `held` the inodes of its tree (itself included)."""

    index: int
    step: int
    newest: int
    held: dict[Inode, str]


class Journal:
    def __init__(self, root: Path) -> None:
        self.root = os.path.realpath(root)
        self.events: list[Event] = []
        self._deletions: list[Deletion] = []
        self._lock = threading.Lock()

    def note(self, event: Event) -> None:
        with self._lock:
            self.events.append(event)

    def deleting(self, path: str) -> None:
        step = self._step_of(path)
        with self._lock:
            self.events.append(Event("delete", path))
            if step is None or any(d.step == step for d in self._deletions):
                return
            others = [s for s in self._steps() if s != step]
            if others and max(others) > step:  # an older step, not a file of the newest
                newest = max(others)
                held = _tree(Path(self.root) / str(newest))
                self._deletions.append(Deletion(len(self.events) - 1, step, newest, held))

    def deletions(self) -> list[Deletion]:
        return list(self._deletions)

    def fsynced_before(self, index: int) -> set[Inode]:
        return {e.inode for e in self.events[:index] if e.kind == "fsync" and e.inode}

    def index(self, kind: str, path: str | os.PathLike[str], after: int = -1) -> int | None:
        """Position of the first event `kind` on `path` after position `after`; None if none."""
        wanted = os.path.realpath(path)
        for i, event in enumerate(self.events):
            if i > after and event.kind == kind and event.path == wanted:
                return i
        return None

    def _step_of(self, path: str) -> int | None:
        relative = os.path.relpath(path, self.root)
        first = relative.split(os.sep)[0]
        return int(first) if first.isdecimal() and not relative.startswith("..") else None

    def _steps(self) -> list[int]:
        return [int(p) for p in os.listdir(self.root) if p.isdecimal()]


def _tree(step_dir: Path) -> dict[Inode, str]:
    """Every file and directory of `step_dir` (itself included) by inode."""
    held = {}
    for path in [step_dir, *step_dir.rglob("*")]:
        st = os.lstat(path)
        held[(st.st_dev, st.st_ino)] = str(path)
    return held


def _absolute(path: Any, dir_fd: int | None = None) -> str:
    path = os.fsdecode(path)
    if dir_fd is not None and not os.path.isabs(path):
        path = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
    return os.path.abspath(path)


def record(monkeypatch: pytest.MonkeyPatch, root: str | os.PathLike[str]) -> Journal:
    """Starts the journal of the calls touching `root` (undone with `monkeypatch`)."""
    journal = Journal(Path(root))
    real_fsync, real_rmtree = os.fsync, shutil.rmtree
    real = {name: getattr(os, name) for name in ("rename", "replace", "unlink", "remove", "rmdir")}

    def mine(path: str) -> bool:
        return path == journal.root or path.startswith(journal.root + os.sep)

    def fsync(fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        st = os.fstat(fd)
        real_fsync(fd)
        if mine(path):  # noted once it has returned: written back by then
            journal.note(Event("fsync", path, (st.st_dev, st.st_ino)))

    def renaming(name: str) -> Any:
        def rename(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
            source = _absolute(src, kwargs.get("src_dir_fd"))
            destination = _absolute(dst, kwargs.get("dst_dir_fd"))
            if (
                mine(source)
                and journal._step_of(source) is not None
                and journal._step_of(destination) != journal._step_of(source)
            ):
                journal.deleting(source)  # a step moved away is a step deleted
            real[name](src, dst, *args, **kwargs)
            if mine(destination):
                journal.note(Event("rename", destination, source=source))

        return rename

    def deleting(name: str) -> Any:
        def delete(path: Any, *args: Any, **kwargs: Any) -> None:
            absolute = _absolute(path, kwargs.get("dir_fd"))
            if mine(absolute):
                journal.deleting(absolute)
            real[name](path, *args, **kwargs)

        return delete

    def rmtree(path: Any, *args: Any, **kwargs: Any) -> None:
        absolute = _absolute(path, kwargs.get("dir_fd"))
        if mine(absolute):
            journal.deleting(absolute)
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    for name in ("rename", "replace"):
        monkeypatch.setattr(os, name, renaming(name))
    for name in ("unlink", "remove", "rmdir"):
        monkeypatch.setattr(os, name, deleting(name))
    monkeypatch.setattr(shutil, "rmtree", rmtree)
    return journal
