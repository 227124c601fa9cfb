"""`RestoreResult`: what `restore_sharded` (and `load_model`, `from_preset`) did."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping, Sequence

from keras_orbax._src.format.step_record import StepRecord
from keras_orbax._src.model.matching import counted, listed


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
