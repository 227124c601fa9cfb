"""Imports keras-hub for a test module: skipped where it is not installed, unless CI requires it.

`.ci/run` installs keras-hub (without TensorFlow) and sets `KERAS_ORBAX_REQUIRE_HUB=1`, so there a
broken install fails the suite instead of silently skipping the keras-hub tests.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest


def import_keras_hub(module: str = "keras_hub") -> ModuleType:
    """`module` (keras-hub or another package of the `hub` extra, e.g. `safetensors`)."""
    if os.environ.get("KERAS_ORBAX_REQUIRE_HUB") == "1":
        return importlib.import_module(module)
    return pytest.importorskip(module)


# A tiny keras-hub Gemma backbone's arguments: every dimension divides the (4, 2) and (2, 4) meshes
# the tests shard it over.
TINY_GEMMA = dict(
    vocabulary_size=64,
    num_layers=2,
    num_query_heads=4,
    num_key_value_heads=4,
    hidden_dim=16,
    intermediate_dim=32,
    head_dim=8,
)
