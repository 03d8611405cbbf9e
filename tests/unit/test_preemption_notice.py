"""Preemption notices: which sources ``--preemption-notice`` names, what counts as a notice,
and one look at each kind of source (a local HTTP server stands in for a cloud's)."""

from __future__ import annotations

import http.server
import json
import threading
from pathlib import Path
from typing import Iterator

import pytest

from agents.policy import LeaveNotice
from agents.preemption import (
    NoticePoller,
    NoticeSource,
    check_at_start,
    look,
    notice_in_answer,
    parse_source,
)
from tests.fixtures.local_http import serving
from elastic_rt.errors import ConfigError, EndpointUnreachableError, UnknownURLSchemeError
from elastic_rt.etcd_server import free_port


def which(name: str) -> str | None:
    return f"/usr/bin/{name}" if name in ("curl", "check-preempted", "sh") else None


@pytest.mark.parametrize(("spec", "source"), [
    ("http://127.0.0.1:8080/preempted", NoticeSource("http", "http://127.0.0.1:8080/preempted")),
    ("HTTPS://metadata/x", NoticeSource("http", "HTTPS://metadata/x")),
    ("file:/run/preempted", NoticeSource("file", "/run/preempted")),
    ("file:///run/preempted", NoticeSource("file", "/run/preempted")),
    ("/run/preempted", NoticeSource("file", "/run/preempted")),
    ("cmd:curl -sf http://x | grep -q TRUE",
     NoticeSource("command", "curl -sf http://x | grep -q TRUE")),
    ("check-preempted --node a", NoticeSource("command", "check-preempted --node a")),
])
def test_the_flag_names_a_url_a_file_or_a_command(spec: str, source: NoticeSource) -> None:
    assert parse_source(spec, which=which) == source


@pytest.mark.parametrize(("spec", "error", "words"), [
    ("s3://bucket/preempted", UnknownURLSchemeError, "unknown scheme s3://"),
    ("", ConfigError, "empty"),
    ("cmd:", ConfigError, "names no command"),
    ("cmd:no-such-tool --x", ConfigError, "no-such-tool is not found"),
    ("file:", ConfigError, "names no file"),
    ("no-such-tool --flag", ConfigError, "neither a command on PATH nor a file path"),
])
def test_a_source_that_is_none_is_one_clear_line(spec: str, error: type[Exception],
                                                 words: str) -> None:
    with pytest.raises(error, match=words):
        parse_source(spec, which=which)


SRC = "http://127.0.0.1:1/x"


@pytest.mark.parametrize(("status", "body", "notice"), [
    (200, b'{"preempted": true}', LeaveNotice(SRC, '{"preempted": true}')),
    (200, b'{"Preempted": "TRUE"}', LeaveNotice(SRC, '{"Preempted": "TRUE"}')),
    (200, b'{"preempted": 1}', LeaveNotice(SRC, '{"preempted": 1}')),
    (200, b'{"preempted": false}', None),
    (200, b'{"preempted": "false"}', None),
    (200, b"{}", None),
    (200, b"TRUE\n", LeaveNotice(SRC, "TRUE")),  # GCP's instance/preempted
    (200, b"FALSE", None),
    (200, b"true", LeaveNotice(SRC, "true")),
    (200, b"", None),
    (200, b"[1, 2]", None),
    (404, b'{"preempted": true}', None),  # AWS answers 404 until there is an action
    (500, b"TRUE", None),
    (200, b'{"action": "terminate", "time": "2017-09-18T08:22:00Z"}',
     LeaveNotice(SRC, "terminate at 2017-09-18T08:22:00Z", deadline_ms=1505722920000)),
    (200, b'{"action": "stop"}', LeaveNotice(SRC, "stop")),
    (200, b'{"action": "none"}', None),
    (200, b"2015-01-05T18:02:00Z",  # AWS's spot/termination-time
     LeaveNotice(SRC, "termination at 2015-01-05T18:02:00Z", deadline_ms=1420480920000)),
    (200, json.dumps({"DocumentIncarnation": 3, "Events": [
        {"EventType": "Freeze", "NotBefore": ""},
        {"EventType": "Preempt", "NotBefore": "Mon, 19 Sep 2016 18:29:47 GMT"}]}).encode(),
     LeaveNotice(SRC, "Preempt at Mon, 19 Sep 2016 18:29:47 GMT", deadline_ms=1474309787000)),
    (200, b'{"DocumentIncarnation": 1, "Events": []}', None),  # Azure: nothing scheduled
])
def test_what_an_answer_says(status: int, body: bytes, notice: LeaveNotice | None) -> None:
    assert notice_in_answer(status, body, SRC) == notice


