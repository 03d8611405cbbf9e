"""The etcd-v3 torchrun plugin's pieces against a real etcd.

torch's own ``RendezvousBackendTestMixin`` (vendored) holds the backend contract, and
torch's own integration test of its dynamic rendezvous (vendored) runs its handlers over
this backend; the rest covers what torch's handler needs from our Store, reuse of a run
id, the endpoint forms, and that loading the entry point first causes no circular import.
"""

from __future__ import annotations

import http.server
import socket
import subprocess
import sys
import threading
import unittest
from datetime import timedelta
from typing import Iterator

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

from elastic_rt.etcd_server import EtcdServer
from elastic_rt.rendezvous.etcd_kv import EtcdKV
from elastic_rt.torchrun.backend import EtcdV3RendezvousBackend
from elastic_rt.torchrun.endpoint import EndpointError, parse_target
from elastic_rt.torchrun.plugin import create_handler, handler_creator
from elastic_rt.torchrun.store import EtcdStore
from tests.contract import torch_dynamic_rendezvous_integration as torch_integration
from tests.contract.torch_rendezvous_backend_mixin import RendezvousBackendTestMixin
from tests.fixtures.tls import Pki, make_pki

pytestmark = pytest.mark.etcd


class EtcdV3BackendContractTest(RendezvousBackendTestMixin, unittest.TestCase):
    """torch's assertions, each on a fresh run id's state key."""

    @pytest.fixture(autouse=True)
    def _backend_on_etcd(self, etcd_kv: EtcdKV, run_id: str) -> None:
        self._kv = etcd_kv
        self._prefix = f"/elastic_rt/torchrun/{run_id}/g0"
        self._backend = EtcdV3RendezvousBackend(etcd_kv, self._prefix)

    def _corrupt_state(self) -> None:
        self._kv.put(self._prefix + "/state", b"#not base64#")


def _threads(target: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.endswith(target)]


class EtcdV3DynamicRendezvousIntegrationTest(torch_integration.IntegrationTest):
    """torch's handlers joining, queueing as redundant and taking over, over etcd."""

    @pytest.fixture(autouse=True)
    def _etcd(self, etcd_kv: EtcdKV, run_id: str) -> Iterator[None]:
        self._kv, self._prefix = etcd_kv, f"/elastic_rt/torchrun/{run_id}/g0"
        yield
        # torch's test waits for each state (_wait_for) without asserting it came: here a
        # wait still polling once its deadline passed fails the test.
        for waiting in _threads("(_wait_while)"):
            waiting.join(15)
            assert not waiting.is_alive(), "a state torch's test waited for never came"
        # A handler in the redundancy list polls until the state changes (torch checks no
        # deadline there): with the state gone it finds its join deadline passed and ends
        # with the RendezvousTimeoutError the test ignores, before the client is closed.
        self._kv.delete_prefix(self._prefix)
        for thread in _threads("(_ignore_exception)"):
            thread.join(10)

    def _make_backend(self) -> EtcdV3RendezvousBackend:
        return EtcdV3RendezvousBackend(self._kv, self._prefix)


def test_token_is_the_mod_revision(etcd_kv: EtcdKV, run_id: str) -> None:
    backend = EtcdV3RendezvousBackend(etcd_kv, f"/elastic_rt/torchrun/{run_id}/g0")
    result = backend.set_state(b"x")
    assert result is not None
    kept = etcd_kv.get(f"/elastic_rt/torchrun/{run_id}/g0/state")
    assert kept is not None and result[1] == kept.mod_revision


def test_store_semantics_through_a_prefix_store(etcd_kv: EtcdKV, run_id: str) -> None:
    raw = EtcdStore(etcd_kv, f"/elastic_rt/torchrun/{run_id}/g0", timedelta(seconds=2))
    store = dist.PrefixStore("torch.rendezvous.r.0", raw)
    store.set("a", "1")
    assert store.get("a") == b"1"
    assert store.add("n", 2) == 2 and store.add("n", 3) == 5
    assert store.check(["a"]) and not store.check(["missing"])
    store.multi_set(["k1", "k2"], [b"v1", b"v2"])  # type: ignore[attr-defined]
    assert store.multi_get(["k1", "k2"]) == [b"v1", b"v2"]
    assert store.compare_set("c", "", "first") == b"first"
    assert store.compare_set("c", "wrong", "second") == b"first"
    assert store.compare_set("c", "first", "second") == b"second"
    # c10d's Python-store trampoline does not forward delete_key or num_keys (torch
    # 2.13: "pure virtual"); torchrun uses neither, and they work called directly.
    assert raw.delete_key("torch.rendezvous.r.0/a") and not raw.check(["torch.rendezvous.r.0/a"])
    with pytest.raises(dist.DistStoreError):
        store.wait(["never"], timedelta(milliseconds=200))


def _params(endpoint: str, run_id: str, **conf: str) -> RendezvousParameters:
    return RendezvousParameters(
        backend="etcd-v3", endpoint=endpoint, run_id=run_id, min_nodes=1, max_nodes=1,
        join_timeout="10", last_call_timeout="1", close_timeout="2", **conf)


