"""Incremental saves: an unchanged shard file is a hard link to the previous step's, a changed one
is written; counted from the filesystem (inodes), with the file contents as the oracle."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import keras
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import keras_orbax
from keras_orbax._src.format import step_dirs
from keras_orbax._src.model import state_keys
from tests import _models

DTYPES = ["float32", "bfloat16", "float16", "int8", "int32", "bool", "uint8"]


class Mixed(keras.layers.Layer):
    """One (16, 32) variable of each dtype in `DTYPES`; passes its input through."""

    def build(self, input_shape):
        for dtype in DTYPES:
            self.add_weight(shape=(16, 32), dtype=dtype, initializer="zeros", name=dtype)

    def call(self, x):
        return x


def _mixed_model() -> keras.Model:
    """Every dtype, and an int4-quantized Dense (its kernel packed two values a byte, int8)."""
    inputs = keras.Input((16,))
    x = Mixed(name="mixed")(inputs)
    outputs = keras.layers.Dense(32, name="quantized")(x)
    model = keras.Model(inputs, outputs)
    model.get_layer("quantized").quantize("int4")
    return model


def _shard_all(model: keras.Model, rng: np.random.Generator) -> None:
    """Random values, split over a 2 x 4 mesh where the dimensions allow."""
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
    for v in model.variables:
        shape = tuple(v.shape)
        if len(shape) == 2 and shape[0] % 2 == 0 and shape[1] % 4 == 0:
            spec = P("a", "b") if shape[0] > 1 else P(None, "b")
        elif len(shape) == 2 and shape[1] % 4 == 0:
            spec = P(None, "b")
        elif len(shape) == 1 and shape[0] % 4 == 0:
            spec = P("b")
        else:
            spec = P()
        dtype = np.dtype(v.value.dtype)
        if dtype == np.bool_:
            values = rng.random(shape) < 0.5
        elif np.issubdtype(dtype, np.integer):
            info = np.iinfo(dtype)
            values = rng.integers(info.min, info.max, shape, endpoint=True).astype(dtype)
        else:
            values = rng.standard_normal(shape).astype(dtype)
        v.assign(jax.device_put(values, NamedSharding(mesh, spec)))


def _shard_files(step_dir: Path) -> dict[tuple[str, tuple[int, ...]], Path]:
    """(array directory, chunk coordinates) -> shard file, for every shard file of a step."""
    files = {}
    state = step_dir / "state"
    for path in state.rglob("*"):
        if not path.is_file():
            continue
        parts = path.relative_to(state).parts
        if len(parts) < 2 or not (parts[1] == "c" or parts[1].startswith("c.")):
            continue  # not an array's shard file (commit_success.txt, a checksum file)
        if parts[1] == "c" and len(parts) > 2:
            coords = tuple(int(p) for p in parts[2:])
        elif parts[1].startswith("c."):
            coords = tuple(int(p) for p in parts[1].split(".")[1:])
        else:
            coords = ()
        files[(parts[0], coords)] = path
    return files


def _new_files(before: Path, after: Path) -> set[tuple[str, tuple[int, ...]]]:
    """The shard files of step `after` that are not the very files (inodes) of step `before`."""
    old = {name: path.stat().st_ino for name, path in _shard_files(before).items()}
    return {n for n, p in _shard_files(after).items() if old.get(n) != p.stat().st_ino}


def _changed_files(before: Path, after: Path) -> set[tuple[str, tuple[int, ...]]]:
    """The shard files of step `after` whose bytes differ from step `before`'s (the oracle)."""
    old = _shard_files(before)
    return {
        name
        for name, path in _shard_files(after).items()
        if name not in old or old[name].read_bytes() != path.read_bytes()
    }


def _flip(variable: keras.Variable, rng: np.random.Generator, whole_element: bool) -> tuple:
    """Changes one bit (or one whole element) of `variable`, keeping its sharding; returns the
    element's index."""
    value = variable.value
    host = np.array(value)
    index = tuple(int(rng.integers(n)) for n in host.shape)
    element = np.array(host[index]).reshape(1)  # a copy, changed byte by byte
    raw = element.reshape(-1).view(np.uint8)
    if host.dtype == np.bool_:
        raw[0] ^= 1  # a bool's only valid bits
    elif whole_element:
        old = raw.copy()
        while np.array_equal(raw, old):
            raw[:] = rng.integers(0, 256, raw.size, dtype=np.uint8)
    else:
        raw[int(rng.integers(raw.size))] ^= np.uint8(1 << int(rng.integers(8)))
    host[index] = element[0]
    variable.assign(jax.device_put(host, value.sharding))
    return index


