"""One writer per step: a lock per (directory, step), held until the step is committed.

Two processes saving the same step into one directory would share Orbax's temporary directory
(`<step>.orbax-checkpoint-tmp`) and trip over each other's files. `writer_lock` takes an exclusive
`flock` on `<directory>/.keras_orbax.<step>.lock` for the whole write; a second writer of that step
gets `StepLockedError` at once, naming the holder's PID and host, and writes nothing. Other steps
are not locked: two writers of different steps both commit.

- The kernel drops a `flock` when its holder exits or is killed, so a dead writer never blocks the
  next one; the stale file it leaves is simply locked again.
- The file starts with a dot and its name is not a number: neither Orbax's step listing nor
  `committed_steps` takes it for a step. It is deleted on release while still locked; a writer that
  opened it just before finds, once it holds the lock, that the path no longer names its file, and
  starts over with a new one.
- Under `jax.distributed`, only process 0 takes the lock (every process saves each step); the
  others learn whether it got it, so all of them save or all raise.
- Object storage (`gs://`, `s3://`) has no `flock`: remote directories are not locked. Neither is a
  local filesystem that does not support `flock` (some network and FUSE mounts).

`run_lock` is the same lock on the whole directory (`.keras_orbax.lock`), held by a
`ModelCheckpoint` while its `fit` runs: a second training run there is refused before it writes.
`held_if_free` and `is_held` let whoever cleans up after a killed writer (`step_leftovers`) prove
that no writer of a step is left.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from keras_orbax._src.storage import locations
from keras_orbax.errors import StepLockedError

try:
    import fcntl
except ImportError:  # Windows: no flock, no lock
    fcntl = None  # type: ignore[assignment]

_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
_HOLDER_WAIT_S = 2.0


def lock_path(directory: str | os.PathLike, step: int) -> Path:
    """The lock file of `step` in `directory`."""
    return Path(directory) / f".keras_orbax.{step}.lock"


@contextlib.contextmanager
def writer_lock(directory: str | os.PathLike, step: int) -> Iterator[None]:
    """Holds the writer lock of `step` in `directory` for the with-block; call on every process.

    Raises:
        StepLockedError: another writer holds it; nothing was written.
        OSError: the lock file cannot be created (e.g. a read-only directory).
    """
    if fcntl is None or locations.is_remote(directory):
        yield
        return
    taken: list[int] = []

    def take() -> None:
        fd = _acquire(directory, step)
        if fd is not None:
            taken.append(fd)

    from keras_orbax._src.runtime import multihost  # JAX: not on inspect's listing path

    multihost.primary_value(f"writer lock of step {step}", take)
    try:
        yield
    finally:
        for fd in taken:
            _release(lock_path(directory, step), fd)


def _acquire(directory: str | os.PathLike, step: int) -> int | None:
    """A file descriptor holding the lock; None where the filesystem has no `flock`."""
    path = lock_path(directory, step)
    fd = _take(path)
    if isinstance(fd, _Busy):
        raise StepLockedError(_busy_message(directory, step, fd.holder, path)) from None
    return fd


class _Busy:
    """Another writer holds the lock; `holder` names it."""

    def __init__(self, holder: str) -> None:
        self.holder = holder


def _take(path: Path, *, name_holder: bool = True) -> int | _Busy | None:
    """A descriptor holding `path`'s lock, `_Busy` if another holds it, None where the
    filesystem has no `flock`. `name_holder`: wait for the holder's record (for a message)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd) if name_holder else ""
            os.close(fd)
            return _Busy(holder)
        except OSError as error:
            os.close(fd)
            if error.errno in _NO_FLOCK:
                return None
            raise
        if _names(path, fd):
            _record_holder(fd)
            return fd
        os.close(fd)  # its holder released and deleted it after we opened it: take a new one


@contextlib.contextmanager
def held_if_free(directory: str | os.PathLike, step: int) -> Iterator[bool]:
    """This process alone takes the lock of `step` for the block if no writer holds it (True);
    False at once where one does, or where it cannot be taken (a read-only directory, no
    `flock`, object storage): whoever cleans up after a dead writer proves it dead so."""
    fd: int | _Busy | None = None
    if fcntl is not None and not locations.is_remote(directory):
        with contextlib.suppress(OSError):
            fd = _take(lock_path(directory, step), name_holder=False)
    if not isinstance(fd, int):
        yield False
        return
    try:
        yield True
    finally:
        _release(lock_path(directory, step), fd)


