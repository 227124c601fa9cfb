"""Dtype changes on restore: cast shard by shard; mixed precision round-trips."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import keras_orbax
from keras_orbax.errors import CheckpointMismatchError
from tests import _models


@pytest.mark.parametrize(("saved", "restored"), [("float32", "bfloat16"), ("bfloat16", "float32")])
def test_float_dtypes_cast_on_restore(tmp_path, distribution, saved, restored):
    distribution(_models.model_parallel((2, 4)))
    source = _models.mlp(dtype=saved)
    _models.fill_arange(source, limit=256)  # integers below 256 are exact in bfloat16
    keras_orbax.save(source, tmp_path, step=1)

    distribution(_models.model_parallel((4, 2)))
    target = _models.mlp(dtype=restored)
    keras_orbax.restore_sharded(target, tmp_path)
    for want, got in zip(source.variables, target.variables, strict=True):
        assert str(got.value.dtype) == restored
        np.testing.assert_array_equal(
            np.asarray(got.value).astype("float32"), np.asarray(want.value).astype("float32")
        )


def test_mixed_precision_round_trips(tmp_path, distribution):
    distribution(_models.model_parallel((2, 4)))
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        source = _models.compile_adam(_models.full_model())
        x, y = _models.training_data()
        source.fit(x, y, batch_size=8, epochs=1, verbose=0)
        keras_orbax.save(source, tmp_path, step=4)
        target = _models.compile_adam(_models.full_model())
        keras_orbax.restore_sharded(target, tmp_path)
    finally:
        keras.config.set_dtype_policy("float32")
    kernel = target.layers[3].kernel
    assert kernel.value.dtype == np.float32  # variables stay float32 under mixed_bfloat16
    for want, got in zip(source.variables, target.variables, strict=True):
        np.testing.assert_array_equal(np.asarray(got.value), np.asarray(want.value))


def test_integer_to_float_is_refused(tmp_path, distribution):
    distribution(_models.model_parallel((2, 4)))

    def model(dtype: str) -> keras.Model:
        embedding = keras.layers.Embedding(
            16, 8, embeddings_initializer="zeros", dtype=dtype, name="embedding"
        )
        return keras.Sequential([keras.Input((4,), dtype="int32"), embedding], name="seq")

    keras_orbax.save(model("float32"), tmp_path, step=1)
    target = model("int32")
    before = np.asarray(target.layers[0].embeddings.value)
    message = (
        r"layers/embedding/vars/0: checkpoint seq/embedding/embeddings \(16, 8\) float32, "
        r"model seq/embedding/embeddings \(16, 8\) int32"
    )
    with pytest.raises(CheckpointMismatchError, match=message):
        keras_orbax.restore_sharded(target, tmp_path)
    np.testing.assert_array_equal(np.asarray(target.layers[0].embeddings.value), before)


class Unusual(keras.layers.Layer):
    """A zero-size weight and an int64 counter (int32 in JAX unless jax_enable_x64 is on)."""

    def build(self, input_shape):
        self.empty = self.add_weight(shape=(0, 8), name="empty")
        self.counter = self.add_weight(
            shape=(8,), name="counter", dtype="int64", initializer="zeros", trainable=False
        )

    def call(self, x):
        return x


def test_zero_size_and_int64_variables_round_trip(tmp_path, distribution):
    distribution(_models.model_parallel((2, 4)))

    def model() -> keras.Model:
        return keras.Sequential([keras.Input((8,)), Unusual(name="unusual")], name="unusual")

    source = model()
    source.layers[0].counter.assign(np.arange(8))
    keras_orbax.save(source, tmp_path, step=1)
    record = keras_orbax.inspect(tmp_path).record.variables
    assert record["layers/unusual/vars/0"].shape == (0, 8)
    assert record["layers/unusual/vars/1"].dtype == "int32"  # as JAX holds it without x64
    with keras_orbax.deferred_init():
        target = model()
    result = keras_orbax.restore_sharded(target, tmp_path)
    assert result.restored == ("layers/unusual/vars/0", "layers/unusual/vars/1")
    assert target.layers[0].empty.value.shape == (0, 8)
    np.testing.assert_array_equal(np.asarray(target.layers[0].counter.value), np.arange(8))
