"""Layouts that cut the saved rows: the regions of an array are read together (`coalesce`), in a
few large reads scattered with numpy; values exact, every byte read once, never a byte no region needs.
"""

from __future__ import annotations

import os

import jax
import keras
import ml_dtypes
import numpy as np
import pytest

import keras_orbax
from keras_orbax._src.read import coalesce
from keras_orbax._src.read.contiguous import ContiguousArray
from keras_orbax._src.storage.byte_runs import bounds

# These tests name the files of single shards (`c/1/2`) or cut the saved shards.
pytestmark = pytest.mark.usefixtures("one_file_per_shard")

DTYPES = ["float32", "bfloat16", "float16", "int8", "int32"]


class _Table(keras.layers.Layer):
    def __init__(self, shape: tuple[int, ...], table_dtype: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.table_shape, self.table_dtype = shape, table_dtype

    def build(self, input_shape):
        self.table = self.add_weight(
            shape=self.table_shape,
            name="table",
            dtype=self.table_dtype,
            initializer="zeros",
            trainable=False,
        )

    def call(self, x):
        return x


def _model(shape: tuple[int, ...], dtype: str) -> keras.Model:
    return keras.Sequential([keras.Input((3,)), _Table(shape, dtype, name="t")], name="m")


def _split(mesh_shape: tuple[int, ...], axes: tuple) -> keras.distribution.Distribution:
    names = ("model",) if len(mesh_shape) == 1 else ("batch", "model")
    mesh = keras.distribution.DeviceMesh(mesh_shape, names, jax.devices())
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*table"] = axes
    return keras.distribution.ModelParallel(layout_map=layout_map)


def _values(shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """Random values (no two shards alike, no NaN), exactly representable in `dtype`."""
    rng = np.random.default_rng(7)
    if np.dtype(dtype).kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, shape, endpoint=True).astype(dtype)
    return rng.standard_normal(shape).astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)


class _Reads:
    """Every `preadv` of the test: (bytes, file offset, file name) of each."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[int, int, str]] = []
        real = os.preadv

        def preadv(fd, buffers, offset, *args):
            n = real(fd, buffers, offset, *args)
            self.calls.append((n, offset, os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))))
            return n

        monkeypatch.setattr(os, "preadv", preadv)

    def data(self, chunk_bytes: int) -> list[int]:
        """Sizes of the reads of array data (not of a shard file's index, stored past its data, nor
        of the array's `zarr.json`)."""
        return [n for n, offset, name in self.calls if offset < chunk_bytes and name != "zarr.json"]


@pytest.fixture
def small_pieces(monkeypatch):
    """Pieces of 3 rows of 48 elements (the bands here are 8 rows: 3 + 3 + 2), jobs of 2 pieces."""

    def set_sizes(itemsize: int) -> None:
        monkeypatch.setattr(coalesce, "_PIECE_BYTES", 3 * 48 * itemsize + 1)
        monkeypatch.setattr(coalesce, "_JOB_BYTES", 2 * 3 * 48 * itemsize)

    return set_sizes


@pytest.mark.parametrize("dtype", DTYPES)
def test_saved_on_rows_restored_on_columns(
    tmp_path, distribution, monkeypatch, small_pieces, dtype
):
    shape = (64, 48)  # saved shards (8, 48); target regions (64, 6): 8 short runs in every shard
    distribution(_split((8,), ("model", None)))
    source = _model(shape, dtype)
    want = _values(shape, dtype)
    source.layers[0].table.assign(want)
    keras_orbax.save(source, tmp_path, step=1)

    distribution(_split((8,), (None, "model")))
    with keras_orbax.deferred_init():
        target = _model(shape, dtype)
    itemsize = np.dtype(want.dtype).itemsize
    small_pieces(itemsize)
    reads = _Reads(monkeypatch)
    result = keras_orbax.restore_sharded(target, tmp_path)

    table = target.layers[0].table.value
    assert table.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(table), want)
    assert all(shard.data.shape == (64, 6) for shard in table.addressable_shards)
    assert result.bytes_read == want.nbytes
    data = reads.data(8 * 48 * itemsize)
    assert sum(data) == want.nbytes  # each byte once: the 8 regions tile every row
    assert len(data) == 8 * 3  # 3 pieces of rows per saved shard, not 8 x 8 runs of each


