"""One commit protocol for every writer: staged, agreed, checked, fsynced, renamed, then pruned.

A `Sink` writes one format. An `ExportSink` (a `.weights.h5`, a keras-hub preset, a Hugging Face
directory) is run by `write` through the stages every export goes through, so that no sink can
forget one; a step (`write.step_sink.StepSink`) goes through the same stages inside Orbax's save,
with the same outcome gathering (`multihost.gather_outcomes`) and region check (`check_regions`):

1. **stage**: process 0 prepares a hidden staging directory beside the destination
   (`.<name>.partial`), then every process writes its regions there (nothing is visible under a
   name a reader looks for); process 0 also writes the configs there.
2. **agree**: every process reports its outcome and the regions it wrote; all raise if any
   failed. Every process then checks every process's regions against those it was due to write
   (`Sink.regions_due`, `check_regions`), never a directory listing or a file size, so all reach
   the same verdict; process 0 assembles what others staged.
3. **fsync**: every file and directory of the staged export, at any depth.
4. **rename**: a directory export is swapped with the old one in one atomic `renameat2` exchange
   (the old one's other files linked in first); a file export is renamed file by file, its index
   last (the old index removed first: a crash part-way leaves parts without an index, which loads
   nothing, never a mix). This is the commit point: the parent directory is fsynced.
5. **prune**: only now is what it replaced removed.

A failure at any stage is a `SaveFailedError` on every process (within
`KERAS_ORBAX_SYNC_TIMEOUT_S` under `jax.distributed`), and the previous export is untouched.

```python
write(weights_h5.H5Sink(model, Path("/out/m.weights.h5")))
```
"""

from __future__ import annotations

import abc
import contextlib
import errno
import hashlib
import os
import signal
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from keras_orbax._src.runtime import gc_pause, multihost
from keras_orbax._src.storage import durable, replace
from keras_orbax.errors import KerasOrbaxError, SaveFailedError

STAGES = ("stage", "agree", "fsync", "rename", "prune")
# Test-only: names a stage (`rename`, or `rename@1` for process 1 only) at whose start this
# process SIGKILLs itself, so the fault matrix kills real processes at every stage.
KILL_AT_ENV = "KERAS_ORBAX_TEST_KILL_AT"
_hooks: list[Callable[[str], None]] = []


class Sink(abc.ABC):
    """A place a model's state is committed to, in one format: the mirror of `sources.base.Source`
    (a new format is a new sink, nothing else).

    Every sink goes through the same protocol, whoever drives it (`write` for an export, Orbax's
    save for a step, `write.step_sink.StepSink`): stage under partial names; every process
    reports its outcome (`multihost.gather_outcomes`) and the regions it wrote, which every
    process checks against those each was due to write (`check_regions`: never a listing or a
    size); fsync every file and directory; rename in a fixed order, configs last; only then remove
    what it replaces. A failure anywhere is a `SaveFailedError` on every process.
    """

    destination: Any
    """What the sink writes to: an export's file or directory, a checkpoint's root."""
    unchanged: str = "the export is abandoned; the previous one is untouched"
    """What a failure leaves as it was, in the words its error ends with."""

    @abc.abstractmethod
    def regions_due(self, process: int) -> Sequence[str]:
        """The keys of the regions `process` must have written (known once it has staged)."""

    def check(self, reports: Sequence[Any]) -> None:
        """`check_regions` of every process's report against `regions_due`.

        Raises:
            SaveFailedError: some process's regions are not those it was due to write.
        """
        check_regions(reports, self.regions_due, str(self.destination), self.unchanged)


