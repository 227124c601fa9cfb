"""Runs one local object store on 127.0.0.1, in memory; started by `tests/_object_stores.py`.

Usage: `python tests/_store_server.py {s3,gcs} PORT [REQUESTS]`. Either server exits when the
process that started it dies, even by SIGKILL, so a killed test run leaves no server behind.

With `REQUESTS` (a file), the server appends one JSON line per request it answered: the method,
the object key it names (`bucket/key`; null where the request names none), the bytes of request
body the server read, and, for a server-side copy, its source key. A line is written before the
next request is handled (GCS) or before the answer is sent (S3): what the clients sent, counted
by the server.

- `s3`: moto's server (`moto.server`), patched in this process only: it ignores
  `x-amz-copy-source-if-match`; real S3 refuses such a copy with 412 when the source's ETag
  differs, and so does this one.
- `gcs`: gcp-storage-emulator, patched in this process only:
  - It leaves the `x-goog-generation` and `x-goog-metageneration` headers out of a media download;
    real GCS sends them, and tensorstore's `gcs` driver takes an object's generation from them
    (without, every read has an unknown generation). The patch adds both, from the object's own
    metadata, to each successful download. (`ifGenerationMatch` is still ignored: writes succeed.)
  - Its `rewriteTo` and `copyTo` ignore `ifSourceGenerationMatch`; real GCS answers 412 when the
    source's generation differs, and so does this one.
  - Its server handles one connection at a time, so a client that opens a connection early
    (connection pools do) and sends nothing yet stalls every other request. Here each connection
    has its own thread; requests still run one at a time, as the emulator's storage expects.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import re
import signal
import sys
import threading
from http import HTTPStatus
from http.server import ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def exit_with_parent() -> None:
    """Exits this process as soon as its parent is gone: the kernel sends it SIGKILL then."""
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(0)


class Requests:
    """The request log (`REQUESTS` above): one JSON line per request, appended under a lock."""

    def __init__(self, path: str | None) -> None:
        self._path = path
        self._lock = threading.Lock()

    def record(self, method: str, key: str | None, nbytes: int, source: str | None) -> None:
        if self._path is None:
            return
        line = json.dumps({"method": method, "key": key, "bytes": nbytes, "copied_from": source})
        with self._lock, open(self._path, "a") as out:
            out.write(line + "\n")


class Counting:
    """A request body stream that counts the bytes read from it."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self.count = 0

    def read(self, *args: Any) -> bytes:
        data = self._stream.read(*args)
        self.count += len(data)
        return data

    def read1(self, *args: Any) -> bytes:
        data = self._stream.read1(*args)
        self.count += len(data)
        return data

    def readline(self, *args: Any) -> bytes:
        data = self._stream.readline(*args)
        self.count += len(data)
        return data

    def readinto(self, buffer: Any) -> int:
        n = self._stream.readinto(buffer) or 0
        self.count += n
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def run_s3(port: int, requests: Requests) -> None:
    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from moto.s3.exceptions import PreconditionFailed
    from moto.s3.responses import S3Response
    from werkzeug.serving import run_simple

    copy_object = S3Response.copy_object

    def copy_object_if_match(self: Any) -> Any:
        wanted = self.headers.get("x-amz-copy-source-if-match")
        if wanted is not None:
            bucket, key = _s3_copy_source(self.headers["x-amz-copy-source"]).split("/", 1)
            found = self.backend.get_object(bucket, key)
            if found is not None and found.etag.strip('"') != wanted.strip('"'):
                raise PreconditionFailed(failed_condition="x-amz-copy-source-If-Match")
        return copy_object(self)

    S3Response.copy_object = copy_object_if_match
    app = DomainDispatcherApplication(create_backend_app)

    def counted(environ: dict[str, Any], start_response: Any) -> Any:
        body = Counting(environ["wsgi.input"])
        environ["wsgi.input"] = body
        answer = app(environ, start_response)  # moto reads the whole body while answering
        source = environ.get("HTTP_X_AMZ_COPY_SOURCE")
        key = environ.get("PATH_INFO", "").lstrip("/") or None  # path-style: /bucket/key
        requests.record(
            environ["REQUEST_METHOD"], key, body.count, source and _s3_copy_source(source)
        )
        return answer

    run_simple("127.0.0.1", port, counted, threaded=True, request_handler=MotoRequestHandler)


def _s3_copy_source(header: str | bytes) -> str:
    """`bucket/key` of an `x-amz-copy-source` header (`[/]bucket/key[?versionId=...]`, quoted)."""
    text = header.decode() if isinstance(header, bytes) else header
    return unquote(urlsplit(text).path).lstrip("/")


