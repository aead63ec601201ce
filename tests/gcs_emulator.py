"""A GCS emulator for tests (the ``gcp-storage-emulator`` package: the JSON API, in memory), and
the environment that points jaxrl at it: ``STORAGE_EMULATOR_HOST`` alone, as a user sets it
(``jaxrl.runtime.storage.use_emulator`` derives tensorstore's variables from it)."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Iterator
from typing import Any

BUCKET = "jaxrl-test"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _download_with_generation() -> None:
    """Make the emulator's media downloads carry ``x-goog-generation`` as GCS's do: tensorstore
    (orbax's OCDBT manifest reads) takes an object's generation from that header and fails
    with "Malformed StorageGeneration" without it."""
    from gcp_storage_emulator import server
    from gcp_storage_emulator.exceptions import NotFound
    from gcp_storage_emulator.handlers import objects

    original = objects.download
    if getattr(original, "with_generation", False):
        return

    def download(request: Any, response: Any, storage: Any, *args: Any, **kwargs: Any) -> Any:
        with contextlib.suppress(NotFound, KeyError):
            obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
            response["x-goog-generation"] = str(obj["generation"])
            response["x-goog-metageneration"] = str(obj["metageneration"])
        return original(request, response, storage, *args, **kwargs)

    download.with_generation = True
    objects.download = download  # objects.get (alt=media) looks it up by name
    for _, methods in server.HANDLERS:
        for method, handler in list(methods.items()):
            if handler is original:
                methods[method] = download


@contextlib.contextmanager
def gcs_emulator() -> Iterator[str]:
    """Serve an empty in-memory GCS with bucket ``BUCKET``; yields ``STORAGE_EMULATOR_HOST``."""
    from gcp_storage_emulator.server import create_server

    # the emulator logs every 404 (each existence check) as an error; a client closing its
    # connection early prints a BrokenPipe traceback: neither is a failure
    logging.getLogger("gcp_storage_emulator").setLevel(logging.CRITICAL)
    _download_with_generation()
    port = free_port()
    server = create_server("127.0.0.1", port, in_memory=True, default_bucket=BUCKET)
    server.start()
    server._api._httpd.handle_error = lambda *args: None  # noqa: SLF001
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


EMULATOR_VARIABLES = (
    "STORAGE_EMULATOR_HOST",
    "TENSORSTORE_GCS_HTTP_URL",
    "GOOGLE_AUTH_TOKEN_FOR_TESTING",
    "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT",
)


@contextlib.contextmanager
def emulator_env(host: str) -> Iterator[None]:
    """``STORAGE_EMULATOR_HOST=host`` for this process (and jaxrl's derived variables), undone
    after."""
    import fsspec

    from jaxrl.runtime import storage

    saved = {k: os.environ.get(k) for k in EMULATOR_VARIABLES}
    for k in EMULATOR_VARIABLES:
        os.environ.pop(k, None)
    os.environ["STORAGE_EMULATOR_HOST"] = host
    gcs = fsspec.config.conf.get("gcs")
    storage.use_emulator()
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if gcs is None:
            fsspec.config.conf.pop("gcs", None)
        else:
            fsspec.config.conf["gcs"] = gcs
