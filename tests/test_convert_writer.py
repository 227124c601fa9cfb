"""`convert` writes its step as `save` does (`array_writer.save_arrays`): a checksum for every
shard file, the writer lock, nothing committed when it fails, and a Keras file name refused.

Sources are `.weights.h5` files written by Keras's own `save_weights`; the expected values come
from Keras's own `load_weights` of the same file.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import keras_orbax
from keras_orbax._src.format import step_dirs
from keras_orbax._src.format.checksum import CHECKSUMS_DIR
from keras_orbax._src.storage import mapped
from keras_orbax._src.tools.convert import convert
from keras_orbax._src.write import array_writer
from keras_orbax.errors import CorruptCheckpointError, StepExistsError, StepLockedError
from tests import _models
from tests._lock_holder import lock_holder
from tests._page_cache import written_back

HANG_S = 300  # only to stop a hung worker; no test asserts on time
KERNEL = "layers/dense/vars/0"  # the hidden kernel of `_models.mlp()`, (16, 32)


@pytest.fixture
def h5(tmp_path) -> Path:
    """`_models.mlp()` with random values, saved by Keras."""
    model = _models.mlp()
    rng = np.random.default_rng(0)
    for variable in model.weights:
        variable.assign(rng.standard_normal(variable.shape).astype("float32"))
    path = tmp_path / "source" / "m.weights.h5"
    path.parent.mkdir()
    model.save_weights(path)
    return path


def _keras_loaded(h5: Path) -> list[np.ndarray]:
    """What Keras's own `load_weights` gives for `h5`: the oracle."""
    model = _models.mlp()
    model.load_weights(h5)
    return _models.values(model.weights)


def _converted(h5: Path, destination: Path, how: str, **kwargs) -> Path:
    """Converts by the file's structure, or by the model under a (2, 4) mesh, one file per shard
    (so that each array is several files, each with its own checksum)."""
    if how == "structure":
        return convert(h5, destination, **kwargs)
    with _models.one_file_per_shard():
        return convert(h5, destination, model=_models.mlp(), **kwargs)


def _shard_files(state: Path) -> set[str]:
    """Every file of every array under `state` but its `zarr.json`, relative to `state`."""
    arrays = [p.parent for p in state.glob("*/zarr.json")]
    return {
        str(f.relative_to(state))
        for array in arrays
        for f in array.rglob("*")
        if f.is_file() and f.name != "zarr.json"
    }


def _recorded(state: Path) -> dict[str, int]:
    files: dict[str, int] = {}
    for path in (state / CHECKSUMS_DIR).glob("process_*.json"):
        files.update({k: v["crc32"] for k, v in json.loads(path.read_text())["files"].items()})
    return files


@pytest.mark.parametrize("how", ["structure", "model_2x4"])
def test_every_shard_file_is_checksummed_and_verifies(tmp_path, h5, distribution, how):
    if how == "model_2x4":
        distribution(_models.model_parallel((2, 4)))
    step_dir = _converted(h5, tmp_path / "ckpt", how)

    assert step_dir == tmp_path / "ckpt" / "0"
    assert step_dirs.committed_steps(tmp_path / "ckpt") == [0]
    files = _shard_files(step_dir / "state")
    # By structure each array is one file; on the mesh each kernel is 8 shards, each bias 1.
    assert len(files) == (4 if how == "structure" else 8 + 1 + 8 + 1)
    assert set(_recorded(step_dir / "state")) == files
    result = keras_orbax.verify(tmp_path / "ckpt")
    assert (result.step, result.files, result.checksummed, result.unchecked) == (
        0,
        len(files),
        len(files),
        (),
    ), str(result)


@pytest.mark.parametrize("how", ["structure", "model_2x4"])
def test_restores_what_keras_load_weights_gives(tmp_path, h5, distribution, how):
    if how == "model_2x4":
        distribution(_models.model_parallel((2, 4)))
    _converted(h5, tmp_path / "ckpt", how)

    with keras_orbax.deferred_init():
        model = _models.mlp()
    keras_orbax.restore_sharded(model, tmp_path / "ckpt", verify=True)
    for got, want in zip(_models.values(model.weights), _keras_loaded(h5), strict=True):
        np.testing.assert_array_equal(got, want)


def test_the_step_is_durable_when_convert_returns(tmp_path, h5, distribution):
    """No page of the step's files is left for the kernel to write back, Orbax's included."""
    if mapped.filesystem_type(os.stat(tmp_path).st_dev) in {"tmpfs", "ramfs"}:
        pytest.skip("a filesystem in memory writes nothing back")
    distribution(_models.model_parallel((2, 4)))
    step_dir = _converted(h5, tmp_path / "ckpt", "model_2x4")
    files = [path for path in step_dir.rglob("*") if path.is_file()]
    assert len(files) > 18
    assert written_back(files) == []


def test_a_flipped_byte_is_found_by_verify_and_by_restore(tmp_path, h5):
    step_dir = convert(h5, tmp_path / "ckpt")
    damaged = step_dir / "state" / "layers.dense.vars.0" / "c.0.0"
    data = bytearray(damaged.read_bytes())
    data[100] ^= 0x01  # a data byte: the file's size and zarr index stay valid
    damaged.write_bytes(bytes(data))

    named = rf"{KERNEL}: {re.escape(str(damaged))}: checksum 0x[0-9a-f]+, recorded 0x[0-9a-f]+"
    with pytest.raises(CorruptCheckpointError, match=named):
        keras_orbax.verify(tmp_path / "ckpt")
    model = _models.mlp()
    before = _models.values(model.weights)
    with pytest.raises(CorruptCheckpointError, match=named):
        keras_orbax.restore_sharded(model, tmp_path / "ckpt", verify=True)
    for got, want in zip(_models.values(model.weights), before, strict=True):
        np.testing.assert_array_equal(got, want)


