"""Checkpoints in object storage: `s3://bucket/prefix` and `gs://bucket/prefix`, given as plain strings.

The local servers (`tests/_object_stores.py`: moto for S3, a patched gcp-storage-emulator for GCS)
each give a test a fresh bucket, with the endpoint and credentials only in the standard environment
variables. A test of what each store does its own way (writing, listing, ranged reads, deleting,
missing and damaged objects, a step cut short) runs against both (`store`, `bucket`); one of what
keras-orbax does the same way on either store, above those, runs against one. Objects are listed, deleted and damaged with the stores' own
clients, never through keras-orbax. The working directory is an empty folder that must stay empty:
a URL taken for a local path (`gs:/bucket/...`) would show up there.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import keras
import numpy as np
import pytest

import keras_orbax
from keras_orbax.errors import CheckpointNotFoundError, CorruptCheckpointError
from tests import _models
from tests._harness import REPO_ROOT, WORKERS_DIR

HANG_S = 240.0  # only to stop a hung call or worker; no test asserts on time
KERNEL = "layers/dense/vars/0"  # the hidden kernel of `_models.mlp()`, (16, 32)
MLP_BYTES = (16 * 32 + 32 + 32 * 8 + 8) * 4


@pytest.fixture(autouse=True)
def empty_cwd(tmp_path, monkeypatch):
    """Runs the test in an empty working directory and checks that nothing was written there."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    yield
    assert sorted(p.name for p in cwd.iterdir()) == [], "a URL was taken for a local path"


@pytest.fixture
def mesh_2x4(distribution):
    return distribution(_models.model_parallel((2, 4)))


