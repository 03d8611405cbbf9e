"""``elastic-rt launch``: torchrun's flags in, one :class:`AgentConfig` out, then the agent.

Every value is checked here, before a private etcd starts, so that a mistake costs
nothing to clean up and gets one line naming the flag. Precedence is the one
``elastic_rt.config`` writes down: flag > environment > default. What launching does
(a private etcd, the address peers reach us at, torchrun's process defaults) is the
agent's, in ``agents/launch.py``.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
from datetime import timedelta
from typing import TYPE_CHECKING

from elastic_rt import config as cfg
from elastic_rt.cli import flags, torchrun_flags
from elastic_rt.errors import ConfigError

if TYPE_CHECKING:
    from agents.config import AgentConfig
    from agents.output import OutputSpec
    from agents.preemption import NoticeSource

logger = logging.getLogger(__name__)


def add_launch(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """torchrun's flags and spellings (docs/torchrun.md maps each one), then ours."""
    p = commands.add_parser("launch", help="run a training script on this node, elastically")
    p.add_argument("--nnodes", default="1", help="N or MIN:MAX nodes (torchrun's meaning)")
    p.add_argument("--nproc-per-node", "--nproc_per_node", default="1",
                   help="workers on this node: a number, cpu, gpu, xpu or auto (torchrun's values)")
    p.add_argument("--rdzv-endpoint", "--rdzv_endpoint", default="",
                   help="etcd://host:port of the rendezvous (a cluster: "
                        "etcd://h1:2379,h2:2379,...); none starts a private etcd on 127.0.0.1")
    p.add_argument("--rdzv-backend", "--rdzv_backend", default="etcd", help="only 'etcd' (v3 API)")
    p.add_argument("--rdzv-conf", "--rdzv_conf", default="",
                   help="torchrun's k=v,... settings: join_timeout, last_call_timeout (seconds)")
    p.add_argument("--standalone", action="store_true",
                   help="a private rendezvous on this host (the default when no --rdzv-endpoint)")
    p.add_argument("--run-id", "--rdzv-id", "--rdzv_id", dest="run_id", default="default",
                   help="names the job; two run ids on one etcd never meet")
    p.add_argument("--max-restarts", "--max_restarts", type=int, default=cfg.DEFAULT_MAX_RESTARTS,
                   help="worker failures the whole job absorbs (membership changes are free)")
    p.add_argument("--monitor-interval", "--monitor_interval", type=flags.seconds,
                   default=cfg.DEFAULT_MONITOR_INTERVAL, help="seconds between worker checks")
    p.add_argument("--start-method", "--start_method", choices=("spawn", "fork", "forkserver"),
                   default="spawn", help="accepted for torchrun scripts; workers are always new "
                                         "processes (torchrun ignores it for scripts too)")
    p.add_argument("--shutdown-timeout", "--shutdown_timeout", type=flags.seconds,
                   default=timedelta(seconds=3),
                   help="seconds from SIGTERM to SIGKILL when stopping workers (default 3)")
    p.add_argument("--preemption-notice", default=None, metavar="URL|FILE|CMD",
                   help="leave at the next step boundary once this says so: an http(s) URL "
                        "answering 200 with e.g. {\"preempted\": true} or a cloud's "
                        "instance-action, file:PATH existing, or cmd:COMMAND exiting 0 "
                        "(docs/preemption.md); SIGTERM always does")
    p.add_argument("--leave-timeout", type=flags.seconds, default=cfg.DEFAULT_LEAVE_TIMEOUT,
                   help="seconds from SIGTERM or a preemption notice to leaving at once if no "
                        f"step boundary came first (default "
                        f"{cfg.DEFAULT_LEAVE_TIMEOUT.total_seconds():g})")
    _add_output(p)
    _add_static(p)
    # None: the environment decides, read in launch(), inside main's error guard.
    p.add_argument("--lease-ttl", type=flags.seconds, default=None,
                   help=f"seconds a silent node stays a member (env {cfg.LEASE_TTL_ENV}, "
                        f"default {cfg.DEFAULT_LEASE_TTL.total_seconds():g})")
    # None: torchrun's --rdzv-conf key decides, else the default (config.first_given).
    p.add_argument("--last-call", type=flags.seconds, default=None,
                   help="seconds to wait for more nodes once MIN have joined "
                        f"(default {cfg.DEFAULT_LAST_CALL.total_seconds():g})")
    p.add_argument("--join-timeout", type=flags.seconds, default=None,
                   help="seconds to wait for MIN nodes before giving up "
                        f"(default {cfg.DEFAULT_JOIN_TIMEOUT.total_seconds():g})")
    p.add_argument("--etcd-wait", type=flags.seconds, default=None,
                   help="seconds a starting node retries an etcd that does not answer yet "
                        f"(default {cfg.DEFAULT_ETCD_WAIT.total_seconds():g})")
    # None: the environment decides, else the default (precedence CLI > env > default).
    p.add_argument("--hang-factor", type=float, default=None,
                   help="report ranks with no step for this many median step times, with "
                        f"their stacks (env {cfg.HANG_FACTOR_ENV}, "
                        f"default {cfg.DEFAULT_HANG_FACTOR:g}; 0 turns it off)")
    p.add_argument("--node-id", default=None, help="this node's name (default host-pid)")
    p.add_argument("--local-addr", "--local_addr", default=None,
                   help="address peers reach this node at "
                        "(default 127.0.0.1 for a loopback endpoint)")
    p.add_argument("--etcd-port", type=torchrun_flags.port, default=None,
                   help="client port of the private etcd")
    p.add_argument("--metrics-port", type=torchrun_flags.port, default=None,
                   help="serve Prometheus metrics at http://LOCAL_ADDR:PORT/metrics (off: none)")
    p.add_argument("--events-file", default=os.environ.get(cfg.EVENTS_FILE_ENV),
                   help="append JSON-lines events here")
    flags.add_etcd_auth(p)
    torchrun_flags.add_refused(p)
    p.add_argument("-m", "--module", action="store_true", help="run the script as 'python -m'")
    p.add_argument("--no-python", "--no_python", action="store_true",
                   help="run the script as a program")
    p.add_argument("--run-path", "--run_path", action="store_true",
                   help="run the script with runpy.run_path (in a fresh interpreter per worker)")
    p.add_argument("script", help="the training script")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")
    p.set_defaults(func=launch)


