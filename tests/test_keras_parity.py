"""Everything Keras's own round trip keeps, a step keeps: values a layer's `save_own_variables`
stores that are no variable, files its `save_assets` writes, state its `load_own_variables` sets.

The oracle is Keras: `model.save(x.keras)` + `keras.saving.load_model` of the same model. Every
case is saved under one `ModelParallel` mesh and restored under another.
"""

from __future__ import annotations

import inspect
import os

import keras
import numpy as np
import pytest

import keras_orbax
from keras_orbax.errors import CheckpointMismatchError, CorruptCheckpointError, KerasOrbaxWarning
from tests import _harness, _models

X = np.arange(32, dtype="float32").reshape(8, 4) / 10


@keras.saving.register_keras_serializable("parity")
class Table(keras.layers.Layer):
    """Stores a NumPy table that is no variable, and writes a vocabulary file as an asset; both
    change what it computes."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.table = np.zeros((4,), "float32")
        self.words = ["[UNK]"]

    def build(self, input_shape):
        self.scale = self.add_weight(shape=(4,), initializer="ones", name="scale")

    def call(self, x):
        return x * self.scale + self.table + len(self.words)

    def save_own_variables(self, store):
        super().save_own_variables(store)
        store["table"] = self.table

    def load_own_variables(self, store):
        self.scale.assign(store["0"])
        self.table = np.asarray(store["table"])

    def save_assets(self, dir_path):
        with open(os.path.join(dir_path, "words.txt"), "w") as file:
            file.write("\n".join(self.words))

    def load_assets(self, dir_path):
        with open(os.path.join(dir_path, "words.txt")) as file:
            self.words = file.read().split("\n")


@keras.saving.register_keras_serializable("parity")
class Identity(keras.layers.Layer):
    def call(self, x):
        return x


def table_model(trained: bool) -> keras.Model:
    inputs = keras.Input((4,))
    table = Table(name="table")
    outputs = keras.layers.Dense(8, name="head")(table(inputs))
    model = keras.Model(inputs, outputs)
    if trained:
        table.table = np.arange(4, dtype="float32")
        table.words = ["[UNK]", "a", "b", "c"]
        table.scale.assign(np.full((4,), 2.0, "float32"))
    return model


@pytest.fixture
def saved_table(tmp_path, distribution):
    distribution(_models.model_parallel((2, 4)))
    model = table_model(trained=True)
    keras_orbax.save(model, tmp_path / "ckpt", step=1)
    model.save(tmp_path / "m.keras")
    expected = model.predict(X, verbose=0)
    keras_model = keras.saving.load_model(tmp_path / "m.keras")  # Keras's own round trip
    np.testing.assert_array_equal(keras_model.predict(X, verbose=0), expected)
    assert not np.allclose(table_model(trained=False).predict(X, verbose=0), expected)
    distribution(_models.model_parallel((4, 2)))  # restored on another mesh
    return tmp_path, expected, keras_model


def test_a_step_holds_non_variable_values_and_assets(saved_table):
    root, _, _ = saved_table
    folder = root / "ckpt" / "1" / "keras_state"
    assert {"asset_0", "manifest.json", "value_0.npy"} <= {p.name for p in folder.iterdir()}
    assert (folder / "asset_0").read_text() == "[UNK]\na\nb\nc"


@pytest.mark.parametrize("deferred", [False, True], ids=["built", "deferred"])
def test_restore_sharded_keeps_what_keras_keeps(saved_table, deferred):
    root, expected, keras_model = saved_table
    if deferred:
        with keras_orbax.deferred_init():
            model = table_model(trained=False)
    else:
        model = table_model(trained=False)
    keras_orbax.restore_sharded(model, root / "ckpt")
    table, keras_table = model.get_layer("table"), keras_model.get_layer("table")
    np.testing.assert_array_equal(table.table, keras_table.table)
    assert table.words == keras_table.words
    np.testing.assert_array_equal(model.predict(X, verbose=0), expected)
    assert model.get_layer("head").kernel.value.sharding.mesh.devices.shape == (4, 2)


def test_load_model_keeps_what_keras_keeps(saved_table):
    root, expected, _ = saved_table
    model = keras_orbax.load_model(root / "ckpt")
    assert model.get_layer("table").words == ["[UNK]", "a", "b", "c"]
    np.testing.assert_array_equal(model.predict(X, verbose=0), expected)


def test_a_damaged_keras_state_file_fails_before_any_change(saved_table):
    root, _, _ = saved_table
    (root / "ckpt" / "1" / "keras_state" / "asset_0").write_text("[UNK]\nx\ny\nz")
    model = table_model(trained=False)
    before = [np.asarray(v.value) for v in model.weights]
    with pytest.raises(CorruptCheckpointError, match=r"keras_state/asset_0"):
        keras_orbax.restore_sharded(model, root / "ckpt")
    for want, variable in zip(before, model.weights, strict=True):
        np.testing.assert_array_equal(np.asarray(variable.value), want)
    assert model.get_layer("table").words == ["[UNK]"]


def test_a_failing_layer_loader_puts_every_variable_back(saved_table, monkeypatch):
    root, _, _ = saved_table
    model = table_model(trained=False)
    before = [np.asarray(v.value) for v in model.weights]

    def refuse(self, dir_path):
        raise ValueError("not this vocabulary")

    monkeypatch.setattr(Table, "load_assets", refuse)
    with pytest.raises(CheckpointMismatchError, match="table: ValueError: not this vocabulary"):
        keras_orbax.restore_sharded(model, root / "ckpt")
    for want, variable in zip(before, model.weights, strict=True):
        np.testing.assert_array_equal(np.asarray(variable.value), want)


def test_a_step_saved_without_keras_state_says_what_it_lacks(saved_table):
    root, _, _ = saved_table
    for file in (root / "ckpt" / "1" / "keras_state").iterdir():
        file.unlink()
    (root / "ckpt" / "1" / "keras_state").rmdir()
    model = table_model(trained=False)
    with pytest.warns(KerasOrbaxWarning, match=r"table: table\). .*keep the values they had"):
        keras_orbax.restore_sharded(model, root / "ckpt")
    assert model.get_layer("table").words == ["[UNK]"]


def test_a_model_with_no_variables_saves_and_loads(tmp_path, distribution):
    distribution(_models.model_parallel((2, 4)))
    inputs = keras.Input((4,))
    model = keras.Model(inputs, Identity()(inputs))
    model.save(tmp_path / "m.keras")  # Keras saves and loads it
    keras.saving.load_model(tmp_path / "m.keras")
    keras_orbax.save(model, tmp_path / "ckpt", step=1)
    result = keras_orbax.restore_sharded(model, tmp_path / "ckpt")
    assert result.restored == () and result.step == 1
    loaded = keras_orbax.load_model(tmp_path / "ckpt")
    np.testing.assert_array_equal(loaded.predict(X, verbose=0), X)


def _overrides(cls: type, method: str) -> bool:
    own = getattr(cls, method, None)
    return own is not None and own is not getattr(keras.layers.Layer, method, None)


def stateful_keras_layers() -> list[type]:
    """Every layer class of `keras.layers` whose saving or loading is its own."""
    methods = ("save_own_variables", "load_own_variables", "save_assets", "load_assets")
    return sorted(
        {
            cls
            for _, cls in inspect.getmembers(keras.layers, inspect.isclass)
            if issubclass(cls, keras.layers.Layer) and any(_overrides(cls, m) for m in methods)
        },
        key=lambda cls: cls.__name__,
    )


def test_the_list_of_stateful_layers_is_what_keras_has():
    names = {cls.__name__ for cls in stateful_keras_layers()}
    assert {"Dense", "EinsumDense", "Embedding", "Normalization", "Discretization"} <= names
    assert {"StringLookup", "IntegerLookup", "TextVectorization"} <= names


def test_inspect_shows_what_a_step_keeps_besides_the_variables(saved_table):
    root, _, _ = saved_table
    info = keras_orbax.inspect(root / "ckpt")
    assert info.keras_state == {
        "layers/table/vars/table": "value  (4,) float32",
        "layers/table/words.txt": "asset  11 B",
    }
    assert "kept besides the variables (keras_state/):" in str(info)


def test_verify_checks_the_keras_state_files(saved_table):
    root, _, _ = saved_table
    assert keras_orbax.verify(root / "ckpt").intact
    (root / "ckpt" / "1" / "keras_state" / "value_0.npy").write_bytes(b"\x93NUMPY")
    with pytest.raises(CorruptCheckpointError, match=r"keras_state/value_0\.npy"):
        keras_orbax.verify(root / "ckpt")


def test_keras_loaders_keep_the_very_arrays_read(saved_table):
    """Running each layer's own loader (`keras_walk.replay`) hands Keras's `assign` the arrays
    already on their devices: each variable keeps the same array and the same shard buffers, so
    nothing is gathered onto one device or copied."""
    from keras_orbax._src.model import keras_walk

    root, _, _ = saved_table
    model = keras_orbax.load_model(root / "ckpt")
    model.compile(optimizer="adam", loss="mse")
    model.fit(X, np.zeros((8, 8), "float32"), verbose=0)  # optimizer slots too
    variables = [*model.weights, *model.optimizer.variables]

    def buffers(variable):
        return [s.data.unsafe_buffer_pointer() for s in variable.value.addressable_shards]

    before = [(v.value, buffers(v)) for v in variables]
    keras_walk.replay(model, None)
    for variable, (array, pointers) in zip(variables, before, strict=True):
        assert variable.value is array, variable.path
        assert buffers(variable) == pointers, variable.path
    kernel = model.get_layer("head").kernel.value
    assert len({s.device for s in kernel.addressable_shards}) == 8
    assert kernel.addressable_shards[0].data.shape == (1, 4)  # (4, 8) over the (4, 2) mesh


def test_convert_keeps_what_a_step_keeps_besides_the_variables(saved_table):
    root, expected, _ = saved_table
    keras_orbax.convert(root / "ckpt", root / "copy", step=5)
    model = table_model(trained=False)
    keras_orbax.restore_sharded(model, root / "copy")
    assert model.get_layer("table").words == ["[UNK]", "a", "b", "c"]
    np.testing.assert_array_equal(model.predict(X, verbose=0), expected)


def test_diff_compares_what_a_step_keeps_besides_the_variables(tmp_path, distribution):
    distribution(_models.model_parallel((2, 4)))
    model = table_model(trained=True)
    keras_orbax.save(model, tmp_path / "a", step=1)
    table = model.get_layer("table")
    table.table = table.table[::-1].copy()  # same shape and dtype, other values
    table.words = ["[UNK]", "a", "b", "d"]  # same size, other bytes
    keras_orbax.save(model, tmp_path / "b", step=1)

    by_keys = keras_orbax.diff(tmp_path / "a", tmp_path / "b")
    assert by_keys.identical and not by_keys.keras_state  # shapes, dtypes and sizes agree
    by_values = keras_orbax.diff(tmp_path / "a", tmp_path / "b", values=True)
    assert not by_values.identical
    assert set(by_values.max_abs_diff.values()) == {0.0}  # the variables are the same
    assert by_values.keras_state == {
        "keras_state/layers/table/vars/table": "(4,) float32 -> (4,) float32: values differ",
        "keras_state/layers/table/words.txt": "11 bytes -> 11 bytes: content differs",
    }
    assert "! keras_state/layers/table/words.txt" in str(by_values)
    assert keras_orbax.diff(tmp_path / "a", tmp_path / "a", values=True).identical


class _Saved(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(8)
        self.table = Table()

    def call(self, x):
        return self.dense(self.table(x))


class _Redefined(keras.Model):
    """The same layer held as `a_dense`, which Keras's walk meets first, and returned by a
    `dense` property: Keras's `load_weights` finds its state at `dense`."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.a_dense = keras.layers.Dense(8)
        self.a_table = Table()

    @property
    def dense(self):
        return self.a_dense

    @property
    def table(self):
        return self.a_table

    def call(self, x):
        return self.a_dense(self.a_table(x))


