"""keras-orbax: sharded, distributed checkpoints for Keras 3 on JAX.

Every shard is read straight onto the device that owns it; no host or device ever holds a full copy
of a sharded variable.

```python
import keras_orbax

keras_orbax.save(model, "/ckpt", step=100)
with keras_orbax.deferred_init():
    model = build_model()
keras_orbax.restore_sharded(model, "/ckpt")
```
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import TYPE_CHECKING, Any

# keras-orbax is for Keras's JAX backend: choose it unless the user chose one. Keras reads this when
# it is first imported, and every module of keras-orbax imports this package first.
_CHOSEN_BACKEND = os.environ.get("KERAS_BACKEND")
if not _CHOSEN_BACKEND:  # unset, or set empty, which Keras reads as unset too
    os.environ["KERAS_BACKEND"] = "jax"

from keras_orbax import errors  # noqa: E402  (cheap: imports nothing of ours)

if TYPE_CHECKING:
    from keras_orbax._src.export.preset import save_to_preset
    from keras_orbax._src.export.transformers import export_to_transformers
    from keras_orbax._src.export.weights_h5 import save_weights
    from keras_orbax._src.model.deferred import deferred_init
    from keras_orbax._src.restore.layout_map import get_layout_map
    from keras_orbax._src.restore.load_model import load_model
    from keras_orbax._src.restore.preset import from_preset
    from keras_orbax._src.restore.restore import restore_sharded
    from keras_orbax._src.restore.result import RestoreResult
    from keras_orbax._src.tools.convert import convert
    from keras_orbax._src.tools.diff import DiffResult, diff
    from keras_orbax._src.tools.inspect_checkpoint import CheckpointInfo, inspect
    from keras_orbax._src.tools.verify_step import VerifyResult, verify
    from keras_orbax._src.training.callback import ModelCheckpoint
    from keras_orbax._src.write.step_writer import save

__version__ = "0.1.0"

__all__ = [
    "CheckpointInfo",
    "DiffResult",
    "ModelCheckpoint",
    "RestoreResult",
    "VerifyResult",
    "convert",
    "deferred_init",
    "diff",
    "errors",
    "export_to_transformers",
    "from_preset",
    "get_layout_map",
    "inspect",
    "load_model",
    "restore_sharded",
    "save",
    "save_to_preset",
    "save_weights",
    "verify",
]

# The public names, imported on first use (PEP 562): `import keras_orbax` and the console script
# stay cheap, and JAX, Keras and Orbax load only for a verb that needs them.
_LAZY = {
    "CheckpointInfo": "keras_orbax._src.tools.inspect_checkpoint",
    "DiffResult": "keras_orbax._src.tools.diff",
    "ModelCheckpoint": "keras_orbax._src.training.callback",
    "RestoreResult": "keras_orbax._src.restore.result",
    "VerifyResult": "keras_orbax._src.tools.verify_step",
    "convert": "keras_orbax._src.tools.convert",
    "deferred_init": "keras_orbax._src.model.deferred",
    "diff": "keras_orbax._src.tools.diff",
    "export_to_transformers": "keras_orbax._src.export.transformers",
    "from_preset": "keras_orbax._src.restore.preset",
    "get_layout_map": "keras_orbax._src.restore.layout_map",
    "inspect": "keras_orbax._src.tools.inspect_checkpoint",
    "load_model": "keras_orbax._src.restore.load_model",
    "restore_sharded": "keras_orbax._src.restore.restore",
    "save": "keras_orbax._src.write.step_writer",
    "save_to_preset": "keras_orbax._src.export.preset",
    "save_weights": "keras_orbax._src.export.weights_h5",
    "verify": "keras_orbax._src.tools.verify_step",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'keras_orbax' has no attribute {name!r}")
    _prepare()
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*__all__, *(name for name in globals() if name.startswith("__"))})


def _prepare() -> None:
    """What must hold before the first module that needs Keras, JAX or the storage layers loads."""
    _require_jax_backend()
    from keras_orbax._src.storage import locations

    # Object-store paths through gcsfs/s3fs, not TensorFlow's file system, and the variables the
    # storage layers read derived from the standard ones (see `locations`).
    locations.configure_environment()


def _require_jax_backend() -> None:
    """Imports Keras (on JAX, unless the user chose another backend) and checks its backend.

    Runs before the first module that needs Keras is imported: under another backend, Keras's
    variables have no JAX shardings and a save would fail deep inside, naming neither.

    Raises:
        BackendError: Keras runs another backend (`KERAS_BACKEND` set to another, or Keras
            imported before keras-orbax with the backend of `~/.keras/keras.json`).
    """
    if "keras" in sys.modules or os.environ.get("KERAS_BACKEND") == "jax":
        import keras

        backend, runs = keras.backend.backend(), "Keras runs"
    else:  # not imported yet: importing it would import that backend, which may not be installed
        backend, runs = os.environ["KERAS_BACKEND"], "KERAS_BACKEND chooses"
    if backend != "jax":
        raise errors.BackendError(
            f"keras-orbax needs Keras's JAX backend, but {runs} the '{backend}' backend. "
            "Keras chooses its backend once, when it is first imported: set KERAS_BACKEND=jax "
            f"in the environment before anything imports Keras. "
            f"Received: KERAS_BACKEND={_CHOSEN_BACKEND!r}"
        )
