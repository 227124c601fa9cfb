"""The reshard matrix: save under one layout, restore under another, values and shardings exact."""

from __future__ import annotations

import jax
import keras
import numpy as np
import pytest
from jax.sharding import NamedSharding

import keras_orbax
from tests import _models

LAYOUTS = {
    "mesh_2x4": lambda: _models.model_parallel((2, 4)),
    "mesh_4x2": lambda: _models.model_parallel((4, 2)),
    "mesh_1x8": lambda: _models.model_parallel((1, 8)),
    "mesh_8x1": lambda: _models.model_parallel((8, 1)),
    "data_parallel": _models.data_parallel,
    "one_device": lambda: None,
}
PAIRS = [
    ("mesh_2x4", "mesh_4x2"),
    ("mesh_2x4", "mesh_1x8"),
    ("mesh_2x4", "mesh_8x1"),
    ("mesh_2x4", "data_parallel"),
    ("mesh_2x4", "one_device"),
    ("mesh_2x4", "mesh_2x4"),
    ("mesh_4x2", "mesh_2x4"),
    ("one_device", "mesh_2x4"),
    ("data_parallel", "mesh_1x8"),
]


def _expected_sharding(variable: keras.Variable) -> jax.sharding.Sharding:
    distribution = keras.distribution.distribution()
    if distribution is None:
        return jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return distribution.get_variable_layout(variable).backend_layout


@pytest.mark.parametrize(("saved_on", "restored_on"), PAIRS)
def test_restore_onto_another_layout(tmp_path, distribution, saved_on, restored_on):
    distribution(LAYOUTS[saved_on]())
    source = _models.mlp()
    _models.fill_arange(source)
    expected = _models.values(source.variables)
    keras_orbax.save(source, tmp_path, step=3)

    distribution(LAYOUTS[restored_on]())
    target = _models.mlp()
    result = keras_orbax.restore_sharded(target, tmp_path)

    assert result.step == 3
    assert len(result.restored) == len(target.variables) == 4
    for variable, want in zip(target.variables, expected, strict=True):
        np.testing.assert_array_equal(np.asarray(variable.value), want, err_msg=variable.path)
        sharding = variable.value.sharding
        assert sharding.is_equivalent_to(_expected_sharding(variable), variable.value.ndim), (
            variable.path
        )
    if restored_on.startswith("mesh"):
        kernel = target.get_layer("hidden").kernel.value
        assert isinstance(kernel.sharding, NamedSharding)
        assert tuple(kernel.sharding.spec) == ("batch", "model")


@pytest.mark.parametrize("saved_on", ["mesh_2x4", "mesh_4x2"])
def test_each_device_shard_comes_from_the_checkpoint(tmp_path, distribution, saved_on):
    distribution(LAYOUTS[saved_on]())
    source = _models.mlp()
    _models.fill_arange(source)
    full = np.asarray(source.get_layer("hidden").kernel.value)
    keras_orbax.save(source, tmp_path, step=1)

    distribution(_models.model_parallel((2, 4)))
    target = _models.mlp()
    keras_orbax.restore_sharded(target, tmp_path)
    kernel = target.get_layer("hidden").kernel.value
    assert len(kernel.addressable_shards) == 8
    for shard in kernel.addressable_shards:
        assert shard.data.shape == (8, 8)  # (16, 32) split (2, 4): never the full shape
        np.testing.assert_array_equal(np.asarray(shard.data), full[shard.index])


class _Cube(keras.layers.Layer):
    def build(self, input_shape):
        self.cube = self.add_weight(shape=(4, 8, 16), name="cube")

    def call(self, x):
        return x


def _cube_distribution(mesh_shape: tuple[int, int], axes: tuple) -> keras.distribution.Distribution:
    mesh = keras.distribution.DeviceMesh(mesh_shape, ("batch", "model"), jax.devices())
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*cube"] = axes
    return keras.distribution.ModelParallel(layout_map=layout_map)


@pytest.mark.parametrize(
    ("saved", "restored"),
    [
        (((2, 4), (None, "batch", "model")), ((4, 2), ("batch", None, "model"))),
        (((2, 4), ("batch", "model", None)), ((2, 4), (None, "model", "batch"))),
        (((8, 1), (None, None, "batch")), ((1, 8), (None, None, "model"))),
        (((8, 1), (None, "batch", None)), ((4, 2), ("model", None, "batch"))),
    ],
)
def test_three_dimensional_variable_any_split_to_any_split(tmp_path, distribution, saved, restored):
    distribution(_cube_distribution(*saved))
    source = keras.Sequential([keras.Input((3,)), _Cube(name="cube")], name="c")
    _models.fill_arange(source)
    keras_orbax.save(source, tmp_path, step=1)
    full = np.asarray(source.layers[0].cube.value)

    distribution(_cube_distribution(*restored))
    with keras_orbax.deferred_init():
        target = keras.Sequential([keras.Input((3,)), _Cube(name="cube")], name="c")
    result = keras_orbax.restore_sharded(target, tmp_path)
    cube = target.layers[0].cube.value
    np.testing.assert_array_equal(np.asarray(cube), full)
    assert tuple(cube.sharding.spec) == restored[1]
    distinct = {repr(s.index): s.data.nbytes for s in cube.addressable_shards}
    assert result.bytes_read == sum(distinct.values())  # exactly the distinct target shards


def test_compact_format_restores_through_orbax_onto_another_layout(tmp_path, distribution):
    distribution(_models.model_parallel((2, 4)))
    source = _models.mlp()
    _models.fill_arange(source)
    keras_orbax.save(source, tmp_path, step=1, format="compact")
    assert not list(tmp_path.glob("1/state/layers.dense.vars.0"))  # arrays live in OCDBT

    distribution(_models.model_parallel((4, 2)))
    with keras_orbax.deferred_init():
        target = _models.mlp()
    result = keras_orbax.restore_sharded(target, tmp_path)
    assert result.bytes_read > 0
    for variable, want in zip(target.variables, _models.values(source.variables), strict=True):
        np.testing.assert_array_equal(np.asarray(variable.value), want, err_msg=variable.path)
        assert variable.value.sharding.is_equivalent_to(
            _expected_sharding(variable), variable.value.ndim
        )
