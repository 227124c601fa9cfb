"""A process's part of a local step under `jax.distributed`: the shards its devices hold, nothing
of the other processes', so that each process's `local_directory` may be on its own machine.

```
<local_directory>/
  process_<i>/<step>/          this process's own part of step <step>
    part.json                  the step's record, each shard's key, region, offset and length,
                               the CRC-32 of part.bin; sealed with its own checksum
    part.bin                   the shards' bytes, one after the other (C order)
    data_state/process_<i>.json   this process's input position (`format/data_state.py`)
  process_<i-1>/<step>/        the replica of the previous process's part, as it sent it
```

A part is one payload on the wire and two files on disk, the same bytes: `pack` makes it from the
shards, `unpack` checks it (the seal of its manifest, the CRC of its data), `commit` writes it
under a temporary name, fsyncs and renames it, and `read` reads it back checked. Restoring takes
the regions this process's devices hold from it (`arrays`): the same mesh and layouts as when it
was saved, which a restart of the same job has.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from keras_orbax._src.format import crc, json_checksum
from keras_orbax._src.format.data_state import DATA_STATE, file_name
from keras_orbax._src.format.dtypes import np_dtype
from keras_orbax._src.format.step_record import StepRecord
from keras_orbax._src.storage import durable
from keras_orbax.errors import CheckpointMismatchError, CorruptCheckpointError

if TYPE_CHECKING:  # `inspect` and `verify` read parts without importing JAX
    import jax

MANIFEST = "part.json"
DATA = "part.bin"
KIND = "keras_orbax.process_part"
_LENGTH = struct.Struct("<Q")
_STAGED = ".partial"
Index = tuple[tuple[int, int], ...]  # (start, stop) per dimension
Payload = bytes | memoryview | np.ndarray  # a part's bytes: read from disk, packed or received


def folder(root: Path, process: int) -> Path:
    """Where process `process`'s parts (its own, or the replica a peer keeps) lie under `root`."""
    return root / f"process_{process}"


def is_process_tier(root: Path) -> bool:
    """Whether `root` is a local directory of parts written under `jax.distributed`."""
    return root.is_dir() and any(_process_of(p) is not None and p.is_dir() for p in root.iterdir())


def processes_in(root: Path) -> list[int]:
    """The processes whose parts (own or replica) `root` holds, ascending."""
    found = (_process_of(p) for p in root.iterdir() if p.is_dir()) if root.is_dir() else ()
    return sorted(p for p in found if p is not None)


def _process_of(path: Path) -> int | None:
    digits = path.name.removeprefix("process_")
    return int(digits) if path.name.startswith("process_") and digits.isdecimal() else None


def index_of(index: tuple[slice, ...], shape: tuple[int, ...]) -> Index:
    """A shard's region as (start, stop) per dimension."""
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))


def pack(
    process: int,
    record: StepRecord,
    shards: Iterable[tuple[str, Index, np.ndarray]],
    data_state: Mapping[str, Any] | None,
) -> np.ndarray:
    """Process `process`'s part, one buffer (`uint8`): its manifest (sealed), then every shard's
    bytes, copied once into it (the caller's arrays may be device buffers the next train step
    donates). It is packed on the train loop: the CRC is taken of the shards where they lie, and
    nothing is filled or copied twice."""
    shards = [(key, index, _bytes_of(data)) for key, index, data in shards]
    regions, offset = [], 0
    for key, index, data in shards:
        regions.append(
            {"key": key, "index": [list(i) for i in index], "offset": offset, "nbytes": data.size}
        )
        offset += data.size
    manifest = json_checksum.sealed(
        {
            "kind": KIND,
            "process": process,
            "step": record.step,
            "record": record.to_json(),
            "regions": regions,
            "nbytes": offset,
            "crc32": crc.CRC32.of(*(data for _, _, data in shards)),
            "data_state": None if data_state is None else json_checksum.sealed(data_state),
        }
    )
    text = json.dumps(manifest).encode()
    head = _LENGTH.pack(len(text)) + text
    part = np.empty(len(head) + offset, np.uint8)
    part[: len(head)] = np.frombuffer(head, np.uint8)
    at = len(head)
    for _, _, data in shards:
        part[at : at + data.size] = data
        at += data.size
    return part


