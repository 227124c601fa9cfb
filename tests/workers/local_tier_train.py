"""A training run with a local tier that SIGKILLs itself after a chosen batch; started by
`tests/test_local_tier.py` (not by `_harness`).

One process, 8 virtual CPU devices, ModelParallel (2, 4). Arguments: one JSON object in argv[1]:
directory, local_directory, kill_after (the global batch after whose end the process is killed,
before the next batch starts: its local save may or may not have committed).
"""

from __future__ import annotations

import json
import os
import signal
import sys

args = json.loads(sys.argv[1])
os.environ["KERAS_BACKEND"] = "jax"

import keras  # noqa: E402

from tests import _local_tier  # noqa: E402


class _KillAfter(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if int(self.model.optimizer.iterations.numpy()) == args["kill_after"]:
            os.kill(os.getpid(), signal.SIGKILL)


_local_tier.train(args["directory"], args["local_directory"], extra_callbacks=[_KillAfter()])
raise SystemExit("not killed")
