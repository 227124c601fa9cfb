"""`verify` reads a saved step back and names each damaged file and its variable."""

from __future__ import annotations

import json

import keras
import numpy as np
import pytest

import keras_orbax
from keras_orbax.errors import CorruptCheckpointError, KerasOrbaxWarning
from tests import _models

# These tests name the files of single shards (`c/1/2`) or cut the saved shards.
pytestmark = pytest.mark.usefixtures("one_file_per_shard")

KERNEL = "layers/dense/vars/0"  # the "hidden" layer's kernel, sharded 2 x 4


@pytest.fixture
def saved(tmp_path, distribution):
    distribution(_models.model_parallel((2, 4)))
    model = _models.compile_adam(_models.mlp())
    model.optimizer.build(model.trainable_variables)
    _models.fill_arange(model)
    keras_orbax.save(model, tmp_path, step=3)
    return tmp_path


def _shard(root):
    return root / "3" / "state" / KERNEL.replace("/", ".") / "c" / "1" / "2"


def test_an_intact_checkpoint_verifies(saved):
    result = keras_orbax.verify(saved)
    assert result.step == 3 and result.unchecked == ()
    assert result.checksummed == result.files > 8  # every file, each with its recorded checksum
    assert result.bytes > 0


@pytest.mark.parametrize("where", [0, 100, -1], ids=["first", "middle", "index"])
def test_a_flipped_byte_is_named(saved, where):
    shard = _shard(saved)
    data = bytearray(shard.read_bytes())
    data[where] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(
        CorruptCheckpointError, match=rf"{KERNEL}: .*c/1/2: (checksum|bad zarr)"
    ) as e:
        keras_orbax.verify(saved)
    assert "No variable was modified" not in str(e.value)  # the restore's note: verify has none


def test_a_flipped_data_byte_is_caught_by_the_checksum(saved):
    shard = _shard(saved)
    data = bytearray(shard.read_bytes())
    data[5] ^= 0x80
    shard.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=r"c/1/2: checksum 0x[0-9a-f]+, recorded"):
        keras_orbax.verify(saved, step=3)


def test_a_file_whose_checksum_is_not_recorded_is_not_called_intact(saved):
    """A checksum file that lost an entry (or a process's checksum file lost whole): the file's
    array is read back but reported unchecked, so a flipped byte in it is not called intact."""
    checksums = saved / "3" / "state" / "keras_orbax_checksums" / "process_0.json"
    content = json.loads(checksums.read_text())
    relative = str(_shard(saved).relative_to(saved / "3" / "state"))
    del content["files"][relative]
    checksums.write_text(json.dumps(content))
    shard = _shard(saved)
    data = bytearray(shard.read_bytes())
    data[5] ^= 0x80
    shard.write_bytes(bytes(data))
    result = keras_orbax.verify(saved)
    assert not result.intact
    assert result.unchecked == (KERNEL,)
    assert result.why_unchecked == "no checksum is recorded for files of 1 array"
    assert result.checksummed == result.files - 1


def test_a_compact_step_is_checked_by_its_files_or_says_why_not(tmp_path, distribution):
    """A compact step records a CRC of each file of its OCDBT databases, checked whole; one saved
    before that is read back array by array and says why it is unchecked."""
    distribution(_models.model_parallel((2, 4)))
    model = _models.mlp()
    keras_orbax.save(model, tmp_path, step=1, format="compact")
    state = tmp_path / "1" / "state"
    files = [*state.glob("manifest.ocdbt"), *state.glob("d/*"), *state.glob("ocdbt.process_*/*")]
    files += [*state.glob("ocdbt.process_*/d/*")]
    result = keras_orbax.verify(tmp_path)
    assert result.intact and result.unchecked == ()
    assert result.files == result.checksummed == len([f for f in files if f.is_file()])
    assert result.bytes == sum(f.stat().st_size for f in files if f.is_file())

    (state / "keras_orbax_checksums" / "ocdbt.json").unlink()  # as saved before checksums
    result = keras_orbax.verify(tmp_path)
    assert not result.intact and len(result.unchecked) == len(model.weights)
    assert result.why_unchecked.startswith("arrays of the compact format, saved before")
    assert result.bytes == sum(v.value.nbytes for v in model.weights)  # read back whole


def test_a_truncated_file_is_named(saved):
    shard = _shard(saved)
    shard.write_bytes(shard.read_bytes()[:-7])
    with pytest.raises(CorruptCheckpointError, match=rf"{KERNEL}: .*c/1/2: \d+ bytes, expected"):
        keras_orbax.verify(saved)


def test_a_missing_file_is_named_with_every_other_problem(saved):
    _shard(saved).unlink()
    record = keras_orbax.inspect(saved).record
    (momentum,) = [v for v in record.variables.values() if v.path.endswith("hidden_bias_momentum")]
    bias = saved / "3" / "state" / momentum.array / "c" / "0"
    bias.write_bytes(b"")
    with pytest.raises(CorruptCheckpointError) as caught:
        keras_orbax.verify(saved)
    message = str(caught.value)
    assert f"{KERNEL}: " in message and "c/1/2: missing" in message
    assert f"{momentum.key}: " in message and "0 bytes" in message
    assert "2 array files failed" in message