def is_held(directory: str | os.PathLike, step: int) -> bool:
    """Whether a writer holds the lock of `step` now; asked without writing anything (a shared
    `flock` on the file, if there is one, let go at once)."""
    if fcntl is None or locations.is_remote(directory):
        return False
    try:
        fd = os.open(lock_path(directory, step), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:  # no lock file: no writer
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:  # no flock here: no lock to hold
        return False
    finally:
        os.close(fd)  # drops the shared lock too
    return False


def run_lock_path(directory: str | os.PathLike) -> Path:
    """The lock a `ModelCheckpoint` holds on its whole directory while `fit` runs."""
    return Path(directory) / ".keras_orbax.lock"


@contextlib.contextmanager
def run_lock(directory: str | os.PathLike, *, shared: bool = True) -> Iterator[None]:
    """Holds the lock of the whole `directory` (one training run writes it) for the with-block;
    call on every process (process 0 takes it, as `writer_lock`). A `directory` not `shared`
    is this process's own (its part of a local tier, on its machine): it takes the lock itself.

    Raises:
        StepLockedError: another run holds it; nothing was written.
    """
    if fcntl is None or locations.is_remote(directory):
        yield
        return
    taken: list[int] = []
    path = run_lock_path(directory)

    def take() -> None:
        try:
            fd = _take(path)
        except OSError:  # a directory that cannot be written: its saves fail, saying why
            return
        if isinstance(fd, _Busy):
            raise StepLockedError(_run_busy_message(directory, fd.holder, path))
        if fd is not None:
            taken.append(fd)

    from keras_orbax._src.runtime import multihost  # JAX: not on inspect's listing path

    if shared:
        multihost.primary_value(f"run lock of {os.fspath(directory)}", take)
    else:
        take()
    try:
        yield
    finally:
        for fd in taken:
            _release(path, fd)


def _record_holder(fd: int) -> None:
    """Writes `<pid> <host>` for a second writer's error message."""
    # Best effort: on a full disk the save fails anyway, with the error that says why.
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()} {socket.gethostname()}\n".encode())


def _release(path: Path, fd: int) -> None:
    """Deletes the lock file while still holding it, then drops the lock."""
    try:
        # Best effort: a lock file left behind (say, on a directory remounted read-only) is
        # harmless; the next writer locks it again.
        with contextlib.suppress(OSError):
            path.unlink()
    finally:
        os.close(fd)


def _names(path: Path, fd: int) -> bool:
    """Whether `path` still names the file open as `fd`."""
    try:
        on_disk = path.stat()
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (on_disk.st_dev, on_disk.st_ino) == (mine.st_dev, mine.st_ino)


def _holder(fd: int) -> str:
    """`PID <pid> on <host>` as the holder wrote it, or a note that it has not yet.

    The holder records itself just after taking the lock: a writer refused in between waits up to
    `_HOLDER_WAIT_S` for the record rather than name no one.
    """
    deadline = time.monotonic() + _HOLDER_WAIT_S
    while True:
        try:
            pid, host = os.pread(fd, 256, 0).decode().split()
        except (OSError, UnicodeDecodeError, ValueError):
            if time.monotonic() > deadline:
                return "its PID not yet recorded"
            time.sleep(0.01)
        else:
            return f"PID {pid} on {host}"


def _busy_message(directory: str | os.PathLike, step: int, holder: str, path: Path) -> str:
    return (
        f"Cannot save step {step} to '{directory}': another writer ({holder}) is saving that "
        f"step right now and holds its lock, {path}. Nothing was written; the committed steps "
        "are intact. Save a different step, or wait for that save to finish. "
        f"Received: step={step}"
    )


def _run_busy_message(directory: str | os.PathLike, holder: str, path: Path) -> str:
    return (
        f"Cannot save to '{directory}': another training run ({holder}) is writing checkpoints "
        f"there and holds its lock, {path}. Nothing was written; its steps are untouched. Give "
        "this run a directory of its own, or stop the other run first. "
        f"Received: directory='{directory}'"
    )
