"""A keras-hub backbone under `deferred_init`, restored on another mesh with its own layout map.

keras-hub is an optional extra (see `.ci/run` for installing it without TensorFlow); this module is
skipped where it is not installed, except in CI, which requires it.
"""

from __future__ import annotations

import jax
import keras
import numpy as np

import keras_orbax
from tests._hub import TINY_GEMMA, import_keras_hub

keras_hub = import_keras_hub()


def _gemma() -> keras.Model:
    return keras_hub.models.GemmaBackbone(**TINY_GEMMA)


def _distribution(shape: tuple[int, int]) -> keras.distribution.ModelParallel:
    mesh = keras.distribution.DeviceMesh(shape, ("batch", "model"), jax.devices())
    layout_map = keras_hub.models.GemmaBackbone.get_layout_map(mesh)
    return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")


def test_gemma_backbone_restores_deferred_on_another_mesh(tmp_path, distribution):
    # 8 rows: divisible by both meshes' batch axes; `predict` compiles once (eager calls compile per op).
    inputs = {"token_ids": np.ones((8, 8), "int32"), "padding_mask": np.ones((8, 8), "int32")}
    distribution(_distribution((2, 4)))
    source = _gemma()
    keras_orbax.save(source, tmp_path, step=1)
    expected = source.predict(inputs, verbose=0)

    distribution(_distribution((4, 2)))
    with keras_orbax.deferred_init():
        target = _gemma()
    assert all(v._value is None for v in target.variables)
    result = keras_orbax.restore_sharded(target, tmp_path)
    assert result.num_variables == len(target.variables)
    for want, got in zip(source.variables, target.variables, strict=True):
        np.testing.assert_array_equal(np.asarray(got.value), np.asarray(want.value))
    np.testing.assert_allclose(target.predict(inputs, verbose=0), expected, rtol=1e-5, atol=1e-6)
