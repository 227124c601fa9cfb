"""Checkpoint keys do not depend on Keras's global name counters; duplicates are refused."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import keras_orbax
from keras_orbax._keys import keyed_variables
from keras_orbax.errors import DuplicateKeyError
from tests import _models


def _sequential() -> keras.Model:
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dropout(0.5), keras.layers.Dense(2)]
    )
    model.compile(optimizer="adam", loss="mse")
    model.fit(np.ones((4, 4)), np.ones((4, 2)), verbose=0)
    return model


def test_the_same_model_built_twice_has_the_same_keys(tmp_path):
    first, second = _sequential(), _sequential()
    assert (
        first.layers[0].kernel.path != second.layers[0].kernel.path
    )  # sequential/dense vs sequential_1/dense_2
    assert first.optimizer.name != second.optimizer.name  # adam vs adam_1
    assert list(keyed_variables(first)) == list(keyed_variables(second))
    assert list(keyed_variables(first)) == [
        "model/layers/dense/kernel",
        "model/layers/dense/bias",
        "model/layers/dropout/seed_generator/state",
        "model/layers/dense_1/kernel",
        "model/layers/dense_1/bias",
        "optimizer/iteration",
        "optimizer/learning_rate",
        "optimizer/model/layers/dense/kernel/momentum",
        "optimizer/model/layers/dense/kernel/velocity",
        "optimizer/model/layers/dense/bias/momentum",
        "optimizer/model/layers/dense/bias/velocity",
        "optimizer/model/layers/dense_1/kernel/momentum",
        "optimizer/model/layers/dense_1/kernel/velocity",
        "optimizer/model/layers/dense_1/bias/momentum",
        "optimizer/model/layers/dense_1/bias/velocity",
        "metrics/loss/total",
        "metrics/loss/count",
    ]

    keras_orbax.save(first, tmp_path, step=1)
    result = keras_orbax.restore_sharded(second, tmp_path)
    assert len(result.restored) == 17 and not result.skipped
    for want, got in zip(
        first.variables + first.optimizer.variables,
        second.variables + second.optimizer.variables,
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(got.value), np.asarray(want.value))


class TwoWeights(keras.layers.Layer):
    def build(self, input_shape):
        self.a = self.add_weight(shape=(2,), name="w")
        self.b = self.add_weight(shape=(2,), name="w")

    def call(self, x):
        return x * self.a * self.b


def test_duplicate_variable_paths_are_refused(tmp_path):
    model = keras.Sequential([keras.Input((2,)), TwoWeights(name="twice")], name="dup")
    assert model.layers[0].a.path == model.layers[0].b.path == "dup/twice/w"
    with pytest.raises(
        DuplicateKeyError, match=r"'model/layers/two_weights/w': 'dup/twice/w' and 'dup/twice/w'"
    ):
        keras_orbax.save(model, tmp_path, step=1)
    assert not list(tmp_path.iterdir())


class _Twins(keras.Model):
    """Two sub-layers with the same explicit name: the same `variable.path`, different attributes."""

    def __init__(self):
        super().__init__(name="twins")
        self.left = keras.layers.Dense(4, name="same")
        self.right = keras.layers.Dense(4, name="same")

    def call(self, x):
        return self.left(x) + self.right(x)


def test_sub_layers_with_the_same_name_are_told_apart_by_attribute(tmp_path, distribution):
    distribution(_models.model_parallel((2, 4)))
    source = _Twins()
    source(np.ones((2, 8)))
    assert source.left.kernel.path == source.right.kernel.path
    keras_orbax.save(source, tmp_path, step=1)

    target = _Twins()
    target(np.ones((2, 8)))
    keras_orbax.restore_sharded(target, tmp_path)
    np.testing.assert_array_equal(
        np.asarray(target.left.kernel.value), np.asarray(source.left.kernel.value)
    )
    np.testing.assert_array_equal(
        np.asarray(target.right.kernel.value), np.asarray(source.right.kernel.value)
    )
    assert not np.array_equal(
        np.asarray(target.left.kernel.value), np.asarray(target.right.kernel.value)
    )
