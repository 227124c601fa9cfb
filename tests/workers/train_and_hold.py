"""A training run that holds its checkpoint directory: `fit` with `ModelCheckpoint(max_to_keep=2,
save_freq=2)` commits steps 2 and 4, then stops inside its save of step 6, its shard files staged
and every process agreed (the start of the "rename" stage), until killed. Started by
`tests/test_shared_directory.py`. argv[1]: JSON with directory and ready (a
`tests._beacons.Beacon` opened once there).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

args = json.loads(sys.argv[1])
os.environ["KERAS_BACKEND"] = "jax"

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_orbax  # noqa: E402
from keras_orbax._src.storage import commit  # noqa: E402
from tests import _models  # noqa: E402

renames = []


def hold_in_third_save(stage: str) -> None:
    if stage == "rename":
        renames.append(stage)
        if len(renames) == 3:
            Path(args["ready"]).write_text(str(os.getpid()))
            while True:  # until killed
                signal.pause()


keras.distribution.set_distribution(_models.model_parallel((2, 4)))
model = _models.compile_adam(_models.mlp())
checkpoint = keras_orbax.ModelCheckpoint(args["directory"], max_to_keep=2, save_freq=2)
x, y = np.ones((32, 16), "float32"), np.ones((32, 8), "float32")
with commit.on_stage(hold_in_third_save):
    model.fit(x, y, batch_size=8, epochs=3, verbose=0, callbacks=[checkpoint])
sys.stdout.flush()
