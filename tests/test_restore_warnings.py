"""A restore says so when it matters (one device of several, optimizer state dropped, variables
left as they were by `strict=False`) and stays quiet otherwise; its messages hold no array values,
count with the right plural and give advice only where it applies."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import h5py
import keras
import numpy as np
import pytest

import keras_orbax
from keras_orbax._src.sources.keras_loader import reason
from keras_orbax.errors import CheckpointMismatchError, CorruptCheckpointError, KerasOrbaxWarning
from tests import _models

ONE_DEVICE = r"No keras\.distribution is set: model 'mlp' is restored onto one device of the 8"
HINT = "pass strict=False"
# Printed array values: three numbers with a decimal point in a row, as numpy prints them.
ARRAY_VALUES = re.compile(r"(-?\d+\.\d*(e[-+]?\d+)?[\s,\[\]]+){3}")


@pytest.fixture
def trained(tmp_path, distribution) -> Path:
    """`_models.mlp()` compiled with Adam and `mae`, trained one epoch, saved at step 1."""
    distribution(_models.data_parallel())
    model = _models.compile_adam(_models.mlp())
    x = np.random.default_rng(0).random((8, 16), dtype="float32")
    model.fit(x, x[:, :8], batch_size=8, epochs=2, verbose=0)
    keras_orbax.save(model, tmp_path / "ckpt", step=1)
    model.save_weights(tmp_path / "m.weights.h5")
    keras.distribution.set_distribution(None)  # each test sets the one it restores under
    return tmp_path


def _ours(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, KerasOrbaxWarning)]


def _quiet(restore) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        restore()
    assert _ours(caught) == []


def test_no_distribution_on_several_devices_warns_at_the_callers_line(trained):
    with pytest.warns(KerasOrbaxWarning, match=ONE_DEVICE) as caught:
        keras_orbax.restore_sharded(_models.compile_adam(_models.mlp()), trained / "ckpt")
    (said,) = [w for w in caught if "distribution" in str(w.message)]
    assert said.filename == __file__  # attributed to the call, not to keras-orbax's insides
    assert "ModelParallel with a LayoutMap" in str(said.message)
    assert "DataParallel" in str(said.message)
    with pytest.warns(KerasOrbaxWarning, match=ONE_DEVICE) as caught:
        keras_orbax.load_model(trained / "ckpt")
    assert [w.filename for w in caught if "distribution" in str(w.message)] == [__file__]


@pytest.mark.parametrize("kind", ["data", "model"])
def test_a_distribution_keeps_it_quiet(trained, distribution, kind):
    dist = _models.data_parallel() if kind == "data" else _models.model_parallel((2, 4))
    distribution(dist)
    _quiet(
        lambda: keras_orbax.restore_sharded(_models.compile_adam(_models.mlp()), trained / "ckpt")
    )
    _quiet(lambda: keras_orbax.load_model(trained / "ckpt"))


def test_an_uncompiled_model_hears_that_the_optimizer_state_was_dropped(trained, distribution):
    distribution(_models.data_parallel())
    with pytest.warns(KerasOrbaxWarning) as caught:
        result = keras_orbax.restore_sharded(_models.mlp(), trained / "ckpt")
    optimizer = [k for k in result.skipped if k.startswith("optimizer/")]
    metrics = [k for k in result.skipped if k.startswith("metrics/")]
    assert len(optimizer) == 10 and len(metrics) == 4
    assert _ours(caught) == [
        f"Model 'mlp' has no optimizer, so 10 optimizer variables and 4 metric variables of "
        f"'{trained / 'ckpt' / '1'}' were not restored. To resume training from them, compile the "
        "model with its optimizer before restore_sharded, or use keras_orbax.load_model, which "
        "compiles the model from its saved config."
    ]
    # A weights file holds no model config: load_model is not offered.
    with pytest.warns(KerasOrbaxWarning) as caught:
        keras_orbax.restore_sharded(_models.mlp(), trained / "m.weights.h5")
    (said,) = _ours(caught)
    assert "so 10 optimizer variables of" in said and "were not restored" in said
    assert "load_model" not in said


def test_one_dropped_optimizer_variable_is_counted_in_the_singular(tmp_path, distribution):
    distribution(_models.data_parallel())
    path = tmp_path / "m.weights.h5"
    _models.mlp().save_weights(path)
    with h5py.File(path, "a") as file:
        file.create_dataset("optimizer/vars/0", data=np.zeros((), "int64"))
    with pytest.warns(KerasOrbaxWarning) as caught:
        keras_orbax.restore_sharded(_models.mlp(), path)
    (said,) = _ours(caught)
    assert f"so 1 optimizer variable of '{path}' was not restored." in said


def test_a_compiled_model_takes_it_all_quietly(trained, distribution):
    distribution(_models.data_parallel())
    model = _models.compile_adam(_models.mlp())
    _quiet(lambda: keras_orbax.restore_sharded(model, trained / "ckpt"))
    assert int(model.optimizer.iterations.value) == 2


def _wider(extra: int, center: bool = True) -> keras.Model:
    """`_models.mlp()` with `extra` LayerNormalization layers the checkpoint does not hold (each
    with 2 variables, or 1 without `center`)."""
    inputs = keras.Input((16,))
    x = keras.layers.Dense(32, name="hidden")(inputs)
    for i in range(extra):
        x = keras.layers.LayerNormalization(name=f"norm{i}", center=center)(x)
    return keras.Model(inputs, keras.layers.Dense(8, name="head")(x), name="mlp")


@pytest.mark.parametrize(
    ("extra", "center", "listed"),
    [
        (
            1,
            False,
            "1 variable of model 'mlp' that '{}' lacks or holds with another shape or dtype: "
            "norm0/gamma. It keeps its initial value, and so does its optimizer state "
            "(12 variables), restored whole or not at all.",
        ),
        (
            6,
            True,
            "12 variables of model 'mlp' that '{}' lacks or holds with another shape or dtype: "
            "norm0/gamma, norm0/beta, norm1/gamma, norm1/beta, norm2/gamma, norm2/beta, "
            "norm3/gamma, norm3/beta, norm4/gamma, norm4/beta, and 2 more. They keep their "
            "initial values, and so does its optimizer state (34 variables), restored whole or "
            "not at all.",
        ),
    ],
)
def test_strict_false_names_what_it_left_by_keras_path(
    trained, distribution, extra, center, listed
):
    distribution(_models.data_parallel())
    model = _models.compile_adam(_wider(extra, center))
    with pytest.warns(KerasOrbaxWarning) as caught:
        result = keras_orbax.restore_sharded(model, trained / "ckpt", strict=False)
    (said,) = _ours(caught)
    assert said == "restore_sharded(strict=False) did not restore " + listed.format(
        trained / "ckpt" / "1"
    )
    gamma = "layers/layer_normalization/vars/0"
    assert gamma in result.skipped and result.paths[gamma] == "norm0/gamma"
    assert result.paths["layers/dense/vars/0"] == "hidden/kernel"
    assert "skipped=[norm0/gamma" in repr(result) and "norm0/gamma" in result.skipped_paths
    assert "restored=6 variables" in repr(result)  # 4 weights, the loss tracker's 2


def test_strict_false_names_an_optimizer_state_it_left(trained, distribution):
    distribution(_models.data_parallel())
    model = _models.mlp()
    model.compile(optimizer=keras.optimizers.SGD(momentum=0.9), loss="mse")
    with pytest.warns(KerasOrbaxWarning) as caught:
        keras_orbax.restore_sharded(model, trained / "ckpt", strict=False)
    assert _ours(caught) == [
        "restore_sharded(strict=False) did not restore the optimizer state (6 variables) of "
        f"model 'mlp': '{trained / 'ckpt' / '1'}' holds it for other variables, shapes or dtypes, "
        "and it is restored whole or not at all. It keeps its initial values."
    ]


def test_strict_false_with_nothing_left_is_quiet(trained, distribution):
    distribution(_models.data_parallel())
    _quiet(
        lambda: keras_orbax.restore_sharded(
            _models.compile_adam(_models.mlp()), trained / "ckpt", strict=False
        )
    )


def _mismatch(model: keras.Model, location: Path) -> str:
    with pytest.raises(CheckpointMismatchError) as caught:
        keras_orbax.restore_sharded(model, location)
    return str(caught.value)


def test_problems_are_counted_in_the_singular_and_plural(trained, distribution):
    distribution(_models.data_parallel())
    inputs = keras.Input((16,))
    x = keras.layers.Dense(32, name="hidden", use_bias=False)(inputs)
    one = keras.Model(inputs, keras.layers.Dense(8, name="head")(x), name="mlp")
    # Uncompiled: the checkpoint's optimizer state is no problem, so only the weights count.
    assert "/1': 1 problem.\n" in _mismatch(one, trained / "ckpt")
    assert "/1': 2 problems.\n" in _mismatch(_wider(1), trained / "ckpt")


def test_the_strict_hint_only_where_strict_false_would_go_ahead(trained, distribution):
    distribution(_models.model_parallel((2, 4)))
    # Keys on one side, shapes that differ: strict=False restores the rest.
    assert HINT in _mismatch(_models.compile_adam(_wider(1)), trained / "ckpt")
    assert HINT in _mismatch(_models.compile_adam(_models.mlp(width=24)), trained / "ckpt")
    # A layout the mesh does not divide (30 columns over 4 devices) fails whatever the strictness.
    with keras_orbax.deferred_init():
        model = _models.mlp(width=30)
    _models.compile_adam(model)
    message = _mismatch(model, trained / "ckpt")
    assert "(size 30) into 4 parts" in message and HINT not in message
    with pytest.raises(CheckpointMismatchError, match="does not divide it"):
        keras_orbax.restore_sharded(model, trained / "ckpt", strict=False)


def test_a_weights_file_mismatch_holds_no_array_values(trained, distribution):
    distribution(_models.data_parallel())
    path = trained / "m.weights.h5"
    message = _mismatch(_models.mlp(width=24), path)
    assert message.splitlines()[1:] == [
        "  layers/dense/vars/0: checkpoint layers/dense/vars/0 (16, 32) float32, "
        "model hidden/kernel (16, 24) float32",
        "  layers/dense/vars/1: checkpoint layers/dense/vars/1 (32,) float32, "
        "model hidden/bias (24,) float32",
        "  layers/dense_1/vars/0: checkpoint layers/dense_1/vars/0 (32, 8) float32, "
        "model head/kernel (24, 8) float32",
        f"No variable was modified. {keras_orbax._src.model.matching.STRICT_HINT}",
    ]
    assert f"from '{path}': 3 problems." in message
    # Compiled: the optimizer's slots differ too, each on its line; Keras's own errors (each
    # printing every value of the variable) are not repeated.
    message = _mismatch(_models.compile_adam(_models.mlp(width=24)), path)
    lines = message.splitlines()
    assert not [line for line in lines if ARRAY_VALUES.search(line)], message
    assert "Keras cannot load" not in message and all(len(line) < 200 for line in lines)
    assert "model adam" in message and "hidden_kernel_momentum (16, 24) float32" in message


def test_keras_errors_are_reduced_to_one_line_without_values():
    variable = keras.Variable(np.random.default_rng(0).random((16, 24)), name="kernel")
    with pytest.raises(ValueError) as caught:
        variable.assign(np.zeros((16, 32)))
    assert len(str(caught.value).splitlines()) > 10  # Keras prints every value
    said = reason(caught.value)
    assert "\n" not in said and not ARRAY_VALUES.search(said)
    assert f"{variable.path} (16, 24) float32" in said and "value.shape=(16, 32)" in said


@pytest.mark.parametrize("damaged", [1, 2])
def test_damaged_files_are_counted_in_the_singular_and_plural(one_file_per_shard, trained, damaged):
    step = trained / "ckpt" / "1" / "state"
    files = sorted(p for p in step.glob("layers.dense*.vars.*/c/**/*") if p.is_file())
    for file in files[:damaged]:
        file.write_bytes(b"")
    with pytest.raises(CorruptCheckpointError) as caught:
        keras_orbax.verify(trained / "ckpt")
    failed = "1 array file failed:\n" if damaged == 1 else "2 array files failed:\n"
    assert failed in str(caught.value)


def test_a_weights_only_step_restores_into_a_compiled_model_leaving_its_optimizer(
    tmp_path, distribution
):
    """As Keras's `load_weights` of a file without optimizer state: the weights are restored, the
    optimizer stays as it is, and nothing is said (the step was saved without it on purpose)."""
    distribution(_models.data_parallel())
    model = _models.compile_adam(_models.mlp())
    x = np.random.default_rng(0).random((8, 16), dtype="float32")
    callback = keras_orbax.ModelCheckpoint(
        tmp_path / "ckpt", save_weights_only=True, save_on_background=False
    )
    model.fit(x, x[:, :8], batch_size=8, epochs=1, verbose=0, callbacks=[callback])
    target = _models.compile_adam(_models.mlp())
    target.optimizer.build(target.trainable_variables)
    target.optimizer.iterations.assign(7)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        keras_orbax.restore_sharded(target, tmp_path / "ckpt")
    assert _ours(caught) == []
    for saved, restored in zip(model.weights, target.weights, strict=True):
        np.testing.assert_array_equal(np.asarray(restored.value), np.asarray(saved.value))
    assert int(target.optimizer.iterations.value) == 7
    loaded = keras_orbax.load_model(tmp_path / "ckpt")  # compiled from the step's config
    assert loaded.optimizer is not None
    for saved, restored in zip(model.weights, loaded.weights, strict=True):
        np.testing.assert_array_equal(np.asarray(restored.value), np.asarray(saved.value))


def test_load_model_skips_optimizer_state_of_another_class_as_keras_does(tmp_path):
    """A `mixed_float16` model saved with its LossScaleOptimizer, loaded under the float32 policy:
    Keras's `load_model` compiles plain Adam, restores the weights and skips the optimizer state
    with a warning; so does keras-orbax's (it had refused the whole model)."""
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_float16")
    try:
        model = _models.compile_adam(_models.mlp())
        model.optimizer.build(model.trainable_variables)
        _models.fill_arange(model)
        keras_orbax.save(model, tmp_path / "ckpt", step=1)
        model.save(tmp_path / "m.keras")
    finally:
        keras.config.set_dtype_policy(previous)

    keras_model = keras.saving.load_model(tmp_path / "m.keras")
    assert type(keras_model.optimizer) is keras.optimizers.Adam
    for location in (tmp_path / "ckpt", tmp_path / "m.keras"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loaded = keras_orbax.load_model(location)
        assert type(loaded.optimizer) is keras.optimizers.Adam
        for got, want in zip(loaded.weights, keras_model.weights, strict=True):
            np.testing.assert_array_equal(np.asarray(got.value), np.asarray(want.value))
        (said,) = [m for m in _ours(caught) if "optimizer state" in m]
        assert "does not fit the Adam compiled from its config" in said
        assert "keras.config.set_dtype_policy('mixed_float16')" in said
        assert not loaded.optimizer.built or int(loaded.optimizer.iterations) == 0


def _layout_map(kernel_key: str) -> keras.distribution.ModelParallel:
    mesh = keras.distribution.DeviceMesh((2, 4), ("batch", "model"))
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[kernel_key] = ("batch", "model")
    return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")


@pytest.fixture
def sharded(tmp_path, distribution) -> Path:
    """`_models.mlp()` and its Adam state saved with both kernels split over a (2, 4) mesh."""
    distribution(_models.model_parallel((2, 4)))
    model = _models.compile_adam(_models.mlp())
    model.optimizer.build(model.trainable_variables)
    keras_orbax.save(model, tmp_path, step=1)
    return tmp_path


def test_a_layout_map_that_matches_nothing_warns_once_naming_what_is_replicated(
    sharded, distribution
):
    """A typo in a LayoutMap key replicates what the checkpoint holds sharded: one warning names
    every such variable, the bytes per device and how keys match."""
    distribution(_layout_map(".*kernal"))
    model = _models.compile_adam(_models.mlp())
    with pytest.warns(KerasOrbaxWarning) as caught:
        keras_orbax.restore_sharded(model, sharded)
    (said,) = [str(w.message) for w in caught if "restored whole" in str(w.message)]
    assert said.startswith(
        "Model 'mlp': 6 variables saved sharded are restored whole on each of the 8 devices, "
    )
    assert re.search(r"devices, 9\.0 KiB per device: hidden/kernel \(2\.0 KiB\), ", said)
    assert re.search(r"adam(_\d+)?/head_kernel_velocity \(1\.0 KiB\)\. ", said)
    assert "re.fullmatch" in said and "'.*dense.*kernel' does" in said
    assert model.get_layer("hidden").kernel.value.sharding.is_fully_replicated


def test_a_layout_map_that_matches_is_quiet(sharded, distribution):
    distribution(_layout_map(".*kernel"))
    _quiet(lambda: keras_orbax.restore_sharded(_models.compile_adam(_models.mlp()), sharded))


def test_one_device_or_a_replicated_checkpoint_is_not_said_to_be_replicated(
    trained, sharded, distribution
):
    distribution(_layout_map(".*kernal"))  # saved replicated (DataParallel): nothing changes
    _quiet(
        lambda: keras_orbax.restore_sharded(_models.compile_adam(_models.mlp()), trained / "ckpt")
    )
    mesh = keras.distribution.DeviceMesh(
        (1, 1), ("batch", "model"), keras.distribution.list_devices()[:1]
    )
    layout_map = keras.distribution.LayoutMap(mesh)
    distribution(keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch"))
    _quiet(lambda: keras_orbax.restore_sharded(_models.compile_adam(_models.mlp()), sharded))
