"""The only module that knows about processes: who is primary, and agreeing on success or failure.

Under `jax.distributed`, `restore_sharded` is collective: every process reads its own shards, and
either all of them assign their variables or all raise the same error. `agree` is that handshake,
over JAX's coordination service, with a named key and a timeout, so a process that fails or never
arrives produces an error naming it instead of a hang.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import numpy as np
from jax.experimental import multihost_utils

from keras_orbax import _compat, errors
from keras_orbax.errors import KerasOrbaxError, ProcessSyncError

T = TypeVar("T")
DEFAULT_TIMEOUT_S = float(os.environ.get("KERAS_ORBAX_SYNC_TIMEOUT_S", "300"))
_calls = itertools.count()


def process_count() -> int:
    return jax.process_count()


def is_primary() -> bool:
    """True on the process that prints and writes shared files (process 0)."""
    return jax.process_index() == 0


def primary_decision(decision: bool) -> bool:
    """Process 0's decision, on every process, so that all enter a collective save together."""
    if process_count() == 1:
        return decision
    return bool(multihost_utils.broadcast_one_to_all(np.int32(decision)))


def agree(name: str, error: BaseException | None, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Every process reports how its part of `name` went; all raise if any failed.

    Single-process: re-raises `error` if given. Multi-process: each process publishes its outcome
    under a key unique to this call, then waits up to `timeout_s` for every other process's.

    Raises:
        The failing process's error type (from `keras_orbax.errors`), with a message that names
        each failed process, on every process; `ProcessSyncError` naming the processes that did
        not report in time.
    """
    if process_count() == 1:
        if error is not None:
            raise error
        return
    client = _compat.distributed_client()
    key = f"keras_orbax/{name}/{next(_calls)}"
    me = jax.process_index()
    outcome: dict[str, Any] = {"ok": error is None}
    if error is not None:
        outcome |= {"type": type(error).__name__, "message": str(error)}
    client.key_value_set(f"{key}/{me}", json.dumps(outcome))
    failures, missing = {}, []
    for process in range(process_count()):
        try:
            found = json.loads(
                client.blocking_key_value_get(f"{key}/{process}", int(timeout_s * 1000))
            )
        except Exception:  # the coordination service reports a timeout as a generic error
            missing.append(process)
            continue
        if not found["ok"]:
            failures[process] = found
    if missing:
        raise ProcessSyncError(
            f"Processes {missing} did not reach '{name}' within {timeout_s:.0f} s (this is process "
            f"{me}). They may have crashed or be stuck; no variable was modified here."
        ) from error
    if failures:
        raise _combined(name, failures) from error


def run_collectively(name: str, fn: Callable[..., T], *args: Any) -> T:
    """Runs `fn(*args)` on this process, then `agree`s: returns only if it succeeded everywhere."""
    try:
        result = fn(*args)
    except Exception as error:  # reported to every process by `agree`, which re-raises
        agree(name, error)
        raise
    agree(name, None)
    return result


def _combined(name: str, failures: dict[int, dict]) -> KerasOrbaxError:
    """One error, the same on every process, naming each process that failed and why."""
    first = failures[min(failures)]
    error_type = getattr(errors, first["type"], KerasOrbaxError)
    if not (isinstance(error_type, type) and issubclass(error_type, KerasOrbaxError)):
        error_type = KerasOrbaxError
    lines = [f"'{name}' failed on {len(failures)} of {process_count()} processes:"]
    lines += [f"process {p}: {f['type']}: {f['message']}" for p, f in sorted(failures.items())]
    return error_type("\n".join(lines))
