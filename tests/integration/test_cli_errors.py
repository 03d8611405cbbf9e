"""The real CLI, run as a subprocess, on bad input and as a foreground etcd.

Bad input must give exactly one stderr line, ``elastic-rt: error: <problem>. <fix>``,
exit code 2 and no traceback: a user reads one sentence, not a stack. Every case
fails before any etcd or worker starts, so each takes about a second.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import psutil
import pytest

from elastic_rt.etcd_server import free_port
from elastic_rt.harness import child_env, wait_until
from elastic_rt.rendezvous.etcd_kv import EtcdKV
from tests.fixtures.processes import ProcessTree
from tests.integration.launch_helpers import TORCHRUN_SCRIPT

pytestmark = pytest.mark.timeout(60)


@pytest.fixture()
def busy_port() -> Iterator[int]:
    """A port something listens on for the whole test."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        yield int(sock.getsockname()[1])


def _cli(*args: str, tmp: Path, env: dict[str, str] | None = None
         ) -> subprocess.CompletedProcess[str]:
    # cwd is a scratch dir, so a relative path in a case cannot hit a repo file.
    return subprocess.run(
        [sys.executable, "-m", "elastic_rt.cli", *args],
        capture_output=True, text=True, timeout=30, env={**child_env(), **(env or {})}, cwd=tmp,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip


def _assert_one_line_error(result: subprocess.CompletedProcess[str], *names: str) -> str:
    lines = result.stderr.splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    line = lines[0]
    assert line.startswith("elastic-rt: error: "), line
    problem, sep, fix = line[len("elastic-rt: error: "):].partition(". ")
    assert sep and problem and fix, f"no problem-then-fix sentence: {line}"
    for name in names:
        assert name in line, f"{name!r} not named in: {line}"
    return line


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (("--nnodes", "3:2"), ("--nnodes", "3:2", "MIN:MAX")),
        (("--nnodes", "x"), ("--nnodes", "'x'", "--nnodes 2")),
        (("--nnodes", "0"), ("--nnodes", "'0'")),
        (("--rdzv-endpoint", "zk://127.0.0.1:2181"), ("zk", "etcd://host:port")),
        (("--nproc-per-node", "0"), ("--nproc-per-node 0", "Pass 1 or more")),
        (("--rdzv-endpoint", "etcd://127.0.0.1:x"), ("127.0.0.1:x", "etcd://host:port")),
        (("--hang-factor", "-1"), ("--hang-factor -1", "or 0 to turn")),
        (("--preemption-notice", "s3://bucket/preempted"),
         ("--preemption-notice", "unknown scheme s3://", "file:PATH or cmd:COMMAND")),
        (("--preemption-notice", f"http://127.0.0.1:{free_port()}/preempted"),
         ("preemption notice URL", "does not answer", "--preemption-notice")),
        (("--preemption-notice", "cmd:no-such-preemption-tool"),
         ("no-such-preemption-tool is not found", "PATH")),
    ],
    ids=["nnodes-reversed", "nnodes-text", "nnodes-zero", "scheme", "nproc-zero", "endpoint-port",
         "hang-factor", "notice-scheme", "notice-url-silent", "notice-command"],
)
def test_bad_launch_flag_is_one_line_with_exit_2(args: tuple[str, ...], names: tuple[str, ...],
                                                 tmp_path: Path) -> None:
    _assert_one_line_error(_cli("launch", *args, TORCHRUN_SCRIPT, tmp=tmp_path), *names)


@pytest.mark.parametrize("args", [("launch", "--bogus", "x"), ("checkpoint",), ("frobnicate",)],
                         ids=["unknown-flag", "missing-action", "unknown-command"])
