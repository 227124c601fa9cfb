"""`keras_orbax.from_preset` against keras-hub's own `from_preset`: Keras-format presets and Hugging Face
directories, built deferred under the backbone's own layout map, every value equal."""

from __future__ import annotations

import jax
import keras
import numpy as np
import pytest

import keras_orbax
from tests._hub import TINY_GEMMA, import_keras_hub
from tests.test_hf_safetensors import GEMMA, LLAMA
from tests.test_no_code import no_code_execution

keras_hub = import_keras_hub()


def _distribution(cls, shape=(4, 2)) -> keras.distribution.ModelParallel:
    mesh = keras.distribution.DeviceMesh(shape, ("batch", "model"), jax.devices())
    return keras.distribution.ModelParallel(
        layout_map=cls.get_layout_map(mesh), batch_dim_name="batch"
    )


def _assert_same(model: keras.Model, expected: keras.Model) -> None:
    assert len(model.weights) == len(expected.weights)
    for got, want in zip(model.weights, expected.weights, strict=True):
        np.testing.assert_array_equal(np.asarray(got.value), np.asarray(want.value), got.path)


def _exported(tmp_path, cls, config):
    directory = tmp_path / cls.__name__
    cls(**config).export_to_transformers(str(directory))
    return directory


@pytest.mark.parametrize(
    ("cls", "config", "mesh"),
    [
        (keras_hub.models.Llama3Backbone, LLAMA, (2, 4)),
        (keras_hub.models.GemmaBackbone, GEMMA, (8, 1)),  # one key/value head: no "model" split
    ],
    ids=["llama3", "gemma"],
)
def test_hugging_face_directory_loads_like_keras_hub(
    tmp_path, distribution, monkeypatch, cls, config, mesh
):
    directory = _exported(tmp_path, cls, config)
    distribution(_distribution(cls, mesh))
    expected = cls.from_preset(str(directory))
    with no_code_execution(monkeypatch) as calls:
        model = keras_orbax.from_preset(cls, str(directory))
    assert calls == []
    _assert_same(model, expected)
    for got, want in zip(model.weights, expected.weights, strict=True):
        assert got.value.sharding.is_equivalent_to(want.value.sharding, len(got.shape)), got.path


def test_keras_format_preset_loads_like_keras_hub(tmp_path, distribution, monkeypatch):
    cls = keras_hub.models.GemmaBackbone
    distribution(_distribution(cls, (2, 4)))
    cls(**TINY_GEMMA).save_to_preset(str(tmp_path / "preset"))
    distribution(_distribution(cls))
    expected = cls.from_preset(str(tmp_path / "preset"))
    with no_code_execution(monkeypatch) as calls:
        model = keras_orbax.from_preset(cls, str(tmp_path / "preset"))
    assert calls == []
    _assert_same(model, expected)
    kernel = model.get_layer("decoder_block_0").attention.query_dense.kernel.value
    assert kernel.sharding.mesh.devices.shape == (4, 2)


def test_a_task_preset_loads_like_keras_hub(tmp_path, distribution, monkeypatch):
    backbone = keras_hub.models.GemmaBackbone(**TINY_GEMMA)
    keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None).save_to_preset(
        str(tmp_path / "task")
    )
    expected = keras_hub.models.GemmaCausalLM.from_preset(str(tmp_path / "task"), preprocessor=None)
    distribution(_distribution(keras_hub.models.GemmaBackbone, (2, 4)))
    with no_code_execution(monkeypatch) as calls:
        model = keras_orbax.from_preset(
            keras_hub.models.GemmaCausalLM, str(tmp_path / "task"), preprocessor=None
        )
    assert calls == []
    assert isinstance(model, keras_hub.models.GemmaCausalLM)
    _assert_same(model, expected)
    inputs = {"token_ids": np.ones((2, 8), "int32"), "padding_mask": np.ones((2, 8), "int32")}
    np.testing.assert_allclose(model(inputs), expected(inputs), rtol=1e-5, atol=1e-5)


def test_a_task_with_its_own_head_loads_it_as_keras_hub_does(tmp_path, distribution):
    """A classifier's head is in `task.weights.h5`: keras-hub's own `load_task_weights` reads it
    after the backbone is restored sharded (it had kept its random initial values)."""
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=64,
        num_layers=2,
        num_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        max_sequence_length=16,
    )
    saved = keras_hub.models.BertTextClassifier(backbone=backbone, num_classes=3, preprocessor=None)
    saved.save_to_preset(str(tmp_path / "classifier"))
    assert (tmp_path / "classifier" / "task.weights.h5").is_file()
    distribution(keras.distribution.DataParallel())
    model = keras_orbax.from_preset(
        keras_hub.models.TextClassifier, tmp_path / "classifier", preprocessor=None
    )
    assert isinstance(model, keras_hub.models.BertTextClassifier)
    _assert_same(model, saved)


def test_strict_false_is_what_the_mismatch_error_advises(tmp_path, distribution):
    """A preset whose config has fewer layers than its weights: refused, with the advice to pass
    strict=False, which from_preset takes (keras-hub's own from_preset swallows it unread)."""
    import json

    saved = keras_hub.models.GemmaBackbone(**TINY_GEMMA)
    saved.save_to_preset(str(tmp_path / "preset"))
    config_file = tmp_path / "preset" / "config.json"
    config = json.loads(config_file.read_text())
    config["config"]["num_layers"] -= 1
    config_file.write_text(json.dumps(config))
    distribution(keras.distribution.DataParallel())
    gemma = keras_hub.models.GemmaBackbone
    with pytest.raises(keras_orbax.errors.CheckpointMismatchError, match="pass strict=False"):
        keras_orbax.from_preset(gemma, tmp_path / "preset")
    model = keras_orbax.from_preset(gemma, tmp_path / "preset", strict=False)
    assert model.num_layers == TINY_GEMMA["num_layers"] - 1  # the last layer's weights unread
    embeddings = [m.get_layer("token_embedding").embeddings.value for m in (model, saved)]
    np.testing.assert_array_equal(*map(np.asarray, embeddings))


def test_a_preset_records_no_checksums_and_from_preset_says_so_only_when_asked(
    tmp_path, distribution
):
    """By default a preset is read quietly (it records no checksums); `verify=True` warns that
    nothing was verified; `verify=False` is accepted too."""
    import warnings

    cls = keras_hub.models.GemmaBackbone
    distribution(_distribution(cls))
    cls(**TINY_GEMMA).save_to_preset(str(tmp_path / "preset"))
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "error", message=".*verif", category=keras_orbax.errors.KerasOrbaxWarning
        )
        keras_orbax.from_preset(cls, str(tmp_path / "preset"))
    with pytest.warns(keras_orbax.errors.KerasOrbaxWarning, match="nothing was verified"):
        keras_orbax.from_preset(cls, str(tmp_path / "preset"), verify=True)
    keras_orbax.from_preset(cls, str(tmp_path / "preset"), verify=False)
