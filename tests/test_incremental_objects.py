"""Incremental saves in object storage: an unchanged shard object is copied by the store itself
(S3 CopyObject, GCS rewrite) from the previous step's object, so the client sends none of its
bytes. Counted by the local servers (`tests/_store_server.py` records the request body bytes the
server read for each request), with the objects' contents, read with the stores' own clients,
as the oracle."""

from __future__ import annotations

import collections
import json

import keras
import numpy as np
import pytest

import keras_orbax
from keras_orbax.errors import CorruptCheckpointError
from tests import _models

FROZEN = {"frozen_in/kernel", "frozen_out/kernel"}
FACTORS = {f"{layer}/lora_kernel_{ab}" for layer in ("frozen_in", "frozen_out") for ab in "ab"}


def _lora_model() -> keras.Model:
    """Two frozen kernels (512 KiB and 16 KiB), LoRA factors of rank 2 trained by Adam."""
    model = _models.lora_pair(inputs=256, hidden=512, seed=5)
    model.optimizer.build(model.trainable_variables)
    return model


def _state(model: keras.Model) -> list[np.ndarray]:
    return [np.asarray(v.value).copy() for v in model.variables + model.optimizer.variables]


def _where(url: str) -> tuple[str, str]:
    """(bucket, key prefix with its trailing slash) of `scheme://bucket/prefix`."""
    bucket, _, prefix = url.split("://", 1)[1].partition("/")
    return bucket, prefix.rstrip("/") + "/"


def _read(store, bucket: str, key: str) -> bytes:
    """An object's bytes, read with the store's own client."""
    from tests import _object_stores

    if store.kind == "s3":
        found = _object_stores.s3_client(store).get_object(Bucket=bucket, Key=key)
        return found["Body"].read()
    return _object_stores.gcs_client(store).bucket(bucket).blob(key).download_as_bytes()


def _write(store, bucket: str, key: str, content: bytes) -> None:
    from tests import _object_stores

    if store.kind == "s3":
        _object_stores.s3_client(store).put_object(Bucket=bucket, Key=key, Body=content)
    else:
        _object_stores.gcs_client(store).bucket(bucket).blob(key).upload_from_string(content)


def _shard_objects(store, url: str, step: int) -> dict[str, bytes]:
    """Name under `<step>/state/` -> bytes of every shard object of a step (`<array>/c/...` or
    `<array>/c.0.0`)."""
    bucket, prefix = _where(url)
    state = f"{prefix}{step}/state/"
    found = {}
    for key in store.keys(url):
        name = key[len(state) :]
        parts = name.split("/")
        if key.startswith(state) and len(parts) > 1 and (parts[1] == "c" or parts[1][:2] == "c."):
            found[name] = _read(store, bucket, key)
    return found


def _arrays(url: str, step: int, paths: set[str]) -> set[str]:
    """The array directories of the variables at Keras `paths` in a step's record."""
    variables = keras_orbax.inspect(url, step=step).record.variables.values()
    return {v.array for v in variables if v.path in paths}


def _train_once(model: keras.Model) -> None:
    rng = np.random.default_rng(0)
    x, y = rng.random((8, 256), "float32"), rng.random((8, 8), "float32")
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)


def test_a_lora_save_copies_the_frozen_kernels_on_the_server(store, bucket):
    url = f"{bucket}/run"
    bucket_name, prefix = _where(url)
    model = _lora_model()
    _train_once(model)  # lora_kernel_b leaves 0: from now on every factor is trained
    keras_orbax.save(model, url, step=1)
    _train_once(model)  # changes the factors, Adam's moments and the counters; not the kernels
    before = len(store.requests())
    keras_orbax.save(model, url, step=2)
    sent = store.requests()[before:]

    old, new = _shard_objects(store, url, 1), _shard_objects(store, url, 2)
    unchanged = {name for name, content in new.items() if old.get(name) == content}
    changed = set(new) - unchanged
    frozen, factors = _arrays(url, 2, FROZEN), _arrays(url, 2, FACTORS)
    assert len(frozen) == 2 and {name.split("/")[0] for name in unchanged} >= frozen
    assert {name.split("/")[0] for name in changed} >= factors  # what training changed

    received = collections.Counter()
    copies = {}
    for request in sent:
        received[request["key"]] += request["bytes"]
        if request["copied_from"]:
            copies[request["key"]] = request["copied_from"]
    state = f"{bucket_name}/{prefix}2/state/"
    for name in unchanged:  # copied by the server from step 1's object; no byte of it sent
        assert received[state + name] == 0, name
        assert copies[state + name] == f"{bucket_name}/{prefix}1/state/{name}"
    for name in changed:  # written in full
        assert received[state + name] >= len(new[name]), name
    carried = sum(len(new[name]) for name in unchanged)
    step_bytes = sum(len(_read(store, bucket_name, key)) for key in store.keys(f"{url}/2"))
    assert carried > 0.8 * step_bytes  # the frozen kernels are most of the step
    # The rest of the step at most twice (Orbax writes its step metadata file twice): no room for
    # a carried shard's bytes sent under a name the count does not see.
    assert sum(received.values()) <= 2 * (step_bytes - carried)

    keras_orbax.verify(url, step=2)
    expected = _state(model)
    _delete_step(store, url, 1)
    assert {key.split("/")[1] for key in store.keys(url)} == {"2"}
    restored = _lora_model()
    assert keras_orbax.restore_sharded(restored, url).step == 2
    for got, want in zip(_state(restored), expected, strict=True):
        np.testing.assert_array_equal(got, want)


