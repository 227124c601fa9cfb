"""A step's `keras_state/`: what Keras's saving keeps of a model besides its variables.

A layer's `save_own_variables` may store values that are no variable (a NumPy array: a lookup
layer's IDF weights, a custom layer's table), and its `save_assets` may write files (a lookup
layer's vocabulary). Keras's `.keras` format keeps both; a step keeps them in `<step>/keras_state/`,
written by process 0 (they are small and the same on every process), one flat folder:

    manifest.json       {"values": {entry: file}, "assets": {entry: file},
                         "files": {file: {"bytes": n, "crc32": c}}}
    value_0.npy         a value, as `numpy.save` writes it (no pickle)
    asset_0             an asset file's bytes

A value's entry is where `.weights.h5` would put it (`layers/index_lookup/vars/idf_weights`), an
asset's the group and the file's path inside the layer's assets folder
(`layers/string_lookup/vocabulary.txt`), as `.keras` archives do under `assets/`.
"""

from __future__ import annotations

import dataclasses
import io
import json
import posixpath
import zlib
from typing import Any

import numpy as np

from keras_orbax.errors import CorruptCheckpointError

KERAS_STATE = "keras_state"  # the Orbax checkpointable (a folder of the step) holding it
MANIFEST = "manifest.json"


@dataclasses.dataclass(frozen=True)
class OwnState:
    """Values stored by `save_own_variables` that are no variable, and files from `save_assets`.

    Attributes:
        values: By entry, `<group>/vars/<key>` (the group as `.weights.h5` names it).
        assets: By entry, `<group>/<path inside the layer's assets folder>`: the file's bytes.
    """

    values: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    assets: dict[str, bytes] = dataclasses.field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.values or self.assets)

    def files(self) -> dict[str, bytes]:
        """Every file of `keras_state/` by name, the manifest included."""
        files: dict[str, bytes] = {}
        values, assets = {}, {}
        for i, (entry, value) in enumerate(self.values.items()):
            values[entry] = name = f"value_{i}.npy"
            buffer = io.BytesIO()
            np.save(buffer, value, allow_pickle=False)
            files[name] = buffer.getvalue()
        for i, (entry, data) in enumerate(self.assets.items()):
            assets[entry] = name = f"asset_{i}"
            files[name] = data
        sums = {
            name: {"bytes": len(data), "crc32": zlib.crc32(data)} for name, data in files.items()
        }
        manifest = {"values": values, "assets": assets, "files": sums}
        return {MANIFEST: json.dumps(manifest, indent=1).encode(), **files}

    @property
    def nbytes(self) -> int:
        return sum(len(data) for data in self.files().values())


def read(step_dir: Any) -> OwnState | None:
    """The `keras_state/` of the step at `step_dir`, each file checked against its size and
    CRC-32; None where the step has none (nothing stored, or saved before keras-orbax kept it).

    Raises:
        CorruptCheckpointError: a file is missing, of another size or checksum, or unreadable.
    """
    folder = step_dir / KERAS_STATE
    if not (folder / MANIFEST).exists():
        return None
    what = f"Checkpoint step '{step_dir}'"
    try:
        manifest = json.loads((folder / MANIFEST).read_bytes())
        expected = manifest["files"]
        files = {name: (folder / _plain(name)).read_bytes() for name in expected}
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as error:
        raise CorruptCheckpointError(
            f"{what}: its {KERAS_STATE}/ (layers' non-variable state and assets) is unreadable: "
            f"{type(error).__name__}: {error}. No variable was modified."
        ) from error
    bad = [
        name
        for name, data in files.items()
        if len(data) != expected[name]["bytes"] or zlib.crc32(data) != expected[name]["crc32"]
    ]
    if bad:
        raise CorruptCheckpointError(
            f"{what}: {len(bad)} file(s) of {KERAS_STATE}/ do not match the size or CRC-32 "
            f"recorded in its {MANIFEST}: {', '.join(f'{KERAS_STATE}/{n}' for n in bad)}. "
            "No variable was modified."
        )
    values = {
        entry: np.load(io.BytesIO(files[name]), allow_pickle=False)
        for entry, name in manifest["values"].items()
    }
    return OwnState(values, {entry: files[name] for entry, name in manifest["assets"].items()})


def _plain(name: str) -> str:
    """`name` if it names a file of the folder itself, not one elsewhere (`../x`, `/x`)."""
    if not name or posixpath.basename(name) != name or name in (".", ".."):
        raise ValueError(f"not a file name of {KERAS_STATE}/: {name!r}")
    return name


class StepFiles:
    """`state` as an Orbax `StatefulCheckpointable`: its files written into the step's
    `keras_state/` by process 0, inside Orbax's save, so that they commit with the step.
    (keras-orbax reads them with `read`, not through Orbax.)"""

    def __init__(self, state: OwnState) -> None:
        self._files = state.files()  # now: the save may finish in the background

    async def save(self, directory: Any) -> Any:
        async def write_files() -> None:
            path = await directory.await_creation()
            from keras_orbax._src.runtime import multihost  # JAX: not for `inspect`'s reads

            if multihost.is_primary():
                for name, data in self._files.items():
                    (path / name).write_bytes(data)

        return write_files()

    async def load(self, directory: Any) -> Any:
        raise NotImplementedError(f"{KERAS_STATE}/ is read by keras_orbax, not through Orbax")
