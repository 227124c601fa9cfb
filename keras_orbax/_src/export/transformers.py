"""`export_to_transformers`: a sharded keras-hub model as a Hugging Face directory, never gathered.

keras-hub's own `export_to_transformers` computes every tensor and then fetches each whole to one
host (`np.array`), which needs the whole model on that host and fails outright for arrays that
span other processes' devices. Here the tensors, their names and the config are keras-hub's
(`hub_tensors`, `compat.hub_compat`); the safetensors layout is fixed before any byte is written
(`safetensors_writer`), so every process writes its own regions into the same files on a shared
filesystem, one window at a time. Process 0 writes the headers and the non-weight files. The
directory goes through the commit protocol every export shares (`storage.commit`): staged whole,
checked against the regions each process was due to write, fsynced, and swapped with the old one
at once; a failure anywhere fails all and leaves the previous export as it was.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import keras

from keras_orbax._src.compat import hub_compat, keras_compat
from keras_orbax._src.export import (
    export_checksums,
    file_windows,
    hub_fixes,
    hub_tensors,
    regions,
    safetensors_writer,
    tensor_writer,
)
from keras_orbax._src.export.hub_tensors import HubTensor
from keras_orbax._src.export.safetensors_writer import FileLayout, TensorSpec
from keras_orbax._src.runtime import host_memory
from keras_orbax._src.storage import commit, locations
from keras_orbax.errors import SaveFailedError, UnsupportedSourceError

DEFAULT_WINDOW_BYTES = regions.DEFAULT_WINDOW_BYTES


def export_to_transformers(
    model: keras.Model,
    directory: str | os.PathLike,
    *,
    window_bytes: int = DEFAULT_WINDOW_BYTES,
    max_shard_bytes: int | None = None,
) -> Path:
    """Writes a keras-hub backbone or `CausalLM` as a Hugging Face model directory.

    The files are those of keras-hub's `model.export_to_transformers(directory)` (`config.json`,
    `model.safetensors`, and for a `CausalLM` the tokenizer's and other configs), with the same
    tensors, bytes and header, but written from each process's own shards, at most `window_bytes`
    of a variable on the host at a time; LoRA layers merged, and Gemma's attention projections
    written as transformers reads them, where keras-hub 0.32's exporter writes them wrong. Under `jax.distributed`, call it on every process, with
    `directory` on a filesystem they share.

    ```python
    keras_orbax.export_to_transformers(causal_lm, "/tmp/gemma_hf")
    # transformers.AutoModelForCausalLM.from_pretrained("/tmp/gemma_hf") or vLLM read it.
    ```

    Args:
        model: A keras-hub backbone, or a task with a `backbone` (a `CausalLM`: the LM head and
            the preprocessor's tokenizer are exported too), of a class keras-hub exports.
        directory: Local directory to write into (created if missing). An earlier export
            there is replaced only once this one is complete; other files there are kept.
        window_bytes: The most bytes of a variable's shard fetched to the host at a time.
        max_shard_bytes: If the tensors exceed it, write `model-0000i-of-0000n.safetensors` parts
            of at most this many bytes each (a larger tensor gets a part of its own) and
            `model.safetensors.index.json`, as transformers does; by default one file.

    Returns:
        The directory, as an absolute path.

    Raises:
        UnsupportedSourceError: keras-hub cannot export this model to Hugging Face format, or
            the format keras-hub writes it as cannot describe it (a Gemma with Gemma 2's options).
        SaveFailedError: writing failed on some process (each process raises, naming it); the
            previous export in `directory` is untouched.
    """
    if window_bytes < 1:
        raise ValueError(f"window_bytes must be at least 1. Received: window_bytes={window_bytes}")
    directory = Path(locations.as_path(directory))
    backbone, tokenizer, include_lm_head = _parts(model)
    functions = hub_compat.hf_export_functions(type(backbone).__name__)
    if functions is None:
        raise UnsupportedSourceError(
            f"keras-hub cannot export a {type(backbone).__name__} to Hugging Face format; it "
            f"exports {', '.join(hub_compat.hf_exported_classes())}."
        )
    get_config, keras_hubs_map = functions
    get_weights_map = hub_fixes.weights_map(backbone, keras_hubs_map)
    tensors = hub_tensors.trace_tensors(
        lambda: get_weights_map(backbone, include_lm_head=include_lm_head),
        backbone.variables,
        keras_compat.lora_merges(backbone),
    )
    specs = [TensorSpec(t.name, t.shape, t.dtype) for t in tensors]
    layouts = safetensors_writer.plan_files(specs, max_shard_bytes)

    def other_files(staging: Path) -> None:
        with open(staging / "config.json", "w") as f:
            config = hub_fixes.hf_config(backbone, _with_tokens(get_config(backbone), tokenizer))
            json.dump(config, f, indent=2)
        if model is not backbone:
            hub_compat.hf_write_extra_files(backbone, tokenizer, os.fspath(staging))

    sink = TransformersSink(directory, tensors, layouts, window_bytes, other_files)
    return commit.write(sink, f"export_to_transformers({directory})")


class TransformersSink(export_checksums.ReadBackSink):
    """A Hugging Face directory: `config.json`, the safetensors files (laid out before any byte is
    written, each process writing its own regions at their offsets) and, for a `CausalLM`, the
    tokenizer's and other configs. Staged whole and swapped with the old directory at once
    (`storage.commit`); the old directory's other files are kept."""

    whole_directory = True

    def __init__(
        self,
        destination: Path,
        tensors: list[HubTensor],
        layouts: list[FileLayout],
        window_bytes: int,
        other_files: Callable[[Path], None],
    ) -> None:
        self.destination, self.tensors, self.layouts = destination, tensors, layouts
        self.window_bytes, self.other_files = window_bytes, other_files
        # name -> (shape, dtype, sharding, fully addressable, window) of what each tensor was
        # written from, recorded while writing (a computed tensor's sharding is known only then)
        self.written_from: dict[str, tuple[Any, ...]] = {}
        self.writer: tensor_writer.TensorWriter | None = None  # this process's, once staged
        self.reported: dict[str, int] = {}  # every process's region CRCs (`check`)

    def prepare(self, staging: Path) -> None:
        """Process 0: `config.json` as keras-hub writes it, the other files, and each weights
        file's header (its data follows from every process)."""
        commit.check_space(staging, sum(layout.size for layout in self.layouts) + (1 << 20))
        self.other_files(staging)
        for layout in self.layouts:
            with open(staging / layout.file_name, "wb") as f:
                f.write(layout.prefix)

    def stage(self, staging: Path) -> list[str]:
        self.writer, written = _write_regions(
            staging, self.tensors, self.layouts, self.window_bytes, self.written_from
        )
        return written

    def region_crcs(self) -> dict[str, int]:
        """Each region's CRC as this process wrote it: process 0 reads every region back before
        the commit (`export_checksums.check_read_back`)."""
        return {} if self.writer is None else self.writer.region_crcs

    def regions_due(self, process: int) -> list[str]:
        return [
            f"{name}/{regions.region_key(index)}"
            for name, (shape, dtype, sharding, local, window, whole) in self.written_from.items()
            for index in regions.due_windows(shape, dtype, sharding, process, window, local, whole)
        ]

    def assemble(self, staging: Path) -> None:
        """Process 0: every process's regions read back and checked against the CRCs it
        reported, each tensor's CRCs written to the sidecar file (`export_checksums`), and the
        index, where the tensors are in parts (a directory with parts and no index loads
        nothing)."""
        placements = {} if self.writer is None else self.writer.placements
        entries = export_checksums.check_read_back(
            staging,
            self.layouts,
            placements,
            self.reported,
            export_checksums.read_back_bytes(self.window_bytes),
        )
        export_checksums.write_sidecar(staging / export_checksums.SIDECAR, entries)
        if len(self.layouts) > 1:
            index = safetensors_writer.index_json(self.layouts)
            (staging / safetensors_writer.INDEX_FILE).write_text(index)

    def commit_order(self) -> list[str]:
        return []  # the directory is swapped whole

    def replaced(self) -> list[str]:
        return []

    def is_export_file(self, relative: str) -> bool:
        """The config and every weights file an export writes: an old one would mix with the
        new export (transformers reads `model.safetensors` before an index)."""
        return (
            relative
            in (
                "config.json",
                safetensors_writer.SINGLE_FILE,
                safetensors_writer.INDEX_FILE,
                export_checksums.SIDECAR,
            )
            or re.fullmatch(r"model-\d+-of-\d+\.safetensors", relative) is not None
            or (relative.startswith(".") and relative.endswith(".partial"))
        )


def _parts(model: keras.Model) -> tuple[keras.Model, Any, bool]:
    """(backbone, tokenizer or None, whether the LM head is exported), as keras-hub decides, but
    for a backbone whose LM head is a variable of its own (untied embeddings), which it leaves out."""
    import keras_hub  # the `hub` extra

    if isinstance(model, keras_hub.models.Backbone):
        return model, None, hub_fixes.has_untied_lm_head(model)
    if not isinstance(model, keras_hub.models.CausalLM):
        raise UnsupportedSourceError(
            f"keras-hub exports a backbone or a CausalLM to Hugging Face format, not a "
            f"{type(model).__name__}. Received: model={model.name!r}"
        )
    backbone = model.backbone
    preprocessor = getattr(model, "preprocessor", None)
    tokenizer = None if preprocessor is None else preprocessor.tokenizer
    if preprocessor is not None and tokenizer is None:
        raise UnsupportedSourceError(
            f"{type(model).__name__}'s preprocessor has no tokenizer; keras-hub exports a task's "
            "preprocessor only with one. Set `model.preprocessor = None` to export the weights."
        )
    return backbone, tokenizer, True


def _with_tokens(config: Any, tokenizer: Any) -> dict[str, Any]:
    """keras-hub's `export_backbone`: the tokenizer's start and end tokens become the config's."""
    config = dict(config.to_dict() if hasattr(config, "to_dict") else config)
    if tokenizer is not None:
        if tokenizer.start_token is not None:
            config["bos_token_id"] = tokenizer.token_to_id(tokenizer.start_token)
        if tokenizer.end_token is not None:
            config["eos_token_id"] = tokenizer.token_to_id(tokenizer.end_token)
    return config


def _write_regions(
    staging: Path,
    tensors: list[HubTensor],
    layouts: list[FileLayout],
    window_bytes: int,
    written_from: dict[str, tuple[Any, ...]],
) -> tuple[tensor_writer.TensorWriter, list[str]]:
    """This process's regions of every tensor, at their byte offsets (`file_windows`), then
    synced to disk; the writer (what it wrote: `TensorWriter.region_crcs`) and the keys of the
    regions written. Every process runs every computed tensor (they run collectives), in one
    order, even after a failure here."""
    file_of = {name: layout for layout in layouts for name in layout.offsets}
    error: SaveFailedError | None = None
    written: list[str] = []
    with file_windows.FileWindows() as files:
        writer = tensor_writer.TensorWriter(files, window_bytes)
        for tensor in tensors:
            on_devices = tensor_writer.device_computed(tensor, window_bytes)
            if error is not None:
                if on_devices is not None:
                    on_devices.compute()
                continue
            layout = file_of[tensor.name]
            try:
                fd = files.open(staging / layout.file_name)
                keys = writer.write(fd, layout.offsets[tensor.name], tensor, written_from)
                written += [f"{tensor.name}/{key}" for key in keys]
                if not isinstance(tensor.source, hub_tensors.Rearranged):
                    host_memory.release_freed()  # XLA's result or NumPy's, freed: not kept
            except OSError as e:
                where = staging / layout.file_name
                error = SaveFailedError(f"Writing {tensor.name} into {where} failed: {e}")
        if error is None:
            files.sync()
    if error is not None:
        raise error
    return writer, written
