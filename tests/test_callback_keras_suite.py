"""The scenarios of Keras 3.15's own `OrbaxCheckpoint` tests, run against `keras_orbax.ModelCheckpoint`.

Adapted from `keras/src/callbacks/orbax_checkpoint_test.py`, one function per scenario, with the
same models and data sizes. Where Keras's test only checks that files exist (or that there are at
most 5 of them with `max_to_keep=2`), these check the exact steps on disk. Differences that follow
from the design:

- Steps are global training steps, not epoch numbers (Keras saves epoch `e` as step `e`).
- Keras reloads with `keras.saving.load_model(directory)` or `model.load_weights(directory)`;
  here a model is rebuilt (in code, or from the config stored with the step) and filled with
  `keras_orbax.restore_sharded`. A weights-only checkpoint restores into a compiled model with
  `strict=False`, and refuses to with `strict=True` (Keras's `load_model` raises there too).
- Training resumption uses `resume=True` with the same `fit(epochs=N)` call extended by one
  epoch, where Keras's callback reuses the directory and would collide on steps.
- Not adapted: `test_checkpoint_with_assets`. Its `StringLookup` needs TensorFlow, which this
  project does not install, and keras-orbax stores variables and the model config, not asset files.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
from keras.distribution import DeviceMesh, LayoutMap, ModelParallel, TensorLayout

import keras_orbax
from keras_orbax._src.format import step_dirs

DENSE_UNITS, OUT_UNITS, NUM_SAMPLES, PREDICT_BATCH = 32, 16, 64, 8  # the distributed tests' sizes


def _create_test_model(steps_per_execution: int = 1) -> keras.Model:
    inputs = keras.layers.Input(shape=(10,), name="input_layer")
    x = keras.layers.Dense(6, name="dense_layer")(inputs)
    outputs = keras.layers.Dense(2, name="output_layer")(x)
    model = keras.Model(inputs, outputs, name="test_model")
    model.compile(optimizer="adam", loss="mse", steps_per_execution=steps_per_execution)
    return model


def _create_dummy_data(num_samples: int = 100, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((num_samples, 10)), rng.standard_normal((num_samples, 2))


def _build_distributed_model() -> keras.Model:
    inputs = keras.layers.Input(shape=(10,), name="input_layer")
    h = keras.layers.Dense(DENSE_UNITS, name="dense_layer")(inputs)
    outputs = keras.layers.Dense(OUT_UNITS, name="output_layer")(h)
    model = keras.Model(inputs, outputs, name="test_model")
    model.compile(optimizer="adam", loss="mse")
    return model


def _layout_map(mesh: DeviceMesh, *layer_names: str) -> LayoutMap:
    layout_map = LayoutMap(mesh)
    for name in layer_names:
        layout_map[f"{name}/kernel"] = TensorLayout(axes=(None, "data"))
        layout_map[f"{name}/bias"] = TensorLayout(axes=("data",))
    return layout_map


def _simulate_best(values: list[float], better, initial: float | None = None) -> list[int]:
    """Indices of the epochs `save_best_only` saves, given each epoch's monitored value."""
    saved, best = [], initial
    for i, value in enumerate(values):
        if best is None or better(value, best):
            saved.append(i)
            best = value
    return saved


def _assert_all_equal(got: list, want: list) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize(
    ("save_freq", "epochs", "batch_size", "steps"),
    [(10, 1, 5, [10]), ("epoch", 3, None, [6])],  # 50 samples: 10 batches of 5, 2 of 32
)
def test_checkpoint_saving_basic(tmp_path, save_freq, epochs, batch_size, steps):
    x, y = _create_dummy_data(num_samples=50)
    callback = keras_orbax.ModelCheckpoint(tmp_path, save_freq=save_freq)
    _create_test_model().fit(
        x, y, epochs=epochs, batch_size=batch_size, callbacks=[callback], verbose=0
    )
    assert step_dirs.committed_steps(tmp_path) == steps


