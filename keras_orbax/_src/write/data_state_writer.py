"""Writes each process's input position into the step being saved, as the Orbax checkpointable
`data_state` (`format/data_state.py`): in the step's temporary directory, so that Orbax's commit of
the step commits it too, and the step's durability pass fsyncs it."""

from __future__ import annotations

import json
from collections.abc import Awaitable
from typing import Any

import jax
import orbax.checkpoint.experimental.v1 as ocp

from keras_orbax._src.format import json_checksum
from keras_orbax._src.format.data_state import DATA_STATE, KINDS, file_name


class DataStateHandler(ocp.handlers.CheckpointableHandler):
    """Orbax's handler for a position: every process writes its own file (Orbax's `JsonHandler`
    writes on the primary process only)."""

    async def save(self, directory: Any, checkpointable: dict[str, Any]) -> Awaitable[None]:
        process = jax.process_index()
        text = json.dumps(json_checksum.sealed(checkpointable))

        async def write() -> None:
            path = await directory.await_creation()
            (path / file_name(process)).write_text(text)

        return write()

    async def load(self, directory: Any, abstract_checkpointable: Any = None) -> Awaitable[Any]:
        process = jax.process_index()

        async def read() -> Any:
            return json_checksum.without(json.loads((directory / file_name(process)).read_text()))

        return read()

    async def metadata(self, directory: Any) -> None:
        return None

    def is_handleable(self, checkpointable: Any) -> bool:
        return isinstance(checkpointable, dict) and checkpointable.get("kind") in KINDS

    def is_abstract_handleable(self, abstract_checkpointable: Any) -> bool | None:
        return None


def register(registry: Any) -> Any:
    """Adds the handler of `data_state` to an Orbax handler registry; returns the registry."""
    registry.add(DataStateHandler, checkpointable_name=DATA_STATE)
    return registry
