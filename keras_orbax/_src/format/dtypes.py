"""Dtype names <-> numpy dtypes, and which casts a restore may do."""

from __future__ import annotations

import numpy as np
from jax import numpy as jnp


def np_dtype(name: str) -> np.dtype:
    """`"bfloat16"` and friends included (JAX registers them with numpy via ml_dtypes)."""
    return np.dtype(jnp.dtype(name))


def can_cast(saved: str, target: str) -> bool:
    """Floats cast to floats shard by shard; every other dtype must match exactly."""
    if saved == target:
        return True
    return bool(jnp.issubdtype(np_dtype(saved), jnp.floating)) and bool(
        jnp.issubdtype(np_dtype(target), jnp.floating)
    )
