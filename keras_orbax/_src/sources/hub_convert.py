"""Which safetensors tensor keras-hub puts in which variable of a backbone, and through what hook.

keras-hub loads a Hugging Face directory by running a converter module (chosen from `model_type`)
that calls `loader.port_weight(variable, hf_key, hook_fn)` for every variable: read the whole
tensor, apply the hook (a transpose, a reshape, ...) on the host, then `variable.assign` it. Here the
same converter runs against a loader that records each call instead, so the caller can read each
variable's shards straight from the file. Needs keras-hub and safetensors (the `hub` extra; see
`.ci/run` for installing keras-hub without TensorFlow).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from typing import Any

import keras
import numpy as np

from keras_orbax._src.compat import hub_compat, keras_compat
from keras_orbax._src.sources.hub_hooks import HookPlan, classify
from keras_orbax._src.sources.safetensors_files import (
    SafetensorsTensor,
    read_directory,
    read_tensor,
)
from keras_orbax.errors import CheckpointMismatchError

Hook = Callable[[Any, list[int]], Any]

__all__ = [
    "HookPlan",
    "PortedTensor",
    "build_backbone",
    "classify_hook",
    "converted_shape",
    "host_value",
    "port_tensors",
    "unported_variables",
]


@dataclasses.dataclass(frozen=True, eq=False)
class PortedTensor:
    """One `port_weight` call of a keras-hub converter: `variable` gets `hook(tensor, shape)`.

    Attributes:
        variable: The backbone's Keras variable.
        tensor: Where the Hugging Face tensor lies on disk.
        hook: The converter's `hook_fn(array, list(variable.shape))`, or None for as-is.
    """

    variable: keras.Variable
    tensor: SafetensorsTensor
    hook: Hook | None


def _transformers_loader(directory: str | os.PathLike) -> Any:
    loader = hub_compat.hub_preset_loader(os.fspath(directory))
    if not hub_compat.hub_is_transformers_loader(loader):
        raise ValueError(
            f"{directory} is not a Hugging Face model directory (its config.json has no "
            f"`model_type`). Received: directory={directory!r}"
        )
    return loader


def build_backbone(directory: str | os.PathLike, **kwargs: Any) -> keras.Model:
    """Builds, without loading weights, the backbone `Backbone.from_preset(directory)` builds.

    keras-hub picks the backbone class and its config from `config.json`'s `model_type`. Call it
    under `keras_orbax.deferred_init()` to allocate nothing.

    Args:
        directory: A local Hugging Face model directory (`config.json` + safetensors).
        **kwargs: Passed to the backbone's constructor (e.g. `dtype`), as `from_preset` does.
    """
    loader = _transformers_loader(directory)
    return loader.load_backbone(loader.check_backbone_class(), load_weights=False, **kwargs)


class _MissingTensor(KeyError):
    """A tensor the converter asks for that the directory lacks: a KeyError still, as a converter
    probing for an optional tensor expects."""

    def __init__(self, directory: str, name: str, variable: keras.Variable | None) -> None:
        super().__init__(f"{directory} has no tensor {name!r}.")
        self.name = name
        self.variable = variable


class _Unread:
    """What the recorder's `get_tensor` returns: enough to probe for a key, never a value."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __array__(self, *args: Any, **kwargs: Any) -> np.ndarray:
        raise NotImplementedError(
            f"The keras-hub converter uses the values of {self.name!r} outside `port_weight`; "
            "keras-orbax cannot map such a conversion onto reads from the file."
        )


def _recording_loader(
    directory: str, tensors: dict[str, SafetensorsTensor], record: list[PortedTensor]
) -> Any:
    base: Any = hub_compat.hub_safetensor_loader_class()

    class RecordingLoader(base):
        """keras-hub's loader, with `port_weight` recording instead of reading and assigning."""

        def get_tensor(self, hf_weight_key: str) -> Any:
            key = self.get_prefixed_key(hf_weight_key, tensors)
            if key not in tensors:
                raise _MissingTensor(directory, hf_weight_key, None)
            return _Unread(key)

        def port_weight(
            self, keras_variable: keras.Variable, hf_weight_key: str, hook_fn: Hook | None = None
        ) -> None:
            key = self.get_prefixed_key(hf_weight_key, tensors)
            if key not in tensors:
                raise _MissingTensor(directory, hf_weight_key, keras_variable)
            record.append(PortedTensor(keras_variable, tensors[key], hook_fn))

    return RecordingLoader(directory)


