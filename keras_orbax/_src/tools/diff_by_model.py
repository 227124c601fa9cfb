"""`diff` of two sources that key their arrays differently, matched through Keras paths: a keras-hub
task's step (`layers/gemma_backbone/...`) against the preset (`layers/...`) or the Hugging Face
directory (`model.layers.0...`) exported from it.

Each source is paired with the model it describes, built without allocating it (a step's from its
config, as `load_model` builds it; a preset's or a Hugging Face directory's as keras-hub's
`Backbone.from_preset` builds it), as a restore pairs them (keras-hub's converter decides for a
Hugging Face directory; a source that holds only a task's backbone is paired with the backbone). A
source that describes none (a `.weights.h5`) is paired with the other's model. The two are then
compared variable by variable, by their Keras paths (keras-hub names its layers, so a task's
backbone and the backbone built from its preset have the same paths).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from keras_orbax._src.sources.base import Prepared, Source, batched

_HUB_KINDS = ("keras-preset", "transformers")


@dataclasses.dataclass(frozen=True)
class Paired:
    """One source's arrays by the model variable each restores: Keras path -> key and record."""

    source: Source
    prepared: Prepared
    keys: dict[str, str]  # Keras path -> the model's key the source pairs with it
    unpaired: list[str]  # this source's keys that pair with no variable of the model


def describes_a_model(source: Source) -> bool:
    return source.model_config is not None or source.kind in _HUB_KINDS


def pair(first: Source, second: Source) -> tuple[Paired, Paired]:
    """Each source paired with the model it describes (one that describes none: with the
    other's)."""
    models = {id(s): _model(s) for s in (first, second) if describes_a_model(s)}
    other = {id(first): second, id(second): first}
    return tuple(  # type: ignore[return-value]
        _paired(s, models.get(id(s)) or models[id(other[id(s)])]) for s in (first, second)
    )


def read_pairs(
    a: Paired, b: Paired, paths: list[str], on_read: Callable[[int, int], None] | None
) -> Iterator[tuple[str, np.ndarray, np.ndarray]]:
    """Each path's two arrays (as the model's variable takes them), 64 MiB of them at a time."""
    from keras_orbax._src.read import sharded_read

    def nbytes(path: str) -> int:
        return _record(a, path).nbytes + _record(b, path).nbytes

    total = sum(nbytes(path) for path in paths)
    for batch in batched(paths, nbytes):
        xs, ys = (
            sharded_read.read_arrays(_only(side, [side.keys[p] for p in batch]))[0]
            for side in (a, b)
        )
        for path in batch:
            x, y = xs.pop(a.keys[path]), ys.pop(b.keys[path])
            if on_read is not None:
                on_read(nbytes(path), total)
            yield path, np.asarray(x), np.asarray(y)


def described(side: Paired, path: str) -> str:
    record = _record(side, path)
    return f"{record.shape} {record.dtype}"


def one_sided(side: Paired, other: Paired) -> list[str]:
    """What `side` holds that `other` does not, each named as `side` names it (its saved Keras
    path where it records one: a step's `adam/iteration`, not the rebuilt model's `adam_1/...`)."""
    saved = side.prepared.record.variables
    return [_record(side, p).path for p in side.keys if p not in other.keys] + [
        saved[key].path for key in side.unpaired
    ]


def _record(side: Paired, path: str) -> Any:
    return side.prepared.record.variables[side.keys[path]]


def readable(a: Paired, b: Paired, path: str) -> bool:
    """Both sides restore the variable at `path` (neither's shape or dtype is refused)."""
    return all(side.keys[path] in side.prepared.plan.reads for side in (a, b))


def _only(side: Paired, keys: list[str]) -> Any:
    reads = side.prepared.reads
    assert reads is not None
    wanted = set(keys)
    return dataclasses.replace(
        reads,
        fast=[entry for entry in reads.fast if entry[0].record.key in wanted],
        via_orbax=[request for request in reads.via_orbax if request.record.key in wanted],
    )


def _model(source: Source) -> Any:
    """The model `source` describes, deferred: a step's as `load_model` builds it (compiled),
    a preset's or a Hugging Face directory's as keras-hub's `Backbone.from_preset` builds it."""
    if source.model_config is not None:
        from keras_orbax._src.restore import load_model

        return load_model.build_deferred(source, None, True, compile=True)
    import keras_hub

    from keras_orbax._src.restore import preset

    return preset.deferred_model(keras_hub.models.Backbone, str(source.location), {})


def _paired(source: Source, model: Any) -> Paired:
    """`source` paired with `model`, or with its backbone where it restores nothing of the model
    itself (a preset or Hugging Face directory against a task)."""
    prepared = source.prepare(model, strict=False)
    backbone = getattr(model, "backbone", None)
    if not prepared.plan.reads and backbone is not None:
        prepared = source.prepare(backbone, strict=False)
    variables, plan = prepared.state.variables, prepared.plan
    keys = {variables[key].path: key for key in [*plan.reads, *plan.mismatched]}
    return Paired(source, prepared, keys, list(plan.unexpected))