def test_usage_mistakes_are_one_line_naming_the_help(args: tuple[str, ...],
                                                     tmp_path: Path) -> None:
    result = _cli(*args, tmp=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith("elastic-rt") and "error:" in line and "--help)" in line, line


@pytest.mark.parametrize(
    ("env", "names"),
    [
        ({"ELASTIC_RT_LEASE_TTL_SEC": "soon"}, ("ELASTIC_RT_LEASE_TTL_SEC", "'soon'")),
        ({"ELASTIC_RT_LEASE_TTL_SEC": "-1"}, ("ELASTIC_RT_LEASE_TTL_SEC", "'-1'")),
        ({"ELASTIC_RT_LEASE_TTL_SEC": "0.5"}, ("lease TTL", "ELASTIC_RT_LEASE_TTL_SEC")),
        ({"ELASTIC_RT_LOG_LEVEL": "LOUD"}, ("ELASTIC_RT_LOG_LEVEL", "'LOUD'", "INFO")),
        ({"ELASTIC_RT_HANG_FACTOR": "often"}, ("ELASTIC_RT_HANG_FACTOR", "'often'")),
        ({"ELASTIC_RT_PREEMPTION_POLL_SEC": "0"}, ("ELASTIC_RT_PREEMPTION_POLL_SEC", "0.05")),
    ],
    ids=["ttl-text", "ttl-negative", "ttl-under-1s", "log-level", "hang-factor",
         "preemption-poll"],
)
def test_bad_environment_value_is_one_line_with_exit_2(env: dict[str, str],
                                                       names: tuple[str, ...],
                                                       tmp_path: Path) -> None:
    # No --rdzv-endpoint: the value must be refused before a private etcd starts.
    _assert_one_line_error(_cli("launch", TORCHRUN_SCRIPT, tmp=tmp_path, env=env), *names)


@pytest.mark.parametrize("flag", ["--lease-ttl", "--last-call", "--monitor-interval"])
def test_bad_duration_flag_is_one_usage_line(flag: str, tmp_path: Path) -> None:
    result = _cli("launch", flag, "soon", TORCHRUN_SCRIPT, tmp=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    (line,) = result.stderr.splitlines()
    assert flag in line and "'soon' is not a number of seconds" in line, line


def test_missing_script(tmp_path: Path) -> None:
    missing = str(tmp_path / "no_such_train.py")
    _assert_one_line_error(_cli("launch", missing, "--steps", "3", tmp=tmp_path), missing, "path")


def test_unreachable_endpoint(tmp_path: Path) -> None:
    port = free_port()
    # --etcd-wait 0: one try (the retries are test_cli_bad_input's)
    result = _cli("launch", "--rdzv-endpoint", f"etcd://127.0.0.1:{port}", "--run-id", "unreach",
                  "--etcd-wait", "0", TORCHRUN_SCRIPT, tmp=tmp_path)
    _assert_one_line_error(result, f"127.0.0.1:{port}", "elastic-rt etcd", "--rdzv-endpoint")


def test_etcd_cert_without_key(tmp_path: Path) -> None:
    cert = tmp_path / "client.pem"
    cert.write_text("not checked: the pairing is refused first\n")
    result = _cli("launch", "--rdzv-endpoint", "etcd://127.0.0.1:1", "--etcd-cert", str(cert),
                  TORCHRUN_SCRIPT, tmp=tmp_path)
    _assert_one_line_error(result, "--etcd-cert", "--etcd-key")


def test_etcd_port_in_use(busy_port: int, tmp_path: Path) -> None:
    _assert_one_line_error(_cli("etcd", "--port", str(busy_port), tmp=tmp_path),
                           str(busy_port), "--port")


def test_launch_etcd_port_in_use(busy_port: int, tmp_path: Path) -> None:
    result = _cli("launch", "--etcd-port", str(busy_port), TORCHRUN_SCRIPT, tmp=tmp_path)
    _assert_one_line_error(result, f"--etcd-port {busy_port}", "another --etcd-port")


@pytest.mark.etcd
def test_etcd_command_serves_and_cleans_up_on_sigterm(process_tree: ProcessTree,
                                                      tmp_path: Path) -> None:
    log = tmp_path / "etcd.log"
    cli = process_tree.elastic_rt("etcd", env=child_env(), log=str(log))

    def endpoint() -> str | None:
        for line in log.read_text().splitlines() if log.exists() else []:
            if line.startswith("etcd://127.0.0.1:"):
                return line[len("etcd://"):]
        return None

    address = str(wait_until(endpoint, 30, "the etcd:// line"))
    (etcd,) = psutil.Process(cli.pid).children(recursive=True)
    cmdline = etcd.cmdline()
    data_dir = cmdline[cmdline.index("--data-dir") + 1]
    assert os.path.isdir(data_dir)

    kv = EtcdKV(address)
    try:
        kv.put("/cli-test/key", b"served")
        item = kv.get("/cli-test/key")
        assert item is not None and item.value == b"served"
    finally:
        kv.close()

    os.kill(cli.pid, signal.SIGTERM)
    assert cli.wait(timeout=15) == 0
    wait_until(lambda: not _alive(etcd), 5, "etcd to exit")
    assert not os.path.exists(data_dir)


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
