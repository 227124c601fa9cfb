"""The one place that decides what a location names; every verb opens its sources here.

A location is spelled as users spell it (relative, `~`, a trailing slash, `gs://`, `s3://`) and
resolved once (`locations.as_path`). It names:
- a keras-orbax checkpoint root, or one of its steps (`ckpt/8`, as Orbax users pass it, or
  `ckpt@8`): a `keras-orbax` step, or a `keras-checkpoint` step where Keras's own
  `OrbaxCheckpoint` wrote it; a step that resume moved aside (`ckpt/8.unreadable`) is read as
  step 8, on its own;
- a Keras weights file (`.weights.h5`, `.weights.json`, `.keras`), a keras-hub preset directory,
  or a Hugging Face model directory (`config.json` with a `model_type`, and safetensors).
Anything at another level (a step's `state/` folder, one array's directory) gets an error that
says what to pass instead.

```python
source = open_source("~/runs/ckpt/8")   # OrbaxStepSource(location=/home/me/runs/ckpt, step=8)
```
"""

from __future__ import annotations

import dataclasses
import os
import re
import warnings
from pathlib import Path
from typing import Any

from keras_orbax._src.format import step_dirs
from keras_orbax._src.sources import keras_checkpoint
from keras_orbax._src.sources.base import Source, SourceKind
from keras_orbax._src.sources.hf_directory import TransformersSource, is_transformers_directory
from keras_orbax._src.sources.keras_checkpoint import KerasCheckpointSource
from keras_orbax._src.sources.keras_weights import (
    PRESET_WEIGHTS,
    KerasArchiveSource,
    KerasPresetSource,
    KerasWeightsSource,
    is_weights_file,
    preset_weights,
)
from keras_orbax._src.sources.orbax_step import OrbaxStepSource
from keras_orbax._src.storage import locations
from keras_orbax.errors import CheckpointNotFoundError, KerasOrbaxWarning, UnsupportedSourceError

_AT_STEP = re.compile(r"^(.*)@(\d+)$")


@dataclasses.dataclass(frozen=True)
class Located:
    """What a location names, decided without reading any array or record (JSON-safe, so that
    process 0 can decide it for every process)."""

    kind: SourceKind
    location: str  # resolved: absolute, or an object-store URL
    step: int | None = None
    aside: str | None = None  # the step's directory, where resume moved it aside


def open_source(location: str | os.PathLike, step: int | None = None) -> Source:
    """The source `location` names (see the module's doc); `step` as `@STEP` does.

    Raises:
        CheckpointNotFoundError: nothing there, no committed step, not the step asked for, or a
            location at a wrong level (the message says what to pass).
        CorruptCheckpointError: its metadata cannot be read.
        ValueError: `step` given twice with different values.
    """
    return open_located(locate(location, step))


def open_on_every_process(location: str | os.PathLike, step: int | None, verb: str) -> Source:
    """`open_source` under `jax.distributed`: process 0 decides what `location` names and which
    step (a step committed in between must not split the processes), every process opens that.
    Collective: every process calls it, with the same `verb`."""
    from keras_orbax._src.runtime import multihost  # imports JAX: not on `inspect`'s path

    step = None if step is None else step_dirs.checked_step(step)  # JSON-safe, checked
    given = multihost.gather(f"{verb}/arguments", [os.fspath(location), step])
    me = given[multihost.process_index()]
    if me != given[0]:  # process 0 decides: said where this process was told otherwise
        warnings.warn(
            f"{verb} on process {multihost.process_index()} was given '{me[0]}'"
            f"{'' if me[1] is None else f' (step {me[1]})'}, process 0 '{given[0][0]}'"
            f"{'' if given[0][1] is None else f' (step {given[0][1]})'}: every process reads "
            "what process 0 names. Pass each process the same location and step.",
            KerasOrbaxWarning,
            stacklevel=3,
        )
    located = multihost.primary_value(f"{verb}/locate", _locate_json, os.fspath(location), step)
    return open_located(Located(**located))


