"""Dtype names <-> numpy dtypes, and which casts a restore may do."""

from __future__ import annotations

import numpy as np


def np_dtype(name: str) -> np.dtype:
    """`"bfloat16"` and friends included: numpy knows them once ml_dtypes (JAX's) registers them.
    ml_dtypes is imported only for such a name: its import costs more CPU than the rest of
    `keras-orbax inspect`."""
    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes  # noqa: F401  (registers its dtypes' names with numpy)

        return np.dtype(name)


def can_cast(saved: str, target: str) -> bool:
    """Floats cast to floats shard by shard; every other dtype must match exactly."""
    if saved == target:
        return True
    from jax import numpy as jnp  # heavy: keeps `keras-orbax inspect` free of JAX

    return bool(jnp.issubdtype(np_dtype(saved), jnp.floating)) and bool(
        jnp.issubdtype(np_dtype(target), jnp.floating)
    )
