"""Private Orbax, etils and JAX symbols, each wrapped with why no public API serves (Keras's are in
`_compat`).

Checked against orbax-checkpoint 0.12.8 and jax 0.10.2 (etils as Orbax installs it); the tests
exercise every one of them, so a symbol that moves fails the suite rather than a user.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def distributed_client() -> Any:
    """JAX's client of the coordination service that `jax.distributed.initialize` started.

    Why private: its key-value store (`key_value_set`, `blocking_key_value_get` with a timeout) is
    only reachable as `jax._src.distributed.global_state.client`; the public `multihost_utils`
    collectives have no timeout and hang when a process is gone.
    """
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("jax.distributed is not initialized, yet jax.process_count() > 1.")
    return client


def step_custom_metadata(step_dir: Any) -> dict[str, Any] | None:
    """The `custom_metadata` Orbax stored with one step, read from that step's metadata file alone.

    Why private: the public `ocp.checkpointables_metadata` also loads the tree metadata of every
    array (about 1 s for 1,500 variables); Orbax's own step-metadata store reads just the JSON file.
    """
    from orbax.checkpoint._src.metadata import checkpoint

    store = checkpoint.metadata_store(enable_write=False)
    serialized = store.read(checkpoint.step_metadata_file_path(step_dir))
    return None if serialized is None else serialized.get("custom_metadata")


def step_metadata_file(step_dir: Any) -> Any:
    """The file `step_custom_metadata` reads (a `pathlib.Path`, or an `epath.Path` in object
    storage). Why private: see `step_custom_metadata`; named in errors about a missing or damaged
    step record."""
    from orbax.checkpoint._src.metadata import checkpoint

    path = checkpoint.step_metadata_file_path(step_dir)
    return path if "://" in str(path) else Path(path)


def step_metrics(step_dir: Any) -> dict[str, Any]:
    """The metrics Orbax stored with one step (`save(..., metrics=logs)`).

    Why private: Orbax's v1 `training.Checkpointer` writes them as the step's `metrics` item, a JSON
    file `metrics/metrics` (what its `CheckpointManager._get_metrics` reads back), and leaves the
    `metrics` field of the step metadata file empty; the public way to read them
    (`Checkpointer(root).checkpoints`) opens the root and loads the tree metadata of every step.
    Steps that Orbax wrote the other way keep them in that field, read second.
    """
    import json

    from orbax.checkpoint import checkpoint_manager
    from orbax.checkpoint._src.metadata import checkpoint

    item = step_dir / checkpoint_manager.METRIC_ITEM_NAME / checkpoint_manager.METRIC_ITEM_NAME
    if item.is_file():
        return dict(json.loads(item.read_text()) or {})
    store = checkpoint.metadata_store(enable_write=False)
    serialized = store.read(checkpoint.step_metadata_file_path(step_dir))
    return dict((serialized or {}).get("metrics") or {})


def epath_forget_tensorflow() -> None:
    """Makes `etils.epath` read `EPATH_USE_TF` again for object-store paths.

    Why private: epath decides once per process (`gpath._is_tf_installed`, a `functools.cache`)
    whether to send `gs://` and `s3://` to TensorFlow; a path used before keras-orbax set
    `EPATH_USE_TF=false` would keep TensorFlow's file system, which has no `s3` and ignores
    `STORAGE_EMULATOR_HOST`.
    """
    from etils.epath import gpath

    if gpath._is_tf_installed.cache_info().currsize and not gpath._epath_use_tf():
        gpath._is_tf_installed.cache_clear()


def pytree_handler_with_array_writer(leaf_handler: type) -> type:
    """Orbax's `PyTreeHandler`, saving every `jax.Array` leaf with `leaf_handler` instead of Orbax's.

    Why private: Orbax registers checkpointable handlers by class and records the class's dotted name
    in the step's metadata (`item_handlers`); plain `ocp.load` resolves the handler from that name.
    The subclass only swaps the leaf-handler registry (a constructor argument Orbax offers but the
    registry cannot pass) and keeps `PyTreeHandler`'s recorded name, because what it writes is
    exactly `PyTreeHandler`'s layout: plain Orbax then loads it with no warning. `leaf_handler` is
    registered for `jax.Array` under Orbax's own type name `"jax.Array"` (the `value_type` in
    `_METADATA`), so the tree metadata is unchanged too.
    """
    import jax
    from orbax.checkpoint.experimental.v1._src.handlers.pytree_handler import PyTreeHandler
    from orbax.checkpoint.experimental.v1._src.serialization import registry

    class Handler(PyTreeHandler):
        def __init__(self, **kwargs: Any) -> None:
            leaves = registry.BaseLeafHandlerRegistry()
            for (
                leaf,
                abstract,
                typestrs,
                handler,
            ) in registry.STANDARD_TYPE_AND_ABSTRACT_TYPE_AND_TYPESTR_TO_HANDLER:
                if leaf is jax.Array:
                    handler = leaf_handler
                leaves.add(leaf, abstract, handler, secondary_typestrs=typestrs)
            super().__init__(leaf_handler_registry=leaves, **kwargs)

    Handler.__module__ = PyTreeHandler.__module__
    Handler.__qualname__ = Handler.__name__ = PyTreeHandler.__qualname__
    return Handler


def array_leaf_handler() -> type:
    """Orbax's v1 `ArrayLeafHandler`, the base of our array writer (it keeps Orbax's reading).

    Why private: the v1 leaf-handler classes are not exported yet in orbax-checkpoint 0.12.
    """
    from orbax.checkpoint.experimental.v1._src.serialization.array_leaf_handler import (
        ArrayLeafHandler,
    )

    return ArrayLeafHandler


def serialized_sharding(sharding: Any) -> str | None:
    """The string Orbax stores for `sharding` in a step's `_sharding` file (None: not storable).

    Why private: Orbax's sharding-metadata serializer is internal; the `_sharding` file is what
    plain `ocp.load` reads to restore arrays onto their saved shardings.
    """
    from orbax.checkpoint._src.metadata import sharding as sharding_metadata

    metadata = sharding_metadata.from_jax_sharding(sharding)
    return None if metadata is None else metadata.to_serialized_string()


def put_on_devices(target: Any, values: list[Any], devices: list[Any]) -> Any:
    """The `jax.Array` of shape, dtype and sharding `target` whose shard on `devices[i]` is
    `values[i]` (host arrays of the shard's shape and the target's dtype; the CPU backend adopts
    a 64-byte-aligned one without a copy). What `jax.make_array_from_callback` ends in.

    Why private: the public call wraps each shard in a Python callback, canonicalizes and checks
    it and builds the abstract value around the same `pxla.batched_device_put`; with thousands of
    small arrays that is most of placing them (5000 arrays, 12,500 regions: 0.11-0.15 s this way,
    0.16-0.22 s through the public call).
    """
    from jax._src import core
    from jax._src.interpreters import pxla

    aval = core.update_aval_with_sharding(
        core.ShapedArray(target.shape, target.dtype), target.sharding
    )
    return pxla.batched_device_put(aval, target.sharding, values, devices)
