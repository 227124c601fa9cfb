"""The local object stores themselves (`tests/_object_stores.py`), checked with the clients the
library builds on (tensorstore, s3fs, gcsfs) and the stores' own (boto3, google-cloud-storage):
write, ranged read, list. No keras-orbax here: a failure below is the fixture's, not the library's.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorstore as ts

DATA = bytes(range(256)) * 4


def _bucket_name(url: str) -> str:
    return url.split("://", 1)[1]


def test_each_bucket_is_new_and_empty(store):
    first, second = store.new_bucket(), store.new_bucket()
    assert first != second
    assert first.startswith(f"{store.scheme}://")
    assert store.keys(first) == store.keys(second) == []


def test_a_named_bucket_is_emptied_when_made_again(store):
    url = store.new_bucket("checkpoints-test")
    name = _bucket_name(url)
    assert url == f"{store.scheme}://checkpoints-test"
    if store.kind == "s3":
        _object_stores().s3_client(store).put_object(Bucket=name, Key="a/b", Body=b"x")
    else:
        _object_stores().gcs_client(store).bucket(name).blob("a/b").upload_from_string(b"x")
    assert store.keys(url) == ["a/b"]
    assert store.new_bucket("checkpoints-test") == url
    assert store.keys(url) == []


def _check_kvstore(spec: dict) -> None:
    """Write, ranged read, generation round trip, list; then a sharded zarr3 array, by region."""
    kv = ts.KvStore.open(spec).result()
    written = kv.write("dir/a", DATA).result()
    ranged = kv.read("dir/a", byte_range=slice(100, 300)).result()
    assert ranged.value == DATA[100:300]
    # The generation comes back with a read (for GCS: the emulator patch's x-goog-generation).
    assert ranged.stamp.generation == written.generation != b""
    assert kv.read("dir/missing").result().state == "missing"
    kv.write("dir/b", b"b").result()
    assert sorted(kv.list().result()) == [b"dir/a", b"dir/b"]

    values = np.arange(64, dtype="float32").reshape(16, 4)
    array = ts.open(
        {"driver": "zarr3", "kvstore": {**spec, "path": spec.get("path", "") + "array/"}},
        create=True,
        dtype=ts.float32,
        shape=values.shape,
        chunk_layout=ts.ChunkLayout(chunk_shape=[4, 4]),
    ).result()
    array.write(values).result()
    np.testing.assert_array_equal(array[5:9, 1:3].read().result(), values[5:9, 1:3])


def test_tensorstore_gcs_driver_through_the_emulator(gcs_store, gcs_bucket, monkeypatch):
    monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", gcs_store.endpoint)
    _check_kvstore({"driver": "gcs", "bucket": _bucket_name(gcs_bucket), "path": "p/"})
    assert gcs_store.keys(gcs_bucket)[:2] == ["p/array/c/0/0", "p/array/c/1/0"]
    assert {"p/dir/a", "p/dir/b", "p/array/zarr.json"} <= set(gcs_store.keys(gcs_bucket))


def test_tensorstore_s3_driver_with_an_explicit_endpoint(s3_store, s3_bucket):
    spec = {
        "driver": "s3",
        "bucket": _bucket_name(s3_bucket),
        "endpoint": s3_store.endpoint,
        "aws_region": s3_store.env["AWS_REGION"],
        "path": "p/",
    }
    _check_kvstore(spec)
    assert {"p/dir/a", "p/dir/b", "p/array/zarr.json"} <= set(s3_store.keys(s3_bucket))


def _check_fsspec(fs, url: str) -> None:
    root = _bucket_name(url)
    fs.pipe(f"{root}/dir/a", DATA)
    fs.pipe(f"{root}/dir/sub/b", b"b")
    assert fs.cat_file(f"{root}/dir/a", start=100, end=300) == DATA[100:300]
    assert sorted(fs.ls(f"{root}/dir", detail=False)) == [f"{root}/dir/a", f"{root}/dir/sub"]
    assert sorted(fs.find(f"{root}/dir")) == [f"{root}/dir/a", f"{root}/dir/sub/b"]
    fs.rm(f"{root}/dir/sub", recursive=True)
    fs.invalidate_cache()
    assert fs.find(f"{root}/dir") == [f"{root}/dir/a"]


def test_s3fs_and_boto3(s3_store, s3_bucket):
    import s3fs

    # No arguments: s3fs (through botocore) reads the endpoint and credentials from the environment.
    _check_fsspec(s3fs.S3FileSystem(skip_instance_cache=True), s3_bucket)
    client = _object_stores().s3_client(s3_store)
    got = client.get_object(Bucket=_bucket_name(s3_bucket), Key="dir/a", Range="bytes=100-299")
    assert got["Body"].read() == DATA[100:300]
    assert s3_store.keys(s3_bucket) == ["dir/a"]


def test_gcsfs_and_the_json_api(gcs_store, gcs_bucket, monkeypatch):
    # gcsfs decides when first imported whether `gcsfs.GCSFileSystem` is its experimental class,
    # which asks the Storage Control API (gRPC, not served by the emulator) for each bucket's
    # layout and waits 60 s for it: turned off before the import, and the plain class used here.
    monkeypatch.setenv("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    from gcsfs.core import GCSFileSystem

    # gcsfs reads STORAGE_EMULATOR_HOST.
    _check_fsspec(GCSFileSystem(token="anon", skip_instance_cache=True), gcs_bucket)
    blob = _object_stores().gcs_client(gcs_store).bucket(_bucket_name(gcs_bucket)).blob("dir/a")
    assert blob.download_as_bytes(start=100, end=299) == DATA[100:300]
    assert gcs_store.keys(gcs_bucket) == ["dir/a"]


def _object_stores():
    from tests import _object_stores

    return _object_stores


@pytest.mark.parametrize("kind", ["s3", "gcs"])
def test_missing_server_packages_are_named(kind, monkeypatch):
    import importlib.util

    stores = _object_stores()
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "boto3" else real(name, *a)
    )
    assert ("boto3" in stores.missing_packages(kind)) == (kind == "s3")
