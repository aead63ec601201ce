"""Where jaxrl reads and writes files: local paths and storage URLs (``gs://bucket/run``), one
path type for both (docs/tpu_pod.md).

Every path jaxrl writes or reads (``output_dir``, ``model.path``, data files) goes through
:func:`path`, which gives an ``etils.epath.Path``: the path type orbax already uses. A local
path is a ``pathlib`` path underneath; a URL is served by fsspec (``gcsfs`` for ``gs://``), and
orbax writes its arrays to the same URL through tensorstore. ``pathlib.Path("gs://b/run")`` is a
local directory named ``gs:``; nothing in jaxrl builds one from a configured path.

Writes are atomic as before: a local file is written to a temporary name and renamed; an
object store's single-object upload is already atomic (a reader sees the old object or the new
one), and GCS has no cheap rename, so a remote file is written once, in place. Object stores
have no append either: :func:`append_text` rewrites a remote file whole.

Libraries that need a local file (safetensors' memory map, tokenizers, pyarrow) read a remote
file or directory through :func:`local`, a copy downloaded once per process; directories that
libraries write (the ``hf/`` export) are written locally and uploaded by :func:`staged`.

``STORAGE_EMULATOR_HOST`` (the variable Google's client libraries and gcsfs honour, e.g.
``http://localhost:9023``) points every GCS access at an emulator: :func:`use_emulator` (run when
this module is imported) derives tensorstore's ``TENSORSTORE_GCS_HTTP_URL`` and
``GOOGLE_AUTH_TOKEN_FOR_TESTING`` from it where they are unset, and makes gcsfs connect
anonymously without probing the bucket's layout over gRPC (which an emulator does not serve).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

from etils import epath

__all__ = [
    "EMULATOR",
    "absolute",
    "append_text",
    "files",
    "is_remote",
    "local",
    "path",
    "staged",
    "use_emulator",
    "write_bytes",
    "write_text",
]

EMULATOR = "STORAGE_EMULATOR_HOST"
LOCAL_SCHEMES = ("file://",)


def use_emulator() -> str | None:
    """Point tensorstore and gcsfs at ``$STORAGE_EMULATOR_HOST`` when it is set (variables the
    user set already are kept); returns the emulator's URL, or None."""
    host = os.environ.get(EMULATOR, "")
    if host in ("", "default"):
        return None
    url = host if host.startswith(("http://", "https://")) else f"http://{host}"
    os.environ.setdefault("TENSORSTORE_GCS_HTTP_URL", url)  # orbax's array writes
    os.environ.setdefault("GOOGLE_AUTH_TOKEN_FOR_TESTING", "emulator")  # tensorstore: no ADC
    # gcsfs >= 2025 probes a bucket's layout over gRPC first, which an emulator does not serve
    # (a minute of retries per bucket); read when gcsfs is imported
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    import fsspec

    fsspec.config.conf.setdefault("gcs", {}).setdefault("token", "anon")
    return url


use_emulator()


def is_remote(p: Any) -> bool:
    """Whether ``p`` names a storage URL (``gs://``, ``s3://``, ...) rather than a local path."""
    text = os.fspath(p) if not isinstance(p, str) else p
    return "://" in text and not text.startswith(LOCAL_SCHEMES)


def path(p: str | os.PathLike) -> epath.Path:
    """``p`` as an ``epath.Path`` (a ``file://`` URL becomes its local path)."""
    text = os.fspath(p)
    if text.startswith("file://"):
        text = text.removeprefix("file://")
    return epath.Path(text)


def absolute(p: str | os.PathLike) -> epath.Path:
    """:func:`path`, made absolute when local (a URL is absolute already)."""
    out = path(p)
    return out if is_remote(out) else epath.Path(os.path.abspath(os.fspath(out)))


def write_bytes(p: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``p`` atomically: a local temporary beside it renamed over it, or one
    object upload (atomic on an object store)."""
    target = path(p)
    if is_remote(target):
        target.write_bytes(data)
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.fspath(target.parent), prefix=f".{target.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename makes it visible
        os.replace(tmp, os.fspath(target))
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_text(p: str | os.PathLike, text: str) -> None:
    """:func:`write_bytes` of ``text`` as UTF-8."""
    write_bytes(p, text.encode("utf-8"))


def append_text(p: str | os.PathLike, text: str) -> None:
    """Append ``text`` to ``p``: an append locally; remotely (no appends on object stores) the
    file is read and written again whole, one atomic upload."""
    target = path(p)
    if not is_remote(target):
        with open(os.fspath(target), "a", encoding="utf-8") as f:
            f.write(text)
        return
    old = target.read_text() if target.exists() else ""
    target.write_text(old + text)


def files(root: str | os.PathLike) -> list[tuple[str, epath.Path]]:
    """Every file under ``root`` as ``(path relative to root, path)``, sorted (``rglob``, which
    GCS paths do not support, walked by hand)."""
    root = path(root)
    out: list[tuple[str, epath.Path]] = []

    def walk(d: epath.Path, prefix: str) -> None:
        for child in d.iterdir():
            name = f"{prefix}{child.name}"
            if child.is_dir():
                walk(child, f"{name}/")
            else:
                out.append((name, child))

    walk(root, "")
    return sorted(out, key=lambda item: item[0])


def _cache_root() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxrl", "storage")


def local(p: str | os.PathLike) -> str:
    """A local path holding ``p``'s bytes: ``p`` itself when local; for a URL, a copy of the
    file or directory (every file under it) in ``~/.cache/jaxrl/storage/``, for libraries that
    read only local files. The copy is named by the URL and its files' names and sizes, so it
    is downloaded once per host (processes sharing a host share it; a changed source is
    downloaded again), into a temporary name renamed when whole."""
    source = path(p)
    if not is_remote(source):
        return os.fspath(source)
    if not source.exists():
        raise FileNotFoundError(f"{os.fspath(source)} does not exist")
    listing = files(source) if source.is_dir() else [("", source)]
    key = hashlib.sha256(os.fspath(source).encode())
    for name, file in listing:
        key.update(f"{name}\0{file.stat().length}\0".encode())
    target = os.path.join(_cache_root(), key.hexdigest()[:16], source.name)
    if os.path.exists(target):
        return target
    staging = f"{target}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    for name, file in listing:
        dest = os.path.join(staging, name) if name else staging
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        with file.open("rb") as src, open(dest, "wb") as out:
            shutil.copyfileobj(src, out, 1 << 22)  # streamed: weights may exceed memory
    try:
        os.replace(staging, target)  # a copy cut short is never taken for a whole one
    except OSError:  # another process of this host renamed its copy first
        if not os.path.exists(target):
            raise
        shutil.rmtree(staging, ignore_errors=True)
    return target


@contextlib.contextmanager
def staged(p: str | os.PathLike) -> Iterator[str]:
    """A local directory to write ``p``'s files into: ``p`` itself when local; for a URL, a
    temporary directory whose files are uploaded under ``p`` (each one atomic) when the block
    ends without an error."""
    target = path(p)
    if not is_remote(target):
        yield os.fspath(target)
        return
    with tempfile.TemporaryDirectory(prefix="jaxrl-upload-") as tmp:
        yield tmp
        for name, file in files(tmp):
            (target / name).write_bytes(file.read_bytes())
