"""The user's own code the `keras-orbax` command line runs, by choice: `--model MODULE:FUNCTION`
(built without allocating it) and `--layout-map MODULE:FUNCTION`."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from keras_orbax import errors


def load_function(spec: str) -> Callable[..., Any]:
    """`package.module:function` or `path/to/file.py:function` (the user's own code, by choice)."""
    module_name, _, function = spec.rpartition(":")
    if not module_name or not function:
        raise ValueError(f"--model must be MODULE:FUNCTION. Received: {spec!r}")
    if module_name.endswith(".py"):
        location = Path(module_name)
        if not location.is_file():
            raise FileNotFoundError(f"No such file: '{location}' (from --model {spec})")
        loaded = importlib.util.spec_from_file_location(location.stem, location)
        assert loaded is not None and loaded.loader is not None
        module = importlib.util.module_from_spec(loaded)
        loaded.loader.exec_module(module)
    else:
        sys.path.insert(0, os.getcwd())
        module = importlib.import_module(module_name)
    if not hasattr(module, function):
        raise AttributeError(f"'{module_name}' has no function '{function}' (from --model {spec})")
    return getattr(module, function)


def build_deferred(spec: str) -> Any:
    """The model `--model SPEC` builds, under `deferred_init()`: nothing allocated."""
    from keras_orbax._src.model.deferred import deferred_init

    build = load_function(spec)
    try:
        with deferred_init():
            return build()
    except errors.NotDeferrableError:
        raise errors.NotDeferrableError(
            f"--model {spec} compiles the model with an optimizer it makes, which keras-orbax "
            "cannot do while it builds the model without allocating it (Keras makes an "
            "optimizer's step counter from a number). Make the optimizer outside the function, "
            "at module level, and compile with that object; or return the model uncompiled (its "
            "optimizer state is then left out). A keras-hub task compiles a default optimizer "
            "when it is made: pass it compile=False (then compile it as above, or not)."
        ) from None
