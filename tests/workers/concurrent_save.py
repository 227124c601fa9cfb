"""One of two processes saving to the same checkpoint directory at once; started by
`tests/test_environment.py`. argv[1]: JSON with directory, writer (0 or 1), steps (a list: saved
in turn, each started when both writers are ready), workdir (for a FIFO per step) and result.

The model's every value is `writer + 1`, so a step mixing both writers' files shows."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

args = json.loads(sys.argv[1])
os.environ["KERAS_BACKEND"] = "jax"

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_orbax  # noqa: E402
from tests import _models  # noqa: E402

keras.distribution.set_distribution(_models.model_parallel((2, 4)))
model = _models.mlp()
for variable in model.variables:
    variable.assign(np.full(variable.shape, args["writer"] + 1, "float32"))
workdir = Path(args["workdir"])
outcomes = []
for round_, step in enumerate(args["steps"]):
    # A rendezvous: opening a FIFO blocks until its other end is opened too (writer 0 reads,
    # writer 1 writes), so both leave here together, woken by the kernel.
    fifo = workdir / f"ready_{round_}"
    with contextlib.suppress(FileExistsError):
        os.mkfifo(fifo)
    os.close(os.open(fifo, os.O_RDONLY if args["writer"] == 0 else os.O_WRONLY))
    try:
        keras_orbax.save(model, args["directory"], step=step)
        outcomes.append("ok")
    except Exception as error:
        outcomes.append(f"{type(error).__module__}.{type(error).__name__}: {error}")
Path(args["result"]).write_text(json.dumps(outcomes))
# After a clashing save, an Orbax thread can keep the interpreter from exiting (seen: minutes);
# the result is written, so leave at once.
sys.stdout.flush()
os._exit(0)
