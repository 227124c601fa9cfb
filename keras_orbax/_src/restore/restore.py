"""`restore_sharded`: validate the whole plan, read every shard onto its device, assign all or nothing."""

from __future__ import annotations

import collections
import dataclasses
import inspect
import os
import warnings
from collections.abc import Mapping, Sequence

import jax
import keras

from keras_orbax._src.compat import keras_compat
from keras_orbax._src.format.own_state import OwnState
from keras_orbax._src.format.step_record import StepRecord
from keras_orbax._src.model import deferred, keras_walk, matching, state_keys
from keras_orbax._src.model.matching import counted, listed
from keras_orbax._src.model.state_keys import METRIC, OPTIMIZER
from keras_orbax._src.read import replicas, sharded_read
from keras_orbax._src.restore.checked_reads import checked_reads, unverified_keys
from keras_orbax._src.restore.replicated import replicated_message
from keras_orbax._src.runtime import gc_pause, multihost
from keras_orbax._src.sources import resolve
from keras_orbax._src.sources.base import Prepared, Source
from keras_orbax._src.storage import locations
from keras_orbax.errors import (
    CheckpointMismatchError,
    CorruptCheckpointError,
    KerasOrbaxWarning,
)


@dataclasses.dataclass(frozen=True)
class RestoreResult:
    """What `restore_sharded` did.

    Attributes:
        step: The step restored (None for a Keras weights file).
        epoch: The epoch recorded with the step, if any.
        restored: Keys of the variables restored from the checkpoint.
        initialized: Keys of deferred variables the checkpoint lacked, initialized (strict=False).
        skipped: Keys that were not restored: model variables the checkpoint lacks or holds with
            another shape or dtype (kept as they were), and checkpoint entries the model lacks.
        bytes_read: Bytes of array data this process read from storage.
        record: The checkpoint's full keras-orbax record.
        bytes_received: Bytes of array data this process's devices received from other processes
            instead of reading them (`single_replica_reads`); with `bytes_read`, every distinct
            region its devices hold, once.
        paths: The Keras path of each key above: the model variable's, or for a checkpoint
            entry the model lacks, the path it was saved under. `restored_paths`,
            `initialized_paths` and `skipped_paths` list the keys above by these paths.
        unverified: Keys of the variables restored without a check of their bytes against a
            recorded checksum: all of them with `verify=False` or from a source that records
            none (Keras and Hugging Face files, Keras's `OrbaxCheckpoint` steps), a compact
            step's; none where every byte read was checked.
    """

    step: int | None
    epoch: int | None
    restored: tuple[str, ...]
    initialized: tuple[str, ...]
    skipped: tuple[str, ...]
    bytes_read: int
    record: StepRecord = dataclasses.field(repr=False)
    bytes_received: int = 0
    paths: Mapping[str, str] = dataclasses.field(default_factory=dict)
    unverified: tuple[str, ...] = ()

    @property
    def num_variables(self) -> int:
        return len(self.restored)

    @property
    def restored_paths(self) -> tuple[str, ...]:
        """`restored` by Keras path (`dense/kernel`, `adam/iteration`)."""
        return tuple(self.paths.get(k, k) for k in self.restored)

    @property
    def initialized_paths(self) -> tuple[str, ...]:
        """`initialized` by Keras path."""
        return tuple(self.paths.get(k, k) for k in self.initialized)

    @property
    def skipped_paths(self) -> tuple[str, ...]:
        """`skipped` by Keras path."""
        return tuple(self.paths.get(k, k) for k in self.skipped)

    def __repr__(self) -> str:
        """The restored variables counted, the others named by Keras path."""
        return (
            f"RestoreResult(step={self.step}, epoch={self.epoch}, "
            f"restored={counted(len(self.restored), 'variable')}, "
            f"initialized=[{self._named(self.initialized)}], "
            f"skipped=[{self._named(self.skipped)}], bytes_read={self.bytes_read}, "
            f"bytes_received={self.bytes_received})"
        )

    def _named(self, keys: Sequence[str]) -> str:
        """Each key by its Keras path; by both where two keys share a path (two sub-layers of a
        subclassed model named alike)."""
        shared = collections.Counter(self.paths.values())
        named = [(k, self.paths.get(k, k)) for k in keys]
        return listed([f"{p} ({k})" if shared[p] > 1 else p for k, p in named])


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
        step: The step to restore; `None` means the latest committed one (or the one named by
            `directory`).
        strict: If False, restore what matches: variables the checkpoint lacks or holds with another
            shape or dtype keep their values (deferred ones are initialized), and checkpoint
            entries the model lacks are ignored. `RestoreResult.skipped` lists them, and a
            `KerasOrbaxWarning` names the model's by Keras path.
        verify: Check every byte read against the checksum recorded when it was written (the
            fast format's CRC-32 of each shard file), in the threads that read, over the bytes
            just read, nothing read twice; a file that fails raises `CorruptCheckpointError`
            naming the file and the array, and no variable is changed. `None` (default) checks
            so and says nothing of what it could not check (`RestoreResult.unverified` lists
            it: a source that records no checksums, such as Keras and Hugging Face files and
            Keras's `OrbaxCheckpoint` steps; a compact step's arrays; a file this process reads
            only part of). `True` also reads such partly read files back whole, and warns
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
        _warn(
            f"'{source.label}' lacks what {counted(len(replayed.lacking), 'layer')} of model "
            f"'{model.name}' store besides their variables ("
            + "; ".join(f"{group}: {listed(keys)}" for group, keys in replayed.lacking.items())
            + "), so their own loaders were not run: they keep the values they had."
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
) -> RestoreResult:
    """`restore_sharded` from a source every process has opened already (`load_model` opens it
    first, for its model config). `warn_lenient=False`: the caller said what was skipped."""
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
        _warn(
            f"No keras.distribution is set: model '{model.name}' is restored onto one device of "
            f"the {len(jax.devices())} there are, which must hold all of it. Set a distribution "
            "before building and restoring the model: ModelParallel with a LayoutMap to shard "
            "its weights over the devices, or DataParallel to replicate them."
        )
    paths = {k: v.path for k, v in prepared.state.variables.items()}
    replicated = replicated_message(list(plan.reads.values()), paths, model.name)
    if replicated is not None:
        _warn(replicated)
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
    warn_untaken(model, source, prepared)
    if not strict and warn_lenient:
        _warn_lenient(model, source, prepared, paths)
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
        _warn(said)
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


def _warn(message: str) -> None:
    """A `KerasOrbaxWarning` attributed to the first caller outside keras-orbax and Keras (the
    user's call of `restore_sharded`, `load_model` or `from_preset`, or of `fit` for a resuming
    `ModelCheckpoint`), so Python shows it once per call site."""
    frame, level = inspect.currentframe(), 1
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] in (
        "keras_orbax",
        "keras",  # `fit` runs a resuming ModelCheckpoint's restore
        "contextlib",  # `gc_pause.paused()` decorates `restore_sharded`
    ):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, KerasOrbaxWarning, stacklevel=level)


