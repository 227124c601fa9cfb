"""Small files read from the page cache at once and from disk by tensorstore (`small_files`), and
a restore of many small variables from a cold page cache against Keras's own load."""

import os

import keras
import numpy as np
import pytest
import tensorstore as ts

import keras_orbax
from keras_orbax._src.storage import small_files
from keras_orbax._src.storage.small_files import SmallFiles
from tests import _models
from tests._page_cache import evict


def _tensorstore_file_reads() -> int:
    metrics = ts.experimental_collect_matching_metrics("/tensorstore/kvstore/file/read")
    return sum(v.get("value", 0) for m in metrics for v in m.get("values", []))


def _write_files(directory) -> dict[str, bytes]:
    rng = np.random.default_rng(0)
    written = {}
    for i, size in enumerate([0, 1, 63, 4096, 4097, 100_000] * 4):
        path = str(directory / f"f{i}")
        written[path] = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        with open(path, "wb") as f:
            f.write(written[path])
    return written


def _read_all(paths: list[str]) -> tuple[dict[str, np.ndarray | None], int]:
    """What `SmallFiles` gives for each path, and how many files tensorstore read for it."""
    files = SmallFiles()
    before = _tensorstore_file_reads()
    for path in paths:
        files.start(path)
    got = {path: files.get(path) for path in paths}
    return got, _tensorstore_file_reads() - before


@pytest.mark.skipif(not hasattr(os, "RWF_NOWAIT"), reason="RWF_NOWAIT is Linux's")
def test_files_in_the_page_cache_are_read_at_once(tmp_path):
    written = _write_files(tmp_path)  # just written: in the page cache
    missing = str(tmp_path / "missing")
    got, tensorstore_reads = _read_all([*written, missing])
    assert tensorstore_reads == 0
    assert got.pop(missing) is None
    for path, data in got.items():
        assert data is not None and data.tobytes() == written[path], path
        assert not data.size or data.ctypes.data % 64 == 0  # a device adopts it without a copy


@pytest.mark.parametrize("cold", ["evicted", "never_cached"])
def test_files_not_in_the_page_cache_are_read_by_tensorstore(tmp_path, monkeypatch, cold):
    """Evicted: each file read by tensorstore, unless asking for it has read it in already; with
    no page-cache reads at all (no `RWF_NOWAIT`: not Linux), every file."""
    written = _write_files(tmp_path)
    evict(list(written))
    if cold == "never_cached":
        monkeypatch.setattr(small_files, "_NOWAIT", 0)
    missing = str(tmp_path / "missing")
    got, tensorstore_reads = _read_all([*written, missing])
    if cold == "never_cached":
        assert tensorstore_reads == len(written) + 1
    assert got.pop(missing) is None
    for path, data in got.items():
        assert data is not None and data.tobytes() == written[path], path
        assert not data.size or data.ctypes.data % 64 == 0


def _independent_dense(layers: int) -> keras.Model:
    inputs = keras.Input((16,))
    outputs = [keras.layers.Dense(8, name=f"d{i}")(inputs) for i in range(layers)]
    return keras.Model(inputs, outputs)


@pytest.mark.skipif(not hasattr(os, "RWF_NOWAIT"), reason="RWF_NOWAIT is Linux's")
def test_many_small_variables_restore_cold_or_warm_as_keras_loads_them(
    tmp_path, distribution, monkeypatch
):
    """Each small array is one file: read from the page cache at once, or by tensorstore (evicted,
    or no page-cache reads at all); every way gives what Keras's own `load_weights` of the same
    weights gives, on the saved layout."""
    distribution(_models.model_parallel((2, 4)))
    model = _independent_dense(12)
    _models.fill_arange(model)
    keras_orbax.save(model, tmp_path / "ckpt", step=1)
    model.save_weights(tmp_path / "model.weights.h5")
    expected = _independent_dense(12)
    expected.load_weights(tmp_path / "model.weights.h5")
    files = [str(p) for p in (tmp_path / "ckpt").rglob("*") if p.is_file()]
    for case in ("evicted", "never_cached", "warm"):
        if case == "evicted":
            evict(files)
        with keras_orbax.deferred_init():
            restored = _independent_dense(12)
        with monkeypatch.context() as patch:
            if case == "never_cached":
                patch.setattr(small_files, "_NOWAIT", 0)
            before = _tensorstore_file_reads()
            keras_orbax.restore_sharded(restored, tmp_path / "ckpt")
            reads = _tensorstore_file_reads() - before
        if case == "never_cached":  # 24 arrays: each one's zarr.json and its one data file
            assert reads == 48
        if case == "warm":
            assert reads == 0
        for ours, theirs in zip(restored.variables, expected.variables, strict=True):
            np.testing.assert_array_equal(ours.value, theirs.value)
            assert ours.value.sharding.is_equivalent_to(theirs.value.sharding, ours.value.ndim)
