"""Telling a child process's progress to the test and back, without polling: FIFOs.

```python
ready, go = Beacon(tmp_path / "ready"), Go(tmp_path / "go")   # before the child starts
child = subprocess.Popen([...])             # writes `ready` once there, then waits on `go`
ready.wait(child, timeout=HANG_S)           # wakes when the child opens `ready` (or exits)
go.send()                                   # the child's read of one byte from `go` returns
```

A `Beacon` is a FIFO this process holds open for reading from before the child starts, so the
child's open for writing (`Path(p).write_text(...)`; not `touch()`, which only sets the time of an
existing file) neither blocks nor goes unseen, and `select` wakes on it. `wait` also watches the
child's pidfd, so a child that dies first fails the wait at once, with its log.
"""

from __future__ import annotations

import os
import select
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Self


class _Fifo:
    path: Path
    _fd: int

    def __fspath__(self) -> str:
        return str(self.path)

    __str__ = __fspath__

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        os.close(self._fd)


class Beacon(_Fifo):
    """A point a child process reaches: it opens the FIFO at `path` for writing."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        os.mkfifo(self.path)
        # Opened before any writer: Linux then reports the first writer's close as readable.
        self._fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)

    def wait(
        self,
        procs: subprocess.Popen | Sequence[subprocess.Popen],
        timeout: float,
        log: str | os.PathLike | None = None,
    ) -> None:
        """Returns once a child has opened the beacon.

        Raises:
            AssertionError: one of `procs` exited first, or `timeout` seconds passed; with the
                tail of `log`.
        """
        procs = [procs] if isinstance(procs, subprocess.Popen) else list(procs)
        pidfds = {os.pidfd_open(p.pid): p for p in procs}
        deadline = time.monotonic() + timeout
        try:
            while True:
                left = deadline - time.monotonic()
                ready, _, _ = select.select([self._fd, *pidfds], [], [], max(left, 0))
                if self._fd in ready:
                    return
                exited = [pidfds[fd] for fd in ready]
                assert not exited, (
                    f"{self.path.name}: a child exited ({exited[0].wait()}) before it got there"
                    f"{_tail(log)}"
                )
                assert left > 0, f"{self.path.name}: no child got there in {timeout:g}s{_tail(log)}"
        finally:
            for fd in pidfds:
                os.close(fd)


class Go(_Fifo):
    """A signal to a child waiting at a point: it reads one byte from the FIFO at `path`."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        os.mkfifo(self.path)
        # Read-write: the child's open for reading returns at once, and its read waits for `send`.
        self._fd = os.open(self.path, os.O_RDWR)

    def send(self) -> None:
        os.write(self._fd, b"g")


def wait_for_go(path: str | os.PathLike) -> None:
    """In the child: returns once the test has sent `Go`."""
    with open(path, "rb") as fifo:
        fifo.read(1)


def _tail(log: str | os.PathLike | None) -> str:
    return f"; {log}:\n{Path(log).read_text(errors='replace')[-3000:]}" if log else ""
