"""Damaged checkpoints: truncated, deleted, bit-flipped and hand-edited files.

Each case is a typed error from `keras_orbax.errors` that names the file or variable, and the
model keeps every value it had (all variables, optimizer state included), or, where the damaged
byte is one restore never uses, a restore whose values equal the saved ones exactly.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import hypothesis
import keras
import numpy as np
import pytest
from hypothesis import strategies as st

import keras_orbax
from keras_orbax._src.format import json_checksum
from keras_orbax.errors import CorruptCheckpointError, KerasOrbaxError, UnsupportedVersionError
from tests import _models

STEP = 3
FAST_FLIPS = hypothesis.settings(
    max_examples=12, deadline=None, derandomize=True, database=None, print_blob=True
)


@pytest.fixture(scope="module")
def originals(tmp_path_factory) -> dict[str, Path]:
    """One checkpoint of a compiled `mlp` (optimizer built) per format, saved on a (2, 4) mesh."""
    previous = keras.distribution.distribution()
    keras.distribution.set_distribution(_models.model_parallel((2, 4)))
    try:
        model = _model()
        _models.fill_arange(model)
        root = tmp_path_factory.mktemp("damage")
        with _models.one_file_per_shard():  # the tests damage the files of single shards
            for fmt in ("fast", "compact"):
                keras_orbax.save(model, root / fmt, step=STEP, format=fmt)
        return {"fast": root / "fast", "compact": root / "compact", "values": _state(model)}
    finally:
        keras.distribution.set_distribution(previous)


@pytest.fixture
def mesh(distribution):
    distribution(_models.model_parallel((2, 4)))


def _model() -> keras.Model:
    model = _models.compile_adam(_models.mlp())
    model.optimizer.build(model.trainable_variables)
    return model


def _state(model: keras.Model) -> list[np.ndarray]:
    return _models.values(model.variables + model.optimizer.variables)


def _copy(originals: dict, fmt: str, tmp_path: Path) -> Path:
    directory = tmp_path / fmt
    shutil.copytree(originals[fmt], directory)
    return directory


def restore_or_untouched(directory: Path, saved: list[np.ndarray]) -> KerasOrbaxError | None:
    """Restores a fresh model from `directory`: returns the typed error it raised, after checking
    that no value changed, or None after checking that every value equals the saved one."""
    model = _model()
    before = _state(model)
    try:
        keras_orbax.restore_sharded(model, directory)
    except KerasOrbaxError as error:
        _assert_all_equal(_state(model), before)
        return error
    _assert_all_equal(_state(model), saved)
    return None


def _assert_all_equal(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)


# -- files: truncated, deleted, emptied -----------------------------------------------------------

KERNEL = "state/layers.dense.vars.0"  # where `save` put the hidden kernel today
_FILE_CASES: list[tuple[str, str, str, Callable[[Path], None], type, str]] = []


def _case(fmt: str, file: str, damage: str, error: type, match: str) -> None:
    def damaged(path: Path) -> None:
        if damage == "delete":
            path.unlink()
        elif damage == "truncate":
            with open(path, "r+b") as f:
                f.truncate(path.stat().st_size // 2)
        elif damage == "empty":
            path.write_bytes(b"")

    _FILE_CASES.append((fmt, file, damage, damaged, error, match))


for _damage in ("delete", "truncate", "empty"):
    _case("fast", "_CHECKPOINT_METADATA", _damage, CorruptCheckpointError, r"_CHECKPOINT_METADATA")
    _case(
        "fast",
        f"{KERNEL}/c/1/2",
        _damage,
        CorruptCheckpointError,
        r"1 shard file is missing or truncated:\n  .*layers/dense/vars/0.*c/1/2",
    )
    _case("fast", f"{KERNEL}/zarr.json", _damage, CorruptCheckpointError, r"layers/dense/vars/0")
    _case(
        "compact", "_CHECKPOINT_METADATA", _damage, CorruptCheckpointError, "_CHECKPOINT_METADATA"
    )
    _case("compact", "state/_METADATA", _damage, CorruptCheckpointError, r"layers/dense/vars/0")
    _case(
        "compact", "state/manifest.ocdbt", _damage, CorruptCheckpointError, r"layers/dense/vars/0"
    )


@pytest.mark.parametrize(
    ("fmt", "file", "damage", "damaged", "error", "match"),
    _FILE_CASES,
    ids=[f"{c[0]}-{c[1].rsplit('/', 2)[-1]}-{c[2]}" for c in _FILE_CASES],
)
def test_damaged_file_is_a_typed_error_and_the_model_is_untouched(
    originals, tmp_path, mesh, fmt, file, damage, damaged, error, match
):
    directory = _copy(originals, fmt, tmp_path)
    damaged(directory / str(STEP) / file)
    caught = restore_or_untouched(directory, originals["values"])
    assert isinstance(caught, error), caught
    assert re.search(match, str(caught)), str(caught)


def test_files_the_fast_format_never_reads_may_go(originals, tmp_path, mesh):
    """Orbax's own tree metadata is not needed by the fast reader: deleting it loses nothing."""
    directory = _copy(originals, "fast", tmp_path)
    (directory / str(STEP) / "state" / "_METADATA").unlink()
    (directory / str(STEP) / "state" / "_sharding").unlink()
    assert restore_or_untouched(directory, originals["values"]) is None


