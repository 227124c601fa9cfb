"""What a restore says beside its result: `KerasOrbaxWarning`s attributed to the user's call."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Mapping

import keras

from keras_orbax._src.model.matching import counted, listed
from keras_orbax._src.model.state_keys import METRIC, OPTIMIZER
from keras_orbax._src.sources.base import Prepared, Source
from keras_orbax.errors import KerasOrbaxWarning


def warn(message: str) -> None:
    """A `KerasOrbaxWarning` attributed to the first caller outside keras-orbax and Keras (the
    user's call of `restore_sharded`, `load_model` or `from_preset`, or of `fit` for a resuming
    `ModelCheckpoint`), so Python shows it once per call site."""
    frame, level = inspect.currentframe(), 1
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] in (
        "keras_orbax",
        "keras",  # `fit` runs a resuming ModelCheckpoint's restore
        "contextlib",  # `gc_pause.paused()` decorates `restore_sharded`
    ):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, KerasOrbaxWarning, stacklevel=level)


def warn_untaken(
    model: keras.Model, source: Source, prepared: Prepared, *, verb: str = "restore_sharded"
) -> None:
    """Says so where the checkpoint's optimizer state is dropped because the model has no
    optimizer (an uncompiled model): compiling it afterwards starts training from fresh slots.
    `verb` is what drops it (`convert` writes what the model takes)."""
    if any(role == OPTIMIZER for role in prepared.state.roles.values()):
        return
    roles = {key: prepared.record.variables[key].role for key in prepared.plan.unexpected}
    optimizer = sum(role == OPTIMIZER for role in roles.values())
    if not optimizer:
        return
    metrics = sum(role == METRIC for role in roles.values())
    also = f" and {counted(metrics, 'metric variable')}" if metrics else ""
    compiled = source.model_config is not None and source.model_config.get("compile_config")
    were = "was" if optimizer + metrics == 1 else "were"
    if verb == "convert":
        done, why = "written", "To keep them"
        config = ", or convert without a model: the one its saved config describes is compiled"
    else:
        done, why = "restored", "To resume training from them"
        config = ", or use keras_orbax.load_model, which compiles the model from its saved config"
    advice = f"compile the model with its optimizer before {verb}{config if compiled else ''}"
    if verb == "load_model":  # called with compile=False
        advice = (
            "load it with compile=True (the default)"
            if compiled
            else "compile the model with its optimizer and call restore_sharded"
        )
    warn(
        f"Model '{model.name}' has no optimizer, so {counted(optimizer, 'optimizer variable')}"
        f"{also} of '{source.label}' {were} not {done}. {why}, {advice}."
    )


def warn_lenient(
    model: keras.Model, source: Source, prepared: Prepared, paths: Mapping[str, str]
) -> None:
    """Names the variables `strict=False` left as they were (or initialized, deferred ones)."""
    roles = prepared.state.roles
    kept = [key for key in prepared.plan.lenient if key in roles]
    weights = [paths[key] for key in kept if roles[key] != OPTIMIZER]
    slots = sum(roles[key] == OPTIMIZER for key in kept)
    optimizer = f"optimizer state ({counted(slots, 'variable')})"
    if weights:
        keep = (
            "It keeps its initial value" if len(weights) == 1 else "They keep their initial values"
        )
        also = f", and so does its {optimizer}, restored whole or not at all" if slots else ""
        warn(
            f"restore_sharded(strict=False) did not restore {counted(len(weights), 'variable')} "
            f"of model '{model.name}' that '{source.label}' lacks or holds with another shape or "
            f"dtype: {listed(weights)}. {keep}{also}."
        )
    elif slots:
        warn(
            f"restore_sharded(strict=False) did not restore the {optimizer} of model "
            f"'{model.name}': '{source.label}' holds it for other variables, shapes or dtypes, and "
            "it is restored whole or not at all. It keeps its initial values."
        )