def _within(seconds: float, call: Callable[[], Any]) -> Any:
    """`call()`, or a test failure if it has not returned after `seconds` (it is left running)."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = call()
        except BaseException as error:  # re-raised in the test's thread
            outcome["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        pytest.fail(f"still running after {seconds:g}s (hung)")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _key_prefix(url: str) -> str:
    """The object-key prefix of `scheme://bucket/prefix`, with its trailing slash."""
    return url.split("://", 1)[1].partition("/")[2].rstrip("/") + "/"


def _steps_in_bucket(store, url: str) -> set[str]:
    """The first path segment under `url` of every object there: step folders and their kin."""
    prefix = _key_prefix(url)
    return {key[len(prefix) :].split("/", 1)[0] for key in store.keys(url)}


def _expected_sharding(variable: keras.Variable) -> jax.sharding.Sharding:
    distribution = keras.distribution.distribution()
    if distribution is None:
        return jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return distribution.get_variable_layout(variable).backend_layout


def _assert_restored(model: keras.Model, expected: list[np.ndarray]) -> None:
    """Every value exactly as saved, and on the sharding the active distribution gives it."""
    for variable, want in zip(model.variables, expected, strict=True):
        np.testing.assert_array_equal(np.asarray(variable.value), want, err_msg=variable.path)
        sharding = variable.value.sharding
        assert sharding.is_equivalent_to(_expected_sharding(variable), variable.value.ndim), (
            variable.path,
            sharding,
        )


def _saved_arange(url: str, step: int = 3) -> list[np.ndarray]:
    """Saves `_models.mlp()` filled with `arange` at `step` under the active distribution."""
    model = _models.mlp()
    _models.fill_arange(model)
    keras_orbax.save(model, url, step=step)
    return _models.values(model.variables)


def test_save_then_restore_sharded_under_model_parallel(store, bucket, mesh_2x4):
    url = f"{bucket}/run"
    expected = _saved_arange(url)
    assert _steps_in_bucket(store, url) == {"3"}

    with keras_orbax.deferred_init():
        model = _models.mlp()
    result = keras_orbax.restore_sharded(model, url)

    assert result.step == 3
    assert len(result.restored) == len(model.variables) == 4
    assert 0 < result.bytes_read <= MLP_BYTES
    _assert_restored(model, expected)


def test_restore_onto_other_layouts(gcs_bucket, distribution):
    url = f"{gcs_bucket}/run"
    distribution(_models.model_parallel((2, 4)))
    expected = _saved_arange(url)

    # (1, 8) cuts the rows of every saved shard: its regions are read together, in ranged requests.
    layouts = (_models.model_parallel((4, 2)), _models.model_parallel((1, 8)))
    for layout in (*layouts, _models.data_parallel(), None):
        distribution(layout)
        model = _models.mlp()
        result = keras_orbax.restore_sharded(model, url)
        assert result.step == 3 and 0 < result.bytes_read <= MLP_BYTES
        _assert_restored(model, expected)


def _compiled_mlp(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    model = _models.mlp()
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", metrics=["mae"])
    return model


def _state(model: keras.Model) -> list[np.ndarray]:
    return _models.values(model.variables + model.optimizer.variables + model.metrics_variables)


def test_model_checkpoint_keeps_the_latest_and_resumes_exactly(store, bucket, mesh_2x4):
    url = f"{bucket}/run"
    rng = np.random.default_rng(0)
    x, y = rng.random((16, 16), dtype="float32"), rng.random((16, 8), dtype="float32")
    fit = {"x": x, "y": y, "batch_size": 8, "shuffle": False, "verbose": 0}  # 2 batches an epoch

    uninterrupted = _compiled_mlp(seed=1)
    uninterrupted.fit(epochs=3, **fit)

    first = _compiled_mlp(seed=1)
    first.fit(epochs=2, callbacks=[keras_orbax.ModelCheckpoint(url, max_to_keep=1)], **fit)
    # Saved at steps 2 and 4; retention deleted every object of step 2.
    assert keras_orbax.inspect(url).steps == (4,)
    assert _steps_in_bucket(store, url) == {"4"}

    resumed = _compiled_mlp(seed=2)  # another init: the restore must overwrite all of it
    checkpoint = keras_orbax.ModelCheckpoint(url, max_to_keep=1, resume=True)
    history = resumed.fit(epochs=3, callbacks=[checkpoint], **fit)

    assert checkpoint.restored is not None
    assert (checkpoint.restored.step, checkpoint.restored.epoch) == (4, 2)
    assert history.epoch == [2]  # from step 4 (epoch 2), not from 0
    assert int(resumed.optimizer.iterations) == 6
    for got, want in zip(_state(resumed), _state(uninterrupted), strict=True):
        np.testing.assert_array_equal(got, want)
    assert keras_orbax.inspect(url).steps == (6,)
    assert _steps_in_bucket(store, url) == {"6"}


def test_load_model_from_a_bucket(s3_bucket, mesh_2x4):
    url = f"{s3_bucket}/run"
    source = _compiled_mlp(seed=3)
    source.optimizer.build(source.trainable_variables)
    _models.fill_arange(source)
    slots = source.optimizer.variables  # iterations and Adam's moments: not a fresh optimizer's 0
    for variable, values in zip(
        slots, _models.arange_values([v.shape for v in slots]), strict=True
    ):
        variable.assign(values.astype(variable.dtype) + 1)
    keras_orbax.save(source, url, step=5)

    loaded = keras_orbax.load_model(url)

    assert loaded.name == "mlp" and [layer.name for layer in loaded.layers[1:]] == [
        "hidden",
        "head",
    ]
    _assert_restored(loaded, _models.values(source.variables))
    for got, want in zip(
        _models.values(loaded.optimizer.variables), _models.values(slots), strict=True
    ):
        np.testing.assert_array_equal(got, want)
    x = np.random.default_rng(0).random((8, 16), dtype="float32")
    np.testing.assert_array_equal(np.asarray(loaded(x)), np.asarray(source(x)))


def _saved_twice(url: str) -> None:
    model = _models.mlp()
    keras_orbax.save(model, url, step=5, epoch=2)
    keras_orbax.save(model, url, step=9, epoch=3)


def test_inspect(store, bucket, mesh_2x4):
    url = f"{bucket}/run"
    _saved_twice(url)

    info = keras_orbax.inspect(url, step=5)
    assert info.steps == (5, 9) and info.step == 5 and info.record.epoch == 2
    kernel = info.record.variables[KERNEL]
    assert (kernel.path, kernel.shape, kernel.dtype) == ("hidden/kernel", (16, 32), "float32")
    assert info.nbytes == MLP_BYTES
    assert str(info).startswith(f"{url}: steps [5, 9]; step 5, epoch 2, 4 variables, 3.2 KiB")
    assert all(s.disk_bytes >= MLP_BYTES for s in info.summaries)


def test_a_step_another_tool_deleted_is_no_longer_listed(store, bucket, mesh_2x4):
    """Each listing asks the store: s3fs and gcsfs would keep a bucket's listing for the life of
    the process, and `inspect` then failed on the deleted step's files."""
    url = f"{bucket}/run"
    _saved_twice(url)
    assert keras_orbax.inspect(url).steps == (5, 9)
    store.delete(f"{url}/9/")
    info = keras_orbax.inspect(url)
    assert info.steps == (5,) and info.step == 5