def test_an_unreadable_file_is_named_not_raised(saved):
    """An OSError other than a missing file (here a directory where the shard was; in object
    storage, an object replaced since it was listed) is a named problem, like the others."""
    _shard(saved).unlink()
    _shard(saved).mkdir()
    with pytest.raises(CorruptCheckpointError, match=rf"{KERNEL}: .*c/1/2: unreadable \(IsADir"):
        keras_orbax.verify(saved)


@pytest.mark.parametrize("verify", [None, True], ids=["default", "verify"])
@pytest.mark.parametrize(
    "layout",
    [(2, 4), (4, 2), (1, 8), "data_parallel"],
    ids=["saved_layout", "other_layout", "cut_columns", "replicated"],
)
def test_restore_refuses_a_flipped_byte_and_changes_nothing(saved, distribution, layout, verify):
    """By default, on the saved layout (each file checked by the thread that reads it) and on
    others (the files a region cuts checked before reading): the file and the array named."""
    shard = _shard(saved)
    data = bytearray(shard.read_bytes())
    data[5] ^= 0x40  # a data byte: read as it is without verify
    shard.write_bytes(bytes(data))
    if layout == "data_parallel":
        distribution(_models.data_parallel())
    else:
        distribution(_models.model_parallel(layout))
    model = _models.mlp()
    before = _models.values(model.weights)
    kwargs = {} if verify is None else {"verify": verify}
    with pytest.raises(CorruptCheckpointError, match=rf"{KERNEL}: .*c/1/2: checksum") as caught:
        keras_orbax.restore_sharded(model, saved, strict=False, **kwargs)
    assert "No variable was modified" in str(caught.value)
    for variable, want in zip(model.weights, before, strict=True):
        np.testing.assert_array_equal(np.asarray(variable.value), want)
    result = keras_orbax.restore_sharded(model, saved, strict=False, verify=False)  # as it is
    assert KERNEL in result.unverified


def test_restore_with_verify_warns_for_arrays_it_could_not_verify(
    tmp_path_factory, saved, distribution
):
    """A compact step saved before its files' checksums were recorded, and a fast one whose
    checksum file is lost, are restored as read, and `verify=True` says which arrays it could not
    check."""
    distribution(_models.model_parallel((2, 4)))
    model = _models.mlp()
    compact = tmp_path_factory.mktemp("compact")
    keras_orbax.save(model, compact, step=1, format="compact")
    (compact / "1" / "state" / "keras_orbax_checksums" / "ocdbt.json").unlink()
    with pytest.warns(KerasOrbaxWarning) as warned:
        keras_orbax.restore_sharded(_models.mlp(), compact, verify=True)
    (message,) = [str(w.message) for w in warned if "could not verify" in str(w.message)]
    assert message.startswith("restore_sharded(verify=True) could not verify 4 arrays of ")
    assert "saved before keras-orbax recorded its files' checksums" in message
    assert KERNEL in message

    for lost in (saved / "3" / "state" / "keras_orbax_checksums").iterdir():
        lost.unlink()
    with pytest.warns(KerasOrbaxWarning) as warned:
        keras_orbax.restore_sharded(_models.mlp(), saved, verify=True)
    (message,) = [str(w.message) for w in warned if "could not verify" in str(w.message)]
    assert "(the step was saved without checksums)" in message and KERNEL in message


@pytest.mark.parametrize("batch_bytes", [1, 1 << 30])
def test_a_weights_file_is_read_back_in_batches_and_a_cut_array_named(
    tmp_path, monkeypatch, batch_bytes
):
    """A `.weights.h5` records no checksums: every array is read back, one per read or all in
    one; the same bytes, and a truncated file names the array it cut, whichever the batch."""
    from keras_orbax._src.sources import base

    monkeypatch.setattr(base, "READ_BATCH_BYTES", batch_bytes)
    model = _models.mlp()
    path = tmp_path / "m.weights.h5"
    model.save_weights(path)
    result = keras_orbax.verify(path)
    assert result.bytes == sum(v.value.nbytes for v in model.weights)
    assert len(result.unchecked) == len(model.weights)  # read back, none checksummed
    assert result.files == 0 and "; 3.2 KiB read, 0 checksums" in str(result)  # arrays, not files

    # The last dataset stored again compressed, as other writers store them (read through h5py),
    # then a byte of its one chunk flipped: inflating it fails.
    import h5py

    with h5py.File(path, "r+") as file:
        name = _datasets(file)[-1].name
        data, attrs = file[name][()], dict(file[name].attrs)
        del file[name]
        file.create_dataset(name, data=data, compression="gzip", chunks=data.shape)
        file[name].attrs.update(attrs)
        chunk = file[name].id.get_chunk_info(0)
    with open(path, "r+b") as file:
        file.seek(chunk.byte_offset + chunk.size // 2)
        byte = file.read(1)
        file.seek(chunk.byte_offset + chunk.size // 2)
        file.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CorruptCheckpointError, match=name.strip("/")):
        keras_orbax.verify(path)


def _datasets(file) -> list:
    """Every dataset of the h5 `file`, in name order."""
    import h5py

    found: list = []
    file.visititems(lambda _, item: found.append(item) if isinstance(item, h5py.Dataset) else None)
    return found


def test_a_source_without_arrays_is_not_called_checked(tmp_path):
    path = tmp_path / "empty.weights.h5"
    keras.Sequential([keras.Input((4,)), keras.layers.Activation("relu")]).save_weights(path)
    result = keras_orbax.verify(path)
    assert not result.intact
    assert str(result).endswith("not verified: it holds no arrays, so nothing was checked.")
