"""What Keras and keras-hub users type out of habit: Keras's positional callback arguments, a Keras
`filepath` as the checkpoint directory, keras-hub's own `from_preset` keywords and generic classes,
the arguments of `from_preset` swapped. Each either works as keras-hub's own call does (values
compared with it) or gets a one-line error that says what to write."""

from __future__ import annotations

import functools
import inspect

import jax
import keras
import numpy as np
import pytest

import keras_orbax
from keras_orbax.errors import KerasOrbaxError, NotDeferrableError
from tests._hub import TINY_GEMMA, import_keras_hub

# -- ModelCheckpoint ------------------------------------------------------------------------------


def test_keras_positional_arguments_are_refused(tmp_path):
    keras_style = (tmp_path / "ckpt", "val_loss", 1, True, "min")
    # Keras's OrbaxCheckpoint takes this call, its fifth argument being `mode`...
    bound = inspect.signature(keras.callbacks.OrbaxCheckpoint).bind(*keras_style)
    assert bound.arguments["mode"] == "min"
    # ...where it would set keras-orbax's `save_weights_only` if that were positional.
    with pytest.raises(TypeError, match="positional"):
        keras_orbax.ModelCheckpoint(*keras_style)
    checkpoint = keras_orbax.ModelCheckpoint(
        tmp_path / "ckpt", monitor="val_loss", verbose=1, save_best_only=True, mode="min"
    )
    assert (checkpoint.mode, checkpoint.save_weights_only) == ("min", False)


@pytest.mark.parametrize(
    ("directory", "names"),
    [
        ("ep{epoch:02d}.weights.h5", "'{epoch}'"),
        ("ckpt-{epoch}-{val_loss:.2f}", "'{epoch}', '{val_loss}'"),
        ("runs/{epoch}/", "'{epoch}'"),
        ("model.keras", "'.keras' suffix"),
        ("model.weights.h5", "'.weights.h5' suffix"),
        ("model.h5", "'.h5' suffix"),
        ("model.weights.json", "'.weights.json' suffix"),
        ("best.KERAS/", "'.keras' suffix"),
    ],
)
def test_a_keras_filepath_is_refused_before_anything_is_created(
    tmp_path, monkeypatch, directory, names
):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as raised:
        keras_orbax.ModelCheckpoint(directory)
    message = str(raised.value)
    assert "\n" not in message
    assert "one subdirectory per step" in message
    assert names in message
    assert message.endswith(f"Received: directory={directory!r}")
    assert ("save_weights_only=True" in message) == (".weights." in directory)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("directory", ["run.1", "ckpt_h5", "odd{name", "keras"])
def test_a_directory_that_only_looks_odd_is_taken(tmp_path, directory):
    checkpoint = keras_orbax.ModelCheckpoint(tmp_path / directory)
    assert checkpoint.directory == str(tmp_path / directory)


# -- from_preset ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hub():
    """`keras_hub.models` (the callback tests above run without keras-hub)."""
    return import_keras_hub().models


@pytest.fixture(scope="module")
def presets(hub, tmp_path_factory):
    """A tiny Gemma backbone preset and a CausalLM task preset (no tokenizer), saved by keras-hub."""
    root = tmp_path_factory.mktemp("presets")
    previous = keras.distribution.distribution()
    keras.distribution.set_distribution(None)
    try:
        backbone = hub.GemmaBackbone(**TINY_GEMMA)
        backbone.save_to_preset(str(root / "backbone"))
        task = hub.GemmaCausalLM(backbone=backbone, preprocessor=None)
        task.save_to_preset(str(root / "task"))
    finally:
        keras.distribution.set_distribution(previous)
    return {"backbone": str(root / "backbone"), "task": str(root / "task")}


def _model_parallel(hub) -> keras.distribution.ModelParallel:
    mesh = keras.distribution.DeviceMesh((2, 4), ("batch", "model"), jax.devices())
    layout_map = hub.GemmaBackbone.get_layout_map(mesh)
    return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")


def _embeddings(model: keras.Model) -> keras.Variable:
    backbone = getattr(model, "backbone", model)
    return backbone.get_layer("token_embedding").embeddings


def _assert_same(model: keras.Model, expected: keras.Model) -> None:
    assert type(model) is type(expected)
    assert [w.path for w in model.weights] == [w.path for w in expected.weights]
    for got, want in zip(model.weights, expected.weights, strict=True):
        assert got.dtype == want.dtype, got.path
        np.testing.assert_array_equal(np.asarray(got.value), np.asarray(want.value), got.path)


def _kwargs(hub, cls: type) -> dict:
    return (
        {"preprocessor": None} if issubclass(cls, hub.Task) else {}
    )  # the presets hold no tokenizer