class ExportSink(Sink):
    """An export: a `.weights.h5`, a preset, an HF directory. `write` calls its methods in this
    order; only `stage` runs on every process."""

    destination: Path
    """What the export replaces: a directory (`whole_directory`) or a file."""
    whole_directory: bool

    def prepare(self, staging: Path) -> None:
        """Process 0: what must exist before any process writes (a file's header, configs)."""

    @abc.abstractmethod
    def stage(self, staging: Path) -> Sequence[str]:
        """Every process: writes the regions it is due under `staging`, fsyncs them, and returns
        their keys."""

    def report(self, written: Sequence[str]) -> list[Any]:
        """What this process reports of the regions it wrote (`written`, their keys): their
        `digest`; a sink may add what process 0 checks them by (`check`)."""
        return digest(written)

    def assemble(self, staging: Path) -> None:
        """Process 0, once every region is in: copies staged regions into place, writes indexes."""

    @abc.abstractmethod
    def commit_order(self) -> Sequence[str]:
        """A file export's file names (in `staging` and beside `destination`), in rename order:
        configs and indexes last."""

    def removed_first(self) -> Sequence[str]:
        """A file export's names beside `destination` removed before any is renamed (an index:
        a rename part-way never leaves one naming a mix); by default the last of `commit_order`."""
        order = self.commit_order()
        return list(order[-1:]) if len(order) > 1 else []

    def replaced(self) -> Sequence[str]:
        """A file export's names beside `destination` that no longer belong to it (old parts):
        removed when the export is committed."""
        return []

    @abc.abstractmethod
    def is_export_file(self, relative: str) -> bool:
        """Whether a directory export writes (or once wrote) the file at `relative`; the old
        directory's other files are kept."""


def digest(keys: Sequence[str]) -> list[Any]:
    """A process's report of the regions it wrote: a short, order-free summary of their keys (their
    count and a hash), small enough for the coordination service whatever the model's size."""
    text = "\n".join(sorted(keys)).encode()
    return [len(keys), hashlib.sha256(text).hexdigest()]


def check_regions(
    reports: Sequence[Any],
    due: Callable[[int], Sequence[str]],
    what: str,
    unchanged: str = "the export is abandoned; the previous one is untouched",
) -> None:
    """Checks every process's report (`digest` of the regions it wrote) against the regions it was
    due to write, `due(process)`, computed from the arrays' shardings: never a directory listing
    or a file size. Every process runs it on all processes' reports, so all reach the same verdict
    without another round.

    Raises:
        SaveFailedError: some process wrote other regions than it was due to (a region missing,
            a file gone between its write and the commit); each such process named.
    """
    wrong = [
        f"process {process}: wrote {report[0]} regions, was due {expected[0]}"
        + ("" if report[0] != expected[0] else " (not the same ones)")
        for process, report in enumerate(reports)
        if list(report) != (expected := digest(list(due(process))))
    ]
    if wrong:
        raise SaveFailedError(f"Not every region of {what} was written: {wrong}; {unchanged}")


def write(sink: ExportSink, name: str) -> Path:
    """Runs `sink` through the commit protocol on every process; returns its destination.

    Raises:
        SaveFailedError: any stage failed on any process; the previous export is untouched.
        ProcessSyncError: a process did not reach a stage within `KERAS_ORBAX_SYNC_TIMEOUT_S`.
    """
    # An export allocates as it writes (Keras's walk, h5py, each region), and each full collection
    # would walk every object the process holds, the loaded model's included: when each run of a
    # column-cut kernel was a Python object, they were a fifth of a large export
    # (docs/benchmarks.md, "Where the exports' time went"). See gc_pause.hold.
    with gc_pause.paused():
        return _write(sink, name)


def _write(sink: ExportSink, name: str) -> Path:
    if sink.whole_directory and sink.destination.is_symlink():  # swap the directory, not the link
        sink.destination = sink.destination.resolve()
    staging = staging_path(sink)
    primary = multihost.is_primary()
    committed = False
    try:
        fault_point("stage")
        _collectively(f"{name}: prepare", _prepare, sink, staging, primary=True)
        written, error = None, None
        try:
            written = _stage(sink, staging)
        except Exception as failed:  # reported to every process by the gathering, which raises
            error = failed
        fault_point("agree")
        reports = _gathered(f"{name}: stage", error, sink.report(written or ()))
        sink.check(reports)  # on every process: the same verdict everywhere
        _collectively(f"{name}: assemble", sink.assemble, staging)
        fault_point("fsync")
        _collectively(f"{name}: fsync", _fsync_staged, sink, staging)
        fault_point("rename")
        _collectively(f"{name}: rename", replace.rename, sink, staging, fault_point)
        committed = True
        fault_point("prune")
        if primary:
            replace.prune(sink, staging)
    finally:
        if primary and not committed:
            with contextlib.suppress(OSError):
                replace.remove(staging)
    return sink.destination


