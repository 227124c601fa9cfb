"""Opted in (`KERAS_ORBAX_MAP_SHARDS=1`), large saved shards restored onto the saved layout become
mappings of their files (`mapped`): the device's buffer is the file's pages, all in memory when the
restore returns; training goes on from it, the checkpoint stays as written, and deleting it loses
nothing. The default, copying, is tested in test_mapped_safety.py."""

import os
import re
import shutil
from pathlib import Path

import keras
import numpy as np
import pytest

import keras_orbax
from keras_orbax._src.storage import mapped
from keras_orbax.errors import CorruptCheckpointError
from tests import _models
from tests._page_cache import evict

SHAPE = (1024, 512)  # 2 MiB of float32: stored one file per shard, (512, 128) = 256 KiB each
KERNEL_DIR = "1/state/layers.dense.vars.0"


@pytest.fixture(autouse=True)
def small_mappings(monkeypatch):
    """Opts in to mapping, of shards of 64 KiB and more (4 MiB by default), to keep the model
    small."""
    monkeypatch.setenv(mapped.ENVIRONMENT_VARIABLE, "1")
    monkeypatch.setattr(mapped, "MIN_BYTES", 64 << 10)


def _model() -> keras.Model:
    inputs = keras.Input((SHAPE[0],))
    return keras.Model(inputs, keras.layers.Dense(SHAPE[1], name="dense")(inputs))


def _saved(tmp_path, distribution) -> tuple[str, np.ndarray]:
    if not mapped._is_local(os.stat(tmp_path).st_dev):
        pytest.skip(f"{tmp_path} is not on a local filesystem: its files are read, not mapped")
    distribution(_models.model_parallel((2, 4)))
    model = _model()
    want = np.random.default_rng(3).standard_normal(SHAPE).astype("float32")
    model.layers[1].kernel.assign(want)
    directory = str(tmp_path / "ckpt")
    keras_orbax.save(model, directory, step=1)
    return directory, want


def _restored(directory: str) -> keras.Model:
    """The model built deferred and restored from `directory`."""
    with keras_orbax.deferred_init():
        model = _model()
    keras_orbax.restore_sharded(model, directory)
    return model


def _mapping_of(address: int) -> tuple[str, str, int, int]:
    """(permissions, file, size, resident bytes) of the mapping of this process holding
    `address`, from /proc/self/smaps."""
    with open("/proc/self/smaps") as smaps:
        lines = smaps.read().splitlines()
    for i, line in enumerate(lines):
        head = re.match(r"([0-9a-f]+)-([0-9a-f]+) (\S+) \S+ \S+ \S+\s*(.*)$", line)
        if head and int(head[1], 16) <= address < int(head[2], 16):
            fields = {}
            for entry in lines[i + 1 :]:
                if re.match(r"[0-9a-f]+-[0-9a-f]+ ", entry):
                    break
                name, _, value = entry.partition(":")
                fields[name] = value.split()
            size, rss = int(fields["Size"][0]) * 1024, int(fields["Rss"][0]) * 1024
            return head[3], head[4], size, rss
    raise LookupError(hex(address))


def _files(directory: str) -> list[str]:
    return [os.path.join(root, name) for root, _, names in os.walk(directory) for name in names]


def _shard_file(directory: str, index: tuple[slice, ...]) -> str:
    rows, columns = index
    return os.path.realpath(
        f"{directory}/{KERNEL_DIR}/c/{rows.start // 512}/{columns.start // 128}"
    )


def test_saved_layout_is_restored_into_mappings_of_the_shard_files(tmp_path, distribution):
    directory, want = _saved(tmp_path, distribution)
    evict(_files(directory))  # the pages must come from disk, all of them
    model = _restored(directory)

    kernel = model.layers[1].kernel.value
    np.testing.assert_array_equal(np.asarray(kernel), want)
    for shard in kernel.addressable_shards:
        permissions, path, size, resident = _mapping_of(shard.data.unsafe_buffer_pointer())
        assert path == _shard_file(directory, shard.index), (path, shard.index)
        assert permissions.endswith("p")  # private: nothing reaches the file
        assert resident == size  # every page in memory when the restore returned

    bias = model.layers[1].bias.value.addressable_shards[0].data  # small: read, not mapped
    assert directory not in _mapping_of(bias.unsafe_buffer_pointer())[1]


def test_training_goes_on_and_the_checkpoint_stays_as_written(tmp_path, distribution):
    directory, want = _saved(tmp_path, distribution)
    written = {path: Path(path).read_bytes() for path in _files(directory)}
    model = _restored(directory)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x = np.ones((8, SHAPE[0]), "float32")
    model.fit(x, np.ones((8, SHAPE[1]), "float32"), epochs=2, verbose=0)

    trained = np.asarray(model.layers[1].kernel.value)
    assert not np.array_equal(trained, want)
    assert {path: Path(path).read_bytes() for path in _files(directory)} == written
    again = _restored(directory)
    np.testing.assert_array_equal(np.asarray(again.layers[1].kernel.value), want)


def test_deleting_the_checkpoint_after_a_restore_loses_nothing(tmp_path, distribution):
    directory, want = _saved(tmp_path, distribution)
    model = _restored(directory)
    shutil.rmtree(directory)  # unlinked: the blocks stay while the mappings do
    np.testing.assert_array_equal(np.asarray(model.layers[1].kernel.value), want)
    x = np.ones((2, SHAPE[0]), "float32")
    np.testing.assert_allclose(model.predict(x, verbose=0), x @ want, rtol=1e-4, atol=1e-3)


def test_another_layout_is_read_into_fresh_memory(tmp_path, distribution):
    directory, want = _saved(tmp_path, distribution)
    distribution(_models.model_parallel((1, 8)))  # cuts every saved shard: nothing to map
    model = _restored(directory)
    kernel = model.layers[1].kernel.value
    np.testing.assert_array_equal(np.asarray(kernel), want)
    for shard in kernel.addressable_shards:
        assert directory not in _mapping_of(shard.data.unsafe_buffer_pointer())[1]


def test_a_mappable_shard_whose_index_fails_its_check_is_refused(tmp_path, distribution):
    directory, _ = _saved(tmp_path, distribution)
    shard = f"{directory}/{KERNEL_DIR}/c/1/2"
    with open(shard, "r+b") as f:
        f.seek(-20, os.SEEK_END)
        f.write(b"\x01")  # the data offset: 0 -> 1, still inside the file
    model = _model()
    before = np.asarray(model.layers[1].kernel.value)
    with pytest.raises(CorruptCheckpointError, match=r"CRC-32C.*c/1/2|c/1/2.*CRC-32C"):
        keras_orbax.restore_sharded(model, directory)
    np.testing.assert_array_equal(np.asarray(model.layers[1].kernel.value), before)


def test_only_files_on_local_filesystems_are_mapped(tmp_path, monkeypatch):
    assert mapped._is_local(os.stat("/proc/self").st_dev) is False  # procfs
    if not mapped._is_local(os.stat(tmp_path).st_dev):
        pytest.skip(f"{tmp_path} is not on a local filesystem")
    path = tmp_path / "shard"
    path.write_bytes(bytes(range(256)) * 4096)  # 1 MiB
    data = mapped.map_file(str(path), 1 << 20)
    assert data is not None and data[:256].tolist() == list(range(256))
    assert mapped.map_file(str(path), (1 << 20) + 1) is None  # not the size expected
    # The same file, its filesystem taken for a network one: read, not mapped.
    monkeypatch.setattr(mapped, "_LOCAL_FILESYSTEMS", frozenset({"nfs4"}))
    assert mapped.map_file(str(path), 1 << 20) is None