def test_a_step_another_process_is_writing_is_refused_and_nothing_is_written(tmp_path, h5):
    directory = tmp_path / "ckpt"
    with lock_holder(tmp_path, directory, 0) as holder:
        with pytest.raises(StepLockedError, match=rf"step 0 .*PID {holder.pid} .*Nothing was"):
            convert(h5, directory)
        assert sorted(p.name for p in directory.iterdir()) == [".keras_orbax.0.lock"]
    assert step_dirs.committed_steps(directory) == []


def test_a_committed_step_is_refused(tmp_path, h5):
    step_dir = convert(h5, tmp_path / "ckpt")
    written = {p: p.read_bytes() for p in step_dir.rglob("*") if p.is_file()}
    with pytest.raises(StepExistsError, match=r"Step 0 is already committed"):
        convert(h5, tmp_path / "ckpt")
    assert {p: p.read_bytes() for p in step_dir.rglob("*") if p.is_file()} == written


def _zeros(record) -> dict[str, jax.Array]:
    return {key: jnp.zeros(v.shape, v.dtype) for key, v in record.variables.items()}


def _arrays_then_failure(record) -> Iterator[tuple[str, jax.Array]]:
    """The first array of `record`, then an error, as a source that breaks midway would give."""
    key = next(iter(record.variables))
    yield key, _zeros(record)[key]
    raise OSError("the source broke after one array")


def test_a_failure_midway_commits_nothing_and_leaves_the_earlier_step(tmp_path, h5):
    directory = tmp_path / "ckpt"
    convert(h5, directory, step=0)
    record = step_dirs.read_record(directory / "0")

    with pytest.raises(OSError, match="the source broke after one array"):
        array_writer.save_arrays(directory, 1, record, _arrays_then_failure(record))
    assert sorted(p.name for p in directory.iterdir()) == ["0"]  # no lock, no temporary step

    def fail_after_first(nbytes: int, total: int) -> None:
        raise KeyboardInterrupt  # the user stops it while the progress is shown

    with pytest.raises(KeyboardInterrupt):
        convert(h5, directory, step=2, on_write=fail_after_first)
    assert sorted(p.name for p in directory.iterdir()) == ["0"]

    assert step_dirs.committed_steps(directory) == [0]
    result = keras_orbax.verify(directory)
    assert (result.files, result.checksummed, result.unchecked) == (4, 4, ()), str(result)
    restored = _models.mlp()
    keras_orbax.restore_sharded(restored, directory, verify=True)
    for got, want in zip(_models.values(restored.weights), _keras_loaded(h5), strict=True):
        np.testing.assert_array_equal(got, want)


def test_arrays_that_do_not_fit_the_record_are_refused(tmp_path, h5):
    directory = tmp_path / "ckpt"
    convert(h5, directory)
    record = step_dirs.read_record(directory / "0")
    values = _zeros(record)

    wrong_shape = {**values, KERNEL: values[KERNEL][:, :16]}
    cases = {
        r"Array 'layers/dense/vars/0' is \(16, 16\) float32, but the step's record says "
        r"\(16, 32\) float32": wrong_shape.items(),
        r"4 arrays of step 1 were never given": [],
        r"Array 'x' is not in the step's record": [("x", values[KERNEL])],
    }
    for match, arrays in cases.items():
        with pytest.raises(ValueError, match=match):
            array_writer.save_arrays(directory, 1, record, iter(arrays))
        assert sorted(p.name for p in directory.iterdir()) == ["0"]


@pytest.mark.parametrize("suffix", [".h5", ".keras", ".weights.json"])
def test_a_keras_file_destination_is_refused_and_nothing_is_created(tmp_path, h5, suffix):
    destination = tmp_path / "out" / f"model{suffix}"
    message = (
        r"convert writes a keras-orbax checkpoint directory, .*restore_sharded.*save_weights.*"
        rf"Received: destination='{re.escape(str(destination))}'$"
    )
    with pytest.raises(ValueError, match=message):
        convert(h5, destination)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["source"]


def test_convert_into_a_bucket(store, bucket, h5):
    url = f"{bucket}/run"
    convert(h5, url, step=0)
    result = keras_orbax.verify(url)
    assert (result.files, result.checksummed, result.unchecked) == (4, 4, ()), str(result)
    with keras_orbax.deferred_init():
        model = _models.mlp()
    keras_orbax.restore_sharded(model, url, verify=True)
    for got, want in zip(_models.values(model.weights), _keras_loaded(h5), strict=True):
        np.testing.assert_array_equal(got, want)

    before = store.keys(url)
    prefix = url.split("://", 1)[1].partition("/")[2]
    assert f"{prefix}/0/state/{CHECKSUMS_DIR}/process_0.json" in before

    def fail_after_first(nbytes: int, total: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        convert(h5, url, step=1, on_write=fail_after_first)
    assert store.keys(url) == before  # step 1's objects written before the failure are removed
    assert keras_orbax.inspect(url).steps == (0,)
