"""`keras_orbax.save_weights`: a sharded model written as Keras's own `.weights.h5`, region by region.

The oracle is Keras: the file's groups, datasets (shape, dtype, h5 type, layout, bytes) and attributes
equal what `model.save_weights` writes, and `model.load_weights` reads back exactly the model's values.
"""

from __future__ import annotations

import errno
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import h5py
import jax
import keras
import numpy as np
import pytest

import keras_orbax
from keras_orbax._src.export import regions
from keras_orbax.errors import CorruptCheckpointError, SaveFailedError
from tests import _harness, _models


def h5_contents(path: Path) -> dict[str, Any]:
    """Every group and dataset of an h5 file: kind, attributes, and for datasets shape, dtype,
    h5 type, storage layout, chunking, compression and raw bytes."""
    found: dict[str, Any] = {}

    def visit(name: str, obj: Any) -> None:
        entry: dict[str, Any] = {"attrs": {k: obj.attrs[k] for k in obj.attrs}}
        if isinstance(obj, h5py.Dataset):
            entry.update(
                shape=obj.shape,
                dtype=obj.dtype.str,
                h5type=obj.id.get_type().dumps() if hasattr(obj.id.get_type(), "dumps") else None,
                tclass=obj.id.get_type().get_class(),
                layout=obj.id.get_create_plist().get_layout(),
                chunks=obj.chunks,
                compression=obj.compression,
                data=obj[()].tobytes(),
            )
        found[name] = entry

    with h5py.File(path, "r") as h5:
        found["/"] = {"attrs": dict(h5.attrs)}
        h5.visititems(visit)
    return found


def _trained(build) -> keras.Model:  # type: ignore[no-untyped-def]
    model = _models.compile_adam(build())
    x = np.random.default_rng(0).random((8, *model.input_shape[1:])).astype("float32")
    if model.input.dtype == "int32":
        x = (x * 16).astype("int32")
    model.fit(x, np.ones((8, 8), "float32"), batch_size=8, epochs=1, verbose=0)
    _models.fill_arange(model, limit=1000)
    return model


@pytest.mark.parametrize(
    "build, bfloat16",
    [
        (lambda: _models.mlp(32), False),
        (lambda: _models.mlp(32, "bfloat16"), True),
        (_models.full_model, False),
    ],
    ids=["mlp", "mlp-bfloat16", "full"],
)
def test_same_file_as_keras_and_loads_back(tmp_path, distribution, build, bfloat16):
    distribution(_models.model_parallel((2, 4)))
    model = _trained(build)
    sharded = [v for v in model.weights if not v.value.sharding.is_fully_replicated]
    assert sharded  # sharded for real
    ours = keras_orbax.save_weights(model, tmp_path / "ours.weights.h5", window_bytes=48)
    model.save_weights(tmp_path / "keras.weights.h5")
    assert ours == tmp_path / "ours.weights.h5"
    expected, got = h5_contents(tmp_path / "keras.weights.h5"), h5_contents(ours)
    assert list(got) == list(expected)
    assert got == expected
    marked = [name for name, e in got.items() if e["attrs"].get("dtype") == "bfloat16"]
    assert bool(marked) == bfloat16
    fresh = _models.compile_adam(build())
    fresh.optimizer.build(fresh.trainable_variables)
    fresh.load_weights(ours)
    saved_variables = model.weights + model.optimizer.variables
    loaded_variables = fresh.weights + fresh.optimizer.variables
    for saved, loaded in zip(saved_variables, loaded_variables, strict=True):
        assert np.array_equal(np.asarray(saved.value), np.asarray(loaded.value)), saved.path
    # Keras loaded it with the sidecar beside it, which `verify` checks every dataset against
    sidecar = "ours.weights.h5.keras_orbax_checksums.json"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "keras.weights.h5",
        "ours.weights.h5",
        sidecar,
    ]
    result = keras_orbax.verify(ours)
    assert result.intact and result.checksummed == len(got) - _groups(got) - 1, result
    assert result.unchecked == ()


def _groups(contents: dict[str, Any]) -> int:
    return sum("shape" not in entry for name, entry in contents.items() if name != "/")


