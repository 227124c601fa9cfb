"""Any saved state the command line reads, as one listing of arrays by key, each readable alone.

A source is a keras-orbax checkpoint directory (its latest step, or `DIR@STEP`), a directory
written by Keras's `OrbaxCheckpoint` (keyed by tree path, `trainable_variables/dense/kernel`), or a
Keras weights file (`.weights.h5`, `.weights.json`, `.keras`, a keras-hub preset directory: keyed
by h5 dataset path, `layers/dense/vars/0`, which is the keras-orbax key of ordinary layers).

```python
source = open_source("/ckpt@100")
kernel = source.read("layers/dense/vars/0")  # a numpy array, read alone
```
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from keras_orbax._src.format import step_dirs
from keras_orbax._src.format.step_record import StepRecord, VariableRecord
from keras_orbax._src.model.state_keys import MODEL, OPTIMIZER
from keras_orbax._src.read import sharded_read
from keras_orbax._src.sources import h5_files, keras_checkpoint, keras_weights
from keras_orbax._src.storage import locations

_AT_STEP = re.compile(r"^(.*)@(\d+)$")


@dataclasses.dataclass(frozen=True)
class Source:
    """Arrays by key; `reads(requests)` plans reading them onto the requests' targets."""

    label: str
    kind: str  # "keras-orbax", "keras" (OrbaxCheckpoint) or "weights" (a Keras weights file)
    record: StepRecord
    plan_reads: Callable[[list[sharded_read.ReadRequest]], sharded_read.ReadPlan]

    @property
    def variables(self) -> dict[str, VariableRecord]:
        return self.record.variables

    def read_array(self, key: str, sharding: Any = None) -> jax.Array:
        """One array, whole, on one device (or on `sharding`)."""
        saved = self.variables[key]
        sharding = sharding or jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        target = jax.ShapeDtypeStruct(saved.shape, saved.dtype, sharding=sharding)
        arrays, _ = sharded_read.read_arrays(
            self.plan_reads([sharded_read.ReadRequest(saved, target)])
        )
        return arrays[key]

    def read(self, key: str) -> np.ndarray:
        return np.asarray(self.read_array(key))


def split_step(spec: str | os.PathLike) -> tuple[Any, int | None]:
    """`"/ckpt@100"` -> `(Path("/ckpt"), 100)`; a path that exists as given is taken whole.

    An object-store URL (`gs://`, `s3://`) gives an `etils.epath.Path`.
    """
    text = os.fspath(spec)
    match = _AT_STEP.match(text)
    if match and not locations.as_path(text).exists():
        return locations.as_path(match.group(1)), int(match.group(2))
    return locations.as_path(text), None


def open_source(spec: str | os.PathLike, step: int | None = None) -> Source:
    """The source `spec` names (`DIR`, `DIR@STEP`, a weights file); `step` as `@STEP`.

    Raises:
        CheckpointNotFoundError: no such path, or no such step.
        CorruptCheckpointError: its metadata cannot be read.
    """
    path, at = split_step(spec)
    step = at if at is not None else step
    file = None if locations.is_remote(path) else keras_weights.weights_file(path)
    if file is not None:
        return _weights_source(file)
    step, step_dir = step_dirs.step_path(path, step)
    label = f"{path}@{step}"
    if keras_checkpoint.is_keras_step(step_dir):
        record = keras_checkpoint.tree_record(step, step_dir)
        paths = keras_checkpoint.tree_keys(record)

        def keras_reads(requests: list[sharded_read.ReadRequest]) -> sharded_read.ReadPlan:
            return sharded_read.ReadPlan(step_dir, [], requests, keras_checkpoint.PYTREE, paths)

        return Source(label, "keras", record, keras_reads)
    record = step_dirs.read_record(step_dir)
    return Source(label, "keras-orbax", record, lambda r: sharded_read.plan_reads(step_dir, r))


def _weights_source(file: Path) -> Source:
    from keras_orbax.errors import CheckpointNotFoundError

    if not file.exists():
        raise CheckpointNotFoundError(f"Weights file does not exist: '{file}'")
    arrays = h5_files.h5_datasets(file)
    variables = {
        name: VariableRecord(
            name,
            name,
            tuple(int(n) for n in a.shape),
            str(a.dtype),
            name,
            role=OPTIMIZER if name.startswith("optimizer/") else MODEL,
        )
        for name, a in arrays.items()
    }
    config = None
    if file.name.endswith(".keras"):
        config = h5_files.archive_json(file, "config.json")
    record = StepRecord(step=0, variables=variables, model_config=config, format_version=0)

    def reads(requests: list[sharded_read.ReadRequest]) -> sharded_read.ReadPlan:
        return sharded_read.plan_reads(file, requests, lambda r: arrays[r.key])

    return Source(str(file), "weights", record, reads)
