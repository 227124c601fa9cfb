"""Regions are read ahead of being placed by at most the read window's bytes."""

from __future__ import annotations

import threading

import jax
import numpy as np

from keras_orbax import _read, _read_ahead


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
    request = _read.ReadRequest(record=None, target=target)  # type: ignore[arg-type]
    tasks = [(request, reader, (slice(i, i + 1), slice(None))) for i in range(16)]
    units = [_read_ahead.Unit([task]) for task in tasks]
    for _ in _read_ahead.read_ahead(units, workers=8, window=3 << 20):
        with reader.lock:
            reader.consumed += 1
    # With a 3 MiB window, region i is read only once regions up to i - 3 have been handed on.
    assert all(reader.seen[i] >= i - 3 for i in range(16)), reader.seen
    assert sorted(reader.seen) == list(range(16))


def test_a_region_larger_than_the_window_still_goes():
    reader = _CountingReader()
    target = jax.ShapeDtypeStruct((2, 1 << 18), np.float32)
    request = _read.ReadRequest(record=None, target=target)  # type: ignore[arg-type]
    tasks = [(request, reader, (slice(i, i + 1), slice(None))) for i in range(2)]
    got = 0
    for _ in _read_ahead.read_ahead(
        [_read_ahead.Unit([task]) for task in tasks], workers=4, window=1 << 10
    ):
        got += 1
        with reader.lock:
            reader.consumed += 1
    assert got == 2 and reader.seen == {0: 0, 1: 1}  # one at a time, but each one goes