def test_an_attribute_redefined_as_a_property_restores_as_in_keras(tmp_path, distribution):
    distribution(_models.model_parallel((2, 4)))
    saved = _Saved()
    saved(X)
    saved.table.table, saved.table.words = np.arange(4, dtype="float32"), ["[UNK]", "z"]
    saved.save_weights(tmp_path / "m.weights.h5")
    keras_orbax.save(saved, tmp_path / "ckpt", step=1)
    keras_model = _Redefined()
    keras_model(X)
    keras_model.load_weights(tmp_path / "m.weights.h5")  # Keras resolves it
    np.testing.assert_array_equal(keras_model.a_table.table, saved.table.table)
    keras_model.a_table.words = saved.table.words  # assets: a `.weights.h5` holds none
    expected = saved.predict(X, verbose=0)
    np.testing.assert_array_equal(keras_model.predict(X, verbose=0), expected)
    distribution(_models.model_parallel((4, 2)))
    model = _Redefined()
    model(X)
    result = keras_orbax.restore_sharded(model, tmp_path / "ckpt")
    assert len(result.restored) == 3 and not result.skipped
    np.testing.assert_array_equal(model.a_table.table, np.arange(4, dtype="float32"))
    assert model.a_table.words == ["[UNK]", "z"]
    np.testing.assert_array_equal(model.predict(X, verbose=0), expected)


