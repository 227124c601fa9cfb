"""`restore_sharded`: validate the whole plan, read every shard onto its device, assign all or nothing."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence

import jax
import keras

from keras_orbax._src.compat import keras_compat
from keras_orbax._src.format.own_state import OwnState
from keras_orbax._src.model import deferred, keras_walk, matching, state_keys
from keras_orbax._src.model.matching import counted, listed
from keras_orbax._src.model.state_keys import OPTIMIZER
from keras_orbax._src.read import replicas, sharded_read
from keras_orbax._src.restore import notices, process_tier
from keras_orbax._src.restore.checked_reads import checked_reads, unverified_keys
from keras_orbax._src.restore.replicated import replicated_message
from keras_orbax._src.restore.result import RestoreResult
from keras_orbax._src.runtime import gc_pause, multihost
from keras_orbax._src.sources import resolve
from keras_orbax._src.sources.base import Prepared, Source
from keras_orbax._src.storage import locations
from keras_orbax.errors import CheckpointMismatchError, CorruptCheckpointError

__all__ = ["RestoreResult", "restore_sharded", "restore_source"]


@gc_pause.paused()
def restore_sharded(
    model: keras.Model,
    directory: str | os.PathLike,
    step: int | None = None,
    *,
    strict: bool = True,
    verify: bool | None = None,
    read_window_bytes: int | None = None,
    single_replica_reads: bool | None = None,
    verbose: int = 0,
) -> RestoreResult:
    """Restores `model` from a checkpoint, each shard read straight onto its device.

    Call on every process. Each process reads only the shards its devices own under the active
    `keras.distribution` (`ModelParallel`, `DataParallel`, or none: one device), whatever mesh the
    checkpoint was saved on. Floats are cast shard by shard where the model's dtype differs. The
    whole checkpoint is checked against the model first; either every variable is restored or
    none is changed.

    Args:
        model: A model built normally or under `keras_orbax.deferred_init()`. If it has an optimizer
            that is not built yet, it is built so that its state can be restored.
        directory: Where the state is: the root given to `save` or to the `ModelCheckpoint`
            callback, or one of its steps (`ckpt/8`, `ckpt@8`); a directory written by
            `keras.callbacks.OrbaxCheckpoint`; a `.weights.h5`, `.weights.json` or `.keras` file;
            a keras-hub preset or a Hugging Face model directory. Relative, `~`, `gs://`, `s3://`.
            Also a `ModelCheckpoint`'s `local_directory` written under `jax.distributed`, each
            process passing its own: its part of the step is read there, or received from the
            process that keeps its replica; the model must be built, on the mesh the step was
            saved from, and each part is checked whole (`strict=False` is refused; the read
            options do not apply).
        step: The step to restore; `None` means the latest committed one (or the one named by
            `directory`).
        strict: If False, restore what matches: variables the checkpoint lacks or holds with another
            shape or dtype keep their values (deferred ones are initialized), and checkpoint
            entries the model lacks are ignored. `RestoreResult.skipped` lists them, and a
            `KerasOrbaxWarning` names the model's by Keras path.
        verify: Check every byte read against the checksum recorded when it was written (the
            fast format's CRC of each shard file, in the threads that read, over the bytes just
            read, nothing read twice; a compact step's OCDBT files and a keras-orbax Hugging Face
            export's tensors, each read whole before the restore reads them); a file that fails
            raises `CorruptCheckpointError` naming the file and the array, and no variable is
            changed. `None` (default) checks so and says nothing of what it could not check
            (`RestoreResult.unverified` lists it: a source that records no checksums, such as
            Keras files, other Hugging Face directories and Keras's `OrbaxCheckpoint` steps; a
            compact step saved before its files' checksums; a file this process reads only part
            of). `True` also reads such partly read files back whole, and warns
            (`KerasOrbaxWarning`) naming what records no checksum. `False` checks nothing.
        read_window_bytes: Host memory for regions read ahead of being placed on their devices;
            default 512 MiB or the largest region, whichever is larger.
        single_replica_reads: Where several processes hold replicas of a region (`DataParallel`,
            or a layout replicated over a mesh axis that spans processes), one of them reads it
            from storage and sends it to the others over the interconnect (a JAX collective), so
            the checkpoint is read once in all, the reading spread evenly over the processes.
            `None` (default) does so in object storage (`gs://`, `s3://`) and on accelerators
            (GPU, TPU), not from local files on the CPU backend, where gloo over TCP is slower
            than reading; `False` has every process read its own replicas. One process: no
            effect.
        verbose: 1 shows the bytes read and the rate on a terminal (process 0 only).

    Returns:
        A `RestoreResult`: step, epoch, keys restored and skipped, bytes this process read and
            received.

    Warns:
        KerasOrbaxWarning: no `keras.distribution` is set while there are several devices (the
            whole model goes to one); the checkpoint's optimizer state is dropped because the
            model has no optimizer (an uncompiled model); a distribution of several devices
            puts variables the checkpoint holds sharded whole on every device (a LayoutMap key
            that matches nothing: one warning names them all, with the bytes per device);
            `strict=False` left variables as they were; `verify=True` could not check some or
            all of what it read.

    Raises:
        CheckpointNotFoundError: no such directory, no committed step, or no such step.
        CheckpointMismatchError: keys, shapes, dtypes or layouts do not fit; the message lists each.
        CorruptCheckpointError: array files are missing, truncated or unreadable.

    Example:
    ```python
    keras.distribution.set_distribution(ModelParallel(layout_map=layout_map))
    with keras_orbax.deferred_init():
        model = build_model()
    keras_orbax.restore_sharded(model, "/ckpt")
    ```
    """
    if process_tier.named(directory):  # a local tier of ModelCheckpoint's, under jax.distributed
        return process_tier.restore_tier(model, directory, step, strict=strict)
    # Collective: process 0 decides what the location names and which step; every process checks
    # what it will read, then reads its shards; all raise if any fails, and only then does any
    # process change anything.
    source = resolve.open_on_every_process(directory, step, "restore_sharded")
    return restore_source(
        model,
        source,
        strict=strict,
        verify=verify,
        read_window_bytes=read_window_bytes,
        single_replica_reads=single_replica_reads,
        verbose=verbose,
    )


def _replay_keras_loaders(
    model: keras.Model,
    source: Source,
    own: OwnState | None,
    variables: Mapping[str, keras.Variable],
    previous: Mapping[str, jax.Array | None],
    aliases: Mapping[str, Sequence[str]],
) -> None:
    """Runs each layer's own `load_own_variables` and `load_assets` over the variables just
    assigned and the source's saved values and files (`keras_walk.replay`), so that the layers
    hold what Keras's own loading leaves (quantization flags, derived state, vocabularies). If a
    loader fails, each restored variable that had a value gets it back before the error is raised
    (one built under `deferred_init()` had none: it keeps the checkpoint's)."""
    try:
        replayed = keras_walk.replay(model, own, aliases)
    except CheckpointMismatchError as error:
        for key, value in previous.items():
            if value is not None:
                keras_compat.set_value(variables[key], value)
        raise CheckpointMismatchError(
            f"{error} (restoring from '{source.label}'). Every variable that had a value before "
            "the restore has it again."
        ) from error
    if replayed.lacking:
        notices.warn(
            f"'{source.label}' lacks what {counted(len(replayed.lacking), 'layer')} of model "
            f"'{model.name}' store besides their variables ("
            + "; ".join(f"{group}: {listed(keys)}" for group, keys in replayed.lacking.items())
            + "), so their own loaders were not run: they keep the values they had."
        )
    if replayed.not_applied:
        notices.warn(
            f"{counted(len(replayed.not_applied), 'layer')} of model '{model.name}' store a "
            "device array they compute as they save, so their own loaders were not run and "
            f"these values saved in '{source.label}' were not restored ("
            + "; ".join(f"{group}: {listed(keys)}" for group, keys in replayed.not_applied.items())
            + "): the layers keep the values they had; their variables are restored."
        )


def restore_source(
    model: keras.Model,
    source: Source,
    *,
    strict: bool = True,
    verify: bool | None = None,
    read_window_bytes: int | None = None,
    single_replica_reads: bool | None = None,
    verbose: int = 0,
    warn_lenient: bool = True,
    verb: str | None = "restore_sharded",
) -> RestoreResult:
    """`restore_sharded` from a source every process has opened already (`load_model` opens it
    first, for its model config). `warn_lenient=False`: the caller said what was skipped. `verb`:
    the call a warning names (None: optimizer state is left out on purpose, unwarned)."""
    share = replicas.enabled(
        single_replica_reads, object_storage=locations.is_remote(source.location)
    )
    prepared = multihost.run_collectively(
        "restore_sharded/plan", _prepare, model, source, strict, verify, share
    )
    plan, reads = prepared.plan, prepared.reads
    assert reads is not None  # `_prepare` raised otherwise
    # Small files, checked against their checksums before any array is read.
    own = multihost.run_collectively("restore_sharded/keras_state", source.own_state)
    if _on_one_device(plan):
        notices.warn(
            f"No keras.distribution is set: model '{model.name}' is restored onto one device of "
            f"the {len(jax.devices())} there are, which must hold all of it. Set a distribution "
            "before building and restoring the model: ModelParallel with a LayoutMap to shard "
            "its weights over the devices, or DataParallel to replicate them."
        )
    paths = {k: v.path for k, v in prepared.state.variables.items()}
    replicated = replicated_message(list(plan.reads.values()), paths, model.name)
    if replicated is not None:
        notices.warn(replicated)
    arrays, bytes_read = multihost.run_collectively(
        "restore_sharded/read",
        _read_checked,
        plan,
        reads,
        read_window_bytes,
        bool(verbose) and multihost.is_primary(),
    )
    # Every array is read: from here on only a layer's own loader can fail, and then the
    # variables get their values back (`_replay_keras_loaders`).
    variables = _attach_optimizer(model, source, prepared.state)
    previous = {key: keras_compat.current_value(variables[key]) for key in arrays}
    for key, array in arrays.items():
        keras_compat.set_value(variables[key], array)
    not_read = [*plan.missing, *plan.mismatched]
    initialized = [k for k in not_read if deferred.is_deferred(variables[k])]
    for key in initialized:
        deferred.initialize(variables[key])
    _replay_keras_loaders(model, source, own, variables, previous, prepared.state.aliases)
    paths = {k: v.path for k, v in variables.items()}
    paths |= {k: prepared.record.variables[k].path for k in plan.unexpected}
    if verb is not None:
        notices.warn_untaken(model, source, prepared, verb=verb)
    if not strict and warn_lenient:
        notices.warn_lenient(model, source, prepared, paths)
    return RestoreResult(
        step=source.step,
        epoch=prepared.record.epoch,
        restored=tuple(arrays),
        initialized=tuple(initialized),
        skipped=tuple(k for k in (*not_read, *plan.unexpected) if k not in initialized),
        bytes_read=bytes_read,
        record=prepared.record,
        bytes_received=reads.received_bytes,
        paths={k: paths[k] for k in (*arrays, *not_read, *plan.unexpected)},
        unverified=unverified_keys(arrays, prepared.unverified, reads),
    )


def _prepare(
    model: keras.Model, source: Source, strict: bool, verify: bool | None, share: bool
) -> Prepared:
    """Everything a restore decides before reading: the plan, the reads that check what they read
    (unless `verify` is False). Changes nothing: an optimizer that is not built yet is planned
    through a deferred copy of it. `share`: read each region replicated across processes on one of
    them only (`replicas`).

    Raises:
        CheckpointMismatchError: the saved state does not fit the model; every problem listed.
        CorruptCheckpointError: the source's checksum files cannot be read.
    """
    prepared = source.prepare(model, strict=strict)
    if prepared.problems or prepared.reads is None:
        hint = " ".join(filter(None, [prepared.hint, matching.strict_hint(prepared.plan, strict)]))
        raise matching.mismatch_error(model, source.label, prepared.problems, hint=hint)
    reads = replicas.share(prepared.reads) if share else prepared.reads
    reads, unverified, said = checked_reads(source, reads, verify)
    if said is not None:
        notices.warn(said)
    return dataclasses.replace(prepared, reads=reads, unverified=unverified)


def _read_checked(
    plan: matching.Plan,
    reads: sharded_read.ReadPlan,
    window_bytes: int | None = None,
    show_progress: bool = False,
) -> tuple[dict[str, jax.Array], int]:
    """Reads every planned array and checks that each is one: the right key, type, shape, dtype
    and sharding. A damaged file can make a reader hand back something else (Orbax returns the
    abstract target for a key its tree metadata lost); nothing may be assigned then."""
    arrays, bytes_read = sharded_read.read_arrays(
        reads, window_bytes=window_bytes, show_progress=show_progress
    )
    wrong = []
    for key, request in plan.reads.items():
        array, target = arrays.get(key), request.target
        if not (
            isinstance(array, jax.Array)
            and array.shape == target.shape
            and array.dtype == target.dtype
            and (
                array.sharding is target.sharding  # as placed: no need to compare device maps
                or array.sharding.is_equivalent_to(target.sharding, len(target.shape))
            )
        ):
            got = f"{array.shape} {array.dtype}" if isinstance(array, jax.Array) else repr(array)
            wrong.append(f"  {key}: read {got[:80]}, expected {target.shape} {target.dtype}")
    if wrong:
        raise CorruptCheckpointError(
            f"Checkpoint step '{reads.step_dir}' did not yield what its record lists for "
            f"{counted(len(wrong), 'array')}\n"
            + "\n".join(wrong[:20])
            + "\nNo variable was modified."
        )
    return arrays, bytes_read


def _attach_optimizer(
    model: keras.Model, source: Source, planned: state_keys.KeyedState
) -> dict[str, keras.Variable]:
    """Builds the model's optimizer if the plan went through a stand-in of it; the variables by key."""
    optimizer = getattr(model, "optimizer", None)
    if not isinstance(optimizer, keras.optimizers.Optimizer) or optimizer.built:
        return planned.variables
    if sum(role == OPTIMIZER for role in planned.roles.values()) <= len(optimizer.variables):
        return planned.variables  # planned without a stand-in: nothing of the optimizer is read
    deferred.build_optimizer(model)
    variables = source.keyed_state(model).variables
    if list(variables) != list(planned.variables):  # a stand-in that differs is a bug of ours
        raise RuntimeError(
            f"keras-orbax: optimizer '{optimizer.name}' built with other variables than planned "
            "for; no variable was modified."
        )
    return variables


def _on_one_device(plan: matching.Plan) -> bool:
    """Whether, without a distribution, every variable read goes to one device of several: the
    model must then fit in that device's memory."""
    if keras.distribution.distribution() is not None or len(jax.devices()) < 2:
        return False
    targets = [request.target.sharding for request in plan.reads.values()]
    return bool(targets) and all(len(sharding.device_set) == 1 for sharding in targets)
