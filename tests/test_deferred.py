"""`deferred_init` and `load_model`: models restored without ever being materialized."""

from __future__ import annotations

import gc

import jax
import keras
import numpy as np
import pytest

import keras_orbax
from keras_orbax.errors import CheckpointMismatchError, DeferredVariableError
from tests import _models


@pytest.fixture
def trained(tmp_path, distribution):
    """A full model trained one epoch on a (2, 4) mesh and saved at its global step."""
    distribution(_models.model_parallel((2, 4)))
    model = _models.compile_adam(_models.full_model())
    x, y = _models.training_data()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    keras_orbax.save(model, tmp_path, step=int(model.optimizer.iterations), epoch=1)
    return model, tmp_path


def _state(model: keras.Model) -> list[keras.Variable]:
    return model.variables + model.optimizer.variables


def test_deferred_model_holds_nothing_until_restored(trained, distribution):
    source, directory = trained
    distribution(_models.model_parallel((4, 2)))
    with keras_orbax.deferred_init():
        model = _models.full_model()
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", metrics=["mae"])
    assert all(v._value is None for v in model.variables)
    assert all(v.shape == () for v in model.optimizer.variables)  # iteration, learning_rate
    gc.collect()
    before = {id(a) for a in jax.live_arrays()}

    result = keras_orbax.restore_sharded(model, directory)
    assert result.step == 4 and result.epoch == 1
    for want, got in zip(_state(source), _state(model), strict=True):
        np.testing.assert_array_equal(
            np.asarray(got.value), np.asarray(want.value), err_msg=got.path
        )
        expected = keras.distribution.distribution().get_variable_layout(got).backend_layout
        assert got.value.sharding.is_equivalent_to(expected, got.value.ndim), got.path

    # No array on the mesh but the restored values themselves: nothing was copied or kept aside.
    # (Single-device arrays in `live_arrays` are the per-device pieces of these.)
    gc.collect()
    values = {id(v.value) for v in _state(model) + model.metrics_variables}
    on_mesh = [
        a for a in jax.live_arrays() if id(a) not in before and len(a.sharding.device_set) > 1
    ]
    assert {id(a) for a in on_mesh} == values


def test_restored_shards_are_the_buffers_that_were_read(trained, distribution):
    """The direct path: each shard file read once into an aligned buffer the device adopts."""
    _, directory = trained
    distribution(_models.model_parallel((2, 4)))  # the saved layout: every shard read directly
    with keras_orbax.deferred_init():
        model = _models.full_model()
    result = keras_orbax.restore_sharded(model, directory)
    expected_bytes = 0
    for variable in model.variables:
        shards = variable.value.addressable_shards
        pointers = {s.data.unsafe_buffer_pointer() for s in shards}
        distinct = {repr(s.index) for s in shards}
        assert len(pointers) == len(distinct), (
            variable.path
        )  # devices sharing a shard share its read
        assert all(p % 64 == 0 for p in pointers), variable.path
        expected_bytes += sum(s.data.nbytes for s in {repr(s.index): s for s in shards}.values())
    assert result.bytes_read == expected_bytes  # every byte once; optimizer and metrics not read


def test_using_a_deferred_model_before_restore_is_an_error():
    with keras_orbax.deferred_init():
        model = _models.mlp()
    with pytest.raises(
        DeferredVariableError, match=r"'hidden/kernel' was built under .*deferred_init"
    ):
        model.predict(np.ones((2, 16)), verbose=0)
    with pytest.raises(DeferredVariableError, match="never restored"):
        keras_orbax.save(model, "/tmp/never-written", step=1)
    # A discarded deferred model does not affect other models in the process.
    other = _models.compile_adam(_models.mlp())
    other.fit(np.ones((8, 16)), np.ones((8, 8)), verbose=0)