def test_regions_cover_each_array_once_in_windows():
    """Every element written exactly once, each block within the window, on any layout."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
    P = jax.sharding.PartitionSpec
    cases = [((64, 48), P("a", "b"), 100), ((64, 48), P(None, "b"), 1000), ((8, 5, 4), P("b"), 6)]
    cases += [((7,), P(), 8), ((), P(), 8), ((0, 4), P(), 8)]
    for shape, spec, window in cases:
        values = np.arange(int(np.prod(shape)), dtype="float32").reshape(shape)
        array = jax.device_put(values, jax.sharding.NamedSharding(mesh, spec))
        written = np.zeros(shape, "int32")
        out = np.zeros(shape, "float32")
        for region in regions.iter_regions(array, window):
            assert region.block.nbytes <= max(window, 4), (shape, spec, region.block.shape)
            written[region.index] += 1
            out[region.index] = region.block
        assert (written == 1).all(), (shape, spec)
        assert np.array_equal(out, values), (shape, spec)


def test_refuses_other_names_and_unbuilt_models(tmp_path):
    model = _models.mlp()
    with pytest.raises(ValueError, match=r"must end in `\.weights\.h5`.*path='.*model\.h5'"):
        keras_orbax.save_weights(model, tmp_path / "model.h5")
    with pytest.raises(ValueError, match=r"local file.*gs://b/m\.weights\.h5"):
        keras_orbax.save_weights(model, "gs://b/m.weights.h5")
    unbuilt = keras.Sequential([keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="needs a built model"):
        keras_orbax.save_weights(unbuilt, tmp_path / "m.weights.h5")
    assert list(tmp_path.iterdir()) == []


class _Failing(keras.layers.Layer):
    """Stores its variable, then fails: an error in the middle of the walk."""

    def build(self, input_shape):  # type: ignore[no-untyped-def]
        self.w = self.add_weight(shape=(4, 4), initializer="ones")

    def call(self, x):  # type: ignore[no-untyped-def]
        return x

    def save_own_variables(self, store):  # type: ignore[no-untyped-def]
        store["0"] = self.w
        raise OSError("disk gone")


def test_error_mid_export_leaves_the_previous_file(tmp_path):
    good = _models.mlp()
    destination = tmp_path / "m.weights.h5"
    keras_orbax.save_weights(good, destination)
    before = destination.read_bytes()
    inputs = keras.Input((16,))
    failing = keras.Model(inputs, _Failing()(keras.layers.Dense(8)(inputs)))
    with pytest.raises(SaveFailedError, match="OSError: disk gone"):
        keras_orbax.save_weights(failing, destination)
    assert destination.read_bytes() == before  # the old, complete file: never a partial one
    left = sorted(p.name for p in tmp_path.iterdir())  # no partial file left
    assert left == ["m.weights.h5", "m.weights.h5.keras_orbax_checksums.json"]
    assert keras_orbax.verify(destination).intact  # its own checksums, not the failed export's
    fresh = _models.mlp()
    fresh.load_weights(destination)


def flip_byte(file: Path, offset: int) -> None:
    """One bit of `file` changed at `offset`, as a disk or a copy might change it."""
    with open(file, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def test_a_changed_byte_is_named_by_verify_and_every_restore(tmp_path):
    """The sidecar beside the export lists each dataset's CRCs: a byte changed in one dataset is
    named (file and h5 path) by `verify` and by a restore, which leaves the model as it was;
    `verify=False` reads it as it is. An export over it replaces the file and its sidecar."""
    saved = _models.mlp()
    destination = keras_orbax.save_weights(saved, tmp_path / "m.weights.h5")
    sidecar = tmp_path / "m.weights.h5.keras_orbax_checksums.json"
    entries = json.loads(sidecar.read_text())["tensors"]
    assert sorted(entries) == [f"m.weights.h5/{n}" for n in _dataset_names(h5py.File(destination))]
    name, entry = max(entries.items(), key=lambda item: item[1]["bytes"])
    flip_byte(destination, entry["offset"] + entry["bytes"] // 2)
    where = rf"m\.weights\.h5: {name}: checksum .*, recorded .*bytes as read are not"
    with pytest.raises(CorruptCheckpointError, match=where):
        keras_orbax.verify(destination)
    model = _models.mlp()
    before = [np.asarray(v.value) for v in model.weights]
    with pytest.raises(CorruptCheckpointError, match=where):
        keras_orbax.restore_sharded(model, destination)
    for variable, value in zip(model.weights, before, strict=True):
        np.testing.assert_array_equal(np.asarray(variable.value), value, err_msg=variable.path)
    keras_orbax.restore_sharded(model, destination, verify=False)  # as it is, the flip included
    changed = [
        w.path
        for w, s in zip(model.weights, saved.weights, strict=True)
        if not np.array_equal(np.asarray(w.value), np.asarray(s.value))
    ]
    assert len(changed) == 1
    keras_orbax.save_weights(saved, destination)  # the file and its sidecar, both replaced
    assert keras_orbax.verify(destination).intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.weights.h5", sidecar.name]


_KILLED_MID_EXPORT = """
import os, signal, keras, keras_orbax

