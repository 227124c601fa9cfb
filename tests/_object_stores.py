"""Local object stores for the tests: moto's S3 server and a patched gcp-storage-emulator.

Both run as subprocesses on 127.0.0.1, in memory, once per test session (the `s3_store` and
`gcs_store` fixtures in `tests/conftest.py`):

```python
store = start("s3", logdir)     # a free port; returns once the server answers HTTP
url = store.new_bucket()        # "s3://ko-1a2b3c4d5e6f7a8b", empty
store.use(monkeypatch)          # this test's environment points at the server (or: store.env)
store.requests()                # every request answered so far: method, key, body bytes, copy source
stop(store)
```

The library finds the servers only through the standard variables: `AWS_ENDPOINT_URL`,
`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_REGION` for S3 and `STORAGE_EMULATOR_HOST` for
GCS. `env` also points the AWS configuration files at nothing and turns off the EC2 metadata
lookup, so no request can leave this machine. `Store.clean_env` lists the variables to remove
for a test, so none left in the caller's environment (a real profile, a derived tensorstore URL)
wins over the local server.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

from tests._harness import REPO_ROOT, TESTS_DIR, free_port

START_TIMEOUT_S = 60.0
"""How long a server may take to answer its first request before the session fails."""
REQUIRE_ENV = "KERAS_ORBAX_REQUIRE_CLOUD"
"""Set to 1 (CI does) to fail instead of skipping when a server package is missing."""

KINDS = ("s3", "gcs")
_PACKAGES = {
    "s3": ("moto", "boto3", "s3fs", "flask", "flask_cors"),
    "gcs": ("gcp_storage_emulator", "google.cloud.storage", "gcsfs"),
}
_REGION = "us-east-1"
_STOP_TIMEOUT_S = 10.0
_POLL_S = 0.1


def missing_packages(kind: str) -> list[str]:
    """The Python packages `kind`'s server, bucket creation or smoke test need and cannot find."""
    missing = []
    for name in _PACKAGES[kind]:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:  # a parent package ("google.cloud") is missing
            found = False
        if not found:
            missing.append(name)
    return missing


def required() -> bool:
    return os.environ.get(REQUIRE_ENV, "") not in ("", "0")


@dataclasses.dataclass
class Store:
    """One running server and how to reach it."""

    kind: str  # "s3" or "gcs"
    endpoint: str  # http://127.0.0.1:<port>
    env: dict[str, str]
    """Variables the library reads to reach this server (set them in the test or the worker)."""
    proc: subprocess.Popen[bytes]
    log: Path
    requests_log: Path
    """One JSON line per request the server answered (`tests/_store_server.py`)."""

    @property
    def scheme(self) -> str:
        return {"s3": "s3", "gcs": "gs"}[self.kind]

    @property
    def clean_env(self) -> tuple[str, ...]:
        """Variables that would change where requests go or which credentials they carry."""
        if self.kind == "s3":
            return (
                "AWS_ENDPOINT_URL_S3",
                "AWS_PROFILE",
                "AWS_DEFAULT_PROFILE",
                "AWS_SESSION_TOKEN",
                "AWS_SECURITY_TOKEN",
                "AWS_DEFAULT_REGION",
                "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
                "AWS_CONTAINER_CREDENTIALS_FULL_URI",
                "AWS_WEB_IDENTITY_TOKEN_FILE",
                "AWS_ROLE_ARN",
            )
        return (
            "TENSORSTORE_GCS_HTTP_URL",
            "GOOGLE_APPLICATION_CREDENTIALS",
            "CLOUDSDK_CONFIG",
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT",
        )

    def new_bucket(self, name: str | None = None) -> str:
        """Creates an empty bucket; returns its URL (`s3://…` or `gs://…`).

        Args:
            name: The bucket's name; a fresh one if None. A bucket of that name made earlier in
                the session is emptied instead (for pages that name their bucket).
        """
        name = name or f"ko-{uuid.uuid4().hex[:16]}"
        if self.kind == "s3":
            client = s3_client(self)
            if name in {b["Name"] for b in client.list_buckets().get("Buckets", [])}:
                for key in self.keys(f"s3://{name}"):
                    client.delete_object(Bucket=name, Key=key)
            else:
                client.create_bucket(Bucket=name)
        else:
            client = gcs_client(self)
            bucket = client.lookup_bucket(name)
            if bucket is None:
                client.create_bucket(name)
            else:
                for blob in client.list_blobs(name):
                    blob.delete()
        return f"{self.scheme}://{name}"

    def keys(self, url: str) -> list[str]:
        """Every object key under `url` (`scheme://bucket[/prefix]`), sorted, read with the
        store's own client (not with the library)."""
        bucket, _, prefix = url.split("://", 1)[1].partition("/")
        if self.kind == "s3":
            pages = (
                s3_client(self)
                .get_paginator("list_objects_v2")
                .paginate(Bucket=bucket, Prefix=prefix)
            )
            return sorted(o["Key"] for page in pages for o in page.get("Contents", []))
        return sorted(b.name for b in gcs_client(self).list_blobs(bucket, prefix=prefix or None))

    def delete(self, url: str) -> None:
        """Deletes every object under `url` with the store's own client (another tool, to the
        library: nothing of its caches hears of it)."""
        bucket = url.split("://", 1)[1].partition("/")[0]
        keys = self.keys(url)
        assert keys, url
        for key in keys:
            if self.kind == "s3":
                s3_client(self).delete_object(Bucket=bucket, Key=key)
            else:
                gcs_client(self).bucket(bucket).blob(key).delete()

    def requests(self) -> list[dict]:
        """Every request the server has answered, in order: `method`, `key` (`bucket/key`, None
        where the request names no object), `bytes` (of request body the server read),
        `copied_from` (a server-side copy's source key, else None)."""
        _answers(self.endpoint)  # answered after every earlier request was recorded
        if not self.requests_log.exists():
            return []
        return [json.loads(line) for line in self.requests_log.read_text().splitlines()]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def use(self, monkeypatch) -> None:
        """Points this test's environment at the server (`pytest.MonkeyPatch`), and only at it."""
        if not self.alive():
            raise RuntimeError(
                f"the {self.kind} server exited with return code {self.proc.returncode}; "
                f"{self.log}:\n{_tail(self.log)}"
            )
        for name in self.clean_env:
            monkeypatch.delenv(name, raising=False)
        for name, value in self.env.items():
            monkeypatch.setenv(name, value)


