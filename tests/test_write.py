"""keras-orbax writes the fast format's files itself: byte for byte what Orbax's own writer makes."""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import keras
import numpy as np
import orbax.checkpoint.experimental.v1 as ocp
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import keras_orbax
from keras_orbax._src.format import checksum, crc
from keras_orbax._src.write import shard_files, shard_writer, step_sink
from tests import _models


def _tree() -> dict:
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("batch", "model"))

    def put(values: np.ndarray, *spec: str | None) -> jax.Array:
        return jax.device_put(values, NamedSharding(mesh, PartitionSpec(*spec)))

    rng = np.random.default_rng(0)
    return {
        "kernel": put(rng.standard_normal((16, 32), dtype=np.float32), "batch", "model"),
        "embed": {"table": put(rng.standard_normal((8, 16)).astype(jnp.bfloat16), None, "model")},
        "bias": put(np.arange(32, dtype=np.int32)),
        "seed": put(np.array([7, 9], dtype=np.uint32)),
        "mask": put(np.array([True, False, True, True]), "model"),
        "small": put(np.arange(-4, 4, dtype=np.int8), "model"),
        "half": put(np.ones((4, 8), dtype=np.float16), "batch"),
        "cube": put(rng.standard_normal((4, 8, 2), dtype=np.float32), "batch", "model", None),
        "step": put(np.array(5, dtype=np.int64 if jax.config.x64_enabled else np.int32)),
    }


def _files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and checksum.CHECKSUMS_DIR not in p.parts
    }


@pytest.mark.parametrize("blocking", [True, False])
def test_writer_makes_the_files_orbax_makes(tmp_path, blocking, monkeypatch):
    """Arrays above `PACK_BYTES`: one file per distinct shard, as Orbax writes them."""
    monkeypatch.setattr(shard_writer, "PACK_BYTES", -1)  # every array of the tree is small
    tree = _tree()
    theirs, ours = _save_both(tmp_path, tree, tree, blocking)
    assert sorted(ours) == sorted(theirs)
    different = [name for name in theirs if theirs[name] != ours[name]]
    assert different == ["commit_success.txt"]  # it names the directory it was written in
    _assert_orbax_loads(tmp_path / "ours" / "1", tree)


@pytest.mark.parametrize("blocking", [True, False])
def test_a_small_array_is_one_file_as_orbax_writes_a_replicated_one(tmp_path, blocking):
    """A small array, however sharded, is one chunk in one file: the bytes Orbax writes for the same
    values replicated, under the chunk key `c.0.0` (no directories below the array's), while
    `_sharding` keeps the layout it was saved with."""
    tree = _tree()
    replicated = NamedSharding(jax.tree.leaves(tree)[0].sharding.mesh, PartitionSpec())
    theirs, ours = _save_both(
        tmp_path, jax.tree.map(lambda a: jax.device_put(a, replicated), tree), tree, blocking
    )
    chunk_files = [name for name in ours if re.fullmatch(r".+/c(\.0)*", name)]
    assert len(chunk_files) == len(jax.tree.leaves(tree))  # one per array, none in a subdirectory

    as_orbax_names = {_slashed(name): content for name, content in ours.items()}
    assert sorted(as_orbax_names) == sorted(theirs)
    different = {name for name in theirs if theirs[name] != as_orbax_names[name]}
    specs = {name for name in different if name.endswith("zarr.json")}
    assert different - specs == {"_sharding", "commit_success.txt"}
    for name in specs:
        spec = json.loads(theirs[name])
        spec["chunk_key_encoding"]["configuration"] = {"separator": "."}
        assert json.loads(as_orbax_names[name]) == spec
    _assert_orbax_loads(tmp_path / "ours" / "1", tree)


def _slashed(name: str) -> str:
    """`<array>/c.0.1` as Orbax names that chunk, `<array>/c/0/1`."""
    array, _, key = name.rpartition("/")
    return f"{array}/{key.replace('.', '/')}" if key.startswith("c.") else name


