"""`from_preset`: a keras-hub model built from its preset without allocating, its weights read sharded."""

from __future__ import annotations

import difflib
import json
import os
import re
from pathlib import Path
from typing import Any

import keras

from keras_orbax._src.model.deferred import deferred_init
from keras_orbax._src.restore.restore import restore_sharded
from keras_orbax._src.sources import resolve
from keras_orbax._src.storage import locations
from keras_orbax.errors import CheckpointNotFoundError, NotDeferrableError


def from_preset(
    cls: Any,
    preset: str | os.PathLike,
    *,
    strict: bool = True,
    verify: bool | None = None,
    **kwargs: Any,
) -> keras.Model:
    """Like keras-hub's `cls.from_preset(preset, **kwargs)`, with each weight read straight onto its
    devices under the active distribution, and no variable ever initialized.

    keras-hub builds the model (its own preset code reads the config: same classes, same arguments)
    under `deferred_init()` with `load_weights=False`; then `restore_sharded` reads the preset's
    `model.weights.h5` (or `model.weights.json` and its parts) region by region. Set the
    distribution first, typically from `keras_orbax.get_layout_map(preset, mesh)` (any backbone)
    or keras-hub's own `cls.get_layout_map(mesh)`. `kaggle://` and `hf://` handles
    are downloaded by keras-hub's own code (not tested offline); local directories work as they are.

    Args:
        cls: A keras-hub model class: a backbone (`keras_hub.models.GemmaBackbone`) or a task
            (`keras_hub.models.GemmaCausalLM`), or a generic one (`keras_hub.models.Backbone`,
            `keras_hub.models.CausalLM`), which keras-hub resolves from the preset's config. A
            task's backbone is built deferred and gets the preset's weights; a task's own layers
            (`task.weights.h5`, a classifier's head) are read as keras-hub reads them.
        preset: A preset handle or a local preset directory.
        strict: As in `restore_sharded`: False restores what matches the preset and leaves the
            rest initialized (warning with the list), where keras-hub's own loader would refuse.
        verify: As in `restore_sharded`. A keras-hub preset records no checksums: by default
            nothing is checked and nothing said (`True` warns that nothing could be).
        **kwargs: Passed to `cls.from_preset`, as with keras-hub: `dtype` (given to the backbone,
            the weights cast to it as keras-hub casts them), `preprocessor`, `num_classes`...
            `load_weights=False` returns keras-hub's own model, initialized, with no weights read;
            with `backbone=`, keras-hub's `from_preset` is called as it is.

    Returns:
        What `cls.from_preset(preset, **kwargs)` returns, restored.

    Raises:
        TypeError: `cls` is not a keras-hub backbone or task class (or the arguments are swapped).
        NotDeferrableError: keras-hub's code for `cls` makes a variable Keras cannot defer; the
            message says how to read the weights sharded into a model keras-hub builds.

    Example:
    ```python
    mesh = keras.distribution.DeviceMesh((1, 8), ("batch", "model"))
    layout_map = keras_orbax.get_layout_map("/presets/gemma2_9b_en", mesh)
    keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map))
    gemma = keras_orbax.from_preset(keras_hub.models.CausalLM, "/presets/gemma2_9b_en")
    ```
    """
    hub = _hub_models(cls, preset)
    if not kwargs.get("load_weights", True) or "backbone" in kwargs:
        return cls.from_preset(preset, **kwargs)  # nothing for keras-orbax to read
    kwargs.pop("load_weights", None)
    directory = _local_directory(preset, cls)
    preset = os.fspath(directory)  # keras-hub reads the same resolved directory
    if not issubclass(cls, hub.Task):
        model = deferred_model(cls, preset, kwargs)
        restore_sharded(model, directory, strict=strict, verify=verify)
        return model
    # A task compiles itself when it is made (its optimizer's counters come from numbers, which
    # cannot be deferred): only its backbone, which holds the weights, is built deferred. keras-hub
    # gives a task's backbone these arguments (`get_backbone_kwargs`), and resolves a generic
    # backbone or task class from the preset's config, as here.
    backbone_kwargs: dict[str, Any] = {
        k: kwargs.pop(k) for k in ("dtype", "image_shape") if k in kwargs
    }
    backbone = deferred_model(hub.Backbone, preset, backbone_kwargs)
    task = cls.from_preset(preset, backbone=backbone, load_weights=False, **kwargs)
    restore_sharded(backbone, directory, strict=strict, verify=verify)
    _load_task_weights(task, directory, cls)
    return task


