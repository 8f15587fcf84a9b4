"""Object storage behind fsspec: ``file://`` (a local folder, the default) or ``s3://``.

Every write is atomic: a single object is written under a temporary name and renamed
(local) or PUT whole (S3, where a PUT is atomic), so a reader sees the old object or
the new one, never half of one. Multi-file outputs (checkpoints, model folders) add a
``MANIFEST.json`` written last; a folder without one is not committed.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import time
import uuid
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Callable

import fsspec
from fsspec.core import url_to_fs


class StorageError(RuntimeError):
    """Storage is unreachable or an object is missing/unreadable; the message names the URI."""


class StorageIOError(StorageError, OSError):
    """A read or write that the OS or the object store refused (a full disk, a permission): the
    message names the URI and the OS's error (``[Errno 28] No space left on device``). Still an
    OSError for code that catches those."""


log = logging.getLogger("yattflow.storage")


_retry_cap: ContextVar[float | None] = ContextVar("yattflow_storage_retry_cap", default=None)


def retry_s() -> float:
    """How long a remote object-store call retries an unreachable store before failing:
    ``YATTFLOW_STORAGE_RETRY_S`` (seconds, default 180; 0: fail at once), or less inside ``retry_at_most``."""
    configured, cap = float(os.environ.get("YATTFLOW_STORAGE_RETRY_S", "180")), _retry_cap.get()
    return configured if cap is None else min(configured, cap)


ON_THE_WAY_OUT_S = 10.0  # how long a call on the way out of a command (where it stopped, the lease given back,
# TensorBoard's last lines) waits for a store that does not answer: the command may have failed on it already


@contextmanager
def retry_at_most(seconds: float):
    """Calls in this block (this thread or task) ride out an outage for at most ``seconds``: for reads that
    only add to what a command says as it ends (where a run that failed on storage stands), which must not
    wait out another ``retry_s()``."""
    token = _retry_cap.set(seconds)
    try:
        yield
    finally:
        _retry_cap.reset(token)


def _transient(e: BaseException) -> bool:
    """The store did not answer (refused, reset, timed out, a 5xx), as opposed to answering no."""
    import botocore.exceptions

    seen = 0
    while e is not None and seen < 10:
        if isinstance(e, (botocore.exceptions.ConnectionError, botocore.exceptions.HTTPClientError, ConnectionError, TimeoutError)):
            return True
        if type(e).__module__.startswith("aiohttp") and ("Connect" in type(e).__name__ or "Disconnected" in type(e).__name__):
            return True
        if any(code in str(e) for code in ("ServiceUnavailable", "SlowDown", "InternalError", "503 Service", "502 Bad")):
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return False


# an endpoint as the HTTP clients name it: ``endpoint URL: "http://host:port/bucket/key"``, ``host 10.0.0.5:9000``
_ENDPOINT = re.compile(r"""(:\s*)?["']?\bhttps?://[^\s"']*["']?|\bhost \S+:\d+(\s+ssl:\S+)?(\s+\[[^]]*\])?""", re.IGNORECASE)


def _reason(e: BaseException) -> str:
    """A store that did not answer, in the words of its client, without the HTTP endpoint or address it
    names: ``EndpointConnectionError: Could not connect to the endpoint URL``. The object's URI says what
    failed; the endpoint is the client's setting (``AWS_ENDPOINT_URL_S3``), and in a failure's exception
    chain (the log file's traceback)."""
    first = str(e).splitlines()[0] if str(e) else ""
    first = " ".join(_ENDPOINT.sub(lambda m: "host" if m.group(0).lower().startswith("host") else "", first).split())
    return f"{type(e).__name__}: {first[:200]}" if first else type(e).__name__


def retrying(uri: str, what: str, call: Callable):
    """``call()``; on a remote URI an unreachable store is retried with backoff (0.5 s doubling to
    10 s) for ``retry_s()``, then a StorageError naming ``uri``. A local folder is never retried.

    One warning per call that meets an outage, naming ``uri`` and not the HTTP endpoint (``_reason``), and
    a line when the store answers again."""
    if is_local(uri):
        return call()
    started = time.monotonic()
    deadline, delay, warned = started + retry_s(), 0.5, False
    while True:
        try:
            result = call()
        except Exception as e:  # noqa: BLE001 - only a store that did not answer is retried
            if not _transient(e):
                raise
            if time.monotonic() + delay > deadline:
                raise StorageError(f"{uri}: {what} failed: the object store did not answer for {retry_s():.0f}s "
                                   f"(YATTFLOW_STORAGE_RETRY_S) ({_reason(e)})") from e
            if not warned:
                log.warning("%s: %s: the object store does not answer (%s); retrying for up to %.0fs (YATTFLOW_STORAGE_RETRY_S)",
                            uri, what, _reason(e), retry_s())
                warned = True
            time.sleep(delay)
            delay = min(2 * delay, 10.0)
            continue
        if warned:
            log.info("%s: %s: the object store answers again (after %.0fs)", uri, what, time.monotonic() - started)
        return result


def os_error(e: OSError) -> str:
    """The OS's words for a failed read or write: ``[Errno 28] No space left on device`` (without the
    name of a writer's temporary file, which the URI beside it replaces)."""
    return f"[Errno {e.errno}] {e.strerror}" if e.errno is not None and e.strerror else f"{type(e).__name__}: {e}"


def normalize(uri: str) -> str:
    """A plain path becomes an absolute ``file://`` URI; URIs with a scheme are kept."""
    if "://" in uri:
        return uri.rstrip("/")
    return "file://" + str(Path(uri).expanduser().resolve())


def join(base: str, *parts: str) -> str:
    return "/".join([base.rstrip("/")] + [p.strip("/") for p in parts if p])


def resolve(root: str, path: str) -> str:
    """A path in the config is relative to the storage root unless it is absolute or a URI."""
    if "://" in path or path.startswith(("/", "~")):
        return normalize(path)
    return join(normalize(root), path)


def fs_for(uri: str) -> tuple[fsspec.AbstractFileSystem, str]:
    return url_to_fs(uri)


def is_local(uri: str) -> bool:
    return uri.startswith("file://") or "://" not in uri


def exists(uri: str) -> bool:
    fs, path = fs_for(uri)
    return retrying(uri, "exists", lambda: fs.exists(path))


def read_bytes(uri: str) -> bytes:
    """One object's bytes. A local object that is a symbolic link is refused, never followed: the store
    writes plain files only, and a link put in place of one may lead anywhere (``/etc/passwd``)."""
    fs, path = fs_for(uri)
    if is_local(uri) and os.path.islink(path):
        raise StorageError(f"{uri}: a symbolic link (to {os.readlink(path)}), not an object the store wrote; the store "
                           "never follows one: put the file itself there, or point the config at it")

    try:  # (one GET: open() reads the object's ETag first and fails if a writer replaces it before the read)
        return retrying(uri, "read", lambda: fs.cat_file(path))
    except FileNotFoundError as e:
        raise StorageError(f"{uri}: not found") from e
    except OSError as e:
        raise StorageIOError(f"{uri}: read failed: {os_error(e)}") from e


def write_bytes(uri: str, data: bytes) -> None:
    """Write one object atomically; a failed write (a full disk, say) raises StorageError naming
    the URI and the OS's error, and leaves the old object, or none."""
    try:
        retrying(uri, "write", lambda: _write_bytes(uri, data))
    except OSError as e:
        raise StorageIOError(f"{uri}: write failed: {os_error(e)}") from e


def _write_bytes(uri: str, data: bytes) -> None:
    fs, path = fs_for(uri)
    if is_local(uri):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    else:
        with fs.open(path, "wb") as f:  # S3 PUT (or multipart complete) is all-or-nothing
            f.write(data)


def read_json(uri: str) -> dict:
    return _parse_json(uri, read_bytes(uri))


def _parse_json(uri: str, data: bytes):
    try:
        return json.loads(data)
    except ValueError as e:  # truncated or not JSON (JSONDecodeError), or not even text (UnicodeDecodeError)
        raise StorageError(f"{uri}: not valid JSON ({e})") from e


def json_bytes(obj) -> bytes:
    """How the store writes a JSON object (``write_json``): indented, keys sorted."""
    return json.dumps(obj, indent=2, sort_keys=True).encode()


def write_json(uri: str, obj: dict) -> None:
    write_bytes(uri, json_bytes(obj))


def update_json(uri: str, change: Callable[[dict | None], dict | None]) -> dict | None:
    """Compare-and-swap one small JSON object: ``change(current)`` (None: absent) returns the new
    object, or None to leave it as it is; returns what the object is afterwards.

    Two processes updating at once never both win: a local folder takes an exclusive ``flock``
    on ``<object>.lock`` around the read and the write; S3 writes conditionally (``If-None-Match:
    *`` when the object is absent, ``If-Match: <ETag>`` of what was read otherwise) and reads and
    decides again when another writer came first."""
    fs, path = fs_for(uri)
    if is_local(uri):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(f"{path}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            current = _parse_json(uri, Path(path).read_bytes()) if os.path.exists(path) else None
            new = change(current)
            if new is not None:
                write_json(uri, new)
            return current if new is None else new
    while True:
        try:
            etag = retrying(uri, "read", lambda: fs.info(path, refresh=True)["ETag"])
            current = json.loads(retrying(uri, "read", lambda: fs.cat_file(path)))
        except FileNotFoundError:
            etag, current = None, None
        new = change(current)
        if new is None:
            return current
        condition = {"mode": "create"} if etag is None else {"IfMatch": etag}
        try:
            retrying(uri, "write", lambda: fs.pipe_file(path, json.dumps(new, indent=2, sort_keys=True).encode(), **condition))
            return new
        except OSError as e:  # 412 Precondition Failed (s3fs reports it as EINVAL): another writer came first
            if "pre-condition" not in str(e) and "Precondition" not in str(e):
                raise


def list_files(uri: str, suffix: str = "") -> list[str]:
    """Sorted URIs of the objects directly under ``uri`` (a folder) or ``[uri]`` for a file."""
    fs, path = fs_for(uri)
    scheme = uri.split("://", 1)[0] if "://" in uri else "file"
    if retrying(uri, "list", lambda: fs.isfile(path)):
        return [uri]
    if not retrying(uri, "list", lambda: fs.exists(path)):
        raise StorageError(f"{uri}: not found")
    names = sorted(p for p in retrying(uri, "list", lambda: fs.ls(path, detail=False)) if p.endswith(suffix) and ".tmp-" not in p)
    return [f"{scheme}://{p}" for p in names]


def remove(uri: str) -> None:
    fs, path = fs_for(uri)
    try:
        if retrying(uri, "remove", lambda: fs.exists(path)):
            retrying(uri, "remove", lambda: fs.rm(path, recursive=True))
    except OSError as e:
        raise StorageIOError(f"{uri}: remove failed: {os_error(e)}") from e


def move(uri: str, to: str) -> None:
    """Move an object or a folder (local: one rename; S3: a copy, then the delete)."""
    fs, path = fs_for(uri)
    try:
        retrying(uri, "move", lambda: fs.mv(path, fs_for(to)[1], recursive=True))
    except OSError as e:
        raise StorageIOError(f"{uri}: move to {to} failed: {os_error(e)}") from e


def check_reachable(root: str) -> None:
    """Fail fast, before any device time is spent, when storage cannot be written."""
    probe = join(root, f".probe-{uuid.uuid4().hex[:8]}")
    try:  # once, not retried: at the start an unreachable store is a setting to fix, not an outage to ride out
        _write_bytes(probe, b"ok")
        fs, path = fs_for(probe)
        fs.rm(path)
    except Exception as e:  # noqa: BLE001 - any failure here means "unreachable"
        raise StorageError(f"storage root {root} is not reachable or not writable: {type(e).__name__}: {e}") from e


def upload_folder(local_dir: str, uri: str) -> None:
    """Copy a local folder to ``uri`` and commit it with a MANIFEST.json written last."""
    files = sorted(p for p in Path(local_dir).rglob("*") if p.is_file())
    for p in files:
        write_bytes(join(uri, str(p.relative_to(local_dir))), p.read_bytes())
    write_json(join(uri, "MANIFEST.json"), {"files": [str(p.relative_to(local_dir)) for p in files]})


def local_folder(uri: str, cache_dir: str | None = None) -> str:
    """A local path for a folder URI (a Hugging Face model folder, say): local folders are
    used in place; remote ones are downloaded once into a cache keyed by the URI."""
    if is_local(uri):
        path = fs_for(uri)[1]
        if not os.path.isdir(path):
            raise StorageError(f"{uri}: folder not found")
        return path
    cache = Path(cache_dir or os.environ.get("YATTFLOW_CACHE", "~/.cache/yattflow")).expanduser()
    target = cache / uri.replace("://", "/").strip("/")
    if (target / "MANIFEST.json").exists():
        return str(target)
    fs, path = fs_for(uri)
    if not exists(uri):
        raise StorageError(f"{uri}: folder not found")
    tmp = Path(f"{target}.tmp-{uuid.uuid4().hex[:8]}")
    retrying(uri, "download", lambda: fs.get(path.rstrip("/") + "/", str(tmp), recursive=True))
    if not (tmp / "MANIFEST.json").exists():
        (tmp / "MANIFEST.json").write_text(json.dumps({"source": uri}))
    target.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, target)
    return str(target)
