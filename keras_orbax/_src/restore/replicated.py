"""The warning for variables a restore puts whole on every device where the checkpoint holds them
sharded: the out-of-memory path keras-orbax exists to remove, most often a LayoutMap key that
matches nothing (`"dense.*kernal"`)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import keras

from keras_orbax._src.model.matching import ReadRequest, counted, listed
from keras_orbax._src.runtime.progress import human_bytes


def replicated_message(
    requests: Sequence[ReadRequest], paths: Mapping[str, str], model_name: str
) -> str | None:
    """What to tell the user where a distribution of several devices gets variables whole on each
    device that the checkpoint holds split (its saved layout partitions some axis over a mesh
    axis of more than one device); None where there are none. One message for all of them."""
    distribution = keras.distribution.distribution()
    if distribution is None:
        return None
    found = [
        r
        for r in requests
        if _sharded(r.record.layout)
        and len(r.target.sharding.device_set) > 1
        and r.target.sharding.is_fully_replicated
    ]
    if not found:
        return None
    found.sort(key=lambda r: -r.record.nbytes)
    named = [
        f"{paths.get(r.record.key, r.record.key)} ({human_bytes(r.record.nbytes)})" for r in found
    ]
    devices = len(found[0].target.sharding.device_set)
    total = human_bytes(sum(r.record.nbytes for r in found))
    return (
        f"Model '{model_name}': {counted(len(found), 'variable')} saved sharded {'is' if len(found) == 1 else 'are'} "
        f"restored whole on each of the {devices} devices, {total} per device: {listed(named)}. "
        + _hint(distribution)
    )


def _hint(distribution: Any) -> str:
    if isinstance(distribution, keras.distribution.ModelParallel):
        return (
            "No key of the ModelParallel's LayoutMap matches their paths, so they are "
            "replicated. A key matches a variable's path exactly or by re.fullmatch: "
            "'dense.*kernel' does not match 'model/dense/kernel', '.*dense.*kernel' does. If "
            "they should be replicated, nothing is wrong."
        )
    return (
        f"{type(distribution).__name__} replicates every variable; to split them over the "
        "devices, use ModelParallel with a LayoutMap."
    )


def _sharded(layout: Mapping[str, Any] | None) -> bool:
    """Whether a saved layout splits some axis over more than one device."""
    if not layout:
        return False
    sizes = dict(zip(layout.get("axis_names", []), layout.get("mesh_shape", []), strict=False))
    for axes in layout.get("partition", []):
        names = [] if axes is None else [axes] if isinstance(axes, str) else list(axes)
        if math.prod(int(sizes.get(name, 1)) for name in names) > 1:
            return True
    return False