RNG = np.random.default_rng(0)
# Each stateful Keras layer in a small model, given state to keep (adapted, or its weights), with
# the data it takes. The lookup layers need TensorFlow at runtime (not a keras-orbax dependency).
NEEDS_TENSORFLOW = {"Hashing", "IntegerLookup", "StringLookup", "TextVectorization"}
# Preprocessing layers whose state is their config, checked all the same.
CONFIG_STATE = {"Hashing"}
NOT_ON_JAX = {"TorchModuleWrapper"}  # wraps a torch.nn.Module: the torch backend only


def _stateful(name: str) -> tuple[keras.Layer, keras.KerasTensor, np.ndarray]:
    """The layer, its model's input, and data for it."""
    floats = RNG.random((8, 8, 4)).astype("float32")
    if name.startswith("Conv"):
        rank = int(name[-2])
        shape = (6,) * rank + (2,)
        layer = getattr(keras.layers, name)(4, 3, name="layer")
        return layer, keras.Input(shape), RNG.random((8, *shape)).astype("float32")
    if name in ("Embedding", "ReversibleEmbedding"):
        layer = getattr(keras.layers, name)(16, 4, name="layer")
        return layer, keras.Input((3,), dtype="int32"), RNG.integers(0, 16, (8, 3))
    if name in ("Dense", "TernaryDense"):  # TernaryDense: Keras 3.16 on
        return getattr(keras.layers, name)(4, name="layer"), keras.Input((8, 4)), floats
    if name == "EinsumDense":
        layer = keras.layers.EinsumDense("abc,cd->abd", (8, 4), bias_axes="d", name="layer")
        return layer, keras.Input((8, 4)), floats
    if name == "Normalization":
        layer = keras.layers.Normalization(name="layer")
        layer.adapt(RNG.random((64, 8, 4)).astype("float32") * 3 + 1)
        return layer, keras.Input((8, 4)), floats * 4
    if name == "Discretization":  # its state is its config (its `adapt` needs TensorFlow)
        layer = keras.layers.Discretization(bin_boundaries=[0.25, 0.5, 0.75], name="layer")
        return layer, keras.Input((8, 4)), floats
    if name in ("IntegerLookup", "StringLookup"):
        layer = getattr(keras.layers, name)(name="layer", output_mode="int")
        words = ["a", "b", "c", "d"] if name == "StringLookup" else [5, 7, 9, 11]
        layer.adapt(words * 3)
        dtype = "string" if name == "StringLookup" else "int64"
        return layer, keras.Input((2,), dtype=dtype), np.array([words[:2]] * 8)
    if name == "Hashing":
        layer = keras.layers.Hashing(num_bins=8, salt=[3, 5], name="layer")
        return layer, keras.Input((2,), dtype="int64"), RNG.integers(0, 100, (8, 2))
    if name == "TextVectorization":
        layer = keras.layers.TextVectorization(name="layer", output_sequence_length=3)
        layer.adapt(["the cat sat", "the dog ran", "a cat ran"])
        return layer, keras.Input((1,), dtype="string"), np.array([["the cat ran"]] * 8)
    raise AssertionError(f"no case for {name}: add one")