# -- a record that lies ---------------------------------------------------------------------------


def _edit_record(directory: Path, edit: Callable[[dict], None]) -> None:
    """Edits the step's record as a writer that lies would write it: with its checksum matching
    (`json_checksum`), so that only the record's own checks can tell."""
    path = directory / str(STEP) / "_CHECKPOINT_METADATA"
    metadata = json.loads(path.read_text())
    record = json_checksum.without(metadata["custom_metadata"]["keras_orbax"])
    edit(record)
    metadata["custom_metadata"]["keras_orbax"] = json_checksum.sealed(record)
    path.write_text(json.dumps(metadata))


def _set(field: str, value: object) -> Callable[[dict], None]:
    return lambda record: record.__setitem__(field, value)


def _set_kernel(field: str, value: object) -> Callable[[dict], None]:
    def edit(record: dict) -> None:
        (kernel,) = [v for v in record["variables"] if v["path"] == "hidden/kernel"]
        kernel[field] = value

    return edit


RECORD_CASES = {
    "format_version_text": (_set("format_version", "2"), r"unknown format_version '2'"),
    "format_version_zero": (_set("format_version", 0), r"unknown format_version 0"),
    "no_variables": (lambda r: r.pop("variables"), r"variables is NoneType, not a list"),
    "step_not_int": (_set("step", 3.5), r"step is 3.5"),
    "shape_negative": (_set_kernel("shape", [-16, 32]), r"hidden.*shape \[-16, 32\] is not"),
    "shape_absurd": (_set_kernel("shape", [2**40, 2**40]), r"hidden.*more than 2\*\*48 elements"),
    "shape_not_list": (_set_kernel("shape", "16x32"), r"shape is '16x32'"),
    "shape_bool": (_set_kernel("shape", [True, 32]), r"hidden.*not a list of non-negative ints"),
    "dtype_unknown": (_set_kernel("dtype", "float33"), r"hidden.*unknown dtype 'float33'"),
    "dtype_object": (_set_kernel("dtype", "object"), r"hidden.*unknown dtype 'object'"),
    "array_parent": (
        _set_kernel("array", "../../other/3/state/layers.dense.vars.0"),
        r"hidden.*array name '\.\./\.\./other.*not a plain name inside the step directory",
    ),
    "array_absolute": (
        _set_kernel("array", "/tmp/elsewhere/layers.dense.vars.0"),
        r"hidden.*array name '/tmp/elsewhere.*not a plain name",
    ),
    "array_dotdot": (_set_kernel("array", ".."), r"array name '\.\.' is not a plain name"),
    "array_twice": (
        lambda r: [v.__setitem__("array", "layers.dense.vars.1") for v in r["variables"]],
        r"array 'layers.dense.vars.1' is named by two variables",
    ),
    "key_parent": (_set_kernel("key", "model/../../x"), r"'model/\.\./\.\./x'.*not a relative"),
    "key_absolute": (_set_kernel("key", "/model/x"), r"'/model/x'.*not a relative"),
    "variable_not_object": (lambda r: r["variables"].append(7), r"variables\[\d+\] is a int"),
}


