"""`load_model`: rebuild a model from a checkpoint's config without allocating it, then restore it sharded."""

from __future__ import annotations

import os
import warnings
from typing import Any

import keras

from keras_orbax._src.compat import saving_compat
from keras_orbax._src.model.deferred import deferred_init
from keras_orbax._src.model.matching import counted
from keras_orbax._src.model.state_keys import OPTIMIZER
from keras_orbax._src.restore import hub_tasks
from keras_orbax._src.restore.restore import restore_source
from keras_orbax._src.sources import resolve
from keras_orbax._src.sources.base import Source
from keras_orbax.errors import CheckpointMismatchError, KerasOrbaxWarning


def load_model(
    directory: str | os.PathLike,
    step: int | None = None,
    *,
    custom_objects: dict[str, Any] | None = None,
    compile: bool = True,
    safe_mode: bool = True,
    strict: bool = True,
    verify: bool | None = None,
) -> keras.Model:
    """Rebuilds the model saved in a checkpoint and restores it sharded under the active distribution.

    The model is built from the config stored with the step under `deferred_init()`, so no variable is
    allocated before its shards are read onto their devices. Call on every process.

    Args:
        directory: The root given to `save` or to the `ModelCheckpoint` callback (or one of its
            steps, `ckpt/8`), a directory written by `keras.callbacks.OrbaxCheckpoint`, or a
            `.keras` archive written by `model.save` (its weights read in place, region by
            region). Weights files, presets and Hugging Face directories hold no Keras model
            config: the error names what to call instead.
        step: The step to load; `None` means the latest committed one.
        custom_objects: Classes and functions the config names, as for `keras.models.load_model`.
        compile: Compile the model as it was when saved, and restore its optimizer state.
        safe_mode: As in Keras: refuse to deserialize code (`Lambda` layers and such) stored in the
            checkpoint. Nothing in a checkpoint is ever unpickled.
        strict: As in `restore_sharded`.
        verify: As in `restore_sharded`: by default every byte read is checked against its
            recorded checksum where the checkpoint records one; False reads without checking.

    Returns:
        The restored model, ready to predict, evaluate, fit and save.

    Raises:
        UnsupportedSourceError: the location holds no model config (a weights file, a preset, a
            model that was not serializable); the message names what to call instead.

    Example:
    ```python
    keras.distribution.set_distribution(ModelParallel(layout_map=layout_map))
    model = keras_orbax.load_model("/ckpt")
    ```
    """
    source = resolve.open_on_every_process(directory, step, "load_model")
    return load_described(
        source,
        custom_objects=custom_objects,
        compile=compile,
        safe_mode=safe_mode,
        strict=strict,
        verify=verify,
    )


def load_described(
    source: Source,
    *,
    custom_objects: dict[str, Any] | None = None,
    compile: bool = True,
    safe_mode: bool = True,
    strict: bool = True,
    verify: bool | None = None,
    verb: str | None = "load_model",
) -> keras.Model:
    """`load_model` of a source every process has opened. `verb`: the call that a warning about
    optimizer state left out names; None where the caller leaves it out on purpose (`convert` to
    a format that holds none)."""
    if source.model_config is None:
        raise resolve.unsupported(source, verb or "convert", _without_config(source))
    model = build_deferred(source, custom_objects, safe_mode, compile=compile)
    try:
        restore_source(model, source, strict=strict, verify=verify, verb=verb)
    except CheckpointMismatchError:  # nothing was changed
        if not (strict and _only_the_optimizer_differs(model, source)):
            raise
        restore_source(model, source, strict=False, verify=verify, warn_lenient=False, verb=verb)
    return model


