"""Small models, distributions and value helpers shared by the tests."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax
import keras
import numpy as np
import pytest
from keras.distribution import DataParallel, DeviceMesh, LayoutMap, ModelParallel


def model_parallel(shape: tuple[int, int], devices: list | None = None) -> ModelParallel:
    """A (batch, model) mesh: Dense kernels sharded over both axes, embeddings over "model"."""
    mesh = DeviceMesh(shape, ("batch", "model"), devices or jax.devices())
    layout_map = LayoutMap(mesh)
    layout_map[".*kernel"] = ("batch", "model")
    layout_map[".*embeddings"] = (None, "model")
    return ModelParallel(layout_map=layout_map, batch_dim_name="batch")


def data_parallel() -> DataParallel:
    return DataParallel(devices=jax.devices())


def mlp(width: int = 32, dtype: str | None = None) -> keras.Model:
    """Two Dense layers whose dimensions every mesh of 8 devices divides."""
    inputs = keras.Input((16,))
    x = keras.layers.Dense(width, name="hidden", dtype=dtype)(inputs)
    outputs = keras.layers.Dense(8, name="head", dtype=dtype)(x)
    return keras.Model(inputs, outputs, name="mlp")


def full_model() -> keras.Model:
    """Dense, Embedding, LayerNormalization, BatchNormalization and Dropout (with RNG state)."""
    inputs = keras.Input((4,), dtype="int32")
    x = keras.layers.Embedding(16, 8)(inputs)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(16)(x)
    x = keras.layers.LayerNormalization()(x)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.Dropout(0.25)(x)
    outputs = keras.layers.Dense(8)(x)
    return keras.Model(inputs, outputs)


def lora_pair(inputs: int, hidden: int, seed: int) -> keras.Model:
    """Two frozen bias-free Dense kernels, `frozen_in` (inputs x hidden) and `frozen_out`
    (hidden x 8), each with LoRA factors of rank 2, compiled with Adam: what a LoRA fine-tune
    saves (frozen kernels, trained factors, Adam's state for the factors)."""
    keras.utils.set_random_seed(seed)
    x = keras.Input((inputs,))
    h = keras.layers.Dense(hidden, use_bias=False, name="frozen_in")(x)
    model = keras.Model(x, keras.layers.Dense(8, use_bias=False, name="frozen_out")(h))
    for name in ("frozen_in", "frozen_out"):
        model.get_layer(name).enable_lora(2)
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    return model


def compile_adam(model: keras.Model) -> keras.Model:
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", metrics=["mae"])
    return model


def training_data(n: int = 32) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.integers(0, 16, (n, 4)).astype("int32"), rng.random((n, 8)).astype("float32")


def arange_values(shapes: list[tuple[int, ...]], limit: int | None = None) -> list[np.ndarray]:
    """Distinct `arange` values for each shape in turn (modulo `limit`): what `fill_arange` assigns."""
    arrays, offset = [], 0
    for shape in shapes:
        size = int(np.prod(shape))
        values = np.arange(offset, offset + size, dtype="float32").reshape(shape)
        arrays.append(values % limit if limit is not None else values)
        offset += size
    return arrays


def fill_arange(model: keras.Model, limit: int | None = None) -> None:
    """Gives every variable distinct `arange` values, so a misplaced shard cannot pass."""
    shapes = [tuple(v.shape) for v in model.variables]
    for variable, values in zip(model.variables, arange_values(shapes, limit), strict=True):
        variable.assign(values.astype(variable.dtype))


def values(variables: list[keras.Variable]) -> list[np.ndarray]:
    return [np.asarray(v.value) for v in variables]


@contextlib.contextmanager
def one_file_per_shard() -> Iterator[None]:
    """Within it, saves write every array as one file per shard, small ones too (as the fast format
    does above `shard_writer.PACK_BYTES`): for tests of that layout (damage to one shard's file, layouts
    that cut the saved shards)."""
    from keras_orbax._src.write import shard_writer

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(shard_writer, "PACK_BYTES", -1)
        yield
