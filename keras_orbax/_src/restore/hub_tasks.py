"""keras-hub models rebuilt from a saved config: what their config does not say.

A keras-hub task compiles a default optimizer in its constructor (its step counter is made from a
number, which cannot be deferred), so it is built with keras-hub's own `compile=False`. A
backbone's config does not record `enable_lora`: LoRA is enabled again, by keras-hub's own
`Backbone.enable_lora`, on the layers whose LoRA kernels the step holds. Only public keras-hub
names are used; keras-hub is imported only where the config or the process already uses it.
"""

from __future__ import annotations

import sys
from typing import Any

import keras

from keras_orbax._src.compat import saving_compat
from keras_orbax._src.format.step_record import StepRecord

_LORA_A = "/lora_kernel_a"


def uncompiled_task_config(
    config: dict[str, Any], custom_objects: dict[str, Any] | None
) -> dict[str, Any]:
    """`config` (a serialized model), with `compile=False` where it describes a keras-hub task."""
    if not _names_a_task(config, custom_objects):
        return config
    return {**config, "config": {**config["config"], "compile": False}}


def is_task(model: keras.Model) -> bool:
    """Whether `model` is a keras-hub task, whose `compile` takes Keras's arguments (it only fills
    in defaults)."""
    if "keras_hub" not in sys.modules:
        return False
    import keras_hub

    return isinstance(model, keras_hub.models.Task)


def enable_saved_lora(model: keras.Model, record: StepRecord) -> None:
    """Enables LoRA on `model`'s keras-hub backbone as the step saved it: by keras-hub's
    `enable_lora(rank, target_layer_names)`, with the rank and the names of the layers whose
    `lora_kernel_a` the step holds. Run under `deferred_init()`: the kernels are deferred."""
    saved = {
        v.path[: -len(_LORA_A)]: v.shape[-1]
        for v in record.variables.values()
        if v.path.endswith(_LORA_A)
    }
    backbone = _backbone(model)
    if not saved or backbone is None or getattr(backbone, "_lora_enabled_layers", None):
        return
    names = {
        layer.name
        for layer in saving_compat.all_layers(backbone)
        if hasattr(layer, "enable_lora")
        and isinstance(kernel := getattr(layer, "kernel", None), keras.Variable)
        and kernel.path.rpartition("/")[0] in saved
    }
    ranks = set(saved.values())
    if names and len(ranks) == 1:  # else the restore names each kernel it cannot place
        backbone.enable_lora(ranks.pop(), target_layer_names=sorted(names))


def _backbone(model: keras.Model) -> Any:
    if "keras_hub" not in sys.modules:
        return None
    import keras_hub

    if isinstance(model, keras_hub.models.Backbone):
        return model
    if isinstance(model, keras_hub.models.Task):
        return model.backbone
    return None


def _names_a_task(config: dict[str, Any], custom_objects: dict[str, Any] | None) -> bool:
    """Whether `config` describes a keras-hub `Task` (or a subclass). A subclass of the user's
    needs keras-hub imported to be deserialized at all; keras-hub's own name its module."""
    module = str(config.get("module") or "")
    if module.split(".")[0] != "keras_hub" and "keras_hub" not in sys.modules:
        return False
    try:
        import keras_hub
    except ImportError:
        return False
    name = config.get("registered_name") or config.get("class_name")
    cls = keras.saving.get_registered_object(name, custom_objects)
    return (
        isinstance(cls, type)
        and issubclass(cls, keras_hub.models.Task)
        and isinstance(config.get("config"), dict)
    )
