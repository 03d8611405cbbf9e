"""``elastic-rt``: launch | etcd | status | checkpoint | timeline.

Parses flags and calls one function per subcommand. A :class:`UserError` becomes
one line, ``elastic-rt: error: <problem>. <fix>``, and exit code 2; anything else
is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from datetime import timedelta
from typing import NoReturn, Sequence

from elastic_rt import config as cfg
from elastic_rt.errors import ConfigError, UnknownURLSchemeError, UserError

logger = logging.getLogger(__name__)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``elastic-rt`` command."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        _configure_logging(os.environ.get(cfg.LOG_LEVEL_ENV, "INFO"))
        code = int(args.func(args) or 0)
    except UserError as exc:
        print(f"elastic-rt: error: {exc.one_line()}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    if args.command == "launch":
        # The agent has stopped its workers, left the rendezvous and closed etcd; all that
        # is left is interpreter teardown, where gRPC's channel finalizers have been seen to
        # hang on a lock a dead watch thread held. A launcher must exit with its code.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _configure_logging(level: str) -> None:
    """Log to stderr at ``level``; an unknown level name is a user error, not a traceback."""
    if not isinstance(logging.getLevelName(level.upper()), int):
        raise ConfigError(f"{cfg.LOG_LEVEL_ENV}={level!r} is not a log level",
                          "Use DEBUG, INFO, WARNING or ERROR.")
    logging.basicConfig(
        level=level.upper(),
        format="[%(asctime)s] %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def _seconds(text: str) -> timedelta:
    """An argparse type: a flag's value in seconds, kept as a duration from here on."""
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not seconds >= 0 or seconds == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds")
    return timedelta(seconds=seconds)