class _Metadata(http.server.BaseHTTPRequestHandler):
    """A cloud metadata endpoint: 404 until ``answer`` is set, then 200 with it."""

    answer: bytes | None = None

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        body = type(self).answer
        self.send_response(404 if body is None else 200)
        self.end_headers()
        if body is not None:
            self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture()
def metadata() -> Iterator[tuple[str, type[_Metadata]]]:
    handler = type("Handler", (_Metadata,), {"answer": None})
    with serving(handler) as url:
        yield f"{url}/preempted", handler


def test_a_url_is_a_notice_once_it_says_so(metadata: tuple[str, type[_Metadata]]) -> None:
    url, handler = metadata
    source = parse_source(url)
    check_at_start(source)  # a 404 is an answer
    assert look(source, timeout=2) is None
    handler.answer = b'{"preempted": true}'
    assert look(source, timeout=2) == LeaveNotice(url, '{"preempted": true}')


def test_a_url_that_does_not_answer_at_start_is_refused() -> None:
    source = parse_source(f"http://127.0.0.1:{free_port()}/preempted")
    with pytest.raises(EndpointUnreachableError, match="does not answer"):
        check_at_start(source)
    assert look(source, timeout=1) is None  # later, only no notice: it is polled again


def test_a_file_is_a_notice_once_it_exists(tmp_path: Path) -> None:
    path = tmp_path / "preempted"
    source = parse_source(f"file:{path}")
    check_at_start(source)
    assert look(source, timeout=1) is None
    path.write_text("maintenance at 12:00\nmore\n")
    assert look(source, timeout=1) == LeaveNotice(f"file:{path}", "maintenance at 12:00")
    with pytest.raises(ConfigError, match="does not exist"):
        check_at_start(parse_source(f"file:{tmp_path}/no/such/folder/flag"))


def test_a_command_is_a_notice_when_it_exits_0(tmp_path: Path) -> None:
    flag = tmp_path / "flag"
    source = parse_source(f"cmd:test -e {flag} && echo preempted by test")
    assert look(source, timeout=5) is None
    flag.touch()
    assert look(source, timeout=5) == LeaveNotice(source.describe(), "preempted by test")
    assert look(parse_source("cmd:sleep 5"), timeout=0.2) is None  # ran over: no notice


def test_the_poller_hands_over_one_notice_and_stops() -> None:
    answers = iter([None, None, LeaveNotice("x", "now")])
    seen: list[LeaveNotice] = []
    done = threading.Event()

    def take(notice: LeaveNotice) -> None:
        seen.append(notice)
        done.set()

    poller = NoticePoller(NoticeSource("http", "x"), take, every=0.01,
                          look_once=lambda _: next(answers))
    poller.start()
    assert done.wait(5)
    poller._thread.join(timeout=5)
    assert seen == [LeaveNotice("x", "now")] and not poller._thread.is_alive()


def test_a_look_that_raises_is_logged_and_tried_again() -> None:
    calls: Iterator[Exception | LeaveNotice] = iter([RuntimeError("boom"), LeaveNotice("x")])
    done = threading.Event()

    def flaky(_: NoticeSource) -> LeaveNotice | None:
        answer = next(calls)
        if isinstance(answer, Exception):
            raise answer
        return answer

    poller = NoticePoller(NoticeSource("file", "x"), lambda n: done.set(), every=0.01,
                          look_once=flaky)
    poller.start()
    assert done.wait(5)
    poller.stop()
