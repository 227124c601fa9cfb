"""Checkpoint keys are Keras's own saving structure, independent of Keras's global name counters."""

from __future__ import annotations

import contextlib
from pathlib import Path

import h5py
import keras
import numpy as np
import pytest

import keras_orbax
from keras_orbax._src.compat.keras_compat import own_variables
from keras_orbax._src.model.state_keys import keyed_state, keyed_variables
from tests import _models

DATA = Path(__file__).parent / "data"


def _sequential() -> keras.Model:
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dropout(0.5), keras.layers.Dense(2)]
    )
    model.compile(optimizer="adam", loss="mse")
    model.fit(np.ones((4, 4)), np.ones((4, 2)), verbose=0)
    return model


def test_the_same_model_built_twice_has_the_same_keys(tmp_path):
    first, second = _sequential(), _sequential()
    assert first.layers[0].kernel.path != second.layers[0].kernel.path  # dense vs dense_2
    assert first.optimizer.name != second.optimizer.name  # adam vs adam_1
    assert list(keyed_variables(first)) == list(keyed_variables(second))
    assert list(keyed_variables(first)) == [
        "layers/dense/vars/0",
        "layers/dense/vars/1",
        "layers/dropout/seed_generators/0",
        "layers/dense_1/vars/0",
        "layers/dense_1/vars/1",
        *(f"optimizer/vars/{i}" for i in range(10)),
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


class _Block(keras.layers.Layer):
    """A layer holding sub-layers in a list, a dict and a nested list, plus a weight of its own."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.scale = None
        self.stack = [keras.layers.Dense(4), keras.layers.Dense(4)]
        self.by_name = {"b": keras.layers.LayerNormalization(), "a": keras.layers.Dense(4)}
        self.nested = [[keras.layers.Dense(4)], [keras.layers.Dense(4), keras.layers.Dense(4)]]

    def build(self, input_shape):
        self.scale = self.add_weight(shape=(4,), name="scale", initializer="ones")
        for layer in self.stack:
            layer.build(input_shape)
        self.by_name["b"].build(input_shape)
        self.by_name["a"].build(input_shape)
        for group in self.nested:
            for layer in group:
                layer.build(input_shape)

    def call(self, x):
        for layer in self.stack:
            x = layer(x)
        x = self.by_name["a"](self.by_name["b"](x))
        for group in self.nested:
            for layer in group:
                x = layer(x)
        return x * self.scale


class _Nested(keras.Model):
    """Sub-layers under attribute names that sort before and after `layers`, in containers."""

    def __init__(self):
        super().__init__(name="nested")
        self.aaa_blocks = [_Block(), _Block()]
        self.zzz_head = keras.layers.Dense(2)
        self.mmm = {"first": keras.layers.Dense(4), "second": [keras.layers.Dense(4)]}

    def call(self, x):
        for block in self.aaa_blocks:
            x = block(x)
        x = self.mmm["second"][0](self.mmm["first"](x))
        return self.zzz_head(x)


class _ListsItsAttributes(keras.Model):
    """A class with its own `__dir__`, which hides one sub-layer: Keras's walk reads `dir()`."""

    def __init__(self):
        super().__init__(name="lists_its_attributes")
        self.shown = keras.layers.Dense(4)
        self.hidden = keras.layers.Dense(2)

    def __dir__(self):
        return [name for name in super().__dir__() if name != "hidden"]

    def call(self, x):
        return self.hidden(self.shown(x))


def _every_family() -> keras.Model:
    """One layer of each Keras family that holds weights, in a functional model."""
    image = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(4, 3, padding="same")(image)
    x = keras.layers.DepthwiseConv2D(3, padding="same")(x)
    x = keras.layers.SeparableConv2D(4, 3, padding="same")(x)
    x = keras.layers.Conv2DTranspose(4, 3, padding="same")(x)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.GroupNormalization(groups=2)(x)
    x = keras.layers.PReLU()(x)
    x = keras.layers.Reshape((16, 16))(x)
    x = keras.layers.Conv1D(8, 3, padding="same")(x)
    x = keras.layers.Conv1DTranspose(8, 3, padding="same")(x)
    x = keras.layers.LSTM(8, return_sequences=True)(x)
    x = keras.layers.GRU(8, return_sequences=True)(x)
    x = keras.layers.Bidirectional(keras.layers.SimpleRNN(4, return_sequences=True))(x)
    x = keras.layers.MultiHeadAttention(2, 4)(x, x)
    x = keras.layers.GroupQueryAttention(4, 4, 2)(x, x)
    x = keras.layers.LayerNormalization()(x)
    x = keras.layers.RMSNormalization()(x)
    x = keras.layers.EinsumDense("abc,cd->abd", (16, 8), bias_axes="d")(x)
    x = keras.layers.Dropout(0.1)(x)
    x = keras.layers.TimeDistributed(keras.layers.Dense(4))(x)
    x = keras.layers.Flatten()(x)
    tokens = keras.Input((5,), dtype="int32")
    t = keras.layers.Embedding(32, 4)(tokens)
    t = keras.layers.Conv1D(4, 2)(t)
    t = keras.layers.GlobalAveragePooling1D()(t)
    x = keras.layers.Concatenate()([x, t])
    x = keras.layers.UnitNormalization()(x)
    outputs = keras.layers.Dense(3)(x)
    return keras.Model([image, tokens], outputs)


def _compiled(model: keras.Model, inputs) -> keras.Model:
    """Built, compiled, its optimizer built, every variable holding distinct values."""
    if not model.built:
        model(inputs)
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    model.optimizer.build(model.trainable_variables)
    state = model.variables + model.optimizer.variables
    for i, variable in enumerate(state):
        size = int(np.prod(variable.shape))
        variable.assign(np.arange(i, i + size).reshape(variable.shape).astype(variable.dtype))
    return model


def _family_inputs():
    rng = np.random.default_rng(0)
    return [rng.random((4, 8, 8, 3), dtype="float32"), rng.integers(0, 32, (4, 5))]


def _h5_datasets(path: Path) -> dict[str, np.ndarray]:
    found: dict[str, np.ndarray] = {}
    with h5py.File(path, "r") as file:
        file.visititems(
            lambda name, obj: (
                found.__setitem__(name, obj[()]) if isinstance(obj, h5py.Dataset) else None
            )
        )
    return found


@pytest.mark.parametrize(
    ("build", "inputs"),
    [
        (_every_family, _family_inputs),
        (_Nested, lambda: np.random.default_rng(0).random((4, 4), dtype="float32")),
    ],
    ids=["every_layer_family", "nested_containers"],
)
def test_keys_are_the_datasets_of_keras_save_weights(tmp_path, build, inputs):
    model = _compiled(build(), inputs())
    model.save_weights(tmp_path / "m.weights.h5")
    datasets = _h5_datasets(tmp_path / "m.weights.h5")
    state = keyed_state(model)
    stored = {
        key: variable
        for key, variable in state.variables.items()
        if state.roles[key] != "metric" and "/seed_generators/" not in key
    }
    assert sorted(stored) == sorted(datasets)
    for key, variable in stored.items():
        np.testing.assert_array_equal(np.asarray(variable.value), datasets[key], err_msg=key)
    assert not [key for key in state.variables if key.startswith("unreached/")]


@pytest.mark.parametrize(
    ("build", "inputs"),
    [
        (_every_family, _family_inputs),
        (_Nested, lambda: np.random.default_rng(0).random((4, 4), dtype="float32")),
        (_sequential, lambda: np.random.default_rng(0).random((2, 4), dtype="float32")),
        (_ListsItsAttributes, lambda: np.random.default_rng(0).random((2, 4), dtype="float32")),
    ],
    ids=["every_layer_family", "nested_containers", "sequential", "own_dir"],
)
def test_the_walk_visits_what_keras_saving_walk_does(build, inputs):
    """`keras_compat.walk_saveable` caches the attribute order of Keras's `_walk_saveable`; for every
    object the keys reach (layers, cells, the optimizer, metrics...), both yield the same names,
    in the same order, with the same saveable children."""
    from keras.src.saving import saving_lib

    from keras_orbax._src.compat import keras_compat
    from keras_orbax._src.model.state_keys import saveables

    model = _compiled(build(), inputs())
    walked = 0
    for _, saveable in saveables(model):
        ours = list(keras_compat.walk_saveable(saveable))
        theirs = list(saving_lib._walk_saveable(saveable))
        assert [name for name, _ in ours] == [name for name, _ in theirs], type(saveable)
        for (name, child), (_, keras_child) in zip(ours, theirs, strict=True):
            if keras_compat.is_saveable(keras_child) or isinstance(keras_child, keras.Variable):
                assert child is keras_child, name
        walked += 1
    assert walked > len(model.layers)  # the model, its layers, the optimizer, ...


def test_keras_snake_case_names_groups():
    keys = list(keyed_variables(_compiled(_every_family(), _family_inputs())))
    assert "layers/conv2d/vars/0" in keys and "layers/lstm/cell/vars/0" in keys
    assert not [key for key in keys if "conv2_d" in key or "l_s_t_m" in key]


class TwoWeights(keras.layers.Layer):
    def build(self, input_shape):
        self.a = self.add_weight(shape=(2,), name="w")
        self.b = self.add_weight(shape=(2,), name="w")

    def call(self, x):
        return x * self.a * self.b


def test_variables_with_the_same_path_are_told_apart_by_position(tmp_path):
    model = keras.Sequential([keras.Input((2,)), TwoWeights(name="twice")], name="dup")
    layer = model.layers[0]
    assert layer.a.path == layer.b.path == "dup/twice/w"
    layer.a.assign([1.0, 2.0])
    layer.b.assign([3.0, 4.0])
    keras_orbax.save(model, tmp_path, step=1)
    target = keras.Sequential([keras.Input((2,)), TwoWeights(name="twice")], name="dup")
    keras_orbax.restore_sharded(target, tmp_path)
    np.testing.assert_array_equal(np.asarray(target.layers[0].a.value), [1.0, 2.0])
    np.testing.assert_array_equal(np.asarray(target.layers[0].b.value), [3.0, 4.0])


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


def _v0_1_model() -> keras.Model:
    """The model tests/data/make_v0_1_checkpoint.py saved with keras-orbax 0.1 (uncompiled)."""
    inputs = keras.Input((8,))
    x = keras.layers.Dense(16, name="hidden")(inputs)
    x = keras.layers.Dropout(0.25)(x)
    outputs = keras.layers.Dense(4, name="head")(x)
    return keras.Model(inputs, outputs, name="v01")


@pytest.mark.parametrize("deferred", [False, True], ids=["built", "deferred"])
def test_a_checkpoint_written_by_0_1_restores(distribution, deferred):
    distribution(_models.model_parallel((4, 2)))
    assert keras_orbax.inspect(DATA / "v0_1_checkpoint").record.format_version == 1
    with keras_orbax.deferred_init() if deferred else contextlib.nullcontext():
        model = _v0_1_model()
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    result = keras_orbax.restore_sharded(model, DATA / "v0_1_checkpoint")
    assert result.step == 2 and result.epoch == 1
    expected = np.load(DATA / "v0_1_expected.npz")
    state = model.variables + model.optimizer.variables
    assert len(state) == len(expected.files)
    for i, variable in enumerate(state):
        np.testing.assert_array_equal(np.asarray(variable.value), expected[f"v{i}"], variable.path)


def test_the_walk_leaves_out_only_what_a_lora_layer_computes():
    """Once LoRA is enabled, Keras's Dense, EinsumDense and Embedding compute `kernel` and
    `embeddings` (a matmul on the devices) at every read; the walk skips exactly those, which are
    tensors, not state, so the keys are Keras's walk's."""
    from keras.src.saving import saving_lib

    from keras_orbax._src.compat import keras_compat

    inputs = keras.Input((3,), dtype="int32")
    x = keras.layers.Embedding(10, 8, name="embed")(inputs)
    x = keras.layers.EinsumDense("abc,cd->abd", (3, 4), name="einsum")(x)
    model = keras.Model(inputs, keras.layers.Dense(2, name="dense")(x))
    for layer in model.layers[1:]:
        layer.enable_lora(2)
    for layer, computed in (("embed", "embeddings"), ("einsum", "kernel"), ("dense", "kernel")):
        saveable = model.get_layer(layer)
        ours = [name for name, _ in keras_compat.walk_saveable(saveable)]
        theirs = dict(saving_lib._walk_saveable(saveable))
        assert [name for name in theirs if name != computed] == ours, layer
        assert not isinstance(theirs[computed], keras.Variable), layer
        assert not keras_compat.is_saveable(theirs[computed]), layer
    assert len(keyed_variables(model)) == len(model.variables)


def test_metric_state_reaches_metrics_renamed_by_keras_counters(tmp_path):
    """Metric variables are keyed by path; compiled again in one process, two AUCs and a Precision
    are `auc_2`, `auc_3`, `precision_1`. Each still gets its own saved accumulators."""

    def compiled() -> keras.Model:
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, activation="sigmoid")])
        metrics = [keras.metrics.AUC(), keras.metrics.AUC(curve="PR"), keras.metrics.Precision()]
        model.compile(optimizer="adam", loss="binary_crossentropy", metrics=metrics)
        rng = np.random.default_rng(0)
        x, y = rng.random((16, 4), "float32"), (rng.random((16, 1)) > 0.5).astype("float32")
        model.fit(x, y, epochs=1, batch_size=4, verbose=0)
        return model

    saved = compiled()
    keras_orbax.save(saved, tmp_path, step=1)
    restored = compiled()
    assert [v.path for v in restored.metrics_variables] != [v.path for v in saved.metrics_variables]
    for variable in restored.metrics_variables:
        variable.assign(np.zeros(variable.shape, variable.dtype))
    result = keras_orbax.restore_sharded(restored, tmp_path)
    assert result.skipped == ()
    for got, want in zip(restored.metrics_variables, saved.metrics_variables, strict=True):
        np.testing.assert_array_equal(np.asarray(got.value), np.asarray(want.value), want.path)


def test_a_float8_layer_restores_however_it_was_built(tmp_path):
    """`quantize("float8")` creates a Dense's variables kernel first, a float8 dtype policy (the
    config, as `load_model` builds it) scales first: each variable still gets its own value."""

    def float8(policy: str | None = None) -> keras.Model:
        inputs = keras.Input((6,))
        dense = keras.layers.Dense(2, name="d", dtype=policy)
        return keras.Model(inputs, dense(inputs))

    saved = float8()
    saved.quantize("float8")
    layer = saved.get_layer("d")
    for i, variable in enumerate(own_variables(layer)):
        variable.assign(np.full(variable.shape, i + 1, variable.dtype))
    keras_orbax.save(saved, tmp_path, step=1)
    built = float8("float8_from_float32")
    assert [v.name for v in built.weights] != [v.name for v in saved.weights]  # the case in point
    keras_orbax.restore_sharded(built, tmp_path)
    for restored in (built, keras_orbax.load_model(tmp_path)):
        values = {v.name: np.asarray(v.value) for v in restored.get_layer("d").weights}
        for variable in own_variables(layer):
            np.testing.assert_array_equal(values[variable.name], np.asarray(variable.value))
