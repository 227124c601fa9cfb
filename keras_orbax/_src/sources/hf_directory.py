"""Restoring a keras-hub backbone from a Hugging Face directory (`config.json` + safetensors).

keras-hub's own converter decides which tensor goes to which variable, through which hook
(`hub_convert`). A tensor the hook leaves as it is, or only transposes, is read region by region
straight from the file (a transposed region is a box of the stored tensor); any other hook runs on
the host one tensor at a time, and each device gets only its region. The plan, the checks and the
all-or-nothing assignment are those of every other source.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from keras_orbax._src.format import checksum
from keras_orbax._src.format.step_record import METRIC, StepRecord, VariableRecord
from keras_orbax._src.read.contiguous import ComputedArray, ContiguousArray
from keras_orbax._src.sources import export_sidecar, safetensors_files
from keras_orbax._src.sources.base import FileCheck, Prepared, Source
from keras_orbax._src.sources.safetensors_files import SafetensorsTensor
from keras_orbax._src.storage.byte_runs import Index, aligned_empty
from keras_orbax.errors import CorruptCheckpointError

# Keras, JAX and the restore's modules load in the methods that restore: `resolve` asks
# `is_transformers_directory` of every location, `keras-orbax inspect`'s included (see `base`).
if TYPE_CHECKING:
    import keras

    from keras_orbax._src.model.matching import ReadRequest
    from keras_orbax._src.read.sharded_read import ReadPlan


def is_transformers_directory(path: Path) -> bool:
    """A Hugging Face model directory: its `config.json` has a `model_type`, beside safetensors.

    Raises:
        CorruptCheckpointError: a `config.json` beside safetensors that is not JSON.
    """
    config = path / "config.json"
    if not (path.is_dir() and config.is_file()):
        return False
    try:
        return "model_type" in json.loads(config.read_text())
    except (OSError, ValueError, RecursionError) as error:  # RecursionError: nested too deep
        if any((path / name).is_file() for name in safetensors_files.FILES):
            raise CorruptCheckpointError(
                f"'{config}' of the Hugging Face model directory '{path}' is unreadable: "
                f"{type(error).__name__}: {error}"
            ) from None
        return False


@dataclasses.dataclass(frozen=True)
class TransposedArray:
    """A stored tensor whose variable is `tensor.transpose(permutation)`: a region of the variable is
    the permuted region of the tensor, read as a box, then transposed into an aligned buffer."""

    stored: ContiguousArray
    permutation: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def dtype(self) -> np.dtype:
        return self.stored.dtype

    def check(self, indices: list[Index]) -> None:
        self.stored.check([])

    def read(self, index: Index, dtype: np.dtype) -> np.ndarray:
        source: list[slice] = [slice(None)] * len(index)
        for axis, stored_axis in enumerate(self.permutation):
            source[stored_axis] = index[axis]
        region = self.stored.read(tuple(source), dtype).transpose(self.permutation)
        out = aligned_empty(region.nbytes).view(region.dtype).reshape(region.shape)
        np.copyto(out, region)
        return out


class TransformersSource(export_sidecar.CheckedBySidecar, Source):
    """A Hugging Face model directory, listed by safetensors tensor name; restored into a keras-hub
    backbone as keras-hub's own converter assigns it."""

    kind = "transformers"
    description = "Hugging Face model directory"
    no_checksums = "is a Hugging Face directory, whose safetensors files record no checksums"

    def __init__(self, directory: Path) -> None:
        self.tensors = safetensors_files.read_directory(directory)
        variables = {
            name: VariableRecord(name, name, tuple(t.shape), str(np.dtype(t.dtype)), name)
            for name, t in self.tensors.items()
        }
        super().__init__(directory, StepRecord(step=0, variables=variables, format_version=0))

    @property
    def model_config(self) -> None:
        """Its `config.json` is Hugging Face's: keras-hub's `from_preset` builds the model."""
        return None

    def checked_by_sidecar(self) -> FileCheck | None:
        """Reads every tensor the sidecar file lists and checks it; None where there is none.

        Raises:
            CorruptCheckpointError: the sidecar cannot be read, or names each tensor and file
                that fails its CRC.
        """
        places = {name: (t.file, t.offset, t.nbytes) for name, t in self.tensors.items()}
        return export_sidecar.check(
            self.location / checksum.EXPORT_FILE, places, f"'{self.location}'"
        )

    def plan_reads(self, requests: Sequence[ReadRequest]) -> ReadPlan:
        from keras_orbax._src.read import sharded_read

        def stored(saved: VariableRecord) -> ContiguousArray:
            t = self.tensors[saved.key]
            return ContiguousArray(t.name, t.file, t.offset, t.shape, t.dtype)

        return sharded_read.plan_reads(self.location, requests, stored)

    def prepare(self, model: keras.Model, *, strict: bool) -> Prepared:
        """keras-hub's converter decides which tensor goes to which variable, through which hook.

        Raises:
            CheckpointMismatchError: keras-hub cannot convert this directory for `model`.
        """
        from keras_orbax._src.model import state_keys
        from keras_orbax._src.model.matching import make_plan
        from keras_orbax._src.read import sharded_read
        from keras_orbax._src.sources import hub_convert  # keras-hub is an optional extra

        state = state_keys.keyed_state(model)
        key_of = {id(v): k for k, v in state.variables.items()}
        record = StepRecord(step=0, variables={}, format_version=0)
        readers: dict[str, Any] = {}
        converted: dict[str, SafetensorsTensor] = {}  # by key: tensors the converter reshapes
        for ported in hub_convert.port_tensors(model, self.location):
            key = key_of[id(ported.variable)]
            shape = tuple(int(n) for n in ported.variable.shape)
            hook = hub_convert.classify_hook(ported)
            readers[key] = _reader(ported, hook, shape)
            name = ported.tensor.name
            # The checkpoint's side is the tensor as the converter turns it into the variable:
            # a config.json that describes other shapes than the tensors have is a mismatch here,
            # not a NumPy error from the hook halfway through the reads.
            saved_shape = hub_convert.converted_shape(ported, hook)
            if saved_shape != tuple(ported.tensor.shape):
                converted[key] = ported.tensor
            record.variables[key] = VariableRecord(
                key, name, saved_shape, str(readers[key].dtype), name, role=state.roles[key]
            )
        optional = {
            k for k in state.variables if "/seed_generators/" in k or state.roles[k] == METRIC
        }
        plan = make_plan(record, state, strict=strict, optional=frozenset(optional))
        reads = None
        if not plan.problems:
            requests = list(plan.reads.values())
            reads = sharded_read.plan_reads(self.location, requests, lambda r: readers[r.key])
        hint = ""
        if example := next((converted[k] for k in plan.mismatched if k in converted), None):
            hint = (
                "The checkpoint's shapes are its tensors as keras-hub's converter turns them into "
                f"the model's variables ({example.name} is stored as {tuple(example.shape)})."
            )
        return Prepared(record, state, plan, reads, tuple(plan.problems), hint)


def _reader(ported: Any, hook: Any, shape: tuple[int, ...]) -> Any:
    import jax

    from keras_orbax._src.compat import keras_compat
    from keras_orbax._src.sources import hub_convert
    from keras_orbax._src.sources.hub_hooks import HookKind

    tensor = ported.tensor
    stored = ContiguousArray(tensor.name, tensor.file, tensor.offset, tensor.shape, tensor.dtype)
    if not hook.casts and hook.kind is HookKind.IDENTITY and tensor.shape == shape:
        return stored
    if not hook.casts and hook.kind is HookKind.TRANSPOSE and hook.permutation is not None:
        permuted = tuple(tensor.shape[axis] for axis in hook.permutation)
        if permuted == shape:
            return TransposedArray(stored, tuple(hook.permutation), shape)
    dtype = np.dtype(jax.numpy.dtype(keras_compat.stored_dtype(ported.variable)))
    return ComputedArray(tensor.name, lambda: hub_convert.host_value(ported), shape, dtype)