def _bytes_of(data: np.ndarray) -> np.ndarray:
    """`data`'s bytes in C order, a view where it is C-contiguous."""
    return np.ascontiguousarray(data).reshape(-1).view(np.uint8)


def unpack(
    payload: Payload, where: str, *, check_data: bool = True
) -> tuple[dict[str, Any], memoryview]:
    """The manifest and data of a part, both checked (the data's CRC-32 only with `check_data`:
    a part this process has just packed is not read again).

    Raises:
        CorruptCheckpointError: the manifest does not parse or fails its seal, or the data its
            length or CRC-32; `where` names the part in the message.
    """
    view = np.frombuffer(payload, np.uint8).data  # any bytes-like payload, not copied
    try:
        (length,) = _LENGTH.unpack_from(view)
        manifest = json.loads(bytes(view[_LENGTH.size : _LENGTH.size + length]))
    except (struct.error, ValueError) as error:
        raise CorruptCheckpointError(f"{where} holds no readable part: {error}") from error
    problem = json_checksum.problem(manifest) if isinstance(manifest, dict) else "not an object"
    if problem is not None or manifest.get("kind") != KIND:
        raise CorruptCheckpointError(f"The manifest of {where} is damaged: {problem or 'kind'}.")
    data = view[_LENGTH.size + length :]
    if len(data) != manifest["nbytes"] or (check_data and crc.CRC32.of(data) != manifest["crc32"]):
        raise CorruptCheckpointError(
            f"The data of {where} is damaged: {len(data)} bytes with CRC-32 "
            f"{crc.CRC32.of(data):08x}, where {manifest['nbytes']} bytes with CRC-32 "
            f"{manifest['crc32']:08x} were written."
        )
    return manifest, data


def commit(into: Path, payload: Payload, *, checked: bool = False) -> Path:
    """Writes a part as step `<into>/<step>`: checked (unless `checked` already: this process
    packed it, or has just read it), staged under a temporary name, fsynced, then renamed.
    Returns the step's directory.

    Raises:
        CorruptCheckpointError: the payload fails its checks (nothing is written).
        OSError: the write failed; no step is left (the staged directory is removed).
    """
    manifest, data = unpack(payload, f"the part for '{into}'", check_data=not checked)
    step_dir = into / str(manifest["step"])
    staged = into / f"{manifest['step']}{_STAGED}"
    into.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(staged, ignore_errors=True)
    try:
        staged.mkdir()
        (staged / MANIFEST).write_text(json.dumps(manifest))
        (staged / DATA).write_bytes(data)
        if manifest["data_state"] is not None:
            (staged / DATA_STATE).mkdir()
            position = staged / DATA_STATE / file_name(manifest["process"])
            position.write_text(json.dumps(manifest["data_state"]))
        durable.fsync_tree(staged)
        if step_dir.exists():  # the same step written again (a rerun from an older step)
            shutil.rmtree(step_dir)
        os.rename(staged, step_dir)
        durable.fsync_path(into)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    return step_dir


def remove_staged(into: Path) -> None:
    """Removes what a killed commit left under `into` (only this process writes there)."""
    if into.is_dir():
        for path in into.iterdir():
            if path.name.endswith(_STAGED):
                shutil.rmtree(path, ignore_errors=True)


def steps(into: Path) -> list[int]:
    """The committed steps of a process's folder, ascending."""
    if not into.is_dir():
        return []
    return sorted(
        int(p.name)
        for p in into.iterdir()
        if p.name.isdecimal() and str(int(p.name)) == p.name and (p / MANIFEST).is_file()
    )