def _save_both(tmp_path: Path, for_orbax: dict, for_us: dict, blocking: bool) -> tuple[dict, dict]:
    """The files of `state/` as Orbax's own array writer and as keras-orbax's save each tree."""
    orbax_context = ocp.Context()
    for option, value in step_sink.FORMATS["fast"].items():
        setattr(orbax_context.array.saving, option, value)
    with ocp.training.Checkpointer(tmp_path / "orbax", context=orbax_context) as checkpointer:
        checkpointer.save_pytree(1, for_orbax)
    with step_sink.open_checkpointer(tmp_path / "ours", "fast") as checkpointer:
        context = shard_writer.shards_stay_unchanged() if blocking else contextlib.nullcontext()
        with context:
            response = checkpointer.save_async(1, for_us)
        response.result()
    return _files(tmp_path / "orbax" / "1" / "state"), _files(tmp_path / "ours" / "1" / "state")


def _assert_orbax_loads(step_dir: Path, tree: dict) -> None:
    """Plain Orbax loads the step: the values, each on the sharding it was saved with."""
    loaded = ocp.load(step_dir, checkpointable_name="state")
    for got, want in zip(jax.tree.leaves(loaded), jax.tree.leaves(tree), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        assert got.sharding.is_equivalent_to(want.sharding, want.ndim)
    # Orbax's metadata of the step describes every array as saved.
    described = ocp.checkpointables_metadata(step_dir).metadata["state"]
    assert _shapes(described) == _shapes(tree)


def _shapes(tree: dict) -> dict[str, tuple]:
    """Each leaf's path, shape and dtype (arrays or Orbax's metadata of them)."""
    return {
        jax.tree_util.keystr(path): (tuple(leaf.shape), np.dtype(leaf.dtype))
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
    }


def test_arrays_up_to_pack_bytes_are_one_file_and_restore_onto_any_layout(tmp_path, distribution):
    distribution(_models.model_parallel((2, 4)))
    model = _models.mlp(width=32768)  # the hidden kernel is 2 MiB, the head's exactly 1 MiB
    assert model.get_layer("head").kernel.value.nbytes == shard_writer.PACK_BYTES
    _models.fill_arange(model)
    keras_orbax.save(model, tmp_path, step=1)

    state = tmp_path / "1" / "state"
    shard_files = {
        array.name: sorted(
            str(p.relative_to(array))
            for p in array.rglob("*")
            if p.is_file() and p.name != "zarr.json"
        )
        for array in state.iterdir()
        if (array / "zarr.json").exists()
    }
    grid = [f"c/{i}/{j}" for i in range(2) for j in range(4)]
    assert shard_files.pop("layers.dense.vars.0") == grid  # split (batch, model): 8 files
    assert shard_files.pop("layers.dense_1.vars.0") == ["c.0.0"]  # split the same way: one file
    assert shard_files == {"layers.dense.vars.1": ["c.0"], "layers.dense_1.vars.1": ["c.0"]}

    want = _models.values(model.variables)
    for layout in (_models.model_parallel((4, 2)), _models.data_parallel()):
        distribution(layout)
        restored = _models.mlp(width=32768)
        keras_orbax.restore_sharded(restored, tmp_path)
        for got, expected in zip(_models.values(restored.variables), want, strict=True):
            np.testing.assert_array_equal(got, expected)
        kernel = restored.get_layer("head").kernel
        assert kernel.value.sharding.is_equivalent_to(
            layout.get_variable_layout(kernel).backend_layout, 2
        )


def test_the_same_zarr_json_is_written_once_and_linked(tmp_path, distribution):
    """Arrays of one shape, chunk and dtype share one `zarr.json` file (hard links); plain Orbax
    and keras-orbax read every array back."""
    distribution(_models.model_parallel((2, 4)))
    inputs = keras.Input((16,))
    outputs = [keras.layers.Dense(32, name=f"same_{i}")(inputs) for i in range(6)]
    model = keras.Model(inputs, [*outputs, keras.layers.Dense(8, name="other")(inputs)])
    _models.fill_arange(model)
    keras_orbax.save(model, tmp_path, step=1)

    specs = list((tmp_path / "1" / "state").glob("*/zarr.json"))
    assert len(specs) == len(model.variables)
    by_content: dict[bytes, set[int]] = {}
    for spec in specs:
        by_content.setdefault(spec.read_bytes(), set()).add(spec.stat().st_ino)
    # kernels (16, 32), biases (32,), and the other layer's two: one file each
    assert len(by_content) == 4
    assert all(len(inodes) == 1 for inodes in by_content.values())
    assert max(spec.stat().st_nlink for spec in specs) == 6
    files = [f for f in (tmp_path / "1").rglob("*") if f.is_file()]
    once_each = {f.stat().st_ino: f.stat().st_size for f in files}
    (summary,) = keras_orbax.inspect(tmp_path).summaries
    assert summary.disk_bytes == sum(once_each.values())  # a linked file counted once
    assert summary.disk_bytes < sum(f.stat().st_size for f in files)

    with keras_orbax.deferred_init():
        restored = keras.models.clone_model(model)
    keras_orbax.restore_sharded(restored, tmp_path)
    want = _models.values(model.variables)
    for got, expected in zip(_models.values(restored.variables), want, strict=True):
        np.testing.assert_array_equal(got, expected)
    loaded = ocp.load(tmp_path / "1", checkpointable_name="state")
    assert len(jax.tree.leaves(loaded)) == len(model.variables)


def test_a_content_whose_first_file_is_gone_is_written_again(tmp_path):
    """Where the link fails (here its source was removed; elsewhere a filesystem without hard
    links), the file is written with its content instead."""
    once = shard_files.Once()
    a, b, c = (str(tmp_path / name) for name in "abc")
    once.write(a, b"{}")
    os.unlink(a)
    once.write(b, b"{}")
    once.write(c, b"{}")
    assert Path(b).read_bytes() == Path(c).read_bytes() == b"{}"
    assert once.written == [a, b]  # c is a link to b
    assert os.stat(c).st_ino == os.stat(b).st_ino


def test_a_step_committed_while_waiting_for_the_lock_is_step_exists(
    tmp_path, monkeypatch, distribution
):
    """Whether the step is taken is decided under its writer lock: another writer that held the
    lock may commit the step between a save's first check and its taking the lock."""
    from keras_orbax._src.storage import writer_lock

    distribution(_models.model_parallel((2, 4)))
    model, other = _models.mlp(), _models.mlp()
    _models.fill_arange(other)
    acquire = writer_lock._acquire
    raced: list[bool] = []

    def another_writer_commits_first(directory, step):
        if not raced:  # that writer takes the lock, commits step 5 and releases it
            raced.append(True)
            keras_orbax.save(other, directory, step=step)
        return acquire(directory, step)

    monkeypatch.setattr(writer_lock, "_acquire", another_writer_commits_first)
    with pytest.raises(keras_orbax.errors.StepExistsError, match="Step 5 is already committed"):
        keras_orbax.save(model, tmp_path, step=5)
    restored = _models.mlp()
    keras_orbax.restore_sharded(restored, tmp_path, 5)  # the other writer's step, untouched
    got, want = _models.values(restored.variables), _models.values(other.variables)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)


def test_the_recorded_crcs_are_those_of_the_bytes_on_disk(tmp_path, distribution):
    """Every CRC the writer computes while writing (each piece before it is handed to the kernel)
    is that of the file as it lies on disk once the save returns."""
    distribution(_models.model_parallel((2, 4)))
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(256), keras.layers.Dense(8)])
    model.compile(optimizer="adam", loss="mse")
    model.optimizer.build(model.trainable_variables)
    _models.fill_arange(model, limit=1000)
    keras_orbax.save(model, tmp_path, step=1)
    state = tmp_path / "1" / "state"
    recorded = json.loads((state / checksum.CHECKSUMS_DIR / "process_0.json").read_text())["files"]
    assert len(recorded) > 8
    for name, entry in recorded.items():
        for algorithm in crc.RECORDED:
            got = checksum.file_crc(str(state / name), algorithm)
            assert got == (entry["bytes"], entry[algorithm.key]), (name, algorithm.key)
