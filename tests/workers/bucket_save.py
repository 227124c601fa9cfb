"""Saves two steps into an object-store prefix; the test SIGKILLs it while step 2 is written.

Started by `tests/test_object_storage.py` as a plain subprocess (not by `_harness`): one process,
8 virtual CPU devices, ModelParallel (2, 4), the store's endpoint and credentials in its
environment. Arguments: one JSON object in argv[1]: `directory` (the `s3://`/`gs://` prefix) and
`marker` (a local file written once step 1 is committed, just before step 2 starts).

Step 1 is `_models.mlp()` filled with `arange`; step 2 is a larger model (16 MiB of kernels in 32
shard objects, 64 MiB on S3, which moto takes faster), so its save is still running when the test
sees its first object and kills.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ["KERAS_BACKEND"] = "jax"

import keras

import keras_orbax
from tests import _models

args = json.loads(sys.argv[1])
keras.distribution.set_distribution(_models.model_parallel((2, 4)))
model = _models.mlp()
_models.fill_arange(model)
keras_orbax.save(model, args["directory"], step=1)

# moto takes a 16 MiB step faster than the test can list and kill: 64 MiB there.
width = 2048 if args["directory"].startswith("s3://") else 1024
big = keras.Sequential([keras.Input((width,))] + [keras.layers.Dense(width) for _ in range(4)])
Path(args["marker"]).write_text("")
keras_orbax.save(big, args["directory"], step=2)
print("step 2 committed: the test did not kill this process in time", flush=True)
