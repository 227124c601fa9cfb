"""Where each variable lives: Keras distribution + TensorLayout -> a JAX sharding."""

from __future__ import annotations

import functools
from typing import Any

import jax
import keras
from jax.sharding import NamedSharding, Sharding, SingleDeviceSharding

from keras_orbax._src.compat import keras_compat


def target_sharding(variable: keras.Variable) -> Sharding:
    """The sharding `variable` should hold under the active distribution.

    `ModelParallel`: the variable's layout (its own, else the LayoutMap's, else replicated);
    `DataParallel`: replicated over its mesh; no distribution: where the variable already lives,
    else the first local device.
    """
    distribution = keras.distribution.distribution()
    if distribution is not None:
        layout = keras_compat.layout(variable) or distribution.get_variable_layout(variable)
        if isinstance(layout, keras.distribution.TensorLayout):
            return layout.backend_layout
        if isinstance(layout, Sharding):
            return layout
    if keras_compat.is_allocated(variable):
        return keras_compat.current_value(variable).sharding
    return SingleDeviceSharding(jax.local_devices()[0])


@functools.lru_cache(maxsize=1024)
def replica_zero(
    sharding: Sharding, shape: tuple[int, ...]
) -> tuple[tuple[int, tuple[tuple[int, int], ...]], ...]:
    """(process, bounds) of replica 0 of each distinct shard of an array of `shape`: the copy a
    checkpoint writes (JAX numbers a shard's replicas in the order of `devices_indices_map`).
    Computed once per layout: a model's thousands of arrays have a few."""
    seen: set[tuple[tuple[int, int], ...]] = set()
    found = []
    for device, index in sharding.devices_indices_map(shape).items():
        bounds = tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))
        if bounds not in seen:
            seen.add(bounds)
            found.append((int(device.process_index), bounds))  # type: ignore[attr-defined]
    return tuple(found)


def layout_error(sharding: Sharding, shape: tuple[int, ...]) -> str | None:
    """Why `sharding` cannot hold an array of `shape` (a mesh axis that does not divide it), or None."""
    if not isinstance(sharding, NamedSharding):
        return None
    mesh_shape = dict(sharding.mesh.shape)
    for dim, axes in enumerate(sharding.spec):
        if axes is None or dim >= len(shape):
            continue
        names = (axes,) if isinstance(axes, str) else tuple(axes)
        parts = 1
        for name in names:
            parts *= mesh_shape[name]
        if shape[dim] % parts:
            return (
                f"layout {tuple(sharding.spec)} splits dimension {dim} (size {shape[dim]}) "
                f"into {parts} parts over mesh axes {names}, which does not divide it"
            )
    return None


def describe(sharding: Sharding) -> dict[str, Any] | None:
    """A JSON description of a sharding for the checkpoint record."""
    if not isinstance(sharding, NamedSharding):
        return None
    return {
        "mesh_shape": [int(n) for n in sharding.mesh.devices.shape],
        "axis_names": [str(a) for a in sharding.mesh.axis_names],
        "partition": [_axes(a) for a in sharding.spec],
    }


def _axes(axes: Any) -> list[str] | str | None:
    if axes is None or isinstance(axes, str):
        return axes
    return [str(a) for a in axes]