def test_missing_variables_are_initialized_with_strict_false(trained, distribution):
    _, directory = trained
    distribution(_models.model_parallel((2, 4)))
    with keras_orbax.deferred_init():
        inputs = keras.Input((4,), dtype="int32")
        x = keras.layers.Embedding(16, 8)(inputs)
        x = keras.layers.Flatten()(x)
        outputs = keras.layers.Dense(16)(x)
        model = keras.Model(inputs, keras.layers.Dense(12, name="new_head")(outputs))
    with pytest.raises(
        CheckpointMismatchError,
        match=r"layers/dense_1/vars/0: checkpoint dense_\d+/kernel \(16, 8\) float32, "
        r"model new_head/kernel \(16, 12\) float32",
    ):
        keras_orbax.restore_sharded(model, directory)
    assert all(v._value is None for v in model.variables)

    result = keras_orbax.restore_sharded(model, directory, strict=False)
    assert result.initialized == ("layers/dense_1/vars/0", "layers/dense_1/vars/1")
    assert "layers/layer_normalization/vars/0" in result.skipped
    head = model.get_layer("new_head").kernel
    assert head.value.shape == (16, 12)
    assert tuple(head.value.sharding.spec) == ("batch", "model")
    assert model.predict(np.ones((2, 4), "int32"), verbose=0).shape == (2, 12)


def test_subclassed_model_under_deferred_init(tmp_path, distribution):
    distribution(_models.model_parallel((2, 4)))

    class Tower(keras.Model):
        def __init__(self):
            super().__init__(name="tower")
            self.blocks = [keras.layers.Dense(16) for _ in range(3)]
            self.norm = keras.layers.LayerNormalization()

        def call(self, x):
            for block in self.blocks:
                x = block(x)
            return self.norm(x)

    source = Tower()
    source(np.ones((2, 8)))
    keras_orbax.save(source, tmp_path, step=1)
    with keras_orbax.deferred_init():
        target = Tower()
        target(keras.Input((8,)))  # a symbolic call builds a subclassed model without allocating
    assert all(v._value is None for v in target.variables)
    keras_orbax.restore_sharded(target, tmp_path)
    np.testing.assert_allclose(target(np.ones((2, 8))), source(np.ones((2, 8))), rtol=1e-6)


def test_load_model_rebuilds_compiles_and_restores(trained, distribution):
    source, directory = trained
    distribution(_models.model_parallel((1, 8)))
    model = keras_orbax.load_model(directory)
    assert model.optimizer.built and int(model.optimizer.iterations) == 4
    for want, got in zip(_state(source), _state(model), strict=True):
        np.testing.assert_array_equal(
            np.asarray(got.value), np.asarray(want.value), err_msg=got.path
        )
    x, y = _models.training_data()
    np.testing.assert_allclose(
        model.predict(x, verbose=0), source.predict(x, verbose=0), rtol=1e-5, atol=1e-6
    )
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert int(model.optimizer.iterations) == 8

    weights_only = keras_orbax.load_model(directory, compile=False)
    assert getattr(weights_only, "optimizer", None) is None


def test_load_model_never_runs_code_from_the_checkpoint(tmp_path):
    inputs = keras.Input((4,))
    doubled = keras.layers.Lambda(lambda t: t * 2)(inputs)
    model = keras.Model(inputs, keras.layers.Dense(2)(doubled))
    keras_orbax.save(model, tmp_path, step=1)
    with pytest.raises(ValueError, match=r"(?i)unsafe|safe_mode"):
        keras_orbax.load_model(tmp_path)


def test_compiling_with_an_optimizer_name_inside_says_what_to_do():
    with (
        pytest.raises(ValueError, match=r"compile after the `with` block"),
        keras_orbax.deferred_init(),
    ):
        model = _models.mlp()
        model.compile(optimizer="adam", loss="mse")


def test_an_optimizer_made_before_can_be_compiled_inside(trained, distribution):
    source, directory = trained
    distribution(_models.model_parallel((2, 4)))
    optimizer = keras.optimizers.Adam(1e-2)
    with keras_orbax.deferred_init():
        model = _models.full_model()
        model.compile(optimizer=optimizer, loss="mse")
    keras_orbax.restore_sharded(model, directory)
    for want, got in zip(_state(source), _state(model), strict=True):
        np.testing.assert_array_equal(
            np.asarray(got.value), np.asarray(want.value), err_msg=got.path
        )