def _only_the_optimizer_differs(model: keras.Model, source: Source) -> bool:
    """Keras's `load_model` restores the weights strictly but skips, with a warning, optimizer
    state that does not fit the optimizer compiled from the config (another class: a
    `mixed_float16` model loaded under the float32 policy gets Adam, not the LossScaleOptimizer it
    saved). True, and warned as Keras does, where a strict restore would fail on that alone."""
    if getattr(model, "optimizer", None) is None:
        return False
    prepared = source.prepare(model, strict=False)  # changes nothing
    lenient, record = prepared.plan.lenient, prepared.record.variables
    roles = {**{k: v.role for k, v in record.items()}, **prepared.state.roles}
    if not lenient or prepared.plan.layouts or any(roles[k] != OPTIMIZER for k in lenient):
        return False
    saved = [v for v in record.values() if v.role == OPTIMIZER]
    hint = ""
    mixed = any(
        layer.dtype_policy.name == "mixed_float16" for layer in saving_compat.all_layers(model)
    )
    if mixed and not isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer):
        hint = (
            " Its layers are mixed_float16, whose LossScaleOptimizer Keras compiles only where "
            "that is the global policy: keras.config.set_dtype_policy('mixed_float16') before "
            "load_model restores it too."
        )
    mine = sum(role == OPTIMIZER for role in prepared.state.roles.values())
    warnings.warn(
        f"load_model('{source.label}'): its optimizer state ({counted(len(saved), 'variable')}) "
        f"does not fit the {type(model.optimizer).__name__} compiled from its config "
        f"({counted(mine, 'variable')}), so it is skipped, as keras.saving.load_model skips it: "
        f"the weights are restored, the optimizer starts afresh.{hint}",
        KerasOrbaxWarning,
        stacklevel=3,
    )
    return True


def _without_config(source: Source) -> str:
    """What to call instead for a source that holds no Keras model config."""
    if source.kind in ("keras-preset", "transformers"):
        return "build it with keras_orbax.from_preset(keras_hub.models.<Class>, location)."
    if source.kind == "keras-weights":
        return "a weights file holds no architecture: build the model and call restore_sharded."
    return (
        "the step holds no model config (the model that saved it could not be serialized, e.g. "
        "a subclassed model without get_config): build the model and call restore_sharded."
    )


def build_deferred(
    source: Source,
    custom_objects: dict[str, Any] | None,
    safe_mode: bool,
    *,
    compile: bool,
) -> keras.Model:
    """The model `source`'s saved config describes, built under `deferred_init()` and, where
    `compile`, compiled as it was saved (its optimizer unbuilt: the restore builds its slots
    deferred). A keras-hub task is built uncompiled and LoRA enabled as saved (`hub_tasks`)."""
    assert source.model_config is not None
    config = dict(source.model_config)
    compile_config = config.pop("compile_config", None)
    config = hub_tasks.uncompiled_task_config(config, custom_objects)
    with deferred_init():
        model = keras.saving.deserialize_keras_object(
            config, custom_objects=custom_objects, safe_mode=safe_mode
        )
        hub_tasks.enable_saved_lora(model, source.record)
    if compile and compile_config:  # {} for a model that was never compiled
        compile_deferred(model, compile_config, custom_objects, safe_mode)
    return model


def compile_deferred(
    model: keras.Model,
    compile_config: dict[str, Any],
    custom_objects: dict[str, Any] | None,
    safe_mode: bool,
) -> None:
    """`model.compile_from_config`, deserialized in the same custom-object and safe-mode scopes as
    the model, but leaving the optimizer unbuilt: `restore_sharded` builds its slots deferred, so
    no initialized copy of the optimizer state is ever made. (Outside `deferred_init()`: an
    optimizer's step counter is made from a number.)"""
    if type(model).compile is not keras.Model.compile and not hub_tasks.is_task(model):
        model.compile_from_config(compile_config)  # Keras warns that a custom compile is not called
        return
    # keras-hub's tasks override `compile` only to fill in defaults; it takes Keras's arguments.
    arguments = keras.saving.deserialize_keras_object(
        compile_config, custom_objects=custom_objects, safe_mode=safe_mode
    )
    model.compile(**arguments)
