"""How a staged export takes the place of the previous one: the rename stage (the commit point)
and the prune stage of `storage.commit`'s protocol.

A directory export is swapped with the old directory in one atomic `renameat2(RENAME_EXCHANGE)`,
the old one's other files linked in first; where it cannot be (a mount point, a filesystem without
the exchange) its files are renamed one by one, configs last, with a warning. A file export is
renamed file by file, its index last. Only after the commit is what it replaced removed.

```python
replace.rename(sink, staging)  # committed once this returns
replace.prune(sink, staging)
```
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from keras_orbax._src.storage import durable
from keras_orbax.errors import KerasOrbaxWarning, SaveFailedError

if TYPE_CHECKING:
    from keras_orbax._src.storage.commit import ExportSink


def in_place(sink: ExportSink) -> bool:
    """Whether the export is a mount point, renamed into file by file (no rename leaves it)."""
    return sink.whole_directory and os.path.ismount(sink.destination)


def rename(
    sink: ExportSink, staging: Path, fault_point: Callable[[str], None] | None = None
) -> None:
    """The commit: one atomic exchange for a directory, else each file, configs last (before the
    last, a file export calls `fault_point("rename.last")`: where a fault matrix kills one)."""
    parent = sink.destination.parent
    if sink.whole_directory:
        if in_place(sink):
            _rename_each_file(sink, staging)
        elif not sink.destination.exists():
            os.rename(staging, sink.destination)
        elif not _exchange(staging, sink.destination):
            _rename_each_file(sink, staging)
    else:
        _rename_files(sink, staging, fault_point)
    durable.fsync_path(parent)


def _rename_files(
    sink: ExportSink, staging: Path, fault_point: Callable[[str], None] | None
) -> None:
    """A file export's files renamed in `commit_order`, after `removed_first` is removed (the old
    index first: a rename part-way never mixes). A failure part-way says what is in place: not
    the previous export any more, nor the whole new one."""
    parent, order = sink.destination.parent, sink.commit_order()
    removed: list[str] = []
    done: list[str] = []
    try:
        for name in sink.removed_first():
            if (parent / name).exists():
                (parent / name).unlink()
                removed.append(name)
        for name in order:
            if fault_point is not None and len(order) > 1 and name == order[-1]:
                fault_point("rename.last")
            os.replace(staging / name, parent / name)
            done.append(name)
    except OSError as error:
        if not done and not removed:
            raise  # nothing in place changed: the previous export is untouched
        raise SaveFailedError(
            f"Renaming the export's files into {parent} failed part-way: "
            f"{type(error).__name__}: {error}. In place now: "
            + (", ".join(f"the new {n}" for n in done) or "the previous files")
            + (f"; removed: the previous {', '.join(removed)}" if removed else "")
            + f"; not written: the new {', '.join(n for n in order if n not in done)}. It is "
            "neither the previous export nor the whole new one: export again."
        ) from error


def _rename_each_file(sink: ExportSink, staging: Path) -> None:
    """Where the directory cannot be swapped (a mount point, a filesystem without
    `RENAME_EXCHANGE`): the files one by one, configs last, then the old export's files that this
    one does not write removed; say so: a kill part-way leaves a directory that mixes both."""
    warnings.warn(
        f"{sink.destination} cannot be swapped with its new version atomically (a mount point, "
        "or no renameat2 RENAME_EXCHANGE); the export's files are renamed one by one, configs "
        "last.",
        KerasOrbaxWarning,
        stacklevel=4,
    )
    files = sorted(
        (p for p in staging.rglob("*") if p.is_file()), key=lambda p: p.name.endswith(".json")
    )
    written = {path.relative_to(staging).as_posix() for path in files}
    for path in files:
        target = sink.destination / path.relative_to(staging)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, target)
    for path in list(sink.destination.rglob("*")):
        relative = path.relative_to(sink.destination).as_posix()
        if path.is_file() and relative not in written and sink.is_export_file(relative):
            path.unlink()
    durable.fsync_tree(sink.destination)


def prune(sink: ExportSink, staging: Path) -> None:
    """Removes what the committed export replaced; a failure only warns (the export is
    committed, and the next export removes what is left)."""
    try:
        if not sink.whole_directory:
            for name in sink.replaced():
                (sink.destination.parent / name).unlink(missing_ok=True)
        remove(staging)  # a directory export: the old directory, swapped in here
        durable.fsync_path(sink.destination.parent)
    except OSError as error:
        warnings.warn(
            f"{sink.destination} is committed, but removing what it replaced failed: {error}. "
            f"The next export there removes {staging}.",
            KerasOrbaxWarning,
            stacklevel=3,
        )


def link_kept_files(sink: ExportSink, staging: Path) -> None:
    """Hard links, into the staged directory, every file of the old one that this export does not
    write (the user's own files): the exchange keeps them."""
    if not sink.destination.is_dir():
        return
    for path in sorted(sink.destination.rglob("*")):
        relative = path.relative_to(sink.destination)
        target = staging / relative
        if path.is_dir() or target.exists() or sink.is_export_file(relative.as_posix()):
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(path, target)
        except OSError:  # a filesystem without hard links: a copy
            shutil.copy2(path, target)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swaps two paths (Linux `renameat2(RENAME_EXCHANGE)`); False where the platform or
    filesystem cannot."""
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    done = renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if done == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EXDEV, errno.EBUSY):
        return False
    raise OSError(code, os.strerror(code), os.fspath(b))


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
