"""Validates a step's keras-orbax record before anything is built from it.

The record is untrusted JSON: a damaged or hand-edited file must give a clear error, never a
`TypeError` from deep inside a restore, a read outside the step directory, or an allocation sized
from a number nobody checked. `record_problems` returns one line per problem, naming the variable.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeGuard

from keras_orbax._src.format.dtypes import np_dtype

MAX_ELEMENTS = 2**48  # per variable: ~1 PB of float32, far beyond any model, far below overflow
KNOWN_DTYPES = frozenset(
    {
        "bool",
        "int4",
        "uint4",
        "int8",
        "uint8",
        "int16",
        "uint16",
        "int32",
        "uint32",
        "int64",
        "uint64",
        "float16",
        "bfloat16",
        "float32",
        "float64",
        "complex64",
        "complex128",
        "float8_e4m3fn",
        "float8_e4m3fnuz",
        "float8_e4m3b11fnuz",
        "float8_e5m2",
        "float8_e5m2fnuz",
    }
)
_VARIABLE_FIELDS = {"key": str, "path": str, "shape": list, "dtype": str, "array": str}


def record_problems(record: Any, max_version: int) -> list[str]:
    """Everything wrong with a record as read from JSON; `[]` if it can be used.

    Checks the format version (an int from 1 to `max_version`), the step, epoch and batch (ints),
    and each variable: key (unique, relative, no `.`/`..` parts), array name (unique, one plain
    path component: it names a directory under the step), shape (non-negative ints whose product
    is at most `MAX_ELEMENTS`), dtype (a known numeric dtype).
    """
    if not isinstance(record, Mapping):
        return [f"the record is a {type(record).__name__}, not a JSON object"]
    version = record.get("format_version")
    if not _is_int(version) or not 1 <= version <= max_version:
        return [
            f"unknown format_version {version!r}: this version of keras-orbax reads formats 1 to "
            f"{max_version}. If the checkpoint is newer, upgrade keras-orbax."
        ]
    problems = [
        f"{name} is {record.get(name)!r}, not an int"
        for name in ("step", "epoch", "batch")
        if not (_is_int(record.get(name)) or (name != "step" and record.get(name) is None))
    ]
    for name in ("model_config", "versions", "extra"):
        if record.get(name) is not None and not isinstance(record.get(name), Mapping):
            problems.append(f"{name} is a {type(record.get(name)).__name__}, not a JSON object")
    variables = record.get("variables")
    if not isinstance(variables, list):
        return [*problems, f"variables is {type(variables).__name__}, not a list"]
    keys: set[str] = set()
    arrays: set[str] = set()
    for i, entry in enumerate(variables):
        problems += _variable_problems(i, entry, keys, arrays)
    return problems


def _variable_problems(i: int, entry: Any, keys: set[str], arrays: set[str]) -> list[str]:
    if not isinstance(entry, Mapping):
        return [f"variables[{i}] is a {type(entry).__name__}, not a JSON object"]
    wrong = [
        f"{name} is {entry.get(name)!r}"
        for name, kind in _VARIABLE_FIELDS.items()
        if not isinstance(entry.get(name), kind)
    ]
    key = entry.get("key")
    where = f"variable {key!r}" if isinstance(key, str) else f"variables[{i}]"
    if isinstance(key, str) and isinstance(entry.get("path"), str):
        where += f" ({entry['path']})"
    if wrong:
        return [f"{where}: {', '.join(wrong)}"]
    key = entry["key"]
    problems = []
    if not _plain_key(key):
        problems.append(f"{where}: the key is not a relative '/'-separated name")
    if key in keys:
        problems.append(f"{where}: the key appears twice")
    keys.add(key)
    array = entry["array"]
    if not plain_name(array):
        problems.append(
            f"{where}: array name {array!r} is not a plain name inside the step directory"
        )
    elif array in arrays:
        problems.append(f"{where}: array {array!r} is named by two variables")
    arrays.add(array)
    shape = entry["shape"]
    if not all(_is_int(n) and n >= 0 for n in shape):
        problems.append(f"{where}: shape {shape!r} is not a list of non-negative ints")
    elif _product(shape) > MAX_ELEMENTS:
        problems.append(f"{where}: shape {shape!r} has more than 2**48 elements")
    if entry["dtype"] not in KNOWN_DTYPES or not _parses(entry["dtype"]):
        problems.append(f"{where}: unknown dtype {entry['dtype']!r}")
    if entry.get("layout") is not None and not isinstance(entry.get("layout"), Mapping):
        problems.append(f"{where}: layout is not a JSON object")
    return problems


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _plain_key(key: str) -> bool:
    return bool(key) and "\0" not in key and all(p not in ("", ".", "..") for p in key.split("/"))


def plain_name(name: str) -> bool:
    """One path component: no separator, not `.`/`..`, nothing a filesystem reads specially."""
    return (
        name not in ("", ".", "..")
        and not any(c in name for c in "/\\\0")
        and not name.startswith("~")
    )


def _product(shape: list[int]) -> int:
    total = 1
    for n in shape:
        total *= n
    return total


def _parses(name: str) -> bool:
    try:
        np_dtype(name)
    except TypeError:
        return False
    return True
