"""Where a checkpoint lives: a local directory, or a prefix in object storage (`gs://`, `s3://`).

Local paths are `pathlib.Path`s, read and written with system calls. Object-store prefixes are
`etils.epath.Path`s (what Orbax uses: listing, metadata files, deletes) and, for the array bytes,
tensorstore key-value stores (ranged reads, concurrent writes). Endpoints and credentials come from
the standard environment variables only:

- S3: `AWS_ENDPOINT_URL_S3` or `AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`,
  `AWS_REGION` (read by s3fs and by tensorstore's credential chain; the endpoint and region are
  put into tensorstore's spec, which ignores those variables).
- GCS: Google's default credentials, or `STORAGE_EMULATOR_HOST` for an emulator (anonymous),
  turned into `TENSORSTORE_GCS_HTTP_URL` for tensorstore.

```python
keras_orbax.save(model, "s3://bucket/run-1", step=100)
```
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import tensorstore as ts

REMOTE_SCHEMES = ("gs://", "s3://")
COMMIT_FILE = "commit_success.txt"  # Orbax's marker of a committed step where rename is not atomic
_GCS_URL = "TENSORSTORE_GCS_HTTP_URL"


def is_remote(path: str | os.PathLike) -> bool:
    """Whether `path` is an object-store URL (`gs://...` or `s3://...`)."""
    return os.fspath(path).startswith(REMOTE_SCHEMES)


def as_path(path: str | os.PathLike) -> Any:
    """The one spelling of a location that every verb and dependency gets.

    A local path becomes an absolute `pathlib.Path` with `~` expanded (Orbax needs absolute
    paths); an object-store URL becomes an `etils.epath.Path` without its trailing slash (a
    `pathlib.Path` would turn `s3://b/x` into `s3:/b/x`, a local folder).

    ```python
    as_path("~/ckpt/")  # PosixPath('/home/me/ckpt')
    ```
    """
    text = os.fspath(path)
    if not is_remote(text):
        return pathlib.Path(os.path.abspath(os.path.expanduser(text)))
    from etils import epath

    configure_environment()
    scheme, _, rest = text.partition("://")
    return epath.Path(f"{scheme}://{rest.rstrip('/') or rest}")


def configure_environment() -> None:
    """Derives what the storage layers need from the standard variables, unless the user set it.

    - `EPATH_USE_TF=false`: with TensorFlow installed (keras-hub pulls it in), epath sends `gs://`
      and `s3://` to `tf.io.gfile`, which has no `s3` and ignores `STORAGE_EMULATOR_HOST`.
    - No listings cache in s3fs and gcsfs (`_no_listings_cache`).
    - With `STORAGE_EMULATOR_HOST`: `TENSORSTORE_GCS_HTTP_URL` (tensorstore reads only that) and
      `GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false` (gcsfs otherwise probes bucket layouts the emulator
      does not serve, slowing every call by seconds).
    """
    os.environ.setdefault("EPATH_USE_TF", "false")
    _no_listings_cache()
    emulator = os.environ.get("STORAGE_EMULATOR_HOST")
    if emulator:
        url = emulator if "://" in emulator else f"http://{emulator}"
        os.environ.setdefault(_GCS_URL, url)
        os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    if "etils.epath" in sys.modules:  # imported already: it may have decided before
        from keras_orbax._src.compat import orbax_compat

        orbax_compat.epath_forget_tensorflow()


def _no_listings_cache() -> None:
    """Turns off the listings cache of the s3fs and gcsfs file systems made from now on, unless
    the user configured it: it kept a bucket's listing for the life of the process, so a step
    another process or tool deleted or rewrote since was still listed (`inspect` then failed on
    files that were gone). A checkpoint directory is shared: each listing asks the store."""
    try:
        import fsspec
    except ImportError:  # no `cloud` extra: no object storage either
        return
    for protocol in ("s3", "gcs", "gs"):
        fsspec.config.conf.setdefault(protocol, {}).setdefault("use_listings_cache", False)


def split_url(url: str | os.PathLike) -> tuple[str, str, str]:
    """(scheme, bucket, key) of the object-store URL `scheme://bucket/key` (key as written)."""
    scheme, _, rest = os.fspath(url).partition("://")
    bucket, _, key = rest.partition("/")
    return scheme, bucket, key


def filesystem(url: str | os.PathLike) -> tuple[Any, str]:
    """fsspec's file system for the object-store `url` (s3fs or gcsfs, configured as
    `configure_environment` sets up), and `url`'s path in it."""
    import fsspec

    configure_environment()
    fs, root = fsspec.core.url_to_fs(os.fspath(url))
    return fs, str(root)


def kvstore_spec(path: str | os.PathLike) -> dict[str, Any]:
    """The tensorstore kvstore spec of the object-store prefix `path` (ending in `/`)."""
    scheme, bucket, prefix = split_url(path)
    prefix = prefix.strip("/")
    spec: dict[str, Any] = {
        "driver": "gcs" if scheme == "gs" else "s3",
        "bucket": bucket,
        "path": f"{prefix}/" if prefix else "",
    }
    if scheme == "s3":
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        if endpoint:
            spec["endpoint"] = endpoint
        if region:
            spec["aws_region"] = region
    return spec


def kvstore(path: str | os.PathLike) -> ts.KvStore:
    """An open tensorstore kvstore rooted at the object-store prefix `path`."""
    configure_environment()
    spec = kvstore_spec(path)
    prefix = spec.pop("path")
    # tensorstore's gcs driver reads its endpoint from the environment: part of the cache key.
    return _open_bucket(json.dumps(spec, sort_keys=True), os.environ.get(_GCS_URL)) / prefix


@functools.lru_cache(maxsize=16)
def _open_bucket(spec: str, gcs_url: str | None) -> ts.KvStore:
    """One kvstore per bucket and endpoint: its connections and credentials are reused."""
    import tensorstore as ts  # heavy: keeps `keras-orbax inspect` of a local step free of it

    return ts.KvStore.open(json.loads(spec)).result()


def total_bytes(path: str | os.PathLike) -> int:
    """Bytes of every object under the object-store prefix `path` (one listing, via fsspec)."""
    fs, root = filesystem(path)
    return int(fs.du(root, total=True))


def object_sizes(path: str | os.PathLike) -> dict[str, int]:
    """Name (relative to the prefix `path`) -> size of every object under `path`, in one listing."""
    fs, root = filesystem(path)
    found = fs.find(root, detail=True)
    root = root.rstrip("/") + "/"
    return {name[len(root) :]: int(info["size"]) for name, info in found.items()}