def check_space(directory: Path, needed: int) -> None:
    """Raises ENOSPC before anything is written where the filesystem of `directory` has fewer than
    `needed` bytes free: HDF5 crashes the process (a segmentation fault while it closes the file)
    when a write fails mid-file with ENOSPC, so an export that cannot fit fails up front.

    Raises:
        OSError: ENOSPC, with the bytes needed and free.
    """
    stats = os.statvfs(directory)
    free = stats.f_bavail * stats.f_frsize
    if free < needed:
        raise OSError(
            errno.ENOSPC,
            f"{os.strerror(errno.ENOSPC)}: the export needs about {needed} bytes, {free} are free",
            os.fspath(directory),
        )


def staging_path(sink: ExportSink) -> Path:
    """Where an export is staged: hidden, a name no reader looks for; beside the destination, or,
    where that is a mount point (no rename leaves it), inside it."""
    if replace.in_place(sink):
        return sink.destination / ".keras_orbax.partial"
    return sink.destination.with_name(f".{sink.destination.name}.partial")


@contextlib.contextmanager
def on_stage(hook: Callable[[str], None]) -> Iterator[None]:
    """Test-only: calls `hook(stage)` at the start of each stage of every `write` within (a fault
    matrix fills the disk or shuts the filesystem down there)."""
    _hooks.append(hook)
    try:
        yield
    finally:
        _hooks.remove(hook)


def fault_point(stage: str) -> None:
    """Test-only: where a fault matrix injects its fault (`on_stage` hooks, `KILL_AT_ENV`); a
    no-op otherwise. Also called by `save`'s writer at its stages (`stage`, `agree`, `rename`,
    `fsync`; docs/reliability.md maps them onto Orbax's commit)."""
    for hook in list(_hooks):
        hook(stage)
    kill_at = os.environ.get(KILL_AT_ENV, "")
    where, _, process = kill_at.partition("@")
    if where == stage and (not process or int(process) == multihost.process_index()):
        os.kill(os.getpid(), signal.SIGKILL)


def _collectively(name: str, fn: Callable[..., Any], *args: Any, primary: bool = True) -> Any:
    """`fn(*args)` on process 0 (`primary`) or on every process, then agreed: every process raises
    `SaveFailedError` if it failed anywhere."""
    result, error = None, None
    if not primary or multihost.is_primary():
        try:
            result = fn(*args)
        except Exception as failed:  # reported to every process by `agree`, which re-raises
            error = failed
    if error is not None and multihost.process_count() == 1:
        raise _failed(name, error) from error
    multihost.agree(name, error, unchanged=_UNCHANGED, fallback=SaveFailedError)
    return result


_UNCHANGED = "the export is abandoned; the previous one is untouched"


def _gathered(name: str, error: Exception | None, value: Any) -> list[Any]:
    """Every process's `value` (`multihost.gather_outcomes`), or `SaveFailedError` on every process
    if any failed; within `KERAS_ORBAX_SYNC_TIMEOUT_S` of the slowest."""
    if error is not None and multihost.process_count() == 1:
        raise _failed(name, error) from error
    return multihost.gather_outcomes(
        name,
        multihost.next_round(name),
        error,
        value,
        wait_s=multihost.DEFAULT_TIMEOUT_S,
        fallback=SaveFailedError,
        every_report=True,
    )


def _failed(name: str, error: Exception) -> Exception:
    if isinstance(error, KerasOrbaxError | ValueError | TypeError):
        return error  # the caller's input, or our own error: as it is
    return SaveFailedError(f"'{name}' failed: {type(error).__name__}: {error}; {_UNCHANGED}.")


def _prepare(sink: ExportSink, staging: Path) -> None:
    staging.parent.mkdir(parents=True, exist_ok=True)
    replace.remove(staging)  # what an earlier, failed attempt left
    staging.mkdir()
    sink.prepare(staging)


def _stage(sink: ExportSink, staging: Path) -> list[str]:
    written = list(sink.stage(staging))
    if multihost.is_primary() and sink.whole_directory and not replace.in_place(sink):
        replace.link_kept_files(sink, staging)
    return written


def _fsync_staged(sink: ExportSink, staging: Path) -> None:
    """Every file and directory the export holds, at any depth, then the directory holding it."""
    durable.fsync_tree(staging)
    durable.fsync_path(staging.parent)
