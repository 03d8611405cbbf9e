"""Checkpoint storage: fsspec path operations behind a small Protocol.

This module is the only place that knows fsspec, s3fs and botocore exist as error
sources. Everything it raises is ours: a bad URL is :class:`UnknownURLSchemeError`,
refused or missing credentials are :class:`CredentialsError`, and transient S3
trouble (throttling, 5xx, dropped connections) is retried a few times before it is
raised. Credentials never appear in a message or a log line: we log URLs only, and
``storage_options`` are never formatted.

Guarantees: :meth:`Storage.write_bytes` is atomic (readers see the whole file or
none): a local file is written beside its target and renamed, an object store puts
the object in one request. Not guaranteed: atomic directory operations.
"""

from __future__ import annotations

import datetime
import logging
import os
import posixpath
import time
import uuid
from typing import Any, Callable, Protocol, TypeVar, runtime_checkable

import fsspec
from fsspec.core import url_to_fs

from elastic_rt.errors import (
    CheckpointError,
    CheckpointLocationError,
    CredentialsError,
    ElasticError,
    StorageUnreachableError,
    UnknownURLSchemeError,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

SCHEMES = ("file", "local", "memory", "s3", "s3a")
"""URL schemes we test and support; a plain path means ``file``."""

RETRIES = 4
"""Attempts of an idempotent storage call before a transient error is raised."""

NOT_A_FILE = (FileNotFoundError, IsADirectoryError, NotADirectoryError)
"""What a read of a path that is missing, or is a folder, raises: the caller's to
interpret (for a checkpoint file: damage), never a storage failure."""

_DRIVER_LOGGERS = ("botocore", "aiobotocore", "s3fs", "fsspec", "urllib3")

_CREDENTIAL_CODES = frozenset(
    {"InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "ExpiredToken",
     "InvalidToken", "UnrecognizedClientException"}
)
_TRANSIENT_CODES = frozenset(
    {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "InternalError",
     "ServiceUnavailable", "503", "500", "RequestTimeTooSkewed"}
)


@runtime_checkable
class Storage(Protocol):
    """What the checkpoint code needs from a storage backend. Paths are relative."""

    url: str

    def url_of(self, rel: str) -> str: ...
    def list_dirs(self) -> list[str]: ...
    def list_files(self, rel: str) -> dict[str, int]: ...
    def check_location(self, *, allow_new_run: bool) -> None: ...
    def last_change(self, rel: str) -> float | None: ...
    def exists(self, rel: str) -> bool: ...
    def read_bytes(self, rel: str, nonempty: bool = False) -> bytes: ...
    def write_bytes(self, rel: str, data: bytes) -> None: ...
    def remove_tree(self, rel: str) -> None: ...


def parse_url(url: str) -> str:
    """Return the scheme of ``url`` ("file" for a plain path).

    Raises:
        UnknownURLSchemeError: the scheme is not one we support.
    """
    scheme = url.split("://", 1)[0].lower() if "://" in url else "file"
    if scheme not in SCHEMES:
        raise UnknownURLSchemeError(
            f"checkpoint URL {url!r} has the unknown scheme {scheme!r}",
            "Use a local path, file://, memory:// or s3://bucket/prefix.",
        )
    return scheme


class FsspecStorage:
    """A :class:`Storage` rooted at one fsspec URL.

    Args:
        url: a path, ``file://``, ``memory://`` or ``s3://bucket/prefix``.
        storage_options: passed to fsspec (for S3: ``endpoint_url``, ``key``...).

    Raises:
        UnknownURLSchemeError: the URL's scheme is not supported or its driver is missing.
    """

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        scheme = parse_url(url)
        self.url = url.rstrip("/")
        self.storage_options = dict(storage_options or {})
        if scheme in ("s3", "s3a"):
            # Listings must see other ranks' and processes' writes at once.
            self.storage_options.setdefault("use_listings_cache", False)
        try:
            self.fs, root = url_to_fs(self.url, **self.storage_options)
        except ImportError as exc:
            raise UnknownURLSchemeError(
                f"the driver for {scheme}:// URLs is not installed",
                "Install it, for example pip install s3fs.",
            ) from exc
        self.root = root.rstrip("/") or "/"
        self.is_local = isinstance(self.fs, fsspec.implementations.local.LocalFileSystem)
        self.is_memory = scheme == "memory"

    def __repr__(self) -> str:
        return f"FsspecStorage({self.url!r})"

    def path(self, rel: str) -> str:
        """The fsspec path (no scheme) of ``rel`` under the root."""
        return posixpath.join(self.root, rel) if rel else self.root

    def url_of(self, rel: str) -> str:
        """The full URL of ``rel`` under the root, for people and for DCP."""
        return f"{self.url}/{rel}" if rel else self.url

    def list_dirs(self) -> list[str]:
        """Names of the folders directly under the root (none if the root is missing)."""
        entries = self._call(self._ls, "")
        return sorted(posixpath.basename(e["name"].rstrip("/")) for e in entries
                      if e.get("type") == "directory")

    def list_files(self, rel: str) -> dict[str, int]:
        """Files directly under ``rel``: name -> size in bytes (empty if missing)."""
        entries = self._call(self._ls, rel)
        return {posixpath.basename(e["name"]): int(e.get("size") or 0) for e in entries
                if e.get("type") == "file"}

    def check_location(self, *, allow_new_run: bool) -> None:
        """Make sure the root exists before anything reads "no checkpoints" from it.

        A local root must be a folder; with ``allow_new_run`` a missing one whose
        parent exists counts as a new, empty run (the first save makes it). An S3 bucket must
        exist (prefixes are implicit: a prefix with nothing under it is an empty
        location). Few attempts (:meth:`_probe_fs`), no retries of ours: this runs at
        start-up, where a wrong endpoint should fail in seconds.

        Raises:
            CheckpointLocationError: the folder or bucket does not exist.
            StorageUnreachableError: the endpoint does not answer.
            CredentialsError: storage refused the credentials.
        """
        try:
            if self.is_local:
                self._check_local(allow_new_run)
            elif not self.is_memory:
                self._probe_fs().info(self.root.split("/", 1)[0])  # the bucket, or raises
        except ElasticError:
            raise
        except FileNotFoundError as exc:
            raise CheckpointLocationError(
                f"the bucket of checkpoint URL {self.url} does not exist",
                "Create the bucket, or fix the bucket name or endpoint_url.") from exc
        except Exception as exc:  # the seam: fsspec/botocore errors land here
            if is_transient(exc):
                raise StorageUnreachableError(
                    f"checkpoint storage for {self.url} cannot be reached ({_describe(exc)})",
                    "Check the endpoint_url storage option and the network.") from exc
            raise translate_error(exc, self.url) from exc

    def _probe_fs(self) -> Any:
        """The object store client with botocore's retries cut to two attempts (unless
        the options set them): a wrong endpoint fails in about a second, not fourteen."""
        options = dict(self.storage_options)
        config = dict(options.get("config_kwargs") or {})
        config.setdefault("retries", {"max_attempts": 2, "mode": "standard"})
        options.update(config_kwargs=config)
        return url_to_fs(self.url, **options)[0]

    def _check_local(self, allow_new_run: bool) -> None:
        if os.path.isdir(self.root):
            return
        if os.path.exists(self.root):
            raise CheckpointLocationError(f"checkpoint path {self.root} is a file, not a folder",
                                          "Point the checkpoint URL at a folder.")
        if allow_new_run and os.path.isdir(os.path.dirname(self.root)):
            return
        raise CheckpointLocationError(f"checkpoint folder {self.root} does not exist",
                                      f"Create it (mkdir -p {self.root}) or fix the path.")

    def last_change(self, rel: str) -> float | None:
        """When anything in folder ``rel`` last changed (epoch seconds), None if it is
        missing. A local folder's own time counts (a writer that only made it)."""
        entries = self._call(self._ls, rel)
        times = [_modified(e) for e in entries]
        if self.is_local:
            try:
                times.append(os.stat(self.path(rel)).st_mtime)
            except FileNotFoundError:
                pass
        return max(times) if times else None

    def exists(self, rel: str) -> bool:
        return bool(self._call(self.fs.exists, self.path(rel)))

    def read_bytes(self, rel: str, nonempty: bool = False) -> bytes:
        """The whole file. Raises FileNotFoundError (ours to interpret) if missing.

        ``nonempty``, when the caller knows the file is not empty, saves an object store
        the HEAD request s3fs makes to learn the size: the object is fetched with one
        GET of the range "from byte 0" (still all of it, so a size check stays exact;
        an empty object answers that range with InvalidRange, and is then read plainly).
        """
        if nonempty:
            try:
                return self._call(self.fs.cat_file, self.path(rel), start=0)
            except CheckpointError as exc:
                if not any(_error_code(err) == "InvalidRange" for err in _chain(exc)):
                    raise  # else it is empty after all (damage): read it plainly
        return self._call(self.fs.cat_file, self.path(rel))

    def write_bytes(self, rel: str, data: bytes) -> None:
        """Write a whole file atomically (see the module docstring)."""
        self._call(self._write_atomic, self.path(rel), data)

    def remove_tree(self, rel: str) -> None:
        """Remove a folder and everything in it; a missing folder is fine."""
        try:
            self._call(self.fs.rm, self.path(rel), recursive=True)
        except FileNotFoundError:
            pass

    def _ls(self, rel: str) -> list[dict[str, Any]]:
        path = self.path(rel)
        try:
            self.fs.invalidate_cache(path)
            return list(self.fs.ls(path, detail=True))
        except FileNotFoundError:
            return []

    def _write_atomic(self, path: str, data: bytes) -> None:
        if not self.is_local:
            self.fs.pipe_file(path, data)
            return
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        _fsync_dir(os.path.dirname(path))

    def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return call_with_retries(fn, *args, url=self.url, **kwargs)


def _modified(entry: dict[str, Any]) -> float:
    """An ls entry's modification time; unknown counts as now (never stale)."""
    for key in ("mtime", "LastModified", "created"):
        value = entry.get(key)
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, datetime.datetime):
            return value.timestamp()
    return time.time()


