"""The weight files people already have: `.weights.h5`, a sharded `.weights.json`, a `.keras`
archive, a keras-hub preset directory (Keras format).

Which stored array goes to which variable is decided by Keras's own loader (`keras_loader`); the
plan, the all-or-nothing checks and the region reads are the same as for keras-orbax's own steps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from keras_orbax._src.format import checksum
from keras_orbax._src.format.own_state import OwnState
from keras_orbax._src.format.step_record import (
    METRIC,
    MODEL,
    OPTIMIZER,
    StepRecord,
    VariableRecord,
)
from keras_orbax._src.read.contiguous import ContiguousArray
from keras_orbax._src.sources import export_sidecar, h5_files
from keras_orbax._src.sources.base import FileCheck, Prepared, Source, SourceKind

# Keras, JAX and the restore's modules load in the methods that restore: `resolve` asks
# `is_weights_file` and `preset_weights` of every location, and `keras-orbax inspect` lists a
# weights file from its h5 datasets alone (see `base`).
if TYPE_CHECKING:
    import keras

    from keras_orbax._src.model.matching import ReadRequest
    from keras_orbax._src.read.sharded_read import ReadPlan

WEIGHTS_SUFFIXES = (".h5", ".keras", ".weights.json")
PRESET_WEIGHTS = ("model.weights.h5", "model.weights.json")  # keras-hub reads the .h5 first


def is_weights_file(path: Path) -> bool:
    """Whether `path` is named as a Keras weights file (it may not exist)."""
    return path.name.endswith(WEIGHTS_SUFFIXES)


def preset_weights(directory: Path) -> Path | None:
    """The weights file of a keras-hub preset directory (Keras format), or None if it is not one."""
    if not (directory / "config.json").is_file():
        return None
    return next((directory / n for n in PRESET_WEIGHTS if (directory / n).is_file()), None)


class KerasWeightsSource(export_sidecar.CheckedBySidecar, Source):
    """A Keras weights file, listed by h5 dataset path (`layers/dense/vars/0`, the keras-orbax key
    of ordinary layers), restored as Keras's own `load_weights` assigns it."""

    kind: ClassVar[SourceKind] = "keras-weights"
    description = "Keras weights file"
    no_checksums = (
        "is a Keras weights file that records no checksums (`keras_orbax.save_weights` records "
        "them beside the file)"
    )

    def __init__(self, file: Path, location: Path | None = None) -> None:
        self.file = file
        self.arrays = h5_files.h5_datasets(file)
        variables = {
            name: VariableRecord(
                name,
                name,
                tuple(int(n) for n in a.shape),
                str(a.dtype),
                name,
                role=OPTIMIZER if name.startswith("optimizer/") else MODEL,
            )
            for name, a in self.arrays.items()
        }
        config = None
        if file.name.endswith(".keras"):
            config = h5_files.archive_json(file, "config.json")
        record = StepRecord(step=0, variables=variables, model_config=config, format_version=0)
        super().__init__(location or file, record)
        self._own: OwnState | None = None  # known once a model is prepared

    @property
    def sidecar(self) -> Path | None:
        """Where keras-orbax's export keeps its datasets' CRCs (`export.export_checksums`)."""
        return self.file.parent / checksum.export_sidecar_of(self.file.name)

    def checked_by_sidecar(self) -> FileCheck | None:
        """Every dataset the sidecar records, read and checked; None where there is no sidecar.

        Raises:
            CorruptCheckpointError: the sidecar cannot be read, or naming each file and dataset
                that fails its CRC.
        """
        return None if self.sidecar is None else self.checked_against(self.sidecar)

    def checked_against(self, sidecar: Path) -> FileCheck | None:
        """`checked_by_sidecar` with the CRCs that `sidecar` records (None: it does not exist)."""
        places = {  # the sidecar's names: `<file>/<h5 path>`
            f"{a.file.name}/{name}": (a.file, a.offset, a.nbytes)
            for name, a in self.arrays.items()
            if isinstance(a, ContiguousArray)
        }
        found = export_sidecar.check(sidecar, places, f"'{self.location}'")
        if found is None:
            return None
        checked = {name.partition("/")[2] for name in places} - {
            name.partition("/")[2] for name in found.unchecked
        }
        unchecked = tuple(name for name in self.arrays if name not in checked)
        why = f"{len(unchecked)} datasets not in {sidecar.name}" if unchecked else ""
        return dataclasses.replace(found, unchecked=unchecked, why_unchecked=why)

    def plan_reads(self, requests: Sequence[ReadRequest]) -> ReadPlan:
        from keras_orbax._src.read import sharded_read

        return sharded_read.plan_reads(self.file, requests, lambda r: self.arrays[r.key])

    def own_state(self) -> OwnState | None:
        """The values the last `prepare`d model's layers store that are no variable, and a
        `.keras` archive's assets (a `.weights.h5` has none, as in Keras)."""
        return self._own

    def prepare(self, model: keras.Model, *, strict: bool) -> Prepared:
        """Keras's own loader decides which stored array goes to which variable (`keras_loader`);
        the plan, the all-or-nothing checks and the region reads are those of every source."""
        from keras_orbax._src.model import keras_walk, state_keys
        from keras_orbax._src.model.deferred import optimizer_stand_in
        from keras_orbax._src.model.matching import make_plan
        from keras_orbax._src.read import sharded_read
        from keras_orbax._src.sources.keras_loader import trace_load

        # What the model's layers store that is no variable is read whole (it is small) and kept
        # for their own loaders (`own_state`); the other datasets are arrays.
        host = keras_walk.host_entries(model)
        values = {n: _whole(a) for n, a in self.arrays.items() if n in host}
        self._own = OwnState(values, h5_files.archive_assets(self.file))
        arrays = {n: a for n, a in self.arrays.items() if n not in values}
        saved_optimizer = [name for name in arrays if name.startswith("optimizer/")]
        stand_in = optimizer_stand_in(model, len(saved_optimizer))
        state = state_keys.keyed_state(model, optimizer=stand_in)
        traced = trace_load(model, arrays, state, stand_in, values)
        record = StepRecord(step=0, variables={}, format_version=0)
        for key, feed in traced.feeds.items():
            record.variables[key] = VariableRecord(
                key, feed.source, feed.shape, feed.dtype, feed.source, role=state.roles[key]
            )
        for name, array in arrays.items():
            if name not in traced.consumed and name not in record.variables:
                role = OPTIMIZER if name.startswith("optimizer/") else MODEL
                record.variables[name] = VariableRecord(
                    name, name, tuple(array.shape), str(array.dtype), name, role=role
                )
        optional = {
            k for k in state.variables if "/seed_generators/" in k or state.roles[k] == METRIC
        }
        if not saved_optimizer:  # a file saved without optimizer state: Keras keeps the optimizer's
            optional |= {k for k, role in state.roles.items() if role == OPTIMIZER}
        plan = make_plan(record, state, strict=strict, optional=frozenset(optional))
        # A layer whose variables the plan names already (both sides' paths, shapes, dtypes)
        # needs no second line for Keras's reason.
        named = tuple(f"{key.rsplit('/vars/', 1)[0]}/" for key in plan.lenient)
        refused = [p for g, p in traced.problems.items() if not f"{g}/".startswith(named)]
        problems = [*refused, *plan.problems] if strict else plan.problems
        feeds = traced.feeds
        reads = None
        if not problems:
            requests = list(plan.reads.values())
            reads = sharded_read.plan_reads(self.file, requests, lambda r: feeds[r.key].reader)
        return Prepared(record, state, plan, reads, tuple(problems))


