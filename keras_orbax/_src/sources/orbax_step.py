"""A step keras-orbax wrote (`save`, `ModelCheckpoint`, `convert`): arrays keyed by Keras's saving
structure, a record of each, and a checksum per shard file of the fast format.

```python
source = OrbaxStepSource(Path("/ckpt"), 100, steps=(90, 100))
prepared = source.prepare(model, strict=True)
```
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from keras_orbax._src.format import checksum, data_state, own_state, step_dirs
from keras_orbax._src.format.own_state import OwnState
from keras_orbax._src.format.read_checks import ReadChecks
from keras_orbax._src.format.step_record import METRIC, OPTIMIZER, STATE, StepRecord
from keras_orbax._src.format.zarr_shards import FastArray
from keras_orbax._src.sources.base import FileCheck, Prepared, Source

# Keras and the restore's modules load in the methods that restore (see `base`).
if TYPE_CHECKING:
    import keras

    from keras_orbax._src.model import state_keys
    from keras_orbax._src.model.matching import ReadRequest
    from keras_orbax._src.read.sharded_read import ReadPlan


class OrbaxStepSource(Source):
    """One committed step of a keras-orbax checkpoint root."""

    kind = "keras-orbax"
    description = "keras-orbax checkpoint step"

    def __init__(
        self, root: Any, step: int, steps: Sequence[int] = (), *, step_dir: Any = None
    ) -> None:
        """`step_dir`: where the step is, if not `root/step` (a step resume moved aside)."""
        self.step_dir = root / str(step) if step_dir is None else step_dir
        self.moved_aside = step_dir is not None
        super().__init__(root, step_dirs.read_record(self.step_dir), step, steps)

    @property
    def label(self) -> str:
        return str(self.step_dir) if self.moved_aside else super().label

    @property
    def where(self) -> Any:
        return self.step_dir if self.moved_aside else self.location

    def step_directory(self, step: int) -> Any:
        return self.step_dir if step == self.step else super().step_directory(step)

    def plan_reads(self, requests: Sequence[ReadRequest]) -> ReadPlan:
        from keras_orbax._src.read import sharded_read

        return sharded_read.plan_reads(self.step_dir, requests)

    def own_state(self) -> OwnState | None:
        return own_state.read(self.step_dir)

    def prepare(self, model: keras.Model, *, strict: bool) -> Prepared:
        from keras_orbax._src.model import deferred, matching

        saved = sum(v.role == OPTIMIZER for v in self.record.variables.values())
        state = self.keyed_state(model, deferred.optimizer_stand_in(model, saved))
        record = _metrics_by_creation_order(self.record, state)
        optional = matching.absent_optimizer(record, state)
        plan = matching.make_plan(record, state, strict=strict, optional=optional)
        reads = None if plan.problems else self.plan_reads(list(plan.reads.values()))
        return Prepared(record, state, plan, reads, tuple(plan.problems))

    def keyed_state(
        self, model: keras.Model, optimizer: keras.optimizers.Optimizer | None = None
    ) -> state_keys.KeyedState:
        """The model's state keyed by the scheme the step was written with (attributes the step
        holds under another name of the same layer resolved as Keras resolves them)."""
        from keras_orbax._src.model import state_keys, state_keys_v1

        if self.record.format_version == 1:
            return state_keys_v1.keyed_state(model, optimizer=optimizer)
        state = state_keys.keyed_state(model, optimizer=optimizer)
        return state.resolved(self.record.variables)

    def check_files(
        self, keys: Sequence[str] | None = None, on_file: Callable[[int], None] | None = None
    ) -> FileCheck:
        own_state.read(self.step_dir)  # checks `keras_state/` against its manifest
        data_state.read_all(self.step_dir)  # checks each input position against its checksum
        records = self.record.variables
        arrays = {k: FastArray.open(self.step_dir, records[k]) for k in keys or records}
        checked = checksum.check_files(
            self.step_dir, f"Step {self.step} of '{self.location}'", arrays, _every_file, on_file
        )
        compact = self._check_compact(arrays)
        if compact is None:
            return _file_check(arrays, *checked)
        files, nbytes, compared, uncovered = checked
        if on_file is not None:
            on_file(compact[1])
        return _file_check(
            arrays, files + compact[0], nbytes + compact[1], compared + compact[0], uncovered,
            compact_checked=True,
        )  # fmt: skip

    def _check_compact(self, arrays: dict[str, FastArray | None]) -> tuple[int, int] | None:
        """Checks every file of the step's OCDBT databases against its recorded CRC, if some
        of `arrays` are in them (None: none is, or no CRC is recorded); (files, bytes) read.

        Raises:
            CorruptCheckpointError: naming each file that failed.
        """
        keys = [key for key, array in arrays.items() if array is None]
        recorded = checksum.recorded_ocdbt(self.step_dir / STATE) if keys else {}
        if not recorded:
            return None
        more = f" and {len(keys) - 5} more" if len(keys) > 5 else ""
        what = (
            f"Step {self.step} of '{self.location}' (the OCDBT files of the compact format's "
            f"arrays {', '.join(keys[:5])}{more})"
        )
        return checksum.check_whole_files(self.step_dir / STATE, recorded, what)

    def verified_reads(
        self, reads: ReadPlan, *, read_back: bool = False
    ) -> tuple[ReadPlan, FileCheck]:
        """Every byte read checked against its file's recorded CRC-32, by the threads that read,
        over the bytes just read (`read_checks`): a region that is one whole shard file at once,
        the files that regions cut (another layout) from their pieces once all are read."""
        recorded = checksum.recorded_checksums(self.step_dir / STATE)
        checks = ReadChecks(recorded, read_back=read_back)
        fast = [
            (request, array.checked_by(checks) if isinstance(array, FastArray) else array, indices)
            for request, array, indices in reads.fast
        ]
        arrays: dict[str, FastArray | None] = {
            request.record.key: a if isinstance(a, FastArray) else None for request, a, _ in fast
        }
        arrays.update({request.record.key: None for request in reads.via_orbax})
        # Read by Orbax: its files are checked whole before anything is read.
        compact_checked = self._check_compact(arrays) is not None
        files = collections.Counter(name.partition("/")[0] for name in recorded)
        unrecorded = tuple(
            key
            for key, array in arrays.items()
            if array is not None and files[array.directory.name] != _file_count(array)
        )
        found = _file_check(
            arrays, 0, 0, 0, unrecorded,
            any_recorded=bool(recorded) or compact_checked, compact_checked=compact_checked,
        )  # fmt: skip
        return dataclasses.replace(reads, fast=fast, checks=checks), found


def _file_count(array: FastArray) -> int:
    return math.prod(n // c for n, c in zip(array.shape, array.chunk_shape, strict=True))


def _metrics_by_creation_order(record: StepRecord, state: state_keys.KeyedState) -> StepRecord:
    """`record` with its metric variables paired to the model's where only Keras's name counters
    tell them apart: metric variables are keyed by path (`metrics/auc/true_positives`), and a
    model compiled again in the same process names them `auc_2`... (`name_counters`)."""
    from keras_orbax._src.model import name_counters

    leftover = {
        k: v for k, v in record.variables.items() if v.role == METRIC and k not in state.variables
    }
    wanted = {
        k: k for k, role in state.roles.items() if role == METRIC and k not in record.variables
    }
    pairs = name_counters.pair_by_counterless_paths(leftover, wanted, {}, state) if wanted else {}
    if not pairs:
        return record
    variables = {
        pairs.get(k, k): dataclasses.replace(v, key=pairs.get(k, k))
        for k, v in record.variables.items()
    }
    return dataclasses.replace(record, variables=variables)


def _file_check(
    arrays: dict[str, FastArray | None],
    files: int,
    nbytes: int,
    compared: int,
    uncovered: tuple[str, ...],
    *,
    any_recorded: bool | None = None,
    compact_checked: bool = False,
) -> FileCheck:
    """What `checksum.check_files` found, with the keys no checksum covers and why: arrays not in
    the fast format of a step that records no CRC of its OCDBT files (`compact_checked`: it does,
    and they were checked; Orbax writes their data without a checksum: zarr's crc32c covers only
    each shard's index, and a changed byte of the data reads back as another value), and
    fast-format arrays with a file for which no checksum is recorded (every array of a step saved
    before checksums; some, where a process's checksum file is missing or incomplete)."""
    compact = () if compact_checked else tuple(k for k, a in arrays.items() if a is None)
    reasons = []
    if compact:
        reasons.append(
            "arrays of the compact format, saved before keras-orbax recorded its files' checksums"
        )
    if any_recorded is None:  # every file was read back: none matched, none was recorded
        any_recorded = compared > 0
    if uncovered and not any_recorded:
        reasons.append("the step was saved without checksums")
    elif uncovered:
        arrays_word = "array" if len(uncovered) == 1 else "arrays"
        reasons.append(f"no checksum is recorded for files of {len(uncovered)} {arrays_word}")
    return FileCheck(files, nbytes, compared, compact + uncovered, "; ".join(reasons))


def _every_file(array: FastArray) -> Iterable[tuple[int, ...]]:
    grid = [n // c for n, c in zip(array.shape, array.chunk_shape, strict=True)]
    return itertools.product(*map(range, grid))