def _stateful_names() -> list[str]:
    # Conv1D and Convolution1D are one class: one case each class, by its own name.
    return sorted({cls.__name__ for cls in stateful_keras_layers()} - NOT_ON_JAX | CONFIG_STATE)


@pytest.mark.parametrize("name", _stateful_names())
def test_every_stateful_keras_layer_comes_back_as_keras_gives_it_back(tmp_path, distribution, name):
    if name in NEEDS_TENSORFLOW:
        pytest.importorskip("tensorflow")
    distribution(_head_parallel((2, 4)))
    keras.utils.set_random_seed(1)
    layer, inputs, data = _stateful(name)
    if data.dtype.kind == "U":  # strings: the layer runs on TensorFlow, outside a JAX model
        model = keras.Model(inputs, layer(inputs))
    else:
        outputs = keras.layers.Dense(8, name="head")(keras.ops.cast(layer(inputs), "float32"))
        model = keras.Model(inputs, outputs)
    expected = _outputs(model, data)
    model.save(tmp_path / "m.keras")
    keras_orbax.save(model, tmp_path / "ckpt", step=1)
    keras_model = keras.saving.load_model(tmp_path / "m.keras")  # Keras's own round trip
    np.testing.assert_array_equal(_outputs(keras_model, data), expected)
    distribution(_head_parallel((4, 2)))  # the head's sums split otherwise: not bit for bit
    loaded = keras_orbax.load_model(tmp_path / "ckpt")
    np.testing.assert_allclose(_outputs(loaded, data), expected, rtol=1e-5, atol=1e-7)
    keras.utils.set_random_seed(2)  # other initial values
    rebuilt = keras.Model.from_config(model.get_config())
    keras_orbax.restore_sharded(rebuilt, tmp_path / "ckpt")
    np.testing.assert_allclose(_outputs(rebuilt, data), expected, rtol=1e-5, atol=1e-7)
    for want, got in zip(keras_model.weights, rebuilt.weights, strict=True):
        np.testing.assert_array_equal(np.asarray(got.value), np.asarray(want.value))