def port_tensors(backbone: keras.Model, directory: str | os.PathLike) -> list[PortedTensor]:
    """Runs keras-hub's converter for `directory` on `backbone`, recording what it would load.

    Reads `config.json` and the safetensors headers only; no tensor data, no variable is touched.
    A variable ported more than once keeps only its last port, as keras-hub's assignments would.

    Args:
        backbone: The backbone `build_backbone(directory)` made (deferred or not).
        directory: A local Hugging Face model directory.

    Returns:
        One `PortedTensor` per variable the converter fills, in the converter's order.

    Raises:
        CheckpointMismatchError: the converter asks for a tensor the directory lacks (its
            `config.json` describes another model than its safetensors files hold).
        NotImplementedError: the converter uses tensor values itself (e.g. stacks MoE experts).
    """
    loader = _transformers_loader(directory)
    tensors = read_directory(directory)
    record: list[PortedTensor] = []
    try:
        with _recording_loader(os.fspath(directory), tensors, record) as recorder:
            hub_compat.hub_convert_weights(loader, backbone, recorder)
    except _MissingTensor as missing:
        into = ""
        if (variable := missing.variable) is not None:
            into = (
                f", which keras-hub's converter reads into {variable.path} {tuple(variable.shape)}"
            )
        raise CheckpointMismatchError(
            f"{directory} has no tensor {missing.name!r}{into}: its config.json describes "
            f"another model than its {len(tensors)} safetensors tensors (compare its layer count, "
            "sizes and `tie_word_embeddings` with the tensors: `keras-orbax inspect "
            f"{directory}`). No variable was modified."
        ) from None
    last = {id(p.variable): i for i, p in enumerate(record)}
    return [p for i, p in enumerate(record) if last[id(p.variable)] == i]


def unported_variables(backbone: keras.Model, ported: list[PortedTensor]) -> list[keras.Variable]:
    """The backbone's variables that no `PortedTensor` fills."""
    filled = {id(p.variable) for p in ported}
    return [v for v in backbone.variables if id(v) not in filled]


def classify_hook(ported: PortedTensor) -> HookPlan:
    """What `ported.hook` does to the tensor: identity, transpose, reshape, rearrange or other."""
    return classify(ported.hook, ported.tensor.shape, ported.tensor.dtype, ported.variable.shape)


def converted_shape(ported: PortedTensor, hook: HookPlan) -> tuple[int, ...]:
    """The shape `ported.hook` gives the tensor, found without reading it: the traced hook's, or
    for a hook that cannot be traced and changes the element count (so cannot be a reshape), its
    output on a stand-in that holds one element; the stored shape where the hook fails on it."""
    if hook.shape is not None:
        return hook.shape
    target = tuple(int(n) for n in ported.variable.shape)
    stored = tuple(ported.tensor.shape)
    if ported.hook is None or math.prod(stored) == math.prod(target):
        return target  # as traced hooks do; the read applies the hook to the tensor itself
    stand_in = np.broadcast_to(np.zeros((), ported.tensor.dtype), stored)
    try:
        return tuple(np.shape(ported.hook(stand_in, list(target))))
    except Exception:  # e.g. a reshape the sizes do not allow: the shapes say what is wrong
        return stored


def host_value(ported: PortedTensor) -> np.ndarray:
    """The value keras-hub would assign to `ported.variable`, computed on the host.

    Reads exactly the tensor's bytes, applies the hook as `port_weight` does, then casts to the
    variable's stored dtype as `assign` does.
    """
    value = read_tensor(ported.tensor)
    if ported.hook is not None:
        value = ported.hook(value, list(ported.variable.shape))
    return np.asarray(value).astype(keras_compat.stored_dtype(ported.variable), copy=False)
