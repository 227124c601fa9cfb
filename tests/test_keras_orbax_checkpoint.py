"""Directories written by Keras's own `keras.callbacks.OrbaxCheckpoint` restore sharded, exactly."""

from __future__ import annotations

import keras
import numpy as np
import orbax.checkpoint.experimental.v1 as ocp
import pytest

import keras_orbax
from tests import _models


def _build() -> keras.Model:
    inputs = keras.Input((16,))
    x = keras.layers.Dense(32, name="hidden")(inputs)
    x = keras.layers.BatchNormalization(name="norm")(x)
    outputs = keras.layers.Dense(8, name="head")(x)
    return keras.Model(inputs, outputs, name="mlp")


def _compiled(model: keras.Model) -> keras.Model:
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", metrics=["mae"])
    return model


@pytest.fixture(scope="module")
def keras_checkpoint(tmp_path_factory):
    """Three epochs saved by Keras's callback (steps 0, 1, 2); the model as trained."""
    directory = tmp_path_factory.mktemp("keras_orbax_checkpoint")
    rng = np.random.default_rng(0)
    x, y = rng.random((32, 16), "float32"), rng.random((32, 8), "float32")
    model = _compiled(_build())
    callback = keras.callbacks.OrbaxCheckpoint(
        str(directory), max_to_keep=3, save_on_background=False
    )
    model.fit(x, y, epochs=3, batch_size=8, verbose=0, callbacks=[callback])
    return directory, model


def _state(model: keras.Model) -> dict[str, np.ndarray]:
    """Every variable by keras-orbax key (weights, optimizer, metrics)."""
    return {
        k: np.asarray(v.value)
        for k, v in keras_orbax._src.model.state_keys.keyed_variables(model).items()
    }


def _saved(directory, trained: keras.Model, step: int) -> dict[str, np.ndarray]:
    """The oracle: the step's tree as Orbax loads it, given to each variable of the model that
    saved it by its collection and path, as Keras's `set_state_tree` does; by keras-orbax key."""
    tree = ocp.load_checkpointables(directory / str(step), {"pytree": None})["pytree"]
    collections = {
        "trainable_variables": trained.trainable_variables,
        "non_trainable_variables": trained.non_trainable_variables,
        "optimizer_variables": trained.optimizer.variables,
        "metrics_variables": trained.metrics_variables,
    }
    keys = {id(v): k for k, v in keras_orbax._src.model.state_keys.keyed_variables(trained).items()}
    expected = {}
    for collection, variables in collections.items():
        for variable in variables:
            node = tree[collection]
            for part in variable.path.split("/"):
                node = node[part]
            expected[keys[id(variable)]] = np.asarray(node)
    return expected


def _assert_equal(actual: dict, expected: dict) -> None:
    assert sorted(actual) == sorted(expected)
    for key in expected:
        np.testing.assert_array_equal(actual[key], expected[key], err_msg=key)


@pytest.mark.parametrize("step", [None, 1])
def test_restores_latest_or_chosen_step_sharded(tmp_path, distribution, keras_checkpoint, step):
    directory, trained = keras_checkpoint
    distribution(_models.model_parallel((2, 4)))
    model = _compiled(_build())  # built in the same process: paths carry `_1` counters
    result = keras_orbax.restore_sharded(model, directory, step)
    assert result.step == (2 if step is None else 1)
    assert "layers/dense/vars/0" not in result.skipped
    expected = _saved(directory, trained, result.step)
    assert sorted(expected) == sorted(_state(trained))  # the whole state, metrics included
    _assert_equal(_state(model), {k: expected[k] for k in _state(model)})
    if step is None:  # the latest step is what the trained model holds
        _assert_equal(
            _state(model), {k: v for k, v in _state(trained).items() if k in _state(model)}
        )
    assert int(model.optimizer.iterations) == (12 if step is None else 8)
    kernel = model.get_layer("hidden").kernel.value
    assert tuple(kernel.sharding.spec) == ("batch", "model")


def test_restores_an_uncompiled_and_a_deferred_model(distribution, keras_checkpoint):
    directory, trained = keras_checkpoint
    distribution(_models.model_parallel((2, 4)))
    weights = [np.asarray(v) for v in trained.weights]
    plain = _build()
    keras_orbax.restore_sharded(plain, directory)
    with keras_orbax.deferred_init():
        deferred = _build()
    _compiled(deferred)
    keras_orbax.restore_sharded(deferred, directory)
    for model in (plain, deferred):
        for got, expected in zip(model.weights, weights, strict=True):
            np.testing.assert_array_equal(np.asarray(got.value), expected)
    optimizer = {k: v for k, v in _state(trained).items() if k.startswith("optimizer/")}
    _assert_equal({k: v for k, v in _state(deferred).items() if k in optimizer}, optimizer)
    assert int(deferred.optimizer.iterations) == 12


def test_load_model_rebuilds_from_keras_config(distribution, keras_checkpoint):
    directory, trained = keras_checkpoint
    distribution(_models.model_parallel((2, 4)))
    model = keras_orbax.load_model(directory)
    expected = _saved(directory, trained, 2)
    _assert_equal(_state(model), {k: expected[k] for k in _state(model)})
    assert len(_state(model)) == len(expected) - 2  # all but the mae metric, not built yet
    assert model.optimizer.built and int(model.optimizer.iterations) == 12