def _outputs(model: keras.Model, data: np.ndarray) -> np.ndarray:
    if data.dtype.kind == "U":
        return np.asarray(model.get_layer("layer")(data))
    return model.predict(data, verbose=0)


def _head_parallel(shape: tuple[int, int]) -> keras.distribution.ModelParallel:
    """`head`'s kernel split over "model", the layer under test replicated (a conv kernel's
    3 x 3 window divides no mesh axis)."""
    layouts = keras.distribution.LayoutMap(keras.distribution.DeviceMesh(shape, ("batch", "model")))
    layouts["head/kernel"] = (None, "model")
    return keras.distribution.ModelParallel(layout_map=layouts, batch_dim_name="batch")


def test_a_keras_archive_gives_back_what_keras_gives_back(saved_table):
    root, expected, keras_model = saved_table
    model = table_model(trained=False)
    keras_orbax.restore_sharded(model, root / "m.keras")
    assert model.get_layer("table").words == keras_model.get_layer("table").words
    np.testing.assert_array_equal(model.get_layer("table").table, np.arange(4, dtype="float32"))
    np.testing.assert_array_equal(model.predict(X, verbose=0), expected)
    loaded = keras_orbax.load_model(root / "m.keras")
    np.testing.assert_array_equal(loaded.predict(X, verbose=0), expected)


def test_a_weights_file_gives_back_the_values_keras_stores(tmp_path):
    """A `.weights.h5` holds the table (a dataset no variable takes), not the words: Keras's
    `save_weights` writes no assets, and its `load_weights` leaves them as they are."""
    table_model(trained=True).save_weights(tmp_path / "t.weights.h5")
    keras_model, model = table_model(trained=False), table_model(trained=False)
    keras_model.load_weights(tmp_path / "t.weights.h5")
    keras_orbax.restore_sharded(model, tmp_path / "t.weights.h5")
    np.testing.assert_array_equal(
        model.get_layer("table").table, keras_model.get_layer("table").table
    )
    assert model.get_layer("table").words == keras_model.get_layer("table").words == ["[UNK]"]
    np.testing.assert_array_equal(model.predict(X, verbose=0), keras_model.predict(X, verbose=0))


def test_keras_state_in_object_storage(store, bucket, distribution):
    distribution(_models.model_parallel((2, 4)))
    model = table_model(trained=True)
    expected = model.predict(X, verbose=0)
    keras_orbax.save(model, f"{bucket}/run", step=1)
    assert keras_orbax.inspect(f"{bucket}/run").keras_state["layers/table/words.txt"]
    restored = table_model(trained=False)
    keras_orbax.restore_sharded(restored, f"{bucket}/run")
    assert restored.get_layer("table").words == ["[UNK]", "a", "b", "c"]
    np.testing.assert_array_equal(restored.predict(X, verbose=0), expected)