@pytest.mark.parametrize("fmt", ["fast", "compact"])
@pytest.mark.parametrize("case", sorted(RECORD_CASES))
def test_record_that_lies_is_refused_before_anything_is_read(originals, tmp_path, mesh, fmt, case):
    edit, match = RECORD_CASES[case]
    directory = _copy(originals, fmt, tmp_path)
    _edit_record(directory, edit)
    caught = restore_or_untouched(directory, originals["values"])
    assert isinstance(caught, CorruptCheckpointError), caught
    assert "_CHECKPOINT_METADATA" in str(caught)
    assert re.search(match, str(caught)), str(caught)
    with pytest.raises(CorruptCheckpointError, match=match):  # inspect reads the record too
        keras_orbax.inspect(directory)


def test_a_newer_format_is_unsupported_not_damaged(originals, tmp_path, mesh):
    """A step a newer install wrote is intact: upgrading reads it. It is never called corrupt
    (resume would set it aside as damaged and train from an older step)."""
    directory = _copy(originals, "fast", tmp_path)
    _edit_record(directory, _set("format_version", 99))
    caught = restore_or_untouched(directory, originals["values"])
    assert isinstance(caught, UnsupportedVersionError), caught
    assert not isinstance(caught, CorruptCheckpointError)
    assert re.search(r"format 99, newer than .*Upgrade keras-orbax", str(caught)), str(caught)
    with pytest.raises(UnsupportedVersionError, match="format 99"):
        keras_orbax.inspect(directory)


def test_array_outside_the_step_is_never_read(originals, tmp_path, mesh):
    """A record pointing at another checkpoint's (valid) array must not restore from it."""
    directory = _copy(originals, "fast", tmp_path)
    other = _copy(originals, "compact", tmp_path)  # a sibling with a different layout on disk
    shutil.copytree(
        originals["fast"] / str(STEP) / KERNEL, other / "outside" / "layers.dense.vars.0"
    )
    shutil.rmtree(directory / str(STEP) / KERNEL)  # the step's own copy is gone
    _edit_record(directory, _set_kernel("array", f"../../../compact/outside/{KERNEL[6:]}"))
    caught = restore_or_untouched(directory, originals["values"])
    assert isinstance(caught, CorruptCheckpointError)
    assert "not a plain name inside the step directory" in str(caught)


def test_fields_a_newer_writer_adds_are_ignored(originals, tmp_path, mesh):
    directory = _copy(originals, "fast", tmp_path)
    _edit_record(directory, _set_kernel("checksum", "crc32c:1234"))
    assert restore_or_untouched(directory, originals["values"]) is None


def test_zarr_json_whose_chunks_make_no_sense(originals, tmp_path, mesh):
    """Chunk shapes of zero, the wrong length or the wrong type fall back to Orbax, which refuses."""
    for chunk in ([0, 8], [8], "8x8", [-8, 8]):
        directory = _copy(originals, "fast", tmp_path / str(chunk))
        path = directory / str(STEP) / KERNEL / "zarr.json"
        spec = json.loads(path.read_text())
        spec["chunk_grid"]["configuration"]["chunk_shape"] = chunk
        spec["codecs"][0]["configuration"]["chunk_shape"] = chunk
        path.write_text(json.dumps(spec))
        caught = restore_or_untouched(directory, originals["values"])
        assert isinstance(caught, CorruptCheckpointError), (chunk, caught)
        assert "layers/dense/vars/0" in str(caught)


