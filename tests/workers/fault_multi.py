"""Worker for tests/test_fault_matrix.py, 2 processes x 4 devices: three exports, each over an
earlier one of the same sink, each with a real fault that process 1 injects
(`storage.commit.on_stage`):

- "weights.h5" on an ext4 filesystem that process 1 shuts down at the start of "stage" (EIO);
- "transformers" on a tmpfs that process 1 fills at the start of "stage" (ENOSPC);
- "preset", where process 1 SIGKILLs itself at the start of "agree" (`KERAS_ORBAX_TEST_KILL_AT`):
  process 0 must give up within `KERAS_ORBAX_SYNC_TIMEOUT_S`.

args: {"cases": [{"sink", "root"}, ...]}. Each process writes, after each case, what it raised
(and process 0 the files of the earlier export) to `<workdir>/cases_<process>.json`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import keras

from keras_orbax._src.storage import commit
from tests import _faults
from tests._worker_util import exit_now, init_worker, write_result

_FAULTS = {  # sink -> (stage, what process 1 does there)
    "weights.h5": ("stage", lambda root: _faults.shut_down(root)),
    "transformers": ("stage", lambda root: _faults.fill_disk(root)),
}


def _case(sink: str, root: Path, process_id: int) -> dict:
    keras.utils.set_random_seed(0)  # every process builds the same initial values
    model = _faults.built_sharded(sink)
    _faults.fill(model, _faults.PREVIOUS)
    _faults.export(sink, model, root)
    before = _faults.files(root) if process_id == 0 else None
    _faults.fill(model, _faults.NEW)
    if sink == "preset" and process_id == 1:
        os.environ[commit.KILL_AT_ENV] = "agree"
    error = ""
    try:
        if process_id == 1 and sink in _FAULTS:
            stage, fault = _FAULTS[sink]
            with commit.on_stage(_faults.fault_at(stage, lambda: fault(root))):
                _faults.export(sink, model, root)
        else:
            _faults.export(sink, model, root)
    except Exception as failed:
        error = f"{type(failed).__name__}: {failed}"
    return {"sink": sink, "error": error, "before": before}


def main() -> None:
    ctx = init_worker()
    done = []
    for case in ctx.args["cases"]:
        done.append(_case(case["sink"], Path(case["root"]), ctx.process_id))
        (ctx.workdir / f"cases_{ctx.process_id}.json").write_text(json.dumps(done))
    write_result({"cases": done})
    exit_now()  # process 1 is dead: skip jax's shutdown barrier


if __name__ == "__main__":
    main()