def _locate_json(location: str, step: int | None) -> dict[str, Any]:
    return dataclasses.asdict(locate(location, step))


def open_located(located: Located) -> Source:
    """The source of a `locate` decision."""
    path = locations.as_path(located.location)
    if located.kind == "keras-weights":
        return (KerasArchiveSource if path.name.endswith(".keras") else KerasWeightsSource)(path)
    if located.kind == "keras-preset":
        weights = preset_weights(path)
        if weights is None:
            raise CheckpointNotFoundError(f"Preset directory '{path}' has no model.weights.h5.")
        return KerasPresetSource(weights, location=path)
    if located.kind == "transformers":
        return TransformersSource(path)
    assert located.step is not None  # a step kind
    if located.aside is not None:  # not one of the root's steps: the only step it has
        return OrbaxStepSource(path, located.step, (located.step,), step_dir=Path(located.aside))
    steps = step_dirs.committed_steps(path)
    if located.kind == "keras-checkpoint":
        return KerasCheckpointSource(path, located.step, steps)
    return OrbaxStepSource(path, located.step, steps)


def locate(location: str | os.PathLike, step: int | None = None) -> Located:
    """Decides what `location` names, and for a checkpoint which committed step (the latest if
    none is given by `step`, `@STEP` or a step directory)."""
    step = None if step is None else step_dirs.checked_step(step)
    text = os.fspath(location)
    path = locations.as_path(text)
    at = _AT_STEP.match(text.rstrip("/"))  # `ckpt@5/` as `ckpt@5`, as `ckpt/5/` is `ckpt/5`
    if at and not path.exists():
        path = locations.as_path(at.group(1))
        step = _same_step(step, int(at.group(2)), text)
    if not locations.is_remote(path):
        kind = _weights_kind(path)
        if kind is None and path.is_dir():
            _refuse_half_a_preset(path)  # what it holds is read, not taken for a checkpoint
        if kind is not None:
            if step is not None:
                raise ValueError(
                    f"'{path}' is a {kind.replace('-', ' ')} source, which has no steps. "
                    f"Received: step={step}"
                )
            return Located(kind, str(path))
    aside = None if locations.is_remote(path) else step_dirs.aside_step(path)
    if aside is not None:  # `ckpt/12.unreadable`, which resume moved aside
        step = _same_step(step, aside, text)
        return Located("keras-orbax", str(path.parent), step, aside=str(path))
    root, step = _root_and_step(path, step)
    step, step_dir = step_dirs.step_path(root, step)
    kind = "keras-checkpoint" if keras_checkpoint.is_keras_step(step_dir) else "keras-orbax"
    return Located(kind, str(root), step)


_HELD = {
    "keras-orbax": "checkpoint steps",
    "keras-preset": "a keras-hub preset",
    "transformers": "a Hugging Face model directory",
}


def check_destination(destination: str | os.PathLike, kind: SourceKind) -> None:
    """Refuses to write saved state of `kind` ("keras-orbax", "keras-preset" or "transformers")
    into a local directory that holds another kind already: the result would hide one behind
    the other (`inspect` of it would describe only one; a verb would read the other).

    Raises:
        ValueError: `destination` holds another kind of saved state.
    """
    if isinstance(destination, step_dirs.CheckpointRoot):
        path = destination.path
    else:
        path = locations.as_path(os.fspath(destination))
    if locations.is_remote(path) or not path.is_dir():
        return
    here = _weights_kind(path)
    held = [here] if here is not None else []
    # Listed only where steps would be another kind than the one written.
    if kind != "keras-orbax" and step_dirs.committed_steps(path):
        held.append("keras-orbax")
    others = [k for k in held if k != kind]
    if others:
        raise ValueError(
            f"'{path}' holds {_HELD[others[0]]}: convert writes {_HELD[kind]} only into a new or "
            f"empty directory, or one that holds the same. Received: destination='{destination}'"
        )


