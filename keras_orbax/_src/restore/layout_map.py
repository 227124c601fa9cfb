"""`get_layout_map`: a `keras.distribution.LayoutMap` for any model, derived from its variables.

keras-hub writes layout maps by hand for a few backbones. Every other model gets one derived from
its variables' shapes, each split as `layout_axes.split_axes` says (over the model axis along its
largest dimension that the axis divides, over the data axis along another, a convolution kernel
along its channels only; vectors, scalars and what no axis divides replicated). The keys are the
variables' paths with their numbers matching any number, so that a model built again (layer names
counted up from another start) is matched the same way.
"""

from __future__ import annotations

import math
import os
import re
import sys
import warnings
from collections.abc import Sequence
from typing import Any

import keras

from keras_orbax._src.model import matching
from keras_orbax._src.restore import layout_axes, layout_keys
from keras_orbax._src.restore import preset as preset_loading
from keras_orbax.errors import KerasOrbaxWarning

Axes = layout_keys.Axes

# Above this many times an even split of the model, a device holds enough of what could not be
# split for the user to want to know (the bound the tests hold keras-hub's backbones to).
_EVEN_SPLIT_TOLERANCE = 1.25


def get_layout_map(
    preset_or_model: str | os.PathLike | keras.Model,
    device_mesh: keras.distribution.DeviceMesh,
    *,
    model_parallel_dim_name: str = "model",
    data_parallel_dim_name: str = "batch",
) -> keras.distribution.LayoutMap:
    """A `LayoutMap` that shards `preset_or_model`'s variables over `device_mesh`.

    Takes keras-hub's `get_layout_map` arguments, plus what to map: a keras-hub preset (built from
    its config under `deferred_init()`: nothing is allocated, no weight read) or a model. Where the
    backbone class has its own `get_layout_map` (Gemma, Llama, Qwen...), its layouts are kept for
    every variable whose dimensions they divide. Every other variable of two or more dimensions is
    split over the model axis along its largest dimension that the axis divides and over the data
    axis along another one (a convolution kernel only along its channels: XLA computes a strided
    convolution split along its window wrongly); vectors, scalars and what no axis divides are
    replicated.

    The keys match any layer number (`decoder_block_\\d+/...`, `moe_block(?:_\\d+)?/...`), so
    the map fits the model that `from_preset` or a script builds next, whatever Keras numbers its
    layers. Layers whose names differ only by Keras's counter (`conv2d`, `conv2d_1`) get one layout
    that divides them all; only where none does, their keys keep the numbers, and a model built
    with other numbers leaves them replicated.

    Args:
        preset_or_model: A keras-hub preset (a local directory, a Hugging Face directory, a
            `kaggle://`/`hf://` handle or one of keras-hub's preset names), or a Keras model (a
            keras-hub backbone or task, or any other), built or deferred.
        device_mesh: The `keras.distribution.DeviceMesh` to shard over.
        model_parallel_dim_name: The mesh axis the weights are split over first.
        data_parallel_dim_name: The mesh axis the data is split over; weights are split over it
            too, along another dimension, as keras-hub's own maps do.

    Returns:
        A `keras.distribution.LayoutMap` for `keras.distribution.ModelParallel`.

    Raises:
        ValueError: an axis name is not one of `device_mesh.axis_names`.
        TypeError: `preset_or_model` is neither a preset nor a Keras model.
        CheckpointNotFoundError: no such preset directory, nor one of keras-hub's preset names
            (the message names the closest ones).

    Warns:
        KerasOrbaxWarning: what the mesh's axes could not split leaves each device more than 1.25 x
            an even split of the model's matrices; the message names the least split and why
            (no axis divides them, a convolution window, or a key shared with other shapes).

    Example:
    ```python
    mesh = keras.distribution.DeviceMesh((2, 4), ("batch", "model"))
    layout_map = keras_orbax.get_layout_map("/presets/mistral_7b_en", mesh)
    keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map))
    model = keras_orbax.from_preset(keras_hub.models.CausalLM, "/presets/mistral_7b_en")
    ```
    """
    axes = _mesh_axes(device_mesh, model_parallel_dim_name, data_parallel_dim_name)
    model = _model_of(preset_or_model)
    layouts = _layouts(model, device_mesh, axes)
    _warn_if_uneven(model, layouts, device_mesh, axes)
    layout_map = keras.distribution.LayoutMap(device_mesh)
    for key, layout in layout_keys.keyed(layouts).items():
        layout_map[key] = layout
    return layout_map


def _layouts(
    model: keras.Model, device_mesh: keras.distribution.DeviceMesh, axes: tuple[str, str]
) -> dict[str, Axes]:
    """Each variable path's layout over `device_mesh`."""
    hub_map = _hub_layout_map(model, device_mesh, axes)
    windows = layout_axes.convolution_kernels(model)
    # Each variable's own layout; then one per path (a subclassed model or two nested encoders
    # can hold one path twice) and per name that Keras's counters alone tell apart.
    own = []
    for variable in layout_axes.unique_variables(model):
        path, shape = variable.path, tuple(variable.shape)
        kept = _hub_axes(hub_map, path, shape, device_mesh)
        split = layout_axes.split_axes(shape, device_mesh, axes, window=path in windows)
        own.append((path, shape, kept or split))
    return _unified(own, device_mesh, axes, windows)