@pytest.mark.parametrize(("offset", "nbytes"), [(2**64 - 2, 256), (2**40, 256), (0, 2**62)])
def test_shard_index_with_absurd_offset_or_size(originals, tmp_path, mesh, offset, nbytes):
    """The 16-byte index at the end of a fast-format shard file is data from disk too."""
    directory = _copy(originals, "fast", tmp_path)
    path = directory / str(STEP) / KERNEL / "c" / "0" / "1"
    data = bytearray(path.read_bytes())
    data[-20:-4] = offset.to_bytes(8, "little") + nbytes.to_bytes(8, "little")
    path.write_bytes(bytes(data))
    caught = restore_or_untouched(directory, originals["values"])
    assert isinstance(caught, CorruptCheckpointError), caught
    assert "c/0/1" in str(caught) and "layers/dense/vars/0" in str(caught)


# -- one flipped bit in a metadata file ------------------------------------------------------------


def _flip(path: Path, position: float, bit: int) -> int:
    data = bytearray(path.read_bytes())
    at = min(int(position * len(data)), len(data) - 1)
    data[at] ^= 1 << bit
    path.write_bytes(bytes(data))
    return at


@pytest.mark.parametrize(
    ("fmt", "file"),
    [
        ("fast", "_CHECKPOINT_METADATA"),
        ("fast", f"{KERNEL}/zarr.json"),
        ("compact", "_CHECKPOINT_METADATA"),
        ("compact", "state/_METADATA"),
    ],
)
def test_a_flipped_bit_in_metadata_is_detected_or_harmless(originals, tmp_path, mesh, fmt, file):
    """Every outcome is a typed error (model untouched) or the exact saved values. Also counts
    both outcomes, so a flip that the test believes it made really changes something."""
    outcomes = {"error": 0, "harmless": 0}
    counter = iter(range(10**6))

    @FAST_FLIPS
    @hypothesis.given(position=st.floats(0, 1, exclude_max=True), bit=st.integers(0, 7))
    def flip(position: float, bit: int) -> None:
        directory = _copy(originals, fmt, tmp_path / str(next(counter)))
        _flip(directory / str(STEP) / file, position, bit)
        caught = restore_or_untouched(directory, originals["values"])
        outcomes["error" if caught is not None else "harmless"] += 1

    flip()
    assert outcomes["error"] > 0, outcomes  # some flips must be caught, or none was made


def test_a_shard_index_whose_crc32c_fails_is_refused(originals, tmp_path, mesh):
    """An index that still points inside the file, but is not the one written: refused on restore,
    not silently read from the wrong offset."""
    directory = _copy(originals, "fast", tmp_path)
    shard = directory / str(STEP) / KERNEL / "c" / "1" / "2"
    data = bytearray(shard.read_bytes())
    data[-20] ^= 0x01  # the low byte of the data offset: 0 -> 1, still within the file
    shard.write_bytes(bytes(data))
    caught = restore_or_untouched(directory, originals["values"])
    assert isinstance(caught, CorruptCheckpointError), caught
    assert "CRC-32C" in str(caught) and "c/1/2" in str(caught)


def test_a_region_of_another_shape_or_dtype_is_never_placed():
    """The last check before regions become a device array (placing them checks nothing more)."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from keras_orbax._src.format.step_record import VariableRecord
    from keras_orbax._src.read import sharded_read

    sharding = NamedSharding(Mesh(jax.devices(), ("x",)), PartitionSpec("x"))
    target = jax.ShapeDtypeStruct((16,), np.float32, sharding=sharding)
    record = VariableRecord("layers/dense/vars/0", "dense/kernel", (16,), "float32", "a")
    request = sharded_read.ReadRequest(record, target)
    indices = request.local_indices()
    right = {repr(index): np.zeros(2, np.float32) for index in indices}
    assert np.asarray(sharded_read._on_devices(request, right)).shape == (16,)
    for wrong in (np.zeros(3, np.float32), np.zeros(2, np.float16)):
        regions = {**right, repr(indices[5]): wrong}
        with pytest.raises(CorruptCheckpointError, match=r"layers/dense/vars/0: read regions \("):
            sharded_read._on_devices(request, regions)