def _add_output(p: argparse.ArgumentParser) -> None:
    p.add_argument("--role", default="default",
                   help="ROLE_NAME of the workers and their log prefix")
    p.add_argument("--log-dir", "--log_dir", default=None,
                   help="base directory for the workers' log and error files (created if missing)")
    p.add_argument("-r", "--redirects", default="0",
                   help="streams into files in --log-dir: 1 stdout, 2 stderr, 3 both, "
                        "or 0:3,1:2 per local rank")
    p.add_argument("-t", "--tee", default="0",
                   help="as --redirects, and also to this console prefixed [<role><local_rank>]:")
    p.add_argument("--local-ranks-filter", "--local_ranks_filter", default="",
                   help="only these local ranks (e.g. 0,1) reach the console")


def _add_static(p: argparse.ArgumentParser) -> None:
    text = "torchrun's static rendezvous; on one node only (multi-node: --rdzv-endpoint)"
    p.add_argument("--node-rank", "--node_rank", type=int, default=None, help=text)
    p.add_argument("--master-addr", "--master_addr", default=None, help=text)
    p.add_argument("--master-port", "--master_port", type=torchrun_flags.port, default=None,
                   help=text)


_RUN_PATH = (
    "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
)
"""torchrun's --run-path: the script runs through runpy, argv as it would see it."""


def _worker_command(args: argparse.Namespace) -> list[str]:
    if sum((args.no_python, args.module, args.run_path)) > 1:
        raise ConfigError("--no-python, -m and --run-path exclude one another", "Pass one of them.")
    if args.no_python:
        if not shutil.which(args.script):
            raise ConfigError(f"--no-python program {args.script} is not found or not executable",
                              "Check the name and PATH, or drop --no-python for a Python script.")
        return [args.script, *args.script_args]
    if args.module:
        return [sys.executable, "-u", "-m", args.script, *args.script_args]
    if not os.path.isfile(args.script):
        raise ConfigError(f"training script {args.script} does not exist", "Check the path.")
    if args.run_path:
        return [sys.executable, "-u", "-c", _RUN_PATH, args.script, *args.script_args]
    return [sys.executable, "-u", args.script, *args.script_args]


