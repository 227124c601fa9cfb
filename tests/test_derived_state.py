"""State a layer derives from its variables, outside them, recomputed as Keras's loader does.

An adapted `Normalization` normalizes with a broadcast copy of its mean and variance, which its
`load_own_variables` recomputes (`finalize_state`) once Keras has assigned the variables. The
oracle is Keras: a restore from each kind of source predicts what the model that was saved
predicts, and what `load_weights` of Keras's own file gives.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import keras_orbax
from keras_orbax.errors import CheckpointMismatchError
from tests import _models

X = np.random.default_rng(1).random((8, 3)).astype("float32") * 5


def normalized(adapt: bool, width: int = 8) -> keras.Model:
    inputs = keras.Input((3,))
    norm = keras.layers.Normalization(name="norm")
    if adapt:
        norm.adapt(np.random.default_rng(0).random((50, 3)).astype("float32") * 5 + 2)
    outputs = keras.layers.Dense(width, kernel_initializer="ones", name="head")(norm(inputs))
    return keras.Model(inputs, outputs)


@pytest.fixture
def saved(tmp_path, distribution):
    distribution(_models.data_parallel())
    model = normalized(adapt=True)
    keras_orbax.save(model, tmp_path / "ckpt", step=1)
    model.save_weights(tmp_path / "m.weights.h5")
    keras_model = normalized(adapt=False)
    keras_model.load_weights(tmp_path / "m.weights.h5")
    expected = model.predict(X, verbose=0)
    np.testing.assert_array_equal(keras_model.predict(X, verbose=0), expected)
    assert not np.allclose(normalized(adapt=False).predict(X, verbose=0), expected)  # it matters
    return tmp_path, expected


@pytest.mark.parametrize("source", ["ckpt", "m.weights.h5"])
@pytest.mark.parametrize("deferred", [False, True], ids=["built", "deferred"])
def test_an_adapted_normalization_predicts_as_saved(saved, source, deferred):
    root, expected = saved
    if deferred:
        with keras_orbax.deferred_init():
            model = normalized(adapt=False)
    else:
        model = normalized(adapt=False)
    keras_orbax.restore_sharded(model, root / source)
    np.testing.assert_array_equal(model.predict(X, verbose=0), expected)


def test_load_model_predicts_as_saved(saved):
    root, expected = saved
    model = keras_orbax.load_model(root / "ckpt")
    np.testing.assert_array_equal(model.predict(X, verbose=0), expected)


def test_a_refused_weights_file_leaves_the_layer_usable(saved):
    """Keras's walk over a `.weights.h5` runs traced; a restore it refuses leaves no traced value
    in the layer: called again (eagerly: `predict` would reuse what it compiled before), the model
    gives what it gave before."""
    root, _ = saved
    model = normalized(adapt=False, width=4)
    before = np.asarray(model(X))
    with pytest.raises(CheckpointMismatchError):
        keras_orbax.restore_sharded(model, root / "m.weights.h5")
    np.testing.assert_array_equal(np.asarray(model(X)), before)
