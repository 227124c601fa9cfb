"""A sharded keras-hub backbone or task written as a keras-hub preset, its weights region by region.

keras-hub's `save_to_preset` writes the configs, then the weights with Keras's `save_weights`, which
fetches every variable whole to one host. Here every file but the weights comes from keras-hub's own
writers (the configs, `metadata.json`, a task's preprocessor with its tokenizer assets); the weights
files are written by `weights_h5.write`, the same groups and datasets Keras writes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import keras

from keras_orbax._src.compat import hub_compat, saving_compat
from keras_orbax._src.export import regions, weights_h5
from keras_orbax._src.runtime import multihost
from keras_orbax._src.storage import locations
from keras_orbax.errors import SaveFailedError


def save_to_preset(
    model: keras.Model,
    directory: str | os.PathLike,
    *,
    window_bytes: int = regions.DEFAULT_WINDOW_BYTES,
    max_shard_size: float | None = 10,
) -> Path:
    """Writes a keras-hub backbone or task as a preset, without fetching any variable whole.

    The files are those `model.save_to_preset(directory)` writes (`config.json`, `metadata.json`,
    `model.weights.h5`; for a task also `task.json`, `task.weights.h5` where the task has weights of
    its own, and its preprocessor's files), and keras-hub's `from_preset` reads them back. Call on
    every process: each process's own shards are read window by window; process 0 writes the files.

    Args:
        model: A built keras-hub `Backbone` or `Task`, sharded or not.
        directory: The preset directory (local; created if missing, its files replaced).
        window_bytes: The most bytes of one array copied to the host at a time (256 MiB).
        max_shard_size: As keras-hub's: a backbone larger than this many GB is written as
            `model.weights.json` and parts of at most this size; None: one `model.weights.h5`.

    Returns:
        The preset directory (absolute).

    Example:
    ```python
    keras_orbax.save_to_preset(causal_lm, "my_preset")
    keras_hub.models.CausalLM.from_preset("my_preset")
    ```

    Raises:
        ValueError: `model` is neither a keras-hub `Backbone` nor a `Task`, or `directory` is an
            object-store URL.
        OSError: a file could not be written; no weights file was left half written. Under
            `jax.distributed`, `SaveFailedError` on every process, naming each one's error.
    """
    import keras_hub

    text = os.fspath(directory)
    if locations.is_remote(text):
        raise ValueError(
            "save_to_preset writes a local directory; write it locally, then copy it. "
            f"Received: directory={text!r}"
        )
    if not isinstance(model, keras_hub.models.Backbone | keras_hub.models.Task):
        raise ValueError(
            "save_to_preset writes a keras-hub Backbone or Task; for any other Keras model use "
            f"`keras_orbax.save_weights`. Received: model of type {type(model).__name__}"
        )
    destination: Path = locations.as_path(text)
    if isinstance(model, keras_hub.models.Task):
        _save_task(model, destination, window_bytes, max_shard_size)
    else:
        _save_backbone(model, destination, window_bytes, max_shard_size)
    return destination


def _save_backbone(
    backbone: Any, directory: Path, window_bytes: int, max_shard_size: float | None
) -> None:
    """As keras-hub's `KerasPresetSaver.save_backbone`: one weights file, or an index and parts
    where the backbone is larger than `max_shard_size` GB. The weights first, so that a preset
    whose export failed has no config and never loads."""
    size = hub_compat.preset_weights_bytes(str(directory), backbone) / 1024**3
    index = directory / hub_compat.preset_file("SHARDED_MODEL_WEIGHTS_CONFIG_FILE")
    single = directory / hub_compat.preset_file("MODEL_WEIGHTS_FILE")
    if max_shard_size is not None and size > max_shard_size:
        weights_h5.write(backbone, index, window_bytes=window_bytes, max_shard_size=max_shard_size)
        stale = [single]
    else:
        weights_h5.write(backbone, single, window_bytes=window_bytes)
        stale = [*_parts(index), index]
    # The other form, from an earlier save: keras-hub reads `model.weights.h5` where there is
    # one, so a stale one would shadow the weights just written.
    _on_primary("save_to_preset stale weights", lambda: _remove(stale))
    _on_primary(
        "save_to_preset config",
        lambda: hub_compat.save_preset_config(
            str(directory), backbone, hub_compat.preset_file("CONFIG_FILE"), metadata=True
        ),
    )


def _save_task(task: Any, directory: Path, window_bytes: int, max_shard_size: float | None) -> None:
    """As keras-hub's `KerasPresetSaver.save_task`: task weights (only the task's own layers),
    the backbone, the task config and the preprocessor's files."""
    if task.has_task_weights():
        weights = directory / hub_compat.preset_file("TASK_WEIGHTS_FILE")
        skip = saving_compat.all_layers(task.backbone)  # as `Task.save_task_weights`
        weights_h5.write(task, weights, window_bytes=window_bytes, skip=skip)
    _save_backbone(task.backbone, directory, window_bytes, max_shard_size)

    def configs() -> None:
        config_file = hub_compat.preset_file("TASK_CONFIG_FILE")
        hub_compat.save_preset_config(str(directory), task, config_file, metadata=False)
        if task.preprocessor is not None:
            task.preprocessor.save_to_preset(str(directory))

    _on_primary("save_to_preset task config", configs)


def _remove(paths: list[Path]) -> None:
    for path in paths:
        path.unlink(missing_ok=True)


def _parts(index: Path) -> list[Path]:
    """The part files a `model.weights.json` lists (none if there is none or it cannot be read)."""
    try:
        weight_map = json.loads(index.read_text()).get("weight_map", {})
    except (OSError, ValueError, AttributeError):
        return []
    names = {name for name in weight_map.values() if isinstance(name, str) and "/" not in name}
    return [index.parent / name for name in sorted(names)]


def _on_primary(name: str, write: Any) -> None:
    """Runs `write` on process 0; every process raises if it failed."""
    error = None
    if multihost.is_primary():
        try:
            write()
        except Exception as failed:  # reported to every process by `agree`, which re-raises
            error = failed
    multihost.agree(name, error, unchanged=multihost.NOTHING_EXPORTED, fallback=SaveFailedError)