class _OneLineParser(argparse.ArgumentParser):
    """Usage mistakes get one line naming the problem and where help is, like every
    other user error here (argparse alone prints the whole usage first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog="elastic-rt", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    _add_launch(commands)
    _add_etcd(commands)
    _add_status(commands)
    _add_checkpoint(commands)
    _add_timeline(commands)
    return parser


# launch ---------------------------------------------------------------------------
def _add_launch(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = commands.add_parser("launch", help="run a training script on this node, elastically")
    p.add_argument("--nnodes", default="1", help="N or MIN:MAX nodes (torchrun's meaning)")
    p.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=1,
                   help="workers on this node")
    p.add_argument("--rdzv-endpoint", "--rdzv_endpoint", default="",
                   help="etcd://host:port of the rendezvous (a cluster: "
                        "etcd://h1:2379,h2:2379,...); none starts a private etcd on 127.0.0.1")
    p.add_argument("--rdzv-backend", "--rdzv_backend", default="etcd", help="only 'etcd' (v3 API)")
    p.add_argument("--run-id", "--rdzv-id", "--rdzv_id", dest="run_id", default="default",
                   help="names the job; two run ids on one etcd never meet")
    p.add_argument("--max-restarts", "--max_restarts", type=int, default=cfg.DEFAULT_MAX_RESTARTS,
                   help="worker failures the whole job absorbs (membership changes are free)")
    p.add_argument("--monitor-interval", "--monitor_interval", type=_seconds,
                   default=cfg.DEFAULT_MONITOR_INTERVAL, help="seconds between worker checks")
    # None: the environment decides, read in _launch, inside main's error guard.
    p.add_argument("--lease-ttl", type=_seconds, default=None,
                   help=f"seconds a silent node stays a member (env {cfg.LEASE_TTL_ENV}, "
                        f"default {cfg.DEFAULT_LEASE_TTL.total_seconds():g})")
    p.add_argument("--last-call", type=_seconds, default=cfg.DEFAULT_LAST_CALL,
                   help="seconds to wait for more nodes once MIN have joined")
    p.add_argument("--join-timeout", type=_seconds, default=cfg.DEFAULT_JOIN_TIMEOUT,
                   help="seconds to wait for MIN nodes before giving up")
    p.add_argument("--node-id", default=None, help="this node's name (default host-pid)")
    p.add_argument("--local-addr", default=None,
                   help="address peers reach this node at "
                        "(default 127.0.0.1 for a loopback endpoint)")
    p.add_argument("--etcd-port", type=int, default=None, help="client port of the private etcd")
    p.add_argument("--events-file", default=os.environ.get(cfg.EVENTS_FILE_ENV),
                   help="append JSON-lines events here")
    _add_etcd_auth(p)
    p.add_argument("-m", "--module", action="store_true", help="run the script as 'python -m'")
    p.add_argument("--no-python", "--no_python", action="store_true",
                   help="run the script as a program")
    p.add_argument("script", help="the training script")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")
    p.set_defaults(func=_launch)


def _add_etcd_auth(p: argparse.ArgumentParser) -> None:
    env = os.environ
    p.add_argument("--etcd-cacert", default=env.get(cfg.ETCD_CACERT_ENV),
                   help="CA of etcd's TLS certificate")
    p.add_argument("--etcd-cert", default=env.get(cfg.ETCD_CERT_ENV), help="client certificate")
    p.add_argument("--etcd-key", default=env.get(cfg.ETCD_KEY_ENV), help="client key")
    p.add_argument("--etcd-user", default=env.get(cfg.ETCD_USER_ENV),
                   help=f"etcd user; the password comes from {cfg.ETCD_PASSWORD_ENV}")


def _auth(args: argparse.Namespace, tls: bool = False) -> cfg.EtcdAuth:
    for flag in ("etcd_cacert", "etcd_cert", "etcd_key"):
        path = getattr(args, flag)
        if path and not os.path.isfile(path):
            raise ConfigError(f"--{flag.replace('_', '-')} {path} does not exist",
                              "Pass the path of a PEM file.")
    if bool(args.etcd_cert) != bool(args.etcd_key):
        raise ConfigError("--etcd-cert and --etcd-key go together", "Pass both or neither.")
    password = os.environ.get(cfg.ETCD_PASSWORD_ENV)
    if args.etcd_user and not password:
        raise ConfigError(f"--etcd-user {args.etcd_user} has no password",
                          f"Set {cfg.ETCD_PASSWORD_ENV}.")
    return cfg.EtcdAuth(
        cacert=args.etcd_cacert, cert=args.etcd_cert, key=args.etcd_key,
        user=args.etcd_user, password=password if args.etcd_user else None, tls=tls,
    )  # fmt: skip


def parse_endpoint(text: str) -> tuple[str, bool]:
    """``etcd://host:port``, ``etcds://host:port`` (TLS) or ``host:port`` -> (host:port, tls).

    Several members of one etcd cluster are separated by commas
    (``etcd://h1:2379,h2:2379,h3:2379``) and come back the same way.
    """
    scheme, sep, rest = text.partition("://")
    if not sep:
        scheme, rest = "etcd", text
    if scheme not in ("etcd", "etcds", "http", "https"):
        raise UnknownURLSchemeError(
            f"rendezvous endpoint {text!r} has the unknown scheme {scheme!r}",
            "Use etcd://host:port (or etcds://host:port for TLS).",
        )
    members = [member.strip().rstrip("/") for member in rest.rstrip("/").split(",")]
    for member in members:
        host, _, port = member.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"rendezvous endpoint {text!r} is not host:port",
                              "Use etcd://host:port (a cluster: etcd://h1:2379,h2:2379,h3:2379).")
    return ",".join(members), scheme in ("etcds", "https")


def _worker_command(args: argparse.Namespace) -> list[str]:
    if args.no_python:
        return [args.script, *args.script_args]
    if args.module:
        return [sys.executable, "-u", "-m", args.script, *args.script_args]
    if not os.path.isfile(args.script):
        raise ConfigError(f"training script {args.script} does not exist", "Check the path.")
    return [sys.executable, "-u", args.script, *args.script_args]


def _launch(args: argparse.Namespace) -> int:
    from agents.agent import Agent
    from agents.config import AgentConfig
    from elastic_rt.etcd_server import EtcdServer, is_port_free

    min_nodes, max_nodes = cfg.parse_nnodes(args.nnodes)
    if args.rdzv_backend not in ("etcd", "etcd-v3"):
        raise ConfigError(f"--rdzv-backend {args.rdzv_backend} is not supported",
                          "Use --rdzv-backend etcd.")
    if args.nproc_per_node < 1:
        raise ConfigError(f"--nproc-per-node {args.nproc_per_node} is below 1", "Pass 1 or more.")
    endpoint, tls = parse_endpoint(args.rdzv_endpoint) if args.rdzv_endpoint else ("", False)
    # Every value is checked before a private etcd starts: a mistake costs nothing to clean up.
    rendezvous = cfg.RendezvousConfig(
        run_id=args.run_id,
        endpoint=endpoint,
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        lease_ttl=(args.lease_ttl or cfg.env_seconds(os.environ, cfg.LEASE_TTL_ENV)
                   or cfg.DEFAULT_LEASE_TTL),
        last_call=args.last_call,
        join_timeout=args.join_timeout,
        auth=_auth(args, tls),
    )
    command = _worker_command(args)
    if not endpoint and args.etcd_port is not None and not is_port_free(args.etcd_port):
        # Checked here so the fix names launch's flag, not `elastic-rt etcd --port`.
        raise ConfigError(
            f"--etcd-port {args.etcd_port} is already in use on 127.0.0.1",
            "Pick another --etcd-port, or leave it out to get a free one.",
        )
    server = None if endpoint else EtcdServer(port=args.etcd_port).start()
    try:
        if server is not None:
            rendezvous = dataclasses.replace(rendezvous, endpoint=server.endpoint)
            logger.info("private etcd at etcd://%s", server.endpoint)
        host = args.local_addr or (
            "127.0.0.1" if rendezvous.endpoint.split(":")[0] in ("127.0.0.1", "localhost")
            else _fqdn()
        )  # fmt: skip
        if host == "127.0.0.1":
            # Keep gloo on loopback too, whatever the host name resolves to.
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        extra = {"node_id": args.node_id} if args.node_id else {}
        config = AgentConfig(
            rendezvous=rendezvous,
            command=command,
            nproc_per_node=args.nproc_per_node,
            max_restarts=args.max_restarts,
            monitor_interval=args.monitor_interval,
            host=host,
            events_file=args.events_file,
            **extra,
        )
        return Agent(config).run()
    finally:
        if server is not None:
            server.stop()


def _fqdn() -> str:
    import socket

    return socket.getfqdn()


# etcd -----------------------------------------------------------------------------
def _add_etcd(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = commands.add_parser("etcd", help="run an etcd in the foreground for local agents")
    p.add_argument("--port", type=int, default=None, help="client port (default: a free one)")
    p.add_argument("--data-dir", default=None, help="keep data here (default: a temporary dir)")
    p.set_defaults(func=_etcd)


def _etcd(args: argparse.Namespace) -> int:
    import signal
    import threading

    from elastic_rt.etcd_server import EtcdServer

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with EtcdServer(port=args.port, data_dir=args.data_dir) as server:
        print(f"etcd://{server.endpoint}", flush=True)
        try:
            stop.wait()
        except KeyboardInterrupt:
            pass
    return 0


# status, checkpoint, timeline -------------------------------------------------------
def _add_status(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = commands.add_parser("status", help="show a run: nodes, round, layout, checkpoint, budget")
    p.add_argument("--run-id", required=True)
    p.add_argument("--rdzv-endpoint", "--rdzv_endpoint", required=True, help="etcd://host:port")
    p.add_argument("--events-file", default=None, help="also summarise this event log")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    _add_etcd_auth(p)
    p.set_defaults(func=_status)


def _status(args: argparse.Namespace) -> int:
    from elastic_rt.status import show_status

    endpoint, tls = parse_endpoint(args.rdzv_endpoint)
    print(show_status(endpoint, args.run_id, auth=_auth(args, tls), events_file=args.events_file,
                      as_json=args.json))
    return 0


def _add_checkpoint(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = commands.add_parser("checkpoint", help="inspect checkpoints on a URL")
    sub = p.add_subparsers(dest="action", required=True)
    for name, text in (("ls", "list checkpoints"), ("verify", "check every file's checksum")):
        q = sub.add_parser(name, help=text)
        q.add_argument("url", help="path, file://, s3://bucket/prefix or memory://")
        q.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE",
                       help="an fsspec storage option, e.g. endpoint_url=http://host:9000, "
                            "profile=NAME, anon=true (repeatable)")
        q.set_defaults(func=_checkpoint)


def parse_storage_options(items: Sequence[str]) -> dict[str, object]:
    """``KEY=VALUE`` pairs as fsspec options; ``true``/``false`` become booleans.

    Raises:
        ConfigError: an item is not ``KEY=VALUE``.
    """
    options: dict[str, object] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip().isidentifier():
            raise ConfigError(f"--storage-option {item!r} is not KEY=VALUE",
                              "Pass for example --storage-option endpoint_url=http://host:9000.")
        options[key.strip()] = {"true": True, "false": False}.get(value.lower(), value)
    return options


def _checkpoint(args: argparse.Namespace) -> int:
    from elastic_rt.checkpoint import inspect
    from elastic_rt.checkpoint.storage import quiet_drivers
    from elastic_rt.errors import CheckpointError

    options = parse_storage_options(args.storage_option)
    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
        quiet_drivers()
    try:
        if args.action == "ls":
            for line in inspect.ls(args.url, options):
                print(line)
            return 0
        ok, lines = inspect.verify(args.url, options)
    except CheckpointError as exc:  # storage failed mid-way: one line, not a traceback
        print(f"elastic-rt: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    for line in lines:
        print(line)
    return 0 if ok else 1


def _add_timeline(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = commands.add_parser("timeline", help="draw a run's events as a picture")
    p.add_argument("events", nargs="+", help="JSON-lines event files")
    p.add_argument("-o", "--output", default="run.png", help="image to write (.png or .svg)")
    p.set_defaults(func=_timeline)


def _timeline(args: argparse.Namespace) -> int:
    from elastic_rt.timeline_draw import draw_timeline

    path = draw_timeline(args.events, args.output)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
