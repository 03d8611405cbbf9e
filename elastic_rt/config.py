"""Configuration values and the names of every environment variable we read or write.

Precedence, written once: command-line flags > environment variables > defaults.
The agent passes torchrun's variables to workers (so unmodified torchrun scripts
run) plus ``ELASTIC_RT_*`` extras that the library reads with :func:`WorkerEnv.from_env`.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Mapping, TypeVar

from elastic_rt.errors import ConfigError

_T = TypeVar("_T")

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
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"

# Our extras.
ENDPOINT_ENV = "ELASTIC_RT_ENDPOINT"
NODE_ID_ENV = "ELASTIC_RT_NODE_ID"
NODE_HOST_ENV = "ELASTIC_RT_NODE_HOST"
STREAM_OVER_TCP_ENV = "ELASTIC_RT_STREAM_OVER_TCP"
"""``0``: a join's state stream goes through the process group's backend, not over TCP
connections of its own (``worker/trainers/tcp_stream.py``; e.g. where only known ports
are open between nodes)."""
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
AGENT_DIR_ENV = "ELASTIC_RT_AGENT_DIR"
COLLECTIVE_TIMEOUT_ENV = "ELASTIC_RT_COLLECTIVE_TIMEOUT_SEC"
LOG_LEVEL_ENV = "ELASTIC_RT_LOG_LEVEL"
HANG_FACTOR_ENV = "ELASTIC_RT_HANG_FACTOR"
MAX_NODES_ENV = "ELASTIC_RT_MAX_NODES"
HEARTBEAT_INTERVAL_ENV = "ELASTIC_RT_HEARTBEAT_INTERVAL_SEC"
HEARTBEAT_MISSES_ENV = "ELASTIC_RT_HEARTBEAT_MISSES"
PREEMPTION_POLL_ENV = "ELASTIC_RT_PREEMPTION_POLL_SEC"
"""Seconds between two looks at the ``--preemption-notice`` source (default 0.5)."""
BACKEND_ENV = "ELASTIC_RT_BACKEND"
"""``gloo`` or ``nccl``: the backend of a round's groups; unset, NCCL exactly when CUDA is
present (see :mod:`elastic_rt.accelerator`). Read by workers from the inherited environment."""

# Defaults, each written here once; the CLI, the agent and the workers take them from here.
DEFAULT_LEASE_TTL = timedelta(seconds=5)
DEFAULT_LAST_CALL = timedelta(seconds=1)
DEFAULT_JOIN_TIMEOUT = timedelta(seconds=600)
DEFAULT_ETCD_WAIT = timedelta(seconds=30)
DEFAULT_MAX_RESTARTS = 3
DEFAULT_MONITOR_INTERVAL = timedelta(seconds=0.1)
DEFAULT_HANG_FACTOR = 10.0
"""A rank with no step for this many median step times is reported as hung (0: never)."""
DEFAULT_REFORM_TIMEOUT = timedelta(seconds=120)
"""In-process workers that have not joined a new round by then are restarted."""
DEFAULT_HEARTBEAT_INTERVAL = timedelta(seconds=0.1)
DEFAULT_LEAVE_TIMEOUT = timedelta(seconds=20)
"""From SIGTERM or a preemption notice to leaving at once when no step boundary came first
(Kubernetes' default grace period is 30 s; GCP and Azure warn about 30 s ahead)."""
DEFAULT_PREEMPTION_POLL = timedelta(seconds=0.5)
"""Between two looks at a ``--preemption-notice`` source."""
DEFAULT_HEARTBEAT_MISSES = 4
"""A peer silent for 4 x 0.1 s is evicted; measured on a loaded box (agents/heartbeat.py)."""


def first_given(*values: _T | None, default: _T) -> _T:
    """The first value that is not None, else ``default``: the precedence above, applied.

    Callers list the sources strongest first (a flag, then an environment variable or
    torchrun's ``--rdzv-conf`` key).
    """
    return next((value for value in values if value is not None), default)


def env_seconds(env: Mapping[str, str], name: str) -> timedelta | None:
    """The duration in seconds held by variable ``name`` (``2.5`` works); None when unset.

    Raises:
        ConfigError: the value is not a non-negative number.
    """
    seconds = _env_number(env, name, "a number of seconds", "e.g. 5")
    return None if seconds is None else timedelta(seconds=seconds)


def env_factor(env: Mapping[str, str], name: str, default: float) -> float:
    """A non-negative number held by variable ``name``; ``default`` when unset.

    Raises:
        ConfigError: the value is not a non-negative number.
    """
    value = _env_number(env, name, "a non-negative number",
                        "a number such as 10, or 0 to turn it off")
    return default if value is None else value


def _env_number(env: Mapping[str, str], name: str, what: str, example: str) -> float | None:
    text = env.get(name, "").strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise ConfigError(f"{name}={text!r} is not {what}", f"Set {name} to {example}.")
    return value


def _env_int(env: Mapping[str, str], name: str, default: int) -> int:
    text = env.get(name, "").strip()
    if not text:
        return default
    try:
        return int(text)
    except ValueError:
        raise ConfigError(
            f"{name}={text!r} is not a whole number",
            "Start workers with elastic-rt launch or torchrun.",
        ) from None


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


@dataclass(frozen=True, kw_only=True, slots=True)
class HeartbeatConfig:
    """How agents watch each other (``agents/heartbeat.py``)."""

    interval: timedelta = DEFAULT_HEARTBEAT_INTERVAL
    """Between two probes of the watched peer; 0 turns heartbeats off (the lease decides)."""
    misses: int = DEFAULT_HEARTBEAT_MISSES
    """Intervals of silence after which the peer is evicted."""

    @property
    def interval_s(self) -> float:
        return self.interval.total_seconds()

    @property
    def window_s(self) -> float:
        """Seconds of silence that evict a peer."""
        return self.interval_s * self.misses

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "HeartbeatConfig":
        """From ``ELASTIC_RT_HEARTBEAT_INTERVAL_SEC`` and ``ELASTIC_RT_HEARTBEAT_MISSES``.

        Raises:
            ConfigError: a value is not a non-negative number, or misses is under 1.
        """
        misses = _env_number(env, HEARTBEAT_MISSES_ENV, "a whole number >= 1", "e.g. 4")
        if misses is not None and (misses < 1 or misses != int(misses)):
            raise ConfigError(f"{HEARTBEAT_MISSES_ENV}={env[HEARTBEAT_MISSES_ENV]!r} is not a "
                              "whole number >= 1", f"Set {HEARTBEAT_MISSES_ENV} to e.g. 4.")
        interval = env_seconds(env, HEARTBEAT_INTERVAL_ENV)
        return cls(interval=DEFAULT_HEARTBEAT_INTERVAL if interval is None else interval,
                   misses=DEFAULT_HEARTBEAT_MISSES if misses is None else int(misses))


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
    lease_ttl: timedelta = DEFAULT_LEASE_TTL
    """A node whose lease is not renewed for this long is gone."""
    last_call: timedelta = DEFAULT_LAST_CALL
    """Once ``min_nodes`` are there, wait this long for more before forming a round."""
    join_timeout: timedelta = DEFAULT_JOIN_TIMEOUT
    """Give up when ``min_nodes`` have not joined within this time."""
    etcd_wait: timedelta = DEFAULT_ETCD_WAIT
    """How long a starting node retries an etcd that does not answer yet (nodes and etcd
    are often started together, by one job script or one pod spec)."""
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


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerEnv:
    """What the agent tells a worker through its environment, and the worker reads back.

    The one description of that environment: the agent builds these values and
    writes them with :meth:`to_env`; the library reads them with :meth:`from_env`, and
    ``from_env(w.to_env()) == w``. torchrun's variables are included, so an
    unmodified torchrun script runs. A worker started outside any round (``round``
    -1, an in-process replacement waiting to be admitted) has no rank yet: its
    torchrun placement variables are not written and read back as the defaults.
    """

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    group_rank: int = 0
    """The node's index in the round (torchrun's ``GROUP_RANK``)."""
    group_world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    restart_count: int = 0
    """Worker failures the job has restarted after (torchrun's ``TORCHELASTIC_RESTART_COUNT``;
    nodes lost or joining do not count). Job-wide, like ``max_restarts``."""
    max_restarts: int = 0
    node_id: str = ""
    node_host: str = ""
    """The address other nodes reach this node's workers at (the agent's); empty outside
    ``elastic-rt launch``."""
    run_id: str = ""
    round: int = 0
    token: int = 0
    endpoint: str = ""
    """etcd ``host:port``; empty when the script runs under plain torchrun."""
    agent_dir: str = ""
    """Where the worker leaves its in-process acknowledgements for the agent."""
    events_file: str | None = None
    lease_ttl: timedelta = DEFAULT_LEASE_TTL
    collective_timeout: timedelta | None = None
    """How long a training collective may wait; None: the lease TTL decides."""
    hang_factor: float = DEFAULT_HANG_FACTOR
    """See :mod:`elastic_rt.worker.hang`."""
    max_nodes: int = 0
    """The job's ``--nnodes`` maximum (0: unknown). A worker waiting to be admitted builds
    for the world it will most likely join: a spare's, once the round is full, is the
    current one (it takes a lost member's place)."""
    auth: EtcdAuth = field(default_factory=EtcdAuth)

    @property
    def is_elastic(self) -> bool:
        """True under ``elastic-rt launch``; False under plain torchrun or none."""
        return bool(self.endpoint and self.node_id)

    @property
    def in_round(self) -> bool:
        """False for a worker started before its node was admitted to any round."""
        return self.round >= 0

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "WorkerEnv":
        """Read a worker's environment; single-process defaults where unset.

        Raises:
            ConfigError: a variable holds something that is not a number (named).
        """
        return cls(
            rank=_env_int(env, RANK_ENV, 0),
            local_rank=_env_int(env, LOCAL_RANK_ENV, 0),
            world_size=_env_int(env, WORLD_SIZE_ENV, 1),
            local_world_size=_env_int(env, LOCAL_WORLD_SIZE_ENV, 1),
            group_rank=_env_int(env, GROUP_RANK_ENV, 0),
            group_world_size=_env_int(env, GROUP_WORLD_SIZE_ENV, 1),
            master_addr=env.get(MASTER_ADDR_ENV) or "127.0.0.1",
            master_port=_env_int(env, MASTER_PORT_ENV, 0),
            restart_count=_env_int(env, RESTART_COUNT_ENV, 0),
            max_restarts=_env_int(env, MAX_RESTARTS_ENV, 0),
            node_id=env.get(NODE_ID_ENV, ""),
            node_host=env.get(NODE_HOST_ENV, ""),
            run_id=env.get(RUN_ID_ENV, ""),
            round=_env_int(env, ROUND_ENV, 0),
            token=_env_int(env, TOKEN_ENV, 0),
            endpoint=env.get(ENDPOINT_ENV, ""),
            agent_dir=env.get(AGENT_DIR_ENV, ""),
            events_file=env.get(EVENTS_FILE_ENV) or None,
            lease_ttl=env_seconds(env, LEASE_TTL_ENV) or DEFAULT_LEASE_TTL,
            collective_timeout=env_seconds(env, COLLECTIVE_TIMEOUT_ENV),
            hang_factor=env_factor(env, HANG_FACTOR_ENV, DEFAULT_HANG_FACTOR),
            max_nodes=_env_int(env, MAX_NODES_ENV, 0),
            auth=EtcdAuth.from_env(env),
        )

    def to_env(self) -> dict[str, str]:
        """The variables to set for this worker (added to the agent's own environment)."""
        env = {
            LOCAL_RANK_ENV: str(self.local_rank),
            LOCAL_WORLD_SIZE_ENV: str(self.local_world_size),
            RESTART_COUNT_ENV: str(self.restart_count),
            MAX_RESTARTS_ENV: str(self.max_restarts),
            NODE_ID_ENV: self.node_id,
            NODE_HOST_ENV: self.node_host,
            RUN_ID_ENV: self.run_id,
            ROUND_ENV: str(self.round),
            ENDPOINT_ENV: self.endpoint,
            AGENT_DIR_ENV: self.agent_dir,
            LEASE_TTL_ENV: _seconds_text(self.lease_ttl),
            HANG_FACTOR_ENV: repr(self.hang_factor),
            MAX_NODES_ENV: str(self.max_nodes),
            **self.auth.to_env(),
        }
        if self.in_round:
            env.update({
                RANK_ENV: str(self.rank),
                ROLE_RANK_ENV: str(self.rank),
                WORLD_SIZE_ENV: str(self.world_size),
                ROLE_WORLD_SIZE_ENV: str(self.world_size),
                ROLE_NAME_ENV: "default",
                GROUP_RANK_ENV: str(self.group_rank),
                GROUP_WORLD_SIZE_ENV: str(self.group_world_size),
                MASTER_ADDR_ENV: self.master_addr,
                MASTER_PORT_ENV: str(self.master_port),
                TOKEN_ENV: str(self.token),
            })  # fmt: skip
        if self.events_file:
            env[EVENTS_FILE_ENV] = self.events_file
        if self.collective_timeout is not None:
            env[COLLECTIVE_TIMEOUT_ENV] = _seconds_text(self.collective_timeout)
        return env


def _seconds_text(duration: timedelta) -> str:
    """``5`` for whole seconds (what torchrun-era scripts expect), else ``2.5``."""
    seconds = duration.total_seconds()
    return str(int(seconds)) if seconds == int(seconds) else repr(seconds)