def s3_client(store: Store):
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=store.endpoint,
        aws_access_key_id=store.env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=store.env["AWS_SECRET_ACCESS_KEY"],
        region_name=_REGION,
    )


def gcs_client(store: Store):
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    return storage.Client(
        project="test",
        credentials=AnonymousCredentials(),
        client_options={"api_endpoint": store.endpoint},
    )


def _env(kind: str, endpoint: str) -> dict[str, str]:
    local = {"NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}
    if kind == "s3":
        return local | {
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_REGION": _REGION,
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
            "AWS_EC2_METADATA_DISABLED": "true",
        }
    # Where Google's libraries look for the GCE metadata server: a closed local port, so a
    # credentials lookup fails at once instead of going out.
    nowhere = "127.0.0.1:9"
    return local | {
        "STORAGE_EMULATOR_HOST": endpoint,
        "GCE_METADATA_HOST": nowhere,
        "GCE_METADATA_IP": nowhere,
        "GCE_METADATA_ROOT": nowhere,
    }


def _command(kind: str, port: int, requests_log: Path) -> list[str]:
    server = str(TESTS_DIR / "_store_server.py")
    return [sys.executable, server, kind, str(port), str(requests_log)]


def start(kind: str, logdir: Path, timeout: float = START_TIMEOUT_S) -> Store:
    """Starts `kind`'s server on a free port and returns once it answers HTTP.

    Raises:
        RuntimeError: it exited, or did not answer within `timeout`; names its log and its tail.
    """
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    log = logdir / f"{kind}_server.log"
    requests_log = logdir / f"{kind}_requests.jsonl"
    env = {k: v for k, v in os.environ.items() if "_proxy" not in k.lower()}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            _command(kind, port, requests_log),
            env=env,
            cwd=REPO_ROOT,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    store = Store(kind, endpoint, _env(kind, endpoint), proc, log, requests_log)
    deadline = time.monotonic() + timeout
    while not _answers(endpoint):
        if proc.poll() is not None:
            raise RuntimeError(
                f"the {kind} server ({' '.join(_command(kind, port, requests_log))}) exited with "
                f"return code "
                f"{proc.returncode} before it answered; {log}:\n{_tail(log)}"
            )
        if time.monotonic() > deadline:
            stop(store)
            raise RuntimeError(
                f"the {kind} server did not answer on {endpoint} within {timeout:g}s; "
                f"{log}:\n{_tail(log)}"
            )
        time.sleep(_POLL_S)
    return store


def stop(store: Store) -> None:
    """Terminates the server (SIGKILL if it lingers) and reaps it."""
    if store.proc.poll() is None:
        store.proc.terminate()
        try:
            store.proc.wait(timeout=_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            store.proc.kill()
            store.proc.wait(timeout=_STOP_TIMEOUT_S)


def _answers(endpoint: str) -> bool:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # 127.0.0.1 directly
    try:
        with opener.open(endpoint + "/", timeout=2):
            return True
    except urllib.error.HTTPError:  # an HTTP answer, even an error, means it is serving
        return True
    except OSError:
        return False


def _tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as e:
        return f"<no output: {e}>"
    return "\n".join(text.splitlines()[-lines:]) or "<no output>"
