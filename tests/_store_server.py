"""Runs one local object store on 127.0.0.1, in memory; started by `tests/_object_stores.py`.

Usage: `python tests/_store_server.py {s3,gcs} PORT`. Either server exits when the process that
started it dies, even by SIGKILL, so a killed test run leaves no server behind.

- `s3`: moto's server (`moto.server`), unchanged.
- `gcs`: gcp-storage-emulator, patched in this process only:
  - It leaves the `x-goog-generation` and `x-goog-metageneration` headers out of a media download;
    real GCS sends them, and tensorstore's `gcs` driver takes an object's generation from them
    (without, every read has an unknown generation). The patch adds both, from the object's own
    metadata, to each successful download. (`ifGenerationMatch` is still ignored: writes succeed.)
  - Its server handles one connection at a time, so a client that opens a connection early
    (connection pools do) and sends nothing yet stalls every other request. Here each connection
    has its own thread; requests still run one at a time, as the emulator's storage expects.
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import sys
import threading
from http import HTTPStatus
from http.server import ThreadingHTTPServer

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def exit_with_parent() -> None:
    """Exits this process as soon as its parent is gone: the kernel sends it SIGKILL then."""
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(0)


def run_s3(port: int) -> None:
    from moto import server

    server.main(["-H", "127.0.0.1", "-p", str(port)])


def run_gcs(port: int) -> None:
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

    lock = threading.Lock()

    def one_at_a_time(name: str):
        handle = getattr(server.RequestHandler, name)

        def locked(self) -> None:
            with lock:  # the request line and headers are read: only a sent request waits here
                handle(self)

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
    exit_with_parent()
    {"s3": run_s3, "gcs": run_gcs}[kind](port)


if __name__ == "__main__":
    main()
