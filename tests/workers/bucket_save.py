"""Saves two steps into an object-store prefix and SIGKILLs itself in the middle of step 2.

Started by `tests/test_object_storage.py` as a plain subprocess (not by `_harness`): one process,
8 virtual CPU devices, ModelParallel (2, 4), the store's endpoint and credentials in its
environment. Arguments: one JSON object in argv[1]: `directory` (the `s3://`/`gs://` prefix).

Step 1 is `_models.mlp()` filled with `arange`. Step 2 (the same model, its head's kernel changed:
the other shards are copied on the server, `incremental`) dies as soon as its first shard object
is written to the bucket: the kill comes from inside, at that event, whatever the speed of the
store or of the machine (a test that listed the bucket and killed from outside could be too late).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import Any

os.environ["KERAS_BACKEND"] = "jax"

import keras

import keras_orbax
from keras_orbax._src.write import shard_files
from tests import _models

args = json.loads(sys.argv[1])
keras.distribution.set_distribution(_models.model_parallel((2, 4)))
model = _models.mlp()
_models.fill_arange(model)
keras_orbax.save(model, args["directory"], step=1)

# The objects' bytes are sent by tensorstore (C++, invisible to audit hooks); keras-orbax's
# `put_shard` returns once one is written: the one Python-level point after an object is stored.
put_shard = shard_files.put_shard


def put_shard_then_die(store: Any, shard: Any, **kwargs: Any) -> Any:
    put_shard(store, shard, **kwargs)
    os.kill(os.getpid(), signal.SIGKILL)


shard_files.put_shard = put_shard_then_die
head = model.get_layer("head").kernel
head.assign(head + 1.0)
keras_orbax.save(model, args["directory"], step=2)
print("step 2 committed: no shard object was written through put_shard", flush=True)
