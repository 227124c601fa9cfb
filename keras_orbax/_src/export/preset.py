"""A sharded keras-hub backbone or task written as a keras-hub preset, its weights region by region.

keras-hub's `save_to_preset` writes the configs, then the weights with Keras's `save_weights`, which
fetches every variable whole to one host. Here every file but the weights comes from keras-hub's own
writers (the configs, `metadata.json`, a task's preprocessor with its tokenizer assets); the weights
files are written by `weights_h5.write`, the same groups and datasets Keras writes.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import keras

from keras_orbax._src.compat import hub_compat, saving_compat
from keras_orbax._src.export import export_checksums, hub_fixes, regions, weights_h5
from keras_orbax._src.storage import commit, locations


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
        SaveFailedError: a file could not be written (on any process: every process raises,
            naming each one's error); the previous preset in `directory` is untouched.
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
    sink = PresetSink(model, destination, window_bytes, max_shard_size)
    return commit.write(sink, f"save_to_preset {destination}")


class PresetSink(export_checksums.ReadBackSink):
    """A keras-hub preset, as keras-hub's `KerasPresetSaver.save_backbone` and `save_task` write
        it: task weights (only the task's own layers), the backbone's weights (one file, or an index
        and parts where it is larger than `max_shard_size` GB), the configs and the preprocessor's
        files. The whole directory is staged and swapped with the old one at once (`storage.commit`):
        a task's head never lands on another export's backbone, and the old directory's other files
        are kept. Each weights file's datasets are read back and checked before the commit, their CRCs
    kept in `keras_orbax_checksums.json` (`export_checksums`)."""

    whole_directory = True

    def __init__(
        self, model: Any, destination: Path, window_bytes: int, max_shard_size: float | None
    ) -> None:
        import keras_hub

        self.model, self.destination = model, destination
        self.reported = {}
        is_task = isinstance(model, keras_hub.models.Task)
        self.backbone = model.backbone if is_task else model
        self.files: list[weights_h5.H5File] = []
        if is_task and model.has_task_weights():
            skip = saving_compat.all_layers(self.backbone)  # as `Task.save_task_weights`
            name = hub_compat.preset_file("TASK_WEIGHTS_FILE")
            self.files.append(weights_h5.H5File(model, name, window_bytes, skip))
        size = hub_compat.preset_weights_bytes(str(destination), self.backbone) / 1024**3
        if max_shard_size is not None and size > max_shard_size:
            name = hub_compat.preset_file("SHARDED_MODEL_WEIGHTS_CONFIG_FILE")
            self.files.append(
                weights_h5.H5File(self.backbone, name, window_bytes, (), max_shard_size)
            )
        else:
            name = hub_compat.preset_file("MODEL_WEIGHTS_FILE")
            self.files.append(weights_h5.H5File(self.backbone, name, window_bytes))

    def prepare(self, staging: Path) -> None:
        commit.check_space(staging, max(file.bytes_needed() for file in self.files))

    def stage(self, staging: Path) -> list[str]:
        return [key for file in self.files for key in file.stage(staging)]

    def regions_due(self, process: int) -> list[str]:
        return [key for file in self.files for key in file.regions_due(process)]

    def region_crcs(self) -> dict[str, int]:
        return {key: crc for file in self.files for key, crc in file.region_crcs().items()}

    def assemble(self, staging: Path) -> None:
        """The staged regions copied in and every dataset read back and checked (its CRCs kept in
        the sidecar), then the configs and the preprocessor's files."""
        for file in self.files:
            file.assemble(staging)
        weights_h5.remove_regions(staging)
        entries = {
            k: v for file in self.files for k, v in file.read_back(staging, self.reported).items()
        }
        export_checksums.write_sidecar(staging / export_checksums.SIDECAR, entries)
        config = hub_compat.preset_file("CONFIG_FILE")
        hub_compat.save_preset_config(str(staging), self.backbone, config, metadata=True)
        hub_fixes.complete_preset_config(staging / config, self.backbone)
        if self.model is not self.backbone:
            config = hub_compat.preset_file("TASK_CONFIG_FILE")
            hub_compat.save_preset_config(str(staging), self.model, config, metadata=False)
            hub_fixes.complete_preset_config(staging / config, self.backbone)
            if self.model.preprocessor is not None:
                self.model.preprocessor.save_to_preset(str(staging))

    def commit_order(self) -> list[str]:
        return []  # the directory is swapped whole

    def replaced(self) -> list[str]:
        return []

    def is_export_file(self, relative: str) -> bool:
        """The configs and every weights file a preset export writes, in either form: an old one
        that this export does not write would shadow or mix with the new weights."""
        names = {
            hub_compat.preset_file(name)
            for name in (
                "CONFIG_FILE",
                "TASK_CONFIG_FILE",
                "TASK_WEIGHTS_FILE",
                "MODEL_WEIGHTS_FILE",
                "SHARDED_MODEL_WEIGHTS_CONFIG_FILE",
            )
        }
        stem = hub_compat.preset_file("SHARDED_MODEL_WEIGHTS_CONFIG_FILE").removesuffix(
            ".weights.json"
        )
        return (
            relative in names
            or relative in ("metadata.json", export_checksums.SIDECAR)
            or re.fullmatch(rf"{re.escape(stem)}_\d+\.weights\.h5", relative) is not None
        )