def _mesh_axes(
    device_mesh: keras.distribution.DeviceMesh, model_axis: str, data_axis: str
) -> tuple[str, str]:
    if not isinstance(device_mesh, keras.distribution.DeviceMesh):
        raise TypeError(
            "device_mesh must be a keras.distribution.DeviceMesh. "
            f"Received: device_mesh={device_mesh!r}"
        )
    for argument, name in (
        ("model_parallel_dim_name", model_axis),
        ("data_parallel_dim_name", data_axis),
    ):
        if name not in device_mesh.axis_names:
            raise ValueError(
                f"{argument} must be one of the mesh's axis names {list(device_mesh.axis_names)}. "
                f"Received: {argument}={name!r}"
            )
    return model_axis, data_axis


def _model_of(preset_or_model: Any) -> keras.Model:
    """The model itself, or the backbone a preset's config describes, built deferred."""
    if isinstance(preset_or_model, keras.Model):
        return preset_or_model
    if not isinstance(preset_or_model, str | os.PathLike):
        raise TypeError(
            "preset_or_model must be a keras-hub preset (a directory or a handle) or a Keras "
            f"model. Received: preset_or_model={preset_or_model!r}"
        )
    import keras_hub

    backbone = keras_hub.models.Backbone
    directory = preset_loading._local_directory(preset_or_model, backbone)
    return preset_loading.deferred_model(backbone, os.fspath(directory), {})


def _hub_layout_map(
    model: keras.Model, device_mesh: keras.distribution.DeviceMesh, axes: tuple[str, str]
) -> keras.distribution.LayoutMap | None:
    """keras-hub's own map for the model's backbone class, where it has one."""
    hub = sys.modules.get("keras_hub")
    if hub is None:  # not imported: the model is no keras-hub model
        return None
    backbone = model.backbone if isinstance(model, hub.models.Task) else model
    own = getattr(type(backbone), "get_layout_map", None)
    if own is None:
        return None
    return own(device_mesh, model_parallel_dim_name=axes[0], data_parallel_dim_name=axes[1])


def _hub_axes(
    hub_map: keras.distribution.LayoutMap | None,
    path: str,
    shape: tuple[int, ...],
    device_mesh: keras.distribution.DeviceMesh,
) -> Axes | None:
    """keras-hub's layout for `path` if it has one and it divides `shape`."""
    layout = None if hub_map is None else hub_map[path]
    if layout is None or not layout_axes.divides(tuple(layout.axes), shape, device_mesh):
        return None
    return tuple(layout.axes)


def _unified(
    own: list[tuple[str, tuple[int, ...], Axes]],
    device_mesh: keras.distribution.DeviceMesh,
    mesh_axes: Sequence[str],
    windows: frozenset[str],
) -> dict[str, Axes]:
    """One layout per path, from each variable's own (`own`: path, shape, layout).

    Paths that differ only by the counters Keras appends to names (`conv2d`, `conv2d_1`) get the
    same layout where one divides all of them (theirs, or the best for all their shapes at once),
    the one splitting their bytes most:
    another build numbers them differently, so no key could tell them apart. Otherwise each path
    gets the one that divides all of its variables (replicated where none does).
    """
    groups: dict[str, list[tuple[str, tuple[int, ...], Axes]]] = {}
    for path, shape, axes in own:
        counterless = "/".join(re.sub(r"_\d+$", "", name) for name in path.split("/"))
        groups.setdefault(counterless, []).append((path, shape, axes))
    layouts: dict[str, Axes] = {}
    for members in groups.values():
        common = _common(members, device_mesh, mesh_axes, windows)
        for path, shape, _ in members:
            if common is None:
                alone = [m for m in members if m[0] == path]
                common_here = _common(alone, device_mesh, mesh_axes, windows)
                layouts[path] = common_here or (None,) * len(shape)
            else:
                layouts[path] = common
    return layouts


def _common(
    members: list[tuple[str, tuple[int, ...], Axes]],
    device_mesh: keras.distribution.DeviceMesh,
    mesh_axes: Sequence[str],
    windows: frozenset[str],
) -> Axes | None:
    """Of the members' layouts and the split of their shapes' common divisors, the one that
    divides every member's shape and leaves a device the fewest elements of them; None if none
    divides them all."""
    candidates = dict.fromkeys(layout for _, _, layout in members)
    shapes = [shape for _, shape, _ in members]
    if len({len(shape) for shape in shapes}) == 1:
        divisors = tuple(math.gcd(*dims) for dims in zip(*shapes, strict=True))
        window = any(path in windows for path, _, _ in members)
        split = layout_axes.split_axes(divisors, device_mesh, mesh_axes, window=window)
        if any(split):  # replicating them all is left to the fallback of each path its own
            candidates[split] = None
    fits = [
        layout
        for layout in candidates
        if all(layout_axes.divides(layout, shape, device_mesh) for shape in shapes)
    ]
    if not fits:
        return None
    return min(
        fits, key=lambda a: sum(layout_axes.held(a, shape, device_mesh) for _, shape, _ in members)
    )


