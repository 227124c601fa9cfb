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