@pytest.mark.parametrize(
    ("saved", "restored"),
    [
        (((2, 4), ("model", "batch")), ((2, 4), ("batch", "model"))),
        (((2, 4), ("model", "batch")), ((4, 2), ("model", "batch"))),
        (((2, 4), ("model", "batch")), ((1, 8), (None, "model"))),
        (((8, 1), ("batch", None)), ((2, 4), ("model", "batch"))),
    ],
    ids=["2x4-swapped", "onto-4x2", "onto-columns", "rows-onto-2x4"],
)
@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_two_dimensional_meshes(
    tmp_path, distribution, monkeypatch, small_pieces, saved, restored, dtype
):
    shape = (48, 64)
    distribution(_split(*saved))
    source = _model(shape, dtype)
    want = _values(shape, dtype)
    source.layers[0].table.assign(want)
    keras_orbax.save(source, tmp_path, step=1)

    distribution(_split(*restored))
    with keras_orbax.deferred_init():
        target = _model(shape, dtype)
    small_pieces(want.dtype.itemsize)
    reads = _Reads(monkeypatch)
    result = keras_orbax.restore_sharded(target, tmp_path)

    table = target.layers[0].table.value
    np.testing.assert_array_equal(np.asarray(table), want)
    for shard in table.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index])
    assert result.bytes_read == want.nbytes
    assert sum(reads.data(want.nbytes // 8)) == want.nbytes  # each saved shard holds 1/8


def test_three_dimensional(tmp_path, distribution, monkeypatch):
    shape = (8, 8, 16)  # saved shards (1, 8, 16); target regions (8, 8, 2): 2-element runs
    distribution(_split((8, 1), ("batch", None, None)))
    source = _model(shape, "float32")
    want = _values(shape, "float32")
    source.layers[0].table.assign(want)
    keras_orbax.save(source, tmp_path, step=1)

    distribution(_split((1, 8), (None, None, "model")))
    with keras_orbax.deferred_init():
        target = _model(shape, "float32")
    reads = _Reads(monkeypatch)
    keras_orbax.restore_sharded(target, tmp_path)
    np.testing.assert_array_equal(np.asarray(target.layers[0].table.value), want)
    assert reads.data(want.nbytes // 8) == [want.nbytes // 8] * 8  # one read per saved shard


def _stored(tmp_path, shape: tuple[int, ...], dtype: str) -> tuple[ContiguousArray, np.ndarray]:
    """An array stored contiguous at byte 100 of a file, as Keras stores an h5 dataset."""
    want = _values(shape, dtype)
    path = tmp_path / "raw.bin"
    path.write_bytes(b"x" * 100 + want.tobytes() + b"y" * 7)
    return ContiguousArray("raw", path, 100, shape, want.dtype), want


def _read_together(array: ContiguousArray, indices: list) -> list[np.ndarray] | None:
    together = coalesce.plan(array.blocks, array.shape, array.dtype, indices)
    if together is None:
        return None
    for job in together.jobs():
        job()
    return together.regions(array.dtype)


COLUMNS = [(slice(None), slice(8 * i, 8 * i + 8)) for i in range(8)]


@pytest.mark.parametrize(
    ("regions", "reads_per_row"),
    [
        (range(8), 0),  # whole rows: pieces of rows, not a read per row
        (range(2, 6), 1),  # a narrower box (a process with 4 of the 8 devices): one read a row
    ],
)
def test_only_the_bytes_some_region_needs(
    tmp_path, monkeypatch, small_pieces, regions, reads_per_row
):
    array, want = _stored(tmp_path, (40, 64), "float32")
    small_pieces(4)
    indices = [COLUMNS[i] for i in regions]
    reads = _Reads(monkeypatch)
    got = _read_together(array, indices)

    assert got is not None
    for index, region in zip(indices, got, strict=True):
        np.testing.assert_array_equal(region, want[index])
    needed = sum(want[index].nbytes for index in indices)
    assert sum(n for n, _, _ in reads.calls) == needed  # exactly: no byte of the other columns
    if reads_per_row:
        assert len(reads.calls) == 40  # one per row of the 4 regions, not 4 per row
    else:
        assert len(reads.calls) < 40


def test_rows_that_no_region_needs_are_skipped(tmp_path, monkeypatch, small_pieces):
    array, want = _stored(tmp_path, (40, 64), "float32")
    small_pieces(4)
    halves = [slice(0, 32), slice(32, 64)]
    indices = [(rows, half) for rows in (slice(0, 8), slice(24, 40)) for half in halves]
    reads = _Reads(monkeypatch)
    got = _read_together(array, indices)
    assert got is not None
    for index, region in zip(indices, got, strict=True):
        np.testing.assert_array_equal(region, want[index])
    assert sum(n for n, _, _ in reads.calls) == sum(want[index].nbytes for index in indices)


def test_regions_that_tile_no_box_are_read_alone(tmp_path, monkeypatch):
    array, want = _stored(tmp_path, (40, 64), "float32")
    indices = [COLUMNS[0], COLUMNS[2], COLUMNS[5]]  # gaps between them: reading across would waste
    assert coalesce.plan(array.blocks, array.shape, array.dtype, indices) is None
    region = array.read(COLUMNS[2], array.dtype)
    np.testing.assert_array_equal(region, want[COLUMNS[2]])


# Keras's own save_weights of a bfloat16 variable (np.array on a jax array) warns; not ours.
@pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")
def test_the_keras_weights_file_path(tmp_path, distribution, monkeypatch):
    shape = (256, 96)
    source = _model(shape, "bfloat16")
    want = _values(shape, "bfloat16")
    source.layers[0].table.assign(want)
    path = tmp_path / "m.weights.h5"
    source.save_weights(path)
    expected = _model(shape, "bfloat16")
    expected.load_weights(path)  # Keras's own loader is the oracle

    distribution(_split((2, 4), ("batch", "model")))  # regions (128, 24): each cuts the rows
    with keras_orbax.deferred_init():
        target = _model(shape, "bfloat16")
    reads = _Reads(monkeypatch)
    result = keras_orbax.restore_sharded(target, path)
    table = target.layers[0].table.value
    np.testing.assert_array_equal(np.asarray(table), np.asarray(expected.layers[0].table.value))
    assert result.bytes_read == want.nbytes
    assert sum(n for n, _, _ in reads.calls) == want.nbytes
    assert len(reads.calls) < 16  # a few pieces of rows, not a read per row of each region


def test_bounds_of_a_full_index():
    assert bounds((slice(None), slice(2, 5)), (4, 8)) == [(0, 4), (2, 5)]
