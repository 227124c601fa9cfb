"""Regions are read ahead of being placed by at most the read window's bytes, and those cut into
short runs (scattered by numpy) by one thread per core."""

from __future__ import annotations

import os
import signal
import threading
import time
import warnings

import jax
import keras
import numpy as np
import pytest

import keras_orbax
from keras_orbax._src.format.zarr_shards import FastArray
from keras_orbax._src.read import coalesce, read_ahead, sharded_read
from keras_orbax._src.runtime import thread_pools
from tests import _models


class _CountingReader:
    """A real reader of zeros that notes how many regions the consumer had taken when each read ran."""

    def __init__(self) -> None:
        self.consumed = 0
        self.seen: dict[int, int] = {}
        self.lock = threading.Lock()

    def read(self, index, dtype):
        with self.lock:
            self.seen[index[0].start] = self.consumed
        return np.zeros((1, 1 << 18), dtype)  # 1 MiB of float32


def test_read_ahead_stays_within_the_window():
    reader = _CountingReader()
    target = jax.ShapeDtypeStruct((16, 1 << 18), np.float32)
    request = sharded_read.ReadRequest(record=None, target=target)  # type: ignore[arg-type]
    tasks = [(request, reader, (slice(i, i + 1), slice(None))) for i in range(16)]
    units = [read_ahead.Unit([task]) for task in tasks]
    for _ in read_ahead.read_ahead(units, workers=8, window=3 << 20):
        with reader.lock:
            reader.consumed += 1
    # With a 3 MiB window, region i is read only once regions up to i - 3 have been handed on.
    assert all(reader.seen[i] >= i - 3 for i in range(16)), reader.seen
    assert sorted(reader.seen) == list(range(16))


def test_large_regions_are_read_while_the_wave_before_is_handed_on():
    """The disk never waits for placing: while the consumer holds the last region of a wave of
    large regions, the next wave's reads run; and still at most the window is read ahead."""
    started = threading.Condition()
    seen: dict[int, int] = {}
    consumed = 0

    class Reader:
        def read(self, index, dtype):
            with started:
                seen[index[0].start] = consumed
                started.notify_all()
            return np.zeros((1, 1 << 19), dtype)  # 2 MiB of float32: a large region

    target = jax.ShapeDtypeStruct((12, 1 << 19), np.float32)
    request = sharded_read.ReadRequest(record=None, target=target)  # type: ignore[arg-type]
    reader = Reader()
    units = [
        read_ahead.Unit([(request, reader, (slice(i, i + 1), slice(None)))]) for i in range(12)
    ]
    assert not any(unit.is_small for unit in units)
    for i, _ in enumerate(read_ahead.read_ahead(units, workers=8, window=8 << 20)):
        if i < 10:  # the reads of the regions after this one's wave start before it is handed on
            with started:
                assert started.wait_for(lambda i=i: len(seen) > i + 1, timeout=60), (i, seen)
        with started:
            consumed += 1
    # 8 MiB: four regions read and not yet handed on at most.
    assert sorted(seen) == list(range(12)) and all(seen[i] >= i - 3 for i in seen), seen


def test_a_region_larger_than_the_window_still_goes():
    reader = _CountingReader()
    target = jax.ShapeDtypeStruct((2, 1 << 18), np.float32)
    request = sharded_read.ReadRequest(record=None, target=target)  # type: ignore[arg-type]
    tasks = [(request, reader, (slice(i, i + 1), slice(None))) for i in range(2)]
    got = 0
    for _ in read_ahead.read_ahead(
        [read_ahead.Unit([task]) for task in tasks], workers=4, window=1 << 10
    ):
        got += 1
        with reader.lock:
            reader.consumed += 1
    assert got == 2 and reader.seen == {0: 0, 1: 1}  # one at a time, but each one goes


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="pins a thread to a core: Linux")
@pytest.mark.parametrize(
    ("saved", "restored"),
    [((None, "model"), ("model", None)), (("model", None), (None, "model"))],
    ids=["whole_rows_in_short_runs", "cut_rows"],
)
def test_regions_in_short_runs_are_read_by_one_thread_per_core(
    tmp_path, distribution, monkeypatch, saved, restored
):
    """The reads that scatter with numpy are Python and copies, not waits on storage: more threads
    than cores only pass the GIL around. With this thread pinned to one core, every such read
    of a 16 MiB table (regions of 2 MiB) runs on one thread."""

    def split(axes: tuple) -> keras.distribution.ModelParallel:
        mesh = keras.distribution.DeviceMesh((8,), ("model",), jax.devices())
        layout_map = keras.distribution.LayoutMap(mesh)
        layout_map[".*embeddings"] = axes
        return keras.distribution.ModelParallel(layout_map=layout_map)

    def table() -> keras.Model:
        tokens = keras.Input((2,), dtype="int32")
        return keras.Model(tokens, keras.layers.Embedding(8192, 512, name="e")(tokens))

    distribution(split(saved))
    want = np.random.default_rng(3).standard_normal((8192, 512)).astype("float32")
    source = table()
    source.get_layer("e").embeddings.assign(want)
    keras_orbax.save(source, tmp_path, step=1)

    distribution(split(restored))
    with keras_orbax.deferred_init():
        target = table()
    threads: set[int] = set()
    for owner, name in ((FastArray, "read"), (coalesce.Together, "_run")):
        method = getattr(owner, name)

        def noting(*args, _method=method, **kwargs):
            threads.add(threading.get_ident())
            return _method(*args, **kwargs)

        monkeypatch.setattr(owner, name, noting)
    cores = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(cores)})  # this thread, and the threads it starts
    try:
        keras_orbax.restore_sharded(target, tmp_path)
    finally:
        os.sched_setaffinity(0, cores)
    np.testing.assert_array_equal(np.asarray(target.get_layer("e").embeddings.value), want)
    assert len(threads) == 1, threads  # not spread over the reading pool (4 threads per core)


