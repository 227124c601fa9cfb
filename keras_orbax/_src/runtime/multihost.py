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
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import numpy as np
from jax.experimental import multihost_utils

from keras_orbax import errors
from keras_orbax._src.compat import orbax_barriers, orbax_compat
from keras_orbax._src.runtime import io_faults
from keras_orbax.errors import KerasOrbaxError, ProcessSyncError

T = TypeVar("T")
DEFAULT_TIMEOUT_S = float(os.environ.get("KERAS_ORBAX_SYNC_TIMEOUT_S", "300"))
_calls = itertools.count()
_agreed: weakref.WeakSet[BaseException] = weakref.WeakSet()  # raised by `agree`: reported already
_published: list[str] = []  # keys this process set that another process may still have to read


def _client() -> Any:
    """JAX's coordination-service client, once Orbax's own barriers follow keras-orbax's limit
    (`orbax_barriers_follow`): every collective call of keras-orbax (a save's, a restore's) gets
    its client here before it reaches any barrier of Orbax's."""
    orbax_barriers_follow()
    return orbax_compat.distributed_client()


def orbax_barriers_follow() -> None:
    """Makes Orbax's barriers outside keras-orbax's handler wait at most `DEFAULT_TIMEOUT_S`
    (`KERAS_ORBAX_SYNC_TIMEOUT_S`) for a process that does not arrive, under `jax.distributed`
    (`orbax_barriers.set_barrier_timeout`).

    Process-wide, for every Orbax call of the process (Keras's `OrbaxCheckpoint` too): Orbax keeps
    one constant and one flag. Also without the variable: Orbax's default barrier is a collective
    over every device, without any limit.
    """
    if _followed or process_count() == 1:
        return
    with _following:  # Orbax's background thread makes collective calls too
        if not _followed:
            orbax_barriers.set_barrier_timeout(DEFAULT_TIMEOUT_S)
            _followed.append(True)


_followed: list[bool] = []  # set once: `DEFAULT_TIMEOUT_S` never changes
_following = threading.Lock()


def process_count() -> int:
    return jax.process_count()


def process_index() -> int:
    return jax.process_index()


def is_primary() -> bool:
    """True on the process that prints and writes shared files (process 0)."""
    return jax.process_index() == 0


# What a process that stops waiting for the others has left as it was, by what they were doing.
NOTHING_RESTORED = "no variable was modified here"
NOTHING_EXPORTED = "the export is abandoned, and no complete file is left at the destination"


def primary_decision(decision: bool) -> bool:
    """Process 0's decision, on every process, so that all enter a collective save together."""
    if process_count() == 1:
        return decision
    return bool(multihost_utils.broadcast_one_to_all(np.int32(decision)))


def agree(
    name: str,
    error: BaseException | None,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    unchanged: str = NOTHING_RESTORED,
    fallback: type[KerasOrbaxError] = KerasOrbaxError,
) -> None:
    """Every process reports how its part of `name` went; all raise if any failed.

    Single-process: re-raises `error` if given. Multi-process: each process publishes its outcome
    under a key unique to this call, then waits for every other process's, all within one deadline
    `timeout_s` from now.

    Raises:
        The failing process's error type (from `keras_orbax.errors`; `fallback` for another
        library's, an `OSError` say), with a message that names
        each failed process and its details (a mismatch's `problems` too), on every process;
        `ProcessSyncError` naming the processes that did not report in time, and ending with
        `unchanged`: what this process left as it was.
    """
    if process_count() == 1:
        if error is not None:
            raise error
        return
    client = _client()
    key = f"keras_orbax/{name}/{next(_calls)}"
    me = jax.process_index()
    _publish(client, f"{key}/{me}", json.dumps(_outcome(error)))
    deadline = time.monotonic() + timeout_s
    failures, missing = {}, []
    for process in range(process_count()):
        found = _get(client, f"{key}/{process}", deadline)
        if found is None:
            missing.append(process)
        elif not found["ok"]:
            failures[process] = found
    if not missing:
        _delete_earlier(client, f"{key}/{me}")
    if missing:
        late = ProcessSyncError(
            f"Processes {missing} did not reach '{name}' within {timeout_s:.0f} s (this is process "
            f"{me}). They may have crashed or be stuck; {unchanged}."
        )
        raise _mark(late) from error
    if failures:
        raise _mark(_combined(name, failures, fallback)) from error


def agree_on_outcome(
    name: str,
    round_key: str,
    error: BaseException | None,
    *,
    wait_s: float | None = None,
    fallback: type[KerasOrbaxError] = errors.SaveFailedError,
) -> None:
    """`gather_outcomes` without a value: returns only if every process's part succeeded."""
    gather_outcomes(name, round_key, error, wait_s=wait_s, fallback=fallback)


