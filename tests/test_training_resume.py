"""Save mid-training, restore into a fresh instance, and training continues exactly."""

from __future__ import annotations

import keras
import numpy as np

import keras_orbax
from tests import _models


def _train(model: keras.Model, epochs: int) -> list[float]:
    x, y = _models.training_data()
    history = model.fit(x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=0)
    return history.history["loss"]


def _state(model: keras.Model) -> list[np.ndarray]:
    return _models.values(model.variables + model.optimizer.variables)


def test_restored_model_trains_exactly_like_the_original(tmp_path, distribution):
    distribution(_models.model_parallel((2, 4)))
    keras.utils.set_random_seed(1)
    original = _models.compile_adam(_models.full_model())
    _train(original, epochs=2)
    keras_orbax.save(original, tmp_path, step=int(original.optimizer.iterations), epoch=2)

    keras.utils.set_random_seed(2)  # a different initialization, overwritten by the restore
    fresh = _models.compile_adam(_models.full_model())  # built in the same process: dense_2, adam_1
    assert fresh.layers[3].kernel.path != original.layers[3].kernel.path
    result = keras_orbax.restore_sharded(fresh, tmp_path)
    assert result.step == 8 and result.epoch == 2
    assert int(fresh.optimizer.iterations) == 8
    for want, got in zip(_state(original), _state(fresh), strict=True):
        np.testing.assert_array_equal(got, want)

    assert _train(fresh, epochs=2) == _train(original, epochs=2)
    for want, got in zip(_state(original), _state(fresh), strict=True):
        np.testing.assert_array_equal(got, want)


def test_uncompiled_model_takes_the_weights_only(tmp_path, distribution):
    distribution(_models.model_parallel((2, 4)))
    trained = _models.compile_adam(_models.full_model())
    _train(trained, epochs=1)
    keras_orbax.save(trained, tmp_path, step=1)

    distribution(_models.model_parallel((4, 2)))
    bare = _models.full_model()
    result = keras_orbax.restore_sharded(bare, tmp_path)
    assert len(result.restored) == len(bare.variables)
    assert any(key.startswith("optimizer/") for key in result.skipped)
    for want, got in zip(trained.variables, bare.variables, strict=True):
        np.testing.assert_array_equal(np.asarray(got.value), np.asarray(want.value))
    x, _ = _models.training_data(8)
    np.testing.assert_allclose(
        bare.predict(x, verbose=0), trained.predict(x, verbose=0), rtol=1e-5, atol=1e-6
    )


def test_compiled_model_with_unbuilt_optimizer_gets_the_optimizer_state(tmp_path, distribution):
    distribution(_models.model_parallel((2, 4)))
    trained = _models.compile_adam(_models.full_model())
    _train(trained, epochs=1)
    keras_orbax.save(trained, tmp_path, step=4)

    fresh = _models.compile_adam(_models.full_model())
    assert not fresh.optimizer.built
    keras_orbax.restore_sharded(fresh, tmp_path)
    assert fresh.optimizer.built
    for want, got in zip(_state(trained), _state(fresh), strict=True):
        np.testing.assert_array_equal(got, want)
    kernel = fresh.layers[3].kernel
    slot = next(v for v in fresh.optimizer.variables if v.name.endswith("kernel_momentum"))
    assert slot.shape == kernel.shape
    assert tuple(kernel.value.sharding.spec) == ("batch", "model")
    assert slot.value.sharding.is_equivalent_to(kernel.value.sharding, 2)