class KerasPresetSource(KerasWeightsSource):
    """A keras-hub preset directory (Keras format): its `model.weights.h5` or `.json`."""

    kind: ClassVar[SourceKind] = "keras-preset"
    description = "keras-hub preset"
    no_checksums = (
        "is a keras-hub preset that records no checksums (`keras_orbax.save_to_preset` records "
        "them)"
    )

    @property
    def model_config(self) -> None:
        """A preset's config is keras-hub's, built by `from_preset`, not by `load_model`."""
        return None

    @property
    def sidecar(self) -> Path | None:
        return self.location / checksum.EXPORT_FILE

    def checked_by_sidecar(self) -> FileCheck | None:
        """The model's datasets and, where the preset has them, its task's (`task.weights.h5`,
        which keras-hub's own loader reads once the backbone is restored), against the one
        sidecar of the preset."""
        found = super().checked_by_sidecar()
        task = self.location / TASK_WEIGHTS
        if found is None or not task.is_file():
            return found
        head = KerasWeightsSource(task).checked_against(self.location / checksum.EXPORT_FILE)
        if head is None:
            return found
        return FileCheck(
            found.files + head.files,
            found.nbytes + head.nbytes,
            found.checksummed + head.checksummed,
            found.unchecked + tuple(f"{TASK_WEIGHTS}/{name}" for name in head.unchecked),
            "; ".join(w for w in (found.why_unchecked, head.why_unchecked) if w),
        )


TASK_WEIGHTS = "task.weights.h5"  # a preset's task's own layers, beside the backbone's


class KerasArchiveSource(KerasWeightsSource):
    """A Keras `.keras` archive: its `model.weights.h5`, read in place, and its model config."""

    description = "Keras .keras archive"
    no_checksums = "is a Keras .keras archive, which records no checksums"

    @property
    def sidecar(self) -> Path | None:
        return None  # keras-orbax exports no archive


def _whole(array: h5_files.H5Array) -> Any:
    """A small dataset, read whole."""
    return array.read(tuple(slice(0, n) for n in array.shape), array.dtype)
