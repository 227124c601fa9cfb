"""`ModelCheckpoint`'s local tier under `jax.distributed`: each process keeps its own part of each
local step in its own `local_directory` (its machine's `/dev/shm` or SSD; nothing shared), and a
replica of the previous process's part, sent to it over JAX's collectives (`runtime.ring`), so the
loss of any one process's local directory loses nothing.

Per local save, on the train loop: this process's shards are copied to the host and packed with
their checksums (`format.process_parts`), and one ring exchange gives each process its peer's
part; both are then written in the background. No barrier waits for a write: which steps are
whole everywhere is agreed when resuming (`resume`), over the coordination service.

Resuming takes the newest step that every process can restore, from its own part or, where that
is lost or damaged, from the copy its next process keeps (sent back over the ring); steps passed
over are moved aside, never deleted. A step two neighbouring processes both lost (a process's part
and its only replica) is passed over: the persistent tier is the fallback (docs/preemption.md).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import keras
import numpy as np

from keras_orbax._src.compat import keras_compat
from keras_orbax._src.format import process_parts, step_dirs
from keras_orbax._src.format.step_record import StepRecord, versions
from keras_orbax._src.model import keras_walk, state_keys
from keras_orbax._src.restore import process_tier
from keras_orbax._src.runtime import multihost, ring
from keras_orbax._src.storage import locations, writer_lock
from keras_orbax._src.training.resume import Resumed, set_aside
from keras_orbax._src.write.step_writer import variable_record
from keras_orbax.errors import (
    CheckpointMismatchError,
    KerasOrbaxWarning,
    SaveFailedError,
    StepLockedError,
)

logger = logging.getLogger("keras_orbax")


class PeerTier:
    """The local steps of one `ModelCheckpoint` under `jax.distributed` (see the module's doc).

    Same surface as `LocalTier`: `open`, `due`, `save`, `check_follows`, `resume`, and `saves`
    (`start`, `raise_if_failed`, `wait`, `close`) for the callback's hooks.
    """

    def __init__(self, directory: str | os.PathLike, *, every: int, max_to_keep: int) -> None:
        self.directory = os.fspath(directory)
        self.every = every
        self.max_to_keep = max_to_keep
        self.saves = self  # the callback waits on and closes the tier's writes through `saves`
        self.last_saved_step: int | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: tuple[int, concurrent.futures.Future[None]] | None = None
        self._checked = False  # whether the model's state is all variables (`_refuse_host_state`)
        self._run = contextlib.ExitStack()  # this process's lock on its own folder
        me, n = multihost.process_index(), multihost.process_count()
        self.root: Path = locations.as_path(self.directory)  # local: PeerTier.open refuses a URL
        self.own = process_parts.folder(self.root, me)
        self.previous = (me - 1) % n
        self.replica = process_parts.folder(self.root, self.previous)

    # -- the callback's hooks ---------------------------------------------------------------------

    def open(self) -> None:
        if locations.is_remote(self.directory):
            raise ValueError(
                "Under jax.distributed, local_directory is each process's own local storage (its "
                "part of each step, and a replica of a peer's): a bucket is the persistent "
                f"directory's place. Received: local_directory={self.directory!r}"
            )
        self.own.mkdir(parents=True, exist_ok=True)
        # Another run on this machine writing the same folders (a job launched twice) stops every
        # process here, before anything is written or removed.
        failure = None
        try:
            self._run.enter_context(writer_lock.run_lock(self.own, shared=False))
        except StepLockedError as error:
            failure = error
        multihost.agree(
            "local tier/run lock",
            failure,
            unchanged="nothing was written",
            fallback=StepLockedError,
        )
        for into in (self.own, self.replica):
            process_parts.remove_staged(into)  # a killed write's; only this process writes here
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="local-tier")

    def start(self, model: keras.Model) -> None:
        """Nothing to ready: the shards are copied at each save."""

    def due(self, previous_step: int, step: int) -> bool:
        return step // self.every > previous_step // self.every and step != self.last_saved_step

    def check_follows(self, step: int) -> None:
        """Refuses, on every process, local directories holding steps of a run ahead of this
        one (a collective call: every process then takes part in the same saves' exchanges)."""
        steps = process_parts.steps(self.own)
        found = multihost.gather("local tier/newest", steps[-1] if steps else None)
        newest = max((n for n in found if n is not None), default=None)
        if newest is not None and newest > step:
            ahead = found.index(newest)
            raise ValueError(
                f"local_directory '{self.directory}' of process {ahead} already holds steps up "
                f"to {newest}, but the model is at step {step}: new local steps would be mixed "
                "with a different run's. Pass resume=True to continue that run, or use a new "
                f"local_directory. Received: local_directory='{self.directory}'"
            )
        self.last_saved_step = newest

    def save(
        self,
        model: keras.Model,
        *,
        step: int,
        epoch: int,
        batch: int | None,
        steps_per_epoch: int | None,
        data_state: dict[str, Any] | None,
    ) -> None:
        """Packs this process's shards, swaps parts with the peers (a collective: every process
        saves at the same step), and writes both in the background once the previous local save
        has committed: a write that failed on any process raises `SaveFailedError` on every
        process here, so that none waits in the exchange for one that has stopped."""
        failure = None
        try:
            self.wait()
        except SaveFailedError as error:
            failure = error
        multihost.agree(
            f"local tier/before step {step}",
            failure,
            unchanged="the earlier local steps are intact",
            fallback=SaveFailedError,
        )
        if self._pool is None:
            raise SaveFailedError(f"The local tier '{self.directory}' is closed.")
        state = state_keys.keyed_state(model)
        if not self._checked:
            _refuse_host_state(model, state, self.directory)
            self._checked = True
        variables = {k: v for k, v in state.variables.items() if keras_compat.is_allocated(v)}
        record = StepRecord(
            step=step,
            epoch=epoch,
            batch=batch,
            variables={k: variable_record(k, v, state.roles[k]) for k, v in variables.items()},
            versions=versions(),
            extra={"reason": "local", "steps_per_epoch": steps_per_epoch},
        )
        me = multihost.process_index()
        own = process_parts.pack(me, record, _host_shards(variables), data_state)
        replica = ring.shift(own, by=1, name=f"local tier/step {step}")
        self._pending = (step, self._pool.submit(self._write, own, replica))
        self.last_saved_step = step
        logger.debug("Saving step %d to the local tier '%s'", step, self.own)

    def _write(self, own: process_parts.Payload, replica: process_parts.Payload) -> None:
        process_parts.commit(self.own, own, checked=True)  # packed here
        process_parts.commit(self.replica, replica)  # its CRC-32 checked here, off the loop
        for into in (self.own, self.replica):
            for old in process_parts.steps(into)[: -self.max_to_keep]:
                shutil.rmtree(into / str(old))

    def raise_if_failed(self) -> None:
        """Nothing: a failed write is raised at the next save, on every process at once (one
        process leaving `fit` alone would leave the others waiting in the exchange)."""

    def wait(self) -> None:
        """Blocks until the local save in progress has committed.

        Raises:
            SaveFailedError: it failed; the earlier local steps are intact.
        """
        pending, self._pending = self._pending, None
        if pending is None:
            return
        step, future = pending
        try:
            future.result()
        except Exception as error:
            self.close(failing=True)
            raise SaveFailedError(
                f"Saving step {step} to the local tier '{self.own}' failed: "
                f"{type(error).__name__}: {error}. Its earlier steps are intact."
            ) from error

    def close(self, *, failing: bool) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        self._run.close()

    # -- resuming ---------------------------------------------------------------------------------

    def resume(
        self,
        model: keras.Model,
        *,
        persistent: str,
        position_input: Callable[[str, int, StepRecord], bool],
        verbose: int = 0,
    ) -> Resumed | None:
        """Restores the newest local step newer than the persistent tier's newest that every
        process can restore, taking a lost or damaged part from the next process's replica (and
        writing it back); None where there is none, for the persistent tier to resume from. Local
        steps passed over are moved aside (never deleted), with a warning. A collective call.
        """
        persistent_steps = step_dirs.committed_steps(persistent)
        newer_than = persistent_steps[-1] if persistent_steps else -1
        choice = process_tier.newest_whole(self.own, self.replica, newer_than=newer_than)
        self._set_aside_passed_over(choice, newer_than)
        if choice.step is None:
            return None
        step, me = choice.step, multihost.process_index()
        where = f"step {step} of '{self.own}'"

        def read() -> tuple[dict[str, jax.Array], dict[str, Any], int]:
            payload = process_tier.part_of(self.own, self.replica, choice)
            checked = payload is choice.own_part  # read and checked while choosing the step
            read = process_tier.arrays_from(model, payload, where, checked=checked)
            if me in choice.missing:  # written back: this process's tier holds it again
                process_parts.commit(self.own, payload, checked=True)
            return read

        try:
            arrays, manifest, nbytes = multihost.run_collectively(
                f"local tier/restore {step}", read
            )
        except CheckpointMismatchError as error:  # another mesh or model: the local tier is moot
            warnings.warn(
                f"Step {step} of the local tier '{self.directory}' does not fit this run's model "
                f"or mesh, so fit resumes from '{persistent}'. {error}",
                KerasOrbaxWarning,
                stacklevel=3,
            )
            moot = dataclasses.replace(choice, step=None)
            self._set_aside_passed_over(moot, newer_than, "does not fit this run's model or mesh")
            return None
        restored = process_tier.assign(model, arrays, manifest, nbytes, step=step)
        if me in choice.missing:
            warnings.warn(
                f"Step {step} of this process's local tier '{self.own}' was lost or damaged: "
                f"it was taken from the replica process {(me + 1) % multihost.process_count()} "
                "keeps, and written back.",
                KerasOrbaxWarning,
                stacklevel=3,
            )
        record = restored.record
        positioned = position_input(str(self.own), step, record)
        keras_compat.set_initial_epoch(model, record.epoch)
        if multihost.is_primary():
            than = f"step {newer_than}, the newest of" if newer_than >= 0 else "any step of"
            line = (
                f"Resuming from step {step} of the local tier '{self.directory}', newer than "
                f"{than} '{persistent}'"
                + f", the parts of processes {list(choice.missing)} from their peers' replicas"
                * bool(choice.missing)
                + (": the input goes on where it was." if positioned else ".")
            )
            logger.info(line)
            if verbose > 0:
                print(line, flush=True)
        return Resumed(restored, record.epoch)

    def _set_aside_passed_over(
        self,
        choice: process_tier.Choice,
        newer_than: int,
        why: str = "is not whole on every process",
    ) -> None:
        """Moves aside this process's local steps (own and replica) newer than the chosen step
        (all newer than the persistent tier's where none is chosen), and its own damaged chosen
        step, which the peer's replica replaces: each warned about, none deleted."""
        step = choice.step
        for into, bad in ((self.own, choice.damaged_own), (self.replica, choice.damaged_replica)):
            passed = [
                s
                for s in process_parts.steps(into)
                if s > newer_than and (step is None or s > step or (s == step and s in bad))
            ]
            for s, where in zip(passed, set_aside(str(into), passed), strict=True):
                warnings.warn(
                    f"Local step {s} of '{into}' {f'is damaged: {bad[s]}' if s in bad else why}; it was moved aside to '{where}' (nothing "
                    "is deleted; inspect it, then remove it yourself).",
                    KerasOrbaxWarning,
                    stacklevel=4,
                )


def _refuse_host_state(model: keras.Model, state: state_keys.KeyedState, directory: str) -> None:
    """Raises ValueError where `model`'s layers store values besides their variables (a lookup
    layer's vocabulary): a part holds variables only, so a resume would not bring those back."""
    kept = keras_walk.captured(model, state.objects)
    entries = sorted(kept.values) + sorted(kept.assets)
    if entries:
        raise ValueError(
            f"Under jax.distributed, a local step holds model '{model.name}''s variables only, "
            f"but its layers store more besides them ({', '.join(entries[:5])}): a resume from "
            "the local tier would not restore it. Use the persistent directory alone (save_freq) "
            f"for this model. Received: local_directory={directory!r}"
        )


def _host_shards(variables: dict[str, keras.Variable]) -> list[tuple[str, Any, np.ndarray]]:
    """This process's distinct shards of each variable, as host arrays (on CPU, views of the
    device buffers: `process_parts.pack` copies them before the next train step donates them)."""
    shards = []
    for key, variable in variables.items():
        value = keras_compat.current_value(variable)
        if not value.size:
            continue
        seen = set()
        for shard in sorted(value.addressable_shards, key=lambda s: s.device.id):
            index = process_parts.index_of(shard.index, value.shape)
            if index not in seen:
                seen.add(index)
                shards.append((key, index, np.asarray(shard.data)))
    return shards
