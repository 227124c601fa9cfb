"""Keras weights files whose datasets are stored big-endian restore with the values Keras's own
loader gives (h5py reads them into native order), not their bytes reinterpreted; bfloat16, which
Keras stores as 2-byte opaque data with a `dtype` attribute, still restores exactly."""

from __future__ import annotations

import zipfile
from pathlib import Path

import h5py
import keras
import numpy as np
import pytest

import keras_orbax
from tests import _models


def _model(dtype: str | None = None) -> keras.Model:
    """Embedding and Dense in `dtype`, then a float16 Dense: every kernel and the embedding table
    sharded by `_models.model_parallel`."""
    inputs = keras.Input((4,), dtype="int32")
    x = keras.layers.Embedding(16, 8, name="embed", dtype=dtype)(inputs)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(32, name="hidden", dtype=dtype)(x)
    outputs = keras.layers.Dense(8, name="head", dtype="float16")(x)
    return keras.Model(inputs, outputs, name="byte_order")


def _filled(model: keras.Model) -> keras.Model:
    """Distinct random values, so swapped bytes or a misplaced shard cannot pass."""
    rng = np.random.default_rng(7)
    for variable in model.weights:
        value = rng.standard_normal(tuple(variable.shape)).astype("float32")
        variable.assign(value.astype(keras.backend.standardize_dtype(variable.dtype)))
    return model


def _to_big_endian(h5: Path, chunks: bool = False) -> list[str]:
    """Rewrites every float dataset of `h5` big-endian (same name, attributes and values; chunked
    if asked, where Keras writes contiguous data); the names rewritten."""
    rewritten: list[str] = []
    with h5py.File(h5, "r+") as file:
        names: list[str] = []
        file.visititems(
            lambda n, o: (
                names.append(n) if isinstance(o, h5py.Dataset) and o.dtype.kind == "f" else None
            )
        )
        for name in names:
            dataset = file[name]
            data, attrs = dataset[()], dict(dataset.attrs)
            del file[name]
            big = data.astype(data.dtype.newbyteorder(">"))
            swapped = file.create_dataset(
                name, data=big, chunks=(1,) * big.ndim if chunks else None
            )
            swapped.attrs.update(attrs)
            assert swapped.dtype.byteorder == ">" and (swapped.chunks is not None) == chunks
            np.testing.assert_array_equal(swapped[()], data)
            rewritten.append(name)
    return rewritten


def _write(model: keras.Model, directory: Path, kind: str) -> Path:
    """`m.weights.h5` (its datasets chunked for `h5-chunked`), or `m.keras` with its weights member
    rewritten and stored again, with every float dataset big-endian."""
    if kind.startswith("h5"):
        path = directory / "m.weights.h5"
        model.save_weights(path)
        assert _to_big_endian(path, chunks=kind == "h5-chunked")
        return path
    path = directory / "m.keras"
    model.save(path)
    weights = directory / "model.weights.h5"
    with zipfile.ZipFile(path) as zf:
        members = {name: zf.read(name) for name in zf.namelist()}
    weights.write_bytes(members["model.weights.h5"])
    assert _to_big_endian(weights)
    members["model.weights.h5"] = weights.read_bytes()
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:  # Keras stores members so
        for name, data in members.items():
            zf.writestr(name, data)
    return path


def _keras_loaded(build, path: Path) -> keras.Model:
    """The oracle: Keras's own loader."""
    if path.name.endswith(".keras"):
        return keras.saving.load_model(path)
    model = build()
    model.load_weights(path)
    return model


@pytest.mark.parametrize("kind", ["h5", "h5-chunked", "keras"])
@pytest.mark.parametrize("dtype", [None, "bfloat16"], ids=["float32", "bfloat16"])
def test_big_endian_datasets_restore_like_keras(tmp_path, distribution, kind, dtype):
    """float32 or bfloat16 (stored as opaque 2-byte data, left as is), and float16, big-endian."""
    build = lambda: _model(dtype)  # noqa: E731
    original = _models.values(_filled(build()).weights)
    path = _write(_filled(build()), tmp_path, kind)
    expected = _models.values(_keras_loaded(build, path).weights)
    for want, value in zip(original, expected, strict=True):
        np.testing.assert_array_equal(value, want)  # Keras converts what h5py reads

    dist = distribution(_models.model_parallel((2, 4)))
    with keras_orbax.deferred_init():
        model = build()
    keras_orbax.restore_sharded(model, path)
    for variable, want in zip(model.weights, expected, strict=True):
        value = variable.value
        assert value.dtype == want.dtype, variable.path
        np.testing.assert_array_equal(np.asarray(value), want, err_msg=variable.path)
        laid_out = dist.get_variable_layout(variable).backend_layout
        assert value.sharding.is_equivalent_to(laid_out, value.ndim), variable.path
    kernel = model.get_layer("hidden").kernel.value
    assert tuple(kernel.sharding.spec) == ("batch", "model")
    assert kernel.sharding.mesh.devices.shape == (2, 4)
    assert tuple(model.get_layer("embed").embeddings.value.sharding.spec) == (None, "model")


def test_big_endian_datasets_are_listed_in_native_dtypes(tmp_path):
    """inspect, diff and plan share this listing: `>f4` would never equal a model's float32."""
    path = _write(_filled(_model()), tmp_path, "h5")
    listed = {k: v.dtype for k, v in keras_orbax.inspect(path).record.variables.items()}
    assert listed == {
        "layers/embedding/vars/0": "float32",
        "layers/dense/vars/0": "float32",
        "layers/dense/vars/1": "float32",
        "layers/dense_1/vars/0": "float16",
        "layers/dense_1/vars/1": "float16",
    }


def test_big_endian_sharded_weights_restore_like_keras(tmp_path, distribution):
    """A `.weights.json` whose parts are rewritten big-endian."""
    model = _filled(_model())
    model.save_weights(tmp_path / "m.weights.json", max_shard_size=0.000004)
    parts = sorted(tmp_path.glob("m_*.weights.h5"))
    assert len(parts) > 1 and sum(len(_to_big_endian(p)) for p in parts) == 5
    path = tmp_path / "m.weights.json"
    expected = _models.values(_keras_loaded(_model, path).weights)
    distribution(_models.model_parallel((2, 4)))
    with keras_orbax.deferred_init():
        restored = _model()
    keras_orbax.restore_sharded(restored, path)
    for variable, want in zip(restored.weights, expected, strict=True):
        np.testing.assert_array_equal(np.asarray(variable.value), want, err_msg=variable.path)
