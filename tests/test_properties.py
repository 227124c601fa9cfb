"""Property-based: random shapes, dtypes, meshes and layouts on 8 devices; save under one layout,
restore under another, values equal exactly; one corrupted byte in a shard file is detected or
harmless. Derandomized, bounded: the same examples on every run."""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path

import hypothesis
import jax
import keras
import numpy as np
from hypothesis import strategies as st
from keras.distribution import DeviceMesh, LayoutMap, ModelParallel

import keras_orbax
from keras_orbax.errors import KerasOrbaxError
from tests import _models

SETTINGS = hypothesis.settings(
    max_examples=15,
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=[hypothesis.HealthCheck.too_slow],
)
DTYPES = ["float32", "float16", "bfloat16", "int8", "int32", "uint8", "bool"]
MESHES = [None, (8,), (2, 4), (4, 2), (2, 2, 2), (1, 8)]
DIMS = [1, 2, 3, 4, 5, 6, 8, 12, 16]


class Holder(keras.layers.Layer):
    """One weight of any shape and dtype; trainable only for floats."""

    def __init__(self, shape: tuple[int, ...], dtype: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.w = self.add_weight(
            shape=shape,
            dtype=dtype,
            initializer="zeros",
            trainable=dtype.startswith(("float", "bfloat")),
            name="w",
        )

    def call(self, x):
        return x


def _model(shape: tuple[int, ...], dtype: str) -> keras.Model:
    inputs = keras.Input((1,))
    return keras.Model(inputs, Holder(shape, dtype, name="holder")(inputs), name="holder_model")


@st.composite
def layouts(draw, shape: tuple[int, ...]):
    """A mesh (or None: one device) and, per dimension, None or mesh axes that divide it."""
    mesh_shape = draw(st.sampled_from(MESHES))
    if mesh_shape is None:
        return None, None
    names = [f"a{i}" for i in range(len(mesh_shape))]
    free = dict(zip(names, mesh_shape, strict=True))
    axes: list[str | tuple[str, ...] | None] = []
    for size in shape:
        usable = [n for n, m in free.items() if size % m == 0]
        chosen = draw(st.sampled_from([None, *usable]))
        if chosen is not None:
            del free[chosen]
        axes.append(chosen)
    return (tuple(mesh_shape), tuple(names)), tuple(axes)


def _distribution(layout) -> ModelParallel | None:
    mesh_spec, axes = layout
    if mesh_spec is None:
        return None
    mesh = DeviceMesh(mesh_spec[0], list(mesh_spec[1]), jax.devices())
    layout_map = LayoutMap(mesh)
    if any(a is not None for a in axes):
        layout_map[".*holder/w"] = axes
    return ModelParallel(layout_map=layout_map)


def _values(shape: tuple[int, ...], dtype: str, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if dtype == "bool":
        return rng.random(shape) < 0.5
    if dtype in ("int8", "uint8", "int32"):
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, shape, endpoint=True).astype(dtype)
    return rng.standard_normal(shape).astype(jax.numpy.dtype(dtype))


def _bytes(array: np.ndarray) -> bytes:
    return np.ascontiguousarray(array).tobytes()


def _save(directory: Path, shape, dtype, layout, fmt: str, seed: int) -> np.ndarray:
    keras.distribution.set_distribution(_distribution(layout))
    model = _model(shape, dtype)
    values = _values(shape, dtype, seed)
    model.get_layer("holder").w.assign(values)
    keras_orbax.save(model, directory, step=1, format=fmt)
    return np.asarray(model.get_layer("holder").w.value)


@st.composite
def cases(draw):
    shape = tuple(draw(st.lists(st.sampled_from(DIMS), min_size=0, max_size=3)))
    dtype = draw(st.sampled_from(DTYPES))
    return shape, dtype, draw(layouts(shape)), draw(layouts(shape))


@SETTINGS
@hypothesis.given(case=cases(), fmt=st.sampled_from(["fast", "compact"]), seed=st.integers(0, 99))
def test_save_under_one_layout_restore_under_another(case, fmt, seed):
    shape, dtype, saved_layout, restored_layout = case
    previous = keras.distribution.distribution()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            saved = _save(Path(tmp), shape, dtype, saved_layout, fmt, seed)
            keras.distribution.set_distribution(_distribution(restored_layout))
            model = _model(shape, dtype)
            keras_orbax.restore_sharded(model, tmp)
            variable = model.get_layer("holder").w
            restored = np.asarray(variable.value)
            assert restored.dtype == saved.dtype and restored.shape == shape
            assert _bytes(restored) == _bytes(saved)  # exact, NaN payloads and -0.0 included
            distribution = keras.distribution.distribution()
            if distribution is not None:
                want = distribution.get_variable_layout(variable).backend_layout
                assert variable.value.sharding.is_equivalent_to(want, len(shape))
    finally:
        keras.distribution.set_distribution(previous)


@SETTINGS
@hypothesis.given(
    case=cases(),
    seed=st.integers(0, 99),
    which=st.floats(0, 1, exclude_max=True),
    position=st.floats(0, 1, exclude_max=True),
    bit=st.integers(0, 7),
    packed=st.booleans(),
)
def test_one_corrupted_byte_in_a_shard_file_is_detected_or_harmless(
    case, seed, which, position, bit, packed
):
    """Fast format, restored with `verify=True` (each shard file's CRC-32C checked before it is
    read), the array in one file (`packed`, as small arrays are) or one per shard. Outcomes: a
    typed error with the model untouched, or the saved values exactly (proven harmless). No flip
    goes undetected."""
    shape, dtype, saved_layout, restored_layout = case
    previous = keras.distribution.distribution()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            with contextlib.nullcontext() if packed else _models.one_file_per_shard():
                saved = _save(Path(tmp), shape, dtype, saved_layout, "fast", seed)
            # <array>/c/<i>/<j>..., <array>/c.<i>.<j>... (packed), or <array>/c for 0-d
            files = sorted(
                p
                for p in (Path(tmp) / "1").rglob("*")
                if p.is_file() and ("c" in p.relative_to(tmp).parts or p.name.startswith("c."))
            )
            path = files[int(which * len(files))]
            data = bytearray(path.read_bytes())
            at = int(position * len(data))
            data[at] ^= 1 << bit
            path.write_bytes(bytes(data))

            keras.distribution.set_distribution(_distribution(restored_layout))
            model = _model(shape, dtype)
            before = _bytes(np.asarray(model.get_layer("holder").w.value))
            try:
                keras_orbax.restore_sharded(model, tmp, verify=True)
            except KerasOrbaxError as error:
                assert _bytes(np.asarray(model.get_layer("holder").w.value)) == before
                hypothesis.event(f"detected: {type(error).__name__}")
                return
            restored = _bytes(np.asarray(model.get_layer("holder").w.value))
            assert restored == _bytes(saved), f"undetected flip in {path} at byte {at}, bit {bit}"
            hypothesis.event("harmless: the saved values exactly")
    finally:
        keras.distribution.set_distribution(previous)
