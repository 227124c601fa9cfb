"""`get_layout_map` shards every keras-hub backbone over a (2, 4) mesh.

The backbones are keras-hub's own, in the tiny configs of tests/_hub_backbones.py (after keras-hub's
own tests; tests/test_hub_backbones.py checks that they name every keras-hub backbone), which the
mesh divides. Where keras-hub has a map of its own, its key/value heads (4) divide the model axis
(4), except Gemma's here (2), so that keras-hub's own map cannot be used as it is. Each backbone is
split evenly, and computes sharded what it computes unsharded.
"""

from __future__ import annotations

import math
import os
import warnings

import jax
import keras
import numpy as np
import pytest

import keras_orbax
from keras_orbax._src.compat import keras_compat
from keras_orbax.errors import CheckpointNotFoundError, KerasOrbaxWarning
from tests._hub_backbones import BACKBONES, keras_hub

# This test's changes to the shared configs.
CHANGED = {"GemmaBackbone": dict(num_key_value_heads=2)}
# keras-hub's own maps, kept wherever their layouts divide the variable.
HUB_MAPPED = {"GemmaBackbone", "LlamaBackbone", "Llama3Backbone", "QwenBackbone"}
HUB_MAPPED |= {"Qwen2Backbone", "QwenMoeBackbone", "Qwen3MoeBackbone"}
# The backbones that the map leaves above 1.25 x an even split, each with what its warning says.
UNEVEN = {
    # keras-hub leaves their convolutions unnamed (`conv2d_12`): those of one name share one key,
    # so one layout (Keras numbers them anew in every build, so that no key can tell them apart),
    # and one of them divides over the model axis alone (its input channels are the image's 3, or
    # it is depthwise: 1).
    "BASNetBackbone": r"conv2d_\d+/kernel[^;]* share one key.*; all 8 devices on the 'model'",
    "MobileNetV5Backbone": r"conv_norm_act_\d+/conv2d_\d+/kernel[^;]* share one key.*; all 8",
}
# Most of these tiny configs' matrices is their patch embedding, a convolution of the image's 3
# channels, split over the model axis only: XLA's partitioner computes it wrongly split along its
# window (test_every_backbone_computes_sharded_what_it_computes_unsharded fails so).
_PATCHES = r"(patch_embeddings?(/projection)?|patching_and_embedding/conv2d(_\d+)?)/kernel"
_WINDOW = rf"{_PATCHES}[^;]* are convolution kernels, not split along their window"
UNEVEN |= dict.fromkeys(
    [
        *("BLIP2Backbone", "CLIPBackbone", "CLIPVisionEncoder", "DINOV2Backbone"),
        *("DINOV3Backbone", "DeiTBackbone", "MetaCLIP2Backbone", "MetaCLIP2VisionEncoder"),
        *("SAMBackbone", "SigLIPBackbone", "SigLIPVisionEncoder", "ViTBackbone"),
    ],
    _WINDOW,
)


def _bound(name: str) -> float:
    """Per-device bytes, in even shares: where the map warns, its largest matrices are split at
    least over the model axis (4 of the 8 devices)."""
    return 2.0 if name in UNEVEN else 1.25


@pytest.fixture
def mesh(distribution):
    distribution(None)
    return keras.distribution.DeviceMesh((2, 4), ("batch", "model"), jax.devices())


def _deferred(name: str) -> keras.Model:
    with keras_orbax.deferred_init():
        return BACKBONES[name](**CHANGED.get(name, {}))


def _device_bytes(variables: list[keras.Variable], shardings: dict) -> tuple[float, float]:
    """(bytes one device holds, bytes of an even split) of `variables`, by their shardings."""
    held = total = 0.0
    for v in variables:
        itemsize = np.dtype(keras_compat.stored_dtype(v)).itemsize
        held += math.prod(shardings[id(v)].shard_shape(tuple(v.shape))) * itemsize
        total += math.prod(v.shape) * itemsize
    return held, total / len(jax.devices())


