"""`convert`: any source `restore_sharded` reads, written as a keras-orbax checkpoint step, one array
at a time (peak memory near the largest variable, not the model).

Without a model, a weights file's arrays keep their h5 dataset paths as keys (`layers/dense/vars/0`),
which are the keras-orbax keys of ordinary layers: the result restores into the same architecture
by Keras's structure and position. Layers whose `save_own_variables` stores derived values (LoRA
stores merged kernels; quantized layers their own set) need `model`: Keras's own loader then decides
what each variable gets, exactly as `load_weights` would, and the checkpoint holds the variables.
A Keras `OrbaxCheckpoint` step is converted by the model its saved config describes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import jax
import keras

from keras_orbax._src.compat import keras_compat, orbax_compat
from keras_orbax._src.format import step_dirs
from keras_orbax._src.format.step_record import StepRecord, VariableRecord, versions
from keras_orbax._src.model import matching
from keras_orbax._src.model.matching import ReadRequest
from keras_orbax._src.read import sharded_read
from keras_orbax._src.restore import load_model, notices
from keras_orbax._src.sources import resolve
from keras_orbax._src.sources.base import Source
from keras_orbax._src.storage import locations
from keras_orbax._src.tools import convert_export
from keras_orbax._src.write import array_writer, step_writer


def convert(
    source: str | os.PathLike,
    destination: str | os.PathLike,
    *,
    model: keras.Model | None = None,
    step: int | None = None,
    on_write: Callable[[int, int], None] | None = None,
    incremental: bool = True,
    preset: bool = False,
    transformers: bool = False,
) -> Path:
    """Writes the state `source` holds as step `step` of the keras-orbax checkpoint `destination`,
    or as a Keras `.weights.h5` file or a keras-hub preset (`convert_export`).

    The step is written as `save` writes one: shard files with checksums, under the writer lock,
    durable before this returns.

    Args:
        source: Any location `restore_sharded` reads: a checkpoint (`DIR`, `DIR/STEP`,
            `DIR@STEP`, also one written by `keras.callbacks.OrbaxCheckpoint`), a `.weights.h5`,
            `.weights.json` or `.keras` file, a keras-hub preset or a Hugging Face directory.
        destination: The keras-orbax checkpoint root (local, `gs://` or `s3://`).
        model: The architecture (built, or under `deferred_init()`): keys and values are then what
            `restore_sharded(model, source)` gives, i.e. Keras's own `load_weights`. Required for a
            Hugging Face directory, and for an `OrbaxCheckpoint` step saved without a model config.
        step: The step written; `None`: the source's step where it is a checkpoint step (its
            epoch and metrics are kept too), else 0.
        on_write: Called with `(nbytes, total)` after each array is written.
        incremental: Link each shard file unchanged since `destination`'s latest committed step
            before `step` (in object storage: copy it on the server) instead of writing it
            (docs/incremental.md).
        preset: Write `destination` as a keras-hub preset directory (docs/exporting.md). A
            `destination` ending in `.weights.h5` is written as Keras's weights file. Either
            restores `source` into `model` (or the model `source` describes) first.
        transformers: Write `destination` as a Hugging Face directory, as keras-hub's
            `export_to_transformers` does (a keras-hub backbone or CausalLM; docs/exporting.md).

    Returns:
        The step's directory (the file or preset directory written, for an export).

    Example:
    ```python
    keras_orbax.convert("model.weights.h5", "/ckpt")                  # by structure
    keras_orbax.convert("/hf/llama", "/ckpt", model=llama_backbone)   # by the model
    ```

    Raises:
        ValueError: `destination` names a Keras file other than `.weights.h5` (`.keras`, ...),
            or a directory that holds another kind of saved state (a preset, a Hugging Face
            directory, checkpoint steps).
        UnsupportedSourceError: `source` needs `model` (the message says why).
        StepExistsError: `destination` already holds `step`.
        StepLockedError: another writer is saving `step` to `destination` right now.
        CheckpointMismatchError: `model` does not fit `source`.
        SaveFailedError: the write failed (e.g. a full disk). In every case nothing was
            committed and the committed steps are intact.
    """
    if convert_export.names_an_export(destination, to_preset=preset, to_transformers=transformers):
        return convert_export.export(
            source,
            destination,
            model=model,
            to_preset=preset,
            on_write=on_write,
            to_transformers=transformers,
        )
    _refuse_keras_file(destination)
    root = step_dirs.CheckpointRoot(destination)  # the one path of it from here on
    resolve.check_destination(root, "keras-orbax")
    opened = resolve.open_source(source)  # its metadata only
    step = step_dirs.checked_step(step if step is not None else opened.step or 0)
    # A committed `step` is refused under the writer lock, before any array is read (the reads
    # are lazy): the one listing of `root`'s steps (`array_writer.save_arrays`).
    if model is None:
        record, reads = _by_structure(opened)
    else:
        record, reads = _by_model(opened, model)
    total = sum(v.nbytes for v in record.variables.values())
    # Where the source is a step: its epoch, position and metrics are the converted step's too.
    saved = opened.record
    record = dataclasses.replace(
        record, step=step, epoch=saved.epoch, batch=saved.batch, versions=versions()
    )
    metrics = None
    if opened.step is not None:
        metrics = orbax_compat.step_metrics(opened.location / str(opened.step)) or None

    def read_each() -> Iterator[tuple[str, jax.Array]]:
        for key, plan in reads:
            arrays, _ = sharded_read.read_arrays(plan)
            yield key, arrays.pop(key)  # the writer holds the only reference

    def written(key: str) -> None:
        if on_write is not None:
            on_write(record.variables[key].nbytes, total)

    made = not locations.is_remote(root) and not root.path.exists()
    try:
        return array_writer.save_arrays(
            root,
            step,
            record,
            read_each(),
            on_written=written,
            incremental=incremental,
            metrics=metrics,
            keras_state=opened.own_state(),  # small files, read whole
        )
    except BaseException:
        if made and root.path.is_dir():  # made by this convert: nothing else can be in it
            _remove_if_stepless(root)
        raise


def _remove_if_stepless(root: step_dirs.CheckpointRoot) -> None:
    """Removes `root` if it holds no committed step: what a failed save left there (its lock, the
    step's temporary directory) is all there is."""
    if not root.listed_again():
        shutil.rmtree(root.path, ignore_errors=True)


_KERAS_FILES = (".h5", ".keras", ".weights.json")  # `.weights.h5` is exported


def _refuse_keras_file(destination: str | os.PathLike) -> None:
    """Raises ValueError if `destination` names a Keras weights file, before anything is written."""
    name = os.fspath(destination).rstrip("/")
    suffix = next((s for s in _KERAS_FILES if name.lower().endswith(s)), None)
    if suffix is not None:
        raise ValueError(
            "convert writes a keras-orbax checkpoint directory, a `.weights.h5` file, a "
            "keras-hub preset (preset=True) or a Hugging Face directory (transformers=True), not "
            f"a Keras '{suffix}' file. To get one, restore "
            "the state with `keras_orbax.restore_sharded(model, source)` and call Keras's "
            f"`model.save_weights(...)` or `model.save(...)`. "
            f"Received: destination={os.fspath(destination)!r}"
        )


def _one_device() -> jax.sharding.Sharding:
    return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])


