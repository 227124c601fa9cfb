"""Worker for tests/test_fault_matrix.py, 2 processes x 4 devices: three exports, each over an
earlier one of the same sink, each with a real fault that process 1 injects
(`storage.commit.on_stage`):

- "weights.h5" on an ext4 filesystem that process 1 shuts down at the start of "stage" (EIO);
- "transformers" on a tmpfs that process 1 fills at the start of "stage" (ENOSPC);
- "step.fast" (`keras_orbax.save`), where no file of process 1 may grow past a limit
  (RLIMIT_FSIZE) that its shard files exceed: its writes fail with EFBIG, on process 1 alone (a
  fault of the shared filesystem would fail process 0's writes too, and so never show process 0
  waiting for process 1); process 0 must raise too, without waiting in Orbax's commit barrier;
- "step.regions" (`keras_orbax.save`), where process 1 removes one of its own shard files at the
  start of the step's region check ("regions"): both processes must refuse the step;
- "step.finalize", where process 1 fails at the start of Orbax's finalize ("rename"), after every
  process agreed: process 0 must give up waiting in Orbax's commit barrier within
  `KERAS_ORBAX_SYNC_TIMEOUT_S`, not Orbax's 20 minutes;
- "step.start", where process 1 stalls at the start of "stage" (`keras_orbax.save`'s call into
  Orbax, just before Orbax's save-start barrier, `CheckpointManager:save_start`) until process 0
  has ended the case: process 0 must give up within `KERAS_ORBAX_SYNC_TIMEOUT_S` (Orbax's
  default barrier there waits without limit), and process 1, arriving late, must raise too;
- "step.write_complete", where process 1 stalls in Orbax's background thread just before the
  `AsyncCheckpointer`'s `async_write_complete` barrier, after every process agreed and passed the
  handler's barriers, until process 0 has ended the case: process 0 must give up within
  `KERAS_ORBAX_SYNC_TIMEOUT_S` (Orbax's limit there is what remains of its 20 minutes), and
  process 1, arriving late, must raise too;
- "step.database", a `"compact"` step where process 1 removes its own OCDBT database's manifest
  (`ocdbt.process_1/manifest.ocdbt`) at the start of the step's region check: both processes
  must refuse the step;
- "preset", where process 1 SIGKILLs itself at the start of "agree" (`KERAS_ORBAX_TEST_KILL_AT`):
  process 0 must give up within `KERAS_ORBAX_SYNC_TIMEOUT_S`.

args: {"cases": [{"sink", "root"}, ...]}. Each process writes, after each case, what it raised
(and process 0 the files of the earlier export) to `<workdir>/cases_<process>.json`.
"""

from __future__ import annotations

import errno
import json
import os
import resource
import signal
import time
from pathlib import Path

import keras

import keras_orbax
from keras_orbax._src.storage import commit
from tests import _faults, _models
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


# The step case's hidden kernel, 16 x WIDE float32 over a (2, 4) mesh: 8 * WIDE bytes a shard file.
WIDE = 32768


def _step_one_saved(
    root: Path, process_id: int, format: str = "fast"
) -> tuple[keras.Model, dict[str, str] | None]:
    """The model with step 1 saved from it (process 0: that step's files) and new values since."""
    keras.utils.set_random_seed(0)
    keras.distribution.set_distribution(_models.model_parallel((2, 4)))
    model = _models.mlp(width=WIDE)
    _faults.fill(model, _faults.PREVIOUS)
    keras_orbax.save(model, root / "ckpt", step=1, format=format)
    before = _faults.files(root / "ckpt" / "1") if process_id == 0 else None
    _faults.fill(model, _faults.NEW)
    return model, before


