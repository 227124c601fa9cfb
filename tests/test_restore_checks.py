"""Every restore checks what it reads against the checksums recorded with it, by default: a changed
byte in a shard file is a `CorruptCheckpointError` naming the file and the array, and the model
is left as it was; a source that records no checksums is read as it is, without a word by default
and without claiming to have been verified."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import keras_orbax
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


def _embedding(distribution, axes: tuple):
    """A (2048, 256) float32 embedding (2 MiB) built under a layout splitting it on `axes`."""
    import keras

    mesh = keras.distribution.DeviceMesh((8,), ("model",))
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*embeddings"] = axes
    distribution(keras.distribution.ModelParallel(layout_map=layout_map))
    tokens = keras.Input((4,), dtype="int32")
    return keras.Model(tokens, keras.layers.Embedding(2048, 256, name="embed")(tokens))


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