def _arrays(model: keras.Model) -> dict[int, str]:
    """id(variable) -> the directory of its array in a step."""
    keyed = state_keys.keyed_state(model).variables
    return {id(v): key.replace("/", ".") for key, v in keyed.items()}


def _expected_file(
    model: keras.Model, variable: keras.Variable, index: tuple, one_file: bool
) -> tuple:
    """(array directory, chunk coordinates) of the shard file holding `index` of `variable`."""
    array = _arrays(model)[id(variable)]
    if one_file:
        return array, (0,) * len(index)
    chunk = variable.value.sharding.shard_shape(tuple(variable.shape))
    return array, tuple(i // n for i, n in zip(index, chunk, strict=True))


@pytest.mark.parametrize("whole_element", [False, True], ids=["bit", "element"])
@pytest.mark.parametrize("small_arrays", ["one_file", "per_shard"])
def test_every_changed_shard_is_written_and_every_unchanged_one_linked(
    tmp_path, monkeypatch, small_arrays, whole_element
):
    from keras_orbax._src.write import shard_writer

    if small_arrays == "per_shard":  # the small arrays split into a file per shard as well
        monkeypatch.setattr(shard_writer, "PACK_BYTES", -1)
    rng = np.random.default_rng(7 + whole_element)
    model = _mixed_model()
    _shard_all(model, rng)
    keras_orbax.save(model, tmp_path, step=1)
    step = 1
    for _ in range(3):  # three rounds: each compares with the step before it
        expected = set()
        for _ in range(int(rng.integers(1, 5))):
            variable = model.variables[int(rng.integers(len(model.variables)))]
            index = _flip(variable, rng, whole_element)
            expected.add(_expected_file(model, variable, index, small_arrays == "one_file"))
        keras_orbax.save(model, tmp_path, step=step + 1)
        before, after = tmp_path / str(step), tmp_path / str(step + 1)
        changed, new = _changed_files(before, after), _new_files(before, after)
        assert changed == expected
        assert new == changed  # every change written, every unchanged file linked
        keras_orbax.verify(tmp_path, step=step + 1)  # the linked files' CRC-32 recorded right
        step += 1
    restored = _mixed_model()
    keras_orbax.restore_sharded(restored, tmp_path)
    for saved, read in zip(model.variables, restored.variables, strict=True):
        np.testing.assert_array_equal(np.asarray(read.value), np.asarray(saved.value))


def _lora_model() -> keras.Model:
    return _models.lora_pair(inputs=32, hidden=256, seed=3)


def test_keras_trainer_gives_frozen_weights_new_arrays():
    """Why buffer identity cannot find the unchanged weights: after a train step a frozen kernel
    is another `jax.Array` object, with the same values."""
    model = _lora_model()
    x, y = np.ones((4, 32), "float32"), np.ones((4, 8), "float32")
    model.fit(x, y, epochs=1, verbose=0)
    kernel = model.get_layer("frozen_in")._kernel
    before, values = kernel.value, np.asarray(kernel.value).copy()
    model.fit(x, y, epochs=1, verbose=0)
    assert kernel.value is not before
    np.testing.assert_array_equal(np.asarray(kernel.value), values)


_RESTORE_SCRIPT = """
import sys
import keras
import numpy as np
import keras_orbax
sys.path.insert(0, {repo!r})
from tests.test_incremental import _lora_model

model = _lora_model()
model.optimizer.build(model.trainable_variables)
keras_orbax.restore_sharded(model, {directory!r})
expected = np.load({expected!r})
for i, v in enumerate(model.variables + model.optimizer.variables):
    np.testing.assert_array_equal(np.asarray(v.value), expected[str(i)], err_msg=v.path)
print("restored", len(expected.files))
"""


def test_lora_second_save_writes_only_what_training_changed(tmp_path):
    model = _lora_model()
    rng = np.random.default_rng(0)
    x, y = rng.random((16, 32), "float32"), rng.random((16, 8), "float32")
    checkpoint = keras_orbax.ModelCheckpoint(tmp_path, max_to_keep=None)
    model.fit(x, y, batch_size=8, epochs=2, callbacks=[checkpoint], verbose=0)
    first, second = step_dirs.committed_steps(tmp_path)
    before, after = tmp_path / str(first), tmp_path / str(second)
    new = _new_files(before, after)
    assert new == _changed_files(before, after)
    new_arrays = {array for array, _ in new}
    record = {v.array: v for v in step_dirs.read_record(after).variables.values()}
    # Only the LoRA factors, optimizer state and counters; never a frozen kernel.
    assert {record[a].path for a in new_arrays if record[a].role == "model"} == {
        "frozen_in/lora_kernel_a",
        "frozen_in/lora_kernel_b",
        "frozen_out/lora_kernel_a",
        "frozen_out/lora_kernel_b",
    }
    frozen = {a for a, v in record.items() if v.path.endswith("/kernel")}
    assert frozen and not frozen & new_arrays
    files = _shard_files(after)
    written = sum(files[name].stat().st_size for name in new)
    frozen_bytes = sum(p.stat().st_size for (a, _), p in files.items() if a in frozen)
    assert written < sum(p.stat().st_size for p in files.values()) - frozen_bytes + 1

    # The later step stands alone: every earlier step deleted, a fresh process restores it.
    expected = tmp_path / "expected.npz"
    state = model.variables + model.optimizer.variables
    np.savez(expected, **{str(i): np.asarray(v.value) for i, v in enumerate(state)})
    shutil.rmtree(before)
    keras_orbax.verify(tmp_path, step=second)
    script = _RESTORE_SCRIPT.format(
        repo=os.fspath(Path(__file__).parent.parent),
        directory=os.fspath(tmp_path),
        expected=os.fspath(expected),
    )
    env = {**os.environ, "KERAS_BACKEND": "jax"}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "restored" in done.stdout

    # A frozen weight changed by hand is written; the other frozen one stays linked.
    kernel = model.get_layer("frozen_in")._kernel
    kernel.assign(kernel.value.at[0, 0].add(1.0))
    keras_orbax.save(model, tmp_path, step=second + 1)
    new = {a for a, _ in _new_files(after, tmp_path / str(second + 1))}
    assert {record[a].path for a in new & frozen} == {"frozen_in/kernel"}


def test_a_step_without_layouts_gives_a_full_save(tmp_path):
    model = _lora_model()
    model.optimizer.build(model.trainable_variables)
    keras_orbax.save(model, tmp_path, step=1, incremental=False)
    checksums = tmp_path / "1/state/keras_orbax_checksums/process_0.json"
    assert "layouts" not in json.loads(checksums.read_text())  # as an older version wrote
    keras_orbax.save(model, tmp_path, step=2)
    assert _new_files(tmp_path / "1", tmp_path / "2") == set(_shard_files(tmp_path / "2"))
    keras_orbax.save(model, tmp_path, step=3)  # step 2 has them: everything linked
    assert _new_files(tmp_path / "2", tmp_path / "3") == set()
    keras_orbax.save(model, tmp_path, step=4, incremental=False)  # the opt-out writes it all
    assert _new_files(tmp_path / "3", tmp_path / "4") == set(_shard_files(tmp_path / "4"))


def test_a_shard_whose_layout_changed_is_written(tmp_path):
    model = _mixed_model()
    _shard_all(model, np.random.default_rng(1))
    keras_orbax.save(model, tmp_path, step=1)
    moved = model.get_layer("mixed").weights[0]  # float32 (16, 32), same values, another mesh
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))
    moved.assign(jax.device_put(moved.value, NamedSharding(mesh, P("a", "b"))))
    keras_orbax.save(model, tmp_path, step=2)
    assert {a for a, _ in _new_files(tmp_path / "1", tmp_path / "2")} == {_arrays(model)[id(moved)]}