def _step_case(root: Path, process_id: int, log: Path) -> dict:
    """Step 1 saved; then step 2, whose shard files process 1 cannot write (EFBIG)."""
    model, before = _step_one_saved(root, process_id)
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    error = ""
    try:
        if process_id == 1:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of death by signal
            # Room for this process's log to grow, none for a shard file (8 * WIDE bytes).
            room = log.stat().st_size + 64 * 1024
            assert room < 8 * WIDE, room
            resource.setrlimit(resource.RLIMIT_FSIZE, (room, limit[1]))
        keras_orbax.save(model, root / "ckpt", step=2)
    except Exception as failed:
        error = f"{type(failed).__name__}: {failed}"
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
    return {"sink": "step.fast", "error": error, "before": before}


def _remove_own_shard_file(ckpt: Path) -> None:
    """Removes the first shard file this process (1) wrote into the step being saved, as its own
    checksum file lists them (written before the region check)."""
    (state,) = ckpt.glob("2.orbax-checkpoint-tmp*/state*")
    listed = json.loads((state / "keras_orbax_checksums" / "process_1.json").read_text())
    (state / sorted(listed["files"])[0]).unlink()


def _remove_own_database(ckpt: Path) -> None:
    """Removes the manifest of this process's (1) OCDBT database in the step being saved."""
    (state,) = ckpt.glob("2.orbax-checkpoint-tmp*/state*")
    (state / "ocdbt.process_1" / "manifest.ocdbt").unlink()


def _fail_finalize() -> None:
    raise OSError(errno.EIO, "injected at Orbax's finalize")


_STEP_FAULTS = {  # sink -> (stage, what process 1 does there, given the checkpoint)
    "step.regions": ("regions", _remove_own_shard_file),
    "step.finalize": ("rename", lambda ckpt: _fail_finalize()),
    "step.start": ("stage", None),  # stalls until process 0 has ended the case (`_wait_for_peer`)
    "step.write_complete": ("async_write_complete", None),  # the same, in Orbax's thread
    "step.database": ("regions", _remove_own_database),
}
_COMPACT = {"step.database"}


def _step_fault_case(sink: str, root: Path, process_id: int, workdir: Path, done: int) -> dict:
    """Step 1 saved; then step 2, with process 1's fault at `_STEP_FAULTS[sink]` (`done`: the
    cases each process has ended before this one)."""
    format = "compact" if sink in _COMPACT else "fast"
    model, before = _step_one_saved(root, process_id, format)
    stage, fault = _STEP_FAULTS[sink]
    if fault is None:
        hook = _faults.fault_at(stage, lambda: _wait_for_peer(workdir, process_id, done + 1))
    else:
        hook = _faults.fault_at(stage, lambda: fault(root / "ckpt"))
    error = ""
    try:
        if process_id == 1:
            with commit.on_stage(hook):
                keras_orbax.save(model, root / "ckpt", step=2, format=format)
        else:
            keras_orbax.save(model, root / "ckpt", step=2, format=format)
    except Exception as failed:
        error = f"{type(failed).__name__}: {failed}"
    return {"sink": sink, "error": error, "before": before}


def _wait_for_peer(workdir: Path, process_id: int, done: int) -> None:
    """Until the other process has finished as many cases: a process that failed early must not
    wait in the next case's first collective call while the other still waits out its timeout."""
    other = workdir / f"cases_{1 - process_id}.json"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if len(json.loads(other.read_text())) >= done:
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.1)


def main() -> None:
    ctx = init_worker()
    done = []
    for case in ctx.args["cases"]:
        root = Path(case["root"])
        if case["sink"] == "step.fast":
            log = ctx.workdir / f"worker_{ctx.process_id}.log"
            done.append(_step_case(root, ctx.process_id, log))
        elif case["sink"] in _STEP_FAULTS:
            case_done = _step_fault_case(case["sink"], root, ctx.process_id, ctx.workdir, len(done))
            done.append(case_done)
        else:
            done.append(_case(case["sink"], root, ctx.process_id))
        (ctx.workdir / f"cases_{ctx.process_id}.json").write_text(json.dumps(done))
        if case["sink"] in _STEP_FAULTS:
            _wait_for_peer(ctx.workdir, ctx.process_id, len(done))
    write_result({"cases": done})
    exit_now()  # process 1 is dead: skip jax's shutdown barrier


if __name__ == "__main__":
    main()
