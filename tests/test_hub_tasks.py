"""A keras-hub task's checkpoint, written by `ModelCheckpoint` while it trains sharded over a (2, 4)
mesh with keras-hub's layout map, loaded back by `load_model` and written by `convert` to each of
its targets.

keras-hub's `Task.__init__` compiles a default Adam, which cannot be built without allocating: the
task is rebuilt with keras-hub's own `compile=False`, then compiled from its saved config, and LoRA
enabled again where the step holds LoRA kernels. The oracles: the trained model's own variables,
Keras's `save_weights` of it, and keras-hub's loaders of what `convert` writes.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import NamedTuple

import h5py
import jax
import keras
import numpy as np
import pytest

import keras_orbax
from keras_orbax import cli
from keras_orbax.errors import KerasOrbaxWarning, NotDeferrableError
from tests import _hf_export, cli_models
from tests._hub import TINY_GEMMA, import_keras_hub

keras_hub = import_keras_hub()

# (architecture, LoRA rank or None): keras-hub's Gemma and Llama 3 tasks, with and without LoRA.
CASES = [("gemma", None), ("llama3", 2)]
_BACKBONE = {"gemma": TINY_GEMMA, "llama3": _hf_export.LLAMA3}


def _distribution(name: str) -> keras.distribution.ModelParallel:
    mesh = keras.distribution.DeviceMesh((2, 4), ("batch", "model"), jax.devices())
    layout_map = _hf_export.backbone_class(name).get_layout_map(mesh)
    return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")


def _datasets(path) -> dict[str, np.ndarray]:
    found: dict[str, np.ndarray] = {}
    with h5py.File(path) as f:
        f.visititems(lambda k, v: found.update({k: v[()]}) if isinstance(v, h5py.Dataset) else None)
    return found


def _values(variables) -> dict[str, np.ndarray]:
    return {v.path: np.asarray(v.value) for v in variables}


class Trained(NamedTuple):
    name: str
    task: keras.Model
    directory: Path


@pytest.fixture(scope="module", params=CASES, ids=lambda case: f"{case[0]}-lora{case[1]}")
def trained(request, tmp_path_factory):
    """A task trained for one epoch (2 batches) with `ModelCheckpoint`, as a user trains one."""
    name, rank = request.param
    previous = keras.distribution.distribution()
    keras.distribution.set_distribution(_distribution(name))
    backbone = _hf_export.backbone_class(name)(**_BACKBONE[name])
    task = _hf_export.causal_lm_class(name)(backbone=backbone, preprocessor=None)
    if rank:
        backbone.enable_lora(rank)
    task.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    tokens = np.random.default_rng(0).integers(0, 64, (8, 9)).astype("int32")
    x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((8, 8), "int32")}
    directory = tmp_path_factory.mktemp(f"{name}-ckpt")
    callback = keras_orbax.ModelCheckpoint(directory)
    task.fit(x, tokens[:, 1:], batch_size=4, epochs=1, callbacks=[callback], verbose=0)
    yield Trained(name, task, directory)
    keras.distribution.set_distribution(previous)


def test_load_model_gives_the_trained_task(trained):
    task, directory = trained.task, trained.directory
    loaded = keras_orbax.load_model(directory)
    assert type(loaded) is type(task)
    # Compiled as saved, not with keras-hub's default Adam(2e-5).
    assert type(loaded.optimizer) is keras.optimizers.Adam
    assert float(loaded.optimizer.learning_rate) == pytest.approx(1e-2)
    assert loaded.backbone.trainable_weights  # LoRA kernels (or all weights) trainable as saved
    assert [v.path for v in loaded.trainable_weights] == [v.path for v in task.trainable_weights]
    want = _values([*task.variables, *task.optimizer.variables])
    got = _values([*loaded.variables, *loaded.optimizer.variables])
    assert got.keys() == want.keys()
    for path, value in want.items():
        np.testing.assert_array_equal(got[path], value, err_msg=path)
    shardings = {v.path: v.value.sharding for v in task.variables}
    for variable in loaded.variables:
        assert variable.value.sharding.is_equivalent_to(shardings[variable.path], variable.ndim)


def test_load_model_without_compile_gives_the_weights(trained):
    task, directory = trained.task, trained.directory
    with pytest.warns(KerasOrbaxWarning, match=r"load it with compile=True \(the default\)"):
        loaded = keras_orbax.load_model(directory, compile=False)
    assert getattr(loaded, "optimizer", None) is None
    want = _values(task.variables)
    got = _values(loaded.variables)
    assert got.keys() == want.keys()
    for path, value in want.items():
        np.testing.assert_array_equal(got[path], value, err_msg=path)


def test_convert_to_weights_h5_writes_what_keras_save_weights_writes(trained, tmp_path):
    task, directory = trained.task, trained.directory
    task.save_weights(tmp_path / "keras.weights.h5")  # Keras's own writer: the oracle
    keras_orbax.convert(directory, tmp_path / "ours.weights.h5")
    expected, got = (
        _datasets(tmp_path / "keras.weights.h5"),
        _datasets(tmp_path / "ours.weights.h5"),
    )
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        np.testing.assert_array_equal(got[key], value, err_msg=key)


def test_convert_to_a_preset_on_the_command_line_under_a_mesh(trained, tmp_path):
    """`keras-orbax convert STEP DST --preset --mesh 2x4 --layout-map ...`; keras-hub's own
    `from_preset` reads what it wrote: the trained backbone, LoRA merged."""
    name, task, directory = trained.name, trained.task, trained.directory
    layout_map = f"tests.cli_models:{name}_layout_map"
    args = ["convert", str(directory), str(tmp_path / "preset"), "--preset", "--mesh", "2x4"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", KerasOrbaxWarning)
        assert cli.main([*args, "--layout-map", layout_map]) == 0
    loaded = keras_hub.models.CausalLM.from_preset(str(tmp_path / "preset"))
    assert type(loaded) is type(task)
    want = _hf_export.exported_values(task.backbone)
    got = _values(loaded.backbone.variables)
    assert got.keys() == want.keys()
    for path, value in want.items():
        np.testing.assert_array_equal(got[path], value, err_msg=path)


def test_convert_to_transformers_is_read_by_keras_hub(trained, tmp_path):
    name, task, directory = trained.name, trained.task, trained.directory
    keras_orbax.convert(directory, tmp_path / "hf", transformers=True)
    loaded = _hf_export.backbone_class(name).from_preset(str(tmp_path / "hf"))
    want = _hf_export.exported_values(task.backbone)
    got = _values(loaded.variables)
    assert got.keys() == want.keys()
    for path, value in want.items():
        np.testing.assert_allclose(got[path], value, rtol=1e-6, atol=1e-6, err_msg=path)


@pytest.mark.parametrize("trained", [CASES[0]], indirect=True, ids=["gemma"])
def test_a_task_built_deferred_is_told_to_pass_compile_false(trained, tmp_path, capsys):
    """keras-hub's `Task.__init__` compiles a default Adam, which `deferred_init` cannot build:
    each message names keras-hub's `compile=False`, and following it works."""
    advice = r"keras-hub task compiles a default optimizer when it is made: pass it compile=False"
    with pytest.raises(NotDeferrableError, match=advice), keras_orbax.deferred_init():
        cli_models.gemma_task()
    with keras_orbax.deferred_init():
        task = cli_models.gemma_task(compile=False)
    keras_orbax.restore_sharded(task, trained.directory)  # the weights; the optimizer warned of
    args = ["convert", str(trained.directory), str(tmp_path / "out.weights.h5"), "--model"]
    assert cli.main([*args, "tests.cli_models:gemma_task"]) == cli.EXIT_ERROR
    assert re.search(advice, capsys.readouterr().err)
    assert cli.main([*args, "tests.cli_models:gemma_task_uncompiled"]) == 0


