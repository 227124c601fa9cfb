"""`export_to_transformers`: a sharded keras-hub model as a Hugging Face directory, never gathered.

keras-hub's own `export_to_transformers` computes every tensor and then fetches each whole to one
host (`np.array`), which needs the whole model on that host and fails outright for arrays that
span other processes' devices. Here the tensors, their names and the config are keras-hub's
(`hub_tensors`, `compat.hub_compat`); the safetensors layout is fixed before any byte is written
(`safetensors_writer`), so every process writes its own regions into the same files on a shared
filesystem, one window at a time. Process 0 writes the headers and the non-weight files, and
renames the files into place only after every process has written and synced its part: a failure
anywhere fails all and leaves no weights file that keras-hub or transformers would load.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jax
import keras
import numpy as np

from keras_orbax._src.compat import hub_compat
from keras_orbax._src.export import hub_tensors, regions, safetensors_writer
from keras_orbax._src.export.hub_tensors import Computed, HubTensor
from keras_orbax._src.export.safetensors_writer import FileLayout, TensorSpec
from keras_orbax._src.runtime import multihost
from keras_orbax._src.storage import durable, locations
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
    of a variable on the host at a time. Under `jax.distributed`, call it on every process, with
    `directory` on a filesystem they share.

    ```python
    keras_orbax.export_to_transformers(causal_lm, "/tmp/gemma_hf")
    # transformers.AutoModelForCausalLM.from_pretrained("/tmp/gemma_hf") or vLLM read it.
    ```

    Args:
        model: A keras-hub backbone, or a task with a `backbone` (a `CausalLM`: the LM head and
            the preprocessor's tokenizer are exported too), of a class keras-hub exports.
        directory: Local directory to write into (created if missing). Weights files of an
            earlier export there are removed first.
        window_bytes: The most bytes of a variable's shard fetched to the host at a time.
        max_shard_bytes: If the tensors exceed it, write `model-0000i-of-0000n.safetensors` parts
            of at most this many bytes each (a larger tensor gets a part of its own) and
            `model.safetensors.index.json`, as transformers does; by default one file.

    Returns:
        The directory, as an absolute path.

    Raises:
        UnsupportedSourceError: keras-hub cannot export this model to Hugging Face format.
        SaveFailedError: writing failed on some process (each process raises, naming it); no
            weights file is left in `directory`. In a single process, a file that cannot be
            opened raises its own `OSError`.
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
    get_config, get_weights_map = functions
    tensors = hub_tensors.trace_tensors(
        lambda: get_weights_map(backbone, include_lm_head=include_lm_head), backbone.variables
    )
    specs = [TensorSpec(t.name, t.shape, t.dtype) for t in tensors]
    layouts = safetensors_writer.plan_files(specs, max_shard_bytes)
    name = f"export_to_transformers({directory})"

    def prepare() -> None:
        if multihost.is_primary():
            config = get_config(backbone)
            _prepare(directory, layouts, _with_tokens(config, tokenizer))
            if model is not backbone:
                hub_compat.hf_write_extra_files(backbone, tokenizer, os.fspath(directory))

    try:
        abandoned = multihost.NOTHING_EXPORTED
        failed = SaveFailedError  # what another library's error (an OSError) becomes
        multihost.run_collectively(
            f"{name}: prepare", prepare, unchanged=abandoned, fallback=failed
        )
        multihost.run_collectively(
            f"{name}: write",
            _write_regions,
            directory,
            tensors,
            layouts,
            window_bytes,
            unchanged=abandoned,
            fallback=failed,
        )
        multihost.run_collectively(
            f"{name}: commit",
            _commit_if_primary,
            directory,
            layouts,
            unchanged=abandoned,
            fallback=failed,
        )
    except BaseException:
        if multihost.is_primary():
            _remove_weights(directory)
        raise
    return directory


def _parts(model: keras.Model) -> tuple[keras.Model, Any, bool]:
    """(backbone, tokenizer or None, whether the LM head is exported), as keras-hub decides."""
    import keras_hub  # the `hub` extra

    if isinstance(model, keras_hub.models.Backbone):
        return model, None, False
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


def _partial(directory: Path, layout: FileLayout) -> Path:
    """Where a file is written until it is complete: a name no reader looks for."""
    return directory / f".{layout.file_name}.partial"


def _prepare(directory: Path, layouts: list[FileLayout], config: dict[str, Any]) -> None:
    """Process 0: the directory, `config.json` as keras-hub writes it, and each weights file's
    header (its data follows from every process)."""
    directory.mkdir(parents=True, exist_ok=True)
    _remove_weights(directory)
    with open(directory / "config.json", "w") as f:
        json.dump(config, f, indent=2)
    for layout in layouts:
        with open(_partial(directory, layout), "wb") as f:
            f.write(layout.prefix)


def _remove_weights(directory: Path) -> None:
    """Every weights file (complete or partial) that an export writes, so that none is stale."""
    names = [safetensors_writer.SINGLE_FILE, safetensors_writer.INDEX_FILE]
    for path in directory.glob("*.safetensors*"):
        if path.name in names or path.name.startswith("model-"):
            path.unlink(missing_ok=True)
    for path in directory.glob(".*.partial"):
        path.unlink(missing_ok=True)


def _write_regions(
    directory: Path, tensors: list[HubTensor], layouts: list[FileLayout], window_bytes: int
) -> None:
    """This process's regions of every tensor, at their byte offsets; then synced to disk."""
    file_of = {name: layout for layout in layouts for name in layout.offsets}
    fds = {
        layout.file_name: os.open(_partial(directory, layout), os.O_WRONLY | os.O_CLOEXEC)
        for layout in layouts
    }
    error: SaveFailedError | None = None
    try:
        for tensor in tensors:
            if error is not None:
                # Computed tensors run collectives: every process runs them all, in one order.
                if isinstance(tensor.source, Computed):
                    tensor.source.compute()
                continue
            layout = file_of[tensor.name]
            try:
                fd = fds[layout.file_name]
                _write_tensor(fd, layout.offsets[tensor.name], tensor, window_bytes)
            except OSError as e:
                where = _partial(directory, layout)
                error = SaveFailedError(f"Writing {tensor.name} into {where} failed: {e}")
        if error is None:
            for fd in fds.values():
                os.fsync(fd)
    finally:
        for fd in fds.values():
            os.close(fd)
    if error is not None:
        raise error