def _on_one_device(plan: matching.Plan) -> bool:
    """Whether, without a distribution, every variable read goes to one device of several: the
    model must then fit in that device's memory."""
    if keras.distribution.distribution() is not None or len(jax.devices()) < 2:
        return False
    targets = [request.target.sharding for request in plan.reads.values()]
    return bool(targets) and all(len(sharding.device_set) == 1 for sharding in targets)


def warn_untaken(
    model: keras.Model, source: Source, prepared: Prepared, *, verb: str = "restore_sharded"
) -> None:
    """Says so where the checkpoint's optimizer state is dropped because the model has no
    optimizer (an uncompiled model): compiling it afterwards starts training from fresh slots.
    `verb` is what drops it (`convert` writes what the model takes)."""
    if any(role == OPTIMIZER for role in prepared.state.roles.values()):
        return
    roles = {key: prepared.record.variables[key].role for key in prepared.plan.unexpected}
    optimizer = sum(role == OPTIMIZER for role in roles.values())
    if not optimizer:
        return
    metrics = sum(role == METRIC for role in roles.values())
    also = f" and {counted(metrics, 'metric variable')}" if metrics else ""
    compiled = source.model_config is not None and source.model_config.get("compile_config")
    were = "was" if optimizer + metrics == 1 else "were"
    if verb == "restore_sharded":
        done, why = "restored", "To resume training from them"
        config = ", or use keras_orbax.load_model, which compiles the model from its saved config"
    else:
        done, why = "written", "To keep them"
        config = ", or convert without a model: the one its saved config describes is compiled"
    _warn(
        f"Model '{model.name}' has no optimizer, so {counted(optimizer, 'optimizer variable')}"
        f"{also} of '{source.label}' {were} not {done}. {why}, compile the model with its "
        f"optimizer before {verb}{config if compiled else ''}."
    )


def _warn_lenient(
    model: keras.Model, source: Source, prepared: Prepared, paths: Mapping[str, str]
) -> None:
    """Names the variables `strict=False` left as they were (or initialized, deferred ones)."""
    roles = prepared.state.roles
    kept = [key for key in prepared.plan.lenient if key in roles]
    weights = [paths[key] for key in kept if roles[key] != OPTIMIZER]
    slots = sum(roles[key] == OPTIMIZER for key in kept)
    optimizer = f"optimizer state ({counted(slots, 'variable')})"
    if weights:
        keep = (
            "It keeps its initial value" if len(weights) == 1 else "They keep their initial values"
        )
        also = f", and so does its {optimizer}, restored whole or not at all" if slots else ""
        _warn(
            f"restore_sharded(strict=False) did not restore {counted(len(weights), 'variable')} "
            f"of model '{model.name}' that '{source.label}' lacks or holds with another shape or "
            f"dtype: {listed(weights)}. {keep}{also}."
        )
    elif slots:
        _warn(
            f"restore_sharded(strict=False) did not restore the {optimizer} of model "
            f"'{model.name}': '{source.label}' holds it for other variables, shapes or dtypes, and "
            "it is restored whole or not at all. It keeps its initial values."
        )