def _load_task_weights(task: Any, directory: Path, cls: Any) -> None:
    """The task's own layers (a classifier's head) from `task.weights.h5`, where keras-hub reads
    them: the preset's `task.json` names `cls` or a subclass, so the task was built from it. By
    keras-hub's own `load_task_weights`: those layers are small, and Keras assigns each whole
    array to its (sharded) variable."""
    weights = directory / "task.weights.h5"
    if not (weights.is_file() and task.has_task_weights()):
        return
    saved = saved_task_class(directory)
    if saved is not None and issubclass(saved, cls):
        task.load_task_weights(str(weights))


def saved_task_class(directory: Path) -> type | None:
    """The task class a preset's `task.json` names (registered by keras-hub once it is imported),
    or None for a preset without one."""
    config = directory / "task.json"
    if not config.is_file():
        return None
    saved = keras.saving.get_registered_object(
        json.loads(config.read_text()).get("registered_name")
    )
    return saved if isinstance(saved, type) else None


def _hub_models(cls: Any, preset: Any) -> Any:
    """`keras_hub.models`, once `cls` is known to be one of its backbone or task classes.

    Raises:
        TypeError: it is not (in one line; with the call to write where the two are swapped).
    """
    if isinstance(cls, str | os.PathLike) and hasattr(preset, "from_preset"):
        name = getattr(preset, "__name__", type(preset).__name__)
        raise TypeError(
            f"from_preset takes the class first, then the preset: keras_orbax.from_preset("
            f"{name}, {os.fspath(cls)!r}). Received: cls={cls!r}, preset={name}"
        )
    import keras_hub

    hub = keras_hub.models
    if not (isinstance(cls, type) and issubclass(cls, hub.Backbone | hub.Task)):
        raise TypeError(
            "cls must be a keras-hub backbone or task class, such as keras_hub.models.CausalLM "
            f"or keras_hub.models.GemmaBackbone. Received: cls={cls!r}"
        )
    return hub


def deferred_model(cls: Any, preset: str, kwargs: dict[str, Any]) -> keras.Model:
    """`cls.from_preset(preset, load_weights=False, **kwargs)` built under `deferred_init()`."""
    try:
        with deferred_init():
            return cls.from_preset(preset, load_weights=False, **kwargs)
    except NotDeferrableError as error:
        raise NotDeferrableError(
            f"keras_orbax.from_preset cannot build {cls.__name__} without allocating it: "
            "building it makes a variable from a number (not an initializer), which Keras cannot "
            "defer. Let keras-hub build it, then read the weights sharded: model = "
            f"{cls.__name__}.from_preset({preset!r}, load_weights=False); "
            f"keras_orbax.restore_sharded(model, {preset!r})."
        ) from error.__cause__


def _local_directory(preset: str | os.PathLike, cls: Any) -> Path:
    """The preset's local directory (as given, or where keras-hub downloaded a handle or one of
    its built-in preset names to), checked to be a preset or a Hugging Face directory.

    Raises:
        CheckpointNotFoundError: neither a directory nor a keras-hub preset name.
        UnsupportedSourceError: it names another kind of saved state; the message says what to
            call instead.
    """
    text = os.fspath(preset)
    if _names_a_builtin_preset(text, cls):
        from keras_orbax._src.compat import hub_compat

        text = os.fspath(hub_compat.downloaded_preset(text))
    located = resolve.locate(text)
    if located.kind not in ("keras-preset", "transformers"):
        source = resolve.open_located(located)
        use = (
            "build the model and call keras_orbax.restore_sharded."
            if source.model_config is None
            else "it holds its model config: call keras_orbax.load_model."
        )
        raise resolve.unsupported(source, "from_preset", use)
    return Path(located.location)


def _names_a_builtin_preset(text: str, cls: Any) -> bool:
    """Whether `text` is a handle (`kaggle://`, `hf://`, ...) or one of keras-hub's preset names
    for `cls` (which keras-hub downloads, as a handle), rather than a local directory.

    Raises:
        CheckpointNotFoundError: no such directory, nor such a preset name: the message names
            keras-hub's closest preset names for `cls`.
    """
    if "://" in text:
        return True
    path = locations.as_path(text)
    root = locations.as_path(re.sub(r"@\d+/*$", "", text))  # `ckpt@3` names `ckpt`
    if path.exists() or root.exists() or locations.is_remote(path):
        return False
    presets = list(getattr(cls, "presets", None) or {})
    if text in presets:
        return True
    close = difflib.get_close_matches(text, presets, n=3, cutoff=0.6)
    if close:
        hint = f" Did you mean {' or '.join(repr(name) for name in close)}?"
    else:
        some = ", ".join(repr(name) for name in presets[:3])
        hint = f" {cls.__name__}.presets lists the {len(presets)} it knows" + (
            f" ({some}, ...)." if presets else "."
        )
    raise CheckpointNotFoundError(
        f"No such preset: '{text}' is neither a directory ('{path}' does not exist) nor one of "
        f"keras-hub's preset names for {cls.__name__}.{hint} Received: preset={text!r}"
    )