def gather_outcomes(
    name: str,
    round_key: str,
    error: BaseException | None,
    value: Any = None,
    *,
    wait_s: float | None = None,
    fallback: type[KerasOrbaxError] = errors.SaveFailedError,
    every_report: bool = False,
) -> list[Any]:
    """Every process's outcome of its part of a write: its JSON-safe `value` (what it wrote, say),
    by process index, on every process; or, if any failed, the same error on every process.

    The one wait on the others that every writer's commit goes through (a step's, an export's).
    A failure is raised on every process as soon as it has ended its own part, while processes
    that are merely slower are waited for up to `wait_s` (the write's own time limit; None: without
    limit). Safe from a background thread: the keys are named by `round_key` (the same on every
    process, e.g. Orbax's operation id, or `next_round` of a collective call), not by the order of
    this process's collective calls. `every_report`: a failure is raised only once every process
    has reported (or `wait_s` has passed), so every process raises the very same error; else as
    soon as one is seen, not waiting for a slow process (a step's write can take minutes).

    Raises:
        `fallback` (or the failing process's keras-orbax error type) naming each process that
        failed and its error, at once on a process that failed and on every other one once it
        has ended its own part; `ProcessSyncError`: a process did not report within `wait_s`.
    """
    if process_count() == 1:
        if error is not None:
            raise error
        return [value]
    client = _client()
    prefix = f"keras_orbax/outcome/{round_key}"
    me = jax.process_index()
    mine = _outcome(error) if error is not None else {"ok": True, "value": value}
    client.key_value_set(f"{prefix}/{me}", json.dumps(mine))
    _outcome_keys.append(f"{prefix}/{me}")
    deadline = None if wait_s is None else time.monotonic() + wait_s
    while True:
        found = {
            int(k.rsplit("/", 1)[1]): json.loads(v)
            for k, v in client.key_value_dir_get(f"{prefix}/")
        }
        failures = {p: f for p, f in found.items() if not f["ok"]}
        missing = [p for p in range(process_count()) if p not in found]
        if failures and (not every_report or not missing):
            raise _mark(_combined(name, failures, fallback)) from error
        if not missing:
            _forget_outcomes(client, f"{prefix}/{me}")
            return [found[p].get("value") for p in range(process_count())]
        if deadline is not None and time.monotonic() > deadline:
            raise _mark(
                ProcessSyncError(
                    f"Processes {missing} did not reach '{name}' within {wait_s:.0f} s (this is "
                    f"process {me}). They may have crashed or be stuck; nothing was committed."
                )
            )
        time.sleep(_POLL_S)


def next_round(name: str) -> str:
    """A `gather_outcomes` round key for a call every process makes in the same order (the main
    thread's collective calls)."""
    return f"{name}/{next(_calls)}"


_POLL_S = 0.05
_outcome_keys: list[str] = []  # `agree_on_outcome`'s keys this process set, deleted a round later


def _forget_outcomes(client: Any, current: str) -> None:
    """Deletes this process's outcome keys of earlier rounds: every process has read them, since
    every process reported this round, which each enters only after ending the last."""
    earlier, _outcome_keys[:] = [k for k in _outcome_keys if k != current], [current]
    for key in earlier:
        try:
            client.key_value_delete(key)
        except Exception:  # the service going away: nothing left to free
            return


def _mark(error: KerasOrbaxError) -> KerasOrbaxError:
    """`error`, noted as the outcome of an `agree`, which every process that got there raises."""
    _agreed.add(error)
    return error