def steps_by_process(root: Path) -> dict[int, list[int]]:
    """The committed steps of every process folder (own or replica) under `root`, by process."""
    return {p: steps(folder(root, p)) for p in processes_in(root)}


def payload(step_dir: Path) -> np.ndarray:
    """The part at `step_dir`, as `pack` made it (checked by `unpack` where it is used), read
    into one buffer."""
    try:
        text = (step_dir / MANIFEST).read_bytes()
        with open(step_dir / DATA, "rb", buffering=0) as f:
            head = _LENGTH.pack(len(text)) + text
            part = np.empty(len(head) + os.fstat(f.fileno()).st_size, np.uint8)
            part[: len(head)] = np.frombuffer(head, np.uint8)
            view, filled = part.data[len(head) :], len(head)
            while view and (n := f.readinto(view)):
                view, filled = view[n:], filled + n
    except OSError as error:
        raise CorruptCheckpointError(f"Cannot read the part '{step_dir}': {error}") from error
    return part[:filled]  # a file cut short meanwhile: `unpack` finds its length wrong


def read(step_dir: Path) -> tuple[dict[str, Any], memoryview]:
    """The checked manifest and data of the part at `step_dir`.

    Raises:
        CorruptCheckpointError: a file is missing or fails its checks.
    """
    return unpack(payload(step_dir), f"'{step_dir}'")


def record_of(manifest: Mapping[str, Any]) -> StepRecord:
    return StepRecord.from_json(json_checksum.without(manifest["record"]))


def arrays(
    manifest: Mapping[str, Any],
    data: memoryview,
    targets: Mapping[str, jax.ShapeDtypeStruct],
    where: str,
) -> dict[str, jax.Array]:
    """Each target's array, its regions on this process's devices taken from the part.

    Raises:
        CheckpointMismatchError: a target's key is missing from the part, or its shape, dtype or
            the regions its devices hold differ from what was saved; the message lists each.
    """
    import jax

    record = record_of(manifest)
    regions: dict[str, dict[Index, Mapping[str, Any]]] = {}
    for region in manifest["regions"]:
        index = tuple((int(a), int(b)) for a, b in region["index"])
        regions.setdefault(region["key"], {})[index] = region
    problems = []
    for key, target in targets.items():
        saved = record.variables.get(key)
        if saved is None:
            problems.append(f"{key}: not in the part")
        elif saved.shape != tuple(target.shape) or np_dtype(saved.dtype) != target.dtype:
            problems.append(
                f"{key}: part {saved.shape} {saved.dtype}, model {tuple(target.shape)} "
                f"{target.dtype}"
            )
        else:
            held = target.sharding.addressable_devices_indices_map(tuple(target.shape))
            absent = [i for i in held.values() if index_of(i, target.shape) not in regions[key]]
            if absent:
                problems.append(f"{key}: the part holds none of region {absent[0]} (another mesh)")
    if problems:
        raise CheckpointMismatchError(
            f"Cannot restore from {where}: it was saved for another model or mesh:\n  "
            + "\n  ".join(problems)
            + "\nNo variable was modified. A local step restores only into the mesh and model "
            "it was saved from: restore the persistent directory's step instead.",
            problems,
        )
    result: dict[str, jax.Array] = {}
    for key, target in targets.items():
        dtype = np_dtype(record.variables[key].dtype)
        held = target.sharding.addressable_devices_indices_map(tuple(target.shape))
        buffers = []
        for device, index in held.items():
            region = regions[key][index_of(index, target.shape)]
            start, nbytes = region["offset"], region["nbytes"]
            shape = tuple(b - a for a, b in index_of(index, target.shape))
            value = np.frombuffer(data[start : start + nbytes], dtype).reshape(shape)
            buffers.append(jax.device_put(value, device))
        result[key] = jax.make_array_from_single_device_arrays(
            tuple(target.shape), target.sharding, buffers
        )
    return result
