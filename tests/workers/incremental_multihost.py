"""Worker for tests/test_incremental.py and tests/test_incremental_objects.py: one of 2 processes
x 4 devices saving `mlp(4096)` on a (2, 4) mesh at step 1, then, with one element of the first
kernel changed, at step 2 (each process compares and links, or in object storage has the
server copy, its own shards).

args: {"directory": the checkpoint root, a local path or an `s3://`/`gs://` URL}.
"""

from __future__ import annotations

import keras

import keras_orbax
from tests import _models
from tests._worker_util import init_worker, write_result

ctx = init_worker()
keras.utils.set_random_seed(0)  # every process must initialize the same values
keras.distribution.set_distribution(_models.model_parallel((2, 4)))
model = _models.mlp(4096)
_models.fill_arange(model)
keras_orbax.save(model, ctx.args["directory"], step=1)
kernel = model.get_layer("hidden").kernel
kernel.assign(kernel.value.at[0, 0].add(1.0))  # in the shard at chunk (0, 0)
keras_orbax.save(model, ctx.args["directory"], step=2)
write_result({"saved": [1, 2]})