@pytest.mark.parametrize(("mode", "better"), [("min", np.less), ("max", np.greater)])
def test_save_best_only(tmp_path, mode, better):
    x, y = _create_dummy_data(num_samples=100)  # 4 batches of 32 per epoch
    callback = keras_orbax.ModelCheckpoint(
        tmp_path, monitor="loss", save_best_only=True, mode=mode, max_to_keep=None
    )
    history = _create_test_model().fit(x, y, epochs=5, callbacks=[callback], verbose=0)
    losses = history.history["loss"]
    saved = _simulate_best(losses, better)
    assert step_dirs.committed_steps(tmp_path) == [4 * (e + 1) for e in saved]
    assert callback.best == losses[saved[-1]]


@pytest.mark.parametrize("save_on_background", [False, True])
def test_async_vs_sync_saving(tmp_path, save_on_background):
    x, y = _create_dummy_data()
    model = _create_test_model()
    callback = keras_orbax.ModelCheckpoint(
        tmp_path, save_on_background=save_on_background, max_to_keep=None
    )
    model.fit(x, y, epochs=2, callbacks=[callback], verbose=0)
    assert step_dirs.committed_steps(tmp_path) == [4, 8]
    fresh = _create_test_model()
    keras_orbax.restore_sharded(fresh, tmp_path)
    _assert_all_equal(fresh.get_weights(), model.get_weights())


def test_max_to_keep(tmp_path):
    x, y = _create_dummy_data()
    callback = keras_orbax.ModelCheckpoint(tmp_path, max_to_keep=2)
    _create_test_model().fit(x, y, epochs=5, callbacks=[callback], verbose=0)
    assert step_dirs.committed_steps(tmp_path) == [16, 20]


def test_load_weights_from_checkpoint(tmp_path):
    model = _create_test_model()
    x, y = _create_dummy_data()
    callback = keras_orbax.ModelCheckpoint(tmp_path, save_weights_only=True)
    model.fit(x, y, epochs=1, callbacks=[callback], verbose=0)
    original = model.get_weights()

    new_model = _create_test_model()
    new_model.set_weights([w * 2 for w in original])
    keras_orbax.restore_sharded(new_model, tmp_path, strict=False)  # no optimizer state saved
    _assert_all_equal(new_model.get_weights(), original)


