"""Every restore checks what it reads against the checksums recorded with it, by default: a changed
byte in a shard file is a `CorruptCheckpointError` naming the file and the array, and the model
is left as it was; a source that records no checksums is read as it is, without a word by default
and without claiming to have been verified."""

from __future__ import annotations

import dataclasses
import os
import re
import warnings

import numpy as np
import pytest

import keras_orbax
from keras_orbax._src.format import checksum, crc, read_checks
from keras_orbax._src.format.zarr_shards import FastArray
from keras_orbax.errors import CorruptCheckpointError, KerasOrbaxWarning
from tests import _models

KERNEL = "layers/dense/vars/0"  # the "hidden" layer's kernel (16, 32) float32: 2 KiB, one file


def _flip(path, at: int = 7) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.fixture
def saved(tmp_path, distribution):
    distribution(_models.model_parallel((2, 4)))
    model = _models.compile_adam(_models.mlp())
    model.optimizer.build(model.trainable_variables)
    _models.fill_arange(model)
    keras_orbax.save(model, tmp_path, step=1)
    return tmp_path


def test_a_small_array_read_whole_is_checked_by_default(saved, distribution):
    """Small arrays are one file each, read whole with many others and cut into regions: the
    file's bytes as read are checked."""
    _flip(saved / "1/state" / KERNEL.replace("/", ".") / "c.0.0")
    distribution(_models.model_parallel((2, 4)))
    model = _models.compile_adam(_models.mlp())
    before = _models.values(model.weights)
    with pytest.raises(CorruptCheckpointError, match=rf"{KERNEL}: .*c\.0\.0: checksum 0x"):
        keras_orbax.restore_sharded(model, saved)
    for variable, want in zip(model.weights, before, strict=True):
        np.testing.assert_array_equal(np.asarray(variable.value), want)


def test_load_model_checks_by_default_and_verify_false_reads_as_it_is(saved, distribution):
    _flip(saved / "1/state" / KERNEL.replace("/", ".") / "c.0.0")
    distribution(_models.model_parallel((2, 4)))
    with pytest.raises(CorruptCheckpointError, match=rf"{KERNEL}: .*c\.0\.0: checksum"):
        keras_orbax.load_model(saved)
    model = keras_orbax.load_model(saved, verify=False)
    assert model.get_layer("hidden").kernel.shape == (16, 32)


def test_an_intact_step_restores_with_every_array_checked(saved, distribution):
    distribution(_models.model_parallel((4, 2)))  # another layout: some files checked up front
    result = keras_orbax.restore_sharded(_models.compile_adam(_models.mlp()), saved)
    assert result.restored and result.unverified == ()


def test_a_source_without_checksums_is_read_quietly_and_not_called_verified(tmp_path):
    """A `.weights.h5` records no checksum: by default it restores without a warning (one on
    every Keras file would be noise), and the result lists every array as unverified."""
    model = _models.mlp()
    _models.fill_arange(model)
    path = tmp_path / "m.weights.h5"
    model.save_weights(path)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*verif", category=KerasOrbaxWarning)
        warnings.filterwarnings("ignore", message="No keras.distribution", category=UserWarning)
        result = keras_orbax.restore_sharded(_models.mlp(), path)
    assert set(result.unverified) == set(result.restored) and result.restored
    with pytest.warns(KerasOrbaxWarning, match="nothing was verified"):
        keras_orbax.restore_sharded(_models.mlp(), path, verify=True)


def _read_bytes() -> int:
    """Bytes this process has read through system calls so far (page cache included)."""
    with open("/proc/self/io") as io:
        return int(next(line for line in io if line.startswith("rchar:")).split()[1])


def _embedding(distribution, axes: tuple, rows: int = 2048):
    """A (rows, 256) float32 embedding (2 MiB by default) built under a layout splitting it on
    `axes`."""
    import keras

    mesh = keras.distribution.DeviceMesh((8,), ("model",))
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*embeddings"] = axes
    distribution(keras.distribution.ModelParallel(layout_map=layout_map))
    tokens = keras.Input((4,), dtype="int32")
    return keras.Model(tokens, keras.layers.Embedding(rows, 256, name="embed")(tokens))


@pytest.mark.parametrize("saved_axes", [("model", None), (None, "model")], ids=["rows", "cols"])
def test_another_layout_is_checked_from_the_bytes_it_reads_once(tmp_path, distribution, saved_axes):
    """Restored onto another layout, each region cuts the saved shard files: the pieces read are
    checksummed as they come and joined, so every file is checked without reading it twice; a
    changed byte is still named."""
    model = _embedding(distribution, saved_axes)
    values = np.random.default_rng(0).random((2048, 256)).astype("float32")  # 2 MiB
    model.weights[0].assign(values)
    keras_orbax.save(model, tmp_path, step=1)
    other = (None, "model") if saved_axes == ("model", None) else ("model", None)
    restored = _embedding(distribution, other)
    before = _read_bytes()
    result = keras_orbax.restore_sharded(restored, tmp_path)
    assert not restored.weights[0].value.sharding.is_equivalent_to(
        model.weights[0].value.sharding, 2
    )
    assert _read_bytes() - before < 1.25 * values.nbytes  # read once, not once more to check
    assert result.unverified == ()
    np.testing.assert_array_equal(np.asarray(restored.weights[0].value), values)

    key = result.restored[0]
    files = sorted((tmp_path / "1/state" / key.replace("/", ".") / "c").rglob("*"))
    _flip([p for p in files if p.is_file()][3], at=1000)
    fresh = _embedding(distribution, other)
    with pytest.raises(CorruptCheckpointError, match=rf"{key}: .*checksum 0x"):
        keras_orbax.restore_sharded(fresh, tmp_path)
    assert not np.array_equal(np.asarray(fresh.weights[0].value), values)  # left as it was