@pytest.mark.parametrize(
    ("name", "preset", "concrete"),
    [
        ("CausalLM", "task", "GemmaCausalLM"),
        ("Backbone", "backbone", "GemmaBackbone"),
        ("Backbone", "task", "GemmaBackbone"),
    ],
)
def test_generic_classes_resolve_as_keras_hub_resolves_them(
    hub, presets, distribution, name, preset, concrete
):
    cls = getattr(hub, name)
    expected = cls.from_preset(presets[preset], **_kwargs(hub, cls))
    distribution(_model_parallel(hub))
    model = keras_orbax.from_preset(cls, presets[preset], **_kwargs(hub, cls))
    assert type(model).__name__ == concrete
    _assert_same(model, expected)
    embeddings = _embeddings(model).value  # read onto the distribution's layout
    assert embeddings.sharding.mesh.devices.shape == (2, 4)


@pytest.mark.parametrize("name", ["GemmaCausalLM", "GemmaBackbone", "Backbone"])
def test_dtype_is_passed_on_as_keras_hub_passes_it(hub, presets, name):
    cls = getattr(hub, name)
    expected = cls.from_preset(presets["task"], dtype="bfloat16", **_kwargs(hub, cls))
    model = keras_orbax.from_preset(cls, presets["task"], dtype="bfloat16", **_kwargs(hub, cls))
    _assert_same(model, expected)
    assert _embeddings(model).dtype == "bfloat16"


@pytest.mark.parametrize("name", ["GemmaCausalLM", "Backbone"])
def test_load_weights_false_returns_keras_hubs_own_model(hub, presets, name):
    cls = getattr(hub, name)
    keras.utils.set_random_seed(7)
    expected = cls.from_preset(presets["task"], load_weights=False, **_kwargs(hub, cls))
    keras.utils.set_random_seed(7)
    model = keras_orbax.from_preset(cls, presets["task"], load_weights=False, **_kwargs(hub, cls))
    _assert_same(model, expected)  # initialized as keras-hub initializes it, every value there
    saved = _embeddings(hub.GemmaBackbone.from_preset(presets["task"])).numpy()
    assert not np.array_equal(_embeddings(model).numpy(), saved)  # and no weights read


def test_swapped_arguments_get_a_one_line_hint(hub, presets):
    with pytest.raises(TypeError) as raised:
        keras_orbax.from_preset(presets["backbone"], hub.GemmaBackbone)
    message = str(raised.value)
    assert "\n" not in message
    assert f"keras_orbax.from_preset(GemmaBackbone, {presets['backbone']!r})" in message


def test_a_class_without_weights_is_refused(hub, presets):
    with pytest.raises(TypeError, match="keras-hub backbone or task class") as raised:
        keras_orbax.from_preset(hub.GemmaTokenizer, presets["backbone"])
    assert "\n" not in str(raised.value)


# -- NotDeferrableError: public, with advice for where it was raised -----------------------------


@functools.cache
def _counting_backbone(hub) -> type:
    """A registered keras-hub backbone that makes a variable from a number (Keras cannot defer it)."""

    @keras.saving.register_keras_serializable("keras_orbax_test_habits")
    class CountingBackbone(hub.Backbone):
        def __init__(self, units: int = 4, **kwargs):
            inputs = keras.Input((4,))
            outputs = keras.layers.Dense(units, name="dense")(inputs)
            super().__init__(inputs=inputs, outputs=outputs, **kwargs)
            self.units = units
            self.calls = keras.Variable(0, trainable=False, name="calls")

        def get_config(self):
            return {**super().get_config(), "units": self.units}

    return CountingBackbone


def test_not_deferrable_in_from_preset_advises_what_works(hub, tmp_path):
    cls = _counting_backbone(hub)
    preset = str(tmp_path / "counting")
    cls().save_to_preset(preset)
    with pytest.raises(NotDeferrableError) as raised:
        keras_orbax.from_preset(cls, preset)
    message = str(raised.value)
    assert isinstance(raised.value, KerasOrbaxError) and isinstance(raised.value, ValueError)
    assert "\n" not in message and "compile" not in message
    advice = f"CountingBackbone.from_preset({preset!r}, load_weights=False)"
    assert f"{advice}; keras_orbax.restore_sharded(model, {preset!r})" in message
    model = cls.from_preset(preset, load_weights=False)  # the advice, followed
    keras_orbax.restore_sharded(model, preset)
    _assert_same(model, cls.from_preset(preset))


def test_not_deferrable_in_a_deferred_init_block_advises_compiling_after_it():
    expected = pytest.raises(NotDeferrableError, match="compile after the `with` block")
    with expected, keras_orbax.deferred_init():
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2)])
        model.compile(optimizer="adam", loss="mse")
        model.optimizer.build(model.trainable_variables)
