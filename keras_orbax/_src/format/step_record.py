"""The JSON record keras-orbax keeps beside the arrays of each step (see docs/format.md)."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any, Literal

from keras_orbax._src.compat.versions import distribution_version
from keras_orbax._src.format import json_checksum
from keras_orbax._src.format.dtypes import np_dtype

FORMAT_NAME = "keras_orbax"
FORMAT_VERSION = (
    2  # 2: keys in Keras's saving structure (`_keys`); 1: keras-orbax 0.1's (`_keys_v1`)
)
STATE = "state"  # Orbax checkpointable that holds the arrays

# What a saved variable is part of; decides how strictly it is matched (`model.matching`).
Role = Literal["model", "optimizer", "metric"]
MODEL: Role = "model"
OPTIMIZER: Role = "optimizer"
METRIC: Role = "metric"


@dataclasses.dataclass(frozen=True)
class VariableRecord:
    """One saved variable: where its array is and what it was when saved."""

    key: str
    path: str
    shape: tuple[int, ...]
    dtype: str
    array: str  # Orbax parameter name: the array's directory under `<step>/state/`
    layout: dict[str, Any] | None = None  # mesh_shape, axis_names, partition; None: one device
    role: str = MODEL  # "model", "optimizer" or "metric"

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np_dtype(self.dtype).itemsize


# The `extra` key of a `ModelCheckpoint` step naming its local tier's directory (absolute).
LOCAL_TIER = "local_directory"


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """Everything keras-orbax wrote about one step, besides the arrays."""

    step: int
    variables: dict[str, VariableRecord]
    epoch: int | None = None
    batch: int | None = None
    model_config: dict[str, Any] | None = None
    versions: dict[str, str] = dataclasses.field(default_factory=dict)
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    def to_json(self) -> dict[str, Any]:
        """The record as stored, with its checksum (`json_checksum`; JSON-ready; it shares its
        dicts with this record). Built field by field: `dataclasses.asdict` deep-copies, 0.5 s
        for 5000 variables."""
        record = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields = [f.name for f in dataclasses.fields(VariableRecord)]
        record["variables"] = [
            {name: getattr(v, name) for name in fields} for v in self.variables.values()
        ]
        return json_checksum.sealed(record)

    @classmethod
    def from_json(cls, record: Mapping[str, Any]) -> StepRecord:
        """Parses a record as stored; raises KeyError, TypeError or ValueError if it is malformed."""
        record = dict(record)
        variables = {}
        fields = {f.name for f in dataclasses.fields(VariableRecord)}
        for entry in record.pop("variables"):  # fields a newer writer added are ignored
            entry = {k: v for k, v in entry.items() if k in fields}
            entry["shape"] = tuple(int(n) for n in entry["shape"])
            entry.setdefault("role", v1_role(entry["key"]))  # 0.1 wrote no role: it is the prefix
            variables[str(entry["key"])] = VariableRecord(**entry)
        known = {f.name for f in dataclasses.fields(cls)}
        record.setdefault("format_version", 1)
        return cls(variables=variables, **{k: v for k, v in record.items() if k in known})


def versions() -> dict[str, str]:
    """Versions of the packages that wrote a checkpoint."""
    return dict(_versions())


@functools.cache  # 1 ms of a background save's blocking time otherwise
def _versions() -> dict[str, str]:
    names = ("keras-orbax", "keras", "jax", "jaxlib", "orbax-checkpoint", "tensorstore")
    return {name: distribution_version(name) or "unknown" for name in names}


def v1_role(key: str) -> str:
    """The role of a keras-orbax 0.1 key (format_version 1), from its first part."""
    group = key.split("/", 1)[0]
    return OPTIMIZER if group == "optimizer" else METRIC if group == "metrics" else MODEL