def test_diff_of_a_task_step_against_its_exports_compares_the_backbone(trained, tmp_path):
    """A task's step keys its arrays by the task (`layers/gemma_backbone/...`), its preset by the
    backbone, a Hugging Face directory by tensor names: `diff` matches them by Keras paths."""
    task, directory = trained.task, trained.directory
    keras_orbax.convert(directory, tmp_path / "preset", preset=True)
    keras_orbax.convert(directory, tmp_path / "hf", transformers=True)
    exports = [tmp_path / "preset", tmp_path / "hf"]
    backbone = {v.path for v in task.backbone.variables}
    lora = {p for p in backbone if "lora_kernel" in p}
    merged = {p.replace("lora_kernel_a", "kernel") for p in lora if p.endswith("_a")}
    for export in exports:
        found = keras_orbax.diff(directory, export, values=True)
        assert found.matched_by and found.only_b == [] and found.changed == {}
        # The step's optimizer and metrics, and LoRA's kernels, which an export merges.
        saved = {v.path for v in [*task.optimizer.variables, *task.metrics_variables]}
        assert set(found.only_a) == saved | lora
        assert set(found.max_abs_diff) == backbone - lora
        differing = {p for p, d in found.max_abs_diff.items() if d > 1e-6}
        assert differing == merged  # the kernel LoRA updates: the step's is the one trained
