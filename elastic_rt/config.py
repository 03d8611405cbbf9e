"""Configuration values and the names of every environment variable we read or write.

Precedence, written once: command-line flags > environment variables > defaults.
The agent passes torchrun's variables to workers (so unmodified torchrun scripts
run) plus ``ELASTIC_RT_*`` extras that the library reads with :func:`WorkerEnv.from_env`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Mapping

from elastic_rt.errors import ConfigError

# torchrun's variables, set for every worker.
RANK_ENV = "RANK"
LOCAL_RANK_ENV = "LOCAL_RANK"
WORLD_SIZE_ENV = "WORLD_SIZE"
LOCAL_WORLD_SIZE_ENV = "LOCAL_WORLD_SIZE"
GROUP_RANK_ENV = "GROUP_RANK"
GROUP_WORLD_SIZE_ENV = "GROUP_WORLD_SIZE"
ROLE_RANK_ENV = "ROLE_RANK"
ROLE_WORLD_SIZE_ENV = "ROLE_WORLD_SIZE"
ROLE_NAME_ENV = "ROLE_NAME"
MASTER_ADDR_ENV = "MASTER_ADDR"
MASTER_PORT_ENV = "MASTER_PORT"
RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"
MAX_RESTARTS_ENV = "TORCHELASTIC_MAX_RESTARTS"
RUN_ID_ENV = "TORCHELASTIC_RUN_ID"

# Our extras.
ENDPOINT_ENV = "ELASTIC_RT_ENDPOINT"
NODE_ID_ENV = "ELASTIC_RT_NODE_ID"
ROUND_ENV = "ELASTIC_RT_ROUND"
TOKEN_ENV = "ELASTIC_RT_TOKEN"
EVENTS_FILE_ENV = "ELASTIC_RT_EVENTS_FILE"
LEASE_TTL_ENV = "ELASTIC_RT_LEASE_TTL_SEC"
ETCD_BIN_ENV = "ELASTIC_RT_ETCD_BIN"
ETCD_CACERT_ENV = "ELASTIC_RT_ETCD_CACERT"
ETCD_CERT_ENV = "ELASTIC_RT_ETCD_CERT"
ETCD_KEY_ENV = "ELASTIC_RT_ETCD_KEY"
ETCD_USER_ENV = "ELASTIC_RT_ETCD_USER"
ETCD_PASSWORD_ENV = "ELASTIC_RT_ETCD_PASSWORD"
ETCD_TLS_ENV = "ELASTIC_RT_ETCD_TLS"


def parse_nnodes(text: str) -> tuple[int, int]:
    """Parse torchrun's ``--nnodes`` (``N`` or ``MIN:MAX``).

    Raises:
        ConfigError: the text is not ``N`` or ``MIN:MAX`` with 1 <= MIN <= MAX.
    """
    parts = text.split(":")
    try:
        values = [int(p) for p in parts]
    except ValueError:
        values = []
    if len(values) == 1:
        values = values * 2
    if len(values) != 2 or not 1 <= values[0] <= values[1]:
        raise ConfigError(
            f"--nnodes {text!r} is not N or MIN:MAX with 1 <= MIN <= MAX",
            "Use for example --nnodes 2 or --nnodes 2:4.",
        )
    return values[0], values[1]


@dataclass(frozen=True, kw_only=True, slots=True)
class EtcdAuth:
    """How to reach a secured etcd (see docs/etcd-security.md).

    Only file paths and the user name are kept in the clear: the password stays out of
    ``repr`` (so out of logs and events), and key files are read by the gRPC client alone.
    """

    cacert: str | None = None
    """CA bundle that signed etcd's server certificate (enables TLS)."""
    cert: str | None = None
    """Client certificate for mutual TLS (enables TLS)."""
    key: str | None = None
    """Client private key for mutual TLS."""
    user: str | None = None
    """etcd user name for password auth."""
    password: str | None = field(default=None, repr=False)
    """etcd password; kept out of repr."""
    tls: bool = False
    """TLS even without a CA file (``etcds://``): etcd's certificate is checked against
    the system's CA bundle."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "EtcdAuth":
        return cls(
            cacert=env.get(ETCD_CACERT_ENV) or None,
            cert=env.get(ETCD_CERT_ENV) or None,
            key=env.get(ETCD_KEY_ENV) or None,
            user=env.get(ETCD_USER_ENV) or None,
            password=env.get(ETCD_PASSWORD_ENV) or None,
            tls=env.get(ETCD_TLS_ENV) == "1",
        )

    def to_env(self) -> dict[str, str]:
        pairs = {
            ETCD_CACERT_ENV: self.cacert,
            ETCD_CERT_ENV: self.cert,
            ETCD_KEY_ENV: self.key,
            ETCD_USER_ENV: self.user,
            ETCD_PASSWORD_ENV: self.password,
            ETCD_TLS_ENV: "1" if self.tls else None,
        }
        return {k: v for k, v in pairs.items() if v}

    @property
    def is_tls(self) -> bool:
        return self.tls or self.cacert is not None or self.cert is not None


_RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")


def check_run_id(run_id: str) -> None:
    """A run id names etcd keys and files: ASCII letters, digits, '-', '_', at most 128.

    Raises:
        ConfigError: anything else (spaces, '/', unicode, empty, too long).
    """
    if not _RUN_ID.fullmatch(run_id):
        shown = repr(run_id) if len(run_id) <= 40 else f"{run_id[:40]!r}... ({len(run_id)} chars)"
        raise ConfigError(
            f"run id {shown} is not 1-128 letters, digits, '-' or '_'",
            "Pass --run-id with ASCII letters, digits, '-' or '_', at most 128 of them.",
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class RendezvousConfig:
    """What every node of one job agrees on."""

    run_id: str
    """Names the job; keys live under ``/elastic_rt/<run_id>/``."""
    endpoint: str
    """etcd address as ``host:port`` (the ``etcd://`` scheme stripped)."""
    min_nodes: int = 1
    max_nodes: int = 1
    lease_ttl: timedelta = timedelta(seconds=5)
    """A node whose lease is not renewed for this long is gone."""
    last_call: timedelta = timedelta(seconds=1)
    """Once ``min_nodes`` are there, wait this long for more before forming a round."""
    join_timeout: timedelta = timedelta(seconds=600)
    """Give up when ``min_nodes`` have not joined within this time."""
    auth: EtcdAuth = field(default_factory=EtcdAuth)

    def __post_init__(self) -> None:
        check_run_id(self.run_id)
        if not 1 <= self.min_nodes <= self.max_nodes:
            raise ConfigError(
                f"nnodes {self.min_nodes}:{self.max_nodes} needs 1 <= MIN <= MAX",
                "Use for example --nnodes 2:4.",
            )
        if self.lease_ttl < timedelta(seconds=1):
            raise ConfigError(
                f"lease TTL {self.lease_ttl.total_seconds()}s is under 1 s",
                f"Set {LEASE_TTL_ENV} to 1 or more.",
            )

    @property
    def prefix(self) -> str:
        return f"/elastic_rt/{self.run_id}/"


AGENT_DIR_ENV = "ELASTIC_RT_AGENT_DIR"
COLLECTIVE_TIMEOUT_ENV = "ELASTIC_RT_COLLECTIVE_TIMEOUT_SEC"


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerEnv:
    """What the agent tells a worker through its environment (see agents/worker_env.py)."""

    rank: int
    local_rank: int
    world_size: int
    master_addr: str
    master_port: int
    node_id: str = ""
    run_id: str = ""
    round: int = 0
    token: int = 0
    endpoint: str = ""
    """etcd ``host:port``; empty when the script runs under plain torchrun."""
    agent_dir: str = ""
    """Where the worker leaves its in-process acknowledgements for the agent."""
    events_file: str | None = None
    lease_ttl: timedelta = timedelta(seconds=5)
    auth: EtcdAuth = field(default_factory=EtcdAuth)

    @property
    def is_elastic(self) -> bool:
        """True under ``elastic-rt launch``; False under plain torchrun or none."""
        return bool(self.endpoint and self.node_id)

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "WorkerEnv":
        """Read a worker's environment; single-process defaults where unset.

        Raises:
            ConfigError: a variable holds something that is not a number.
        """
        try:
            return cls(
                rank=int(env.get(RANK_ENV, 0)),
                local_rank=int(env.get(LOCAL_RANK_ENV, 0)),
                world_size=int(env.get(WORLD_SIZE_ENV, 1)),
                master_addr=env.get(MASTER_ADDR_ENV, "127.0.0.1"),
                master_port=int(env.get(MASTER_PORT_ENV, 0)),
                node_id=env.get(NODE_ID_ENV, ""),
                run_id=env.get(RUN_ID_ENV, ""),
                round=int(env.get(ROUND_ENV, 0)),
                token=int(env.get(TOKEN_ENV, 0)),
                endpoint=env.get(ENDPOINT_ENV, ""),
                agent_dir=env.get(AGENT_DIR_ENV, ""),
                events_file=env.get(EVENTS_FILE_ENV) or None,
                lease_ttl=timedelta(seconds=float(env.get(LEASE_TTL_ENV, 5))),
                auth=EtcdAuth.from_env(env),
            )
        except ValueError as exc:
            raise ConfigError(
                f"a worker environment variable is not a number ({exc})",
                "Start workers with elastic-rt launch or torchrun.",
            ) from exc

    def to_env(self) -> dict[str, str]:
        env = {
            RANK_ENV: str(self.rank),
            LOCAL_RANK_ENV: str(self.local_rank),
            WORLD_SIZE_ENV: str(self.world_size),
            MASTER_ADDR_ENV: self.master_addr,
            MASTER_PORT_ENV: str(self.master_port),
            NODE_ID_ENV: self.node_id,
            RUN_ID_ENV: self.run_id,
            ROUND_ENV: str(self.round),
            TOKEN_ENV: str(self.token),
            ENDPOINT_ENV: self.endpoint,
            AGENT_DIR_ENV: self.agent_dir,
            LEASE_TTL_ENV: str(self.lease_ttl.total_seconds()),
            **self.auth.to_env(),
        }
        if self.events_file:
            env[EVENTS_FILE_ENV] = self.events_file
        return env
