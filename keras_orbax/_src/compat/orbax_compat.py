"""Private Orbax, etils and JAX symbols, each wrapped with why no public API serves (Keras's are in
`keras_compat`).

Tested with orbax-checkpoint 0.12.8, jax 0.10.2 and etils 1.15.0 (`versions.SUPPORTED`). Each is
resolved on first use (importing Orbax is left to the verbs that need it) and fails with one
`UnsupportedVersionError` if moved; tests/test_versions.py resolves every one.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from keras_orbax._src.compat.versions import Private, attribute
from keras_orbax.errors import UnsupportedVersionError

_DISTRIBUTED_STATE = Private("jax", "jax._src.distributed", "global_state")
# Orbax's names in a step directory: the step metadata file (its
# `_src.metadata.checkpoint._STEP_METADATA_FILENAME`), and the item and file of the metrics its v1
# `training.Checkpointer` saves (`checkpoint_manager.METRIC_ITEM_NAME`, twice).
STEP_METADATA_FILE = "_CHECKPOINT_METADATA"
_METRICS_FILE = ("metrics", "metrics")
_IS_TF_INSTALLED = Private("etils", "etils.epath.gpath", "_is_tf_installed")
_EPATH_USE_TF = Private("etils", "etils.epath.gpath", "_epath_use_tf")
_V1 = "orbax.checkpoint.experimental.v1._src"
_LEAF_REGISTRY = Private(
    "orbax-checkpoint", f"{_V1}.serialization.registry", "BaseLeafHandlerRegistry"
)
_STANDARD_LEAF_HANDLERS = Private(
    "orbax-checkpoint",
    f"{_V1}.serialization.registry",
    "STANDARD_TYPE_AND_ABSTRACT_TYPE_AND_TYPESTR_TO_HANDLER",
)
_ARRAY_LEAF_HANDLER = Private(
    "orbax-checkpoint", f"{_V1}.serialization.array_leaf_handler", "ArrayLeafHandler"
)
_ARRAY_LEAF_HANDLER_SERIALIZE = Private(
    "orbax-checkpoint", f"{_V1}.serialization.array_leaf_handler", "ArrayLeafHandler.serialize"
)
# Orbax's wait for a pytree's write futures, the step before its commit barrier.
_ASYNC_FUTURES = Private(
    "orbax-checkpoint", f"{_V1}.synchronization.compatibility", "async_futures"
)
_BACKGROUND_SAVE = Private(
    "orbax-checkpoint", f"{_V1}.handlers.pytree_handler", "PyTreeHandler._background_save"
)
_SHARDING_METADATA = Private(
    "orbax-checkpoint", "orbax.checkpoint._src.metadata.sharding", "from_jax_sharding"
)
_UPDATE_AVAL = Private("jax", "jax._src.core", "update_aval_with_sharding")
_BATCHED_DEVICE_PUT = Private("jax", "jax._src.interpreters.pxla", "batched_device_put")


def distributed_client() -> Any:
    """JAX's client of the coordination service that `jax.distributed.initialize` started.

    Why private: its key-value store (`key_value_set`, `blocking_key_value_get` with a timeout) is
    only reachable as `jax._src.distributed.global_state.client`; the public `multihost_utils`
    collectives have no timeout and hang when a process is gone.
    """
    client = attribute(_DISTRIBUTED_STATE.get(), "client", "jax")
    if client is None:
        raise RuntimeError("jax.distributed is not initialized, yet jax.process_count() > 1.")
    return client


def step_custom_metadata(step_dir: Any) -> dict[str, Any] | None:
    """The `custom_metadata` Orbax stored with one step, read from that step's metadata file alone
    (None where the file is missing or not JSON, as Orbax's reader has it).

    Why not Orbax: the public `ocp.checkpointables_metadata` also loads the tree metadata of every
    array (about 1 s for 1,500 variables). Orbax's own step-metadata store (private) reads just the
    JSON file, which is what `_step_metadata` does, without importing Orbax: `keras-orbax inspect`
    stays free of JAX, Orbax and tensorstore.
    """
    return _step_metadata(step_dir).get("custom_metadata")


def step_metadata_file(step_dir: Any) -> Any:
    """The file `step_custom_metadata` reads (a `pathlib.Path`, or an `epath.Path` in object
    storage); named in errors about a missing or damaged step record."""
    if "://" not in str(step_dir):
        return Path(step_dir) / STEP_METADATA_FILE
    from etils import epath  # what Orbax reads object storage with

    return epath.Path(step_dir) / STEP_METADATA_FILE


def step_metrics(step_dir: Any) -> dict[str, Any]:
    """The metrics Orbax stored with one step (`save(..., metrics=logs)`).

    Why not Orbax: its v1 `training.Checkpointer` writes them as the step's `metrics` item, a JSON
    file `metrics/metrics` (what its `CheckpointManager._get_metrics`, private, reads back), and
    leaves the `metrics` field of the step metadata file empty; the public way to read them
    (`Checkpointer(root).checkpoints`) opens the root and loads the tree metadata of every step.
    Steps that Orbax wrote the other way keep them in that field, read second.
    """
    item = step_dir.joinpath(*_METRICS_FILE)
    if item.is_file():
        return dict(json.loads(item.read_text()) or {})
    return dict(_step_metadata(step_dir).get("metrics") or {})


def _step_metadata(step_dir: Any) -> dict[str, Any]:
    """The step metadata file's JSON, read as Orbax's `metadata_store(enable_write=False).read`
    reads it (`_src.metadata.checkpoint`): missing, unreadable or not JSON reads as nothing."""
    try:
        serialized = json.loads(step_metadata_file(step_dir).read_text())
    except (OSError, ValueError, RecursionError):  # RecursionError: JSON nested too deep
        return {}
    return serialized if isinstance(serialized, dict) else {}


def epath_forget_tensorflow() -> None:
    """Makes `etils.epath` read `EPATH_USE_TF` again for object-store paths.

    Why private: epath decides once per process (`gpath._is_tf_installed`, a `functools.cache`)
    whether to send `gs://` and `s3://` to TensorFlow; a path used before keras-orbax set
    `EPATH_USE_TF=false` would keep TensorFlow's file system, which has no `s3` and ignores
    `STORAGE_EMULATOR_HOST`.
    """
    is_tf_installed = _IS_TF_INSTALLED.get()
    if is_tf_installed.cache_info().currsize and not _EPATH_USE_TF.get()():
        is_tf_installed.cache_clear()


# `before_commit(directory, operation_id, error, wait_s)`: called once this process's writes of
# a pytree into `directory` have ended (`error` None if they succeeded), before Orbax's commit
# barrier; raises to abandon.
BeforeCommit = Callable[[Any, str, "BaseException | None", "float | None"], None]


def pytree_handler_with_array_writer(
    leaf_handler: type,
    before_commit: BeforeCommit | None = None,
    after_agreement_s: float | None = None,
    after_finalize: Callable[[Any], None] | None = None,
) -> type:
    """Orbax's `PyTreeHandler`, saving every `jax.Array` leaf with `leaf_handler` instead of Orbax's,
    and calling `before_commit` between this process's writes and Orbax's commit barrier.

    Why private: Orbax registers checkpointable handlers by class and records the class's dotted name
    in the step's metadata (`item_handlers`); plain `ocp.load` resolves the handler from that name.
    The subclass only swaps the leaf-handler registry (a constructor argument Orbax offers but the
    registry cannot pass) and keeps `PyTreeHandler`'s recorded name, because what it writes is
    exactly `PyTreeHandler`'s layout: plain Orbax then loads it with no warning. `leaf_handler` is
    registered for `jax.Array` under Orbax's own type name `"jax.Array"` (the `value_type` in
    `_METADATA`), so the tree metadata is unchanged too.

    Why `_background_save` is overridden: it waits for the write futures and then enters a barrier
    across processes (`..._commit_complete`) with no hook between; a process whose write failed
    never reaches the barrier, and the others wait there up to Orbax's `timeout_secs`, which bounds
    the whole write (20 minutes by default). The override waits for the futures itself, hands the
    outcome to `before_commit` (keras-orbax's own agreement, which raises on every process if any
    failed), and only then runs Orbax's barrier and finalize, with no futures left to wait for.

    `after_agreement_s` (keras-orbax's `KERAS_ORBAX_SYNC_TIMEOUT_S`) bounds what follows the
    agreement: Orbax's two barriers and its finalize. Orbax measures both barriers' limits from the
    start of the write (`timeout_secs - (now - start_time)`, its private `_get_remaining_timeout`),
    so a process that fails after agreeing (its metadata write, a kill) would leave the others in
    the barrier for what remains of `timeout_secs` (20 minutes by default). Lowering `timeout_secs`
    itself would also cut short slow but healthy writes, so the override hands Orbax a start time
    moved back instead: the same limit, measured from the agreement, at most `after_agreement_s`.

    Why `_finalize` is overridden: it is where process 0 merges the processes' OCDBT databases
    (the compact format) into the step's own, after which none of its files changes; Orbax has no
    hook there, and `after_finalize(directory)` (on every process, before Orbax's barrier that
    ends the finalize and before the step's rename) records their checksums, so they commit with
    the step.
    """
    import jax
    from orbax.checkpoint.experimental.v1.handlers import PyTreeHandler

    registry, standard = _LEAF_REGISTRY.get(), _STANDARD_LEAF_HANDLERS.get()
    async_futures = _ASYNC_FUTURES.get()
    _BACKGROUND_SAVE.get()

    class Handler(PyTreeHandler):
        def __init__(self, **kwargs: Any) -> None:
            leaves = registry()
            for leaf, abstract, typestrs, handler in standard:
                if leaf is jax.Array:
                    handler = leaf_handler
                leaves.add(leaf, abstract, handler, secondary_typestrs=typestrs)
            super().__init__(leaf_handler_registry=leaves, **kwargs)

        async def _background_save(
            self, directory: Any, *, commit_futures: Any, operation_id: str, start_time: float
        ) -> None:
            if before_commit is not None:
                timeout_s = self._context.async_options.timeout_secs
                error = None
                try:
                    await async_futures(
                        commit_futures,
                        timeout_secs=timeout_s,
                        start_time=start_time,
                        operation_name="PyTreeHandler._async_futures",
                        re_raise_cancelled=True,
                    )
                except Exception as failed:  # handed to `before_commit`, which raises it
                    error = failed
                left = None if timeout_s is None else timeout_s - (time.time() - start_time)
                path = directory.path
                await asyncio.to_thread(before_commit, path, operation_id, error, left)
                if error is not None:  # `before_commit` must not let a failed write commit
                    raise error
                commit_futures = []
                now = time.time()
                remaining = None if timeout_s is None else timeout_s - (now - start_time)
                if after_agreement_s is not None and remaining is not None and remaining > 0:
                    bound = max(1.0, min(remaining, after_agreement_s))
                    start_time = now - (timeout_s - bound)
            await super()._background_save(
                directory,
                commit_futures=commit_futures,
                operation_id=operation_id,
                start_time=start_time,
            )

        async def _finalize(self, directory: Any) -> None:
            await super()._finalize(directory)
            if after_finalize is not None:
                await asyncio.to_thread(after_finalize, directory)

    Handler.__module__ = PyTreeHandler.__module__
    Handler.__qualname__ = Handler.__name__ = PyTreeHandler.__qualname__
    return Handler


def array_leaf_handler() -> type:
    """Orbax's v1 `ArrayLeafHandler`, the base of our array writer (it keeps Orbax's reading).

    Why private: the v1 leaf-handler classes are not exported yet in orbax-checkpoint 0.12.
    """
    _ARRAY_LEAF_HANDLER_SERIALIZE.get()  # overridden by keras-orbax's writers
    return _ARRAY_LEAF_HANDLER.get()


def serialized_sharding(sharding: Any) -> str | None:
    """The string Orbax stores for `sharding` in a step's `_sharding` file (None: not storable).

    Why private: Orbax's sharding-metadata serializer is internal; the `_sharding` file is what
    plain `ocp.load` reads to restore arrays onto their saved shardings.
    """
    metadata = _SHARDING_METADATA.get()(sharding)
    return None if metadata is None else metadata.to_serialized_string()


def put_on_devices(target: Any, values: list[Any], devices: list[Any]) -> Any:
    """The `jax.Array` of shape, dtype and sharding `target` whose shard on `devices[i]` is
    `values[i]` (host arrays of the shard's shape and the target's dtype; the CPU backend adopts
    a 64-byte-aligned one without a copy). What `jax.make_array_from_callback` ends in.

    Why private: the public call wraps each shard in a Python callback, canonicalizes and checks
    it and builds the abstract value around the same `pxla.batched_device_put`; with thousands of
    small arrays that is most of placing them (5000 arrays, 12,500 regions: 0.11-0.15 s this way,
    0.16-0.22 s through the public call). Where JAX has moved them, `put_on_devices_public` does
    the same through the public API, only slower: no error over a speed-up.
    """
    fast = _fast_device_put()
    if fast is None:
        return put_on_devices_public(target, values, devices)
    update_aval, batched_device_put = fast
    import jax

    aval = update_aval(jax.core.ShapedArray(target.shape, target.dtype), target.sharding)
    return batched_device_put(aval, target.sharding, values, devices)


def put_on_devices_public(target: Any, values: list[Any], devices: list[Any]) -> Any:
    """`put_on_devices` through JAX's public API."""
    import jax

    shards = [jax.device_put(value, device) for value, device in zip(values, devices, strict=True)]
    return jax.make_array_from_single_device_arrays(target.shape, target.sharding, shards)


@functools.cache
def _fast_device_put() -> tuple[Any, Any] | None:
    try:
        return _UPDATE_AVAL.get(), _BATCHED_DEVICE_PUT.get()
    except UnsupportedVersionError:
        return None
