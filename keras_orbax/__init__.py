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

import os

# keras-orbax is for Keras's JAX backend: choose it unless the user chose one (Keras reads this when
# it is first imported; the console script imports nothing else before).
os.environ.setdefault("KERAS_BACKEND", "jax")
from keras_orbax import errors
from keras_orbax._src.model.deferred import deferred_init
from keras_orbax._src.restore.load_model import load_model
from keras_orbax._src.restore.preset import from_preset
from keras_orbax._src.restore.restore import RestoreResult, restore_sharded
from keras_orbax._src.storage import locations
from keras_orbax._src.tools.convert import convert
from keras_orbax._src.tools.diff import DiffResult, diff
from keras_orbax._src.tools.inspect_checkpoint import CheckpointInfo, inspect
from keras_orbax._src.tools.verify_step import VerifyResult, verify
from keras_orbax._src.training.callback import ModelCheckpoint
from keras_orbax._src.write.step_writer import save

# Object-store paths through gcsfs/s3fs, not TensorFlow's file system, and the variables the storage
# layers read derived from the standard ones, before any of them is imported (see `locations`).
locations.configure_environment()

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
    "from_preset",
    "inspect",
    "load_model",
    "restore_sharded",
    "save",
    "verify",
]
