"""Preemption notices: where a node learns it is about to be taken away, and what counts as one.

Clouds warn a spot or preemptible VM before they take it (AWS two minutes, GCP and Azure
about thirty seconds) through a metadata endpoint; schedulers warn with SIGTERM and a grace
period (Kubernetes, Slurm). A node that heeds the warning leaves at its workers' next step
boundary: nothing is redone and the others pause for one re-form (DESIGN §4, README "Operate").
SIGTERM is the inbox's business (:mod:`agents.inbox`); this module is the other source,
``elastic-rt launch --preemption-notice SOURCE``, polled every ``poll`` seconds from a thread:

=====================================  ==================================================
``http://HOST[:PORT]/PATH`` (https)    a notice when a GET answers 200 with a body that
                                       says so (:func:`notice_in_answer`); 404, any other
                                       status and no answer are no notice
``file:PATH``, or a path               a notice once the file exists; its first line is
                                       the notice's detail
``cmd:COMMAND``, or a command on PATH  a notice when the command exits 0 (run by
                                       ``/bin/sh -c``; its first output line is the
                                       detail); it may run at most ``poll`` x 4 seconds
=====================================  ==================================================

A body says "preempted" when it is (JSON or text):

* a JSON object with a true ``preempted`` (``true``, ``"TRUE"``, ``1``): the form this
  project's tests serve, and the easiest for a sidecar to write;
* AWS's ``spot/instance-action`` answer ``{"action": "terminate", "time": "...Z"}``
  (``stop`` and ``hibernate`` too); the time becomes the notice's deadline;
* Azure's Scheduled Events document with an event of type ``Preempt`` or ``Terminate``
  (``NotBefore`` is the deadline);
* GCP's ``instance/preempted`` text ``TRUE``, or any of ``true``, ``1``, ``yes``,
  ``preempted``; or an ISO-8601 time alone (AWS's ``spot/termination-time``).

Anything else is no notice, so a metadata endpoint that answers "FALSE", ``{}`` or 404
until the day it matters can be polled from the start. The parsing is pure
(:func:`parse_source`, :func:`notice_in_answer`); the I/O (one GET, one ``stat``, one
command) is :func:`look` and :class:`NoticePoller`, the one seam to these endpoints.

Does not cover: cloud endpoints that need a token or a header (GCP wants
``Metadata-Flavor: Google``, AWS IMDSv2 a session token): point a ``cmd:`` source at
``curl`` with them, e.g. ``cmd:curl -sf -H 'Metadata-Flavor: Google'
http://metadata.google.internal/computeMetadata/v1/instance/preempted | grep -q TRUE``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass
from datetime import datetime, timezone
from email.utils import parsedate_to_datetime
from typing import Callable, Literal

from agents.policy import LeaveNotice
from elastic_rt.errors import ConfigError, EndpointUnreachableError, UnknownURLSchemeError

logger = logging.getLogger(__name__)

Kind = Literal["http", "file", "command"]
_TRUE_WORDS = frozenset({"true", "1", "yes", "preempted"})
_AWS_ACTIONS = frozenset({"terminate", "stop", "hibernate"})
_AZURE_EVENTS = frozenset({"preempt", "terminate"})
_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")
_DETAIL_CHARS = 200
"""The most of a body or an output line a notice carries (it goes into events)."""
_FIX = ("Pass --preemption-notice http://HOST:PORT/PATH, file:PATH or cmd:COMMAND "
        "(docs/preemption.md).")


@dataclass(frozen=True, slots=True)
class NoticeSource:
    """Where to look for a notice: ``kind`` and its ``target`` (URL, path or command)."""

    kind: Kind
    target: str

    def describe(self) -> str:
        """As the flag would say it: the URL, ``file:PATH`` or ``cmd:COMMAND``."""
        prefix = {"http": "", "file": "file:", "command": "cmd:"}[self.kind]
        return f"{prefix}{self.target}"


# pure: what the flag says, and what an answer says ------------------------------------
def parse_source(spec: str, *, which: Callable[[str], str | None] = shutil.which
                 ) -> NoticeSource:
    """The source ``--preemption-notice`` names.

    A bare value is a command when its first word is an executable (``which``), else a
    file path when it has no whitespace; ``file:`` and ``cmd:`` say which outright.

    Raises:
        UnknownURLSchemeError: a ``scheme://`` other than http, https or file.
        ConfigError: empty, a command that is not found, or a bare value that is neither.
    """
    text = spec.strip()
    if text.startswith("cmd:"):
        return _command(text[len("cmd:"):], spec, which)
    url = _URL.match(text)
    if url and url.group(1).lower() in ("http", "https"):
        return NoticeSource("http", text)
    if url and url.group(1).lower() == "file":
        return _file(text[url.end():], spec)
    if url:
        raise UnknownURLSchemeError(
            f"--preemption-notice {spec!r}: unknown scheme {url.group(1)}://", _FIX)
    if text.startswith("file:"):
        return _file(text[len("file:"):], spec)
    if not text:
        raise ConfigError("--preemption-notice is empty", _FIX)
    words = shlex.split(text) if text else []
    if words and which(words[0]) is not None:
        return NoticeSource("command", text)
    if len(words) == 1 and not any(c.isspace() for c in text):
        return NoticeSource("file", text)
    raise ConfigError(f"--preemption-notice {spec!r} is neither a command on PATH nor a "
                      "file path", _FIX)


def _file(path: str, spec: str) -> NoticeSource:
    if not path.strip():
        raise ConfigError(f"--preemption-notice {spec!r} names no file", _FIX)
    return NoticeSource("file", path.strip())


def _command(command: str, spec: str, which: Callable[[str], str | None]) -> NoticeSource:
    try:
        words = shlex.split(command)
    except ValueError as exc:
        raise ConfigError(f"--preemption-notice {spec!r}: {exc}", _FIX) from None
    if not words:
        raise ConfigError(f"--preemption-notice {spec!r} names no command", _FIX)
    if which(words[0]) is None:
        raise ConfigError(f"--preemption-notice {spec!r}: {words[0]} is not found or not "
                          "executable", "Check the name and PATH.")
    return NoticeSource("command", command.strip())


def notice_in_answer(status: int, body: bytes, source: str) -> LeaveNotice | None:
    """The notice an HTTP answer gives, if any (the accepted forms: the module's docstring)."""
    if status != 200:
        return None
    text = body.decode("utf-8", errors="replace").strip()
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if isinstance(data, dict):
        return _notice_in_object(data, text, source)
    if text.lower() in _TRUE_WORDS:  # JSON true and 1 too
        return LeaveNotice(source=source, detail=text[:_DETAIL_CHARS])
    deadline = _time_ms(text)
    if deadline is not None:
        return LeaveNotice(source=source, detail=f"termination at {text}", deadline_ms=deadline)
    return None


def _notice_in_object(data: dict[str, object], text: str, source: str) -> LeaveNotice | None:
    flags = {k.lower(): v for k, v in data.items()}
    if "preempted" in flags:
        value = flags["preempted"]
        truthy = value is True or (isinstance(value, (int, str)) and not isinstance(value, bool)
                                   and str(value).strip().lower() in _TRUE_WORDS)
        return LeaveNotice(source=source, detail=text[:_DETAIL_CHARS]) if truthy else None
    action = str(flags.get("action", "")).lower()
    if action in _AWS_ACTIONS:
        when = str(flags.get("time") or "")
        return LeaveNotice(source=source, detail=f"{action} at {when}" if when else action,
                           deadline_ms=_time_ms(when))
    events = flags.get("events")
    if isinstance(events, list):
        for event in events:
            if isinstance(event, dict) and str(event.get("EventType", "")).lower() in \
                    _AZURE_EVENTS:
                when = str(event.get("NotBefore", ""))
                return LeaveNotice(source=source, detail=f"{event['EventType']} at {when}",
                                   deadline_ms=_time_ms(when))
    return None


def _time_ms(text: str) -> int | None:
    """Milliseconds since the epoch of an ISO-8601 or RFC 1123 time; None if it is neither."""
    text = text.strip()
    if not text or len(text) > 64:
        return None
    try:
        when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        try:
            when = parsedate_to_datetime(text)
        except (TypeError, ValueError, IndexError):
            return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return int(when.timestamp() * 1000)


# the I/O: one look, and a thread that looks until it finds one ---------------------------
def look(source: NoticeSource, *, timeout: float) -> LeaveNotice | None:
    """Look once; no notice when the source does not answer (it is polled again)."""
    name = source.describe()
    if source.kind == "http":
        answer = _get(source.target, timeout)
        return None if answer is None else notice_in_answer(*answer, source=name)
    if source.kind == "file":
        if not os.path.exists(source.target):
            return None
        return LeaveNotice(source=name, detail=_first_line(_read_head(source.target)))
    try:
        done = subprocess.run(["/bin/sh", "-c", source.target], stdin=subprocess.DEVNULL,
                              capture_output=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        logger.debug("preemption notice command ran over %.1f s", timeout)
        return None
    if done.returncode != 0:
        return None
    return LeaveNotice(source=name, detail=_first_line(done.stdout))


def check_at_start(source: NoticeSource, *, timeout: float = 3.0) -> None:
    """Before the node starts: a URL must answer (any status; 404 is AWS's "no notice").

    Raises:
        EndpointUnreachableError: the URL does not answer.
        ConfigError: a file source's folder does not exist.
    """
    if source.kind == "http":
        try:
            with urllib.request.urlopen(source.target, timeout=timeout):
                pass
        except urllib.error.HTTPError:
            pass  # it answered
        except (urllib.error.URLError, OSError, ValueError) as exc:
            reason = getattr(exc, "reason", exc)
            raise EndpointUnreachableError(
                f"preemption notice URL {source.target} does not answer ({reason})",
                "Check --preemption-notice, or start the endpoint first.") from exc
    elif source.kind == "file":
        folder = os.path.dirname(os.path.abspath(source.target))
        if not os.path.isdir(folder):
            raise ConfigError(f"--preemption-notice file {source.target}: folder {folder} "
                              "does not exist", "Create it, or pass another path.")


def _get(url: str, timeout: float) -> tuple[int, bytes] | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return int(response.status), response.read(64 * 1024)
    except urllib.error.HTTPError as exc:
        return exc.code, b""
    except (urllib.error.URLError, OSError, ValueError) as exc:
        logger.debug("preemption notice URL %s: %s", url, exc)
        return None


def _read_head(path: str) -> bytes:
    try:
        with open(path, "rb") as handle:
            return handle.read(4096)
    except OSError:
        return b""


def _first_line(raw: bytes) -> str:
    lines = raw.decode("utf-8", errors="replace").strip().splitlines()
    return lines[0][:_DETAIL_CHARS] if lines else ""


class NoticePoller:
    """Looks at ``source`` every ``every`` seconds from a daemon thread until it finds a
    notice, hands it to ``on_notice`` once, and stops.

    Args:
        source: where to look.
        on_notice: called from the poller's thread (the agent's :meth:`Inbox.preempted`).
        every: seconds between two looks.
        look_once: one look (:func:`look`; tests pass their own).
    """

    def __init__(self, source: NoticeSource, on_notice: Callable[[LeaveNotice], None], *,
                 every: float,
                 look_once: Callable[[NoticeSource], LeaveNotice | None] | None = None) -> None:
        self.source, self._on_notice, self.every = source, on_notice, every
        self._look = look_once or (lambda s: look(s, timeout=max(2.0, 4 * every)))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="preemption-notice", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                notice = self._look(self.source)
            except Exception as exc:  # thread boundary: log, and look again next time
                logger.warning("looking for a preemption notice at %s failed: %s",
                               self.source.describe(), exc)
                notice = None
            if notice is not None:
                logger.warning("preemption notice from %s: %s", notice.source,
                               notice.detail or "(no detail)")
                self._on_notice(notice)
                return
            self._stop.wait(self.every)