def _check_rendezvous_flags(args: argparse.Namespace, max_nodes: int) -> None:
    """torchrun's rendezvous flags that have no etcd meaning: refused, or harmless on one node."""
    torchrun_flags.check_refused(args)
    if args.rdzv_backend not in ("etcd", "etcd-v3"):
        raise ConfigError(f"--rdzv-backend {args.rdzv_backend} is not supported",
                          "Use --rdzv-backend etcd (`elastic-rt etcd` runs one).")  # fmt: skip
    if args.standalone and args.rdzv_endpoint:
        raise ConfigError("--standalone starts a private rendezvous, --rdzv-endpoint names one",
                          "Pass one of them.")  # fmt: skip
    static = [(name, value) for name, value in (("--node-rank", args.node_rank),
              ("--master-addr", args.master_addr), ("--master-port", args.master_port))
              if value is not None]  # fmt: skip
    if static and (max_nodes > 1 or args.node_rank not in (None, 0)):
        raise ConfigError(
            f"{static[0][0]} {static[0][1]} belongs to torchrun's static rendezvous; "
            "elastic-rt ranks nodes through etcd",
            "Drop it, run `elastic-rt etcd` on one host and pass --rdzv-endpoint etcd://HOST:PORT.",
        )
    if static:
        names = ", ".join(name for name, _ in static)
        logger.warning("%s: not needed on one node; rank 0's store gets a free port each round "
                       "and MASTER_ADDR/MASTER_PORT tell the workers", names)


def _output(args: argparse.Namespace) -> OutputSpec:
    """torchrun's output flags -> where the workers' streams go (agents/output.py)."""
    from agents.output import OutputSpec, parse_ranks, parse_std

    streams = "0-3 (1 stdout, 2 stderr, 3 both) or LOCAL_RANK:N pairs like 0:3,1:1"
    redirects = flags.flag(f"Pass -r {streams}.", lambda: parse_std(args.redirects, "--redirects"))
    tee = flags.flag(f"Pass -t {streams}.", lambda: parse_std(args.tee, "--tee"))
    ranks = flags.flag("Pass local ranks separated by commas, like 0,1.",
                       lambda: parse_ranks(args.local_ranks_filter))  # fmt: skip
    if args.log_dir and os.path.exists(args.log_dir) and not os.path.isdir(args.log_dir):
        raise ConfigError(f"--log-dir {args.log_dir} is a file", "Pass a directory.")
    return OutputSpec(log_dir=args.log_dir, redirects=redirects, tee=tee, ranks_filter=ranks,
                      role=args.role)  # fmt: skip


def launch(args: argparse.Namespace) -> int:
    """Run this node's agent until the job ends; its exit code."""
    from agents.launch import launch_node

    _check_metrics_port(args.metrics_port)
    return launch_node(agent_config(args), etcd_port=_free_etcd_port(args),
                       local_addr=args.local_addr)