def _write_tensor(fd: int, offset: int, tensor: HubTensor, window_bytes: int) -> None:
    source = tensor.source
    if isinstance(source, Computed):
        array = source.compute()
        _check(tensor, array)
        for region in _own_regions(array, window_bytes):
            safetensors_writer.write_box(fd, offset, tensor.shape, region.index, region.block)
        return
    array = source.variable.value
    kept = [axis for axis, n in enumerate(array.shape) if n != 1]
    view = tuple(array.shape[axis] for axis in kept)
    permutation = source.permutation
    view = tuple(view[p] for p in permutation)
    moved = permutation != tuple(range(len(permutation)))
    # A moved block is copied once on the host: half the window each.
    for region in _own_regions(array, window_bytes // 2 if moved else window_bytes):
        index = tuple(region.index[axis] for axis in kept)
        block = region.block.reshape([s.stop - s.start for s in index])
        block = block.transpose(permutation)
        index = tuple(index[p] for p in permutation)
        safetensors_writer.write_box(fd, offset, view, index, block)
        del block


def _own_regions(array: jax.Array, window_bytes: int) -> Any:
    """The regions of `array` this process writes: the shards of replica 0 (each region of the
    array belongs to exactly one replica 0 shard, on one process)."""
    shards = [s for s in array.addressable_shards if s.replica_id == 0]
    return regions.shard_regions(array, shards, max(1, window_bytes))


def _check(tensor: HubTensor, array: jax.Array) -> None:
    if tuple(array.shape) != tensor.shape or np.dtype(array.dtype) != tensor.dtype:
        raise SaveFailedError(
            f"{tensor.name}: keras-hub's operations gave {np.dtype(array.dtype).name} "
            f"{list(array.shape)} where the trace gave {tensor.dtype.name} {list(tensor.shape)}."
        )


def _commit_if_primary(directory: Path, layouts: list[FileLayout]) -> None:
    """Process 0, once every process has synced its part: the files under their names, the index
    last (a directory with parts and no index loads nothing)."""
    if not multihost.is_primary():
        return
    for layout in layouts:
        partial = _partial(directory, layout)
        size = partial.stat().st_size
        if size != layout.size:
            raise SaveFailedError(
                f"{partial}: {size} bytes after every process wrote, expected {layout.size}."
            )
        os.replace(partial, directory / layout.file_name)
    if len(layouts) > 1:
        index = directory / safetensors_writer.INDEX_FILE
        temporary = directory / f".{index.name}.partial"
        temporary.write_text(safetensors_writer.index_json(layouts))
        durable.fsync_path(temporary)
        os.replace(temporary, index)
    durable.fsync_path(directory)
