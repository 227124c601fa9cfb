"""Server-side copies in object storage (`gs://`, `s3://`), and the versions that make them safe.

An incremental save carries an unchanged shard object into the new step by asking the store to
copy it (S3 `CopyObject`, GCS `objects.rewrite`): the client sends one small request and none of
the object's bytes, and the copy is an object of its own (deleting the source later leaves it
whole). Each copy names the version of its source recorded when that step was written, the S3
ETag (`x-amz-copy-source-if-match`) or the GCS generation (`ifSourceGenerationMatch`): a source
overwritten since has another version, so the store refuses the copy (HTTP 412) and the caller
writes the shard instead. Both go through fsspec's s3fs and gcsfs (the `cloud` extra), which
read the endpoints and credentials `locations` describes.
"""

from __future__ import annotations

import os
from typing import Any

from keras_orbax._src.storage import locations


def versions(prefix: str | os.PathLike) -> dict[str, str]:
    """Name (relative to the object-store prefix `prefix`) -> version of every object under it,
    in one listing (1,000 objects a request): the ETag on S3 (quoted, as S3 sends it), the
    generation on GCS.

    Listed with the stores' own list calls rather than fsspec's `find`, which keeps what it lists
    (ETags included) in its cache: a later read of an object replaced since would then fail on
    the cached ETag instead of reading what is there."""
    fs, _ = locations.filesystem(prefix)
    scheme, bucket, key = locations.split_url(prefix)
    key = key.rstrip("/") + "/"
    found: dict[str, str] = {}
    page: dict[str, Any] = {}
    while True:
        if scheme == "s3":
            listed = fs.call_s3("list_objects_v2", Bucket=bucket, Prefix=key, **page)
            found.update((o["Key"][len(key) :], str(o["ETag"])) for o in listed.get("Contents", []))
            if not listed.get("IsTruncated"):
                return found
            page = {"ContinuationToken": listed["NextContinuationToken"]}
        else:
            listed = fs.call("GET", "b/{}/o", bucket, prefix=key, json_out=True, **page)
            found.update(
                (o["name"][len(key) :], str(o["generation"])) for o in listed.get("items", [])
            )
            if not listed.get("nextPageToken"):
                return found
            page = {"pageToken": listed["nextPageToken"]}


def copy(source: str, target: str, version: str) -> bool:
    """Copies the object `source` to `target` (URLs in one store) on the server if `source` is
    still at `version` (`versions`); whether it did. False where the store refused (412: another
    version; 404: deleted) or the request failed: the caller then writes the object itself."""
    try:
        _copy(source, target, version)
    # The clients raise their own types (s3fs's OSErrors, gcsfs's HttpError, botocore's and
    # aiohttp's errors); whichever it is, the caller writes the bytes instead.
    except Exception:
        return False
    return True


def _copy(source: str, target: str, version: str) -> None:
    fs, _ = locations.filesystem(source)
    scheme, source_bucket, source_key = locations.split_url(source)
    _, target_bucket, target_key = locations.split_url(target)
    if scheme == "s3":
        fs.call_s3(
            "copy_object",
            Bucket=target_bucket,
            Key=target_key,
            CopySource={"Bucket": source_bucket, "Key": source_key},
            CopySourceIfMatch=version,
        )
        return
    rewrite: dict[str, Any] = {"ifSourceGenerationMatch": version}
    while True:  # GCS may answer a large copy in several rounds (within one bucket: one)
        done = fs.call(
            "POST",
            "b/{}/o/{}/rewriteTo/b/{}/o/{}",
            source_bucket,
            source_key,
            target_bucket,
            target_key,
            headers={"Content-Type": "application/json"},
            json_out=True,
            **rewrite,
        )
        if done.get("done") is True:
            return
        rewrite["rewriteToken"] = done["rewriteToken"]
