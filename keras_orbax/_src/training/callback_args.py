"""`ModelCheckpoint`'s arguments, checked with Keras's manners (the value received in the message)."""

from __future__ import annotations

import os
import string
from pathlib import PurePath
from typing import Any

import keras


def validate(
    directory: Any,
    save_freq: Any,
    max_to_keep: Any,
    keep_best: Any,
    keep_every: Any,
    format: Any,
) -> None:
    """Raises ValueError (RuntimeError off the JAX backend) naming the argument and its value."""
    if keras.backend.backend() != "jax":
        raise RuntimeError(
            f"keras-orbax needs the JAX backend. Received: backend={keras.backend.backend()}"
        )
    if not isinstance(directory, str | os.PathLike) or not os.fspath(directory):
        raise ValueError(f"directory must be a non-empty path. Received: directory={directory!r}")
    _check_not_a_file_name(os.fspath(directory))
    if save_freq != "epoch" and not positive_int(save_freq):
        raise ValueError(
            f"save_freq must be 'epoch' or a positive int. Received: save_freq={save_freq!r}"
        )
    for name, value in (
        ("max_to_keep", max_to_keep),
        ("keep_best", keep_best),
        ("keep_every", keep_every),
    ):
        if value is not None and not positive_int(value):
            raise ValueError(f"{name} must be None or a positive int. Received: {name}={value!r}")
    if format not in ("fast", "compact"):
        raise ValueError(f"format must be 'fast' or 'compact'. Received: format={format!r}")


# What Keras's own callbacks are given: `ModelCheckpoint(filepath)` writes one such file per save.
_KERAS_FILE_SUFFIXES = (".weights.h5", ".weights.json", ".keras", ".h5")


def _check_not_a_file_name(directory: str | bytes) -> None:
    """Refuses a Keras `filepath` (a template, or a weights or model file name): keras-orbax would
    otherwise create a directory literally named so, and never fill in its fields."""
    text = os.fsdecode(directory)
    name = PurePath(text).name.lower()
    fields = _format_fields(text)
    suffix = next((s for s in _KERAS_FILE_SUFFIXES if name.endswith(s)), None)
    if not fields and suffix is None:
        return
    without = []
    if fields:
        without.append(
            ", ".join(f"'{{{field}}}'" for field in fields)
            + " (each step records its epoch and logs)"
        )
    if suffix is not None:
        without.append(f"the '{suffix}' suffix")
    weights_only = suffix is not None and suffix.startswith(".weights")
    weights = " To save only the weights, pass save_weights_only=True." if weights_only else ""
    raise ValueError(
        "keras-orbax's ModelCheckpoint writes a checkpoint directory with one subdirectory per "
        "step, named by the global step (DIRECTORY/STEP), not a file per save: pass a plain "
        f"directory, such as 'checkpoints/run1', without {' and '.join(without)}.{weights} "
        f"Received: directory={text!r}"
    )


def _format_fields(text: str) -> list[str]:
    """The `str.format` fields in `text` (`epoch` in `'ep{epoch:02d}'`); none if it is not one."""
    try:
        return [field for _, field, _, _ in string.Formatter().parse(text) if field is not None]
    except ValueError:  # a lone brace: a literal path, not a template
        return []


def positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