_GCS_COPY = re.compile(r"/b/([^/]+)/o/(.+)/(?:rewriteTo|copyTo)/b/([^/]+)/o/(.+)$")
_GCS_INSERT = re.compile(r"/b/([^/]+)/o$")
_GCS_OBJECT = re.compile(r"/b/([^/]+)/o/(.+)$")
_GCS_XML = re.compile(r"^/([-.\w]+)/(.+)$")


def _gcs_key(target: str) -> tuple[str | None, str | None]:
    """(object key, copy source key) a GCS request names: JSON API uploads (`name=`; a multipart
    upload names it in its body: None), object paths, copies, XML API paths."""
    parts = urlsplit(target)
    path, query = parts.path, parse_qs(parts.query)
    copied = _GCS_COPY.search(path)
    if copied:
        source, target_bucket, target_key = copied.group(1, 2), copied[3], copied[4]
        return unquote(f"{target_bucket}/{target_key}"), unquote("/".join(source))
    inserted = _GCS_INSERT.search(path)
    if inserted:
        names = query.get("name")
        return (f"{inserted[1]}/{names[0]}" if names else None), None
    named = _GCS_OBJECT.search(path)
    if named:
        return unquote(f"{named[1]}/{named[2]}"), None
    xml = None if path.startswith(("/storage/", "/upload/", "/download/")) else _GCS_XML.match(path)
    return (unquote(f"{xml[1]}/{xml[2]}") if xml else None), None


def run_gcs(port: int, requests: Requests) -> None:
    from gcp_storage_emulator import server
    from gcp_storage_emulator.exceptions import NotFound
    from gcp_storage_emulator.handlers import objects
    from gcp_storage_emulator.storage import Storage

    download = objects.download

    @functools.wraps(download)
    def download_with_generation(request, response, storage, *args, **kwargs):
        download(request, response, storage, *args, **kwargs)
        if response.status not in (HTTPStatus.OK, HTTPStatus.PARTIAL_CONTENT):
            return
        try:
            obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
        except NotFound:
            return
        response["x-goog-generation"] = str(obj["generation"])
        response["x-goog-metageneration"] = str(obj["metageneration"])

    objects.download = download_with_generation  # what objects.get calls for alt=media
    for _, handlers in server.HANDLERS:
        for method, handler in handlers.items():
            if handler is download:
                handlers[method] = download_with_generation

    def if_source_generation_match(handler):
        @functools.wraps(handler)
        def checked(request, response, storage, *args, **kwargs):
            wanted = request.query.get("ifSourceGenerationMatch")
            if wanted:
                try:
                    source = storage.get_file_obj(
                        request.params["bucket_name"], request.params["object_id"]
                    )
                except NotFound:
                    source = None  # the handler answers 404
                if source is not None and str(source["generation"]) != wanted[0]:
                    response.status = HTTPStatus.PRECONDITION_FAILED
                    return
            handler(request, response, storage, *args, **kwargs)

        return checked

    for _, handlers in server.HANDLERS:
        for method, handler in handlers.items():
            if handler in (objects.rewrite, objects.copy):
                handlers[method] = if_source_generation_match(handler)

    lock = threading.Lock()

    def one_at_a_time(name: str):
        handle = getattr(server.RequestHandler, name)

        def locked(self) -> None:
            with lock:  # the request line and headers are read: only a sent request waits here
                body = Counting(self.rfile)
                self.rfile = body
                try:
                    handle(self)
                finally:
                    self.rfile = body._stream  # the connection's next request reads it
                    key, source = _gcs_key(self.path)
                    requests.record(self.command, key, body.count, source)

        return locked

    methods = ("do_GET", "do_POST", "do_PUT", "do_PATCH", "do_DELETE")
    request_handler = type(
        "OneRequestAtATime", (server.RequestHandler,), {m: one_at_a_time(m) for m in methods}
    )

    storage = Storage(use_memory_fs=True)
    httpd = ThreadingHTTPServer(("127.0.0.1", port), functools.partial(request_handler, storage))
    httpd.daemon_threads = True
    httpd.serve_forever()


def main() -> None:
    kind, port = sys.argv[1], int(sys.argv[2])
    requests = Requests(sys.argv[3] if len(sys.argv) > 3 else None)
    exit_with_parent()
    {"s3": run_s3, "gcs": run_gcs}[kind](port, requests)


if __name__ == "__main__":
    main()
