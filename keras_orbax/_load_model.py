"""`load_model`: rebuild a model from a checkpoint's config without allocating it, then restore it sharded."""

from __future__ import annotations

import os
from typing import Any

import keras

from keras_orbax import _steps
from keras_orbax._deferred import deferred_init
from keras_orbax._restore import restore_sharded
from keras_orbax.errors import CheckpointMismatchError


def load_model(
    directory: str | os.PathLike,
    step: int | None = None,
    *,
    custom_objects: dict[str, Any] | None = None,
    compile: bool = True,
    safe_mode: bool = True,
    strict: bool = True,
) -> keras.Model:
    """Rebuilds the model saved in a checkpoint and restores it sharded under the active distribution.

    The model is built from the config stored with the step under `deferred_init()`, so no variable is
    allocated before its shards are read onto their devices. Call on every process.

    Args:
        directory: The root given to `save` or to the `ModelCheckpoint` callback.
        step: The step to load; `None` means the latest committed one.
        custom_objects: Classes and functions the config names, as for `keras.models.load_model`.
        compile: Compile the model as it was when saved, and restore its optimizer state.
        safe_mode: As in Keras: refuse to deserialize code (`Lambda` layers and such) stored in the
            checkpoint. Nothing in a checkpoint is ever unpickled.
        strict: As in `restore_sharded`.

    Returns:
        The restored model, ready to predict, evaluate, fit and save.

    Raises:
        CheckpointMismatchError: the step holds no model config (the model was not serializable).

    Example:
    ```python
    keras.distribution.set_distribution(ModelParallel(layout_map=layout_map))
    model = keras_orbax.load_model("/ckpt")
    ```
    """
    _, path = _steps.step_path(directory, step)
    config = _steps.read_record(path).model_config
    if config is None:
        raise CheckpointMismatchError(
            f"Checkpoint step '{path}' holds no model config: the model that saved it could not be "
            "serialized (e.g. a subclassed model without get_config). Build the model in code and "
            "call keras_orbax.restore_sharded(model, directory)."
        )
    config = dict(config)
    compile_config = config.pop("compile_config", None)
    with deferred_init(), keras.saving.custom_object_scope(custom_objects or {}):
        model = keras.saving.deserialize_keras_object(config, safe_mode=safe_mode)
    if compile and compile_config:  # {} for a model that was never compiled
        # Outside deferred_init(): an optimizer's iteration counter is not made from an initializer.
        model.compile_from_config(compile_config)
    restore_sharded(model, directory, step, strict=strict)
    return model