@pytest.mark.parametrize("name", sorted(BACKBONES))
def test_every_backbone_is_split_evenly(name, mesh, distribution):
    model = _deferred(name)
    if name in UNEVEN:
        with pytest.warns(KerasOrbaxWarning, match=f"x an even split.*{UNEVEN[name]}"):
            layout_map = keras_orbax.get_layout_map(model, mesh)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("error", KerasOrbaxWarning)  # the warning of an uneven split
            layout_map = keras_orbax.get_layout_map(model, mesh)
    lookup = keras.distribution.ModelParallel(layout_map=layout_map).get_variable_layout

    # Built again under the map, as a load builds it: Keras numbers auto-named layers on from the
    # first build (`moe_block` -> `moe_block_2`), and each variable still finds its layout.
    distribution(keras.distribution.ModelParallel(layout_map=layout_map))
    rebuilt = _deferred(name)
    shardings = {id(v): keras_compat.layout(v).backend_layout for v in rebuilt.weights}
    for first, v in zip(model.weights, rebuilt.weights, strict=True):
        assert keras_compat.layout(v).axes == lookup(first).axes, (first.path, v.path)
        shardings[id(v)].shard_shape(tuple(v.shape))  # raises where a mesh axis does not divide
        assert v.ndim >= 2 or shardings[id(v)].is_fully_replicated, v.path
    held, even = _device_bytes([v for v in rebuilt.weights if v.ndim >= 2], shardings)
    assert held <= _bound(name) * even, (name, held / even)
    if name in HUB_MAPPED:
        # keras-hub's own layout wherever it divides the variable; another where it does not.
        own = type(model).get_layout_map(mesh)
        mapped = [v for v in model.weights if own[v.path] is not None]
        indivisible = {v.path for v in mapped if _indivisible(own[v.path], v)}
        for v in mapped:
            assert (lookup(v).axes == own[v.path].axes) == (v.path not in indivisible), v.path
        if name == "GemmaBackbone":  # 2 key/value heads, which keras-hub splits over 4 devices
            assert {path.split("/")[-2] for path in indivisible} == {"key", "value"}


@pytest.mark.parametrize("name", ["BASNetBackbone", "MobileNetV5Backbone"])
def test_unnamed_convolutions_split_evenly_over_one_axis(name, distribution):
    # The way out that the warning names for the keys that unnamed layers share: all 8 devices on
    # the model axis, which divides every one of their output channels.
    distribution(None)
    mesh = keras.distribution.DeviceMesh((1, 8), ("batch", "model"), jax.devices())
    model = _deferred(name)
    with warnings.catch_warnings():
        warnings.simplefilter("error", KerasOrbaxWarning)
        layout_map = keras_orbax.get_layout_map(model, mesh)
    distribution(keras.distribution.ModelParallel(layout_map=layout_map))
    rebuilt = _deferred(name)
    shardings = {id(v): keras_compat.layout(v).backend_layout for v in rebuilt.weights}
    held, even = _device_bytes([v for v in rebuilt.weights if v.ndim >= 2], shardings)
    assert held <= 1.25 * even, held / even


def _indivisible(layout: keras.distribution.TensorLayout, variable: keras.Variable) -> bool:
    try:
        layout.backend_layout.shard_shape(tuple(variable.shape))
    except ValueError:
        return True
    return False


# Backbones without a map of keras-hub's, text and image: a preset saved by keras-hub, loaded by
# keras-hub without a distribution, and by keras_orbax sharded. (Gemma, whose map keras-hub
# writes, goes the same way with a key/value head the model axis cannot split, LoRA, training
# and an export, in docs/fine-tuning.md, which tests/test_docs.py runs.)
LOADED = {"MistralBackbone": "tokens", "ViTBackbone": "image"}


def _inputs(kind: str, model: keras.Model) -> object:
    rng = np.random.default_rng(0)
    if kind == "image":
        return rng.random((2, *model.input_shape[1:]), dtype=np.float32)
    return {"token_ids": rng.integers(0, 64, (2, 8)), "padding_mask": np.ones((2, 8), "int32")}


