"""`.weights.h5`, sharded `.weights.json` and `.keras` files written by Keras restore sharded, with
exactly the values Keras's own `load_weights` gives, onto the layouts of the active distribution."""

from __future__ import annotations

import contextlib
from pathlib import Path

import keras
import numpy as np
import pytest

import keras_orbax
from keras_orbax.errors import CheckpointMismatchError
from tests import _models
from tests.test_keys import _compiled, _every_family, _family_inputs


def _mlp(width: int = 32) -> keras.Model:
    return _models.mlp(width)


def _trained(build, inputs, targets) -> keras.Model:
    model = build()
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    model.fit(inputs, targets, batch_size=4, epochs=1, verbose=0)
    return model


def _mlp_data():
    rng = np.random.default_rng(3)
    return rng.random((8, 16), dtype="float32"), rng.random((8, 8), dtype="float32")


def _write(model: keras.Model, directory: Path, kind: str) -> Path:
    if kind == "h5":
        model.save_weights(directory / "m.weights.h5")
        return directory / "m.weights.h5"
    if kind == "sharded":
        model.save_weights(directory / "m.weights.json", max_shard_size=0.000004)
        assert len(list(directory.glob("m_*.weights.h5"))) > 1
        return directory / "m.weights.json"
    model.save(directory / "m.keras")
    return directory / "m.keras"


def _keras_loaded(build, path: Path) -> keras.Model:
    """The oracle: Keras's own loader into a normal build with a built optimizer."""
    model = build()
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    model.optimizer.build(model.trainable_variables)
    if path.name.endswith(".keras"):
        return keras.saving.load_model(path)
    model.load_weights(path)
    return model


def _state(model: keras.Model) -> list[np.ndarray]:
    return _models.values(model.weights + model.optimizer.variables)


@pytest.mark.parametrize("kind", ["h5", "sharded", "keras"])
@pytest.mark.parametrize("deferred", [False, True], ids=["built", "deferred"])
def test_keras_files_restore_like_keras_load_weights(tmp_path, distribution, kind, deferred):
    x, y = _mlp_data()
    distribution(_models.model_parallel((2, 4)))
    path = _write(_trained(_mlp, x, y), tmp_path, kind)
    distribution(_models.model_parallel((4, 2)))
    expected = _state(_keras_loaded(_mlp, path))
    with keras_orbax.deferred_init() if deferred else contextlib.nullcontext():
        model = _mlp()
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    result = keras_orbax.restore_sharded(model, path)
    assert result.step is None and result.bytes_read > 0
    got = _state(model)
    assert len(got) == len(expected)
    for want, value in zip(expected, got, strict=True):
        np.testing.assert_array_equal(value, want)
    kernel = model.get_layer("hidden").kernel.value
    assert tuple(kernel.sharding.spec) == ("batch", "model")
    assert kernel.sharding.mesh.devices.shape == (4, 2)


def test_every_layer_family_restores_from_h5_like_keras(tmp_path, distribution):
    # Distinct values in every variable and optimizer slot, as training would leave them (a `fit`
    # of these layers compiles for 15 s; what is read back is the same either way).
    inputs = _family_inputs()
    path = _write(_compiled(_every_family(), inputs), tmp_path, "h5")
    expected = _state(_keras_loaded(_every_family, path))
    with keras_orbax.deferred_init():
        model = _every_family()
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    keras_orbax.restore_sharded(model, path)
    for want, value in zip(expected, _state(model), strict=True):
        np.testing.assert_array_equal(value, want)
    assert model.predict(inputs, verbose=0).shape == (4, 3)  # seed generators came out usable


def test_lora_and_quantized_layers_restore_like_keras(tmp_path):
    def lora() -> keras.Model:
        model = _mlp()
        model.get_layer("hidden").enable_lora(2)
        return model

    def int8() -> keras.Model:
        model = _mlp()
        model.quantize("int8")
        return model

    x, y = _mlp_data()
    for build in (lora, int8):
        path = _write(_trained(build, x, y), tmp_path, "h5")
        expected = _state(_keras_loaded(build, path))
        model = build()
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
        keras_orbax.restore_sharded(model, path)
        for want, value in zip(expected, _state(model), strict=True):
            np.testing.assert_array_equal(value, want)


def test_a_mismatch_names_the_h5_path_and_the_keras_path(tmp_path, distribution):
    x, y = _mlp_data()
    path = _write(_trained(_mlp, x, y), tmp_path, "h5")
    model = _mlp(width=24)
    before = _models.values(model.weights)
    with pytest.raises(CheckpointMismatchError, match="No variable was modified") as caught:
        keras_orbax.restore_sharded(model, path)
    message = str(caught.value)
    assert f"from '{path}'" in message
    assert (
        "checkpoint layers/dense/vars/0 (16, 32) float32, model hidden/kernel (16, 24)" in message
    )
    # One line per variable; not Keras's own errors, which print every value of the variable.
    assert len(message.splitlines()) == 5 and "value=" not in message, message
    for variable, want in zip(model.weights, before, strict=True):
        np.testing.assert_array_equal(np.asarray(variable.value), want)


@pytest.mark.parametrize("safe_mode", [True, False])
def test_load_model_rebuilds_a_keras_archive_deferred(tmp_path, distribution, safe_mode):
    x, y = _mlp_data()
    path = _write(_trained(_mlp, x, y), tmp_path, "keras")
    distribution(_models.model_parallel((4, 2)))
    expected = keras.saving.load_model(path)
    model = keras_orbax.load_model(path, safe_mode=safe_mode)
    for want, value in zip(_state(expected), _state(model), strict=True):
        np.testing.assert_array_equal(value, want)
    assert tuple(model.get_layer("hidden").kernel.value.sharding.spec) == ("batch", "model")
    np.testing.assert_array_equal(model.predict(x, verbose=0), expected.predict(x, verbose=0))


def test_load_model_refuses_a_lambda_in_a_keras_archive(tmp_path):
    inputs = keras.Input((4,))
    outputs = keras.layers.Lambda(lambda t: t * 2)(keras.layers.Dense(4)(inputs))
    keras.Model(inputs, outputs).save(tmp_path / "lambda.keras")
    with pytest.raises(ValueError, match=r"(?i)lambda"):
        keras_orbax.load_model(tmp_path / "lambda.keras")


def test_a_chunked_compressed_dataset_is_read_region_by_region_through_h5py(tmp_path, distribution):
    """Files Keras writes are contiguous; one rewritten by another tool (chunked, gzip) still loads."""
    import h5py

    x, y = _mlp_data()
    path = _write(_trained(_mlp, x, y), tmp_path, "h5")
    with h5py.File(path, "r+") as file:
        data = file["layers/dense/vars/0"][()]
        del file["layers/dense/vars/0"]
        file.create_dataset("layers/dense/vars/0", data=data, chunks=(4, 8), compression="gzip")
    expected = _state(_keras_loaded(_mlp, path))
    distribution(_models.model_parallel((4, 2)))
    with keras_orbax.deferred_init():
        model = _mlp()
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    keras_orbax.restore_sharded(model, path)
    for want, value in zip(expected, _state(model), strict=True):
        np.testing.assert_array_equal(value, want)
