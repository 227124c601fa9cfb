"""How one variable is split over a device mesh: the layout splitting it into the most parts that
the mesh's axes divide, and what a device then holds (`get_layout_map` builds on these)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import keras

from keras_orbax._src.compat import keras_compat, saving_compat
from keras_orbax._src.restore.layout_keys import Axes

# Keras's convolutions: their kernels' leading dimensions are the window, the last two the channels.
CONVOLUTIONS = (
    *(keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D),
    *(keras.layers.Conv1DTranspose, keras.layers.Conv2DTranspose, keras.layers.Conv3DTranspose),
    *(keras.layers.DepthwiseConv1D, keras.layers.DepthwiseConv2D),
    *(keras.layers.SeparableConv1D, keras.layers.SeparableConv2D),
)


def convolution_kernels(model: keras.Model) -> frozenset[str]:
    """The paths of the model's convolution kernels."""
    return frozenset(
        v.path
        for layer in saving_compat.all_layers(model)
        if isinstance(layer, CONVOLUTIONS)
        for v in keras_compat.own_variables(layer)
        if v.ndim >= 3
    )


def split_axes(
    shape: tuple[int, ...],
    device_mesh: keras.distribution.DeviceMesh,
    axes: Sequence[str],
    *,
    window: bool = False,
) -> Axes:
    """The layout splitting `shape` into the most parts: each of `axes` (model axis first) on its
    own dimension that it divides, the model axis on the largest; replicated below two dimensions.

    A convolution kernel's (`window`) leading dimensions, its window, are not split: XLA's
    partitioner computes a strided convolution whose kernel is split there wrongly (a ViT's
    14 x 14 patch embedding gives other outputs; jax-ml/jax#16894 reports strided convolutions
    partitioned wrongly too). Split along their channels they compute right.
    """
    replicated: Axes = (None,) * len(shape)
    if len(shape) < 2:
        return replicated
    sizes = [axis_size(device_mesh, name) for name in axes]
    best, best_parts = replicated, 1
    # Each axis gets a dimension or none (-1); the model axis is tried on the largest first.
    first = max(len(shape) - 2, 0) if window else 0
    dims = sorted(range(first, len(shape)), key=lambda d: -shape[d])
    for choice in itertools.product(*([*dims, -1] for _ in axes)):
        used = [d for d in choice if d >= 0]
        if len(used) != len(set(used)):
            continue
        if any(d >= 0 and shape[d] % size for d, size in zip(choice, sizes, strict=True)):
            continue
        parts = math.prod(size for d, size in zip(choice, sizes, strict=True) if d >= 0)
        if parts > best_parts:
            layout: list[str | None] = [None] * len(shape)
            for d, name in zip(choice, axes, strict=True):
                if d >= 0:
                    layout[d] = name
            best, best_parts = tuple(layout), parts
    return best


def axis_size(device_mesh: keras.distribution.DeviceMesh, name: str) -> int:
    return int(device_mesh.shape[list(device_mesh.axis_names).index(name)])


def unique_variables(model: keras.Model) -> list[keras.Variable]:
    seen: set[int] = set()
    found = []
    for variable in model.weights:
        if id(variable) not in seen:
            seen.add(id(variable))
            found.append(variable)
    return found


def divides(axes: Axes, shape: tuple[int, ...], device_mesh: keras.distribution.DeviceMesh) -> bool:
    return len(axes) == len(shape) and all(
        name is None or dim % axis_size(device_mesh, name) == 0
        for dim, name in zip(shape, axes, strict=True)
    )


def held(axes: Axes, shape: tuple[int, ...], device_mesh: keras.distribution.DeviceMesh) -> float:
    """The elements of an array of `shape` that one device holds under `axes`."""
    return math.prod(shape) / parts(axes, device_mesh)


def parts(axes: Axes, device_mesh: keras.distribution.DeviceMesh) -> int:
    """Into how many parts `axes` split an array."""
    return math.prod(axis_size(device_mesh, a) for a in axes if a is not None)


def stored_bytes(variable: keras.Variable) -> int:
    import numpy as np

    dtype = np.dtype(keras_compat.stored_dtype(variable))
    return math.prod(variable.shape) * dtype.itemsize