def _warn_if_uneven(
    model: keras.Model,
    layouts: dict[str, Axes],
    device_mesh: keras.distribution.DeviceMesh,
    mesh_axes: tuple[str, str],
) -> None:
    """Warns where what could not be split leaves a device well above an even split of the
    variables meant to be (two or more dimensions; vectors and scalars are replicated on purpose),
    naming the least split variables by why they are."""
    devices = math.prod(device_mesh.shape)
    sizes, held, shapes = _shares(model, layouts, device_mesh)
    total, per_device = sum(sizes.values()), sum(held.values())
    if per_device <= _EVEN_SPLIT_TOLERANCE * total / devices:
        return
    excess = {path: held[path] - sizes[path] / devices for path in held}
    least_split = sorted((p for p in excess if excess[p] > 0), key=lambda p: -excess[p])
    windows = layout_axes.convolution_kernels(model)
    why: dict[str, list[str]] = {"shared": [], "window": [], "indivisible": []}
    for path in least_split:
        shape, given = shapes[path], layout_axes.parts(layouts[path], device_mesh)
        own = layout_axes.split_axes(shape, device_mesh, mesh_axes, window=path in windows)
        if layout_axes.parts(own, device_mesh) > given:
            why["shared"].append(path)
        elif (
            layout_axes.parts(layout_axes.split_axes(shape, device_mesh, mesh_axes), device_mesh)
            > given
        ):
            why["window"].append(path)
        else:
            why["indivisible"].append(path)
    reasons = {
        "shared": "{} share one key with variables of other shapes (their layers are unnamed, "
        "and Keras's counters, all that tells them apart, change from build to build), so one "
        "layout must divide them all",
        "window": "{} are convolution kernels, not split along their window (XLA's "
        "partitioner computes a strided convolution whose kernel is split there wrongly)",
        "indivisible": "the mesh's axes do not divide the dimensions of {}; a mesh whose axes "
        "divide them splits them evenly",
    }
    said = [reasons[k].format(matching.listed(why[k], 5)) for k in why if why[k]]
    if why["shared"] or why["window"]:
        said.extend(_one_axis_way_out(model, device_mesh, mesh_axes))
    warnings.warn(
        f"The layout map leaves each of the {devices} devices {per_device / 2**20:.2f} MiB of "
        f"the model's {total / 2**20:.2f} MiB of matrices, {per_device * devices / total:.2f} x "
        f"an even split: {'; '.join(said)}.",
        KerasOrbaxWarning,
        stacklevel=3,
    )


def _shares(
    model: keras.Model, layouts: dict[str, Axes], device_mesh: keras.distribution.DeviceMesh
) -> tuple[dict[str, int], dict[str, float], dict[str, tuple[int, ...]]]:
    """Of each path's matrices (two or more dimensions): bytes, bytes a device holds, shape."""
    sizes: dict[str, int] = {}
    held: dict[str, float] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for v in layout_axes.unique_variables(model):
        if v.ndim >= 2:
            size, axes = layout_axes.stored_bytes(v), layouts[v.path]
            parts = (
                layout_axes.parts(axes, device_mesh)
                if layout_axes.divides(axes, v.shape, device_mesh)
                else 1
            )
            sizes[v.path] = sizes.get(v.path, 0) + size
            held[v.path] = held.get(v.path, 0.0) + size / parts
            shapes[v.path] = tuple(v.shape)
    return sizes, held, shapes


def _one_axis_way_out(
    model: keras.Model, device_mesh: keras.distribution.DeviceMesh, mesh_axes: tuple[str, str]
) -> list[str]:
    """The mesh with every device on the model axis, named where it splits the model within the
    tolerance (a key shared by unnamed layers, or a window, may leave one axis all it can use)."""
    devices = math.prod(device_mesh.shape)
    if layout_axes.axis_size(device_mesh, mesh_axes[0]) == devices:
        return []
    names = tuple(device_mesh.axis_names)
    shape = tuple(devices if name == mesh_axes[0] else 1 for name in names)
    one_axis = keras.distribution.DeviceMesh(shape, names, list(device_mesh.devices.flat))
    sizes, held, _ = _shares(model, _layouts(model, one_axis, mesh_axes), one_axis)
    if sum(held.values()) > _EVEN_SPLIT_TOLERANCE * sum(sizes.values()) / devices:
        return []
    return [
        f"all {devices} devices on the {mesh_axes[0]!r} axis (DeviceMesh({shape}, {names})) "
        f"split them within {_EVEN_SPLIT_TOLERANCE} x"
    ]
