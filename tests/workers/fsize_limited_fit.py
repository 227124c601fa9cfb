"""Trains with `ModelCheckpoint` until its writes fail for real; for tests/test_callback.py.

    python tests/workers/fsize_limited_fit.py DIRECTORY EPOCHS RESULT_DIR

Run with KERAS_BACKEND=jax and 8 virtual CPU devices in XLA_FLAGS. After the first save (step 4)
is committed, no file of this process may grow past 32 KiB (RLIMIT_FSIZE, so writes fail with
EFBIG even as root) while the model's shard files are 64 KiB and more. The limit is set here, in
a process of its own, not in the test runner. Writes `RESULT_DIR/result.json` (the error `fit`
raised, the SIGTERM handler and the garbage collector after it) and `RESULT_DIR/after_first.npz` (the state at step 4).
"""

from __future__ import annotations

import gc
import json
import resource
import signal
import sys
from pathlib import Path

import keras
import numpy as np

import keras_orbax
from tests import _models


def main() -> None:
    directory, epochs, result_dir = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    keras.distribution.set_distribution(_models.model_parallel((2, 4)))
    model = _models.compile_adam(_models.mlp(width=16384))
    checkpoint = keras_orbax.ModelCheckpoint(directory)
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of death by signal

    def fail_from_now_on(epoch: int, logs: dict | None = None) -> None:
        if epoch == 0:
            checkpoint.wait_until_finished()
            state = _models.values(model.variables + model.optimizer.variables)
            np.savez(result_dir / "after_first.npz", *state)
            resource.setrlimit(resource.RLIMIT_FSIZE, (32 * 1024, old_limit[1]))

    rng = np.random.default_rng(0)
    x, y = rng.random((32, 16), dtype="float32"), rng.random((32, 8), dtype="float32")
    error = None
    try:
        model.fit(
            x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=0,
            callbacks=[checkpoint, keras.callbacks.LambdaCallback(on_epoch_end=fail_from_now_on)],
        )  # fmt: skip
    except Exception as e:
        error = {"type": type(e).__name__, "message": str(e)}
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
    result = {
        "error": error,
        "sigterm_is_default": signal.getsignal(signal.SIGTERM) is signal.SIG_DFL,
        "gc_enabled": gc.isenabled(),  # background saves pause the collector (gc_pause.hold)
    }
    (result_dir / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