class Kill(keras.layers.Layer):
    def build(self, input_shape):
        self.w = self.add_weight(shape=(64, 64), initializer="ones")
    def call(self, x):
        return x
    def save_own_variables(self, store):
        store["0"] = self.w
        os.kill(os.getpid(), signal.SIGKILL)

inputs = keras.Input((16,))
model = keras.Model(inputs, Kill()(keras.layers.Dense(8)(inputs)))
keras_orbax.save_weights(model, {path!r})
"""


def test_killed_mid_export_leaves_nothing_that_loads(tmp_path):
    destination = tmp_path / "m.weights.h5"
    script = _KILLED_MID_EXPORT.format(path=str(destination))
    done = subprocess.run([sys.executable, "-c", script], cwd=_harness.REPO_ROOT, timeout=120)
    assert done.returncode == -9
    assert not destination.exists()
    left = [p.name for p in tmp_path.iterdir()]
    assert left == [".m.weights.h5.partial"]  # hidden, not named as a weights file
    keras_orbax.save_weights(_models.mlp(), destination)  # the next export replaces it
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["m.weights.h5", "m.weights.h5.keras_orbax_checksums.json"]


_MEMORY = """
import json, tracemalloc, keras, numpy as np, keras_orbax
from tests._rss import peak_growth

def measured(save):
    tracemalloc.start()
    rss = peak_growth(save)
    _, host_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return host_peak, rss