def test_convert_checks_the_step_it_reads(saved):
    """`convert` reads a step as a restore does: a changed byte is named and nothing is written."""
    _flip(saved / "1/state" / KERNEL.replace("/", ".") / "c.0.0")
    with pytest.raises(CorruptCheckpointError, match=rf"{KERNEL}: .*c\.0\.0: checksum"):
        keras_orbax.convert(saved, saved.parent / "converted", step=1)
    assert not (saved.parent / "converted" / "1").exists()


PIECE = 1 << 20
SHARD_ROWS = 3584  # x 256 float32: 3.5 MiB a shard file, read in 4 pieces, the last one half


@pytest.fixture
def large_shards(tmp_path, distribution):
    """A (8 x SHARD_ROWS, 256) float32 embedding saved split on its rows: 8 files of 3.5 MiB."""
    model = _embedding(distribution, ("model", None), rows=8 * SHARD_ROWS)
    values = np.random.default_rng(1).random((8 * SHARD_ROWS, 256)).astype("float32")
    model.weights[0].assign(values)
    keras_orbax.save(model, tmp_path, step=1)
    (array,) = [p.parent for p in (tmp_path / "1/state").glob("*/zarr.json")]
    return values, array


def test_a_shard_read_whole_is_checksummed_piece_by_piece_as_it_is_read(large_shards):
    """A region that is one saved shard is checksummed 1 MiB at a time, each piece right after it
    is read (still in the cache), the short last piece too, then the index: not in a second pass
    over the whole buffer."""
    values, array = large_shards
    state = array.parent
    sizes: list[int] = []

    def counting(algorithm: crc.Crc) -> crc.Crc:
        def update(value: int, data) -> int:
            sizes.append(memoryview(data).nbytes)
            return algorithm.update(value, data)

        return dataclasses.replace(algorithm, update=update)

    recorded = {n: (counting(a), v) for n, (a, v) in checksum.recorded_checksums(state).items()}
    fast = FastArray("embed", array, values.shape, (SHARD_ROWS, 256), np.dtype("float32"))
    checks = read_checks.ReadChecks(recorded)
    region = fast.checked_by(checks).read(
        (slice(SHARD_ROWS, 2 * SHARD_ROWS), slice(None)), np.dtype("float32")
    )
    np.testing.assert_array_equal(region, values[SHARD_ROWS : 2 * SHARD_ROWS])
    assert sizes == [PIECE, PIECE, PIECE, PIECE // 2, checksum.INDEX_BYTES]
    checks.finish()  # checked whole: nothing left to read back


@pytest.mark.parametrize(
    "at",
    [PIECE - 1, PIECE, 2 * PIECE + 4096, 3 * PIECE + PIECE // 2 - 8],
    ids=["end_of_piece_0", "start_of_piece_1", "piece_2", "partial_last_piece"],
)
@pytest.mark.parametrize("axes", [("model", None), (None, "model")], ids=["saved", "resharded"])
def test_a_changed_byte_in_any_piece_of_a_shard_is_caught_naming_the_file(
    large_shards, distribution, at, axes
):
    """Read whole (the saved layout: 1 MiB pieces checksummed as read) or cut by every region
    (resharded: pieces noted and joined), a flipped byte anywhere is named, nothing assigned."""
    _, array = large_shards
    damaged = array / "c/5/0"
    _flip(damaged, at=at)
    fresh = _embedding(distribution, axes, rows=8 * SHARD_ROWS)
    before = np.asarray(fresh.weights[0].value)
    with pytest.raises(CorruptCheckpointError, match=re.escape(str(damaged)) + ": checksum 0x"):
        keras_orbax.restore_sharded(fresh, array.parent.parent.parent)
    np.testing.assert_array_equal(np.asarray(fresh.weights[0].value), before)


def test_read_in_pieces_gives_the_crc_of_every_byte_and_stops_at_the_end(tmp_path):
    data = np.random.default_rng(2).integers(0, 256, 2 * PIECE + 12345, dtype=np.uint8)
    path = tmp_path / "data"
    path.write_bytes(data.tobytes())
    algorithm = crc.CRC32C or crc.CRC32
    out = bytearray(len(data) + 100)  # longer than the file: a short read says how much it got
    fd = os.open(path, os.O_RDONLY)
    try:
        got, value = read_checks.read_in_pieces(fd, memoryview(out), 0, algorithm)
    finally:
        os.close(fd)
    assert got == len(data)
    assert value == algorithm.of(data.tobytes())
    assert bytes(out[:got]) == data.tobytes()
