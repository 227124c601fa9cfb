"""Restores the checkpoint `DIR` (two Dense kernels saved on a (2, 4) mesh, one file per shard),
then, while the model holds what it restored, truncates one shard file and overwrites another in
place, and reads every weight; prints JSON: each weight's equality with `DIR/saved.npz`, and the
lines of /proc/self/maps that name a file under `DIR` as they were right after the restore.

Usage: python tests/workers/mapped_safety.py DIR [truncate]

Run in a fresh process: a buffer still mapped from a truncated file kills it with SIGBUS when read,
which the test sees as a crash. Without `truncate` the first file is left whole (only the in-place
write), so that a process that does map can report what it sees.
"""

import json
import os
import sys

os.environ["KERAS_BACKEND"] = "jax"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import keras
import numpy as np

import keras_orbax
from keras_orbax._src.storage import mapped
from tests import _models

TRUNCATED = "1/state/layers.dense.vars.0/c/0/0"  # a shard of `first/kernel`
OVERWRITTEN = "1/state/layers.dense_1.vars.0/c/1/3"  # a shard of `second/kernel`


def build() -> keras.Model:
    """Two kernels of 2 MiB, stored one file per shard, each shard (512, 128) or (256, 256) of
    float32: 256 KiB, mappable here (`MIN_BYTES` lowered below)."""
    inputs = keras.Input((1024,))
    x = keras.layers.Dense(512, name="first")(inputs)
    return keras.Model(inputs, keras.layers.Dense(1024, name="second")(x))


def main(directory: str, truncate: bool) -> None:
    mapped.MIN_BYTES = 64 << 10  # the shards here would be mapped if mapping were on
    keras.distribution.set_distribution(_models.model_parallel((2, 4)))
    with keras_orbax.deferred_init():
        model = build()
    keras_orbax.restore_sharded(model, directory)
    with open("/proc/self/maps") as maps:
        mapped_lines = [line.strip() for line in maps if directory in line]

    if truncate:
        os.truncate(os.path.join(directory, TRUNCATED), 0)
    with open(os.path.join(directory, OVERWRITTEN), "r+b") as shard:  # what `cp` and rsync do
        shard.write(np.full(256 * 256, 7.0, "float32").tobytes())

    saved = np.load(os.path.join(directory, "saved.npz"))
    equal = {
        w.path: bool(np.array_equal(np.asarray(w.value), saved[w.path])) for w in model.weights
    }
    print(json.dumps({"equal": equal, "maps": mapped_lines}))


if __name__ == "__main__":
    main(sys.argv[1], truncate=sys.argv[2:] == ["truncate"])
