"""A writer that holds the lock of one step of a checkpoint directory; started by
`tests/test_environment.py`. argv[1]: JSON with directory, step, ready (a file written once the
lock is held: a `tests._beacons.Beacon`) and go (a `tests._beacons.Go` to wait for, then save the
step under the lock and exit; None: hold the lock, writing nothing, until killed).

The model saved is `_models.mlp()` filled with `arange + 1000`, so its step restores to known values.
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

from keras_orbax._src.storage.writer_lock import writer_lock  # noqa: E402
from keras_orbax._src.write import step_sink, step_writer  # noqa: E402
from tests import _models  # noqa: E402
from tests._beacons import wait_for_go  # noqa: E402

keras.distribution.set_distribution(_models.model_parallel((2, 4)))
model = _models.mlp()
_models.fill_arange(model)
for variable in model.variables:
    variable.assign(variable.value + 1000.0)

with writer_lock(args["directory"], args["step"]):
    Path(args["ready"]).write_text(str(os.getpid()))
    if args["go"] is None:
        while True:  # until killed
            signal.pause()
    wait_for_go(args["go"])
    # What `keras_orbax.save` does once it holds the lock.
    with step_sink.open_checkpointer(args["directory"]) as checkpointer:
        step_writer.write_step(checkpointer, model, step=args["step"])
sys.stdout.flush()
