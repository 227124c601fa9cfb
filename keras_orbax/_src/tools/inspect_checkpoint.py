"""`inspect`: what saved state holds, read from its metadata alone (no arrays, no Keras model)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from keras_orbax._src.compat import orbax_compat
from keras_orbax._src.format import data_state, process_parts, step_dirs
from keras_orbax._src.format.step_record import LOCAL_TIER, StepRecord
from keras_orbax._src.runtime.progress import human_bytes
from keras_orbax._src.sources import resolve
from keras_orbax._src.sources.base import Source
from keras_orbax._src.storage import locations, step_leftovers
from keras_orbax.errors import KerasOrbaxError


@dataclasses.dataclass(frozen=True)
class StepSummary:
    """One committed step: its epoch, the metrics saved with it, its array bytes and disk size;
    or, for a step whose record cannot be read, why (`damaged`: `verify` it for the details).

    `disk_bytes` counts every file of the step; `own_bytes` only those no other step shares (an
    incremental save hard-links the files unchanged since the step before): what deleting the
    step frees, and what `du` shows for it after the steps before it.
    """

    step: int
    epoch: int | None
    metrics: dict[str, Any]
    nbytes: int
    disk_bytes: int
    damaged: str | None = None
    own_bytes: int | None = None  # None: as `disk_bytes`
    batch: int | None = None  # batches of epoch `epoch + 1` done (a mid-epoch step); None: none


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """Saved state as recorded on disk: a checkpoint step, a weights file or a model directory.

    Attributes:
        directory: The resolved location: a checkpoint root, a file or a directory.
        steps: Every committed step, ascending (empty for weights files and model directories).
        step: The step described (None for weights files and model directories).
        record: Its record: epoch, versions, model config and one entry per array, keyed as that
            kind keys them (Keras's `OrbaxCheckpoint`: tree paths; Keras weights files: h5
            dataset paths; Hugging Face directories: tensor names).
        summaries: Epoch, metrics and sizes of every committed step.
        disk_bytes: The bytes of every committed step on disk, a file shared by several steps
            (hard links) counted once, as `du` counts them.
        writer: `"keras-orbax"`, `"keras"` (Keras's `OrbaxCheckpoint`, `save_weights`,
            `model.save`), `"keras-hub"` (a preset) or `"transformers"`.
        kind: Which kind of source (`"keras-orbax"`, `"keras-checkpoint"`, `"keras-weights"`,
            `"keras-preset"`, `"transformers"`).
        keras_state: What the step's layers store besides their variables (`keras_state/`):
            one line per value (`layers/lookup/vars/idf_weights`: shape, dtype) or asset file
            (`layers/lookup/vocabulary.txt`: bytes), or why it cannot be read.
        data_position: The input's position saved with the step by `ModelCheckpoint`, per
            process: the kind of input, the epoch and the batches of it done (empty: none saved).
        leftovers: What saves left beside the steps, one line each: a killed save's staging
            directory (`<step>.orbax-checkpoint-tmp`, taking disk space), a step an overwrite
            moved aside (empty: nothing).
        parts: For a local tier written under `jax.distributed`: the steps of each process's
            part this directory holds (its own process's, and the replica of its peer's), by
            folder (`process_1`); empty otherwise.
        local_tier: For a `ModelCheckpoint` directory with a local tier beside it
            (`local_directory`): that directory and the steps it holds here (`steps`; by
            process folder under `jax.distributed`, `parts`), or `missing` where this machine
            has none of it; empty otherwise.
    """

    directory: Path
    steps: tuple[int, ...]
    step: int | None
    record: StepRecord
    summaries: tuple[StepSummary, ...] = ()
    writer: str = "keras-orbax"
    kind: str = "keras-orbax"
    disk_bytes: int = 0  # of every step, a file that steps share counted once (as `du` counts)
    keras_state: dict[str, str] = dataclasses.field(default_factory=dict)
    data_position: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)
    leftovers: tuple[str, ...] = ()
    parts: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    local_tier: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes of all arrays of the step (one copy, whatever the layout)."""
        return sum(v.nbytes for v in self.record.variables.values())

    def __str__(self) -> str:
        record = self.record
        where = f"steps {list(self.steps)}; step {self.step}, " if self.step is not None else ""
        count = len(record.variables)
        lines = [
            f"{self.directory}: {where}"
            + (f"{_position(record.epoch, record.batch)}, " if record.epoch is not None else "")
            + f"{count} {'variable' if count == 1 else 'variables'}, {human_bytes(self.nbytes)}",
        ]
        for process, position in self.data_position.items():
            lines.append(
                f"input position: process {process}: {position['kind']}, "
                f"{_position(position['epoch'], position['batch'])}"
            )
        if record.versions:
            lines.append(f"written by {', '.join(f'{k} {v}' for k, v in record.versions.items())}")
        else:
            archive = self.kind == "keras-weights" and self.directory.name.endswith(".keras")
            lines.append(
                f"written by {'Keras (a .keras archive)' if archive else _WRITTEN_BY[self.kind]}"
            )
        for folder, steps in self.parts.items():
            lines.append(f"local tier: {folder}/ holds the parts of steps {list(steps)}")
        if self.local_tier:
            lines.append(_local_tier_line(self.local_tier))
        if self.summaries:
            lines.extend(self._step_table())
        lines += [f"left beside the steps: {line}" for line in self.leftovers]
        meshes = {_mesh(v.layout) for v in record.variables.values() if v.layout}
        mesh = f" on {next(iter(meshes))}" if len(meshes) == 1 else ""  # said once, not per row
        lines.append(f"step {self.step}{mesh}:" if self.step is not None else f"arrays{mesh}:")
        rows = [
            (key, v.path, str(v.shape), v.dtype, human_bytes(v.nbytes), _where(v.layout, mesh))
            for key, v in record.variables.items()
        ]
        widths = [max((len(r[i]) for r in rows), default=0) for i in range(5)]
        for row in rows:
            lines.append(
                "  "
                + "  ".join(f"{c:<{w}}" for c, w in zip(row, widths, strict=False))
                + "  "
                + row[5]
            )
        if self.keras_state:
            lines.append("kept besides the variables (keras_state/):")
            width = max(len(entry) for entry in self.keras_state)
            lines += [f"  {e:<{width}}  {what}" for e, what in self.keras_state.items()]
        return "\n".join(lines)

    def _step_table(self) -> list[str]:
        """One row per step: epoch, array bytes, bytes on disk and those it alone holds, metrics."""
        lines = [
            f"  {'step':>8}  {'epoch':>5}  {'batch':>5}  {'arrays':>10}  {'on disk':>10}  "
            f"{'its own':>10}  metrics"
        ]
        for s in self.summaries:
            metrics = " ".join(f"{k}={_number(v)}" for k, v in s.metrics.items())
            if s.damaged is not None:
                metrics = f"damaged: {s.damaged.splitlines()[0]}"
            # As the save lines number them: a mid-epoch step's epoch from 1, with its batches.
            epoch = "-" if s.epoch is None else str(s.epoch + 1 if s.batch else s.epoch)
            batch = str(s.batch) if s.batch else "-"
            own = s.disk_bytes if s.own_bytes is None else s.own_bytes
            lines.append(
                f"  {s.step:>8}  {epoch:>5}  {batch:>5}  {human_bytes(s.nbytes):>10}  "
                f"{human_bytes(s.disk_bytes):>10}  {human_bytes(own):>10}  {metrics}".rstrip()
            )
        if any(s.own_bytes is not None and s.own_bytes < s.disk_bytes for s in self.summaries):
            lines.append(
                f"  {human_bytes(self.disk_bytes)} on disk for all steps; 'its own' is what no "
                "other step shares (an incremental step\n  hard-links the files unchanged since "
                "the step before): what deleting that step frees."
            )
        return lines

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready description: the steps and every variable of the step described."""
        return {
            "directory": str(self.directory),
            "writer": self.writer,
            "kind": self.kind,
            "steps": [dataclasses.asdict(s) for s in self.summaries],
            "step": self.step,
            "epoch": self.record.epoch,
            "batch": self.record.batch,
            "data_position": {
                str(process): {k: position[k] for k in ("kind", "epoch", "batch")}
                for process, position in self.data_position.items()
            },
            "nbytes": self.nbytes,
            "disk_bytes": self.disk_bytes,
            "versions": self.record.versions,
            "keras_state": self.keras_state,
            "leftovers": list(self.leftovers),
            "parts": {folder: list(steps) for folder, steps in self.parts.items()},
            "local_tier": self.local_tier,
            "variables": [
                {**dataclasses.asdict(v), "shape": list(v.shape), "nbytes": v.nbytes}
                for v in self.record.variables.values()
            ],
        }


def inspect(directory: str | os.PathLike, step: int | None = None) -> CheckpointInfo:
    """Describes saved state: a checkpoint's committed steps (epoch, metrics, sizes), and for one
    step, or for a weights file, preset or Hugging Face directory, its arrays' keys, Keras paths,
    shapes, dtypes, bytes and layouts.

    Reads only metadata: no array is loaded and no model is needed.

    Args:
        directory: Any location `restore_sharded` takes: a checkpoint root or one of its steps
            (`ckpt/8`, `ckpt@8`), a directory written by `keras.callbacks.OrbaxCheckpoint`, a
            `.weights.h5`, `.weights.json` or `.keras` file, a keras-hub preset or a Hugging Face
            model directory. Or a `ModelCheckpoint`'s `local_directory` written under
            `jax.distributed` (one machine's): the parts it holds by process, and the step's
            record. A `ModelCheckpoint` directory's description names the local tier beside it
            and the steps it holds on this machine (`local_tier`).
        step: The step to describe; `None` means the latest committed one.

    Example:
    ```python
    print(keras_orbax.inspect("/ckpt"))
    ```
    """
    from keras_orbax._src.tools import tier_tools  # it builds on this module's types

    tier = tier_tools.located(directory)
    if tier is not None:
        return tier_tools.inspect(tier, step)
    source = resolve.open_source(directory, step)
    summaries = []
    files = _step_files(source, source.steps)
    for each in source.steps:
        step_dir = source.step_directory(each)
        disk, own = _disk_bytes(step_dir, files, each)
        try:
            opened = source if each == source.step else resolve.open_source(source.location, each)
        except KerasOrbaxError as error:  # another step's damage: said in its row, not raised
            summaries.append(StepSummary(each, None, {}, 0, disk, str(error), own))
            continue
        summaries.append(
            StepSummary(
                each,
                opened.record.epoch,
                orbax_compat.step_metrics(step_dir),
                sum(v.nbytes for v in opened.record.variables.values()),
                disk,
                own_bytes=own,
                batch=opened.record.batch or None,
            )
        )
    return CheckpointInfo(
        directory=source.where,
        steps=source.steps,
        step=source.step,
        record=source.record,
        summaries=tuple(summaries),
        writer=_WRITERS[source.kind],
        kind=source.kind,
        disk_bytes=_total_bytes(files) if files else sum(s.disk_bytes for s in summaries),
        keras_state=_keras_state(source),
        data_position=(
            data_state.read_all(source.step_directory(source.step))
            if source.kind == "keras-orbax" and source.step is not None
            else {}
        ),
        leftovers=step_leftovers.notes(source.location) if source.kind == "keras-orbax" else (),
        local_tier=_local_tier(source.record),
    )


def _local_tier(record: StepRecord) -> dict[str, Any]:
    """The local tier a `ModelCheckpoint` step names, and the steps it holds on this machine."""
    directory = record.extra.get(LOCAL_TIER)
    if not isinstance(directory, str):
        return {}
    root = Path(directory)
    if not root.is_dir():
        return {"directory": directory, "missing": True}
    if process_parts.is_process_tier(root):
        parts = process_parts.steps_by_process(root)
        return {"directory": directory, "parts": {f"process_{p}": s for p, s in parts.items()}}
    return {"directory": directory, "steps": step_dirs.committed_steps(root)}


def _local_tier_line(tier: dict[str, Any]) -> str:
    where = f"local tier: {tier['directory']}"
    if tier.get("missing"):
        return f"{where}: not on this machine (a local tier is each machine's own)"
    if "parts" in tier:
        held = "; ".join(f"{folder}/ steps {steps}" for folder, steps in tier["parts"].items())
        return f"{where}: {held}"
    return f"{where}: steps {tier['steps']}"


def _position(epoch: int, batch: int | None) -> str:
    """Where in training, numbered as the save lines number it (`Epoch 2: saving ...`, `Epoch 1,
    batch 3: saving ...`): `epoch` epochs done, or `batch` batches of the next one."""
    return f"epoch {epoch + 1}, batch {batch}" if batch else f"epoch {epoch}"


def _keras_state(source: Source) -> dict[str, str]:
    """`CheckpointInfo.keras_state` of `source`'s step (its files are small: read whole)."""
    try:
        own = source.own_state()
    except KerasOrbaxError as error:
        return {"keras_state/": f"damaged: {str(error).splitlines()[0]}"}
    if own is None:
        return {}
    values = {k: f"value  {tuple(v.shape)} {v.dtype}" for k, v in own.values.items()}
    return values | {k: f"asset  {human_bytes(len(data))}" for k, data in own.assets.items()}


_WRITTEN_BY = {
    "keras-orbax": "keras-orbax",
    "keras-checkpoint": "keras.callbacks.OrbaxCheckpoint",
    "keras-weights": "Keras (a weights file)",
    "keras-preset": "keras-hub (a preset)",
    "transformers": "Hugging Face transformers (safetensors)",
}
_WRITERS = {
    "keras-orbax": "keras-orbax",
    "keras-checkpoint": "keras",
    "keras-weights": "keras",
    "keras-preset": "keras-hub",
    "transformers": "transformers",
}


_Files = dict[int, dict[tuple[int, int], int]]  # step -> (device, inode) -> size


def _step_files(source: Source, steps: tuple[int, ...]) -> _Files:
    """Each local step's files, by inode: arrays of one shape share a hard-linked `zarr.json`
    within a step, and an incremental step hard-links the shard files of the step before."""
    if locations.is_remote(source.location):
        return {}  # a store copies objects on the server: no step shares another's bytes
    found = {}
    for step in steps:
        stats = [f.stat() for f in source.step_directory(step).rglob("*") if f.is_file()]
        found[step] = {(s.st_dev, s.st_ino): s.st_size for s in stats}
    return found


def _disk_bytes(step_dir: Any, files: _Files, step: int) -> tuple[int, int | None]:
    """The step's bytes on disk, and those no other step shares (None where unknown)."""
    if step not in files:
        return locations.total_bytes(step_dir), None
    mine = files[step]
    others = [held for other, held in files.items() if other != step]
    own = sum(size for inode, size in mine.items() if not any(inode in h for h in others))
    return sum(mine.values()), own


def _total_bytes(files: _Files) -> int:
    return sum({inode: size for held in files.values() for inode, size in held.items()}.values())


def _mesh(layout: dict[str, Any]) -> str:
    return f"mesh {tuple(layout['mesh_shape'])} {tuple(layout['axis_names'])}"


def _where(layout: dict[str, Any] | None, mesh: str) -> str:
    """Where an array was: one device, or its partition (on its mesh, unless `mesh` says it)."""
    if not layout:
        return "one device"
    partition = f"partition {tuple(layout['partition'])}"
    return partition if mesh else f"{_mesh(layout)} {partition}"


def _number(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)
