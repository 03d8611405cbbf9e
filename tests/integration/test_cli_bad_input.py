"""Bad input found by trying the CLI as a user would (issue 13): each gets one line,
exit code 2, and leaves nothing created or lost. The real CLI runs as a subprocess.
"""

from __future__ import annotations

import json
import os
import signal
import socket
from pathlib import Path
from typing import Iterator

import pytest

from elastic_rt.errors import ElasticError
from elastic_rt.etcd_server import EtcdServer, free_port, free_ports
from elastic_rt.harness import child_env, wait_until
from elastic_rt.rendezvous.etcd_kv import EtcdKV
from tests.fixtures.processes import ProcessTree
from tests.fixtures.tls import make_pki
from tests.integration.launch_helpers import TORCHRUN_SCRIPT
from tests.integration.test_cli_errors import _assert_one_line_error, _cli

pytestmark = pytest.mark.timeout(60)

EVENT = {"name": "node.joined", "source": "agent", "timestamp_ms": 1000, "node": "a"}


@pytest.mark.parametrize(
    ("content", "names"),
    [
        (json.dumps({"checkpoint": 3}) + "\n", ("line 1", "not an event")),
        (json.dumps([1, 2]) + "\n", ("line 1", "not an event")),
        (json.dumps(EVENT) + "\n" + json.dumps({**EVENT, "timestamp_ms": "soon"}) + "\n",
         ("line 2", "not an event")),
        (b"\x89PNG\r\n\x1a\n\x00\xff\xfe".decode("latin-1"), ("not text",)),
    ],
    ids=["object", "array", "bad-field", "binary"],
)
def test_timeline_on_a_file_that_is_not_events(content: str, names: tuple[str, ...],
                                               tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    events.write_bytes(content.encode("latin-1"))
    result = _cli("timeline", str(events), "-o", str(tmp_path / "run.png"), tmp=tmp_path)
    _assert_one_line_error(result, str(events), *names, "--events-file")
    assert not (tmp_path / "run.png").exists()


def test_timeline_into_a_missing_folder_creates_nothing(tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    events.write_text(json.dumps(EVENT) + "\n")
    missing = tmp_path / "no" / "such"
    result = _cli("timeline", str(events), "-o", str(missing / "run.png"), tmp=tmp_path)
    _assert_one_line_error(result, str(missing), "does not exist")
    assert not (tmp_path / "no").exists()


def test_a_fractional_lease_ttl_in_the_environment_does_not_break_status(tmp_path: Path) -> None:
    env = {"ELASTIC_RT_LEASE_TTL_SEC": "2.5"}
    port = free_port()
    result = _cli("status", "--run-id", "r", "--rdzv-endpoint", f"etcd://127.0.0.1:{port}",
                  tmp=tmp_path, env=env)  # fmt: skip
    _assert_one_line_error(result, f"127.0.0.1:{port}")  # unreachable, not a traceback


@pytest.mark.parametrize("flag", ["--etcd-cacert", "--etcd-cert"])
def test_a_garbage_pem_file_is_named_before_any_connection(flag: str, tmp_path: Path) -> None:
    pki = make_pki(tmp_path)
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n")
    files = {"--etcd-cacert": pki.ca, "--etcd-cert": pki.client_cert, "--etcd-key": pki.client_key}
    files[flag] = str(garbage)
    tls = [arg for name, path in files.items() for arg in (name, path)]
    result = _cli("status", "--run-id", "r", "--rdzv-endpoint", "etcds://127.0.0.1:1", *tls,
                  tmp=tmp_path)  # fmt: skip
    line = _assert_one_line_error(result, flag, str(garbage), "PEM")
    assert "127.0.0.1:1" not in line  # the file is the problem, not the server


def test_no_python_with_a_missing_program(tmp_path: Path) -> None:
    result = _cli("launch", "--no-python", "no-such-trainer-binary", "--lr", "1", tmp=tmp_path)
    _assert_one_line_error(result, "no-such-trainer-binary", "--no-python", "PATH")


BAD_RUN_IDS = ["my run", "läuft", "x" * 129, "a/b", ""]


@pytest.mark.parametrize("run_id", BAD_RUN_IDS, ids=["space", "unicode", "129", "slash", "empty"])
def test_run_ids_outside_the_rule_are_refused_by_launch_and_status(run_id: str,
                                                                   tmp_path: Path) -> None:
    # Unreachable endpoints: a run id accepted by mistake would fail on the connection instead.
    launch = _cli("launch", "--rdzv-endpoint", "etcd://127.0.0.1:1", "--run-id", run_id,
                  TORCHRUN_SCRIPT, tmp=tmp_path)  # fmt: skip
    status = _cli("status", "--rdzv-endpoint", "etcd://127.0.0.1:1", "--run-id", run_id,
                  tmp=tmp_path)  # fmt: skip
    for result in (launch, status):
        _assert_one_line_error(result, "run id", "letters, digits, '-' or '_'", "128")


def test_a_run_id_of_128_allowed_characters_is_accepted(tmp_path: Path) -> None:
    port = free_port()
    result = _cli("status", "--rdzv-endpoint", f"etcd://127.0.0.1:{port}", "--run-id",
                  "a-_9" * 32, tmp=tmp_path)  # fmt: skip
    _assert_one_line_error(result, f"127.0.0.1:{port}")  # got as far as connecting


@pytest.mark.etcd
def test_status_on_an_unknown_run_names_a_few_runs_not_all(etcd_server: EtcdServer,
                                                           tmp_path: Path) -> None:
    kv = EtcdKV(etcd_server.endpoint)
    names = [f"cap-{i:03d}" for i in range(40)]
    try:
        for name in names:
            kv.put(f"/elastic_rt/{name}/round", b"{}")
        result = _cli("status", "--rdzv-endpoint", f"etcd://{etcd_server.endpoint}",
                      "--run-id", "cap-nope", tmp=tmp_path)  # fmt: skip
    finally:
        for name in names:
            kv.delete_prefix(f"/elastic_rt/{name}/")
        kv.close()
    line = _assert_one_line_error(result, "cap-nope")
    assert sum(name in line for name in names) <= 8 and "..." in line
    assert len(line) < 300


@pytest.fixture()
def time_wait_port() -> Iterator[int]:
    """The port of an etcd that served a client and stopped: its connections sit in
    TIME_WAIT for a minute, which is the issue's case."""
    port = free_port()
    with EtcdServer(port=port) as server:
        kv = EtcdKV(server.endpoint)
        kv.put("/time-wait/key", b"1")
    kv.close()
    with socket.socket() as probe:  # the condition the test is about, checked
        with pytest.raises(OSError):
            probe.bind(("127.0.0.1", port))
    yield port


@pytest.mark.etcd
def test_etcd_accepts_a_port_in_time_wait(time_wait_port: int, process_tree: ProcessTree,
                                          tmp_path: Path) -> None:
    log = tmp_path / "etcd.log"
    cli = process_tree.elastic_rt("etcd", "--port", str(time_wait_port), env=child_env(),
                                  log=str(log))  # fmt: skip
    wanted = f"etcd://127.0.0.1:{time_wait_port}"
    wait_until(lambda: log.exists() and wanted in log.read_text() or cli.poll() is not None,
               30, "etcd to start or the CLI to exit")  # fmt: skip
    assert wanted in log.read_text(), log.read_text()
    os.kill(cli.pid, signal.SIGTERM)
    assert cli.wait(timeout=15) == 0


def test_a_node_started_before_its_etcd_waits_for_it_and_trains(
        process_tree: ProcessTree, tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "node.log"
    script = tmp_path / "hello.py"
    script.write_text("import os; print('rank', os.environ['RANK'], 'trained')\n")
    node = process_tree.elastic_rt(
        "launch", "--rdzv-endpoint", f"etcd://127.0.0.1:{port}", "--run-id", "late-etcd",
        "--etcd-wait", "40", str(script), env=child_env(), log=str(log))
    wait_until(lambda: "does not answer yet" in log.read_text(), 20, "the node waiting on etcd")
    with EtcdServer(port=port):
        assert node.wait(timeout=40) == 0, log.read_text()[-2000:]
    assert "rank 0 trained" in log.read_text()


def test_an_etcd_that_never_answers_is_one_line_after_the_wait(tmp_path: Path) -> None:
    port = free_port()
    result = _cli("launch", "--rdzv-endpoint", f"etcd://127.0.0.1:{port}", "--run-id", "r",
                  "--rdzv-conf", "read_timeout=1", TORCHRUN_SCRIPT, tmp=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    error = result.stderr.splitlines()[-1]
    for name in (f"cannot reach etcd at 127.0.0.1:{port}", "--etcd-wait 1 s", "--rdzv-endpoint"):
        assert name in error, error


def test_ports_picked_together_are_all_different() -> None:
    ports = free_ports(16)
    assert len(set(ports)) == 16


@pytest.mark.etcd
def test_an_etcd_that_exits_at_start_is_reported_with_its_code_and_output() -> None:
    """Its peer port taken (as when two members were once given the same one): etcd
    exits, and the error says so rather than failing on its own cleanup."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = EtcdServer(peer_port=taken.getsockname()[1])
        with pytest.raises(ElasticError, match=r"etcd exited with code \d+: .*already in use"):
            server.start()
    assert server.pid is None  # stopped, its data dir removed