@pytest.mark.parametrize("name", sorted(LOADED))
def test_a_preset_loads_sharded_as_keras_hub_loads_it(name, mesh, distribution, tmp_path):
    keras.utils.set_random_seed(1)
    cls = getattr(keras_hub.models, name)
    BACKBONES[name]().save_to_preset(str(tmp_path))
    expected_model = cls.from_preset(str(tmp_path))  # keras-hub's own loader, on one device
    inputs = _inputs(LOADED[name], expected_model)
    expected = expected_model.predict(inputs, verbose=0)

    layout_map = keras_orbax.get_layout_map(str(tmp_path), mesh)
    distribution(keras.distribution.ModelParallel(layout_map=layout_map))
    model = keras_orbax.from_preset(cls, str(tmp_path))

    shardings = {id(v): v.value.sharding for v in model.weights}
    for v in model.weights:
        assert (
            shardings[id(v)].is_equivalent_to(layout_map[v.path].backend_layout, v.ndim)
            if layout_map[v.path]
            else shardings[id(v)].is_fully_replicated
        )
    matrices = [v for v in model.weights if v.ndim >= 2]
    # The map was derived from another build: every matrix found its key in this one.
    assert not [v.path for v in matrices if shardings[id(v)].is_fully_replicated]
    held, even = _device_bytes(matrices, shardings)
    assert held <= _bound(name) * even
    got = model.predict(inputs, verbose=0)
    keras.tree.map_structure(
        lambda a, b: np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=1e-6),
        got,
        expected,
    )


def test_what_the_mesh_cannot_split_is_named(mesh):
    # keras-hub's own test config of BERT: a hidden size of 2 and 10 words, which a model axis
    # of 4 divides nowhere.
    with keras_orbax.deferred_init():
        model = keras_hub.models.BertBackbone(
            vocabulary_size=10,
            num_layers=2,
            num_heads=2,
            hidden_dim=2,
            intermediate_dim=4,
            max_sequence_length=5,
        )
    with pytest.warns(KerasOrbaxWarning, match=r"x an even split.*token_embedding/embeddings"):
        layout_map = keras_orbax.get_layout_map(model, mesh)
    assert layout_map["token_embedding/embeddings"].axes == ("batch", None)


def test_what_is_not_a_mesh_axis_nor_a_preset_is_refused(mesh):
    model = _deferred("GemmaBackbone")
    with pytest.raises(
        ValueError, match=r"\['batch', 'model'\]. Received: model_parallel_dim_name='tp'"
    ):
        keras_orbax.get_layout_map(model, mesh, model_parallel_dim_name="tp")
    with pytest.raises(TypeError, match="preset_or_model must be"):
        keras_orbax.get_layout_map(3, mesh)
    with pytest.raises(CheckpointNotFoundError, match="Did you mean 'gemma_2b_en'"):
        keras_orbax.get_layout_map("gemma_2b_enn", mesh)


# The shapes (without the batch) of inputs that the rule of `_test_inputs` does not fit.
INPUT_SHAPES = {
    "MoonshineBackbone": {"encoder_input_values": (1024, 1), "encoder_padding_mask": (1024,)},
    "SAMBackbone": {"masks": (0, 32, 32, 1)},  # no mask prompt: keras-hub's own test
}
# XLA at its lowest optimization for the forwards below: compiling them is what they cost, and
# the partitioner, which `get_layout_map`'s layouts go through, runs the same at every level.
_QUICK_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _test_inputs(name: str, model: keras.Model) -> object:
    """One example for each of the model's inputs: unknown lengths 8, token ids below 8 (every
    vocabulary here is larger), masks all ones, segment ids 0, floats in [0, 1)."""
    rng = np.random.default_rng(0)
    found = {}
    for tensor in model.inputs:
        shape = INPUT_SHAPES.get(name, {}).get(tensor.name)
        shape = (1, *(shape or [8 if n is None else n for n in tensor.shape[1:]]))
        if "float" in tensor.dtype:
            found[tensor.name] = rng.random(shape, dtype=np.float32).astype(tensor.dtype)
        elif "mask" in tensor.name:
            found[tensor.name] = np.ones(shape, tensor.dtype)
        elif "segment" in tensor.name:
            found[tensor.name] = np.zeros(shape, tensor.dtype)
        else:
            found[tensor.name] = rng.integers(0, 8, shape).astype(tensor.dtype)
    if isinstance(model._inputs_struct, dict):
        return found
    return list(found.values()) if len(found) > 1 else next(iter(found.values()))