def test_save_freq_epoch_keeps_one_checkpoint_by_default(tmp_path):
    x, y = _create_dummy_data()
    _create_test_model().fit(
        x, y, epochs=3, callbacks=[keras_orbax.ModelCheckpoint(tmp_path)], verbose=0
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["12"]  # nothing else left behind


def test_invalid_save_freq(tmp_path):
    with pytest.raises(ValueError, match="Received: save_freq='invalid'"):
        keras_orbax.ModelCheckpoint(tmp_path, save_freq="invalid")


def test_initial_value_threshold(tmp_path):
    x, y = _create_dummy_data()
    callback = keras_orbax.ModelCheckpoint(
        tmp_path,
        monitor="loss",
        save_best_only=True,
        mode="min",
        initial_value_threshold=1.0,
        max_to_keep=None,
    )
    history = _create_test_model().fit(x, y, epochs=3, callbacks=[callback], verbose=0)
    saved = _simulate_best(history.history["loss"], np.less, initial=1.0)
    assert step_dirs.committed_steps(tmp_path) == [4 * (e + 1) for e in saved]


@pytest.mark.parametrize("save_on_background", [False, True])
def test_checkpoint_loading_comprehensive(tmp_path, save_on_background):
    model = _create_test_model()
    x, y = _create_dummy_data(num_samples=200)
    callback = keras_orbax.ModelCheckpoint(
        tmp_path, save_on_background=save_on_background, save_weights_only=True
    )
    model.fit(x, y, epochs=1, callbacks=[callback], verbose=0)
    original = model.get_weights()

    new_model = _create_test_model()
    new_x, new_y = _create_dummy_data(num_samples=10, seed=1)
    new_model.fit(new_x, new_y, epochs=1, batch_size=5, verbose=0)
    new_model.set_weights([w * 2 for w in original])
    keras_orbax.restore_sharded(new_model, tmp_path, strict=False)
    _assert_all_equal(new_model.get_weights(), original)


def test_distributed_checkpoint_functionality(tmp_path, distribution):
    mesh = DeviceMesh((8,), axis_names=["data"])
    distribution(ModelParallel(layout_map=_layout_map(mesh, "dense_layer", "output_layer")))
    model = _build_distributed_model()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((NUM_SAMPLES, 10))
    y = rng.standard_normal((NUM_SAMPLES, OUT_UNITS))
    model.fit(x, y, epochs=2, callbacks=[keras_orbax.ModelCheckpoint(tmp_path)], verbose=0)

    loaded = _build_distributed_model()
    keras_orbax.restore_sharded(loaded, tmp_path)
    _assert_all_equal(loaded.get_weights(), model.get_weights())
    _assert_all_equal(loaded.optimizer.variables, model.optimizer.variables)
    np.testing.assert_allclose(
        loaded.predict(x[:PREDICT_BATCH], verbose=0), model.predict(x[:PREDICT_BATCH], verbose=0)
    )
    for want, got in zip(model.variables, loaded.variables, strict=True):
        assert got.value.sharding == want.value.sharding, want.path


def test_distributed_checkpoint_resharding(tmp_path, distribution):
    mesh = DeviceMesh((8,), axis_names=["data"])
    distribution(ModelParallel(layout_map=_layout_map(mesh, "dense_layer", "output_layer")))
    model = _build_distributed_model()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((NUM_SAMPLES, 10))
    y = rng.standard_normal((NUM_SAMPLES, OUT_UNITS))
    model.fit(x, y, epochs=2, callbacks=[keras_orbax.ModelCheckpoint(tmp_path)], verbose=0)
    original_predictions = model.predict(x[:PREDICT_BATCH], verbose=0)

    distribution(ModelParallel(layout_map=_layout_map(mesh, "output_layer")))  # layout B
    loaded = _build_distributed_model()
    keras_orbax.restore_sharded(loaded, tmp_path)
    _assert_all_equal(loaded.get_weights(), model.get_weights())
    np.testing.assert_allclose(
        loaded.predict(x[:PREDICT_BATCH], verbose=0), original_predictions, rtol=1e-6, atol=1e-6
    )
    dense_kernel, _, output_kernel, _ = (v.value.sharding for v in loaded.trainable_variables)
    assert dense_kernel.is_fully_replicated
    assert tuple(output_kernel.spec) == (None, "data")


def test_checkpoint_loading_from_the_stored_config(tmp_path):
    model = _create_test_model()
    x, y = _create_dummy_data()
    model.fit(x, y, epochs=1, callbacks=[keras_orbax.ModelCheckpoint(tmp_path)], verbose=0)

    config = step_dirs.read_record(tmp_path / "4").model_config
    assert config is not None
    loaded = keras.saving.deserialize_keras_object(config)
    loaded.compile(optimizer="adam", loss="mse")
    keras_orbax.restore_sharded(loaded, tmp_path)
    _assert_all_equal(loaded.get_weights(), model.get_weights())
    _assert_all_equal(loaded.optimizer.variables, model.optimizer.variables)

    # A weights-only step holds no optimizer state: as Keras's load_weights of such a file, the
    # weights are restored and the compiled model's optimizer is left as it is.
    weights_only = tmp_path / "weights_only"
    callback = keras_orbax.ModelCheckpoint(weights_only, save_weights_only=True)
    model.fit(x, y, epochs=1, callbacks=[callback], verbose=0)
    optimizer_before = [np.asarray(v) for v in loaded.optimizer.variables]
    keras_orbax.restore_sharded(loaded, weights_only)
    _assert_all_equal(loaded.get_weights(), model.get_weights())
    _assert_all_equal(loaded.optimizer.variables, optimizer_before)


@keras.saving.register_keras_serializable(package="keras_orbax_test")
class CustomLayer(keras.layers.Layer):
    def __init__(self, units: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.units = units

    def build(self, input_shape: tuple) -> None:
        self.kernel = self.add_weight(shape=(input_shape[-1], self.units), name="kernel")
        self.moving_mean = self.add_weight(shape=(self.units,), trainable=False, name="moving_mean")

    def call(self, inputs):
        return inputs @ self.kernel

    def get_config(self) -> dict:
        return {**super().get_config(), "units": self.units}


def _comprehensive_model() -> keras.Model:
    inputs = keras.layers.Input(shape=(10,), name="input_layer")
    x = keras.layers.Dense(8, name="dense_layer")(inputs)
    outputs = CustomLayer(2, name="custom_layer")(x)
    model = keras.Model(inputs, outputs, name="comprehensive_test_model")
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    return model


@pytest.mark.parametrize("save_on_background", [False, True])
def test_comprehensive_model_state_restoration(tmp_path, save_on_background):
    keras.utils.set_random_seed(42)
    model = _comprehensive_model()
    model.non_trainable_variables[0].assign(np.arange(2, dtype="float32"))  # moving_mean
    x, y = _create_dummy_data(num_samples=100)
    callback = keras_orbax.ModelCheckpoint(tmp_path, save_on_background=save_on_background)
    model.fit(x, y, epochs=2, verbose=0, callbacks=[callback])

    loaded = _comprehensive_model()
    keras_orbax.restore_sharded(loaded, tmp_path)
    _assert_all_equal(loaded.get_weights(), model.get_weights())
    _assert_all_equal(loaded.optimizer.variables, model.optimizer.variables)
    np.testing.assert_array_equal(np.asarray(loaded.non_trainable_variables[0]), [0.0, 1.0])


@pytest.mark.parametrize(
    ("steps_per_execution", "first", "then"), [(1, [1, 2, 3, 4], [5, 6]), (2, [2, 4], [6])]
)
def test_training_resumption(tmp_path, steps_per_execution, first, then):
    x, y = _create_dummy_data(num_samples=50)  # 2 batches of 25 per epoch
    model = _create_test_model(steps_per_execution)
    oc1 = keras_orbax.ModelCheckpoint(tmp_path, save_freq=1, max_to_keep=10)
    model.fit(x, y, epochs=2, batch_size=25, callbacks=[oc1], verbose=0)
    assert step_dirs.committed_steps(tmp_path) == first

    reloaded = _create_test_model(steps_per_execution)
    oc2 = keras_orbax.ModelCheckpoint(tmp_path, save_freq=1, max_to_keep=10, resume=True)
    history = reloaded.fit(x, y, epochs=3, batch_size=25, callbacks=[oc2], verbose=0)
    assert history.epoch == [2]
    assert step_dirs.committed_steps(tmp_path) == first + then


def test_save_best_only_on_a_monitor_not_logged_saves_every_epoch_as_keras_does(tmp_path):
    """Keras's `ModelCheckpoint` warns and saves each epoch when `monitor` is not in the logs
    (its documented fall back to `save_best_only=False`); keras-orbax's does the same, on the
    same fit."""
    x, y = _create_dummy_data()  # 4 batches of 32 per epoch
    keras_callback = keras.callbacks.ModelCheckpoint(
        str(tmp_path / "keras" / "e{epoch}.weights.h5"),
        monitor="unknown",
        mode="min",  # "auto" raises in both: neither can tell the direction of an unknown metric
        save_best_only=True,
        save_weights_only=True,
    )
    ours = keras_orbax.ModelCheckpoint(
        tmp_path / "ours", monitor="unknown", mode="min", save_best_only=True, max_to_keep=None
    )
    with pytest.warns(UserWarning) as warned:
        _create_test_model().fit(x, y, epochs=3, callbacks=[keras_callback, ours], verbose=0)
    keras_epochs = sorted(int(p.name[1:-11]) for p in (tmp_path / "keras").iterdir())
    assert keras_epochs == [1, 2, 3]
    assert step_dirs.committed_steps(tmp_path / "ours") == [4 * e for e in keras_epochs]
    messages = [str(w.message) for w in warned if "unknown" in str(w.message)]
    assert "Can save best model only with unknown available." in messages  # Keras's own
    ours_warned = [m for m in messages if m.startswith("ModelCheckpoint(save_best_only=True)")]
    assert ours_warned == [
        "ModelCheckpoint(save_best_only=True) saves every time, as Keras's does, while "
        "'unknown' is not a number in the logs. Received: unknown=None"
    ]
