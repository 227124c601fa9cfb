"""A save is durable when it returns: no page of its files is left for the kernel to write back,
Orbax's own files included (`storage/durable.py`), and every directory entry is fsynced.

The page cache shows file data only: a directory's entries (a new file's name, the rename that
commits the step) are metadata it cannot see, so written-back pages alone would pass with no
directory fsynced at all. The fsyncs themselves are recorded too (`tests/_fs_journal.py`)."""

from __future__ import annotations

import collections
import os
import re
import signal
import threading

import keras
import numpy as np
import pytest

import keras_orbax
from keras_orbax._src.storage import durable, mapped
from keras_orbax._src.write import files_writer
from tests import _fs_journal, _models
from tests._page_cache import written_back


def _model() -> keras.Model:
    """24 small Dense layers and one whose kernel is split into shard files of 1 MiB."""
    inputs = keras.Input((1024,))
    outputs = [keras.layers.Dense(8, name=f"small_{i}")(inputs) for i in range(24)]
    outputs.append(keras.layers.Dense(2048, name="large")(inputs))
    return keras.Model(inputs, outputs, name="many")


@pytest.mark.parametrize("format", ["fast", "compact"])
def test_no_page_of_a_saved_step_is_left_to_write_back(tmp_path, distribution, monkeypatch, format):
    """The compact format too: Orbax writes `state/array_metadatas/process_0` two levels down."""
    if mapped.filesystem_type(os.stat(tmp_path).st_dev) in {"tmpfs", "ramfs"}:
        pytest.skip("a filesystem in memory writes nothing back")
    distribution(_models.model_parallel((1, 8)))
    model = _model()
    _models.fill_arange(model, limit=1000)
    journal = _fs_journal.record(monkeypatch, tmp_path)
    keras_orbax.save(model, tmp_path, step=1, format=format)
    monkeypatch.undo()

    files = [path for path in (tmp_path / "1").rglob("*") if path.is_file()]
    if format == "fast":
        assert len(files) > 50
        assert max(map(os.path.getsize, files)) > 1 << 20  # the large kernel's shards
    else:
        assert (tmp_path / "1" / "state" / "array_metadatas" / "process_0") in files
    assert written_back(files) == []  # every page written: the cache could drop them all
    # Every file and directory of the step fsynced (a hard-linked file through any of its names),
    # and after the rename into place, the step's directory and the one holding it.
    fsynced = journal.fsynced_before(len(journal.events))
    entries = [tmp_path / "1", *(tmp_path / "1").rglob("*")]
    assert sum(path.is_dir() for path in entries) > (25 if format == "fast" else 3)
    unsynced = [str(p) for p in entries if (os.lstat(p).st_dev, os.lstat(p).st_ino) not in fsynced]
    assert unsynced == []
    renamed = journal.index("rename", tmp_path / "1")
    assert renamed is not None
    assert journal.index("fsync", tmp_path / "1", after=renamed) is not None
    assert journal.index("fsync", tmp_path, after=renamed) is not None

    with keras_orbax.deferred_init():
        restored = _model()
    keras_orbax.restore_sharded(restored, tmp_path)  # read back from the disk
    for got, want in zip(restored.variables, model.variables, strict=True):
        np.testing.assert_array_equal(np.asarray(got.value), np.asarray(want.value))


def _count_fsyncs(monkeypatch) -> collections.Counter:
    """Counts each fsync by the (device, inode) it reached; the real fsync still runs."""
    counts: collections.Counter = collections.Counter()
    fsync = os.fsync

    def counting(fd: int) -> None:
        stat = os.fstat(fd)
        counts[(stat.st_dev, stat.st_ino)] += 1
        fsync(fd)

    monkeypatch.setattr(os, "fsync", counting)
    return counts


def _inode(path) -> tuple[int, int]:
    stat = os.lstat(path)
    return stat.st_dev, stat.st_ino


def test_a_file_the_writer_fsynced_is_fsynced_once(tmp_path, distribution, monkeypatch):
    """The writer notes each file it fsyncs, and each directory it created (`durable.Synced`);
    the commit passes over those and fsyncs the rest: Orbax's own files and the directories
    Orbax writes into."""
    distribution(_models.model_parallel((1, 8)))
    model = _model()
    _models.fill_arange(model, limit=1000)
    counts = _count_fsyncs(monkeypatch)
    keras_orbax.save(model, tmp_path, step=1)
    monkeypatch.undo()

    entries = [tmp_path / "1", *(tmp_path / "1").rglob("*")]
    shards = [p for p in entries if p.is_file() and re.fullmatch(r"c(\.\d+)+|\d+", p.name)]
    assert len(shards) > 50
    assert {str(p): counts[_inode(p)] for p in shards} == {str(p): 1 for p in shards}
    # The directories the writer created and filled below `state/` too; `state/` itself gets
    # Orbax's `_METADATA` after the writer's fsync, so the commit fsyncs it again.
    own = [p for p in (tmp_path / "1" / "state").rglob("*") if p.is_dir()]
    assert len(own) > 25
    assert {str(p): counts[_inode(p)] for p in own} == {str(p): 1 for p in own}
    assert counts[_inode(tmp_path / "1" / "state")] == 2
    assert [str(p) for p in entries if counts[_inode(p)] == 0] == []  # the rest, at least once
    orbax_own = tmp_path / "1" / "_CHECKPOINT_METADATA"
    assert counts[_inode(orbax_own)] == 1


def test_a_file_changed_after_its_fsync_is_fsynced_again(tmp_path, monkeypatch):
    """`Synced` holds a file by identity: written into after its fsync, it is fsynced again."""
    kept, changed, other = (tmp_path / name for name in ("kept", "changed", "other"))
    for path in (kept, changed, other):
        path.write_bytes(b"x" * 4096)
    synced = durable.Synced()
    durable.fsync_path(kept, synced)
    durable.fsync_path(changed, synced)
    with open(changed, "ab") as handle:
        handle.write(b"y")
    counts = _count_fsyncs(monkeypatch)
    durable.fsync_tree(tmp_path, synced)
    monkeypatch.undo()
    assert counts[_inode(kept)] == 0
    assert counts[_inode(changed)] == 1
    assert counts[_inode(other)] == 1
    assert counts[_inode(tmp_path)] == 1


def test_a_forked_child_writes_and_fsyncs_with_threads_of_its_own(tmp_path):
    """The writer's and the fsync pools live as long as the process; a forked child has none of
    their threads, so it makes pools of its own (`os.register_at_fork`) instead of queueing work
    that no thread would run. `alarm` only ends a child that hangs."""
    paths = [tmp_path / f"file_{i}" for i in range(4)]
    for path in paths:
        path.write_bytes(b"x")
    # The parent's pools with every thread started, now idle: a pool with threads to spare would
    # start one for the child's first task anyway.
    for pool, workers in (
        (durable.shared_pool(), durable._WORKERS),
        (files_writer._writer_pool(16), 16),
    ):
        barrier = threading.Barrier(workers)
        for future in [pool.submit(barrier.wait) for _ in range(workers)]:
            future.result()
    pid = os.fork()
    if pid == 0:  # the child: any outcome but success is a non-zero exit
        try:
            signal.alarm(60)
            durable.fsync_all(paths)
            files_writer._writer_pool(16).submit(int).result()
            os._exit(0)
        except BaseException:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
