"""State a layer keeps beside its variables, as a device array or a host value, comes back.

A layer's `save_own_variables` may store, beside its variables, a `jnp` array and a NumPy array
it holds; its `load_own_variables` takes both back. The oracle is Keras: `load_weights` of the
`.weights.h5` Keras writes for the same model. Saved under one `ModelParallel` mesh, restored
under another.
"""

from __future__ import annotations

import jax.numpy as jnp
import keras
import numpy as np
import pytest

import keras_orbax
from keras_orbax.errors import CheckpointMismatchError, KerasOrbaxWarning
from tests import _models

X = np.arange(16, dtype="float32").reshape(4, 4) / 10
SAVED = np.array([7, 8, 9, 10], "float32")


class Held(keras.layers.Layer):
    """A kernel, plus a device array and a NumPy array it holds; both change what it computes.
    `size`: the length of the held arrays, which its loader checks."""

    def __init__(self, size: int = 4, **kwargs):
        super().__init__(**kwargs)
        self.size = size
        self.on_device = jnp.zeros((size,), "float32")
        self.on_host = np.zeros((size,), "float32")

    def get_config(self):
        return {**super().get_config(), "size": self.size}

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1], 8), name="kernel")

    def call(self, x):
        shift = jnp.sum(self.on_device) + float(np.sum(self.on_host))
        return x @ self.kernel + shift

    def save_own_variables(self, store):
        store["0"] = self.kernel
        store["1"] = self.on_device
        store["2"] = self.on_host

    def load_own_variables(self, store):
        if store["1"].shape != (self.size,):
            raise ValueError(f"a held state of {self.size}, not {store['1'].shape}")
        self.kernel.assign(store["0"])
        self.on_device = jnp.asarray(store["1"])
        self.on_host = np.asarray(store["2"])


def held_model(size: int = 4) -> keras.Model:
    inputs = keras.Input((4,))
    x = Held(name="first")(inputs)
    outputs = Held(size, name="second")(keras.layers.Dense(4, name="middle")(x))
    return keras.Model(inputs, outputs)


def trained() -> keras.Model:
    model = held_model()
    for name in ("first", "second"):
        layer = model.get_layer(name)
        layer.on_device = jnp.asarray(SAVED)
        layer.on_host = SAVED.copy()
    return model


@pytest.fixture
def saved(tmp_path, distribution):
    distribution(_models.model_parallel((2, 4)))
    model = trained()
    keras_orbax.save(model, tmp_path / "ckpt", step=1)
    model.save_weights(tmp_path / "m.weights.h5")
    keras_model = held_model()
    keras_model.load_weights(tmp_path / "m.weights.h5")  # Keras's own loader: the oracle
    expected = model.predict(X, verbose=0)
    np.testing.assert_array_equal(keras_model.predict(X, verbose=0), expected)
    assert not np.allclose(held_model().predict(X, verbose=0), expected)  # the state matters
    distribution(_models.model_parallel((4, 2)))
    return tmp_path, expected, keras_model


def _assert_held_as_keras(model: keras.Model, keras_model: keras.Model) -> None:
    for got, want in zip(model.weights, keras_model.weights, strict=True):
        np.testing.assert_array_equal(np.asarray(got.value), np.asarray(want.value), got.path)
    for name in ("first", "second"):
        got, want = model.get_layer(name), keras_model.get_layer(name)
        np.testing.assert_array_equal(np.asarray(got.on_device), np.asarray(want.on_device))
        np.testing.assert_array_equal(got.on_host, want.on_host)
        np.testing.assert_array_equal(got.on_host, SAVED)


@pytest.mark.parametrize("source", ["ckpt", "m.weights.h5"])
@pytest.mark.parametrize("deferred", [False, True], ids=["built", "deferred"])
def test_held_arrays_come_back_as_keras_loads_them(saved, source, deferred):
    root, expected, keras_model = saved
    if deferred:
        with keras_orbax.deferred_init():
            model = held_model()
    else:
        model = held_model()
    result = keras_orbax.restore_sharded(model, root / source)
    _assert_held_as_keras(model, keras_model)
    # Another mesh sums the matmuls in another order: equal to the last bits.
    np.testing.assert_allclose(model.predict(X, verbose=0), expected, rtol=1e-5, atol=1e-4)
    kernel = model.get_layer("first").kernel.value
    assert kernel.sharding.mesh.devices.shape == (4, 2)
    assert len(kernel.sharding.device_set) == 8
    assert "first/kernel" in " ".join(result.paths.values())


def test_load_model_keeps_the_held_arrays(saved):
    root, expected, keras_model = saved
    model = keras_orbax.load_model(root / "ckpt", custom_objects={"Held": Held})
    _assert_held_as_keras(model, keras_model)
    # Another mesh sums the matmuls in another order: equal to the last bits.
    np.testing.assert_allclose(model.predict(X, verbose=0), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("source", ["ckpt", "m.weights.h5"])
def test_a_failing_loader_leaves_every_layer_as_it_was(saved, source):
    """The second layer's loader refuses the saved state after the first one's has taken it:
    neither the variables nor what the first layer holds keep anything of the restore."""
    root, _, _ = saved
    model = held_model(size=3)
    before = [np.asarray(v.value) for v in model.weights]
    first = model.get_layer("first")
    held_before = (first.on_device, first.on_host)
    with pytest.raises(CheckpointMismatchError, match=r"held_1.*a held state of 3"):
        keras_orbax.restore_sharded(model, root / source)
    for want, variable in zip(before, model.weights, strict=True):
        np.testing.assert_array_equal(np.asarray(variable.value), want)
    assert first.on_device is held_before[0] and first.on_host is held_before[1]


class Computed(Held):
    """Stores a device array it computes as it saves (as a LoRA layer stores its merged kernel)
    beside the host value it holds."""

    def save_own_variables(self, store):
        super().save_own_variables(store)
        store["1"] = self.on_device + 0


def test_a_layer_whose_loader_is_not_run_is_named_with_what_it_keeps(tmp_path, distribution):
    distribution(_models.model_parallel((2, 4)))
    inputs = keras.Input((4,))
    layer = Computed(name="computed")
    model = keras.Model(inputs, layer(inputs))
    layer.on_device, layer.on_host = jnp.asarray(SAVED), SAVED.copy()
    keras_orbax.save(model, tmp_path / "ckpt", step=1)
    layer.on_host = np.zeros((4,), "float32")
    with pytest.warns(KerasOrbaxWarning, match=r"were not restored \(layers/computed: 2\)"):
        keras_orbax.restore_sharded(model, tmp_path / "ckpt")
    np.testing.assert_array_equal(layer.on_host, np.zeros((4,), "float32"))