def _random_values(model: keras.Model) -> None:
    """Gives each variable of the deferred `model` a random value: variances in [0.5, 1.5), other
    floats in [-0.3, 0.3), integers 0 (a seed generator's state)."""
    rng = np.random.default_rng(0)
    for v in model.variables:
        shape, dtype = tuple(v.shape), keras_compat.stored_dtype(v)
        if "int" in dtype:
            value = np.zeros(shape, dtype)
        elif "variance" in v.path:
            value = rng.uniform(0.5, 1.5, shape).astype(dtype)
        else:
            value = rng.uniform(-0.3, 0.3, shape).astype(dtype)
        keras_compat.set_value(v, jax.numpy.asarray(value))


def _forward(model: keras.Model, inputs: object) -> list[np.ndarray]:
    """The model's outputs on `inputs`, in one compiled program under the active distribution."""
    if isinstance(model, keras_hub.models.StableDiffusion3Backbone):
        model.configure_scheduler(1)  # its steps known before the program, as keras-hub's own
    values = [v.value for v in model.trainable_variables]
    others = [v.value for v in model.non_trainable_variables]
    forward = jax.jit(
        lambda t, n, x: model.stateless_call(t, n, x, training=False)[0],
        compiler_options=_QUICK_COMPILE,
    )
    return [np.asarray(out) for out in keras.tree.flatten(forward(values, others, inputs))]


# Compiling two forwards of every backbone takes minutes (docs/loading.md): CI runs those that
# XLA computed wrongly under the map that split convolution windows (DINOv2, PARSeq), and one of
# each kind of layer the map splits: attention kernels of three dimensions (BERT), keras-hub's own
# map with key/value heads it cannot split (Gemma), experts (Mixtral), 2-D convolutions (ResNet),
# depthwise ones sharing a key (MobileNetV5), 1-D ones (Moonshine). `KERAS_ORBAX_HUB_SWEEP=1` runs
# them all.
FORWARD_IN_CI = {"DINOV2Backbone", "PARSeqBackbone", "BertBackbone", "GemmaBackbone"}
FORWARD_IN_CI |= {"MixtralBackbone", "ResNetBackbone", "MobileNetV5Backbone", "MoonshineBackbone"}


def _forward_cases() -> list:
    assert not FORWARD_IN_CI - set(BACKBONES), FORWARD_IN_CI - set(BACKBONES)
    sweep = os.environ.get("KERAS_ORBAX_HUB_SWEEP") == "1"
    skip = pytest.mark.skip(reason="the whole sweep runs with KERAS_ORBAX_HUB_SWEEP=1")
    return [
        pytest.param(name, marks=() if sweep or name in FORWARD_IN_CI else skip, id=name)
        for name in sorted(BACKBONES)
    ]


@pytest.mark.parametrize("name", _forward_cases())
def test_every_backbone_computes_sharded_what_it_computes_unsharded(
    name, mesh, distribution, tmp_path
):
    model = _deferred(name)
    layout_map = keras_orbax.get_layout_map(model, mesh)
    _random_values(model)
    path = tmp_path / "model.weights.h5"
    model.save_weights(path)  # Keras's own writer
    # The unsharded load: what a load makes of the file (keras-hub derives some variables from
    # others, as DINOv2's interpolated position embeddings), on one device.
    keras_orbax.restore_sharded(model, path)
    inputs = _test_inputs(name, model)
    expected = _forward(model, inputs)

    distribution(keras.distribution.ModelParallel(layout_map=layout_map))
    sharded = _deferred(name)
    keras_orbax.restore_sharded(sharded, path)
    assert any(not v.value.sharding.is_fully_replicated for v in sharded.weights)
    got = _forward(sharded, inputs)

    for a, b in zip(got, expected, strict=True):
        assert np.isfinite(b).all()
        # The sharded program sums the products of a split dimension in another order.
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-3 * max(1.0, float(np.abs(b).max())))
