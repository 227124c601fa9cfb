"""Architectures the command-line tests name with `--model tests.cli_models:FUNCTION`."""

from __future__ import annotations

import keras
from keras.distribution import DeviceMesh, LayoutMap


def mlp() -> keras.Model:
    inputs = keras.Input((16,))
    x = keras.layers.Dense(32, name="hidden")(inputs)
    outputs = keras.layers.Dense(8, name="head")(x)
    return keras.Model(inputs, outputs, name="mlp")


def mlp_compiled() -> keras.Model:
    """Compiled with an optimizer made inside: Keras cannot make one while nothing is allocated."""
    model = mlp()
    model.compile(optimizer="adam", loss="mse")
    return model


OPTIMIZER = keras.optimizers.Adam()  # made at import, outside the CLI's deferred build


def mlp_compiled_with_module_optimizer() -> keras.Model:
    model = mlp()
    model.compile(optimizer=OPTIMIZER, loss="mse")
    return model


def wide() -> keras.Model:
    """8 Dense kernels of 8 MiB each (1024 x 2048 float32), no biases: 64 MiB in all."""
    inputs = keras.Input((1024,))
    x = inputs
    for i in range(8):
        x = keras.layers.Dense(2048 if i % 2 == 0 else 1024, use_bias=False, name=f"d{i}")(x)
    return keras.Model(inputs, x, name="wide")


def layout_map(mesh: DeviceMesh) -> LayoutMap:
    layouts = LayoutMap(mesh)
    layouts[".*kernel"] = ("batch", "model")
    return layouts


def gemma_layout_map(mesh: DeviceMesh) -> LayoutMap:
    """keras-hub's own layout map for Gemma (tests/test_hub_tasks.py)."""
    import keras_hub

    return keras_hub.models.GemmaBackbone.get_layout_map(mesh)


def llama3_layout_map(mesh: DeviceMesh) -> LayoutMap:
    """keras-hub's own layout map for Llama 3 (tests/test_hub_tasks.py)."""
    import keras_hub

    return keras_hub.models.Llama3Backbone.get_layout_map(mesh)


def gemma_task(compile: bool = True) -> keras.Model:
    """A tiny keras-hub Gemma task, made as keras-hub makes one: compiled unless `compile=False`."""
    import keras_hub

    from tests._hub import TINY_GEMMA

    backbone = keras_hub.models.GemmaBackbone(**TINY_GEMMA)
    return keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None, compile=compile)


def gemma_task_uncompiled() -> keras.Model:
    return gemma_task(compile=False)