def test_a_sequential_loads_from_its_config_whose_paths_lack_its_name(tmp_path, distribution):
    """A Sequential built with an `Input` names its variables `sequential/dense/kernel` (and Adam's
    slots `adam/sequential_dense_kernel_momentum`); built from its config, as `load_model` builds
    it, `dense/kernel`. Every leaf still reaches its variable."""
    trained = _compiled(keras.Sequential([keras.Input((16,)), keras.layers.Dense(8)]))
    assert trained.weights[0].path.startswith(f"{trained.name}/")
    callback = keras.callbacks.OrbaxCheckpoint(str(tmp_path), save_on_background=False)
    rng = np.random.default_rng(0)
    x, y = rng.random((16, 16), "float32"), rng.random((16, 8), "float32")
    trained.fit(x, y, epochs=1, batch_size=8, verbose=0, callbacks=[callback])
    distribution(_models.model_parallel((2, 4)))
    model = keras_orbax.load_model(tmp_path)
    assert not model.weights[0].path.startswith(f"{model.name}/")  # the case in point
    expected = _state(trained)
    _assert_equal(_state(model), {k: expected[k] for k in _state(model)})
    assert int(model.optimizer.iterations) == 2


def test_a_mismatch_names_the_tree_path(keras_checkpoint):
    directory, _ = keras_checkpoint
    inputs = keras.Input((16,))
    outputs = keras.layers.Dense(8, name="head")(keras.layers.Dense(4, name="hidden")(inputs))
    model = keras.Model(inputs, outputs)
    with pytest.raises(keras_orbax.errors.CheckpointMismatchError, match="trainable_variables/"):
        keras_orbax.restore_sharded(model, directory)


class _Swapped(keras.Model):
    """Makes `first` before `second` but tracks (and applies) `second` first: Keras's saving order
    and the creation order differ, and both layers' weights have one shape."""

    def __init__(self) -> None:
        super().__init__()
        first = keras.layers.Dense(8)
        self.second = keras.layers.Dense(8)
        self.first = first

    def call(self, inputs):
        return self.first(self.second(inputs))


def _swapped_functional() -> keras.Model:
    first, second = keras.layers.Dense(8), keras.layers.Dense(8)
    inputs = keras.Input((8,))
    model = keras.Model(inputs, first(second(inputs)))
    model.first, model.second = first, second
    return model


def _swapped_subclassed() -> keras.Model:
    model = _Swapped()
    model(np.zeros((1, 8), "float32"))
    return model


def _saved_by_keras(directory, model: keras.Model) -> np.ndarray:
    """Trains `model` one step, saved by Keras's callback; its predictions on the returned data."""
    x = np.random.default_rng(1).random((8, 8), "float32")
    callback = keras.callbacks.OrbaxCheckpoint(str(directory), save_on_background=False)
    model.fit(x, x[:, ::-1], epochs=1, batch_size=8, verbose=0, callbacks=[callback])
    return x


@pytest.mark.parametrize("build", [_swapped_functional, _swapped_subclassed])
def test_same_shape_layers_get_their_own_weights_when_counters_shift(tmp_path, build):
    trained = _compiled(build())
    x = _saved_by_keras(tmp_path, trained)
    weights = {name: getattr(trained, name).get_weights() for name in ("first", "second")}
    assert not np.array_equal(weights["first"][0], weights["second"][0])
    model = _compiled(build())  # built again in this process: every counter shifts
    assert model.first.kernel.path != trained.first.kernel.path
    keras_orbax.restore_sharded(model, tmp_path)
    for name, expected in weights.items():
        for got, want in zip(getattr(model, name).get_weights(), expected, strict=True):
            np.testing.assert_array_equal(got, want, err_msg=name)
    np.testing.assert_array_equal(model.predict(x, verbose=0), trained.predict(x, verbose=0))
    optimizer = {k: v for k, v in _state(trained).items() if k.startswith("optimizer/")}
    _assert_equal({k: v for k, v in _state(model).items() if k in optimizer}, optimizer)


def _named(names: tuple[str, str]) -> keras.Model:
    inputs = keras.Input((8,))
    x = keras.layers.Dense(8, name=names[0])(inputs)
    return keras.Model(inputs, keras.layers.Dense(8, name=names[1])(x))


@pytest.mark.parametrize(
    ("saved", "restored"),
    [
        (("proj", "proj_0"), ("proj_1", "proj_2")),  # equal counters: `proj` is `proj_0`
        (("p_0_1", "p_1_0"), ("p_2_1", "p_3_2")),  # the two counters order the sides differently
    ],
)
def test_counters_that_cannot_tell_creation_order_are_refused(tmp_path, saved, restored):
    _saved_by_keras(tmp_path, _compiled(_named(saved)))
    model = _compiled(_named(restored))
    before = [np.asarray(v.value) for v in model.weights]
    with pytest.raises(keras_orbax.errors.CheckpointMismatchError) as caught:
        keras_orbax.restore_sharded(model, tmp_path)
    for name in (*saved, *restored):
        assert any(f"{name}/kernel" in problem for problem in caught.value.problems), name
    keras_orbax.restore_sharded(model, tmp_path, strict=False)  # restores what matches: not these
    for got, expected in zip(model.weights, before, strict=True):
        np.testing.assert_array_equal(np.asarray(got.value), expected, err_msg=got.path)