def quiet_drivers() -> None:
    """Keep the storage drivers' INFO chatter ("Found credentials in environment
    variables.") out of a command's output; their warnings still show."""
    for name in _DRIVER_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


def _fsync_dir(path: str) -> None:
    """Make a rename durable: fsync the folder that holds it."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def call_with_retries(fn: Callable[..., T], *args: Any, url: str, **kwargs: Any) -> T:
    """Call an idempotent storage operation, retrying transient errors.

    Raises:
        CredentialsError: storage refused or found no credentials.
        FileNotFoundError, IsADirectoryError, NotADirectoryError: the path is missing
            or not a file (:data:`NOT_A_FILE`; callers decide what that means).
        CheckpointError: any other storage failure, after the retries.
    """
    for attempt in range(RETRIES):
        try:
            return fn(*args, **kwargs)
        except NOT_A_FILE:
            raise
        except Exception as exc:  # the seam: everything from fsspec/botocore lands here
            error = translate_error(exc, url)
            if not is_transient(exc) or attempt == RETRIES - 1:
                raise error from exc
            delay = 0.1 * 2**attempt
            logger.warning("storage call on %s failed (%s); retrying in %.1fs",
                           url, type(exc).__name__, delay)
            time.sleep(delay)  # backoff between attempts, not synchronisation
    raise AssertionError("unreachable")


def translate_error(exc: BaseException, url: str) -> BaseException:
    """Map an fsspec/s3fs/botocore error to ours; our own errors pass through."""
    if isinstance(exc, ElasticError):
        return exc
    if _is_credentials_error(exc, is_s3=url.startswith(("s3://", "s3a://"))):
        return CredentialsError(
            f"storage at {url} refused the credentials or none were found "
            f"({type(exc).__name__})",
            "Set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE / "
            "~/.aws/credentials) for this bucket.",
        )
    if isinstance(exc, FileNotFoundError):
        return CheckpointError(f"{url}: a file or bucket is missing: {exc}")
    return CheckpointError(f"storage at {url} failed: {_describe(exc)}")


def _describe(exc: BaseException) -> str:
    """The S3 error code and message when the chain has one (s3fs turns them into
    bare OSErrors), else the exception's type and text."""
    for err in _chain(exc):
        response = getattr(err, "response", None)
        if isinstance(response, dict) and response.get("Error", {}).get("Code"):
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            return (f"{response['Error']['Code']} (HTTP {status}): "
                    f"{response['Error'].get('Message', '')}")
    return f"{type(exc).__name__}: {exc}"


def _error_code(exc: BaseException) -> str:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        return str(response.get("Error", {}).get("Code", ""))
    return ""


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in seen:
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


def _is_credentials_error(exc: BaseException, *, is_s3: bool) -> bool:
    for err in _chain(exc):
        name = type(err).__name__
        if name in ("NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError"):
            return True
        if _error_code(err) in _CREDENTIAL_CODES or (is_s3 and isinstance(err, PermissionError)):
            return True
    return False


def is_transient(exc: BaseException) -> bool:
    """Whether retrying ``exc`` may succeed (throttling, 5xx, dropped connection)."""
    for err in _chain(exc):
        name = type(err).__name__
        if name in ("EndpointConnectionError", "ConnectionClosedError", "ReadTimeoutError",
                    "ConnectTimeoutError", "ServerDisconnectedError", "ClientOSError"):
            return True
        if isinstance(err, (ConnectionError, TimeoutError)):
            return True
        if _error_code(err) in _TRANSIENT_CODES:
            return True
    return False
