"""Bad input: a clear error that names the directory, step, variables or files; the model untouched."""

from __future__ import annotations

from pathlib import Path

import keras
import numpy as np
import orbax.checkpoint.experimental.v1 as ocp
import pytest

import keras_orbax
from keras_orbax.errors import (
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    DuplicateKeyError,
    StepExistsError,
)
from tests import _models

# These tests name the files of single shards (`c/1/2`) or cut the saved shards.
pytestmark = pytest.mark.usefixtures("one_file_per_shard")


@pytest.fixture
def saved(tmp_path, distribution) -> Path:
    """A checkpoint of `_models.mlp()` at step 3, saved on a (2, 4) mesh."""
    distribution(_models.model_parallel((2, 4)))
    model = _models.mlp()
    _models.fill_arange(model)
    keras_orbax.save(model, tmp_path / "ckpt", step=3)
    return tmp_path / "ckpt"


def _restore_fails(model: keras.Model, directory: Path, error: type, match: str, **kwargs) -> None:
    before = _models.values(model.variables)
    with pytest.raises(error, match=match):
        keras_orbax.restore_sharded(model, directory, **kwargs)
    for variable, want in zip(model.variables, before, strict=True):
        np.testing.assert_array_equal(np.asarray(variable.value), want, err_msg=variable.path)


def test_missing_directory(tmp_path):
    _restore_fails(
        _models.mlp(), tmp_path / "nope", CheckpointNotFoundError, r"does not exist: '.*nope'"
    )