def test_reading_ahead_stops_when_placing_fails(tmp_path, monkeypatch, distribution):
    """A restore that fails while placing what was read stops its reads at once, not once the
    error (whose traceback holds the reading generator) is freed: none is running when it has
    raised, and none starts after (the pools' threads are kept: work queued before a marker runs
    before it). The failure comes while the next wave's reads run, more than there are threads."""
    distribution(_models.model_parallel((2, 4)))

    def build() -> keras.Model:  # 16 MiB kernels: regions of 2 MiB, read by the pool's threads
        layers = [keras.layers.Dense(2048, name=f"wide_{i}") for i in range(6)]
        return keras.Sequential([keras.Input((2048,)), *layers])

    keras_orbax.save(build(), tmp_path, step=1)
    reads = {"started": 0, "ended": 0}
    lock, failed = threading.Lock(), threading.Event()
    read = FastArray.read

    def counted(*args, **kwargs):
        with lock:
            reads["started"] += 1
        if fails_on_the_second.calls:  # the first array is placed: later reads wait for the error
            failed.wait(timeout=120)
        try:
            return read(*args, **kwargs)
        finally:
            with lock:
                reads["ended"] += 1

    monkeypatch.setattr(FastArray, "read", counted)
    placed = sharded_read._place

    def fails_on_the_second(*args, **kwargs):
        if fails_on_the_second.calls:
            failed.set()
            raise RuntimeError("placing failed")
        fails_on_the_second.calls += 1
        return placed(*args, **kwargs)

    fails_on_the_second.calls = 0
    monkeypatch.setattr(sharded_read, "_place", fails_on_the_second)
    with pytest.raises(RuntimeError, match="placing failed") as caught:
        keras_orbax.restore_sharded(build(), tmp_path, read_window_bytes=64 << 20)
    assert caught.value.__traceback__ is not None  # still held here
    assert reads["started"] == reads["ended"], reads  # none running
    started = reads["started"]
    for pool in _read_pools().values():
        pool.submit(lambda: None).result(timeout=120)
    assert reads["started"] == started < 6 * 8, reads  # none started after; some never did


def _read_all(reader: _CountingReader, n: int) -> int:
    target = jax.ShapeDtypeStruct((n, 1 << 18), np.float32)
    request = sharded_read.ReadRequest(record=None, target=target)  # type: ignore[arg-type]
    units = [read_ahead.Unit([(request, reader, (slice(i, i + 1), slice(None)))]) for i in range(n)]
    return sum(1 for _ in read_ahead.read_ahead(units, workers=4, window=4 << 20))


def _read_pools() -> dict:
    """The process's pools that `read_ahead` reads with (others share the registry)."""
    return {k: v for k, v in thread_pools._pools.items() if k[0] in ("read", "small", "cpu")}


def test_read_threads_are_kept_between_restores_and_a_forked_child_starts_its_own():
    """The reading threads outlive a restore (starting them each time cost a quarter of a 256 MiB
    restore); a child forked after has none of its parent's (their threads are not in it, and a
    pool that thinks it has idle threads would never run a read) and reads with new ones."""
    assert _read_all(_CountingReader(), 8) == 8
    parent_pools = _read_pools()
    assert parent_pools
    assert _read_all(_CountingReader(), 8) == 8
    assert parent_pools == _read_pools()  # the same pools, not new ones
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # fork with JAX's threads: unused here
        pid = os.fork()
    if pid == 0:  # the child: only numpy and the read pools
        code = 3
        try:
            fresh = not thread_pools._pools
            code = 0 if fresh and _read_all(_CountingReader(), 16) == 16 else 1
        finally:
            os._exit(code)
    for _ in range(1200):  # a child stuck on its parent's pools would never end: not a timing
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.1)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child's read never ran")
    assert os.waitstatus_to_exitcode(status) == 0
