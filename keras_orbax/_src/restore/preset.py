"""`from_preset`: a keras-hub model built from its preset without allocating, its weights read sharded."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import keras

from keras_orbax._src.model.deferred import deferred_init
from keras_orbax._src.restore.restore import restore_sharded
from keras_orbax._src.sources import resolve


def from_preset(cls: Any, preset: str | os.PathLike, **kwargs: Any) -> keras.Model:
    """Like keras-hub's `cls.from_preset(preset, **kwargs)`, with each weight read straight onto its
    devices under the active distribution, and no variable ever initialized.

    keras-hub builds the model (its own preset code reads the config: same classes, same arguments)
    under `deferred_init()` with `load_weights=False`; then `restore_sharded` reads the preset's
    `model.weights.h5` (or `model.weights.json` and its parts) region by region. Set the
    distribution first, typically from `cls.get_layout_map(mesh)`. `kaggle://` and `hf://` handles
    are downloaded by keras-hub's own code (not tested offline); local directories work as they are.

    Args:
        cls: A keras-hub class: a backbone (`keras_hub.models.GemmaBackbone`) or a task
            (`keras_hub.models.GemmaCausalLM`): its backbone is built deferred and gets the
            preset's weights; task-only weights (`task.weights.h5`) are not read yet.
        preset: A preset handle or a local preset directory.
        **kwargs: Passed to `cls.from_preset`, as with keras-hub.

    Returns:
        What `cls.from_preset(preset, **kwargs)` returns, restored.

    Example:
    ```python
    mesh = keras.distribution.DeviceMesh((1, 8), ("batch", "model"))
    layout_map = keras_hub.models.GemmaBackbone.get_layout_map(mesh)
    keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map))
    gemma = keras_orbax.from_preset(keras_hub.models.GemmaCausalLM, "/presets/gemma2_9b_en")
    ```
    """
    directory = _local_directory(preset)
    preset = os.fspath(directory)  # keras-hub reads the same resolved directory
    backbone_cls = getattr(cls, "backbone_cls", None)
    if backbone_cls is None:  # a backbone
        with deferred_init():
            model = cls.from_preset(preset, load_weights=False, **kwargs)
        restore_sharded(model, directory)
        return model
    # A task compiles itself when it is made (its optimizer's counters come from numbers, which
    # cannot be deferred): only its backbone, which holds the weights, is built deferred.
    backbone_kwargs = {k: kwargs[k] for k in ("dtype",) if k in kwargs}
    with deferred_init():
        backbone = backbone_cls.from_preset(preset, load_weights=False, **backbone_kwargs)
    task = cls.from_preset(preset, backbone=backbone, load_weights=False, **kwargs)
    restore_sharded(backbone, directory)
    return task


def _local_directory(preset: str | os.PathLike) -> Path:
    """The preset's local directory (as given, or where keras-hub downloaded a handle to),
    checked to be a preset or a Hugging Face directory.

    Raises:
        UnsupportedSourceError: it names another kind of saved state; the message says what to
            call instead.
    """
    text = os.fspath(preset)
    if text.startswith(("kaggle://", "hf://", "modelscope://")):
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