def test_a_run_id_is_reusable_after_the_job_closed(etcd_server: EtcdServer,
                                                   run_id: str) -> None:
    first = create_handler(_params(etcd_server.endpoint, run_id))
    info = first.next_rendezvous()
    assert (info.rank, info.world_size) == (0, 1)
    first.set_closed()
    assert first.is_closed()
    first.shutdown()

    second = create_handler(_params(etcd_server.endpoint, run_id))
    assert not second.is_closed()
    info = second.next_rendezvous()
    assert (info.rank, info.world_size) == (0, 1)
    second.shutdown()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_unreachable_etcd_is_one_line_naming_it(run_id: str) -> None:
    endpoint = f"127.0.0.1:{_free_port()}"
    with pytest.raises(RendezvousConnectionError) as caught:
        create_handler(_params(endpoint, run_id, etcd_timeout="2"))
    message = str(caught.value)
    assert endpoint in message and "\n" not in message
    assert "elastic-rt etcd" in message
    assert caught.value.__cause__ is None and caught.value.__suppress_context__


def test_a_non_etcd_scheme_is_refused() -> None:
    with pytest.raises(RendezvousConnectionError, match="tcp:// is not etcd's"):
        create_handler(_params("tcp://127.0.0.1:29400", "r"))


@pytest.mark.parametrize("endpoint, expected, tls", [
    ("127.0.0.1:2379", "127.0.0.1:2379", False),
    ("etcd-host", "etcd-host:2379", False),
    ("http://h:1", "h:1", False),
    ("https://h:1/", "h:1", True),
    ("h1:1,h2:2, h3:3", "h1:1,h2:2,h3:3", False),
    ("https://h1:1,https://h2:2", "h1:1,h2:2", True),
])
def test_endpoint_forms(endpoint: str, expected: str, tls: bool) -> None:
    target = parse_target(endpoint, {}, env={})
    assert target.endpoint == expected and target.auth.is_tls == tls


def test_rdzv_conf_maps_onto_etcd_auth() -> None:
    conf = {"cacert": "/ca.pem", "cert": "/c.pem", "key": "/k.pem", "user": "u",
            "password": "s3cret"}
    auth = parse_target("h:1", conf, env={}).auth
    assert (auth.cacert, auth.cert, auth.key, auth.user, auth.password) == (
        "/ca.pem", "/c.pem", "/k.pem", "u", "s3cret")
    assert auth.is_tls and "s3cret" not in repr(auth)


def test_auth_falls_back_to_elastic_rt_env() -> None:
    env = {"ELASTIC_RT_ETCD_USER": "u", "ELASTIC_RT_ETCD_PASSWORD": "s3cret"}
    auth = parse_target("h:1", {"user": "other"}, env=env).auth
    assert (auth.user, auth.password, auth.is_tls) == ("other", "s3cret", False)


@pytest.mark.parametrize("endpoint", ["", "h:notaport", "h:0", "http://a:1,https://b:2"])
def test_bad_endpoints(endpoint: str) -> None:
    with pytest.raises(EndpointError):
        parse_target(endpoint, {}, env={})


def test_entry_point_registers_the_creator() -> None:
    assert handler_creator() is create_handler
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    assert rendezvous_handler_registry._registry["etcd-v3"] is create_handler


def test_plugin_first_is_no_circular_import() -> None:
    code = ("import elastic_rt.torchrun.plugin\n"
            "import torch.distributed.elastic.rendezvous.registry\n"
            "from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as r\n"
            "assert 'etcd-v3' in r._registry, r._registry\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Exception while registering" not in done.stderr


def test_a_port_that_is_not_etcd_is_one_line(run_id: str) -> None:
    server = http.server.HTTPServer(("127.0.0.1", 0), _Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = f"127.0.0.1:{server.server_port}"
    try:
        with pytest.raises(RendezvousConnectionError) as caught:
            create_handler(_params(endpoint, run_id, etcd_timeout="3"))
    finally:
        server.shutdown()
        server.server_close()
    assert endpoint in str(caught.value) and "\n" not in str(caught.value)


class _Quiet(http.server.BaseHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - base's name
        return


@pytest.fixture(scope="module")
def tls_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EtcdServer, Pki]]:
    pki = make_pki(tmp_path_factory.mktemp("pki"))
    server = EtcdServer(
        scheme="https",
        extra_args=["--cert-file", pki.server_cert, "--key-file", pki.server_key,
                    "--client-cert-auth", "--trusted-ca-file", pki.ca],
        health_ca=pki.ca, health_cert=(pki.client_cert, pki.client_key))
    with server:
        yield server, pki


def test_mutual_tls_through_rdzv_conf(tls_etcd: tuple[EtcdServer, Pki], run_id: str) -> None:
    server, pki = tls_etcd
    endpoint = f"https://{server.endpoint}"
    handler = create_handler(_params(endpoint, run_id, cacert=pki.ca, cert=pki.client_cert,
                                     key=pki.client_key))
    info = handler.next_rendezvous()
    assert (info.rank, info.world_size) == (0, 1)
    handler.shutdown()
    with pytest.raises(RendezvousConnectionError, match="client certificate"):
        create_handler(_params(endpoint, run_id, cacert=pki.ca))