def test_save_weights_writes_the_values_keras_writes(saved_table):
    """keras-orbax's `save_weights` of a restored model: Keras's `load_weights` reads back the
    table (a `.weights.h5` holds no assets, in Keras as here)."""
    root, expected, _ = saved_table
    model = table_model(trained=False)
    keras_orbax.restore_sharded(model, root / "ckpt")
    keras_orbax.save_weights(model, root / "export.weights.h5")
    keras_model = table_model(trained=False)
    keras_model.load_weights(root / "export.weights.h5")
    np.testing.assert_array_equal(
        keras_model.get_layer("table").table, np.arange(4, dtype="float32")
    )
    keras_model.get_layer("table").words = model.get_layer("table").words  # assets: not in h5
    np.testing.assert_array_equal(keras_model.predict(X, verbose=0), expected)


def test_two_processes_keep_and_restore_a_layers_own_state(tmp_path):
    results = _harness.run_workers(
        _harness.WORKERS_DIR / "keras_state_multihost.py",
        num_processes=2,
        devices_per_process=4,
        args={"directory": str(tmp_path / "ckpt")},
    )
    for result in results:
        assert result["spans_processes"] and result["kernel_shards_equal"]
        assert result["table"] == [0.0, 1.0, 2.0, 3.0]
        assert result["words"] == ["[UNK]", "a", "b"]
    folder = tmp_path / "ckpt" / "1" / "keras_state"
    assert {"manifest.json", "value_0.npy", "asset_0"} <= {p.name for p in folder.iterdir()}


def test_a_compact_step_keeps_it_too(tmp_path, distribution):
    distribution(_models.model_parallel((2, 4)))
    model = table_model(trained=True)
    expected = model.predict(X, verbose=0)
    keras_orbax.save(model, tmp_path / "ckpt", step=1, format="compact")
    restored = table_model(trained=False)
    keras_orbax.restore_sharded(restored, tmp_path / "ckpt")
    assert restored.get_layer("table").words == ["[UNK]", "a", "b", "c"]
    np.testing.assert_array_equal(restored.predict(X, verbose=0), expected)


def test_model_checkpoint_keeps_it_and_resumes_with_it(tmp_path, distribution):
    distribution(_models.model_parallel((2, 4)))
    model = table_model(trained=True)
    model.compile(optimizer="adam", loss="mse")
    y = np.zeros((8, 8), "float32")
    model.fit(X, y, epochs=1, verbose=0, callbacks=[keras_orbax.ModelCheckpoint(tmp_path / "c")])
    resumed = table_model(trained=False)
    resumed.compile(optimizer="adam", loss="mse")
    callback = keras_orbax.ModelCheckpoint(tmp_path / "c", resume=True)
    resumed.fit(X, y, epochs=1, verbose=0, callbacks=[callback])  # restores, then has nothing to do
    assert callback.restored is not None and callback.restored.step is not None
    assert resumed.get_layer("table").words == ["[UNK]", "a", "b", "c"]
    np.testing.assert_array_equal(resumed.predict(X, verbose=0), model.predict(X, verbose=0))


def test_a_lookup_vocabulary_file_rewritten_after_the_save(tmp_path):
    """The issue's case: Keras gives back the saved vocabulary, not the file's current words."""
    pytest.importorskip("tensorflow")
    vocabulary = tmp_path / "vocabulary.txt"
    vocabulary.write_text("a\nb\nc")

    def lookup_model() -> keras.Model:
        inputs = keras.Input((1,), dtype="string")
        return keras.Model(inputs, keras.layers.StringLookup(vocabulary=str(vocabulary))(inputs))

    model = lookup_model()
    model.save(tmp_path / "m.keras")
    keras_orbax.save(model, tmp_path / "ckpt", step=1)
    vocabulary.write_text("x\ny")
    saved = keras.saving.load_model(tmp_path / "m.keras").layers[-1].get_vocabulary()
    assert saved == ["[UNK]", "a", "b", "c"]  # Keras's own round trip
    assert keras_orbax.load_model(tmp_path / "ckpt").layers[-1].get_vocabulary() == saved
    restored = lookup_model()  # built from the file's current words
    keras_orbax.restore_sharded(restored, tmp_path / "ckpt")
    assert restored.layers[-1].get_vocabulary() == saved