def primary_value(name: str, fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` as process 0 computes it, on every process (or its error, raised everywhere).

    What process 0 decides (e.g. which step of a shared directory to restore) is what every process
    does, even if the others would see the directory differently. The value must be JSON-safe.
    """
    if process_count() == 1:
        return fn(*args)
    client = _client()
    key = f"keras_orbax/{name}/{next(_calls)}/decision"
    if jax.process_index() == 0:
        try:
            value = fn(*args)
        except Exception as error:  # published to every process, then raised here too
            _publish(client, key, json.dumps(_outcome(error)))
            raise
        _publish(client, key, json.dumps({"ok": True, "value": value}))
        return value
    found = _get(client, key, time.monotonic() + DEFAULT_TIMEOUT_S)
    if found is None:
        raise ProcessSyncError(
            f"Process 0 did not decide '{name}' within {DEFAULT_TIMEOUT_S:.0f} s (this is process "
            f"{jax.process_index()}). It may have crashed or be stuck; nothing was modified here."
        )
    if not found["ok"]:
        raise _combined(name, {0: found})
    return found["value"]


def gather(name: str, value: Any) -> list[Any]:
    """Every process's JSON-safe `value`, by process index, on every process (e.g. the arguments
    each was given for a collective call, to compare).

    Raises:
        ProcessSyncError: a process did not give its value within the timeout.
    """
    if process_count() == 1:
        return [value]
    client = _client()
    key = f"keras_orbax/{name}/{next(_calls)}/gathered"
    mine = f"{key}/{jax.process_index()}"
    _publish(client, mine, json.dumps({"value": value}))
    deadline = time.monotonic() + DEFAULT_TIMEOUT_S
    found = [_get(client, f"{key}/{process}", deadline) for process in range(process_count())]
    missing = [process for process, got in enumerate(found) if got is None]
    if not missing:
        _delete_earlier(client, mine)
    if missing:
        raise ProcessSyncError(
            f"Processes {missing} did not reach '{name}' within {DEFAULT_TIMEOUT_S:.0f} s (this "
            f"is process {jax.process_index()}). They may have crashed or be stuck."
        )
    return [got["value"] for got in found if got is not None]


def same_arguments(verb: str, **arguments: Any) -> None:
    """Raises on every process unless every process gave `verb` the same `arguments`: a
    collective write given another directory or step elsewhere would wait in Orbax's barriers.

    Raises:
        ProcessSyncError: they differ; the message lists each process's.
    """
    given = gather(f"{verb}/arguments", arguments)  # JSON-safe: paths as strings, steps as ints
    if all(g == given[0] for g in given):
        return
    each = "; ".join(
        f"process {p}: " + ", ".join(f"{k}={v!r}" for k, v in g.items())
        for p, g in enumerate(given)
    )
    raise ProcessSyncError(
        f"{verb} was given other arguments on other processes ({each}). Every process writes its "
        "part of one step into one directory: pass each the same. Nothing was written."
    )


def _publish(client: Any, key: str, value: str) -> None:
    client.key_value_set(key, value)
    _published.append(key)


def _delete_earlier(client: Any, current: str) -> None:
    """Deletes the keys this process set before `current`, once every process has set its key of
    the round that `current` belongs to: each process takes part in the collective calls one at
    a time, in the same order, so each has read every key of the rounds before. The
    coordination service keeps a key until it is deleted; a long job would otherwise pile up
    several per save and restore."""
    earlier = [key for key in _published if key != current]
    _published[:] = [current]
    for key in earlier:
        try:
            client.key_value_delete(key)
        except Exception:  # the service going away: nothing left to free
            return


def _outcome(error: BaseException | None) -> dict[str, Any]:
    if error is None:
        return {"ok": True}
    return {
        "ok": False,
        "type": type(error).__name__,
        "message": str(error),
        "problems": list(getattr(error, "problems", ())),
        "errno": io_faults.io_errno(error),  # whether to retry: every process decides alike
    }


def _get(client: Any, key: str, deadline: float) -> dict[str, Any] | None:
    """The JSON value under `key`, waiting until `deadline` at most; None if it never came."""
    remaining_ms = max(1, int((deadline - time.monotonic()) * 1000))
    try:
        return json.loads(client.blocking_key_value_get(key, remaining_ms))
    except Exception:  # the coordination service reports a timeout as a generic error
        return None


def run_collectively(
    name: str,
    fn: Callable[..., T],
    *args: Any,
    unchanged: str = NOTHING_RESTORED,
    fallback: type[KerasOrbaxError] = KerasOrbaxError,
) -> T:
    """Runs `fn(*args)` on this process, then `agree`s (`unchanged` as there): returns only if it
    succeeded everywhere.

    An error that `fn` got from an `agree` of its own is raised as it is: the processes have
    reported already.
    """
    try:
        result = fn(*args)
    except Exception as error:  # reported to every process by `agree`, which re-raises
        if error in _agreed:
            raise
        agree(name, error, unchanged=unchanged, fallback=fallback)
        raise
    agree(name, None, unchanged=unchanged, fallback=fallback)
    return result


def _combined(
    name: str, failures: dict[int, dict], fallback: type[KerasOrbaxError] = KerasOrbaxError
) -> KerasOrbaxError:
    """One error, the same on every process, naming each process that failed and why."""
    first = failures[min(failures)]
    error_type = getattr(errors, first["type"], fallback)
    if not (isinstance(error_type, type) and issubclass(error_type, KerasOrbaxError)):
        error_type = fallback
    lines = [f"'{name}' failed on {len(failures)} of {process_count()} processes:"]
    lines += [f"process {p}: {f['type']}: {f['message']}" for p, f in sorted(failures.items())]
    message = "\n".join(lines)
    if issubclass(error_type, errors.CheckpointMismatchError):
        problems = [p for f in failures.values() for p in f.get("problems", ())]
        return error_type(message, list(dict.fromkeys(problems)))
    combined = error_type(message)
    code = first.get("errno")
    if isinstance(combined, OSError) and code is not None:
        combined.errno = code  # an I/O error is one everywhere (`io_faults.io_errno`)
    return combined