inputs = keras.Input((2048,))
model = keras.Model(inputs, keras.layers.Dense(8192, use_bias=False)(inputs))  # 64 MiB kernel
keras_orbax.save_weights(model, {warm!r}, window_bytes=1 << 20)  # compiles the slices once
ours = measured(lambda: keras_orbax.save_weights(model, {path!r}, window_bytes=1 << 20))
theirs = measured(lambda: model.save_weights({keras_path!r}))
print(json.dumps({{"ours": ours, "keras": theirs}}))
"""


def test_host_memory_stays_within_the_window(tmp_path):
    """A 64 MiB variable, a 1 MiB window: NumPy never holds more than the window, and the process's
    peak RSS grows by a few windows, where Keras's own `save_weights` holds the whole variable.

    The RSS bound is 16 windows: beside the export's own buffers the process grew by 0-8 MiB
    whatever the window (8.03 MiB once under the full suite's load), most likely XLA's compute
    threads touching scratch memory for the slices."""
    script = _MEMORY.format(
        warm=str(tmp_path / "warm.weights.h5"),
        path=str(tmp_path / "ours.weights.h5"),
        keras_path=str(tmp_path / "keras.weights.h5"),
    )
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        cwd=_harness.REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    (host, rss), (keras_host, keras_rss) = figures["ours"], figures["keras"]
    variable, window = 64 << 20, 1 << 20
    assert keras_host >= variable and keras_rss >= variable // 2  # the measure sees a whole fetch
    assert host <= 2 * window, figures
    assert rss <= 16 * window, figures
    assert h5_contents(tmp_path / "ours.weights.h5") == h5_contents(tmp_path / "keras.weights.h5")


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> tuple[Path, list[dict]]:
    """One launch of 2 processes x 4 devices: a whole export, one failing on each process, and
    one measured for memory."""
    root = tmp_path_factory.mktemp("two_processes")
    for name in ("ok", "fail_0", "fail_1", "torn", "memory"):
        (root / name).mkdir()
    results = _harness.run_workers(
        _harness.WORKERS_DIR / "export_h5.py",
        num_processes=2,
        devices_per_process=4,
        args={"root": str(root)},
        timeout=300,
    )
    return root, results


def test_two_processes_write_one_file(two_processes):
    """2 processes x 4 devices: the file holds every process's regions; Keras reads it back."""
    root, results = two_processes
    destination = root / "ok" / "m.weights.h5"
    assert [(r["ok"]["spans_processes"], r["ok"]["error"]) for r in results] == [(True, None)] * 2
    model = _models.compile_adam(_models.full_model())
    model.optimizer.build(model.trainable_variables)
    model.load_weights(destination)
    expected = _models.arange_values([tuple(v.shape) for v in model.variables], limit=1000)
    saved = {id(v) for v in model.weights + model.optimizer.variables}
    for variable, values in zip(model.variables, expected, strict=True):
        if id(variable) not in saved:
            continue
        assert np.array_equal(np.asarray(variable.value), values.astype(variable.dtype)), (
            variable.path
        )
    sidecar = "m.weights.h5.keras_orbax_checksums.json"
    assert sorted(p.name for p in (root / "ok").iterdir()) == ["m.weights.h5", sidecar]
    result = keras_orbax.verify(destination)  # every process's regions, read back and recorded
    assert result.intact and result.unchecked == () and result.checksummed > 0, result


def test_two_processes_region_torn_on_the_shared_filesystem_fails_both(two_processes):
    """Each process reports each region's CRC as it staged it; process 0 reads every dataset
    back from the file it assembled: a byte of process 1's staged region changed after its write
    (before process 0 copied it in) fails the export on both processes, naming the file, the
    dataset and the region, and leaves no file."""
    root, results = two_processes
    for process, result in enumerate(results):
        error = result["torn"]["error"]
        assert re.search(
            r"^SaveFailedError: .*1 region of the export read back from the shared files is not "
            r"the bytes their process wrote \(CRC-32C?\):\n  \S+/m\.weights\.h5: "
            r"m\.weights\.h5/\S+, region [0-9.-]+\n",
            error,
            re.S,
        ), (process, error)
    assert list((root / "torn").iterdir()) == []


def test_convert_a_checkpoint_to_weights_h5(tmp_path, distribution, capsys):
    """`convert CKPT x.weights.h5` (Python and command line): the model the step's config
    describes, restored sharded, written as the file Keras writes for it."""
    from keras_orbax import cli

    distribution(_models.model_parallel((2, 4)))
    model = _models.full_model()
    _models.fill_arange(model, limit=1000)
    keras_orbax.save(model, tmp_path / "ckpt", step=3)
    model.save_weights(tmp_path / "keras.weights.h5")
    written = keras_orbax.convert(tmp_path / "ckpt", tmp_path / "py.weights.h5")
    assert written == tmp_path / "py.weights.h5"
    expected = h5_contents(tmp_path / "keras.weights.h5")
    assert h5_contents(written) == expected
    out = tmp_path / "cli.weights.h5"
    assert cli.main(["convert", str(tmp_path / "ckpt"), str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"path": str(out), "bytes": _nbytes(model)}
    assert h5_contents(out) == expected


def test_convert_a_weights_file_needs_the_model(tmp_path):
    """A `.weights.h5` source describes no model: `convert` needs the architecture."""
    source = tmp_path / "keras.weights.h5"
    _models.mlp().save_weights(source)
    with pytest.raises(keras_orbax.errors.UnsupportedSourceError, match="describes no model"):
        keras_orbax.convert(source, tmp_path / "out.weights.h5")
    model = _models.mlp()
    keras_orbax.convert(source, tmp_path / "out.weights.h5", model=model)
    datasets = [
        {name: e for name, e in h5_contents(path).items() if "data" in e}  # groups name layers
        for path in (tmp_path / "out.weights.h5", source)
    ]
    assert datasets[0] == datasets[1]
    assert len(datasets[0]) == 4


def _nbytes(model: keras.Model) -> int:
    return sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in model.weights)


def test_two_processes_stay_within_the_window(two_processes):
    """2 processes x 4 devices, a 64 MiB kernel (32 MiB on each process), a 1 MiB window: process 1
    stages its regions as files one window at a time and process 0 copies them in one window at a
    time, so neither process's peak RSS grows by more than a few windows (the same 16-window
    bound as in one process), where a copy of either process's part grows it by 32 MiB."""
    root, results = two_processes
    window, held = 1 << 20, 32 << 20
    for process, result in enumerate(results):
        figures = result["memory"]
        assert figures["held"] == held, (process, figures)
        assert figures["host_copy"] >= held // 2, (process, figures)  # the measure sees a copy
        assert figures["export"] <= 16 * window, (process, figures)
    with h5py.File(root / "memory" / "m.weights.h5") as h5:
        (dataset,) = [h5[name] for name in _dataset_names(h5)]
        assert dataset.shape == (2048, 8192)


def _dataset_names(h5: h5py.File) -> list[str]:
    names: list[str] = []
    h5.visititems(lambda name, obj: names.append(name) if isinstance(obj, h5py.Dataset) else None)
    return names


@pytest.mark.parametrize("fail_on", [0, 1])
def test_a_failure_on_one_process_fails_all_and_leaves_no_file(two_processes, fail_on):
    root, results = two_processes
    for result in results:
        error = result[f"fail_{fail_on}"]["error"]
        assert error is not None and error.startswith("SaveFailedError: ")  # one type everywhere
        assert f"failed on 1 of 2 processes:\nprocess {fail_on}: OSError: disk gone" in error
    assert list((root / f"fail_{fail_on}").iterdir()) == []


def test_sharded_weights_as_keras_writes_them(tmp_path, distribution):
    """`max_shard_size`: the `.weights.json` index and its parts, cut where Keras cuts them."""
    distribution(_models.model_parallel((2, 4)))
    model = _trained(_models.full_model)
    shard_gb = 4096 / 1024**3  # a few variables per part; a group spans two parts
    (tmp_path / "keras").mkdir()
    model.save_weights(tmp_path / "keras" / "m.weights.json", max_shard_size=shard_gb)
    written = keras_orbax.save_weights(
        model, tmp_path / "ours" / "m.weights.json", window_bytes=64, max_shard_size=shard_gb
    )
    assert written == tmp_path / "ours" / "m.weights.json"
    names = sorted(p.name for p in (tmp_path / "keras").iterdir())
    sidecar = "m.weights.json.keras_orbax_checksums.json"  # Keras reads only the index's parts
    assert sorted(p.name for p in (tmp_path / "ours").iterdir()) == sorted([*names, sidecar])
    result = keras_orbax.verify(written)  # every part's datasets, checked
    assert result.intact and result.files == len(names) - 1 and result.unchecked == (), result
    assert len(names) > 3
    index = json.loads((tmp_path / "keras" / "m.weights.json").read_text())
    assert any(isinstance(parts, list) for parts in index["weight_map"].values())
    assert json.loads(written.read_text()) == index
    for name in (n for n in names if n.endswith(".h5")):
        assert h5_contents(tmp_path / "ours" / name) == h5_contents(tmp_path / "keras" / name)
    fresh = _models.compile_adam(_models.full_model())
    fresh.optimizer.build(fresh.trainable_variables)
    fresh.load_weights(written)
    for saved, loaded in zip(model.weights, fresh.weights, strict=True):
        assert np.array_equal(np.asarray(saved.value), np.asarray(loaded.value)), saved.path


def test_a_rename_that_fails_part_way_says_what_is_in_place(tmp_path):
    """An I/O error between the file's rename and its sidecar's: the new file is in place without
    its checksums, and the error says so (not that the previous export is untouched)."""
    from keras_orbax._src.storage import commit

    destination = tmp_path / "m.weights.h5"
    keras_orbax.save_weights(_models.mlp(), destination)
    keras.utils.set_random_seed(7)
    new = _models.mlp()

    def eio_before_the_sidecar(stage: str) -> None:
        if stage == "rename.last":
            raise OSError(errno.EIO, "Input/output error")

    with (
        commit.on_stage(eio_before_the_sidecar),
        pytest.raises(SaveFailedError, match="failed part-way") as failed,
    ):
        keras_orbax.save_weights(new, destination)
    message = str(failed.value)
    assert "In place now: the new m.weights.h5" in message and "untouched" not in message
    assert "removed: the previous m.weights.h5.keras_orbax_checksums.json" in message
    assert not keras_orbax.verify(destination).intact  # no checksums describe it
    loaded = _models.mlp()
    loaded.load_weights(destination)  # the new file, whole
    for got, want in zip(loaded.weights, new.weights, strict=True):
        np.testing.assert_array_equal(np.asarray(got.value), np.asarray(want.value))