def _by_structure(
    opened: Source,
) -> tuple[StepRecord, list[tuple[str, sharded_read.ReadPlan]]]:
    """Every array of `opened` under its own key; a Keras `OrbaxCheckpoint` step that holds its
    model config is converted by that model (its keys are variable paths, not structure)."""
    if opened.kind == "keras-checkpoint":
        if opened.model_config is None:
            raise resolve.unsupported(
                opened,
                "convert",
                "its arrays are keyed by variable paths and it holds no model config: pass the "
                "architecture (model=..., or --model MODULE:FUNCTION).",
            )
        return _by_model(opened, load_model.build_deferred(opened, None, True, compile=True))
    if opened.kind == "transformers":
        raise resolve.unsupported(
            opened,
            "convert",
            "its tensors are named by Hugging Face, not by Keras: pass the keras-hub backbone "
            "(model=..., or --model MODULE:FUNCTION).",
        )
    variables = {
        key: dataclasses.replace(v, array=key.replace("/", "."), layout=None)
        for key, v in opened.record.variables.items()
    }
    requests = [
        ReadRequest(saved, jax.ShapeDtypeStruct(saved.shape, saved.dtype, sharding=_one_device()))
        for saved in opened.record.variables.values()
    ]
    reads = _one_each(opened, opened.plan_reads(requests))
    config = opened.record.model_config
    if opened.kind == "keras-preset":  # keras-hub's config.json is the backbone, serialized by
        # Keras: kept, `load_model` builds it and a preset export writes it again.
        config = json.loads((locations.as_path(opened.location) / "config.json").read_text())
    record = dataclasses.replace(
        opened.record, variables=variables, model_config=config, format_version=2
    )
    return record, reads


def _by_model(
    source: str | os.PathLike | Source, model: keras.Model
) -> tuple[StepRecord, list[tuple[str, sharded_read.ReadPlan]]]:
    """`model`'s variables as `restore_sharded(model, source)` fills them, one read each.

    Raises:
        CheckpointMismatchError: `model` does not fit `source`; every problem listed.
    """
    opened = source if isinstance(source, Source) else resolve.open_source(source)
    prepared = opened.prepare(model, strict=True)
    if prepared.problems or prepared.reads is None:
        hint = "Nothing was written: pass the architecture that saved it."
        raise matching.mismatch_error(model, opened.label, prepared.problems, hint=hint)
    notices.warn_untaken(model, opened, prepared, verb="convert")
    state, reads = prepared.state, prepared.reads
    variables = {}
    for key in prepared.plan.reads:
        variable = state.variables[key]
        variables[key] = VariableRecord(
            key=key,
            path=variable.path,
            shape=tuple(int(n) for n in variable.shape),
            dtype=keras_compat.stored_dtype(variable),
            array=key.replace("/", "."),
            role=state.roles[key],
        )
    record = StepRecord(step=0, variables=variables, model_config=step_writer._model_config(model))
    return record, _one_each(opened, reads)


def _one_each(
    opened: Source, reads: sharded_read.ReadPlan
) -> list[tuple[str, sharded_read.ReadPlan]]:
    """`reads` as one read per key, each checking the bytes it reads against the checksums
    recorded with them, as a restore does (`Source.verified_reads`)."""
    reads, _ = opened.verified_reads(reads)
    return [
        (entry[0].record.key, dataclasses.replace(reads, fast=[entry], via_orbax=[]))
        for entry in reads.fast
    ] + [
        (request.record.key, dataclasses.replace(reads, fast=[], via_orbax=[request]))
        for request in reads.via_orbax
    ]