def _delete_step(store, url: str, step: int) -> None:
    from tests import _object_stores

    bucket, prefix = _where(url)
    keys = [key for key in store.keys(url) if key.startswith(f"{prefix}{step}/")]
    assert keys
    for key in keys:
        if store.kind == "s3":
            _object_stores.s3_client(store).delete_object(Bucket=bucket, Key=key)
        else:
            _object_stores.gcs_client(store).bucket(bucket).blob(key).delete()


def test_an_object_written_into_after_its_step_is_not_copied(store, bucket):
    """An object of step 1 replaced after the step was committed (the same size, one byte
    changed) has another ETag or generation: the store refuses to copy it, and step 2 gets the
    model's bytes, written."""
    url = f"{bucket}/run"
    bucket_name, prefix = _where(url)
    model = _lora_model()
    keras_orbax.save(model, url, step=1)
    # frozen_in's kernel: the largest shard object (found with the store's client alone: what
    # keras-orbax lists, fsspec keeps, ETags included, and would read the replaced object by)
    shards = _shard_objects(store, url, 1)
    name = max(shards, key=lambda name: len(shards[name]))
    kernel = name.split("/")[0]
    key = f"{prefix}1/state/{name}"
    original = shards[name]
    assert len(original) > 512 * 1024
    damaged = bytearray(original)
    damaged[100] ^= 0xFF
    _write(store, bucket_name, key, bytes(damaged))

    before = len(store.requests())
    keras_orbax.save(model, url, step=2)
    sent = store.requests()[before:]
    received = collections.Counter()
    for request in sent:
        received[request["key"]] += request["bytes"]
    state = f"{bucket_name}/{prefix}2/state/"
    assert received[state + name] >= len(original)
    assert _read(store, bucket_name, f"{prefix}2/state/{name}") == original
    others = set(_shard_objects(store, url, 2)) - {name}
    assert others and all(received[state + other] == 0 for other in others)
    keras_orbax.verify(url, step=2)
    with pytest.raises(CorruptCheckpointError, match=kernel.replace(".", "/")):
        keras_orbax.verify(url, step=1)


def test_each_process_copies_its_own_unchanged_shards_on_the_server(s3_store, s3_bucket, tmp_path):
    """2 processes x 4 devices save `mlp(4096)` at step 1, then with one element of one kernel
    changed at step 2 (tests/workers/incremental_multihost.py): the changed shard object is
    written, every other one is copied by the server from step 1's, by the process that holds it."""
    from tests._harness import WORKERS_DIR, run_workers

    url = f"{s3_bucket}/run"
    bucket_name, prefix = _where(url)
    args = {"directory": url}
    run_workers(WORKERS_DIR / "incremental_multihost.py", 2, 4, args, timeout=600, workdir=tmp_path)

    old, new = _shard_objects(s3_store, url, 1), _shard_objects(s3_store, url, 2)
    changed = {name for name, content in new.items() if old.get(name) != content}
    (kernel,) = _arrays(url, 2, {"hidden/kernel"})
    assert {name.split("/")[0] for name in changed} == {kernel} and len(changed) == 1
    state = f"{bucket_name}/{prefix}2/state/"
    received, copies = collections.Counter(), {}
    for request in s3_store.requests():
        if request["key"] and request["key"].startswith(state):
            received[request["key"]] += request["bytes"]
            if request["copied_from"]:
                copies[request["key"]] = request["copied_from"]
    for name in set(new) - changed:
        assert received[state + name] == 0, name
        assert copies[state + name] == f"{bucket_name}/{prefix}1/state/{name}"
    (name,) = changed
    assert received[state + name] >= len(new[name])
    for process in (0, 1):  # each process's record lists the objects it copied
        record = json.loads(
            _read(
                s3_store,
                bucket_name,
                f"{prefix}2/state/keras_orbax_checksums/process_{process}.json",
            )
        )
        copied = [n for n in record["files"] if state + n in copies]
        assert copied and all("layout" in record["files"][n] for n in copied)
    keras_orbax.verify(url, step=2)


def test_a_change_with_the_recorded_crcs_is_not_copied(store, bucket):
    """The model's frozen kernel changed to other bytes with the same CRC-32 and CRC-32C (a
    collision, forged): the object of step 1 is still the recorded version and its CRCs match,
    so only reading the copy back shows it. Step 2 gets the model's bytes, written."""
    from tests.test_incremental import _crc_collision

    url = f"{bucket}/run"
    bucket_name, prefix = _where(url)
    model = _lora_model()
    keras_orbax.save(model, url, step=1)
    kernel = model.get_layer("frozen_in")._kernel
    old = np.asarray(kernel.value)
    forged = _crc_collision(old.tobytes(), changed=100, free=400)
    kernel.assign(np.frombuffer(forged, old.dtype).reshape(old.shape))
    before = len(store.requests())
    keras_orbax.save(model, url, step=2)
    received = collections.Counter()
    for request in store.requests()[before:]:
        received[request["key"]] += request["bytes"]
    (name,) = [n for n, content in _shard_objects(store, url, 1).items() if len(content) > 1e5]
    written = _read(store, bucket_name, f"{prefix}2/state/{name}")
    assert written[: len(forged)] == forged != old.tobytes()
    assert received[f"{bucket_name}/{prefix}2/state/{name}"] >= len(written)
    keras_orbax.verify(url, step=2)
