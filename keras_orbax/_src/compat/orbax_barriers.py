"""Orbax's barriers around a save, bounded by keras-orbax's `KERAS_ORBAX_SYNC_TIMEOUT_S`: private
Orbax symbols, each wrapped with why no public API serves (the handler's own barriers are bounded in
`orbax_compat.pytree_handler_with_array_writer`).

Tested with orbax-checkpoint 0.12.8 (`versions.SUPPORTED`); each symbol is resolved on first use
and fails with one `UnsupportedVersionError` if moved; tests/test_versions.py resolves every one.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

from keras_orbax._src.compat.versions import Private, set_attribute

_V1 = "orbax.checkpoint.experimental.v1._src"
# Orbax's limit on its own barriers (`_DEFAULT_BARRIER_TIMEOUT`), one copy in v0's module and one
# in v1's; and v0's flag that makes its barriers take that limit at all.
_V0_MULTIHOST = Private("orbax-checkpoint", "orbax.checkpoint._src.multihost.multihost")
_V1_MULTIHOST = Private("orbax-checkpoint", f"{_V1}.synchronization.multihost")
_BARRIER_TIMEOUT = "_DEFAULT_BARRIER_TIMEOUT"
_DISTRIBUTED_BARRIER_FLAG = Private(
    "orbax-checkpoint",
    "orbax.checkpoint._src.multihost.multihost",
    "EXPERIMENTAL_ORBAX_USE_DISTRIBUTED_BARRIER",
)
# v1's `AsyncOptions.v0`, which its `training.Checkpointer` calls for the options of the v0
# `AsyncCheckpointer` it saves through; and v0's barrier there by default.
_ASYNC_OPTIONS_V0 = Private("orbax-checkpoint", f"{_V1}.context.options", "AsyncOptions.v0")
_GET_BARRIER_SYNC_FN = Private(
    "orbax-checkpoint", "orbax.checkpoint._src.multihost.multihost", "get_barrier_sync_fn"
)
# The `AsyncCheckpointer`'s two barriers after a save's commit futures, in its background thread
# (`_background_wait_for_commit_futures`): every process's writes done, then process 0's rename.
COMMIT_BARRIERS = ("async_write_complete", "async_commit_complete")
# The v0 `CheckpointManager`'s flag "a save is in progress" (`_save_progress_tracker`, a
# `MultihostSynchronizedValue`), set between two barriers at a save's start and at its end.
_PROGRESS_BARRIER = "ThreadSaveMultiHostValueHolder:set_value"


def set_barrier_timeout(timeout_s: float) -> None:
    """Makes each of Orbax's barriers that its caller gives no limit wait at most `timeout_s` for
    the other processes (rounded up to whole seconds, as Orbax takes them), process-wide.

    Why private: `ocp.training.Checkpointer.save_checkpointables_async` saves through Orbax's v0
    `CheckpointManager` and `AsyncCheckpointer`, whose barriers outside the handlers (the save's
    start, `CheckpointManager:save_start`; the temporary directory's creation,
    `_src.path.atomicity.create_all`; the manager's after a save or deletion) are v0's
    `multihost.sync_global_processes` with no `processes`: by default a collective over every
    device (`multihost_utils.sync_global_devices`), which ignores any limit and waits for a
    stalled process forever. Orbax's own flag `experimental_orbax_use_distributed_barrier` makes
    them the coordination service's barrier with a limit; the limit is
    `multihost.coordination_timeout()`, the module constant `_DEFAULT_BARRIER_TIMEOUT` (300 s, one
    copy in v0's module and one in v1's, read at each call): no option or context reaches either.
    Process-wide because each is one value: setting them around one save would race with a
    background save on another thread. These barriers only wait for the processes to arrive: the
    array writes happen inside the handler, bounded by `timeout_secs`
    (`pytree_handler_with_array_writer`).

    A flag the user set (on the command line, or by `parse`) is left as it is.
    """
    from absl import flags  # Orbax's dependency, which defines the flag

    seconds = max(1, math.ceil(timeout_s))
    for module in (_V0_MULTIHOST, _V1_MULTIHOST):
        set_attribute(module.get(), _BARRIER_TIMEOUT, seconds, "orbax-checkpoint")
    flag = flags.FLAGS[_DISTRIBUTED_BARRIER_FLAG.get().name]
    if not flag.present:
        # `parse` (not assignment): a flag read before absl parsed the command line raises
        # unless it is `present`, and Orbax then falls back to the collective.
        flag.parse(True)


def bound_commit_barriers(
    context: Any, bound_s: float, before_barrier: Callable[[str], None] | None = None
) -> None:
    """Makes the `AsyncCheckpointer`'s two barriers after the commit futures (`COMMIT_BARRIERS`),
    and the manager's around its flag "a save is in progress", wait at most `bound_s` for the
    other processes in a `training.Checkpointer` opened with `context` (an `ocp.Context`); calls
    `before_barrier(name)` before each of the first two (keras-orbax's fault points). Every other
    wait keeps Orbax's limits, and no other checkpointer is affected.

    Why private: the v1 `training.Checkpointer` saves through v0's `AsyncCheckpointer`, whose
    background thread, once the commit futures are done, waits at `async_write_complete`, lets
    process 0 finalize and rename the step, and waits at `async_commit_complete`, each for what
    remains of `timeout_secs` (20 minutes by default) from the thread's start. v0's
    `AsyncOptions.barrier_sync_fn` replaces that barrier's function (it is handed the limit), but
    v1's `AsyncOptions` has no such field and drops it in `v0()`, the conversion its
    `Checkpointer` calls: the context's options become a copy, of a subclass whose `v0()` adds it.
    The context holds them in `_async_options`: the public property has no setter, and passing
    them to `Context(...)` is deprecated (a warning logged at every save).

    Why this cannot cut a healthy write short: the commit futures include the `state` handler's
    (`pytree_handler_with_array_writer`), which returns only once every process has agreed that
    its writes ended (keras-orbax's agreement) and passed Orbax's two handler barriers after it.
    A process reaching `async_write_complete` therefore knows that every process has finished
    writing its arrays; what is left is the other checkpointables' small files (the metrics, the
    input position), written alongside, and process 0's step metadata and rename.

    The same function serves the v0 `CheckpointManager`'s flag "a save is in progress"
    (`MultihostSynchronizedValue`), set between two barriers (`ThreadSaveMultiHostValueHolder:
    set_value_start` and `_end`) that wait the whole `timeout_secs`: at a save's start, after its
    `CheckpointManager:save_start` barrier (bounded already, `set_barrier_timeout`), and at its
    end, in the manager's finalize thread once the `AsyncCheckpointer`'s thread is done, also
    after a failure (a `finally`); those are bounded the same way. (Orbax's finalize thread
    removes steps before it, but keras-orbax hands no preservation policy: it removes none.)

    The function is v0's default for a checkpointer whose `active_processes` is not set
    (keras-orbax never sets it): `multihost.get_barrier_sync_fn()`, the coordination service's
    barrier, which takes the limit it is handed.
    """
    _ASYNC_OPTIONS_V0.get()
    get_barrier_sync_fn = _GET_BARRIER_SYNC_FN.get()
    bound_ms = max(1000, math.ceil(bound_s * 1000))

    def barrier(*, key: str, timeout_ms: int) -> None:
        name = next((name for name in COMMIT_BARRIERS if name in key), None)
        if name is not None and before_barrier is not None:
            before_barrier(name)
        if name is not None or _PROGRESS_BARRIER in key:
            timeout_ms = min(timeout_ms, bound_ms)
        get_barrier_sync_fn()(key=key, timeout_ms=timeout_ms)

    options = context.async_options
    fields = {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}
    base: Any = type(options)
    bounded = _bounded_async_options(base)(barrier_sync_fn=barrier, **fields)
    set_attribute(context, "_async_options", bounded, "orbax-checkpoint")


@functools.cache
def _bounded_async_options(base: Any) -> Any:
    @dataclasses.dataclass(kw_only=True)
    class BoundedAsyncOptions(base):
        barrier_sync_fn: Callable[..., None] | None = None

        def v0(self) -> Any:
            return dataclasses.replace(super().v0(), barrier_sync_fn=self.barrier_sync_fn)

    return BoundedAsyncOptions