def test_convert_links_what_the_destination_holds_already(tmp_path):
    model = _lora_model()
    model.optimizer.build(model.trainable_variables)
    source = tmp_path / "model.weights.h5"
    model.save_weights(source)
    keras_orbax.convert(source, tmp_path / "ckpt", step=1)
    keras_orbax.convert(source, tmp_path / "ckpt", step=2)
    steps = tmp_path / "ckpt/1", tmp_path / "ckpt/2"
    assert _shard_files(steps[1]) and _new_files(*steps) == set()
    keras_orbax.convert(source, tmp_path / "ckpt", step=3, incremental=False)
    assert _new_files(steps[1], tmp_path / "ckpt/3") == set(_shard_files(tmp_path / "ckpt/3"))


def test_a_file_written_into_after_its_step_is_not_passed_on(tmp_path):
    """`cp` or `rsync --inplace` over a committed step writes into its files (same size): the next
    save writes that shard afresh instead of linking the damaged file."""
    model = _lora_model()
    model.optimizer.build(model.trainable_variables)
    keras_orbax.save(model, tmp_path, step=1)
    key = ("layers.dense.vars.0", (0, 0))  # frozen_in's kernel, one file
    damaged = _shard_files(tmp_path / "1")[key]
    with open(damaged, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    # The kernel's clock ticks in jiffies: a write right after the save may carry the save's time.
    recorded = tmp_path / "1/state/keras_orbax_checksums/process_0.json"
    later = recorded.stat().st_mtime_ns + 1_000_000_000
    os.utime(damaged, ns=(later, later))
    keras_orbax.save(model, tmp_path, step=2)
    assert _new_files(tmp_path / "1", tmp_path / "2") == {key}
    keras_orbax.verify(tmp_path, step=2)
    with pytest.raises(keras_orbax.errors.CorruptCheckpointError, match="layers/dense/vars/0"):
        keras_orbax.verify(tmp_path, step=1)


def test_each_process_links_its_own_unchanged_shards(tmp_path):
    from tests._harness import WORKERS_DIR, run_workers

    directory = tmp_path / "ckpt"
    args = {"directory": os.fspath(directory)}
    run_workers(WORKERS_DIR / "incremental_multihost.py", 2, 4, args, timeout=600, workdir=tmp_path)
    before, after = directory / "1", directory / "2"
    assert _changed_files(before, after) == {("layers.dense.vars.0", (0, 0))}
    assert _new_files(before, after) == {("layers.dense.vars.0", (0, 0))}
    keras_orbax.verify(directory, step=2)
    old = {p.stat().st_ino for p in _shard_files(before).values()}
    for process in (0, 1):  # each process's record lists shard files it linked
        listed = json.loads(
            (after / f"state/keras_orbax_checksums/process_{process}.json").read_text()
        )
        linked = [n for n in listed["files"] if (after / "state" / n).stat().st_ino in old]
        assert linked and all("layout" in listed["files"][n] for n in linked)


def test_a_shard_that_changed_at_every_save_is_linked_once_it_stops(tmp_path):
    """A full fine-tune's shards change at every save: each is written (its record complete), and
    linked at the first save after it stops changing."""
    model = _lora_model()
    model.optimizer.build(model.trainable_variables)
    factor = model.get_layer("frozen_out").lora_kernel_b
    array = _arrays(model)[id(factor)]
    for step in range(5):
        if 0 < step < 4:  # changed before saves 1 to 3, the same at 4
            factor.assign(factor.value + 1.0)
        keras_orbax.save(model, tmp_path, step=step)
        if step:
            new = {a for a, _ in _new_files(tmp_path / str(step - 1), tmp_path / str(step))}
            assert (array in new) == (step < 4)
    keras_orbax.verify(tmp_path, step=4)  # the linked file's record carried over


def test_a_shard_that_changed_at_the_previous_save_is_read_once(tmp_path, monkeypatch):
    """A shard that changed at the save before (a trained variable's) is written with its CRCs
    taken as it is written, its bytes not read first for the candidate's CRC; the unchanged
    ones are still compared first, and linked."""
    from keras_orbax._src.format import crc

    model = _lora_model()
    model.optimizer.build(model.trainable_variables)
    factor = model.get_layer("frozen_out").lora_kernel_b
    array = _arrays(model)[id(factor)]
    candidates: list[int] = []  # the bytes of each candidate's CRC computed before its write
    real = crc.Crc.of
    monkeypatch.setattr(
        crc.Crc,
        "of",
        lambda self, *parts: candidates.append(sum(map(len, parts))) or real(self, *parts),
    )
    counted = []
    for step in range(4):
        factor.assign(factor.value + 1.0)
        candidates.clear()
        keras_orbax.save(model, tmp_path, step=step)
        counted.append(len(candidates))
        if step:
            new = {a for a, _ in _new_files(tmp_path / str(step - 1), tmp_path / str(step))}
            assert new == {array}  # the factor written, everything else linked
    # Step 1 compares the factor's file first (it had not changed before); steps 2 and 3 do not.
    assert counted[1] == counted[2] + 1 == counted[3] + 1
    keras_orbax.verify(tmp_path, step=3)
    restored = _lora_model()
    restored.optimizer.build(restored.trainable_variables)
    keras_orbax.restore_sharded(restored, tmp_path)
    np.testing.assert_array_equal(
        np.asarray(restored.get_layer("frozen_out").lora_kernel_b.value), np.asarray(factor.value)
    )


def _checksums(step_dir: Path) -> dict:
    return json.loads((step_dir / "state/keras_orbax_checksums/process_0.json").read_text())


def test_a_save_records_layouts_and_crcs_and_no_hash(tmp_path):
    """What a save records to compare the next one with: each entry's CRCs, size and layout (the
    text, once per distinct layout), no fingerprint of the bytes (no hashing pass)."""
    model = _mixed_model()
    _shard_all(model, np.random.default_rng(2))
    keras_orbax.save(model, tmp_path, step=1)
    content = _checksums(tmp_path / "1")
    assert set(content) == {"algorithm", "layouts", "files"}
    layouts = content["layouts"]
    assert len(set(layouts)) == len(layouts) and all("keras-orbax shard" in t for t in layouts)
    for name, entry in content["files"].items():
        assert set(entry) <= {"crc32", "crc32c", "bytes", "layout", "shared"}, name
        assert layouts[entry["layout"]].split("|")[3] in DTYPES, name
    # The linked step records the same, its CRCs carried over (verify reads them).
    keras_orbax.save(model, tmp_path, step=2)
    assert _new_files(tmp_path / "1", tmp_path / "2") == set()
    linked = _checksums(tmp_path / "2")
    for name, entry in content["files"].items():
        assert linked["files"][name] == {**entry, "shared": 2}
    keras_orbax.verify(tmp_path, step=2)


def _crc_collision(data: bytes, changed: int, free: int) -> bytes:
    """`data` with byte `changed` flipped and bytes `free` to `free + 16` set so that every CRC a
    save records (CRC-32, CRC-32C where google-crc32c is installed) is unchanged: CRCs are affine
    over GF(2), so the 128 free bits solve a linear system."""
    from keras_orbax._src.format import crc

    def syndrome(buffer: bytes) -> int:  # every recorded CRC, side by side
        value = 0
        for algorithm in crc.RECORDED:
            value = (value << 32) | algorithm.of(buffer)
        return value

    zero = syndrome(bytes(len(data)))

    def linear(positions: dict[int, int]) -> int:  # the CRCs' linear part of a difference
        delta = bytearray(len(data))
        for at, byte in positions.items():
            delta[at] ^= byte
        return syndrome(bytes(delta)) ^ zero

    target = linear({changed: 0xFF})
    rows = [(linear({free + bit // 8: 1 << bit % 8}), 1 << bit) for bit in range(128)]
    basis: list[tuple[int, int]] = []  # Gaussian elimination: (syndrome, the bits giving it)
    for value, bits in rows:
        for b_value, b_bits in basis:
            if value ^ b_value < value:
                value, bits = value ^ b_value, bits ^ b_bits
        if value:
            basis.append((value, bits))
            basis.sort(reverse=True)
    chosen = 0
    for b_value, b_bits in basis:
        if target ^ b_value < target:
            target, chosen = target ^ b_value, chosen ^ b_bits
    assert target == 0, "no collision with these free bytes"
    forged = bytearray(data)
    forged[changed] ^= 0xFF
    for bit in range(128):
        if chosen >> bit & 1:
            forged[free + bit // 8] ^= 1 << bit % 8
    assert forged != data and syndrome(bytes(forged)) == syndrome(data)
    return bytes(forged)


def test_a_file_with_other_bytes_and_the_recorded_crcs_is_not_passed_on(tmp_path):
    """A shard file of step 1 replaced by other bytes with the same size, mtime, CRC-32 and CRC-32C
    (a collision, forged): its record is right for the model, so only comparing the bytes shows
    it. Step 2 writes the shard; it restores the model's values."""
    model = _lora_model()
    model.optimizer.build(model.trainable_variables)
    keras_orbax.save(model, tmp_path, step=1)
    key = ("layers.dense.vars.0", (0, 0))  # frozen_in's kernel, one file
    damaged = _shard_files(tmp_path / "1")[key]
    kept = damaged.stat()
    damaged.write_bytes(_crc_collision(damaged.read_bytes(), changed=100, free=400))
    os.utime(damaged, ns=(kept.st_atime_ns, kept.st_mtime_ns))
    keras_orbax.verify(tmp_path, step=1)  # the checksums cannot tell
    keras_orbax.save(model, tmp_path, step=2)
    assert _new_files(tmp_path / "1", tmp_path / "2") == {key}
    expected = np.asarray(model.get_layer("frozen_in")._kernel.value)
    restored = _lora_model()
    restored.optimizer.build(restored.trainable_variables)
    keras_orbax.restore_sharded(restored, tmp_path, step=2)
    np.testing.assert_array_equal(
        np.asarray(restored.get_layer("frozen_in")._kernel.value), expected
    )
    assert not np.array_equal(  # step 1 holds other values under the same checksums
        np.fromfile(damaged, np.float32, count=expected.size), expected.reshape(-1)
    )


@pytest.mark.parametrize("mtime", ["kept", "same_tick"])
def test_a_file_written_into_with_its_mtime_kept_is_not_passed_on(tmp_path, mtime):
    """`rsync -a --inplace` or `cp -p` over a committed step keeps the file's mtime, and a write in
    the save's own clock tick looks unchanged: no timestamp can tell, so the next save reads the
    file and links it only if its bytes are the recorded ones; the step restores the model."""
    model = _lora_model()
    model.optimizer.build(model.trainable_variables)
    keras_orbax.save(model, tmp_path, step=1)
    key = ("layers.dense.vars.0", (0, 0))  # frozen_in's kernel, one file
    damaged = _shard_files(tmp_path / "1")[key]
    recorded = tmp_path / "1/state/keras_orbax_checksums/process_0.json"
    kept = damaged.stat().st_mtime_ns if mtime == "kept" else recorded.stat().st_mtime_ns
    with open(damaged, "r+b") as f:  # 9.0 where the model holds its own values
        f.write(np.full(4, 9.0, "float32").tobytes())
    os.utime(damaged, ns=(kept, kept))
    keras_orbax.save(model, tmp_path, step=2)
    assert _new_files(tmp_path / "1", tmp_path / "2") == {key}
    expected = np.asarray(model.get_layer("frozen_in")._kernel.value)
    restored = _lora_model()
    restored.optimizer.build(restored.trainable_variables)
    keras_orbax.restore_sharded(restored, tmp_path, step=2, verify=False)
    np.testing.assert_array_equal(
        np.asarray(restored.get_layer("frozen_in")._kernel.value), expected
    )
    keras_orbax.verify(tmp_path, step=2)


def test_rewrite_every_keeps_steps_that_many_saves_apart_independent(tmp_path):
    """`ModelCheckpoint(rewrite_every=2)`: a frozen kernel's file is held by at most two steps, so
    steps two saves apart share no file (damage to one cannot reach the other)."""
    model = _lora_model()
    x, y = np.ones((8, 32), "float32"), np.ones((8, 8), "float32")
    checkpoint = keras_orbax.ModelCheckpoint(tmp_path, max_to_keep=None, rewrite_every=2)
    model.fit(x, y, batch_size=8, epochs=5, callbacks=[checkpoint], verbose=0)
    steps = [tmp_path / str(s) for s in step_dirs.committed_steps(tmp_path)]
    key = ("layers.dense.vars.0", (0, 0))  # frozen_in's kernel: the same bytes at every save
    inodes = [_shard_files(s)[key].stat().st_ino for s in steps]
    assert inodes[0] == inodes[1] != inodes[2] == inodes[3] != inodes[4]
    for earlier, later in zip(steps, steps[2:], strict=False):
        assert _new_files(earlier, later) == set(_shard_files(later))
    with pytest.raises(ValueError, match="rewrite_every=0"):
        keras_orbax.ModelCheckpoint(tmp_path, rewrite_every=0)