def test_directory_that_is_not_a_checkpoint(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    _restore_fails(_models.mlp(), tmp_path, CheckpointNotFoundError, "No committed checkpoint step")


def test_directory_with_only_an_interrupted_save(tmp_path):
    (tmp_path / "5.orbax-checkpoint-tmp-1234" / "state").mkdir(parents=True)
    _restore_fails(_models.mlp(), tmp_path, CheckpointNotFoundError, "No committed checkpoint step")


def test_step_that_does_not_exist(saved):
    match = r"Step 7 is not a committed step of .*Committed steps: \[3\]"
    _restore_fails(_models.mlp(), saved, CheckpointNotFoundError, match, step=7)


def test_other_architecture_lists_every_offending_variable(saved):
    model = _models.mlp(width=24)
    _restore_fails(
        model,
        saved,
        CheckpointMismatchError,
        r"(?s)'mlp' from .*/3': 3 problems.*No variable was modified",
    )
    with pytest.raises(CheckpointMismatchError) as caught:
        keras_orbax.restore_sharded(model, saved)
    assert caught.value.problems == (
        "layers/dense/vars/0: checkpoint hidden/kernel (16, 32) float32, "
        "model hidden/kernel (16, 24) float32",
        "layers/dense/vars/1: checkpoint hidden/bias (32,) float32, model hidden/bias (24,) float32",
        "layers/dense_1/vars/0: checkpoint head/kernel (32, 8) float32, "
        "model head/kernel (24, 8) float32",
    )


def test_missing_and_unexpected_keys(saved):
    inputs = keras.Input((16,))
    hidden = keras.layers.Dense(32, name="hidden")(inputs)
    extra = keras.layers.LayerNormalization(name="extra")(hidden)
    model = keras.Model(inputs, keras.layers.Dense(8, name="head")(extra), name="mlp")
    _restore_fails(model, saved, CheckpointMismatchError, r"pass strict=False")
    with pytest.raises(CheckpointMismatchError) as caught:
        keras_orbax.restore_sharded(model, saved)
    assert caught.value.problems == (
        "layers/layer_normalization/vars/0 (model: extra/gamma): in the model, not in the checkpoint",
        "layers/layer_normalization/vars/1 (model: extra/beta): in the model, not in the checkpoint",
    )

    result = keras_orbax.restore_sharded(model, saved, strict=False)
    assert result.skipped == (
        "layers/layer_normalization/vars/0",
        "layers/layer_normalization/vars/1",
    )
    np.testing.assert_array_equal(np.asarray(model.get_layer("extra").gamma.value), np.ones(32))
    assert float(model.get_layer("hidden").kernel.value[0, 1]) == 1.0  # arange, restored


def test_truncated_array_file(saved):
    shard = saved / "3" / "state" / "layers.dense.vars.0" / "c" / "1" / "2"
    with open(shard, "r+b") as file:
        file.truncate(shard.stat().st_size // 2)
    _restore_fails(
        _models.mlp(),
        saved,
        CorruptCheckpointError,
        r"layers/dense/vars/0: .*c/1/2 has \d+ bytes",
    )


def test_missing_array_file(saved):
    shard = saved / "3" / "state" / "layers.dense_1.vars.0" / "c" / "0" / "3"
    shard.unlink()
    _restore_fails(
        _models.mlp(),
        saved,
        CorruptCheckpointError,
        r"layers/dense_1/vars/0: missing file .*c/0/3",
    )


def test_missing_file_on_the_resharding_path(saved, distribution):
    shard = saved / "3" / "state" / "layers.dense_1.vars.0" / "c" / "0" / "3"
    shard.unlink()
    distribution(_models.model_parallel((4, 2)))
    _restore_fails(
        _models.mlp(), saved, CorruptCheckpointError, r"layers/dense_1/vars/0: missing file"
    )


def test_missing_file_in_the_compact_format(tmp_path, distribution):
    distribution(_models.model_parallel((2, 4)))
    keras_orbax.save(_models.mlp(), tmp_path, step=1, format="compact")
    data = [p for p in (tmp_path / "1" / "state").rglob("d/*") if p.is_file()]
    assert data, "the compact format keeps its chunks in OCDBT data files"
    for path in data:
        path.unlink()
    # checked against the CRCs recorded of each OCDBT file before Orbax reads any
    _restore_fails(
        _models.mlp(),
        tmp_path,
        CorruptCheckpointError,
        r"(?s)OCDBT files of the compact format's arrays layers/dense/vars/0.*/d/\w+: missing",
    )


def test_layout_the_mesh_does_not_divide(tmp_path, distribution):
    distribution(None)
    keras_orbax.save(_models.mlp(width=6), tmp_path, step=1)
    distribution(_models.model_parallel((2, 4)))
    with keras_orbax.deferred_init():
        model = _models.mlp(width=6)  # hidden kernel (16, 6): 6 columns over 4 devices
    with pytest.raises(
        CheckpointMismatchError, match=r"hidden/kernel.*dimension 1 \(size 6\) into 4 parts"
    ):
        keras_orbax.restore_sharded(model, tmp_path, strict=False)
    assert all(v._value is None for v in model.variables)


def test_orbax_checkpoint_not_written_by_keras_orbax(tmp_path):
    ocp.save(tmp_path / "1", {"w": np.ones(3)})
    _restore_fails(_models.mlp(), tmp_path, CorruptCheckpointError, "not written by keras-orbax")


def _tree(root: Path) -> dict[str, tuple]:
    """Every file and directory under `root`: inode, modification time (ns) and file content. (A
    directory's own mtime changes only when an entry directly in it comes or goes: a file written
    over in place, or anything in a subdirectory, leaves it as it was.)"""
    return {
        str(p.relative_to(root)): (
            p.stat().st_ino,
            p.stat().st_mtime_ns,
            None if p.is_dir() else p.read_bytes(),
        )
        for p in [root, *root.rglob("*")]
    }


def test_saving_a_committed_step_again_is_refused(saved, distribution):
    distribution(_models.model_parallel((2, 4)))
    model = _models.mlp()
    before = _tree(saved)
    with pytest.raises(StepExistsError, match=r"Step 3 is already committed in .*overwrite=True"):
        keras_orbax.save(model, saved, step=3)
    assert _tree(saved) == before  # nothing written, replaced or added anywhere in the directory
    keras_orbax.save(model, saved, step=3, overwrite=True)
    assert float(keras_orbax.restore_sharded(model, saved).step) == 3


@pytest.mark.parametrize(
    ("step", "error"),
    [(-1, ValueError), (2.5, TypeError), (True, TypeError), ("7", TypeError), (None, TypeError)],
)
def test_a_step_that_is_not_a_count_is_refused_before_anything_is_written(tmp_path, step, error):
    with pytest.raises(error, match=r"step must be .*Received: step="):
        keras_orbax.save(_models.mlp(), tmp_path, step=step)
    assert list(tmp_path.iterdir()) == []


def test_a_step_may_be_any_integer_keras_or_numpy_gives(tmp_path):
    model = _models.compile_adam(_models.mlp())
    model.optimizer.build(model.trainable_variables)
    model.optimizer.iterations.assign(4)
    iterations = model.optimizer.iterations
    for step in (np.int64(1), np.int32(2), iterations.value - 1, iterations):
        keras_orbax.save(model, tmp_path, step=step)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1", "2", "3", "4"]
    assert keras_orbax.restore_sharded(model, tmp_path).step == 4


def test_two_metrics_of_one_name_get_advice(tmp_path):
    """Metric variables are keyed by path: two `MeanAbsoluteError()`s of two outputs collide (as
    in Keras's own `OrbaxCheckpoint`); the error says what to change."""
    inputs = keras.Input((4,))
    outputs = {
        "a": keras.layers.Dense(1, name="a")(inputs),
        "b": keras.layers.Dense(1, name="b")(inputs),
    }
    model = keras.Model(inputs, outputs)
    metrics = {"a": [keras.metrics.MeanAbsoluteError()], "b": [keras.metrics.MeanAbsoluteError()]}
    model.compile(optimizer="adam", loss="mse", metrics=metrics)
    x = np.ones((8, 4), "float32")
    model.fit(x, {"a": np.ones((8, 1)), "b": np.ones((8, 1))}, epochs=1, verbose=0)
    with pytest.raises(DuplicateKeyError, match="give each metric a unique name"):
        keras_orbax.save(model, tmp_path, step=1)
    assert list(tmp_path.iterdir()) == []


def test_saving_an_unbuilt_model_without_variables_is_refused(tmp_path):
    # A built model without variables saves, as in Keras (tests/test_keras_parity.py).
    model = keras.Sequential([keras.layers.Dense(4)], name="empty")
    with pytest.raises(ValueError, match="Model 'empty' has no variables to save: build it"):
        keras_orbax.save(model, tmp_path, step=1)
    assert not (tmp_path / "1").exists()


def test_a_removed_middle_layer_is_named_on_both_sides(tmp_path, distribution):
    distribution(_models.model_parallel((2, 4)))
    inputs = keras.Input((16,))
    x = keras.layers.Dense(32, name="hidden")(inputs)
    x = keras.layers.Dense(32, name="middle")(x)
    keras_orbax.save(keras.Model(inputs, keras.layers.Dense(8, name="head")(x)), tmp_path, step=1)
    target = _models.mlp()  # hidden, head: the checkpoint's `dense_2` group is gone
    _restore_fails(target, tmp_path, CheckpointMismatchError, "No variable was modified")
    with pytest.raises(CheckpointMismatchError) as caught:
        keras_orbax.restore_sharded(target, tmp_path)
    problems = caught.value.problems
    assert (
        "layers/dense_1/vars/0: checkpoint middle/kernel (32, 32) float32, "
        "model head/kernel (32, 8) float32"
    ) in problems
    assert (
        "layers/dense_2/vars/0 (checkpoint: head/kernel): in the checkpoint, not in the model"
    ) in problems


def test_a_save_error_names_the_error_it_was_raised_while_handling():
    """Orbax's manager meets the other processes once more in a `finally` after a failed save; a
    process lost there too raises that barrier's error, and the first one must not be lost."""
    from keras_orbax._src.write.save_errors import described_error

    try:
        try:
            raise OSError(28, "No space left on device")
        except OSError:
            raise TimeoutError("Barrier timed out: set_value_end")  # noqa: B904 (as Orbax's)
    except TimeoutError as late:
        text = described_error(late)
    assert text.startswith("TimeoutError: Barrier timed out")
    assert "raised while handling OSError: [Errno 28] No space left on device" in text
