"""Another process holding the writer lock of one step (`workers/hold_step_lock.py`)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from tests._beacons import Beacon, Go

REPO_ROOT = Path(__file__).resolve().parent.parent
HANG_S = 300  # only to stop a hang


@contextlib.contextmanager
def lock_holder(
    tmp_path: Path, directory: Path, step: int, *, go: Go | None = None
) -> Iterator[subprocess.Popen]:
    """Yields once the holder has the lock of `step`; it then holds it until killed on the way
    out or, given `go`, until `go.send()`, when it saves the step under the lock and exits."""
    ready = Beacon(tmp_path / f"holder_{step}.ready")
    args = {"directory": str(directory), "step": step, "ready": str(ready), "go": go and str(go)}
    log = tmp_path / f"holder_{step}.log"
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), JAX_PLATFORMS="cpu")
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                str(REPO_ROOT / "tests" / "workers" / "hold_step_lock.py"),
                json.dumps(args),
            ],
            cwd=REPO_ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        ready.wait(proc, HANG_S, log)
        yield proc
    finally:
        ready.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
