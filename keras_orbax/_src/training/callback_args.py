"""`ModelCheckpoint`'s arguments, checked with Keras's manners (the value received in the message)."""

from __future__ import annotations

import os
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
    if save_freq != "epoch" and not _positive_int(save_freq):
        raise ValueError(
            f"save_freq must be 'epoch' or a positive int. Received: save_freq={save_freq!r}"
        )
    for name, value in (
        ("max_to_keep", max_to_keep),
        ("keep_best", keep_best),
        ("keep_every", keep_every),
    ):
        if value is not None and not _positive_int(value):
            raise ValueError(f"{name} must be None or a positive int. Received: {name}={value!r}")
    if format not in ("fast", "compact"):
        raise ValueError(f"format must be 'fast' or 'compact'. Received: format={format!r}")


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