def agent_config(args: argparse.Namespace) -> AgentConfig:
    """The agent's configuration from ``launch``'s flags (checked; no endpoint when the
    node is to start a private etcd).

    Raises:
        ConfigError: a flag's value is wrong (the message names the flag and the fix).
    """
    from agents.config import AgentConfig

    min_nodes, max_nodes = cfg.parse_nnodes(args.nnodes)
    _check_rendezvous_flags(args, max_nodes)
    conf = torchrun_flags.parse_rdzv_conf(args.rdzv_conf)
    endpoint, tls = flags.parse_endpoint(args.rdzv_endpoint) if args.rdzv_endpoint else ("", False)
    rendezvous = cfg.RendezvousConfig(
        run_id=args.run_id,
        endpoint=endpoint,
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        lease_ttl=cfg.first_given(args.lease_ttl, cfg.env_seconds(os.environ, cfg.LEASE_TTL_ENV),
                                  default=cfg.DEFAULT_LEASE_TTL),
        last_call=cfg.first_given(args.last_call, conf.get("last_call_timeout"),
                                  default=cfg.DEFAULT_LAST_CALL),
        join_timeout=cfg.first_given(args.join_timeout, conf.get("join_timeout"),
                                     default=cfg.DEFAULT_JOIN_TIMEOUT),
        etcd_wait=cfg.first_given(args.etcd_wait, conf.get("read_timeout"),
                                  default=cfg.DEFAULT_ETCD_WAIT),
        auth=flags.auth(args, tls),
    )  # fmt: skip
    extra = {"node_id": args.node_id} if args.node_id else {}
    return AgentConfig(
        rendezvous=rendezvous,
        command=_worker_command(args),
        nproc_per_node=torchrun_flags.resolve_nproc(args.nproc_per_node),
        max_restarts=args.max_restarts,
        monitor_interval=args.monitor_interval,
        hang_factor=_hang_factor(args.hang_factor),
        heartbeat=cfg.HeartbeatConfig.from_env(os.environ),
        grace_period=args.shutdown_timeout,
        events_file=args.events_file,
        metrics_port=args.metrics_port,
        output=_output(args),
        preemption_notice=_preemption_notice(args.preemption_notice),
        preemption_poll=_preemption_poll(),
        leave_timeout=args.leave_timeout,
        **extra,
    )


def _preemption_poll() -> timedelta:
    """$ELASTIC_RT_PREEMPTION_POLL_SEC, else the default; at least 0.05 s (a source is
    a metadata server or a command: polling it in a loop would only load it).

    Raises:
        ConfigError: not a number, or under 0.05.
    """
    poll = cfg.first_given(cfg.env_seconds(os.environ, cfg.PREEMPTION_POLL_ENV),
                           default=cfg.DEFAULT_PREEMPTION_POLL)
    if poll < timedelta(seconds=0.05):
        raise ConfigError(f"{cfg.PREEMPTION_POLL_ENV}={poll.total_seconds():g} is under 0.05 s",
                          f"Set {cfg.PREEMPTION_POLL_ENV} to e.g. 0.5.")
    return poll


def _preemption_notice(spec: str | None) -> NoticeSource | None:
    """--preemption-notice, parsed and, for a URL, answering (before anything starts).

    Raises:
        ConfigError, UnknownURLSchemeError: the value names no source.
        EndpointUnreachableError: the URL does not answer.
    """
    if spec is None:
        return None
    from agents.preemption import check_at_start, parse_source

    source = parse_source(spec)
    check_at_start(source)
    return source


def _free_etcd_port(args: argparse.Namespace) -> int | None:
    """--etcd-port, checked here so that the fix names launch's flag, not `elastic-rt etcd`'s."""
    port: int | None = args.etcd_port
    if not args.rdzv_endpoint and port is not None:
        from elastic_rt.etcd_server import is_port_free

        if not is_port_free(port):
            raise ConfigError(f"--etcd-port {port} is already in use on 127.0.0.1",
                              "Pick another --etcd-port, or leave it out to get a free one.")
    return port


def _check_metrics_port(port: int | None) -> None:
    """Before anything starts: a taken port would otherwise fail after etcd and the rendezvous."""
    if port is not None:
        from elastic_rt.etcd_server import is_port_free

        if not is_port_free(port):
            raise ConfigError(f"--metrics-port {port} is already in use on 127.0.0.1",
                              "Pick another --metrics-port, or leave it out.")


def _hang_factor(flag: float | None) -> float:
    """--hang-factor, else $ELASTIC_RT_HANG_FACTOR, else the default.

    Raises:
        ConfigError: a negative or infinite factor.
    """
    if flag is None:
        return cfg.env_factor(os.environ, cfg.HANG_FACTOR_ENV, cfg.DEFAULT_HANG_FACTOR)
    if not 0 <= flag < float("inf"):
        raise ConfigError(f"--hang-factor {flag} is not a non-negative number",
                          "Pass a number such as 10, or 0 to turn hang reports off.")
    return flag