def _weights_kind(path: Path) -> SourceKind | None:
    """The kind of a local weights file or directory, or None for a checkpoint directory."""
    if path.is_file() or (is_weights_file(path) and not path.is_dir()):
        if not path.exists():
            raise CheckpointNotFoundError(f"Weights file does not exist: '{path}'")
        if not is_weights_file(path):
            raise CheckpointNotFoundError(
                f"'{path}' is a file, but not a Keras weights file (.weights.h5, .weights.json, "
                ".keras). Pass a checkpoint directory, a weights file, a keras-hub preset or a "
                "Hugging Face model directory."
            )
        return "keras-weights"
    if path.is_dir() and is_transformers_directory(path):
        return "transformers"
    if path.is_dir() and preset_weights(path) is not None:
        return "keras-preset"
    return None


def _refuse_half_a_preset(path: Path) -> None:
    """A directory with a preset's config but no weights file, or the reverse, is a damaged
    preset, not a checkpoint directory: said so, naming the file it lacks. Keras files saved side
    by side (no keras-hub `metadata.json`) are named as such, with the file to pass."""
    has_config = (path / "config.json").is_file()
    weights = [name for name in PRESET_WEIGHTS if (path / name).is_file()]
    if has_config and not weights and (path / "metadata.json").is_file():
        raise CheckpointNotFoundError(
            f"Preset directory '{path}' has a config.json but no weights file "
            f"({' or '.join(PRESET_WEIGHTS)})."
        )
    if weights and not has_config and (path / "metadata.json").is_file():  # keras-hub's
        raise CheckpointNotFoundError(
            f"Preset directory '{path}' has {weights[0]} but no config.json, which keras-hub "
            "builds the model from."
        )
    if weights and not has_config:  # Keras files, saved side by side
        files = sorted(f.name for f in path.iterdir() if f.is_file() and is_weights_file(f))
        raise CheckpointNotFoundError(
            f"'{path}' holds Keras files ({', '.join(files)}) but no config.json: it is not a "
            "keras-hub preset (keras-hub builds the model from its config.json) nor a checkpoint "
            f"directory. Pass one of the files, e.g. '{path / files[0]}'."
        )


def _root_and_step(path: Any, step: int | None) -> tuple[Any, int | None]:
    """A checkpoint root and step from a root, or from one of its step directories (`ckpt/8`).

    Raises:
        CheckpointNotFoundError: `path` is inside a step (its `state/` folder, an array's
            directory): the message names the root and step to pass.
    """
    if step_dirs.committed_steps(path):
        return path, step
    name, parent = path.name, path.parent
    if name.isdecimal() and step_dirs.committed_steps(parent):  # `ckpt/9`: step 9 of `ckpt`,
        return parent, _same_step(step, int(name), os.fspath(path))  # committed or not
    if not path.exists():
        return path, step
    for inside, level in ((parent, "a folder"), (parent.parent, "an array directory")):
        if inside.name.isdecimal() and int(inside.name) in step_dirs.committed_steps(inside.parent):
            root = inside.parent
            raise CheckpointNotFoundError(
                f"'{path}' is {level} inside step {inside.name} of the checkpoint '{root}', "
                f"not a checkpoint. Pass '{root}' (its latest step) or '{root}@{inside.name}'."
            )
    return path, step


def _same_step(given: int | None, named: int, text: str) -> int:
    if given is not None and given != named:
        raise ValueError(
            f"'{text}' names step {named}, but step={given} was passed too. Pass one of them. "
            f"Received: step={given}"
        )
    return named


def describe(source: Source) -> str:
    """`'<location>' (a keras-orbax checkpoint step)` for messages."""
    return f"'{source.label}' ({source.description})"


def unsupported(source: Source, verb: str, use: str) -> UnsupportedSourceError:
    """The one-line error of a verb that cannot serve this kind of source, naming what can."""
    return UnsupportedSourceError(f"{verb} cannot use {describe(source)}: {use}")
