"""Worker side of the multi-process harness (`tests/_harness.py`).

A worker script started by the harness does:

```python
from tests._worker_util import init_worker, write_result

ctx = init_worker()            # jax.distributed is up; ctx.process_id, ctx.args, ...
...
write_result({"loss": 0.1})    # JSON, written atomically where the harness looks for it
```

Fail by raising: `init_worker` installs an excepthook that prints the traceback and exits at
once with status 1. A plain exit runs jax's atexit `distributed.shutdown()`, a barrier that waits
for every other process, so it would hang a failed run; do not `sys.exit(1)` after `init_worker`.
The same barrier keeps process 0 (the coordination service) alive until the others are done.

A worker that must finish although a peer is dead (the test killed it) writes its result and
calls `exit_now()`, which skips that barrier.

This module imports nothing from jax at import time, so the harness can share its constants.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, NoReturn

ENV_COORDINATOR = "KERAS_ORBAX_TEST_COORDINATOR"
ENV_NUM_PROCESSES = "KERAS_ORBAX_TEST_NUM_PROCESSES"
ENV_PROCESS_ID = "KERAS_ORBAX_TEST_PROCESS_ID"
ENV_RESULT_PATH = "KERAS_ORBAX_TEST_RESULT_PATH"
ENV_WORKDIR = "KERAS_ORBAX_TEST_WORKDIR"
ENV_ARGS = "KERAS_ORBAX_TEST_ARGS"


@dataclass(frozen=True)
class WorkerContext:
    """Where this worker stands in the run the harness started."""

    coordinator_address: str
    num_processes: int
    process_id: int
    result_path: Path
    workdir: Path
    args: Any
    """The `args` given to `run_workers`/`start_workers`, after a JSON round trip."""


def worker_context() -> WorkerContext:
    """Reads the context the harness put in the environment, without initializing anything."""
    try:
        return WorkerContext(
            coordinator_address=os.environ[ENV_COORDINATOR],
            num_processes=int(os.environ[ENV_NUM_PROCESSES]),
            process_id=int(os.environ[ENV_PROCESS_ID]),
            result_path=Path(os.environ[ENV_RESULT_PATH]),
            workdir=Path(os.environ[ENV_WORKDIR]),
            args=json.loads(os.environ.get(ENV_ARGS, "null")),
        )
    except KeyError as e:
        raise RuntimeError(
            f"{e.args[0]} is not set: run this script through tests/_harness.py run_workers()."
        ) from None


def init_worker(*, initialization_timeout: int = 60, shutdown_timeout: int = 120) -> WorkerContext:
    """Installs the fail-fast excepthook and joins the `jax.distributed` cluster.

    Args:
        initialization_timeout: Seconds to wait for all processes to connect.
        shutdown_timeout: Seconds the exit-time shutdown barrier waits for the other processes
            before jax aborts this one (SIGABRT, naming the missing processes in its log).

    Returns:
        The worker's context.
    """
    ctx = worker_context()
    sys.excepthook = _exit_on_uncaught
    import jax

    jax.distributed.initialize(
        coordinator_address=ctx.coordinator_address,
        num_processes=ctx.num_processes,
        process_id=ctx.process_id,
        initialization_timeout=initialization_timeout,
        shutdown_timeout_seconds=shutdown_timeout,
        coordinator_bind_address=ctx.coordinator_address if ctx.process_id == 0 else None,
    )
    return ctx


def write_result(result: dict[str, Any]) -> None:
    """Writes this worker's JSON result atomically (numpy values become lists or numbers)."""
    path = Path(os.environ[ENV_RESULT_PATH])
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, default=_to_json))
    os.replace(tmp, path)


def _to_json(value: Any) -> Any:
    import numpy as np

    if isinstance(value, np.ndarray | np.generic):
        return value.tolist()
    jax = sys.modules.get("jax")
    if jax is not None and isinstance(value, jax.Array):
        return np.asarray(value).tolist()
    raise TypeError(f"write_result: {type(value).__name__} is not JSON serializable: {value!r}")


def exit_now(code: int = 0) -> NoReturn:
    """Exits at once, skipping the `jax.distributed` shutdown barrier (for when a peer is dead)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _exit_on_uncaught(
    exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None
) -> None:
    traceback.print_exception(exc_type, exc, tb)
    exit_now(1)
