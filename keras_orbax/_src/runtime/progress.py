"""Progress of long operations on a terminal: bytes done, total and rate, on one updated line.

Shown only when the stream is a terminal (not in logs or pipes) and not asked to be quiet. Uses
`rich` when it is installed, a plain carriage-return line otherwise.

```python
with Progress("convert", total=nbytes) as progress:
    for array in arrays:
        write(array)
        progress.advance(array.nbytes)
```
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO


class Progress:
    """A progress line for `total` bytes, shown on `stream` if it is a terminal and `enabled`."""

    def __init__(
        self, label: str, total: int, *, enabled: bool = True, stream: TextIO | None = None
    ) -> None:
        self.label = label
        self.total = total
        self.done = 0
        self.stream = stream or sys.stderr
        self.enabled = enabled and self.stream.isatty()
        self._start = time.monotonic()
        self._shown = 0.0
        self._rich: Any = None

    def __enter__(self) -> Progress:
        if self.enabled:
            self._rich = _rich_progress(self.stream, self.label, self.total)
        return self

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        if not self.enabled:
            return
        if self._rich is not None:
            progress, task = self._rich
            progress.update(task, advance=nbytes)
            return
        now = time.monotonic()
        if now - self._shown >= 0.1 or self.done >= self.total:
            self._shown = now
            self.stream.write(f"\r{self.line()}")
            self.stream.flush()

    def line(self) -> str:
        """`convert: 24.0 MiB / 64.0 MiB (37%), 120.3 MiB/s`."""
        elapsed = max(time.monotonic() - self._start, 1e-9)
        percent = 100 * self.done // self.total if self.total else 100
        return (
            f"{self.label}: {human_bytes(self.done)} / {human_bytes(self.total)} ({percent}%), "
            f"{human_bytes(self.done / elapsed)}/s"
        )

    def __exit__(self, *exc: Any) -> None:
        if not self.enabled:
            return
        if self._rich is not None:
            self._rich[0].stop()
        else:
            self.stream.write(f"\r{self.line()}\n")
            self.stream.flush()


def _rich_progress(stream: TextIO, label: str, total: int) -> tuple[Any, Any] | None:
    try:
        from rich.console import Console
        from rich.progress import BarColumn, DownloadColumn, ProgressColumn
        from rich.progress import Progress as RichProgress
        from rich.text import Text
    except ImportError:
        return None

    class BinaryRateColumn(ProgressColumn):
        """The rate in KiB/s, MiB/s, GiB/s: rich's `TransferSpeedColumn` says MB/s (powers of
        1000) next to sizes in MiB."""

        def render(self, task: Any) -> Text:
            speed = task.finished_speed or task.speed
            shown = "?" if speed is None else f"{human_bytes(speed)}/s"
            return Text(shown, style="progress.data.speed")

    progress = RichProgress(
        "{task.description}",
        BarColumn(),
        DownloadColumn(binary_units=True),
        BinaryRateColumn(),
        console=Console(file=stream),
    )
    progress.start()
    return progress, progress.add_task(label, total=total)


def human_bytes(nbytes: float) -> str:
    """`512 B`, `3.2 KiB`, `1.0 GiB`: binary units, as everything keras-orbax prints."""
    if nbytes < 1024:
        return f"{int(nbytes)} B"
    for unit in ("KiB", "MiB", "GiB"):
        nbytes /= 1024
        if round(nbytes, 1) < 1024:  # 1023.96 KiB reads 1.0 MiB, not 1024.0 KiB
            return f"{nbytes:.1f} {unit}"
    return f"{nbytes / 1024:.1f} TiB"
