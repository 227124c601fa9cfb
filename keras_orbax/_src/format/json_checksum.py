"""Checksums of the JSON a step keeps beside its arrays: its record and each process's input
position (docs/format.md, "Checksums").

The checksum is a field of the object itself, `"checksum": {"crc32": ..., "crc32c": ...}`: the CRCs
(`crc.RECORDED`) of the object's canonical JSON without that field (keys sorted, no spaces), as a
reader parses it back. The record lives inside Orbax's `_CHECKPOINT_METADATA`, beside fields Orbax
writes (its commit time), so no file's bytes can be checksummed whole; canonical JSON is the same
whoever serialized it. An object without the field (written before checksums) is read as it is.

```python
text = json.dumps(sealed({"kind": "arrays", "epoch": 1}))
problem(json.loads(text))   # None: it matches; else what is wrong, in words
```
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from keras_orbax._src.format.crc import RECORDED, strongest

FIELD = "checksum"


def _canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def sealed(value: Mapping[str, Any]) -> dict[str, Any]:
    """`value` with its checksum added (`FIELD`), computed over `value` as a reader parses it back
    (tuples become lists, int keys strings)."""
    body = _canonical(json.loads(json.dumps(value)))
    return {**value, FIELD: {algorithm.key: algorithm.of(body) for algorithm in RECORDED}}


def problem(value: Mapping[str, Any]) -> str | None:
    """What is wrong with the parsed object `value` against its checksum, in words; None if it
    matches or records none."""
    recorded = value.get(FIELD)
    if recorded is None:
        return None
    try:
        algorithm, expected = strongest(recorded)
    except (KeyError, TypeError, ValueError, AttributeError):
        return f"its checksum {str(recorded)[:80]!r} is not one keras-orbax writes"
    crc = algorithm.of(_canonical({k: v for k, v in value.items() if k != FIELD}))
    if crc == expected:
        return None
    return (
        f"its {algorithm.label} is {crc:#010x}, recorded {expected:#010x}: its content is not "
        "what was written"
    )


def without(value: Mapping[str, Any]) -> dict[str, Any]:
    """`value` without its checksum field."""
    return {k: v for k, v in value.items() if k != FIELD}
