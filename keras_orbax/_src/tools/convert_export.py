"""`convert` to the formats people share: a `.weights.h5` file or a keras-hub preset directory.

The source is restored into the model first (sharded under the active distribution, each region read
onto its devices), then written by the export sinks region by region: peak host memory is the model
as it is resident plus one window, never a whole sharded variable more.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import keras

from keras_orbax._src.export import preset as preset_sink
from keras_orbax._src.export import transformers as transformers_sink
from keras_orbax._src.export import weights_h5
from keras_orbax._src.restore import load_model, preset, restore
from keras_orbax._src.sources import resolve
from keras_orbax._src.storage import locations

_HUB_KINDS = ("keras-preset", "transformers")


def names_an_export(
    destination: str | os.PathLike, *, to_preset: bool, to_transformers: bool = False
) -> bool:
    """Whether `convert` writes `destination` through an export sink rather than as a checkpoint."""
    return (
        to_preset
        or to_transformers
        or os.fspath(destination).rstrip("/").endswith(weights_h5.SUFFIX)
    )


def export(
    source: str | os.PathLike,
    destination: str | os.PathLike,
    *,
    model: keras.Model | None,
    to_preset: bool,
    on_write: Callable[[int, int], None] | None = None,
    to_transformers: bool = False,
) -> Path:
    """Restores `source` into `model` (or the model it describes) and writes it to `destination`.

    Raises:
        UnsupportedSourceError: there is no `model` and `source` does not describe one.
        ValueError: `to_preset` and the model is not a keras-hub backbone or task.
        UnsupportedSourceError: `to_transformers` and keras-hub does not export the model.
    """
    if to_preset and to_transformers:
        raise ValueError(
            "convert writes one format: a keras-hub preset or a Hugging Face directory. "
            "Received: preset=True, transformers=True"
        )
    if to_preset or to_transformers:  # before anything is read
        resolve.check_destination(
            destination, "transformers" if to_transformers else "keras-preset"
        )
    if model is None:
        model = _described_model(source, to_preset or to_transformers)
    else:
        restore.restore_sharded(model, source)
    if to_transformers:
        written = transformers_sink.export_to_transformers(model, destination)
    elif to_preset:
        written = preset_sink.save_to_preset(model, destination)
    else:
        written = weights_h5.save_weights(model, destination)
    if on_write is not None:
        total = sum(int(v.value.nbytes) for v in model.weights)
        on_write(total, total)
    return written


def _described_model(source: str | os.PathLike, to_preset: bool) -> keras.Model:
    """The model a checkpoint's saved config or a keras-hub preset (Keras or Hugging Face format)
    describes, restored from it."""
    opened = resolve.open_source(source)
    if opened.kind in _HUB_KINDS:
        import keras_hub

        # A task preset (its `task.json`) as the task, preprocessor and head included, so that
        # its export is the task's; otherwise the backbone.
        task = preset.saved_task_class(locations.as_path(os.fspath(opened.location)))
        return preset.from_preset(task or keras_hub.models.Backbone, source)
    if opened.model_config is None:
        raise resolve.unsupported(
            opened,
            "convert",
            "it describes no model to write: pass the architecture (model=..., or --model "
            "MODULE:FUNCTION).",
        )
    if to_preset:
        import keras_hub  # registers keras-hub's classes, which the saved config names

    # Compiled as saved, for a `.weights.h5`: Keras's `save_weights` writes the optimizer's state
    # where the model has one. A preset and a Hugging Face directory hold none.
    return load_model.load_described(
        resolve.open_on_every_process(source, None, "convert"),
        compile=not to_preset,
        verb=None if to_preset else "convert",
    )