def test_the_command_line_finds_the_emulator_from_the_environment(gcs_store, gcs_bucket, mesh_2x4):
    """A fresh process reaches the GCS emulator from STORAGE_EMULATOR_HOST alone: the variables
    keras-orbax derives from it (set in this process by now) are left out. (S3's clients read
    the standard variables themselves: nothing to derive.)"""
    url = f"{gcs_bucket}/run"
    _saved_twice(url)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "KERAS_BACKEND": "jax", **gcs_store.env}
    for derived in gcs_store.clean_env:
        env.pop(derived, None)
    printed = subprocess.run(
        [sys.executable, "-m", "keras_orbax", "inspect", url],
        capture_output=True,
        text=True,
        env=env,
        timeout=HANG_S,
    )
    assert printed.returncode == 0, printed.stdout + printed.stderr
    assert f"{url}: steps [5, 9]; step 9, epoch 3, 4 variables, 3.2 KiB" in printed.stdout
    assert re.search(rf"{KERNEL} +hidden/kernel +\(16, 32\) +float32", printed.stdout)


def test_missing_prefix_is_checkpoint_not_found(bucket, mesh_2x4):
    url = f"{bucket}/never-written"
    model = _models.mlp()
    before = _models.values(model.variables)
    with pytest.raises(CheckpointNotFoundError, match="never-written"):
        _within(HANG_S, lambda: keras_orbax.restore_sharded(model, url))
    with pytest.raises(CheckpointNotFoundError, match="never-written"):
        _within(HANG_S, lambda: keras_orbax.inspect(url))
    for got, want in zip(_models.values(model.variables), before, strict=True):
        np.testing.assert_array_equal(got, want)


def _damage(store, url: str, kind: str) -> str:
    """Deletes or truncates one shard object of the hidden kernel of step 3; returns its key."""
    shard_prefix = f"{_key_prefix(url)}3/"
    shards = [k for k in store.keys(url) if k.startswith(shard_prefix) and "/c/" in k]
    kernel_shards = sorted(k for k in shards if k.split("/c/")[0].endswith("layers.dense.vars.0"))
    assert kernel_shards, f"no shard object of {KERNEL} among {store.keys(url)}"
    key = kernel_shards[-1]
    bucket = url.split("://", 1)[1].split("/", 1)[0]
    if store.kind == "s3":
        client = _object_stores().s3_client(store)
        if kind == "delete":
            client.delete_object(Bucket=bucket, Key=key)
        else:
            body = client.get_object(Bucket=bucket, Key=key)["Body"].read()
            client.put_object(Bucket=bucket, Key=key, Body=body[: len(body) // 2])
    else:
        blob = _object_stores().gcs_client(store).bucket(bucket).blob(key)
        if kind == "delete":
            blob.delete()
        else:
            body = blob.download_as_bytes()
            blob.upload_from_string(body[: len(body) // 2])
    return key


def _object_stores():
    from tests import _object_stores

    return _object_stores


@pytest.mark.parametrize("damage", ["delete", "truncate"])
@pytest.mark.usefixtures("one_file_per_shard")  # damages one shard's object of a split kernel
def test_damaged_shard_object_is_corrupt_and_the_model_is_untouched(
    store, bucket, mesh_2x4, damage
):
    url = f"{bucket}/run"
    _saved_arange(url)
    key = _damage(store, url, damage)
    shard = key.split("/c/", 1)[1]  # e.g. "1/3"

    model = _models.mlp()
    before = _models.values(model.variables)
    with pytest.raises(CorruptCheckpointError) as caught:
        _within(HANG_S, lambda: keras_orbax.restore_sharded(model, url))
    assert KERNEL in str(caught.value) and f"c/{shard}" in str(caught.value), str(caught.value)
    for got, want in zip(_models.values(model.variables), before, strict=True):
        np.testing.assert_array_equal(got, want)


def test_killed_mid_save_the_latest_committed_step_restores(store, bucket, tmp_path, mesh_2x4):
    """The worker saves step 1, then SIGKILLs itself once the first object of step 2 is written."""
    url = f"{bucket}/run"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(
        store.env,
        XLA_FLAGS="--xla_force_host_platform_device_count=8",
        JAX_PLATFORMS="cpu",
        KERAS_BACKEND="jax",
        PYTHONPATH=str(REPO_ROOT),
    )
    log = tmp_path / "worker.log"
    with open(log, "wb") as out:
        done = subprocess.run(
            [sys.executable, str(WORKERS_DIR / "bucket_save.py"), json.dumps({"directory": url})],
            cwd=REPO_ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=HANG_S,
        )
    assert done.returncode == -signal.SIGKILL, _log_tail(log)

    left = _steps_in_bucket(store, url) - {"1"}
    assert left, "the kill left nothing of step 2 behind; nothing was tested"
    assert keras_orbax.inspect(url).steps == (1,), left
    with keras_orbax.deferred_init():
        model = _models.mlp()
    assert keras_orbax.restore_sharded(model, url).step == 1
    _assert_restored(model, _models.arange_values([tuple(v.shape) for v in model.variables]))


def _log_tail(path: Path) -> str:
    return f"{path}:\n" + "\n".join(path.read_text(errors="replace").splitlines()[-30:])
